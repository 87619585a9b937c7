// Frozen base weights stored in int8 (weight-only quantisation): per output channel absmax,
//
//   scale[r] = max_j |W[r, j]| / 127,   q[r, j] = round(W[r, j] / scale[r]) in [-127, 127],   W ≈ q · scale
//
// where r runs over dim 0 (a linear's out features, a conv's Co) and j over the rest of the row. The GEMM and
// conv kernels dequantize q · scale in f32 as they load the weight (shaders/matmul.wgsl b_elem with B_INT8,
// shaders/conv2d.wgsl w_at with W_INT8), so no f16 copy is ever made: a weight costs 1 byte per element plus 4 per
// row instead of 2. Only frozen weights are stored this way (they get no gradient and no update; the LoRA
// gradient flows through dx = dy · W, which reads the same int8 weight).
//
// A weight is stored in int8 only when every row round-trips within `tolerance`: the RMS of (W - q · scale) over
// the row, relative to the row's mean |W| (not its RMS, which one outlier dominates and so would hide a bulk
// rounded away). Absmax rounding errs by at most scale / 2, uniformly spread (RMS scale / sqrt 12), so a row of
// Gaussian values (absmax ~3.5 sigma, mean |W| 0.8 sigma) lands near 0.9 %, uniform values near 0.5 %; a row whose
// absmax passes ~8 sigma (an outlier far above its bulk, which then sits on a few levels) exceeds the 2 % default,
// and that weight stays f16: never silently degraded.
//
// Layout of one allocation: the q bytes (row-major, 4 per u32 word, little-endian), padded to 256 bytes (the
// largest minStorageBufferOffsetAlignment WebGPU allows), then the f32 scales. One allocation, so freeing the
// weight frees both; the kernels bind the two ranges as two read-only windows of the same buffer.
import type { BufferWindow, Gpu } from '../gpu/device.ts';
import type { Allocation } from '../gpu/allocator.ts';
import { fmtShape, ShapeError } from '../gpu/errors.ts';
import { numel, Tensor, type DType } from '../gpu/tensor.ts';

/** Round-trip error per row (RMS error over mean |w|) above which a weight stays f16. */
export const INT8_TOLERANCE = 0.02;

const ALIGN = 256;

/** Bytes of an int8 weight of `shape` (q padded to the alignment, then one f32 scale per row). */
export function int8Bytes(shape: readonly number[]): number {
  return Math.ceil(numel(shape) / ALIGN) * ALIGN + shape[0] * 4;
}

/**
 * A frozen weight in int8 with per-row f32 scales. Its `dtype` is the run's compute dtype (what the layers see:
 * every op's dtype checks pass, and its outputs are in that dtype); only the matmul B-operand and conv weight
 * loaders read it, and views keep dim 0 (the rows the scales belong to).
 */
export class Int8Weight extends Tensor {
  constructor(alloc: Allocation, shape: readonly number[], dtype: DType, owner = true) {
    super(alloc, shape, dtype, 0, owner);
  }

  /** Byte offset of the f32 scales inside the allocation. */
  get scaleOffset(): number {
    return Math.ceil(this.numel / ALIGN) * ALIGN;
  }

  override get byteSize(): number {
    return int8Bytes(this.shape);
  }

  override reshape(shape: readonly number[]): Int8Weight {
    if (numel(shape) !== this.numel || shape[0] !== this.shape[0])
      throw new ShapeError('reshape', `an int8 weight ${fmtShape(this.shape)} keeps its rows (dim 0): cannot view it as ${fmtShape(shape)}`);
    return new Int8Weight(this.alloc, shape, this.dtype, false);
  }

  /** The q bytes (as u32 words) and the scales, as two storage-binding windows. */
  windows(): { q: BufferWindow; scale: BufferWindow } {
    const qBytes = Math.ceil(this.numel / 4) * 4;
    return {
      q: { buffer: this.buffer, offset: 0, size: qBytes },
      scale: { buffer: this.buffer, offset: this.scaleOffset, size: this.shape[0] * 4 },
    };
  }

  override toString(): string {
    return `Int8Weight(${this.dtype}${fmtShape(this.shape)} ${this.alloc.label})`;
  }
}

export function isInt8(t: Tensor): t is Int8Weight {
  return t instanceof Int8Weight;
}

export interface Quantized {
  /** Row-major int8 values. */
  q: Int8Array;
  /** One f32 scale per row (dim 0). */
  scale: Float32Array;
  /** The largest per-row round-trip error (RMS error over mean |w|). */
  worstError: number;
}

/**
 * Per-row absmax int8 of `w` (shape [rows, ...]); null when some row's round-trip error (file comment) exceeds
 * `tolerance` (the weight then stays in its float dtype). Scales are f32, so q · scale is what the kernels compute.
 */
