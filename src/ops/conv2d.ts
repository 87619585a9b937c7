// 2-D convolution, NCHW with PyTorch semantics, as implicit GEMM (shaders/conv2d.wgsl): forward,
// grad input, grad weight and grad bias, each with a plain-TS reference (float64 accumulation).
//
//   y[n, co, oh, ow] = b[co] + Σ_{ci, kh, kw} w[co, ci, kh, kw] · x[n, ci, oh*S - P + kh, ow*S - P + kw]
//   dx[n, ci, ih, iw] = Σ_{co, kh, kw : ih = oh*S - P + kh, iw = ow*S - P + kw} w[co, ci, kh, kw] · dy[n, co, oh, ow]
//   dw[co, ci, kh, kw] = Σ_{n, oh, ow} dy[n, co, oh, ow] · x[n, ci, oh*S - P + kh, ow*S - P + kw]
//   db[co] = Σ_{n, oh, ow} dy[n, co, oh, ow]
import type { BufferWindow, Gpu } from '../gpu/device.ts';
import { fmtShape, ShapeError } from '../gpu/errors.ts';
import { kernel } from '../gpu/kernel.ts';
import type { Defs } from '../gpu/shaders.ts';
import { BYTES, expectSameDType, expectShape, type Tensor } from '../gpu/tensor.ts';
import { matmul } from './matmul.ts';

export interface Conv2dOptions {
  stride: number;
  padding: number;
  /**
   * Force a workgroup tile of the implicit-GEMM kernel (tests, benchmarks); this also keeps 1x1 convolutions
   * on that kernel instead of matmul(). By default picked per problem (`pickConvTile`).
   */
  tile?: ConvTile;
}

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

// ---- tiles ----------------------------------------------------------------------------------------

/**
 * Workgroup tile of the implicit GEMM: BM x BN outputs per workgroup, TM x TN per invocation (multiples of
 * 4), BK-deep reduction steps. BK is optional: 32 where the two f32 shared tiles fit the device's workgroup
 * memory, else 16.
 */
export interface ConvTile {
  BM: number;
  BN: number;
  TM: number;
  TN: number;
  BK?: number;
}

/** Square and rectangular tiles with 8x8 register blocks (256 / 128 / 64 invocations). */
export const CONV_TILE_128: ConvTile = { BM: 128, BN: 128, TM: 8, TN: 8 };
export const CONV_TILE_128x64: ConvTile = { BM: 128, BN: 64, TM: 8, TN: 8 };
export const CONV_TILE_64x128: ConvTile = { BM: 64, BN: 128, TM: 8, TN: 8 };
export const CONV_TILE_64: ConvTile = { BM: 64, BN: 64, TM: 8, TN: 8 };
/** 4x4 blocks, 256 invocations: small problems. */
export const CONV_TILE_64_4x4: ConvTile = { BM: 64, BN: 64, TM: 4, TN: 4 };
/**
 * Skinny tiles for a GEMM side of at most 4 or 16: 4 / 16 output channels (SD's 4-channel latent convs),
 * or 4 / 16 pixels (the deepest blocks at low resolution). A 64x64 tile over M = 4 would do 16x the work.
 * The 4-wide ones step BK 16: with 32 invocations each stages 16 vec4 groups of the long side per step at
 * BK 16 (32 at BK 32 doubles the generated code, and lavapipe's compile time, for no gain on a memory-bound
 * shape).
 */
export const CONV_TILE_ROWS_4: ConvTile = { BM: 4, BN: 128, TM: 4, TN: 4, BK: 16 };
export const CONV_TILE_ROWS_16: ConvTile = { BM: 16, BN: 64, TM: 4, TN: 4 };
export const CONV_TILE_COLS_4: ConvTile = { BM: 128, BN: 4, TM: 4, TN: 4, BK: 16 };
export const CONV_TILE_COLS_16: ConvTile = { BM: 64, BN: 16, TM: 4, TN: 4 };

const SQUARE_TILES = [CONV_TILE_128, CONV_TILE_128x64, CONV_TILE_64x128, CONV_TILE_64];

/**
 * The tile for an M x N GEMM over `batch` independent problems: skinny when a side is that small; else the
 * largest of the square / rectangular 8x8-block tiles that pads M and N by at most 1/8 and still gives the
 * device `fillWorkgroups` workgroups (SD's 320 channels take 64-row tiles: 128 would pad them to 384);
 * 4x4 blocks when even 64x64 tiles leave the device idle.
 */
