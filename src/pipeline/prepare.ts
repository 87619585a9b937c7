// The training run's preparation (pipeline/run.ts, TrainingRun.prepare): the model's shape for the settings'
// ranges, the prompts' token check, the photos decoded, checked and cropped (or bucketed), class images
// generated when none are given, the latents and text embeddings cached in the store (or found there, while the
// masks they were encoded with still match), what training does not use freed, and the GPU memory plan.
import type { Gpu } from '../gpu/device.ts';
import { bucketFor, bucketRegion, checkImageSet, cropPosition, prepareImage, resolveCrop, scaleCrop, type ImageSize, type RgbaImage } from '../io/image.ts';
import { prepareMask, type MaskOptions } from '../io/mask.ts';
import { CLIP_MAX_LENGTH, type ClipTokenizer } from '../io/tokenizer.ts';
import type { LoadedModel } from '../models/load.ts';
import type { Json, ModelSource } from '../models/source.ts';
import { loraTargets } from '../nn/lora.ts';
import type { ScheduleConfig } from '../sample/schedulers.ts';
import type { ChunkStore } from '../store/chunkstore.ts';
import { crc32 } from '../store/chunkstore.ts';
import { encodeTrainData, generateClassImage, loadTrainData, saveTrainData, type PreparedSet } from '../train/preprocess.ts';
import { preparedTimeIds } from '../train/conditioning.ts';
import { planBaseWeights, trainableShapes, type BasePlan } from '../train/plan.ts';
import { quantizeWeights } from '../ops/int8.ts';
import type { Tensor } from '../gpu/tensor.ts';
import type { DreamBoothTrainer, TrainData, TrainSettings } from '../train/trainer.ts';
import { formatBytes } from '../util/bytes.ts';
import { phaseTicker } from './progress.ts';
import type { ImageInput, PlanSummary, RunHost, RunInput } from './run-host.ts';
import { RunError, type ModelShape, type RunSettings } from './settings.ts';

/** The model's shape as the settings see it, from its configs and tensor shapes (nothing on the GPU yet). */
export function modelShapeOf(source: ModelSource, withTextEncoder: boolean): ModelShape {
  const blocks = (c: Json) => (Array.isArray(c.block_out_channels) ? c.block_out_channels.length : 1);
  const resolutionFactor = 2 ** (blocks(source.configs.vae) - 1) * 2 ** (blocks(source.configs.unet) - 1);
  let maxRank = Infinity;
  const narrowest = (kind: 'unet' | 'text_encoder', shapes: Map<string, readonly number[]>) => {
    for (const layer of loraTargets(kind, shapes.keys())) {
      const w = shapes.get(`${layer}.weight`);
      if (w)
        maxRank = Math.min(
          maxRank,
          w[0],
          w.slice(1).reduce((a, b) => a * b, 1),
        );
    }
  };
  narrowest('unet', source.shapes('unet'));
  if (withTextEncoder) narrowest('text_encoder', source.shapes('text_encoder'));
  return { resolutionFactor, maxRank: Number.isFinite(maxRank) ? maxRank : 0 };
}

/** The prompt, checked: not empty; past the text encoder's 75 tokens, a warning that names the words cut. */
export function promptWarning(tokenizer: ClipTokenizer, prompt: string, what: string): string | null {
  const ids = tokenizer.encode(prompt);
  const keep = CLIP_MAX_LENGTH - 2;
  if (ids.length <= keep) return null;
  const cut = tokenizer.decode(ids.slice(keep)).trim();
  return `${what} is ${ids.length} tokens; the text encoder reads only the first ${keep}, so "${cut}" is cut: shorten it`;
}

function tensorBytes(ws: Iterable<{ byteSize: number }>): number {
  let n = 0;
  for (const t of ws) n += t.byteSize;
  return n;
}

