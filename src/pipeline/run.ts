// The one training-run pipeline, host-neutral: `cli train` (Node, Dawn, a folder store) and the studio's Web
// Worker (WebGPU, IndexedDB) both run a DreamBooth fine-tune through this file, in steps a host can drive:
//   prepare: validate the settings (schema, then against the model's shape, before any image is read), load
//            the model, decode and crop the photos, generate class images when asked, cache latents and
//            text embeddings in the store (or find them there), free the encoders, plan placement under the
//            GPU budget (prepare.ts), build the trainer, resume from the last checkpoint when there is one;
//   train:   step until done, paused or cancelled, reporting every step (median s/step, ETA, storage),
//            sampling every N steps with a fixed seed, checkpointing on schedule and on pause; a full store
//            stops with the last checkpoint intact (RunStorageFullError);
//   export:  the four formats (kohya and PEFT LoRA, single file, diffusers zip) streamed to a ByteSink; a
//            LoRA run exported as a full model has its adapters merged (run-export.ts).
// The VAE decoder and the text encoder stay on the GPU when samples are on (their bytes come off the
// budget the planner gets); the VAE encoder leaves once the latents are cached. What the host gives and what
// the run reports are in run-host.ts.
import { GpuOutOfMemoryError } from '../gpu/errors.ts';
import type { ByteSink } from '../io/safetensors.ts';
import { ClipTokenizer } from '../io/tokenizer.ts';
import type { Family } from '../models/detect.ts';
import { loadModel, type LoadedModel } from '../models/load.ts';
import { openDiffusers, openSingleFile, type Json, type ModelSource } from '../models/source.ts';
import { scheduleFromJson, SD_SCHEDULE, type ScheduleConfig } from '../sample/schedulers.ts';
import { txt2img } from '../sample/txt2img.ts';
import { txt2imgSdxl } from '../sample/txt2img-sdxl.ts';
import type { LoadedSdxl } from '../models/sdxl.ts';
import type { ChunkStore } from '../store/chunkstore.ts';
import { StorageFullError } from '../store/chunkstore.ts';
import { captionsProcessed } from '../train/captions.ts';
import { encodePrompt } from '../train/preprocess.ts';
import { DreamBoothTrainer, VALIDATION_IMAGES, VALIDATION_T, type TrainSettings } from '../train/trainer.ts';
import { formatBytes } from '../util/bytes.ts';
import { cachedTrainData, modelShapeOf, planRun, promptWarning, releaseFor, resumeTrainer, runStartedAt, storeBaseWeights } from './prepare.ts';
import { exportFileName, exportRun, trainedLoraHash, type ExportFormat } from './run-export.ts';
import { etaText, PhaseClock } from './progress.ts';
import type { OpenedModel, PlanSummary, RunEvent, RunHost, RunInput } from './run-host.ts';
import { RunClock } from './timing.ts';
import { generateTryIt, type TryItOptions, type TryItResult } from './tryit.ts';
import { exportSdxlRun, freeSdxl, openedIsSdxl, prepareSdxlRun, sdxlAdapters, tryItSdxl, type SdxlParts } from './sdxl-run.ts';
import { sdxlKohyaLoraHash } from '../export/lora-sdxl.ts';
import { RunError, validatePrompt, validateForModel, validateSettings, flagName, trainSettings } from './settings.ts';

export type { ImageInput, MaskInput, OpenedModel, Phase, PlanSummary, RunEvent, RunHost, RunInput } from './run-host.ts';
export { DEFAULT_EXPORTS, EXPORT_FORMATS, exportFileName, type ExportFormat } from './run-export.ts';
export { maskFingerprint, modelShapeOf, promptWarning, storageNeed } from './prepare.ts';

/** Batch-1 UNet forwards one validation runs (DreamBoothTrainer.validate). */
function validationForwards(t: DreamBoothTrainer): number {
  return (Math.min(VALIDATION_IMAGES, t.data.instance.length) + Math.min(VALIDATION_IMAGES, t.data.classes.length)) * VALIDATION_T.length;
}

