// AdamW on fp32 master weights and moments (torch.optim.AdamW semantics), reading loss-scaled
// gradients (f16 or f32), optionally clipping by a global norm held on the GPU
// (torch.nn.utils.clip_grad_norm_), skipping the whole step on the GPU when the non-finite flag is
// set, and writing the compute-dtype weight copy. The math is in shaders/adamw.wgsl.
//
// One training step, with no read-back before the update:
//   clearFlag(flag); checkFinite(grads, flag); norm = globalNorm(grads, scale); adamw(...) per param
// (adamwAll does exactly this). The host then reads the flag once (4 bytes) to drive the
// DynamicLossScaler and to advance the step number only for applied steps.
//
// Finite gradients can still blow the weights up (a learning rate of 1e30: the decay factor 1 - lr*wd and
// the step size overflow the master, or an f16 weight copy past 65504). adamwCheck runs the same update
// without writing and raises an update flag when any new master, m, v or f16 copy would be non-finite;
// adamwStats / adamwStateStats measure a state and adamwStepSafe bounds a step from those measurements,
// so a caller can prove a step safe without touching the state (train/optimizer.ts uses both).
import type { Gpu } from '../gpu/device.ts';
import { fmtShape, ShapeError } from '../gpu/errors.ts';
import { f32, kernel, u32 } from '../gpu/kernel.ts';
import { expectDType, type DType, type Tensor } from '../gpu/tensor.ts';
import { checkFinite, clearFlag, elementWindow, globalNorm, windowCapacity, type ElementWindow } from './reduce.ts';

const WG = 256;

export interface AdamWConfig {
  lr: number;
  beta1: number;
  beta2: number;
  eps: number;
  weightDecay: number;
}

/** torch.optim.AdamW's defaults. */
export const ADAMW_DEFAULTS: AdamWConfig = { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weightDecay: 1e-2 };

/** One trainable parameter: f32 master + moments, and the weight copy the model computes with. */
export interface AdamWParam {
  master: Tensor;
  m: Tensor;
  v: Tensor;
  /** Compute-dtype copy written after each update (f16 or f32); absent or the master itself: none. */
  weight?: Tensor;
}

export interface AdamWStep {
  /** 1-based step number t (bias corrections use it); do not advance it for skipped steps. */
  step: number;
  /** The loss scale the gradients carry; they are divided by it. */
  lossScale: number;
  /** f32 [1] non-finite flag (reduce.checkFinite): non-zero skips the update. */
  flag: Tensor;
  /** Optional clipping: f32 [1] global norm of the unscaled gradients (reduce.globalNorm) and the max. */
  clip?: { norm: Tensor; maxNorm: number };
}

/** Allocates master (from the given values), m and v for a weight tensor. */
export function adamwParam(gpu: Gpu, weight: Tensor, masterValues: ArrayLike<number>): AdamWParam {
  const master = gpu.upload(masterValues, weight.shape, 'f32', 'optimizer', 'adamw.master');
  const m = gpu.zeros(weight.shape, 'f32', 'optimizer', 'adamw.m');
  const v = gpu.zeros(weight.shape, 'f32', 'optimizer', 'adamw.v');
  return { master, m, v, weight };
}

function sameTensor(a: Tensor, b: Tensor): boolean {
  return a.buffer === b.buffer && a.byteOffset === b.byteOffset;
}

function scalarBuffer(op: string, name: string, t: Tensor): void {
  if (t.dtype !== 'f32' || t.numel !== 1) throw new ShapeError(op, `${name} must be f32 [1], got ${t.dtype}${fmtShape(t.shape)}`);
}

