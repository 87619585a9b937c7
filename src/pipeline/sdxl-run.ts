// SDXL runs through the one pipeline (run.ts's TrainingRun, for `cli train` and the studio's worker alike):
//   prepare: the model detected from the opened folder or file (models/sdxl.ts), both tokenizers, the settings
//            checked against its shape (LoRA only: a full SDXL fine-tune is not offered), the photos prepared
//            at SDXL's aspect buckets (kohya's 64 px steps at SDXL's resolutions) with each one's time ids,
//            latents (f32 VAE) and both encoders' embeddings cached in the store, class images drawn by the
//            base when none are given, the plan (prepare.ts planRun), the trainer with the UNet's and
//            optionally both text encoders' adapters, resumed from the store's last checkpoint;
//   sample / try it: txt2imgSdxl with the run's LoRA scale (the base: the same weights without adapters);
//   export: the SDXL kohya LoRA (lora_unet_ in SGM names, lora_te1_, lora_te2_) or diffusers' SDXL LoRA.
import type { Gpu } from '../gpu/device.ts';
import type { Tensor } from '../gpu/tensor.ts';
import type { ByteSink } from '../io/safetensors.ts';
import { ClipTokenizer, type ClipTokenizerFiles } from '../io/tokenizer.ts';
import { writeSdxlKohyaLora, writeSdxlPeftLora, type SdxlLoraAdapters } from '../export/lora-sdxl.ts';
import type { TensorProvider } from '../io/tensor-provider.ts';
import {
  isSdxlDiffusers,
  isSdxlSingleFile,
  loadSdxl,
  openSdxlDiffusers,
  openSdxlSingleFile,
  SDXL_COMPONENTS,
  type LoadedSdxl,
  type SdxlComponent,
  type SdxlSource,
} from '../models/sdxl.ts';
import { readJsonFile, tokenizerFilesFrom } from '../models/source.ts';
import { ModelError } from '../models/detect.ts';
import { inspectSdxl } from '../models/sdxl-inspect.ts';
import { loraTargets } from '../nn/lora.ts';
import { SD_SCHEDULE, type ScheduleConfig } from '../sample/schedulers.ts';
import { txt2imgSdxl } from '../sample/txt2img-sdxl.ts';
import { effectiveScheduler } from '../train/lr-schedule.ts';
import { loadTrainData, saveTrainData, type PreparedSet } from '../train/preprocess.ts';
import { encodeSdxlTrainData, generateSdxlClassImage } from '../train/preprocess-sdxl.ts';
import { TEXT_ENCODER_2_PREFIX } from '../train/trainable.ts';
import { DreamBoothTrainer, type TrainData, type TrainSettings } from '../train/trainer.ts';
import {
  cachedMasksMatch,
  maskFingerprint,
  masksKey,
  planRun,
  prepareSet,
  promptWarning,
  releaseFor,
  resumeTrainer,
  runStartedAt,
  storeBaseWeights,
} from './prepare.ts';
import { phaseTicker } from './progress.ts';
import type { OpenedModel, PlanSummary, RunHost, RunInput } from './run-host.ts';
import { checkTryIt, tryItResult, tryItSampling, uploadPart, withoutAdapters, type TryItOptions, type TryItResult, type TryItRun } from './tryit.ts';
import { flagName, RunError, validateForModel, type ModelShape } from './settings.ts';
import type { ExportFormat } from './run-export.ts';

/** An SDXL run's model: its weights, where they came from (kept open: try it re-reads parts), both tokenizers. */
export interface SdxlParts {
  model: LoadedSdxl;
  source: SdxlSource;
  tokenizers: [ClipTokenizer, ClipTokenizer];
}

/** Whether the opened model is SDXL (headers and configs only). */
export async function openedIsSdxl(opened: OpenedModel): Promise<boolean> {
  if (opened.kind === 'single-file') return isSdxlSingleFile(opened.file.names);
  const r = opened.reader;
  const json = async (p: string) => ((await r.exists(p)) ? await readJsonFile(r, p) : undefined);
  return isSdxlDiffusers(await json('model_index.json'), await json('unet/config.json'));
}

