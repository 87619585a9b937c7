// Element-wise ops: forward and backward side by side, each with a plain-TS reference.
// Math is in shaders/elementwise.wgsl; all of it computes in f32 and stores T (f16 or f32).
import type { Bindable, Gpu } from '../gpu/device.ts';
import { fmtShape, ShapeError } from '../gpu/errors.ts';
import { type BindingArgs, f32, kernel, type KernelDecl, read, u32, type UniformArgs, write } from '../gpu/kernel.ts';
import type { Defs } from '../gpu/shaders.ts';
import { BYTES, expectDType, expectSameDType, type DType, Tensor } from '../gpu/tensor.ts';

const WG = 256;
/** Elements per invocation of the flat kernels (see first() in the shader): 8 measured ~2x faster than 1 on lavapipe. */
const PER = 8;
/** Elements one workgroup of a flat kernel covers. */
const BLOCK = WG * PER;

function sameShape(op: string, a: Tensor, b: Tensor, names = ['a', 'b']): void {
  if (a.shape.length !== b.shape.length || a.shape.some((d, i) => d !== b.shape[i]))
    throw new ShapeError(op, `shapes differ: ${names[0]} ${fmtShape(a.shape)} vs ${names[1]} ${fmtShape(b.shape)}`);
}

// ---- kernel interfaces (shaders/elementwise.wgsl) ----------------------------------------------------

/** Every entry walks `n` elements (or planes); the host passes the count of each range. */
const N = u32('n');
const elementwise = <const D extends Omit<KernelDecl, 'shader'>>(d: D) => kernel({ shader: 'elementwise', ...d });

const ADD = elementwise({ entry: 'add', uniforms: [N, f32('alpha')], bindings: [read('x'), read('y'), write('out')] });
const MUL = elementwise({ entry: 'mul', uniforms: [N, f32('alpha')], bindings: [read('x'), read('y'), write('out')] });
const SCALE = elementwise({ entry: 'scale', uniforms: [N, f32('alpha')], bindings: [read('x'), write('out')] });
// The same ops over vec4s (n counts vec4s), for ranges whose elements are a multiple of 4: see add4 in the shader.
const V4 = 'vec4<T>';
const ADD4 = elementwise({ entry: 'add4', uniforms: [N, f32('alpha')], bindings: [read('x', V4), read('y', V4), write('out', V4)] });
const SCALE4 = elementwise({ entry: 'scale4', uniforms: [N, f32('alpha')], bindings: [read('x', V4), write('out', V4)] });
const CONVERT = elementwise({ entry: 'convert', uniforms: [N], bindings: [read('x'), write('out', 'U')] });
const REPEAT = elementwise({ entry: 'repeat', uniforms: [N, u32('inner')], bindings: [read('x'), write('out')] });
const ADD_CHANNEL = elementwise({
  entry: 'add_channel',
  uniforms: [N, u32('inner'), u32('elem0'), u32('chans'), u32('t_stride'), u32('t_off')],
  bindings: [read('x'), read('t'), write('out')],
});
const SUM_PLANES = elementwise({
  entry: 'sum_planes',
  uniforms: [N, u32('inner'), u32('lanes'), u32('shift')],
  bindings: [read('dy'), write('out')],
});
const ACT_FWD = elementwise({ entry: 'act_fwd', uniforms: [N], bindings: [read('x'), write('out')] });
const ACT_BWD = elementwise({ entry: 'act_bwd', uniforms: [N], bindings: [read('x'), read('dy'), write('dx')] });
const ACT_FWD4 = elementwise({ entry: 'act_fwd4', uniforms: [N], bindings: [read('x', V4), write('out', V4)] });
const ACT_BWD4 = elementwise({ entry: 'act_bwd4', uniforms: [N], bindings: [read('x', V4), read('dy', V4), write('dx', V4)] });
const GEGLU_FWD = elementwise({ entry: 'geglu_fwd', uniforms: [N, u32('f')], bindings: [read('x'), write('out')] });
const GEGLU_BWD = elementwise({ entry: 'geglu_bwd', uniforms: [N, u32('f')], bindings: [read('x'), read('dy'), write('dx')] });
const UPSAMPLE_FWD = elementwise({ entry: 'upsample2x_fwd', uniforms: [N, u32('ow'), u32('oh')], bindings: [read('x'), write('out')] });
const UPSAMPLE_BWD = elementwise({ entry: 'upsample2x_bwd', uniforms: [N, u32('w'), u32('h')], bindings: [read('dy'), write('dx')] });
const PAD_SHAPE = [N, u32('h'), u32('w'), u32('oh'), u32('ow'), u32('top'), u32('left')] as const;
const PAD2D = elementwise({ entry: 'pad2d', uniforms: PAD_SHAPE, bindings: [read('x'), write('out')] });
const PAD2D_CROP = elementwise({ entry: 'pad2d_crop', uniforms: PAD_SHAPE, bindings: [read('dy'), write('dx')] });
const TRANSPOSE2D = elementwise({ entry: 'transpose2d', uniforms: [N, u32('rows'), u32('cols')], bindings: [read('x'), write('out')] });
const CONCAT_CHANNELS = elementwise({
  entry: 'concat_channels',
  uniforms: [N, u32('cx'), u32('cy'), u32('inner')],
  bindings: [read('x'), read('y'), write('out')],
});
const SPLIT_CHANNELS = elementwise({
  entry: 'split_channels',
  uniforms: [N, u32('first'), u32('count'), u32('inner'), u32('total')],
  bindings: [read('x'), write('out')],
});
const TIMESTEP_EMBEDDING = elementwise({
  entry: 'timestep_embedding',
  uniforms: [N, u32('dim')],
  bindings: [read('timesteps', 'f32'), write('out')],
});