/** The instance photos' largest aspect-ratio bucket (by latent area), for the plan; none when all are square. */
function largestBucket(data: TrainData): { instanceShape?: [number, number, number] } {
  const shapes = data.instance.map((x) => x.latentShape).filter((s): s is [number, number, number] => !!s);
  if (!shapes.length) return {};
  return { instanceShape: shapes.reduce((a, b) => (b[1] * b[2] > a[1] * a[2] ? b : a)) };
}

/**
 * The run's training data: its cached latents and embeddings when the store has them (encoded with the masks
 * the photos have now), else the photos (and class images, given or generated) prepared, encoded and cached.
 */
export async function cachedTrainData(
  host: RunHost,
  run: RunInput,
  source: ModelSource,
  model: LoadedModel,
  tokenizer: ClipTokenizer,
  schedule: ScheduleConfig,
): Promise<TrainData> {
  const { gpu, store, emit } = host;
  const s = run.settings;
  // The cached latents hold the masks as they were when encoded: a mask painted, changed or removed since
  // (a resumed run) encodes the photos again.
  const masks = await maskFingerprint(run.images);
  let data = await loadTrainData(store, run.runId);
  if (
    data &&
    !(await cachedMasksMatch(
      store,
      run.runId,
      masks,
      run.images,
      data.instance.some((x) => x.mask),
    ))
  ) {
    emit({ type: 'phase', phase: 'encoding', message: 'A mask changed since the photos were encoded: encoding them again' });
    data = null;
  }
  if (!data) {
    const step = s.aspect === 'bucket' ? modelShapeOf(source, false).resolutionFactor : null;
    const instance = await prepareSet(host, tokenizer, run.images, run.prompt, s.resolution, s.flip, 'images', step);
    let classes: PreparedSet | null = null;
    if (s.priorPreservation) {
      if (run.classImages.length) classes = await prepareSet(host, tokenizer, run.classImages, s.classPrompt, s.resolution, false, 'class-images', step);
      else classes = await generateClassImages(host, model, tokenizer, schedule, s);
    }
    // The first image compiles the VAE encoder's pipelines: the time left comes from the ones after it.
    const tick = phaseTicker('Encoding with the VAE and the text encoder: image', instance.images.length + (classes?.images.length ?? 0), (message, r) =>
      emit({ type: 'phase', phase: 'encoding', message, ...r }),
    );
    tick(0);
    data = await encodeTrainData(gpu, model, tokenizer, s.resolution, instance, classes, (done) => tick(done));
    await saveTrainData(store, run.runId, data);
    await store.write(masksKey(run.runId), new TextEncoder().encode(masks));
  }
  return data;
}

/**
 * The GPU memory plan for the prepared data under the budget less what samples keep (reported as a 'plan'
 * event; refused when it does not fit), written into `settings` (activation checkpointing, resident chunks,
 * fused updates). Call after releaseFor: the bytes kept for samples are what is still on the GPU.
 */