/** Tokenizer 2's files: the host's, else a diffusers folder's tokenizer_2/. */
async function tokenizer2Files(opened: OpenedModel): Promise<ClipTokenizerFiles> {
  if (opened.tokenizer2) return opened.tokenizer2;
  const files = opened.kind === 'diffusers' ? await tokenizerFilesFrom(opened.reader, 'tokenizer_2/') : null;
  if (!files)
    throw new RunError(
      `${opened.name}: an SDXL model needs its second tokenizer (tokenizer_2/ with tokenizer.json, or vocab.json and merges.txt)${opened.kind === 'single-file' ? ': a single file carries none, give the tokenizer_2 files' : ''}`,
    );
  return files;
}

/** The model's shape for the settings' range checks: its resolution factor and the narrowest adapted layer. */
export function sdxlModelShape(source: SdxlSource, withTextEncoders: boolean): ModelShape {
  const blocks = (c: SdxlComponent) => {
    const b = source.configs[c].block_out_channels;
    return Array.isArray(b) ? b.length : 1;
  };
  let maxRank = Infinity;
  const narrowest = (kind: 'unet' | 'text_encoder', shapes: Map<string, readonly number[]>) => {
    for (const layer of loraTargets(kind, shapes.keys())) {
      const w = shapes.get(`${layer}.weight`);
      if (w) maxRank = Math.min(maxRank, w[0], w[1]);
    }
  };
  narrowest('unet', source.shapes('unet'));
  if (withTextEncoders) for (const c of ['text_encoder', 'text_encoder_2'] as const) narrowest('text_encoder', source.shapes(c));
  return { resolutionFactor: 2 ** (blocks('vae') - 1) * 2 ** (blocks('unet') - 1), maxRank: Number.isFinite(maxRank) ? maxRank : 0 };
}

/**
 * The buckets' side step: kohya's bucket_reso_steps 64 at SDXL's resolutions (512 px and up, so 1024 px gives
 * SDXL's 1024x1024, 1152x896, 1216x832, 1344x768 ... list), the model's own factor below (tests' tiny models).
 */
export function sdxlBucketStep(resolution: number, factor: number): number {
  return resolution >= 512 && 64 % factor === 0 ? 64 : factor;
}

/** What a host shows of an SDXL model before a run (the studio's model summary): headers and configs only. */
export async function sdxlModelSummary(
  opened:
    | Pick<Extract<OpenedModel, { kind: 'diffusers' }>, 'kind' | 'name' | 'reader' | 'overrides'>
    | Pick<Extract<OpenedModel, { kind: 'single-file' }>, 'kind' | 'name' | 'file' | 'overrides'>,
): Promise<{ name: string; family: 'sdxl'; layout: string; prediction: string; parameters: number; resolutionFactor: number }> {
  const o = opened.overrides ? { overrides: opened.overrides } : {};
  const source = opened.kind === 'diffusers' ? await openSdxlDiffusers(opened.reader, o) : await openSdxlSingleFile(opened.file, o);
  try {
    // What the loader would refuse, refused now (a model is judged when it is chosen, not after the photos are encoded).
    const problems = inspectSdxl(source, []).problems;
    if (problems.length) throw new ModelError(problems.join('; '));
    let parameters = 0;
    for (const c of SDXL_COMPONENTS) for (const s of source.shapes(c).values()) parameters += s.reduce((a, b) => a * b, 1);
    const { resolutionFactor } = sdxlModelShape(source, false);
    return { name: opened.name, family: 'sdxl', layout: source.layout, prediction: source.prediction, parameters, resolutionFactor };
  } finally {
    if (opened.kind === 'diffusers') await source.close();
  }
}

/** Frees every weight of an SDXL model. */
export function freeSdxl(gpu: Gpu, m: LoadedSdxl): void {
  for (const part of [m.unet, m.vae, m.textEncoder, m.textEncoder2]) {
    gpu.free(...part.weights.values());
    part.weights.clear();
  }
}