export function pickConvTile(M: number, N: number, batch: number, fillWorkgroups: number): ConvTile {
  if (M <= 4 && N > M) return CONV_TILE_ROWS_4;
  if (N <= 4) return CONV_TILE_COLS_4;
  if (M <= 16 && N > M) return CONV_TILE_ROWS_16;
  if (N <= 16) return CONV_TILE_COLS_16;
  const pad = (t: ConvTile) => (Math.ceil(M / t.BM) * t.BM * Math.ceil(N / t.BN) * t.BN) / (M * N);
  const groups = (t: ConvTile) => Math.ceil(M / t.BM) * Math.ceil(N / t.BN) * batch;
  const fits = SQUARE_TILES.filter((t) => groups(t) >= fillWorkgroups);
  const lean = fits.find((t) => pad(t) <= 1.125);
  if (lean) return lean;
  if (fits.length) return fits.reduce((a, b) => (pad(b) < pad(a) ? b : a));
  return groups(CONV_TILE_64_4x4) > groups(CONV_TILE_64) ? CONV_TILE_64_4x4 : CONV_TILE_64;
}

/** The tile with its BK: 32 when both shared tiles fit the workgroup memory, else 16. */
function resolveTile(gpu: Gpu, op: string, t: ConvTile): Required<ConvTile> {
  const shared = (bk: number) => 4 * (t.BM + t.BN) * bk;
  const limit = gpu.device.limits.maxComputeWorkgroupStorageSize;
  const BK = t.BK ?? (shared(32) <= limit ? 32 : 16);
  const groupsOk = (b: number) => b / 4 === 1 || (b / 4) % Math.min(8, b / 4) === 0; // the XOR swizzle stays inside a row
  const ok =
    t.TM % 4 === 0 &&
    t.TN % 4 === 0 &&
    t.BM % t.TM === 0 &&
    t.BN % t.TN === 0 &&
    groupsOk(t.BM) &&
    groupsOk(t.BN) &&
    (BK === 16 || BK === 32) &&
    (t.BM / t.TM) * (t.BN / t.TN) <= gpu.device.limits.maxComputeInvocationsPerWorkgroup &&
    shared(BK) <= limit;
  if (!ok) throw new ShapeError(op, `invalid conv tile ${JSON.stringify(t)} (BK ${BK}, ${limit} bytes of workgroup memory)`);
  return { ...t, BK };
}

// ---- the generated GEMM core ----------------------------------------------------------------------

/**
 * WGSL of `conv_gemm` for one tile shape (defs BM, BN, BK, TM, TN, FIT_M, FIT_K, PREFETCH): the invocation's
 * TM x TN accumulators, its A/B fragments and its staging registers are separate variables with constant
 * names (a loop over an array indexed by loop counters is kept in memory and gathered by software adapters).
 *
 * Shared tiles are f32 vec4 groups, [BK][BM/4] and [BK][BN/4]. A is always staged k-fastest (w and dy rows
 * are contiguous in k); B k-fastest only for the weight gradient (`bKFast`), else pixel-fastest. A k-fastest
 * store would put consecutive invocations BM/4 groups apart, on one bank: the group index is XORed with
 * k mod 8 (the swizzle), on the store and on the read, so 8 consecutive k hit 8 different banks.
 *
 * Invocation (tx, ty) owns rows 4 * (i * WG_Y + ty) + r and columns 4 * (j * WG_X + tx) + q: its vec4 reads
 * of a k row are consecutive across invocations. With PREFETCH the next K tile is loaded into registers
 * while this one is multiplied out of shared memory.
 */
