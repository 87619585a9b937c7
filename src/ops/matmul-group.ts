// One batched GEMM over the members of a group whose operands lie at a uniform stride in one allocation (the LoRA
// factors of grouped projections: the trainer packs A_q, B_q, A_k, B_k, ... end to end, nn/ops.ts linearGroup):
//   C_s = op(A_s) · op(B_s) (+ C_s)   for s < S,   A_s at a + s strideA (strideA 0: one A for all), likewise B, C.
// Each member's result is the GEMM it would be on its own, bit for bit: the batched dispatch is forced onto the
// tile and split-K a single member's GEMM picks (split-K sums partials in a different order, and a batch of S
// members fills the device S times better, so left alone it would choose fewer splits).
import type { Gpu } from '../gpu/device.ts';
import { ShapeError } from '../gpu/errors.ts';
import { BYTES, expectSameDType, Tensor } from '../gpu/tensor.ts';
import { chooseSplitK, pickTcTile, TC_BK } from './gemm.ts';
import { isInt8 } from './int8.ts';
import { runGemm, type Gemm } from './matmul.ts';
import { DIRECT_TILES, pickTile, tilesFor } from './tiles.ts';

/** An operand of member 0 (`t`, row-major with leading dimension `ld`) and the element stride to member s's. */
export interface Strided {
  t: Tensor;
  ld: number;
  stride: number;
}

export interface GroupGemm {
  M: number;
  N: number;
  K: number;
  /** Members. */
  S: number;
  a: Strided;
  b: Strided;
  c: Strided;
  /** a is stored [K, M] (per member). */
  transA?: boolean;
  /** b is stored [N, K]. */
  transB?: boolean;
  /** C_s += ... instead of C_s = ... */
  accumulate?: boolean;
}

/** C_s = op(A_s) · op(B_s) (+ C_s) for every member s as one batched GEMM, each C_s with its own GEMM's bits. */
export function matmulGroup(gpu: Gpu, p: GroupGemm): void {
  const op = 'matmulGroup';
  const { M, N, K, S } = p;
  const [transA, transB] = [p.transA ?? false, p.transB ?? false];
  expectSameDType(op, p.a.t, p.b.t);
  if (isInt8(p.a.t) || isInt8(p.b.t)) throw new ShapeError(op, 'int8 operands are not grouped');
  if (p.c.t.dtype !== p.a.t.dtype && p.c.t.dtype !== 'f32') throw new ShapeError(op, `C must be ${p.a.t.dtype} or f32, got ${p.c.t.dtype}`);
  // Each member's last element must lie inside the allocation its member 0 sits in.
  const last = (o: Strided, rows: number, cols: number) => (S - 1) * o.stride + (rows - 1) * o.ld + cols;
  const fits = (o: Strided, rows: number, cols: number, name: string) => {
    if (o.ld < cols) throw new ShapeError(op, `${name}: leading dimension ${o.ld} is less than its ${cols} columns`);
    if (o.t.byteOffset + last(o, rows, cols) * BYTES[o.t.dtype] > o.t.buffer.size)
      throw new ShapeError(op, `${name}: ${S} members at stride ${o.stride} run past its buffer (${o.t.buffer.size} bytes)`);
  };
  fits(p.a, transA ? K : M, transA ? M : K, 'a');
  fits(p.b, transB ? N : K, transB ? K : N, 'b');
  fits(p.c, M, N, 'c');
  // One member's choice (matmul.ts runGemm with batch 1): a tensor-core tile where it would take one, else the SIMT tile.
  const tc = p.a.t.dtype === 'f16' ? pickTcTile(gpu, M, N, 1) : null;
  const tile = tc ? undefined : pickTile(M, N, 1, gpu.fillWorkgroups, gpu.gemmConfig.direct ? DIRECT_TILES : tilesFor(gpu));
  const block = tc ? { BM: tc.BM, BN: tc.BN, BK: TC_BK } : tile!;
  const split = chooseSplitK(gpu, Math.ceil(M / block.BM) * Math.ceil(N / block.BN), 1, M, N, K, block.BK);
  const g: Gemm = {
    op,
    M,
    N,
    K,
    batch: S,
    a: p.a.t,
    b: p.b.t,
    c: p.c.t,
    bias: null,
    biasRows: false,
    transA,
    transB,
    lda: p.a.ld,
    ldb: p.b.ld,
    ldc: p.c.ld,
    strideA: p.a.stride,
    strideB: p.b.stride,
    strideC: p.c.stride,
    accumulate: p.accumulate ?? false,
    tile,
    tcTile: tc ?? undefined,
    splitK: split.splits,
  };
  runGemm(gpu, g);
}

