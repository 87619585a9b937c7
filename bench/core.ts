// Shared benchmark code: runs our kernels on the SD1.5 shapes of bench/shapes.json and measures
// median wall time (submit -> onSubmittedWorkDone) and the peak bytes allocated above the inputs.
// Used by the Chromium page (against onnxruntime-web and tfjs in the same page) and by Node.
import type { Gpu } from '../src/gpu/device.ts';
import type { DType, Tensor } from '../src/gpu/tensor.ts';
import { flashAttention, flashAttentionBackward, naiveAttention, naiveAttentionBackward } from '../src/ops/attention.ts';
import { conv2d } from '../src/ops/conv2d.ts';
import { matmul } from '../src/ops/matmul.ts';
import { randomValues } from '../src/selftest/check.ts';

export interface ShapeCase {
  id: string;
  op: 'matmul' | 'conv' | 'attention';
  label: string;
  M?: number;
  K?: number;
  N?: number;
  C?: number;
  H?: number;
  W?: number;
  D?: number;
  /** Conv kernel size (3 or 1; 3 when absent). */
  R?: number;
}

export type Pass = 'fwd' | 'fwdbwd';

export interface Measurement {
  id: string;
  label: string;
  impl: string;
  dtype: string;
  /** What one run computes: the forward, or forward + backward (attention). */
  pass?: Pass;
  /** Median wall milliseconds per run: R back-to-back runs per measurement, submit to completion, divided by R. */
  ms: number;
  /** Median GPU milliseconds per run from timestamps around R back-to-back runs (ours, where available). */
  gpuMs?: number;
  /** Per-run wall ms of each measurement. */
  all: number[];
  /** Per-run GPU ms of each measurement (ours, where available). */
  allGpu?: number[];
  /** Runs per measurement (R). */
  repeat?: number;
  gflops: number;
  /** Peak bytes allocated above the inputs during one run (ours only). */
  peakBytes?: number;
  /** The same peak as planned by a dry run of the same code (ours only; also where no real run was made). */
  plannedPeakBytes?: number;
  note?: string;
}

export function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}

/** Conv kernel size of a case. */
export const convKernel = (c: ShapeCase): number => c.R ?? 3;

/** Useful FLOPs of one run (the same for every implementation). */
export function flops(c: ShapeCase, pass: Pass = 'fwd'): number {
  if (c.op === 'matmul') return 2 * c.M! * c.K! * c.N!;
  if (c.op === 'conv') return 2 * c.H! * c.W! * c.C! * c.C! * convKernel(c) ** 2;
  const fwd = 4 * c.H! * c.N! * c.M! * c.D!;
  return pass === 'fwd' ? fwd : 3.5 * fwd; // backward: dV, dP, dQ, dK + the recomputed scores QKᵀ = 2.5x the forward
}

/** Dawn's timestamp quantization rounds every timestamp down to a multiple of 2^16 ns (65.536 us). */
export const TIMESTAMP_QUANTUM_NS = 65536;

/**
 * Were these raw timestamp durations (ns, one per measurement, undivided) quantized? True when every one is a
 * multiple of 65.536 us (a chance of 2^-16 each for real durations), undefined with none to judge.
 */
export function timestampsQuantized(rawNs: number[]): boolean | undefined {
  if (!rawNs.length) return undefined;
  return rawNs.every((ns) => Math.round(ns) % TIMESTAMP_QUANTUM_NS === 0);
}

export interface Timing {
  /** Wall ms per run of each measurement (measurement wall time / repeat). */
  all: number[];
  /** GPU ms per run of each measurement (timestamps / repeat), where the device has timestamps. */
  gpuMs: number[];
  /** Undivided GPU durations of each measurement in ns (for the quantization check). */
  rawGpuNs: number[];
  /** How the GPU time was taken: one timestamp pair around the R runs, or per-dispatch timestamps summed. */
  method: 'pass' | 'profile' | 'wall';
  peak: number;
  /** Runs per measurement. */
  repeat: number;
  /** Fewer than `reps` measurements: the time budget ran out. */
  cut: boolean;
}

export interface TimingOptions {
  /** Measurements wanted (the median is taken over them). */
  reps: number;
  /** No further measurement starts past this time (performance.now()) once `minReps` are done. */
  deadline: number;
  minReps?: number;
  /** Wanted length of one measurement: R is the number of runs that fills it (at least 1, at most 500). */
  targetMs?: number;
}

