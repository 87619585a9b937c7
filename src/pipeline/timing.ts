// A run's time, honestly: what its steps, samples and checkpoints took, and what is left of all three.
// Pure (no GPU, no clock of its own: the run hands it measured seconds), so the CLI's progress lines and the
// studio's ETA come from the same numbers and a Node test checks them.
//
// - Warm-up: the first step a session trains compiles the GPU pipelines it uses (seconds on a software
//   adapter, where a warm step takes a fraction of that). It is reported on its own and left out of s/step,
//   the median of the last warm steps.
// - Samples and checkpoints are part of the run's time: the ETA counts the ones the schedule still holds, at
//   their measured cost (the median of the warm ones; the session's first sample also compiles pipelines, so
//   it counts only until a warm one is measured) or, before any is measured, at a first estimate.
// - A sample reports its own progress (denoising step i of n), and the ETA then counts down inside it.
// - Validation losses (every `validateEvery` steps, after the step and before its sample) count the same way.
// - Before a warm step is measured, the sample drawn before training gives the pace: its denoising steps after
//   the first run warm, and a training step is about 1.5 of them (DENOISE_STEP_PER_TRAIN_STEP), so the ETA right
//   after the warm-up step does not rest on the warm-up's compile time. The warm-up step itself is estimated
//   from what that sample's first denoising step compiled (warmupEstimate).

/** The parts of a run's settings that set its schedule. */
export interface RunSchedule {
  /** The run's last step. */
  steps: number;
  /** A sample every N steps (and after the last step); 0: none. */
  sampleEvery: number;
  /** Denoising steps per sample. */
  sampleSteps: number;
  /** A checkpoint every N steps; 0: only the final one (and one on pause). */
  checkpointEvery: number;
  /** A validation loss every N steps (and after the last step); 0 or absent: none. */
  validateEvery?: number;
  /** Batch-1 UNet forwards one validation runs (images x timesteps), for its first estimate. */
  validationForwards?: number;
}

export interface TimeReport {
  /** Median seconds of the last warm steps; null until one warm step was measured. */
  secondsPerStep: number | null;
  /** The session's first step (it compiles the GPU pipelines), in seconds; null before it. */
  warmupSeconds: number | null;
  /** Seconds left: steps, samples and checkpoints still to come (and the rest of a sample being drawn); null
   * while steps remain and none has been timed. */
  etaSeconds: number | null;
  /** Part of the ETA rests on a first estimate (no warm step, or no sample or checkpoint measured yet). */
  provisional: boolean;
}

/**
 * First estimate of one denoising step, as a fraction of a training step: a sample's UNet forward runs on a
 * batch of 2 (classifier-free guidance), a training step runs a forward and a backward (about twice a
 * forward) on a batch of 1, so about 2 / 3. Replaced by the measured cost after the first warm sample.
 */
export const DENOISE_STEP_PER_TRAIN_STEP = 2 / 3;

/** First estimate of a checkpoint, in training steps (replaced by the measured cost after the first one). */
export const CHECKPOINT_PER_TRAIN_STEP = 1;

/**
 * First estimate of one batch-1 UNet forward, in training steps: a step runs a forward and a backward (about
 * three forwards) on a batch of 2 (instance + class), so about 1 / 6.
 */
export const FORWARD_PER_TRAIN_STEP = 1 / 6;

/**
 * First estimate of what the warm-up step compiles, in units of what the session's first sample compiled (its
 * first denoising step less a warm one): a training step's forward compiles about the pipelines a denoising step
 * does, and its backward about as many again.
 */
const WARMUP_COMPILE_PER_SAMPLE_COMPILE = 2;

/** How many recent warm steps s/step is the median of. */
const RECENT = 10;

function median(xs: readonly number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  return s.length % 2 ? s[(s.length - 1) / 2] : (s[s.length / 2 - 1] + s[s.length / 2]) / 2;
}

/** Samples the schedule draws at steps `from`..`to` (from >= 1): every `sampleEvery` steps, and after the last. */
function samplesIn(from: number, to: number, s: RunSchedule): number {
  if (s.sampleEvery <= 0 || from > to) return 0;
  const every = Math.floor(to / s.sampleEvery) - Math.floor((from - 1) / s.sampleEvery);
  return every + (to === s.steps && s.steps % s.sampleEvery !== 0 ? 1 : 0);
}