export { RunError };

/** The store filled up: training stopped at `step`, the last checkpoint is intact. */
export class RunStorageFullError extends RunError {
  override name = 'StorageFullError';
  constructor(
    message: string,
    readonly step: number,
    options?: { cause?: unknown },
  ) {
    super(message, options);
  }
}

/** The trainer's settings for a run's (validated) settings: the schema's entries say how (settings.ts). */
export { trainSettings };

// ---- the run ------------------------------------------------------------------------------------------

export class TrainingRun {
  private pauseAsked = false;
  private cancelAsked = false;
  /** This session's measured step, sample and checkpoint times, and the ETA from them (timing.ts). */
  private clock: RunClock;
  private running = false;

  /** The base model: SD 1.x/2.x (its source kept open) or SDXL (sdxl-run.ts). */
  readonly model: LoadedModel | LoadedSdxl;

  private constructor(
    private readonly host: RunHost,
    private readonly base: { kind: 'sd'; model: LoadedModel; source: ModelSource } | { kind: 'sdxl'; parts: SdxlParts },
    private readonly opened: OpenedModel,
    readonly tokenizer: ClipTokenizer,
    readonly schedule: ScheduleConfig,
    readonly trainer: DreamBoothTrainer,
    readonly run: RunInput,
    readonly plan: PlanSummary,
    /** When the run first started (kept in the store, so a resumed run keeps it): kohya's ss_training_started_at. */
    readonly startedAt: Date,
  ) {
    this.model = base.kind === 'sd' ? base.model : base.parts.model;
    const s = run.settings;
    this.clock = new RunClock({
      steps: s.steps,
      sampleEvery: s.sampleEvery,
      sampleSteps: s.sampleSteps,
      checkpointEvery: s.checkpointEvery,
      validateEvery: s.validateEvery,
      validationForwards: validationForwards(trainer),
    });
  }

  get step(): number {
    return this.trainer.step;
  }

  get family(): Family | 'sdxl' {
    return this.model.family;
  }

  /** Everything before the first step; resumes from the store's last checkpoint of `run.runId`. */
  static async prepare(host: RunHost, opened: OpenedModel, run: RunInput): Promise<TrainingRun> {
    const preparedFrom = new Date();
    const { gpu, emit } = host;
    const name = host.settingName ?? flagName;
    const s = run.settings;
    validateSettings(s, name);
    validatePrompt(run.prompt, 'the instance prompt');
    emit({ type: 'phase', phase: 'loading', message: `Loading ${opened.name} onto the GPU` });
    if (await openedIsSdxl(opened)) {
      const r = await prepareSdxlRun(host, opened, run, trainSettings(s), preparedFrom);
      return new TrainingRun(host, { kind: 'sdxl', parts: r.parts }, opened, r.parts.tokenizers[0], r.schedule, r.trainer, run, r.summary, r.startedAt);
    }
    const tokenizer = ClipTokenizer.fromFiles(opened.tokenizer);
    const sourceOptions = opened.overrides ? { overrides: opened.overrides } : {};
    const source = opened.kind === 'diffusers' ? await openDiffusers(opened.reader, sourceOptions) : await openSingleFile(opened.file, sourceOptions);
    let model: LoadedModel | null = null;
    try {
      // Ranges that need the model's shape, before its weights reach the GPU or any photo is read.
      validateForModel(s, modelShapeOf(source, s.mode === 'lora' && s.trainTextEncoder), name);
      model = await loadModel(gpu, source, gpu.computeDType);
      return await TrainingRun.prepareLoaded(host, opened, run, trainSettings(s), source, model, tokenizer, preparedFrom);
    } catch (e) {
      // Nothing stays on the GPU after a refusal (the store keeps what was cached, e.g. encoded latents).
      if (model) for (const part of [model.unet.weights, model.vae.weights, model.textEncoder.weights]) gpu.free(...part.values());
      await source.close();
      throw e;
    }
  }

