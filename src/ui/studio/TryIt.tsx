// "Try it" (issue 15): after a run (done) or while it is paused, a prompt, negative prompt, steps, guidance,
// seed and (LoRA runs) strength draw the fine-tuned model and the base model for the same seed in the worker
// (TrainingRun.tryIt through actions.ts tryTrainedRun), shown side by side. Each result is kept with the run
// (state.ts: the project's IndexedDB, like samples), listed newest first, and downloadable as PNGs that carry
// the generation parameters the way AUTOMATIC1111 writes them (a "parameters" text chunk).
import { useState, type ChangeEvent, type ReactNode } from 'react';
import { MAX_STRENGTH } from '../../pipeline/tryit.ts';
import { tryTrainedRun } from './actions.ts';
import { runBusy, useStudioStore, type RunProgress, type TryItem } from './state.ts';

/** Why Try it cannot run now, or null when it can. */
export function tryItBlocked(run: Pick<RunProgress, 'status' | 'step' | 'runId'>, modelReady: boolean, exporting = false): string | null {
  if (runBusy(run.status)) return 'The engine is busy training: pause the run (or wait until it is done) to try it.';
  if (exporting) return 'The engine is busy exporting: Try it is available again when the export is done.';
  if (!run.runId || run.step === 0)
    return 'No finished training step yet: Try it needs at least one (the fine-tuned model would still be the base model). Train first.';
  if (run.status !== 'done' && run.status !== 'paused') return 'Try it works on a paused or finished run: resume it, then pause.';
  if (!modelReady) return 'Load the model again (see Model above): Try it runs on it.';
  return null;
}

/** A download name for one image of a result. */
function fileName(t: TryItem, which: 'base' | 'tuned'): string {
  return `tryit-step${t.step}-seed${t.seed}-${which === 'tuned' ? 'fine-tuned' : 'base'}-${t.id}.png`;
}

function Field({ label, children }: { label: string; children: ReactNode }) {
  return (
    <label>
      {label}
      {children}
    </label>
  );
}

/** Where the two images are: the fine-tuned one first, then the base, each "step i of n". */
function TryProgress({ progress }: { progress: { done: number; total: number } }) {
  const half = progress.total / 2;
  return (
    <p role="status" data-testid="tryit-progress">
      <label>
        {progress.done < half ? `Fine-tuned: step ${progress.done} of ${half}` : `Base: step ${progress.done - half} of ${half}`}{' '}
        <progress max={progress.total} value={progress.done} />
      </label>
    </p>
  );
}

/** The run's results, newest first: base and fine-tuned side by side, each downloadable, each removable. */
function TryResults({ tries }: { tries: TryItem[] }) {
  const remove = (id: string) =>
    useStudioStore.getState().setRun((x) => {
      const gone = (x.tries ?? []).find((t) => t.id === id);
      for (const u of [gone?.baseUrl, gone?.tunedUrl]) if (u) URL.revokeObjectURL(u);
      return { tries: (x.tries ?? []).filter((t) => t.id !== id) };
    });
  return (
    <ul className="tries" aria-label="Try it results, newest first">
      {tries.map((t) => (
        <li key={t.id} data-testid="tryit-result">
          <div className="pair">
            {(['base', 'tuned'] as const).map((which) => (
              <figure key={which}>
                <img src={which === 'base' ? t.baseUrl : t.tunedUrl} alt={`${which === 'base' ? 'base' : 'fine-tuned'}: ${t.prompt}`} />
                <figcaption>{which === 'base' ? 'base' : 'fine-tuned'}</figcaption>
                <a href={which === 'base' ? t.baseUrl : t.tunedUrl} download={fileName(t, which)}>
                  Download {which === 'base' ? 'base' : 'fine-tuned'} PNG
                </a>
              </figure>
            ))}
          </div>
          <p className="hint">
            Step {t.step} · “{t.prompt}”{t.negativePrompt ? ` · not “${t.negativePrompt}”` : ''} · {t.steps} steps · CFG {t.guidance} · seed {t.seed}
            {t.strength !== null ? ` · strength ${t.strength}` : ''}
          </p>
          <button
            type="button"
            className="secondary"
            aria-label={`Remove the result of step ${t.step}, seed ${t.seed} ("${t.prompt}")`}
            onClick={() => remove(t.id)}
          >
            Remove
          </button>
        </li>
      ))}
    </ul>
  );
}

