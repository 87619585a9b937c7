// The trainer's checks before it trusts anything: the run's data and settings (validate, before any GPU work)
// and a checkpoint's record (checkCheckpointMeta, before anything is restored).
import { gemmConfigProblem } from '../gpu/device.ts';
import { MASTER_KINDS, OPTIMIZER_KINDS } from './packed-state.ts';
import { HUBER_C_DEFAULT, LOSS_KINDS } from './loss-options.ts';
import { HOST_OPTIMIZERS, isHostOptimizer } from './host-optimizer.ts';
import type { CheckpointMeta, TrainData, TrainSettings } from './train-types.ts';

/** A checkpoint whose record cannot be true (a damaged or edited file): never trusted, always named. */
export class CheckpointError extends Error {
  override name = 'CheckpointError';
}

/**
 * The checkpoint's record checked before anything is restored: the step a whole number within the run it
 * was made for, applied steps within it, one loss per step, a finite loss scale, a version for each stored
 * chunk of this run's layout. Optimizer files are checked for size as they are read (optimizer.restore).
 */
export function checkCheckpointMeta(m: CheckpointMeta, chunks: number): void {
  const bad = (what: string) => {
    throw new CheckpointError(`this run's last checkpoint is damaged (${what}): it cannot be resumed; start the run again`);
  };
  const whole = (x: unknown, lo: number, hi: number) => typeof x === 'number' && Number.isInteger(x) && x >= lo && x <= hi;
  if (typeof m !== 'object' || m === null || typeof m.settings !== 'object' || m.settings === null) bad('no settings');
  if (!whole(m.settings.steps, 1, Number.MAX_SAFE_INTEGER)) bad(`its run has ${m.settings.steps} steps`);
  if (!whole(m.step, 0, m.settings.steps)) bad(`step ${m.step} is not within 0..${m.settings.steps}`);
  if (!whole(m.applied, 0, m.step)) bad(`${m.applied} applied steps at step ${m.step}`);
  if (
    m.validation !== undefined &&
    (!Array.isArray(m.validation) ||
      !m.validation.every((v) => whole(v?.step, 0, m.step) && [v.instance, v.class].every((l) => l === null || typeof l === 'number')))
  )
    bad('validation losses');
  if (!Array.isArray(m.losses) || m.losses.length !== m.step || !m.losses.every((l) => l === null || typeof l === 'number'))
    bad(`${Array.isArray(m.losses) ? m.losses.length : 'no'} losses for ${m.step} steps`);
  if (!whole(m.rng, 0, 2 ** 32 - 1)) bad(`random state ${m.rng}`);
  if (m.settings.ema && !whole(m.ema, 0, m.step)) bad(`${m.ema} EMA updates at step ${m.step}`);
  if (m.gemm !== undefined && gemmConfigProblem(m.gemm)) bad(`GEMM config: ${gemmConfigProblem(m.gemm)}`);
  const sc = m.scaler;
  if (
    typeof sc !== 'object' ||
    sc === null ||
    !(Number.isFinite(sc.scale) && sc.scale > 0) ||
    !whole(sc.goodSteps, 0, Number.MAX_SAFE_INTEGER) ||
    !whole(sc.skipped, 0, Number.MAX_SAFE_INTEGER)
  )
    bad('loss scale');
  if (typeof m.versions !== 'object' || m.versions === null) bad('no chunk versions');
  for (const [k, v] of Object.entries(m.versions))
    if (!whole(Number(k), 0, chunks - 1) || !whole(v, 0, Number.MAX_SAFE_INTEGER)) bad(`chunk ${k} version ${v} for a layout of ${chunks} chunks`);
}

