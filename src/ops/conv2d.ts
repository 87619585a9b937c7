// 2-D convolution, NCHW with PyTorch semantics, as implicit GEMM (shaders/conv2d.wgsl): forward,
// grad input, grad weight and grad bias, each with a plain-TS reference (float64 accumulation). A pointwise conv
// (1x1, stride 1, no padding: SD's attention projections in/out, shortcuts) runs its forward and grad input as plain
// batched matmuls (src/ops/matmul.ts: vec4 loads of the pixel rows, no tap arithmetic); its grad weight stays an
// implicit GEMM, which sums over the samples in one reduction.
//
//   y[n, co, oh, ow] = b[co] + Σ_{ci, kh, kw} w[co, ci, kh, kw] · x[n, ci, oh*S - P + kh, ow*S - P + kw]
//   dx[n, ci, ih, iw] = Σ_{co, kh, kw : ih = oh*S - P + kh, iw = ow*S - P + kw} w[co, ci, kh, kw] · dy[n, co, oh, ow]
//   dw[co, ci, kh, kw] = Σ_{n, oh, ow} dy[n, co, oh, ow] · x[n, ci, oh*S - P + kh, ow*S - P + kw]
//   db[co] = Σ_{n, oh, ow} dy[n, co, oh, ow]
import type { Gpu } from '../gpu/device.ts';
import { kernel, read, u32, write } from '../gpu/kernel.ts';
import type { Defs } from '../gpu/shaders.ts';
import { fmtShape, ShapeError } from '../gpu/errors.ts';
import { BYTES, expectSameDType, expectShape, type Tensor } from '../gpu/tensor.ts';
import { matmul } from './matmul.ts';
import { isInt8 } from './int8.ts';
import { elemWindow, pickTile, simtTileDefs, tilesFor, tileSharedBytes, windowBytesBound, type Tile } from './tiles.ts';
import { chooseSplitK, epilogueFlags, pickTcTile, simtGemmEntry, SPLIT_REDUCE_WG, splitReduceEntry, tcDefs, TC_BK, tensorCoreEntry } from './gemm.ts';

export interface Conv2dOptions {
  stride: number;
  padding: number;
  /** Force a workgroup tile (tests, benchmarks). */
  tile?: Tile;
  /** Force this many split-K chunks in every GEMM (tests, benchmarks; 1 turns split-K off). */
  splitK?: number;
  /**
   * Compile the layer's sizes into the implicit GEMM as constants (sizeAccessors). Default: on GPUs, off on CPU
   * adapters, where each new shape would be a new pipeline to compile (lavapipe: about 1-2 s each).
   */
  constSizes?: boolean;
  /**
   * How the forward and grad input of a convolution other than a pointwise one run: 'implicit' (the implicit GEMM:
   * im2col gathered by the tile loaders, nothing stored) or 'im2col' (the im2col matrix stored, then plain GEMMs on
   * the matmul kernels; see shaders/conv2d.wgsl). Grad weight is the implicit GEMM either way. Default (`lowering`):
   * im2col on CPU adapters whose matmuls run the direct core, where forward and grad input measured 1.1-2.7x faster
   * at the small-f4 UNet's shapes, unless a tile, split-K or constSizes is forced (those choose the implicit GEMM's
   * kernels); implicit elsewhere.
   */
  lowering?: Lowering;
}

export type Lowering = 'implicit' | 'im2col';

export interface Conv2dBackwardOptions extends Conv2dOptions {
  /** Add into `into.*` instead of writing new tensors (gradient accumulation). */
  accumulate?: boolean;
  /** Gradient tensors to write or add into (input dtype, or f32). */
  into?: { dx?: Tensor; dw?: Tensor; db?: Tensor };
}

export interface ConvShape {
  N: number;
  Ci: number;
  H: number;
  W: number;
  Co: number;
  KH: number;
  KW: number;
  Ho: number;
  Wo: number;
  stride: number;
  pad: number;
}