function check(param: AdamWParam, grad: Tensor, s: AdamWStep): void {
  const op = 'adamw';
  expectDType(op, param.master, 'f32', 'master');
  expectDType(op, param.m, 'f32', 'm');
  expectDType(op, param.v, 'f32', 'v');
  const n = param.master.numel;
  const others: [string, Tensor | undefined][] = [
    ['m', param.m],
    ['v', param.v],
    ['weight', param.weight],
    ['grad', grad],
  ];
  for (const [name, t] of others)
    if (t && t.numel !== n) throw new ShapeError(op, `${name} ${fmtShape(t.shape)} does not match master ${fmtShape(param.master.shape)}`);
  scalarBuffer(op, 'flag', s.flag);
  if (s.clip) {
    scalarBuffer(op, 'clip norm', s.clip.norm);
    if (!(s.clip.maxNorm > 0)) throw new ShapeError(op, `maxNorm must be > 0, got ${s.clip.maxNorm}`);
  }
  if (!Number.isInteger(s.step) || s.step < 1) throw new ShapeError(op, `step must be an integer >= 1, got ${s.step}`);
  if (!(s.lossScale > 0) || !Number.isFinite(s.lossScale)) throw new ShapeError(op, `loss scale must be finite and > 0, got ${s.lossScale}`);
}

/** The largest finite f16: an f16 weight copy of a master beyond it is inf. */
export const F16_MAX = 65504;
/** The largest finite f32. */
export const F32_MAX = 3.4028234663852886e38;

/** The compute-dtype copy an update writes (null: none, or the weight is the master itself). */
function copyOf(param: AdamWParam): Tensor | null {
  return param.weight && !sameTensor(param.weight, param.master) ? param.weight : null;
}

/** The largest |master| whose weight copy (of this dtype; none: undefined) stays finite. */
export function masterLimit(copy: DType | undefined): number {
  return copy === 'f16' ? F16_MAX : F32_MAX;
}

// ---- kernel interfaces (shaders/adamw.wgsl) ------------------------------------------------------

/** The update's element count, window skips and f32 factors (PyTorch's, computed on the host). */
const UPDATE_UNIFORMS = [
  u32('n'),
  u32('g_skip'),
  u32('p_skip'),
  u32('m_skip'),
  u32('v_skip'),
  f32('decay'),
  f32('beta1'),
  f32('one_minus_beta1'),
  f32('beta2'),
  f32('one_minus_beta2'),
  f32('step_size'),
  f32('bc2_sqrt'),
  f32('eps'),
  f32('inv_scale'),
  f32('max_norm'),
] as const;

/** What every update kernel binds: the gradient, the state (written or only read), the skip flag, the clip norm. */
function updateBindings<A extends 'read' | 'read_write'>(state: A) {
  return [
    { name: 'grad', type: 'G', access: 'read' },
    { name: 'master', type: 'f32', access: state },
    { name: 'm', type: 'f32', access: state },
    { name: 'v', type: 'f32', access: state },
    { name: 'flag', type: 'u32', access: 'read' },
    { name: 'norm', type: 'f32', access: 'read', when: 'CLIP' },
  ] as const;
}

const ADAMW_STEP = kernel({ shader: 'adamw', entry: 'adamw_step', uniforms: UPDATE_UNIFORMS, bindings: updateBindings('read_write') });
const ADAMW_STEP_COPY = kernel({
  shader: 'adamw',
  entry: 'adamw_step_copy',
  uniforms: [...UPDATE_UNIFORMS, u32('w_skip')],
  bindings: [...updateBindings('read_write'), { name: 'weight', type: 'W', access: 'read_write' }],
});
const ADAMW_CHECK = kernel({
  shader: 'adamw',
  entry: 'adamw_check',
  uniforms: UPDATE_UNIFORMS,
  bindings: [...updateBindings('read'), { name: 'update_flag', type: 'atomic<u32>', access: 'read_write' }],
});
/** adamw_stats' grid cap: enough workgroups to fill a large GPU, few enough barrier trees for a CPU adapter. */
const STATS_WORKGROUPS = 512;
const ADAMW_STATS = kernel({
  shader: 'adamw',
  entry: 'adamw_stats',
  uniforms: [u32('n'), u32('p_skip'), u32('m_skip'), u32('v_skip'), f32('stats_eps')],
  bindings: [
    { name: 'master', type: 'f32', access: 'read' },
    { name: 'm', type: 'f32', access: 'read' },
    { name: 'v', type: 'f32', access: 'read' },
    { name: 'stats', type: 'atomic<u32>', access: 'read_write' },
  ],
});