// ---- dispatch over binding-sized ranges -------------------------------------------------------------

/**
 * Runs a flat element-wise kernel over `n` elements, splitting into binding-sized ranges. Every tensor
 * in `walked` is walked in step: each gets a window over the same range; `n` is the range's count. With
 * `vec4` (the same kernel over vec4 bindings), a range whose count is a multiple of 4 runs that instead,
 * with `n` = count / 4.
 */
function flatRun<D extends KernelDecl>(
  gpu: Gpu,
  k: D,
  defs: Defs,
  n: number,
  walked: BindingArgs<D, Tensor>,
  uniforms: Omit<UniformArgs<D>, 'n'>,
  vec4?: Omit<D, 'entry'> & { entry: string },
): void {
  const tensors = Object.entries(walked as Record<string, Tensor>);
  const sizes = tensors.map(([, t]) => BYTES[t.dtype]);
  for (const { start, count } of gpu.chunks(n, Math.max(...sizes), Math.min(...sizes))) {
    const bindings = Object.fromEntries(tensors.map(([name, t]) => [name, gpu.subWindow(t, start, count, BYTES[t.dtype])]));
    const lanes = vec4 && count % 4 === 0 ? 4 : 1;
    gpu.run((lanes === 4 && vec4 ? vec4 : k) as D, {
      defs: { WG, PER, ...defs },
      uniforms: { ...uniforms, n: count / lanes } as UniformArgs<D>,
      bindings: bindings as BindingArgs<D, Bindable>,
      workgroups: gpu.grid(Math.ceil(count / lanes / BLOCK)),
    });
  }
}

/** One operand of itemRun: a tensor split into `perItem`-element items, or a tensor bound whole. */
type ItemOperand = { items: Tensor; perItem: number } | { whole: Tensor };

const gcd = (a: number, b: number): number => (b === 0 ? a : gcd(b, a % b));

/**
 * Runs kernel `k` over `items` independent items (rows, planes, samples, matrices) in ranges that fit
 * one storage binding, for ops whose operands differ in size. Item operands get a window over the range's
 * items, whole operands the whole tensor. The shader indexes relative to the range's first item;
 * `work(count)` gives the invocation count and the uniforms of a range of `count` items. A single item
 * larger than one binding is refused.
 */