/** Validates x [N, Ci, H, W], w [Co, Ci, KH, KW], stride 1|2, padding >= 0; returns the sizes. */
export function convShape(op: string, xShape: readonly number[], wShape: readonly number[], opts: Conv2dOptions): ConvShape {
  const desc = `x ${fmtShape(xShape)}, weight ${fmtShape(wShape)}, stride ${opts.stride}, padding ${opts.padding}`;
  if (xShape.length !== 4 || wShape.length !== 4) throw new ShapeError(op, `x must be [N,Ci,H,W] and weight [Co,Ci,kh,kw]: ${desc}`);
  const [N, Ci, H, W] = xShape;
  const [Co, Cw, KH, KW] = wShape;
  if (Cw !== Ci) throw new ShapeError(op, `weight expects ${Cw} input channels, x has ${Ci}: ${desc}`);
  if (opts.stride !== 1 && opts.stride !== 2) throw new ShapeError(op, `stride must be 1 or 2: ${desc}`);
  if (!Number.isInteger(opts.padding) || opts.padding < 0) throw new ShapeError(op, `padding must be a non-negative integer: ${desc}`);
  const Ho = Math.floor((H + 2 * opts.padding - KH) / opts.stride) + 1;
  const Wo = Math.floor((W + 2 * opts.padding - KW) / opts.stride) + 1;
  if (KH < 1 || KW < 1 || Ho < 1 || Wo < 1) throw new ShapeError(op, `empty output: ${desc}`);
  return { N, Ci, H, W, Co, KH, KW, Ho, Wo, stride: opts.stride, pad: opts.padding };
}

function expectOutDType(op: string, input: Tensor, out: Tensor): void {
  if (out.dtype !== input.dtype && out.dtype !== 'f32') throw new ShapeError(op, `out must be ${input.dtype} or f32, got ${out.dtype}${fmtShape(out.shape)}`);
}

/** MODE of shaders/conv2d.wgsl: which GEMM the implicit-GEMM kernel runs. */
const Mode = { Forward: 0, GradInput: 1, GradWeight: 2 } as const;
type Mode = (typeof Mode)[keyof typeof Mode];

/** How many whole samples of these per-sample sizes (bytes) fit one binding; throws when none. */
function samplesPerBinding(gpu: Gpu, op: string, s: ConvShape, perSampleBytes: number[]): number {
  const per = Math.max(...perSampleBytes);
  const n = Math.floor((gpu.maxBinding - windowBytesBound(gpu, 0, 1)) / per);
  if (n < 1) throw new ShapeError(op, `one sample (${per} bytes) exceeds a storage binding of ${gpu.maxBinding} bytes (N=${s.N}, Ci=${s.Ci}, ${s.H}x${s.W})`);
  return Math.min(n, s.N, gpu.facts.maxWorkgroupsPerDimension);
}

function wholeFits(gpu: Gpu, op: string, t: Tensor, name: string): void {
  if (windowBytesBound(gpu, t.numel, BYTES[t.dtype]) > gpu.maxBinding)
    throw new ShapeError(op, `${name} ${fmtShape(t.shape)} exceeds a storage binding of ${gpu.maxBinding} bytes`);
}

const CONV_UNIFORMS = [
  u32('GM'),
  u32('GN'),
  u32('GK'),
  u32('Ci'),
  u32('H'),
  u32('W'),
  u32('Co'),
  u32('Ho'),
  u32('Wo'),
  u32('pad'),
  u32('off_a'),
  u32('off_b'),
  u32('off_c'),
  u32('off_bias'),
  u32('stride_b'),
  u32('stride_c'),
  u32('k_splits'),
  u32('k_chunk'),
  u32('epilogue'),
] as const;

/** The layer sizes the implicit GEMM reads through sz_<name>() (shaders/conv2d.wgsl). */
const CONV_SIZES = ['GM', 'GN', 'GK', 'Ci', 'H', 'W', 'Co', 'Ho', 'Wo', 'pad'] as const;

/**
 * sz_<name>() for each of CONV_SIZES: with def CONST_SIZES the constant def SZ_<name> (the layer's sizes compiled
 * in, so the divisions by Wo, W and Ho*Wo in the loaders become multiply-shifts and the index math folds with the
 * tile's constants), else the uniform p.<name>.
 */
export function sizeAccessors(defs: Defs): string {
  const fixed = defs.CONST_SIZES === true;
  return CONV_SIZES.map((x) => {
    if (fixed && typeof defs[`SZ_${x}`] !== 'number') throw new Error(`conv2d: CONST_SIZES without def SZ_${x}`);
    return `fn sz_${x}() -> u32 { return ${fixed ? `SZ_${x}` : `p.${x}`}; }`;
  }).join('\n');
}