function alignedFlag(gpu: Gpu, op: string, name: string, t: Tensor): ElementWindow {
  const w = elementWindow(gpu, t, 0, 1);
  if (w.skip !== 0) throw new ShapeError(op, `${name} must start at an aligned offset`);
  return w;
}

/**
 * The update (adamw_step / adamw_step_copy) or its dry run (adamw_check, which only raises `updateFlag`),
 * over binding-sized element ranges.
 */
function dispatchAdamW(gpu: Gpu, param: AdamWParam, grad: Tensor, cfg: AdamWConfig, s: AdamWStep, updateFlag: Tensor | null): void {
  check(param, grad, s);
  const op = updateFlag ? 'adamwCheck' : 'adamw';
  if (updateFlag) scalarBuffer(op, 'update flag', updateFlag);
  const copy = copyOf(param);
  // Scalars in float64, handed to the kernel as f32 (what PyTorch does with its Python floats).
  const stepSize = cfg.lr / (1 - cfg.beta1 ** s.step);
  const bc2Sqrt = Math.sqrt(1 - cfg.beta2 ** s.step);
  const flagW = alignedFlag(gpu, op, 'flag', s.flag);
  const normW = s.clip ? alignedFlag(gpu, op, 'clip norm', s.clip.norm) : null;
  const updateW = updateFlag ? alignedFlag(gpu, op, 'update flag', updateFlag) : null;
  // The check reads no weight copy (it only needs its dtype).
  const walked = [grad, param.master, param.m, param.v, ...(copy && !updateFlag ? [copy] : [])];
  const per = Math.min(...walked.map((t) => windowCapacity(gpu, t.dtype)));
  const n = param.master.numel;
  const factors = {
    decay: 1 - cfg.lr * cfg.weightDecay,
    beta1: cfg.beta1,
    one_minus_beta1: 1 - cfg.beta1,
    beta2: cfg.beta2,
    one_minus_beta2: 1 - cfg.beta2,
    step_size: stepSize,
    bc2_sqrt: bc2Sqrt,
    eps: cfg.eps,
    inv_scale: 1 / s.lossScale,
    max_norm: s.clip?.maxNorm ?? 0, // read only with CLIP
  };
  const defs = { G: grad.dtype, WG, CLIP: !!s.clip };
  for (let start = 0; start < n; start += per) {
    const count = Math.min(per, n - start);
    const [g, p, m, v, w] = walked.map((t) => elementWindow(gpu, t, start, count));
    const uniforms = { n: count, g_skip: g.skip, p_skip: p.skip, m_skip: m.skip, v_skip: v.skip, ...factors };
    const bindings = { grad: g.window, master: p.window, m: m.window, v: v.window, flag: flagW.window, ...(normW && { norm: normW.window }) };
    const workgroups = gpu.grid(Math.ceil(count / WG));
    if (updateW) {
      const check = { uniforms, bindings: { ...bindings, update_flag: updateW.window }, workgroups };
      gpu.run(ADAMW_CHECK, { defs: { ...defs, W_F16: copy?.dtype === 'f16' }, ...check });
    } else if (copy && w) {
      const step = { uniforms: { ...uniforms, w_skip: w.skip }, bindings: { ...bindings, weight: w.window }, workgroups };
      gpu.run(ADAMW_STEP_COPY, { defs: { ...defs, W: copy.dtype }, ...step });
    } else gpu.run(ADAMW_STEP, { defs, uniforms, bindings, workgroups });
  }
}

