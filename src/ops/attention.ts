// Attention: flash attention forward/backward (shaders/attention.wgsl: online softmax, LSE saved,
// backward recomputes P tile by tile; the N x M score matrix never exists), and naive attention
// built from batched matmul + softmax, which materialises it (the benchmark baseline).
import type { Gpu } from '../gpu/device.ts';
import { kernel } from '../gpu/kernel.ts';
import type { Defs } from '../gpu/shaders.ts';
import { fmtShape, ShapeError } from '../gpu/errors.ts';
import { expectSameDType, Tensor } from '../gpu/tensor.ts';
import { scale as scaleOp } from './elementwise.ts';
import { matmul } from './matmul.ts';
import { softmax, softmaxBackward } from './softmax.ts';

export type AttentionLayout = 'bhnd' | 'bnhd';

export interface AttentionOptions {
  /** Defaults to 1/sqrt(D). */
  scale?: number;
  /** 'bhnd': q [B,H,N,D], k/v [B,H,M,D] (default). 'bnhd': q [B,N,H,D], k/v [B,M,H,D]. */
  layout?: AttentionLayout;
  /** Query i attends to keys j <= i only (CLIP's text encoder). Needs M = N. */
  causal?: boolean;
  /**
   * Forward tile shape (tests): an FA-2 tile, or null for the one-row-per-invocation general path.
   * Defaults to fwdTile(D, the device's workgroup memory).
   */
  tile?: FwdTile | null;
  /**
   * Backward (tests): true forces the fused dQ path (scores once; an error where it does not fit),
   * false the separate dQ kernel. Default: fused where workgroup memory and its scratch cap allow.
   */
  fusedDq?: boolean;
}

/** Largest head dim: each invocation keeps a few D-vectors in registers. */
export const MAX_HEAD_DIM = 256;
const BR = 64;

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
 * at most 32 (each invocation keeps BC scores in registers). D40: 32, D64: 28, D80: 24, D160: 12.
 */
function tileRows(D: number): number {
  const fit = Math.floor(16384 / (2 * 16 * Math.ceil(D / 4) + 8));
  return Math.max(4, Math.min(32, fit - (fit % 4)));
}