function itemRun<D extends KernelDecl>(
  gpu: Gpu,
  op: string,
  k: D,
  defs: Defs,
  items: number,
  operands: BindingArgs<D, ItemOperand>,
  work: (count: number) => { invocations: number; uniforms: UniformArgs<D> },
  perWorkgroup = BLOCK,
): void {
  const bound = Object.entries(operands as Record<string, ItemOperand>);
  const itemBytes: number[] = [];
  for (const [, b] of bound) {
    if ('whole' in b && !gpu.fitsBinding(b.whole)) throw new ShapeError(op, `${b.whole} is larger than one storage binding (${gpu.maxBinding} bytes)`);
    if ('items' in b) itemBytes.push(b.perItem * BYTES[b.items.dtype]);
  }
  const widest = Math.max(...itemBytes);
  if (widest > gpu.maxBinding) throw new ShapeError(op, `one item of ${widest} bytes is larger than one storage binding (${gpu.maxBinding} bytes)`);
  // Range starts must be aligned in every windowed operand: align to the gcd of their item sizes.
  for (const { start, count } of gpu.chunks(items, widest, itemBytes.reduce(gcd))) {
    const { invocations, uniforms } = work(count);
    const bindings = Object.fromEntries(
      bound.map(([name, b]) => [name, 'whole' in b ? b.whole : gpu.subWindow(b.items, start * b.perItem, count * b.perItem, BYTES[b.items.dtype])]),
    );
    gpu.run(k, {
      defs: { WG, PER, ...defs },
      uniforms,
      bindings: bindings as BindingArgs<D, Bindable>,
      workgroups: gpu.grid(Math.ceil(invocations / perWorkgroup)),
    });
  }
}

// ---- add / mul / scale / cast ---------------------------------------------------------------------

/** out = a + alpha * b (same shapes). */
export function add(gpu: Gpu, a: Tensor, b: Tensor, alpha = 1, out?: Tensor): Tensor {
  sameShape('add', a, b);
  expectSameDType('add', a, b);
  const o = out ?? gpu.tensor(a.shape, a.dtype, 'activations', 'add');
  flatRun(gpu, ADD, { T: a.dtype }, a.numel, { x: a, y: b, out: o }, { alpha }, ADD4);
  return o;
}

/** Backward of add: da = dy, db = alpha * dy. */
export function addBackward(gpu: Gpu, dy: Tensor, alpha = 1): { da: Tensor; db: Tensor } {
  return { da: dy, db: alpha === 1 ? dy : scale(gpu, dy, alpha) };
}

export function addRef(a: ArrayLike<number>, b: ArrayLike<number>, alpha = 1): Float32Array {
  return Float32Array.from(a, (v, i) => v + alpha * b[i]);
}

/** out = a * b element-wise (same shapes). */
export function mul(gpu: Gpu, a: Tensor, b: Tensor, alpha = 1): Tensor {
  sameShape('mul', a, b);
  expectSameDType('mul', a, b);
  const o = gpu.tensor(a.shape, a.dtype, 'activations', 'mul');
  flatRun(gpu, MUL, { T: a.dtype }, a.numel, { x: a, y: b, out: o }, { alpha });
  return o;
}

/** Backward of mul: da = dy * b, db = dy * a. */
export function mulBackward(gpu: Gpu, a: Tensor, b: Tensor, dy: Tensor): { da: Tensor; db: Tensor } {
  sameShape('mulBackward', a, dy, ['a', 'dy']);
  return { da: mul(gpu, dy, b), db: mul(gpu, dy, a) };
}

export function mulRef(a: ArrayLike<number>, b: ArrayLike<number>): Float32Array {
  return Float32Array.from(a, (v, i) => v * b[i]);
}

/** out = s * x (into `out` when given: same shape and dtype, not x). Its backward is scale(dy, s). */
export function scale(gpu: Gpu, x: Tensor, s: number, out?: Tensor): Tensor {
  if (out) {
    sameShape('scale', x, out, ['x', 'out']);
    expectSameDType('scale', x, out);
  }
  const o = out ?? gpu.tensor(x.shape, x.dtype, 'activations', 'scale');
  flatRun(gpu, SCALE, { T: x.dtype }, x.numel, { x, out: o }, { alpha: s }, SCALE4);
  return o;
}

/** Converts between f16 and f32 storage. */
export function cast(gpu: Gpu, x: Tensor, to: DType, tag = x.tag): Tensor {
  const o = gpu.tensor(x.shape, to, tag, `cast-${to}`);
  flatRun(gpu, CONVERT, { T: x.dtype, U: to }, x.numel, { x, out: o }, {});
  return o;
}

/** [times, ...x.shape]: x repeated `times` times. Its backward sums the copies (sumColumns). */
export function repeat(gpu: Gpu, x: Tensor, times: number): Tensor {
  const o = gpu.tensor([times, ...x.shape], x.dtype, 'activations', 'repeat');
  itemRun(gpu, 'repeat', REPEAT, { T: x.dtype }, times, { x: { whole: x }, out: { items: o, perItem: x.numel } }, (count) => ({
    invocations: count * x.numel,
    uniforms: { n: count * x.numel, inner: x.numel },
  }));
  return o;
}

// ---- per-channel broadcast add (time embedding into ResNet feature maps) ---------------------------