/** One AdamW update of `param` from `grad` (loss-scaled). Large tensors run in binding-sized ranges. */
export function adamw(gpu: Gpu, param: AdamWParam, grad: Tensor, cfg: AdamWConfig, s: AdamWStep): void {
  dispatchAdamW(gpu, param, grad, cfg, s, null);
}

/**
 * The same update as `adamw`, computed and thrown away: sets `updateFlag` (f32 [1], 1.0) when it would
 * leave any element's new m, v or master non-finite, or a master beyond F16_MAX with an f16 weight copy.
 * Writes nothing else, so every value stays bit-identical; like the update it does nothing when `s.flag`
 * (non-finite gradients) is set. Costs one read of the gradient and the state (no writes).
 */
export function adamwCheck(gpu: Gpu, param: AdamWParam, grad: Tensor, cfg: AdamWConfig, s: AdamWStep, updateFlag: Tensor): void {
  dispatchAdamW(gpu, param, grad, cfg, s, updateFlag);
}

/** Plain-TS adamwCheck: true when the update (in the kernel's f32 operations) would set the flag. */
export function adamwCheckRef(
  master: ArrayLike<number>,
  m: ArrayLike<number>,
  v: ArrayLike<number>,
  grad: ArrayLike<number>,
  cfg: AdamWConfig,
  step: number,
  limit: number,
  lossScale = 1,
  clipFactor = 1,
): boolean {
  const f = Math.fround;
  const decay = f(1 - cfg.lr * cfg.weightDecay);
  const stepSize = f(cfg.lr / (1 - cfg.beta1 ** step));
  const bc2Sqrt = f(Math.sqrt(1 - cfg.beta2 ** step));
  const [b1, omb1, b2, omb2, eps] = [cfg.beta1, 1 - cfg.beta1, cfg.beta2, 1 - cfg.beta2, cfg.eps].map(f);
  for (let i = 0; i < master.length; i++) {
    const g = f(f(f(grad[i]) * f(1 / lossScale)) * f(clipFactor));
    const m1 = f(f(b1 * m[i]) + f(omb1 * g));
    const v1 = f(f(b2 * v[i]) + f(f(omb2 * g) * g));
    const denom = f(f(f(Math.sqrt(v1)) / bc2Sqrt) + eps);
    const w = f(f(master[i] * decay) - f(stepSize * f(m1 / denom)));
    if (!Number.isFinite(m1) || !Number.isFinite(v1) || !(Math.abs(w) <= limit)) return true;
  }
  return false;
}

// ---- state statistics and the step bound ---------------------------------------------------------

/** Maxima over a state: |master|, |m|, v, and |m| / (sqrt(v) + statsEps(cfg)). */
export interface AdamWStateStats {
  maxAbsMaster: number;
  maxAbsM: number;
  maxV: number;
  maxRatio: number;
}

/**
 * The epsilon of the stats' ratio: at most eps * bc2 / sqrt(beta2) for every step t (bc2 = sqrt(1 - beta2^t)
 * >= sqrt(1 - beta2)), with a factor 4 to spare, so the ratio bounds |m| / denom of any later step.
 */
export function statsEps(cfg: AdamWConfig): number {
  return (cfg.eps * Math.sqrt((1 - cfg.beta2) / cfg.beta2)) / 4;
}

/**
 * Accumulates `state`'s statistics into `out` (f32 [4]: the four maxima, in AdamWStateStats order) as
 * atomic maxima: zero `out` first. One read of the state; the host reads 16 bytes.
 */
