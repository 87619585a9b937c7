// GroupNorm and LayerNorm: forward saves mean/rstd (f32), backward gives dx and the f32 parameter
// gradients. Both run the "segment norm" kernels of shaders/norm.wgsl (see the math there).
import type { Gpu } from '../gpu/device.ts';
import { kernel } from '../gpu/kernel.ts';
import { fmtShape, ShapeError } from '../gpu/errors.ts';
import { BYTES, expectSameDType, Tensor } from '../gpu/tensor.ts';

const WG = 256;

/**
 * Lanes per segment (shaders/norm.wgsl LANES): a power of two from 1 to WG, a uniform, so every choice runs the
 * same pipeline. On software adapters (gpu.facts.software: lavapipe, SwiftShader) workgroup barriers and idle lanes
 * cost far more than the arithmetic of a short segment, so a segment gets one lane per CPU_LANE_ELEMS elements
 * (rounded up to a power of two; bench/norm.ts measured 1 lane best up to ~1000 elements). On GPUs (not measured
 * here) a segment gets one lane per element up to WG: the lanes the old one-workgroup-per-segment kernel left
 * idle only added zeros in its tree, so its results are bit-identical to that kernel's for every length.
 * Segments of more than 256 * 1024 elements get WG lanes on both: again the old kernel's sums, bit for bit.
 */
const CPU_LANE_ELEMS = 1024;

/** Lanes for a walk of `n` elements per slot (segment length, or a channel's element count). */
export function normLanes(n: number, software: boolean): number {
  if (lanesOverride !== null) return lanesOverride;
  const perLane = software ? CPU_LANE_ELEMS : 1;
  let lanes = 1;
  while (lanes < WG && lanes * perLane < n) lanes *= 2;
  return lanes;
}

let lanesOverride: number | null = null;

/** Tests and benchmarks: run every norm kernel with this many lanes per slot (null: normLanes's choice). */
export function setNormLanes(lanes: number | null): void {
  if (lanes !== null && !(Number.isInteger(lanes) && lanes >= 1 && lanes <= WG && (lanes & (lanes - 1)) === 0))
    throw new Error(`setNormLanes: lanes must be a power of two from 1 to ${WG}, got ${lanes}`);
  lanesOverride = lanes;
}

/** Workgroups for `slots` segments or channels at `lanes` lanes each. */
function slotGrid(gpu: Gpu, slots: number, lanes: number): [number, number] {
  return gpu.grid(Math.ceil(slots / (WG / lanes)));
}

/** How a norm sees its input: segments of cpg*inner contiguous elements, `groups` per sample. */
interface Layout {
  segs: number;
  cpg: number;
  inner: number;
  groups: number;
  channels: number;
}

export interface NormSaved {
  mean: Tensor;
  rstd: Tensor;
}

export interface NormGrads {
  dx: Tensor;
  /** f32 [C] */
  dgamma: Tensor;
  /** f32 [C] */
  dbeta: Tensor;
}

/** Where a norm backward writes dx: into this tensor, adding to what it holds when `accumulate` (NORM_BWD_INPUT ACCUMULATE). */
export interface NormInto {
  dx: Tensor;
  accumulate: boolean;
}

/** Which halves of a norm backward to run: the input gradient, the parameter gradients. */
export interface NormParts {
  dx: boolean;
  params: boolean;
}

function groupLayout(op: string, x: Tensor, groups: number): Layout {
  if (x.shape.length < 2) throw new ShapeError(op, `x must be [N,C,...], got ${fmtShape(x.shape)}`);
  const [n, c] = x.shape;
  if (c % groups !== 0) throw new ShapeError(op, `channels ${c} of x ${fmtShape(x.shape)} are not divisible by ${groups} groups`);
  const inner = x.shape.slice(2).reduce((a, b) => a * b, 1);
  return { segs: n * groups, cpg: c / groups, inner, groups, channels: c };
}

function layerLayout(op: string, x: Tensor): Layout {
  if (x.shape.length < 1) throw new ShapeError(op, `x must have a last dim, got ${fmtShape(x.shape)}`);
  const d = x.shape[x.shape.length - 1];
  return { segs: x.numel / d, cpg: d, inner: 1, groups: 1, channels: d };
}

