// What the studio's controls do: they talk to the engine worker (Comlink) and update the zustand store.
// The page itself decodes nothing heavier than an image header; the GPU, the photos' pixels, storage and
// exports all happen in the worker.
import * as Comlink from 'comlink';
import { centerCrop, MAX_IMAGES, type CropBox } from '../../io/image.ts';
import { browserDecoder, captionOf, checkMask, checkPhoto, type PhotoDecoder } from './photo-check.ts';
import { download, thumbnailOf } from './blobs.ts';
import { splitMasks, stemOf } from './mask-files.ts';
import { storagePersistence } from '../../store/idb-store.ts';
import { SHIPPED_DEMO_RESOLUTION } from '../../models/shipped-demo.ts';
import { exportFileName, type ExportFormat, type RunInput } from '../../pipeline/run.ts';
import type { TryItOptions, TryItResult } from '../../pipeline/tryit.ts';
import type { PhaseReport } from '../../pipeline/progress.ts';
import { PRESETS, SETTING_LABELS, type PresetName } from './presets.ts';
import type { ModelChoice, ModelSummary, StudioWorkerApi, WorkerEvent } from '../../studio/worker.ts';
import type { RunSettings } from '../../pipeline/settings.ts';
import {
  EMPTY_RUN,
  finishedMessage,
  fmtBytes,
  STOPPED,
  forgetWorkspace,
  runBusy,
  savedWorkspaces,
  saveProject,
  storageShortfall,
  storedBlob,
  storedBlobSizes,
  switchWorkspace,
  useStudioStore,
  type ModelRef,
  type PhotoItem,
  type RunProgress,
  type RunRow,
} from './state.ts';
import { byRecent, chunkBytesByRun, lostMessage, lostParts, photoUsers, runIdsOfChunks, runStorage, summarize, thumbKey, thumbSource } from './runs.ts';

let worker: Worker | null = null;
let api: Comlink.Remote<StudioWorkerApi> | null = null;
/** The model's File objects (kept in memory only: browsers do not let a page reopen files after a reload). */
let modelChoice: ModelChoice | null = null;

const S = () => useStudioStore.getState();

function spawn(): Comlink.Remote<StudioWorkerApi> {
  worker = new Worker(new URL('../../studio/worker.ts', import.meta.url), { type: 'module', name: 'dreambooth-engine' });
  api = Comlink.wrap<StudioWorkerApi>(worker);
  return api;
}

/** The engine's start-up options from the page's URL: `?tensorCores=0` turns tensor cores off. */
const engineOptions = () => ({ tensorCores: new URLSearchParams(location.search).get('tensorCores') !== '0' });

/** Starts the engine worker and reads the GPU and storage situation. */
export async function initStudio(): Promise<void> {
  const w = spawn();
  const r = await w.init(engineOptions());
  S().set({
    env: r.ok
      ? { kind: 'ready', adapter: r.adapter, hasF16: r.hasF16, gemm: r.gemm, tensorCores: r.tensorCores }
      : { kind: 'error', noWebGpu: r.noWebGpu, message: r.message },
  });
  await refreshStorage();
  // The model the open run used comes back by itself where it can (the demo model ships with the page); a file or
  // folder must be given again (the model panel asks), a hub model says it comes from the cache.
  if (r.ok && S().model.ref?.kind === 'demo' && S().model.status === 'none') void loadDemoModel();
  (globalThis as { __studio?: unknown }).__studio = { loseDevice: () => api?.loseDevice(), state: S };
}

export async function refreshStorage(): Promise<void> {
  const p = await storagePersistence();
  S().set({ storage: { persisted: p.persisted, quota: p.quota ?? null, usage: p.usage ?? null } });
}

/** Asks the browser not to evict this site's data (navigator.storage.persist). */
export async function requestPersistence(): Promise<boolean> {
  const granted = (await navigator.storage?.persist?.().catch(() => false)) ?? false;
  await refreshStorage();
  return granted;
}

// ---- model ----------------------------------------------------------------------------------------------