export async function planRun(
  host: RunHost,
  s: RunSettings,
  /** SDXL's second text encoder, when present, is kept and planned like the first. */
  model: Pick<LoadedModel, 'unet' | 'vae' | 'textEncoder'> & { textEncoder2?: LoadedModel['textEncoder'] },
  data: TrainData,
  settings: TrainSettings,
  schedule: ScheduleConfig,
): Promise<PlanSummary> {
  const { gpu, emit } = host;
  const sampling = s.sampleEvery > 0;
  const factor = 2 ** (model.vae.config.blockOutChannels.length - 1);
  const textBytes = tensorBytes(model.textEncoder.weights.values()) + tensorBytes(model.textEncoder2?.weights.values() ?? []);
  const samplingBytes = sampling ? tensorBytes(model.vae.weights.values()) + (settings.textEncoderLora ? 0 : textBytes) : 0;

  emit({ type: 'phase', phase: 'planning', message: 'Planning GPU memory' });
  const planModel = {
    config: model.unet.config,
    dtype: gpu.computeDType,
    schedule,
    textEncoder: settings.textEncoderLora ? model.textEncoder.config : undefined,
    textEncoder2: settings.textEncoderLora ? model.textEncoder2?.config : undefined,
  };
  const plan: BasePlan = await planBaseWeights(
    host.dryRunGpu,
    planModel,
    {
      latentShape: data.latentShape,
      contextShape: data.contextShape,
      withClass: data.classes.length > 0,
      vaeFactor: factor,
      masked: data.instance.some((x) => x.mask),
      ...largestBucket(data),
    },
    settings,
    s.budgetBytes - samplingBytes,
    s.baseWeights,
  );
  const trainableParams = trainableShapes(planModel, settings).reduce((a, t) => a + t.shape.reduce((x, y) => x * y, 1), 0);
  const cacheBytes =
    (data.instance.length + data.classes.length) * 4 * (data.latentShape.reduce((a, b) => a * b, 1) + data.contextShape[0] * data.contextShape[1]);
  const summary: PlanSummary = {
    peakBytes: plan.peakBytes + samplingBytes,
    budgetBytes: s.budgetBytes,
    activationCheckpointing: plan.activationCheckpointing,
    residentChunks: plan.residentChunks,
    fusedUpdates: plan.fusedUpdates,
    chunks: plan.chunks,
    samplingBytes,
    trainableParams,
    storageNeedBytes: storageNeed(trainableParams, cacheBytes),
    baseWeights: plan.baseWeights,
    baseWeightsReason: plan.baseWeightsReason,
    ...(plan.message
      ? { message: plan.message + (samplingBytes ? ` (plus ${formatBytes(samplingBytes)} kept for samples: set samples to 0 to free it)` : '') }
      : {}),
  };
  emit({ type: 'plan', plan: summary });
  if (!plan.fits) throw new RunError(summary.message ?? 'the run does not fit the GPU memory budget');
  settings.activationCheckpointing = plan.activationCheckpointing;
  settings.residentChunks = plan.residentChunks;
  settings.fusedUpdates = plan.fusedUpdates;
  return summary;
}

/**
 * The frozen UNet weights in the storage the plan chose: with int8 each weight that round-trips within its
 * tolerance is stored in int8 (src/ops/int8.ts), the others stay f16 and are named in the log.
 */
export async function storeBaseWeights(host: RunHost, summary: PlanSummary, weights: Map<string, Tensor>): Promise<void> {
  if (summary.baseWeights !== 'int8') return;
  const r = await quantizeWeights(host.gpu, weights);
  const kept = r.kept.length
    ? `; ${r.kept.length} kept in f16 (they would not round-trip within 2 %: ${r.kept.slice(0, 3).join(', ')}${r.kept.length > 3 ? ', ...' : ''})`
    : '';
  host.emit({ type: 'phase', phase: 'planning', message: `Base weights: ${summary.baseWeightsReason}: ${r.int8} UNet weights in int8${kept}` });
}

