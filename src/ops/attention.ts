// Attention: flash attention forward/backward (shaders/attention.wgsl: online softmax, LSE saved,
// backward recomputes P tile by tile; the N x M score matrix never exists), and naive attention
// built from batched matmul + softmax, which materialises it (the benchmark baseline).
//
// Kernels (the AttentionKernelChoice fields; each defaults per device):
//   forward  'tiled': FlashAttention-2 (a block of 64 query rows per workgroup, score and output tiles as
//            register matmuls, row max/sum across each row's invocations by subgroup shuffles where present,
//            constant loop bounds with masking, the next K/V tile prefetched on GPUs) where its tiles fit the
//            device's workgroup memory, on GPUs; 'rows': one query row per invocation (CPU adapters, where it
//            measured faster, and devices whose workgroup memory fits no tile).
//   backward 'tiled': FlashAttention-2's backward as two register-tiled kernels (shaders/attention_bwd.wgsl):
//            dK/dV parallel over key blocks with K and V resident in workgroup memory, dQ parallel over query
//            blocks with Q and dO resident; no scratch, no reduce pass. On GPUs for self-attention (keys at
//            least half the queries), where a tile fits.
//            'fused': one kernel per key block computes S, P, dP and dS once per (query, key) and yields dK,
//            dV and the block's share of dQ (f32 scratch, summed in block order by a second kernel, bounded
//            by running slices of b*heads), on GPUs; 'separate': a dQ kernel and a dK/dV kernel that each
//            recompute S and dP (CPU adapters, where it measured faster, and where even one b*head's dQ
//            scratch would not fit the budget).
import type { Gpu } from '../gpu/device.ts';
import { kernel, read, write } from '../gpu/kernel.ts';
import { fmtShape, ShapeError } from '../gpu/errors.ts';
import { BYTES, expectSameDType, Tensor, type DType } from '../gpu/tensor.ts';
import { scale as scaleOp } from './elementwise.ts';
import { matmul } from './matmul.ts';
import { prefetchRefusal } from './tiles.ts';
import { softmax, softmaxBackward } from './softmax.ts';

export type AttentionLayout = 'bhnd' | 'bnhd';

export interface AttentionOptions {
  /** Defaults to 1/sqrt(D). */
  scale?: number;
  /** 'bhnd': q [B,H,N,D], k/v [B,H,M,D] (default). 'bnhd': q [B,N,H,D], k/v [B,M,H,D]. */
  layout?: AttentionLayout;
  /** Query i attends to keys j <= i only (CLIP's text encoder). Needs M = N. */
  causal?: boolean;
  /** Pins kernel choices (tests and benchmarks); each field left out takes the device's default. */
  kernels?: AttentionKernelChoice;
}

/** Kernel choices of flash attention. */
export interface AttentionKernelChoice {
  /**
   * 'tiled' (FlashAttention-2; 'rows' where its tiles do not fit) or 'rows' (a query row per invocation). Default:
   * tiled on GPUs, rows on CPU adapters, where register tiles hide no latency and the tiled kernel's barriers cost:
   * bench:kernels --quick measured it at 0.38-0.52x the row kernel on SwiftShader, 0.99-1.07x on lavapipe.
   */
  forward?: 'tiled' | 'rows';
  /** Row reductions of the tiled forward by subgroup shuffles, where the adapter's subgroups are wide enough. */
  subgroups?: boolean;
  /** The tiled forward loads the next K/V tile into registers before this tile's math (default on GPUs). */
  prefetch?: boolean;
  /**
   * 'tiled' (register-tiled dK/dV and dQ kernels; 'fused' where no tile fits), 'fused' ('separate' where one
   * b*head's dQ scratch exceeds the budget) or 'separate'. Default on GPUs: tiled where the keys are at least half
   * as many as the queries (self-attention: no dQ scratch, which at SD 1.5's 4096 tokens would be 32x q per b*head,
   * and no reduce pass), fused elsewhere (cross-attention's 77 keys: the fused kernel splits the queries, where
   * the tiled dK/dV kernel would have 2 key blocks per b*head to run in parallel);
   * separate on CPU adapters, where the fused kernel's dQ hand-over through workgroup memory (a barrier per
   * query tile and key chunk) costs more than computing S and dP twice: on lavapipe at the small-f4 UNet's
   * shapes (batch 8, 4 heads) the separate kernels took 101-117 ms against 128-150 at 256 tokens D8, 36-40
   * against 55-65 for 256 x 77 cross-attention, and the same at 64 tokens D16.
   */
  backward?: 'fused' | 'separate' | 'tiled';
  /**
   * Bytes of dQ scratch the fused backward may hold at once (at most one storage binding). Default: twice the
   * bytes of q, at most 128 MiB, so the fused kernel never costs much memory: it runs where the keys are few
   * (cross-attention's 77: 2 key blocks), and long self-attention (4096 keys: 64 blocks, 32x q per b*head)
   * takes the separate kernels, which need no scratch.
   */
  dqScratchBytes?: number;
}