async function loadModelChoice(choice: ModelChoice): Promise<void> {
  const w = api;
  if (!w) return;
  const ref =
    choice.kind === 'demo'
      ? ({ kind: 'demo' } as const)
      : choice.kind === 'hub'
        ? ({ kind: 'hub', endpoint: choice.endpoint, repo: choice.repo } as const)
        : choice.kind === 'file'
          ? ({ kind: 'file', name: choice.file.name, size: choice.file.size, ...(choice.config ? { config: choice.config.name } : {}) } as const)
          : ({ kind: 'folder', name: choice.name, count: choice.files.length } as const);
  S().set({
    model: {
      ref: S().model.ref,
      summary: null,
      status: 'loading',
      message: choice.kind === 'hub' ? `Downloading ${choice.repo}…` : 'Reading the model…',
      download: null,
    },
  });
  try {
    const summary = await w.inspect(
      choice,
      Comlink.proxy((e: WorkerEvent) => e.type === 'download' && S().set((s) => ({ model: { ...s.model, download: e } }))),
    );
    const prev = S().model.ref;
    const differs = prev && S().run.runId && S().run.status !== 'idle' && JSON.stringify(prev) !== JSON.stringify(ref);
    modelChoice = choice;
    S().set({ model: { ref, summary, status: 'ready', message: '', download: null } });
    // SDXL trains LoRA adapters only (a full SDXL fine-tune is not offered): its preset is LoRA's.
    if (summary.family === 'sdxl' && S().settings.mode !== 'lora') applyPreset('lora');
    S().setSettings(modelDefaults(ref, prev, summary, S().settings));
    if (differs)
      S().setRun((r) => ({
        warnings: [
          ...r.warnings,
          'This is not the model the current run started from: resuming or exporting it would mix the two. Start a new run, or load the original model.',
        ],
      }));
  } catch (e) {
    S().set({ model: { ref: S().model.ref, summary: null, status: 'error', message: (e as Error).message, download: null } });
  }
}

/**
 * Settings a model brings when it is chosen: the demo model trains at its own pretraining size (64 px), so its
 * photos and samples are tiny and fast; an SDXL model at its 1024 px. Only when switching to it: the same model loaded again (after a
 * reload) keeps the settings the user changed since.
 */
export function modelDefaults(
  ref: ModelRef,
  prev: ModelRef | null,
  summary: Pick<ModelSummary, 'nativeResolution'> & { family?: string },
  settings: Pick<RunSettings, 'steps'>,
): Partial<RunSettings> {
  // SDXL trains at its own 1024 px; the same model given again keeps what the user set since.
  if (summary.family === 'sdxl') return JSON.stringify(prev) === JSON.stringify(ref) ? {} : { resolution: 1024 };
  if (ref.kind !== 'demo' || prev?.kind === 'demo') return {};
  return {
    resolution: summary.nativeResolution ?? SHIPPED_DEMO_RESOLUTION,
    budgetBytes: 512 * 2 ** 20,
    sampleEvery: 5,
    sampleSteps: 8,
    steps: Math.min(settings.steps, 20),
    checkpointEvery: 5,
  };
}

export const loadDemoModel = () => loadModelChoice({ kind: 'demo' });
export const loadHubModel = (endpoint: string, repo: string) => loadModelChoice({ kind: 'hub', endpoint: endpoint.trim(), repo: repo.trim() });
/**
 * A single checkpoint, given alone or with its config JSON (the CLI's --config: what its weights cannot say);
 * `endpoint`: the hub its tokenizer comes from. Any other set of files is refused, naming them, and changes nothing.
 */
export function loadModelFiles(files: File[], endpoint?: string): Promise<void> {
  const config = files.length === 2 ? files.find((f) => /\.json$/i.test(f.name)) : undefined;
  const file = files.length === 1 ? files[0] : config ? files.find((f) => f !== config) : undefined;
  if (!file) {
    S().set((s) => ({
      model: {
        ...s.model,
        status: 'error',
        message: `${files.map((f) => f.name).join(', ')}: give one checkpoint (.safetensors), with its config (.json) if it needs one, or a diffusers folder`,
      },
    }));
    return Promise.resolve();
  }
  return loadModelChoice({ kind: 'file', file, ...(config ? { config } : {}), ...(endpoint ? { endpoint: endpoint.trim() } : {}) });
}

export function loadModelFolder(files: { path: string; file: File }[], name: string): Promise<void> {
  // Strip the top folder from the paths ("sd15/unet/config.json" -> "unet/config.json").
  const strip = files.every((f) => f.path.includes('/') && f.path.split('/')[0] === files[0].path.split('/')[0]);
  return loadModelChoice({ kind: 'folder', name, files: strip ? files.map((f) => ({ path: f.path.split('/').slice(1).join('/'), file: f.file })) : files });
}

// ---- photos ---------------------------------------------------------------------------------------------

let nextId = Date.now();

/** How dropped photos are decoded to check them (the browser's decoder; Node tests pass a real one of their own). */
let decoder: PhotoDecoder = browserDecoder;
export function setPhotoDecoder(d: PhotoDecoder): void {
  decoder = d;
}