function checkAffine(op: string, x: Tensor, gamma: Tensor, beta: Tensor, channels: number): void {
  expectSameDType(op, x, gamma, beta);
  for (const [name, t] of [
    ['gamma', gamma],
    ['beta', beta],
  ] as const)
    if (t.numel !== channels || t.shape.length !== 1)
      throw new ShapeError(op, `${name} must be [${channels}] for x ${fmtShape(x.shape)}, got ${fmtShape(t.shape)}`);
}

const SEGMENTS = [
  { name: 'seg_len', type: 'u32' },
  { name: 'cpg', type: 'u32' },
  { name: 'inner', type: 'u32' },
  { name: 'groups', type: 'u32' },
  { name: 'seg_offset', type: 'u32' },
  { name: 'n_segs', type: 'u32' },
  { name: 'lanes', type: 'u32' },
] as const;

const NORM_FWD = kernel({
  shader: 'norm',
  entry: 'norm_fwd',
  uniforms: [...SEGMENTS, { name: 'eps', type: 'f32' }],
  bindings: [
    { name: 'x', type: 'T', access: 'read' },
    { name: 'gamma', type: 'T', access: 'read' },
    { name: 'beta', type: 'T', access: 'read' },
    { name: 'y', type: 'T', access: 'read_write' },
    { name: 'mean', type: 'f32', access: 'read_write' },
    { name: 'rstd', type: 'f32', access: 'read_write' },
  ],
});

const NORM_BWD_INPUT = kernel({
  shader: 'norm',
  entry: 'norm_bwd_input',
  uniforms: SEGMENTS,
  bindings: [
    { name: 'x', type: 'T', access: 'read' },
    { name: 'gamma', type: 'T', access: 'read' },
    { name: 'beta', type: 'T', access: 'read', when: 'SILU' },
    { name: 'dy', type: 'T', access: 'read' },
    { name: 'dx', type: 'T', access: 'read_write' },
    { name: 'mean', type: 'f32', access: 'read' },
    { name: 'rstd', type: 'f32', access: 'read' },
  ],
});

const NORM_BWD_PARAMS = kernel({
  shader: 'norm',
  entry: 'norm_bwd_params',
  uniforms: [...SEGMENTS, { name: 'accumulate', type: 'u32' }],
  bindings: [
    { name: 'x', type: 'T', access: 'read' },
    { name: 'gamma', type: 'T', access: 'read', when: 'SILU' },
    { name: 'beta', type: 'T', access: 'read', when: 'SILU' },
    { name: 'dy', type: 'T', access: 'read' },
    { name: 'dgamma', type: 'f32', access: 'read_write' },
    { name: 'dbeta', type: 'f32', access: 'read_write' },
    { name: 'mean', type: 'f32', access: 'read' },
    { name: 'rstd', type: 'f32', access: 'read' },
  ],
});

/** The segment-layout uniforms every norm kernel takes. */
function segments(l: Layout, segOffset: number, nSegs: number, lanes: number) {
  return { seg_len: l.cpg * l.inner, cpg: l.cpg, inner: l.inner, groups: l.groups, seg_offset: segOffset, n_segs: nSegs, lanes };
}

/** `silu`: the output is silu(norm(x)) (shaders/norm.wgsl SILU). */
function normForward(gpu: Gpu, op: string, x: Tensor, gamma: Tensor, beta: Tensor, eps: number, l: Layout, silu = false): { y: Tensor } & NormSaved {
  checkAffine(op, x, gamma, beta, l.channels);
  const y = gpu.tensor(x.shape, x.dtype, 'activations', op);
  const mean = gpu.tensor([l.segs], 'f32', 'activations', `${op}.mean`);
  const rstd = gpu.tensor([l.segs], 'f32', 'activations', `${op}.rstd`);
  const segBytes = l.cpg * l.inner * BYTES[x.dtype];
  for (const { start, count } of gpu.chunks(l.segs, segBytes)) {
    const xw = gpu.subWindow(x, start, count, segBytes);
    const lanes = normLanes(l.cpg * l.inner, gpu.facts.software);
    gpu.run(NORM_FWD, {
      defs: { T: x.dtype, WG, SILU: silu },
      uniforms: { ...segments(l, start, count, lanes), eps },
      bindings: { x: xw, gamma, beta, y: gpu.subWindow(y, start, count, segBytes), mean, rstd },
      workgroups: slotGrid(gpu, count, lanes),
    });
  }
  return { y, mean, rstd };
}