/** Decodes, checks and crops one set of photos (instance or class); `flip` adds mirrored copies. */
export async function prepareSet(
  host: RunHost,
  tokenizer: ClipTokenizer,
  items: ImageInput[],
  prompt: string,
  resolution: number,
  flip: boolean,
  what: 'images' | 'class-images',
  /** Aspect-ratio buckets with sides multiples of this (the model's factor); null: square crops. */
  bucketStep: number | null = null,
): Promise<PreparedSet> {
  const label = what === 'images' ? 'photos' : 'class images';
  const decoded: { item: ImageInput; img: RgbaImage & { original?: ImageSize } }[] = [];
  for (let i = 0; i < items.length; i++) {
    host.emit({ type: 'phase', phase: 'images', message: `Reading ${label}: ${items[i].name}`, done: i, total: items.length });
    const { pixels, blob, name } = items[i];
    if (!pixels && !blob) throw new RunError(`${name}: the image has neither a file nor pixels`);
    decoded.push({ item: items[i], img: pixels ?? (await host.decode(blob!, name, resolution)) });
  }
  // A crop the host gives was chosen by the user (the studio sends one only when the slider moved): no
  // "not square" note for it.
  const report = checkImageSet(
    decoded.map(({ item, img }) => ({ name: item.name, ...(img.original ?? img), ...(item.crop ? { crop: item.crop } : {}) })),
    { resolution, buckets: bucketStep !== null },
  );
  for (const w of report.warnings) host.emit({ type: 'warning', message: w });
  if (report.errors.length) throw new RunError(report.errors.join('; '));
  const set: PreparedSet = { images: [], prompts: [] };
  for (const { item, img } of decoded) {
    const crop = item.crop && img.original ? scaleCrop(item.crop, img.original, img) : (item.crop ?? 'center');
    const caption = item.caption?.trim();
    const w = caption ? promptWarning(tokenizer, caption, `the caption of ${item.name}`) : null;
    if (w) host.emit({ type: 'warning', message: w });
    if (item.mask && !item.mask.pixels && !item.mask.blob) throw new RunError(`${item.mask.name}: the mask has neither a file nor pixels`);
    const maskPixels = item.mask ? (item.mask.pixels ?? (await host.decode(item.mask.blob!, item.mask.name, resolution))) : null;
    // A bucket: the photo's own aspect ratio at about the square's pixel count, from the largest region of that
    // shape (placed where a chosen square crop sits along the long side, else centred).
    const upright = img.original ?? img;
    const size = bucketStep !== null ? bucketFor(upright, resolution, bucketStep) : null;
    const bucket = size ? { size, region: bucketRegion(img, size, item.crop ? cropPosition(upright, item.crop) : 0.5) } : undefined;
    // SDXL's time ids (train/conditioning.ts): the photo's size, where its crop starts, the size it trains at.
    const square = bucket ? null : resolveCrop(img, crop, item.name);
    const region = bucket?.region ?? { x: square!.x, y: square!.y, width: square!.size, height: square!.size };
    for (const f of flip ? [false, true] : [false]) {
      set.images.push(prepareImage(img, { resolution, crop, flip: f, name: item.name, ...(bucket ? { bucket } : {}) }));
      set.prompts.push(caption || prompt);
      (set.timeIds ??= []).push(preparedTimeIds(img, img.original, region, size ?? { width: resolution, height: resolution }, f));
      (set.sizes ??= []).push(size);
      const maskOpts: MaskOptions = { resolution, crop, flip: f, photoName: item.name, maskName: item.mask?.name ?? '', ...(bucket ? { bucket } : {}) };
      (set.masks ??= []).push(maskPixels ? prepareMask(maskPixels, img, maskOpts) : null);
    }
  }
  return set;
}

/** Prior-preservation images from the base model itself (what diffusers' train_dreambooth does). */
async function generateClassImages(
  host: RunHost,
  model: LoadedModel,
  tokenizer: ClipTokenizer,
  schedule: ScheduleConfig,
  s: RunSettings,
): Promise<PreparedSet> {
  const set: PreparedSet = { images: [], prompts: [] };
  // The first image compiles the UNet's and the VAE decoder's pipelines: the time left comes from the ones after it.
  const tick = phaseTicker(`Generating class images of "${s.classPrompt}": image`, s.classCount, (message, r) =>
    host.emit({ type: 'phase', phase: 'class-images', message, ...r }),
  );
  for (let i = 0; i < s.classCount; i++) {
    tick(i);
    set.images.push(
      await generateClassImage(host.gpu, model, tokenizer, schedule, {
        prompt: s.classPrompt,
        seed: s.seed,
        index: i,
        steps: s.classSteps,
        resolution: s.resolution,
      }),
    );
    set.prompts.push(s.classPrompt);
  }
  return set;
}

