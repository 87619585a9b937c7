// LyCORIS network types beside plain LoRA (KohakuBlueleaf/LyCORIS, as A1111 and ComfyUI load them). Each adapted
// layer's weight W [out, in(, kh, kw)] is viewed as a matrix [out, K] (K = in kh kw, a conv's kernel flattened as
// torch's reshape does) and gets a weight delta ΔW [out, K] from its factors; the layer then runs with W + ΔW:
//   LoCon (a conv): ΔW = s B A,              A = lora_A [r, K], B = lora_B [out, r], s = convAlpha / convRank
//     (LoCon's linear layers are plain LoRA and keep loraLinear's thin-matmul path);
//   LoHa: ΔW = s (w1a w1b) ∘ (w2a w2b),       w1a, w2a [out, r], w1b, w2b [r, K], s = alpha / r (Hadamard product);
//   LoKr: ΔW = s kron(w1, w2),                w1 [outL, inM], w2 = w2a w2b ([outK, r] [r, inN kh kw]) or a full
//     lokr_w2 [outK, inN kh kw]; out = outL outK and in = inM inN by LyCORIS' `factorization`; s = alpha / r with
//     w2 decomposed, 1 with it full (LyCORIS forces alpha = r there).
// ΔW is materialised with the engine's GEMM and element-wise ops under the tape (`hadamard` records the
// product), so the frozen layer's weight gradient d(W + ΔW) flows back through those ops to the factors (forward
// and backward golden-tested against PyTorch: tests/fixtures/train/gen_lycoris.py). The Kronecker product is two GEMM pairs with constant 0/1
// selectors: kron(w1, w2) = (E w1 Gᵀ) ∘ (P w2 Qᵀ), E [outL outK, outL] with E[i outK + p, i] = 1, G [inM n, inM]
// with G[j n + q, j] = 1, P[i outK + p, p] = 1, Q[j n + q, q] = 1 (n = w2's columns), so the gradient of each
// factor is the selectors' transposes applied to the product's gradient times the other factor: torch.kron's.
import { ShapeError } from '../gpu/errors.ts';
import type { DType, Tensor } from '../gpu/tensor.ts';
import { mul } from '../ops/elementwise.ts';
import { weight, type Weights } from './blocks.ts';
import { doraWeight } from './dora.ts';
import type { Ops } from './ops.ts';

export const NETWORK_TYPES = ['lora', 'locon', 'loha', 'lokr'] as const;
export type NetworkType = (typeof NETWORK_TYPES)[number];

/** A run's network: its type, the linear layers' rank/alpha and, for LyCORIS types, the convs' and LoKr's factor. */
export interface NetworkSpec {
  type: NetworkType;
  rank: number;
  alpha: number;
  /** Rank and alpha of the ResNet 3x3 convs' adapters (locon, loha, lokr). */
  convRank: number;
  convAlpha: number;
  /** LoKr's factorization factor (-1: the split closest to a square, LyCORIS' default). */
  factor: number;
  /** DoRA (LyCORIS dora_wd): each adapted layer runs with W + s ΔW renormalised by a trained magnitude (nn/dora.ts). */
  dora?: boolean;
}

/** The network of a weight map (the trainer attaches it with the adapters; the modules read scales from it). */
const attached = new WeakMap<Weights, NetworkSpec>();

export function attachNetwork(w: Weights, spec: NetworkSpec): void {
  attached.set(w, spec);
}

export function networkOf(w: Weights): NetworkSpec | undefined {
  return attached.get(w);
}

/** The ResNet convs LyCORIS types adapt besides the attention projections: every ResNet's conv1 and conv2 (3x3). */
const CONV_TARGET = /^((?:down_blocks\.\d+|up_blocks\.\d+|mid_block)\.resnets\.\d+\.conv[12])\.weight$/;

/** UNet ResNet 3x3 conv layers (without `.weight`) in the order of `paramNames`. */
export function convTargets(paramNames: Iterable<string>): string[] {
  const out: string[] = [];
  for (const n of paramNames) {
    const m = CONV_TARGET.exec(n);
    if (m) out.push(m[1]);
  }
  return out;
}