/** The run's data: cached, or the photos (and class images) prepared, encoded by both encoders and cached. */
async function cachedSdxlData(host: RunHost, run: RunInput, parts: SdxlParts, schedule: ScheduleConfig, bucketStep: number | null): Promise<TrainData> {
  const { gpu, store, emit } = host;
  const s = run.settings;
  const masks = await maskFingerprint(run.images);
  const cached = await loadTrainData(store, run.runId);
  if (
    cached &&
    (await cachedMasksMatch(
      store,
      run.runId,
      masks,
      run.images,
      cached.instance.some((x) => x.mask),
    ))
  )
    return cached;
  if (cached) emit({ type: 'phase', phase: 'encoding', message: 'A mask changed since the photos were encoded: encoding them again' });
  const [tok1] = parts.tokenizers;
  const instance = await prepareSet(host, tok1, run.images, run.prompt, s.resolution, s.flip, 'images', bucketStep);
  let classes: PreparedSet | null = null;
  if (s.priorPreservation && run.classImages.length)
    classes = await prepareSet(host, tok1, run.classImages, s.classPrompt, s.resolution, false, 'class-images', bucketStep);
  else if (s.priorPreservation) {
    classes = { images: [], prompts: [] };
    const tick = phaseTicker(`Generating class images of "${s.classPrompt}": image`, s.classCount, (message, r) =>
      emit({ type: 'phase', phase: 'class-images', message, ...r }),
    );
    for (let i = 0; i < s.classCount; i++) {
      tick(i);
      const o = { prompt: s.classPrompt, seed: s.seed, index: i, steps: s.classSteps, resolution: s.resolution };
      classes.images.push(await generateSdxlClassImage(gpu, parts.model, parts.tokenizers, schedule, o));
      classes.prompts.push(s.classPrompt);
    }
  }
  const tick = phaseTicker('Encoding with the VAE and both text encoders: image', instance.images.length + (classes?.images.length ?? 0), (message, r) =>
    emit({ type: 'phase', phase: 'encoding', message, ...r }),
  );
  tick(0);
  const data = await encodeSdxlTrainData(gpu, parts.model, parts.tokenizers, s.resolution, instance, classes, (done) => tick(done));
  await saveTrainData(store, run.runId, data);
  await store.write(masksKey(run.runId), new TextEncoder().encode(masks));
  return data;
}

/**
 * TrainingRun.prepare for an SDXL model (see the file's head): everything up to a trainer ready at its first
 * (or resumed) step. A refusal leaves nothing on the GPU and closes the source.
 */
