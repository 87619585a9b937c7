// Before training: every image through the VAE encoder once and every prompt through the text encoder
// once (the offline-preprocessing lesson of large SD trainers); the results go to the chunk store, and the
// VAE and text encoder leave the GPU before the UNet trains. Host-neutral: images arrive prepared
// ([3, R, R] in [-1, 1], io/image.ts), the model already loaded (models/load.ts).
import type { Gpu } from '../gpu/device.ts';
import { prepareImage, type RgbaImage } from '../io/image.ts';
import type { ClipTokenizer } from '../io/tokenizer.ts';
import type { LoadedModel } from '../models/load.ts';
import { clipTextForward } from '../nn/clip.ts';
import { vaeEncodeMean } from '../nn/vae-tiled.ts';
import type { ScheduleConfig } from '../sample/schedulers.ts';
import { txt2img } from '../sample/txt2img.ts';
import type { ChunkStore } from '../store/chunkstore.ts';
import { commitSnapshot, openSnapshot } from '../store/snapshot.ts';
import type { TrainData, TrainSample } from './trainer.ts';
import { latentMask } from './objective.ts';

/** One image's latent: the mean of the VAE posterior times the scaling factor (kohya's cached latents). */
export async function encodeImage(
  gpu: Gpu,
  vae: LoadedModel['vae'],
  image: Float32Array,
  resolution: number,
  /** A rectangular image (an aspect-ratio bucket) instead of the resolution x resolution square. */
  size: { width: number; height: number } = { width: resolution, height: resolution },
): Promise<Float32Array> {
  // Tiled past one storage binding (nn/vae-tiled.ts); whole otherwise, as before.
  const latent = await vaeEncodeMean(gpu, vae.config, vae.weights, image, size, gpu.computeDType);
  for (let i = 0; i < latent.length; i++) latent[i] *= vae.config.scalingFactor;
  return latent;
}

/** The text encoder's last hidden state [77, D] for a prompt. */
export async function encodePrompt(gpu: Gpu, te: LoadedModel['textEncoder'], tokenizer: ClipTokenizer, prompt: string): Promise<Float32Array> {
  const ctx = clipTextForward(gpu, te.config, te.weights, tokenizer.encodePadded(prompt), 1);
  const out = await gpu.read(ctx);
  gpu.free(ctx);
  return out;
}

/** RGB bytes [H, W, 3] (a sampler's output) as opaque RGBA. */
export function rgbToRgba(rgb: Uint8Array, w: number, h: number): RgbaImage {
  const data = new Uint8Array(w * h * 4);
  for (let p = 0; p < w * h; p++) {
    data.set(rgb.subarray(3 * p, 3 * p + 3), 4 * p);
    data[4 * p + 3] = 255;
  }
  return { width: w, height: h, data };
}

/** The sampler seed of class image `index` of a run with seed `runSeed`. */
export function classImageSeed(runSeed: number, index: number): number {
  return runSeed * 1000 + index;
}

/**
 * One prior-preservation image from the base model itself (what diffusers' train_dreambooth does): image
 * `index` of the run is sampled with seed classImageSeed(seed, index) (DPM-Solver++ 2M, guidance 7.5) and prepared
 * at the training resolution.
 */
export async function generateClassImage(
  gpu: Gpu,
  model: LoadedModel,
  tokenizer: ClipTokenizer,
  schedule: ScheduleConfig,
  o: { prompt: string; seed: number; index: number; steps: number; resolution: number },
): Promise<Float32Array> {
  const img = await txt2img(gpu, model, tokenizer, {
    prompt: o.prompt,
    negativePrompt: '',
    steps: o.steps,
    guidance: 7.5,
    seed: classImageSeed(o.seed, o.index),
    width: o.resolution,
    height: o.resolution,
    sampler: 'dpm++2m',
    schedule,
  });
  return prepareImage(rgbToRgba(img.rgb, img.width, img.height), { resolution: o.resolution, crop: 'center' });
}

export interface PreparedSet {
  /** [3, R, R] in [-1, 1] per image. */
  images: Float32Array[];
  /** Per image: its loss mask [R, R] in [0, 1] (cropped and resized like the image), or null; absent: none. */
  masks?: (Float32Array | null)[];
  /** Per image: its size when it is an aspect-ratio bucket's ([3, H, W], mask [H, W]), or null (the square); absent: all square. */
  sizes?: ({ width: number; height: number } | null)[];
  /** Per image: its caption, or the set's prompt. */
  prompts: string[];
  /**
   * SDXL, per image: its time ids [original h, w, crop top, left, target h, w] (train/conditioning.ts
   * sdxlTimeIds); absent: [target h, w, 0, 0, target h, w] (an image made at the size it trains at).
   */
  timeIds?: (Float32Array | null)[];
}

