// AdamW on compact optimizer state (issue 14): 8-bit blockwise moments as bitsandbytes' Adam8bit keeps them, and
// a compact master (the f16 compute weight plus a 16-bit extension word) instead of a separate fp32 copy. The
// kernel is shaders/adamw.wgsl `adamw_packed`; `adamwPackedRef` is its plain-TS reference (the same f32
// operations, the same tables, the same nearest-code search).
//
// 8-bit moments (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization"; bitsandbytes'
// kOptimizerStatic8bit2StateBlockwise): each parameter's m and v are split into blocks of QBLOCK = 256 elements
// (bitsandbytes' block size for its blockwise 8-bit optimizers: small enough that one outlier only coarsens 255
// neighbours, and one workgroup here); a block stores one f32 absolute maximum and a byte per element, an index
// into a 256-entry code table: m uses the signed dynamic map, v (>= 0) the unsigned one (create_dynamic_map:
// an exponent of 10^-6 .. 10^0 and a linear fraction, so small values keep relative precision). An update
// dequantises (code * absmax), updates in f32, takes the block's new absmax and requantises to the nearest code.
// Parameters under MIN_8BIT_SIZE = 4096 elements keep f32 moments (bitsandbytes' min_8bit_size: their state is
// small and they are often biases and norms, the most sensitive).
//
// Compact master: with f16 compute the master is w + ext * ulp16(w) / 65536, w the f16 weight the model
// computes with and ext an i16 (ulp16(w): f16's spacing at w, 2^(e - 10) for w in [2^e, 2^(e+1)), 2^-24 below
// f16's normals). The representation error is at most ulp16(w) * 2^-17 <= 2^-27 |w| for normal w (27
// significant bits: 11 of f16 and 16 of the extension), 2^-41 absolute below 2^-14: finer than an fp32 master
// (24 bits, 2^-24 |w|). The update is compensated so those bits survive f32 arithmetic (see the shader). With f32
// compute the weight itself is the master (no extension, nothing extra stored).
import type { Gpu } from '../gpu/device.ts';
import { fmtShape, ShapeError } from '../gpu/errors.ts';
import { f32, kernel, u32 } from '../gpu/kernel.ts';
import { Tensor } from '../gpu/tensor.ts';
import { f16BitsToF32, f32ToF16Bits } from '../util/half.ts';
import { statsEps, type AdamWConfig, type AdamWStep } from './adamw.ts';
import { elementWindow, windowCapacity } from './reduce.ts';

/** Elements per quantisation block (one f32 absmax each): bitsandbytes' blockwise optimizer block size. */
export const QBLOCK = 256;
/** Parameters smaller than this keep f32 moments (bitsandbytes' min_8bit_size). */
export const MIN_8BIT_SIZE = 4096;

/**
 * bitsandbytes' create_dynamic_map(signed, max_exponent_bits = 7, total_bits = 8): for exponent i = 0..6, the
 * midpoints of linspace(0.1, 1, 2^i + 1) (signed; 2^(i+1) + 1 unsigned) times 10^(i - 6), with their negatives
 * when signed; then 0 and 1; sorted. 256 entries either way (2 x 127 + 2 signed, 254 + 2 unsigned). Computed in
 * float64 and rounded to f32 (torch builds it in f32: entries agree to an f32 rounding, checked against the
 * generator's table in tests/kernels/adamw-packed.test.ts).
 */
export function dynamicMap(signed: boolean): Float32Array {
  const data: number[] = [];
  const maxExp = 7;
  for (let i = 0; i < maxExp; i++) {
    const items = signed ? 2 ** i + 1 : 2 ** (i + 1) + 1;
    const bounds = Array.from({ length: items }, (_, k) => 0.1 + (0.9 * k) / (items - 1));
    for (let k = 0; k + 1 < items; k++) {
      const mean = (bounds[k] + bounds[k + 1]) / 2;
      data.push(10 ** (i - (maxExp - 1)) * mean);
      if (signed) data.push(-(10 ** (i - (maxExp - 1))) * mean);
    }
  }
  data.push(0, 1);
  if (data.length !== 256) throw new Error(`dynamic map has ${data.length} entries`);
  return Float32Array.from(data.sort((a, b) => a - b));
}