/**
 * The element stride at which `ts` lie in one allocation (each the same shape and dtype, member s at first + s
 * stride), or null. A stride that is not a multiple of 4 elements is refused too: the GEMM then could not read every
 * member in whole vec4s as its own GEMM does (matmul.ts vec4Operand).
 */
export function uniformStride(ts: readonly Tensor[]): number | null {
  const [first] = ts;
  if (ts.length < 2) return null;
  const bytes = BYTES[first.dtype];
  const stride = (ts[1].byteOffset - first.byteOffset) / bytes;
  if (!Number.isInteger(stride) || stride < first.numel || stride % 4) return null;
  const same = (t: Tensor, i: number) =>
    t.alloc === first.alloc &&
    t.dtype === first.dtype &&
    !isInt8(t) &&
    t.shape.length === first.shape.length &&
    t.shape.every((d, j) => d === first.shape[j]) &&
    t.byteOffset === first.byteOffset + i * stride * bytes;
  return ts.every(same) ? stride : null;
}

/**
 * The LoRA adapters of grouped projections (nn/ops.ts linearGroup) where they can run as matmulGroup's batched GEMMs:
 * every layer has one, the A's [r, K] at one stride in one allocation and the B's [N, r] likewise (the trainer packs
 * A_q, B_q, A_k, B_k, ... end to end, train/optimizer-chunks.ts uploadPacked). Else null.
 */
export interface PackedLora {
  as: Tensor[];
  ups: Tensor[];
  r: number;
  strideA: number;
  strideB: number;
}

export function packedLora(adapters: readonly ({ a: Tensor; up: Tensor } | null)[]): PackedLora | null {
  if (adapters.some((ad) => !ad)) return null;
  const as = adapters.map((ad) => ad!.a);
  const ups = adapters.map((ad) => ad!.up);
  const [strideA, strideB] = [uniformStride(as), uniformStride(ups)];
  if (strideA === null || strideB === null || as[0].shape.length !== 2) return null;
  return { as, ups, r: as[0].shape[0], strideA, strideB };
}

/**
 * The members' down projections h_s = x A_sᵀ as one GEMM into h [S, rows, r] (returned), then their up projections
 * y_s += h_s B_sᵀ as another, y [S, rows, N] (the grouped base GEMM's output).
 */
export function loraGroupForward(gpu: Gpu, x: Tensor, p: PackedLora, y: Tensor): Tensor {
  const [S, K, N] = [p.as.length, p.as[0].shape[1], p.ups[0].shape[0]];
  const rows = x.numel / K;
  const h = gpu.tensor([S, rows, p.r], x.dtype, 'activations', 'lora.down');
  const hs = { t: h, ld: p.r, stride: rows * p.r };
  matmulGroup(gpu, { M: rows, N: p.r, K, S, a: { t: x, ld: K, stride: 0 }, b: { t: p.as[0], ld: K, stride: p.strideA }, c: hs, transB: true });
  const c = { t: y, ld: N, stride: rows * N };
  matmulGroup(gpu, { M: rows, N, K: p.r, S, a: hs, b: { t: p.ups[0], ld: p.r, stride: p.strideB }, c, transB: true, accumulate: true });
  return h;
}

/** dA_s = dh_sᵀ x for every member as one GEMM, dh [S, rows, r], into `slots` (false, nothing run, unless at one stride). */
export function loraGroupDownGrads(gpu: Gpu, x: Tensor, p: PackedLora, dh: Tensor, slots: readonly Tensor[]): boolean {
  const stride = uniformStride(slots);
  if (stride === null) return false;
  const [S, K] = [p.as.length, p.as[0].shape[1]];
  const rows = x.numel / K;
  const a = { t: dh, ld: p.r, stride: rows * p.r };
  matmulGroup(gpu, { M: p.r, N: K, K: rows, S, a, b: { t: x, ld: K, stride: 0 }, c: { t: slots[0], ld: K, stride }, transA: true });
  return true;
}

/** Member s of a packed [S, ...] tensor as a view of `shape`. */
export function memberView(all: Tensor, s: number, shape: readonly number[]): Tensor {
  return new Tensor(all.alloc, shape, all.dtype, all.byteOffset + (s * all.byteSize) / all.shape[0], false);
}