/**
 * Times `fn` (records one run: dispatches only, returns its outputs, which are freed) as the GPU sees it:
 * a warm-up run (pipelines compiled, per-adapter choices made), one or two runs that calibrate R (the first
 * also measures the peak bytes allocated above the inputs), then `reps` measurements of R back-to-back runs.
 * With timestamps, the R runs are recorded into one compute pass between one timestamp pair
 * (Gpu.gpuTime); where an op splits the pass (it submits mid-way), per-dispatch timestamps (startProfile)
 * are summed instead. Each measurement's wall time (record to completion, read-back of the timestamps
 * included) is taken too. Per-run times are the measurement's / R.
 */
export async function timeOurs(gpu: Gpu, fn: () => Tensor[], opts: TimingOptions): Promise<Timing> {
  const targetMs = opts.targetMs ?? 5;
  const minReps = Math.min(opts.reps, opts.minReps ?? 3);
  gpu.free(...fn()); // warm-up
  await gpu.sync();
  let method: Timing['method'] = gpu.hasTimestamps ? 'pass' : 'wall';
  const runs = (n: number) => {
    for (let i = 0; i < n; i++) gpu.free(...fn());
  };
  /** One measurement of `n` runs: [wall ms, GPU ns (NaN without timestamps)]. */
  const measure = async (n: number): Promise<[number, number]> => {
    const t0 = performance.now();
    let ns = NaN;
    if (method === 'pass') {
      try {
        ns = Math.round((await gpu.gpuTime(() => runs(n))) * 1e6);
      } catch (e) {
        if (!/spanned \d+ compute passes/.test((e as Error).message)) throw e;
        await gpu.sync();
        method = 'profile';
        return measure(n);
      }
    } else if (method === 'profile') {
      gpu.startProfile();
      runs(n);
      ns = Math.round((await gpu.stopProfile()).totalMs * 1e6);
    } else {
      runs(n);
      await gpu.sync();
    }
    return [performance.now() - t0, ns];
  };
  const perRun = ([wall, ns]: [number, number]) => (Number.isFinite(ns) ? ns / 1e6 : wall);
  const base = gpu.allocator.report().current;
  gpu.allocator.resetPeak();
  let first = await measure(1); // also the run whose peak bytes above the inputs are reported
  const peak = gpu.allocator.report().peak - base;
  // A short run is calibrated again: the first timed pass pays one-off costs (query sets, the resolve path)
  // that would make R far too small. A run longer than the target is stable enough to count as a measurement.
  const short = perRun(first) < targetMs;
  if (short) first = await measure(1);
  const repeat = Math.max(1, Math.min(500, Math.floor(targetMs / Math.max(perRun(first), 1e-3))));
  const all: number[] = [];
  const gpuMs: number[] = [];
  const rawGpuNs: number[] = [];
  const record = ([wall, ns]: [number, number]) => {
    all.push(wall / repeat);
    if (Number.isFinite(ns)) {
      gpuMs.push(ns / 1e6 / repeat);
      rawGpuNs.push(ns);
    }
  };
  if (!short) record(first); // R = 1: the calibration run was already a measurement of one run
  while (all.length < opts.reps && (all.length < minReps || performance.now() < opts.deadline)) record(await measure(repeat));
  return { all, gpuMs, rawGpuNs, method, peak, repeat, cut: all.length < opts.reps };
}

function rand(gpu: Gpu, shape: number[], dtype: DType, seed: number): Tensor {
  if (gpu.dryRun) return gpu.zeros(shape, dtype, 'weights', 'bench-input');
  const n = shape.reduce((a, b) => a * b, 1);
  return gpu.upload(randomValues(n, seed, 0.5), shape, dtype, 'weights', 'bench-input');
}

/** One thing we time for a shape: what it runs and which FLOP count applies. */
interface Variant {
  impl: string;
  pass: Pass;
  run: () => Tensor[];
  note?: string;
}

const ROW_KERNELS = { forward: 'rows', backward: 'separate' } as const;
const ROWS_FWD = 'ours (flash, row kernels)';
const ROWS_FWDBWD = 'ours (flash, row kernels) fwd+bwd';

