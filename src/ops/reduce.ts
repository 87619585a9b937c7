// Reductions, all accumulating in f32: the sum of all elements, row sums (over the last dim),
// column sums (over the leading dims: bias gradients), the MSE loss and its gradient, the
// non-finite flag and the global gradient norm. The kernels are in shaders/reduce.wgsl.
//
// Multi-pass tree reduction: a pass splits every row into segments of at most SEG elements and
// turns each segment into one f32 partial (workgroup tree sum); the partials form a shorter row and
// the next pass reduces them again, until one value per row is left. The last pass applies the
// finishing scale (1/n for a mean, sqrt and 1/loss_scale for a norm) and stores the output dtype.
//
// Tensors larger than one storage binding: a dispatch binds windows that start at the aligned byte
// offset at or below its first element, and is told that element's index inside the window (the
// "skip"), so any element range of any tensor, views at odd offsets included, can be bound.
import type { BufferWindow, Gpu } from '../gpu/device.ts';
import { fmtShape, ShapeError } from '../gpu/errors.ts';
import { f32, kernel, u32 } from '../gpu/kernel.ts';
import { BYTES, expectSameDType, type DType, Tensor } from '../gpu/tensor.ts';
import { elemWindow } from './tiles.ts';

const WG = 256;
/** Elements one workgroup sums per row pass (8 per invocation). */
const SEG = WG * 8;
/** Rows one invocation sums per column pass. */
const ROW_SEG = 64;
const MAX_WORKGROUPS_Y = 65535;

// ---- kernel interfaces (shaders/reduce.wgsl) -----------------------------------------------------

const X = { name: 'x', type: 'T', access: 'read' } as const;
const Y = { name: 'y', type: 'T', access: 'read' } as const;
const OUT = { name: 'out', type: 'O', access: 'read_write' } as const;

/** A row pass's units (segments of rows) and the windows' skips; see shaders/reduce.wgsl. */
const ROW_UNITS = [u32('cols'), u32('segs'), u32('seg'), u32('unit0'), u32('units'), u32('elem0'), u32('x_skip'), u32('out_skip'), f32('scale')] as const;

const SUM_ROWS = kernel({ shader: 'reduce', entry: 'sum_rows', uniforms: ROW_UNITS, bindings: [X, OUT] });
const SUMSQ_ROWS = kernel({ shader: 'reduce', entry: 'sumsq_rows', uniforms: ROW_UNITS, bindings: [X, OUT] });
const SQDIFF_ROWS = kernel({ shader: 'reduce', entry: 'sqdiff_rows', uniforms: [...ROW_UNITS, u32('y_skip')], bindings: [X, Y, OUT] });
const SUM_COLS = kernel({
  shader: 'reduce',
  entry: 'sum_cols',
  uniforms: [u32('cols'), u32('rows'), u32('row_seg'), u32('seg0'), u32('row0'), u32('x_skip'), u32('out_skip')],
  bindings: [X, OUT],
});
const MSE_BACKWARD = kernel({
  shader: 'reduce',
  entry: 'mse_backward',
  uniforms: [u32('n'), u32('x_skip'), u32('y_skip'), u32('out_skip'), f32('coef')],
  bindings: [X, Y, OUT],
});
const NONFINITE = kernel({
  shader: 'reduce',
  entry: 'nonfinite',
  uniforms: [u32('n'), u32('skip')],
  bindings: [
    { name: 'bits', type: 'u32', access: 'read' },
    { name: 'flag', type: 'atomic<u32>', access: 'read_write' },
  ],
});

/** The row passes over x alone. */
const ROW_SUMS = { sum_rows: SUM_ROWS, sumsq_rows: SUMSQ_ROWS };
type RowEntry = keyof typeof ROW_SUMS | 'sqdiff_rows';

// ---- windows --------------------------------------------------------------------------------------

/** A binding over some elements of a tensor, and the index of the first of them inside it. */
export interface ElementWindow {
  window: BufferWindow;
  skip: number;
}

/** Binds elements [start, start + count) of `t` from the aligned byte offset at or below `start` (matmul's elemWindow). */
export function elementWindow(gpu: Gpu, t: Tensor, start: number, count: number): ElementWindow {
  if (t.byteOffset % BYTES[t.dtype] !== 0)
    throw new ShapeError('elementWindow', `${t} starts at byte ${t.byteOffset}, not a multiple of its ${BYTES[t.dtype]}-byte elements`);
  const w = elemWindow(gpu, t, start, count);
  return { window: w.window, skip: w.offset };
}