/** Largest head dim: each invocation keeps a few D-vectors in registers. */
export const MAX_HEAD_DIM = 256;
const BR = 64;

/** The sizes that choose kernels. */
export type Sizes = Pick<Dims, 'B' | 'H' | 'N' | 'M' | 'D'>;

interface Dims {
  B: number;
  H: number;
  N: number;
  M: number;
  D: number;
  scale: number;
  layout: AttentionLayout;
  causal: boolean;
}

function dims(op: string, q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions): Dims {
  const layout = opts.layout ?? 'bhnd';
  for (const [name, t] of [
    ['q', q],
    ['k', k],
    ['v', v],
  ] as const)
    if (t.shape.length !== 4) throw new ShapeError(op, `${name} must be rank 4 (${layout === 'bhnd' ? '[B,H,N,D]' : '[B,N,H,D]'}), got ${fmtShape(t.shape)}`);
  expectSameDType(op, q, k, v);
  const [B, a, b, D] = q.shape;
  const [N, H] = layout === 'bhnd' ? [b, a] : [a, b];
  const M = layout === 'bhnd' ? k.shape[2] : k.shape[1];
  const kh = layout === 'bhnd' ? k.shape[1] : k.shape[2];
  const all = `q ${fmtShape(q.shape)}, k ${fmtShape(k.shape)}, v ${fmtShape(v.shape)}`;
  if (k.shape[0] !== B || kh !== H || k.shape[3] !== D) throw new ShapeError(op, `k does not match q in batch, heads or head dim (layout ${layout}): ${all}`);
  if (v.shape.some((d, i) => d !== k.shape[i])) throw new ShapeError(op, `v must have k's shape: ${all}`);
  if (D < 1 || D > MAX_HEAD_DIM) throw new ShapeError(op, `head dim ${D} is not supported (1..${MAX_HEAD_DIM}): ${all}`);
  if (N === 0 || M === 0) throw new ShapeError(op, `empty attention: ${all}`);
  const causal = opts.causal ?? false;
  if (causal && M !== N) throw new ShapeError(op, `causal attention needs as many keys as queries: ${all}`);
  return { B, H, N, M, D, scale: opts.scale ?? 1 / Math.sqrt(D), layout, causal };
}

/**
 * Rows staged per tile (keys in the forward and dQ, queries in dK/dV): two tiles of D4 vec4<f32>
 * per row plus (LSE, Delta) must fit Chrome's default 16 KiB of workgroup memory; a multiple of 4,
 * at most 32. D40: 32, D64: 28, D80: 24, D160: 12.
 */
function tileRows(D: number): number {
  const fit = Math.floor(16384 / (2 * 16 * Math.ceil(D / 4) + 8));
  return Math.max(4, Math.min(32, fit - (fit % 4)));
}

function shaderDefs(d: Dims, dtype: Tensor['dtype']) {
  return { T: dtype, D: d.D, D4: Math.ceil(d.D / 4), BR, BC: tileRows(d.D), CAUSAL: d.causal };
}

/** The tiled forward's shape: 64 query rows per workgroup on a 16 x 8 grid of invocations. */
const FWD_BQ = 64;
const FWD_TR = 16;
const FWD_TC = 8;
/** Vec4 chunks of head dim per Q staging step when Q is not resident. */
const FWD_KC = 4;

export interface ForwardTiling {
  /** Keys per tile. */
  BK: number;
  /** Head-dim vec4 chunks per row in workgroup memory (D4 rounded up to a multiple of the grid's TC). */
  D4S: number;
  /** Q chunks staged per step: D4S when Q stays resident for the whole key loop. */
  KC: number;
  /** Row reductions by subgroup shuffles. */
  subgroups: boolean;
  prefetch: boolean;
  /** Workgroup memory the kernel declares. */
  bytes: number;
}

/**
 * The tiled forward's tiles for head dim D on this device, or null where none fits its workgroup memory: Q
 * resident with 32 then 16 keys per tile, then Q staged in 16-dim chunks with 32, 16 or 8 keys. The row-max
 * exchange needs BQ x TC floats unless subgroups of at least TC lanes do it.
 */
