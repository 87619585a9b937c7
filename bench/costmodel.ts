// A cost model of GPU time per recorded dispatch (bench/census-record.ts), calibrated on the one training step ever
// profiled on hardware (bench/results/step-nvidia-h200.json, commit 2756811). Every figure it gives is MODELLED.
//
// Per dispatch, from what the census recorded (kernel, defs, grid, workgroup size, uniforms, bound bytes):
//   work        FLOPs (2 per multiply-add of the GEMM and attention kernels; other kernels count none), serial
//               k-steps per workgroup, serialised global-load groups per k-step per invocation (without prefetch an
//               invocation stages its units one after another: load, store, next; with PREFETCH one group per step),
//               and the FMAs each invocation does in sequence;
//   latency     waves x (k-steps x load groups x L + serial FMAs / clock), waves = workgroups over what the SMs
//               hold at once (by threads, workgroup memory and the per-SM workgroup cap);
//   throughput  FLOPs / the family's rate in isolation (bench/results/kernels-node-nvidia-h200.json), bytes bound /
//               bandwidth;
//   time        floor + max(latency, throughput): `floor` is what one dispatch costs in the profile (each in its own
//               timestamped compute pass) beside its work.
// L and floor are fitted (least worst relative error over the profile's conv2d, matmul, attention and other ms);
// the hardware facts are data (HARDWARE) and the rates are measured.
import type { CountedDispatch } from './census-record.ts';
import { EPILOGUE } from '../src/ops/gemm.ts';

/** Facts of a GPU the model needs, in one place. */
export interface Hardware {
  name: string;
  sms: number;
  threadsPerSm: number;
  workgroupsPerSm: number;
  sharedBytesPerSm: number;
  clockHz: number;
  bandwidthBytesPerS: number;
  /** FLOP/s each family reached in isolation at SD 1.5 shapes (f16 storage, f32 math), measured. */
  rates: Record<'conv2d' | 'matmul' | 'attention', number>;
  source: string;
}

/**
 * NVIDIA H200 SXM (Hopper GH100): 132 SMs, 2048 threads and 32 blocks per SM, 228 KiB shared memory per SM, 1.98 GHz
 * boost, HBM3e 4.8 TB/s (NVIDIA's data sheet). Rates from kernels-node-nvidia-h200.json (f16): conv 3x3 320->320 at
 * 64x64 7.55 GFLOP in 0.481 ms = 15.7 TFLOP/s; matmul the mean of the three linears (4096x320x320 17.2, 4096x320x2560
 * 24.7, 4096x1280x320 18.3) = 20.1; flash attention 8x4096x4096 d40 forward 21.5 GFLOP in 1.895 ms = 11.3.
 */
export const H200: Hardware = {
  name: 'nvidia-h200',
  sms: 132,
  threadsPerSm: 2048,
  workgroupsPerSm: 32,
  sharedBytesPerSm: 228 * 1024,
  clockHz: 1.98e9,
  bandwidthBytesPerS: 4.8e12,
  rates: { conv2d: 15.7e12, matmul: 20.1e12, attention: 11.3e12 },
  source:
    'NVIDIA H200 data sheet (SMs, clock, HBM3e bandwidth), Hopper tuning guide (per-SM limits); rates measured in bench/results/kernels-node-nvidia-h200.json',
};

export const HARDWARE: Readonly<Record<string, Hardware>> = { 'nvidia-h200': H200 };

export type Family = 'conv2d' | 'matmul' | 'attention' | 'other';
export const FAMILIES: readonly Family[] = ['conv2d', 'matmul', 'attention', 'other'];

/** What one dispatch does, from its record. */
export interface Work {
  family: Family;
  kernel: string;
  flops: number;
  workgroups: number;
  threads: number;
  kSteps: number;
  loadGroups: number;
  serialFmas: number;
  /**
   * Whether the kernel keeps per-invocation arrays indexed by loop counters (the attention kernels' q, o, score
   * rows): such arrays live in local memory, so each of its serial FMAs costs ModelParams.arrayFmaCycles; the GEMM
   * cores (src/ops/gemm.ts) name every register and issue about one FMA per cycle.
   */
  arrays: boolean;
  sharedBytes: number;
  bytesRead: number;
  bytesWritten: number;
  /** A GEMM or attention core (the kernels the tensor-core sheet and the latency term are about). */
  core: boolean;
}

