// The live loss chart: uPlot on a canvas (raw per-step loss and a 10-step moving average). The legend is the
// page's own: it shows the values at the step under the pointer, or the latest ones, so it always says a
// number (uPlot's own legend says "--" until the pointer is over the plot). No chart is drawn before the
// first step: until then a line of text says where the loss will appear.
import { useEffect, useMemo, useRef, useState } from 'react';
import uPlot from 'uplot';
import 'uplot/dist/uPlot.min.css';
import { legendValues, movingAverage } from './chart-values.ts';

const RAW = '#9bb7e0';
const AVERAGE = '#1f5fbf';

export function LossChart({ losses }: { losses: { step: number; loss: number }[] }) {
  const box = useRef<HTMLDivElement>(null);
  const plot = useRef<uPlot | null>(null);
  const [hover, setHover] = useState<number | null>(null);
  // Memoised so the chart's data is set again only when the store hands over a new losses array.
  const finite = useMemo(() => losses.filter((l) => Number.isFinite(l.loss)), [losses]);
  const hasData = finite.length > 0;

  // The plot exists while there are steps to draw (a new run with no steps yet has none).
  useEffect(() => {
    const el = box.current;
    if (!el || !hasData) return;
    const width = () => Math.max(240, Math.min(el.clientWidth || 600, 900));
    plot.current = new uPlot(
      {
        width: width(),
        height: 220,
        scales: { x: { time: false } },
        axes: [{ label: 'step' }, { label: 'loss', size: 60 }],
        series: [{ label: 'step' }, { label: 'loss', stroke: RAW, width: 1 }, { label: 'average of 10', stroke: AVERAGE, width: 2 }],
        legend: { show: false },
        hooks: { setCursor: [(u) => setHover(u.cursor.idx ?? null)] },
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
      setHover(null);
    };
  }, [hasData]);

  useEffect(() => {
    const ys = finite.map((l) => l.loss);
    plot.current?.setData([finite.map((l) => l.step), ys, movingAverage(ys)]);
  }, [finite, hasData]);

  const shown = legendValues(finite, hover);
  const last = finite.at(-1);
  return (
    <figure className="chart" aria-labelledby="loss-caption">
      {hasData && (
        <ul className="chart-legend" data-testid="loss-legend" aria-label={shown?.latest ? 'Latest values' : `Values at step ${shown?.step}`}>
          <li>step {shown!.step}</li>
          <li>
            <span className="swatch" style={{ background: RAW }} aria-hidden="true" /> loss {shown!.loss.toFixed(4)}
          </li>
          <li>
            <span className="swatch" style={{ background: AVERAGE }} aria-hidden="true" /> average of 10 {shown!.average.toFixed(4)}
          </li>
        </ul>
      )}
      <div
        ref={box}
        hidden={!hasData}
        data-testid="loss-chart"
        role="img"
        aria-label={last ? `Loss chart, ${finite.length} steps, latest loss ${last.loss.toFixed(4)}` : 'Loss chart, no steps yet'}
      />
      <figcaption id="loss-caption" data-testid="loss-text">
        {last
          ? `Loss at step ${last.step}: ${last.loss.toFixed(4)} (average of the last 10: ${movingAverage(finite.map((l) => l.loss))
              .at(-1)!
              .toFixed(4)})`
          : 'The training loss appears here, step by step, from the first step.'}
      </figcaption>
    </figure>
  );
}