/**
 * LyCORIS' `factorization(dimension, factor)`: dimension = m n with m <= n; with factor > 0 dividing it, (factor,
 * dimension / factor) ordered; else the pair with the smallest m + n whose m does not exceed factor (-1: no limit).
 */
export function factorization(dimension: number, factor = -1): [number, number] {
  if (factor > 0 && dimension % factor === 0) {
    const [m, n] = [factor, dimension / factor];
    return m > n ? [n, m] : [m, n];
  }
  const limit = factor < 0 ? dimension : factor;
  let [m, n] = [1, dimension];
  const length = m + n;
  while (m < n) {
    let nm = m + 1;
    while (dimension % nm !== 0) nm++;
    const nn = dimension / nm;
    if (nm + nn > length || nm > limit) break;
    [m, n] = [nm, nn];
  }
  return m > n ? [n, m] : [m, n];
}

interface LayerPlan {
  out: number;
  /** Columns of the matrix view: in kh kw. */
  k: number;
  rank: number;
  conv: boolean;
  /** LoKr: [outL, outK], [inM, inN], whether w2 is decomposed. */
  lokr?: { outL: number; outK: number; inM: number; inN: number; decomposed: boolean };
}

function plan(spec: NetworkSpec, s: readonly number[]): LayerPlan {
  const conv = s.length === 4;
  const [out, inC] = s;
  const kk = conv ? s[2] * s[3] : 1;
  const rank = conv ? spec.convRank : spec.rank;
  const p: LayerPlan = { out, k: inC * kk, rank, conv };
  if (spec.type === 'lokr') {
    const [outL, outK] = factorization(out, spec.factor);
    const [inM, inN] = factorization(inC, spec.factor);
    p.lokr = { outL, outK, inM, inN, decomposed: rank < Math.max(outK, inN) / 2 };
  }
  return p;
}

/** Factor shapes of one layer whose base weight has shape `s`, by engine name (`<layer>.<factor>`). */
function layerShapes(spec: NetworkSpec, layer: string, s: readonly number[]): [string, number[]][] {
  const factors = deltaShapes(spec, layer, s);
  // DoRA's magnitude: one per input channel (LyCORIS' dora_scale, [1, in])
  return spec.dora ? [...factors, [`${layer}.dora_scale`, [1, s[1]]]] : factors;
}

function deltaShapes(spec: NetworkSpec, layer: string, s: readonly number[]): [string, number[]][] {
  const p = plan(spec, s);
  const { out, k, rank: r } = p;
  if (spec.type === 'lora' || spec.type === 'locon')
    return [
      [`${layer}.lora_A.weight`, [r, k]],
      [`${layer}.lora_B.weight`, [out, r]],
    ];
  if (spec.type === 'loha')
    return [
      [`${layer}.hada_w1_a`, [out, r]],
      [`${layer}.hada_w1_b`, [r, k]],
      [`${layer}.hada_w2_a`, [out, r]],
      [`${layer}.hada_w2_b`, [r, k]],
    ];
  const { outL, outK, inM, inN, decomposed } = p.lokr!;
  const n = inN * (k / (inM * inN));
  const w1: [string, number[]] = [`${layer}.lokr_w1`, [outL, inM]];
  return decomposed ? [w1, [`${layer}.lokr_w2_a`, [outK, r]], [`${layer}.lokr_w2_b`, [r, n]]] : [w1, [`${layer}.lokr_w2`, [outK, n]]];
}

