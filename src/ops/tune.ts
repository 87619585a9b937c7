// Per-adapter GEMM tuning: a short timing of a few kernel configurations (GemmConfig: register block, fill target,
// split-K, step depth, prefetch) on the GEMMs of an SD 1.5 training step (matmuls, and the 3x3 convolutions'
// implicit GEMMs forward and backward, which follow the same config), the fastest applied to the Gpu and cached
// per adapter, so the next session on that adapter starts with it and times nothing.
//
// The search walks one field at a time from the adapter kind's defaults (coordinate descent over
// GEMM_CONFIG_VALUES): each other value of the field is timed against the best so far with the rest held, and
// taken only when its summed time is at least `minGain` (5 %) below the best's in that comparison and in a second
// one, so timing noise does not move a config that is as fast. In a comparison each shape's time per config is the
// median of `samples` wall-clock measurements of `reps` back-to-back GEMMs (one submit and one wait each; reps
// chosen so a measurement lasts about `sampleMs`), the two configs' measurements interleaved so that a busy machine
// slows both alike; the first run of each config and shape compiles its pipelines and is not timed.
import { defaultGemmConfig, gemmConfigProblem, GEMM_CONFIG_VALUES, type GemmConfig, type Gpu } from '../gpu/device.ts';
import { GpuDeviceLostError } from '../gpu/errors.ts';
import type { Tensor } from '../gpu/tensor.ts';
import { conv2d, conv2dBackward } from './conv2d.ts';
import { matmul } from './matmul.ts';

/**
 * Part of every cache key: bump when the kernels, the candidates or the shapes timed change, so older entries are
 * timed again (3: the convolutions joined the shapes; 4: the direct matmul core joined the candidates).
 */
export const TUNE_VERSION = 4;

/** Where the chosen configs persist: a file in Node (src/io/tuning-node.ts), IndexedDB in the page (tuning-idb.ts). */
export interface TuningCache {
  load(key: string): Promise<string | null>;
  save(key: string, value: string): Promise<void>;
}

/** One timed GEMM: C[M,N] = op(A)·op(B) over K, with A stored [K, M] (transA) or B stored [N, K] (transB). */
export interface MatmulTuneShape {
  name: string;
  M: number;
  N: number;
  K: number;
  transA?: boolean;
  transB?: boolean;
}

/**
 * One timed convolution, square, padded to keep its side (kernel / 2): the forward (one implicit GEMM), or with
 * `backward` the whole backward pass (input gradient, then the weight gradient: a reduction over every pixel).
 */
export interface ConvTuneShape {
  name: string;
  conv: { batch: number; channels: number; out: number; side: number; kernel: number; backward?: boolean };
}

export type TuneShape = MatmulTuneShape | ConvTuneShape;

/**
 * On a GPU: the GEMMs of a 512 px step (64x64 latents: 4096 tokens) at SD 1.5's first level (320 channels): a
 * projection, the feed-forward's way down, a weight gradient and a LoRA weight gradient (the last two have few
 * output tiles and a long reduction: split-K's case).
 */
export const GPU_TUNE_SHAPES: readonly TuneShape[] = [
  { name: 'linear 4096x320->320', M: 4096, N: 320, K: 320, transB: true },
  { name: 'linear 4096x1280->320', M: 4096, N: 320, K: 1280, transB: true },
  { name: 'grad weight 320x320 over 4096', M: 320, N: 320, K: 4096, transA: true },
  { name: 'LoRA grad 4x320 over 4096', M: 4, N: 320, K: 4096, transA: true },
  // The resnets' 3x3 convolutions, most of a step's time, at the same level: forward, then backward.
  { name: 'conv 3x3 320->320 at 64x64', conv: { batch: 1, channels: 320, out: 320, side: 64, kernel: 3 } },
  { name: 'conv 3x3 320->320 at 64x64 backward', conv: { batch: 1, channels: 320, out: 320, side: 64, kernel: 3, backward: true } },
];

