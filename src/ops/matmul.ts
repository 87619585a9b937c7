// Matmul family: batched tiled matmul with transposes, bias epilogue and accumulation; its backward
// through the transpose variants of the same kernel; nn.Linear on top. Each op has a plain-TS
// reference (`*Ref`, float64 accumulation) beside it.
//
//   Y = op(A) · op(B) + bias        op(A): [M, K], op(B): [K, N], Y: [M, N] per batch
//   dop(A) = dY · op(B)ᵀ            dop(B) = op(A)ᵀ · dY  (summed over the batch when B is broadcast)
//   dbias = column sums of dY over every row of every batch
import type { Gpu } from '../gpu/device.ts';
import { kernel, u32 } from '../gpu/kernel.ts';
import { fmtShape, ShapeError } from '../gpu/errors.ts';
import { BYTES, expectSameDType, expectShape, numel, Tensor } from '../gpu/tensor.ts';
import { checkTile, DIRECT_TILES, elemWindow, pickTile, simtTileDefs, tilesFor, windowBytesBound, type Tile } from './tiles.ts';
import { isInt8 } from './int8.ts';
import { chooseSplitK, pickTcTile, simtGemmEntry, SPLIT_REDUCE_WG, splitReduceEntry, tcDefs, tcTileFits, TC_BK, tensorCoreEntry, type TcTile } from './gemm.ts';
import { epilogueFlags } from './gemm.ts';

export interface MatmulOptions {
  /** a is stored [..., K, M]. */
  transA?: boolean;
  /** b is stored [..., N, K]. */
  transB?: boolean;
  /** [N], added in the epilogue. */
  bias?: Tensor;
  /** [M], added to row m of every batch instead (a 1x1 convolution's per-channel bias, src/ops/conv2d.ts); not with `bias`. */
  rowBias?: Tensor;
  /** Write into this tensor instead of a new one (input dtype, or f32 for f32 gradient buffers). */
  out?: Tensor;
  /** out += a·b (+ bias) instead of out = ... (needs `out`). */
  accumulate?: boolean;
  /** Force a workgroup tile of the SIMT kernel (tests, benchmarks); by default picked from the problem size. */
  tile?: Tile;
  /** Force a tensor-core tile (tests, benchmarks; needs gpu.tensorCores and f16 operands). */
  tcTile?: TcTile;
  /** Force this many split-K chunks (tests, benchmarks; 1 turns split-K off); by default src/ops/gemm.ts's pickSplitK. */
  splitK?: number;
}

/** A forced tile of either kernel and split-K (tests, benchmarks), passed on to every GEMM an op runs. */
type TileChoice = Pick<MatmulOptions, 'tile' | 'tcTile' | 'splitK'>;

// ---- the GEMM driver ------------------------------------------------------------------------

/** One batched GEMM over row-major operands with leading dimensions and batch strides. */
export interface Gemm {
  op: string;
  M: number;
  N: number;
  K: number;
  batch: number;
  a: Tensor;
  b: Tensor;
  c: Tensor;
  bias: Tensor | null;
  /** The bias is indexed by row m (rowBias) rather than column n. */
  biasRows: boolean;
  transA: boolean;
  transB: boolean;
  lda: number;
  ldb: number;
  ldc: number;
  strideA: number;
  strideB: number;
  strideC: number;
  accumulate: boolean;
  tile?: Tile;
  tcTile?: TcTile;
  splitK?: number;
}

/** Element span [first, last] of rows [r0, r0+rc) x cols [c0, c0+cc) over batches [b0, b0+nb). */
function span(ld: number, stride: number, b0: number, nb: number, r0: number, rc: number, c0: number, cc: number): [number, number] {
  return [b0 * stride + r0 * ld + c0, (b0 + nb - 1) * stride + (r0 + rc - 1) * ld + c0 + cc - 1];
}

/** A sub-problem: batches [b0, b0+nb), output rows [m0, m0+mc), columns [n0, n0+nc), reduction [k0, k0+kc). */
interface Block {
  b0: number;
  nb: number;
  m0: number;
  mc: number;
  n0: number;
  nc: number;
  k0: number;
  kc: number;
}

type Dim = 'm' | 'n' | 'k';

/** Each operand's stored (row, column) dims and its element span for a block. */
function operands(g: Gemm, k: Block): { name: string; rows: Dim; cols: Dim; span: [number, number] }[] {
  const len = (d: Dim) => (d === 'm' ? [k.m0, k.mc] : d === 'n' ? [k.n0, k.nc] : [k.k0, k.kc]);
  const op = (name: string, ld: number, stride: number, rows: Dim, cols: Dim) => {
    const [r0, rc] = len(rows);
    const [c0, cc] = len(cols);
    return { name, rows, cols, span: span(ld, stride, k.b0, k.nb, r0, Math.max(rc, 1), c0, Math.max(cc, 1)) };
  };
  return [
    g.transA ? op('a', g.lda, g.strideA, 'k', 'm') : op('a', g.lda, g.strideA, 'm', 'k'),
    g.transB ? op('b', g.ldb, g.strideB, 'n', 'k') : op('b', g.ldb, g.strideB, 'k', 'n'),
    op('c', g.ldc, g.strideC, 'm', 'n'),
  ];
}

