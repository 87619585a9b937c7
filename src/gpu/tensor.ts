// A tensor is a typed, shaped view of (part of) a GPU buffer. Views share the allocation;
// only the owning tensor frees it.

import type { Allocation, Tag } from './allocator.ts';
import { fmtShape, ShapeError } from './errors.ts';

export type DType = 'f16' | 'f32';

export const BYTES: Record<DType, number> = { f16: 2, f32: 4 };

export function numel(shape: readonly number[]): number {
  let n = 1;
  for (const d of shape) n *= d;
  return n;
}

export class Tensor {
  constructor(
    readonly alloc: Allocation,
    readonly shape: readonly number[],
    readonly dtype: DType,
    /** Byte offset of element 0 inside the buffer. */
    readonly byteOffset = 0,
    readonly owner = true,
  ) {}

  get buffer(): GPUBuffer {
    return this.alloc.buffer;
  }
  get tag(): Tag {
    return this.alloc.tag;
  }
  get numel(): number {
    return numel(this.shape);
  }
  get byteSize(): number {
    return this.numel * BYTES[this.dtype];
  }

  /** Same elements, another shape. */
  reshape(shape: readonly number[]): Tensor {
    if (numel(shape) !== this.numel) throw new ShapeError('reshape', `cannot view ${fmtShape(this.shape)} as ${fmtShape(shape)}`);
    return new Tensor(this.alloc, shape, this.dtype, this.byteOffset, false);
  }

  toString(): string {
    return `Tensor(${this.dtype}${fmtShape(this.shape)} ${this.alloc.label})`;
  }
}

export function expectShape(op: string, name: string, t: Tensor, shape: readonly number[]): void {
  if (t.shape.length !== shape.length || t.shape.some((d, i) => d !== shape[i]))
    throw new ShapeError(op, `${name} must be ${fmtShape(shape)}, got ${fmtShape(t.shape)}`);
}

export function expectDType(op: string, t: Tensor, dtype: DType, name = 'input'): void {
  if (t.dtype !== dtype) throw new ShapeError(op, `${name} must be ${dtype}, got ${t.dtype} ${fmtShape(t.shape)}`);
}

export function expectSameDType(op: string, ...ts: Tensor[]): void {
  const d = ts[0].dtype;
  for (const t of ts) if (t.dtype !== d) throw new ShapeError(op, `dtype mismatch: ${ts.map((x) => `${x.dtype}${fmtShape(x.shape)}`).join(' vs ')}`);
}