async function toPhotos(files: File[], list: PhotoItem[]): Promise<{ added: PhotoItem[]; errors: string[] }> {
  const added: PhotoItem[] = [];
  const errors: string[] = [];
  for (const f of files) {
    if (list.length + added.length >= MAX_IMAGES) {
      errors.push(`${f.name}: not added, a run takes at most ${MAX_IMAGES} photos`);
      continue;
    }
    const p = await checkPhoto(f, decoder);
    if ('error' in p) {
      errors.push(p.error);
      continue;
    }
    // Copy the bytes into a Blob of our own: it is what gets saved, independent of the dropped file.
    const blob = new Blob([p.bytes as Uint8Array<ArrayBuffer>], { type: f.type });
    added.push({ id: `p${nextId++}`, name: f.name, blob, width: p.width, height: p.height, crop: centerCrop(p), caption: '', url: URL.createObjectURL(blob) });
  }
  return { added, errors };
}

/**
 * Adds photos; with the instance photos, files named as their masks (mask-files.ts: kohya's same-name rule) become
 * those photos' loss masks, each checked in full like a photo and of its photo's shape, or refused by name.
 * `paths`: the files' paths within a dropped folder, where known.
 */
export async function addPhotos(all: File[], which: 'photos' | 'classPhotos' = 'photos', paths?: string[]): Promise<void> {
  // kohya's captions: photo.txt beside photo.png is that photo's caption (instance photos only).
  const isTxt = (f: File) => which === 'photos' && /\.txt$/i.test(f.name);
  const captionFiles = all.filter(isTxt);
  const files = all.filter((f) => !isTxt(f));
  paths = paths?.filter((_, i) => !isTxt(all[i]));
  const split =
    which === 'photos'
      ? splitMasks(
          files.map((f, i) => ({ path: paths?.[i] ?? f.name })),
          S().photos.map((p) => p.name),
        )
      : { photos: files.map((_, i) => i), masks: [], orphans: [] };
  const { added, errors } = await toPhotos(
    split.photos.map((i) => files[i]),
    S()[which],
  );
  for (const i of split.orphans)
    errors.push(`${files[i].name}: named like a mask, but no photo ${stemOf(files[i].name).replace(/[_.-]mask$/i, '')}.* was given: add it with its photo`);
  S().set((s) => ({ [which]: [...s[which], ...added], photoErrors: errors }) as Partial<typeof s>);
  for (const { index, stem } of split.masks) {
    const photo = S().photos.find((p) => stemOf(p.name) === stem)!;
    const m = await checkMask(files[index], photo, decoder);
    if ('error' in m) errors.push(m.error);
    else setPhotoMask(photo.id, m.blob);
  }
  for (const f of captionFiles) {
    const photo = S().photos.find((p) => stemOf(p.name) === stemOf(f.name));
    const r = photo ? await captionOf(f, photo.name) : { error: `${f.name}: a caption, but no photo ${stemOf(f.name)}.* was given: add it with its photo` };
    if ('error' in r) errors.push(r.error);
    else updatePhoto(photo!.id, { caption: r.caption });
  }
  if (split.masks.length || captionFiles.length) S().set({ photoErrors: [...errors] });
  void saveProject().then(refreshRuns);
}

export function removePhoto(id: string, which: 'photos' | 'classPhotos' = 'photos'): void {
  const p = S()[which].find((x) => x.id === id);
  if (p?.url) URL.revokeObjectURL(p.url);
  S().set((s) => ({ [which]: s[which].filter((x) => x.id !== id) }) as Partial<typeof s>);
}

export async function replacePhoto(id: string, file: File): Promise<void> {
  const { added, errors } = await toPhotos([file], []);
  if (!added.length) {
    S().set({ photoErrors: errors });
    return;
  }
  const old = S().photos.find((x) => x.id === id);
  if (old?.url) URL.revokeObjectURL(old.url);
  // A new id: the saved Blob of the old photo is dropped, the new one written.
  S().set((s) => ({ photos: s.photos.map((x) => (x.id === id ? { ...added[0], caption: x.caption } : x)), photoErrors: [] }));
}

/** Changes a photo's crop (then a chosen crop) or caption. */
export function updatePhoto(id: string, p: Partial<Pick<PhotoItem, 'crop' | 'caption'>>): void {
  const chosen = p.crop ? { cropChosen: true } : {};
  S().set((s) => ({ photos: s.photos.map((x) => (x.id === id ? { ...x, ...p, ...chosen } : x)) }));
}

/** Sets (or with null removes) a photo's loss mask. */
export function setPhotoMask(id: string, mask: Blob | null): void {
  S().set((s) => ({ photos: s.photos.map((x) => (x.id !== id ? x : mask ? { ...x, mask } : (({ mask: _m, ...rest }) => rest)(x))) }));
}

/**
 * What the run gets of a photo: its crop only when the user chose one (the run centre-crops the others, and says
 * so), and its loss mask when one is painted.
 */
export function photoInput(p: PhotoItem): RunInput['images'][number] {
  const { id, name, blob, crop, caption } = p;
  return { id, name, blob, caption, ...(p.cropChosen ? { crop } : {}), ...(p.mask ? { mask: { name: `the mask of ${name}`, blob: p.mask } } : {}) };
}

