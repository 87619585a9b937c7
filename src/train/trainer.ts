// The DreamBooth training loop on the engine: cached latents and text embeddings in, UNet (LoRA adapters
// or every weight) trained with AdamW on fp32 masters, fp16 compute with a dynamic loss scale, the
// optimizer state chunked through the store under the GPU budget, checkpoints that resume bit-identically.
//
// One step (diffusers' train_dreambooth semantics):
//   batch = [instance image i] (+ [class image j] with prior preservation), i = step mod #instances
//   eps ~ N(0, I) (+ offset * N(0, 1) per sample and channel: offset noise), t ~ U{0..T-1} per sample
//   x_t = sqrt(ā_t) x0 + sqrt(1 - ā_t) eps;  target = eps, or v = sqrt(ā_t) eps - sqrt(1 - ā_t) x0
//   loss = mse(pred_inst, target_inst) + prior_weight * mse(pred_class, target_class), each sample's term
//          times its min-SNR-gamma weight when set
//   grads = d(loss * scale)/dθ;  overflow -> skip the update, halve the scale;  else AdamW with clipping
//   an update that would make a weight non-finite (a learning rate far too high) -> skip, scale kept
//   `maxConsecutiveSkips` skipped steps in a row -> TrainingStalledError (nothing is being learned)
import type { Gpu } from '../gpu/device.ts';
import type { DType, Tensor } from '../gpu/tensor.ts';
import { doraMagnitudes } from '../nn/dora.ts';
import { attachNetwork } from '../nn/lycoris.ts';
import { Tape } from '../nn/ops.ts';
import { unetForward } from '../nn/unet.ts';
import { ADAMW_DEFAULTS } from '../ops/adamw.ts';
import { DynamicLossScaler } from '../ops/lossscale.ts';
import { alphasCumprod } from '../sample/schedulers.ts';
import type { ChunkStore } from '../store/chunkstore.ts';
import { commitSnapshot, openSnapshot } from '../store/snapshot.ts';
import { scheduleFactor } from './lr-schedule.ts';
import { addNoise, velocity, weightedMse } from '../ops/loss.ts';
import { lossWeights } from './objective.ts';
import { huberCs, passLoss, HUBER_C_DEFAULT } from './loss-options.ts';
import { ReplayMismatchError, StepReplay, type ReplayStats, type StepRun } from '../gpu/replay.ts';
import { drawStepNoise, zeroTerminalSnr } from './noise.ts';
import { WeightEma, type ChunkEma } from './ema.ts';
import { StoredEma } from './ema-store.ts';
import { captionsProcessed, processCaption } from './captions.ts';
import { checkConditioning, groupWeights, passConditioning } from './conditioning.ts';
import { ChunkedAdamW } from './optimizer.ts';
import { HostOptimizer, hostOptimizerOptions, isHostOptimizer } from './host-optimizer.ts';
import { uploadPacked } from './optimizer-chunks.ts';
import { initGroup, networkSpecOf, textEncoderLrOf, trainableSpec } from './trainable.ts';
import { checkCheckpointMeta, validate, validateKnobs } from './trainer-checks.ts';
import {
  TrainingStalledError,
  VALIDATION_IMAGES,
  VALIDATION_SEED,
  VALIDATION_T,
  type CheckpointMeta,
  type StepInputs,
  type StepReport,
  type TrainData,
  type TrainerModel,
  type TrainSample,
  type TrainSettings,
  type ValidationReport,
} from './train-types.ts';
import { fromF16Bits } from '../util/half.ts';
import { Rng } from '../util/rng.ts';

export * from './train-types.ts';
export { CheckpointError } from './trainer-checks.ts';

export class DreamBoothTrainer {
  /** Steps done (applied or skipped). */
  step = 0;
  /**
   * The EMA of the trained weights (settings.ema), updated after every step; null: off. A LoRA run's is on the
   * host (WeightEma), a full fine-tune's weight-sized one in the chunk store (StoredEma, ema-store.ts).
   */
  ema: ChunkEma | null = null;
  readonly losses: number[] = [];
  readonly validation: ValidationReport[] = [];
  readonly rng: Rng;
  readonly scaler: DynamicLossScaler;
  /** Skipped steps since the last applied one, and the last one's reason. */
  private skipRun = { count: 0, last: '' };
  private readonly acp: Float64Array;
  private readonly snrAcp: Float64Array;
  private readonly dtype: DType;
  /**
   * Whether a warm step's forward and backward are replayed from a record instead of re-running the op code and the
   * tape (src/gpu/replay.ts; bit-identical): unfused steps of one UNet pass whose text encoder does not train.
   */
  stepReplay = true;
  private readonly replay: StepReplay | null;
  /** Why the replay was turned off during the current step (the step's report carries it once), else ''. */
  private replayWarning = '';

