// The studio page's state (zustand) and what it keeps across reloads (IndexedDB through idb-keyval): the
// prompt, the settings, the photos (as Blobs, with crops and captions), which model was used, and the run's
// progress (id, step, losses, samples, last checkpoint). The training state itself is in the worker's chunk
// store; a run interrupted by a reload or a lost device resumes from its last checkpoint.
import { createStore, del, entries, get, keys, set as idbSet, type UseStore } from 'idb-keyval';
import { create } from 'zustand';
import type { AdapterSummary } from '../../gpu/device.ts';
import type { CropBox } from '../../io/image.ts';
import { formatBytes } from '../../util/bytes.ts';
import type { ExportFormat, PlanSummary } from '../../pipeline/run.ts';
import { etaText, type PhaseReport } from '../../pipeline/progress.ts';
import { defaultSettings, type RunSettings as StudioSettings } from '../../pipeline/settings.ts';
import { PAGE_DEFAULTS as DEFAULT_SETTINGS, PRESETS, type PresetName } from './presets.ts';
import type { ModelSummary } from '../../studio/worker.ts';
import type { ValidationReport } from '../../train/trainer.ts';
import {
  cleanRunName,
  legacyMaskKey,
  nextRunNumber,
  legacyWorkspaceId,
  maskKey,
  OPEN_KEY,
  photoKey,
  projectBlobKeys,
  sampleKey,
  thumbKey,
  tryKey,
  workspaceKey,
  type PhotoMeta,
  type RunSummary,
  type SavedProject,
  type WorkspaceInfo,
} from './runs.ts';

/** The model as remembered: demo and hub models reopen by themselves; files must be given again. */
export type ModelRef =
  | { kind: 'demo' }
  | { kind: 'hub'; endpoint: string; repo: string }
  | { kind: 'file'; name: string; size: number; config?: string }
  | { kind: 'folder'; name: string; count: number };

export interface PhotoItem {
  id: string;
  name: string;
  blob: Blob;
  /** Upright size from the header. */
  width: number;
  height: number;
  crop: CropBox;
  /** The crop was moved by the user (else the centred square): the run gets it and does not warn "not square". */
  cropChosen?: boolean;
  caption: string;
  /** Object URL for thumbnails (not persisted). */
  url?: string;
  /** The loss mask painted on it (a PNG of the photo's shape, white = subject; ui/studio/MaskEditor.tsx), if any. */
  mask?: Blob;
}

export type RunStatus = 'idle' | 'preparing' | 'training' | 'pausing' | 'paused' | 'done' | 'cancelled' | 'error' | 'interrupted' | 'device-lost' | 'quota';

export interface SampleItem {
  step: number;
  blob: Blob;
  url?: string;
}

/** A "Try it" result (ui/studio/TryIt.tsx): base and fine-tuned PNGs (with A1111's parameters text) for one seed. */
export interface TryItem {
  id: string;
  /** The run's step the fine-tuned image was drawn at. */
  step: number;
  prompt: string;
  negativePrompt: string;
  steps: number;
  guidance: number;
  seed: number;
  /** LoRA strength; null for a full fine-tune. */
  strength: number | null;
  base: Blob;
  tuned: Blob;
  /** Object URLs for display (not persisted). */
  baseUrl?: string;
  tunedUrl?: string;
}

export interface ExportItem {
  format: ExportFormat;
  name: string;
  size: number;
  url: string;
}

export interface RunProgress {
  runId: string | null;
  status: RunStatus;
  message: string;
  step: number;
  steps: number;
  losses: { step: number; loss: number }[];
  /** Validation losses (photos, class images) at fixed noise, every few steps; absent in projects saved before. */
  validation?: ValidationReport[];
  /** Median of the recent warm steps; null (or 0, in projects saved before) until one is timed. */
  secondsPerStep: number | null;
  /** The session's first step, which compiles the GPU pipelines (not counted in s/step). */
  warmupSeconds?: number | null;
  /** Steps, samples and checkpoints still to come; null while nothing is timed. */
  etaSeconds: number | null;
  /** The ETA rests partly on first estimates. */
  etaProvisional?: boolean;
  /** The sample being drawn: denoising step `denoised` of `total`. */
  sampling?: { step: number; denoised: number; total: number } | null;
  /**
   * The phase under way when it has items (class images, encoding, validation, ...): i of n and the time left,
   * as reported at `at` (ms since the epoch; the page counts down from there).
   */
  phase?: (PhaseReport & { at?: number }) | null;
  gpuBytes: number;
  gpuPeakBytes: number;
  storageBytes: number;
  lastCheckpoint: number;
  plan: PlanSummary | null;
  warnings: string[];
  error: string | null;
  samples: SampleItem[];
  /** "Try it" images of this run, newest first (absent in projects saved before). */
  tries?: TryItem[];
  /** Settings, prompt and photos the run was started with (a resume uses these, not later edits). */
  startedWith: { prompt: string; settings: StudioSettings; photoIds: string[]; classIds: string[] } | null;
}