/** Inputs on `gpu` for shape `c` and the variants that run on them (ours: the op's forward; attention also flash and naive fwd+bwd). */
function variants(gpu: Gpu, c: ShapeCase): { inputs: Tensor[]; list: Variant[] } {
  const dtype = gpu.computeDType;
  if (c.op === 'matmul') {
    const a = rand(gpu, [c.M!, c.K!], dtype, 1);
    const b = rand(gpu, [c.K!, c.N!], dtype, 2);
    return { inputs: [a, b], list: [{ impl: 'ours', pass: 'fwd', run: () => [matmul(gpu, a, b)] }] };
  }
  if (c.op === 'conv') {
    const r = convKernel(c);
    const x = rand(gpu, [1, c.C!, c.H!, c.W!], dtype, 1);
    const w = rand(gpu, [c.C!, c.C!, r, r], dtype, 2);
    const bias = rand(gpu, [c.C!], dtype, 3);
    const padding = (r - 1) / 2;
    return { inputs: [x, w, bias], list: [{ impl: 'ours', pass: 'fwd', run: () => [conv2d(gpu, x, w, bias, { stride: 1, padding })] }] };
  }
  const q = rand(gpu, [1, c.H!, c.N!, c.D!], dtype, 1);
  const k = rand(gpu, [1, c.H!, c.M!, c.D!], dtype, 2);
  const v = rand(gpu, [1, c.H!, c.M!, c.D!], dtype, 3);
  const dout = rand(gpu, [1, c.H!, c.N!, c.D!], dtype, 4);
  return {
    inputs: [q, k, v, dout],
    list: [
      {
        impl: 'ours (flash)',
        pass: 'fwd',
        run: () => {
          const f = flashAttention(gpu, q, k, v);
          return [f.out, f.lse];
        },
      },
      {
        impl: 'ours (flash) fwd+bwd',
        pass: 'fwdbwd',
        run: () => {
          const f = flashAttention(gpu, q, k, v);
          const g = flashAttentionBackward(gpu, q, k, v, f.out, f.lse, dout);
          return [f.out, f.lse, g.dq, g.dk, g.dv];
        },
      },
      // The kernels before FlashAttention-2 (one query row per invocation; dQ and dK/dV kernels that each
      // recompute S and dP), still the fallback: the same run gives the before/after.
      {
        impl: ROWS_FWD,
        pass: 'fwd',
        run: () => {
          const f = flashAttention(gpu, q, k, v, { kernels: ROW_KERNELS });
          return [f.out, f.lse];
        },
      },
      {
        impl: ROWS_FWDBWD,
        pass: 'fwdbwd',
        run: () => {
          const f = flashAttention(gpu, q, k, v, { kernels: ROW_KERNELS });
          const g = flashAttentionBackward(gpu, q, k, v, f.out, f.lse, dout, { kernels: ROW_KERNELS });
          return [f.out, f.lse, g.dq, g.dk, g.dv];
        },
      },
      {
        impl: 'naive fwd+bwd',
        pass: 'fwdbwd',
        note: 'materialises the [H,N,M] scores',
        run: () => {
          const f = naiveAttention(gpu, q, k, v);
          const g = naiveAttentionBackward(gpu, q, k, v, f.probs, dout);
          return [f.out, f.probs, g.dq, g.dk, g.dv];
        },
      },
    ],
  };
}

/**
 * Peak bytes above the inputs of each variant, planned by a dry-run Gpu (allocations accounted, no
 * work done) running the same code: exact, and possible where a real run is too slow or too big.
 */
export function planPeaks(planner: Gpu, c: ShapeCase): Map<string, number> {
  const { inputs, list } = variants(planner, c);
  const peaks = new Map<string, number>();
  for (const v of list) {
    const base = planner.allocator.report().current;
    planner.allocator.resetPeak();
    planner.free(...v.run());
    peaks.set(v.impl, planner.allocator.report().peak - base);
  }
  planner.free(...inputs);
  return peaks;
}

export interface BenchOptions {
  /** Measurements per variant (median over them). */
  reps: number;
  /** Measurements of naive attention, the baseline (slow on software adapters); `reps` when absent, 0: not timed. */
  naiveReps?: number;
  /** Time budget per variant (ms): past it, no further measurement starts once 3 are done. */
  budgetMs?: number;
  /** Wanted length of one measurement (ms): R runs fill it. */
  targetMs?: number;
  /** A dry-run Gpu of the same kind: every measurement also gets its planned peak bytes. */
  planner?: Gpu;
  /** Naive attention is not run when one [H,N,M] score buffer exceeds this (its peak is still planned). */
  naiveMaxScoreBytes?: number;
}

/** What the timestamps of a set of measurements showed. */
export interface TimestampReport {
  /** Every raw duration a multiple of 65.536 us (Dawn's quantization on); undefined without timestamps. */
  quantized: boolean | undefined;
  /** Raw durations looked at. */
  durations: number;
  methods: string[];
}

