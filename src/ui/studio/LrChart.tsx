// The learning-rate schedule of a run, small, under the loss chart: the rate of every update from the first
// to the last step (train/lr-schedule.ts, the trainer's own formula), and a dot at the step the run has
// reached. Adafactor with its relative step reads no rate: the chart says so instead of drawing one.
import { scheduleFactor, type LrSchedule } from '../../train/lr-schedule.ts';
import type { RunSettings } from '../../pipeline/settings.ts';

const W = 600;
const H = 80;
/** At most this many points are drawn (a long run is sampled evenly; the schedule is smooth between). */
const MAX_POINTS = 300;

/** The schedule's rate at each drawn step: [step, rate] pairs from step 0 to steps - 1. */
export function lrPoints(s: Pick<RunSettings, 'lr' | 'steps' | 'lrScheduler' | 'lrWarmup' | 'lrCycles' | 'lrPower'>): [number, number][] {
  const o: LrSchedule = { scheduler: s.lrScheduler, warmup: s.lrWarmup, steps: s.steps, lr: s.lr, cycles: s.lrCycles, power: s.lrPower };
  const every = Math.max(1, Math.ceil(s.steps / MAX_POINTS));
  const out: [number, number][] = [];
  for (let t = 0; t < s.steps; t += every) out.push([t, s.lr * scheduleFactor(o, t)]);
  if (out.at(-1)![0] !== s.steps - 1) out.push([s.steps - 1, s.lr * scheduleFactor(o, s.steps - 1)]);
  return out;
}

export function LrChart({ settings, step }: { settings: RunSettings; step: number }) {
  if (settings.optimizer === 'adafactor' && settings.adafactorRelativeStep === 'on')
    return (
      <p className="lr-chart-note" data-testid="lr-chart">
        Learning rate: Adafactor's own relative step (min(0.01, 1/√t) of each weight's scale); --lr is not read.
      </p>
    );
  const pts = lrPoints(settings);
  const max = Math.max(...pts.map((p) => p[1])) || 1;
  const x = (t: number) => (settings.steps > 1 ? (t / (settings.steps - 1)) * (W - 8) + 4 : W / 2);
  const y = (v: number) => H - 4 - (v / max) * (H - 8);
  const at = Math.min(Math.max(step, 0), settings.steps - 1);
  const o: LrSchedule = {
    scheduler: settings.lrScheduler,
    warmup: settings.lrWarmup,
    steps: settings.steps,
    lr: settings.lr,
    cycles: settings.lrCycles,
    power: settings.lrPower,
  };
  const now = settings.lr * scheduleFactor(o, at);
  return (
    <figure className="lr-chart" data-testid="lr-chart">
      <svg
        viewBox={`0 0 ${W} ${H}`}
        width="100%"
        height={H}
        role="img"
        aria-label={`Learning-rate schedule ${settings.lrScheduler}: ${now.toExponential(2)} at step ${at + 1} of ${settings.steps}`}
      >
        <polyline fill="none" stroke="#7c3aed" strokeWidth={2} points={pts.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(' ')} />
        <circle cx={x(at)} cy={y(now)} r={4} fill="#7c3aed" />
      </svg>
      <figcaption>
        Learning rate ({settings.lrScheduler}
        {settings.lrWarmup > 0 ? `, ${settings.lrWarmup} warm-up steps` : ''}): {now.toExponential(2)} at step {at + 1}, peak {max.toExponential(2)}
      </figcaption>
    </figure>
  );
}