export function forwardTiling(gpu: Gpu, D: number, choice: AttentionKernelChoice = {}): ForwardTiling | null {
  const limit = gpu.facts.maxWorkgroupStorage;
  const subgroups = (choice.subgroups ?? true) && gpu.facts.subgroups && gpu.facts.subgroupMinSize >= FWD_TC;
  const prefetch = (choice.prefetch ?? !gpu.facts.software) && !prefetchRefusal(gpu);
  const D4S = Math.ceil(Math.ceil(D / 4) / FWD_TC) * FWD_TC;
  const options: [boolean, number][] = [
    [true, 32],
    [true, 16],
    [false, 32],
    [false, 16],
    [false, 8],
  ];
  for (const [resident, BK] of options) {
    const KC = resident ? D4S : FWD_KC;
    // Q, K/V and P tiles with rows padded by one (bank conflicts), and the row-max exchange.
    const bytes = FWD_BQ * (KC + 1) * 16 + 2 * BK * (D4S + 1) * 16 + FWD_BQ * (BK + 1) * 4 + (subgroups ? 0 : FWD_BQ * FWD_TC * 4);
    if (bytes <= limit) return { BK, D4S, KC, subgroups, prefetch, bytes };
  }
  return null;
}

function forwardDefs(d: Dims, dtype: Tensor['dtype'], t: ForwardTiling) {
  const { BK, D4S, KC } = t;
  return { T: dtype, D: d.D, D4: Math.ceil(d.D / 4), BQ: FWD_BQ, BK, TR: FWD_TR, TC: FWD_TC, D4S, KC, CAUSAL: d.causal, PREFETCH: t.prefetch };
}

/** Scaled key-row chunks the fused backward stages per dQ step. */
const BWD_KQ = 4;

/**
 * Query rows per tile of the fused backward: the dK/dV kernel's two tiles and (LSE, Delta), plus the dS tile
 * (BR + 1 floats per row), beside the KQ-chunk key tile must fit the device's workgroup memory; 0 where none does.
 */
function fusedTileRows(gpu: Gpu, D: number): number {
  const free = gpu.facts.maxWorkgroupStorage - BR * BWD_KQ * 16;
  const fit = Math.floor(free / (2 * 16 * Math.ceil(D / 4) + 8 + 4 * (BR + 1)));
  return fit < 4 ? 0 : Math.min(32, fit - (fit % 4));
}

/** The uniforms every attention kernel takes: sizes, scale and the strides of both layouts. */
const DIMS = [
  { name: 'heads', type: 'u32' },
  { name: 'n', type: 'u32' },
  { name: 'm', type: 'u32' },
  { name: 'scale', type: 'f32' },
  { name: 'q_sb', type: 'u32' },
  { name: 'q_sh', type: 'u32' },
  { name: 'q_sn', type: 'u32' },
  { name: 'k_sb', type: 'u32' },
  { name: 'k_sh', type: 'u32' },
  { name: 'k_sn', type: 'u32' },
] as const;
const SPLIT_DIMS = [...DIMS, { name: 'q_split', type: 'u32' }, { name: 'bh0', type: 'u32' }] as const;
/** The fused backward's: its dispatch covers b*heads bh0 on. */
const FUSED_DIMS = [...DIMS, { name: 'bh0', type: 'u32' }] as const;

const ATTN_FWD = kernel({
  shader: 'attention',
  entry: 'attn_fwd',
  uniforms: DIMS,
  bindings: [read('q'), read('k'), read('v'), write('out'), write('lse', 'f32')],
});

const FWD_BINDINGS = [read('q'), read('k'), read('v'), write('out'), write('lse', 'f32')] as const;
const ATTN_FWD_TILED = kernel({ shader: 'attention', entry: 'attn_fwd_tiled', uniforms: DIMS, bindings: FWD_BINDINGS });
const ATTN_FWD_TILED_SG = kernel({ shader: 'attention', entry: 'attn_fwd_tiled_sg', uniforms: DIMS, bindings: FWD_BINDINGS });

const ATTN_BWD_DELTA = kernel({
  shader: 'attention',
  entry: 'attn_bwd_delta',
  uniforms: DIMS,
  bindings: [read('out'), read('dy'), write('delta', 'f32')],
});

/** What the dQ and dK/dV kernels read: the inputs, dO, and the per-row LSE and Delta. */
const BWD_INPUTS = [read('q'), read('k'), read('v'), read('dy'), read('lse', 'f32'), read('delta', 'f32')] as const;

const ATTN_BWD_DQ = kernel({
  shader: 'attention',
  entry: 'attn_bwd_dq',
  uniforms: DIMS,
  bindings: [...BWD_INPUTS, write('dq')],
});

const ATTN_BWD_DKV = kernel({
  shader: 'attention',
  entry: 'attn_bwd_dkv',
  uniforms: DIMS,
  bindings: [...BWD_INPUTS, write('dk'), write('dv')],
});