export function adamwStats(gpu: Gpu, state: { master: Tensor; m: Tensor; v: Tensor }, cfg: AdamWConfig, out: Tensor): void {
  const op = 'adamwStats';
  for (const [name, t] of [
    ['master', state.master],
    ['m', state.m],
    ['v', state.v],
  ] as const) {
    expectDType(op, t, 'f32', name);
    if (t.numel !== state.master.numel) throw new ShapeError(op, `${name} ${fmtShape(t.shape)} does not match master ${fmtShape(state.master.shape)}`);
  }
  if (out.dtype !== 'f32' || out.numel !== 4) throw new ShapeError(op, `out must be f32 [4], got ${out.dtype}${fmtShape(out.shape)}`);
  const outW = elementWindow(gpu, out, 0, 4);
  if (outW.skip !== 0) throw new ShapeError(op, 'out must start at an aligned offset');
  const walked = [state.master, state.m, state.v];
  const per = windowCapacity(gpu, 'f32');
  const n = state.master.numel;
  for (let start = 0; start < n; start += per) {
    const count = Math.min(per, n - start);
    const [p, m, v] = walked.map((t) => elementWindow(gpu, t, start, count));
    gpu.run(ADAMW_STATS, {
      defs: { WG },
      uniforms: { n: count, p_skip: p.skip, m_skip: m.skip, v_skip: v.skip, stats_eps: statsEps(cfg) },
      bindings: { master: p.window, m: m.window, v: v.window, stats: outW.window },
      // At most STATS_WORKGROUPS workgroups: each invocation strides over the rest (the shader's comment).
      workgroups: gpu.grid(Math.min(STATS_WORKGROUPS, Math.ceil(count / WG))),
    });
  }
}

/** Plain-TS adamwStats (float64), also how the optimizer measures state it holds on the host. */
export function adamwStateStats(master: ArrayLike<number>, m: ArrayLike<number>, v: ArrayLike<number>, cfg: AdamWConfig): AdamWStateStats {
  const e = statsEps(cfg);
  const s: AdamWStateStats = { maxAbsMaster: 0, maxAbsM: 0, maxV: 0, maxRatio: 0 };
  // NaN never passes a `>`; a NaN anywhere makes the stats NaN so no bound is claimed from them.
  const max = (a: number, b: number) => (Number.isNaN(a) || Number.isNaN(b) ? NaN : a > b ? a : b);
  for (let i = 0; i < master.length; i++) {
    s.maxAbsMaster = max(s.maxAbsMaster, Math.abs(master[i]));
    s.maxAbsM = max(s.maxAbsM, Math.abs(m[i]));
    s.maxV = max(s.maxV, Math.abs(v[i]));
    s.maxRatio = max(s.maxRatio, Math.abs(m[i]) / (Math.sqrt(Math.abs(v[i])) + e));
  }
  return s;
}

/**
 * True when one AdamW step provably leaves every element of a state with these `stats` finite, its new
 * |master| within `limit` (masterLimit: F16_MAX for an f16 weight copy), given |unscaled, clipped
 * gradient| <= `gradMax`. False means "not proven" (run the exact adamwCheck), never "unsafe". Per
 * element, with the kernel's f32 factors (bc2 = sqrt(1 - b2^t), denom = sqrt(v1) / bc2 + eps):
 *   |m1| <= b1 max|m| + (1 - b1) G,   v1 <= b2 max v + (1 - b2) G^2                  (finite moments)
 *   |m1| / denom <= b1 |m| / (sqrt(b2 v) / bc2 + eps) + (1 - b1) |g| / (sqrt(1 - b2) |g| / bc2)
 *                <= b1 bc2 / sqrt(b2) * maxRatio + (1 - b1) bc2 / sqrt(1 - b2)
 *     (v1 >= b2 v and v1 >= (1 - b2) g^2; statsEps <= eps bc2 / sqrt(b2). Where (1 - b2) g^2 underflows
 *     (|g| < gTiny), denom >= eps bounds the second term by (1 - b1) gTiny / eps instead.)
 *   |master1| <= max|master| |1 - lr wd| + stepSize * (that ratio bound)
 * Each product and sum gets a 1e-3 margin: the kernel rounds a handful of f32 operations (ulps of 6e-8).
 * Loose on purpose (the worst element's bounds need not meet): normal learning rates pass with orders of
 * magnitude to spare, a blown-up one does not.
 */