  private static async prepareLoaded(
    host: RunHost,
    opened: OpenedModel,
    run: RunInput,
    settings: TrainSettings,
    source: ModelSource,
    model: LoadedModel,
    tokenizer: ClipTokenizer,
    preparedFrom: Date,
  ): Promise<TrainingRun> {
    const { gpu, store, emit } = host;
    const s = run.settings;
    const sampling = s.sampleEvery > 0;
    const schedule = { ...SD_SCHEDULE, ...scheduleFromJson(source.scheduler as Json, model.prediction) };
    for (const [text, what] of [
      [run.prompt, 'the instance prompt'],
      [s.priorPreservation ? s.classPrompt : '', 'the class prompt'],
      [sampling ? s.samplePrompt : '', 'the sample prompt'],
    ]) {
      const w = text ? promptWarning(tokenizer, text, what) : null;
      if (w) emit({ type: 'warning', message: w });
    }
    const data = await cachedTrainData(host, run, source, model, tokenizer, schedule);
    // The VAE encoder is done; the decoder and the text encoder stay only for samples (or text-encoder LoRA).
    // Caption dropout and tag shuffling encode a step's caption with the text encoder: it stays.
    const captions = captionsProcessed(settings.captions);
    releaseFor(gpu, model, sampling, settings.textEncoderLora || captions);
    const summary = await planRun(host, s, model, data, settings, schedule);
    await storeBaseWeights(host, summary, model.unet.weights);
    // The allocator's pool keeps freed buffers for reuse: within the budget, and without what preparation
    // (the VAE encoder, decoding) left in it.
    gpu.trimPool();
    gpu.allocator.reserveLimit = s.budgetBytes;
    // Written once the run's settings, photos and plan are known to be good (a refused run stores nothing of
    // its own), read back on every resume.
    const startedAt = await runStartedAt(store, run.runId, preparedFrom);
    const trainer = await DreamBoothTrainer.create(
      gpu,
      {
        config: model.unet.config,
        weights: model.unet.weights,
        schedule,
        textEncoder: model.textEncoder,
        ...(captions
          ? { captions: { ids: (t: string) => tokenizer.encodePadded(t), context: (t: string) => encodePrompt(gpu, model.textEncoder, tokenizer, t) } }
          : {}),
      },
      data,
      settings,
      store,
      run.runId,
    );
    await resumeTrainer(emit, trainer, s.steps);
    return new TrainingRun(host, { kind: 'sd', model, source }, opened, tokenizer, schedule, trainer, run, summary, startedAt);
  }

  pause(): void {
    this.pauseAsked = true;
  }

  cancel(): void {
    this.cancelAsked = true;
  }

  get isRunning(): boolean {
    return this.running;
  }

  /** Whether the run has reached its last step (and so may be reported done and exported as trained). */
  get finished(): boolean {
    return this.trainer.step >= this.run.settings.steps;
  }

