// The runs kept in this browser (issue 15, "Runs"): each with its thumbnail, mode, steps, date and the storage it
// uses; Open makes it the page's run (photos, settings, chart, samples, Try it; resume and export act on it),
// New run keeps the open one and starts another, Delete frees its storage (asking first, and stopping it
// when it is training). Runs whose storage the browser cleared are named, with a Remove button.
import { useEffect, useRef, useState } from 'react';
import { deleteRun, newRun, openRun, refreshRuns } from './actions.ts';
import { fmtBytes, renameWorkspace, runBusy, useStudioStore, type RunRow } from './state.ts';
import { summarize } from './runs.ts';

const MODE_LABELS = { lora: 'LoRA', full: 'Full' } as const;

function fmtDate(t: number): string {
  return t ? new Date(t).toLocaleString(undefined, { dateStyle: 'medium', timeStyle: 'short' }) : '—';
}

/** The kept runs; the open run's row follows the page as it changes (its storage and thumbnail come with the next refresh). */
function useLiveRuns(): RunRow[] {
  const listed = useStudioStore((s) => s.runs);
  const prompt = useStudioStore((s) => s.prompt);
  const settings = useStudioStore((s) => s.settings);
  const run = useStudioStore((s) => s.run);
  const workspace = useStudioStore((s) => s.workspace);
  return listed.map((r) => {
    if (!r.open) return r;
    const { id, created, updated, photoIds } = r;
    const live = summarize({
      version: 2,
      workspace,
      prompt,
      settings,
      preset: 'lora',
      model: null,
      photos: [],
      classPhotos: [],
      run: { ...run, samples: [], tries: [] },
    });
    return { ...r, ...live, id, created, updated, photoIds };
  });
}

export function RunsPanel() {
  const runs = useLiveRuns();
  const runId = useStudioStore((s) => s.run.runId);
  const lost = useStudioStore((s) => s.lostRuns);
  const storage = useStudioStore((s) => s.storage);
  const status = useStudioStore((s) => s.run.status);
  const exporting = useStudioStore((s) => s.exporting);
  const [asking, setAsking] = useState<RunRow | null>(null);
  const [renaming, setRenaming] = useState<string | null>(null);
  const [working, setWorking] = useState(false);
  const busy = runBusy(status);
  const blocked = busy ? 'Pause or stop the training run to open another.' : exporting ? 'Wait for the export to finish.' : null;
  const total = useStudioStore((s) => s.runsBytes);
  const act = async (f: () => Promise<void>) => {
    setWorking(true);
    try {
      await f();
    } finally {
      setWorking(false);
    }
  };
  // Nothing to list yet (one run, not started): the panel appears with the first run there is to keep.
  if (!lost.length && runs.length <= 1 && !runId && asking === null) return null;
  return (
    <section aria-labelledby="runs-title" data-testid="runs-panel">
      <h2 id="runs-title">Runs in this browser</h2>
      {lost.map((l) => (
        <div key={l.id} className="error" role="alert" data-testid="lost-run">
          <p>{l.message}</p>
          <button type="button" className="secondary" onClick={() => void act(() => deleteRun(l.id))} disabled={working}>
            Remove "{l.name}" from the list
          </button>
        </div>
      ))}
      <p className="hint" data-testid="runs-total">
        {runs.length} {runs.length === 1 ? 'run uses' : 'runs use'} about {fmtBytes(total)}
        {storage.usage !== null && ` · this site stores ${fmtBytes(storage.usage)}${storage.quota !== null ? ` of ${fmtBytes(storage.quota)} allowed` : ''}`}.
      </p>
      <ul className="runs" data-testid="runs">
        {runs.map((r) => (
          <RunItem key={r.id} r={r} renaming={renaming} setRenaming={setRenaming} working={working} blocked={blocked} act={act} ask={setAsking} />
        ))}
      </ul>
      <div className="row-wrap">
        <button type="button" onClick={() => void act(newRun)} disabled={working || blocked !== null}>
          New run
        </button>
        <span className="hint">{blocked ?? 'keeps the open run here and starts another with the same photos and settings'}</span>
      </div>
      {asking && (
        <ConfirmDelete
          row={asking}
          training={asking.open && busy}
          onClose={(yes) => {
            const r = asking;
            setAsking(null);
            if (yes) void act(() => deleteRun(r.id));
          }}
        />
      )}
    </section>
  );
}

interface RunItemProps {
  r: RunRow;
  renaming: string | null;
  setRenaming: (id: string | null) => void;
  working: boolean;
  /** Why another run cannot be opened now, or null. */
  blocked: string | null;
  act: (f: () => Promise<void>) => Promise<void>;
  ask: (r: RunRow) => void;
}

