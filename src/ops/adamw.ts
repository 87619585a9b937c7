// AdamW on fp32 master weights and moments (torch.optim.AdamW semantics), reading loss-scaled
// gradients (f16 or f32), optionally clipping by a global norm held on the GPU, skipping the whole
// step on the GPU when the non-finite flag is set, and writing the compute-dtype weight copy.
// The math is in shaders/adamw.wgsl.
import { Uniforms, type Gpu } from '../gpu/device.ts';
import { fmtShape, ShapeError } from '../gpu/errors.ts';
import { BYTES, expectDType, Tensor } from '../gpu/tensor.ts';

const WG = 256;

export interface AdamWConfig {
  lr: number;
  beta1: number;
  beta2: number;
  eps: number;
  weightDecay: number;
}

export const ADAMW_DEFAULTS: AdamWConfig = { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weightDecay: 1e-2 };

/** One trainable parameter: f32 master + moments, and the weight copy the model computes with. */
export interface AdamWParam {
  master: Tensor;
  m: Tensor;
  v: Tensor;
  weight: Tensor;
}

export interface AdamWStep {
  /** 1-based step number t (bias corrections use it); do not advance it for skipped steps. */
  step: number;
  /** The loss scale the gradients carry; they are divided by it. */
  lossScale: number;
  /** u32 flag: non-zero skips the update (see reduce.checkFinite). */
  flag: Tensor;
  /** Optional clipping: f32 [1] global norm of the unscaled gradients (reduce.globalNorm) and the max. */
  clip?: { norm: Tensor; maxNorm: number };
}

/** Allocates master (from the current weight values), m and v for a weight tensor. */
export function adamwParam(gpu: Gpu, weight: Tensor, masterValues: ArrayLike<number>): AdamWParam {
  const master = gpu.upload(masterValues, weight.shape, 'f32', 'optimizer', 'adamw.master');
  const m = gpu.zeros(weight.shape, 'f32', 'optimizer', 'adamw.m');
  const v = gpu.zeros(weight.shape, 'f32', 'optimizer', 'adamw.v');
  return { master, m, v, weight };
}

function check(param: AdamWParam, grad: Tensor): void {
  const n = param.master.numel;
  for (const [name, t] of [['m', param.m], ['v', param.v], ['weight', param.weight], ['grad', grad]] as const)
    if (t.numel !== n) throw new ShapeError('adamw', `${name} ${fmtShape(t.shape)} does not match master ${fmtShape(param.master.shape)}`);
  expectDType('adamw', param.master, 'f32', 'master');
  expectDType('adamw', param.m, 'f32', 'm');
  expectDType('adamw', param.v, 'f32', 'v');
}

/** One AdamW update of `param` from `grad` (loss-scaled). Large tensors run in binding-sized ranges. */
export function adamw(gpu: Gpu, param: AdamWParam, grad: Tensor, cfg: AdamWConfig, s: AdamWStep): void {
  check(param, grad);
  if (!(s.step >= 1)) throw new ShapeError('adamw', `step must be >= 1, got ${s.step}`);
  const bc1 = 1 - cfg.beta1 ** s.step;
  const bc2 = 1 - cfg.beta2 ** s.step;
  const narrow = Math.min(BYTES[grad.dtype], BYTES[param.weight.dtype]);
  for (const { start, count } of gpu.chunks(param.master.numel, 4, narrow)) {
    const win = (t: Tensor) => gpu.subWindow(t, start, count, BYTES[t.dtype]);
    gpu.dispatch({
      shader: 'adamw',
      entry: 'adamw_step',
      defs: { G: grad.dtype, W: param.weight.dtype, WG, CLIP: !!s.clip },
      uniforms: new Uniforms().u32(count).f32(cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weightDecay, bc1, bc2, 1 / s.lossScale, s.clip?.maxNorm ?? 0),
      // Without clipping the norm binding is unused but still part of the layout: bind the flag there.
      bindings: [win(grad), win(param.master), win(param.m), win(param.v), win(param.weight), s.flag, s.clip ? s.clip.norm : s.flag],
      workgroups: gpu.grid(Math.ceil(count / WG)),
    });
  }
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
