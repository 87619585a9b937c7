// The denoising loss kernels (the trainer's objective, train/objective.ts): noising at per-sample timesteps and
// the epsilon or v target (one per-sample mix), and the weighted MSE with its gradient, optionally under a
// per-photo loss mask (sd-scripts' masked loss). WGSL in shaders/loss.wgsl.
import type { Gpu } from '../gpu/device.ts';
import { fmtShape, ShapeError } from '../gpu/errors.ts';
import { kernel } from '../gpu/kernel.ts';
import { expectSameDType, Tensor } from '../gpu/tensor.ts';
import { mseLoss, sumRows } from './reduce.ts';

const WG = 256;

const PER_SAMPLE = [
  { name: 'n', type: 'u32' },
  { name: 'per_sample', type: 'u32' },
] as const;

/** out = c[b].x * x + c[b].y * y with sample b's coefficient pair c[b]. */
const MIX = kernel({
  shader: 'loss',
  entry: 'mix',
  uniforms: PER_SAMPLE,
  bindings: [
    { name: 'x', type: 'T', access: 'read' },
    { name: 'y', type: 'T', access: 'read' },
    { name: 'coef', type: 'vec2<f32>', access: 'read' },
    { name: 'out', type: 'T', access: 'read_write' },
  ],
});

/** out = alpha * weight[b] * (x - y): the weighted MSE's gradient for x = pred, y = target. */
const WMSE_GRAD = kernel({
  shader: 'loss',
  entry: 'wmse_grad',
  uniforms: [...PER_SAMPLE, { name: 'alpha', type: 'f32' }],
  bindings: [
    { name: 'x', type: 'T', access: 'read' },
    { name: 'y', type: 'T', access: 'read' },
    { name: 'weight', type: 'f32', access: 'read' },
    { name: 'out', type: 'T', access: 'read_write' },
  ],
});

/** The masked loss's per-element terms m[b, s] (pred - target)^2 in f32 (summed per sample by sumRows). */
const MASKED_SQ_ERR = kernel({
  shader: 'loss',
  entry: 'masked_sq_err',
  uniforms: [...PER_SAMPLE, { name: 'plane', type: 'u32' }],
  bindings: [
    { name: 'x', type: 'T', access: 'read' },
    { name: 'y', type: 'T', access: 'read' },
    { name: 'mask', type: 'f32', access: 'read' },
    { name: 'out', type: 'f32', access: 'read_write' },
  ],
});

/** out = alpha * weight[b] * m[b, s] * (x - y): the masked weighted MSE's gradient. */
const MASKED_WMSE_GRAD = kernel({
  shader: 'loss',
  entry: 'masked_wmse_grad',
  uniforms: [...PER_SAMPLE, { name: 'plane', type: 'u32' }, { name: 'alpha', type: 'f32' }],
  bindings: [
    { name: 'x', type: 'T', access: 'read' },
    { name: 'y', type: 'T', access: 'read' },
    { name: 'weight', type: 'f32', access: 'read' },
    { name: 'mask', type: 'f32', access: 'read' },
    { name: 'out', type: 'T', access: 'read_write' },
  ],
});

function perSample(op: string, a: Tensor, b: Tensor): { batch: number; per: number } {
  expectSameDType(op, a, b);
  if (a.shape.length < 2 || a.shape.length !== b.shape.length || a.shape.some((d, i) => d !== b.shape[i]))
    throw new ShapeError(op, `${fmtShape(a.shape)} and ${fmtShape(b.shape)} must be the same batched shape`);
  return { batch: a.shape[0], per: a.numel / a.shape[0] };
}

function mix(gpu: Gpu, op: string, x: Tensor, y: Tensor, coef: number[][]): Tensor {
  const { batch, per } = perSample(op, x, y);
  if (coef.length !== batch) throw new ShapeError(op, `${coef.length} coefficient pairs for a batch of ${batch}`);
  const c = gpu.upload(coef.flat(), [batch, 2], 'f32', 'scratch', `${op}.coef`);
  const out = gpu.tensor(x.shape, x.dtype, 'activations', op);
  gpu.run(MIX, {
    defs: { T: x.dtype, WG },
    uniforms: { n: x.numel, per_sample: per },
    bindings: { x, y, coef: c, out },
    workgroups: gpu.grid(Math.ceil(x.numel / WG)),
  });
  gpu.free(c);
  return out;
}

/** x_t = sqrt(ā_t) x0 + sqrt(1 - ā_t) eps, one timestep per sample (DDPMScheduler.add_noise). */
export function addNoise(gpu: Gpu, x0: Tensor, eps: Tensor, timesteps: number[], acp: Float64Array): Tensor {
  return mix(
    gpu,
    'addNoise',
    x0,
    eps,
    timesteps.map((t) => [Math.sqrt(acp[t]), Math.sqrt(1 - acp[t])]),
  );
}