export async function prepareSdxlRun(
  host: RunHost,
  opened: OpenedModel,
  run: RunInput,
  settings: TrainSettings,
  preparedFrom: Date,
): Promise<{ parts: SdxlParts; schedule: ScheduleConfig; trainer: DreamBoothTrainer; summary: PlanSummary; startedAt: Date }> {
  const { gpu, store, emit } = host;
  const name = host.settingName ?? flagName;
  const s = run.settings;
  if (s.mode !== 'lora')
    throw new RunError(`${opened.name} is an SDXL model: SDXL trains LoRA adapters here (a full SDXL fine-tune is not offered); set ${name('mode')} to lora`);
  if (s.captionDropout > 0 || s.shuffleTags)
    throw new RunError(
      `${opened.name} is an SDXL model: ${name(s.shuffleTags ? 'shuffleTags' : 'captionDropout')} is for SD 1.x/2.x runs here (SDXL trains the cached captions as they are); leave it out`,
    );
  const tokenizers: [ClipTokenizer, ClipTokenizer] = [ClipTokenizer.fromFiles(opened.tokenizer), ClipTokenizer.fromFiles(await tokenizer2Files(opened))];
  const o = opened.overrides ? { overrides: opened.overrides } : {};
  const source = opened.kind === 'diffusers' ? await openSdxlDiffusers(opened.reader, o) : await openSdxlSingleFile(opened.file, o);
  let model: LoadedSdxl | null = null;
  try {
    const shape = sdxlModelShape(source, settings.textEncoderLora);
    validateForModel(s, shape, name);
    model = await loadSdxl(gpu, source, gpu.computeDType);
    const parts: SdxlParts = { model, source, tokenizers };
    // SDXL's training schedule is SD's (scaled_linear 0.00085..0.012 over 1000 steps); the prediction type is the model's.
    const schedule: ScheduleConfig = { ...SD_SCHEDULE, prediction: source.prediction };
    for (const [text, what] of [
      [run.prompt, 'the instance prompt'],
      [s.priorPreservation ? s.classPrompt : '', 'the class prompt'],
      [s.sampleEvery > 0 ? s.samplePrompt : '', 'the sample prompt'],
    ]) {
      const w = text ? promptWarning(tokenizers[0], text, what) : null;
      if (w) emit({ type: 'warning', message: w });
    }
    const bucketStep = s.aspect === 'bucket' ? sdxlBucketStep(s.resolution, shape.resolutionFactor) : null;
    const data = await cachedSdxlData(host, run, parts, schedule, bucketStep);
    releaseFor(gpu, model, s.sampleEvery > 0, settings.textEncoderLora);
    const summary = await planRun(host, s, model, data, settings, schedule);
    await storeBaseWeights(host, summary, model.unet.weights);
    gpu.trimPool();
    gpu.allocator.reserveLimit = s.budgetBytes;
    const startedAt = await runStartedAt(store, run.runId, preparedFrom);
    const te = settings.textEncoderLora ? { textEncoder: model.textEncoder, textEncoder2: model.textEncoder2 } : {};
    const trainer = await DreamBoothTrainer.create(
      gpu,
      { config: model.unet.config, weights: model.unet.weights, schedule, ...te },
      data,
      settings,
      store,
      run.runId,
    );
    await resumeTrainer(emit, trainer, s.steps);
    return { parts, schedule, trainer, summary, startedAt };
  } catch (e) {
    if (model) freeSdxl(gpu, model);
    await source.close();
    throw e;
  }
}

/** The trained adapters as the SDXL exporters take them: UNet, text encoder 1 (text_model.*), 2 (text_encoder_2.*). */
export async function sdxlAdapters(trainer: DreamBoothTrainer, model: LoadedSdxl, o: { ema?: boolean } = {}): Promise<SdxlLoraAdapters> {
  // --export-ema: the EMA of the weights instead of the last step's.
  const values = await trainer.trainedValues(o);
  const provider = (keep: (n: string) => boolean, strip = ''): TensorProvider | undefined => {
    const names = [...values.keys()].filter(keep);
    if (!names.length) return undefined;
    return {
      names: () => names.map((n) => n.slice(strip.length)),
      shape: (n) => [...trainer.trainable.get(strip + n)!.shape],
      read: async (n) => values.get(strip + n)!,
    };
  };
  const c = model.unet.config;
  const te1 = provider((n) => n.startsWith('text_model.'));
  const te2 = provider((n) => n.startsWith(TEXT_ENCODER_2_PREFIX), TEXT_ENCODER_2_PREFIX);
  return {
    rank: trainer.settings.rank,
    alpha: trainer.settings.alpha,
    layout: { blocks: c.blockOutChannels.length, layersPerBlock: c.layersPerBlock, downAttention: c.downAttention, upAttention: c.upAttention },
    unet: provider((n) => !n.startsWith('text_model.') && !n.startsWith(TEXT_ENCODER_2_PREFIX))!,
    ...(te1 ? { textEncoder: te1 } : {}),
    ...(te2 ? { textEncoder2: te2 } : {}),
  };
}