  /**
   * Trains until the last step ('done', with a final checkpoint), a pause ('paused', checkpointed) or a
   * cancel ('cancelled': no checkpoint; the caller discards the run). A full store stops the run with the
   * last checkpoint intact (RunStorageFullError). A run none of whose steps was applied (every update
   * skipped as non-finite) is never 'done': it throws, saying why.
   */
  async train(): Promise<'done' | 'paused' | 'cancelled'> {
    if (this.running) throw new RunError('the run is already training');
    this.running = true;
    this.pauseAsked = false;
    this.cancelAsked = false;
    const { emit, store } = this.host;
    const t = this.trainer;
    const s = this.run.settings;
    try {
      // The validation at the step training starts from (step 0, or a resumed run's checkpoint, which is written
      // before that step's validation runs), unless the run has it.
      if (s.validateEvery > 0 && t.step % s.validateEvery === 0 && t.validation.at(-1)?.step !== t.step) await this.validate();
      if (t.step === 0 && s.sampleEvery > 0) await this.sample();
      while (t.step < s.steps) {
        if (this.cancelAsked) return 'cancelled';
        if (this.pauseAsked) {
          emit({ type: 'phase', phase: 'checkpoint', message: `Saving a checkpoint at step ${t.step}` });
          await this.timedCheckpoint();
          emit({ type: 'checkpoint', step: t.step });
          return 'paused';
        }
        emit(this.stepPhase());
        const t0 = performance.now();
        const r = await t.trainStep();
        if (r.warning) emit({ type: 'warning', message: r.warning });
        // trainStep checkpoints on its own schedule (settings.checkpointEvery) after timing the step: the
        // rest of its wall time is the checkpoint's.
        const checkpointed = s.checkpointEvery > 0 && r.step % s.checkpointEvery === 0;
        this.clock.recordStep(r.seconds);
        if (checkpointed) this.clock.recordCheckpoint(Math.max(0, (performance.now() - t0) / 1000 - r.seconds));
        const time = this.clock.afterStep(r.step);
        emit({
          type: 'step',
          report: r,
          steps: s.steps,
          secondsPerStep: time.secondsPerStep,
          warmupSeconds: time.warmupSeconds,
          etaSeconds: time.etaSeconds,
          provisional: time.provisional,
          storageBytes: await store.bytesUsed(),
        });
        if (checkpointed) emit({ type: 'checkpoint', step: r.step });
        if (s.validateEvery > 0 && (r.step % s.validateEvery === 0 || r.step === s.steps)) await this.validate();
        if (s.sampleEvery > 0 && (r.step % s.sampleEvery === 0 || r.step === s.steps)) await this.sample();
      }
      if (t.appliedSteps === 0)
        throw new RunError(
          `none of the ${t.step} steps changed the weights (every update was skipped: non-finite loss, gradients or weights), so there is nothing trained to export: ` +
            `lower the learning rate (${(this.host.settingName ?? flagName)('lr')}), check the model, or train in f32`,
        );
      emit({ type: 'phase', phase: 'checkpoint', message: `Saving the final checkpoint at step ${t.step}` });
      await this.timedCheckpoint();
      emit({ type: 'checkpoint', step: t.step });
      return 'done';
    } catch (e) {
      if (e instanceof StorageFullError)
        throw new RunStorageFullError(`${e.message.replace(/\.$/, '')}. Training stopped at step ${t.step}; the last checkpoint is intact.`, t.step, {
          cause: e,
        });
      if (e instanceof GpuOutOfMemoryError) throw new RunError(this.outOfMemoryMessage(e), { cause: e });
      throw e;
    } finally {
      this.running = false;
    }
  }

  /**
   * The device could not give what the plan counted on (the budget is more than the GPU has free): say what the
   * step needs and what to change.
   */
  private outOfMemoryMessage(e: GpuOutOfMemoryError): string {
    const name = this.host.settingName ?? flagName;
    const p = this.plan;
    const placement = `${p.activationCheckpointing ? 'with' : 'without'} activation checkpointing, ${p.residentChunks} of ${p.chunks} optimizer chunks on the GPU${p.fusedUpdates ? ', updates fused into the backward pass' : ''}`;
    return (
      `The GPU ran out of memory at step ${this.trainer.step + 1} (${formatBytes(e.bytes)} for ${e.tag} '${e.label}'). ` +
      `This step needs about ${formatBytes(p.peakBytes)} of GPU memory (${placement}), planned under the budget of ${formatBytes(p.budgetBytes)}, ` +
      `and the device has less free: set the GPU memory budget (${name('budgetBytes')}) below what the GPU has free (close other programs or tabs using it), ` +
      `or lower the resolution (${name('resolution')}); a smaller budget makes the plan checkpoint activations and keep optimizer chunks in storage. ` +
      `Resuming continues from the last checkpoint.`
    );
  }

  /** A checkpoint of the trainer, timed for the ETA. */
  private async timedCheckpoint(): Promise<void> {
    const t0 = performance.now();
    await this.trainer.checkpoint();
    this.clock.recordCheckpoint((performance.now() - t0) / 1000);
  }