/** The two tables as the kernel reads them: [signed (m) | unsigned (v)]. */
export const CODES = (() => {
  const t = new Float32Array(512);
  t.set(dynamicMap(true), 0);
  t.set(dynamicMap(false), 256);
  return t;
})();
/** Index of the code 0 in each table (an all-zero block quantises to it). */
export const ZERO_M = CODES.subarray(0, 256).indexOf(0);
export const ZERO_V = CODES.subarray(256).indexOf(0);

const fr = Math.fround;

/** The kernel's nearest-code search (f32 products and differences): see `quantise` in the shader. */
export function quantiseRef(x: number, absmax: number, table: Float32Array, zero: number): number {
  if (absmax === 0) return zero;
  let lo = 0;
  for (let half = 128; half > 0; half >>= 1) {
    const k = lo + half;
    if (k <= 255 && fr(table[k] * absmax) <= x) lo = k;
  }
  if (lo < 255) {
    const below = fr(x - fr(table[lo] * absmax));
    const above = fr(fr(table[lo + 1] * absmax) - x);
    if (above < below) return lo + 1;
  }
  return lo;
}

/** The exponent k of f16's spacing at |x|: 2^k (-24 below f16's normals). */
export function ulp16Exp(x: number): number {
  const a = Math.abs(x);
  const e = a === 0 || !Number.isFinite(a) ? -127 : Math.floor(Math.log2(a));
  // log2 can be off by one at binade edges: correct it against exact powers of two.
  const ee = 2 ** e > a ? e - 1 : 2 ** (e + 1) <= a ? e + 1 : e;
  return Math.max(ee, -14) - 10;
}

/** The extension word of `master` over its f16 weight `w` (f16-exact): round((master - w) / ulp16(w) * 2^16), clamped to i16. */
export function extOf(master: number, w: number): number {
  const q = roundHalfEven((master - w) * 2 ** (16 - ulp16Exp(w)));
  return Math.min(32767, Math.max(-32768, q));
}

/** The master a weight and its extension word stand for (float64; exact). */
export function masterOf(w: number, ext: number): number {
  return w + ext * 2 ** (ulp16Exp(w) - 16);
}

function roundHalfEven(x: number): number {
  const r = Math.round(x);
  return Math.abs(x % 1) === 0.5 && r % 2 !== 0 ? r - 1 : r;
}

/** The f16 value nearest x (round to nearest even), as a number. */
export function f16Of(x: number): number {
  return f16BitsToF32(f32ToF16Bits(x));
}

// ---- the kernel ---------------------------------------------------------------------------------

/**
 * One parameter's state for adamw_packed: views into a chunk's packed state (ops/optimizer layout). The master
 * is `master` (an fp32 master, or with no extension the f32 compute weight itself) or the f16 `weight` plus
 * `ext`; the moments `m`/`v` (f32) or `m8`/`v8` (u8 codes, 4 per word) with `absm`/`absv` (f32 per block).
 * Word views (ext, m8, v8) are f32-typed tensors of raw 32-bit words.
 */
export interface PackedParam {
  numel: number;
  /** The compute weight: the master's high part (ext), a copy to write (fp32 master), or the master itself. */
  weight: Tensor;
  master?: Tensor;
  ext?: Tensor;
  m?: Tensor;
  v?: Tensor;
  m8?: Tensor;
  v8?: Tensor;
  absm?: Tensor;
  absv?: Tensor;
}

