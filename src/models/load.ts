// Loads a Stable Diffusion model into engine tensors from a ModelSource (source.ts: a single-file
// checkpoint through the key maps, or a diffusers folder), one tensor at a time. The configs and every
// tensor's name and shape are checked (check.ts) BEFORE any weight is read or uploaded; each tensor's
// values are checked for NaN/Inf as they pass through the CPU.
import type { Gpu } from '../gpu/device.ts';
import { BYTES, Tensor, type DType } from '../gpu/tensor.ts';
import type { SafetensorsFile } from '../io/safetensors.ts';
import type { ClipTextConfig } from '../nn/clip.ts';
import type { Weights } from '../nn/blocks.ts';
import type { UnetConfig } from '../nn/unet.ts';
import type { VaeConfig } from '../nn/vae.ts';
import { checkModel, compareTensors, mismatchSummary } from './check.ts';
import { ModelError, type Component, type Family, type Prediction } from './detect.ts';
import type { ParamShapes } from './shapes.ts';
import { openDiffusers, openSingleFile, type FolderReader, type ModelSource, type SourceOptions } from './source.ts';

export { inferUnet } from './source.ts';

export interface LoadedModel {
  family: Family;
  prediction: Prediction;
  unet: { config: UnetConfig; weights: Weights };
  vae: { config: VaeConfig; weights: Weights };
  textEncoder: { config: ClipTextConfig; weights: Weights };
}

export interface LoadOptions extends SourceOptions {
  dtype: DType;
}

/**
 * Every tensor the component's config needs is present with its shape, and nothing unknown is left
 * over: otherwise a ModelError names the component, the tensor and both shapes.
 */
export function validateComponent(what: string, component: string, expected: ParamShapes, actual: Map<string, readonly number[]>): void {
  const summary = mismatchSummary(component, compareTensors(expected, actual));
  if (summary) throw new ModelError(`${what}: ${summary}`);
}

/** f16's largest finite value is 65504; from 65520 up a value rounds to Inf. */
const F16_OVERFLOW = 65520;

/**
 * How many values are NaN or +-Inf, and how many finite ones would become Inf as f16 weights
 * (counted only for dtype f16). One pass; x - x is 0 for every finite x and NaN otherwise.
 */
export function countBadValues(values: Float32Array, dtype: DType): { nonFinite: number; beyondF16: number } {
  let nonFinite = 0;
  let beyondF16 = 0;
  const f16 = dtype === 'f16';
  for (let i = 0; i < values.length; i++) {
    const v = values[i];
    if (v - v !== 0) nonFinite++;
    else if (f16 && (v >= F16_OVERFLOW || v <= -F16_OVERFLOW)) beyondF16++;
  }
  return { nonFinite, beyondF16 };
}

/** A ModelError naming the tensor and where it lives when its values cannot become `dtype` weights. */
function checkValues(src: ModelSource, c: Component, name: string, data: Float32Array, dtype: DType): void {
  const bad = countBadValues(data, dtype);
  if (!bad.nonFinite && !bad.beyondF16) return;
  const tensor = `${src.name}: ${c} tensor ${name}${src.tensorOrigin ? ` (${src.tensorOrigin(c, name)})` : ''}`;
  const values = (n: number, kind: string) => `${n} ${kind}value${n === 1 ? '' : 's'}`;
  if (bad.nonFinite)
    throw new ModelError(
      `${tensor} holds ${values(bad.nonFinite, 'non-finite ')} (NaN/Inf): this checkpoint is corrupt or was saved after a diverged run; use another file`,
    );
  throw new ModelError(
    `${tensor} holds ${values(bad.beyondF16, '')} beyond f16's range (|x| >= ${F16_OVERFLOW}), which would be Inf in f16 weights: load it in f32 or use another file`,
  );
}

/**
 * Frozen layers a model reads through one merged GEMM when their weights lie side by side in one allocation: every
 * UNet ResNet's time_emb_proj, whose rows are all projections of the same time embedding (nn/unet.ts
 * timeProjections), their weights in one allocation and their biases in another, in the order the names come; and
 * each attention's projections of the same input (nn/lora.ts loraLinearGroup): self-attention's q, k, v, cross-
 * attention's k, v, in that order. `re`'s first group names the allocation, its second the member.
 */