function spanFits(gpu: Gpu, s: [number, number], bytes: number): boolean {
  return windowBytesBound(gpu, s[1] - s[0] + 1, bytes) <= gpu.maxBinding;
}

/** ceil(total / parts), rounded up to whole tiles while it is at least one tile. */
function chunkLen(total: number, parts: number, tileLen: number): number {
  const raw = Math.max(1, Math.ceil(total / parts));
  return raw >= tileLen ? Math.min(total, Math.ceil(raw / tileLen) * tileLen) : raw;
}

/**
 * Splits the GEMM into dispatches whose operand windows each fit one storage binding: whole batch
 * groups when they fit, else one batch at a time in chunks of M, N and K. An operand that does not
 * fit has its stored row dimension split (rows of a row-major matrix are contiguous), then its
 * column dimension. K chunks after the first accumulate onto it.
 */
function planGemm(gpu: Gpu, g: Gemm, tile: Pick<Tile, 'BM' | 'BN' | 'BK'>): Block[] {
  const bytes = BYTES[g.a.dtype];
  const whole = (b0: number, nb: number): Block => ({ b0, nb, m0: 0, mc: g.M, n0: 0, nc: g.N, k0: 0, kc: g.K });
  const allFit = (k: Block) => operands(g, k).every((o) => spanFits(gpu, o.span, bytes));
  const maxZ = gpu.facts.maxWorkgroupsPerDimension;
  let group = Math.min(g.batch, maxZ);
  while (group > 1 && !allFit(whole(0, group))) group = Math.ceil(group / 2);
  if (allFit(whole(0, group))) {
    const blocks: Block[] = [];
    for (let b0 = 0; b0 < g.batch; b0 += group) blocks.push(whole(b0, Math.min(group, g.batch - b0)));
    return blocks;
  }
  // One batch at a time; grow the number of chunks per dimension until every window fits.
  const parts: Record<Dim, number> = { m: 1, n: 1, k: 1 };
  const total: Record<Dim, number> = { m: g.M, n: g.N, k: g.K };
  const tileLen: Record<Dim, number> = { m: tile.BM, n: tile.BN, k: tile.BK };
  for (;;) {
    const c: Record<Dim, number> = { m: chunkLen(g.M, parts.m, tile.BM), n: chunkLen(g.N, parts.n, tile.BN), k: chunkLen(g.K, parts.k, tile.BK) };
    const bad = operands(g, { b0: 0, nb: 1, m0: 0, mc: c.m, n0: 0, nc: c.n, k0: 0, kc: c.k }).filter((o) => !spanFits(gpu, o.span, bytes));
    if (!bad.length) {
      const blocks: Block[] = [];
      for (let b0 = 0; b0 < g.batch; b0++)
        for (let m0 = 0; m0 < g.M; m0 += c.m)
          for (let n0 = 0; n0 < g.N; n0 += c.n)
            for (let k0 = 0; k0 < Math.max(g.K, 1); k0 += Math.max(c.k, 1))
              blocks.push({ b0, nb: 1, m0, mc: Math.min(c.m, g.M - m0), n0, nc: Math.min(c.n, g.N - n0), k0, kc: Math.min(c.k, g.K - k0) });
      return blocks;
    }
    for (const o of bad) {
      const d = c[o.rows] > 1 ? o.rows : c[o.cols] > 1 ? o.cols : null;
      if (!d)
        throw new ShapeError(
          g.op,
          `operands [${g.M}x${g.K}]${g.transA ? 'ᵀ' : ''} · [${g.K}x${g.N}]${g.transB ? 'ᵀ' : ''}: ${o.name} cannot be split into storage bindings of ${gpu.maxBinding} bytes`,
        );
      if (chunkLen(total[d], parts[d], tileLen[d]) === c[d]) parts[d] *= 2;
    }
  }
}

const MATMUL_UNIFORMS = [
  u32('M'),
  u32('N'),
  u32('K'),
  u32('lda'),
  u32('ldb'),
  u32('ldc'),
  u32('off_a'),
  u32('off_b'),
  u32('off_c'),
  u32('off_bias'),
  u32('stride_a'),
  u32('stride_b'),
  u32('stride_c'),
  u32('k_splits'),
  u32('k_chunk'),
  u32('epilogue'),
] as const;

/** The SIMT GEMM; with SPLIT_K it writes one reduction chunk's f32 partials to `part` instead of c. */
const MATMUL = kernel({
  shader: 'matmul',
  entry: 'matmul',
  code: simtGemmEntry('matmul'),
  uniforms: MATMUL_UNIFORMS,
  bindings: [
    { name: 'a', type: 'T', access: 'read', when: '!A_VEC4' },
    { name: 'b', type: 'T', access: 'read', when: 'B_PLAIN' },
    { name: 'c', type: 'TC', access: 'read_write', when: '!SPLIT_K' },
    { name: 'bias', type: 'T', access: 'read', when: '!SPLIT_K' },
    { name: 'part', type: 'f32', access: 'read_write', when: 'SPLIT_K' },
    { name: 'a4', type: 'vec4<T>', access: 'read', when: 'A_VEC4' },
    { name: 'b4', type: 'vec4<T>', access: 'read', when: 'B_VEC4' },
    { name: 'bq', type: 'u32', access: 'read', when: 'B_INT8' },
    { name: 'bs', type: 'f32', access: 'read', when: 'B_INT8' },
  ],
});