const ATTN_BWD_DKV_SPLIT = kernel({
  shader: 'attention',
  entry: 'attn_bwd_dkv_split',
  uniforms: SPLIT_DIMS,
  bindings: [...BWD_INPUTS, write('dk_part', 'f32'), write('dv_part', 'f32')],
});

const ATTN_BWD_FUSED = kernel({
  shader: 'attention',
  entry: 'attn_bwd_fused',
  uniforms: FUSED_DIMS,
  bindings: [...BWD_INPUTS, write('dk'), write('dv'), write('dq_part', 'f32')],
});

const ATTN_BWD_FUSED_SPLIT = kernel({
  shader: 'attention',
  entry: 'attn_bwd_fused_split',
  uniforms: SPLIT_DIMS,
  bindings: [...BWD_INPUTS, write('dk_part', 'f32'), write('dv_part', 'f32'), write('dq_part', 'f32')],
});

const ATTN_BWD_DKV_TILED = kernel({
  shader: 'attention_bwd',
  entry: 'attn_bwd_dkv_tiled',
  uniforms: DIMS,
  bindings: [...BWD_INPUTS, write('dk'), write('dv')],
});

const ATTN_BWD_DQ_TILED = kernel({
  shader: 'attention_bwd',
  entry: 'attn_bwd_dq_tiled',
  uniforms: DIMS,
  bindings: [...BWD_INPUTS, write('dq')],
});

const ATTN_BWD_DQ_REDUCE = kernel({
  shader: 'attention',
  entry: 'attn_bwd_dq_reduce',
  uniforms: FUSED_DIMS,
  bindings: [read('dq_part', 'f32'), write('dq')],
});

const ATTN_BWD_DKV_REDUCE = kernel({
  shader: 'attention',
  entry: 'attn_bwd_dkv_reduce',
  uniforms: SPLIT_DIMS,
  bindings: [read('dk_part', 'f32'), read('dv_part', 'f32'), write('dk'), write('dv')],
});

function uniforms(d: Dims) {
  const { H, N, M, D } = d;
  const [q_sb, q_sh, q_sn] = d.layout === 'bhnd' ? [H * N * D, N * D, D] : [N * H * D, D, H * D];
  const [k_sb, k_sh, k_sn] = d.layout === 'bhnd' ? [H * M * D, M * D, D] : [M * H * D, D, H * D];
  return { heads: H, n: N, m: M, scale: d.scale, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn };
}

/**
 * Query rows per split of the dK/dV kernel. With few keys (cross-attention to 77 tokens) one
 * workgroup per 64 keys leaves the GPU idle, so the query rows are split and partial sums reduced;
 * with many keys (self-attention) there is one split.
 */
function querySplit(d: Sizes, bc: number, bhCount = d.B * d.H): number {
  const workgroups = Math.ceil(d.M / BR) * bhCount;
  const want = Math.ceil(256 / workgroups);
  const splits = Math.max(1, Math.min(want, Math.ceil(d.N / (4 * bc))));
  return Math.ceil(Math.ceil(d.N / splits) / bc) * bc;
}

/** Refuses tensors larger than one storage binding (attention binds whole tensors). */
function checkBindable(gpu: Gpu, op: string, ...ts: Tensor[]): void {
  for (const t of ts) if (!gpu.fitsBinding(t)) throw new ShapeError(op, `${t} is larger than one storage binding (${gpu.maxBinding} bytes); split the batch`);
}

/** Workgroups of BR rows (queries or keys) per (batch, head), times `splits`. */
function rowGroups(d: Dims, rows: number, splits = 1, bhCount = d.B * d.H): [number, number, number] {
  return [Math.ceil(rows / BR), bhCount, splits];
}

export interface FlashResult {
  out: Tensor;
  /** f32 [B, H, N]: log-sum-exp of each query row's scaled scores. */
  lse: Tensor;
}

/** softmax(scale q k^T) v without materialising the scores; saves LSE for the backward. */
export function flashAttention(gpu: Gpu, q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions = {}): FlashResult {
  const d = dims('flashAttention', q, k, v, opts);
  const out = gpu.tensor(q.shape, q.dtype, 'activations', 'attention.out');
  const lse = gpu.tensor([d.B, d.H, d.N], 'f32', 'activations', 'attention.lse');
  checkBindable(gpu, 'flashAttention', q, k, v, out);
  const tiling = attentionPlan(gpu, d, opts.kernels, q.dtype).forward;
  const bindings = { q, k, v, out, lse };
  if (tiling) {
    const decl = tiling.subgroups ? ATTN_FWD_TILED_SG : ATTN_FWD_TILED;
    gpu.run(decl, { defs: forwardDefs(d, q.dtype, tiling), uniforms: uniforms(d), bindings, workgroups: [Math.ceil(d.N / FWD_BQ), d.B * d.H] });
  } else gpu.run(ATTN_FWD, { defs: shaderDefs(d, q.dtype), uniforms: uniforms(d), bindings, workgroups: rowGroups(d, d.N) });
  return { out, lse };
}