function shaderDefs(d: Dims, dtype: Tensor['dtype']) {
  return { T: dtype, D: d.D, D4: Math.ceil(d.D / 4), BR, BC: tileRows(d.D), CAUSAL: d.causal };
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
const SPLIT_DIMS = [...DIMS, { name: 'q_split', type: 'u32' }] as const;

const read = (name: string, type = 'T') => ({ name, type, access: 'read' }) as const;
const write = (name: string, type = 'T') => ({ name, type, access: 'read_write' }) as const;

/**
 * FA-2 forward tile: TR x TC invocations; each owns RM query rows x RN key columns of the BR x BC score
 * tile (BR = TR * RM, BC = TC * RN) and RM rows x DC vec4 chunks of O (DC = ceil(D4 / TC)).
 */
export interface FwdTile {
  RM: number;
  RN: number;
  TC: number;
  TR: number;
}

/** Workgroup bytes of the FA-2 forward: Q block, K/V tile (f32 vec4 chunks), P tile, row partials. */
function fwdBytes(t: FwdTile, D4: number): number {
  const BR = t.TR * t.RM;
  const BC = t.TC * t.RN;
  return (BR + BC) * D4 * 16 + BR * BC * 4 + BR * t.TC * 4;
}

/**
 * The FA-2 tile for head dim D under a workgroup-memory limit, or null (then the one-row-per-invocation
 * path runs). TC divides D4 where it can (no idle O chunks: D40 -> 5, D64/D80/D160 -> 4); about 64
 * invocations; 4 x 4 register blocks, halved until the tiles fit.
 */
export function fwdTile(D: number, wgBytes: number): FwdTile | null {
  const D4 = Math.ceil(D / 4);
  const TC = [4, 5, 8, 2].find((t) => D4 % t === 0) ?? Math.min(4, D4);
  const TR = Math.min(16, Math.floor(64 / TC));
  for (const [RM, RN] of [
    [4, 4],
    [4, 2],
    [2, 4],
    [2, 2],
    [1, 2],
    [1, 1],
  ]) {
    const t = { RM, RN, TC, TR };
    if (fwdBytes(t, D4) <= wgBytes) return t;
  }
  return null;
}

const range = (n: number) => Array.from({ length: n }, (_, i) => i);

/**
 * The FA-2 forward entry point, unrolled for one tile shape: every register block (scores a/s/p, O
 * chunks o, prefetched K/V kp/vp) is a separate variable, so nothing is indexed by a loop counter.
 * The loops over the D4 chunks and the BC keys of a tile have constant bounds.
 */
function fwdCode(defs: Defs): string {
  const n = (k: string) => defs[k] as number;
  const [R, J, I, L] = [range(n('RM')), range(n('RN')), range(n('DC')), range(n('KL'))];
  const RJ = R.flatMap((r) => J.map((j) => [r, j]));
  const RI = R.flatMap((r) => I.map((i) => [r, i]));
  const lines = (xs: number[][] | number[], f: (...a: number[]) => string) => xs.map((x) => (Array.isArray(x) ? f(...x) : f(x))).join('\n    ');
  const maxOf = (xs: string[]) => xs.reduce((a, b) => `max(${a}, ${b})`);
  const sumOf = (xs: string[]) => xs.reduce((a, b) => `(${a} + ${b})`);
  return `
@compute @workgroup_size(TR * TC)
fn attn_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let t = task(wid);
  let tr = lid / TC;
  let tc = lid % TC;
  stage_q(t, lid);
  ${lines(
    R,
    (r) => `let lr${r} = tr * RM + ${r}u;
    var m${r} = NEG_BIG;
    var l${r} = 0.0;`,
  )}
  ${lines(RI, (r, i) => `var o${r}_${i} = vec4<f32>(0.0);`)}
  ${lines(
    L,
    (l) => `var kp${l} = load_k(t, 0u, lid + ${l}u * WG);
    var vp${l} = vec4<f32>(0.0);`,
  )}
  let tiles = key_tiles(t.row0);
  for (var ti = 0u; ti < tiles; ti++) {
    let kt = ti * BC;
    // K tile into workgroup memory; this tile's V into registers meanwhile.
    ${lines(
      L,
      (l) => `store_kv(lid + ${l}u * WG, kp${l});
    vp${l} = load_v(t, kt, lid + ${l}u * WG);`,
    )}
    workgroupBarrier();
    // S block = Q rows . K columns (scale folded into Q).
    ${lines(RJ, (r, j) => `var a${r}_${j} = vec4<f32>(0.0);`)}
    for (var c = 0u; c < D4; c++) {
      ${lines(R, (r) => `let q${r} = qs[lr${r} * D4 + c];`)}
      ${lines(J, (j) => `let k${j} = kv[(${j}u * TC + tc) * D4 + c];`)}
      ${lines(RJ, (r, j) => `a${r}_${j} = fma(q${r}, k${j}, a${r}_${j});`)}
    }
    ${lines(RJ, (r, j) => `var s${r}_${j} = hsum(a${r}_${j});`)}
    if (CAUSAL || kt + BC > p.m) {
      ${lines(RJ, (r, j) => `s${r}_${j} = mask_score(s${r}_${j}, t.row0 + lr${r}, kt + ${j}u * TC + tc);`)}
    }
    // Row max across the TC invocations sharing the row; rescale l and O to it.
    ${lines(R, (r) => `red[lr${r} * TC + tc] = ${maxOf(J.map((j) => `s${r}_${j}`))};`)}
    workgroupBarrier();
    ${lines(
      R,
      (r) => `let mn${r} = max(m${r}, row_max(lr${r}));
    let corr${r} = exp(m${r} - mn${r});
    m${r} = mn${r};`,
    )}
    ${lines(
      RJ,
      (r, j) => `let p${r}_${j} = exp(s${r}_${j} - mn${r});
    ps[lr${r} * BC + ${j}u * TC + tc] = p${r}_${j};`,
    )}
    ${lines(R, (r) => `l${r} = l${r} * corr${r} + ${sumOf(J.map((j) => `p${r}_${j}`))};`)}
    ${lines(RI, (r, i) => `o${r}_${i} *= corr${r};`)}
    workgroupBarrier(); // K and the row maxima read, P written
    // V tile into workgroup memory; the next K tile into registers meanwhile.
    ${lines(L, (l) => `store_kv(lid + ${l}u * WG, vp${l});`)}
    if (ti + 1u < tiles) {
      ${lines(L, (l) => `kp${l} = load_k(t, kt + BC, lid + ${l}u * WG);`)}
    }
    workgroupBarrier();
    // O block += P block . V tile.
    for (var j = 0u; j < BC; j++) {
      ${lines(R, (r) => `let pw${r} = vec4<f32>(ps[lr${r} * BC + j]);`)}
      ${lines(I, (i) => `let v${i} = kv[j * D4 + min(${i}u * TC + tc, D4 - 1u)];`)}
      ${lines(RI, (r, i) => `o${r}_${i} = fma(pw${r}, v${i}, o${r}_${i});`)}
    }
    workgroupBarrier();
  }
  // Row sums across the TC invocations, in a fixed order; O = o / l, LSE = m + log l.
  ${lines(R, (r) => `red[lr${r} * TC + tc] = l${r};`)}
  workgroupBarrier();
  ${lines(
    R,
    (r) => `let lt${r} = row_sum(lr${r});
    if (tc == 0u) { store_lse(t, lr${r}, m${r}, lt${r}); }`,
  )}
  ${lines(RI, (r, i) => `store_out(t, lr${r}, ${i}u * TC + tc, o${r}_${i} / lt${r});`)}
}
`;
}

const ATTN_FWD = kernel({
  shader: 'attention',
  entry: 'attn_fwd',
  uniforms: DIMS,
  bindings: [read('q'), read('k'), read('v'), write('out'), write('lse', 'f32')],
  code: fwdCode,
});

/** General forward path (head dims whose FA-2 tiles do not fit): one invocation per query row. */
const ATTN_FWD_ROWS = kernel({
  shader: 'attention',
  entry: 'attn_fwd_rows',
  uniforms: DIMS,
  bindings: [read('q'), read('k'), read('v'), write('out'), write('lse', 'f32')],
});

/** Defs of the FA-2 forward for these dims and tile. */
function fwdDefs(d: Dims, dtype: Tensor['dtype'], t: FwdTile): Defs {
  const D4 = Math.ceil(d.D / 4);
  const WG = t.TR * t.TC;
  const BC = t.TC * t.RN;
  return {
    T: dtype,
    D: d.D,
    D4,
    BR: t.TR * t.RM,
    BC,
    ...t,
    DC: Math.ceil(D4 / t.TC),
    KL: Math.ceil((BC * D4) / WG),
    CAUSAL: d.causal,
  };
}

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

/** FUSED_DQ: per-key-block f32 dQ partials written by the dK/dV kernels (shaders/attention.wgsl dq_partials). */
const DQ_PART = { name: 'dq_part', type: 'vec4<f32>', access: 'read_write', when: 'FUSED_DQ' } as const;

const ATTN_BWD_DKV = kernel({
  shader: 'attention',
  entry: 'attn_bwd_dkv',
  uniforms: DIMS,
  bindings: [...BWD_INPUTS, write('dk'), write('dv'), DQ_PART],
});

const ATTN_BWD_DKV_SPLIT = kernel({
  shader: 'attention',
  entry: 'attn_bwd_dkv_split',
  uniforms: SPLIT_DIMS,
  bindings: [...BWD_INPUTS, write('dk_part', 'f32'), write('dv_part', 'f32'), DQ_PART],
});

const ATTN_BWD_DQ_REDUCE = kernel({
  shader: 'attention',
  entry: 'attn_bwd_dq_reduce',
  uniforms: DIMS,
  bindings: [read('dq_part', 'vec4<f32>'), write('dq')],
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
function querySplit(d: Dims, bc: number): number {
  const workgroups = Math.ceil(d.M / BR) * d.B * d.H;
  const want = Math.ceil(256 / workgroups);
  const splits = Math.max(1, Math.min(want, Math.ceil(d.N / (4 * bc))));
  return Math.ceil(Math.ceil(d.N / splits) / bc) * bc;
}

/** Cap on the fused backward's dQ partials; past it the separate dQ kernel runs. */
const DQ_PARTIALS_MAX_BYTES = 64 * 2 ** 20;

/**
 * Query rows per staged tile of the fused backward (dK/dV kernel that also writes dQ partials), or null
 * when it does not fit: besides the Q and dO tiles it keeps the key block's K (BR x D4 vec4) and the dS
 * tile (BC x BR f32) in workgroup memory, and its partials take ceil(M / BR) x B x H x N x D4 x 16 bytes.
 */
export function fusedDqTileRows(D: number, M: number, rows: number, wgBytes: number, maxBinding: number): number | null {
  const D4 = Math.ceil(D / 4);
  const perRow = 2 * 16 * D4 + 8 + 4 * BR;
  const fit = Math.floor((wgBytes - BR * D4 * 16) / perRow);
  const bc = Math.min(32, fit - (fit % 4));
  const partials = Math.ceil(M / BR) * rows * D4 * 16;
  return bc >= 4 && partials <= Math.min(maxBinding, DQ_PARTIALS_MAX_BYTES) ? bc : null;
}

/** Refuses tensors larger than one storage binding (attention binds whole tensors). */
function checkBindable(gpu: Gpu, op: string, ...ts: Tensor[]): void {
  for (const t of ts) if (!gpu.fitsBinding(t)) throw new ShapeError(op, `${t} is larger than one storage binding (${gpu.maxBinding} bytes); split the batch`);
}

/** Workgroups of BR rows (queries or keys) per (batch, head), times `splits`. */
function rowGroups(d: Dims, rows: number, splits = 1): [number, number, number] {
  return [Math.ceil(rows / BR), d.B * d.H, splits];
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
  const bindings = { q, k, v, out, lse };
  const tile = opts.tile === undefined ? fwdTile(d.D, gpu.device.limits.maxComputeWorkgroupStorageSize) : opts.tile;
  if (tile) {
    const BR = tile.TR * tile.RM;
    gpu.run(ATTN_FWD, { defs: fwdDefs(d, q.dtype, tile), uniforms: uniforms(d), bindings, workgroups: [Math.ceil(d.N / BR), d.B * d.H] });
  } else gpu.run(ATTN_FWD_ROWS, { defs: shaderDefs(d, q.dtype), uniforms: uniforms(d), bindings, workgroups: rowGroups(d, d.N) });
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
  const defs = shaderDefs(d, q.dtype);
  const u = uniforms(d);
  const delta = gpu.tensor([d.B, d.H, d.N], 'f32', 'scratch', 'attention.delta');
  gpu.run(ATTN_BWD_DELTA, { defs, uniforms: u, bindings: { out, dy, delta }, workgroups: rowGroups(d, d.N) });
  const dq = gpu.tensor(q.shape, q.dtype, 'gradients', 'attention.dq');
  const dk = gpu.tensor(k.shape, k.dtype, 'gradients', 'attention.dk');
  const dv = gpu.tensor(v.shape, v.dtype, 'gradients', 'attention.dv');
  const inputs = { q, k, v, dy, lse, delta };
  // Fused: the dK/dV kernel also writes dQ partials from its dS (scores computed once); otherwise the
  // dQ kernel recomputes them.
  const fusedBc = opts.fusedDq === false ? null : fusedDqTileRows(d.D, d.M, d.B * d.H * d.N, gpu.device.limits.maxComputeWorkgroupStorageSize, gpu.maxBinding);
  if (opts.fusedDq === true && fusedBc === null) throw new ShapeError(op, `the fused dQ path does not fit this device for q ${fmtShape(q.shape)}`);
  const bc = fusedBc ?? defs.BC;
  const dkvDefs = { ...defs, BC: bc, FUSED_DQ: fusedBc !== null, KB_LEN: fusedBc ? BR * defs.D4 : 1, DS_LEN: fusedBc ? bc * BR : 1 };
  const dq_part = fusedBc ? gpu.tensor([Math.ceil(d.M / BR) * d.B * d.H * d.N * defs.D4 * 4], 'f32', 'scratch', 'attention.dq-partials') : null;
  const fused: { dq_part?: Tensor } = dq_part ? { dq_part } : {};
  if (!dq_part) gpu.run(ATTN_BWD_DQ, { defs, uniforms: u, bindings: { ...inputs, dq }, workgroups: rowGroups(d, d.N) });
  const qSplit = querySplit(d, bc);
  const splits = Math.ceil(d.N / qSplit);
  if (splits === 1) gpu.run(ATTN_BWD_DKV, { defs: dkvDefs, uniforms: u, bindings: { ...inputs, dk, dv, ...fused }, workgroups: rowGroups(d, d.M) });
  else {
    const part = [splits * d.B * d.H * d.M * d.D];
    const dk_part = gpu.tensor(part, 'f32', 'scratch', 'attention.dk-partials');
    const dv_part = gpu.tensor(part, 'f32', 'scratch', 'attention.dv-partials');
    checkBindable(gpu, op, dk_part);
    const su = { ...u, q_split: qSplit };
    gpu.run(ATTN_BWD_DKV_SPLIT, { defs: dkvDefs, uniforms: su, bindings: { ...inputs, dk_part, dv_part, ...fused }, workgroups: rowGroups(d, d.M, splits) });
    gpu.run(ATTN_BWD_DKV_REDUCE, { defs, uniforms: su, bindings: { dk_part, dv_part, dk, dv }, workgroups: [Math.ceil((d.M * d.D) / BR), d.B * d.H] });
    gpu.free(dk_part, dv_part);
  }
  if (dq_part) {
    gpu.run(ATTN_BWD_DQ_REDUCE, { defs, uniforms: u, bindings: { dq_part, dq }, workgroups: [Math.ceil((d.N * d.D) / BR), d.B * d.H] });
    gpu.free(dq_part);
  }
  gpu.free(delta);
  return { dq, dk, dv };
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