/** Our measurements for one shape: the op's forward, plus flash vs naive fwd+bwd for attention. */
export async function benchOurs(gpu: Gpu, c: ShapeCase, opts: BenchOptions, rawNs: number[] = []): Promise<Measurement[]> {
  const dtype = gpu.computeDType;
  const planned = opts.planner ? planPeaks(opts.planner, c) : new Map<string, number>();
  const out: Measurement[] = [];
  const { inputs, list } = variants(gpu, c);
  for (const v of list) {
    const base = { id: c.id, label: c.label, impl: v.impl, dtype, pass: v.pass, plannedPeakBytes: planned.get(v.impl) };
    const naive = v.impl.startsWith('naive');
    const skip = naive ? naiveSkipReason(gpu, c, opts.naiveMaxScoreBytes ?? Infinity, opts.naiveReps) : undefined;
    if (skip) {
      out.push({ ...base, ms: NaN, all: [], gflops: NaN, note: `not run: ${skip}` });
      continue;
    }
    try {
      const reps = naive ? (opts.naiveReps ?? opts.reps) : opts.reps;
      const r = await timeOurs(gpu, v.run, { reps, deadline: performance.now() + (opts.budgetMs ?? 600_000), targetMs: opts.targetMs });
      rawNs.push(...r.rawGpuNs);
      const ms = median(r.all);
      const gpuMs = r.gpuMs.length ? median(r.gpuMs) : undefined;
      const how = {
        pass: `timestamps around ${r.repeat} runs in one pass`,
        profile: `per-dispatch timestamps summed over ${r.repeat} runs`,
        wall: `${r.repeat} runs per submit`,
      }[r.method];
      out.push({
        ...base,
        ms,
        gpuMs,
        all: r.all,
        allGpu: r.gpuMs.length ? r.gpuMs : undefined,
        repeat: r.repeat,
        gflops: flops(c, v.pass) / (gpuMs ?? ms) / 1e6,
        peakBytes: r.peak,
        note: [v.note, how, r.cut ? `only ${r.all.length} of ${reps} measurements (time budget)` : ''].filter(Boolean).join('; '),
      });
    } catch (e) {
      out.push({ ...base, ms: NaN, all: [], gflops: NaN, note: `failed: ${firstLine((e as Error).message)}` });
    }
  }
  gpu.free(...inputs);
  return out;
}

/** The first line of an error message, at most 200 characters (WebGPU validation errors run to pages). */
export const firstLine = (message: string): string => message.split('\n')[0].slice(0, 200);

/** Why naive attention is not run on this shape (undefined: it is). */
function naiveSkipReason(gpu: Gpu, c: ShapeCase, maxScoreBytes: number, reps?: number): string | undefined {
  if (reps === 0) return 'naive attention not timed (--naive-reps 0, the --quick default; its peak is planned)';
  const scoreBytes = c.H! * c.N! * c.M! * (gpu.computeDType === 'f16' ? 2 : 4);
  const mib = (b: number) => `${(b / 2 ** 20).toFixed(0)} MiB`;
  if (scoreBytes > gpu.device.limits.maxBufferSize) return `scores of ${mib(scoreBytes)} exceed maxBufferSize ${mib(gpu.device.limits.maxBufferSize)}`;
  if (scoreBytes > maxScoreBytes) return `scores of ${mib(scoreBytes)} exceed --naive-max-mib ${mib(maxScoreBytes)} (too slow to time here)`;
  return undefined;
}

/** One comparison: our median against each peer's on the same case, pass and dtype. */
export interface CaseComparison {
  id: string;
  label: string;
  pass: Pass;
  dtype: string;
  /** Which time is compared: GPU timestamps (ours) vs the peer's own device time, or wall time for everyone. */
  basis: 'gpu' | 'wall';
  oursMs: number;
  peersMs: Record<string, number>;
  fastestPeer?: string;
  /** Fastest peer's ms / ours: > 1 means ours is faster (speedup over the faster peer), < 1 slower. */
  speedVsFastestPeer?: number;
  /** Peers that were not run, and why. */
  notRun?: Record<string, string>;
}

const isOurs = (m: Measurement) => m.impl.startsWith('ours');

