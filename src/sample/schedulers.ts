// Noise schedules and samplers for text-to-image: SD's DDPM schedule (scaled_linear betas, 1000 steps),
// DDIM (eta 0, "leading" timesteps with steps_offset 1) and DPM-Solver++ 2M (diffusers'
// DPMSolverMultistepScheduler: "linspace" timesteps, data prediction, second-order midpoint updates,
// first order at the last step, final sigma 0), for epsilon and v-prediction models. All on the CPU
// over Float32Arrays (latents are small); the UNet runs on the GPU.

export interface ScheduleConfig {
  numTrainTimesteps: number;
  betaStart: number;
  betaEnd: number;
  betaSchedule: 'scaled_linear' | 'linear';
  prediction: 'epsilon' | 'v_prediction';
}

export const SD_SCHEDULE: ScheduleConfig = {
  numTrainTimesteps: 1000,
  betaStart: 0.00085,
  betaEnd: 0.012,
  betaSchedule: 'scaled_linear',
  prediction: 'epsilon',
};

/** A scheduler config the engine cannot honour; the message names the file and the field. */
export class ScheduleConfigError extends Error {}

/**
 * Checks a scheduler config's fields before they are used: a schedule of 0 steps, betas out of (0, 1) or
 * falling, or a beta_schedule / prediction_type the engine does not implement would otherwise sample or train
 * on nonsense silently.
 */
function checkScheduleJson(j: Record<string, unknown>, where: string): void {
  const bad = (field: string, why: string) => new ScheduleConfigError(`${where}: ${field} ${why}`);
  const n = j.num_train_timesteps;
  if (n !== undefined && !(typeof n === 'number' && Number.isInteger(n) && n >= 2 && n <= 100_000))
    throw bad('num_train_timesteps', `must be a whole number from 2 to 100000, got ${JSON.stringify(n)}`);
  for (const k of ['beta_start', 'beta_end']) {
    const v = j[k];
    if (v !== undefined && !(typeof v === 'number' && v > 0 && v < 1)) throw bad(k, `must be a number between 0 and 1 (exclusive), got ${JSON.stringify(v)}`);
  }
  const start = (j.beta_start as number | undefined) ?? SD_SCHEDULE.betaStart;
  const end = (j.beta_end as number | undefined) ?? SD_SCHEDULE.betaEnd;
  if (start > end) throw bad('beta_start', `${start} is above beta_end ${end}: the noise must grow with the timestep`);
  const schedules = ['linear', 'scaled_linear'];
  if (j.beta_schedule !== undefined && !schedules.includes(j.beta_schedule as string))
    throw bad('beta_schedule', `${JSON.stringify(j.beta_schedule)} is not one the engine implements (${schedules.join(', ')})`);
  const predictions = ['epsilon', 'v_prediction'];
  if (j.prediction_type !== undefined && !predictions.includes(j.prediction_type as string))
    throw bad('prediction_type', `${JSON.stringify(j.prediction_type)} is not one the engine implements (${predictions.join(', ')})`);
}

export function scheduleFromJson(
  j: Record<string, unknown>,
  prediction?: 'epsilon' | 'v_prediction',
  where = 'scheduler/scheduler_config.json',
): ScheduleConfig {
  checkScheduleJson(j, where);
  return {
    numTrainTimesteps: (j.num_train_timesteps as number) ?? 1000,
    betaStart: (j.beta_start as number) ?? 0.00085,
    betaEnd: (j.beta_end as number) ?? 0.012,
    betaSchedule: j.beta_schedule === 'linear' ? 'linear' : 'scaled_linear',
    prediction: prediction ?? ((j.prediction_type as 'epsilon' | 'v_prediction') || 'epsilon'),
  };
}

/** alphā_t = prod_{s<=t} (1 - beta_s), float64. */
export function alphasCumprod(c: ScheduleConfig): Float64Array {
  const n = c.numTrainTimesteps;
  const out = new Float64Array(n);
  let prod = 1;
  for (let i = 0; i < n; i++) {
    const f = n === 1 ? 0 : i / (n - 1);
    const beta =
      c.betaSchedule === 'scaled_linear'
        ? (Math.sqrt(c.betaStart) + f * (Math.sqrt(c.betaEnd) - Math.sqrt(c.betaStart))) ** 2
        : c.betaStart + f * (c.betaEnd - c.betaStart);
    prod *= 1 - beta;
    out[i] = prod;
  }
  return out;
}

