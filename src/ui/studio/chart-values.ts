// The loss chart's numbers (pure, so Node tests check them): the moving average it draws and the values its
// legend shows.

/** The mean of the last `n` values at each point (fewer at the start). */
export function movingAverage(ys: number[], n = 10): number[] {
  const out: number[] = [];
  let sum = 0;
  for (let i = 0; i < ys.length; i++) {
    sum += ys[i];
    if (i >= n) sum -= ys[i - n];
    out.push(sum / Math.min(i + 1, n));
  }
  return out;
}

/** The legend's row: the point under the pointer (`hover`, an index) when there is one, else the latest. */
export function legendValues(
  losses: { step: number; loss: number }[],
  hover: number | null,
): { step: number; loss: number; average: number; latest: boolean } | null {
  if (!losses.length) return null;
  const i = hover !== null && hover >= 0 && hover < losses.length ? hover : losses.length - 1;
  return {
    step: losses[i].step,
    loss: losses[i].loss,
    average: movingAverage(losses.slice(0, i + 1).map((l) => l.loss)).at(-1)!,
    latest: i === losses.length - 1,
  };
}

/** A validation record as the chart takes it (DreamBoothTrainer.validate's report). */
export interface ValidationPoint {
  step: number;
  instance: number | null;
  class: number | null;
}

/**
 * The chart's aligned columns: every step with a training loss or a validation loss (validation starts at step
 * 0, before the first training step), each series null where it has no value (uPlot leaves a gap, or joins the
 * points of a sparse series with spanGaps).
 */
export function chartColumns(
  losses: { step: number; loss: number }[],
  validation: ValidationPoint[],
): { steps: number[]; loss: (number | null)[]; average: (number | null)[]; instance: (number | null)[]; classes: (number | null)[] } {
  const average = movingAverage(losses.map((l) => l.loss));
  const byStep = new Map<number, { loss: number; average: number }>(losses.map((l, i) => [l.step, { loss: l.loss, average: average[i] }]));
  const valByStep = new Map(validation.map((v) => [v.step, v]));
  const steps = [...new Set([...byStep.keys(), ...valByStep.keys()])].sort((a, b) => a - b);
  const finite = (x: number | null | undefined) => (x !== null && x !== undefined && Number.isFinite(x) ? x : null);
  return {
    steps,
    loss: steps.map((s) => byStep.get(s)?.loss ?? null),
    average: steps.map((s) => byStep.get(s)?.average ?? null),
    instance: steps.map((s) => finite(valByStep.get(s)?.instance)),
    classes: steps.map((s) => finite(valByStep.get(s)?.class)),
  };
}

/** The latest validation at or before `step` (the legend's validation values), or null. */
export function validationAt(validation: ValidationPoint[], step: number): ValidationPoint | null {
  let found: ValidationPoint | null = null;
  for (const v of validation) if (v.step <= step && (!found || v.step >= found.step)) found = v;
  return found;
}

/** The loss chart's x-axis tick spacings: whole steps only (1, 2, 5 per decade), never a fractional step. */
export const STEP_TICKS: number[] = [1, 2, 5].flatMap((m) => [1, 10, 100, 1000, 10000, 100000].map((d) => m * d)).sort((a, b) => a - b);