export interface AttentionGrads {
  dq: Tensor;
  dk: Tensor;
  dv: Tensor;
}

/** Gradients of flash attention from the saved out and LSE; recomputes P tile by tile. */
export function flashAttentionBackward(
  gpu: Gpu,
  q: Tensor,
  k: Tensor,
  v: Tensor,
  out: Tensor,
  lse: Tensor,
  dy: Tensor,
  opts: AttentionOptions = {},
): AttentionGrads {
  const op = 'flashAttentionBackward';
  const d = dims(op, q, k, v, opts);
  expectSameDType(op, q, out, dy);
  for (const [name, t] of [
    ['out', out],
    ['dy', dy],
  ] as const)
    if (t.shape.some((x, i) => x !== q.shape[i]) || t.shape.length !== 4)
      throw new ShapeError(op, `${name} ${fmtShape(t.shape)} must have q's shape ${fmtShape(q.shape)}`);
  if (lse.numel !== d.B * d.H * d.N || lse.dtype !== 'f32')
    throw new ShapeError(op, `lse must be f32 [${d.B},${d.H},${d.N}], got ${lse.dtype} ${fmtShape(lse.shape)}`);
  checkBindable(gpu, op, q, k, v, out, dy);
  const u = uniforms(d);
  const delta = gpu.tensor([d.B, d.H, d.N], 'f32', 'scratch', 'attention.delta');
  gpu.run(ATTN_BWD_DELTA, { defs: shaderDefs(d, q.dtype), uniforms: u, bindings: { out, dy, delta }, workgroups: rowGroups(d, d.N) });
  const grads: AttentionGrads = {
    dq: gpu.tensor(q.shape, q.dtype, 'gradients', 'attention.dq'),
    dk: gpu.tensor(k.shape, k.dtype, 'gradients', 'attention.dk'),
    dv: gpu.tensor(v.shape, v.dtype, 'gradients', 'attention.dv'),
  };
  const inputs = { q, k, v, dy, lse, delta };
  const plan = attentionPlan(gpu, d, opts.kernels, q.dtype);
  if (plan.tiledBackward) tiledBackward(gpu, d, q.dtype, plan.tiledBackward, inputs, grads);
  else if (plan.backward) fusedBackward(gpu, d, q.dtype, plan.backward, inputs, grads);
  else separateBackward(gpu, d, q.dtype, inputs, grads);
  gpu.free(delta);
  return grads;
}

interface BackwardInputs {
  q: Tensor;
  k: Tensor;
  v: Tensor;
  dy: Tensor;
  lse: Tensor;
  delta: Tensor;
}

/** How the fused backward runs: query rows per tile, b*heads per dispatch (bounding the dQ scratch), query splits. */
export interface FusedPlan {
  BC: number;
  bhPerDispatch: number;
  /** Query rows per split of a dispatch's dK/dV (all N: one split). */
  qSplit: number;
  /** dQ-part bytes of one b*head: key blocks x N x D f32. */
  bytesPerBh: number;
}

const DQ_SCRATCH_MAX = 128 << 20;

/** The fused backward's plan for these sizes on this device, or null: the separate kernels run. */
export function fusedPlan(gpu: Gpu, d: Sizes, choice: AttentionKernelChoice = {}, dtype: DType = 'f32'): FusedPlan | null {
  if ((choice.backward ?? (gpu.facts.software ? 'separate' : 'fused')) !== 'fused') return null;
  const BC = fusedTileRows(gpu, d.D);
  if (!BC) return null;
  const bytesPerBh = Math.ceil(d.M / BR) * d.N * d.D * 4;
  const budget = Math.min(choice.dqScratchBytes ?? Math.min(DQ_SCRATCH_MAX, 2 * d.B * d.H * d.N * d.D * BYTES[dtype]), gpu.maxBinding);
  let bhPerDispatch = Math.min(d.B * d.H, Math.floor(budget / bytesPerBh));
  if (bhPerDispatch < 1) return null;
  // The query-split dK/dV partials of a dispatch (splits x its b*heads x M x D f32) must fit one binding too.
  for (;;) {
    const qSplit = querySplit(d, BC, bhPerDispatch);
    const splits = Math.ceil(d.N / qSplit);
    if (splits === 1 || splits * bhPerDispatch * d.M * d.D * 4 <= gpu.maxBinding) return { BC, bhPerDispatch, qSplit, bytesPerBh };
    if (bhPerDispatch === 1) return null;
    bhPerDispatch = Math.ceil(bhPerDispatch / 2);
  }
}