/** `code` of a conv entry point: the size accessors, then the generated core. */
function withSizes(core: (defs: Defs) => string): (defs: Defs) => string {
  return (defs) => `${sizeAccessors(defs)}\n${core(defs)}`;
}

/** The implicit-GEMM core (forward, grad input, grad weight by MODE; see shaders/conv2d.wgsl); with SPLIT_K it writes one reduction chunk's f32 partials to `part`. */
const CONV_GEMM = kernel({
  shader: 'conv2d',
  entry: 'conv_gemm',
  code: withSizes(simtGemmEntry('conv_gemm')),
  uniforms: CONV_UNIFORMS,
  bindings: [
    { name: 'src_a', type: 'T', access: 'read', when: '!W_INT8' },
    { name: 'src_b', type: 'T', access: 'read' },
    { name: 'wq', type: 'u32', access: 'read', when: 'W_INT8' },
    { name: 'ws', type: 'f32', access: 'read', when: 'W_INT8' },
    { name: 'out', type: 'TC', access: 'read_write', when: '!SPLIT_K' },
    { name: 'bias', type: 'T', access: 'read', when: '!SPLIT_K' },
    { name: 'part', type: 'f32', access: 'read_write', when: 'SPLIT_K' },
  ],
});

/** The same implicit GEMM on tensor cores (f16; src/ops/gemm.ts generates the entry point). */
const CONV_GEMM_TC = kernel({ ...CONV_GEMM, entry: 'conv_gemm_tc', code: withSizes(tensorCoreEntry('conv_gemm_tc')) });

/** out = the sum of the split-K partials (+ bias, + out), through the same epilogue. */
const CONV_SPLIT_REDUCE = kernel({
  shader: 'conv2d',
  entry: 'conv_split_reduce',
  code: withSizes(splitReduceEntry('conv_split_reduce')),
  uniforms: CONV_UNIFORMS,
  bindings: [
    { name: 'part', type: 'f32', access: 'read' },
    { name: 'out', type: 'TC', access: 'read_write' },
    { name: 'bias', type: 'T', access: 'read' },
  ],
});

/** db[co] = sum over samples and pixels of dy[n, co, pixel]. */
/** Invocations per workgroup of bias_grad (its SUM_WG def: the tree reduction's width). */
const BIAS_GRAD_WG = 64;
const BIAS_GRAD = kernel({
  shader: 'conv2d',
  entry: 'bias_grad',
  uniforms: [u32('samples'), u32('pixels'), u32('Co'), u32('off_dy'), u32('off_c')],
  bindings: [
    { name: 'dy', type: 'T', access: 'read' },
    { name: 'out', type: 'TC', access: 'read_write' },
  ],
});

/** Invocations per workgroup of im2col and col2im (their ROW_WG def), one output row each; rowWorkgroups sizes the grid by it. */
const ROW_WG = 64;
const LOWERING_UNIFORMS = [u32('rows'), u32('H'), u32('W'), u32('Ho'), u32('Wo'), u32('pad'), u32('off_in'), u32('off_out')] as const;

/** col [N, Ci*KH*KW, Ho*Wo] = im2col(x): one invocation per col row (n, ci, tap, oh). */
const IM2COL = kernel({ shader: 'conv2d', entry: 'im2col', uniforms: LOWERING_UNIFORMS, bindings: [read('x'), write('col')] });

/** dx (=, or += with ACCUMULATE) = col2im(dcol): one invocation per dx row (n, ci, ih), each element a sum over its taps. */
const COL2IM = kernel({ shader: 'conv2d', entry: 'col2im', uniforms: LOWERING_UNIFORMS, bindings: [read('dcol', 'f32'), write('dx', 'TC')] });

