// Step 4, Train: the buttons, the run's progress (steps, the phase under way with i of n and the time left, the
// sample being drawn), its status (a live region), warnings, gauges, the memory plan, the loss chart and samples.
import { useEffect, useRef, useState } from 'react';
import { cancelTraining, modelReady, pauseTraining, resumeTraining, startTraining } from './actions.ts';
import { LossChart } from './LossChart.tsx';
import { LrChart } from './LrChart.tsx';
import { fmtBytes, phaseEtaText, progressLine, runBusy, samplesHint, statusMessage, stepCount, useStudioStore, type RunProgress } from './state.ts';

function Gauge({ label, value, max, id }: { label: string; value: number; max: number | null; id: string }) {
  return (
    <div className="gauge">
      <label htmlFor={id}>{label}</label>
      <meter id={id} min={0} max={max ?? Math.max(1, value)} value={value} />
      <span>
        {fmtBytes(value)}
        {max ? ` of ${fmtBytes(max)}` : ''}
      </span>
    </div>
  );
}

const STATUS_LABELS: Record<string, string> = {
  preparing: 'Preparing',
  training: 'Training',
  pausing: 'Pausing',
  paused: 'Paused',
  done: 'Done',
  cancelled: 'Cancelled',
  error: 'Stopped',
  interrupted: 'Interrupted',
  'device-lost': 'GPU lost',
  quota: 'Not enough storage',
};

/** The panels a stopped run shows instead of a status line: a lost device, an interrupted run, full storage. */
function RunNotices({ run }: { run: RunProgress }) {
  return (
    <>
      {run.status === 'device-lost' && (
        <div className="error" role="alert" data-testid="device-lost">
          <h3>The GPU device was lost</h3>
          <p>
            {run.message} This happens when the driver resets or another program takes the GPU. Resume starts a new device and continues from the last
            checkpoint.
          </p>
        </div>
      )}
      {run.status === 'interrupted' && (
        <p className="notice" role="note" data-testid="interrupted">
          {run.message}
        </p>
      )}
      {run.status === 'quota' && (
        <div className="error" role="alert" data-testid="quota">
          <h3>Not enough browser storage for this run</h3>
          <p>{run.error}</p>
          <p>
            A full fine-tune keeps about 24 bytes per UNet weight (fp32 weights and two AdamW moments, plus the checkpointed copy); LoRA needs a small fraction
            of that. Free space, delete old site data, or switch to LoRA; a stopped run resumes from its last checkpoint.
          </p>
        </div>
      )}
    </>
  );
}

/** Train, Pause, Resume, Cancel; `onStart` runs as Train is pressed (the focus moves to the status line). */
function TrainButtons({ run, onStart }: { run: RunProgress; onStart: () => void }) {
  const photos = useStudioStore((s) => s.photos);
  const modelStatus = useStudioStore((s) => s.model.status);
  const busy = runBusy(run.status);
  const canResume =
    run.runId !== null && run.startedWith !== null && ['paused', 'interrupted', 'device-lost', 'error', 'quota'].includes(run.status) && run.step < run.steps;
  const ready = modelStatus === 'ready' && modelReady();
  return (
    <>
      <div className="row-wrap">
        <button
          type="button"
          onClick={() => {
            // A new run replaces the current one's checkpoints: ask first when there is progress to lose.
            if (
              run.runId &&
              run.step > 0 &&
              run.status !== 'cancelled' &&
              !confirm(
                `Train this run again from the start? Its ${stepCount(run.step)} and checkpoints will be deleted; export it first, or use "New run" (Runs, above) to keep it.`,
              )
            )
              return;
            onStart();
            void startTraining();
          }}
          disabled={busy || !ready || photos.length === 0}
        >
          {run.runId && run.status !== 'cancelled' ? 'Train again from the start' : 'Train'}
        </button>
        <button type="button" onClick={() => void pauseTraining()} disabled={run.status !== 'training'}>
          Pause
        </button>
        <button type="button" onClick={() => void resumeTraining()} disabled={!canResume || busy || !ready}>
          Resume
        </button>
        <button
          type="button"
          className="secondary"
          onClick={() => {
            if (run.step > 0 && !confirm(`Cancel the run? Its ${stepCount(run.step)} and checkpoints will be deleted.`)) return;
            void cancelTraining();
          }}
          disabled={!run.runId || run.status === 'done' || run.status === 'cancelled'}
        >
          Cancel
        </button>
      </div>
      {!ready && <p className="hint">Load a base model first{photos.length === 0 ? ' and add photos' : ''}.</p>}
      {ready && photos.length === 0 && <p className="hint">Add photos first.</p>}
    </>
  );
}

/**
 * The steps' progress, and under it what the run is doing right now where that takes a while: a phase with
 * items (class images, encoding, validation, an export) or the sample being drawn, each with i of n and the
 * time left.
 */