/** Moves the square crop along the photo's long side: `t` from 0 (left/top) to 1 (right/bottom). */
export function cropAt(p: Pick<PhotoItem, 'width' | 'height'>, t: number): CropBox {
  const size = Math.min(p.width, p.height);
  const slack = Math.max(p.width, p.height) - size;
  const off = Math.round(slack * Math.min(1, Math.max(0, t)));
  return p.width >= p.height ? { x: off, y: 0, size } : { x: 0, y: off, size };
}

export function applyPreset(name: PresetName): void {
  S().set((s) => ({ preset: name, settings: { ...s.settings, ...PRESETS[name].settings } }));
}

// ---- training ---------------------------------------------------------------------------------------------

/** An export is under way: the worker's phase messages are the export's, not the run's. */
let exportInProgress = false;

/** A phase event's items and time left (class images, encoding, validation, ...); null for a phase without items. */
function phaseReport(e: Extract<WorkerEvent, { type: 'phase' }>): (PhaseReport & { at: number }) | null {
  if (e.total === undefined || e.total <= 0) return null;
  return { done: e.done ?? 0, total: e.total, etaSeconds: e.etaSeconds ?? null, provisional: e.provisional ?? false, at: Date.now() };
}

/** What the page does with each worker event (exported for tests). */
export function onEvent(e: WorkerEvent): void {
  const { setRun } = S();
  switch (e.type) {
    case 'phase':
      // Progress comes through its own message port, so it may land after the run's result: a late one
      // never replaces what the page says of a run that has stopped (done, paused, ...).
      if (exportInProgress || e.phase === 'exporting') S().set({ exportMessage: e.message });
      else if (runBusy(S().run.status)) setRun({ message: e.message, phase: phaseReport(e) });
      break;
    case 'warning':
      setRun((r) => ({ warnings: [...r.warnings, e.message] }));
      break;
    case 'plan':
      setRun({ plan: e.plan });
      break;
    case 'resumed':
      setRun({ step: e.step, lastCheckpoint: e.step, losses: e.losses.map((loss, i) => ({ step: i + 1, loss })), validation: e.validation });
      break;
    case 'validation':
      setRun((r) => ({ phase: null, validation: [...(r.validation ?? []).filter((v) => v.step < e.report.step), e.report] }));
      break;
    case 'step':
      setRun((r) => ({
        status: r.status === 'pausing' || !runBusy(r.status) ? r.status : 'training',
        step: e.report.step,
        steps: e.steps,
        secondsPerStep: e.secondsPerStep,
        warmupSeconds: e.warmupSeconds,
        etaSeconds: e.etaSeconds,
        etaProvisional: e.provisional,
        gpuBytes: e.report.gpuBytes,
        gpuPeakBytes: Math.max(e.report.gpuPeakBytes, e.report.step === 1 ? 0 : r.gpuPeakBytes),
        storageBytes: e.storageBytes,
        losses: [...r.losses.filter((l) => l.step < e.report.step), { step: e.report.step, loss: e.report.loss }],
        ...(e.report.skipped ? { warnings: [...r.warnings, e.report.skipped] } : {}),
      }));
      break;
    case 'sample-progress':
      setRun({ sampling: { step: e.step, denoised: e.denoised, total: e.total }, ...(e.etaSeconds !== null ? { etaSeconds: e.etaSeconds } : {}) });
      break;
    case 'sample': {
      const blob = new Blob([e.png as BlobPart], { type: 'image/png' });
      setRun((r) => ({ sampling: null, samples: [...r.samples.filter((s) => s.step !== e.step), { step: e.step, blob, url: URL.createObjectURL(blob) }] }));
      void refreshRuns();
      break;
    }
    case 'checkpoint':
      setRun({ lastCheckpoint: e.step });
      void saveProject().then(refreshRuns);
      break;
    case 'device-lost':
      setRun({
        status: 'device-lost',
        message: `The GPU device was lost (${e.message}). Your progress up to the checkpoint at step ${S().run.lastCheckpoint} is saved.`,
      });
      break;
    case 'download': {
      // A download for an export or Try it of a stopped run is said on the export's line, never as the run's status.
      const message = `Downloading ${e.path}: ${fmtBytes(e.loaded)}${e.total ? ` of ${fmtBytes(e.total)}` : ''}`;
      if (exportInProgress) S().set({ exportMessage: message });
      else if (runBusy(S().run.status)) setRun({ message });
      break;
    }
  }
}