/** Runs one implicit-GEMM mode over sample groups that fit the storage bindings. */
function convGemm(
  gpu: Gpu,
  op: string,
  mode: Mode,
  s: ConvShape,
  srcA: Tensor,
  srcB: Tensor,
  out: Tensor,
  bias: Tensor | null,
  accumulate: boolean,
  forced: Pick<Conv2dOptions, 'tile' | 'splitK' | 'constSizes'>,
): void {
  const forcedTile = forced.tile;
  const KHW = s.KH * s.KW;
  const xSample = s.Ci * s.H * s.W;
  const ySample = s.Co * s.Ho * s.Wo;
  const [GM, GN] = mode === Mode.Forward ? [s.Co, s.Ho * s.Wo] : mode === Mode.GradInput ? [s.Ci, s.H * s.W] : [s.Co, s.Ci * KHW];
  // Per-sample element counts of the operands walked by sample: (src_a, src_b, out).
  const perA = mode === Mode.GradWeight ? ySample : 0;
  const perB = mode === Mode.GradInput ? ySample : xSample;
  const perC = mode === Mode.Forward ? ySample : mode === Mode.GradInput ? xSample : 0;
  if (mode !== Mode.GradWeight) wholeFits(gpu, op, srcA, 'weight');
  else wholeFits(gpu, op, out, 'grad weight');
  if (bias) wholeFits(gpu, op, bias, 'bias');
  const group = samplesPerBinding(gpu, op, s, [perA * BYTES[srcA.dtype], perB * BYTES[srcB.dtype], perC * BYTES[out.dtype]]);
  const batches = mode === Mode.GradWeight ? 1 : group;
  // Tensor cores for f16 where the device has them, unless a test forces a SIMT tile.
  // An int8 weight (modes 0 and 1; src/ops/int8.ts) is bound whole as its bytes and scales, on the SIMT core.
  const int8 = mode !== Mode.GradWeight && isInt8(srcA) ? srcA.windows() : null;
  if (int8 && int8.q.size > gpu.maxBinding) throw new ShapeError(op, `int8 weight ${srcA} exceeds one storage binding (${gpu.maxBinding} bytes)`);
  const tc = forcedTile || srcA.dtype !== 'f16' || int8 ? null : pickTcTile(gpu, GM, GN, batches);
  const tile = tc ? null : (forcedTile ?? pickTile(GM, GN, batches, gpu.fillWorkgroups, tilesFor(gpu)));
  if (tile && tileSharedBytes(tile) > gpu.facts.maxWorkgroupStorage) throw new ShapeError(op, `tile ${JSON.stringify(tile)} needs too much workgroup memory`);
  const [tileM, tileN] = tc ? [tc.BM, tc.BN] : [tile!.BM, tile!.BN];
  const constSizes = forced.constSizes ?? !gpu.facts.software;
  for (let n0 = 0; n0 < s.N; n0 += group) {
    const nb = Math.min(group, s.N - n0);
    const wa = mode === Mode.GradWeight ? elemWindow(gpu, srcA, n0 * perA, nb * perA) : elemWindow(gpu, srcA, 0, srcA.numel);
    const wb = elemWindow(gpu, srcB, n0 * perB, nb * perB);
    const wc = mode === Mode.GradWeight ? elemWindow(gpu, out, 0, out.numel) : elemWindow(gpu, out, n0 * perC, nb * perC);
    const wbias = bias ? elemWindow(gpu, bias, 0, bias.numel) : null;
    const GK = mode === Mode.Forward ? s.Ci * KHW : mode === Mode.GradInput ? s.Co * KHW : nb * s.Ho * s.Wo;
    const zs = mode === Mode.GradWeight ? 1 : nb;
    const tiles: [number, number] = [Math.ceil(GN / tileN), Math.ceil(GM / tileM)];
    const BK = tc ? TC_BK : tile!.BK;
    const split = chooseSplitK(gpu, tiles[0] * tiles[1] * zs, zs, GM, GN, GK, BK, forced.splitK);
    const defs = {
      T: srcA.dtype,
      TC: out.dtype,
      // the tile divides the GEMM: loads and stores skip their bounds checks
      FITS: GM % tileM === 0 && GN % tileN === 0 && GK % BK === 0,
      MODE: mode,
      KH: s.KH,
      KW: s.KW,
      STRIDE: s.stride,
      W_INT8: int8 !== null,
      CONST_SIZES: constSizes,
    };
    const uniforms = {
      GM,
      GN,
      GK,
      Ci: s.Ci,
      H: s.H,
      W: s.W,
      Co: s.Co,
      Ho: s.Ho,
      Wo: s.Wo,
      pad: s.pad,
      off_a: int8 ? 0 : wa.offset,
      off_b: wb.offset,
      off_c: wc.offset,
      off_bias: wbias?.offset ?? 0,
      stride_b: perB,
      stride_c: perC,
      k_splits: split.splits,
      k_chunk: split.chunk,
      // Grad weight sums over samples: later sample groups add onto the first.
      epilogue: epilogueFlags({ bias: bias !== null, accumulate: accumulate || (mode === Mode.GradWeight && n0 > 0) }),
    };
    const sizeDefs = constSizes ? Object.fromEntries(CONV_SIZES.map((x) => [`SZ_${x}`, uniforms[x]])) : {};
    const core = tc ? CONV_GEMM_TC : CONV_GEMM;
    const coreDefs = tc ? tcDefs(tc, gpu.tensorCores!) : simtTileDefs(tile!);
    // without a bias, src_b's first element stands in for the bias binding (the epilogue flags never read it)
    const biasBinding = { bias: (wbias ?? elemWindow(gpu, srcB, 0, 1)).window };
    const weight = int8 ? { wq: int8.q, ws: int8.scale } : { src_a: wa.window };
    if (split.splits === 1) {
      gpu.run(core, {
        defs: { ...defs, ...sizeDefs, ...coreDefs, SPLIT_K: false },
        uniforms,
        bindings: { ...weight, src_b: wb.window, out: wc.window, ...biasBinding },
        workgroups: [...tiles, zs],
      });
      continue;
    }
    // Split-K (src/ops/gemm.ts): each reduction chunk's f32 partials, then one pass summing them into out.
    const part = gpu.tensor([zs * split.splits, GM, GN], 'f32', 'scratch', `${op}.split-k`);
    const wp = elemWindow(gpu, part, 0, part.numel);
    gpu.run(core, {
      defs: { ...defs, ...sizeDefs, ...coreDefs, SPLIT_K: true },
      uniforms,
      bindings: { ...weight, src_b: wb.window, part: wp.window },
      workgroups: [...tiles, zs * split.splits],
    });
    gpu.run(CONV_SPLIT_REDUCE, {
      defs: { T: defs.T, TC: defs.TC, CONST_SIZES: constSizes, ...sizeDefs },
      uniforms,
      bindings: { part: wp.window, out: wc.window, ...biasBinding },
      workgroups: [Math.ceil(GN / SPLIT_REDUCE_WG), GM, zs],
    });
    gpu.free(part);
  }
}