  /**
   * The step about to train; the session's first (warm-up: it compiles the GPU pipelines, often the longest
   * wait of a run) with its estimate (timing.ts warmupEstimate) as one item, so the page shows it counting down.
   */
  private stepPhase(): RunEvent {
    const next = `Training step ${this.trainer.step + 1} of ${this.run.settings.steps}`;
    if (this.clock.warmupSeconds !== null) return { type: 'phase', phase: 'training', message: next };
    const r = new PhaseClock(1, this.clock.warmupEstimate()).at(0, 0);
    const eta = etaText(r);
    return { type: 'phase', phase: 'training', message: `${next} (warm-up: it also compiles the GPU pipelines)${eta ? ` · ${eta}` : ''}`, ...r };
  }

  /**
   * The validation loss at the current step (DreamBoothTrainer.validate), timed for the ETA: validation i of n
   * in the run's schedule (at the first step, every validateEvery steps, and after the last), with its estimate.
   */
  async validate(): Promise<void> {
    const { emit } = this.host;
    const { steps, validateEvery: every } = this.run.settings;
    const step = this.trainer.step;
    const total = Math.floor(steps / every) + 1 + (steps % every ? 1 : 0);
    const index = step === steps ? total : Math.floor(step / every) + 1;
    // Before any step is timed there is nothing to estimate from (the first estimate would read 0).
    const estimate = this.clock.validationEstimate();
    const r = new PhaseClock(1, estimate.measured || estimate.seconds > 0 ? estimate.seconds : null).at(0, 0);
    const eta = etaText(r);
    emit({
      type: 'phase',
      phase: 'validating',
      message: `Validation ${index} of ${total}: the loss at step ${step} (${validationForwards(this.trainer)} forward passes)${eta ? ` · ${eta}` : ''}`,
      ...r,
    });
    const t0 = performance.now();
    const report = await this.trainer.validate();
    const seconds = (performance.now() - t0) / 1000;
    this.clock.recordValidation(seconds);
    emit({ type: 'validation', report, seconds });
  }

  /**
   * A sample with the run's fixed seed and prompt at the current weights; reports each denoising step
   * (sample-progress, with the ETA counting down inside the sample) and its time.
   */
  async sample(): Promise<void> {
    const s = this.run.settings;
    if (!this.model.vae.weights.size || !this.model.textEncoder.weights.size) return;
    const step = this.trainer.step;
    this.host.emit({ type: 'phase', phase: 'sampling', message: `Sampling "${s.samplePrompt || this.run.prompt}" at step ${step}` });
    const t0 = performance.now();
    const progress = (denoised: number, total: number) =>
      this.host.emit({
        type: 'sample-progress',
        step,
        denoised,
        total,
        etaSeconds: this.clock.duringSample(step, denoised, total, (performance.now() - t0) / 1000).etaSeconds,
      });
    progress(0, s.sampleSteps);
    const o = {
      prompt: s.samplePrompt || this.run.prompt,
      negativePrompt: '',
      steps: s.sampleSteps,
      guidance: 7.5,
      seed: s.seed,
      width: s.resolution,
      height: s.resolution,
      sampler: 'dpm++2m' as const,
      schedule: this.schedule,
      loraScale: this.trainer.loraScale,
      onStep: progress,
    };
    const b = this.base;
    // SDXL: both tokenizers and its conditioning, at SDXL's usual guidance 5. With an EMA, at the averaged weights.
    const img = await this.trainer.withEmaWeights(() =>
      b.kind === 'sdxl'
        ? txt2imgSdxl(this.host.gpu, b.parts.model, b.parts.tokenizers, { ...o, guidance: 5 })
        : txt2img(this.host.gpu, b.model, this.tokenizer, o),
    );
    const seconds = (performance.now() - t0) / 1000;
    this.clock.recordSample(seconds);
    this.host.emit({ type: 'sample', step, png: this.host.encodePng(img.rgb, img.width, img.height), width: img.width, height: img.height, seconds });
  }