  private constructor(
    readonly gpu: Gpu,
    readonly model: TrainerModel,
    readonly data: TrainData,
    readonly settings: TrainSettings,
    readonly store: ChunkStore,
    readonly runId: string,
    /** Trainable parameter names in execution order, and their compute-dtype tensors. */
    readonly trainable: Map<string, Tensor>,
    /** AdamW (GPU kernels, chunked), or Prodigy / Adafactor on the host (LoRA). */
    private readonly opt: ChunkedAdamW | HostOptimizer,
    rng: Rng,
  ) {
    this.rng = rng;
    this.replay = gpu.dryRun ? null : new StepReplay(gpu);
    // Loss weights read the schedule's own SNR, as sd-scripts computes all_snr before the zero-terminal-SNR
    // rescale (so they stay finite at the last timestep, whose rescaled SNR is 0); noising reads the rescaled one.
    this.snrAcp = alphasCumprod(model.schedule);
    this.acp = settings.zeroTerminalSnr ? zeroTerminalSnr(this.snrAcp) : this.snrAcp;
    this.dtype = [...model.weights.values()][0].dtype;
    // f32 compute needs no loss scale (nothing underflows): 1 keeps it exact.
    this.scaler = new DynamicLossScaler(this.dtype === 'f16' ? {} : { initScale: 1, growthInterval: Number.MAX_SAFE_INTEGER });
  }

  /** The chunked AdamW (GPU kernels) of every run but Prodigy's and Adafactor's (see hostOptimizer). */
  get optimizer(): ChunkedAdamW {
    if (this.opt instanceof HostOptimizer)
      throw new Error(`this run's optimizer is ${this.settings.optimizer}, kept on the host: it has no chunked AdamW state (see hostOptimizer)`);
    return this.opt;
  }

  /** Prodigy or Adafactor, when the run uses one; else null. */
  get hostOptimizer(): HostOptimizer | null {
    return this.opt instanceof HostOptimizer ? this.opt : null;
  }

  /** Optimizer chunks streamed through the store (none for a host optimizer). */
  get storedChunks(): number {
    return this.opt.storedChunks;
  }

  /** Steps replayed and captured, and why the last one was not replayed (src/gpu/replay.ts). */
  get replayStats(): ReplayStats | null {
    return this.replay && { ...this.replay.stats };
  }

  /** Steps whose update was applied (skipped steps excluded): 0 means the run changed nothing. */
  get appliedSteps(): number {
    return this.opt.applied;
  }

  /** LoRA scale alpha / rank (1 in full mode). */
  get loraScale(): number {
    return this.settings.mode === 'lora' ? this.settings.alpha / this.settings.rank : 1;
  }

  static async create(
    gpu: Gpu,
    model: TrainerModel,
    data: TrainData,
    settings: TrainSettings,
    store: ChunkStore,
    runId: string,
    /** LoRA: starting adapters (PEFT names), e.g. a test's; default PEFT's init from the run's seed. */
    loraInit?: Map<string, Float32Array>,
  ): Promise<DreamBoothTrainer> {
    validate(data, settings);
    validateKnobs(settings, model.schedule.numTrainTimesteps, model.schedule.prediction);
    const sets = [
      { what: 'instance' as const, samples: data.instance },
      { what: 'class' as const, samples: data.classes },
    ];
    checkConditioning(model, sets, settings.mode === 'lora' && settings.textEncoderLora);
    if (captionsProcessed(settings.captions) && model.captions && data.instance.some((x) => x.prompt === undefined))
      throw new Error("caption dropout and tag shuffling need each photo's prompt (cached with its latents): encode the photos again");
    const rng = new Rng(settings.seed);
    const dtype = [...model.weights.values()][0].dtype;
    // The one trainable set the planner sizes too (trainable.ts): names, order, shapes and each group's rate.
    const groups = trainableSpec(model.config, model.textEncoder?.config, settings, model.textEncoder2?.config);
    const trainable = new Map<string, Tensor>();
    let initial: (name: string) => Promise<Float32Array>;
    if (settings.mode === 'lora') {
      const init = loraInit ?? new Map<string, Float32Array>();
      for (const g of groups) {
        const weights = groupWeights(model, g.model);
        if (!loraInit) for (const [n, v] of initGroup(g, settings, { next: () => rng.uniform() })) init.set(g.prefix + n, v);
        // DoRA's magnitudes start at the base weights' own column norms (read from the GPU, one per channel)
        if (!loraInit && networkSpecOf(settings).dora) for (const [n, v] of await doraMagnitudes(gpu, weights, g.layers)) init.set(g.prefix + n, v);
        attachNetwork(weights, networkSpecOf(settings));
        for (const p of g.params) if (!init.has(p.name)) throw new Error(`LoRA init has no ${p.name}`);
        // side by side in one buffer, as the optimizer's chunks: one AdamW kernel per chunk (optimizer-chunks.ts)
        const packed = uploadPacked(gpu, g.params, (n) => init.get(n)!, dtype);
        for (const p of g.params) {
          weights.set(p.name.slice(g.prefix.length), packed.get(p.name)!);
          trainable.set(p.name, packed.get(p.name)!);
        }
      }
      initial = async (n) => init.get(n)!;
    } else {
      for (const p of groups[0].params) trainable.set(p.name, model.weights.get(p.name)!);
      // Masters start from the weights as loaded (f16 values are exact in f32).
      initial = (n) => gpu.read(trainable.get(n)!);
    }
    const params = groups.flatMap((g) => g.params);
    const optimizer = isHostOptimizer(settings.optimizer)
      ? await HostOptimizer.create(gpu, params, trainable, initial, hostOptimizerOptions(settings))
      : await ChunkedAdamW.create(gpu, params, trainable, initial, {
          cfg: { ...ADAMW_DEFAULTS, lr: settings.lr, weightDecay: settings.weightDecay },
          chunkElems: settings.chunkElems,
          residentChunks: settings.residentChunks,
          store,
          prefix: `${runId}/opt`,
          maxGradNorm: settings.maxGradNorm > 0 ? settings.maxGradNorm : undefined,
          mode: { optimizer: settings.optimizer, master: settings.master },
        });
    const trainer = new DreamBoothTrainer(gpu, model, data, settings, store, runId, trainable, optimizer, rng);
    const masters = (i: number) => optimizer.chunkMasters(i);
    if (settings.ema)
      trainer.ema =
        settings.mode === 'full'
          ? await StoredEma.start(
              settings.ema,
              store,
              `${runId}/ema`,
              optimizer.chunks.map((c) => c.elems),
              masters,
              gpu.dryRun,
            )
          : await WeightEma.start(settings.ema, optimizer.chunks.length, masters);
    return trainer;
  }