function gemmCode(d: Defs, bKFast: boolean): string {
  const n = (k: string) => d[k] as number;
  const [BM, BN, BK, TM, TN] = [n('BM'), n('BN'), n('BK'), n('TM'), n('TN')];
  const [fitM, fitN, fitK, prefetch] = [d.FIT_M, d.FIT_N, d.FIT_K, d.PREFETCH] as boolean[];
  const WG_X = BN / TN;
  const WG_Y = BM / TM;
  const WG = WG_X * WG_Y;
  const [VM, VN, BM4, BN4] = [TM / 4, TN / 4, BM / 4, BN / 4];
  const aGroups = BM4 * BK;
  const bGroups = BN4 * BK;
  const qa = Math.ceil(aGroups / WG);
  const qb = Math.ceil(bGroups / WG);
  const swA = Math.min(8, BM4) - 1;
  const swB = bKFast ? Math.min(8, BN4) - 1 : 0;
  const range = (k: number) => Array.from({ length: k }, (_, i) => i);
  const L: string[] = [];
  const e = (s: string) => L.push(s);
  e(`const WG_X = ${WG_X}u;`);
  e(`const WG_Y = ${WG_Y}u;`);
  e(`var<workgroup> tile_a: array<vec4<f32>, ${aGroups}>;`);
  e(`var<workgroup> tile_b: array<vec4<f32>, ${bGroups}>;`);
  e(`fn conv_gemm(tid: u32, tx: u32, ty: u32, row0: u32, col0: u32, z: u32, k_begin: u32, k_end: u32) {`);
  // Staging slots: fixed for the whole K loop, so rows and columns are decomposed once.
  const aGuard = (q: number) => (q * WG + WG > aGroups ? `tid + ${q * WG}u < ${aGroups}u` : '');
  const bGuard = (q: number) => (q * WG + WG > bGroups ? `tid + ${q * WG}u < ${bGroups}u` : '');
  const clampM = (s: string) => (fitM ? s : `min(${s}, GM - 1u)`);
  const clampN = (s: string) => (fitN ? s : `min(${s}, GN - 1u)`);
  for (const q of range(qa)) {
    const g = `min(tid + ${q * WG}u, ${aGroups - 1}u)`;
    e(`  let ga${q} = ${g};`);
    e(`  let ak${q} = ga${q} % ${BK}u;`);
    e(`  let am${q} = ga${q} / ${BK}u;`);
    e(`  let as${q} = ak${q} * ${BM4}u + (am${q} ^ (ak${q} & ${swA}u));`);
    for (const l of range(4)) e(`  let ar${q}_${l} = a_row(${clampM(`row0 + am${q} * 4u + ${l}u`)});`);
    e(`  var pa${q}: vec4<f32>;`);
  }
  for (const q of range(qb)) {
    const g = `min(tid + ${q * WG}u, ${bGroups - 1}u)`;
    e(`  let gb${q} = ${g};`);
    if (bKFast) e(`  let bk${q} = gb${q} % ${BK}u;\n  let bn${q} = gb${q} / ${BK}u;`);
    else e(`  let bk${q} = gb${q} / ${BN4}u;\n  let bn${q} = gb${q} % ${BN4}u;`);
    e(`  let bs${q} = bk${q} * ${BN4}u + (bn${q} ^ (bk${q} & ${swB}u));`);
    for (const l of range(4)) e(`  let bc${q}_${l} = b_col(${clampN(`col0 + bn${q} * 4u + ${l}u`)});`);
    e(`  var pb${q}: vec4<f32>;`);
  }
  for (const i of range(TM)) for (const j of range(VN)) e(`  var c${i}_${j} = vec4<f32>(0.0);`);
  // fetch: the K tile starting at k0 into the staging registers (zero past k_end).
  const fetch = (k0: string, ind: string) => {
    for (const q of range(qa)) {
      const guard = aGuard(q);
      const body = [
        `let k = ${k0} + ak${q};`,
        `${fitK ? '' : 'if (k < k_end) { '}pa${q} = vec4<f32>(${range(4)
          .map((l) => `a_load(ar${q}_${l}, k)`)
          .join(', ')});${fitK ? '' : ' } else { pa' + q + ' = vec4<f32>(0.0); }'}`,
      ];
      e(`${ind}${guard ? `if (${guard}) ` : ''}{ ${body.join(' ')} }`);
    }
    for (const q of range(qb)) {
      const guard = bGuard(q);
      const body = [
        `let k = ${k0} + bk${q};`,
        `${fitK ? '' : 'if (k < k_end) { '}pb${q} = vec4<f32>(${range(4)
          .map((l) => `b_load(bc${q}_${l}, k, z)`)
          .join(', ')});${fitK ? '' : ' } else { pb' + q + ' = vec4<f32>(0.0); }'}`,
      ];
      e(`${ind}${guard ? `if (${guard}) ` : ''}{ ${body.join(' ')} }`);
    }
  };
  const stash = (ind: string) => {
    for (const q of range(qa)) e(`${ind}${aGuard(q) ? `if (${aGuard(q)}) ` : ''}{ tile_a[as${q}] = pa${q}; }`);
    for (const q of range(qb)) e(`${ind}${bGuard(q) ? `if (${bGuard(q)}) ` : ''}{ tile_b[bs${q}] = pb${q}; }`);
  };
  if (prefetch) fetch('k_begin', '  ');
  e(`  for (var k0 = k_begin; k0 < k_end; k0 += ${BK}u) {`);
  if (!prefetch) fetch('k0', '    ');
  stash('    ');
  e(`    workgroupBarrier();`);
  if (prefetch) {
    e(`    if (k0 + ${BK}u < k_end) {`);
    fetch(`k0 + ${BK}u`, '      ');
    e(`    }`);
  }
  e(`    for (var k = 0u; k < ${BK}u; k++) {`);
  e(`      let sa = k & ${swA}u;`);
  e(`      let sb = k & ${swB}u;`);
  for (const i of range(VM)) e(`      let a${i} = tile_a[k * ${BM4}u + ((${i * WG_Y}u + ty) ^ sa)];`);
  for (const j of range(VN)) e(`      let b${j} = tile_b[k * ${BN4}u + ((${j * WG_X}u + tx) ^ sb)];`);
  const comp = ['x', 'y', 'z', 'w'];
  for (const i of range(VM))
    for (const r of range(4))
      for (const j of range(VN)) {
        const c = `c${i * 4 + r}_${j}`;
        e(`      ${c} = fma(vec4<f32>(a${i}.${comp[r]}), b${j}, ${c});`);
      }
  e(`    }`);
  e(`    workgroupBarrier();`);
  e(`  }`);
  // Epilogue: rows past GM are skipped (their A rows were clamped copies); store_c checks columns.
  for (const i of range(VM))
    for (const r of range(4)) {
      const m = `row0 + ${i * WG_Y * 4 + r}u + ty * 4u`;
      e(`  {`);
      e(`    let m = ${m};`);
      const stores = range(VN)
        .map((j) => `store_c(m, col0 + ${j * WG_X * 4}u + tx * 4u, c${i * 4 + r}_${j}, z);`)
        .join(' ');
      e(`    ${fitM ? '' : 'if (m < GM) '}{ ${stores} }`);
      e(`  }`);
    }
  e(`}`);
  return L.join('\n');
}