/** How much the run may still store: the browser's quota less what other data uses. */
async function checkQuota(need: number): Promise<string | null> {
  await refreshStorage();
  const { quota, usage } = S().storage;
  // Only this run's chunks (its cached photos so far) count as part of its need: other kept runs stay.
  const runId = S().run.runId;
  const ours = api && runId ? (chunkBytesByRun(await api.chunkSizes()).get(runId) ?? 0) : 0;
  return storageShortfall(need, quota, usage, ours);
}

function runInput(r: RunProgress): RunInput {
  const st = S();
  const w = r.startedWith!;
  const byId = new Map([...st.photos, ...st.classPhotos].map((p) => [p.id, p]));
  const pick = (ids: string[]) =>
    ids
      .map((id) => byId.get(id))
      .filter((p): p is PhotoItem => !!p)
      .map(photoInput);
  return { runId: r.runId!, prompt: w.prompt, settings: w.settings, images: pick(w.photoIds), classImages: pick(w.classIds) };
}

/** The run being driven (started, resumed): a delete of the training run cancels it and waits for this. */
let driving: Promise<void> = Promise.resolve();

function drive(start: () => Promise<'done' | 'paused' | 'cancelled' | 'ready'>): Promise<void> {
  const p = driveRun(start);
  driving = p;
  return p;
}

async function driveRun(start: () => Promise<'done' | 'paused' | 'cancelled' | 'ready'>): Promise<void> {
  const { setRun } = S();
  try {
    const result = await start();
    const r = S().run;
    if (result === 'cancelled') {
      await api?.discard(r.runId!);
      setRun({ ...EMPTY_RUN, status: 'cancelled', message: 'Training cancelled; its checkpoints were deleted.' });
    } else if (result === 'paused') setRun({ ...STOPPED, status: 'paused', message: `Paused at step ${r.step} (checkpoint saved).` });
    else if (result === 'done') setRun({ ...STOPPED, status: 'done', message: finishedMessage(r.step) });
    else setRun({ ...STOPPED, status: 'paused', message: `Loaded at step ${r.step}.` });
  } catch (e) {
    if (S().run.status === 'device-lost') return;
    const err = e as Error;
    if (err.name === 'GpuDeviceLostError' || /device.*lost|lost.*device|destroyed/i.test(err.message ?? '')) {
      setRun({
        status: 'device-lost',
        message: `The GPU device was lost (${err.message}). Your progress up to the checkpoint at step ${S().run.lastCheckpoint} is saved.`,
      });
      return;
    }
    if (err.name === 'QuotaTooSmall' || err.name === 'StorageFullError') setRun({ ...STOPPED, status: 'quota', error: err.message, message: '' });
    else setRun({ ...STOPPED, status: 'error', error: err.message, message: '' });
  } finally {
    await saveProject();
    void refreshStorage().then(refreshRuns);
  }
}

export function modelReady(): boolean {
  return S().model.status === 'ready' && modelChoice !== null;
}

/** Starts a new run with the current photos and settings (discarding the previous run's checkpoints). */
export async function startTraining(): Promise<void> {
  await tryDone();
  const st = S();
  if (!api || !modelChoice) return;
  if (st.photos.length === 0) {
    st.setRun({ status: 'error', error: 'Add at least one photo of your subject (3 to 5 work best).' });
    return;
  }
  const old = st.run.runId;
  if (old) await api.discard(old).catch(() => undefined);
  for (const s of st.run.samples) if (s.url) URL.revokeObjectURL(s.url);
  const runId = `run-${Date.now().toString(36)}`;
  const settings = { ...st.settings, classCount: st.settings.priorPreservation && st.classPhotos.length ? st.classPhotos.length : st.settings.classCount };
  st.set({ exports: [], exportError: null, exportMessage: '' });
  st.setRun({
    ...EMPTY_RUN,
    runId,
    status: 'preparing',
    steps: settings.steps,
    message: 'Starting…',
    startedWith: {
      prompt: st.prompt,
      settings,
      photoIds: st.photos.map((p) => p.id),
      classIds: settings.priorPreservation ? st.classPhotos.map((p) => p.id) : [],
    },
  });
  await saveProject();
  await drive(async () => {
    const prepared = await api!.start(modelChoice!, runInput(S().run), Comlink.proxy(onEvent), false, SETTING_LABELS);
    const plan = S().run.plan;
    const problem = plan ? await checkQuota(plan.storageNeedBytes) : null;
    if (problem) {
      const e = new Error(problem);
      e.name = 'QuotaTooSmall';
      throw e;
    }
    if (prepared !== 'ready') return prepared;
    if (S().run.status === 'preparing') S().setRun({ status: 'training' });
    return api!.train(Comlink.proxy(onEvent));
  });
}

export async function pauseTraining(): Promise<void> {
  S().setRun({ status: 'pausing', message: 'Pausing after this step…' });
  await api?.pause();
}