  /** Draws the next step's sample indices, noise and timesteps from the run's Rng. */
  drawInputs(): StepInputs {
    const hasClass = this.data.classes.length > 0;
    const instance = this.step % this.data.instance.length;
    const classIndex = hasClass ? this.step % this.data.classes.length : null;
    const shapes = this.batchOf(instance, classIndex).map((x) => this.shapeOf(x));
    const drawn: StepInputs = { instance, classIndex, ...drawStepNoise(this.rng, shapes, this.settings, this.model.schedule.numTrainTimesteps) };
    // After the noise, and only with caption processing on: a run without it draws what it always did.
    const o = this.settings.captions;
    if (captionsProcessed(o) && this.model.captions) drawn.caption = processCaption(this.data.instance[instance].prompt ?? '', o, () => this.rng.uniform());
    return drawn;
  }

  /** The step's processed caption's ids and (unless the text encoder trains) its encoding; a few hundred kept. */
  private async captionSample(sample: TrainSample, text: string): Promise<TrainSample> {
    const enc = this.model.captions!;
    const ids = enc.ids(text);
    if (this.settings.mode === 'lora' && this.settings.textEncoderLora) return { ...sample, ids };
    let context = this.captionContexts.get(text);
    if (!context) {
      context = await enc.context(text);
      if (this.captionContexts.size >= 256) this.captionContexts.delete(this.captionContexts.keys().next().value!);
      this.captionContexts.set(text, context);
    }
    return { ...sample, ids, context };
  }

  private readonly captionContexts = new Map<string, Float32Array>();

  /** A step's samples: the instance photo, then the class image when there is one. */
  private batchOf(instance: number, classIndex: number | null): TrainSample[] {
    return [this.data.instance[instance], ...(classIndex !== null ? [this.data.classes[classIndex]] : [])];
  }

  /** A sample's latent shape: its bucket's, or the data's. */
  private shapeOf(s: TrainSample): [number, number, number] {
    return s.latentShape ?? this.data.latentShape;
  }

  /** One training step (inputs drawn from the Rng unless given). */
  async trainStep(inputs: StepInputs = this.drawInputs()): Promise<StepReport> {
    const gpu = this.gpu;
    const t0 = performance.now();
    gpu.allocator.resetPeak();
    const scale = this.scaler.scale;
    this.opt.setLrScale(lrFactor(this.settings, this.step));
    const r = this.settings.fusedUpdates ? await this.fusedStep(inputs, scale) : await this.unfusedStep(inputs, scale);
    const { loss, applied, gradNorm, skipped } = r;
    await gpu.sync();
    this.step++;
    if (this.ema) await this.ema.update((i) => this.opt.chunkMasters(i));
    this.losses.push(loss);
    const mem = gpu.allocator.report();
    const report: StepReport = {
      step: this.step,
      loss,
      applied,
      lossScale: this.scaler.scale,
      gradNorm,
      seconds: (performance.now() - t0) / 1000,
      gpuBytes: mem.current,
      gpuPeakBytes: mem.peak,
    };
    if (skipped) report.skipped = skipped;
    if (this.replayWarning) [report.warning, this.replayWarning] = [this.replayWarning, ''];
    this.skipRun = skipped ? { count: this.skipRun.count + 1, last: skipped } : { count: 0, last: '' };
    if (this.settings.checkpointEvery > 0 && this.step % this.settings.checkpointEvery === 0) await this.checkpoint();
    if (this.skipRun.count >= this.settings.maxConsecutiveSkips)
      throw new TrainingStalledError(this.skipRun.count, this.step, this.skipRun.last, this.appliedSteps);
    return report;
  }