export type EnvState =
  | { kind: 'loading' }
  | {
      kind: 'ready';
      adapter: AdapterSummary;
      hasF16: boolean;
      /** The GEMM kernel config in force and its source (worker init's tuning). */
      gemm: string;
      /** Whether f16 GEMMs run on tensor cores and why (worker init, Gpu.tensorCoreNote). */
      tensorCores: string;
    }
  | { kind: 'error'; noWebGpu: boolean; message: string };

export interface StudioState {
  env: EnvState;
  storage: { persisted: boolean | null; quota: number | null; usage: number | null };
  model: {
    ref: ModelRef | null;
    summary: ModelSummary | null;
    status: 'none' | 'loading' | 'ready' | 'needs-file' | 'error';
    message: string;
    download: { path: string; loaded: number; total: number | null } | null;
  };
  photos: PhotoItem[];
  classPhotos: PhotoItem[];
  photoErrors: string[];
  prompt: string;
  preset: PresetName;
  settings: StudioSettings;
  run: RunProgress;
  exports: ExportItem[];
  exporting: boolean;
  exportError: string | null;
  /** What the last export did or is doing (its own line: the run's status stays as it was). */
  exportMessage: string;
  /** Export through the browser's save dialog (streams to disk) where it exists. */
  saveWithDialog: boolean;
  restored: boolean;
  /** The open run's workspace: its id and dates, and its small thumbnail for the runs list. */
  workspace: WorkspaceInfo & { thumb?: Blob };
  /** The runs kept in this browser (ui/studio/Runs.tsx), the open one included; refreshed by actions.refreshRuns. */
  runs: RunRow[];
  /** What all runs store together (training state and Blobs, each shared photo once). */
  runsBytes: number;
  /** Runs whose storage the browser cleared, with what is gone. */
  lostRuns: { id: string; name: string; message: string }[];
  set: (p: Partial<StudioState> | ((s: StudioState) => Partial<StudioState>)) => void;
  setRun: (p: Partial<RunProgress> | ((r: RunProgress) => Partial<RunProgress>)) => void;
  setSettings: (p: Partial<StudioSettings>) => void;
}

/** A row of the runs list: the summary, its storage and a thumbnail URL. */
export interface RunRow extends RunSummary {
  open: boolean;
  bytes: number;
  /** Bytes of photos also used by another run (counted in each). */
  sharedBytes: number;
  thumbUrl: string | null;
}

export const EMPTY_RUN: RunProgress = {
  runId: null,
  status: 'idle',
  message: '',
  step: 0,
  steps: 0,
  losses: [],
  validation: [],
  secondsPerStep: null,
  warmupSeconds: null,
  etaSeconds: null,
  etaProvisional: false,
  sampling: null,
  phase: null,
  gpuBytes: 0,
  gpuPeakBytes: 0,
  storageBytes: 0,
  lastCheckpoint: 0,
  plan: null,
  warnings: [],
  error: null,
  samples: [],
  startedWith: null,
};

