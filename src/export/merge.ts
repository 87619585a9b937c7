// A LoRA run exported as a full checkpoint: the adapters merged into the layers they adapt,
//   W' = W + (alpha / r) · B · A        (B: [out, r], A: [r, in], W: [out, in]; conv 1x1 kernels flattened)
// computed in f32 one layer at a time when the exporter asks for it, so no more than one layer's weight is
// in memory at once.
import type { TensorProvider } from '../io/tensor-provider.ts';
import { layerScale, networkShapes, type NetworkSpec } from '../nn/lycoris.ts';
import { DORA_EPS } from '../ops/dora.ts';
import { ExportError } from './provider.ts';

/** The base model's weights of the adapted layers (e.g. read back from the GPU). */
export interface BaseWeights {
  shape(name: string): readonly number[];
  read(name: string): Promise<Float32Array>;
}

const A_SUFFIX = '.lora_A.weight';

/**
 * The UNet layers adapted by PEFT-named adapters (`<layer>.lora_A.weight` [r, in], `<layer>.lora_B.weight`
 * [out, r]) with the adapters merged at `scale` (alpha / rank). Names starting with `skipPrefix` (the text
 * encoder's adapters) are left out.
 */
export function mergedLoraProvider(base: BaseWeights, adapters: ReadonlyMap<string, Float32Array>, scale: number, skipPrefix = 'text_model.'): TensorProvider {
  const layers = [...adapters.keys()].filter((n) => n.endsWith(A_SUFFIX) && !n.startsWith(skipPrefix)).map((n) => n.slice(0, -A_SUFFIX.length));
  const shapes = new Map(layers.map((l) => [`${l}.weight`, [...base.shape(`${l}.weight`)]]));
  return {
    names: () => [...shapes.keys()],
    shape: (n) => shapes.get(n)!,
    read: async (n) => {
      const layer = n.slice(0, -'.weight'.length);
      const shape = shapes.get(n)!;
      return mergeLora(await base.read(n), adapters.get(`${layer}.lora_A.weight`)!, adapters.get(`${layer}.lora_B.weight`)!, shape[0], scale);
    },
  };
}

/** W += scale · B · A in place (W [out, in...], A [r, in...], B [out, r]); returns W. */
export function mergeLora(w: Float32Array, A: Float32Array, B: Float32Array, out: number, scale: number): Float32Array {
  const inn = w.length / out;
  const r = A.length / inn;
  if (!Number.isInteger(inn) || !Number.isInteger(r) || B.length !== out * r)
    throw new Error(`LoRA merge: W has ${w.length} values, A ${A.length}, B ${B.length}: the shapes do not agree`);
  for (let o = 0; o < out; o++)
    for (let k = 0; k < r; k++) {
      const b = scale * B[o * r + k];
      if (b === 0) continue;
      for (let i = 0; i < inn; i++) w[o * inn + i] += b * A[k * inn + i];
    }
  return w;
}

// A LyCORIS run (nn/lycoris.ts) exported as a full checkpoint: each adapted layer's weight as the trained model
// runs it and as the loaders merge its file (export/lycoris.ts), W [out, K] viewed as a matrix (K = in kh kw):
//   V = W + s ΔW,   ΔW = B A (LoCon), (w1a w1b) ∘ (w2a w2b) (LoHa), kron(w1, w2a w2b or w2) (LoKr),
//   s = layerScale (alpha / r; 1 for LoKr's full w2), and with DoRA W' = V m_j / (||V_:,j|| + eps),
// the norm per input channel j over the outputs and kernel taps. Sums in f64, one layer at a time.

const LYCORIS_FACTOR = /^(.*)\.(lora_A\.weight|lora_B\.weight|hada_w[12]_[ab]|lokr_w1|lokr_w2|lokr_w2_[ab]|dora_scale)$/;

/** The UNet layers a LyCORIS network's factors (engine names, `<layer>.<factor>`) adapt, merged by mergeLycoris. */
export function mergedLycorisProvider(
  base: BaseWeights,
  adapters: ReadonlyMap<string, Float32Array>,
  spec: NetworkSpec,
  skipPrefix = 'text_model.',
): TensorProvider {
  const layers = new Set<string>();
  for (const n of adapters.keys()) {
    const m = LYCORIS_FACTOR.exec(n);
    if (m && !n.startsWith(skipPrefix)) layers.add(m[1]);
  }
  const shapes = new Map([...layers].map((l) => [`${l}.weight`, [...base.shape(`${l}.weight`)]]));
  return {
    names: () => [...shapes.keys()],
    shape: (n) => shapes.get(n)!,
    read: async (n) => {
      const layer = n.slice(0, -'.weight'.length);
      return mergeLycoris(await base.read(n), shapes.get(n)!, spec, (f) => adapters.get(`${layer}.${f}`));
    },
  };
}

