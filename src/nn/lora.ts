// LoRA adapters (PEFT layout) shared by the UNet and the CLIP text encoder. A base linear layer
// y = x W^T + b (W [out, in]) gets a rank-r update ΔW = (alpha / r) B A with A [r, in] and B [out, r]:
//   y = x W^T + b + (alpha / r) (x A^T) B^T,
// computed as two thin matmuls (x A^T is [.., r]) rather than forming ΔW. Only A and B train; the
// base weights stay frozen. Tensor names follow PEFT/diffusers: `<layer>.lora_A.weight` and
// `<layer>.lora_B.weight` beside `<layer>.weight`.
import { ShapeError } from '../gpu/errors.ts';
import { BYTES, Tensor } from '../gpu/tensor.ts';
import { isInt8 } from '../ops/int8.ts';
import { weight, type Weights } from './blocks.ts';
import { networkWeight } from './lycoris.ts';
import type { Ops } from './ops.ts';

/**
 * A linear layer with an optional LoRA adapter: y = x W^T (+ b) + loraScale (x A^T) B^T, where
 * loraScale = alpha / r. Without `<layer>.lora_A.weight` in `w` it is exactly F.linear. Under a tape the
 * two adapter matmuls record their backward like any other op, so the adapters receive
 *   dB = loraScale dy^T (x A^T)   and   dA = loraScale (dy B)^T x
 * (summed over tokens) and x receives the adapter's share loraScale (dy B) A on top of dy W.
 */
export function loraLinear(F: Ops, x: Tensor, w: Weights, layer: string, loraScale: number, withBias = false): Tensor {
  const a = w.get(`${layer}.lora_A.weight`);
  const bias = withBias ? weight(w, `${layer}.bias`) : null;
  // LoHa / LoKr factors or DoRA: the layer runs with its materialised weight (nn/lycoris.ts)
  const adapted = a && !w.has(`${layer}.dora_scale`) ? null : networkWeight(F, w, layer);
  if (adapted) {
    const y = F.linear(x, adapted, bias);
    F.release(adapted);
    return y;
  }
  // alpha = rank makes the scale 1: the up projection adds into y in its GEMM's epilogue (Ops.loraLinear, the
  // same bits as the unfused ops below, one dispatch fewer each way)
  if (a && loraScale === 1) return F.loraLinear(x, weight(w, `${layer}.weight`), bias, a, weight(w, `${layer}.lora_B.weight`));
  const y = F.linear(x, weight(w, `${layer}.weight`), bias);
  if (!a) {
    if (w.has(`${layer}.lora_B.weight`)) throw new ShapeError('lora', `${layer} has lora_B but no lora_A`);
    return y;
  }
  const down = F.linear(x, a);
  const up = F.linear(down, weight(w, `${layer}.lora_B.weight`));
  const scaled = F.scale(up, loraScale);
  const out = F.add(y, scaled);
  F.release(y, down, up, scaled);
  return out;
}

/** The tensors a layer may have for loraLinearGroup: anything else (LyCORIS factors, DoRA, a bias) keeps it separate. */
const PLAIN = new Set(['weight', 'lora_A.weight', 'lora_B.weight']);

/**
 * Linear layers over the same x (q, k, v of self-attention; k, v of cross-attention) as one GEMM (Ops.linearGroup),
 * when their frozen weights lie end to end in one allocation in `layers` order (models/load.ts allocateWeights) and
 * each has no adapter or a plain LoRA pair at scale 1. Layer i's output is `ys[i]`, a view of `owner` (release it
 * after them). Null where any of that does not hold (trained base weights, int8, LyCORIS, DoRA, alpha != rank,
 * weights not loaded grouped, an output slice not at a bindable offset): run loraLinear per layer.
 */
export function loraLinearGroup(F: Ops, x: Tensor, w: Weights, layers: readonly string[], loraScale: number): { ys: Tensor[]; owner: Tensor } | null {
  const ws: Tensor[] = [];
  for (const l of layers) {
    const t = w.get(`${l}.weight`);
    if (!t || t.shape.length !== 2 || isInt8(t) || t.dtype !== x.dtype || !F.frozen(t)) return null;
    ws.push(t);
  }
  const [first] = ws;
  // Each layer's output is a view bound on its own (attention binds q, k, v whole), so every slice must start at
  // an offset the adapter can bind: 256 bytes on most browsers' adapters; cross-attention's 77 tokens at batch 1
  // often are not, and keep the separate GEMMs.
  const slice = (x.numel / first.shape[1]) * first.shape[0] * BYTES[x.dtype];
  if (slice % F.gpu.device.limits.minStorageBufferOffsetAlignment) return null;
  if (ws.some((t, i) => t.alloc !== first.alloc || t.byteOffset !== first.byteOffset + i * first.byteSize || t.shape.some((d, j) => d !== first.shape[j])))
    return null;
  for (const name of w.keys()) for (const l of layers) if (name.startsWith(`${l}.`) && !PLAIN.has(name.slice(l.length + 1))) return null;
  const adapters = layers.map((l) => {
    const [a, up] = [w.get(`${l}.lora_A.weight`), w.get(`${l}.lora_B.weight`)];
    return a && up ? { a, up } : null;
  });
  const partial = layers.some((l, i) => !adapters[i] && (w.has(`${l}.lora_A.weight`) || w.has(`${l}.lora_B.weight`)));
  if (partial || (loraScale !== 1 && adapters.some((a) => a))) return null;
  const stack = new Tensor(first.alloc, [ws.length, ...first.shape], first.dtype, first.byteOffset, false);
  return F.linearGroup(x, stack, ws, adapters);
}

