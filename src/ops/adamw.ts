// AdamW on fp32 master weights and moments (torch.optim.AdamW semantics), reading loss-scaled
// gradients (f16 or f32), optionally clipping by a global norm held on the GPU
// (torch.nn.utils.clip_grad_norm_), skipping the whole step on the GPU when the non-finite flag is
// set, and writing the compute-dtype weight copy. The math is in shaders/adamw.wgsl.
//
// One training step, with no read-back before the update:
//   clearFlag(flag); checkFinite(grads, flag); norm = globalNorm(grads, scale); adamw(...) per param
// (adamwAll does exactly this). The host then reads the flag once (4 bytes) to drive the
// DynamicLossScaler and to advance the step number only for applied steps.
import { Uniforms, type Gpu } from '../gpu/device.ts';
import { fmtShape, ShapeError } from '../gpu/errors.ts';
import { expectDType, type Tensor } from '../gpu/tensor.ts';
import { checkFinite, clearFlag, elementWindow, globalNorm, windowCapacity } from './reduce.ts';

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
  const others: [string, Tensor | undefined][] = [['m', param.m], ['v', param.v], ['weight', param.weight], ['grad', grad]];
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

/** One AdamW update of `param` from `grad` (loss-scaled). Large tensors run in binding-sized ranges. */
export function adamw(gpu: Gpu, param: AdamWParam, grad: Tensor, cfg: AdamWConfig, s: AdamWStep): void {
  check(param, grad, s);
  const copy = param.weight && !sameTensor(param.weight, param.master) ? param.weight : null;
  // Scalars in float64, handed to the kernel as f32 (what PyTorch does with its Python floats).
  const stepSize = cfg.lr / (1 - cfg.beta1 ** s.step);
  const bc2Sqrt = Math.sqrt(1 - cfg.beta2 ** s.step);
  const flagW = elementWindow(gpu, s.flag, 0, 1);
  const normW = s.clip ? elementWindow(gpu, s.clip.norm, 0, 1) : flagW; // unread without CLIP, but in the layout
  if (flagW.skip !== 0 || normW.skip !== 0) throw new ShapeError('adamw', 'flag and norm must start at aligned offsets');
  const walked = [grad, param.master, param.m, param.v, ...(copy ? [copy] : [])];
  const per = Math.min(...walked.map((t) => windowCapacity(gpu, t.dtype)));
  const n = param.master.numel;
  for (let start = 0; start < n; start += per) {
    const count = Math.min(per, n - start);
    const [g, p, m, v, w] = walked.map((t) => elementWindow(gpu, t, start, count));
    gpu.dispatch({
      shader: 'adamw',
      entry: copy ? 'adamw_step_copy' : 'adamw_step',
      defs: { G: grad.dtype, W: copy?.dtype ?? 'f32', WG, CLIP: !!s.clip },
      uniforms: new Uniforms()
        .u32(count, g.skip, p.skip, m.skip, v.skip, w?.skip ?? 0)
        .f32(1 - cfg.lr * cfg.weightDecay, cfg.beta1, 1 - cfg.beta1, cfg.beta2, 1 - cfg.beta2, stepSize, bc2Sqrt, cfg.eps, 1 / s.lossScale, s.clip?.maxNorm ?? 0),
      bindings: [g.window, p.window, m.window, v.window, flagW.window, normW.window, w?.window ?? null],
      workgroups: gpu.grid(Math.ceil(count / WG)),
    });
  }
}

/**
 * A whole optimizer step over several parameters: clears the flag, checks every gradient for
 * inf/NaN, measures the global norm when clipping, and updates every parameter (each update skips
 * itself on the GPU if the flag is set). Returns the norm tensor (f32 [1]) when clipping, for logging.
 */
export function adamwAll(
  gpu: Gpu, params: AdamWParam[], grads: Tensor[], cfg: AdamWConfig,
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
  master: Float32Array, m: Float32Array, v: Float32Array, grad: ArrayLike<number>, cfg: AdamWConfig,
  step: number, lossScale = 1, clipFactor = 1,
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