const PACKED = kernel({
  shader: 'adamw',
  entry: 'adamw_packed',
  uniforms: [
    u32('n'),
    u32('g_skip'),
    u32('w_skip'),
    u32('p_skip'),
    u32('e_skip'),
    u32('m_skip'),
    u32('v_skip'),
    u32('m8_skip'),
    u32('v8_skip'),
    u32('am_skip'),
    u32('av_skip'),
    u32('zero_m'),
    u32('zero_v'),
    f32('decay'),
    f32('neg_lr_wd'),
    f32('beta1'),
    f32('one_minus_beta1'),
    f32('beta2'),
    f32('one_minus_beta2'),
    f32('step_size'),
    f32('bc2_sqrt'),
    f32('eps'),
    f32('inv_scale'),
    f32('max_norm'),
    f32('stats_eps'),
    u32('stats_at'),
    u32('norm_at'),
  ],
  bindings: [
    { name: 'grad', type: 'G', access: 'read' },
    { name: 'weight', type: 'W', access: 'read_write', when: 'HAS_W' },
    { name: 'master', type: 'f32', access: 'read_write', when: 'HAS_MASTER' },
    { name: 'ext', type: 'u32', access: 'read_write', when: 'EXT' },
    { name: 'm', type: 'f32', access: 'read_write', when: 'M32' },
    { name: 'v', type: 'f32', access: 'read_write', when: 'M32' },
    { name: 'm8', type: 'u32', access: 'read_write', when: 'Q8' },
    { name: 'v8', type: 'u32', access: 'read_write', when: 'Q8' },
    { name: 'absm', type: 'f32', access: 'read_write', when: 'Q8' },
    { name: 'absv', type: 'f32', access: 'read_write', when: 'Q8' },
    { name: 'codes', type: 'f32', access: 'read', when: 'Q8' },
    // Two bindings for the step's flags, norm and statistics (packedSignals): inputs[0] is the gradients' non-finite
    // flag and inputs[norm_at] the gradient norm (read); the check raises the update flag (signals[0]), the update
    // the statistics (signals[stats_at..+4]). Separate buffers made the 8-bit compact entry point bind 12 storage
    // buffers, past SwiftShader's 10 (its pipeline was refused); this way it binds at most 10.
    { name: 'inputs', type: 'u32', access: 'read' },
    { name: 'signals', type: 'atomic<u32>', access: 'read_write' },
  ],
});

/**
 * The buffers of an adamw_packed run's flags, norm and statistics, two in all so the kernel binds two: `signals`
 * (written by the kernel: the update flag at element 0, the 4 state statistics one storage-offset alignment later)
 * and `inputs` (read by it: the gradients' non-finite flag at 0, the gradient norm one alignment later). Each part is
 * a view the other kernels bind on its own (checkFinite and adamw's flag, globalNorm's output, adamwCheck's update
 * flag, adamwStats' maxima); a buffer is never bound writable and read-only in one dispatch, as WebGPU requires.
 * Free `buffers`.
 */
export function packedSignals(gpu: Gpu): { updateFlag: Tensor; stats: Tensor; flag: Tensor; norm: Tensor; buffers: Tensor[] } {
  const at = gpu.facts.storageAlignment / 4;
  const signals = gpu.zeros([at + 4], 'f32', 'scratch', 'adamw.signals');
  const inputs = gpu.zeros([at + 1], 'f32', 'scratch', 'adamw.inputs');
  const view = (t: Tensor, offset: number, n: number) => new Tensor(t.alloc, [n], 'f32', t.byteOffset + offset * 4, false);
  return { updateFlag: view(signals, 0, 1), stats: view(signals, at, 4), flag: view(inputs, 0, 1), norm: view(inputs, at, 1), buffers: [signals, inputs] };
}

/** Elements from `from` to `to` in one buffer (both from packedSignals), or a ShapeError. */
function offsetIn(from: Tensor, to: Tensor, what: string): number {
  const at = (to.byteOffset - from.byteOffset) / 4;
  if (to.alloc !== from.alloc || at < 1 || !Number.isInteger(at)) throw new ShapeError('adamwPacked', `${what} must come from packedSignals`);
  return at;
}

/** The two bindings over a run's flags, norm and statistics, and where the statistics and the norm sit in them. */
function signalsOf(r: PackedRun, s: AdamWStep): { signals: Tensor; inputs: Tensor; stats_at: number; norm_at: number } {
  const stats_at = offsetIn(r.updateFlag, r.stats, 'the update flag and the statistics');
  const norm_at = s.clip ? offsetIn(s.flag, s.clip.norm, 'the gradient flag and the norm') : 0;
  return {
    signals: new Tensor(r.updateFlag.alloc, [stats_at + 4], 'f32', r.updateFlag.byteOffset, false),
    inputs: new Tensor(s.flag.alloc, [norm_at + 1], 'f32', s.flag.byteOffset, false),
    stats_at,
    norm_at,
  };
}

export interface PackedRun {
  /** f32 [512] CODES on the GPU (the caller owns it). */
  codes: Tensor;
  /** f32 [1]: raised by a check. */
  updateFlag: Tensor;
  /** f32 [4]: atomic maxima of the new state raised by an update (AdamWStateStats order). */
  stats: Tensor;
  /** Only compute, and raise updateFlag when the update would leave a non-finite value (or an f16 weight past 65504). */
  check: boolean;
}

