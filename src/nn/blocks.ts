// Building blocks shared by the VAE and the UNet, forward: the ResNet block and the single-head
// channel-first spatial self-attention of the VAE's mid block. Weights by diffusers names.
import { ShapeError } from '../gpu/errors.ts';
import { Tensor } from '../gpu/tensor.ts';
import { isInt8 } from '../ops/int8.ts';
import { networkWeight } from './lycoris.ts';
import type { Ops } from './ops.ts';

export type Weights = Map<string, Tensor>;

export function weight(weights: Weights, name: string): Tensor {
  const t = weights.get(name);
  if (!t) throw new ShapeError('weights', `missing tensor ${name}`);
  return t;
}

/** GroupNorm then SiLU, in one kernel each way (Ops.groupNormSilu). */
export function normSilu(F: Ops, x: Tensor, weights: Weights, prefix: string, groups: number, eps: number): Tensor {
  return F.groupNormSilu(x, weight(weights, `${prefix}.weight`), weight(weights, `${prefix}.bias`), groups, eps);
}

/** Conv by weight name; padding defaults to 1 for 3x3 stride-1 convs and 0 otherwise (the VAE pads itself). */
export function conv(F: Ops, x: Tensor, weights: Weights, prefix: string, stride: 1 | 2 = 1, padding?: number): Tensor {
  // A LyCORIS-adapted conv (LoCon, LoHa, LoKr) runs with its materialised weight W + ΔW (nn/lycoris.ts)
  const adapted = networkWeight(F, weights, prefix);
  const w = adapted ?? weight(weights, `${prefix}.weight`);
  const y = F.conv(x, w, weights.get(`${prefix}.bias`) ?? null, { stride, padding: padding ?? (w.shape[2] === 3 && stride === 1 ? 1 : 0) });
  if (adapted) F.release(adapted);
  return y;
}

/** Layers that run with their stored weights: nothing under their names but weight and bias (no LyCORIS or DoRA factors). */
function plainLayers(weights: Weights, layers: string[]): boolean {
  for (const name of weights.keys()) if (layers.some((l) => name.startsWith(`${l}.`) && name !== `${l}.weight` && name !== `${l}.bias`)) return false;
  return true;
}

/**
 * diffusers ResnetBlock2D: h = conv1(silu(norm1(x))) (+ time_emb_proj(silu(temb)) per channel),
 * h = conv2(silu(norm2(h))), out = shortcut(x) + h (shortcut = 1x1 conv_shortcut when channels change).
 * `tembProj` is the already projected [N, C_out] time embedding, or null (VAE).
 */
export function resnetForward(
  F: Ops,
  x: Tensor,
  weights: Weights,
  prefix: string,
  groups: number,
  eps: number,
  /** [N, C_out], or columns [column, column + C_out) of all the ResNets' projections [N, S] (nn/unet.ts) */
  tembProj: Tensor | { t: Tensor; column: number } | null = null,
): Tensor {
  const a = normSilu(F, x, weights, `${prefix}.norm1`, groups, eps);
  let h = conv(F, a, weights, `${prefix}.conv1`);
  F.release(a);
  if (tembProj) {
    const ht = tembProj instanceof Tensor ? F.addChannel(h, tembProj) : F.addChannel(h, tembProj.t, tembProj.column);
    F.release(h);
    h = ht;
  }
  const b = normSilu(F, h, weights, `${prefix}.norm2`, groups, eps);
  F.release(h);
  const sw = weights.get(`${prefix}.conv_shortcut.weight`);
  if (sw && sw.shape[2] === 1 && sw.shape[3] === 1 && !isInt8(sw) && plainLayers(weights, [`${prefix}.conv2`, `${prefix}.conv_shortcut`])) {
    // The 1x1 shortcut's GEMM adds into conv2's output in its epilogue: no add pass, the same bits.
    const w2 = weight(weights, `${prefix}.conv2.weight`);
    const out = F.convAddPointwise(
      b,
      w2,
      weights.get(`${prefix}.conv2.bias`) ?? null,
      { stride: 1, padding: w2.shape[2] === 3 ? 1 : 0 },
      x,
      sw,
      weights.get(`${prefix}.conv_shortcut.bias`) ?? null,
    );
    F.release(b);
    return out;
  }
  const h2 = conv(F, b, weights, `${prefix}.conv2`);
  F.release(b);
  const short = sw ? conv(F, x, weights, `${prefix}.conv_shortcut`) : x;
  const out = F.add(short, h2);
  F.release(h2);
  if (short !== x) F.release(short);
  return out;
}

/** W [C, C] applied to channel-first x [N, C, P] plus a per-channel bias (one row per sample): [N, C, P]. */
function channelLinear(F: Ops, x: Tensor, w: Tensor, b: Tensor, n: number, p: number): Tensor {
  const c = w.shape[0];
  // A [C, C] weight is used as it is: a reshaped view would be a different tensor to the tape, which (with a
  // trainable set) treats an unknown 'weights' tensor as frozen, and the weight would never get its gradient.
  const y = F.matmul(w.shape.length === 2 ? w : F.reshape(w, [c, w.numel / c]), x);
  const bias = F.repeat(b, n);
  const out = F.addChannel(F.reshape(y, [n, c, p]), bias);
  F.release(y, bias);
  return out;
}

/**
 * The VAE's mid-block attention (one head over all channels): out = x + to_out(softmax(q^T k / sqrt(C)) v)
 * with q, k, v = 1x1 projections of group_norm(x), computed channel-first so no transpose is needed:
 * S = q^T k [N, P, P], O^T = v P^T [N, C, P]. Materialises S (C = 512 is past the flash kernel's head
 * dims; the VAE runs once per image, not in the training loop).
 */
export function vaeAttentionForward(F: Ops, x: Tensor, weights: Weights, prefix: string, groups: number, eps: number): Tensor {
  const [n, c, h, w] = x.shape;
  const p = h * w;
  const g = F.groupNorm(x, weight(weights, `${prefix}.group_norm.weight`), weight(weights, `${prefix}.group_norm.bias`), groups, eps);
  const xn = F.reshape(g, [n, c, p]);
  const proj = (name: string) => channelLinear(F, xn, weight(weights, `${prefix}.${name}.weight`), weight(weights, `${prefix}.${name}.bias`), n, p);
  const [q, k, v] = [proj('to_q'), proj('to_k'), proj('to_v')];
  F.release(g);
  const sRaw = F.matmul(q, k, { transA: true }); // [N, P, P]
  const s = F.scale(sRaw, 1 / Math.sqrt(c));
  const probs = F.softmax(s);
  const oT = F.matmul(v, probs, { transB: true }); // [N, C, P]
  F.release(q, k, v, sRaw, s, probs);
  const o = channelLinear(F, oT, weight(weights, `${prefix}.to_out.0.weight`), weight(weights, `${prefix}.to_out.0.bias`), n, p);
  F.release(oT);
  const out = F.add(x, F.reshape(o, x.shape));
  F.release(o);
  return out;
}
