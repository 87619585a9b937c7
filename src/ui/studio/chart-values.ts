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
