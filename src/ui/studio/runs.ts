// The runs kept in this browser (issue 15, "Runs"): what the list shows of each saved workspace, which
// stored Blobs belong to it, what it costs in storage, and which runs lost their storage to the browser.
// Pure functions over the saved records (ui/studio/state.ts writes and reads them); no IndexedDB here.
//
// Layout of the project database (state.ts): 'project' is the open run's workspace; each other run's
// workspace is a record `ws:<id>`. Photos are shared by id (`photo:<photoId>`, never rewritten: a replaced
// photo gets a new id); masks, samples, Try it images and the thumbnail are the workspace's own. The
// training state (cached latents, optimizer state, checkpoints) is in the worker's chunk store under
// `<runId>/…` (pipeline/run.ts).
import type { RunProgress, RunStatus, TryItem, PhotoItem } from './state.ts';
import type { RunSettings } from '../../pipeline/settings.ts';
import type { PresetName } from './presets.ts';
import type { ModelRef } from './state.ts';

export type PhotoMeta = Omit<PhotoItem, 'url' | 'blob' | 'mask'> & { hasMask?: boolean };
export type TryMeta = Omit<TryItem, 'base' | 'tuned' | 'baseUrl' | 'tunedUrl'>;

/** Which run a workspace is, and when it was made and last changed (absent in projects saved before runs). */
export interface WorkspaceInfo {
  id: string;
  created: number;
  updated: number;
  /** What the thumbnail was drawn from (a sample or photo key), when there is one. */
  thumbFrom?: string;
  /** The run's number in this browser (1, 2, ...), given when it is made; part of its default name. */
  number?: number;
  /** The name the user gave the run (else `defaultRunName`). */
  name?: string;
}

/** A workspace as stored: the prompt, settings, photo metadata and the run's progress (Blobs under their own keys). */
export interface SavedProject {
  version: 2;
  workspace?: WorkspaceInfo;
  prompt: string;
  preset: PresetName;
  settings: RunSettings;
  model: ModelRef | null;
  photos: PhotoMeta[];
  classPhotos: PhotoMeta[];
  run: Omit<RunProgress, 'samples' | 'tries'> & { samples: { step: number }[]; tries?: TryMeta[] };
  /** The export panel's "Choose where to save" (absent in projects saved before it was kept: on). */
  saveWithDialog?: boolean;
}

export const OPEN_KEY = 'project';
export const workspaceKey = (id: string) => `ws:${id}`;
export const photoKey = (id: string) => `photo:${id}`;
/** A workspace's mask of a photo (two runs of one photo may paint it differently). */
export const maskKey = (ws: string, id: string) => `mask:${ws}:${id}`;
/** Where masks were before runs had workspaces (read once when migrating). */
export const legacyMaskKey = (id: string) => `mask:${id}`;
export const sampleKey = (runId: string | null, step: number) => `sample:${runId ?? 'none'}:${step}`;
export const tryKey = (runId: string | null, id: string, which: 'base' | 'tuned') => `try:${runId ?? 'none'}:${id}:${which}`;
export const thumbKey = (ws: string) => `thumb:${ws}`;

/** The id a workspace saved before runs had ids gets (stable: the same record migrates to the same id). */
export function legacyWorkspaceId(p: Pick<SavedProject, 'run'>): string {
  return `w-${p.run.runId ?? 'first'}`;
}

/** Every Blob key a stored workspace refers to (its photos, masks, samples, Try it images, thumbnail). */
export function projectBlobKeys(p: SavedProject): string[] {
  const ws = p.workspace?.id ?? legacyWorkspaceId(p);
  const out: string[] = [];
  for (const m of [...p.photos, ...(p.classPhotos ?? [])]) {
    out.push(photoKey(m.id));
    if (m.hasMask) out.push(maskKey(ws, m.id));
  }
  for (const s of p.run.samples) out.push(sampleKey(p.run.runId, s.step));
  for (const t of p.run.tries ?? []) out.push(tryKey(p.run.runId, t.id, 'base'), tryKey(p.run.runId, t.id, 'tuned'));
  if (p.workspace?.thumbFrom) out.push(thumbKey(ws));
  return out;
}

/** What the thumbnail is drawn from: the last sample, else the first photo; null when there is neither. */
export function thumbSource(p: Pick<SavedProject, 'photos' | 'run'>): string | null {
  const last = [...p.run.samples].sort((a, b) => b.step - a.step)[0];
  if (last) return sampleKey(p.run.runId, last.step);
  return p.photos[0] ? photoKey(p.photos[0].id) : null;
}

/** One row of the runs list. */
export interface RunSummary {
  id: string;
  /** The run's name: the user's, else mode, number and date (`defaultRunName`), so runs of one prompt differ. */
  name: string;
  /** The subject's prompt the run trains (or will train) on. */
  prompt: string;
  mode: 'lora' | 'full';
  step: number;
  steps: number;
  status: RunStatus;
  created: number;
  updated: number;
  runId: string | null;
  photoIds: string[];
}

const two = (n: number) => String(n).padStart(2, '0');

/**
 * A run's name when the user gave none: mode, its number in this browser and when it was made ("LoRA run 3 ·
 * 2026-11-29 04:18", local time), so three runs of one prompt read differently in the list and the dialogs.
 */
