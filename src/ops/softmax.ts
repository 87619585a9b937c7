// Softmax over the last dim: forward and backward (from y), plus plain-TS references.
import type { Gpu } from '../gpu/device.ts';
import { fmtShape, ShapeError } from '../gpu/errors.ts';
import { kernel, type BindingArgs, type UniformArgs } from '../gpu/kernel.ts';
import { BYTES, expectSameDType, Tensor } from '../gpu/tensor.ts';

const WG = 128;

const ROWS = [
  { name: 'rows', type: 'u32' },
  { name: 'cols', type: 'u32' },
] as const;

const SOFTMAX_FWD = kernel({
  shader: 'softmax',
  entry: 'softmax_fwd',
  uniforms: ROWS,
  bindings: [
    { name: 'x', type: 'T', access: 'read' },
    { name: 'y', type: 'T', access: 'read_write' },
  ],
});

const SOFTMAX_BWD = kernel({
  shader: 'softmax',
  entry: 'softmax_bwd',
  uniforms: ROWS,
  bindings: [
    { name: 'y', type: 'T', access: 'read' },
    { name: 'dy', type: 'T', access: 'read' },
    { name: 'dx', type: 'T', access: 'read_write' },
  ],
});

/** Runs a row kernel over the rows of `rowsOf` ([..., cols]) in binding-sized ranges; every tensor in `t` is windowed alike. */
function rowsRun<K extends typeof SOFTMAX_FWD | typeof SOFTMAX_BWD>(gpu: Gpu, k: K, rowsOf: Tensor, t: BindingArgs<K, Tensor>): void {
  const cols = rowsOf.shape[rowsOf.shape.length - 1];
  const rows = rowsOf.numel / cols;
  const rowBytes = cols * BYTES[rowsOf.dtype];
  for (const { start, count } of gpu.chunks(rows, rowBytes)) {
    const bindings = Object.fromEntries(Object.entries(t as Record<string, Tensor>).map(([name, x]) => [name, gpu.subWindow(x, start, count, rowBytes)]));
    gpu.run(k, {
      defs: { T: rowsOf.dtype, WG },
      uniforms: { rows: count, cols } as UniformArgs<K>,
      bindings: bindings as BindingArgs<K, Tensor>,
      workgroups: gpu.grid(count),
    });
  }
}

/** y = softmax(x) over the last dim. */
export function softmax(gpu: Gpu, x: Tensor): Tensor {
  if (x.shape.length < 1 || x.numel === 0) throw new ShapeError('softmax', `x must be non-empty, got ${fmtShape(x.shape)}`);
  const y = gpu.tensor(x.shape, x.dtype, 'activations', 'softmax');
  rowsRun(gpu, SOFTMAX_FWD, x, { x, y });
  return y;
}

/** dx = y * (dy - sum(dy * y)) from the forward output y. */
export function softmaxBackward(gpu: Gpu, y: Tensor, dy: Tensor): Tensor {
  expectSameDType('softmaxBackward', y, dy);
  if (y.shape.length !== dy.shape.length || y.shape.some((d, i) => d !== dy.shape[i]))
    throw new ShapeError('softmaxBackward', `dy ${fmtShape(dy.shape)} does not match y ${fmtShape(y.shape)}`);
  const dx = gpu.tensor(y.shape, y.dtype, 'gradients', 'softmax.dx');
  rowsRun(gpu, SOFTMAX_BWD, y, { y, dy, dx });
  return dx;
}

export function softmaxRef(x: ArrayLike<number>, cols: number): Float32Array {
  const y = new Float32Array(x.length);
  for (let b = 0; b < x.length; b += cols) {
    let m = -Infinity;
    for (let j = 0; j < cols; j++) m = Math.max(m, x[b + j]);
    let s = 0;
    for (let j = 0; j < cols; j++) s += Math.exp(x[b + j] - m);
    for (let j = 0; j < cols; j++) y[b + j] = Math.exp(x[b + j] - m) / s;
  }
  return y;
}

export function softmaxBackwardRef(y: ArrayLike<number>, dy: ArrayLike<number>, cols: number): Float32Array {
  const dx = new Float32Array(y.length);
  for (let b = 0; b < y.length; b += cols) {
    let dot = 0;
    for (let j = 0; j < cols; j++) dot += dy[b + j] * y[b + j];
    for (let j = 0; j < cols; j++) dx[b + j] = y[b + j] * (dy[b + j] - dot);
  }
  return dx;
}