/** The register-tiled backward's grid: TR x TC invocations, each owning BQ / TR resident rows. */
const BWD_TR = 16;
const BWD_TC = 8;

/** Tiles of the register-tiled backward (attention_bwd.wgsl): the same for its dK/dV and dQ kernels. */
export interface BackwardTiling {
  /** Resident rows per workgroup: keys (dK/dV) or queries (dQ). */
  BQ: number;
  /** Streamed rows per tile: queries (dK/dV) or keys (dQ). */
  BS: number;
  /** Workgroup memory the kernels declare. */
  bytes: number;
}

/**
 * The register-tiled backward's tiles for head dim D on this device, or null where none fits: 64 resident rows
 * (4 per invocation) with 16- then 8-row streamed tiles, then 32 and 16 resident rows. Resident and streamed
 * rows are two tiles each of D4 + 1 vec4 (one chunk of padding against bank conflicts), beside P and dS
 * (BQ x (BS + 1) floats each) and the streamed rows' (LSE, Delta). On 48 KiB: D40 64 x 16, D80 32 x 16, D160
 * 16 x 8.
 */
export function backwardTiling(gpu: Gpu, D: number): BackwardTiling | null {
  const RS = Math.ceil(D / 4) + 1;
  for (const [BQ, BS] of [
    [64, 16],
    [64, 8],
    [32, 16],
    [32, 8],
    [16, 8],
  ]) {
    const bytes = 2 * (BQ + BS) * RS * 16 + 2 * BQ * (BS + 1) * 4 + BS * 8;
    if (bytes <= gpu.facts.maxWorkgroupStorage) return { BQ, BS, bytes };
  }
  return null;
}

/** Which kernels flashAttention and its backward run for these sizes on this device. */
export interface AttentionPlan {
  /** The tiled forward's tiles, or null: the one-row-per-invocation forward. */
  forward: ForwardTiling | null;
  /** The fused backward's plan, or null: the tiled or the separate dQ and dK/dV kernels. */
  backward: FusedPlan | null;
  /** The register-tiled backward's tiles, or null: the fused or the separate kernels. */
  tiledBackward: BackwardTiling | null;
}

export function attentionPlan(gpu: Gpu, d: Sizes, choice: AttentionKernelChoice = {}, dtype: DType = 'f32'): AttentionPlan {
  const forward = choice.forward ?? (gpu.facts.software ? 'rows' : 'tiled');
  const mode = choice.backward ?? (gpu.facts.software ? 'separate' : undefined);
  const fused = fusedPlan(gpu, d, { ...choice, backward: mode === 'separate' ? 'separate' : 'fused' }, dtype);
  // By default the tiled kernels run self-attention; with few keys and many queries (cross-attention) their dK/dV
  // grid (key blocks x b*heads) would leave most of the GPU idle where the fused kernel splits the queries.
  const wantTiled = mode === 'tiled' || (mode === undefined && 2 * d.M >= d.N);
  const tiledBackward = wantTiled ? backwardTiling(gpu, d.D) : null;
  return {
    forward: forward === 'tiled' ? forwardTiling(gpu, d.D, choice) : null,
    backward: tiledBackward ? null : fused,
    tiledBackward,
  };
}

/** dK, dV and dQ parts from one kernel per slice of b*heads, then the parts summed into dQ. */
function fusedBackward(gpu: Gpu, d: Dims, dtype: Tensor['dtype'], plan: FusedPlan, inputs: BackwardInputs, g: AttentionGrads): void {
  const defs = { ...shaderDefs(d, dtype), BC: plan.BC, KQ: BWD_KQ };
  const u = uniforms(d);
  const { qSplit } = plan;
  const splits = Math.ceil(d.N / qSplit);
  const { dq, dk, dv } = g;
  for (let bh0 = 0; bh0 < d.B * d.H; bh0 += plan.bhPerDispatch) {
    const count = Math.min(plan.bhPerDispatch, d.B * d.H - bh0);
    const dq_part = gpu.tensor([Math.ceil(d.M / BR) * count * d.N * d.D], 'f32', 'scratch', 'attention.dq-parts');
    const fu = { ...u, bh0 };
    if (splits === 1) gpu.run(ATTN_BWD_FUSED, { defs, uniforms: fu, bindings: { ...inputs, dk, dv, dq_part }, workgroups: rowGroups(d, d.M, 1, count) });
    else {
      const part = [splits * count * d.M * d.D];
      const dk_part = gpu.tensor(part, 'f32', 'scratch', 'attention.dk-partials');
      const dv_part = gpu.tensor(part, 'f32', 'scratch', 'attention.dv-partials');
      const su = { ...fu, q_split: qSplit };
      gpu.run(ATTN_BWD_FUSED_SPLIT, { defs, uniforms: su, bindings: { ...inputs, dk_part, dv_part, dq_part }, workgroups: rowGroups(d, d.M, splits, count) });
      gpu.run(ATTN_BWD_DKV_REDUCE, { defs, uniforms: su, bindings: { dk_part, dv_part, dk, dv }, workgroups: [Math.ceil((d.M * d.D) / BR), count] });
      gpu.free(dk_part, dv_part);
    }
    gpu.run(ATTN_BWD_DQ_REDUCE, { defs, uniforms: fu, bindings: { dq_part, dq }, workgroups: [Math.ceil((d.N * d.D) / BR), count] });
    gpu.free(dq_part);
  }
}