interface Factor {
  shape: number[];
  data: Float32Array;
}

/** Σ_k a[i, k] b[k, j] for a [?, r], b [r, n]. */
function dot(a: Factor, b: Factor, i: number, j: number): number {
  const [r, n] = b.shape;
  let sum = 0;
  for (let k = 0; k < r; k++) sum += a.data[i * r + k] * b.data[k * n + j];
  return sum;
}

/** a [m, r] b [r, n] as a Factor [m, n]. */
function product(a: Factor, b: Factor): Factor {
  const [m, n] = [a.shape[0], b.shape[1]];
  const data = new Float32Array(m * n);
  for (let i = 0; i < m; i++) for (let j = 0; j < n; j++) data[i * n + j] = dot(a, b, i, j);
  return { shape: [m, n], data };
}

/** w + s ΔW (w [out, K], in place) for the factors of one layer. */
function addDelta(w: Float32Array, out: number, s: number, f: (name: string) => Factor | undefined): void {
  const k = w.length / out;
  const get = (name: string) => f(name)!;
  if (f('lora_A.weight')) mergeLora(w, get('lora_A.weight').data, get('lora_B.weight').data, out, s);
  else if (f('hada_w1_a')) {
    const [w1a, w1b, w2a, w2b] = ['hada_w1_a', 'hada_w1_b', 'hada_w2_a', 'hada_w2_b'].map(get);
    for (let o = 0; o < out; o++) for (let j = 0; j < k; j++) w[o * k + j] += s * dot(w1a, w1b, o, j) * dot(w2a, w2b, o, j);
  } else {
    // kron(w1 [outL, inM], w2 [outK, n]): element [i outK + p, j n + q] = w1[i, j] w2[p, q]
    const w1 = get('lokr_w1');
    const w2 = f('lokr_w2') ?? product(get('lokr_w2_a'), get('lokr_w2_b'));
    const [outL, inM] = w1.shape;
    const [outK, n] = w2.shape;
    for (let i = 0; i < outL; i++)
      for (let j = 0; j < inM; j++) {
        const a = s * w1.data[i * inM + j];
        for (let p = 0; p < outK; p++) for (let q = 0; q < n; q++) w[(i * outK + p) * k + j * n + q] += a * w2.data[p * n + q];
      }
  }
}

/**
 * One layer's merged weight (see above) from its base weight w (shape `shape`, overwritten and returned) and
 * its factors by name (`lora_A.weight`, `hada_w1_a`, `lokr_w1`, `dora_scale`, ...), each of the shape the
 * engine trains (nn/lycoris.ts networkShapes); a missing or misshapen factor is an ExportError naming it.
 */
export function mergeLycoris(w: Float32Array, shape: readonly number[], spec: NetworkSpec, factor: (name: string) => Float32Array | undefined): Float32Array {
  const planned = networkShapes(['l'], new Map([['l.weight', shape]]), spec);
  const present = [...planned.keys()].filter((n) => factor(n.slice(2)) !== undefined);
  // a LoCon linear layer without DoRA has the plain LoRA pair; every planned factor of the layer must be there
  if (!present.length || present.length !== planned.size)
    throw new ExportError(
      `LyCORIS merge: a layer of shape [${shape}] needs ${[...planned.keys()].map((n) => n.slice(2)).join(', ')}; it has ${present.map((n) => n.slice(2)).join(', ') || 'none'}`,
    );
  const f = (name: string): Factor | undefined => {
    const data = factor(name);
    const s = planned.get(`l.${name}`);
    if (!data || !s) return undefined;
    if (data.length !== s[0] * s[1]) throw new ExportError(`LyCORIS merge: ${name} has ${data.length} values, the layer's [${s}] needs ${s[0] * s[1]}`);
    return { shape: s, data };
  };
  const out = shape[0];
  addDelta(w, out, layerScale(spec, shape), f);
  const m = f('dora_scale');
  if (!m) return w;
  const inC = shape[1];
  const taps = w.length / (out * inC);
  const norm = new Float64Array(inC);
  for (let i = 0; i < w.length; i++) norm[Math.floor(i / taps) % inC] += w[i] * w[i];
  const c = Float64Array.from(norm, (ss, j) => m.data[j] / (Math.sqrt(ss) + DORA_EPS));
  for (let i = 0; i < w.length; i++) w[i] *= c[Math.floor(i / taps) % inC];
  return w;
}