/** Shapes of the factor tensors for `layers` (linear [out, in] or conv [out, in, kh, kw] base weights). */
export function networkShapes(layers: Iterable<string>, shapes: ReadonlyMap<string, readonly number[]>, spec: NetworkSpec): Map<string, number[]> {
  for (const [what, v] of [
    ['rank', spec.rank],
    ['conv rank', spec.convRank],
  ] as const)
    if (!Number.isInteger(v) || v < 1) throw new ShapeError('lycoris', `${what} must be a positive integer, got ${v}`);
  const m = new Map<string, number[]>();
  for (const layer of layers) {
    const s = shapes.get(`${layer}.weight`);
    if (!s || (s.length !== 2 && s.length !== 4))
      throw new ShapeError('lycoris', `${layer}.weight must be a linear or conv weight, got ${s ? `[${s}]` : 'none'}`);
    for (const [n, shape] of layerShapes(spec, layer, s)) m.set(n, shape);
  }
  return m;
}

/** The scale s of a layer's ΔW (see the header). */
export function layerScale(spec: NetworkSpec, baseShape: readonly number[]): number {
  const p = plan(spec, baseShape);
  if (spec.type === 'lokr' && !p.lokr!.decomposed) return 1;
  return (p.conv ? spec.convAlpha : spec.alpha) / p.rank;
}

/** The ΔW scale recorded in an export's per-module `alpha`: the alpha whose alpha / r the loaders apply. */
export function exportedAlpha(spec: NetworkSpec, baseShape: readonly number[]): number {
  const p = plan(spec, baseShape);
  if (spec.type === 'lokr' && !p.lokr!.decomposed) return p.rank;
  return p.conv ? spec.convAlpha : spec.alpha;
}

/** A seeded source of uniform numbers in [0, 1). */
export interface UniformRng {
  next(): number;
}

/**
 * LyCORIS' initialisation, so ΔW starts at 0: LoRA/LoCon A ~ kaiming_uniform(a = sqrt 5) = U(±1/sqrt(fan_in)),
 * B = 0; LoHa w1b, w2b ~ N(0, 1), w1a ~ N(0, 0.1), w2a = 0; LoKr w1 and w2a kaiming-uniform, w2b (or a full w2) = 0.
 * fan_in is a factor's column count (a conv factor's in kh kw, as torch counts a 4-D one). Normals by Box-Muller.
 * DoRA's dora_scale is left 0 here: it starts at W's column norms (nn/dora.ts doraMagnitudes, from the weights).
 */
export function initNetwork(
  layers: Iterable<string>,
  shapes: ReadonlyMap<string, readonly number[]>,
  spec: NetworkSpec,
  rng: UniformRng,
): Map<string, Float32Array> {
  const normal = (): number => {
    const u = 1 - rng.next();
    return Math.sqrt(-2 * Math.log(u)) * Math.cos(2 * Math.PI * rng.next());
  };
  const out = new Map<string, Float32Array>();
  for (const [name, s] of networkShapes(layers, shapes, spec)) {
    const t = new Float32Array(s[0] * s[1]);
    const kind = name.slice(name.lastIndexOf('.', name.endsWith('.weight') ? name.length - 8 : name.length) + 1);
    if (kind === 'lora_A.weight' || kind === 'lokr_w1' || kind === 'lokr_w2_a') {
      const bound = 1 / Math.sqrt(s[1]);
      for (let i = 0; i < t.length; i++) t[i] = bound * (2 * rng.next() - 1);
    } else if (kind === 'hada_w1_b' || kind === 'hada_w2_b') for (let i = 0; i < t.length; i++) t[i] = normal();
    else if (kind === 'hada_w1_a') for (let i = 0; i < t.length; i++) t[i] = 0.1 * normal();
    out.set(name, t);
  }
  return out;
}

/**
 * Element-wise a * b (same shapes) under F's tape, as Ops records its ops: da = dy * b, db = dy * a, each only
 * where wanted; y is freed once its backward ran.
 */
export function hadamard(F: Ops, a: Tensor, b: Tensor): Tensor {
  const y = mul(F.gpu, a, b);
  const tape = F.tape;
  if (!tape) return y;
  tape.derive(y, [a, b]);
  tape.record(() => {
    const dy = tape.take(y);
    if (dy) {
      if (tape.needs(a)) tape.acc(a, mul(F.gpu, dy, b));
      if (tape.needs(b)) tape.acc(b, mul(F.gpu, dy, a));
      tape.release(dy);
    }
    F.gpu.free(y);
  });
  return y;
}