/** Streams an SDXL run's LoRA in `format` (kohya's SDXL layout or diffusers'); full formats are refused. */
export async function exportSdxlRun(
  r: { emit: RunHost['emit']; parts: SdxlParts; opened: OpenedModel; trainer: DreamBoothTrainer; run: RunInput; startedAt: Date },
  format: ExportFormat,
  sink: ByteSink,
): Promise<void> {
  if (format !== 'lora-kohya' && format !== 'lora-diffusers')
    throw new RunError(`${format}: an SDXL run exports its LoRA (lora-kohya or lora-diffusers); full SDXL checkpoints are not written`);
  r.emit({ type: 'phase', phase: 'exporting', message: `Writing ${format}` });
  const t = r.trainer;
  const s = r.run.settings;
  const info = {
    prediction: r.parts.model.prediction,
    resolution: s.resolution,
    steps: t.step,
    lr: s.lr,
    ...(s.trainTextEncoder && s.textEncoderLr > 0 ? { textEncoderLr: s.textEncoderLr } : {}),
    lrScheduler: effectiveScheduler(s.lrScheduler, s.lrWarmup),
    lrWarmup: s.lrWarmup,
    instancePrompt: r.run.prompt,
    ...(s.priorPreservation ? { classPrompt: s.classPrompt, numClassImages: t.data.classes.length } : {}),
    numImages: t.data.instance.length,
    // each photo's own caption (or the prompt) for ss_tag_frequency, as the SD 1 export counts them
    captions: t.data.instance.map((x) => x.prompt ?? r.run.prompt),
    baseModelName: r.opened.name,
    title: `${r.opened.name} dreambooth lora`,
    date: new Date(),
    startedAt: r.startedAt,
    seed: s.seed,
  };
  const adapters = await sdxlAdapters(t, r.parts.model, { ema: s.exportEma });
  await (format === 'lora-kohya' ? writeSdxlKohyaLora : writeSdxlPeftLora)(sink, adapters, info);
}

/**
 * Try it on an SDXL LoRA run (pipeline/tryit.ts's counterpart): the fine-tuned model at the run's LoRA scale
 * times `strength`, then the base (the same weights without adapters) for the same seed. The VAE decoder and
 * text encoders come from the source for the call when the run released them.
 */
export async function tryItSdxl(
  gpu: Gpu,
  parts: SdxlParts,
  run: Pick<TryItRun, 'schedule' | 'step' | 'appliedSteps' | 'loraScale' | 'resolution' | 'baseName' | 'tunedName' | 'tunedHash'>,
  o: TryItOptions,
): Promise<TryItResult> {
  const { model } = parts;
  checkTryIt({ model, mode: 'lora', step: run.step, appliedSteps: run.appliedSteps, resolution: run.resolution }, o);
  const t0 = performance.now();
  const temporary: Map<string, Tensor>[] = [];
  const have = async (w: Map<string, Tensor>, c: SdxlComponent, keep?: (n: string) => boolean) => {
    if (w.size) return w;
    const up = await uploadPart(gpu, parts.source, c, keep, c === 'vae' ? 'f32' : gpu.computeDType);
    temporary.push(up);
    return up;
  };
  try {
    const vae = await have(model.vae.weights, 'vae', (n) => !/^(encoder|quant_conv)\./.test(n));
    const te1 = await have(model.textEncoder.weights, 'text_encoder');
    const te2 = await have(model.textEncoder2.weights, 'text_encoder_2');
    const strength = o.strength ?? 1;
    const steps = o.steps;
    const draw = (strip: boolean, loraScale: number, offset: number) => {
      const w = (m: Map<string, Tensor>) => (strip ? withoutAdapters(m) : m);
      const m: LoadedSdxl = {
        ...model,
        unet: { config: model.unet.config, weights: w(model.unet.weights) },
        vae: { config: model.vae.config, weights: vae },
        textEncoder: { config: model.textEncoder.config, weights: w(te1) },
        textEncoder2: { config: model.textEncoder2.config, weights: w(te2) },
      };
      return txt2imgSdxl(gpu, m, parts.tokenizers, tryItSampling(o, run.resolution, run.schedule, loraScale, offset));
    };
    o.onStep?.(0, 2 * steps);
    const tuned = await draw(false, run.loraScale * strength, 0);
    const base = await draw(true, 1, steps);
    return tryItResult(run, o, tuned, base, strength, t0);
  } finally {
    for (const w of temporary) gpu.free(...w.values());
    gpu.trimPool();
  }
}