/** Does a peer that was not run ('torch f16', 'torch sdpa', 'onnxruntime-web fwd+bwd') concern this measurement of ours? */
function notRunApplies(peer: string, ours: Measurement): boolean {
  const dtype = /\b(f16|f32)\b/.exec(peer)?.[1];
  if (dtype && dtype !== ours.dtype) return false;
  if (peer.includes('sdpa') && !ours.impl.includes('flash')) return false;
  if (peer.includes('fwd+bwd') && ours.pass !== 'fwdbwd') return false;
  return true;
}
const isNaive = (m: Measurement) => m.impl.startsWith('naive');

/**
 * Per case, pass and dtype: our median against every peer's, and the speed ratio against the faster one.
 * `gpuTimes`: compare our GPU (timestamp) times with the peers' reported times (PyTorch's CUDA events, or its
 * CPU wall time where it runs on the CPU); otherwise wall times measured the same way for everyone (the page).
 */
export function compare(ms: Measurement[], gpuTimes: boolean, notRun: Record<string, string> = {}): CaseComparison[] {
  const time = (m: Measurement) => (gpuTimes ? (m.gpuMs ?? m.ms) : m.ms);
  const out: CaseComparison[] = [];
  for (const ours of ms.filter(isOurs)) {
    const pass = ours.pass ?? 'fwd';
    const peers = ms.filter((m) => m.id === ours.id && (m.pass ?? 'fwd') === pass && m.dtype === ours.dtype && !isOurs(m) && !isNaive(m));
    const peersMs = Object.fromEntries(peers.filter((m) => Number.isFinite(m.ms)).map((m) => [m.impl, time(m)]));
    const fastest = Object.entries(peersMs).sort((a, b) => a[1] - b[1])[0];
    const missing = Object.fromEntries(Object.entries(notRun).filter(([peer]) => notRunApplies(peer, ours)));
    for (const m of peers.filter((p) => !Number.isFinite(p.ms))) missing[m.impl] = m.note ?? 'failed';
    out.push({
      id: ours.id,
      label: ours.label,
      pass,
      dtype: ours.dtype,
      basis: gpuTimes && ours.gpuMs !== undefined ? 'gpu' : 'wall',
      oursMs: time(ours),
      peersMs,
      fastestPeer: fastest?.[0],
      speedVsFastestPeer: fastest && Number.isFinite(time(ours)) ? fastest[1] / time(ours) : undefined,
      notRun: Object.keys(missing).length ? missing : undefined,
    });
  }
  return out;
}

/** The comparison as a table: ours, each peer, and the speed ratio against the faster peer. */
export function comparisonTable(rows: CaseComparison[]): string {
  const peers = [...new Set(rows.flatMap((r) => Object.keys(r.peersMs)))];
  const f = (x: number | undefined) => (x === undefined || !Number.isFinite(x) ? '-' : x < 10 ? x.toFixed(3) : x.toFixed(1));
  const body = rows.map((r) => [
    r.label,
    r.pass === 'fwd' ? 'fwd' : 'fwd+bwd',
    r.dtype,
    f(r.oursMs),
    ...peers.map((p) => f(r.peersMs[p])),
    r.speedVsFastestPeer === undefined ? '-' : `${r.speedVsFastestPeer.toFixed(2)}x`,
  ]);
  const head = ['case', 'pass', 'dtype', 'ours ms', ...peers.map((p) => `${p} ms`), 'fastest peer / ours'];
  const w = head.map((h, i) => Math.max(h.length, ...body.map((r) => r[i].length)));
  const line = (r: string[]) => r.map((c, i) => c.padEnd(w[i])).join('  ');
  return [line(head), line(w.map((x) => '-'.repeat(x))), ...body.map(line), '(fastest peer / ours: > 1 = ours faster by that factor, < 1 = ours slower)'].join(
    '\n',
  );
}

/** Flash vs naive attention (issue 2's targets): time and peak bytes, per dtype. */
export function flashVsNaive(ms: Measurement[], gpuTimes = false): Record<string, number | string> {
  const time = (m: Measurement) => (gpuTimes ? (m.gpuMs ?? m.ms) : m.ms);
  const s: Record<string, number | string> = {};
  for (const dtype of new Set(ms.map((m) => m.dtype)))
    for (const id of new Set(ms.map((m) => m.id))) {
      const flash = ms.find((m) => m.id === id && m.dtype === dtype && m.impl === 'ours (flash) fwd+bwd');
      const naive = ms.find((m) => m.id === id && m.dtype === dtype && m.impl === 'naive fwd+bwd');
      if (!flash || !naive) continue;
      const key = `${id} ${dtype}`;
      if (Number.isFinite(naive.ms)) s[`${key}: naive/flash time (target >= 2)`] = time(naive) / time(flash);
      else s[`${key}: naive/flash time (target >= 2)`] = `not measured (${naive.note ?? 'naive not run'})`;
      if (naive.peakBytes !== undefined && flash.peakBytes !== undefined)
        s[`${key}: naive/flash peak bytes (target >= 10)`] = naive.peakBytes / flash.peakBytes;
      else if (naive.plannedPeakBytes !== undefined && flash.plannedPeakBytes !== undefined) {
        s[`${key}: naive/flash peak bytes, planned by a dry run (target >= 10)`] = naive.plannedPeakBytes / flash.plannedPeakBytes;
      }
    }
  return s;
}