// ---- kernels ------------------------------------------------------------------------------------

const CONV_FWD = kernel({
  shader: 'conv2d',
  entry: 'conv_fwd',
  uniforms: [
    { name: 'off_w', type: 'u32' },
    { name: 'off_x', type: 'u32' },
    { name: 'off_y', type: 'u32' },
    { name: 'off_bias', type: 'u32' },
  ],
  bindings: [
    { name: 'w', type: 'T', access: 'read' },
    { name: 'x', type: 'T', access: 'read' },
    { name: 'bias', type: 'T', access: 'read', when: 'HAS_BIAS' },
    { name: 'y', type: 'TC', access: 'read_write' },
  ],
  code: (d) => gemmCode(d, false),
});

const CONV_DX = kernel({
  shader: 'conv2d',
  entry: 'conv_dx',
  uniforms: [
    { name: 'off_w', type: 'u32' },
    { name: 'off_dy', type: 'u32' },
    { name: 'off_dx', type: 'u32' },
  ],
  bindings: [
    { name: 'w', type: 'T', access: 'read' },
    { name: 'dy', type: 'T', access: 'read' },
    { name: 'dx', type: 'TC', access: 'read_write' },
  ],
  code: (d) => gemmCode(d, false),
});

const CONV_DW = kernel({
  shader: 'conv2d',
  entry: 'conv_dw',
  uniforms: [
    { name: 'off_dy', type: 'u32' },
    { name: 'off_x', type: 'u32' },
    { name: 'off_dw', type: 'u32' },
    { name: 'k_len', type: 'u32' },
    { name: 'k_split', type: 'u32' },
  ],
  bindings: [
    { name: 'dy', type: 'T', access: 'read' },
    { name: 'x', type: 'T', access: 'read' },
    { name: 'dw', type: 'TC', access: 'read_write' },
  ],
  code: (d) => gemmCode(d, true),
});

const DW_REDUCE = kernel({
  shader: 'conv2d',
  entry: 'dw_reduce',
  uniforms: [
    { name: 'len', type: 'u32' },
    { name: 'splits', type: 'u32' },
    { name: 'off_out', type: 'u32' },
  ],
  bindings: [
    { name: 'partial', type: 'f32', access: 'read' },
    { name: 'out', type: 'TC', access: 'read_write' },
  ],
});

const BIAS_GRAD = kernel({
  shader: 'conv2d',
  entry: 'bias_grad',
  uniforms: [
    { name: 'off_dy', type: 'u32' },
    { name: 'off_db', type: 'u32' },
    { name: 'n_samples', type: 'u32' },
    { name: 'channels', type: 'u32' },
    { name: 'plane', type: 'u32' },
  ],
  bindings: [
    { name: 'dy', type: 'T', access: 'read' },
    { name: 'db', type: 'TC', access: 'read_write' },
  ],
});

const BIAS_FILL = kernel({
  shader: 'conv2d',
  entry: 'bias_fill',
  uniforms: [
    { name: 'off_y', type: 'u32' },
    { name: 'off_bias', type: 'u32' },
    { name: 'count', type: 'u32' },
  ],
  bindings: [
    { name: 'bias', type: 'T', access: 'read' },
    { name: 'y', type: 'T', access: 'read_write' },
  ],
});

// ---- windows: element ranges bound at an aligned offset ---------------------------------------------

interface ElemWindow {
  window: BufferWindow;
  /** Element index, inside the window, of the range's first element. */
  offset: number;
}