export function adamwStepSafe(stats: AdamWStateStats, cfg: AdamWConfig, step: number, gradMax: number, limit: number): boolean {
  const { beta1: b1, beta2: b2, eps } = cfg;
  // Outside these the derivation does not hold (or eps sinks below f32's smallest square roots).
  if (!(b1 >= 0 && b1 < 1 && b2 > 0 && b2 < 1 && statsEps(cfg) >= 1e-16 && gradMax >= 0)) return false;
  const slack = 1.001;
  const f = Math.fround;
  const bc2 = f(Math.sqrt(1 - b2 ** step));
  const stepSize = Math.abs(f(cfg.lr / (1 - b1 ** step)));
  const decay = Math.abs(f(1 - cfg.lr * cfg.weightDecay));
  const g = gradMax * slack;
  const m1 = (b1 * stats.maxAbsM + (1 - b1) * g) * slack;
  const v1 = (b2 * stats.maxV + (1 - b2) * g * g) * slack;
  const gTiny = 2 * Math.sqrt(2 ** -126 / (1 - b2));
  const ratio = ((b1 * bc2 * stats.maxRatio) / Math.sqrt(b2) + Math.max(((1 - b1) * bc2) / Math.sqrt(1 - b2), ((1 - b1) * gTiny) / eps)) * slack;
  const master = (stats.maxAbsMaster * decay + stepSize * ratio) * slack;
  // Written so that NaN (and inf) anywhere answers false.
  return m1 * slack <= F32_MAX && v1 * slack <= F32_MAX && master * slack <= limit;
}

/**
 * A whole optimizer step over several parameters: clears the flag, checks every gradient for
 * inf/NaN, measures the global norm when clipping, and updates every parameter (each update skips
 * itself on the GPU if the flag is set). Returns the norm tensor (f32 [1]) when clipping, for logging.
 */
export function adamwAll(
  gpu: Gpu,
  params: AdamWParam[],
  grads: Tensor[],
  cfg: AdamWConfig,
  s: { step: number; lossScale: number; flag: Tensor; maxNorm?: number },
): Tensor | null {
  if (params.length !== grads.length) throw new ShapeError('adamwAll', `${params.length} parameters but ${grads.length} gradients`);
  clearFlag(gpu, s.flag);
  checkFinite(gpu, grads, s.flag);
  const norm = s.maxNorm !== undefined ? globalNorm(gpu, grads, s.lossScale) : null;
  const clip = norm ? { norm, maxNorm: s.maxNorm! } : undefined;
  params.forEach((p, i) => adamw(gpu, p, grads[i], cfg, { step: s.step, lossScale: s.lossScale, flag: s.flag, clip }));
  return norm;
}

/** Plain-TS AdamW step (in place, float64 math), the reference for the kernel. */
export function adamwRef(
  master: Float32Array,
  m: Float32Array,
  v: Float32Array,
  grad: ArrayLike<number>,
  cfg: AdamWConfig,
  step: number,
  lossScale = 1,
  clipFactor = 1,
): void {
  const bc1 = 1 - cfg.beta1 ** step;
  const bc2 = 1 - cfg.beta2 ** step;
  for (let i = 0; i < master.length; i++) {
    const g = (grad[i] / lossScale) * clipFactor;
    let p = master[i];
    p -= cfg.lr * cfg.weightDecay * p;
    m[i] = cfg.beta1 * m[i] + (1 - cfg.beta1) * g;
    v[i] = cfg.beta2 * v[i] + (1 - cfg.beta2) * g * g;
    p -= (cfg.lr / bc1) * (m[i] / (Math.sqrt(v[i]) / Math.sqrt(bc2) + cfg.eps));
    master[i] = p;
  }
}

/** clip_grad_norm_'s factor for a measured (unscaled) norm. */
export function clipFactorRef(norm: number, maxNorm: number): number {
  return Math.min(1, maxNorm / (norm + 1e-6));
}