/** The same GEMM on tensor cores (f16 operands; src/ops/gemm.ts generates the entry point). */
const MATMUL_TC = kernel({ ...MATMUL, entry: 'matmul_tc', code: tensorCoreEntry('matmul_tc') });

/** c = the sum of the split-K partials (+ bias, + c), through the same epilogue. */
const MATMUL_SPLIT_REDUCE = kernel({
  shader: 'matmul',
  entry: 'matmul_split_reduce',
  code: splitReduceEntry('matmul_split_reduce'),
  uniforms: MATMUL_UNIFORMS,
  bindings: [
    { name: 'part', type: 'f32', access: 'read' },
    { name: 'c', type: 'TC', access: 'read_write' },
    { name: 'bias', type: 'T', access: 'read' },
  ],
});

/** The tensor-core tile this GEMM runs with, or null for the SIMT kernel. */
function gemmTcTile(gpu: Gpu, g: Gemm): TcTile | null {
  if (g.tcTile) {
    if (!gpu.tensorCores || g.a.dtype !== 'f16')
      throw new ShapeError(g.op, `tcTile needs tensor cores and f16 operands (${gpu.tensorCoreNote}; operands ${g.a.dtype})`);
    if (!tcTileFits(gpu, g.tcTile, gpu.tensorCores)) throw new ShapeError(g.op, `tensor-core tile ${JSON.stringify(g.tcTile)} does not fit this device`);
    return g.tcTile;
  }
  if (g.tile || g.a.dtype !== 'f16' || isInt8(g.b)) return null;
  return pickTcTile(gpu, g.M, g.N, g.batch);
}

export function runGemm(gpu: Gpu, g: Gemm): void {
  if (g.M === 0 || g.N === 0 || g.batch === 0) return;
  const tc = gemmTcTile(gpu, g);
  const tileSet = gpu.gemmConfig.direct ? DIRECT_TILES : tilesFor(gpu);
  const tile = tc ? null : (g.tile ?? pickTile(g.M, g.N, g.batch, gpu.fillWorkgroups, tileSet));
  if (tile) checkTile(gpu, tile);
  const blockTile = tile ?? { BM: tc!.BM, BN: tc!.BN, BK: TC_BK };
  for (const k of planGemm(gpu, g, blockTile)) {
    const [sa, sb, sc] = operands(g, k).map((o) => o.span);
    const firstK = k.k0 === 0;
    // K = 0 gives C = bias (or leaves C as is when accumulating): the kernel's K loop is empty.
    const wa = elemWindow(gpu, g.a, sa[0], sa[1] - sa[0] + 1);
    const wb = elemWindow(gpu, g.b, sb[0], sb[1] - sb[0] + 1);
    const wc = elemWindow(gpu, g.c, sc[0], sc[1] - sc[0] + 1);
    const wbias = firstK && g.bias !== null ? (g.biasRows ? elemWindow(gpu, g.bias, k.m0, k.mc) : elemWindow(gpu, g.bias, k.n0, k.nc)) : null;
    const tiles: [number, number] = [Math.ceil(k.nc / blockTile.BN), Math.ceil(k.mc / blockTile.BM)];
    const split = chooseSplitK(gpu, tiles[0] * tiles[1] * k.nb, k.nb, k.mc, k.nc, k.kc, blockTile.BK, g.splitK);
    // Whole vec4 reads along each operand's contiguous index where its strides allow: along m or n as the groups
    // both cores stage (Aᵀ stored [K, M], B [K, N]), along k as the SIMT core's 4x4 quads (A [M, K], Bᵀ stored
    // [N, K]: the forward x·Wᵀ; gemm.ts operandStaging).
    const aQuads = tile !== null && !g.transA && vec4Operand(true, k.kc, g.lda, g.strideA, wa.offset);
    // An int8 B (a frozen weight, src/ops/int8.ts) is bound whole as its bytes and scales, read element by element.
    const int8 = isInt8(g.b) ? g.b.windows() : null;
    if (int8 && int8.q.size > gpu.maxBinding) throw new ShapeError(g.op, `int8 weight ${g.b} exceeds one storage binding (${gpu.maxBinding} bytes)`);
    const bQuads = tile !== null && g.transB && !int8 && vec4Operand(true, k.kc, g.ldb, g.strideB, wb.offset);
    const aVec4 = aQuads || vec4Operand(g.transA, k.mc, g.lda, g.strideA, wa.offset);
    const bVec4 = bQuads || (!int8 && vec4Operand(!g.transB, k.nc, g.ldb, g.strideB, wb.offset));
    const defs = {
      T: g.a.dtype,
      TC: g.c.dtype,
      A_VEC4: aVec4,
      B_VEC4: bVec4,
      B_INT8: int8 !== null,
      B_PLAIN: !bVec4 && !int8,
      A_QUADS: aQuads,
      B_QUADS: bQuads,
      // the tile divides the block: loads and stores skip their bounds checks
      FITS: k.mc % blockTile.BM === 0 && k.nc % blockTile.BN === 0 && k.kc % blockTile.BK === 0,
      TRANS_A: g.transA,
      TRANS_B: g.transB,
    };
    const uniforms = {
      M: k.mc,
      N: k.nc,
      K: k.kc,
      lda: g.lda,
      ldb: g.ldb,
      ldc: g.ldc,
      off_a: wa.offset,
      off_b: int8 ? sb[0] : wb.offset,
      off_c: wc.offset,
      off_bias: wbias?.offset ?? 0,
      stride_a: g.strideA,
      stride_b: g.strideB,
      stride_c: g.strideC,
      k_splits: split.splits,
      k_chunk: split.chunk,
      epilogue: epilogueFlags({ bias: wbias !== null, bias_rows: g.biasRows, accumulate: g.accumulate || !firstK }),
    };
    const core = tc ? MATMUL_TC : MATMUL;
    const coreDefs = tc ? tcDefs(tc, gpu.tensorCores!) : simtTileDefs(tile!);
    const bias = { bias: (wbias ?? elemWindow(gpu, g.a, 0, 1)).window }; // no bias: a stand-in the epilogue never reads
    const staged = {
      ...(aVec4 ? { a4: wa.window } : { a: wa.window }),
      ...(int8 ? { bq: int8.q, bs: int8.scale } : bVec4 ? { b4: wb.window } : { b: wb.window }),
    };
    if (split.splits === 1) {
      gpu.run(core, {
        defs: { ...defs, ...coreDefs, SPLIT_K: false },
        uniforms,
        bindings: { ...staged, c: wc.window, ...bias },
        workgroups: [...tiles, k.nb],
      });
      continue;
    }
    // Split-K: each chunk's f32 partial products, then one pass summing them into c through the epilogue.
    const part = gpu.tensor([k.nb * split.splits, k.mc, k.nc], 'f32', 'scratch', `${g.op}.split-k`);
    const wp = elemWindow(gpu, part, 0, part.numel);
    gpu.run(core, {
      defs: { ...defs, ...coreDefs, SPLIT_K: true },
      uniforms,
      bindings: { ...staged, part: wp.window },
      workgroups: [...tiles, k.nb * split.splits],
    });
    gpu.run(MATMUL_SPLIT_REDUCE, {
      defs: { T: defs.T, TC: defs.TC },
      uniforms,
      bindings: { part: wp.window, c: wc.window, ...bias },
      workgroups: [Math.ceil(k.nc / SPLIT_REDUCE_WG), k.mc, k.nb],
    });
    gpu.free(part);
  }
}