/** The most elements of `dtype` one elementWindow may cover, whatever its skip. */
export function windowCapacity(gpu: Gpu, dtype: DType): number {
  const align = gpu.facts.storageAlignment;
  const cap = Math.floor((gpu.maxBinding - align) / BYTES[dtype]);
  if (cap < 2) throw new ShapeError('windowCapacity', `a storage binding of ${gpu.maxBinding} bytes holds no useful window`);
  return Math.min(cap, 2 ** 31);
}

function checkIndexable(op: string, t: Tensor): void {
  if (t.numel >= 2 ** 32) throw new ShapeError(op, `${t} has ${t.numel} elements; kernels index up to 2^32`);
}

// ---- row passes (sum of all, row sums, sums of squares, squared differences) -----------------------

/** Elements per segment for a row pass over `x` (and `y`): SEG, or less where a binding is small. */
function segmentLength(gpu: Gpu, x: Tensor, y: Tensor | null): number {
  return Math.min(SEG, windowCapacity(gpu, x.dtype), y ? windowCapacity(gpu, y.dtype) : Infinity);
}

/**
 * One pass over x viewed as [rows, cols]: unit u = row * segs + segment gets the (finished) sum of
 * its segment, stored at out[outStart + u]. Dispatches cover runs of units whose windows fit.
 */
function rowPass(
  gpu: Gpu,
  entry: RowEntry,
  x: Tensor,
  y: Tensor | null,
  rows: number,
  cols: number,
  seg: number,
  out: Tensor,
  outStart: number,
  scale = 1,
  sqrt = false,
): void {
  const segs = Math.ceil(cols / seg);
  const units = rows * segs;
  const span = segs === 1 ? cols : seg; // elements one unit covers at most
  const cap = Math.min(windowCapacity(gpu, x.dtype), y ? windowCapacity(gpu, y.dtype) : Infinity);
  const perDispatch = Math.max(1, Math.min(Math.floor(cap / span), windowCapacity(gpu, out.dtype)));
  const begin = (u: number) => Math.floor(u / segs) * cols + (u % segs) * seg;
  const end = (u: number) => Math.floor(u / segs) * cols + Math.min((u % segs) * seg + seg, cols);
  for (let u0 = 0; u0 < units; u0 += perDispatch) {
    const n = Math.min(perDispatch, units - u0);
    const e0 = begin(u0);
    const count = end(u0 + n - 1) - e0;
    const xw = elementWindow(gpu, x, e0, count);
    const yw = y ? elementWindow(gpu, y, e0, count) : null;
    const ow = elementWindow(gpu, out, outStart + u0, n);
    const defs = { T: x.dtype, O: out.dtype, WG, SQRT: sqrt };
    const pass = { cols, segs, seg, unit0: u0, units: n, elem0: e0, x_skip: xw.skip, out_skip: ow.skip, scale };
    const workgroups = gpu.grid(n);
    if (entry !== 'sqdiff_rows') gpu.run(ROW_SUMS[entry], { defs, uniforms: pass, bindings: { x: xw.window, out: ow.window }, workgroups });
    else if (yw) gpu.run(SQDIFF_ROWS, { defs, uniforms: { ...pass, y_skip: yw.skip }, bindings: { x: xw.window, y: yw.window, out: ow.window }, workgroups });
    else throw new ShapeError('sqdiff_rows', 'needs y');
  }
}

/** Reduces each row of x [rows, cols] to one value, pass after pass, into out[outStart + row]. */
function reduceRows(
  gpu: Gpu,
  entry: RowEntry,
  x: Tensor,
  y: Tensor | null,
  rows: number,
  cols: number,
  out: Tensor,
  outStart: number,
  scale = 1,
  sqrt = false,
): void {
  const partials: Tensor[] = [];
  let src = x;
  let srcY = y;
  let e = entry;
  let c = cols;
  for (;;) {
    const seg = segmentLength(gpu, src, srcY);
    if (c <= seg) {
      rowPass(gpu, e, src, srcY, rows, c, seg, out, outStart, scale, sqrt);
      break;
    }
    const segs = Math.ceil(c / seg);
    const partial = gpu.tensor([rows * segs], 'f32', 'scratch', 'reduce.partials');
    rowPass(gpu, e, src, srcY, rows, c, seg, partial, 0);
    partials.push(partial);
    [src, srcY, e, c] = [partial, null, 'sum_rows', segs];
  }
  gpu.free(...partials); // destroyed once the recorded passes are submitted
}