/** Continues a paused run; after a reload or a lost device, from the last checkpoint in storage. */
export async function resumeTraining(): Promise<void> {
  await tryDone();
  const st = S();
  if (!st.run.runId || !st.run.startedWith) return;
  if (!modelChoice) {
    st.setRun({ error: 'Load the model first (see Model above).' });
    return;
  }
  // A paused run the worker does not hold (opened from the runs list, or after a reload) loads from its checkpoint.
  const fresh = ['interrupted', 'device-lost', 'error', 'quota'].includes(st.run.status) || !(await api?.hasSession());
  st.setRun({ status: fresh ? 'preparing' : 'training', error: null, message: fresh ? 'Resuming from the last checkpoint…' : 'Resuming…' });
  if (st.run.status === 'device-lost' || S().run.status === 'preparing') {
    // A lost device cannot be used again: a new worker gets a new one.
    if (worker && st.env.kind === 'ready') {
      worker.terminate();
      const w = spawn();
      const r = await w.init(engineOptions());
      if (!r.ok) {
        S().setRun({ status: 'device-lost', error: r.message });
        return;
      }
    }
  }
  await drive(async () => {
    if (!fresh) return api!.train(Comlink.proxy(onEvent));
    const prepared = await api!.start(modelChoice!, runInput(S().run), Comlink.proxy(onEvent), false, SETTING_LABELS);
    if (prepared !== 'ready') return prepared;
    S().setRun({ status: 'training' });
    return api!.train(Comlink.proxy(onEvent));
  });
}

export async function cancelTraining(): Promise<void> {
  await tryDone();
  const st = S();
  if (st.run.status === 'training' || st.run.status === 'pausing' || st.run.status === 'preparing') {
    st.setRun({ message: 'Cancelling…' });
    await api?.cancel();
    return;
  }
  // Not running (paused, interrupted): discard the checkpoints now.
  if (st.run.runId) await api?.discard(st.run.runId).catch(() => undefined);
  st.setRun({ ...EMPTY_RUN, status: 'cancelled', message: 'Training cancelled; its checkpoints were deleted.' });
}

type SavePicker = (o: { suggestedName: string }) => Promise<FileSystemFileHandle>;

/** The browser's save dialog (Chrome, Edge), when it has one. */
export function savePicker(): SavePicker | null {
  const p = (globalThis as { showSaveFilePicker?: SavePicker }).showSaveFilePicker;
  return typeof p === 'function' ? p : null;
}

/**
 * Exports the run in `format`: streamed into a file chosen in the save dialog (nothing held in memory), or
 * built as a Blob and downloaded where there is no dialog or the user turned it off.
 */
export async function exportRun(format: ExportFormat): Promise<void> {
  const st = S();
  if (!api || !st.run.runId || !st.run.startedWith) return;
  st.set({ exporting: true, exportError: null, exportMessage: '' });
  exportInProgress = true;
  try {
    if (!modelChoice) throw new Error('Load the model first (see Model above): exports are built on the base model.');
    // The dialog first, while the click still counts as a user gesture.
    const picker = st.saveWithDialog ? savePicker() : null;
    let handle: FileSystemFileHandle | null = null;
    if (picker) {
      const step = st.run.status === 'paused' || st.run.status === 'done' ? st.run.step : st.run.lastCheckpoint;
      try {
        handle = await picker({ suggestedName: exportFileName(st.model.summary?.name ?? 'model', st.run.startedWith.settings.mode, step, format) });
      } catch (e) {
        if ((e as Error).name === 'AbortError') return; // the dialog was closed
        throw e;
      }
    }
    // A Try it under way holds the run's GPU state: the export follows it (after the dialog, which needs the click).
    await tryDone();
    // After a reload the worker has no session: load the run from its last checkpoint first.
    if (!(await api.hasSession())) await api.start(modelChoice, runInput(st.run), Comlink.proxy(onEvent), false, SETTING_LABELS);
    if (handle) {
      const out = await api.exportToFile(format, handle);
      S().set((s) => ({
        exports: [...s.exports, { format, name: out.name, size: out.size, url: '' }],
        exportMessage: `Saved ${out.name} (${fmtBytes(out.size)}).`,
      }));
      return;
    }
    const out = await api.exportModel(format);
    const url = URL.createObjectURL(out.blob);
    const a = document.createElement('a');
    a.href = url;
    a.download = out.name;
    document.body.append(a);
    a.click();
    a.remove();
    S().set((s) => ({
      exports: [...s.exports, { format, name: out.name, size: out.size, url }],
      exportMessage: `Exported ${out.name} (${fmtBytes(out.size)}).`,
    }));
  } catch (e) {
    S().set({ exportError: (e as Error).message, exportMessage: '' });
  } finally {
    exportInProgress = false;
    S().set({ exporting: false });
    void refreshStorage();
  }
}