export function validate(data: TrainData, s: TrainSettings): void {
  if (data.instance.length === 0) throw new Error('no instance images: add at least one photo of the subject');
  if (!(s.lr > 0)) throw new Error(`learning rate must be > 0, got ${s.lr}`);
  if (s.textEncoderLr !== undefined && !(s.textEncoderLr >= 0 && Number.isFinite(s.textEncoderLr)))
    throw new Error(`text-encoder learning rate must be 0 (the learning rate) or more, got ${s.textEncoderLr}`);
  if (!Number.isInteger(s.steps) || s.steps < 1) throw new Error(`steps must be a positive integer, got ${s.steps}`);
  if (s.mode === 'lora' && (!Number.isInteger(s.rank) || s.rank < 1)) throw new Error(`LoRA rank must be a positive integer, got ${s.rank}`);
  const kinds: readonly string[] = [...OPTIMIZER_KINDS, ...HOST_OPTIMIZERS];
  if (!kinds.includes(s.optimizer)) throw new Error(`optimizer must be one of ${kinds.join(', ')}, got ${String(s.optimizer)}`);
  if (isHostOptimizer(s.optimizer) && (s.mode !== 'lora' || s.master !== 'fp32'))
    throw new Error(`the ${s.optimizer} optimizer keeps its state on the host: it is for LoRA runs with fp32 masters (got ${s.mode}, ${s.master})`);
  if (isHostOptimizer(s.optimizer) && s.textEncoderLr !== undefined && s.textEncoderLr !== 0 && s.textEncoderLr !== s.lr)
    throw new Error(`the ${s.optimizer} optimizer has one learning rate: leave textEncoderLr unset`);
  if (s.fusedUpdates && s.mode !== 'full')
    throw new Error(`fused updates are for full fine-tuning (a LoRA run's gradients are small): turn fusedUpdates (--fused-updates) off for a ${s.mode} run`);
  if (!MASTER_KINDS.includes(s.master)) throw new Error(`master must be one of ${MASTER_KINDS.join(', ')}, got ${String(s.master)}`);
  if (!Number.isInteger(s.maxConsecutiveSkips) || s.maxConsecutiveSkips < 1)
    throw new Error(`maxConsecutiveSkips (skipped steps in a row before the run stops) must be a positive integer, got ${s.maxConsecutiveSkips}`);
  for (const [what, set] of [
    ['instance', data.instance],
    ['class', data.classes],
  ] as const)
    for (const [i, x] of set.entries()) {
      const [c, h, w] = x.latentShape ?? data.latentShape;
      if (x.latentShape && (x.latentShape.length !== 3 || c !== data.latentShape[0] || !x.latentShape.every((d) => Number.isInteger(d) && d > 0)))
        throw new Error(`${what} image ${i}'s latent shape [${x.latentShape.join(', ')}] is not [${data.latentShape[0]}, h, w]`);
      if (x.latent.length !== c * h * w) throw new Error(`${what} latent ${i} has ${x.latent.length} values, expected ${c}x${h}x${w}`);
      if (!x.mask) continue;
      if (x.mask.length !== h * w) throw new Error(`${what} image ${i}'s loss mask has ${x.mask.length} values, expected ${h}x${w}`);
      if (!x.mask.every((v) => v >= 0 && v <= 1)) throw new Error(`${what} image ${i}'s loss mask has values outside [0, 1] (or non-finite ones)`);
    }
}

/** The noise, loss and EMA settings against the model's schedule (the trainer's own API checks them too). */
export function validateKnobs(s: TrainSettings, T: number, prediction: 'epsilon' | 'v_prediction'): void {
  const whole = (x: number | undefined, lo: number, hi: number) => x === undefined || (Number.isInteger(x) && x >= lo && x <= hi);
  const lo = s.minTimestep ?? 0;
  const hi = s.maxTimestep ?? T;
  if (!whole(lo, 0, T - 1) || !whole(hi, 1, T) || lo >= hi)
    throw new Error(`timesteps must be drawn from a range within 0..${T}: minTimestep ${lo} must be below maxTimestep ${hi}, both whole`);
  if (s.zeroTerminalSnr && prediction !== 'v_prediction')
    throw new Error(
      "zero terminal SNR trains the last timestep on pure noise, where an epsilon-prediction model's target is its own input: it needs a v-prediction model (SD 2.x 768-v); leave zeroTerminalSnr (--zero-terminal-snr) off for this one",
    );
  if (!whole(s.multiresNoiseIterations, 0, 100)) throw new Error(`multiresNoiseIterations must be a whole number 0..100, got ${s.multiresNoiseIterations}`);
  if (s.multiresNoiseIterations && s.offsetNoise > 0) throw new Error('multires noise and offset noise both reshape the noise: use one of them');
  for (const [k, v, max] of [
    ['multiresNoiseDiscount', s.multiresNoiseDiscount, 1],
    ['ipNoiseGamma', s.ipNoiseGamma, 1],
    ['huberC', s.huberC, 1],
  ] as const)
    if (v !== undefined && !(v >= 0 && v <= max)) throw new Error(`${k} must be from 0 to ${max}, got ${v}`);
  if (s.loss !== undefined && !LOSS_KINDS.includes(s.loss)) throw new Error(`loss must be one of ${LOSS_KINDS.join(', ')}, got ${String(s.loss)}`);
  if (s.loss && s.loss !== 'l2' && !((s.huberC ?? HUBER_C_DEFAULT) > 0)) throw new Error(`huberC must be above 0 for the ${s.loss} loss, got ${s.huberC}`);
  const e = s.ema;
  if (
    e &&
    !(
      e.decay >= 0 &&
      e.decay < 1 &&
      e.minDecay >= 0 &&
      e.minDecay <= e.decay &&
      e.invGamma > 0 &&
      e.power > 0 &&
      whole(e.updateAfterStep, 0, Number.MAX_SAFE_INTEGER)
    )
  )
    throw new Error(
      `ema settings out of range (decay in [0, 1), 0 <= minDecay <= decay, invGamma and power above 0, updateAfterStep whole): ${JSON.stringify(e)}`,
    );
}