/**
 * Whether an operand's staging groups (4 consecutive elements along its contiguous dimension: m of a stored Aᵀ,
 * n of B) are whole aligned vec4s of its storage: the staged dimension runs contiguously in memory, and its length,
 * the leading dimension, the batch stride and the element offset inside the bound window are multiples of 4.
 */
function vec4Operand(contiguous: boolean, len: number, ld: number, batchStride: number, offset: number): boolean {
  return contiguous && len % 4 === 0 && ld % 4 === 0 && batchStride % 4 === 0 && offset % 4 === 0;
}

/** An output is stored in the input dtype, or in f32 (f32 gradient buffers of f16 operands). */
function expectOutDType(op: string, input: Tensor, out: Tensor): void {
  if (out.dtype !== input.dtype && out.dtype !== 'f32')
    throw new ShapeError(op, `out must be ${input.dtype} or f32, got ${out.dtype}${fmtShape(out.shape)} for ${input.dtype}${fmtShape(input.shape)} inputs`);
}

// ---- matmul ----------------------------------------------------------------------------------

interface MatmulShape {
  M: number;
  N: number;
  K: number;
  batchShape: number[];
  batch: number;
  aBatched: boolean;
  bBatched: boolean;
}

function matmulShape(op: string, a: Tensor, b: Tensor, transA: boolean, transB: boolean): MatmulShape {
  const desc = () => `a ${fmtShape(a.shape)}${transA ? 'ᵀ' : ''} · b ${fmtShape(b.shape)}${transB ? 'ᵀ' : ''}`;
  if (a.shape.length < 2 || b.shape.length < 2) throw new ShapeError(op, `operands must have at least 2 dims: ${desc()}`);
  expectSameDType(op, a, b);
  if (isInt8(a) || (isInt8(b) && b.shape.length !== 2))
    throw new ShapeError(op, `an int8 weight is read only as an unbatched operand b (a 2-D weight): ${desc()}`);
  const [ar, ac] = a.shape.slice(-2);
  const [br, bc] = b.shape.slice(-2);
  const M = transA ? ac : ar;
  const K = transA ? ar : ac;
  const Kb = transB ? bc : br;
  const N = transB ? br : bc;
  if (K !== Kb) throw new ShapeError(op, `inner dimensions differ (${K} vs ${Kb}): ${desc()}`);
  const aBatch = a.shape.slice(0, -2);
  const bBatch = b.shape.slice(0, -2);
  if (aBatch.length && bBatch.length && (aBatch.length !== bBatch.length || aBatch.some((d, i) => d !== bBatch[i])))
    throw new ShapeError(op, `batch dimensions differ: ${desc()}`);
  const batchShape = aBatch.length ? aBatch : bBatch;
  return { M, N, K, batchShape, batch: numel(batchShape), aBatched: aBatch.length > 0, bBatched: bBatch.length > 0 };
}

