// Text to image on the engine: CLIP-encode the prompt and the negative prompt, denoise seeded latents
// with classifier-free guidance (one UNet call on the [negative, prompt] batch per step:
// out = neg + g (pos - neg)) under DDIM or DPM-Solver++ 2M, then VAE-decode latents / scaling_factor.
import type { Gpu } from '../gpu/device.ts';
import type { ClipTokenizer } from '../io/tokenizer.ts';
import type { LoadedModel } from '../models/load.ts';
import { clipTextForward } from '../nn/clip.ts';
import { unetForward } from '../nn/unet.ts';
import { vaeDecode } from '../nn/vae.ts';
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

/** Returns an RGB image [H, W, 3] as bytes. */
export async function txt2img(gpu: Gpu, model: LoadedModel, tokenizer: ClipTokenizer, o: Txt2ImgOptions): Promise<{ rgb: Uint8Array; width: number; height: number }> {
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
    const guided = new Float32Array(n);
    for (let k = 0; k < n; k++) guided[k] = out[k] + o.guidance * (out[n + k] - out[k]);
    x = sampler.step(i, x, guided);
    o.onStep?.(i + 1, sampler.timesteps.length);
  }
  gpu.free(context);
  const scaled = x.map((v) => v / model.vae.config.scalingFactor);
  const image = await gpu.read(vaeDecode(gpu, model.vae.config, model.vae.weights, gpu.upload(scaled, [1, zc, h, w], dtype)));
  const H = h * f;
  const W = w * f;
  const rgb = new Uint8Array(H * W * 3);
  for (let c = 0; c < 3; c++)
    for (let p = 0; p < H * W; p++) rgb[p * 3 + c] = Math.round(Math.min(1, Math.max(0, (image[c * H * W + p] + 1) / 2)) * 255);
  return { rgb, width: W, height: H };
}
