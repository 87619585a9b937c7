// Per-adapter matmul tuning. For a problem class (src/ops/matmul.ts `gemmClass`: M, N, K and batch
// rounded up to powers of two, dtype, transposes) a few candidate configurations (tile shape, split-K)
// are timed briefly on the GPU and the fastest is kept in the Gpu's tuning table (`tunedGemms`), which
// `matmul` consults before its heuristic. Results are cached per adapter in a store the host supplies
// (Node: a JSON file; the browser: localStorage), so a second run reads them instead of timing again.
//
// Tuning is opt-in: nothing here runs unless a host calls `tuneMatmul`, so tests and training stay
// deterministic with the heuristic unless a run asks for tuning.
//
// Node file store (host code, not placed here so this module stays browser-safe):
//   const file = join(process.env.XDG_CACHE_HOME ?? join(homedir(), '.cache'), 'dreambooth-studio', 'matmul-tuning.json');
//   const store: TuningStore = {
//     load: async (key) => { try { return JSON.parse(await readFile(file, 'utf8'))[key] ?? null; } catch { return null; } },
//     save: async (key, value) => { ... read the object (or {}), set [key] = value, mkdir -p, write a temp file, rename },
//   };
import type { Gpu } from '../gpu/device.ts';
import type { Tensor } from '../gpu/tensor.ts';
import { fitTile, gemmClass, GEMM_TILES, heuristicGemm, matmul, tunedGemms, type GemmConfig, type GemmProblem, type Tile } from './matmul.ts';

/** Where tuning results live between runs: one string per key (the host decides the medium). */
export interface TuningStore {
  load(key: string): Promise<string | null> | string | null;
  save(key: string, value: string): Promise<void> | void;
}

/** A store in memory (tests, or hosts with nowhere to keep results). */
export function memoryTuningStore(): TuningStore & { data: Map<string, string> } {
  const data = new Map<string, string>();
  return { data, load: (k) => data.get(k) ?? null, save: (k, v) => void data.set(k, v) };
}

/** The browser's localStorage (absent in Node and workers: then null). */
export function localStorageTuningStore(): TuningStore | null {
  const ls = (globalThis as { localStorage?: Storage }).localStorage;
  if (!ls) return null;
  return { load: (k) => ls.getItem(k), save: (k, v) => ls.setItem(k, v) };
}

/** Bump when the kernels change enough that old timings no longer say anything. */
export const TUNING_VERSION = 1;

/** The cache key of an adapter: results from one GPU (or driver description) never apply to another. */
export function adapterKey(gpu: Gpu): string {
  const a = gpu.adapter;
  return `matmul-tuning:${[a.vendor, a.architecture, a.device, a.description].join('|')}`;
}

interface CacheEntry {
  tile: Tile;
  splitK: number;
  ms: number;
}

interface CacheFile {
  version: number;
  entries: Record<string, CacheEntry>;
}

export interface TuneOptions {
  store?: TuningStore | null;
  /** Timed runs per candidate (the fastest counts); default 3. */
  reps?: number;
  /** Candidates to time instead of the default set (tests). */
  candidates?: (p: GemmProblem) => GemmConfig[];
  /** Where warnings go (a corrupt or stale cache entry); default console.warn. */
  warn?: (message: string) => void;
}

export interface TuneResult {
  problem: GemmProblem;
  class: string;
  config: GemmConfig;
  /** Milliseconds of the chosen config (from the cache when `cached`). */
  ms: number;
  cached: boolean;
  /** Every candidate's time when timed now. */
  timings?: { config: GemmConfig; ms: number }[];
}

const sameConfig = (a: GemmConfig, b: GemmConfig) =>
  a.splitK === b.splitK && a.tile.BM === b.tile.BM && a.tile.BN === b.tile.BN && a.tile.BK === b.tile.BK && a.tile.TM === b.tile.TM && a.tile.TN === b.tile.TN;

/**
 * The default candidates: the heuristic's choice, every candidate tile that fits the device, and for a
 * single-batch problem with a long K the heuristic's tile with 2, 4 and 8 K ranges.
 */
export function defaultCandidates(gpu: Gpu, p: GemmProblem): GemmConfig[] {
  const out: GemmConfig[] = [];
  const add = (c: GemmConfig) => {
    if (!out.some((o) => sameConfig(o, c))) out.push(c);
  };
  const h = heuristicGemm(gpu, p);
  add(h);
  for (const t of GEMM_TILES) {
    const f = fitTile(gpu, t, p.transA, p.transB);
    if (f) add({ tile: f, splitK: 1 });
  }
  if (p.batch === 1 && p.K >= 1024) for (const s of [2, 4, 8]) add({ tile: h.tile, splitK: s });
  return out;
}

/** Why a cached entry cannot be used, or null when it can. */
function entryProblem(gpu: Gpu, p: GemmProblem, e: unknown): string | null {
  if (typeof e !== 'object' || e === null) return 'not an object';
  const { tile, splitK, ms } = e as Partial<CacheEntry>;
  if (!Number.isInteger(splitK) || splitK! < 1 || splitK! > 64) return `bad splitK ${String(splitK)}`;
  if (typeof ms !== 'number' || !(ms >= 0)) return `bad time ${String(ms)}`;
  if (typeof tile !== 'object' || tile === null) return 'no tile';
  for (const k of ['BM', 'BN', 'BK', 'TM', 'TN'] as const) if (!Number.isInteger(tile[k]) || tile[k] < 4) return `bad tile ${JSON.stringify(tile)}`;
  const ok = tile.TM % 4 === 0 && tile.TN % 4 === 0 && tile.BK % 4 === 0 && tile.BM % tile.TM === 0 && tile.BN % tile.TN === 0;
  const fitted = ok ? fitTile(gpu, tile, p.transA, p.transB) : null;
  if (!fitted || fitted.BK !== tile.BK) return `tile ${JSON.stringify(tile)} does not fit this device`;
  return null;
}