/** Frees what training does not use: the VAE encoder always, the rest unless samples (or TE LoRA) need it. */
export function releaseFor(
  gpu: Gpu,
  model: Pick<LoadedModel, 'vae' | 'textEncoder'> & { textEncoder2?: LoadedModel['textEncoder'] },
  sampling: boolean,
  keepTextEncoder: boolean,
): void {
  const drop = (ws: Map<string, { byteSize: number }>, keep: (n: string) => boolean) => {
    for (const [n, t] of ws)
      if (!keep(n)) {
        gpu.free(t as never);
        ws.delete(n);
      }
  };
  drop(model.vae.weights, (n) => sampling && !/^(encoder|quant_conv)\./.test(n));
  drop(model.textEncoder.weights, () => sampling || keepTextEncoder);
  if (model.textEncoder2) drop(model.textEncoder2.weights, () => sampling || keepTextEncoder);
}

/** Store key of the fingerprint of the masks the cached latents were encoded with (maskFingerprint's text). */
/**
 * A new trainer resumed from the store's last checkpoint, if any (the host told); a checkpoint past the steps asked
 * for is refused (the trainer destroyed); then the run says it is ready.
 */
export async function resumeTrainer(emit: RunHost['emit'], trainer: DreamBoothTrainer, steps: number): Promise<void> {
  if (await trainer.resume()) emit({ type: 'resumed', step: trainer.step, losses: [...trainer.losses], validation: [...trainer.validation] });
  if (trainer.step > steps) {
    const step = trainer.step;
    trainer.destroy();
    throw new RunError(`this run's checkpoint is at step ${step}, past the ${steps} steps asked for: ask for at least ${step} steps to continue it`);
  }
  emit({ type: 'phase', phase: 'ready', message: trainer.step ? `Ready to continue from step ${trainer.step}` : 'Ready to train' });
}

export const masksKey = (runId: string) => `${runId}/cache-masks`;

/** Which photos have masks and what each mask is (its bytes' CRC-32): the cached latents' validity. */
export async function maskFingerprint(images: ImageInput[]): Promise<string> {
  const parts: string[] = [];
  for (const img of images) {
    const m = img.mask;
    if (!m) parts.push(`${img.id}:-`);
    else if (m.pixels) {
      const px = m.pixels.data;
      parts.push(`${img.id}:${m.pixels.width}x${m.pixels.height}:${crc32(new Uint8Array(px.buffer, px.byteOffset, px.byteLength)).toString(16)}`);
    } else if (m.blob) parts.push(`${img.id}:${crc32(new Uint8Array(await m.blob.arrayBuffer())).toString(16)}`);
    else parts.push(`${img.id}:?`);
  }
  return parts.join(',');
}

/**
 * Whether the cached latents were encoded with these masks. A cache from before the fingerprint was kept
 * counts as matching when neither it nor the photos have masks.
 */
export async function cachedMasksMatch(store: ChunkStore, runId: string, masks: string, images: ImageInput[], cacheHasMasks: boolean): Promise<boolean> {
  const kept = await store.read(masksKey(runId));
  if (kept) return new TextDecoder().decode(kept) === masks;
  return !cacheHasMasks && !images.some((i) => i.mask);
}

/** Store key of a run's start time (ISO 8601 text). */
const startedKey = (runId: string) => `${runId}/started`;

/**
 * When run `runId` first started: the time kept in the store, or `now` (then written there) for a new run or
 * one from before the time was kept. Unreadable text counts as absent.
 */
export async function runStartedAt(store: ChunkStore, runId: string, now: Date): Promise<Date> {
  const kept = await store.read(startedKey(runId));
  const t = kept ? new Date(new TextDecoder().decode(kept)) : null;
  if (t && Number.isFinite(t.getTime())) return t;
  await store.write(startedKey(runId), new TextEncoder().encode(now.toISOString()));
  return now;
}

/**
 * About what a run keeps in storage: the cached latents and embeddings, and the fp32 optimizer state
 * (master weights, first and second moments: 12 bytes per trained parameter) twice over, since the last
 * checkpoint's version stays pinned while the next is written.
 */
export function storageNeed(trainableParams: number, cacheBytes: number): number {
  return cacheBytes + 2 * 12 * trainableParams;
}