/** y = conv2d(x, w) + bias, x [N, Ci, H, W], w [Co, Ci, KH, KW], bias [Co] or null. */
export function conv2d(gpu: Gpu, x: Tensor, w: Tensor, bias: Tensor | null, opts: Conv2dOptions): Tensor {
  const op = 'conv2d';
  const s = convShape(op, x.shape, w.shape, opts);
  expectSameDType(op, x, w, ...(bias ? [bias] : []));
  if (bias) expectShape(op, 'bias', bias, [s.Co]);
  const y = gpu.tensor([s.N, s.Co, s.Ho, s.Wo], x.dtype, 'activations', 'conv2d');
  // An int8 weight is read by the implicit GEMM's loader only (src/ops/int8.ts), 1x1 convolutions included.
  if (isPointwise(s) && !isInt8(w)) {
    // y[n] [Co, H*W] = w [Co, Ci] · x[n] [Ci, H*W] + bias[co]
    const hw = s.H * s.W;
    matmul(gpu, w.reshape([s.Co, s.Ci]), x.reshape([s.N, s.Ci, hw]), { ...gemmChoice(opts), rowBias: bias ?? undefined, out: y.reshape([s.N, s.Co, hw]) });
    return y;
  }
  if (lowering(gpu, s, x, w, opts) === 'im2col') {
    // y[n] [Co, Ho*Wo] = w [Co, Ci*KHW] · col[n] + bias[co]
    const col = im2col(gpu, s, x);
    matmul(gpu, w.reshape([s.Co, colRows(s)]), col, { rowBias: bias ?? undefined, out: y.reshape([s.N, s.Co, s.Ho * s.Wo]) });
    gpu.free(col);
    return y;
  }
  convGemm(gpu, op, Mode.Forward, s, w, x, y, bias, false, opts);
  return y;
}

export interface Conv2dGrads {
  dx: Tensor;
  dw: Tensor;
  db: Tensor;
}