/** dK/dV from one kernel over key blocks and dQ from another over query blocks, each register-tiled. */
function tiledBackward(gpu: Gpu, d: Dims, dtype: Tensor['dtype'], t: BackwardTiling, inputs: BackwardInputs, g: AttentionGrads): void {
  const defs = { T: dtype, D: d.D, D4: Math.ceil(d.D / 4), BQ: t.BQ, BS: t.BS, TR: BWD_TR, TC: BWD_TC, CAUSAL: d.causal };
  const u = uniforms(d);
  gpu.run(ATTN_BWD_DKV_TILED, { defs, uniforms: u, bindings: { ...inputs, dk: g.dk, dv: g.dv }, workgroups: [Math.ceil(d.M / t.BQ), d.B * d.H] });
  gpu.run(ATTN_BWD_DQ_TILED, { defs, uniforms: u, bindings: { ...inputs, dq: g.dq }, workgroups: [Math.ceil(d.N / t.BQ), d.B * d.H] });
}

/** dQ from one kernel (over key tiles) and dK, dV from another (over query tiles): each recomputes S and dP. */
function separateBackward(gpu: Gpu, d: Dims, dtype: Tensor['dtype'], inputs: BackwardInputs, g: AttentionGrads): void {
  const defs = shaderDefs(d, dtype);
  const u = uniforms(d);
  const { dq, dk, dv } = g;
  gpu.run(ATTN_BWD_DQ, { defs, uniforms: u, bindings: { ...inputs, dq }, workgroups: rowGroups(d, d.N) });
  const qSplit = querySplit(d, tileRows(d.D));
  const splits = Math.ceil(d.N / qSplit);
  if (splits === 1) gpu.run(ATTN_BWD_DKV, { defs, uniforms: u, bindings: { ...inputs, dk, dv }, workgroups: rowGroups(d, d.M) });
  else {
    const part = [splits * d.B * d.H * d.M * d.D];
    const dk_part = gpu.tensor(part, 'f32', 'scratch', 'attention.dk-partials');
    const dv_part = gpu.tensor(part, 'f32', 'scratch', 'attention.dv-partials');
    checkBindable(gpu, 'flashAttentionBackward', dk_part);
    const su = { ...u, q_split: qSplit, bh0: 0 };
    gpu.run(ATTN_BWD_DKV_SPLIT, { defs, uniforms: su, bindings: { ...inputs, dk_part, dv_part }, workgroups: rowGroups(d, d.M, splits) });
    gpu.run(ATTN_BWD_DKV_REDUCE, { defs, uniforms: su, bindings: { dk_part, dv_part, dk, dv }, workgroups: [Math.ceil((d.M * d.D) / BR), d.B * d.H] });
    gpu.free(dk_part, dv_part);
  }
}

// ---- naive attention (materialised scores) --------------------------------------------------------

export interface NaiveResult {
  out: Tensor;
  /** [B*H, N, M] softmax probabilities. */
  probs: Tensor;
}

function naiveDims(op: string, q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions): Dims {
  const d = dims(op, q, k, v, opts);
  if (d.layout !== 'bhnd') throw new ShapeError(op, `naive attention takes layout 'bhnd' only, got '${d.layout}' for q ${fmtShape(q.shape)}`);
  if (d.causal) throw new ShapeError(op, 'naive attention (the benchmark baseline) has no causal mask');
  return d;
}

/** P = softmax(scale q k^T) as a full [B*H, N, M] tensor, out = P v. */
export function naiveAttention(gpu: Gpu, q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions = {}): NaiveResult {
  const d = naiveDims('naiveAttention', q, k, v, opts);
  const q3 = q.reshape([d.B * d.H, d.N, d.D]);
  const k3 = k.reshape([d.B * d.H, d.M, d.D]);
  const v3 = v.reshape([d.B * d.H, d.M, d.D]);
  const raw = matmul(gpu, q3, k3, { transB: true });
  const scores = scaleOp(gpu, raw, d.scale);
  gpu.free(raw);
  const probs = softmax(gpu, scores);
  gpu.free(scores);
  const out = matmul(gpu, probs, v3).reshape(q.shape);
  return { out, probs };
}