/**
 * Y = op(a) · op(b) (+ bias), batched over leading dims (either operand may be unbatched, i.e.
 * broadcast). Output dtype = input dtype, f32 accumulation.
 */
export function matmul(gpu: Gpu, a: Tensor, b: Tensor, opts: MatmulOptions = {}): Tensor {
  const op = 'matmul';
  const transA = opts.transA ?? false;
  const transB = opts.transB ?? false;
  const s = matmulShape(op, a, b, transA, transB);
  const outShape = [...s.batchShape, s.M, s.N];
  if (opts.bias) {
    expectShape(op, 'bias', opts.bias, [s.N]);
    expectSameDType(op, a, opts.bias);
  }
  if (opts.rowBias) {
    if (opts.bias) throw new ShapeError(op, 'give bias (per column) or rowBias (per row), not both');
    expectShape(op, 'rowBias', opts.rowBias, [s.M]);
    expectSameDType(op, a, opts.rowBias);
  }
  if (opts.accumulate && !opts.out) throw new ShapeError(op, 'accumulate needs an out tensor');
  if (opts.out) {
    expectShape(op, 'out', opts.out, outShape);
    expectOutDType(op, a, opts.out);
  }
  const c = opts.out ?? gpu.tensor(outShape, a.dtype, 'activations', 'matmul');
  const g: Gemm = {
    op,
    M: s.M,
    N: s.N,
    K: s.K,
    batch: s.batch,
    a,
    b,
    c,
    bias: opts.bias ?? opts.rowBias ?? null,
    biasRows: opts.rowBias !== undefined,
    transA,
    transB,
    lda: a.shape[a.shape.length - 1],
    ldb: b.shape[b.shape.length - 1],
    ldc: s.N,
    strideA: s.aBatched ? s.M * s.K : 0,
    strideB: s.bBatched ? s.K * s.N : 0,
    strideC: s.M * s.N,
    accumulate: opts.accumulate ?? false,
    tile: opts.tile,
    tcTile: opts.tcTile,
    splitK: opts.splitK,
  };
  // A broadcast B over rows of A [M, K] is one big GEMM over batch * M rows.
  if (!s.bBatched && s.aBatched && !transA && !opts.rowBias) {
    g.M *= g.batch;
    g.batch = 1;
  }
  runGemm(gpu, g);
  return c;
}

/**
 * Σ_batch op(x_b) · op(y_b) into one [M, N] result (gradients of an operand that was broadcast over
 * the batch). When the reduction runs along the stored rows of both (x transposed, y not) the
 * batches are just more rows: one GEMM over batch * rows. Otherwise one accumulating GEMM per batch.
 */
function matmulSumBatch(
  gpu: Gpu,
  op: string,
  x: Tensor,
  y: Tensor,
  transX: boolean,
  transY: boolean,
  out: Tensor | undefined,
  accumulate: boolean,
  tiles: TileChoice,
): Tensor {
  const s = matmulShape(op, x, y, transX, transY);
  const flat = (t: Tensor) => t.shape.slice(-2);
  if (transX && !transY) {
    const rows = x.numel / x.shape[x.shape.length - 1];
    return matmul(gpu, x.reshape([rows, x.shape[x.shape.length - 1]]), y.reshape([rows, y.shape[y.shape.length - 1]]), {
      transA: true,
      out,
      accumulate,
      ...tiles,
    });
  }
  const c = out ?? gpu.tensor([s.M, s.N], x.dtype, 'gradients', `${op}-sum`);
  const xs = flat(x);
  const ys = flat(y);
  for (let i = 0; i < s.batch; i++) {
    const xv = new Tensor(x.alloc, xs, x.dtype, x.byteOffset + i * numel(xs) * BYTES[x.dtype], false);
    const yv = new Tensor(y.alloc, ys, y.dtype, y.byteOffset + i * numel(ys) * BYTES[y.dtype], false);
    matmul(gpu, xv, yv, { transA: transX, transB: transY, out: c, accumulate: accumulate || i > 0, ...tiles });
  }
  return c;
}

export interface MatmulGrads {
  da: Tensor;
  db: Tensor;
  dbias?: Tensor;
}

export interface MatmulBackwardOptions extends MatmulOptions {
  /** Gradient tensors to write (or, with `accumulate`, add) into instead of new ones. */
  into?: { da?: Tensor; db?: Tensor; dbias?: Tensor };
}

/**
 * Gradients of Y = op(a) · op(b) + bias for upstream dY (same argument order as matmul; `bias`
 * only says whether dbias is wanted). With `accumulate`, adds into `into.*`.
 */
export function matmulBackward(gpu: Gpu, a: Tensor, b: Tensor, dy: Tensor, opts: MatmulBackwardOptions = {}): MatmulGrads {
  return matmulGrads(gpu, a, b, dy, opts, { a: true, b: true }) as MatmulGrads;
}

/**
 * matmulBackward's kernels for the wanted operands only (a frozen input needs no da: requires_grad pruning);
 * each gradient is the same dispatch sequence as in the full backward, so it comes out bit-identical.
 */