export interface ModelParams {
  /** Seconds per serialised global-load group of one k-step (latency). */
  loadLatencyS: number;
  /** Seconds every k-step costs beside its loads (the barrier and the round trip its first load waits for). */
  stepLatencyS: number;
  /** Seconds each profiled dispatch costs beside its work. */
  floorS: number;
  /** Cycles per serial FMA of a kernel whose per-invocation arrays sit in local memory (Work.arrays). */
  arrayFmaCycles: number;
  /** Host seconds per dispatch (encoding), measured on the H200 at 2756811: 101.5 ms / 3587 dispatches. */
  hostPerDispatchS: number;
  /**
   * A warm step's GPU wait over the profiled step's summed dispatch times, measured at 2756811: 408.6 / 896.2 ms
   * (the profile puts every dispatch in its own timestamped pass; a warm step records a few passes and the GPU
   * runs while the host encodes). modelled step = host + GPU x this.
   */
  warmOverProfiled: number;
}

const num = (v: unknown, what: string): number => {
  if (typeof v !== 'number') throw new Error(`costmodel: ${what} is not a number (${String(v)})`);
  return v;
};

/** The family of a shader file: attention's kernels span attention.wgsl and attention_bwd.wgsl. */
function familyOf(shader: string): Family {
  if (shader.startsWith('attention')) return 'attention';
  return shader === 'conv2d' || shader === 'matmul' ? shader : 'other';
}

/** The k-split uniform where the kernel has one (split-K came after 2756811: absent there means 1). */
const splitsOf = (u: Record<string, number>) => u.k_splits ?? 1;

function gemmWork(d: CountedDispatch, base: Work): Work {
  const u = d.uniforms;
  const [M, N, K] = d.shader === 'conv2d' ? [u.GM, u.GN, u.GK] : [u.M, u.N, u.K];
  const splits = splitsOf(u);
  const batches = d.workgroups[2] / splits;
  const kRange = splits > 1 ? Math.min(K, u.k_chunk) : K;
  const tc = d.entry.endsWith('_tc');
  const flops = 2 * M * N * K * batches;
  if (tc) {
    const BM = num(d.defs.TC_BM, 'TC_BM');
    const BN = num(d.defs.TC_BN, 'TC_BN');
    const BK = 32;
    const threads = base.threads;
    const loadGroups = Math.ceil(((BM / 4) * BK) / threads) + Math.ceil((BK * (BN / 4)) / threads);
    const sharedBytes = 2 * (BM * (BK + 8) + BK * (BN + 8)) + 4 * threads * 8;
    return { ...base, flops, kSteps: Math.ceil(kRange / BK), loadGroups, serialFmas: 0, sharedBytes, core: true };
  }
  const [BM, BN, BK, TM, TN] = ['BM', 'BN', 'BK', 'TM', 'TN'].map((k) => num(d.defs[k], k));
  const threads = (BM / TM) * (BN / TN);
  const units = (x: 'A' | 'B') => {
    const quads = d.defs[`${x}_QUADS`] === true;
    const groups = (x === 'A' ? BM : BN) / 4;
    return quads ? { n: groups * (BK / 4), regs: 4 } : { n: groups * BK, regs: 1 };
  };
  const perThread = (x: 'A' | 'B') => Math.ceil(units(x).n / threads) * units(x).regs;
  const direct = d.defs.DIRECT === true;
  const loadGroups = d.defs.PREFETCH === true ? 1 : direct ? 2 : perThread('A') + perThread('B');
  return {
    ...base,
    flops,
    kSteps: Math.ceil(kRange / BK),
    loadGroups,
    serialFmas: TM * TN * kRange,
    sharedBytes: direct ? 0 : 4 * (BM + BN) * BK,
    core: true,
  };
}