export const useStudioStore = create<StudioState>((set) => ({
  env: { kind: 'loading' },
  storage: { persisted: null, quota: null, usage: null },
  model: { ref: null, summary: null, status: 'none', message: '', download: null },
  photos: [],
  classPhotos: [],
  photoErrors: [],
  prompt: 'a photo of sks dog',
  preset: 'lora',
  settings: { ...DEFAULT_SETTINGS, ...PRESETS.lora.settings },
  run: EMPTY_RUN,
  exports: [],
  exporting: false,
  exportError: null,
  exportMessage: '',
  saveWithDialog: true,
  restored: false,
  workspace: { id: `w-${Date.now().toString(36)}`, created: Date.now(), updated: Date.now() },
  runs: [],
  runsBytes: 0,
  lostRuns: [],
  set: (p) => set(p),
  setRun: (p) => set((s) => ({ run: { ...s.run, ...(typeof p === 'function' ? p(s.run) : p) }, workspace: { ...s.workspace, updated: Date.now() } })),
  setSettings: (p) => set((s) => ({ settings: { ...s.settings, ...p } })),
}));

// ---- persistence ----------------------------------------------------------------------------------------
// One small record per workspace (settings, photo and sample metadata, run progress) rewritten on changes:
// 'project' for the open run, `ws:<id>` for each other run kept in the list (ui/studio/runs.ts). Each photo,
// mask and sample Blob lies under its own key, written once: a training step rewrites a few KB, not the
// photos. A Blob no workspace refers to any more is deleted after the record that dropped it.

const PROJECT_DB = 'dreambooth-studio-project';
let idb: UseStore | null = null;
const db = () => (idb ??= createStore(PROJECT_DB, 'project'));

/** Blobs already in the database, with the Blob written (a key whose Blob changed, e.g. a repainted mask, is written again). */
const written = new Map<string, Blob>();
/** The other runs' workspaces (not open), as stored: their Blobs are kept. */
const closed = new Map<string, SavedProject>();

/** A new run's workspace: a fresh id and the next number (ui/studio/runs.ts nextRunNumber) among `others`. */
function newWorkspaceInfo(others: (WorkspaceInfo | undefined)[] = []): WorkspaceInfo {
  const now = Date.now();
  return { id: `w-${now.toString(36)}-${Math.floor(Math.random() * 1e6).toString(36)}`, created: now, updated: now, number: nextRunNumber(others) };
}

function snapshot(s: StudioState): { project: SavedProject; blobs: Map<string, Blob> } {
  const blobs = new Map<string, Blob>();
  const ws = s.workspace.id;
  const meta = (p: PhotoItem): PhotoMeta => {
    blobs.set(photoKey(p.id), p.blob);
    if (p.mask) blobs.set(maskKey(ws, p.id), p.mask);
    const { url: _u, blob: _b, mask: _m, ...rest } = p;
    return { ...rest, ...(p.mask ? { hasMask: true } : {}) };
  };
  const { thumb, ...info } = s.workspace;
  if (thumb && info.thumbFrom) blobs.set(thumbKey(ws), thumb);
  const project: SavedProject = {
    version: 2,
    workspace: thumb ? info : (({ thumbFrom: _f, ...rest }) => rest)(info),
    prompt: s.prompt,
    preset: s.preset,
    settings: s.settings,
    model: s.model.ref,
    photos: s.photos.map(meta),
    classPhotos: s.classPhotos.map(meta),
    run: {
      ...s.run,
      samples: s.run.samples.map((x) => (blobs.set(sampleKey(s.run.runId, x.step), x.blob), { step: x.step })),
      tries: (s.run.tries ?? []).map(({ base, tuned, baseUrl: _b, tunedUrl: _t, ...meta }) => {
        blobs.set(tryKey(s.run.runId, meta.id, 'base'), base);
        blobs.set(tryKey(s.run.runId, meta.id, 'tuned'), tuned);
        return meta;
      }),
    },
    saveWithDialog: s.saveWithDialog,
  };
  return { project, blobs };
}

let saving: Promise<void> = Promise.resolve();

/** Runs `job` after the saves before it (one database change at a time). */
function serial<T>(job: () => Promise<T>): Promise<T> {
  const p = saving.then(job);
  saving = p.then(
    () => undefined,
    () => undefined,
  );
  return p;
}

async function writeProject(project: SavedProject, blobs: Map<string, Blob>): Promise<void> {
  const store = db();
  for (const [k, b] of blobs)
    if (written.get(k) !== b) {
      await idbSet(k, b, store);
      written.set(k, b);
    }
  await idbSet(OPEN_KEY, project, store);
  await sweep(new Set(blobs.keys()));
}