function validate(op: string, p: PackedParam, grad: Tensor, s: AdamWStep): void {
  const n = p.numel;
  if (grad.numel !== n) throw new ShapeError(op, `grad ${fmtShape(grad.shape)} does not match the parameter's ${n} elements`);
  if (p.weight.numel !== n) throw new ShapeError(op, `weight ${fmtShape(p.weight.shape)} does not match the parameter's ${n} elements`);
  if (!p.master === !p.ext) throw new ShapeError(op, 'give either an f32 master or an extension word array, not both or neither');
  if (p.ext && p.weight.dtype !== 'f16') throw new ShapeError(op, `an extension word needs an f16 weight, got ${p.weight.dtype}`);
  if (!(p.m && p.v) === !(p.m8 && p.v8 && p.absm && p.absv)) throw new ShapeError(op, 'give either f32 moments or 8-bit moments with their block maxima');
  const blocks = Math.ceil(n / QBLOCK);
  const want: [string, Tensor | undefined, number][] = [
    ['master', p.master, n],
    ['ext', p.ext, blocks * (QBLOCK / 2)],
    ['m', p.m, n],
    ['v', p.v, n],
    ['m8', p.m8, blocks * (QBLOCK / 4)],
    ['v8', p.v8, blocks * (QBLOCK / 4)],
    ['absm', p.absm, blocks],
    ['absv', p.absv, blocks],
  ];
  for (const [name, t, words] of want) if (t && t.numel !== words) throw new ShapeError(op, `${name} holds ${t.numel} words, not ${words}`);
  if (!Number.isInteger(s.step) || s.step < 1) throw new ShapeError(op, `step must be an integer >= 1, got ${s.step}`);
  if (!(s.lossScale > 0) || !Number.isFinite(s.lossScale)) throw new ShapeError(op, `loss scale must be finite and > 0, got ${s.lossScale}`);
}

/**
 * Storage buffers adamw_packed binds for a state layout (its most, with gradient clipping): what a device's
 * maxStorageBuffersPerShaderStage must allow (WebGPU guarantees 8; SwiftShader gives 10).
 */
export function packedStorageBuffers(layout: { q8: boolean; ext: boolean; master: boolean; copy: boolean }): number {
  const on: Record<string, boolean> = {
    HAS_W: layout.ext || layout.copy,
    HAS_MASTER: layout.master,
    EXT: layout.ext,
    M32: !layout.q8,
    Q8: layout.q8,
    CLIP: true,
  };
  return PACKED.bindings.filter((b) => !('when' in b) || on[b.when as string]).length;
}

/**
 * One AdamW update (or its check) of a packed parameter from its loss-scaled gradient. Ranges of whole blocks
 * that fit a binding; like adamw, nothing happens when `s.flag` (non-finite gradients) is set.
 */