export function quantizeInt8(w: ArrayLike<number>, shape: readonly number[], tolerance = INT8_TOLERANCE): Quantized | null {
  const rows = shape[0];
  const n = numel(shape);
  if (shape.length < 2 || w.length !== n) throw new ShapeError('quantizeInt8', `${w.length} values for ${fmtShape(shape)} (a weight of 2 or more dims)`);
  const len = n / rows;
  const q = new Int8Array(n);
  const scale = new Float32Array(rows);
  let worstError = 0;
  for (let r = 0; r < rows; r++) {
    const o = r * len;
    let amax = 0;
    for (let j = 0; j < len; j++) amax = Math.max(amax, Math.abs(w[o + j]));
    const s = Math.fround(amax / 127);
    scale[r] = s;
    let err2 = 0;
    let sumAbs = 0;
    for (let j = 0; j < len; j++) {
      const v = w[o + j];
      const qi = s === 0 ? 0 : Math.max(-127, Math.min(127, Math.round(v / s)));
      q[o + j] = qi;
      const d = v - Math.fround(qi * s);
      err2 += d * d;
      sumAbs += Math.abs(v);
    }
    const rel = sumAbs === 0 ? 0 : Math.sqrt(err2 / len) / (sumAbs / len);
    worstError = Math.max(worstError, rel);
    if (!(rel <= tolerance)) return null;
  }
  return { q, scale, worstError };
}

/** q · scale per row, in f32: the values the int8 kernels compute with (the test reference). */
export function dequantizeInt8(qz: Pick<Quantized, 'q' | 'scale'>): Float32Array {
  const rows = qz.scale.length;
  const len = qz.q.length / rows;
  const out = new Float32Array(qz.q.length);
  for (let r = 0; r < rows; r++) for (let j = 0; j < len; j++) out[r * len + j] = Math.fround(qz.q[r * len + j] * qz.scale[r]);
  return out;
}

/** An int8 weight on the GPU (tag 'weights'), read by the kernels as `dtype` (the run's compute dtype). */
export function uploadInt8(gpu: Gpu, qz: Pick<Quantized, 'q' | 'scale'>, shape: readonly number[], dtype: DType, label = 'int8 weight'): Int8Weight {
  if (qz.q.length !== numel(shape) || qz.scale.length !== shape[0])
    throw new ShapeError('uploadInt8', `${qz.q.length} values and ${qz.scale.length} scales for ${fmtShape(shape)}`);
  const t = new Int8Weight(gpu.allocator.alloc(int8Bytes(shape), 'weights', label), shape, dtype);
  const bytes = new Uint8Array(t.byteSize);
  bytes.set(new Uint8Array(qz.q.buffer, qz.q.byteOffset, qz.q.length));
  bytes.set(new Uint8Array(qz.scale.buffer, qz.scale.byteOffset, qz.scale.byteLength), t.scaleOffset);
  gpu.writeRaw(t, bytes);
  return t;
}

/** An int8 weight's allocation without contents: the dry-run planner's stand-in (same bytes as uploadInt8). */
export function unbackedInt8(gpu: Gpu, shape: readonly number[], dtype: DType, label = 'int8 weight'): Int8Weight {
  return new Int8Weight(gpu.allocator.alloc(int8Bytes(shape), 'weights', label), shape, dtype);
}

/**
 * Replaces a float weight on the GPU by its int8 form when it round-trips within `tolerance` (the float tensor is
 * freed); otherwise returns it unchanged. Weights of fewer than 2 dims (biases, norms) always stay.
 */
export async function toInt8(gpu: Gpu, w: Tensor, tolerance = INT8_TOLERANCE, free = true): Promise<Tensor> {
  if (isInt8(w) || w.shape.length < 2) return w;
  const qz = quantizeInt8(await gpu.read(w), w.shape, tolerance);
  if (!qz) return w;
  const t = uploadInt8(gpu, qz, w.shape, w.dtype, w.alloc.label);
  if (free) gpu.free(w);
  return t;
}

/**
 * Stores every weight of 2 or more dims of `weights` in int8 where it round-trips (toInt8), in place, one at a time
 * (at most one weight is held twice). Returns how many became int8 and the names kept in their float dtype.
 */
export async function quantizeWeights(gpu: Gpu, weights: Map<string, Tensor>, tolerance = INT8_TOLERANCE): Promise<{ int8: number; kept: string[] }> {
  let int8 = 0;
  const kept: string[] = [];
  // Weights laid end to end in one allocation (models/load.ts allocateWeights): its owner frees it, once every
  // tensor in it has been replaced (a member kept in its float dtype keeps the allocation)
  const holders = new Map<Allocation, { owner: Tensor | null; left: number }>();
  for (const w of weights.values()) {
    const h = holders.get(w.alloc) ?? { owner: null, left: 0 };
    holders.set(w.alloc, { owner: w.owner ? w : h.owner, left: h.left + 1 });
  }
  for (const [name, w] of weights) {
    if (w.shape.length < 2 || isInt8(w)) continue;
    const h = holders.get(w.alloc)!;
    const alone = h.left === 1 && h.owner === w; // toInt8 frees the allocation
    const t = await toInt8(gpu, w, tolerance, alone);
    if (!isInt8(t)) {
      kept.push(name);
      continue;
    }
    weights.set(name, t);
    int8++;
    if (--h.left === 0 && !alone) gpu.free(h.owner);
  }
  return { int8, kept };
}
