// Element-wise ops: forward and backward side by side, each with a plain-TS reference.
import { Uniforms, type Gpu } from '../gpu/device.ts';
import { fmtShape, ShapeError } from '../gpu/errors.ts';
import { BYTES, expectSameDType, type DType, Tensor } from '../gpu/tensor.ts';

const WG = 256;

function sameShape(op: string, a: Tensor, b: Tensor): void {
  if (a.numel !== b.numel || a.shape.length !== b.shape.length || a.shape.some((d, i) => d !== b.shape[i]))
    throw new ShapeError(op, `shapes differ: ${fmtShape(a.shape)} vs ${fmtShape(b.shape)}`);
}

/**
 * Runs a flat element-wise entry over `n` elements, splitting into binding-sized ranges.
 * `bound[i]` (binding i+1) are tensors walked in step; each gets a window over the same range.
 */
export function flatDispatch(
  gpu: Gpu,
  entry: string,
  defs: Record<string, 'f16' | 'f32' | number | boolean>,
  n: number,
  bound: (Tensor | null)[],
  extra: (u: Uniforms) => void = () => {},
  shader = 'elementwise',
): void {
  const widest = Math.max(...bound.filter((t): t is Tensor => t !== null).map((t) => BYTES[t.dtype]));
  for (const { start, count } of gpu.chunks(n, widest)) {
    const u = new Uniforms().u32(count);
    extra(u);
    gpu.dispatch({
      shader,
      entry,
      defs: { WG, ...defs },
      uniforms: u,
      bindings: bound.map((t) => (t ? gpu.subWindow(t, start, count, BYTES[t.dtype]) : null)),
      workgroups: gpu.grid(Math.ceil(count / WG)),
    });
  }
}

/** out = a + alpha * b (same shapes). Backward: da = dout, db = alpha * dout (see scale). */
export function add(gpu: Gpu, a: Tensor, b: Tensor, alpha = 1, out?: Tensor): Tensor {
  sameShape('add', a, b);
  expectSameDType('add', a, b);
  const o = out ?? gpu.tensor(a.shape, a.dtype, 'activations', 'add');
  flatDispatch(gpu, 'add', { T: a.dtype, U: a.dtype }, a.numel, [a, b, o], (u) => u.f32(alpha));
  return o;
}

export function addRef(a: ArrayLike<number>, b: ArrayLike<number>, alpha = 1): Float32Array {
  return Float32Array.from(a, (v, i) => v + alpha * b[i]);
}

/** Converts between f16 and f32 storage. */
export function cast(gpu: Gpu, x: Tensor, to: DType, tag = x.tag): Tensor {
  const o = gpu.tensor(x.shape, to, tag, `cast-${to}`);
  flatDispatch(gpu, 'convert', { T: x.dtype, U: to }, x.numel, [x, null, null, o]);
  return o;
}
