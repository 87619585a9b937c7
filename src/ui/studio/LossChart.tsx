// The live loss chart: uPlot on a canvas (raw per-step loss and a 10-step moving average), with the latest
// values in text beside it for screen readers and for anyone who wants the number.
import { useEffect, useMemo, useRef } from 'react';
import uPlot from 'uplot';
import 'uplot/dist/uPlot.min.css';

function movingAverage(ys: number[], n = 10): number[] {
  const out: number[] = [];
  let sum = 0;
  for (let i = 0; i < ys.length; i++) {
    sum += ys[i];
    if (i >= n) sum -= ys[i - n];
    out.push(sum / Math.min(i + 1, n));
  }
  return out;
}

export function LossChart({ losses }: { losses: { step: number; loss: number }[] }) {
  const box = useRef<HTMLDivElement>(null);
  const plot = useRef<uPlot | null>(null);
  // Memoised so the chart's data is set again only when the store hands over a new losses array.
  const finite = useMemo(() => losses.filter((l) => Number.isFinite(l.loss)), [losses]);

  useEffect(() => {
    const el = box.current;
    if (!el) return;
    const width = () => Math.max(240, Math.min(el.clientWidth || 600, 900));
    plot.current = new uPlot(
      {
        width: width(),
        height: 220,
        scales: { x: { time: false } },
        axes: [{ label: 'step' }, { label: 'loss', size: 60 }],
        series: [{ label: 'step' }, { label: 'loss', stroke: '#9bb7e0', width: 1 }, { label: 'average of 10', stroke: '#1f5fbf', width: 2 }],
        legend: { show: true },
      },
      [[], [], []],
      el,
    );
    const resize = () => plot.current?.setSize({ width: width(), height: 220 });
    window.addEventListener('resize', resize);
    return () => {
      window.removeEventListener('resize', resize);
      plot.current?.destroy();
      plot.current = null;
    };
  }, []);

  useEffect(() => {
    const ys = finite.map((l) => l.loss);
    plot.current?.setData([finite.map((l) => l.step), ys, movingAverage(ys)]);
  }, [finite]);

  const last = finite.at(-1);
  return (
    <figure className="chart" aria-labelledby="loss-caption">
      <div
        ref={box}
        data-testid="loss-chart"
        role="img"
        aria-label={last ? `Loss chart, ${finite.length} steps, latest loss ${last.loss.toFixed(4)}` : 'Loss chart, no steps yet'}
      />
      <figcaption id="loss-caption" data-testid="loss-text">
        {last
          ? `Loss at step ${last.step}: ${last.loss.toFixed(4)} (average of the last 10: ${movingAverage(finite.map((l) => l.loss))
              .at(-1)!
              .toFixed(4)})`
          : 'The training loss appears here, step by step.'}
      </figcaption>
    </figure>
  );
}