/** Deletes the Blobs and workspace records no workspace refers to (removed photos, an earlier run's samples, deleted runs). */
async function sweep(openBlobs: Set<string>): Promise<void> {
  const store = db();
  const keep = new Set([OPEN_KEY, ...openBlobs]);
  for (const [id, p] of closed) {
    keep.add(workspaceKey(id));
    for (const k of projectBlobKeys(p)) keep.add(k);
  }
  for (const k of await keys(store))
    if (typeof k === 'string' && !keep.has(k)) {
      await del(k, store);
      written.delete(k);
    }
}

/** Saves the project (serialised: one write at a time, the latest state wins). */
export function saveProject(): Promise<void> {
  const { project, blobs } = snapshot(useStudioStore.getState());
  return serial(() =>
    writeProject(project, blobs).catch((e: Error) => {
      // Storage full or unavailable: the page keeps working; the message says what will not survive a reload.
      const msg = `Could not save the project in this browser (${e.name}: ${e.message}); it will not survive a reload.`;
      useStudioStore.getState().setRun((r) => ({ warnings: r.warnings.includes(msg) ? r.warnings : [...r.warnings, msg] }));
    }),
  );
}

/** A stored workspace read back into page state (photos, masks, samples, Try it images), with what could not be read. */
async function readWorkspace(saved: SavedProject): Promise<{ state: Partial<StudioState>; lost: string[] }> {
  const store = db();
  const info = saved.workspace ?? { ...newWorkspaceInfo(), id: legacyWorkspaceId(saved) };
  const lost: string[] = [];
  const photos: PhotoItem[] = [];
  const classPhotos: PhotoItem[] = [];
  const samples: SampleItem[] = [];
  const tries: TryItem[] = [];
  const blob = async (k: string) => {
    const b = await get<Blob>(k, store);
    if (b) written.set(k, b);
    return b;
  };
  const load = async (metas: PhotoMeta[], out: PhotoItem[]) => {
    for (const m of metas) {
      const photo = await blob(photoKey(m.id));
      const { hasMask, ...meta } = m;
      // Masks saved before workspaces had ids lie under the photo's id alone (written again under the workspace's key).
      const mask = hasMask ? ((await blob(maskKey(info.id, m.id))) ?? (await get<Blob>(legacyMaskKey(m.id), store))) : undefined;
      if (hasMask && !mask) lost.push(`the mask of ${m.name}`);
      if (photo) out.push({ ...meta, blob: photo, url: URL.createObjectURL(photo), ...(mask ? { mask } : {}) });
      else lost.push(m.name);
    }
  };
  await load(saved.photos, photos);
  await load(saved.classPhotos ?? [], classPhotos);
  for (const x of saved.run.samples) {
    const b = await blob(sampleKey(saved.run.runId, x.step));
    if (b) samples.push({ step: x.step, blob: b, url: URL.createObjectURL(b) });
  }
  for (const t of saved.run.tries ?? []) {
    const [base, tuned] = [await blob(tryKey(saved.run.runId, t.id, 'base')), await blob(tryKey(saved.run.runId, t.id, 'tuned'))];
    if (!base || !tuned) continue;
    tries.push({ ...t, base, tuned, baseUrl: URL.createObjectURL(base), tunedUrl: URL.createObjectURL(tuned) });
  }
  const thumb = info.thumbFrom ? await blob(thumbKey(info.id)) : undefined;
  const busy: RunStatus[] = ['preparing', 'training', 'pausing'];
  // Nothing runs after a reload: no ETA or sample under way; a finished run says it is finished (not the last
  // thing the worker said, e.g. a download for an export).
  const run: RunProgress = { ...EMPTY_RUN, ...saved.run, samples, tries, ...STOPPED };
  // A run saved before a setting existed trained with its schema default (e.g. no LR warm-up).
  if (run.startedWith) run.startedWith = { ...run.startedWith, settings: { ...defaultSettings(run.startedWith.settings.mode), ...run.startedWith.settings } };
  if (run.status === 'done') run.message = finishedMessage(run.step);
  if (busy.includes(run.status)) {
    run.status = 'interrupted';
    run.message =
      run.lastCheckpoint > 0
        ? `The page was closed during training. Resume continues from the checkpoint at step ${run.lastCheckpoint}.`
        : 'The page was closed before the first checkpoint. Resume starts the run again from its cached photos.';
  }
  if (lost.length) run.warnings = [...run.warnings, `Could not read back ${lost.join(', ')} from this browser's storage: add them again.`];
  const ref = saved.model;
  return {
    lost,
    state: {
      workspace: { ...info, ...(thumb ? { thumb } : { thumbFrom: undefined }) },
      prompt: saved.prompt,
      preset: saved.preset,
      settings: { ...DEFAULT_SETTINGS, ...saved.settings },
      photos,
      classPhotos,
      run,
      saveWithDialog: saved.saveWithDialog ?? true,
      model: {
        ref,
        summary: null,
        download: null,
        status: ref && (ref.kind === 'file' || ref.kind === 'folder') ? 'needs-file' : 'none',
        message:
          ref && ref.kind === 'file'
            ? `Drop ${ref.name}${ref.config ? ` with ${ref.config}` : ''} again to continue (browsers do not keep access to files after a reload).`
            : ref && ref.kind === 'folder'
              ? `Choose the ${ref.name} folder again to continue.`
              : '',
      },
    },
  };
}