/** On a CPU adapter (a few GFLOP/s): the same layers at 16x16 latents (256 tokens), so the timing stays short. */
export const CPU_TUNE_SHAPES: readonly TuneShape[] = [
  { name: 'linear 256x320->320', M: 256, N: 320, K: 320, transB: true },
  { name: 'linear 256x1280->320', M: 256, N: 320, K: 1280, transB: true },
  { name: 'grad weight 320x320 over 1024', M: 320, N: 320, K: 1024, transA: true },
  { name: 'LoRA grad 4x320 over 1024', M: 4, N: 320, K: 1024, transA: true },
  { name: 'conv 3x3 320->320 at 16x16', conv: { batch: 1, channels: 320, out: 320, side: 16, kernel: 3 } },
  { name: 'conv 3x3 320->320 at 16x16 backward', conv: { batch: 1, channels: 320, out: 320, side: 16, kernel: 3, backward: true } },
];

export interface TuneOptions {
  /** Where chosen configs persist; without one every call times. */
  cache?: TuningCache;
  /** Time even when the cache has an entry (and replace it), and on CPU adapters too. */
  force?: boolean;
  /**
   * Tune CPU adapters (lavapipe, SwiftShader) too. Default false: they keep the defaults measured for them
   * (defaultGemmConfig; a timed search on lavapipe kept them), and the page's software fallback spends no
   * start-up time on a timing that would change nothing a user trains on.
   */
  cpuAdapters?: boolean;
  /** Progress and cache problems, one line each. */
  log?: (line: string) => void;
  /** Default: GPU_TUNE_SHAPES, or CPU_TUNE_SHAPES on a CPU adapter. */
  shapes?: readonly TuneShape[];
  /** Measurements per shape and config (median taken). Default 5. */
  samples?: number;
  /** Target length of one measurement in milliseconds (sets the GEMMs per measurement, 1-256). Default 20. */
  sampleMs?: number;
  /** Least relative gain for a candidate to replace the best so far. Default 0.05. */
  minGain?: number;
}

/** A config's time in one comparison: the sum over shapes of each shape's median milliseconds per GEMM. */
export interface ConfigTiming {
  config: GemmConfig;
  ms: number;
  perShape: number[];
}

export interface TuneReport {
  /** The cache key: version, adapter and storage dtype. */
  key: string;
  config: GemmConfig;
  /** 'cache': read from the cache; 'timed': measured now; 'defaults': a CPU adapter kept its defaults (nothing timed). */
  source: 'cache' | 'timed' | 'defaults';
  /** The shapes timed (by name), in the order of ConfigTiming.perShape. */
  shapes: string[];
  /** Every config timed, in search order (from the cache: the timings recorded when it was timed). */
  timings: ConfigTiming[];
  /** Wall-clock seconds this call spent. */
  seconds: number;
}

/** The cache key for this Gpu: the tuning version, the adapter's identity and the storage dtype timed. */
export function tuningKey(gpu: Gpu): string {
  const a = gpu.adapter;
  return ['gemm', `v${TUNE_VERSION}`, a.vendor, a.architecture, a.device, a.description, gpu.computeDType].join('|');
}

/** Both configs timed on the same shapes, their measurements interleaved (so a machine's drift hits both alike). */
export type CompareConfigs = (incumbent: GemmConfig, challenger: GemmConfig) => Promise<[ConfigTiming, ConfigTiming]>;

/**
 * Coordinate descent over GEMM_CONFIG_VALUES from `start`: per field, each other value is timed against the best so
 * far (the other fields held) and replaces it when at least `minGain` faster in that comparison and again in a
 * second one. Returns the best and every comparison's challenger timing (the first entry: the start's first timing).
 */
export async function searchGemmConfigs(start: GemmConfig, compare: CompareConfigs, minGain = 0.05): Promise<{ best: GemmConfig; timings: ConfigTiming[] }> {
  let best = start;
  const timings: ConfigTiming[] = [];
  for (const field of Object.keys(GEMM_CONFIG_VALUES) as (keyof GemmConfig)[]) {
    const current = best[field];
    for (const value of GEMM_CONFIG_VALUES[field]) {
      if (value === current) continue;
      const challenger = { ...best, [field]: value };
      const [inc, chal] = await compare(best, challenger);
      if (timings.length === 0) timings.push(inc);
      timings.push(chal);
      if (chal.ms >= inc.ms * (1 - minGain)) continue;
      // A win must show again: one comparison's medians can still differ by 10 % between identical kernels on a
      // busy CPU adapter.
      const [inc2, chal2] = await compare(best, challenger);
      timings.push(chal2);
      if (chal2.ms < inc2.ms * (1 - minGain)) best = challenger;
    }
  }
  return { best, timings };
}

