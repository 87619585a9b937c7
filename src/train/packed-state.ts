// The byte layout of one optimizer chunk's state in the compact modes (issue 14), the same on the GPU (one
// buffer per resident chunk, or the staging buffer) and in the store (the chunk's bytes, as they are):
//
//   [master f32 x elems]           master 'fp32' (at each parameter's element offset, as the fp32 layout)
//   [ext i16 x slots]              master 'compact' with f16 compute: each parameter's extension words
//   [m f32 | v f32]                moments of parameters kept in f32 (all with 'adamw'; < MIN_8BIT_SIZE with 8-bit)
//   [m8 u8 x slots | v8 u8 x slots | absm f32 x blocks | absv f32 x blocks]   8-bit moments
//
// A slot is a parameter's element count rounded up to whole QBLOCK blocks, so every parameter's codes and
// extension words start on a block (and a 32-bit word); each region starts on 256 bytes. The fp32 mode
// ('adamw' + 'fp32') keeps its [master | m | v] layout and code path in optimizer.ts.
import { Tensor, type DType } from '../gpu/tensor.ts';
import { MIN_8BIT_SIZE, QBLOCK, ZERO_M, ZERO_V, type PackedHostState, type PackedParam } from '../ops/adamw-packed.ts';

/** How the moments are kept: f32 (torch.optim.AdamW) or 8-bit blockwise (bitsandbytes' Adam8bit). */
export type OptimizerKind = 'adamw' | 'adamw8bit';
/** How the master weight is kept: a separate fp32 copy, or the compute weight (+ a 16-bit extension with f16). */
export type MasterKind = 'fp32' | 'compact';
export interface OptimizerMode {
  optimizer: OptimizerKind;
  master: MasterKind;
}
export const OPTIMIZER_KINDS: readonly OptimizerKind[] = ['adamw', 'adamw8bit'];
export const MASTER_KINDS: readonly MasterKind[] = ['fp32', 'compact'];
/** The mode every run used before issue 14 (and the LoRA default). */
export const FP32_MODE: OptimizerMode = { optimizer: 'adamw', master: 'fp32' };

export const isFp32Mode = (m: OptimizerMode): boolean => m.optimizer === 'adamw' && m.master === 'fp32';

/** Byte offsets of one parameter's state inside its chunk's bytes (-1: not kept in this mode). */
export interface ParamPack {
  numel: number;
  q8: boolean;
  blocks: number;
  master: number;
  ext: number;
  m: number;
  v: number;
  m8: number;
  v8: number;
  absm: number;
  absv: number;
}

export interface ChunkPack {
  bytes: number;
  params: ParamPack[];
}

const ALIGN = 256;
const up = (n: number, a: number) => Math.ceil(n / a) * a;

/** Whether a parameter of `numel` elements keeps 8-bit moments in this mode. */
export function keeps8bit(mode: OptimizerMode, numel: number): boolean {
  return mode.optimizer === 'adamw8bit' && numel >= MIN_8BIT_SIZE;
}

/** The layout of a chunk holding parameters of these sizes (in order, packed from element 0). */
export function packChunk(numels: number[], mode: OptimizerMode, computeDtype: DType): ChunkPack {
  const elems = numels.reduce((a, b) => a + b, 0);
  const blocks = numels.map((n) => Math.ceil(n / QBLOCK));
  const q8 = numels.map((n) => keeps8bit(mode, n));
  const ext = mode.master === 'compact' && computeDtype === 'f16';
  let at = 0;
  const region = (bytes: number) => {
    const start = at;
    at = up(at + bytes, ALIGN);
    return start;
  };
  const masterAt = mode.master === 'fp32' ? region(4 * elems) : -1;
  const extAt = ext ? region(blocks.reduce((a, b) => a + b * QBLOCK * 2, 0)) : -1;
  const f32Elems = numels.reduce((a, n, i) => a + (q8[i] ? 0 : n), 0);
  const mAt = region(4 * f32Elems);
  const vAt = region(4 * f32Elems);
  const qBlocks = blocks.reduce((a, b, i) => a + (q8[i] ? b : 0), 0);
  const m8At = region(qBlocks * QBLOCK);
  const v8At = region(qBlocks * QBLOCK);
  const amAt = region(4 * qBlocks);
  const avAt = region(4 * qBlocks);
  const params: ParamPack[] = [];
  let elem = 0;
  let slot = 0;
  let f32At = 0;
  let qAt = 0;
  numels.forEach((numel, i) => {
    params.push({
      numel,
      q8: q8[i],
      blocks: blocks[i],
      master: masterAt < 0 ? -1 : masterAt + 4 * elem,
      ext: extAt < 0 ? -1 : extAt + 2 * slot,
      m: q8[i] ? -1 : mAt + 4 * f32At,
      v: q8[i] ? -1 : vAt + 4 * f32At,
      m8: q8[i] ? m8At + qAt * QBLOCK : -1,
      v8: q8[i] ? v8At + qAt * QBLOCK : -1,
      absm: q8[i] ? amAt + 4 * qAt : -1,
      absv: q8[i] ? avAt + 4 * qAt : -1,
    });
    elem += numel;
    slot += blocks[i] * QBLOCK;
    if (q8[i]) qAt += blocks[i];
    else f32At += numel;
  });
  return { bytes: Math.max(at, 4), params };
}

