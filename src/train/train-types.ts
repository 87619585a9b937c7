// The trainer's types: its settings (TrainSettings, the engine's own defaults), its data, one step's inputs
// and report, the validation report, the checkpoint's record, and the stalled-run error. trainer.ts re-exports
// them, so importers keep reading them from there.
import type { GemmConfig } from '../gpu/device.ts';
import type { Weights } from '../nn/blocks.ts';
import type { ClipTextConfig } from '../nn/clip.ts';
import type { UnetConfig } from '../nn/unet.ts';
import type { ScheduleConfig } from '../sample/schedulers.ts';
import type { LrScheduler } from './lr-schedule.ts';
import type { MasterKind, OptimizerKind } from './packed-state.ts';
import type { HostOptimizerKind } from './host-optimizer.ts';
import type { ProdigyConfig } from './prodigy.ts';
import type { AdafactorConfig } from './adafactor.ts';
import type { HuberSchedule, LossKind } from './loss-options.ts';
import type { CaptionOptions } from './captions.ts';
import type { EmaSettings } from './ema.ts';
import type { NetworkType } from '../nn/lycoris.ts';

export type TrainMode = 'lora' | 'full';

export interface TrainSettings {
  mode: TrainMode;
  steps: number;
  lr: number;
  /** LoRA rank and alpha (scale alpha / rank). */
  rank: number;
  alpha: number;
  /** The LoRA network type (nn/lycoris.ts; absent: lora), the ResNet convs' rank and alpha, LoKr's factor. */
  network?: NetworkType;
  convRank?: number;
  convAlpha?: number;
  lokrFactor?: number;
  /** DoRA on a LyCORIS network (nn/dora.ts). */
  dora?: boolean;
  seed: number;
  priorLossWeight: number;
  /** Offset noise strength (0: off). */
  offsetNoise: number;
  /** min-SNR-gamma (null: off). */
  minSnrGamma: number | null;
  maxGradNorm: number;
  weightDecay: number;
  /** LoRA also on the text encoder's attention projections (it then stays on the GPU and runs every step). */
  textEncoderLora: boolean;
  /**
   * The text-encoder adapters' own learning rate (kohya's --text_encoder_lr); absent or 0: `lr`. Their optimizer
   * state then sits in chunks of its own (planChunks), after the UNet's.
   */
  textEncoderLr?: number;
  /** Checkpoint every N steps (0: only when asked). */
  checkpointEvery: number;
  /** Activation checkpointing in the UNet (the planner picks it when the budget needs it). */
  activationCheckpointing: boolean;
  /** fp32 optimizer elements per chunk (the store's unit of transfer). */
  chunkElems: number;
  /** Chunks of optimizer state kept on the GPU (the rest stream through the store); Infinity: all. */
  residentChunks: number;
  /** Skipped steps in a row after which trainStep throws TrainingStalledError. */
  maxConsecutiveSkips: number;
  /** AdamW moments: f32 ('adamw') or 8-bit blockwise ('adamw8bit', bitsandbytes' Adam8bit); see train/packed-state.ts. */
  optimizer: OptimizerKind | HostOptimizerKind;
  /** Master weights: a separate fp32 copy, or 'compact' (the f16 weight + a 16-bit extension; the f32 weight itself). */
  master: MasterKind;
  /** One UNet pass per sample even when the batch's samples share a shape (tests compare it with the batched pass). */
  passPerSample?: boolean;
  /**
   * Full fine-tuning: each optimizer chunk updates inside the backward pass as soon as its gradients are
   * final, so the whole gradient set never exists at once (ChunkedAdamW's fused step: a norm pass first,
   * then the update pass; one more forward and backward per step). Same weights as the unfused step, bit
   * for bit. LoRA keeps it off (its gradients are small). Absent: off.
   */
  fusedUpdates?: boolean;
  /** Linear warm-up of the learning rate over this many steps (absent or 0: none); see lrFactor. */
  lrWarmup?: number;
  /** The learning-rate schedule after the warm-up (train/lr-schedule.ts); absent: constant. */
  lrScheduler?: LrScheduler;
  /** cosine_with_restarts: hard restarts (absent: 1). */
  lrCycles?: number;
  /** polynomial: the decay's power (absent: 1). */
  lrPower?: number;
  /** Zero-terminal-SNR schedule for noising (train/noise.ts; for v-prediction models). Absent: off. */
  zeroTerminalSnr?: boolean;
  /** Debiased estimation's loss weight per sample (train/loss-options.ts). Absent: off. */
  debiasedEstimation?: boolean;
  /** Multi-resolution noise levels (0 or absent: off) and their discount (train/noise.ts). */
  multiresNoiseIterations?: number;
  multiresNoiseDiscount?: number;
  /** Input-perturbation noise strength (0 or absent: off). */
  ipNoiseGamma?: number;
  /** Timesteps are drawn from min..max-1 (absent: 0 and the schedule's length). */
  minTimestep?: number;
  maxTimestep?: number;
  /** The loss (absent: l2) and, for huber and smooth_l1, sd-scripts' huber_c and its schedule (train/loss-options.ts). */
  loss?: LossKind;
  huberC?: number;
  huberSchedule?: HuberSchedule;
  /** An exponential moving average of the trained weights (train/ema.ts; absent: off). */
  ema?: EmaSettings;
  /** Prodigy's and Adafactor's own settings over their defaults (train/prodigy.ts, train/adafactor.ts). */
  prodigy?: Partial<ProdigyConfig>;
  adafactor?: Partial<AdafactorConfig>;
  /** Caption dropout and tag shuffling per step (train/captions.ts; absent: every step trains the cached prompt). */
  captions?: CaptionOptions;
}