export function adamwPacked(gpu: Gpu, p: PackedParam, grad: Tensor, cfg: AdamWConfig, s: AdamWStep, r: PackedRun): void {
  const op = r.check ? 'adamwPackedCheck' : 'adamwPacked';
  validate(op, p, grad, s);
  const q8 = !!p.m8;
  const copy = p.master && p.weight !== p.master && !(p.weight.buffer === p.master.buffer && p.weight.byteOffset === p.master.byteOffset);
  const hasW = !!p.ext || !!copy;
  // Elements per range: whole blocks within every binding (words hold 4 codes or 2 extensions).
  const capElems = Math.min(
    windowCapacity(gpu, grad.dtype),
    windowCapacity(gpu, p.weight.dtype),
    windowCapacity(gpu, 'f32'), // master, m, v (elements); ext/m8/v8 words hold more than one
  );
  const per = Math.floor(capElems / QBLOCK) * QBLOCK;
  if (per < QBLOCK) throw new ShapeError(op, `a storage binding of ${gpu.maxBinding} bytes holds less than one block of ${QBLOCK} elements`);
  const stepSize = cfg.lr / (1 - cfg.beta1 ** s.step);
  const factors = {
    decay: 1 - cfg.lr * cfg.weightDecay,
    neg_lr_wd: -(cfg.lr * cfg.weightDecay),
    beta1: cfg.beta1,
    one_minus_beta1: 1 - cfg.beta1,
    beta2: cfg.beta2,
    one_minus_beta2: 1 - cfg.beta2,
    step_size: stepSize,
    bc2_sqrt: Math.sqrt(1 - cfg.beta2 ** s.step),
    eps: cfg.eps,
    inv_scale: 1 / s.lossScale,
    max_norm: s.clip?.maxNorm ?? 0,
    stats_eps: statsEps(cfg),
    zero_m: ZERO_M,
    zero_v: ZERO_V,
  };
  const defs = {
    QB: QBLOCK,
    G: grad.dtype,
    W: p.weight.dtype,
    W_F16: p.weight.dtype === 'f16',
    HAS_W: hasW,
    HAS_MASTER: !!p.master,
    COPY: !!copy,
    EXT: !!p.ext,
    M32: !q8,
    Q8: q8,
    CLIP: !!s.clip,
    CHECK: r.check,
    STATS: !r.check,
    WG: 64, // the file's common index() reads it; adamw_packed's workgroup is 64 invocations x 4 elements
  };
  const one = (t: Tensor) => elementWindow(gpu, t, 0, t.numel).window;
  const n = p.numel;
  for (let start = 0; start < n; start += per) {
    const count = Math.min(per, n - start);
    const blocks = Math.ceil(count / QBLOCK);
    const b0 = start / QBLOCK;
    const win = (t: Tensor | undefined, from: number, len: number) => (t ? elementWindow(gpu, t, from, len) : null);
    const g = win(grad, start, count)!;
    const w = hasW ? win(p.weight, start, count) : null;
    const ms = win(p.master, start, count);
    const e = win(p.ext, b0 * (QBLOCK / 2), blocks * (QBLOCK / 2));
    const m = win(p.m, start, count);
    const v = win(p.v, start, count);
    const m8 = win(p.m8, b0 * (QBLOCK / 4), blocks * (QBLOCK / 4));
    const v8 = win(p.v8, b0 * (QBLOCK / 4), blocks * (QBLOCK / 4));
    const am = win(p.absm, b0, blocks);
    const av = win(p.absv, b0, blocks);
    const sig = signalsOf(r, s);
    const bindings = {
      grad: g.window,
      signals: sig.signals,
      inputs: sig.inputs,
      ...(w && { weight: w.window }),
      ...(ms && { master: ms.window }),
      ...(e && { ext: e.window }),
      ...(m && v && { m: m.window, v: v.window }),
      ...(m8 && v8 && am && av && { m8: m8.window, v8: v8.window, absm: am.window, absv: av.window, codes: one(r.codes) }),
    };
    const uniforms = {
      n: count,
      g_skip: g.skip,
      w_skip: w?.skip ?? 0,
      p_skip: ms?.skip ?? 0,
      e_skip: e?.skip ?? 0,
      m_skip: m?.skip ?? 0,
      v_skip: v?.skip ?? 0,
      m8_skip: m8?.skip ?? 0,
      v8_skip: v8?.skip ?? 0,
      am_skip: am?.skip ?? 0,
      av_skip: av?.skip ?? 0,
      stats_at: sig.stats_at,
      norm_at: sig.norm_at,
      ...factors,
    };
    gpu.run(PACKED, { defs, uniforms, bindings, workgroups: gpu.grid(blocks) });
  }
}

// ---- plain-TS reference --------------------------------------------------------------------------

/** One parameter's packed state on the host (the reference's and the optimizer's view of stored bytes). */
export interface PackedHostState {
  /** fp32 master, or (compact, f32 compute) the weight itself. */
  master?: Float32Array;
  /** f16 weight values (compact, f16 compute) and their extension words. */
  weight16?: Float32Array;
  ext?: Int16Array;
  m?: Float32Array;
  v?: Float32Array;
  m8?: Uint8Array;
  v8?: Uint8Array;
  absm?: Float32Array;
  absv?: Float32Array;
}

/** The moments as the kernel reads them (dequantised 8-bit, or the f32 arrays). */
export function momentsOf(st: PackedHostState, n: number): { m: Float32Array; v: Float32Array } {
  if (st.m && st.v) return { m: st.m, v: st.v };
  const m = new Float32Array(n);
  const v = new Float32Array(n);
  for (let i = 0; i < n; i++) {
    const b = Math.floor(i / QBLOCK);
    m[i] = fr(CODES[st.m8![i]] * st.absm![b]);
    v[i] = fr(CODES[256 + st.v8![i]] * st.absv![b]);
  }
  return { m, v };
}

/** The masters (float64-exact values rounded to f32). */
export function mastersOf(st: PackedHostState, n: number): Float32Array {
  if (st.master) return st.master.subarray(0, n);
  const out = new Float32Array(n);
  for (let i = 0; i < n; i++) out[i] = masterOf(st.weight16![i], st.ext![i]);
  return out;
}