function checkChannel(op: string, x: Tensor, t: Tensor): number {
  expectSameDType(op, x, t);
  if (x.shape.length < 2 || t.numel !== x.shape[0] * x.shape[1] || t.shape.length !== 2 || t.shape[0] !== x.shape[0] || t.shape[1] !== x.shape[1])
    throw new ShapeError(op, `t must be [N,C] = [${x.shape[0]},${x.shape[1]}] for x ${fmtShape(x.shape)}, got ${fmtShape(t.shape)}`);
  return x.numel / t.numel;
}

/** t [N, S] holding x's C channels at columns [column, column + C): returns the plane size. */
function checkColumns(op: string, x: Tensor, t: Tensor, column: number): number {
  expectSameDType(op, x, t);
  const [n, c] = x.shape;
  if (x.shape.length < 2 || t.shape.length !== 2 || t.shape[0] !== n || !Number.isInteger(column) || column < 0 || column + c > t.shape[1])
    throw new ShapeError(op, `t must be [${n},S] holding columns [${column},${column + c}) for x ${fmtShape(x.shape)}, got ${fmtShape(t.shape)}`);
  return x.numel / (n * c);
}

/**
 * out[n,c,...] = x[n,c,...] + t[n,c]; with `column` (t [N, S], S >= column + C), t's columns [column, column + C):
 * one layer's slice of several layers' projections that one GEMM computed side by side (nn/unet.ts), read in place.
 */
export function addChannel(gpu: Gpu, x: Tensor, t: Tensor, column: number | null = null): Tensor {
  const inner = column === null ? checkChannel('addChannel', x, t) : checkColumns('addChannel', x, t, column);
  if (!gpu.fitsBinding(t)) throw new ShapeError('addChannel', `${t} is larger than one storage binding`);
  const o = gpu.tensor(x.shape, x.dtype, 'activations', 'addChannel');
  const bytes = BYTES[x.dtype];
  const cols = { chans: x.shape[1], t_stride: t.shape[t.shape.length - 1], t_off: column ?? 0 };
  for (const { start, count } of gpu.chunks(x.numel, bytes))
    gpu.run(ADD_CHANNEL, {
      defs: { WG, PER, T: x.dtype },
      uniforms: { n: count, inner, elem0: start, ...cols },
      bindings: { x: gpu.subWindow(x, start, count, bytes), t, out: gpu.subWindow(o, start, count, bytes) },
      workgroups: gpu.grid(Math.ceil(count / BLOCK)),
    });
  return o;
}

/** Backward of addChannel: dx = dy, dt[n,c] = sum over the plane of dy. */
export function addChannelBackward(gpu: Gpu, x: Tensor, t: Tensor, dy: Tensor): { dx: Tensor; dt: Tensor } {
  const inner = checkChannel('addChannelBackward', x, t);
  sameShape('addChannelBackward', x, dy, ['x', 'dy']);
  const dt = gpu.tensor(t.shape, t.dtype, 'gradients', 'addChannel.dt');
  const planes = { dy: { items: dy, perItem: inner }, out: { items: dt, perItem: 1 } };
  // Lanes per plane: a power of two giving each lane ~16 elements, 1 to 64 (see sum_planes in the shader).
  const shift = Math.min(6, Math.max(0, Math.floor(Math.log2(inner / 16))));
  const lanes = 2 ** shift;
  itemRun(
    gpu,
    'addChannelBackward',
    SUM_PLANES,
    { T: x.dtype },
    t.numel,
    planes,
    (count) => ({ invocations: count, uniforms: { n: count, inner, lanes, shift } }),
    WG / lanes,
  );
  return { dx: dy, dt };
}

export function addChannelRef(x: ArrayLike<number>, t: ArrayLike<number>): Float32Array {
  const inner = x.length / t.length;
  return Float32Array.from(x, (v, i) => v + t[Math.floor(i / inner)]);
}

export function addChannelBackwardRef(dy: ArrayLike<number>, planes: number): Float32Array {
  const inner = dy.length / planes;
  const dt = new Float32Array(planes);
  for (let i = 0; i < dy.length; i++) dt[Math.floor(i / inner)] += dy[i];
  return dt;
}

// ---- activations -------------------------------------------------------------------------------------

export type Activation = 'silu' | 'gelu' | 'quickGelu';
const ACT_ID: Record<Activation, number> = { silu: 0, gelu: 1, quickGelu: 2 };