function normBackward(
  gpu: Gpu,
  op: string,
  x: Tensor,
  gamma: Tensor,
  saved: NormSaved,
  dy: Tensor,
  l: Layout,
  accumulate: boolean,
  grads?: { dgamma: Tensor; dbeta: Tensor },
  parts: NormParts = { dx: true, params: true },
  siluBeta: Tensor | null = null,
  into?: NormInto,
): Partial<NormGrads> {
  expectSameDType(op, x, gamma, dy);
  // With siluBeta, dy is the gradient of silu(norm(x)) (the kernels form the norm output's, shaders/norm.wgsl SILU).
  const silu = siluBeta !== null;
  const act = silu ? { beta: siluBeta } : {};
  if (dy.numel !== x.numel) throw new ShapeError(op, `dy ${fmtShape(dy.shape)} does not match x ${fmtShape(x.shape)}`);
  if (into && (into.dx.dtype !== x.dtype || into.dx.numel !== x.numel))
    throw new ShapeError(op, `dx to write into ${fmtShape(into.dx.shape)} ${into.dx.dtype} does not match x ${fmtShape(x.shape)} ${x.dtype}`);
  const dx = parts.dx ? (into?.dx ?? gpu.tensor(x.shape, x.dtype, 'gradients', `${op}.dx`)) : undefined;
  const dgamma = parts.params ? (grads?.dgamma ?? gpu.tensor([l.channels], 'f32', 'gradients', `${op}.dgamma`)) : undefined;
  const dbeta = parts.params ? (grads?.dbeta ?? gpu.tensor([l.channels], 'f32', 'gradients', `${op}.dbeta`)) : undefined;
  const segBytes = l.cpg * l.inner * BYTES[x.dtype];
  gpu.chunks(l.segs, segBytes).forEach(({ start, count }, i) => {
    const win = (t: Tensor) => gpu.subWindow(t, start, count, segBytes);
    const lanes = normLanes(l.cpg * l.inner, gpu.facts.software);
    if (dx)
      gpu.run(NORM_BWD_INPUT, {
        defs: { T: x.dtype, WG, SILU: silu, ACCUMULATE: !!into?.accumulate },
        uniforms: segments(l, start, count, lanes),
        bindings: { x: win(x), gamma, ...act, dy: win(dy), dx: win(dx), mean: saved.mean, rstd: saved.rstd },
        workgroups: slotGrid(gpu, count, lanes),
      });
    if (!dgamma || !dbeta) return;
    // A channel's elements in this dispatch: inner per segment of its group.
    const paramLanes = normLanes(Math.ceil(count / l.groups) * l.inner, gpu.facts.software);
    gpu.run(NORM_BWD_PARAMS, {
      defs: { T: x.dtype, WG, SILU: silu },
      uniforms: { ...segments(l, start, count, paramLanes), accumulate: accumulate || i > 0 ? 1 : 0 },
      bindings: { x: win(x), ...(silu ? { gamma, ...act } : {}), dy: win(dy), dgamma, dbeta, mean: saved.mean, rstd: saved.rstd },
      workgroups: slotGrid(gpu, l.channels, paramLanes),
    });
  });
  return { dx, dgamma, dbeta };
}

/** GroupNorm over NCHW (or [N,C,...]) with `groups` groups, affine. */
export function groupNorm(gpu: Gpu, x: Tensor, gamma: Tensor, beta: Tensor, groups = 32, eps = 1e-5): { y: Tensor } & NormSaved {
  return normForward(gpu, 'groupNorm', x, gamma, beta, eps, groupLayout('groupNorm', x, groups));
}