  /**
   * The forward and backward of a step's batch on a new tape: one UNet pass over it when its samples share a
   * latent shape, one pass per sample when they do not (a photo at its aspect-ratio bucket beside a square
   * class image). The passes' weight gradients add up on the tape, and each pass's loss and gradient keep the
   * whole batch's 1/B, so the sum is the batch's. With `fused`, the last pass's backward hands each chunk's
   * final gradients to `fused.chunk` (then frees them), after `fused.loss` has seen the batch's loss.
   */
  private async forwardBackward(
    inputs: StepInputs,
    scale: number,
    fused?: { loss: (loss: number) => void; chunk: (index: number, grads: Map<string, Tensor>) => Promise<void> },
  ): Promise<{ loss: number; tape: Tape }> {
    const samples = this.batchOf(inputs.instance, inputs.classIndex);
    if (inputs.caption !== undefined) samples[0] = await this.captionSample(samples[0], inputs.caption);
    const B = samples.length;
    const prediction = this.model.schedule.prediction;
    // diffusers adds the prior term to the instance mean: per-sample weights times B undo weightedMse's 1/B.
    const classWeights = samples.map((_, i) => (i === 0 ? 1 : this.settings.priorLossWeight) * B);
    const weights = lossWeights(inputs.timesteps, this.snrAcp, {
      prediction,
      minSnrGamma: this.settings.minSnrGamma ?? undefined,
      debiased: this.settings.debiasedEstimation,
      classWeights,
    });
    const tape = new Tape(this.gpu, new Set(this.trainable.values()));
    // LoRA: gradients into the optimizer's packed buffers (one norm and one AdamW kernel per chunk; a few MB)
    if (this.settings.mode === 'lora' && !this.hostOptimizer)
      tape.useGradSlots((this.loraSlots ??= new Map([...this.optimizer.gradSlots()].map(([n, g]) => [this.trainable.get(n)!, g]))));
    const sameShape = samples.every((x) => this.shapeOf(x).join() === this.shapeOf(samples[0]).join());
    const passes = sameShape && !this.settings.passPerSample ? [samples.map((_, i) => i)] : samples.map((_, i) => [i]);
    const noiseStart = samples.map((_, i) => samples.slice(0, i).reduce((n, x) => n + this.shapeOf(x).reduce((a, b) => a * b, 1), 0));
    const textTrains = this.settings.mode === 'lora' && this.settings.textEncoderLora;
    const replayed = this.replay && this.stepReplay && !fused && passes.length === 1 && !textTrains;
    const run = replayed ? this.replay!.begin(`${this.settings.activationCheckpointing}|${this.loraScale}`) : null;
    let loss = 0;
    try {
      for (const [k, pass] of passes.entries()) {
        const last = k === passes.length - 1;
        const before = loss;
        loss += await this.trainPass(
          tape,
          pass.map((i) => ({ sample: samples[i], t: inputs.timesteps[i], w: weights[i], noise: noiseStart[i] })),
          inputs,
          B,
          scale,
          fused && last ? { loss: (l) => fused.loss(before + l), onFinal: this.chunkHandover(tape, fused.chunk) } : undefined,
          run,
        );
      }
    } catch (e) {
      if (!(e instanceof ReplayMismatchError) || !run) throw e;
      // The replay found the GPU's state other than its record's mid-step: its partial step is dropped (nothing of it
      // reaches the gradients or the allocator, StepRun.discard), and the step runs live on the same inputs (drawn once,
      // by trainStep), as does every later one.
      run.discard();
      tape.dropGrads();
      this.stepReplay = false;
      this.replay!.disarm();
      this.replayWarning = `${e.message} (step ${this.step + 1}): the step ran again without the step replay, and training continues without it, with the same results at a higher host cost per step`;
      return this.forwardBackward(inputs, scale, fused);
    }
    return { loss, tape };
  }

  /** LoRA's packed gradient buffers by trainable weight (ChunkedAdamW.gradSlots), made at the first step. */
  private loraSlots?: Map<Tensor, Tensor>;

  /**
   * Tape.backwardFused's hook: collects the final gradients by optimizer chunk; a chunk whose parameters are
   * all final goes to `chunk`, and its gradients are freed right after.
   */
  private chunkHandover(tape: Tape, chunk: (index: number, grads: Map<string, Tensor>) => Promise<void>): (weights: Tensor[]) => Promise<void> {
    const names = new Map([...this.trainable].map(([n, t]) => [t, n]));
    const chunks = this.opt.chunks;
    const chunkOf = new Map(chunks.flatMap((c) => c.params.map((p) => [p.name, c.index] as const)));
    const waiting = chunks.map((c) => c.params.length);
    const held = chunks.map(() => new Map<string, Tensor>());
    return async (ws) => {
      for (const w of ws) {
        const name = names.get(w);
        if (name === undefined) continue;
        const g = tape.take(w);
        if (!g) throw new Error(`no gradient reached trainable parameter ${name}`);
        const i = chunkOf.get(name)!;
        held[i].set(name, g);
        if (--waiting[i] > 0) continue;
        try {
          await chunk(i, held[i]);
        } finally {
          this.gpu.free(...held[i].values());
          held[i].clear();
        }
      }
    };
  }