export function TryItPanel() {
  const run = useStudioStore((s) => s.run);
  const modelReady = useStudioStore((s) => s.model.status === 'ready');
  const exporting = useStudioStore((s) => s.exporting);
  const lora = run.startedWith?.settings.mode !== 'full';
  const [prompt, setPrompt] = useState<string | null>(null);
  const [negative, setNegative] = useState('');
  const [steps, setSteps] = useState(20);
  const [guidance, setGuidance] = useState(7.5);
  const [seed, setSeed] = useState<number | null>(null);
  const [strength, setStrength] = useState(1);
  const [busy, setBusy] = useState(false);
  const [progress, setProgress] = useState<{ done: number; total: number } | null>(null);
  const [error, setError] = useState('');
  const blocked = tryItBlocked(run, modelReady, exporting);
  const started = run.startedWith;
  const shownPrompt = prompt ?? (started ? started.settings.samplePrompt || started.prompt : '');
  const shownSeed = seed ?? started?.settings.seed ?? 42;
  const tries = run.tries ?? [];

  const generate = async () => {
    setBusy(true);
    setError('');
    setProgress(null);
    try {
      const o = { prompt: shownPrompt, negativePrompt: negative, steps, guidance, seed: shownSeed, ...(lora ? { strength } : {}) };
      const r = await tryTrainedRun(o, (done, total) => setProgress({ done, total }));
      const png = (bytes: Uint8Array) => new Blob([bytes as Uint8Array<ArrayBuffer>], { type: 'image/png' });
      const [base, tuned] = [png(r.base.png), png(r.tuned.png)];
      const item: TryItem = {
        id: Date.now().toString(36),
        step: r.step,
        prompt: o.prompt,
        negativePrompt: negative,
        steps,
        guidance,
        seed: shownSeed,
        strength: r.strength,
        base,
        tuned,
        baseUrl: URL.createObjectURL(base),
        tunedUrl: URL.createObjectURL(tuned),
      };
      useStudioStore.getState().setRun((x) => ({ tries: [item, ...(x.tries ?? [])] }));
    } catch (e) {
      setError((e as Error).message);
    } finally {
      setBusy(false);
      setProgress(null);
    }
  };

  const num =
    (set: (v: number) => void, whole = false) =>
    (e: ChangeEvent<HTMLInputElement>) => {
      const v = Number(e.target.value);
      if (e.target.value !== '' && Number.isFinite(v)) set(whole ? Math.round(v) : v);
    };

  return (
    <section aria-labelledby="tryit-title" data-testid="tryit">
      <h2 id="tryit-title">Try it</h2>
      <p className="hint">
        Draw with the fine-tuned model and with the base model for the same seed, side by side. The PNGs carry the settings as AUTOMATIC1111 writes them (PNG
        Info reads them back).
      </p>
      <form
        className="form"
        onSubmit={(e) => {
          e.preventDefault();
          if (!blocked && !busy) void generate();
        }}
      >
        <label className="span-2">
          Try-it prompt
          <input type="text" name="tryit-prompt" value={shownPrompt} onChange={(e) => setPrompt(e.target.value)} />
        </label>
        <label className="span-2">
          Try-it negative prompt
          <input type="text" name="tryit-negative" value={negative} onChange={(e) => setNegative(e.target.value)} />
        </label>
        <Field label="Try-it denoising steps">
          <input type="number" name="tryit-steps" min={1} max={150} step={1} value={steps} onChange={num((v) => setSteps(Math.max(1, v)), true)} />
        </Field>
        <Field label="Try-it guidance (CFG scale)">
          <input type="number" name="tryit-guidance" min={0} max={100} step="any" value={guidance} onChange={num(setGuidance)} />
        </Field>
        <Field label="Try-it seed">
          <input type="number" name="tryit-seed" min={0} step={1} value={shownSeed} onChange={num((v) => setSeed(Math.max(0, v)), true)} />
        </Field>
        {lora && (
          <Field label="Try-it LoRA strength">
            <input type="number" name="tryit-strength" min={-MAX_STRENGTH} max={MAX_STRENGTH} step="any" value={strength} onChange={num(setStrength)} />
          </Field>
        )}
        <button type="submit" disabled={blocked !== null || busy} aria-describedby={blocked ? 'tryit-blocked' : undefined}>
          {busy ? 'Generating…' : 'Generate'}
        </button>
      </form>
      {blocked && (
        <p className="hint" id="tryit-blocked" role="status" data-testid="tryit-blocked">
          {blocked}
        </p>
      )}
      {busy && progress && <TryProgress progress={progress} />}
      {error && (
        <p className="error" role="alert">
          {error}
        </p>
      )}
      {tries.length > 0 && <TryResults tries={tries} />}
    </section>
  );
}