/** y = f(x) for SiLU, GELU (exact erf form) or quick-GELU. */
export function activation(gpu: Gpu, kind: Activation, x: Tensor): Tensor {
  const o = gpu.tensor(x.shape, x.dtype, 'activations', kind);
  flatRun(gpu, ACT_FWD, { T: x.dtype, ACT: ACT_ID[kind] }, x.numel, { x, out: o }, {}, ACT_FWD4);
  return o;
}

/** dx = dy * f'(x), from the forward input x. */
export function activationBackward(gpu: Gpu, kind: Activation, x: Tensor, dy: Tensor): Tensor {
  sameShape(`${kind}Backward`, x, dy, ['x', 'dy']);
  expectSameDType(`${kind}Backward`, x, dy);
  const dx = gpu.tensor(x.shape, x.dtype, 'gradients', `${kind}.dx`);
  flatRun(gpu, ACT_BWD, { T: x.dtype, ACT: ACT_ID[kind] }, x.numel, { x, dy, dx }, {}, ACT_BWD4);
  return dx;
}

export const silu = (gpu: Gpu, x: Tensor) => activation(gpu, 'silu', x);
export const gelu = (gpu: Gpu, x: Tensor) => activation(gpu, 'gelu', x);
export const quickGelu = (gpu: Gpu, x: Tensor) => activation(gpu, 'quickGelu', x);

const sigmoid = (v: number) => 1 / (1 + Math.exp(-v));

/**
 * erfc(a) for a >= 0 in float64, independent of the shader's fit: below 2.5 as 1 - erf from the
 * all-positive series erf(a) = 2/sqrt(pi) e^(-a^2) sum_n (2a^2)^n a / (1*3*...*(2n+1)); from 2.5 on
 * by the continued fraction erfc(a) = e^(-a^2)/sqrt(pi) / (a + (1/2)/(a + 1/(a + (3/2)/(a + ...)))).
 * Relative error ~1e-13 or better everywhere.
 */
export function erfcRef(a: number): number {
  if (a < 2.5) {
    let term = a;
    let sum = a;
    for (let n = 1; term > 1e-17 * sum; n++) {
      term *= (2 * a * a) / (2 * n + 1);
      sum += term;
    }
    return 1 - (2 / Math.sqrt(Math.PI)) * Math.exp(-a * a) * sum;
  }
  let frac = a;
  for (let k = 80; k >= 1; k--) frac = a + k / 2 / frac;
  return Math.exp(-a * a) / Math.sqrt(Math.PI) / frac;
}

/** Standard normal CDF Phi(v), with relative precision in the negative tail. */
export function normalCdfRef(v: number): number {
  const tail = 0.5 * erfcRef(Math.abs(v) / Math.SQRT2);
  return v < 0 ? tail : 1 - tail;
}

export function activationRef(kind: Activation, v: number): number {
  if (kind === 'silu') return v * sigmoid(v);
  if (kind === 'gelu') return v * normalCdfRef(v);
  return v * sigmoid(1.702 * v);
}

export function activationGradRef(kind: Activation, v: number): number {
  if (kind === 'silu') {
    const s = sigmoid(v);
    return s + v * s * (1 - s);
  }
  if (kind === 'gelu') return normalCdfRef(v) + (v * Math.exp(-0.5 * v * v)) / Math.sqrt(2 * Math.PI);
  const s = sigmoid(1.702 * v);
  return s + 1.702 * v * s * (1 - s);
}

// ---- GEGLU ---------------------------------------------------------------------------------------

function gegluWidth(op: string, x: Tensor): number {
  const last = x.shape[x.shape.length - 1];
  if (x.shape.length < 1 || last % 2 !== 0) throw new ShapeError(op, `last dim of x ${fmtShape(x.shape)} must be even (hidden and gate halves)`);
  return last / 2;
}

/** GEGLU: x [..., 2F] -> hidden * gelu(gate), [..., F] (diffusers' GEGLU after its projection). */
export function geglu(gpu: Gpu, x: Tensor): Tensor {
  const f = gegluWidth('geglu', x);
  const o = gpu.tensor([...x.shape.slice(0, -1), f], x.dtype, 'activations', 'geglu');
  const rows = { x: { items: x, perItem: 2 * f }, out: { items: o, perItem: f } };
  itemRun(gpu, 'geglu', GEGLU_FWD, { T: x.dtype, ACT: ACT_ID.gelu }, o.numel / f, rows, (count) => ({
    invocations: count * f,
    uniforms: { n: count * f, f },
  }));
  return o;
}