/** A cache entry as stored: what was chosen and the timings that chose it. */
interface CacheEntry {
  version: number;
  config: GemmConfig;
  shapes: string[];
  timings: ConfigTiming[];
  timedAt: string;
}

/** The entry's config, or why it cannot be used. */
function parseEntry(text: string): { entry: CacheEntry } | { problem: string } {
  let v: unknown;
  try {
    v = JSON.parse(text);
  } catch (e) {
    return { problem: `not JSON (${(e as Error).message})` };
  }
  const o = (v ?? {}) as Partial<CacheEntry>;
  if (o.version !== TUNE_VERSION) return { problem: `version ${JSON.stringify(o.version)}, expected ${TUNE_VERSION}` };
  const problem = gemmConfigProblem(o.config);
  if (problem) return { problem: `config: ${problem}` };
  return {
    entry: {
      version: o.version,
      config: o.config!,
      shapes: Array.isArray(o.shapes) ? o.shapes : [],
      timings: Array.isArray(o.timings) ? o.timings : [],
      timedAt: String(o.timedAt ?? ''),
    },
  };
}

function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  const mid = s.length >> 1;
  return s.length % 2 ? s[mid] : (s[mid - 1] + s[mid]) / 2;
}

/** A shape ready to time: `once` records one of its GEMMs (or convolution passes) and frees what it made. */
interface TimedOp {
  once(): void;
  free(): void;
}

/** Zero-filled operands on the GPU (no host arrays; zeros time like any normal numbers), freed together. */
function zeroOperands(gpu: Gpu, shapes: number[][]): Tensor[] {
  const made: Tensor[] = [];
  try {
    for (const [i, shape] of shapes.entries()) made.push(gpu.zeros(shape, gpu.computeDType, 'scratch', `tune.${i}`));
    return made;
  } catch (e) {
    gpu.free(...made);
    throw e;
  }
}

function timedOp(gpu: Gpu, s: TuneShape): TimedOp {
  if ('conv' in s) {
    const { batch, channels, out, side, kernel, backward } = s.conv;
    const opts = { stride: 1, padding: kernel >> 1 };
    const [x, w, dy] = zeroOperands(gpu, [
      [batch, channels, side, side],
      [out, channels, kernel, kernel],
      [batch, out, side, side],
    ]);
    return {
      once: backward
        ? () => {
            const g = conv2dBackward(gpu, x, w, dy, opts);
            gpu.free(g.dx, g.dw, g.db);
          }
        : () => gpu.free(conv2d(gpu, x, w, null, opts)),
      free: () => gpu.free(x, w, dy),
    };
  }
  const [a, b] = zeroOperands(gpu, [s.transA ? [s.K, s.M] : [s.M, s.K], s.transB ? [s.N, s.K] : [s.K, s.N]]);
  return { once: () => gpu.free(matmul(gpu, a, b, { transA: s.transA, transB: s.transB })), free: () => gpu.free(a, b) };
}

/** Wall-clock milliseconds of `reps` runs of `op` recorded back to back, submitted once and waited for. */
async function timeReps(gpu: Gpu, op: TimedOp, reps: number): Promise<number> {
  const t0 = performance.now();
  for (let r = 0; r < reps; r++) op.once();
  await gpu.sync();
  return performance.now() - t0;
}

/**
 * Median milliseconds per GEMM of `s` under each config, their measurements interleaved: each config's first,
 * compiling run is untimed, then `samples` rounds time each config once.
 */
async function timeShape(gpu: Gpu, s: TuneShape, configs: GemmConfig[], samples: number, sampleMs: number): Promise<number[]> {
  const op = timedOp(gpu, s);
  try {
    const reps: number[] = [];
    for (const c of configs) {
      gpu.setGemmConfig(c);
      await timeReps(gpu, op, 1); // compiles this config's pipelines
      const once = await timeReps(gpu, op, 1);
      reps.push(Math.max(1, Math.min(256, Math.ceil(sampleMs / Math.max(once, 1e-3)))));
    }
    const perGemm = configs.map((): number[] => []);
    for (let i = 0; i < samples; i++)
      for (const [j, c] of configs.entries()) {
        gpu.setGemmConfig(c);
        perGemm[j].push((await timeReps(gpu, op, reps[j])) / reps[j]);
      }
    return perGemm.map(median);
  } finally {
    op.free();
  }
}