/**
 * Restores the saved project: the open run (a run that was training when the page went away becomes
 * 'interrupted') and the list of the other runs. A project saved before runs had ids becomes the first run.
 */
export async function restoreProject(): Promise<void> {
  const st = useStudioStore.getState();
  let saved: SavedProject | undefined;
  let state: Partial<StudioState> | null = null;
  try {
    const store = db();
    closed.clear();
    for (const k of await keys(store))
      if (typeof k === 'string' && k.startsWith('ws:')) {
        const p = await get<SavedProject>(k, store);
        if (p?.version === 2 && p.workspace) closed.set(p.workspace.id, p);
      }
    saved = await get<SavedProject>(OPEN_KEY, store);
    if (saved?.version === 2) {
      state = (await readWorkspace(saved)).state;
      // A copy of the open run left in the list (the page closed while it was being opened) is the open run.
      closed.delete(state.workspace!.id);
    }
  } catch {
    state = null;
  }
  // A first visit's run is run 1 (or the next number after the runs kept, should the open record be gone).
  const first = { workspace: { ...st.workspace, number: nextRunNumber([...closed.values()].map((p) => p.workspace)) } };
  st.set(state ? { ...state, restored: true } : { ...first, restored: true });
}

/** Names a run (the open one or one kept in the list); an empty name brings back the default (mode, number, date). */
export function renameWorkspace(id: string, name: string): Promise<void> {
  const clean = cleanRunName(name);
  const named = <T extends WorkspaceInfo>(w: T): T => {
    const { name: _n, ...rest } = w;
    return (clean ? { ...rest, name: clean } : rest) as T;
  };
  const st = useStudioStore.getState();
  if (st.workspace.id === id) {
    st.set((s) => ({ workspace: named(s.workspace) }));
    return saveProject();
  }
  return serial(async () => {
    const p = closed.get(id);
    if (!p?.workspace) return;
    const next = { ...p, workspace: named(p.workspace) };
    closed.set(id, next);
    await idbSet(workspaceKey(id), next, db());
  });
}

/** The stored workspaces: the open one (as it is now) first, then the others. */
export function savedWorkspaces(): SavedProject[] {
  return [snapshot(useStudioStore.getState()).project, ...closed.values()];
}

/** A stored Blob (a kept run's thumbnail). */
export function storedBlob(key: string): Promise<Blob | undefined> {
  return get<Blob>(key, db());
}

/** The project database's Blob keys with their sizes. */
export function storedBlobSizes(): Promise<Map<string, number>> {
  return serial(async () => {
    const store = db();
    const out = new Map<string, number>();
    for (const [k, v] of await entries(store)) if (typeof k === 'string' && v instanceof Blob) out.set(k, v.size);
    return out;
  });
}

