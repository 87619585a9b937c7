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
}

export interface Measurement {
  id: string;
  label: string;
  impl: string;
  dtype: string;
  /** Median wall milliseconds per run (batched submissions) over `reps` timed batches. */
  ms: number;
  /** Median GPU milliseconds per run from timestamp queries (ours, where available). */
  gpuMs?: number;
  all: number[];
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

/** Useful FLOPs of one run (the same for every implementation). */
export function flops(c: ShapeCase, pass: 'fwd' | 'fwdbwd' = 'fwd'): number {
  if (c.op === 'matmul') return 2 * c.M! * c.K! * c.N!;
  if (c.op === 'conv') return 2 * c.H! * c.W! * c.C! * c.C! * 9;
  const fwd = 4 * c.H! * c.N! * c.M! * c.D!;
  return pass === 'fwd' ? fwd : 3 * fwd; // backward: dV, dP, dQ, dK = 2x the forward's two products
}

export interface Timing {
  /** Wall ms per run (batch wall time / inner). */
  all: number[];
  /** GPU ms per run from timestamp queries, where the device has them. */
  gpuMs: number[];
  peak: number;
  inner: number;
}

/**
 * Times `fn` as the GPU sees it without per-submit latency: a warm-up run, one run that measures
 * the peak bytes allocated above the inputs, then `reps` batches of `inner` back-to-back runs in
 * one submission each; a run's time is the batch's wall time / inner. `inner` is picked so that a
 * batch lasts about 50 ms. When one run alone is that long (inner = 1), the peak-measuring run is
 * timed exactly like a batch and counts as the first rep (on SwiftShader one SD-sized run can take
 * minutes). Frees what each run returns.
 */
export async function timeOurs(gpu: Gpu, fn: () => Tensor[], reps: number, deadline: number): Promise<Timing> {
  gpu.free(...fn()); // warm-up: pipeline compilation
  await gpu.sync();
  const base = gpu.allocator.report().current;
  gpu.allocator.resetPeak();
  const t0 = performance.now();
  gpu.free(...fn());
  await gpu.sync();
  const single = performance.now() - t0;
  const peak = gpu.allocator.report().peak - base;
  const inner = Math.max(1, Math.min(50, Math.floor(50 / Math.max(single, 0.01))));
  const all: number[] = inner === 1 ? [single] : [];
  const gpuMs: number[] = [];
  const gpuTime = async () => {
    let outs: Tensor[] = [];
    gpuMs.push(await gpu.gpuTime(() => (outs = fn())));
    gpu.free(...outs);
  };
  // Timestamp queries cost one more run per rep: skipped for runs over 5 s, where wall time is GPU time.
  const timestamps = gpu.hasTimestamps && single < 5000;
  if (inner === 1 && timestamps) await gpuTime();
  while (all.length < reps && (all.length === 0 || performance.now() < deadline)) {
    const t1 = performance.now();
    for (let i = 0; i < inner; i++) gpu.free(...fn());
    await gpu.sync();
    all.push((performance.now() - t1) / inner);
    if (timestamps) await gpuTime();
  }
  return { all, peak, inner, gpuMs };
}

function rand(gpu: Gpu, shape: number[], dtype: DType, seed: number): Tensor {
  if (gpu.dryRun) return gpu.zeros(shape, dtype, 'weights', 'bench-input');
  const n = shape.reduce((a, b) => a * b, 1);
  return gpu.upload(randomValues(n, seed, 0.5), shape, dtype, 'weights', 'bench-input');
}

/** One thing we time for a shape: what it runs and which FLOP count applies. */
interface Variant {
  impl: string;
  pass: 'fwd' | 'fwdbwd';
  run: () => Tensor[];
  note?: string;
}

/** Inputs on `gpu` for shape `c` and the variants that run on them (ours: the op's forward; attention also flash and naive fwd+bwd). */
function variants(gpu: Gpu, c: ShapeCase): { inputs: Tensor[]; list: Variant[] } {
  const dtype = gpu.computeDType;
  if (c.op === 'matmul') {
    const a = rand(gpu, [c.M!, c.K!], dtype, 1);
    const b = rand(gpu, [c.K!, c.N!], dtype, 2);
    return { inputs: [a, b], list: [{ impl: 'ours', pass: 'fwd', run: () => [matmul(gpu, a, b)] }] };
  }
  if (c.op === 'conv') {
    const x = rand(gpu, [1, c.C!, c.H!, c.W!], dtype, 1);
    const w = rand(gpu, [c.C!, c.C!, 3, 3], dtype, 2);
    const bias = rand(gpu, [c.C!], dtype, 3);
    return { inputs: [x, w, bias], list: [{ impl: 'ours', pass: 'fwd', run: () => [conv2d(gpu, x, w, bias, { stride: 1, padding: 1 })] }] };
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
  reps: number;
  /** Time budget per shape (ms): after the first rep, no further reps start past it. */
  budgetMs?: number;
  /** A dry-run Gpu of the same kind: every measurement also gets its planned peak bytes. */
  planner?: Gpu;
  /** Naive attention is not run when one [H,N,M] score buffer exceeds this (its peak is still planned). */
  naiveMaxScoreBytes?: number;
}

/** Our measurements for one shape: the op's forward, plus flash vs naive fwd+bwd for attention. */
export async function benchOurs(gpu: Gpu, c: ShapeCase, opts: BenchOptions): Promise<Measurement[]> {
  const dtype = gpu.computeDType;
  const deadline = performance.now() + (opts.budgetMs ?? 120_000);
  const planned = opts.planner ? planPeaks(opts.planner, c) : new Map<string, number>();
  const out: Measurement[] = [];
  const { inputs, list } = variants(gpu, c);
  for (const v of list) {
    const base = { id: c.id, label: c.label, impl: v.impl, dtype, plannedPeakBytes: planned.get(v.impl) };
    const skip = v.impl.startsWith('naive') ? naiveSkipReason(gpu, c, opts.naiveMaxScoreBytes ?? Infinity) : undefined;
    if (skip) {
      out.push({ ...base, ms: NaN, all: [], gflops: NaN, note: `not run: ${skip}` });
      continue;
    }
    try {
      const r = await timeOurs(gpu, v.run, opts.reps, deadline);
      const ms = median(r.all);
      const gpuMs = r.gpuMs.length ? median(r.gpuMs) : undefined;
      const batching = r.inner > 1 ? `batches of ${r.inner} per submit` : '';
      out.push({
        ...base,
        ms,
        gpuMs,
        all: r.all,
        gflops: flops(c, v.pass) / (gpuMs ?? ms) / 1e6,
        peakBytes: r.peak,
        note: [v.note, batching].filter(Boolean).join('; ') || undefined,
      });
    } catch (e) {
      out.push({ ...base, ms: NaN, all: [], gflops: NaN, note: `failed: ${(e as Error).message}` });
    }
  }
  gpu.free(...inputs);
  return out;
}

/** Why naive attention is not run on this shape (undefined: it is). */
function naiveSkipReason(gpu: Gpu, c: ShapeCase, maxScoreBytes: number): string | undefined {
  const scoreBytes = c.H! * c.N! * c.M! * (gpu.computeDType === 'f16' ? 2 : 4);
  const mib = (b: number) => `${(b / 2 ** 20).toFixed(0)} MiB`;
  if (scoreBytes > gpu.device.limits.maxBufferSize) return `scores of ${mib(scoreBytes)} exceed maxBufferSize ${mib(gpu.device.limits.maxBufferSize)}`;
  if (scoreBytes > maxScoreBytes) return `scores of ${mib(scoreBytes)} exceed --naive-max-mib ${mib(maxScoreBytes)} (too slow to time here)`;
  return undefined;
}

/**
 * Ratios the issue asks for, computed from one set of measurements. `gpuTimes`: compare our GPU
 * (timestamp) times, for peers that report GPU time too (PyTorch's CUDA events); otherwise wall
 * times measured the same way for everyone (the Chromium page).
 */
export function summarise(ms: Measurement[], gpuTimes = false): Record<string, number | string> {
  const time = (m: Measurement) => (gpuTimes ? (m.gpuMs ?? m.ms) : m.ms);
  const get = (id: string, impl: string) => ms.find((m) => m.id === id && m.impl === impl);
  const s: Record<string, number | string> = {};
  for (const id of ['self', 'cross']) {
    const flash = get(id, 'ours (flash) fwd+bwd');
    const naive = get(id, 'naive fwd+bwd');
    if (!flash || !naive) continue;
    if (Number.isFinite(naive.ms)) s[`${id}: naive/flash time (target >= 2)`] = time(naive) / time(flash);
    else s[`${id}: naive/flash time (target >= 2)`] = `not measured (${naive.note ?? 'naive not run'})`;
    if (naive.peakBytes !== undefined && flash.peakBytes !== undefined) s[`${id}: naive/flash peak bytes (target >= 10)`] = naive.peakBytes / flash.peakBytes;
    else if (naive.plannedPeakBytes !== undefined && flash.plannedPeakBytes !== undefined) {
      s[`${id}: naive/flash peak bytes, planned by a dry run (target >= 10)`] = naive.plannedPeakBytes / flash.plannedPeakBytes;
    }
  }
  for (const id of new Set(ms.map((m) => m.id))) {
    const ours = ms.find((m) => m.id === id && (m.impl === 'ours' || m.impl === 'ours (flash)'));
    const peers = ms.filter((m) => m.id === id && !m.impl.startsWith('ours') && !m.impl.startsWith('naive') && Number.isFinite(m.ms));
    if (ours && peers.length) {
      const best = peers.reduce((a, b) => (time(a) < time(b) ? a : b));
      s[`${id}: fastest peer (${best.impl}) time / ours (target >= 1.5)`] = time(best) / time(ours);
      const same = peers.filter((m) => m.dtype === ours.dtype);
      if (same.length && !same.includes(best)) {
        const b = same.reduce((x, y) => (time(x) < time(y) ? x : y));
        s[`${id}: fastest ${ours.dtype} peer (${b.impl}) time / ours`] = time(b) / time(ours);
      }
    }
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
    m.impl,
    m.dtype,
    Number.isFinite(m.ms) ? m.ms.toFixed(2) : '-',
    m.gpuMs !== undefined ? m.gpuMs.toFixed(3) : '',
    Number.isFinite(m.gflops) ? m.gflops.toFixed(1) : '-',
    `${m.all.length || ''}`,
    mib(m.peakBytes),
    mib(m.plannedPeakBytes),
    m.note ?? '',
  ]);
  const head = ['shape', 'impl', 'dtype', 'wall ms', 'GPU ms', 'GFLOP/s', 'reps', 'peak MiB', 'planned MiB', 'note'];
  const w = head.map((h, i) => Math.max(h.length, ...rows.map((r) => r[i].length)));
  const line = (r: string[]) => r.map((c, i) => c.padEnd(w[i])).join('  ');
  return [line(head), line(w.map((x) => '-'.repeat(x))), ...rows.map(line)].join('\n');
}