/** Attention kernels: FLOPs as the math they do (flash backward recomputes S), serial steps over key/query tiles. */
function attentionWork(d: CountedDispatch, base: Work): Work {
  const u = d.uniforms;
  const D = num(d.defs.D, 'D');
  const D4 = Math.ceil(D / 4);
  const bh = d.workgroups[1];
  const n = u.n;
  const m = u.m;
  const e = d.entry;
  const rowTile = typeof d.defs.BC === 'number' ? d.defs.BC : 32;
  const rows = (count: number, tile: number, perRow: number, loads: number) => ({
    kSteps: Math.ceil(count / tile),
    serialFmas: perRow * count * D,
    loadGroups: Math.ceil((tile * D4 * loads) / base.threads),
  });
  let flops: number;
  let s: { kSteps: number; serialFmas: number; loadGroups: number };
  if (e === 'attn_fwd') [flops, s] = [4 * n * m * D * bh, rows(m, rowTile, 2, 2)];
  else if (e.startsWith('attn_fwd_tiled')) {
    const BK = num(d.defs.BK, 'BK');
    flops = 4 * n * m * D * bh;
    const perWg = 4 * num(d.defs.BQ, 'BQ') * m * D;
    s = { kSteps: Math.ceil(m / BK), serialFmas: perWg / 2 / base.threads, loadGroups: d.defs.PREFETCH === true ? 1 : Math.ceil((BK * D4 * 2) / base.threads) };
  } else if (e === 'attn_bwd_dq_tiled' || e === 'attn_bwd_dkv_tiled') {
    // Register-tiled as the tiled forward: BQ resident rows per workgroup walk the other side in tiles of BS,
    // each step loading BS rows of two tensors; the invocations share the workgroup's FMAs evenly. dQ: S, dP and
    // dS K (6 n m D); dK/dV: S, dP, dS^T Q and P^T dO (8 n m D).
    const dkv = e === 'attn_bwd_dkv_tiled';
    const streamed = dkv ? n : m;
    const perRow = dkv ? 8 : 6;
    const BS = num(d.defs.BS, 'BS');
    const BQ = num(d.defs.BQ, 'BQ');
    const sharedBytes = 2 * (BQ + BS) * (D4 + 1) * 16 + 2 * BQ * (BS + 1) * 4 + BS * 8; // as src/ops/attention.ts backwardTiling
    const loadGroups = Math.ceil((BS * D4 * 2) / base.threads);
    const serialFmas = (perRow * BQ * streamed * D) / 2 / base.threads;
    return { ...base, flops: perRow * n * m * D * bh, kSteps: Math.ceil(streamed / BS), serialFmas, loadGroups, arrays: true, sharedBytes, core: true };
  } else if (e === 'attn_bwd_dq') [flops, s] = [6 * n * m * D * bh, rows(m, rowTile, 3, 2)];
  else if (e === 'attn_bwd_dkv' || e === 'attn_bwd_dkv_split') {
    const span = e.endsWith('split') ? u.q_split : n;
    [flops, s] = [8 * n * m * D * bh, rows(span, rowTile, 4, 2)];
  } else if (e === 'attn_bwd_fused' || e === 'attn_bwd_fused_split') {
    const span = e.endsWith('split') ? u.q_split : n;
    [flops, s] = [10 * n * m * D * bh, rows(span, rowTile, 5, 2)];
  } else return base; // delta, reductions: memory kernels
  return { ...base, flops, ...s, arrays: true, sharedBytes: 16384, core: true };
}

/** The work of one recorded dispatch. */
export function workOf(d: CountedDispatch): Work {
  const threads = d.workgroupSize[0] * d.workgroupSize[1] * d.workgroupSize[2];
  // the GEMMs say so in their epilogue uniform (src/ops/gemm.ts EPILOGUE), the other kernels in a def
  const epilogue = d.uniforms.epilogue;
  const accumulate = d.defs.ACCUMULATE === true || (epilogue !== undefined && (epilogue & EPILOGUE.accumulate) !== 0);
  let bytesRead = 0;
  let bytesWritten = 0;
  for (const b of d.bindings) {
    // a GEMM without a bias binds a stand-in its epilogue never reads
    if (b.name === 'bias' && epilogue !== undefined && (epilogue & EPILOGUE.bias) === 0) continue;
    if (b.access === 'read') bytesRead += b.bytes;
    else {
      bytesWritten += b.bytes;
      if (accumulate) bytesRead += b.bytes;
    }
  }
  const base: Work = {
    family: familyOf(d.shader),
    kernel: `${d.shader}.${d.entry}`,
    flops: 0,
    workgroups: d.workgroups[0] * d.workgroups[1] * d.workgroups[2],
    threads,
    kSteps: 1,
    loadGroups: 0,
    serialFmas: 0,
    arrays: false,
    sharedBytes: 0,
    bytesRead,
    bytesWritten,
    core: false,
  };
  if (['matmul.matmul', 'matmul.matmul_tc', 'conv2d.conv_gemm', 'conv2d.conv_gemm_tc'].includes(base.kernel)) return gemmWork(d, base);
  if (base.family === 'attention') return attentionWork(d, base);
  return base;
}

