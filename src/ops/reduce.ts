// Reductions (f32 accumulation): total sums, sums of squares, row sums, MSE loss and its gradient,
// the non-finite flag and the global gradient norm. Multi-pass tree reductions: each pass turns
// WG*ITEMS elements into one f32 partial, until one value is left; inputs larger than one storage
// binding are walked in binding-sized ranges whose partials land side by side.
import { Uniforms, type Gpu } from '../gpu/device.ts';
import { fmtShape, ShapeError } from '../gpu/errors.ts';
import { BYTES, expectSameDType, type DType, Tensor } from '../gpu/tensor.ts';
import { colSum } from './matmul.ts';

const WG = 256;
const ITEMS = 8;
const PER_WG = WG * ITEMS;

/** Sum mode of the partial-sum kernel. */
const enum Mode {
  Sum = 0,
  SumSquares = 1,
  SumSquaredDiff = 2,
}

function defs(dtype: DType, mode: Mode) {
  return { T: dtype, WG, ITEMS, MODE: mode };
}

/** Writes the partial sums of `x` (and `y`) into `partial` starting at `offset`; returns the count. */
function partials(gpu: Gpu, x: Tensor, y: Tensor | null, mode: Mode, partial: Tensor, offset: number): number {
  let written = 0;
  const bytes = BYTES[x.dtype];
  // Ranges are whole multiples of PER_WG so each range's partials are complete.
  for (const { start, count } of rangeChunks(gpu, x.numel, bytes)) {
    const groups = Math.ceil(count / PER_WG);
    gpu.dispatch({
      shader: 'reduce',
      entry: 'partial_sum',
      defs: defs(x.dtype, mode),
      uniforms: new Uniforms().u32(count, offset + written).f32(0).u32(0),
      // `y` is in every partial_sum layout (MODE picks whether it is read): x stands in for it.
      bindings: [gpu.subWindow(x, start, count, bytes), gpu.subWindow(y ?? x, start, count, bytes), partial],
      workgroups: gpu.grid(groups),
    });
    written += groups;
  }
  return written;
}

/** Binding-sized ranges of elements, each a whole number of PER_WG blocks (except the last). */
function rangeChunks(gpu: Gpu, n: number, bytes: number): { start: number; count: number }[] {
  return gpu.chunks(Math.ceil(n / PER_WG), bytes * PER_WG).map(({ start, count }) => ({
    start: start * PER_WG,
    count: Math.min(count * PER_WG, n - start * PER_WG),
  }));
}

/** Reduces an f32 vector of `n` partials pass by pass; returns the tensor whose element 0 is the sum. */
function collapse(gpu: Gpu, buf: Tensor, n: number): Tensor {
  while (n > 1) {
    const groups = Math.ceil(n / PER_WG);
    const next = gpu.tensor([groups], 'f32', 'scratch', 'reduce.partials');
    gpu.dispatch({
      shader: 'reduce',
      entry: 'partial_sum',
      defs: defs('f32', Mode.Sum),
      uniforms: new Uniforms().u32(n, 0).f32(0).u32(0),
      bindings: [gpu.subWindow(buf, 0, n, 4), gpu.subWindow(buf, 0, n, 4), next],
      workgroups: gpu.grid(groups),
    });
    gpu.free(buf);
    buf = next;
    n = groups;
  }
  return buf;
}

/** out[0] = alpha * (sqrt?)(src[0]) as an f32 [1] tensor. */
function finalize(gpu: Gpu, src: Tensor, alpha: number, sqrt: boolean, label: string): Tensor {
  const out = gpu.tensor([1], 'f32', 'scratch', label);
  gpu.dispatch({
    shader: 'reduce',
    entry: 'finalize',
    defs: defs('f32', Mode.Sum),
    uniforms: new Uniforms().u32(1, 0).f32(alpha).u32(sqrt ? 1 : 0),
    bindings: [src, null, null, out],
    workgroups: [1],
  });
  return out;
}

function partialCount(gpu: Gpu, t: Tensor): number {
  return rangeChunks(gpu, t.numel, BYTES[t.dtype]).reduce((s, c) => s + Math.ceil(c.count / PER_WG), 0);
}

function reduceTensors(gpu: Gpu, items: { x: Tensor; y: Tensor | null }[], mode: Mode, alpha: number, sqrt: boolean, label: string): Tensor {
  const total = items.reduce((s, it) => s + partialCount(gpu, it.x), 0);
  const buf = gpu.tensor([Math.max(1, total)], 'f32', 'scratch', `${label}.partials`);
  let offset = 0;
  for (const it of items) offset += partials(gpu, it.x, it.y, mode, buf, offset);
  const sum = collapse(gpu, buf, total);
  const out = finalize(gpu, sum, alpha, sqrt, label);
  gpu.free(sum);
  return out;
}

/** sum of all elements -> f32 [1]. */
export function sumAll(gpu: Gpu, x: Tensor): Tensor {
  return reduceTensors(gpu, [{ x, y: null }], Mode.Sum, 1, false, 'sumAll');
}

export function sumAllRef(x: ArrayLike<number>): number {
  let s = 0;
  for (let i = 0; i < x.length; i++) s += x[i];
  return s;
}