  /** The unfused step: every gradient, then the optimizer's step over all of them. */
  private async unfusedStep(inputs: StepInputs, scale: number): Promise<{ loss: number; applied: boolean; gradNorm: number; skipped?: string }> {
    const gpu = this.gpu;
    const { loss, tape } = await this.forwardBackward(inputs, scale);
    const grads = new Map<string, Tensor>();
    for (const [name, t] of this.trainable) {
      const g = tape.take(t);
      if (g) grads.set(name, g);
    }
    tape.dropGrads();
    let applied = false;
    let gradNorm = NaN;
    let skipped: string | undefined;
    if (!Number.isFinite(loss)) {
      // A non-finite loss: nothing is applied (the gradients are not even looked at); lower the scale.
      this.scaler.update(true);
      skipped = `non-finite loss (${loss}) at step ${this.step + 1}: step skipped, loss scale lowered to ${this.scaler.scale}`;
    } else {
      const r = await this.opt.step(grads, scale);
      gradNorm = r.gradNorm;
      applied = r.applied;
      if (r.skipped === 'update') {
        // The gradients were finite at this scale, so the scale is not the problem: Adam's update does not
        // depend on it (m / sqrt(v) divides it out). Lowering it would only push small f16 gradients toward
        // zero, so the scaler is left as it is (neither lowered nor counting a good step).
        skipped = this.updateSkipped(scale);
      } else {
        this.scaler.update(!applied);
        if (!applied) skipped = `inf/NaN in the gradients at loss scale ${scale}: step skipped, scale lowered to ${this.scaler.scale}`;
      }
    }
    for (const g of grads.values()) gpu.free(g);
    return { loss, applied, gradNorm, skipped };
  }

  /**
   * The fused step (settings.fusedUpdates; ChunkedAdamW's fused step): the norm pass hands each chunk's
   * final gradients to fusedNorm and frees them; an overflow or a non-finite loss skips the step with
   * nothing written, exactly as the unfused step does (the scale halves); else (after a check pass when
   * the statistics cannot prove every update finite) the update pass updates each chunk as its gradients
   * become final. The passes run the same forward and backward on the same weights: the update pass
   * compares its loss with the norm pass's, bit for bit, before its backward (a non-deterministic kernel
   * would otherwise update chunks with gradients the decisions were not taken on).
   */
  private async fusedStep(inputs: StepInputs, scale: number): Promise<{ loss: number; applied: boolean; gradNorm: number; skipped?: string }> {
    const opt = this.optimizer;
    const run = opt.fusedBegin(scale);
    try {
      const pass = async (phase: string, chunk: (index: number, grads: Map<string, Tensor>) => Promise<void>, expect?: number) => {
        const r = await this.forwardBackward(inputs, scale, {
          loss: (l) => {
            if (expect !== undefined && !Object.is(l, expect))
              throw new Error(
                `the ${phase} pass's loss ${l} differs from the norm pass's ${expect}: the GPU's kernels are not deterministic; turn fused updates off`,
              );
          },
          chunk,
        });
        r.tape.dropGrads();
        return r.loss;
      };
      const loss = await pass('norm', async (i, g) => opt.fusedNorm(run, i, g));
      if (!Number.isFinite(loss)) {
        await opt.fusedAbort(run);
        this.scaler.update(true);
        return {
          loss,
          applied: false,
          gradNorm: NaN,
          skipped: `non-finite loss (${loss}) at step ${this.step + 1}: step skipped, loss scale lowered to ${this.scaler.scale}`,
        };
      }
      const d = await opt.fusedDecide(run);
      if (d.skipped) {
        this.scaler.update(true);
        return {
          loss,
          applied: false,
          gradNorm: d.gradNorm,
          skipped: `inf/NaN in the gradients at loss scale ${scale}: step skipped, scale lowered to ${this.scaler.scale}`,
        };
      }
      if (d.needsCheck) {
        await pass('check', (i, g) => opt.fusedCheck(run, i, g), loss);
        if (await opt.fusedCheckResult(run)) return { loss, applied: false, gradNorm: d.gradNorm, skipped: this.updateSkipped(scale) };
      }
      await pass('update', (i, g) => opt.fusedApply(run, i, g), loss);
      const { gradNorm } = await opt.fusedEnd(run);
      this.scaler.update(false);
      return { loss, applied: true, gradNorm };
    } finally {
      await opt.fusedAbort(run);
    }
  }

  /** Why a step whose update would overflow was skipped (the scale is kept: see unfusedStep). */
  private updateSkipped(scale: number): string {
    const f16 = this.dtype === 'f16' ? " or past f16's 65504" : '';
    return `the update would make weights non-finite${f16} (learning rate ${this.settings.lr} too high?) at step ${this.step + 1}: step skipped, loss scale kept at ${scale}`;
  }