/** Validations the schedule runs at steps `from`..`to` (from >= 1): every `validateEvery` steps, and after the last. */
function validationsIn(from: number, to: number, s: RunSchedule): number {
  const every = s.validateEvery ?? 0;
  if (every <= 0 || from > to) return 0;
  return Math.floor(to / every) - Math.floor((from - 1) / every) + (to === s.steps && s.steps % every !== 0 ? 1 : 0);
}

/** Samples still to draw once step `done` is trained: the one at `done` itself (if any) and all after it. */
export function samplesFrom(done: number, s: RunSchedule): number {
  return samplesIn(Math.max(done, 1), s.steps, s);
}

/**
 * Checkpoints still to write once step `done` is trained (its own checkpoint, if any, already written with
 * it): every `checkpointEvery` steps after it, and the final one after the last step.
 */
export function checkpointsAfter(done: number, s: RunSchedule): number {
  if (done > s.steps) return 0;
  const every = s.checkpointEvery > 0 ? Math.floor(s.steps / s.checkpointEvery) - Math.floor(done / s.checkpointEvery) : 0;
  return every + 1;
}

export class RunClock {
  private warmup: number | null = null;
  private warmSteps: number[] = [];
  /** Samples drawn in this session: seconds, and whether it was the session's first (pipelines compiled). */
  private samples: { seconds: number; first: boolean; decode: number | null }[] = [];
  private checkpoints: number[] = [];
  private validations: number[] = [];
  /** Seconds per warm denoising step (a sample's steps after its first, whose pipelines were compiled by then). */
  private denoisePace: number | null = null;
  /** The sample being drawn: its step, and when its first denoising step ended. */
  private sampleMark: { step: number; first: number } | null = null;
  /** Seconds of the session's first denoising step (it compiles the sampling pipelines). */
  private firstDenoise: number | null = null;
  /** The sample's denoising steps, once all were drawn: when the last ended, and how many. */
  private sampleDenoised: { step: number; last: number; total: number } | null = null;

  constructor(private readonly schedule: RunSchedule) {}

  /** A training step took `seconds` (its checkpoint, if any, not included). Returns whether it was the warm-up. */
  recordStep(seconds: number): 'warm-up' | 'warm' {
    if (this.warmup === null) {
      this.warmup = seconds;
      return 'warm-up';
    }
    this.warmSteps.push(seconds);
    return 'warm';
  }

  recordSample(seconds: number): void {
    this.samples.push({ seconds, first: this.samples.length === 0, decode: this.sampleDenoised ? seconds - this.sampleDenoised.last : null });
    this.sampleMark = this.sampleDenoised = null;
  }

  recordCheckpoint(seconds: number): void {
    this.checkpoints.push(seconds);
  }

  recordValidation(seconds: number): void {
    this.validations.push(seconds);
  }

  get secondsPerStep(): number | null {
    return this.warmSteps.length ? median(this.warmSteps.slice(-RECENT)) : null;
  }

  get warmupSeconds(): number | null {
    return this.warmup;
  }

  /**
   * Seconds per step for the ETA: the warm median; before a warm step, the warm denoising pace of the sample
   * drawn before training (a step is about 1 / DENOISE_STEP_PER_TRAIN_STEP denoising steps) where it is below the
   * warm-up step, which mostly compiles pipelines (3-4x the rest of a short run on a software adapter); else the
   * warm-up step (an over-estimate); else unknown.
   */
  private get stepEstimate(): number | null {
    if (this.secondsPerStep !== null) return this.secondsPerStep;
    const byPace = this.denoisePace === null ? null : this.denoisePace / DENOISE_STEP_PER_TRAIN_STEP;
    if (byPace !== null && (this.warmup === null || byPace < this.warmup)) return byPace;
    return this.warmup;
  }

  /**
   * The warm-up step before it ran (it compiles the training pipelines): a step at the estimated pace plus
   * WARMUP_COMPILE_PER_SAMPLE_COMPILE times what the first sample's first denoising step compiled (beyond a warm
   * denoising step); null without a sample drawn before it.
   */
  warmupEstimate(): number | null {
    if (this.firstDenoise === null || this.denoisePace === null) return null;
    return (this.stepEstimate ?? 0) + WARMUP_COMPILE_PER_SAMPLE_COMPILE * Math.max(0, this.firstDenoise - this.denoisePace);
  }