// ---- the runs kept in this browser (issue 15, "Runs"; ui/studio/runs.ts, Runs.tsx) ---------------------------

/** Draws the open run's thumbnail again when its source changed (a new last sample, another first photo). */
async function updateThumb(): Promise<void> {
  const st = S();
  const from = thumbSource({ photos: st.photos, run: { ...st.run, samples: st.run.samples.map((x) => ({ step: x.step })) } });
  if (from === (st.workspace.thumbFrom ?? null)) return;
  const last = [...st.run.samples].sort((a, b) => b.step - a.step)[0];
  const source = last ? last.blob : st.photos[0]?.blob;
  const thumb = source ? await thumbnailOf(source) : null;
  S().set((s) => {
    const { thumb: _t, thumbFrom: _f, ...info } = s.workspace;
    return { workspace: thumb && from ? { ...info, thumb, thumbFrom: from } : info };
  });
}

const thumbUrls = new Map<string, { blob: Blob; url: string }>();

/** An object URL for a run's thumbnail Blob, kept while the Blob is the same. */
function thumbUrl(id: string, blob: Blob | undefined): string | null {
  const had = thumbUrls.get(id);
  if (had && had.blob === blob) return had.url;
  if (had) URL.revokeObjectURL(had.url);
  if (!blob) {
    thumbUrls.delete(id);
    return null;
  }
  const url = URL.createObjectURL(blob);
  thumbUrls.set(id, { blob, url });
  return url;
}

let refreshing: Promise<void> = Promise.resolve();

/**
 * Lists the runs (the open one and those kept), each with its storage (training state in the chunk store plus
 * its Blobs), and which lost their storage to the browser; then the browser's own storage estimate.
 */
export function refreshRuns(): Promise<void> {
  // One at a time, each after the one before (a caller sees the state after its own change).
  refreshing = refreshing.then(listRuns, listRuns);
  return refreshing;
}

async function listRuns(): Promise<void> {
  await updateThumb();
  // Without the chunk store's keys (no worker yet, or it failed) no run is called lost.
  const [sizes, chunkSizes] = await Promise.all([storedBlobSizes(), api ? api.chunkSizes().catch(() => null) : Promise.resolve(null)]);
  const chunkBytes = chunkBytesByRun(chunkSizes ?? []);
  const withChunks = runIdsOfChunks((chunkSizes ?? []).map(([k]) => k));
  const projects = savedWorkspaces();
  const users = photoUsers(projects);
  const openId = S().workspace.id;
  const rows: RunRow[] = [];
  const lost: { id: string; name: string; message: string }[] = [];
  for (const p of projects) {
    const sum = summarize(p);
    const open = sum.id === openId;
    const store = runStorage(p, sizes, chunkBytes, users);
    const thumb = open ? S().workspace.thumb : p.workspace?.thumbFrom ? await storedThumb(sum.id) : undefined;
    rows.push({ ...sum, open, bytes: store.bytes, sharedBytes: store.shared, thumbUrl: thumbUrl(sum.id, thumb) });
    // The open run's photos are in memory: only its training state can be gone.
    const parts = lostParts(p, open ? new Set([...sizes.keys(), ...S().photos.map((x) => `photo:${x.id}`)]) : new Set(sizes.keys()), withChunks);
    if (parts.length && chunkSizes) lost.push({ id: sum.id, name: sum.name, message: lostMessage(sum.name, parts) });
  }
  const stored = [...sizes.values()].reduce((a, b) => a + b, 0) + [...chunkBytes.values()].reduce((a, b) => a + b, 0);
  S().set({ runs: rows.sort(byRecent), lostRuns: lost, runsBytes: stored });
  await refreshStorage();
}

const storedThumb = (id: string) => storedBlob(thumbKey(id));

/** A Try it, export or run under way keeps the open run: open another one after it. */
function switchBlocked(): string | null {
  if (runBusy(S().run.status)) return 'Pause or stop the training run first.';
  if (S().exporting) return 'Wait for the export to finish.';
  return null;
}

/** Keeps the open run in the list and starts a new one with the same photos and settings. */
export async function newRun(): Promise<void> {
  await tryDone();
  const why = switchBlocked();
  if (why) return void S().setRun({ error: why });
  await switchWorkspace(null);
  await api?.closeSession();
  await refreshRuns();
}

/** Opens a kept run: its photos, settings, chart, samples and Try it images; resume, export and Try it act on it. */
export async function openRun(id: string): Promise<void> {
  await tryDone();
  const why = switchBlocked();
  if (why) return void S().setRun({ error: why });
  await api?.closeSession();
  await switchWorkspace(id);
  await refreshRuns();
}

