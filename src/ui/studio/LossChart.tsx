// The live loss chart: uPlot on a canvas (raw per-step loss and a 10-step moving average, and the validation
// losses of the photos and of the class images as points every few steps: the photos' falling says the
// subject is being learnt, the class images' rising says the model drifts from its class). The legend is the
// page's own: it shows the values at the step under the pointer, or the latest ones, so it always says a
// number (uPlot's own legend says "--" until the pointer is over the plot). No chart is drawn before the
// first step: until then a line of text says where the loss will appear.
import { useEffect, useMemo, useRef, useState } from 'react';
import uPlot from 'uplot';
import 'uplot/dist/uPlot.min.css';
import { chartColumns, legendValues, movingAverage, STEP_TICKS, validationAt, type ValidationPoint } from './chart-values.ts';

const RAW = '#9bb7e0';
const AVERAGE = '#1f5fbf';
const VAL_PHOTOS = '#c2410c';
const VAL_CLASS = '#15803d';

export function LossChart({ losses, validation = [] }: { losses: { step: number; loss: number }[]; validation?: ValidationPoint[] }) {
  const box = useRef<HTMLDivElement>(null);
  const plot = useRef<uPlot | null>(null);
  const [hover, setHover] = useState<number | null>(null);
  // Memoised so the chart's data is set again only when the store hands over a new losses array.
  const finite = useMemo(() => losses.filter((l) => Number.isFinite(l.loss)), [losses]);
  const hasData = finite.length > 0;
  const columns = useMemo(() => chartColumns(finite, validation), [finite, validation]);
  const hasClass = columns.classes.some((v) => v !== null);

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
        // Steps are whole numbers: the x axis ticks only at whole steps (1, 2, 5, 10, ... apart).
        axes: [
          { label: 'step', incrs: STEP_TICKS },
          { label: 'loss', size: 60 },
        ],
        series: [
          { label: 'step' },
          { label: 'loss', stroke: RAW, width: 1 },
          { label: 'average of 10', stroke: AVERAGE, width: 2 },
          { label: 'validation (photos)', stroke: VAL_PHOTOS, width: 2, spanGaps: true, points: { show: true, size: 6 } },
          { label: 'validation (class images)', stroke: VAL_CLASS, width: 2, spanGaps: true, points: { show: true, size: 6 } },
        ],
        legend: { show: false },
        hooks: { setCursor: [(u) => setHover(u.cursor.idx ?? null)] },
      },
      [[], [], [], [], []],
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
    const c = columns;
    plot.current?.setData([c.steps, c.loss, c.average, c.instance, c.classes] as uPlot.AlignedData);
  }, [columns, hasData]);

  // The pointer is over a column of the merged steps; the legend shows the training loss at that step.
  const hoverStep = hover !== null ? columns.steps[hover] : undefined;
  const hoverIndex = hoverStep === undefined ? null : finite.findIndex((l) => l.step === hoverStep);
  const shown = legendValues(finite, hoverIndex !== null && hoverIndex >= 0 ? hoverIndex : null);
  const val = shown ? validationAt(validation, shown.step) : null;
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
          {val && val.instance !== null && (
            <li data-testid="validation-legend">
              <span className="swatch" style={{ background: VAL_PHOTOS }} aria-hidden="true" /> validation at step {val.step}: photos {val.instance.toFixed(4)}
              {hasClass && val.class !== null && (
                <>
                  {', '}
                  <span className="swatch" style={{ background: VAL_CLASS }} aria-hidden="true" /> class images {val.class.toFixed(4)}
                </>
              )}
            </li>
          )}
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