  /**
   * "Try it" (pipeline/tryit.ts): the fine-tuned model and the base model for the same prompt and seed, as PNGs
   * with A1111's parameters text. Only while the run is not training (it holds the GPU meanwhile, so train()
   * refuses); refused with no finished step. The trained state and the checkpoint are only read.
   */
  async tryIt(o: TryItOptions): Promise<TryItResult> {
    if (this.running) throw new RunError('the run is training: pause it (or let it finish) to try it, the GPU is busy with the steps');
    this.running = true;
    try {
      const s = this.run.settings;
      const b = this.base;
      const tunedName = this.exportName(s.mode === 'lora' ? 'lora-kohya' : 'full-single-file').replace(/\.safetensors$/, '');
      if (b.kind === 'sdxl') {
        const t = this.trainer;
        const run = { schedule: this.schedule, step: t.step, appliedSteps: t.appliedSteps, loraScale: t.loraScale, resolution: s.resolution };
        // The LoRA's "Lora hashes" entry, as for SD 1/2: the sshs_model_hash of the kohya file an export would write now.
        const tunedHash = await sdxlKohyaLoraHash(await sdxlAdapters(t, b.parts.model, { ema: s.exportEma }));
        return await t.withEmaWeights(() => tryItSdxl(this.host.gpu, b.parts, { ...run, baseName: this.opened.name, tunedName, tunedHash }, o));
      }
      // The LoRA's "Lora hashes" entry: the sshs_model_hash of the kohya file an export would write now.
      const tunedHash = s.mode === 'lora' ? await trainedLoraHash({ trainer: this.trainer, run: this.run }) : undefined;
      // With an EMA of the weights, the fine-tuned side is the average (what --export-ema exports).
      return await this.trainer.withEmaWeights(() =>
        generateTryIt(
          {
            gpu: this.host.gpu,
            model: b.model,
            source: b.source,
            tokenizer: this.tokenizer,
            schedule: this.schedule,
            mode: s.mode,
            step: this.trainer.step,
            appliedSteps: this.trainer.appliedSteps,
            loraScale: this.trainer.loraScale,
            resolution: s.resolution,
            baseName: this.opened.name,
            tunedName,
            tunedHash,
          },
          o,
        ),
      );
    } finally {
      this.running = false;
    }
  }

  /** The export's file name for a download (see exportFileName). */
  exportName(format: ExportFormat): string {
    return exportFileName(this.opened.name, this.run.settings.mode, this.trainer.step, format);
  }

  /** Streams the trained model in `format` to `sink` (LoRA formats for LoRA runs; full formats for both). */
  async exportTo(format: ExportFormat, sink: ByteSink): Promise<void> {
    const { host, base, opened, trainer, run, startedAt } = this;
    const emit = (e: RunEvent) => host.emit(e);
    if (base.kind === 'sdxl') await exportSdxlRun({ emit, parts: base.parts, opened, trainer, run, startedAt }, format, sink);
    else await exportRun({ gpu: host.gpu, emit, model: base.model, opened, source: base.source, trainer, run, startedAt }, format, sink);
  }

  /** Frees the GPU state (the store keeps the checkpoint). */
  async destroy(): Promise<void> {
    this.trainer.destroy();
    const b = this.base;
    if (b.kind === 'sdxl') freeSdxl(this.host.gpu, b.parts.model);
    else for (const part of [b.model.unet.weights, b.model.vae.weights, b.model.textEncoder.weights]) this.host.gpu.free(...part.values());
    this.host.gpu.trimPool(); // the freed buffers go back to the device, not to the next run's pool
    await (b.kind === 'sdxl' ? b.parts.source : b.source).close();
  }

  /** Deletes every chunk of run `runId` (a cancelled or replaced run). */
  static async discard(store: ChunkStore, runId: string): Promise<void> {
    for (const k of await store.keys(`${runId}/`)) await store.delete(k);
  }
}