async function readCache(gpu: Gpu, store: TuningStore, key: string, warn: (m: string) => void): Promise<CacheFile> {
  const empty: CacheFile = { version: TUNING_VERSION, entries: {} };
  let text: string | null;
  try {
    text = await store.load(key);
  } catch (e) {
    warn(`matmul tuning: cannot read the cache (${(e as Error).message}); tuning again`);
    return empty;
  }
  if (text === null) return empty;
  let parsed: unknown;
  try {
    parsed = JSON.parse(text);
  } catch {
    warn(`matmul tuning: the cache for ${key} is not valid JSON; ignoring it and tuning again`);
    return empty;
  }
  const f = parsed as Partial<CacheFile>;
  if (typeof f !== 'object' || f === null || typeof f.entries !== 'object' || f.entries === null) {
    warn(`matmul tuning: the cache for ${key} has no entries table; ignoring it`);
    return empty;
  }
  if (f.version !== TUNING_VERSION) {
    warn(`matmul tuning: the cache for ${key} is version ${String(f.version)}, not ${TUNING_VERSION} (kernels changed); ignoring it`);
    return empty;
  }
  return { version: TUNING_VERSION, entries: { ...f.entries } };
}

/** Random operands for a problem (values only matter for not being denormal or NaN). */
function operands(gpu: Gpu, p: GemmProblem): { a: Tensor; b: Tensor } {
  const aShape = p.transA ? [p.K, p.M] : [p.M, p.K];
  const bShape = p.transB ? [p.N, p.K] : [p.K, p.N];
  const fill = (n: number) => Float32Array.from({ length: n }, (_, i) => ((i * 2654435761) % 1000) / 1000 - 0.5);
  const lead = p.batch > 1 ? [p.batch] : [];
  return { a: gpu.upload(fill(p.batch * p.M * p.K), [...lead, ...aShape], p.dtype), b: gpu.upload(fill(p.K * p.N), bShape, p.dtype) };
}

/** Milliseconds of one run of `config` (GPU timestamps where present, else the wall clock to completion). */
async function timeOnce(gpu: Gpu, a: Tensor, b: Tensor, p: GemmProblem, config: GemmConfig): Promise<number> {
  let y: Tensor | null = null;
  const run = () => (y = matmul(gpu, a, b, { transA: p.transA, transB: p.transB, tile: config.tile, splitK: config.splitK }));
  let ms: number;
  if (gpu.hasTimestamps) ms = await gpu.gpuTime(run);
  else {
    await gpu.sync();
    const t0 = performance.now();
    run();
    await gpu.sync();
    ms = performance.now() - t0;
  }
  gpu.free(y);
  return ms;
}

/**
 * Tunes the given problems on this Gpu: cached results (per adapter, from `store`) are used as they are;
 * the rest time every candidate `reps` times (after one untimed run that compiles it) and keep the
 * fastest. The choices go into the Gpu's tuning table, which `matmul` consults from then on; the cache
 * is written back when anything was timed.
 */
export async function tuneMatmul(gpu: Gpu, problems: GemmProblem[], opts: TuneOptions = {}): Promise<TuneResult[]> {
  const warn = opts.warn ?? ((m: string) => console.warn(m));
  const reps = opts.reps ?? 3;
  const key = adapterKey(gpu);
  const cache = opts.store ? await readCache(gpu, opts.store, key, warn) : { version: TUNING_VERSION, entries: {} as Record<string, CacheEntry> };
  const table = tunedGemms(gpu);
  const results: TuneResult[] = [];
  let changed = false;
  for (const p of problems) {
    const cls = gemmClass(p);
    const hit = cache.entries[cls];
    if (hit !== undefined) {
      const why = entryProblem(gpu, p, hit);
      if (why === null) {
        const config = { tile: { ...hit.tile }, splitK: hit.splitK };
        table.set(cls, config);
        results.push({ problem: p, class: cls, config, ms: hit.ms, cached: true });
        continue;
      }
      warn(`matmul tuning: ignoring the cached entry for ${cls} (${why}); tuning it again`);
      delete cache.entries[cls];
    }
    const { a, b } = operands(gpu, p);
    const timings: { config: GemmConfig; ms: number }[] = [];
    try {
      for (const config of opts.candidates?.(p) ?? defaultCandidates(gpu, p)) {
        await timeOnce(gpu, a, b, p, config); // compiles the pipeline
        let best = Infinity;
        for (let r = 0; r < reps; r++) best = Math.min(best, await timeOnce(gpu, a, b, p, config));
        timings.push({ config, ms: best });
      }
    } finally {
      gpu.free(a, b);
    }
    const win = timings.reduce((x, y) => (y.ms < x.ms ? y : x));
    table.set(cls, win.config);
    cache.entries[cls] = { tile: win.config.tile, splitK: win.config.splitK, ms: win.ms };
    changed = true;
    results.push({ problem: p, class: cls, config: win.config, ms: win.ms, cached: false, timings });
  }
  if (changed && opts.store) await opts.store.save(key, JSON.stringify(cache));
  return results;
}

/** Forgets this Gpu's tuned configurations (matmul uses its heuristic again). */
export function clearMatmulTuning(gpu: Gpu): void {
  tunedGemms(gpu).clear();
}
