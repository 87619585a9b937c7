// Softmax over the last dim: forward and backward (from y), plus plain-TS references.
import { Uniforms, type Gpu } from '../gpu/device.ts';
import { fmtShape, ShapeError } from '../gpu/errors.ts';
import { BYTES, expectSameDType, Tensor } from '../gpu/tensor.ts';

const WG = 128;

function rowsDispatch(gpu: Gpu, entry: string, x: Tensor, dy: Tensor | null, out: Tensor): void {
  const cols = x.shape[x.shape.length - 1];
  const rows = x.numel / cols;
  const rowBytes = cols * BYTES[x.dtype];
  for (const { start, count } of gpu.chunks(rows, rowBytes)) {
    const win = (t: Tensor) => gpu.subWindow(t, start, count, rowBytes);
    gpu.dispatch({
      shader: 'softmax',
      entry,
      defs: { T: x.dtype, WG },
      uniforms: new Uniforms().u32(count, cols),
      bindings: [win(x), dy ? win(dy) : null, win(out)],
      workgroups: gpu.grid(count),
    });
  }
}

/** y = softmax(x) over the last dim. */
export function softmax(gpu: Gpu, x: Tensor): Tensor {
  if (x.shape.length < 1 || x.numel === 0) throw new ShapeError('softmax', `x must be non-empty, got ${fmtShape(x.shape)}`);
  const y = gpu.tensor(x.shape, x.dtype, 'activations', 'softmax');
  rowsDispatch(gpu, 'softmax_fwd', x, null, y);
  return y;
}

/** dx = y * (dy - sum(dy * y)) from the forward output y. */
export function softmaxBackward(gpu: Gpu, y: Tensor, dy: Tensor): Tensor {
  expectSameDType('softmaxBackward', y, dy);
  if (y.shape.length !== dy.shape.length || y.shape.some((d, i) => d !== dy.shape[i]))
    throw new ShapeError('softmaxBackward', `dy ${fmtShape(dy.shape)} does not match y ${fmtShape(y.shape)}`);
  const dx = gpu.tensor(y.shape, y.dtype, 'gradients', 'softmax.dx');
  rowsDispatch(gpu, 'softmax_bwd', y, dy, dx);
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