/** The training target: eps, or v = sqrt(ā_t) eps - sqrt(1 - ā_t) x0 (DDPMScheduler.get_velocity). */
export function velocity(gpu: Gpu, x0: Tensor, eps: Tensor, timesteps: number[], acp: Float64Array): Tensor {
  return mix(
    gpu,
    'velocity',
    x0,
    eps,
    timesteps.map((t) => [-Math.sqrt(1 - acp[t]), Math.sqrt(acp[t])]),
  );
}

/**
 * A loss mask's plane: mask is f32 [B, h, w] for pred [B, C, h, w] (one weight per latent position, shared by
 * the channels, as sd-scripts' apply_masked_loss broadcasts its [B, 1, h, w] mask).
 */
function maskPlane(op: string, pred: Tensor, mask: Tensor): number {
  const [B, , h, w] = pred.shape;
  if (pred.shape.length !== 4 || mask.dtype !== 'f32' || mask.shape.length !== 3 || mask.shape[0] !== B || mask.shape[1] !== h || mask.shape[2] !== w)
    throw new ShapeError(op, `a loss mask for ${fmtShape(pred.shape)} must be f32 [${B}, ${h}, ${w}], got ${mask.dtype} ${fmtShape(mask.shape)}`);
  return h * w;
}

/**
 * sum_b w_b mean_b(m_b (pred - target)^2) / B, read back as a number; without a mask m = 1. The masked mean
 * divides by every element, not by the mask's sum (sd-scripts: loss * mask, then .mean([1, 2, 3])), so a
 * mask that keeps half the photo halves the loss, and the weights keep their meaning.
 */
export async function weightedMse(gpu: Gpu, pred: Tensor, target: Tensor, weights: number[], mask: Tensor | null = null): Promise<number> {
  const { batch, per } = perSample('weightedMse', pred, target);
  if (mask) return maskedWeightedMse(gpu, pred, target, weights, mask, batch, per);
  const bytes = (per * pred.byteSize) / pred.numel;
  const align = gpu.facts.storageAlignment;
  if (batch > 1 && bytes % align !== 0)
    throw new ShapeError('weightedMse', `one sample of ${fmtShape(pred.shape)} is ${bytes} bytes, not a multiple of the ${align}-byte binding alignment`);
  const view = (t: Tensor, b: number) => new Tensor(t.alloc, t.shape.slice(1), t.dtype, t.byteOffset + b * bytes, false);
  const perSampleLoss = Array.from({ length: batch }, (_, b) => mseLoss(gpu, view(pred, b), view(target, b)));
  // Read back together: one wait for the GPU per step, not one per sample.
  const values = await Promise.all(perSampleLoss.map((l) => gpu.read(l)));
  gpu.free(...perSampleLoss);
  let loss = 0;
  for (let b = 0; b < batch; b++) loss += weights[b] * values[b][0];
  return loss / batch;
}

async function maskedWeightedMse(gpu: Gpu, pred: Tensor, target: Tensor, weights: number[], mask: Tensor, batch: number, per: number): Promise<number> {
  const plane = maskPlane('weightedMse', pred, mask);
  const terms = gpu.tensor([batch, per], 'f32', 'scratch', 'masked-sq-err');
  gpu.run(MASKED_SQ_ERR, {
    defs: { T: pred.dtype, WG },
    uniforms: { n: pred.numel, per_sample: per, plane },
    bindings: { x: pred, y: target, mask, out: terms },
    workgroups: gpu.grid(Math.ceil(pred.numel / WG)),
  });
  const sums = sumRows(gpu, terms);
  gpu.free(terms);
  const perSampleSums = await gpu.read(sums);
  gpu.free(sums);
  let loss = 0;
  for (let b = 0; b < batch; b++) loss += (weights[b] * perSampleSums[b]) / per;
  return loss / batch;
}

/** Gradient of weightedMse (same arguments) with respect to pred, times the loss scale, in pred's dtype. */
export function weightedMseBackward(gpu: Gpu, pred: Tensor, target: Tensor, weights: number[], mask: Tensor | null = null, lossScale = 1): Tensor {
  const { batch, per } = perSample('weightedMseBackward', pred, target);
  if (weights.length !== batch) throw new ShapeError('weightedMseBackward', `${weights.length} weights for a batch of ${batch}`);
  const w = gpu.upload(weights, [batch], 'f32', 'scratch', 'loss-weights');
  const out = gpu.tensor(pred.shape, pred.dtype, 'gradients', 'dpred');
  const alpha = (2 * lossScale) / (per * batch);
  const workgroups = gpu.grid(Math.ceil(pred.numel / WG));
  if (mask)
    gpu.run(MASKED_WMSE_GRAD, {
      defs: { T: pred.dtype, WG },
      uniforms: { n: pred.numel, per_sample: per, plane: maskPlane('weightedMseBackward', pred, mask), alpha },
      bindings: { x: pred, y: target, weight: w, mask, out },
      workgroups,
    });
  else
    gpu.run(WMSE_GRAD, {
      defs: { T: pred.dtype, WG },
      uniforms: { n: pred.numel, per_sample: per, alpha },
      bindings: { x: pred, y: target, weight: w, out },
      workgroups,
    });
  gpu.free(w);
  return out;
}