/** Binds elements [first, first + count) of `t` from the aligned offset at or below them. */
function elemWindow(gpu: Gpu, t: Tensor, first: number, count: number): ElemWindow {
  const bytes = BYTES[t.dtype];
  const align = gpu.device.limits.minStorageBufferOffsetAlignment;
  const start = t.byteOffset + first * bytes;
  const base = Math.floor(start / align) * align;
  const end = Math.min(Math.ceil((start + Math.max(count, 1) * bytes) / 4) * 4, t.buffer.size);
  return { window: { buffer: t.buffer, offset: base, size: end - base }, offset: (start - base) / bytes };
}

/** Bytes of the largest window `count` elements can need (alignment slack included). */
function windowBytesBound(gpu: Gpu, count: number, bytes: number): number {
  return count * bytes + gpu.device.limits.minStorageBufferOffsetAlignment + 4;
}

/** How many whole samples of these per-sample sizes (bytes) fit one binding; throws when none. */
function samplesPerBinding(gpu: Gpu, op: string, s: ConvShape, perSampleBytes: number[]): number {
  const per = Math.max(...perSampleBytes);
  const n = Math.floor((gpu.maxBinding - windowBytesBound(gpu, 0, 1)) / per);
  if (n < 1) throw new ShapeError(op, `one sample (${per} bytes) exceeds a storage binding of ${gpu.maxBinding} bytes (N=${s.N}, Ci=${s.Ci}, ${s.H}x${s.W})`);
  return Math.min(n, s.N, gpu.device.limits.maxComputeWorkgroupsPerDimension);
}

function wholeFits(gpu: Gpu, op: string, t: Tensor, name: string): void {
  if (windowBytesBound(gpu, t.numel, BYTES[t.dtype]) > gpu.maxBinding)
    throw new ShapeError(op, `${name} ${fmtShape(t.shape)} exceeds a storage binding of ${gpu.maxBinding} bytes`);
}

// ---- the drivers ----------------------------------------------------------------------------------

/** The layer's sizes as pipeline constants, with the tile and whether the tile divides the GEMM. */
function gemmDefs(s: ConvShape, tile: Required<ConvTile>, M: number, N: number, fitK: boolean): Defs {
  const WG = (tile.BM / tile.TM) * (tile.BN / tile.TN);
  const stagingFloats = (Math.ceil((tile.BM * tile.BK) / 4 / WG) + Math.ceil((tile.BN * tile.BK) / 4 / WG)) * 4;
  return {
    CI: s.Ci,
    H: s.H,
    W: s.W,
    CO: s.Co,
    KH: s.KH,
    KW: s.KW,
    STRIDE: s.stride,
    PAD: s.pad,
    HO: s.Ho,
    WO: s.Wo,
    ...tile,
    FIT_M: M % tile.BM === 0,
    FIT_N: N % tile.BN === 0,
    FIT_K: fitK,
    // Prefetching the next K tile holds its staging values in registers through the multiply: worth it
    // while they are few (the skinny tiles stage up to 64 values per invocation).
    PREFETCH: stagingFloats <= 32,
  };
}

/** Sample ranges [n0, n0 + nb) whose operand windows fit one storage binding each. */
function sampleGroups(gpu: Gpu, op: string, s: ConvShape, perSampleBytes: number[]): { n0: number; nb: number }[] {
  const group = samplesPerBinding(gpu, op, s, perSampleBytes);
  const out: { n0: number; nb: number }[] = [];
  for (let n0 = 0; n0 < s.N; n0 += group) out.push({ n0, nb: Math.min(group, s.N - n0) });
  return out;
}

/** y = conv(x, w) (+ bias) through conv_fwd, in sample groups that fit the storage bindings. */
function convForward(gpu: Gpu, op: string, s: ConvShape, x: Tensor, w: Tensor, bias: Tensor | null, y: Tensor, forced?: ConvTile): void {
  const xSample = s.Ci * s.H * s.W;
  const ySample = s.Co * s.Ho * s.Wo;
  wholeFits(gpu, op, w, 'weight');
  if (bias) wholeFits(gpu, op, bias, 'bias');
  const groups = sampleGroups(gpu, op, s, [xSample * BYTES[x.dtype], ySample * BYTES[y.dtype]]);
  const [M, N, K] = [s.Co, s.Ho * s.Wo, s.Ci * s.KH * s.KW];
  const tile = resolveTile(gpu, op, forced ?? pickConvTile(M, N, groups[0].nb, gpu.fillWorkgroups));
  const ww = elemWindow(gpu, w, 0, w.numel);
  const wb = bias ? elemWindow(gpu, bias, 0, bias.numel) : null;
  for (const { n0, nb } of groups) {
    const wx = elemWindow(gpu, x, n0 * xSample, nb * xSample);
    const wy = elemWindow(gpu, y, n0 * ySample, nb * ySample);
    gpu.run(CONV_FWD, {
      defs: { T: x.dtype, TC: y.dtype, ...gemmDefs(s, tile, M, N, K % tile.BK === 0), HAS_BIAS: wb !== null, ACCUMULATE: false },
      uniforms: { off_w: ww.offset, off_x: wx.offset, off_y: wy.offset, off_bias: wb?.offset ?? 0 },
      bindings: { w: ww.window, x: wx.window, y: wy.window, ...(wb ? { bias: wb.window } : {}) },
      workgroups: [Math.ceil(N / tile.BN), Math.ceil(M / tile.BM), nb],
    });
  }
}