/** Keeps the open workspace in the list and opens `next` (a stored run's id) or, with null, a new run with the same photos and settings. */
export function switchWorkspace(next: string | null): Promise<boolean> {
  return serial(async () => {
    const st = useStudioStore.getState();
    const { project, blobs } = snapshot(st);
    const store = db();
    const target = next === null ? null : closed.get(next);
    if (next !== null && !target) return false;
    // The current run first goes into the list (its record and Blobs stay).
    for (const [k, b] of blobs)
      if (written.get(k) !== b) {
        await idbSet(k, b, store);
        written.set(k, b);
      }
    await idbSet(workspaceKey(project.workspace!.id), project, store);
    closed.set(project.workspace!.id, project);
    for (const s of st.run.samples) if (s.url) URL.revokeObjectURL(s.url);
    if (target) {
      const { state } = await readWorkspace(target);
      closed.delete(next!);
      // The loaded model stays when the run was trained on it; another model must be loaded for the run.
      const { model, ...rest } = state;
      const same = JSON.stringify(st.model.ref) === JSON.stringify(target.model);
      useStudioStore.setState({ ...rest, ...(same ? {} : { model }), exports: [], exportError: null, exportMessage: '' });
    } else {
      useStudioStore.setState((s) => ({
        workspace: newWorkspaceInfo([s.workspace, ...[...closed.values()].map((p) => p.workspace)]),
        run: { ...EMPTY_RUN },
        // The same photos (shared, by id) with the masks copied: the new run keeps its own.
        photos: s.photos.map((p) => ({ ...p })),
        exports: [],
        exportError: null,
        exportMessage: '',
      }));
    }
    const now = snapshot(useStudioStore.getState());
    await writeProject(now.project, now.blobs);
    return true;
  });
}

/**
 * Deletes a stored run's workspace (not the open one: open another first) and the Blobs only it used. The
 * caller frees its training state in the chunk store.
 */
export function forgetWorkspace(id: string): Promise<void> {
  return serial(async () => {
    if (!closed.delete(id)) return;
    const { blobs } = snapshot(useStudioStore.getState());
    await sweep(new Set(blobs.keys()));
  });
}

/** Saves after every change, at most every 500 ms (a burst of training steps is one write). */
export function autosave(): () => void {
  let timer: ReturnType<typeof setTimeout> | null = null;
  return useStudioStore.subscribe((s, prev) => {
    if (!s.restored) return;
    if (
      s.prompt === prev.prompt &&
      s.settings === prev.settings &&
      s.photos === prev.photos &&
      s.classPhotos === prev.classPhotos &&
      s.run === prev.run &&
      s.model.ref === prev.model.ref &&
      s.preset === prev.preset &&
      s.workspace.thumb === prev.workspace.thumb &&
      s.workspace.name === prev.workspace.name &&
      s.saveWithDialog === prev.saveWithDialog
    )
      return;
    if (timer) return;
    timer = setTimeout(() => {
      timer = null;
      void saveProject();
    }, 500);
  });
}

/** What a run that stopped (finished, paused, cancelled, failed, reloaded) no longer has: an ETA, a sample under way. */
export const STOPPED = { etaSeconds: null, etaProvisional: false, sampling: null, phase: null } satisfies Partial<RunProgress>;

/** "1 step", "3 steps". */
export function stepCount(n: number): string {
  return `${n} ${n === 1 ? 'step' : 'steps'}`;
}

/** The status line of a finished run (after the "Done." label), also after a reload. */
export function finishedMessage(step: number): string {
  return `Trained ${stepCount(step)}. Try it or export the result below.`;
}

/**
 * What the Samples panel says of the interval: the open run's own (the settings it started with), and the
 * current setting too where it differs (it applies to the next run), or the current setting before any run.
 */
export function samplesHint(run: Pick<RunProgress, 'status' | 'startedWith'>, settings: Pick<StudioSettings, 'sampleEvery'>): string {
  const every = (n: number) => (n > 0 ? `before the first step and every ${stepCount(n)}` : 'never (samples are off)');
  const own = run.startedWith && run.status !== 'idle' && run.status !== 'cancelled' ? run.startedWith.settings.sampleEvery : null;
  if (own === null)
    return settings.sampleEvery > 0
      ? `A sample appears ${every(settings.sampleEvery)}, always with the same seed.`
      : 'Samples are off (Advanced settings: sample every N steps).';
  const next = own !== settings.sampleEvery ? ` The next run, with the settings as they are now: ${every(settings.sampleEvery)}.` : '';
  return `This run draws a sample ${every(own)}, always with the same seed.${next}`;
}