  /**
   * The validation loss now (see ValidationReport), recorded in `validation` (and kept by checkpoints). Every
   * call sees the same noise and timesteps, drawn from the run's seed but not from its Rng, so validating
   * changes nothing about training. One forward per image and timestep, batch 1, no tape: less memory than
   * a training step.
   */
  async validate(): Promise<ValidationReport> {
    const setLoss = async (all: TrainSample[], which: number) => {
      const set = all.slice(0, VALIDATION_IMAGES);
      let sum = 0;
      for (let i = 0; i < set.length; i++) sum += await this.validationLoss(set[i], which * 1_000_003 + i);
      return sum / set.length;
    };
    const report: ValidationReport = {
      step: this.step,
      instance: await setLoss(this.data.instance, 0),
      class: this.data.classes.length ? await setLoss(this.data.classes, 1) : null,
    };
    if (this.validation.at(-1)?.step === this.step) this.validation.pop();
    this.validation.push(report);
    return report;
  }

  /** One sample's plain MSE averaged over VALIDATION_T, with noise fixed by (the run's seed, `key`). */
  private async validationLoss(sample: TrainSample, key: number): Promise<number> {
    const gpu = this.gpu;
    const [c, h, w] = this.shapeOf(sample);
    const rng = new Rng((this.settings.seed ^ VALIDATION_SEED ^ Math.imul(key, 0x9e3779b1)) >>> 0);
    const T = this.model.schedule.numTrainTimesteps;
    let sum = 0;
    for (const frac of VALIDATION_T) {
      const t = Math.round(frac * (T - 1));
      const x0 = gpu.upload(sample.latent, [1, c, h, w], this.dtype, 'activations', 'val-x0');
      const eps = gpu.upload(rng.normals(c * h * w), [1, c, h, w], this.dtype, 'activations', 'val-noise');
      const cond = this.conditioning([sample], null);
      const tT = gpu.upload([t], [1], 'f32', 'activations', 'val-timestep');
      const xt = addNoise(gpu, x0, eps, [t], this.acp);
      const target = this.model.schedule.prediction === 'epsilon' ? eps : velocity(gpu, x0, eps, [t], this.acp);
      const pred = unetForward(gpu, this.model.config, this.model.weights, xt, tT, cond.context, null, this.loraScale, false, cond.added);
      const mask = sample.mask ? gpu.upload(sample.mask, [1, h, w], 'f32', 'activations', 'val-mask') : null;
      sum += await weightedMse(gpu, pred, target, [1], mask);
      gpu.free(x0, eps, ...cond.owned, tT, xt, pred, ...(target !== eps ? [target] : []), ...(mask ? [mask] : []));
    }
    return sum / VALIDATION_T.length;
  }

  /**
   * The forward and backward of one pass over `items` (samples of one latent shape) on `tape`; returns its part of
   * the batch's loss (sum over the pass of w_b mse_b / batch). `noise` is the whole batch's, each item's at its offset.
   */
  private async trainPass(
    tape: Tape,
    items: { sample: TrainSample; t: number; w: number; noise: number }[],
    /** The batch's noise (the target's) and, with input perturbation, the noise x_t is made with. */
    noise: Pick<StepInputs, 'noise' | 'inputNoise'>,
    batch: number,
    scale: number,
    /** The fused step's last pass: sees the batch's loss before the backward, which hands over final weights. */
    fused?: { loss: (loss: number) => void; onFinal: (weights: Tensor[]) => Promise<void> },
    /** The step's replay (a lone pass of an unfused step): the forward and backward replayed, or run and captured. */
    replay: StepRun | null = null,
  ): Promise<number> {
    const gpu = this.gpu;
    const n = items.length;
    const [c, h, w] = this.shapeOf(items[0].sample);
    const cat = (f: (it: (typeof items)[number]) => Float32Array) => {
      const parts = items.map(f);
      const out = new Float32Array(parts.reduce((k, p) => k + p.length, 0));
      parts.forEach((p, i) => out.set(p, i * p.length));
      return out;
    };
    const timesteps = items.map((it) => it.t);
    const x0 = gpu.upload(
      cat((it) => it.sample.latent),
      [n, c, h, w],
      this.dtype,
      'activations',
      'x0',
    );
    const eps = gpu.upload(
      cat((it) => noise.noise.subarray(it.noise, it.noise + c * h * w)),
      [n, c, h, w],
      this.dtype,
      'activations',
      'noise',
    );
    const epsIn = noise.inputNoise
      ? gpu.upload(
          cat((it) => noise.inputNoise!.subarray(it.noise, it.noise + c * h * w)),
          [n, c, h, w],
          this.dtype,
          'activations',
          'input-noise',
        )
      : eps;
    // A trained text encoder runs on the tape (its output is freed by it); else the cached embeddings.
    const cond = this.conditioning(
      items.map((it) => it.sample),
      tape,
    );
    const tT = gpu.upload(timesteps, [n], 'f32', 'activations', 'timesteps');
    const xt = addNoise(gpu, x0, epsIn, timesteps, this.acp);
    const target = this.model.schedule.prediction === 'epsilon' ? eps : velocity(gpu, x0, eps, timesteps, this.acp);
    // weightedMse divides by this pass's size; times n / batch it divides by the batch's (exactly 1 for one pass).
    const weights = items.map((it) => (it.w * n) / batch);
    // A masked photo weights its loss per latent position; a pass without masks runs the plain loss.
    const mask = items.some((it) => it.sample.mask)
      ? gpu.upload(
          cat((it) => it.sample.mask ?? new Float32Array(h * w).fill(1)),
          [n, h, w],
          'f32',
          'activations',
          'loss-mask',
        )
      : null;
    // The noisy latents and cached embeddings need no gradient: conv_in's dx and the k/v projections' dx into the
    // context are never formed (requires_grad pruning; a trained text encoder's output still gets its gradient).
    tape.noGrad(xt, ...cond.constants);
    const forward = () =>
      unetForward(gpu, this.model.config, this.model.weights, xt, tT, cond.context, tape, this.loraScale, this.settings.activationCheckpointing, cond.added);
    const added = cond.added ? [cond.added.textEmbeds, cond.added.timeIds] : [];
    const inputs = [x0, eps, ...(epsIn !== eps ? [epsIn] : []), tT, xt, ...(target !== eps ? [target] : []), ...cond.owned, ...(mask ? [mask] : [])];
    try {
      const pred = replay ? replay.forward([xt, tT, cond.context, ...added], forward) : forward();
      const cs = huberCs(timesteps, this.acp, this.settings.huberC ?? HUBER_C_DEFAULT, this.settings.huberSchedule ?? 'snr');
      const { loss, dy } = await passLoss(gpu, pred, target, weights, mask, scale, { kind: this.settings.loss ?? 'l2', cs });
      fused?.loss(loss);
      if (fused) await tape.backwardFused(pred, dy, fused.onFinal);
      else if (replay) replay.backward(tape.grads, [dy], () => tape.backward(pred, dy));
      else tape.backward(pred, dy);
      return loss;
    } finally {
      gpu.free(...inputs);
    }
  }