/** Gradients of conv2d for upstream dy [N, Co, Ho, Wo] (same argument order as the forward). */
export function conv2dBackward(gpu: Gpu, x: Tensor, w: Tensor, dy: Tensor, opts: Conv2dBackwardOptions): Conv2dGrads {
  const op = 'conv2dBackward';
  const s = convShape(op, x.shape, w.shape, opts);
  expectSameDType(op, x, w, dy);
  expectShape(op, 'dy', dy, [s.N, s.Co, s.Ho, s.Wo]);
  const acc = opts.accumulate ?? false;
  const into = opts.into ?? {};
  if (acc && (!into.dx || !into.dw || !into.db)) throw new ShapeError(op, 'accumulate needs into.dx, into.dw and into.db');
  const grad = (name: 'dx' | 'dw' | 'db', shape: number[]): Tensor => {
    const t = into[name];
    if (!t) return gpu.tensor(shape, x.dtype, name === 'dx' ? 'activations' : 'gradients', `conv2d-${name}`);
    expectShape(op, name, t, shape);
    expectOutDType(op, x, t);
    return t;
  };
  const dx = grad('dx', x.shape as number[]);
  const dw = grad('dw', w.shape as number[]);
  const db = grad('db', [s.Co]);
  gradInput(gpu, op, s, x, w, dy, dx, acc, opts);
  // dw stays the implicit GEMM under either lowering: per-sample dy[n]·col[n]ᵀ summed over n measured 1.0-6x slower
  // on lavapipe (its f32 [N, Co, Ci*KHW] parts outweigh the GEMM at 8x8 and smaller).
  convGemm(gpu, op, Mode.GradWeight, s, dy, x, dw, null, acc, opts);
  biasGrad(gpu, op, s, dy, db, acc);
  return { dx, dw, db };
}

/**
 * dw (and db with `bias`) of conv2dBackward without dx: an input that needs no gradient (requires_grad
 * pruning). The same kernels as conv2dBackward's dw and db, so bit-identical to them.
 */
export function conv2dBackwardWeight(gpu: Gpu, x: Tensor, w: Tensor, dy: Tensor, opts: Conv2dOptions & { bias: boolean }): { dw: Tensor; db: Tensor | null } {
  const op = 'conv2dBackwardWeight';
  const s = convShape(op, x.shape, w.shape, opts);
  expectSameDType(op, x, w, dy);
  expectShape(op, 'dy', dy, [s.N, s.Co, s.Ho, s.Wo]);
  const dw = gpu.tensor(w.shape, x.dtype, 'gradients', 'conv2d-dw');
  convGemm(gpu, op, Mode.GradWeight, s, dy, x, dw, null, false, opts);
  const db = opts.bias ? gpu.tensor([s.Co], x.dtype, 'gradients', 'conv2d-db') : null;
  if (db) biasGrad(gpu, op, s, dy, db, false);
  return { dw, db };
}

/**
 * Only dx of conv2dBackward (a frozen weight: no grad-weight or bias kernels); with `into`, written there or, with
 * `accumulate`, added into it (every path rounds dx to the output type first: the bits of dx and an add).
 */
export function conv2dBackwardInput(gpu: Gpu, x: Tensor, w: Tensor, dy: Tensor, opts: Conv2dOptions, into?: { dx: Tensor; accumulate: boolean }): Tensor {
  const op = 'conv2dBackwardInput';
  const s = convShape(op, x.shape, w.shape, opts);
  expectSameDType(op, x, w, dy);
  expectShape(op, 'dy', dy, [s.N, s.Co, s.Ho, s.Wo]);
  if (into) {
    expectShape(op, 'dx', into.dx, x.shape as number[]);
    expectOutDType(op, x, into.dx);
  }
  const dx = into?.dx ?? gpu.tensor(x.shape, x.dtype, 'activations', 'conv2d-dx');
  gradInput(gpu, op, s, x, w, dy, dx, into?.accumulate ?? false, opts);
  return dx;
}

/** A 1x1 convolution with stride 1 and no padding: a plain GEMM per sample over its pixels (no im2col gathers). */
function isPointwise(s: ConvShape): boolean {
  return s.KH === 1 && s.KW === 1 && s.stride === 1 && s.pad === 0;
}

/** The tile and split-K a test or benchmark forced, for the GEMMs a convolution runs. */
function gemmChoice(opts: Conv2dOptions): { tile?: Tile; splitK?: number } {
  return { tile: opts.tile, splitK: opts.splitK };
}