  /**
   * One sample: the median of the warm samples; else the first one's warm part (its denoising steps at their
   * warm pace and its decode) where known, else the whole first (it compiled); else a first estimate from s/step.
   */
  sampleEstimate(): { seconds: number; measured: boolean } {
    const warm = this.samples.filter((x) => !x.first).map((x) => x.seconds);
    if (warm.length) return { seconds: median(warm), measured: true };
    const first = this.samples[0];
    if (first && this.denoisePace !== null && first.decode !== null)
      return { seconds: Math.min(first.seconds, this.schedule.sampleSteps * this.denoisePace + first.decode), measured: true };
    if (first) return { seconds: first.seconds, measured: true };
    return { seconds: this.schedule.sampleSteps * DENOISE_STEP_PER_TRAIN_STEP * (this.stepEstimate ?? 0), measured: false };
  }

  /** One validation: the median of those measured (the first compiles nothing new: training did), else a first estimate. */
  validationEstimate(): { seconds: number; measured: boolean } {
    if (this.validations.length) return { seconds: median(this.validations), measured: true };
    return { seconds: (this.schedule.validationForwards ?? 0) * FORWARD_PER_TRAIN_STEP * (this.stepEstimate ?? 0), measured: false };
  }

  checkpointEstimate(): { seconds: number; measured: boolean } {
    if (this.checkpoints.length) return { seconds: median(this.checkpoints), measured: true };
    return { seconds: CHECKPOINT_PER_TRAIN_STEP * (this.stepEstimate ?? 0), measured: false };
  }

  /** What is left with `samples` samples, `validations` validations and the steps and checkpoints after step `done`. */
  private left(done: number, samples: number, validations: number): TimeReport {
    const s = this.schedule;
    const checkpoints = checkpointsAfter(done, s);
    const sample = this.sampleEstimate();
    const checkpoint = this.checkpointEstimate();
    const validation = this.validationEstimate();
    const steps = Math.max(0, s.steps - done);
    const step = this.stepEstimate;
    const eta =
      step === null && steps > 0 ? null : steps * (step ?? 0) + samples * sample.seconds + checkpoints * checkpoint.seconds + validations * validation.seconds;
    const provisional =
      (steps > 0 && this.secondsPerStep === null) ||
      (samples > 0 && !sample.measured) ||
      (checkpoints > 0 && !checkpoint.measured) ||
      (validations > 0 && !validation.measured);
    return { secondsPerStep: this.secondsPerStep, warmupSeconds: this.warmup, etaSeconds: eta, provisional };
  }

  /** The time report once step `done` is trained (its sample, later steps, samples and checkpoints to come). */
  afterStep(done: number): TimeReport {
    return this.left(done, samplesFrom(done, this.schedule), validationsIn(Math.max(done, 1), this.schedule.steps, this.schedule));
  }

  /**
   * Learns the warm denoising pace from a sample's progress: the time from the end of its first denoising step
   * (which compiles the sampling pipelines in a session's first sample) to the end of its last, per step.
   */
  private observeSample(step: number, denoised: number, total: number, elapsed: number): void {
    if (denoised === 1) {
      this.sampleMark = { step, first: elapsed };
      this.firstDenoise ??= elapsed;
    }
    if (denoised === total && total > 1 && this.sampleMark?.step === step) {
      const pace = (elapsed - this.sampleMark.first) / (total - 1);
      if (this.denoisePace === null || pace < this.denoisePace) this.denoisePace = pace;
      this.sampleDenoised = { step, last: elapsed, total };
    }
  }

  /**
   * The time report while the sample at step `done` is drawn (step 0: the one before training):
   * `denoised` of `total` denoising steps done in `elapsed` seconds. What is left of it is the larger of its
   * own pace (seconds per denoising step so far) and its estimate less the time spent (the VAE decode comes
   * after the last denoising step); then the rest of the run after it.
   */
  duringSample(done: number, denoised: number, total: number, elapsed: number): TimeReport {
    this.observeSample(done, denoised, total, elapsed);
    const rest = this.left(done, samplesIn(done + 1, this.schedule.steps, this.schedule), validationsIn(done + 1, this.schedule.steps, this.schedule));
    const byPace = denoised > 0 ? (elapsed / denoised) * (total - denoised) : 0;
    const byEstimate = this.sampleEstimate().seconds - elapsed;
    const thisSample = Math.max(0, byPace, byEstimate);
    return { ...rest, etaSeconds: rest.etaSeconds === null ? null : rest.etaSeconds + thisSample };
  }
}