/** Backward of geglu: dx [..., 2F] from the forward input x and dy [..., F]. */
export function gegluBackward(gpu: Gpu, x: Tensor, dy: Tensor): Tensor {
  const f = gegluWidth('gegluBackward', x);
  expectSameDType('gegluBackward', x, dy);
  if (dy.numel * 2 !== x.numel || dy.shape[dy.shape.length - 1] !== f)
    throw new ShapeError('gegluBackward', `dy must be [...,${f}] for x ${fmtShape(x.shape)}, got ${fmtShape(dy.shape)}`);
  const dx = gpu.tensor(x.shape, x.dtype, 'gradients', 'geglu.dx');
  const rows = { x: { items: x, perItem: 2 * f }, dy: { items: dy, perItem: f }, dx: { items: dx, perItem: 2 * f } };
  itemRun(gpu, 'gegluBackward', GEGLU_BWD, { T: x.dtype, ACT: ACT_ID.gelu }, dy.numel / f, rows, (count) => ({
    invocations: count * 2 * f,
    uniforms: { n: count * 2 * f, f },
  }));
  return dx;
}

export function gegluRef(x: ArrayLike<number>, f: number): Float32Array {
  const rows = x.length / (2 * f);
  const out = new Float32Array(rows * f);
  for (let r = 0; r < rows; r++) for (let j = 0; j < f; j++) out[r * f + j] = x[r * 2 * f + j] * activationRef('gelu', x[r * 2 * f + f + j]);
  return out;
}

export function gegluBackwardRef(x: ArrayLike<number>, dy: ArrayLike<number>, f: number): Float32Array {
  const rows = x.length / (2 * f);
  const dx = new Float32Array(x.length);
  for (let r = 0; r < rows; r++)
    for (let j = 0; j < f; j++) {
      const h = x[r * 2 * f + j];
      const g = x[r * 2 * f + f + j];
      dx[r * 2 * f + j] = dy[r * f + j] * activationRef('gelu', g);
      dx[r * 2 * f + f + j] = dy[r * f + j] * h * activationGradRef('gelu', g);
    }
  return dx;
}

// ---- nearest 2x upsample --------------------------------------------------------------------------

/** Nearest-neighbour 2x upsample of x [N, C, H, W] -> [N, C, 2H, 2W]. */
export function upsample2x(gpu: Gpu, x: Tensor): Tensor {
  if (x.shape.length !== 4) throw new ShapeError('upsample2x', `x must be [N,C,H,W], got ${fmtShape(x.shape)}`);
  const [n, c, h, w] = x.shape;
  const o = gpu.tensor([n, c, 2 * h, 2 * w], x.dtype, 'activations', 'upsample2x');
  const planes = { x: { items: x, perItem: h * w }, out: { items: o, perItem: 4 * h * w } };
  itemRun(gpu, 'upsample2x', UPSAMPLE_FWD, { T: x.dtype }, n * c, planes, (count) => ({
    invocations: count * 4 * h * w,
    uniforms: { n: count * 4 * h * w, ow: 2 * w, oh: 2 * h },
  }));
  return o;
}

/** Backward of upsample2x: dx [N, C, H, W] sums each 2x2 block of dy. */
export function upsample2xBackward(gpu: Gpu, x: Tensor, dy: Tensor): Tensor {
  const [n, c, h, w] = x.shape;
  if (dy.shape.length !== 4 || dy.shape[0] !== n || dy.shape[1] !== c || dy.shape[2] !== 2 * h || dy.shape[3] !== 2 * w)
    throw new ShapeError('upsample2xBackward', `dy must be [${n},${c},${2 * h},${2 * w}] for x ${fmtShape(x.shape)}, got ${fmtShape(dy.shape)}`);
  expectSameDType('upsample2xBackward', x, dy);
  const dx = gpu.tensor(x.shape, x.dtype, 'gradients', 'upsample2x.dx');
  const planes = { dy: { items: dy, perItem: 4 * h * w }, dx: { items: dx, perItem: h * w } };
  itemRun(gpu, 'upsample2xBackward', UPSAMPLE_BWD, { T: x.dtype }, n * c, planes, (count) => ({
    invocations: count * h * w,
    uniforms: { n: count * h * w, w, h },
  }));
  return dx;
}