/** dx (written, or added into with `accumulate`): the implicit GEMM; dcol = wᵀ · dy[n] then col2im; or for a pointwise conv dx[n] = wᵀ · dy[n]. */
function gradInput(gpu: Gpu, op: string, s: ConvShape, x: Tensor, w: Tensor, dy: Tensor, dx: Tensor, accumulate: boolean, opts: Conv2dOptions): void {
  const hw = s.Ho * s.Wo;
  if (isPointwise(s) && !isInt8(w)) {
    matmul(gpu, w.reshape([s.Co, s.Ci]), dy.reshape([s.N, s.Co, hw]), { ...gemmChoice(opts), transA: true, out: dx.reshape([s.N, s.Ci, hw]), accumulate });
    return;
  }
  if (lowering(gpu, s, x, w, opts) !== 'im2col') return convGemm(gpu, op, Mode.GradInput, s, w, dy, dx, null, accumulate, opts);
  // dcol in f32, so each dx element is one f32 sum over its taps, rounded once (as the implicit GEMM's).
  const dcol = gpu.tensor([s.N, colRows(s), hw], 'f32', 'scratch', 'conv2d.dcol');
  matmul(gpu, w.reshape([s.Co, colRows(s)]), dy.reshape([s.N, s.Co, hw]), { transA: true, out: dcol });
  const [win, wout] = [elemWindow(gpu, dcol, 0, dcol.numel), elemWindow(gpu, dx, 0, dx.numel)];
  gpu.run(COL2IM, {
    defs: { T: dx.dtype, TC: dx.dtype, KH: s.KH, KW: s.KW, STRIDE: s.stride, ACCUMULATE: accumulate, ROW_WG },
    uniforms: loweringUniforms(s, s.N * s.Ci * s.H, win.offset, wout.offset),
    bindings: { dcol: win.window, dx: wout.window },
    workgroups: rowWorkgroups(gpu, s.N * s.Ci * s.H),
  });
  gpu.free(dcol);
}

/** Rows of the im2col matrix per sample: Ci * KH * KW. */
function colRows(s: ConvShape): number {
  return s.Ci * s.KH * s.KW;
}

/**
 * The lowering a convolution's forward and grad input run (Conv2dOptions.lowering): given, else im2col on a CPU
 * adapter whose matmuls run the direct core, unless a test forces the implicit GEMM's tile, split-K or sizes, or a
 * tensor of the lowered path (x, col, y, the f32 dcol) exceeds one storage binding (the implicit GEMM walks sample
 * chunks).
 */
function lowering(gpu: Gpu, s: ConvShape, x: Tensor, w: Tensor, opts: Conv2dOptions): Lowering {
  if (isInt8(w)) return 'implicit';
  if (opts.lowering) return opts.lowering;
  if (!gpu.facts.software || !gpu.gemmConfig.direct) return 'implicit';
  if (opts.tile || opts.splitK !== undefined || opts.constSizes !== undefined) return 'implicit';
  const colBytes = s.N * colRows(s) * s.Ho * s.Wo * Math.max(BYTES[x.dtype], 4);
  const biggest = Math.max(colBytes, x.byteSize, s.N * s.Co * s.Ho * s.Wo * 4);
  return windowBytesBound(gpu, biggest, 1) <= gpu.maxBinding ? 'im2col' : 'implicit';
}

/** col [N, Ci*KH*KW, Ho*Wo] of x (x's dtype), every element written (0 in the padding). */
function im2col(gpu: Gpu, s: ConvShape, x: Tensor): Tensor {
  const col = gpu.tensor([s.N, colRows(s), s.Ho * s.Wo], x.dtype, 'scratch', 'conv2d.im2col');
  const rows = s.N * colRows(s) * s.Ho;
  const [win, wout] = [elemWindow(gpu, x, 0, x.numel), elemWindow(gpu, col, 0, col.numel)];
  gpu.run(IM2COL, {
    defs: { T: x.dtype, KH: s.KH, KW: s.KW, STRIDE: s.stride, ROW_WG },
    uniforms: loweringUniforms(s, rows, win.offset, wout.offset),
    bindings: { x: win.window, col: wout.window },
    workgroups: rowWorkgroups(gpu, rows),
  });
  return col;
}

/** Element offsets of the bound windows: off_in (x or dcol), off_out (col or dx). */
function loweringUniforms(s: ConvShape, rows: number, off_in: number, off_out: number) {
  return { rows, H: s.H, W: s.W, Ho: s.Ho, Wo: s.Wo, pad: s.pad, off_in, off_out };
}