/** Backward of groupNorm. `accumulate` adds into the given f32 dgamma/dbeta. */
export function groupNormBackward(
  gpu: Gpu,
  x: Tensor,
  gamma: Tensor,
  saved: NormSaved,
  dy: Tensor,
  groups = 32,
  opts: { accumulate?: boolean; grads?: { dgamma: Tensor; dbeta: Tensor } } = {},
): NormGrads {
  return normBackward(gpu, 'groupNormBackward', x, gamma, saved, dy, groupLayout('groupNormBackward', x, groups), !!opts.accumulate, opts.grads) as NormGrads;
}

/**
 * The halves of groupNormBackward that `parts` asks for: dx (NORM_BWD_INPUT) and/or dgamma + dbeta
 * (NORM_BWD_PARAMS), two independent dispatches, so each is bit-identical to the full backward's.
 * A frozen norm skips its parameter gradients; a norm whose input needs no gradient skips dx.
 */
export function groupNormBackwardParts(
  gpu: Gpu,
  x: Tensor,
  gamma: Tensor,
  saved: NormSaved,
  dy: Tensor,
  groups: number,
  parts: NormParts,
  into?: NormInto,
): Partial<NormGrads> {
  return normBackward(gpu, 'groupNormBackward', x, gamma, saved, dy, groupLayout('groupNormBackward', x, groups), false, undefined, parts, null, into);
}

/**
 * silu(groupNorm(x)) in one dispatch (diffusers' norm + nonlinearity pairs in every ResNet): the bits of
 * groupNorm then silu, since the kernel rounds the norm output as its store would before the SiLU.
 */
export function groupNormSilu(gpu: Gpu, x: Tensor, gamma: Tensor, beta: Tensor, groups = 32, eps = 1e-5): { y: Tensor } & NormSaved {
  return normForward(gpu, 'groupNormSilu', x, gamma, beta, eps, groupLayout('groupNormSilu', x, groups), true);
}

/**
 * Backward of groupNormSilu from dy of its output (see groupNormBackwardParts): the SiLU backward is formed
 * inside both kernels from x and the saved statistics, so neither the norm output nor its gradient is stored.
 * The bits of silu's backward then groupNorm's.
 */
export function groupNormSiluBackwardParts(
  gpu: Gpu,
  x: Tensor,
  gamma: Tensor,
  beta: Tensor,
  saved: NormSaved,
  dy: Tensor,
  groups: number,
  parts: NormParts,
  into?: NormInto,
): Partial<NormGrads> {
  const l = groupLayout('groupNormSiluBackward', x, groups);
  checkAffine('groupNormSiluBackward', x, gamma, beta, l.channels);
  return normBackward(gpu, 'groupNormSiluBackward', x, gamma, saved, dy, l, false, undefined, parts, beta, into);
}

/** LayerNorm over the last dim, affine. */
export function layerNorm(gpu: Gpu, x: Tensor, gamma: Tensor, beta: Tensor, eps = 1e-5): { y: Tensor } & NormSaved {
  return normForward(gpu, 'layerNorm', x, gamma, beta, eps, layerLayout('layerNorm', x));
}

export function layerNormBackward(
  gpu: Gpu,
  x: Tensor,
  gamma: Tensor,
  saved: NormSaved,
  dy: Tensor,
  opts: { accumulate?: boolean; grads?: { dgamma: Tensor; dbeta: Tensor } } = {},
): NormGrads {
  return normBackward(gpu, 'layerNormBackward', x, gamma, saved, dy, layerLayout('layerNormBackward', x), !!opts.accumulate, opts.grads) as NormGrads;
}

/** The halves of layerNormBackward that `parts` asks for (see groupNormBackwardParts). */
export function layerNormBackwardParts(
  gpu: Gpu,
  x: Tensor,
  gamma: Tensor,
  saved: NormSaved,
  dy: Tensor,
  parts: NormParts,
  into?: NormInto,
): Partial<NormGrads> {
  return normBackward(gpu, 'layerNormBackward', x, gamma, saved, dy, layerLayout('layerNormBackward', x), false, undefined, parts, null, into);
}

// ---- plain-TS references (f64 accumulation) ----------------------------------------------------