/**
 * Applies this adapter's fastest GEMM config to `gpu`: the cached one when the cache has a valid entry for it (and
 * not `force`), else times candidates (searchGemmConfigs) and caches the winner; CPU adapters keep their defaults
 * unless `cpuAdapters` or `force`. A cache or entry that cannot be read is reported through `log` and timed again;
 * a failed cache write is reported and the config still applied. A failure while timing puts the config the Gpu
 * had back before rethrowing.
 */
export async function tuneGemm(gpu: Gpu, opts: TuneOptions = {}): Promise<TuneReport> {
  const started = performance.now();
  const key = tuningKey(gpu);
  const log = opts.log ?? (() => {});
  const seconds = () => (performance.now() - started) / 1000;
  const shapes = opts.shapes ?? (gpu.facts.software ? CPU_TUNE_SHAPES : GPU_TUNE_SHAPES);
  const names = shapes.map((s) => s.name);
  if (gpu.facts.software && !opts.cpuAdapters && !opts.force)
    return { key, config: gpu.gemmConfig, source: 'defaults', shapes: names, timings: [], seconds: seconds() };
  if (opts.cache && !opts.force) {
    let text: string | null = null;
    try {
      text = await opts.cache.load(key);
    } catch (e) {
      log(`GEMM tuning cache unreadable (${(e as Error).message}); timing again`);
    }
    if (text !== null) {
      const parsed = parseEntry(text);
      if ('entry' in parsed) {
        gpu.setGemmConfig(parsed.entry.config);
        return { key, config: gpu.gemmConfig, source: 'cache', shapes: parsed.entry.shapes, timings: parsed.entry.timings, seconds: seconds() };
      }
      log(`GEMM tuning cache entry "${key}" is unusable (${parsed.problem}); timing again`);
    }
  }
  if (gpu.dryRun) throw new Error('tuneGemm needs a real device: a dry-run Gpu times nothing');
  const samples = opts.samples ?? 5;
  const sampleMs = opts.sampleMs ?? 20;
  const before = gpu.gemmConfig;
  let result: { best: GemmConfig; timings: ConfigTiming[] };
  try {
    const compare: CompareConfigs = async (incumbent, challenger) => {
      const perShape = [[], []] as [number[], number[]];
      for (const s of shapes) {
        const [x, y] = await timeShape(gpu, s, [incumbent, challenger], samples, sampleMs);
        perShape[0].push(x);
        perShape[1].push(y);
      }
      const [inc, chal] = [incumbent, challenger].map((config, i) => ({ config, ms: perShape[i].reduce((p, q) => p + q, 0), perShape: perShape[i] }));
      log(`GEMM tuning: ${describeGemmConfig(chal.config)}: ${chal.ms.toFixed(3)} ms against ${inc.ms.toFixed(3)} ms for ${describeGemmConfig(inc.config)}`);
      return [inc, chal];
    };
    result = await searchGemmConfigs(defaultGemmConfig(gpu.facts.software, before.splitK), compare, opts.minGain ?? 0.05);
  } catch (e) {
    if (!(e instanceof GpuDeviceLostError)) gpu.setGemmConfig(before);
    throw e;
  }
  gpu.setGemmConfig(result.best);
  if (opts.cache) {
    const entry: CacheEntry = { version: TUNE_VERSION, config: result.best, shapes: names, timings: result.timings, timedAt: new Date().toISOString() };
    try {
      await opts.cache.save(key, JSON.stringify(entry));
    } catch (e) {
      log(`GEMM tuning: could not cache the result under "${key}" (${(e as Error).message}); it applies to this session only`);
    }
  }
  return { key, config: gpu.gemmConfig, source: 'timed', shapes: names, timings: result.timings, seconds: seconds() };
}

/** "8x8 blocks, fill 8, split-K off, 16-deep steps, no prefetch, direct matmuls". */
export function describeGemmConfig(c: GemmConfig): string {
  return `${c.registerBlock}x${c.registerBlock} blocks, fill ${c.fillWorkgroups}, split-K ${c.splitK ? 'on' : 'off'}, ${c.bk}-deep steps, ${c.prefetch ? 'prefetch' : 'no prefetch'}, ${c.direct ? 'direct' : 'staged'} matmuls`;
}