/** Sum of all elements -> f32 [1]. */
export function sumAll(gpu: Gpu, x: Tensor): Tensor {
  checkIndexable('sumAll', x);
  const out = gpu.tensor([1], 'f32', 'scratch', 'sumAll');
  reduceRows(gpu, 'sum_rows', x, null, 1, x.numel, out, 0);
  return out;
}

export function sumAllRef(x: ArrayLike<number>): number {
  let s = 0;
  for (let i = 0; i < x.length; i++) s += x[i];
  return s;
}

function lastDim(op: string, x: Tensor): number {
  if (x.shape.length === 0 || x.numel === 0) throw new ShapeError(op, `needs a non-empty tensor with a last dim, got ${fmtShape(x.shape)}`);
  return x.shape[x.shape.length - 1];
}

/** Sums over the last dim: x [..., C] -> [...] ([1] for a 1-D x), stored as `dtype`. */
export function sumRows(gpu: Gpu, x: Tensor, dtype: DType = 'f32'): Tensor {
  const cols = lastDim('sumRows', x);
  checkIndexable('sumRows', x);
  const lead = x.shape.slice(0, -1);
  const out = gpu.tensor(lead.length ? lead : [1], dtype, 'scratch', 'sumRows');
  reduceRows(gpu, 'sum_rows', x, null, x.numel / cols, cols, out, 0);
  return out;
}

export function sumRowsRef(x: ArrayLike<number>, cols: number): Float32Array {
  const out = new Float64Array(x.length / cols);
  for (let i = 0; i < x.length; i++) out[Math.floor(i / cols)] += x[i];
  return Float32Array.from(out);
}

// ---- column passes (sums over the leading dims) ---------------------------------------------------

/** out[s, c] = sum of x[r, c] over row segment s (rowSeg rows), for x viewed as [rows, cols]. */
function colPass(gpu: Gpu, x: Tensor, rows: number, cols: number, rowSeg: number, out: Tensor): void {
  const segs = Math.ceil(rows / rowSeg);
  const perDispatch = Math.min(Math.floor(windowCapacity(gpu, x.dtype) / (rowSeg * cols)), Math.floor(windowCapacity(gpu, out.dtype) / cols), MAX_WORKGROUPS_Y);
  if (perDispatch < 1) throw new ShapeError('sumColumns', `rows of ${cols} elements are too long for a ${gpu.maxBinding}-byte storage binding`);
  for (let s0 = 0; s0 < segs; s0 += perDispatch) {
    const n = Math.min(perDispatch, segs - s0);
    const r0 = s0 * rowSeg;
    const r1 = Math.min(rows, (s0 + n) * rowSeg);
    const xw = elementWindow(gpu, x, r0 * cols, (r1 - r0) * cols);
    const ow = elementWindow(gpu, out, s0 * cols, n * cols);
    gpu.run(SUM_COLS, {
      defs: { T: x.dtype, O: out.dtype, WG },
      uniforms: { cols, rows, row_seg: rowSeg, seg0: s0, row0: r0, x_skip: xw.skip, out_skip: ow.skip },
      bindings: { x: xw.window, out: ow.window },
      workgroups: [Math.ceil(cols / WG), n],
    });
  }
}

/** Sums over every leading dim: x [..., C] -> [C] stored as `dtype` (bias gradients). */
export function sumColumns(gpu: Gpu, x: Tensor, dtype: DType = 'f32'): Tensor {
  const cols = lastDim('sumColumns', x);
  checkIndexable('sumColumns', x);
  const out = gpu.tensor([cols], dtype, 'scratch', 'sumColumns');
  const partials: Tensor[] = [];
  let src = x;
  let rows = x.numel / cols;
  for (;;) {
    const fit = Math.floor(windowCapacity(gpu, src.dtype) / cols);
    if (rows > 1 && fit < 2)
      throw new ShapeError('sumColumns', `${fmtShape(x.shape)}: two rows of ${cols} ${src.dtype} must fit one ${gpu.maxBinding}-byte storage binding`);
    const rowSeg = Math.min(ROW_SEG, fit);
    if (rows <= rowSeg) {
      colPass(gpu, src, rows, cols, rows, out);
      break;
    }
    const partial = gpu.tensor([Math.ceil(rows / rowSeg), cols], 'f32', 'scratch', 'reduce.partials');
    colPass(gpu, src, rows, cols, rowSeg, partial);
    partials.push(partial);
    src = partial;
    rows = partial.shape[0];
  }
  gpu.free(...partials);
  return out;
}