interface RefLayout {
  segs: number;
  segLen: number;
  channelOf: (seg: number, j: number) => number;
  channels: number;
}

function refGroup(shape: readonly number[], groups: number): RefLayout {
  const [n, c] = shape;
  const inner = shape.slice(2).reduce((a, b) => a * b, 1);
  const cpg = c / groups;
  return { segs: n * groups, segLen: cpg * inner, channelOf: (s, j) => (s % groups) * cpg + Math.floor(j / inner), channels: c };
}

function refLayer(shape: readonly number[]): RefLayout {
  const d = shape[shape.length - 1];
  return { segs: shape.reduce((a, b) => a * b, 1) / d, segLen: d, channelOf: (_s, j) => j, channels: d };
}

function normRef(x: ArrayLike<number>, gamma: ArrayLike<number>, beta: ArrayLike<number>, eps: number, l: RefLayout) {
  const y = new Float32Array(x.length);
  const mean = new Float32Array(l.segs);
  const rstd = new Float32Array(l.segs);
  for (let s = 0; s < l.segs; s++) {
    const b = s * l.segLen;
    let m = 0;
    for (let j = 0; j < l.segLen; j++) m += x[b + j];
    m /= l.segLen;
    let v = 0;
    for (let j = 0; j < l.segLen; j++) v += (x[b + j] - m) ** 2;
    const r = 1 / Math.sqrt(v / l.segLen + eps);
    for (let j = 0; j < l.segLen; j++) {
      const c = l.channelOf(s, j);
      y[b + j] = (x[b + j] - m) * r * gamma[c] + beta[c];
    }
    mean[s] = m;
    rstd[s] = r;
  }
  return { y, mean, rstd };
}

function normBackwardRef(x: ArrayLike<number>, gamma: ArrayLike<number>, dy: ArrayLike<number>, eps: number, l: RefLayout) {
  const { mean, rstd } = normRef(x, gamma, new Float32Array(l.channels), eps, l);
  const dx = new Float32Array(x.length);
  const dgamma = new Float64Array(l.channels);
  const dbeta = new Float64Array(l.channels);
  for (let s = 0; s < l.segs; s++) {
    const b = s * l.segLen;
    let sg = 0;
    let sgx = 0;
    for (let j = 0; j < l.segLen; j++) {
      const c = l.channelOf(s, j);
      const xhat = (x[b + j] - mean[s]) * rstd[s];
      const g = dy[b + j] * gamma[c];
      sg += g;
      sgx += g * xhat;
      dgamma[c] += dy[b + j] * xhat;
      dbeta[c] += dy[b + j];
    }
    sg /= l.segLen;
    sgx /= l.segLen;
    for (let j = 0; j < l.segLen; j++) {
      const xhat = (x[b + j] - mean[s]) * rstd[s];
      dx[b + j] = rstd[s] * (dy[b + j] * gamma[l.channelOf(s, j)] - sg - xhat * sgx);
    }
  }
  return { dx, dgamma: Float32Array.from(dgamma), dbeta: Float32Array.from(dbeta) };
}

export function groupNormRef(x: ArrayLike<number>, shape: readonly number[], gamma: ArrayLike<number>, beta: ArrayLike<number>, groups = 32, eps = 1e-5) {
  return normRef(x, gamma, beta, eps, refGroup(shape, groups));
}

export function groupNormBackwardRef(x: ArrayLike<number>, shape: readonly number[], gamma: ArrayLike<number>, dy: ArrayLike<number>, groups = 32, eps = 1e-5) {
  return normBackwardRef(x, gamma, dy, eps, refGroup(shape, groups));
}

export function layerNormRef(x: ArrayLike<number>, shape: readonly number[], gamma: ArrayLike<number>, beta: ArrayLike<number>, eps = 1e-5) {
  return normRef(x, gamma, beta, eps, refLayer(shape));
}

export function layerNormBackwardRef(x: ArrayLike<number>, shape: readonly number[], gamma: ArrayLike<number>, dy: ArrayLike<number>, eps = 1e-5) {
  return normBackwardRef(x, gamma, dy, eps, refLayer(shape));
}
