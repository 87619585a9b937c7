// The loss options of kohya's sd-scripts (library/train_util.py conditional_loss and
// get_huber_threshold_if_needed; custom_train_functions.py apply_debiased_estimation):
//
//   --loss l2          mean(m (pred - target)^2)                          (the GPU kernels of ops/loss.ts)
//   --loss huber       mean(m 2c (sqrt((pred - target)^2 + c^2) - c))    pseudo-Huber, ~ d^2 near 0, ~ 2c|d| far out
//   --loss smooth_l1   mean(m 2 (sqrt((pred - target)^2 + c^2) - c))     the same without the factor c
//   c per sample from --huber-delta (sd-scripts' huber_c) and --huber-schedule:
//     constant     c
//     exponential  exp(ln(c) t / T)                      (1 at t = 0 down to c at t = T)
//     snr          (1 - c) / (1 + sigma_t)^2 + c,  sigma_t = sqrt((1 - ā_t) / ā_t)   (sd-scripts' default)
//   --debiased-estimation: each sample's term times 1 / sqrt(min(SNR_t, 1000)) (epsilon) or 1 / (min(SNR_t, 1000)
//   + 1) (v-prediction), Yu et al. 2023's debiased estimation as sd-scripts weighs it.
//
// Each sample's term is weighted (w_b: prior weight, min-SNR, debiased) and the batch's sum divided by B, as the
// l2 loss is. The robust losses run on the host: a step's latents are tiny (4 x 64 x 64 per 512 px sample: 64 KiB
// in f32), so reading the prediction back and uploading its gradient costs far less than the UNet pass.
import type { Gpu } from '../gpu/device.ts';
import type { Tensor } from '../gpu/tensor.ts';
import { weightedMse, weightedMseBackward } from '../ops/loss.ts';

export type LossKind = 'l2' | 'huber' | 'smooth_l1';
export const LOSS_KINDS: readonly LossKind[] = ['l2', 'huber', 'smooth_l1'];
export type HuberSchedule = 'constant' | 'exponential' | 'snr';
export const HUBER_SCHEDULES: readonly HuberSchedule[] = ['snr', 'exponential', 'constant'];
/** sd-scripts' defaults: huber_c 0.1, huber_schedule snr. */
export const HUBER_C_DEFAULT = 0.1;
/** sd-scripts clamps the SNR of debiased estimation here (t = 0 has SNR near 1/(1 - ā_0) - 1, large). */
export const DEBIASED_SNR_MAX = 1000;

/** Each sample's Huber parameter c at its timestep (see the header); `acp` is the schedule the step noised with. */
export function huberCs(timesteps: number[], acp: Float64Array, c: number, schedule: HuberSchedule): number[] {
  const T = acp.length;
  return timesteps.map((t) => {
    if (schedule === 'constant') return c;
    if (schedule === 'exponential') return Math.exp((Math.log(c) / T) * t);
    const sigma = Math.sqrt((1 - acp[t]) / acp[t]);
    return (1 - c) / (1 + sigma) ** 2 + c;
  });
}

/** Debiased estimation's weight for a sample at SNR `snr`. */
export function debiasedWeight(snr: number, prediction: 'epsilon' | 'v_prediction'): number {
  const s = Math.min(snr, DEBIASED_SNR_MAX);
  return prediction === 'v_prediction' ? 1 / (s + 1) : 1 / Math.sqrt(s);
}

/**
 * A robust loss on the host: pred and target [B, per] (per = C h w), mask [B, plane] or null, weights and cs
 * per sample. Returns the loss (sum_b w_b mean_b(m rho(d)) / B) and its gradient with respect to pred (times
 * `scale`), rho'(d) = 2c d / sqrt(d^2 + c^2) (huber) or 2 d / sqrt(d^2 + c^2) (smooth_l1).
 */
export function robustLoss(
  pred: ArrayLike<number>,
  target: ArrayLike<number>,
  o: { batch: number; per: number; plane: number; weights: number[]; mask: ArrayLike<number> | null; kind: 'huber' | 'smooth_l1'; cs: number[]; scale: number },
): { loss: number; grad: Float32Array } {
  const { batch, per, plane, weights, mask, cs } = o;
  const grad = new Float32Array(batch * per);
  let loss = 0;
  for (let b = 0; b < batch; b++) {
    const c = cs[b];
    const k = o.kind === 'huber' ? 2 * c : 2;
    const g = (weights[b] * o.scale) / (per * batch);
    let sum = 0;
    for (let i = 0; i < per; i++) {
      const j = b * per + i;
      const m = mask ? mask[b * plane + (i % plane)] : 1;
      const d = pred[j] - target[j];
      const r = Math.sqrt(d * d + c * c);
      sum += m * k * (r - c);
      grad[j] = (g * m * k * d) / r;
    }
    loss += (weights[b] * sum) / per;
  }
  return { loss: loss / batch, grad };
}

/** The loss options a pass reads. */
export interface LossOptions {
  kind: LossKind;
  /** Per sample (huber, smooth_l1). */
  cs: number[];
}

/**
 * A pass's loss and its loss-scaled gradient with respect to `pred` (in pred's dtype): l2 on the GPU
 * (ops/loss.ts), the robust losses on the host (robustLoss).
 */
export async function passLoss(
  gpu: Gpu,
  pred: Tensor,
  target: Tensor,
  weights: number[],
  mask: Tensor | null,
  scale: number,
  o: LossOptions,
): Promise<{ loss: number; dy: Tensor }> {
  if (o.kind === 'l2') {
    const loss = await weightedMse(gpu, pred, target, weights, mask);
    return { loss, dy: weightedMseBackward(gpu, pred, target, weights, mask, scale) };
  }
  const [batch, ...rest] = pred.shape;
  const per = rest.reduce((a, b) => a * b, 1);
  const [p, t, m] = await Promise.all([gpu.read(pred), gpu.read(target), mask ? gpu.read(mask) : null]);
  const plane = rest.slice(1).reduce((a, b) => a * b, 1);
  const { loss, grad } = robustLoss(p, t, { batch, per, plane, weights, mask: m, kind: o.kind, cs: o.cs, scale });
  return { loss, dy: gpu.upload(grad, pred.shape, pred.dtype, 'gradients', 'dpred') };
}