/** dx (+)= conv_transpose(dy, w) through conv_dx, in sample groups. */
function convGradInput(gpu: Gpu, op: string, s: ConvShape, w: Tensor, dy: Tensor, dx: Tensor, accumulate: boolean, forced?: ConvTile): void {
  const xSample = s.Ci * s.H * s.W;
  const ySample = s.Co * s.Ho * s.Wo;
  wholeFits(gpu, op, w, 'weight');
  const groups = sampleGroups(gpu, op, s, [ySample * BYTES[dy.dtype], xSample * BYTES[dx.dtype]]);
  const [M, N, K] = [s.Ci, s.H * s.W, s.Co * s.KH * s.KW];
  const tile = resolveTile(gpu, op, forced ?? pickConvTile(M, N, groups[0].nb, gpu.fillWorkgroups));
  const ww = elemWindow(gpu, w, 0, w.numel);
  for (const { n0, nb } of groups) {
    const wdy = elemWindow(gpu, dy, n0 * ySample, nb * ySample);
    const wdx = elemWindow(gpu, dx, n0 * xSample, nb * xSample);
    gpu.run(CONV_DX, {
      defs: { T: dy.dtype, TC: dx.dtype, ...gemmDefs(s, tile, M, N, K % tile.BK === 0), ACCUMULATE: accumulate },
      uniforms: { off_w: ww.offset, off_dy: wdy.offset, off_dx: wdx.offset },
      bindings: { w: ww.window, dy: wdy.window, dx: wdx.window },
      workgroups: [Math.ceil(N / tile.BN), Math.ceil(M / tile.BM), nb],
    });
  }
}

/**
 * How many K splits a weight-gradient GEMM of `tiles` workgroups over a reduction of `k` gets: enough to
 * give the device `fill` workgroups, each split at least 4 BK steps long.
 */
function kSplits(tiles: number, k: number, bk: number, fill: number): number {
  return Math.max(1, Math.min(Math.ceil(fill / tiles), Math.floor(k / (4 * bk))));
}

/**
 * dw (+)= Σ_n dy[n] · im2col(x[n])ᵀ through conv_dw. The reduction over N * HO * WO is split (split-K) when
 * the [CO, CI*KHW] output alone gives the device too few workgroups, and always across sample groups: each
 * split of each sample group writes an f32 partial slab and dw_reduce sums them in parallel, one invocation
 * per weight. One split of one group writes dw directly.
 */