/**
 * Deletes a run: stops it first when it is training (the page asks before), then frees its training state,
 * its samples and Try it images, and the photos no other run uses. Deleting the open run opens the most
 * recent other one (or a new, empty run).
 */
export async function deleteRun(id: string): Promise<void> {
  await tryDone();
  const st = S();
  const open = st.workspace.id === id;
  const runId = open ? st.run.runId : (st.runs.find((r) => r.id === id)?.runId ?? null);
  if (open && runBusy(st.run.status)) {
    st.setRun({ message: 'Stopping the run to delete it…' });
    await api?.cancel();
    await driving;
  }
  if (runId) await api?.discard(runId).catch(() => undefined);
  if (open) {
    await api?.closeSession();
    const next = S()
      .runs.filter((r) => r.id !== id)
      .sort(byRecent)[0];
    await switchWorkspace(next ? next.id : null);
    // The only run went: the new, empty run keeps none of its photos.
    if (!next) {
      S().set({ photos: [], classPhotos: [] });
      await saveProject();
    }
  }
  await forgetWorkspace(id);
  await refreshRuns();
}

// ---- outgrowing the tab (issue 17): a job bundle out, results trained elsewhere back in --------------------

/**
 * The page's current run (prompt, settings, photos with their crops and captions, class photos) as a job
 * bundle for diffusers' DreamBooth scripts and Ray Train, downloaded as a zip. Nothing is trained here.
 */
export async function downloadBundle(): Promise<{ name: string; size: number }> {
  const st = S();
  if (!api) throw new Error('the engine is not ready');
  if (!modelChoice) throw new Error('Choose the base model first (see Model above): the bundle names it.');
  if (st.photos.length === 0) throw new Error('Add the photos of your subject first: the bundle carries them.');
  const settings = { ...st.settings, classCount: st.settings.priorPreservation && st.classPhotos.length ? st.classPhotos.length : st.settings.classCount };
  const out = await api.bundle(modelChoice, {
    prompt: st.prompt,
    settings,
    images: st.photos.map(photoInput),
    classImages: settings.priorPreservation ? st.classPhotos.map(photoInput) : [],
  });
  download(out.blob, out.name);
  return { name: out.name, size: out.size };
}

/** Reads a LoRA file the moment it is chosen: null when it is one, else what is wrong with it (the file named). */
export async function checkLoraFile(lora: File): Promise<string | null> {
  if (!api) return null;
  const r = await api.checkLora(lora);
  return 'error' in r ? r.error : null;
}

/** "Try it" with a LoRA trained elsewhere (or none): an image of the loaded base model, as an object URL. */
export async function tryImportedLora(lora: File | null, o: { prompt: string; seed: number; steps: number; strength: number }): Promise<string> {
  if (!api || !modelChoice || S().model.status !== 'ready') throw new Error('Load the base model first (see Model above): the LoRA runs on it.');
  const png = await api.tryLora(modelChoice, lora, { ...o, size: S().settings.resolution });
  return URL.createObjectURL(new Blob([png as Uint8Array<ArrayBuffer>], { type: 'image/png' }));
}

/** A LoRA trained elsewhere (or the loaded full model alone) exported in one of our formats and downloaded. */
export async function exportImportedLora(lora: File | null, format: ExportFormat): Promise<{ name: string; size: number; warnings: string[] }> {
  if (!api || !modelChoice || S().model.status !== 'ready') throw new Error('Load the base model first (see Model above).');
  const out = await api.exportImported(modelChoice, lora, format);
  download(out.blob, out.name);
  return { name: out.name, size: out.size, warnings: out.warnings };
}

// ---- "Try it" on the run (ui/studio/TryIt.tsx) -----------------------------------------------------------

/** The Try it under way: training, a new run or a cancel wait for it (they would take its GPU state away). */
let trying: Promise<unknown> = Promise.resolve();
const tryDone = () => trying.catch(() => undefined);

/**
 * Fine-tuned and base images of the run (paused or done) for the same seed, as PNGs with A1111's parameters
 * text; after a reload the run is loaded from its last checkpoint first, as exports do.
 */
export function tryTrainedRun(o: Omit<TryItOptions, 'onStep'>, onStep: (done: number, total: number) => void): Promise<TryItResult> {
  const go = async () => {
    const st = S();
    if (!api || !st.run.runId || !st.run.startedWith) throw new Error('Train a run first: Try it draws with its fine-tuned model.');
    if (!modelChoice || st.model.status !== 'ready') throw new Error('Load the model first (see Model above): Try it runs on it.');
    if (!(await api.hasSession())) await api.start(modelChoice, runInput(st.run), Comlink.proxy(onEvent), false, SETTING_LABELS);
    return api.tryIt(o, Comlink.proxy(onStep));
  };
  const p = go();
  trying = p;
  return p;
}