/**
 * Optimizer state bytes per trainable element of a large parameter (>= MIN_8BIT_SIZE; smaller ones keep f32
 * moments): what a resident chunk holds on the GPU, and what a streamed chunk reads from and writes to the
 * store each step (each way). fp32 + adamw: 12; compact (f16 compute) + adamw8bit: 2 + 1 + 1 + 8/256 = 4.03;
 * with f32 compute the compact master costs nothing (the weight is the master). For the planner.
 */
export function stateBytesPerElement(mode: OptimizerMode, computeDtype: DType): number {
  const master = mode.master === 'fp32' ? 4 : computeDtype === 'f16' ? 2 : 0;
  const moments = mode.optimizer === 'adamw8bit' ? 2 + 8 / QBLOCK : 8;
  return master + moments;
}

/** Exact state bytes of a chunk with parameters of these sizes (region padding included). */
export function chunkStateBytes(numels: number[], mode: OptimizerMode, computeDtype: DType): number {
  return isFp32Mode(mode) ? 12 * numels.reduce((a, b) => a + b, 0) : packChunk(numels, mode, computeDtype).bytes;
}

/** Host views of one parameter's state inside a chunk's bytes (weight16: its f16 weight values, compact f16 only). */
export function hostState(bytes: Uint8Array, p: ParamPack, weight16?: Float32Array): PackedHostState {
  const buf = bytes.buffer;
  const o = bytes.byteOffset;
  const f32 = (at: number, n: number) => new Float32Array(buf, o + at, n);
  const st: PackedHostState = {};
  if (p.master >= 0) st.master = f32(p.master, p.numel);
  if (p.ext >= 0) {
    st.ext = new Int16Array(buf, o + p.ext, p.blocks * QBLOCK);
    st.weight16 = weight16;
  }
  if (p.q8) {
    st.m8 = new Uint8Array(buf, o + p.m8, p.blocks * QBLOCK);
    st.v8 = new Uint8Array(buf, o + p.v8, p.blocks * QBLOCK);
    st.absm = f32(p.absm, p.blocks);
    st.absv = f32(p.absv, p.blocks);
  } else {
    st.m = f32(p.m, p.numel);
    st.v = f32(p.v, p.numel);
  }
  return st;
}

/**
 * A chunk's starting bytes: masters from `initial` (fp32; or the extension words of initial over its f16
 * rounding `weight16`), zero moments (8-bit: the code of 0, absmax 0).
 */
export function initialBytes(
  pack: ChunkPack,
  initial: Float32Array[],
  weight16: (Float32Array | undefined)[],
  extOf: (m: number, w: number) => number,
): Uint8Array {
  const bytes = new Uint8Array(pack.bytes);
  pack.params.forEach((p, i) => {
    const st = hostState(bytes, p, weight16[i]);
    if (st.master) st.master.set(initial[i]);
    if (st.ext) for (let k = 0; k < p.numel; k++) st.ext[k] = extOf(initial[i][k], weight16[i]![k]);
    if (st.m8) st.m8.fill(ZERO_M);
    if (st.v8) st.v8.fill(ZERO_V);
  });
  return bytes;
}

/**
 * Views of one parameter's state inside a packed buffer (a resident chunk's or the staging one) for adamw_packed;
 * `weight` is the parameter's compute weight (with a compact master and f32 compute: the master itself).
 */
export function packedViews(buf: Tensor, p: ParamPack, weight: Tensor): PackedParam {
  const words = (at: number, n: number) => (at < 0 ? undefined : new Tensor(buf.alloc, [n], 'f32', buf.byteOffset + at, false));
  const codeWords = p.blocks * (QBLOCK / 4);
  return {
    numel: p.numel,
    weight,
    master: p.master >= 0 ? words(p.master, p.numel) : p.ext >= 0 ? undefined : weight,
    ext: words(p.ext, p.blocks * (QBLOCK / 2)),
    m: words(p.m, p.numel),
    v: words(p.v, p.numel),
    m8: words(p.m8, codeWords),
    v8: words(p.v8, codeWords),
    absm: words(p.absm, p.blocks),
    absv: words(p.absv, p.blocks),
  };
}