/** The settings only the engine sets (the planner or a test may change them); the rest are the run's. */
export type EngineSettings = Pick<
  TrainSettings,
  'maxGradNorm' | 'weightDecay' | 'activationCheckpointing' | 'chunkElems' | 'residentChunks' | 'maxConsecutiveSkips'
>;

/**
 * The engine's own defaults. Every other field's default is the settings schema's (pipeline/settings.ts
 * TRAIN_DEFAULTS: the schema's defaults per mode over these).
 */
export const ENGINE_DEFAULTS: Record<TrainMode, EngineSettings> = {
  lora: { maxGradNorm: 1, weightDecay: 1e-2, activationCheckpointing: false, chunkElems: 1 << 22, residentChunks: Infinity, maxConsecutiveSkips: 10 },
  full: { maxGradNorm: 1, weightDecay: 1e-2, activationCheckpointing: false, chunkElems: 1 << 24, residentChunks: Infinity, maxConsecutiveSkips: 10 },
};

/** Latents (already times the VAE scaling factor) and text embeddings, computed once before training. */
export interface TrainData {
  latentShape: [number, number, number];
  contextShape: [number, number];
  instance: TrainSample[];
  /** Class (prior preservation) images; empty: no prior loss. */
  classes: TrainSample[];
}

export interface TrainSample {
  latent: Float32Array;
  /** The prompt's text-encoder output [L, D]. */
  context: Float32Array;
  /** The prompt's token ids [L] (the text encoder runs on them when it trains). */
  ids?: Int32Array;
  /** A loss mask at latent resolution [h, w] in [0, 1] (the photo's painted subject mask, pooled); none: all ones. */
  mask?: Float32Array;
  /** Its own latent shape [C, h, w] when it trains at an aspect-ratio bucket; absent: TrainData.latentShape. */
  latentShape?: [number, number, number];
  /** SDXL: the prompt's tokenizer-2 ids [L]; encoder 2's pooled, projected output; the image's 6 time ids (conditioning.ts). */
  ids2?: Int32Array;
  pooled?: Float32Array;
  timeIds?: Float32Array;
  /** The prompt it was encoded from (its caption, or the set's prompt): caption processing starts from it. */
  prompt?: string;
}

/** Everything random about one step (drawn from the run's Rng, or injected by a test). */
export interface StepInputs {
  /** Which instance / class sample (indices into TrainData). */
  instance: number;
  classIndex: number | null;
  /** Noise for the batch: each sample's [C, h, w] in batch order (offset noise already added). */
  noise: Float32Array;
  timesteps: number[];
  /** Input perturbation (ip noise): the noise x_t is made with, `noise` + gamma N(0, I); absent: `noise`. */
  inputNoise?: Float32Array;
  /** With caption processing (settings.captions): the caption the instance photo trains with this step. */
  caption?: string;
}

