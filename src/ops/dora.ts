// DoRA's magnitude scale (weight-decomposed LoRA, Liu et al. 2024, as LyCORIS trains it and ComfyUI / A1111
// merge it): per column j of an adapted weight V = W + s ΔW, c_j = m_j / (||V_:,j|| + eps), given the squared
// column norms ss_j = ||V_:,j||^2 (the caller sums them with GEMMs) and the trained magnitudes m_j. The layer then
// runs with V c (each column scaled). Forward and backward side by side; math in shaders/dora.wgsl.
import type { Gpu } from '../gpu/device.ts';
import { fmtShape, ShapeError } from '../gpu/errors.ts';
import { f32, kernel, read, u32, write } from '../gpu/kernel.ts';
import { expectSameDType, type Tensor } from '../gpu/tensor.ts';

const WG = 64;
const N = u32('n');
const EPS = f32('eps');
const FWD = kernel({ shader: 'dora', entry: 'dora_scale_fwd', uniforms: [N, EPS], bindings: [read('m'), read('ss'), write('out')] });
const BWD = kernel({
  shader: 'dora',
  entry: 'dora_scale_bwd',
  uniforms: [N, EPS],
  bindings: [read('m'), read('ss'), read('dc'), write('dm'), write('dss')],
});

/** f32's machine epsilon: LyCORIS and ComfyUI add torch.finfo(float32).eps to the norm. */
export const DORA_EPS = 2 ** -23;

function check(op: string, ...ts: Tensor[]): void {
  expectSameDType(op, ts[0], ts[1]);
  for (const t of ts.slice(1)) if (t.numel !== ts[0].numel) throw new ShapeError(op, `sizes differ: ${fmtShape(ts[0].shape)} vs ${fmtShape(t.shape)}`);
  if (!ts[0].numel) throw new ShapeError(op, 'empty magnitudes');
}

/** c = m / (sqrt(ss) + eps), element-wise, m's shape. */
export function doraScale(gpu: Gpu, m: Tensor, ss: Tensor, eps = DORA_EPS): Tensor {
  check('doraScale', m, ss);
  const out = gpu.tensor(m.shape, m.dtype, 'scratch', 'doraScale');
  gpu.run(FWD, { defs: { T: m.dtype, WG }, uniforms: { n: m.numel, eps }, bindings: { m, ss, out }, workgroups: gpu.grid(Math.ceil(m.numel / WG)) });
  return out;
}

/** The gradients of doraScale for an upstream dc: dm = dc / n, dss = -dc m / (2 n^2 sqrt(ss)) with n = sqrt(ss) + eps. */
export function doraScaleBackward(gpu: Gpu, m: Tensor, ss: Tensor, dc: Tensor, eps = DORA_EPS): { dm: Tensor; dss: Tensor } {
  check('doraScaleBackward', m, ss, dc);
  const dm = gpu.tensor(m.shape, m.dtype, 'gradients', 'doraScale.dm');
  const dss = gpu.tensor(ss.shape, ss.dtype, 'gradients', 'doraScale.dss');
  gpu.run(BWD, {
    defs: { T: m.dtype, WG },
    uniforms: { n: m.numel, eps },
    bindings: { m, ss, dc, dm, dss },
    workgroups: gpu.grid(Math.ceil(m.numel / WG)),
  });
  return { dm, dss };
}

export function doraScaleRef(m: ArrayLike<number>, ss: ArrayLike<number>, eps = DORA_EPS): Float32Array {
  return Float32Array.from(m, (v, i) => v / (Math.sqrt(ss[i]) + eps));
}

export function doraScaleBackwardRef(
  m: ArrayLike<number>,
  ss: ArrayLike<number>,
  dc: ArrayLike<number>,
  eps = DORA_EPS,
): { dm: Float32Array; dss: Float32Array } {
  const dm = new Float32Array(m.length);
  const dss = new Float32Array(m.length);
  for (let i = 0; i < m.length; i++) {
    const r = Math.sqrt(ss[i]);
    const n = r + eps;
    dm[i] = dc[i] / n;
    dss[i] = r > 0 ? (-dc[i] * m[i]) / (n * n) / (2 * r) : 0;
  }
  return { dm, dss };
}
