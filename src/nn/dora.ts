// DoRA (weight-decomposed low-rank adaptation, Liu et al. 2024) on top of a LyCORIS network (nn/lycoris.ts), as
// LyCORIS trains it (`dora_wd`) and ComfyUI (weight_decompose) and A1111 (apply_weight_decompose) merge it: the
// adapted weight V = W + s ΔW [out, in(, kh, kw)] is split into a direction and a trained magnitude per INPUT
// channel j (LyCORIS' default axis; its file's dora_scale is [1, in] or a conv's [1, in, 1, 1]):
//   W' = V m_j / (||V_:,j|| + eps),   ||V_:,j||^2 = sum over the outputs o and kernel taps t of V[o, j, t]^2,
// m starting at W's own column norms, so the first step's layer is the base model's (up to eps ~ 1e-7).
// All under the tape with the engine's GEMM and element-wise ops: the squares by a Hadamard product, the column
// sums and the broadcasts by GEMMs with ones, m / (norm + eps) by ops/dora.ts; the gradient reaches m and, through
// V, the network's factors (golden-tested against PyTorch autograd: tests/fixtures/train/gen_lycoris.py).
import type { Gpu } from '../gpu/device.ts';
import type { Tensor } from '../gpu/tensor.ts';
import { doraScale, doraScaleBackward } from '../ops/dora.ts';
import { mul } from '../ops/elementwise.ts';
import { sumColumns } from '../ops/reduce.ts';
import { weight, type Weights } from './blocks.ts';
import { hadamard } from './lycoris.ts';
import type { Ops } from './ops.ts';

/** c = m / (sqrt(ss) + eps) under F's tape (ops/dora.ts); c is freed once its backward ran. */
function magnitudeScale(F: Ops, m: Tensor, ss: Tensor): Tensor {
  const c = doraScale(F.gpu, m, ss);
  const tape = F.tape;
  if (!tape) return c;
  tape.derive(c, [m, ss]);
  tape.record(() => {
    const dc = tape.take(c);
    if (dc) {
      const g = doraScaleBackward(F.gpu, m, ss, dc);
      if (tape.needs(m)) tape.acc(m, g.dm);
      else F.gpu.free(g.dm);
      if (tape.needs(ss)) tape.acc(ss, g.dss);
      else F.gpu.free(g.dss);
      tape.release(dc);
    }
    F.gpu.free(c);
  });
  return c;
}

/** The weight-decomposed weight W' = V m / (column norm of V + eps), V's shape, for magnitudes m [1, in]. */
export function doraWeight(F: Ops, v: Tensor, m: Tensor): Tensor {
  const [out, inC] = v.shape;
  const taps = v.numel / (out * inC);
  const k = inC * taps;
  const ones = (rows: number, cols: number) => F.constant(F.gpu.upload(new Float32Array(rows * cols).fill(1), [rows, cols], v.dtype, 'weights', 'dora-ones'));
  const [onesOut, colOnes, tapOnes, rowOnes] = [ones(1, out), ones(out, 1), ones(taps, 1), ones(1, taps)];
  const sq = hadamard(F, v, v);
  // ss_j: the squares summed over the outputs, then over the taps of each input channel (a conv's kernel)
  const colSq = F.matmul(onesOut, F.reshape(sq, [out, k]));
  const grouped = taps === 1 ? null : F.matmul(F.reshape(colSq, [inC, taps]), tapOnes);
  const c = magnitudeScale(F, m, grouped ? F.reshape(grouped, [1, inC]) : colSq);
  // c over every tap of its channel, then over every output: the factor V is multiplied by, V's shape
  const spread = taps === 1 ? null : F.matmul(F.reshape(c, [inC, 1]), rowOnes);
  const full = F.matmul(colOnes, spread ? F.reshape(spread, [1, k]) : c);
  const y = hadamard(F, v, F.reshape(full, v.shape));
  F.release(sq, colSq, grouped, c, spread, full, onesOut, colOnes, tapOnes, rowOnes);
  return y;
}

/**
 * LyCORIS' starting magnitudes: each adapted layer's column norms of W (per input channel, over the outputs and
 * kernel taps) as `<layer>.dora_scale` [1, in], computed on the GPU and read back (one number per channel).
 */
export async function doraMagnitudes(gpu: Gpu, w: Weights, layers: Iterable<string>): Promise<Map<string, Float32Array>> {
  const out = new Map<string, Float32Array>();
  for (const layer of layers) {
    const base = weight(w, `${layer}.weight`);
    const [rows, inC] = base.shape;
    const taps = base.numel / (rows * inC);
    const flat = base.reshape([rows, inC * taps]);
    const sq = mul(gpu, flat, flat);
    const cols = sumColumns(gpu, sq);
    gpu.free(sq);
    const s = await gpu.read(cols);
    gpu.free(cols);
    const m = new Float32Array(inC);
    for (let j = 0; j < inC; j++) {
      let t = 0;
      for (let q = 0; q < taps; q++) t += s[j * taps + q];
      m[j] = Math.sqrt(t);
    }
    out.set(`${layer}.dora_scale`, m);
  }
  return out;
}