export function upsample2xRef(x: ArrayLike<number>, shape: readonly number[]): Float32Array {
  const [n, c, h, w] = shape;
  const out = new Float32Array(n * c * 4 * h * w);
  for (let p = 0; p < n * c; p++)
    for (let y = 0; y < 2 * h; y++) for (let xx = 0; xx < 2 * w; xx++) out[(p * 2 * h + y) * 2 * w + xx] = x[(p * h + (y >> 1)) * w + (xx >> 1)];
  return out;
}

export function upsample2xBackwardRef(dy: ArrayLike<number>, shape: readonly number[]): Float32Array {
  const [n, c, h, w] = shape;
  const dx = new Float32Array(n * c * h * w);
  for (let p = 0; p < n * c; p++)
    for (let y = 0; y < 2 * h; y++) for (let xx = 0; xx < 2 * w; xx++) dx[(p * h + (y >> 1)) * w + (xx >> 1)] += dy[(p * 2 * h + y) * 2 * w + xx];
  return dx;
}

// ---- zero padding ---------------------------------------------------------------------------------

export interface Pad2d {
  top: number;
  bottom: number;
  left: number;
  right: number;
}

/** pad2d's shape uniforms for `n` walked elements of planes [H, W] padded to [OH, OW]. */
function padShape(n: number, h: number, w: number, pad: Pad2d) {
  return { n, h, w, oh: h + pad.top + pad.bottom, ow: w + pad.left + pad.right, top: pad.top, left: pad.left };
}

/** Zero-pads the H and W of x [N, C, H, W] (e.g. (0, 1, 0, 1) before the VAE's stride-2 conv). */
export function pad2d(gpu: Gpu, x: Tensor, pad: Pad2d): Tensor {
  if (x.shape.length !== 4) throw new ShapeError('pad2d', `x must be [N,C,H,W], got ${fmtShape(x.shape)}`);
  const [n, c, h, w] = x.shape;
  const o = gpu.tensor([n, c, h + pad.top + pad.bottom, w + pad.left + pad.right], x.dtype, 'activations', 'pad2d');
  const outPlane = o.shape[2] * o.shape[3];
  const planes = { x: { items: x, perItem: h * w }, out: { items: o, perItem: outPlane } };
  itemRun(gpu, 'pad2d', PAD2D, { T: x.dtype }, n * c, planes, (count) => ({
    invocations: count * outPlane,
    uniforms: padShape(count * outPlane, h, w, pad),
  }));
  return o;
}

/** Backward of pad2d: dx = the interior of dy. */
export function pad2dBackward(gpu: Gpu, x: Tensor, dy: Tensor, pad: Pad2d): Tensor {
  const [n, c, h, w] = x.shape;
  const want = [n, c, h + pad.top + pad.bottom, w + pad.left + pad.right];
  if (dy.shape.length !== 4 || dy.shape.some((d, i) => d !== want[i]))
    throw new ShapeError('pad2dBackward', `dy must be ${fmtShape(want)}, got ${fmtShape(dy.shape)}`);
  const dx = gpu.tensor(x.shape, x.dtype, 'gradients', 'pad2d.dx');
  const planes = { dy: { items: dy, perItem: want[2] * want[3] }, dx: { items: dx, perItem: h * w } };
  itemRun(gpu, 'pad2dBackward', PAD2D_CROP, { T: x.dtype }, n * c, planes, (count) => ({
    invocations: count * h * w,
    uniforms: padShape(count * h * w, h, w, pad),
  }));
  return dx;
}

export function pad2dRef(x: ArrayLike<number>, shape: readonly number[], pad: Pad2d): Float32Array {
  const [n, c, h, w] = shape;
  const oh = h + pad.top + pad.bottom;
  const ow = w + pad.left + pad.right;
  const out = new Float32Array(n * c * oh * ow);
  for (let p = 0; p < n * c; p++)
    for (let y = 0; y < h; y++) for (let xx = 0; xx < w; xx++) out[(p * oh + y + pad.top) * ow + xx + pad.left] = x[(p * h + y) * w + xx];
  return out;
}

// ---- layout moves: transpose and channel concat/split ------------------------------------------------