/** Workgroups of 64 invocations, one per row, laid out in x then y (the shader's row_index). */
function rowWorkgroups(gpu: Gpu, rows: number): [number, number, number] {
  const groups = Math.ceil(rows / ROW_WG);
  const x = Math.min(groups, gpu.facts.maxWorkgroupsPerDimension);
  return [x, Math.ceil(groups / x), 1];
}

/** db[co] = Σ_{n, pixels} dy[n, co, ·], one workgroup per channel, sample groups per binding. */
function biasGrad(gpu: Gpu, op: string, s: ConvShape, dy: Tensor, db: Tensor, accumulate: boolean): void {
  const hw = s.Ho * s.Wo;
  const per = s.Co * hw;
  const group = samplesPerBinding(gpu, op, s, [per * BYTES[dy.dtype]]);
  const wc = elemWindow(gpu, db, 0, s.Co);
  for (let n0 = 0; n0 < s.N; n0 += group) {
    const nb = Math.min(group, s.N - n0);
    const wa = elemWindow(gpu, dy, n0 * per, nb * per);
    gpu.run(BIAS_GRAD, {
      defs: { T: dy.dtype, TC: db.dtype, ACCUMULATE: accumulate || n0 > 0, SUM_WG: BIAS_GRAD_WG },
      uniforms: { samples: nb, pixels: hw, Co: s.Co, off_dy: wa.offset, off_c: wc.offset },
      bindings: { dy: wa.window, out: wc.window },
      workgroups: [s.Co],
    });
  }
}

// ---- plain-TS references (float64 accumulation) ---------------------------------------------

function xIndex(s: ConvShape, n: number, ci: number, ih: number, iw: number): number {
  return ((n * s.Ci + ci) * s.H + ih) * s.W + iw;
}

/** Visits every (n, co, oh, ow, ci, kh, kw) whose input tap lies inside x. */
function forEachTap(s: ConvShape, f: (yi: number, wi: number, xi: number) => void): void {
  for (let n = 0; n < s.N; n++)
    for (let co = 0; co < s.Co; co++)
      for (let oh = 0; oh < s.Ho; oh++)
        for (let ow = 0; ow < s.Wo; ow++) {
          const yi = ((n * s.Co + co) * s.Ho + oh) * s.Wo + ow;
          for (let ci = 0; ci < s.Ci; ci++)
            for (let kh = 0; kh < s.KH; kh++) {
              const ih = oh * s.stride - s.pad + kh;
              if (ih < 0 || ih >= s.H) continue;
              for (let kw = 0; kw < s.KW; kw++) {
                const iw = ow * s.stride - s.pad + kw;
                if (iw < 0 || iw >= s.W) continue;
                f(yi, ((co * s.Ci + ci) * s.KH + kh) * s.KW + kw, xIndex(s, n, ci, ih, iw));
              }
            }
        }
}

export function conv2dRef(
  x: ArrayLike<number>,
  xShape: readonly number[],
  w: ArrayLike<number>,
  wShape: readonly number[],
  bias: ArrayLike<number> | null,
  opts: Conv2dOptions,
): Float32Array {
  const s = convShape('conv2dRef', xShape, wShape, opts);
  const y = new Float64Array(s.N * s.Co * s.Ho * s.Wo);
  if (bias) for (let i = 0; i < y.length; i++) y[i] = bias[Math.floor(i / (s.Ho * s.Wo)) % s.Co];
  forEachTap(s, (yi, wi, xi) => (y[yi] += w[wi] * x[xi]));
  return Float32Array.from(y);
}

export function conv2dBackwardRef(
  x: ArrayLike<number>,
  xShape: readonly number[],
  w: ArrayLike<number>,
  wShape: readonly number[],
  dy: ArrayLike<number>,
  opts: Conv2dOptions,
): { dx: Float32Array; dw: Float32Array; db: Float32Array } {
  const s = convShape('conv2dBackwardRef', xShape, wShape, opts);
  const dx = new Float64Array(x.length);
  const dw = new Float64Array(w.length);
  const db = new Float64Array(s.Co);
  for (let i = 0; i < dy.length; i++) db[Math.floor(i / (s.Ho * s.Wo)) % s.Co] += dy[i];
  forEachTap(s, (yi, wi, xi) => {
    dx[xi] += w[wi] * dy[yi];
    dw[wi] += x[xi] * dy[yi];
  });
  return { dx: Float32Array.from(dx), dw: Float32Array.from(dw), db: Float32Array.from(db) };
}
