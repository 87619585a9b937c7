// A LoRA run exported as a full checkpoint: the adapters merged into the layers they adapt,
//   W' = W + (alpha / r) · B · A        (B: [out, r], A: [r, in], W: [out, in]; conv 1x1 kernels flattened)
// computed in f32 one layer at a time when the exporter asks for it, so no more than one layer's weight is
// in memory at once.
import type { TensorProvider } from '../io/tensor-provider.ts';

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