/** Gradients of naive attention from the saved probabilities. */
export function naiveAttentionBackward(gpu: Gpu, q: Tensor, k: Tensor, v: Tensor, probs: Tensor, dy: Tensor, opts: AttentionOptions = {}): AttentionGrads {
  const op = 'naiveAttentionBackward';
  const d = naiveDims(op, q, k, v, opts);
  const q3 = q.reshape([d.B * d.H, d.N, d.D]);
  const k3 = k.reshape([d.B * d.H, d.M, d.D]);
  const v3 = v.reshape([d.B * d.H, d.M, d.D]);
  const dy3 = dy.reshape([d.B * d.H, d.N, d.D]);
  const dv = matmul(gpu, probs, dy3, { transA: true }); // P^T dy
  const dp = matmul(gpu, dy3, v3, { transB: true }); // dy V^T
  const dsRaw = softmaxBackward(gpu, probs, dp);
  gpu.free(dp);
  const ds = scaleOp(gpu, dsRaw, d.scale);
  gpu.free(dsRaw);
  const dq = matmul(gpu, ds, k3); // scale dS K
  const dk = matmul(gpu, ds, q3, { transA: true }); // scale dS^T Q
  gpu.free(ds);
  return { dq: dq.reshape(q.shape), dk: dk.reshape(k.shape), dv: dv.reshape(v.shape) };
}

// ---- plain-TS reference (float64) -------------------------------------------------------------------

export interface AttentionRefResult {
  out: Float32Array;
  lse: Float32Array;
  dq: Float32Array;
  dk: Float32Array;
  dv: Float32Array;
}

/** Forward and (given dy) backward of attention in float64, any layout. */
export function attentionRef(
  q: ArrayLike<number>,
  k: ArrayLike<number>,
  v: ArrayLike<number>,
  dy: ArrayLike<number> | null,
  s: { B: number; H: number; N: number; M: number; D: number; scale?: number; layout?: AttentionLayout; causal?: boolean },
): AttentionRefResult {
  const { B, H, N, M, D } = s;
  const scale = s.scale ?? 1 / Math.sqrt(D);
  const bhnd = (s.layout ?? 'bhnd') === 'bhnd';
  const qi = (b: number, h: number, n: number) => (bhnd ? ((b * H + h) * N + n) * D : ((b * N + n) * H + h) * D);
  const ki = (b: number, h: number, m: number) => (bhnd ? ((b * H + h) * M + m) * D : ((b * M + m) * H + h) * D);
  const out = new Float32Array(B * H * N * D);
  const lse = new Float32Array(B * H * N);
  const dq = new Float32Array(out.length);
  const dk = new Float32Array(B * H * M * D);
  const dv = new Float32Array(dk.length);
  const p = new Float64Array(M);
  for (let b = 0; b < B; b++)
    for (let h = 0; h < H; h++)
      for (let n = 0; n < N; n++) {
        let mx = -Infinity;
        for (let m = 0; m < M; m++) {
          let acc = 0;
          for (let x = 0; x < D; x++) acc += q[qi(b, h, n) + x] * k[ki(b, h, m) + x];
          p[m] = s.causal && m > n ? -Infinity : acc * scale;
          mx = Math.max(mx, p[m]);
        }
        let sum = 0;
        for (let m = 0; m < M; m++) sum += Math.exp(p[m] - mx);
        lse[(b * H + h) * N + n] = mx + Math.log(sum);
        for (let m = 0; m < M; m++) p[m] = Math.exp(p[m] - mx) / sum;
        for (let x = 0; x < D; x++) {
          let acc = 0;
          for (let m = 0; m < M; m++) acc += p[m] * v[ki(b, h, m) + x];
          out[qi(b, h, n) + x] = acc;
        }
        if (!dy) continue;
        let delta = 0;
        for (let x = 0; x < D; x++) delta += dy[qi(b, h, n) + x] * out[qi(b, h, n) + x];
        for (let m = 0; m < M; m++) {
          let dp = 0;
          for (let x = 0; x < D; x++) dp += dy[qi(b, h, n) + x] * v[ki(b, h, m) + x];
          const ds = p[m] * (dp - delta) * scale;
          for (let x = 0; x < D; x++) {
            dq[qi(b, h, n) + x] += ds * k[ki(b, h, m) + x];
            dk[ki(b, h, m) + x] += ds * q[qi(b, h, n) + x];
            dv[ki(b, h, m) + x] += p[m] * dy[qi(b, h, n) + x];
          }
        }
      }
  return { out, lse, dq, dk, dv };
}
