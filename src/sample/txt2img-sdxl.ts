// Text to image on an SDXL model with the project's samplers (DDIM, DPM-Solver++ 2M) and classifier-free
// guidance, as diffusers' StableDiffusionXLPipeline conditions it:
//   - both tokenizers and text encoders (nn/sdxl.ts): prompt_embeds [B, 77, 2048] and pooled text_embeds;
//   - an empty negative prompt is all zeros, embeddings and pooled alike (force_zeros_for_empty_prompt,
//     SDXL base's setting); a given one is encoded like the prompt;
//   - time ids [original h, w, crop top, left, target h, w] = [H, W, 0, 0, H, W] for both halves of the batch;
//   - latents / scaling_factor (0.13025) decoded by the VAE in f32 (SDXL's VAE overflows in f16), in tiles where
//     1024 px passes one storage binding (nn/vae-tiled.ts).
import type { Gpu } from '../gpu/device.ts';
import type { Tensor } from '../gpu/tensor.ts';
import type { ClipTokenizer } from '../io/tokenizer.ts';
import type { LoadedSdxl } from '../models/sdxl.ts';
import { sdxlTextEncode } from '../nn/sdxl.ts';
import { unetForward } from '../nn/unet.ts';
import { vaeDecodeImage } from '../nn/vae-tiled.ts';
import { Ddim, DpmSolverPP2M, randn, type Sampler } from './schedulers.ts';
import { checkTxt2ImgOptions, type Txt2ImgOptions } from './txt2img.ts';

/** CFG conditioning for a [negative, prompt] batch: context [2, L, D] and pooled [2, P] on the GPU. */
export interface SdxlCond {
  context: Tensor;
  pooled: Tensor;
}

/** Encodes [negative, prompt] with both encoders; an empty negative prompt becomes zeros. */
export async function sdxlCond(
  gpu: Gpu,
  model: LoadedSdxl,
  tokenizers: [ClipTokenizer, ClipTokenizer],
  prompt: string,
  negative = '',
  loraScale = 1,
): Promise<SdxlCond> {
  const [t1, t2] = tokenizers;
  const ids1 = [...t1.encodePadded(negative), ...t1.encodePadded(prompt)];
  const ids2 = [...t2.encodePadded(negative), ...t2.encodePadded(prompt)];
  const r = sdxlTextEncode(gpu, model.textEncoder, model.textEncoder2, ids1, ids2, 2, null, loraScale);
  if (negative !== '') return { context: r.context, pooled: r.pooled };
  const zeroFirst = async (t: Tensor) => {
    const d = await gpu.read(t);
    d.fill(0, 0, d.length / 2);
    const z = gpu.upload(d, t.shape, t.dtype);
    gpu.free(t);
    return z;
  };
  return { context: await zeroFirst(r.context), pooled: await zeroFirst(r.pooled) };
}

/** The SDXL time ids of a generated image: no crop, original size = target size = [height, width]. */
export function sdxlTimeIds(height: number, width: number): number[] {
  return [height, width, 0, 0, height, width];
}

/** Denoises the latents x [inChannels, h, w] (flattened) under guided SDXL conditioning for an image of height x width px. */
export async function sdxlDenoise(
  gpu: Gpu,
  model: LoadedSdxl,
  cond: SdxlCond,
  x: Float32Array,
  o: Pick<Txt2ImgOptions, 'steps' | 'guidance' | 'sampler' | 'schedule' | 'onStep' | 'loraScale' | 'width' | 'height'>,
): Promise<Float32Array> {
  const f = 2 ** (model.vae.config.blockOutChannels.length - 1);
  const [h, w] = [o.height / f, o.width / f];
  const zc = model.unet.config.inChannels;
  const n = zc * h * w;
  const dtype = cond.context.dtype;
  const sampler: Sampler = o.sampler === 'ddim' ? new Ddim(o.schedule, o.steps) : new DpmSolverPP2M(o.schedule, o.steps);
  const ids = sdxlTimeIds(o.height, o.width);
  const timeIds = gpu.upload([...ids, ...ids], [2, 6], 'f32');
  for (let i = 0; i < sampler.timesteps.length; i++) {
    const t = sampler.timesteps[i];
    const both = new Float32Array(2 * n);
    both.set(x);
    both.set(x, n);
    const latents = gpu.upload(both, [2, zc, h, w], dtype);
    const tt = gpu.upload([t, t], [2], 'f32');
    const added = { textEmbeds: cond.pooled, timeIds };
    const out = await gpu.read(unetForward(gpu, model.unet.config, model.unet.weights, latents, tt, cond.context, null, o.loraScale ?? 1, false, added));
    gpu.free(latents, tt);
    const guided = new Float32Array(n);
    for (let k = 0; k < n; k++) guided[k] = out[k] + o.guidance * (out[n + k] - out[k]);
    x = sampler.step(i, x, guided);
    o.onStep?.(i + 1, sampler.timesteps.length);
  }
  gpu.free(timeIds);
  return x;
}

/** Returns an RGB image [H, W, 3] as bytes. */
export async function txt2imgSdxl(
  gpu: Gpu,
  model: LoadedSdxl,
  tokenizers: [ClipTokenizer, ClipTokenizer],
  o: Txt2ImgOptions,
): Promise<{ rgb: Uint8Array; width: number; height: number }> {
  checkTxt2ImgOptions(model, o);
  const cond = await sdxlCond(gpu, model, tokenizers, o.prompt, o.negativePrompt ?? '', o.loraScale ?? 1);
  const f = 2 ** (model.vae.config.blockOutChannels.length - 1);
  const zc = model.unet.config.inChannels;
  const x = await sdxlDenoise(gpu, model, cond, randn((zc * o.height * o.width) / (f * f), o.seed), o);
  gpu.free(cond.context, cond.pooled);
  const [H, W] = [o.height, o.width];
  const scaled = x.map((v) => v / model.vae.config.scalingFactor);
  const image = await vaeDecodeImage(gpu, model.vae.config, model.vae.weights, scaled, { width: W / f, height: H / f }, 'f32'); // tiled past one binding
  const rgb = new Uint8Array(H * W * 3);
  for (let c = 0; c < 3; c++) for (let p = 0; p < H * W; p++) rgb[p * 3 + c] = Math.round(Math.min(1, Math.max(0, (image[c * H * W + p] + 1) / 2)) * 255);
  return { rgb, width: W, height: H };
}