function convGradWeight(gpu: Gpu, op: string, s: ConvShape, dy: Tensor, x: Tensor, dw: Tensor, accumulate: boolean, forced?: ConvTile): void {
  const xSample = s.Ci * s.H * s.W;
  const ySample = s.Co * s.Ho * s.Wo;
  const hw = s.Ho * s.Wo;
  wholeFits(gpu, op, dw, 'grad weight');
  const groups = sampleGroups(gpu, op, s, [ySample * BYTES[dy.dtype], xSample * BYTES[x.dtype]]);
  const [M, N] = [s.Co, s.Ci * s.KH * s.KW];
  const tile = resolveTile(gpu, op, forced ?? pickConvTile(M, N, 1, gpu.fillWorkgroups));
  const tiles = Math.ceil(N / tile.BN) * Math.ceil(M / tile.BM);
  const plan = groups.map((g) => {
    const kLen = g.nb * hw;
    const splits = kSplits(tiles, kLen, tile.BK, gpu.fillWorkgroups);
    // Splits of whole BK steps, so that every split but the last is full.
    const kSplit = Math.ceil(Math.ceil(kLen / splits) / tile.BK) * tile.BK;
    return { ...g, kLen, kSplit, splits: Math.ceil(kLen / kSplit) };
  });
  const slabs = plan.reduce((a, g) => a + g.splits, 0);
  const len = M * N;
  const direct = slabs === 1 || windowBytesBound(gpu, slabs * len, 4) > gpu.maxBinding;
  const partial = direct ? null : gpu.tensor([slabs, M, N], 'f32', 'scratch', 'conv2d-dw-partial');
  const wout = elemWindow(gpu, partial ?? dw, 0, (partial ?? dw).numel);
  let slab = 0;
  for (const g of plan) {
    const wdy = elemWindow(gpu, dy, g.n0 * ySample, g.nb * ySample);
    const wx = elemWindow(gpu, x, g.n0 * xSample, g.nb * xSample);
    // Unsplit and too big for partials: later sample groups add onto the first.
    const splits = direct ? 1 : g.splits;
    const kSplit = direct ? g.kLen : g.kSplit;
    gpu.run(CONV_DW, {
      defs: {
        T: dy.dtype,
        TC: partial ? 'f32' : dw.dtype,
        ...gemmDefs(s, tile, M, N, kSplit % tile.BK === 0 && g.kLen % tile.BK === 0),
        ACCUMULATE: partial ? false : accumulate || g.n0 > 0,
      },
      uniforms: { off_dy: wdy.offset, off_x: wx.offset, off_dw: wout.offset + (direct ? 0 : slab * len), k_len: g.kLen, k_split: kSplit },
      bindings: { dy: wdy.window, x: wx.window, dw: wout.window },
      workgroups: [Math.ceil(N / tile.BN), Math.ceil(M / tile.BM), splits],
    });
    slab += splits;
  }
  if (!partial) return;
  const wdw = elemWindow(gpu, dw, 0, len);
  gpu.run(DW_REDUCE, {
    defs: { TC: dw.dtype, ACCUMULATE: accumulate },
    uniforms: { len, splits: slabs, off_out: wdw.offset },
    bindings: { partial: wout.window, out: wdw.window },
    workgroups: gpu.grid(Math.ceil(len / 256)),
  });
  gpu.free(partial);
}

// ---- 1x1 convolutions (stride 1, no padding) as plain GEMMs -----------------------------------------
//
// In NCHW a 1x1 convolution is a matrix product per sample, over the flattened pixels P = H*W:
//   y[n] [Co, P] = W [Co, Ci] · x[n] [Ci, P]               (W broadcast over the batch: batch stride 0)
//   dx[n] [Ci, P] = Wᵀ [Ci, Co] · dy[n] [Co, P]
//   dW [Co, Ci] = Σ_n dy[n] [Co, P] · x[n]ᵀ [P, Ci]         (one batched GEMM into f32 slabs [N, Co, Ci],
//                                                              summed over n by dw_reduce)
// matmul() runs them with its own tiles, split-K and binding chunks.

/** The convolution's limit on any path: one sample of x and of y must each fit a storage binding. */
function oneSampleFits(gpu: Gpu, op: string, s: ConvShape, dtype: Tensor['dtype']): void {
  samplesPerBinding(gpu, op, s, [s.Ci * s.H * s.W * BYTES[dtype], s.Co * s.Ho * s.Wo * BYTES[dtype]]);
}

function isPointwise(s: ConvShape): boolean {
  return s.KH === 1 && s.KW === 1 && s.stride === 1 && s.pad === 0;
}

/** [N, C, H, W] as [N, C, H*W]; [Co, Ci, 1, 1] as [Co, Ci]. */
function planes(t: Tensor): Tensor {
  return t.reshape([t.shape[0], t.shape[1], t.shape[2] * t.shape[3]]);
}
function matrix(w: Tensor): Tensor {
  return w.reshape([w.shape[0], w.shape[1]]);
}

/** y = W · x[n] (+ bias: y is first filled with bias[co] and the GEMM accumulates onto it). */
function pointwiseForward(gpu: Gpu, op: string, s: ConvShape, x: Tensor, w: Tensor, bias: Tensor | null, y: Tensor): void {
  oneSampleFits(gpu, op, s, x.dtype);
  if (bias) {
    wholeFits(gpu, op, bias, 'bias');
    const ySample = s.Co * s.Ho * s.Wo;
    const wb = elemWindow(gpu, bias, 0, bias.numel);
    for (const { n0, nb } of sampleGroups(gpu, op, s, [ySample * BYTES[y.dtype]])) {
      const wy = elemWindow(gpu, y, n0 * ySample, nb * ySample);
      gpu.run(BIAS_FILL, {
        defs: { T: y.dtype, CO: s.Co, HWO: s.Ho * s.Wo },
        uniforms: { off_y: wy.offset, off_bias: wb.offset, count: nb * ySample },
        bindings: { bias: wb.window, y: wy.window },
        workgroups: gpu.grid(Math.ceil((nb * ySample) / 256)),
      });
    }
  }
  matmul(gpu, matrix(w), planes(x), { out: planes(y), accumulate: bias !== null });
}