function matmulGrads(
  gpu: Gpu,
  a: Tensor,
  b: Tensor,
  dy: Tensor,
  opts: MatmulBackwardOptions,
  want: { a: boolean; b: boolean },
): { da?: Tensor; db?: Tensor; dbias?: Tensor } {
  const op = 'matmulBackward';
  const transA = opts.transA ?? false;
  const transB = opts.transB ?? false;
  const s = matmulShape(op, a, b, transA, transB);
  expectShape(op, 'dy', dy, [...s.batchShape, s.M, s.N]);
  expectSameDType(op, a, dy);
  const acc = opts.accumulate ?? false;
  const into = opts.into ?? {};
  if (acc && ((want.a && !into.da) || (want.b && !into.db) || (want.b && opts.bias && !into.dbias)))
    throw new ShapeError(op, 'accumulate needs into.da, into.db (and into.dbias with a bias)');
  const sumA = !s.aBatched && s.bBatched;
  const sumB = !s.bBatched && s.aBatched;

  const tile: TileChoice = { tile: opts.tile, tcTile: opts.tcTile, splitK: opts.splitK };
  // dop(A) = dY · op(B)ᵀ. Stored A = op(A) (no transA) or op(A)ᵀ = op(B) · dYᵀ (transA).
  let da: Tensor | undefined;
  if (!want.a) da = undefined;
  else if (!transA)
    da = sumA
      ? matmulSumBatch(gpu, op, dy, b, false, !transB, into.da, acc, tile)
      : matmul(gpu, dy, b, { transB: !transB, out: into.da, accumulate: acc, ...tile });
  else
    da = sumA
      ? matmulSumBatch(gpu, op, b, dy, transB, true, into.da, acc, tile)
      : matmul(gpu, b, dy, { transA: transB, transB: true, out: into.da, accumulate: acc, ...tile });

  // dop(B) = op(A)ᵀ · dY. Stored B = op(B) (no transB) or op(B)ᵀ = dYᵀ · op(A) (transB).
  let db: Tensor | undefined;
  if (!want.b) db = undefined;
  else if (!transB)
    db = sumB
      ? matmulSumBatch(gpu, op, a, dy, !transA, false, into.db, acc, tile)
      : matmul(gpu, a, dy, { transA: !transA, out: into.db, accumulate: acc, ...tile });
  else
    db = sumB
      ? matmulSumBatch(gpu, op, dy, a, true, transA, into.db, acc, tile)
      : matmul(gpu, dy, a, { transA: true, transB: transA, out: into.db, accumulate: acc, ...tile });

  const grads: { da?: Tensor; db?: Tensor; dbias?: Tensor } = { da, db };
  if (opts.bias && want.b) grads.dbias = colSum(gpu, dy.reshape([dy.numel / s.N, s.N]), into.dbias, acc);
  return grads;
}

const COL_SUM_PARTIAL = kernel({
  shader: 'matmul',
  entry: 'col_sum_partial',
  uniforms: [
    { name: 'rows', type: 'u32' },
    { name: 'cols', type: 'u32' },
    { name: 'off_x', type: 'u32' },
    { name: 'part_row0', type: 'u32' },
  ],
  bindings: [
    { name: 'x', type: 'T', access: 'read' },
    { name: 'partial', type: 'f32', access: 'read_write' },
  ],
});

const COL_SUM_FINISH = kernel({
  shader: 'matmul',
  entry: 'col_sum_finish',
  uniforms: [
    { name: 'cols', type: 'u32' },
    { name: 'off_out', type: 'u32' },
    { name: 'parts', type: 'u32' },
  ],
  bindings: [
    { name: 'partial', type: 'f32', access: 'read' },
    { name: 'out', type: 'TO', access: 'read_write' },
  ],
});

/** out[n] = Σ_r x[r, n] in f32 (two passes: per-256-row partial sums, then their sum). */
/**
 * The column sums' workgroup (matmul.wgsl col_sum_*, compiled in as defs): SUM_COLS column lanes x ROW_LANES row
 * lanes, each workgroup of the first pass over ROWS_PER_WG rows; the grid is sized by the same numbers.
 */
const COL_SUM = { SUM_COLS: 64, ROW_LANES: 4, ROWS_PER_WG: 256 } as const;