/**
 * adamw_packed in plain TS, in place: the same f32 operations in the same order (Math.fround at each), the same
 * tables and search. Returns the new state's statistics as the kernel raises them.
 */
export function adamwPackedRef(
  st: PackedHostState,
  n: number,
  grad: ArrayLike<number>,
  cfg: AdamWConfig,
  step: number,
  lossScale = 1,
  clipFactor = 1,
): { maxAbsMaster: number; maxAbsM: number; maxV: number; maxRatio: number } {
  const f = fr;
  const [b1, omb1, b2, omb2, eps] = [cfg.beta1, 1 - cfg.beta1, cfg.beta2, 1 - cfg.beta2, cfg.eps].map(f);
  const decay = f(1 - cfg.lr * cfg.weightDecay);
  const negLrWd = f(-(cfg.lr * cfg.weightDecay));
  const stepSize = f(cfg.lr / (1 - cfg.beta1 ** step));
  const bc2Sqrt = f(Math.sqrt(1 - cfg.beta2 ** step));
  const invScale = f(1 / lossScale);
  const clip = f(clipFactor);
  const sEps = f(statsEps(cfg));
  const q8 = !!st.m8;
  const old = momentsOf(st, n);
  const m1 = new Float32Array(n);
  const v1 = new Float32Array(n);
  const wn = new Float32Array(n);
  for (let i = 0; i < n; i++) {
    const g = f(f(f(grad[i]) * invScale) * clip);
    const mm = f(f(b1 * old.m[i]) + f(omb1 * g));
    const vv = f(f(b2 * old.v[i]) + f(f(omb2 * g) * g));
    const ratio = f(mm / f(f(f(Math.sqrt(vv)) / bc2Sqrt) + eps));
    if (st.ext) {
      const x = st.weight16![i];
      const r = f(st.ext[i] * 2 ** (ulp16Exp(x) - 16));
      const d = f(f(negLrWd * f(x + r)) - f(stepSize * ratio));
      const s = f(r + d);
      const y = f(x + s);
      const k = ulp16Exp(y);
      const w16 = roundHalfEven(y * 2 ** -k) * 2 ** k;
      const r2 = f(f(x - w16) + s);
      st.ext[i] = Math.min(32767, Math.max(-32768, roundHalfEven(r2 * 2 ** (16 - ulp16Exp(w16)))));
      st.weight16![i] = w16;
      wn[i] = y;
    } else {
      const w = f(f(st.master![i] * decay) - f(stepSize * ratio));
      st.master![i] = w;
      wn[i] = w;
    }
    m1[i] = mm;
    v1[i] = vv;
  }
  let md = m1;
  let vd = v1;
  if (q8) {
    md = new Float32Array(n);
    vd = new Float32Array(n);
    for (let b = 0; b * QBLOCK < n; b++) {
      const lo = b * QBLOCK;
      const hi = Math.min(n, lo + QBLOCK);
      let am = 0;
      let av = 0;
      for (let i = lo; i < hi; i++) {
        am = Math.max(am, Math.abs(m1[i]));
        av = Math.max(av, Math.abs(v1[i]));
      }
      st.absm![b] = am;
      st.absv![b] = av;
      for (let i = lo; i < hi; i++) {
        st.m8![i] = quantiseRef(m1[i], am, CODES.subarray(0, 256), ZERO_M);
        st.v8![i] = quantiseRef(v1[i], av, CODES.subarray(256), ZERO_V);
        md[i] = f(CODES[st.m8![i]] * am);
        vd[i] = f(CODES[256 + st.v8![i]] * av);
      }
    }
  } else {
    st.m!.set(m1);
    st.v!.set(v1);
  }
  const out = { maxAbsMaster: 0, maxAbsM: 0, maxV: 0, maxRatio: 0 };
  for (let i = 0; i < n; i++) {
    out.maxAbsMaster = Math.max(out.maxAbsMaster, Math.abs(wn[i]));
    out.maxAbsM = Math.max(out.maxAbsM, Math.abs(md[i]));
    out.maxV = Math.max(out.maxV, Math.abs(vd[i]));
    out.maxRatio = Math.max(out.maxRatio, f(Math.abs(md[i]) / f(f(Math.sqrt(Math.abs(vd[i]))) + sEps)));
  }
  return out;
}