/** The FlashAttention-2 kernels against the row kernels they replace, measured in the same run: rows time / tiled time. */
export function flashTiledVsRows(ms: Measurement[], gpuTimes = false): Record<string, number> {
  const time = (m: Measurement) => (gpuTimes ? (m.gpuMs ?? m.ms) : m.ms);
  const s: Record<string, number> = {};
  for (const m of ms.filter((x) => x.impl === 'ours (flash)' || x.impl === 'ours (flash) fwd+bwd')) {
    const rows = ms.find((x) => x.id === m.id && x.dtype === m.dtype && x.impl === (m.pass === 'fwdbwd' ? ROWS_FWDBWD : ROWS_FWD));
    if (rows && Number.isFinite(time(rows)) && Number.isFinite(time(m)))
      s[`${m.id} ${m.dtype} ${m.pass === 'fwdbwd' ? 'fwd+bwd' : 'fwd'}: row kernels / FlashAttention-2 time`] = time(rows) / time(m);
  }
  return s;
}

/** The adapter limits that bound what the benchmark can run. */
export function pickLimits(limits: Record<string, number>): Record<string, number> {
  const names = ['maxBufferSize', 'maxStorageBufferBindingSize', 'maxComputeWorkgroupStorageSize', 'maxComputeInvocationsPerWorkgroup'];
  return Object.fromEntries(names.filter((n) => n in limits).map((n) => [n, limits[n]]));
}

export function table(ms: Measurement[]): string {
  const mib = (b?: number) => (b !== undefined ? (b / 2 ** 20).toFixed(1) : '');
  const rows = ms.map((m) => [
    m.label,
    m.pass === 'fwdbwd' && !m.impl.includes('fwd+bwd') ? `${m.impl} fwd+bwd` : m.impl,
    m.dtype,
    Number.isFinite(m.ms) ? m.ms.toFixed(3) : '-',
    m.gpuMs !== undefined ? m.gpuMs.toFixed(3) : '',
    Number.isFinite(m.gflops) ? m.gflops.toFixed(1) : '-',
    `${m.all.length || ''}`,
    `${m.repeat ?? ''}`,
    mib(m.peakBytes),
    mib(m.plannedPeakBytes),
    (m.note ?? '').slice(0, 120),
  ]);
  const head = ['shape', 'impl', 'dtype', 'wall ms', 'GPU ms', 'GFLOP/s', 'reps', 'R', 'peak MiB', 'planned MiB', 'note'];
  const w = head.map((h, i) => Math.max(h.length, ...rows.map((r) => r[i].length)));
  const line = (r: string[]) => r.map((c, i) => c.padEnd(w[i])).join('  ');
  return [line(head), line(w.map((x) => '-'.repeat(x))), ...rows.map(line)].join('\n');
}

/**
 * A file-name slug for an adapter: 'swiftshader', 'lavapipe', or the vendor and model ('nvidia-h200') from the
 * device name (Dawn in Node reports it; Chrome may not, leaving the vendor and architecture: 'nvidia-hopper').
 */
export function adapterSlug(a: { vendor: string; architecture: string; device: string; description: string }): string {
  const all = `${a.vendor} ${a.architecture} ${a.device} ${a.description}`.toLowerCase();
  if (all.includes('swiftshader')) return 'swiftshader';
  if (all.includes('llvmpipe') || all.includes('lavapipe')) return 'lavapipe';
  const model = /\b([a-z]{0,3}\d{2,4}[a-z]*)\b/.exec(a.device.toLowerCase().replace(/nvidia|geforce|rtx|tesla|amd|radeon|intel/g, ''))?.[1];
  const name = [a.vendor || 'gpu', model ?? a.architecture].filter(Boolean).join('-');
  return (
    name
      .replace(/[^a-z0-9]+/gi, '-')
      .replace(/^-|-$/g, '')
      .toLowerCase() || 'gpu'
  );
}