export function colSum(gpu: Gpu, x: Tensor, out?: Tensor, accumulate = false): Tensor {
  const op = 'colSum';
  if (x.shape.length !== 2) throw new ShapeError(op, `x must be 2-D, got ${fmtShape(x.shape)}`);
  const [rows, cols] = x.shape;
  if (out) {
    expectShape(op, 'out', out, [cols]);
    expectOutDType(op, x, out);
  }
  if (accumulate && !out) throw new ShapeError(op, 'accumulate needs an out tensor');
  const o = out ?? gpu.tensor([cols], x.dtype, 'gradients', 'colsum');
  const bytes = BYTES[x.dtype];
  // Row chunks of x that fit one binding; each chunk writes ceil(rows / 256) partial rows.
  const chunkRows = Math.floor((gpu.maxBinding - windowBytesBound(gpu, 0, bytes)) / (cols * bytes));
  if (chunkRows < 1 && rows > 0) throw new ShapeError(op, `${fmtShape(x.shape)}: one row does not fit a storage binding of ${gpu.maxBinding} bytes`);
  const chunks: { r0: number; rc: number }[] = [];
  for (let r0 = 0; r0 < rows; r0 += chunkRows) chunks.push({ r0, rc: Math.min(chunkRows, rows - r0) });
  const parts = Math.max(
    1,
    chunks.reduce((n, c) => n + Math.ceil(c.rc / COL_SUM.ROWS_PER_WG), 0),
  );
  const partial = gpu.tensor([parts, cols], 'f32', 'scratch', 'colsum-partial');
  const wo = elemWindow(gpu, o, 0, cols);
  const wp = elemWindow(gpu, partial, 0, parts * cols);
  let part = 0;
  for (const { r0, rc } of chunks) {
    const wx = elemWindow(gpu, x, r0 * cols, rc * cols);
    const blocks = Math.ceil(rc / COL_SUM.ROWS_PER_WG);
    gpu.run(COL_SUM_PARTIAL, {
      defs: { T: x.dtype, ...COL_SUM },
      uniforms: { rows: rc, cols, off_x: wx.offset, part_row0: part },
      bindings: { x: wx.window, partial: wp.window },
      workgroups: [Math.ceil(cols / COL_SUM.SUM_COLS), blocks],
    });
    part += blocks;
  }
  gpu.run(COL_SUM_FINISH, {
    defs: { TO: o.dtype, ACCUMULATE: accumulate, ...COL_SUM },
    uniforms: { cols, off_out: wo.offset, parts: part },
    bindings: { partial: wp.window, out: wo.window },
    workgroups: [Math.ceil(cols / COL_SUM.SUM_COLS)],
  });
  // Submit before freeing: work already submitted still sees the buffer.
  gpu.flush();
  gpu.free(partial);
  return o;
}

// ---- linear (PyTorch nn.Linear: weight [out, in]) ---------------------------------------------

/** y = x · Wᵀ + b, x [..., in], weight [out, in], bias [out]. */
export function linear(gpu: Gpu, x: Tensor, weight: Tensor, bias?: Tensor | null): Tensor {
  if (x.shape.length < 1 || weight.shape.length !== 2)
    throw new ShapeError('linear', `x ${fmtShape(x.shape)}, weight ${fmtShape(weight.shape)} (must be [out, in])`);
  if (x.shape[x.shape.length - 1] !== weight.shape[1])
    throw new ShapeError(
      'linear',
      `x ${fmtShape(x.shape)} has ${x.shape[x.shape.length - 1]} features, weight ${fmtShape(weight.shape)} takes ${weight.shape[1]}`,
    );
  const x2 = x.shape.length === 1 ? x.reshape([1, x.shape[0]]) : x;
  const y = matmul(gpu, x2, weight, { transB: true, bias: bias ?? undefined });
  // An owning tensor of the output's shape (a view would never free the buffer).
  return x.shape.length === 1 ? new Tensor(y.alloc, [weight.shape[0]], y.dtype, y.byteOffset, y.owner) : y;
}

// Bias gradients are `dbias` here as in matmulBackward: `db` is only ever the gradient of matmul's operand b
// (for linear, that is dw).
export interface LinearGrads {
  dx: Tensor;
  dw: Tensor;
  dbias?: Tensor;
}

/** Gradients of linear: dx = dy · W, dW = Σ dyᵀ · x, dbias = Σ dy (when a bias was used). */
export function linearBackward(
  gpu: Gpu,
  x: Tensor,
  weight: Tensor,
  dy: Tensor,
  bias?: Tensor | null,
  into?: { dx?: Tensor; dw?: Tensor; dbias?: Tensor; accumulate?: boolean },
): LinearGrads {
  if (x.shape.length < 1 || weight.shape.length !== 2 || x.shape[x.shape.length - 1] !== weight.shape[1])
    throw new ShapeError('linearBackward', `x ${fmtShape(x.shape)}, weight ${fmtShape(weight.shape)} (must be [out, in])`);
  const rows = x.numel / weight.shape[1];
  const x2 = x.reshape([rows, weight.shape[1]]);
  expectShape('linearBackward', 'dy', dy, [...x.shape.slice(0, -1), weight.shape[0]]);
  const dy2 = dy.reshape([rows, weight.shape[0]]);
  const g = matmulBackward(gpu, x2, weight, dy2, {
    transB: true,
    bias: bias ?? undefined,
    accumulate: into?.accumulate,
    into: { da: into?.dx?.reshape([rows, weight.shape[1]]), db: into?.dw, dbias: into?.dbias },
  });
  // dx owns its buffer in x's shape (a reshape view would leave the buffer unfreeable).
  const out: LinearGrads = { dx: into?.dx ?? new Tensor(g.da.alloc, x.shape, g.da.dtype, g.da.byteOffset, g.da.owner), dw: g.db };
  if (g.dbias) out.dbias = g.dbias;
  return out;
}

/**
 * dW (and dbias) of linear without dx: for an input that needs no gradient. The same kernels as
 * linearBackward's dW and dbias, so bit-identical to them.
 */