/** Workgroups the GPU holds at once for this kernel. */
export function residentWorkgroups(hw: Hardware, w: Work): number {
  const warps = Math.ceil(w.threads / 32);
  const byThreads = Math.floor(hw.threadsPerSm / (warps * 32));
  const byShared = w.sharedBytes > 0 ? Math.floor(hw.sharedBytesPerSm / w.sharedBytes) : hw.workgroupsPerSm;
  return hw.sms * Math.max(1, Math.min(hw.workgroupsPerSm, byThreads, byShared));
}

/** Modelled seconds of one dispatch, and which term bound it. */
export function dispatchSeconds(hw: Hardware, p: ModelParams, w: Work): { s: number; bound: 'latency' | 'compute' | 'memory' } {
  const waves = Math.ceil(w.workgroups / residentWorkgroups(hw, w));
  const fmaCycles = w.arrays ? p.arrayFmaCycles : 1;
  const perStep = w.loadGroups > 0 ? p.stepLatencyS + w.loadGroups * p.loadLatencyS : 0;
  const latency = waves * (w.kSteps * perStep + (w.serialFmas * fmaCycles) / hw.clockHz);
  const compute = w.family === 'other' || w.flops === 0 ? 0 : w.flops / hw.rates[w.family as 'conv2d' | 'matmul' | 'attention'];
  const memory = (w.bytesRead + w.bytesWritten) / hw.bandwidthBytesPerS;
  const top = Math.max(latency, compute, memory);
  return { s: p.floorS + top, bound: top === latency ? 'latency' : top === compute ? 'compute' : 'memory' };
}

export interface ModelledStep {
  dispatches: number;
  flops: number;
  gpuMs: number;
  byFamily: Record<Family, { ms: number; dispatches: number; flops: number }>;
}

export function modelStep(hw: Hardware, p: ModelParams, kernels: CountedDispatch[]): ModelledStep {
  return modelWorks(
    hw,
    p,
    kernels.map((d) => ({ w: workOf(d), count: d.count })),
  );
}

function modelWorks(hw: Hardware, p: ModelParams, works: { w: Work; count: number }[]): ModelledStep {
  const byFamily = Object.fromEntries(FAMILIES.map((f) => [f, { ms: 0, dispatches: 0, flops: 0 }])) as ModelledStep['byFamily'];
  let dispatches = 0;
  let flops = 0;
  let gpuMs = 0;
  for (const { w, count } of works) {
    const ms = dispatchSeconds(hw, p, w).s * 1000 * count;
    const f = byFamily[w.family];
    f.ms += ms;
    f.dispatches += count;
    f.flops += w.flops * count;
    dispatches += count;
    flops += w.flops * count;
    gpuMs += ms;
  }
  return { dispatches, flops, gpuMs, byFamily };
}

/** The profile the model is calibrated on: GPU ms and dispatches by family at 2756811 (step-nvidia-h200.json). */
export interface MeasuredProfile {
  commit: string;
  families: Record<Family, { ms: number; dispatches: number }>;
  stepS: number;
  hostMs: number;
  waitMs: number;
  profiledTotalMs: number;
  dispatches: number;
}