/** While the run is being prepared or trained: the model and the photos it uses must not change then. */
export function runBusy(status: RunStatus): boolean {
  return status === 'preparing' || status === 'training' || status === 'pausing';
}

/**
 * The status line's message: empty where a panel of its own already says it (the interrupted note, the
 * lost-device alert), so the page says it once.
 */
export function statusMessage(run: Pick<RunProgress, 'status' | 'message'>): string {
  return run.status === 'interrupted' || run.status === 'device-lost' ? '' : run.message;
}

/**
 * Why a run would not fit the browser's storage, or null: `need` bytes against what this site may still
 * store (quota less usage), counting what the run store already holds (`ours`) as reusable.
 */
export function storageShortfall(need: number, quota: number | null, usage: number | null, ours: number): string | null {
  if (quota === null || usage === null) return null;
  const available = quota - usage + ours;
  if (need <= available) return null;
  return `This run needs about ${fmtBytes(need)} of browser storage for its optimizer state and checkpoints, but this site may use only ${fmtBytes(Math.max(0, available))} more (quota ${fmtBytes(quota)}, ${fmtBytes(usage)} in use). Free space on the disk, use LoRA instead of full fine-tuning, or lower the rank.`;
}

// ---- formatting -------------------------------------------------------------------------------------------

/** The page's byte figures: util/bytes.ts, two decimals from a GiB up (budgets, storage needs), "—" unknown. */
export function fmtBytes(n: number): string {
  if (!Number.isFinite(n)) return '—';
  if (Math.abs(n) < 2 ** 10) return `${n} B`;
  return formatBytes(n, { digits: Math.abs(n) >= 2 ** 30 ? 2 : 1 });
}

/**
 * The progress line: the step, the pace (the warm-up step apart from s/step), the ETA (steps, samples and
 * checkpoints; "about" while it rests on a first estimate) and the last checkpoint.
 */
export function progressLine(
  run: Pick<RunProgress, 'step' | 'steps' | 'secondsPerStep' | 'warmupSeconds' | 'etaSeconds' | 'etaProvisional' | 'lastCheckpoint'> & { status?: RunStatus },
): string {
  // A run that is not running has nothing left to estimate.
  if (run.status !== undefined && !runBusy(run.status)) run = { ...run, etaSeconds: null };
  const parts = [`Step ${run.step} / ${run.steps || '—'}`];
  const warm = run.secondsPerStep !== null && run.secondsPerStep > 0;
  if (run.warmupSeconds != null)
    parts.push(warm ? `warm-up ${run.warmupSeconds.toFixed(1)} s` : `warm-up: the first step took ${run.warmupSeconds.toFixed(1)} s (compiling GPU pipelines)`);
  if (warm) parts.push(`${run.secondsPerStep!.toFixed(2)} s/step`);
  if (run.etaSeconds != null && (warm || run.warmupSeconds != null)) parts.push(`ETA ${run.etaProvisional ? 'about ' : ''}${fmtDuration(run.etaSeconds)}`);
  if (run.lastCheckpoint > 0) parts.push(`checkpoint at step ${run.lastCheckpoint}`);
  return parts.join(' · ');
}

/**
 * A phase's time left as the page shows it: counted down from its last report (`at`) to `now` (ms), so a long item
 * (a validation, the warm-up step) does not show a frozen number; past the estimate it says so.
 */
export function phaseEtaText(p: PhaseReport & { at?: number }, now: number): string {
  if (p.etaSeconds === null || p.at === undefined) return etaText(p);
  const left = p.etaSeconds - (now - p.at) / 1000;
  if (left <= 0 && p.done < p.total) return 'taking longer than estimated';
  return etaText({ ...p, etaSeconds: left });
}

export function fmtDuration(seconds: number): string {
  const s = Math.max(0, Math.round(seconds));
  const h = Math.floor(s / 3600);
  return `${h ? `${h}:` : ''}${String(Math.floor(s / 60) % 60).padStart(h ? 2 : 1, '0')}:${String(s % 60).padStart(2, '0')}`;
}