  /** The UNet's conditioning for a pass over `samples` (train/conditioning.ts): cached, or the text encoder(s) on `tape`. */
  private conditioning(samples: TrainSample[], tape: Tape | null) {
    return passConditioning(this.gpu, this.model, samples, this.data.contextShape, this.dtype, {
      trainText: this.settings.mode === 'lora' && this.settings.textEncoderLora,
      tape,
      loraScale: this.loraScale,
    });
  }

  private get ckptPrefix(): string {
    return `${this.runId}/ckpt`;
  }

  /** Commits a checkpoint: trainable state, optimizer, step, Rng, loss scale, settings. */
  async checkpoint(): Promise<void> {
    const st = await this.opt.checkpointState();
    const meta: CheckpointMeta = {
      step: this.step,
      rng: this.rng.state(),
      scaler: this.scaler.state(),
      versions: st.versions,
      applied: st.applied,
      losses: this.losses,
      validation: this.validation,
      settings: this.settings,
      skipRun: this.skipRun,
      gemm: this.gpu.gemmConfig,
      ...(this.ema ? { ema: this.ema.updates } : {}),
    };
    await commitSnapshot(this.store, this.ckptPrefix, this.ema ? new Map([...st.files, ...this.ema.files()]) : st.files, meta);
    await this.opt.pin(st.versions);
    await this.ema?.pin();
  }

  /**
   * Continues from the store's last checkpoint of this run (false when there is none). The trainer must
   * have been created with the same model, data and settings (the checkpoint's are compared).
   */
  async resume(): Promise<boolean> {
    const snap = await openSnapshot<CheckpointMeta>(this.store, this.ckptPrefix);
    if (!snap) return false;
    const m = snap.meta;
    checkCheckpointMeta(m, this.opt.chunks.length);
    // The optimizer's state is kept differently per mode: a checkpoint resumes only in its own (checkpoints
    // made before the modes existed are fp32 AdamW).
    const old: Partial<TrainSettings> = m.settings;
    const was = { optimizer: old.optimizer ?? 'adamw', master: old.master ?? 'fp32' };
    for (const k of ['optimizer', 'master'] as const)
      if (was[k] !== this.settings[k])
        throw new Error(
          `this run's checkpoint was made with ${k} = '${was[k]}', not '${this.settings[k]}': its optimizer state is kept differently; resume with ${k} '${was[k]}' (or start a new run)`,
        );
    for (const k of ['mode', 'rank', 'alpha', 'lr', 'seed', 'chunkElems', 'textEncoderLora'] as const)
      if (m.settings[k] !== this.settings[k])
        throw new Error(`this run's checkpoint was made with ${k} = ${m.settings[k]}, not ${this.settings[k]}: resume with the run's own settings`);
    // Checkpoints from before the setting existed trained the text encoder at `lr`.
    const teLr = { was: textEncoderLrOf({ lr: m.settings.lr, textEncoderLr: m.settings.textEncoderLr }), now: textEncoderLrOf(this.settings) };
    if (this.settings.textEncoderLora && teLr.was !== teLr.now)
      throw new Error(`this run's checkpoint was made with textEncoderLr = ${teLr.was}, not ${teLr.now}: resume with the run's own settings`);
    for (const k of ['ema', 'prodigy', 'adafactor'] as const)
      if (JSON.stringify(m.settings[k] ?? null) !== JSON.stringify(this.settings[k] ?? null))
        throw new Error(
          `this run's checkpoint was made with ${k} = ${JSON.stringify(m.settings[k] ?? null)}, not ${JSON.stringify(this.settings[k] ?? null)}: resume with the run's own settings`,
        );
    await this.opt.restore((n) => snap.read(n), m.versions, m.applied);
    if (this.ema) await this.ema.restore((n) => snap.read(n), m.ema!);
    if (m.gemm !== undefined) this.gpu.setGemmConfig(m.gemm); // checked above
    this.step = m.step;
    this.rng.restore(m.rng);
    this.scaler.restore(m.scaler);
    this.skipRun = m.skipRun ? { ...m.skipRun } : { count: 0, last: '' };
    this.losses.length = 0;
    this.losses.push(...m.losses);
    this.validation.length = 0;
    this.validation.push(...(m.validation ?? []));
    await this.gpu.sync();
    return true;
  }