/** step-nvidia-h200.json's sd15-lora case as a MeasuredProfile (other = every family but the three). */
export function measuredProfile(json: { cases: Record<string, unknown>[] }, commit: string): MeasuredProfile {
  const c = json.cases.find((x) => x.name === 'sd15-lora');
  if (!c) throw new Error('step-nvidia-h200.json has no sd15-lora case');
  const ms = c.gpu_ms_by_family as Record<string, number>;
  const n = c.gpu_dispatches_by_family as Record<string, number>;
  const families = Object.fromEntries(FAMILIES.map((f) => [f, { ms: 0, dispatches: 0 }])) as MeasuredProfile['families'];
  for (const [k, v] of Object.entries(ms)) {
    const f = familyOf(k);
    families[f].ms += v;
    families[f].dispatches += n[k];
  }
  return {
    commit,
    families,
    stepS: num(c.ours_s, 'ours_s'),
    hostMs: num(c.host_ms, 'host_ms'),
    waitMs: num(c.wait_ms, 'wait_ms'),
    profiledTotalMs: num(c.gpu_ms_total, 'gpu_ms_total'),
    dispatches: num(c.dispatches, 'dispatches'),
  };
}

/** A profile and the census of the kernel choices it ran. */
export interface Calibration {
  kernels: CountedDispatch[];
  measured: MeasuredProfile;
}

/**
 * Fits the model to measured profiles (the first is the reference: its host and warm-step ratios are taken): the
 * floor on `other` (its kernels are mostly floor), then the k-step and load latencies by a grid search: among the
 * fits that put the reference's conv2d and matmul within 10 %, the one with the smallest worst error on the other
 * profiles' conv2d and matmul; then the array-FMA cost on the first profile's
 * attention (the one family whose kernels keep arrays; a second profile's attention ran the same kernels).
 */
export function calibrate(hw: Hardware, sets: Calibration[]): { params: ModelParams; steps: ModelledStep[]; worst: number } {
  const ref = sets[0].measured;
  const fixed = { hostPerDispatchS: ref.hostMs / 1000 / ref.dispatches, warmOverProfiled: ref.waitMs / ref.profiledTotalMs };
  const works = sets.map((c) => c.kernels.map((d) => ({ w: workOf(d), count: d.count })));
  const err = (i: number, step: ModelledStep, f: Family) => Math.abs(step.byFamily[f].ms / sets[i].measured.families[f].ms - 1);
  let params: ModelParams = { loadLatencyS: 0, stepLatencyS: 0, floorS: 0, arrayFmaCycles: 1, ...fixed };
  const search = (values: (p: ModelParams) => ModelParams[], objective: (steps: ModelledStep[]) => number) => {
    let best = { p: params, e: Infinity };
    for (const p of values(params)) {
      const e = objective(works.map((w) => modelWorks(hw, p, w)));
      if (e < best.e) best = { p, e };
    }
    params = best.p;
  };
  const range = (lo: number, hi: number, step: number) => Array.from({ length: Math.round((hi - lo) / step) + 1 }, (_, i) => lo + i * step);
  search(
    (p) => range(0, 40e-6, 0.25e-6).map((floorS) => ({ ...p, floorS })),
    (steps) => err(0, steps[0], 'other'),
  );
  search(
    (p) => range(0.05e-6, 1.5e-6, 0.01e-6).flatMap((loadLatencyS) => range(0, 20e-6, 0.25e-6).map((stepLatencyS) => ({ ...p, loadLatencyS, stepLatencyS }))),
    // the reference profile within 10 % first; among those fits, the smallest worst error on the others
    (steps) => {
      const ref = Math.max(err(0, steps[0], 'conv2d'), err(0, steps[0], 'matmul'));
      if (steps.length === 1 || ref > 0.1) return ref > 0.1 ? 10 + ref : ref;
      return Math.max(...steps.slice(1).flatMap((s, i) => [err(i + 1, s, 'conv2d'), err(i + 1, s, 'matmul')]));
    },
  );
  search(
    (p) => range(1, 400, 1).map((arrayFmaCycles) => ({ ...p, arrayFmaCycles })),
    (steps) => err(0, steps[0], 'attention'),
  );
  const steps = works.map((w) => modelWorks(hw, params, w));
  const worst = Math.max(...(['conv2d', 'matmul', 'attention'] as const).map((f) => err(0, steps[0], f)));
  return { params, steps, worst };
}
