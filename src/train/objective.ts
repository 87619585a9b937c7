// DreamBooth's denoising objective (diffusers' train_dreambooth semantics) on the host: per-sample loss weights
// (min-SNR-gamma, prior preservation) and a photo's loss mask at latent resolution (sd-scripts' masked loss).
// The kernels (noising, the v target, the weighted MSE and its gradient) are ops/loss.ts; noise with an offset
// is formed on the host.
import { ShapeError } from '../gpu/errors.ts';
import { debiasedWeight } from './loss-options.ts';

/**
 * Per-sample loss weights: min-SNR-gamma (Hang et al.; SNR = ā / (1 - ā): min(SNR, γ) / SNR for epsilon,
 * min(SNR, γ) / (SNR + 1) for v-prediction), times debiased estimation's weight (train/loss-options.ts), times a
 * class weight (prior_loss_weight for class images).
 */
export function lossWeights(
  timesteps: number[],
  acp: Float64Array,
  o: { prediction: 'epsilon' | 'v_prediction'; minSnrGamma?: number; debiased?: boolean; classWeights?: number[] },
): number[] {
  return timesteps.map((t, i) => {
    let w = 1;
    const snr = acp[t] / (1 - acp[t]);
    if (o.minSnrGamma !== undefined) w = Math.min(snr, o.minSnrGamma) / (o.prediction === 'epsilon' ? snr : snr + 1);
    if (o.debiased) w *= debiasedWeight(snr, o.prediction);
    return w * (o.classWeights?.[i] ?? 1);
  });
}

/**
 * A photo's loss mask at latent resolution: the mask at the training size ([height, width] in [0, 1]; `size` is
 * the side of a square one) averaged over each factor x factor block (torch's interpolate(mode="area") for an
 * integer factor, what sd-scripts applies).
 */
export function latentMask(pixels: Float32Array, size: number | { width: number; height: number }, factor: number): Float32Array {
  const { width, height } = typeof size === 'number' ? { width: size, height: size } : size;
  if (pixels.length !== width * height || width % factor !== 0 || height % factor !== 0)
    throw new ShapeError('latentMask', `a ${width}x${height} mask (${pixels.length} values) does not pool by ${factor}`);
  const w = width / factor;
  const out = new Float32Array(w * (height / factor));
  for (let y = 0; y < height; y++) for (let x = 0; x < width; x++) out[Math.floor(y / factor) * w + Math.floor(x / factor)] += pixels[y * width + x];
  for (let i = 0; i < out.length; i++) out[i] /= factor * factor;
  return out;
}