export function sumColumnsRef(x: ArrayLike<number>, cols: number): Float32Array {
  const out = new Float64Array(cols);
  for (let i = 0; i < x.length; i++) out[i % cols] += x[i];
  return Float32Array.from(out);
}

// ---- MSE loss ------------------------------------------------------------------------------------

function checkPair(op: string, pred: Tensor, target: Tensor): void {
  expectSameDType(op, pred, target);
  if (pred.shape.length !== target.shape.length || pred.shape.some((d, i) => d !== target.shape[i]))
    throw new ShapeError(op, `pred ${fmtShape(pred.shape)} and target ${fmtShape(target.shape)} differ`);
  if (pred.numel === 0) throw new ShapeError(op, `empty pred ${fmtShape(pred.shape)}`);
  checkIndexable(op, pred);
}

/** mean((pred - target)^2) over all elements -> f32 [1]. */
export function mseLoss(gpu: Gpu, pred: Tensor, target: Tensor): Tensor {
  checkPair('mseLoss', pred, target);
  const out = gpu.tensor([1], 'f32', 'scratch', 'mseLoss');
  reduceRows(gpu, 'sqdiff_rows', pred, target, 1, pred.numel, out, 0, 1 / pred.numel);
  return out;
}

/**
 * d loss / d pred = 2 (pred - target) / n, times `lossScale` (the dynamic loss scale), stored as
 * `dtype` (pred's by default; f16 gradients are why the loss is scaled).
 */