  /**
   * The trained values (fp32 masters) of every trainable parameter, by name; with `ema` (and an EMA kept),
   * their moving average instead.
   */
  async trainedValues(o: { ema?: boolean } = {}): Promise<Map<string, Float32Array>> {
    const out = new Map<string, Float32Array>();
    const chunks = new Map<number, Float32Array>();
    const ema = o.ema ? this.ema : null;
    for (const name of this.trainable.keys()) {
      const at = this.opt.locate(name);
      if (!chunks.has(at.chunk)) chunks.set(at.chunk, ema ? await ema.chunk(at.chunk) : await this.opt.chunkMasters(at.chunk));
      out.set(name, chunks.get(at.chunk)!.slice(at.offset, at.offset + at.numel));
    }
    return out;
  }

  /**
   * Runs `fn` with the EMA's values in the model's trainable weights (samples and try-it use the average when
   * one is kept), then puts the trained weights back exactly (their compute-dtype values, read before).
   */
  async withEmaWeights<T>(fn: () => Promise<T>): Promise<T> {
    const ema = this.ema;
    if (!ema) return fn();
    // Chunk by chunk (a full fine-tune's EMA is weight-sized): the weights' own bits are kept (2 bytes per
    // element in f16) and one chunk of the average is on the host at a time.
    const saved = new Map<Tensor, ArrayBuffer>();
    try {
      for (const c of this.opt.chunks) {
        const avg = await ema.chunk(c.index);
        for (const p of c.params) {
          const t = this.trainable.get(p.name)!;
          saved.set(t, await this.gpu.readBytes(t.buffer, t.byteOffset, t.byteSize));
          this.gpu.write(t, avg.subarray(p.offset, p.offset + p.numel));
        }
      }
      return await fn();
    } finally {
      // decoded to values for write() (exact: f16 -> f32 -> f16), which pads an odd f16 length as every upload does
      for (const [t, bits] of saved) this.gpu.write(t, t.dtype === 'f16' ? fromF16Bits(new Uint16Array(bits, 0, t.numel)) : new Float32Array(bits, 0, t.numel));
    }
  }

  /**
   * The trained tensors chunk by chunk, as export/chunked.ts streams a full fine-tune: the masters, or with
   * `ema` (and an EMA kept) their average.
   */
  trainedChunks(o: { ema?: boolean } = {}): TrainedChunks {
    const ema = o.ema ? this.ema : null;
    return { chunks: this.opt.chunks, chunkMasters: (i) => (ema ? ema.chunk(i) : this.opt.chunkMasters(i)) };
  }

  destroy(): void {
    this.opt.destroy();
  }
}

/** Trained tensors by optimizer chunk (export/chunked.ts's ChunkedTensors: the exporters read this shape). */
export interface TrainedChunks {
  readonly chunks: readonly {
    readonly index: number;
    readonly params: readonly { readonly name: string; readonly shape: readonly number[]; readonly offset: number; readonly numel: number }[];
  }[];
  chunkMasters(index: number): Promise<Float32Array>;
}

/**
 * The learning rate's factor for the update after `step` completed steps: the run's schedule
 * (train/lr-schedule.ts, transformers' formulas), a pure function of the step, so a resumed run's rates are
 * the uninterrupted run's. With a warm-up the first update has rate 0, as in transformers.
 */
export function lrFactor(s: Partial<Pick<TrainSettings, 'lrWarmup' | 'lrScheduler' | 'lrCycles' | 'lrPower' | 'steps' | 'lr'>>, step: number): number {
  return scheduleFactor(
    { scheduler: s.lrScheduler ?? 'constant', warmup: s.lrWarmup ?? 0, steps: s.steps ?? 0, lr: s.lr ?? 0, cycles: s.lrCycles ?? 1, power: s.lrPower ?? 1 },
    step,
  );
}

/** The text-encoder adapters' learning rate (trainable.ts), for the trainer's importers. */
export { textEncoderLrOf };