/** Sums over the last dim: x [..., C] -> f32 [...]. */
export function sumRows(gpu: Gpu, x: Tensor): Tensor {
  const cols = x.shape[x.shape.length - 1];
  const rows = x.numel / cols;
  if (!gpu.fitsBinding(x)) throw new ShapeError('sumRows', `${x} is larger than one storage binding; split the rows`);
  const out = gpu.tensor(x.shape.slice(0, -1).length ? x.shape.slice(0, -1) : [1], 'f32', 'scratch', 'sumRows');
  gpu.dispatch({
    shader: 'reduce',
    entry: 'row_sum',
    defs: defs(x.dtype, Mode.Sum),
    uniforms: new Uniforms().u32(cols, rows).f32(0).u32(0),
    bindings: [x, null, out],
    workgroups: gpu.grid(rows),
  });
  return out;
}

export function sumRowsRef(x: ArrayLike<number>, cols: number): Float32Array {
  const out = new Float32Array(x.length / cols);
  for (let i = 0; i < x.length; i++) out[Math.floor(i / cols)] += x[i];
  return out;
}

/** Sums over every leading dim: x [..., C] -> [C] (bias gradients). The matmul family's column sum. */
export const sumColumns = colSum;

// ---- MSE loss ------------------------------------------------------------------------------------

function checkPair(op: string, pred: Tensor, target: Tensor): void {
  expectSameDType(op, pred, target);
  if (pred.shape.length !== target.shape.length || pred.shape.some((d, i) => d !== target.shape[i]))
    throw new ShapeError(op, `pred ${fmtShape(pred.shape)} and target ${fmtShape(target.shape)} differ`);
}

/** mean((pred - target)^2) -> f32 [1]. */
export function mseLoss(gpu: Gpu, pred: Tensor, target: Tensor): Tensor {
  checkPair('mseLoss', pred, target);
  return reduceTensors(gpu, [{ x: pred, y: target }], Mode.SumSquaredDiff, 1 / pred.numel, false, 'mseLoss');
}

/** d loss / d pred = 2 (pred - target) / N, multiplied by the loss scale, in pred's dtype. */
export function mseLossBackward(gpu: Gpu, pred: Tensor, target: Tensor, lossScale = 1): Tensor {
  checkPair('mseLossBackward', pred, target);
  const d = gpu.tensor(pred.shape, pred.dtype, 'gradients', 'mse.dpred');
  const bytes = BYTES[pred.dtype];
  for (const { start, count } of gpu.chunks(pred.numel, bytes))
    gpu.dispatch({
      shader: 'reduce',
      entry: 'mse_grad',
      defs: defs(pred.dtype, Mode.Sum),
      uniforms: new Uniforms().u32(count, 0).f32((2 * lossScale) / pred.numel).u32(0),
      bindings: [gpu.subWindow(pred, start, count, bytes), gpu.subWindow(target, start, count, bytes), null, gpu.subWindow(d, start, count, bytes)],
      workgroups: gpu.grid(Math.ceil(count / WG)),
    });
  return d;
}

export function mseLossRef(pred: ArrayLike<number>, target: ArrayLike<number>): number {
  let s = 0;
  for (let i = 0; i < pred.length; i++) s += (pred[i] - target[i]) ** 2;
  return s / pred.length;
}

export function mseLossBackwardRef(pred: ArrayLike<number>, target: ArrayLike<number>, lossScale = 1): Float32Array {
  return Float32Array.from(pred, (p, i) => ((2 * lossScale) / pred.length) * (p - target[i]));
}

// ---- overflow check and gradient norm -------------------------------------------------------------

/** A u32 [1] flag buffer for checkFinite / the optimizer. */
export function newFlag(gpu: Gpu): Tensor {
  return gpu.tensor([1], 'f32', 'scratch', 'nonfinite-flag'); // 4 bytes read as u32 by the kernels
}

/** Clears the flag (before a step's checks). */
export function clearFlag(gpu: Gpu, flag: Tensor): void {
  gpu.write(flag, [0]);
}

/** Sets flag to non-zero if any element of any tensor is inf or NaN; no read-back. */
export function checkFinite(gpu: Gpu, tensors: Tensor[], flag: Tensor): void {
  for (const t of tensors) {
    const bytes = BYTES[t.dtype];
    for (const { start, count } of gpu.chunks(t.numel, bytes))
      gpu.dispatch({
        shader: 'reduce',
        entry: 'nonfinite',
        defs: defs(t.dtype, Mode.Sum),
        uniforms: new Uniforms().u32(count, 0).f32(0).u32(0),
        bindings: [gpu.subWindow(t, start, count, bytes), null, null, null, flag],
        workgroups: gpu.grid(Math.ceil(count / WG)),
      });
  }
}

/** Reads the flag (one 4-byte read-back): true when a non-finite value was seen. */
export async function readFlag(gpu: Gpu, flag: Tensor): Promise<boolean> {
  const bytes = await gpu.readBytes(flag.buffer, flag.byteOffset, 4);
  return new Uint32Array(bytes)[0] !== 0;
}

/** sqrt(sum of squares over all tensors) / lossScale -> f32 [1] (what clip_grad_norm_ measures). */
export function globalNorm(gpu: Gpu, tensors: Tensor[], lossScale = 1): Tensor {
  if (tensors.length === 0) throw new ShapeError('globalNorm', 'no tensors given');
  // sqrt(S)/scale = sqrt(S / scale^2): finalize applies alpha after the root.
  return reduceTensors(gpu, tensors.map((x) => ({ x, y: null })), Mode.SumSquares, 1 / lossScale, true, 'globalNorm');
}

export function globalNormRef(tensors: ArrayLike<number>[], lossScale = 1): number {
  let s = 0;
  for (const t of tensors) for (let i = 0; i < t.length; i++) s += t[i] * t[i];
  return Math.sqrt(s) / lossScale;
}