/** 0/1 selector [rows, cols] with a 1 at [i, sel(i)] per row. */
function selector(F: Ops, rows: number, cols: number, sel: (i: number) => number, dtype: DType): Tensor {
  const d = new Float32Array(rows * cols);
  for (let i = 0; i < rows; i++) d[i * cols + sel(i)] = 1;
  return F.constant(F.gpu.upload(d, [rows, cols], dtype, 'weights', 'kron-selector'));
}

/** kron(a [m, n], b [p, q]) = [m p, n q] by the selector GEMMs of the header, differentiable in a and b. */
export function kron(F: Ops, a: Tensor, b: Tensor): Tensor {
  const [m, n] = a.shape;
  const [p, q] = b.shape;
  const dt = a.dtype;
  const e = selector(F, m * p, m, (i) => Math.floor(i / p), dt);
  const g = selector(F, n * q, n, (j) => Math.floor(j / q), dt);
  const pp = selector(F, m * p, p, (i) => i % p, dt);
  const qq = selector(F, n * q, q, (j) => j % q, dt);
  const ea = F.matmul(e, a);
  const left = F.matmul(ea, g, { transB: true });
  const pb = F.matmul(pp, b);
  const right = F.matmul(pb, qq, { transB: true });
  const y = hadamard(F, left, right);
  F.release(ea, left, pb, right, e, g, pp, qq);
  return y;
}

/** ΔW [out, K] of a layer with LyCORIS factors in `w` (unscaled), or null when it has none to materialise. */
function rawDelta(F: Ops, w: Weights, layer: string, base: Tensor): Tensor | null {
  const has = (f: string) => w.has(`${layer}.${f}`);
  const get = (f: string) => weight(w, `${layer}.${f}`);
  if (has('hada_w1_a')) {
    const h1 = F.matmul(get('hada_w1_a'), get('hada_w1_b'));
    const h2 = F.matmul(get('hada_w2_a'), get('hada_w2_b'));
    const d = hadamard(F, h1, h2);
    F.release(h1, h2);
    return d;
  }
  if (has('lokr_w1')) {
    const w2 = has('lokr_w2') ? get('lokr_w2') : F.matmul(get('lokr_w2_a'), get('lokr_w2_b'));
    const d = kron(F, get('lokr_w1'), w2);
    if (!has('lokr_w2')) F.release(w2);
    return d;
  }
  // A conv's LoCon adapter, or a DoRA layer's (a linear layer's plain LoRA adapter runs loraLinear's thin matmuls)
  if (has('lora_A.weight') && (base.shape.length === 4 || has('dora_scale'))) return F.matmul(get('lora_B.weight'), get('lora_A.weight'));
  return null;
}

/**
 * The weight a layer runs with, W + s ΔW (W's shape; with DoRA, that renormalised by nn/dora.ts), when `w` holds
 * LyCORIS factors for it that are materialised (LoHa, LoKr, a conv's LoCon, any DoRA layer); null otherwise. The caller releases it after use (F.release).
 */
export function networkWeight(F: Ops, w: Weights, layer: string): Tensor | null {
  const base = weight(w, `${layer}.weight`);
  const raw = rawDelta(F, w, layer, base);
  if (!raw) return null;
  const spec = networkOf(w);
  if (!spec) throw new ShapeError('lycoris', `${layer} has LyCORIS factors but its weights carry no network (attachNetwork)`);
  const s = layerScale(spec, base.shape);
  const scaled = s === 1 ? raw : F.scale(raw, s);
  const shaped = F.reshape(scaled, base.shape);
  const v = F.add(base, shaped);
  F.release(...(scaled === raw ? [raw] : [raw, scaled]));
  if (!spec.dora) return v;
  const y = doraWeight(F, v, weight(w, `${layer}.dora_scale`));
  F.release(v);
  return y;
}