const GROUPED: { re: RegExp; order?: string[] }[] = [
  { re: /^()(.*)\.time_emb_proj\.weight$/ },
  { re: /^()(.*)\.time_emb_proj\.bias$/ },
  { re: /^(.*\.attn1)\.(to_q|to_k|to_v)\.weight$/, order: ['to_q', 'to_k', 'to_v'] },
  { re: /^(.*\.attn2)\.(to_k|to_v)\.weight$/, order: ['to_k', 'to_v'] },
];

/**
 * Tensors (uninitialised, tagged 'weights') for `shapes`: the members of each GROUPED allocation as views into one
 * allocation, laid end to end, the first member owning it (so freeing every tensor of the map frees it once);
 * every other tensor its own. A member whose bytes are not a multiple of the storage-offset alignment gets its
 * own allocation instead. The per-layer names, shapes and values are those of separate tensors: only the layout
 * differs (checkpoints and exports read and write each layer by name as before). The map keeps the order of `shapes`.
 */
export function allocateWeights(gpu: Gpu, shapes: Iterable<readonly [string, readonly number[]]>, dtype: DType): Map<string, Tensor> {
  const list = [...shapes];
  const align = gpu.device.limits.minStorageBufferOffsetAlignment;
  const bytes = (s: readonly number[]) => s.reduce((a, b) => a * b, 1) * BYTES[dtype];
  const out = new Map<string, Tensor>();
  const groups = new Map<string, { name: string; shape: readonly number[]; rank: number }[]>();
  for (const [name, shape] of list)
    for (const [g, { re, order }] of GROUPED.entries()) {
      const m = re.exec(name);
      if (!m || bytes(shape) % align !== 0) continue;
      const key = `${g}:${m[1]}`;
      groups.set(key, [...(groups.get(key) ?? []), { name, shape, rank: order ? order.indexOf(m[2]) : 0 }]);
    }
  for (const group of groups.values()) {
    const members = group.sort((a, b) => a.rank - b.rank).map(({ name, shape }) => [name, shape] as const);
    if (members.length < 2) continue;
    const arena = gpu.tensor(
      [members.reduce((a, [, s]) => a + bytes(s) / BYTES[dtype], 0)],
      dtype,
      'weights',
      `${members[0][0]} (+${members.length - 1} grouped)`,
    );
    let at = arena.byteOffset;
    members.forEach(([n, s], i) => {
      out.set(n, new Tensor(arena.alloc, s, dtype, at, i === 0));
      at += bytes(s);
    });
  }
  // in the order of `shapes` (a streamed source is read in that order)
  return new Map(list.map(([n, s]) => [n, out.get(n) ?? gpu.tensor(s, dtype, 'weights', n)]));
}

/**
 * Configs and every tensor's name and shape checked (check.ts) before anything is read; then each
 * tensor is read, its f32 values checked (after any f16/bf16 conversion: one pass over values already on
 * the CPU) for NaN/Inf and, for f16 weights, for values past f16's range, and uploaded in `dtype`. A
 * refused tensor frees whatever was uploaded before it.
 */
export async function loadModel(gpu: Gpu, src: ModelSource, dtype: DType): Promise<LoadedModel> {
  const configs = checkModel(src);
  const uploaded: Tensor[] = [];
  const upload = async (c: Component): Promise<Weights> => {
    const w: Weights = allocateWeights(gpu, src.shapes(c), dtype);
    uploaded.push(...w.values());
    for (const [name, t] of w) {
      const { data } = await src.read(c, name);
      checkValues(src, c, name, data, dtype);
      gpu.write(t, data);
    }
    return w;
  };
  try {
    return {
      family: src.family,
      prediction: src.prediction,
      unet: { config: configs.unet, weights: await upload('unet') },
      vae: { config: configs.vae, weights: await upload('vae') },
      textEncoder: { config: configs.textEncoder, weights: await upload('text_encoder') },
    };
  } catch (e) {
    gpu.free(...uploaded);
    throw e;
  }
}

/** A single-file (A1111/ComfyUI) checkpoint; the caller closes `file`. */
export async function loadSingleFile(gpu: Gpu, file: SafetensorsFile, o: LoadOptions): Promise<LoadedModel> {
  return loadModel(gpu, await openSingleFile(file, o), o.dtype);
}

/** A diffusers folder (model_index.json, unet/, vae/, text_encoder/, scheduler/); its files are closed after. */
export async function loadDiffusers(gpu: Gpu, dir: FolderReader, o: LoadOptions): Promise<LoadedModel> {
  const src = await openDiffusers(dir, o);
  try {
    return await loadModel(gpu, src, o.dtype);
  } finally {
    await src.close();
  }
}