/** Predicted clean sample x0 and noise eps from the model output at alphā. */
function predictX0Eps(x: Float32Array, out: Float32Array, acp: number, prediction: ScheduleConfig['prediction']): { x0: Float32Array; eps: Float32Array } {
  const a = Math.sqrt(acp);
  const s = Math.sqrt(1 - acp);
  const x0 = new Float32Array(x.length);
  const eps = new Float32Array(x.length);
  for (let i = 0; i < x.length; i++) {
    if (prediction === 'epsilon') {
      eps[i] = out[i];
      x0[i] = (x[i] - s * out[i]) / a;
    } else {
      x0[i] = a * x[i] - s * out[i];
      eps[i] = a * out[i] + s * x[i];
    }
  }
  return { x0, eps };
}

export interface Sampler {
  /** Timesteps at which the model is evaluated, in order. */
  readonly timesteps: number[];
  /** Advances x given the model output at timesteps[i]. */
  step(i: number, x: Float32Array, modelOut: Float32Array): Float32Array;
}

/** DDIM, eta = 0: x_prev = sqrt(ā_prev) x0 + sqrt(1 - ā_prev) eps. */
export class Ddim implements Sampler {
  readonly timesteps: number[];
  private readonly acp: Float64Array;
  constructor(
    private readonly c: ScheduleConfig,
    steps: number,
  ) {
    this.acp = alphasCumprod(c);
    const ratio = Math.floor(c.numTrainTimesteps / steps);
    this.timesteps = Array.from({ length: steps }, (_, i) => (steps - 1 - i) * ratio + 1).filter((t) => t < c.numTrainTimesteps);
  }
  step(i: number, x: Float32Array, out: Float32Array): Float32Array {
    const t = this.timesteps[i];
    const prev = i + 1 < this.timesteps.length ? this.timesteps[i + 1] : -1;
    const { x0, eps } = predictX0Eps(x, out, this.acp[t], this.c.prediction);
    const aPrev = prev >= 0 ? this.acp[prev] : this.acp[0]; // set_alpha_to_one = false
    const r = new Float32Array(x.length);
    for (let k = 0; k < x.length; k++) r[k] = Math.sqrt(aPrev) * x0[k] + Math.sqrt(1 - aPrev) * eps[k];
    return r;
  }
}

/** DPM-Solver++ (2M): multistep data-prediction solver in lambda = log(alpha / sigma). */
export class DpmSolverPP2M implements Sampler {
  readonly timesteps: number[];
  private readonly acp: Float64Array;
  private prevX0: Float32Array | null = null;
  private prevLambda = 0;
  constructor(
    private readonly c: ScheduleConfig,
    steps: number,
  ) {
    this.acp = alphasCumprod(c);
    const n = c.numTrainTimesteps;
    this.timesteps = Array.from({ length: steps + 1 }, (_, i) => Math.round(((n - 1) * i) / steps))
      .reverse()
      .slice(0, steps);
  }
  private coeffs(t: number): { alpha: number; sigma: number; lambda: number } {
    const alpha = Math.sqrt(this.acp[t]);
    const sigma = Math.sqrt(1 - this.acp[t]);
    return { alpha, sigma, lambda: Math.log(alpha) - Math.log(sigma) };
  }
  step(i: number, x: Float32Array, out: Float32Array): Float32Array {
    const s = this.coeffs(this.timesteps[i]);
    const { x0 } = predictX0Eps(x, out, this.acp[this.timesteps[i]], this.c.prediction);
    const last = i === this.timesteps.length - 1;
    const r = new Float32Array(x.length);
    if (last) {
      r.set(x0); // final sigma 0: the data prediction itself
    } else {
      const t = this.coeffs(this.timesteps[i + 1]);
      const h = t.lambda - s.lambda;
      const k = t.alpha * (Math.exp(-h) - 1);
      const ratio = t.sigma / s.sigma;
      // Second order once a previous data prediction exists; the last step (to sigma 0) is first order.
      const secondOrder = this.prevX0 !== null;
      const r0 = secondOrder ? (s.lambda - this.prevLambda) / h : 0;
      for (let q = 0; q < x.length; q++) {
        const d1 = secondOrder ? (x0[q] - this.prevX0![q]) / r0 : 0;
        r[q] = ratio * x[q] - k * x0[q] - 0.5 * k * d1;
      }
    }
    this.prevX0 = x0;
    this.prevLambda = s.lambda;
    return r;
  }
}

/** Seeded standard normal values (mulberry32 + Box-Muller), the same in every host. */
export function randn(n: number, seed: number): Float32Array {
  let st = seed >>> 0;
  const next = () => {
    st = (st + 0x6d2b79f5) >>> 0;
    let t = st;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return (((t ^ (t >>> 14)) >>> 0) + 0.5) / 4294967296;
  };
  const out = new Float32Array(n);
  for (let i = 0; i < n; i += 2) {
    const r = Math.sqrt(-2 * Math.log(next()));
    const th = 2 * Math.PI * next();
    out[i] = r * Math.cos(th);
    if (i + 1 < n) out[i + 1] = r * Math.sin(th);
  }
  return out;
}