export function mseLossBackward(gpu: Gpu, pred: Tensor, target: Tensor, lossScale = 1, dtype: DType = pred.dtype): Tensor {
  checkPair('mseLossBackward', pred, target);
  const d = gpu.tensor(pred.shape, dtype, 'gradients', 'mse.dpred');
  const coef = (2 * lossScale) / pred.numel;
  const per = Math.min(windowCapacity(gpu, pred.dtype), windowCapacity(gpu, dtype));
  for (let start = 0; start < pred.numel; start += per) {
    const n = Math.min(per, pred.numel - start);
    const [pw, tw, dw] = [pred, target, d].map((t) => elementWindow(gpu, t, start, n));
    gpu.run(MSE_BACKWARD, {
      defs: { T: pred.dtype, O: dtype, WG },
      uniforms: { n, x_skip: pw.skip, y_skip: tw.skip, out_skip: dw.skip, coef },
      bindings: { x: pw.window, y: tw.window, out: dw.window },
      workgroups: gpu.grid(Math.ceil(n / WG)),
    });
  }
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

/** A zeroed f32 [1] non-finite flag for checkFinite and the optimizer (0 = clean, 1 = inf/NaN seen). */
export function newFlag(gpu: Gpu): Tensor {
  return gpu.zeros([1], 'f32', 'scratch', 'nonfinite-flag');
}

/** Clears the flag (before a step's checks). */
export function clearFlag(gpu: Gpu, flag: Tensor): void {
  gpu.write(flag, [0]);
}

function checkFlag(op: string, flag: Tensor): void {
  if (flag.dtype !== 'f32' || flag.numel !== 1) throw new ShapeError(op, `flag must be f32 [1], got ${flag.dtype}${fmtShape(flag.shape)}`);
}

/**
 * Sets flag to 1.0 if any element of any tensor is inf or NaN (f16 or f32, tested on the exponent
 * bits); leaves it as it was otherwise. No read-back: the optimizer reads the flag on the GPU.
 */
export function checkFinite(gpu: Gpu, tensors: Tensor[], flag: Tensor): void {
  checkFlag('checkFinite', flag);
  const fw = elementWindow(gpu, flag, 0, 1);
  if (fw.skip !== 0) throw new ShapeError('checkFinite', `flag ${flag} must start at an aligned offset (it is bound as atomic words)`);
  for (const t of tensors) {
    checkIndexable('checkFinite', t);
    const per = windowCapacity(gpu, t.dtype);
    for (let start = 0; start < t.numel; start += per) {
      const n = Math.min(per, t.numel - start);
      const xw = elementWindow(gpu, t, start, n);
      gpu.run(NONFINITE, {
        defs: { WG, IS_F16: t.dtype === 'f16' },
        uniforms: { n, skip: xw.skip },
        bindings: { bits: xw.window, flag: fw.window },
        workgroups: gpu.grid(Math.ceil(n / WG)),
      });
    }
  }
}

export function checkFiniteRef(tensors: ArrayLike<number>[]): boolean {
  return tensors.some((t) => Array.prototype.some.call(t, (v: number) => !Number.isFinite(v)));
}

/** Reads the flag (one 4-byte read-back): true when a non-finite value was seen. */
export async function readFlag(gpu: Gpu, flag: Tensor): Promise<boolean> {
  checkFlag('readFlag', flag);
  return (await gpu.read(flag))[0] !== 0;
}

/**
 * sqrt(sum of squares over every element of every tensor) / lossScale -> f32 [1]: the norm
 * clip_grad_norm_ measures, of gradients that carry the loss scale. Each tensor's first pass writes
 * its partial sums of squares side by side into one buffer; one multi-pass reduction finishes it.
 */
export function globalNorm(gpu: Gpu, tensors: Tensor[], lossScale = 1, /** f32 [1] to write into (else a new tensor). */ out?: Tensor): Tensor {
  if (!(lossScale > 0)) throw new ShapeError('globalNorm', `loss scale must be > 0, got ${lossScale}`);
  const parts = normPartials(gpu, tensors);
  tensors.forEach((t, i) => addNormPartial(gpu, parts, i, t));
  return finishNorm(gpu, parts, lossScale, out);
}

/**
 * globalNorm in pieces, for gradients that exist one at a time (fused optimizer updates): the partial
 * sums of squares of tensor i go to its own segment range of one partials buffer, laid out from the
 * shapes alone, so adding the tensors in any order and then finishing gives globalNorm's bits exactly.
 */
export interface NormPartials {
  partials: Tensor;
  /** Each tensor's first segment in `partials`, its segment length and its shape's element count. */
  plan: { offset: number; seg: number; numel: number }[];
}

/** The partials buffer for tensors shaped like `like` (their values are not read). */
export function normPartials(gpu: Gpu, like: Tensor[]): NormPartials {
  if (like.length === 0) throw new ShapeError('globalNorm', 'no tensors given');
  let offset = 0;
  const plan = like.map((t) => {
    checkIndexable('globalNorm', t);
    const seg = segmentLength(gpu, t, null);
    const at = { offset, seg, numel: t.numel };
    offset += Math.ceil(t.numel / seg);
    return at;
  });
  return { partials: gpu.tensor([Math.max(1, offset)], 'f32', 'scratch', 'globalNorm.partials'), plan };
}

/** Writes tensor i's sums of squares into its range (t: shaped like the i-th tensor the partials were planned for). */
export function addNormPartial(gpu: Gpu, parts: NormPartials, i: number, t: Tensor): void {
  const { offset, seg, numel } = parts.plan[i];
  if (t.numel !== numel) throw new ShapeError('globalNorm', `tensor ${i} has ${t.numel} elements, planned ${numel}`);
  if (t.numel > 0) rowPass(gpu, 'sumsq_rows', t, null, 1, t.numel, seg, parts.partials, offset);
}

/** sqrt(sum of every partial) / lossScale into `out` (or a new f32 [1]); frees the partials. */
export function finishNorm(gpu: Gpu, parts: NormPartials, lossScale = 1, out?: Tensor): Tensor {
  if (!(lossScale > 0)) {
    gpu.free(parts.partials);
    throw new ShapeError('globalNorm', `loss scale must be > 0, got ${lossScale}`);
  }
  const norm = out ?? gpu.tensor([1], 'f32', 'scratch', 'globalNorm');
  if (norm.dtype !== 'f32' || norm.numel !== 1) throw new ShapeError('globalNorm', `out must be f32 [1], got ${norm.dtype}${fmtShape(norm.shape)}`);
  reduceRows(gpu, 'sum_rows', parts.partials, null, 1, parts.partials.numel, norm, 0, 1 / lossScale, true);
  gpu.free(parts.partials);
  return norm;
}

export function globalNormRef(tensors: ArrayLike<number>[], lossScale = 1): number {
  let s = 0;
  for (const t of tensors) for (let i = 0; i < t.length; i++) s += t[i] * t[i];
  return Math.sqrt(s) / lossScale;
}