/** One run: thumbnail, name (or its rename field), prompt, facts; Open, Rename, Delete. */
function RunItem({ r, renaming, setRenaming, working, blocked, act, ask }: RunItemProps) {
  return (
    <li className={r.open ? 'open' : ''} aria-current={r.open ? 'true' : undefined} data-testid="run-row">
      {r.thumbUrl ? <img src={r.thumbUrl} alt={`Thumbnail of ${r.name}`} width={56} height={56} /> : <span className="no-thumb" aria-hidden="true" />}
      <div className="run-info">
        {renaming === r.id ? (
          <RenameField
            row={r}
            onDone={(name) => {
              setRenaming(null);
              if (name !== null) void renameWorkspace(r.id, name).then(refreshRuns);
            }}
          />
        ) : (
          <strong className="run-name">{r.name}</strong>
        )}
        {r.prompt && <span className="hint run-prompt">“{r.prompt}”</span>}
        <span data-testid="run-facts">
          {MODE_LABELS[r.mode]} · step {r.step} / {r.steps} · {r.status === 'idle' ? 'not started' : r.status} · {fmtDate(r.updated)} ·{' '}
          <span data-testid="run-bytes">{fmtBytes(r.bytes)}</span>
          {r.sharedBytes > 0 && ` (${fmtBytes(r.sharedBytes)} of photos shared with another run)`}
        </span>
      </div>
      <div className="row-wrap">
        {r.open ? (
          <span className="hint">open</span>
        ) : (
          <button type="button" onClick={() => void act(() => openRun(r.id))} disabled={working || blocked !== null} aria-label={`Open ${r.name}`}>
            Open
          </button>
        )}
        <button type="button" className="secondary" onClick={() => setRenaming(r.id)} disabled={working || renaming !== null} aria-label={`Rename ${r.name}`}>
          Rename
        </button>
        <button type="button" className="secondary" onClick={() => ask(r)} disabled={working} aria-label={`Delete ${r.name}`}>
          Delete
        </button>
      </div>
    </li>
  );
}

/** A modal dialog (the browser's <dialog>: focus kept inside, Escape cancels) asking before a delete. */
function ConfirmDelete({ row, training, onClose }: { row: RunRow; training: boolean; onClose: (yes: boolean) => void }) {
  const ref = useRef<HTMLDialogElement>(null);
  const keep = useRef<HTMLButtonElement>(null);
  useEffect(() => {
    const d = ref.current;
    if (d && !d.open) d.showModal();
    // The safe choice has the focus (showModal focuses the first button otherwise).
    keep.current?.focus();
  }, []);
  return (
    <dialog ref={ref} aria-labelledby="delete-title" data-testid="delete-dialog" onCancel={() => onClose(false)}>
      <h3 id="delete-title">Delete "{row.name}"?</h3>
      <p data-testid="delete-which">
        {MODE_LABELS[row.mode]} run of “{row.prompt || 'no prompt'}”, made {fmtDate(row.created)}, step {row.step} / {row.steps}.
      </p>
      <p>
        {training ? 'This run is training now: it will be stopped first. ' : ''}
        Its checkpoints, samples and Try it images are deleted ({fmtBytes(row.bytes)}
        {row.sharedBytes ? `, less the photos another run still uses` : ''}); export it first to keep the result.
      </p>
      <div className="row-wrap">
        <button type="button" className="danger" onClick={() => onClose(true)}>
          {training ? 'Stop and delete' : 'Delete'}
        </button>
        <button type="button" className="secondary" ref={keep} onClick={() => onClose(false)}>
          Keep it
        </button>
      </div>
    </dialog>
  );
}

/** The run's name as a text field (Enter or leaving it keeps the name, Escape drops the change; empty brings the default back). */
function RenameField({ row, onDone }: { row: RunRow; onDone: (name: string | null) => void }) {
  const [value, setValue] = useState(row.name);
  const done = useRef(false);
  const finish = (name: string | null) => {
    if (done.current) return;
    done.current = true;
    onDone(name);
  };
  return (
    <label className="run-rename">
      Name of the run
      <input
        autoFocus
        value={value}
        maxLength={80}
        onChange={(e) => setValue(e.target.value)}
        onBlur={() => finish(value)}
        onKeyDown={(e) => {
          if (e.key === 'Enter') finish(value);
          else if (e.key === 'Escape') finish(null);
        }}
      />
    </label>
  );
}
