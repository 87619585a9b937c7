// Per-dispatch GPU timing for Gpu.startProfile/stopProfile (device.ts): a query set with one timestamp pair per
// dispatch, resolved into a read-back at each submit, the times summed by kernel (`${shader}.${entry}`) and then
// by op family (the shader file).

/** GPU time of the profiled dispatches, by op family (shader file) and by kernel (shader.entry). */
export interface GpuProfile {
  byFamily: Record<string, { ms: number; dispatches: number }>;
  byKernel: Record<string, { ms: number; dispatches: number }>;
  totalMs: number;
}

/** State of a profiling window: one timestamp pair per dispatch, resolved at each submit. */
export interface Profiling {
  querySet: GPUQuerySet;
  /** Timestamp pairs the query set holds. */
  capacity: number;
  /** `${shader}.${entry}` of each dispatch recorded since the last submit, in query-pair order. */
  kernels: string[];
  /** Read-backs of submitted query results, accumulating into `totals`. */
  pending: Promise<void>[];
  totals: Map<string, { ms: number; dispatches: number }>;
}

/** Timestamp pairs per query set while profiling (the query-set size limit is 4096 queries). */
const PROFILE_PAIRS = 2048;

/** A new profiling window on `device`. */
export function startProfiling(device: GPUDevice): Profiling {
  const querySet = device.createQuerySet({ type: 'timestamp', count: PROFILE_PAIRS * 2 });
  return { querySet, capacity: PROFILE_PAIRS, kernels: [], pending: [], totals: new Map() };
}

/** The window's totals, longest kernel first, and summed by family (the kernel name up to its first dot). */
export function profileSummary(prof: Profiling): GpuProfile {
  const byFamily: GpuProfile['byFamily'] = {};
  const byKernel: GpuProfile['byKernel'] = {};
  let totalMs = 0;
  for (const [kernel, t] of [...prof.totals].sort((a, b) => b[1].ms - a[1].ms)) {
    byKernel[kernel] = { ...t };
    const family = kernel.slice(0, kernel.indexOf('.'));
    const f = (byFamily[family] ??= { ms: 0, dispatches: 0 });
    f.ms += t.ms;
    f.dispatches += t.dispatches;
    totalMs += t.ms;
  }
  return { byFamily, byKernel, totalMs };
}

/**
 * Before a submit: resolves the recording's timestamps (two buffers made: the resolve target and its staging
 * copy) and returns what to call after the submit: a read-back that adds each pair's nanoseconds to the totals.
 */
export function resolveTimestamps(device: GPUDevice, encoder: GPUCommandEncoder, prof: Profiling): () => void {
  const kernels = prof.kernels.splice(0);
  const bytes = kernels.length * 16;
  const resolved = device.createBuffer({ size: bytes, usage: GPUBufferUsage.QUERY_RESOLVE | GPUBufferUsage.COPY_SRC });
  const staging = device.createBuffer({ size: bytes, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
  encoder.resolveQuerySet(prof.querySet, 0, kernels.length * 2, resolved, 0);
  encoder.copyBufferToBuffer(resolved, 0, staging, 0, bytes);
  return () => {
    prof.pending.push(
      staging.mapAsync(GPUMapMode.READ).then(() => {
        const ticks = new BigUint64Array(staging.getMappedRange());
        kernels.forEach((kernel, i) => {
          const t = prof.totals.get(kernel) ?? { ms: 0, dispatches: 0 };
          t.ms += Number(ticks[2 * i + 1] - ticks[2 * i]) / 1e6;
          t.dispatches++;
          prof.totals.set(kernel, t);
        });
        staging.unmap();
        staging.destroy();
        resolved.destroy();
      }),
    );
  };
}