export interface StepReport {
  step: number;
  loss: number;
  applied: boolean;
  /** Why a step was skipped (a non-finite loss, gradient or update), for the progress line and the UI. */
  skipped?: string;
  /** Something the run should tell the user about this step (the step replay turned off mid-step, trainer.ts). */
  warning?: string;
  lossScale: number;
  gradNorm: number;
  seconds: number;
  gpuBytes: number;
  gpuPeakBytes: number;
}

/**
 * Validation loss at one step: the plain MSE (no min-SNR or prior weights) of the model at fixed noise and
 * timesteps, averaged over the first VALIDATION_IMAGES instance photos and, separately, class images. The instance loss falling
 * says the subject is being learnt; the class loss rising says the model is drifting from the class
 * (overfitting, language drift): what prior preservation is there to stop.
 */
export interface ValidationReport {
  step: number;
  instance: number;
  /** null without class images. */
  class: number | null;
}

/** The timesteps every validation image is noised at, as fractions of the schedule's length (spread over it). */
export const VALIDATION_T = [0.1, 0.3, 0.5, 0.7, 0.9];
/** Images per set (instance, class) that validation uses: the first ones; a class set may hold hundreds. */
export const VALIDATION_IMAGES = 4;
/** Mixed into the run's seed so the validation noise never equals the training draws. */
export const VALIDATION_SEED = 0x5eed_7a11;

export interface TrainerModel {
  config: UnetConfig;
  /** UNet weights in the compute dtype (diffusers names); LoRA adapters are added to this map. */
  weights: Weights;
  schedule: ScheduleConfig;
  /** The text encoder (CLIP weights in the compute dtype), needed only with textEncoderLora. */
  textEncoder?: { config: ClipTextConfig; weights: Weights };
  /** SDXL's second text encoder (CLIPTextModelWithProjection), needed only with textEncoderLora on SDXL. */
  textEncoder2?: { config: ClipTextConfig; weights: Weights };
  /**
   * With caption processing: a step's caption as token ids, and (frozen text encoder) its text-encoder output
   * [L, D]; the run pipeline keeps the text encoder on the GPU for it. Absent (the planner's dry run): the
   * cached prompts train and no caption is drawn.
   */
  captions?: { ids: (text: string) => Int32Array; context: (text: string) => Promise<Float32Array> };
}

export interface CheckpointMeta {
  step: number;
  rng: number;
  scaler: { scale: number; goodSteps: number; skipped: number };
  versions: Record<number, number>;
  applied: number;
  losses: number[];
  /** Validation losses up to this step (absent in checkpoints made before validation existed). */
  validation?: ValidationReport[];
  settings: TrainSettings;
  /**
   * The run of skipped steps the checkpoint ends on (count and the last reason), so a resumed run stops
   * after the same number of skips in a row. Absent in checkpoints made before it existed: 0.
   */
  skipRun?: { count: number; last: string };
  /**
   * The GEMM kernel choices the run trained with (Gpu.gemmConfig: split-K changes the order of sums), applied again
   * on resume so the resumed steps match the uninterrupted ones bit for bit even where this adapter's tuning
   * (src/ops/tune.ts) has since chosen otherwise. Absent in checkpoints made before it existed: the device's own.
   */
  gemm?: GemmConfig;
  /** With settings.ema: the EMA's updates so far (its shadow is in the checkpoint's ema-c<i> files). */
  ema?: number;
}

/**
 * trainStep's error after `maxConsecutiveSkips` skipped steps in a row: the run is going nowhere (every
 * update was refused), so it stops instead of reporting progress. The weights are those of the last
 * applied step (never non-finite); the trainer stays usable.
 */
export class TrainingStalledError extends Error {
  override name = 'TrainingStalledError';
  constructor(
    /** Skipped steps in a row. */
    readonly skippedInARow: number,
    /** The step (1-based) that was the last of them. */
    readonly step: number,
    /** Why that step was skipped. */
    readonly lastReason: string,
    /** Steps applied in the whole run. */
    readonly appliedSteps: number,
  ) {
    super(
      `training stalled: ${skippedInARow} steps in a row were skipped (steps ${step - skippedInARow + 1}-${step}; ${appliedSteps} applied in the whole run). ` +
        `The last: ${lastReason}. Lower the learning rate (--lr / Learning rate), check the model's weights, or use f32.`,
    );
  }
}
