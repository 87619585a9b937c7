// Before an SDXL run trains (preprocess.ts's counterpart): each image through the VAE encoder once, in f32
// (SDXL's VAE overflows in f16) and times its scaling factor (0.13025), and each prompt through both text
// encoders once: the penultimate states concatenated [77, 768 + 1280] and encoder 2's pooled, projected EOS
// row, as diffusers' train_dreambooth_lora_sdxl.py and kohya's sdxl_train_network.py cache them. Each image
// keeps its time ids (conditioning.ts): [original h, w, crop top, left, target h, w].
import type { Gpu } from '../gpu/device.ts';
import { prepareImage } from '../io/image.ts';
import type { ClipTokenizer } from '../io/tokenizer.ts';
import type { LoadedSdxl } from '../models/sdxl.ts';
import { sdxlTextEncode } from '../nn/sdxl.ts';
import { vaeEncodeMean } from '../nn/vae-tiled.ts';
import type { ScheduleConfig } from '../sample/schedulers.ts';
import { txt2imgSdxl } from '../sample/txt2img-sdxl.ts';
import { latentMask } from './objective.ts';
import { classImageSeed, rgbToRgba, type PreparedSet } from './preprocess.ts';
import type { TrainData, TrainSample } from './trainer.ts';

/** One image's latent: the VAE posterior's mean times the scaling factor, the image uploaded in f32. */
export async function encodeSdxlImage(gpu: Gpu, vae: LoadedSdxl['vae'], image: Float32Array, size: { width: number; height: number }): Promise<Float32Array> {
  // Tiled past one storage binding (a 1024 px encode's activations are 512 MiB): nn/vae-tiled.ts.
  const latent = await vaeEncodeMean(gpu, vae.config, vae.weights, image, size, 'f32');
  for (let i = 0; i < latent.length; i++) latent[i] *= vae.config.scalingFactor;
  return latent;
}

/** A prompt's SDXL conditioning: both tokenizers' ids, the context [77, D1 + D2] and the pooled embedding. */
export async function encodeSdxlPrompt(
  gpu: Gpu,
  model: Pick<LoadedSdxl, 'textEncoder' | 'textEncoder2'>,
  tokenizers: [ClipTokenizer, ClipTokenizer],
  prompt: string,
): Promise<{ context: Float32Array; pooled: Float32Array; ids: Int32Array; ids2: Int32Array }> {
  const ids = tokenizers[0].encodePadded(prompt);
  const ids2 = tokenizers[1].encodePadded(prompt);
  const r = sdxlTextEncode(gpu, model.textEncoder, model.textEncoder2, ids, ids2, 1);
  const context = await gpu.read(r.context);
  const pooled = await gpu.read(r.pooled);
  gpu.free(r.context, r.pooled);
  return { context, pooled, ids, ids2 };
}

/**
 * One prior-preservation image from the SDXL base itself (preprocess.ts generateClassImage's counterpart):
 * seed classImageSeed(seed, index), DPM-Solver++ 2M, guidance 5 (SDXL's usual scale), at the training size.
 */
export async function generateSdxlClassImage(
  gpu: Gpu,
  model: LoadedSdxl,
  tokenizers: [ClipTokenizer, ClipTokenizer],
  schedule: ScheduleConfig,
  o: { prompt: string; seed: number; index: number; steps: number; resolution: number },
): Promise<Float32Array> {
  const img = await txt2imgSdxl(gpu, model, tokenizers, {
    prompt: o.prompt,
    negativePrompt: '',
    steps: o.steps,
    guidance: 5,
    seed: classImageSeed(o.seed, o.index),
    width: o.resolution,
    height: o.resolution,
    sampler: 'dpm++2m',
    schedule,
  });
  return prepareImage(rgbToRgba(img.rgb, img.width, img.height), { resolution: o.resolution, crop: 'center' });
}

/** Encodes instance and class sets of an SDXL run into TrainData (each distinct prompt once). */
export async function encodeSdxlTrainData(
  gpu: Gpu,
  model: LoadedSdxl,
  tokenizers: [ClipTokenizer, ClipTokenizer],
  resolution: number,
  instance: PreparedSet,
  classes: PreparedSet | null,
  onProgress?: (done: number, total: number) => void,
): Promise<TrainData> {
  const total = instance.images.length + (classes?.images.length ?? 0);
  let done = 0;
  const prompts = new Map<string, Awaited<ReturnType<typeof encodeSdxlPrompt>>>();
  const prompt = async (p: string) => {
    if (!prompts.has(p)) prompts.set(p, await encodeSdxlPrompt(gpu, model, tokenizers, p));
    return prompts.get(p)!;
  };
  const f = 2 ** (model.vae.config.blockOutChannels.length - 1);
  const zc = model.vae.config.latentChannels;
  const encodeSet = async (set: PreparedSet) => {
    const out: TrainSample[] = [];
    for (let i = 0; i < set.images.length; i++) {
      const mask = set.masks?.[i];
      const size = set.sizes?.[i] ?? { width: resolution, height: resolution };
      const bucket = size.width !== resolution || size.height !== resolution;
      const p = await prompt(set.prompts[i]);
      out.push({
        latent: await encodeSdxlImage(gpu, model.vae, set.images[i], size),
        context: p.context,
        pooled: p.pooled,
        ids: p.ids,
        ids2: p.ids2,
        timeIds: set.timeIds?.[i] ?? Float32Array.of(size.height, size.width, 0, 0, size.height, size.width),
        prompt: set.prompts[i],
        ...(mask ? { mask: latentMask(mask, bucket ? size : resolution, f) } : {}),
        ...(bucket ? { latentShape: [zc, size.height / f, size.width / f] as [number, number, number] } : {}),
      });
      onProgress?.(++done, total);
    }
    return out;
  };
  const inst = await encodeSet(instance);
  const cls = classes ? await encodeSet(classes) : [];
  const D = model.textEncoder.config.hiddenSize + model.textEncoder2.config.hiddenSize;
  const h = resolution / f;
  return { latentShape: [zc, h, h], contextShape: [inst[0].context.length / D, D], instance: inst, classes: cls };
}