/** Swaps the last two dims: x [..., R, C] -> [..., C, R] (e.g. NCHW viewed [N, C, HW] -> tokens [N, HW, C]). */
export function transpose2d(gpu: Gpu, x: Tensor): Tensor {
  if (x.shape.length < 2) throw new ShapeError('transpose2d', `x needs two dims to swap, got ${fmtShape(x.shape)}`);
  const [r, c] = x.shape.slice(-2);
  const o = gpu.tensor([...x.shape.slice(0, -2), c, r], x.dtype, 'activations', 'transpose2d');
  const mats = { x: { items: x, perItem: r * c }, out: { items: o, perItem: r * c } };
  itemRun(gpu, 'transpose2d', TRANSPOSE2D, { T: x.dtype }, x.numel / (r * c), mats, (count) => ({
    invocations: count * r * c,
    uniforms: { n: count * r * c, rows: r, cols: c },
  }));
  return o;
}

/** out [N, Cx + Cy, ...] = x and y stacked along channels. Backward: splitChannels of out's gradient. */
export function concatChannels(gpu: Gpu, x: Tensor, y: Tensor): Tensor {
  expectSameDType('concatChannels', x, y);
  if (x.shape.length < 2 || y.shape.length !== x.shape.length || x.shape[0] !== y.shape[0] || x.shape.slice(2).some((d, i) => d !== y.shape[i + 2]))
    throw new ShapeError('concatChannels', `x ${fmtShape(x.shape)} and y ${fmtShape(y.shape)} differ outside the channel dim`);
  const inner = x.shape.slice(2).reduce((a, b) => a * b, 1);
  const o = gpu.tensor([x.shape[0], x.shape[1] + y.shape[1], ...x.shape.slice(2)], x.dtype, 'activations', 'concat');
  const [cx, cy] = [x.shape[1], y.shape[1]];
  const samples = {
    x: { items: x, perItem: cx * inner },
    y: { items: y, perItem: cy * inner },
    out: { items: o, perItem: (cx + cy) * inner },
  };
  itemRun(gpu, 'concatChannels', CONCAT_CHANNELS, { T: x.dtype }, x.shape[0], samples, (count) => ({
    invocations: count * (cx + cy) * inner,
    uniforms: { n: count * (cx + cy) * inner, cx, cy, inner },
  }));
  return o;
}

/** Channels [first, first + count) of x [N, C, ...]. */
export function splitChannels(gpu: Gpu, x: Tensor, first: number, count: number): Tensor {
  if (x.shape.length < 2 || first < 0 || count < 1 || first + count > x.shape[1])
    throw new ShapeError('splitChannels', `channels [${first}, ${first + count}) are not inside x ${fmtShape(x.shape)}`);
  const inner = x.shape.slice(2).reduce((a, b) => a * b, 1);
  const o = gpu.tensor([x.shape[0], count, ...x.shape.slice(2)], x.dtype, 'activations', 'split');
  const c = x.shape[1];
  const samples = { x: { items: x, perItem: c * inner }, out: { items: o, perItem: count * inner } };
  itemRun(gpu, 'splitChannels', SPLIT_CHANNELS, { T: x.dtype }, x.shape[0], samples, (n) => ({
    invocations: n * count * inner,
    uniforms: { n: n * count * inner, first, count, inner, total: c },
  }));
  return o;
}

// ---- timestep embedding -----------------------------------------------------------------------------

/** Sinusoidal embedding of timesteps t [B] (f32) -> [B, dim] in `dtype` (SD UNet's time_proj). */
export function timestepEmbedding(gpu: Gpu, t: Tensor, dim: number, dtype: DType): Tensor {
  expectDType('timestepEmbedding', t, 'f32', 'timesteps');
  if (t.shape.length !== 1) throw new ShapeError('timestepEmbedding', `timesteps must be [B], got ${fmtShape(t.shape)}`);
  const o = gpu.tensor([t.shape[0], dim], dtype, 'activations', 'timestepEmbedding');
  const rows = { timesteps: { items: t, perItem: 1 }, out: { items: o, perItem: dim } };
  itemRun(gpu, 'timestepEmbedding', TIMESTEP_EMBEDDING, { T: dtype }, t.shape[0], rows, (count) => ({
    invocations: count * dim,
    uniforms: { n: count * dim, dim },
  }));
  return o;
}

export function timestepEmbeddingRef(t: ArrayLike<number>, dim: number): Float32Array {
  const half = Math.floor(dim / 2);
  const out = new Float32Array(t.length * dim);
  for (let b = 0; b < t.length; b++)
    for (let k = 0; k < half; k++) {
      const arg = t[b] * Math.exp((-Math.log(10000) * k) / half);
      out[b * dim + k] = Math.cos(arg);
      out[b * dim + half + k] = Math.sin(arg);
    }
  return out;
}