export function linearBackwardWeight(
  gpu: Gpu,
  x: Tensor,
  weight: Tensor,
  dy: Tensor,
  bias?: Tensor | null,
  /** Write dW (and dbias) into these (added with `accumulate`), as linearBackward's `into`. */
  into?: { dw?: Tensor; dbias?: Tensor; accumulate?: boolean },
): { dw: Tensor; dbias?: Tensor } {
  if (x.shape.length < 1 || weight.shape.length !== 2 || x.shape[x.shape.length - 1] !== weight.shape[1])
    throw new ShapeError('linearBackwardWeight', `x ${fmtShape(x.shape)}, weight ${fmtShape(weight.shape)} (must be [out, in])`);
  const rows = x.numel / weight.shape[1];
  expectShape('linearBackwardWeight', 'dy', dy, [...x.shape.slice(0, -1), weight.shape[0]]);
  const g = matmulGrads(
    gpu,
    x.reshape([rows, weight.shape[1]]),
    weight,
    dy.reshape([rows, weight.shape[0]]),
    { transB: true, bias: bias ?? undefined, accumulate: into?.accumulate, into: { db: into?.dw, dbias: into?.dbias } },
    { a: false, b: true },
  );
  return g.dbias ? { dw: g.db!, dbias: g.dbias } : { dw: g.db! };
}

// ---- plain-TS references (float64 accumulation) ---------------------------------------------

export interface MatmulRefOptions {
  transA?: boolean;
  transB?: boolean;
  bias?: ArrayLike<number>;
  rowBias?: ArrayLike<number>;
}

function refShape(aShape: readonly number[], bShape: readonly number[], transA: boolean, transB: boolean) {
  const [ar, ac] = aShape.slice(-2);
  const [br, bc] = bShape.slice(-2);
  const M = transA ? ac : ar;
  const K = transA ? ar : ac;
  const N = transB ? br : bc;
  const aB = numel(aShape.slice(0, -2));
  const bB = numel(bShape.slice(0, -2));
  const batch = Math.max(aShape.length > 2 ? aB : 1, bShape.length > 2 ? bB : 1);
  return { M, N, K, batch, aStride: aShape.length > 2 ? M * K : 0, bStride: bShape.length > 2 ? K * N : 0 };
}

/** op(a) · op(b) (+ bias) over the batch; returns [batch * M * N]. */
export function matmulRef(
  a: ArrayLike<number>,
  aShape: readonly number[],
  b: ArrayLike<number>,
  bShape: readonly number[],
  opts: MatmulRefOptions = {},
): Float32Array {
  const tA = opts.transA ?? false;
  const tB = opts.transB ?? false;
  const { M, N, K, batch, aStride, bStride } = refShape(aShape, bShape, tA, tB);
  const out = new Float32Array(batch * M * N);
  for (let z = 0; z < batch; z++)
    for (let m = 0; m < M; m++)
      for (let n = 0; n < N; n++) {
        let s = opts.bias ? opts.bias[n] : opts.rowBias ? opts.rowBias[m] : 0;
        for (let k = 0; k < K; k++) {
          const av = a[z * aStride + (tA ? k * M + m : m * K + k)];
          const bv = b[z * bStride + (tB ? n * K + k : k * N + n)];
          s += av * bv;
        }
        out[(z * M + m) * N + n] = s;
      }
  return out;
}

/** Reference gradients of matmul (da/db in the stored layouts and batch shapes of a and b). */
export function matmulBackwardRef(
  a: ArrayLike<number>,
  aShape: readonly number[],
  b: ArrayLike<number>,
  bShape: readonly number[],
  dy: ArrayLike<number>,
  opts: { transA?: boolean; transB?: boolean } = {},
): { da: Float32Array; db: Float32Array; dbias: Float32Array } {
  const tA = opts.transA ?? false;
  const tB = opts.transB ?? false;
  const { M, N, K, batch, aStride, bStride } = refShape(aShape, bShape, tA, tB);
  const da = new Float64Array(numel(aShape));
  const db = new Float64Array(numel(bShape));
  const dbias = new Float64Array(N);
  for (let z = 0; z < batch; z++)
    for (let m = 0; m < M; m++)
      for (let n = 0; n < N; n++) {
        const g = dy[(z * M + m) * N + n];
        dbias[n] += g;
        for (let k = 0; k < K; k++) {
          const ai = z * aStride + (tA ? k * M + m : m * K + k);
          const bi = z * bStride + (tB ? n * K + k : k * N + n);
          da[ai] += g * b[bi];
          db[bi] += g * a[ai];
        }
      }
  return { da: Float32Array.from(da), db: Float32Array.from(db), dbias: Float32Array.from(dbias) };
}

/** x [rows, in] · W [out, in]ᵀ + b. */
export function linearRef(
  x: ArrayLike<number>,
  xShape: readonly number[],
  w: ArrayLike<number>,
  wShape: readonly number[],
  bias?: ArrayLike<number>,
): Float32Array {
  const rows = numel(xShape) / wShape[1];
  return matmulRef(x, [rows, wShape[1]], w, wShape, { transB: true, bias });
}

export function linearBackwardRef(
  x: ArrayLike<number>,
  xShape: readonly number[],
  w: ArrayLike<number>,
  wShape: readonly number[],
  dy: ArrayLike<number>,
): { dx: Float32Array; dw: Float32Array; dbias: Float32Array } {
  const rows = numel(xShape) / wShape[1];
  const g = matmulBackwardRef(x, [rows, wShape[1]], w, wShape, dy, { transB: true });
  return { dx: g.da, dw: g.db, dbias: g.dbias };
}