// The layers that get adapters, by the name of their `.weight`:
//   UNet: the four projections of both attentions (self attn1, cross attn2) of every transformer block,
//     as diffusers' train_dreambooth_lora.py (to_q, to_k, to_v, to_out.0; to_out.1 is dropout).
//   Text encoder: the four self-attention projections of every CLIP layer, as diffusers'
//     train_dreambooth_lora.py text-encoder LoraConfig (q_proj, k_proj, v_proj, out_proj). SD2's OpenCLIP
//     fuses q/k/v into one in_proj; the loader (src/models/keymap.ts) splits it into these diffusers
//     names, so the adapters sit on the split projections and are saved under diffusers names.
const TARGETS: Record<'unet' | 'text_encoder', RegExp> = {
  unet: /^(.*\.transformer_blocks\.\d+\.attn[12]\.(?:to_q|to_k|to_v|to_out\.0))\.weight$/,
  text_encoder: /^(text_model\.encoder\.layers\.\d+\.self_attn\.(?:q_proj|k_proj|v_proj|out_proj))\.weight$/,
};

/** Layer prefixes (without `.weight`) that get adapters, in the order of `paramNames`. */
export function loraTargets(kind: 'unet' | 'text_encoder', paramNames: Iterable<string>): string[] {
  const re = TARGETS[kind];
  const out = new Set<string>();
  for (const n of paramNames) {
    const m = re.exec(n);
    if (m) out.add(m[1]);
  }
  return [...out];
}

/** Shapes of the adapter tensors for `layers`: A [rank, in], B [out, rank], from each base `<layer>.weight` [out, in]. */
export function loraShapes(layers: Iterable<string>, shapes: ReadonlyMap<string, readonly number[]>, rank: number): Map<string, number[]> {
  if (!Number.isInteger(rank) || rank < 1) throw new ShapeError('lora', `rank must be a positive integer, got ${rank}`);
  const m = new Map<string, number[]>();
  for (const layer of layers) {
    const s = shapes.get(`${layer}.weight`);
    if (!s || s.length !== 2) throw new ShapeError('lora', `${layer}.weight must be a linear weight [out, in], got ${s ? `[${s}]` : 'none'}`);
    const [o, i] = s;
    m.set(`${layer}.lora_A.weight`, [rank, i]);
    m.set(`${layer}.lora_B.weight`, [o, rank]);
  }
  return m;
}

/** A seeded source of uniform numbers in [0, 1) (the caller's PRNG; none is defined here). */
export interface UniformRng {
  next(): number;
}

/**
 * PEFT's default initialisation (init_lora_weights=True): A ~ kaiming_uniform_(a = sqrt(5)) and B = 0,
 * so the adapted layer starts as the base layer exactly and only B moves on the first step (dA = 0
 * while B = 0). kaiming_uniform with negative slope a has gain sqrt(2 / (1 + a^2)) = sqrt(1/3) and bound
 * gain sqrt(3 / fan_in) = 1 / sqrt(fan_in), fan_in = in (A's second dimension): A ~ U(-1/sqrt(in),
 * 1/sqrt(in)), drawn row-major as bound (2u - 1). Returns `<layer>.lora_A.weight` and
 * `<layer>.lora_B.weight` per layer (shapes as loraShapes).
 */
export function initLora(layers: Iterable<string>, shapes: ReadonlyMap<string, readonly number[]>, rank: number, rng: UniformRng): Map<string, Float32Array> {
  const out = new Map<string, Float32Array>();
  for (const [name, s] of loraShapes(layers, shapes, rank)) {
    const t = new Float32Array(s[0] * s[1]);
    if (name.endsWith('.lora_A.weight')) {
      const bound = 1 / Math.sqrt(s[1]);
      for (let i = 0; i < t.length; i++) t[i] = bound * (2 * rng.next() - 1);
    }
    out.set(name, t);
  }
  return out;
}
