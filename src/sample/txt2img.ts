// Text to image on the engine: CLIP-encode the prompt and the negative prompt, denoise seeded latents
// with classifier-free guidance (one UNet call on the [negative, prompt] batch per step:
// out = neg + g (pos - neg)) under DDIM or DPM-Solver++ 2M, then VAE-decode latents / scaling_factor.
import type { Gpu } from '../gpu/device.ts';
import type { ClipTokenizer } from '../io/tokenizer.ts';
import type { LoadedModel } from '../models/load.ts';
import { clipTextForward } from '../nn/clip.ts';
import { unetForward } from '../nn/unet.ts';
import { vaeDecodeImage } from '../nn/vae-tiled.ts';
import { Ddim, DpmSolverPP2M, randn, type Sampler, type ScheduleConfig } from './schedulers.ts';

export interface Txt2ImgOptions {
  prompt: string;
  negativePrompt?: string;
  steps: number;
  guidance: number;
  seed: number;
  width: number;
  height: number;
  sampler: 'ddim' | 'dpm++2m';
  schedule: ScheduleConfig;
  onStep?: (i: number, total: number) => void;
  /** alpha / rank of LoRA adapters present in the UNet and text-encoder weights (a run's samples while it trains). */
  loraScale?: number;
}

/** A generation setting that cannot be honoured, named as the option it came from. */
export class SampleOptionError extends Error {
  override name = 'SampleOptionError';
}

/** Pixels per latent pixel times the UNet's down-sampling: image sides must be multiples of it. */
function imageFactor(model: Pick<LoadedModel, 'vae' | 'unet'>): number {
  return 2 ** (model.vae.config.blockOutChannels.length - 1) * 2 ** (model.unet.config.blockOutChannels.length - 1);
}

/** The largest side generated (latents of 256x256 at SD's factor 8). */
export const MAX_IMAGE_SIDE = 2048;

/** Steps, guidance, seed and the image size, checked before any GPU work; throws naming the option. */
export function checkTxt2ImgOptions(
  model: Pick<LoadedModel, 'vae' | 'unet'>,
  o: Pick<Txt2ImgOptions, 'steps' | 'guidance' | 'seed' | 'width' | 'height'>,
): void {
  if (!(Number.isInteger(o.steps) && o.steps >= 1 && o.steps <= 1000))
    throw new SampleOptionError(`steps must be a whole number from 1 to 1000, got ${o.steps}`);
  if (!(Number.isFinite(o.guidance) && o.guidance >= 0 && o.guidance <= 100))
    throw new SampleOptionError(`guidance must be from 0 to 100 (7.5 is usual), got ${o.guidance}`);
  if (!(Number.isSafeInteger(o.seed) && o.seed >= 0)) throw new SampleOptionError(`seed must be a whole number of at least 0, got ${o.seed}`);
  const f = imageFactor(model);
  for (const [k, v] of [
    ['width', o.width],
    ['height', o.height],
  ] as const)
    if (!(Number.isInteger(v) && v >= f && v <= MAX_IMAGE_SIDE && v % f === 0))
      throw new SampleOptionError(`${k} must be a multiple of ${f} from ${f} to ${MAX_IMAGE_SIDE} px for this model, got ${v}`);
}

/** A sample that went non-finite (NaN/Inf): the message names the stage and, with a LoRA, its scale. */
export class NonFiniteSampleError extends Error {}

/** Refuses values with a NaN or Inf: an overflow would otherwise become a black image that looks like a result. */
function checkFinite(values: Float32Array, stage: string, o: Txt2ImgOptions): void {
  let bad = 0;
  for (const v of values) if (!Number.isFinite(v)) bad++;
  if (!bad) return;
  const lora = o.loraScale !== undefined ? ` with the LoRA at scale ${o.loraScale} (a smaller --lora-scale may stay finite)` : '';
  throw new NonFiniteSampleError(`${stage} holds ${bad} non-finite values (NaN/Inf) of ${values.length}${lora}; no image was written`);
}

/** Returns an RGB image [H, W, 3] as bytes. */
export async function txt2img(
  gpu: Gpu,
  model: LoadedModel,
  tokenizer: ClipTokenizer,
  o: Txt2ImgOptions,
): Promise<{ rgb: Uint8Array; width: number; height: number }> {
  checkTxt2ImgOptions(model, o);
  const dtype = gpu.computeDType;
  const ids = [...tokenizer.encodePadded(o.negativePrompt ?? ''), ...tokenizer.encodePadded(o.prompt)];
  const context = clipTextForward(gpu, model.textEncoder.config, model.textEncoder.weights, ids, 2, null, o.loraScale ?? 1);
  const f = 2 ** (model.vae.config.blockOutChannels.length - 1);
  const [h, w] = [Math.floor(o.height / f), Math.floor(o.width / f)];
  const zc = model.unet.config.inChannels;
  const n = zc * h * w;
  const sampler: Sampler = o.sampler === 'ddim' ? new Ddim(o.schedule, o.steps) : new DpmSolverPP2M(o.schedule, o.steps);
  let x = randn(n, o.seed); // init_noise_sigma = 1 for both samplers
  for (let i = 0; i < sampler.timesteps.length; i++) {
    const t = sampler.timesteps[i];
    const both = new Float32Array(2 * n);
    both.set(x);
    both.set(x, n);
    const latents = gpu.upload(both, [2, zc, h, w], dtype);
    const tt = gpu.upload([t, t], [2], 'f32');
    const out = await gpu.read(unetForward(gpu, model.unet.config, model.unet.weights, latents, tt, context, null, o.loraScale ?? 1));
    gpu.free(latents, tt);
    const where = `sampling step ${i + 1}/${sampler.timesteps.length} (timestep ${t})`;
    checkFinite(out, `the UNet's output at ${where}`, o);
    const guided = new Float32Array(n);
    for (let k = 0; k < n; k++) guided[k] = out[k] + o.guidance * (out[n + k] - out[k]);
    x = sampler.step(i, x, guided);
    checkFinite(x, `the latents after ${where}`, o);
    o.onStep?.(i + 1, sampler.timesteps.length);
  }
  gpu.free(context);
  const scaled = x.map((v) => v / model.vae.config.scalingFactor);
  const image = await vaeDecodeImage(gpu, model.vae.config, model.vae.weights, scaled, { width: w, height: h }, dtype); // tiled past one binding
  checkFinite(image, "the VAE decoder's output", o);
  const H = h * f;
  const W = w * f;
  const rgb = new Uint8Array(H * W * 3);
  for (let c = 0; c < 3; c++) for (let p = 0; p < H * W; p++) rgb[p * 3 + c] = Math.round(Math.min(1, Math.max(0, (image[c * H * W + p] + 1) / 2)) * 255);
  return { rgb, width: W, height: H };
}