export function defaultRunName(mode: 'lora' | 'full', number: number | undefined, created: number): string {
  const d = new Date(created);
  const date = created ? ` · ${d.getFullYear()}-${two(d.getMonth() + 1)}-${two(d.getDate())} ${two(d.getHours())}:${two(d.getMinutes())}` : '';
  return `${mode === 'lora' ? 'LoRA' : 'Full'} run${number ? ` ${number}` : ''}${date}`;
}

/** The number a new run gets: one more than any run kept (runs made before numbers count by their place in time). */
export function nextRunNumber(workspaces: (WorkspaceInfo | undefined)[]): number {
  const known = [...new Map(workspaces.filter((w): w is WorkspaceInfo => !!w).map((w) => [w.id, w])).values()];
  return known.reduce((n, w) => Math.max(n, w.number ?? 0), known.length) + 1;
}

/** A name the user typed, trimmed and at most 80 characters; empty means "use the default". */
export function cleanRunName(name: string): string {
  return name.replace(/\s+/g, ' ').trim().slice(0, 80);
}

export function summarize(p: SavedProject): RunSummary {
  const settings = p.run.startedWith?.settings ?? p.settings;
  const ws = p.workspace;
  return {
    id: ws?.id ?? legacyWorkspaceId(p),
    name: ws?.name || defaultRunName(settings.mode, ws?.number, ws?.created ?? 0),
    prompt: (p.run.startedWith?.prompt ?? p.prompt).trim(),
    mode: settings.mode,
    step: p.run.step,
    steps: p.run.steps || settings.steps,
    status: p.run.status,
    created: ws?.created ?? 0,
    updated: ws?.updated ?? 0,
    runId: p.run.runId,
    photoIds: p.photos.map((m) => m.id),
  };
}

/** Whether the run has training state in the chunk store (photos encoded and at least one step done). */
export function hasTrainingState(p: Pick<SavedProject, 'run'>): boolean {
  return p.run.runId !== null && (p.run.step > 0 || p.run.lastCheckpoint > 0);
}

/**
 * What of a run the browser's storage no longer holds: its training state (no chunk under `<runId>/`) and
 * its photos (no Blob). Empty when it is all there.
 */
export function lostParts(p: SavedProject, blobKeys: ReadonlySet<string>, runsWithChunks: ReadonlySet<string>): string[] {
  const out: string[] = [];
  if (hasTrainingState(p) && !runsWithChunks.has(p.run.runId!)) out.push(`its training state (checkpoints at step ${p.run.lastCheckpoint || p.run.step})`);
  const photos = p.photos.filter((m) => !blobKeys.has(photoKey(m.id))).map((m) => m.name);
  if (photos.length) out.push(`${photos.length === 1 ? 'the photo' : 'the photos'} ${photos.join(', ')}`);
  return out;
}

export function lostMessage(name: string, parts: string[]): string {
  return `Storage for run "${name}" was cleared by the browser: ${parts.join(' and ')}. Remove it from the list, or train it again.`;
}

/** The run ids that have chunks, from the chunk store's keys (`<runId>/…`). */
export function runIdsOfChunks(chunkKeys: Iterable<string>): Set<string> {
  const out = new Set<string>();
  for (const k of chunkKeys) {
    const i = k.indexOf('/');
    if (i > 0) out.add(k.slice(0, i));
  }
  return out;
}

/** Chunk bytes per run id, from the chunk store's key sizes. */
export function chunkBytesByRun(sizes: Iterable<[string, number]>): Map<string, number> {
  const out = new Map<string, number>();
  for (const [k, n] of sizes) {
    const i = k.indexOf('/');
    if (i <= 0) continue;
    const run = k.slice(0, i);
    out.set(run, (out.get(run) ?? 0) + n);
  }
  return out;
}

/**
 * The storage a run uses: its training state plus its Blobs. A photo shared with another run is counted in
 * each (it is freed only with the last run that uses it); `shared` says how many of the bytes are such photos.
 */
export function runStorage(
  p: SavedProject,
  blobSizes: ReadonlyMap<string, number>,
  chunkBytes: ReadonlyMap<string, number>,
  photoUsers: ReadonlyMap<string, number>,
): { bytes: number; shared: number } {
  let bytes = p.run.runId ? (chunkBytes.get(p.run.runId) ?? 0) : 0;
  let shared = 0;
  for (const k of new Set(projectBlobKeys(p))) {
    const n = blobSizes.get(k) ?? 0;
    bytes += n;
    if (k.startsWith('photo:') && (photoUsers.get(k) ?? 0) > 1) shared += n;
  }
  return { bytes, shared };
}

/** How many workspaces use each photo key. */
export function photoUsers(projects: SavedProject[]): Map<string, number> {
  const out = new Map<string, number>();
  for (const p of projects) for (const k of new Set(projectBlobKeys(p).filter((k) => k.startsWith('photo:')))) out.set(k, (out.get(k) ?? 0) + 1);
  return out;
}

/** The list's order: the most recently changed run first. */
export function byRecent(a: RunSummary, b: RunSummary): number {
  return b.updated - a.updated || b.created - a.created || a.id.localeCompare(b.id);
}