function RunProgressLines({ run }: { run: RunProgress }) {
  const busy = runBusy(run.status);
  const phase = busy ? run.phase : null;
  // While a phase with a time left is shown, its countdown moves once a second.
  const [now, setNow] = useState(() => Date.now());
  const counting = phase?.etaSeconds != null;
  useEffect(() => {
    if (!counting) return;
    const id = setInterval(() => setNow(Date.now()), 1000);
    return () => clearInterval(id);
  }, [counting]);
  return (
    <>
      <div className="progress-line">
        <label htmlFor="train-progress">Progress</label>
        <progress id="train-progress" max={run.steps || 1} value={run.step} />
        <span data-testid="train-progress-text">{progressLine(run)}</span>
      </div>
      {phase && !run.sampling && (
        <div className="progress-line" data-testid="phase-progress">
          {/* The message without its time left (progress.ts phaseLine): the countdown beside the bar says it. */}
          <label htmlFor="phase-progress">{run.message.replace(/ · [^·]*$/, '')}</label>
          <progress id="phase-progress" max={phase.total} value={phase.done} />
          <span>{phaseEtaText(phase, Math.max(now, phase.at ?? 0))}</span>
        </div>
      )}
      {run.sampling && busy && (
        <div className="progress-line" data-testid="sample-progress">
          <label htmlFor="sample-progress">
            Sample at step {run.sampling.step}: denoising step {run.sampling.denoised} of {run.sampling.total}
          </label>
          <progress id="sample-progress" max={run.sampling.total} value={run.sampling.denoised} />
        </div>
      )}
    </>
  );
}

function PlanNote({ plan }: { plan: NonNullable<RunProgress['plan']> }) {
  return (
    <p className="hint" data-testid="plan">
      Memory plan: peak {fmtBytes(plan.peakBytes)} of the {fmtBytes(plan.budgetBytes)} budget; activation checkpointing{' '}
      {plan.activationCheckpointing ? 'on' : 'off'};{' '}
      {plan.residentChunks >= plan.chunks
        ? 'optimizer state on the GPU'
        : `${plan.residentChunks} of ${plan.chunks} optimizer chunks on the GPU, the rest streamed from storage`}
      {plan.fusedUpdates ? ' (updates fused into the backward pass, so fewer chunks stream)' : ''}; {(plan.trainableParams / 1e6).toFixed(2)} M trained
      parameters, about {fmtBytes(plan.storageNeedBytes)} of storage.
    </p>
  );
}

function Samples({ run }: { run: RunProgress }) {
  const sampleSettings = useStudioStore((s) => s.settings);
  return (
    <>
      <h3>Samples</h3>
      <p className="hint" data-testid="samples-hint">
        {samplesHint(run, sampleSettings)}
      </p>
      {run.samples.length === 0 ? null : (
        <ul className="samples" data-testid="samples">
          {[...run.samples]
            .sort((a, b) => a.step - b.step)
            .map((s) => (
              <li key={s.step}>
                <img src={s.url} alt={`Sample at step ${s.step}`} width={128} height={128} />
                <span>step {s.step}</span>
              </li>
            ))}
        </ul>
      )}
    </>
  );
}

export function TrainPanel() {
  const statusRef = useRef<HTMLParagraphElement>(null);
  const run = useStudioStore((s) => s.run);
  const storage = useStudioStore((s) => s.storage);
  return (
    <section aria-labelledby="train-title">
      <h2 id="train-title">4. Train</h2>
      <RunNotices run={run} />
      {/* The Train button is disabled while the run prepares: the focus goes to the run's status (a live
          region), which says that the run started, not to the page's body. */}
      <TrainButtons run={run} onStart={() => statusRef.current?.focus()} />
      <RunProgressLines run={run} />
      <p role="status" aria-live="polite" data-testid="train-status" tabIndex={-1} ref={statusRef}>
        {run.status !== 'idle' && <strong>{STATUS_LABELS[run.status] ?? run.status}. </strong>}
        {statusMessage(run)}
      </p>
      {run.status === 'error' && run.error && (
        <p role="alert" className="bad" data-testid="train-error">
          {run.error}
        </p>
      )}
      {run.warnings.length > 0 && (
        <ul className="warnings" aria-label="Warnings">
          {run.warnings.map((w, i) => (
            <li key={i}>{w}</li>
          ))}
        </ul>
      )}
      <div className="gauges">
        <Gauge id="gpu-gauge" label="GPU memory (this step's peak)" value={run.gpuPeakBytes} max={run.plan?.budgetBytes ?? null} />
        <Gauge id="storage-gauge" label="Training storage" value={run.storageBytes} max={storage.quota} />
      </div>
      {run.plan && <PlanNote plan={run.plan} />}
      <LossChart losses={run.losses} validation={run.validation} />
      {run.startedWith && <LrChart settings={run.startedWith.settings} step={run.losses.at(-1)?.step ?? 0} />}
      <Samples run={run} />
    </section>
  );
}