/** dx[n] (+)= Wᵀ · dy[n]. */
function pointwiseGradInput(gpu: Gpu, op: string, s: ConvShape, w: Tensor, dy: Tensor, dx: Tensor, accumulate: boolean): void {
  oneSampleFits(gpu, op, s, dy.dtype);
  matmul(gpu, matrix(w), planes(dy), { transA: true, out: planes(dx), accumulate });
}

/**
 * dW (+)= Σ_n dy[n] · x[n]ᵀ: one batched GEMM writes the per-sample products as f32 slabs, dw_reduce sums
 * them in parallel (and rounds once to dw's dtype). False when the slabs do not fit one binding: the
 * implicit-GEMM kernel then does it.
 */
function pointwiseGradWeight(gpu: Gpu, s: ConvShape, dy: Tensor, x: Tensor, dw: Tensor, accumulate: boolean): boolean {
  const len = s.Co * s.Ci;
  if (windowBytesBound(gpu, s.N * len, 4) > gpu.maxBinding) return false;
  const slabs = gpu.tensor([s.N, s.Co, s.Ci], 'f32', 'scratch', 'conv2d-dw-partial');
  matmul(gpu, planes(dy), planes(x), { transB: true, out: slabs });
  const ws = elemWindow(gpu, slabs, 0, slabs.numel);
  const wdw = elemWindow(gpu, dw, 0, len);
  gpu.run(DW_REDUCE, {
    defs: { TC: dw.dtype, ACCUMULATE: accumulate },
    uniforms: { len, splits: s.N, off_out: wdw.offset },
    bindings: { partial: ws.window, out: wdw.window },
    workgroups: gpu.grid(Math.ceil(len / 256)),
  });
  gpu.free(slabs);
  return true;
}

/** y = conv2d(x, w) + bias, x [N, Ci, H, W], w [Co, Ci, KH, KW], bias [Co] or null. */
export function conv2d(gpu: Gpu, x: Tensor, w: Tensor, bias: Tensor | null, opts: Conv2dOptions): Tensor {
  const op = 'conv2d';
  const s = convShape(op, x.shape, w.shape, opts);
  expectSameDType(op, x, w, ...(bias ? [bias] : []));
  if (bias) expectShape(op, 'bias', bias, [s.Co]);
  const y = gpu.tensor([s.N, s.Co, s.Ho, s.Wo], x.dtype, 'activations', 'conv2d');
  if (isPointwise(s) && !opts.tile) pointwiseForward(gpu, op, s, x, w, bias, y);
  else convForward(gpu, op, s, x, w, bias, y, opts.tile);
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
  const pointwise = isPointwise(s) && !opts.tile;
  if (pointwise) pointwiseGradInput(gpu, op, s, w, dy, dx, acc);
  else convGradInput(gpu, op, s, w, dy, dx, acc, opts.tile);
  if (!(pointwise && pointwiseGradWeight(gpu, s, dy, x, dw, acc))) convGradWeight(gpu, op, s, dy, x, dw, acc, opts.tile);
  biasGrad(gpu, op, s, dy, db, acc);
  return { dx, dw, db };
}

/** Only dx of conv2dBackward (a frozen weight: no grad-weight or bias kernels). */
export function conv2dBackwardInput(gpu: Gpu, x: Tensor, w: Tensor, dy: Tensor, opts: Conv2dOptions): Tensor {
  const op = 'conv2dBackwardInput';
  const s = convShape(op, x.shape, w.shape, opts);
  expectSameDType(op, x, w, dy);
  expectShape(op, 'dy', dy, [s.N, s.Co, s.Ho, s.Wo]);
  const dx = gpu.tensor(x.shape, x.dtype, 'activations', 'conv2d-dx');
  if (isPointwise(s) && !opts.tile) pointwiseGradInput(gpu, op, s, w, dy, dx, false);
  else convGradInput(gpu, op, s, w, dy, dx, false, opts.tile);
  return dx;
}

/** db[co] = Σ_{n, pixels} dy[n, co, ·], one workgroup per channel, sample groups per binding. */
function biasGrad(gpu: Gpu, op: string, s: ConvShape, dy: Tensor, db: Tensor, accumulate: boolean): void {
  const hw = s.Ho * s.Wo;
  const per = s.Co * hw;
  const wdb = elemWindow(gpu, db, 0, s.Co);
  for (const { n0, nb } of sampleGroups(gpu, op, s, [per * BYTES[dy.dtype]])) {
    const wdy = elemWindow(gpu, dy, n0 * per, nb * per);
    gpu.run(BIAS_GRAD, {
      defs: { T: dy.dtype, TC: db.dtype, ACCUMULATE: accumulate || n0 > 0 },
      uniforms: { off_dy: wdy.offset, off_db: wdb.offset, n_samples: nb, channels: s.Co, plane: hw },
      bindings: { dy: wdy.window, db: wdb.window },
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