/** Encodes instance and class sets into TrainData (prompts shared by several images are encoded once). */
export async function encodeTrainData(
  gpu: Gpu,
  model: LoadedModel,
  tokenizer: ClipTokenizer,
  resolution: number,
  instance: PreparedSet,
  classes: PreparedSet | null,
  onProgress?: (done: number, total: number) => void,
): Promise<TrainData> {
  const total = instance.images.length + (classes?.images.length ?? 0);
  let done = 0;
  const contexts = new Map<string, Float32Array>();
  const context = async (p: string) => {
    if (!contexts.has(p)) contexts.set(p, await encodePrompt(gpu, model.textEncoder, tokenizer, p));
    return contexts.get(p)!;
  };
  const f = 2 ** (model.vae.config.blockOutChannels.length - 1);
  const encodeSet = async (set: PreparedSet) => {
    const out: TrainData['instance'] = [];
    for (let i = 0; i < set.images.length; i++) {
      const mask = set.masks?.[i];
      const size = set.sizes?.[i] ?? null;
      const bucket = size && (size.width !== resolution || size.height !== resolution) ? size : null;
      out.push({
        latent: await encodeImage(gpu, model.vae, set.images[i], resolution, size ?? undefined),
        context: await context(set.prompts[i]),
        ids: tokenizer.encodePadded(set.prompts[i]),
        prompt: set.prompts[i],
        ...(mask ? { mask: latentMask(mask, size ?? resolution, f) } : {}),
        ...(bucket ? { latentShape: [model.vae.config.latentChannels, bucket.height / f, bucket.width / f] as [number, number, number] } : {}),
      });
      onProgress?.(++done, total);
    }
    return out;
  };
  const h = resolution / f;
  const D = model.textEncoder.config.hiddenSize;
  const inst = await encodeSet(instance);
  const cls = classes ? await encodeSet(classes) : [];
  return { latentShape: [model.vae.config.latentChannels, h, h], contextShape: [inst[0].context.length / D, D], instance: inst, classes: cls };
}

const f32 = (a: Float32Array) => new Uint8Array(a.buffer, a.byteOffset, a.byteLength);
const asF32 = (b: Uint8Array) => new Float32Array(b.buffer, b.byteOffset, b.byteLength / 4);

interface CacheMeta {
  latentShape: [number, number, number];
  contextShape: [number, number];
  instance: number;
  classes: number;
  /** Latent shapes of samples at an aspect-ratio bucket, by file prefix (e.g. "i2"); absent: all square. */
  shapes?: Record<string, [number, number, number]>;
}

/** Stores the encoded data under `${runId}/cache` (one snapshot: all of it or nothing). */
export async function saveTrainData(store: ChunkStore, runId: string, d: TrainData): Promise<void> {
  const files = new Map<string, Uint8Array>();
  const shapes: Record<string, [number, number, number]> = {};
  const put = (p: string) => (x: TrainSample, i: number) => {
    if (x.latentShape) shapes[`${p}${i}`] = x.latentShape;
    files.set(`${p}${i}-latent`, f32(x.latent));
    files.set(`${p}${i}-context`, f32(x.context));
    if (x.ids) files.set(`${p}${i}-ids`, new Uint8Array(x.ids.buffer, x.ids.byteOffset, x.ids.byteLength));
    if (x.ids2) files.set(`${p}${i}-ids2`, new Uint8Array(x.ids2.buffer, x.ids2.byteOffset, x.ids2.byteLength));
    if (x.pooled) files.set(`${p}${i}-pooled`, f32(x.pooled));
    if (x.timeIds) files.set(`${p}${i}-timeids`, f32(x.timeIds));
    if (x.mask) files.set(`${p}${i}-mask`, f32(x.mask));
    if (x.prompt !== undefined) files.set(`${p}${i}-prompt`, new TextEncoder().encode(x.prompt));
  };
  d.instance.forEach(put('i'));
  d.classes.forEach(put('c'));
  const meta: CacheMeta = {
    latentShape: d.latentShape,
    contextShape: d.contextShape,
    instance: d.instance.length,
    classes: d.classes.length,
    ...(Object.keys(shapes).length ? { shapes } : {}),
  };
  await commitSnapshot(store, `${runId}/cache`, files, meta);
}

/** The cached data of a run, or null when it was never (completely) stored. */
export async function loadTrainData(store: ChunkStore, runId: string): Promise<TrainData | null> {
  const snap = await openSnapshot<CacheMeta>(store, `${runId}/cache`);
  if (!snap) return null;
  const m = snap.meta;
  const read = async (k: string) => asF32(await snap.read(k));
  const set = async (p: string, n: number) => {
    const out: TrainSample[] = [];
    for (let i = 0; i < n; i++) {
      const has = (k: string) => snap.names.includes(`${p}${i}-${k}`);
      const ints = async (k: string) => {
        const b = await snap.read(`${p}${i}-${k}`);
        return new Int32Array(b.buffer, b.byteOffset, b.byteLength / 4);
      };
      const mask = has('mask') ? await read(`${p}${i}-mask`) : null;
      out.push({
        latent: await read(`${p}${i}-latent`),
        context: await read(`${p}${i}-context`),
        ...(has('ids') ? { ids: await ints('ids') } : {}),
        ...(has('ids2') ? { ids2: await ints('ids2') } : {}),
        ...(has('pooled') ? { pooled: await read(`${p}${i}-pooled`) } : {}),
        ...(has('timeids') ? { timeIds: await read(`${p}${i}-timeids`) } : {}),
        ...(mask ? { mask } : {}),
        ...(has('prompt') ? { prompt: new TextDecoder().decode(await snap.read(`${p}${i}-prompt`)) } : {}),
        ...(m.shapes?.[`${p}${i}`] ? { latentShape: m.shapes[`${p}${i}`] } : {}),
      });
    }
    return out;
  };
  return { latentShape: m.latentShape, contextShape: m.contextShape, instance: await set('i', m.instance), classes: await set('c', m.classes) };
}
