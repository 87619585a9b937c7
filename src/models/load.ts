// Loads a Stable Diffusion model into engine tensors from a ModelSource (source.ts: a single-file
// checkpoint through the key maps, or a diffusers folder), one tensor at a time. The configs and every
// tensor's name and shape are checked (check.ts) BEFORE any weight is read or uploaded; each tensor's
// values are checked for NaN/Inf as they pass through the CPU.
import type { Gpu } from '../gpu/device.ts';
import type { DType, Tensor } from '../gpu/tensor.ts';
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

/** How many of the values are NaN or +-Inf (x - x is 0 for every finite x, NaN otherwise). */
export function countNonFinite(values: Float32Array): number {
  let n = 0;
  for (let i = 0; i < values.length; i++) if (values[i] - values[i] !== 0) n++;
  return n;
}

/**
 * Configs and every tensor's name and shape checked (check.ts) before anything is read; then each tensor
 * is read, checked for NaN/Inf in its f32 values (after the f16/bf16 conversion, so this is one pass over
 * values already on the CPU) and uploaded in `dtype`. A refused tensor frees whatever was uploaded.
 */
export async function loadModel(gpu: Gpu, src: ModelSource, dtype: DType): Promise<LoadedModel> {
  const configs = checkModel(src);
  const uploaded: Tensor[] = [];
  const upload = async (c: Component): Promise<Weights> => {
    const w: Weights = new Map();
    for (const [name, shape] of src.shapes(c)) {
      const { data } = await src.read(c, name);
      const bad = countNonFinite(data);
      if (bad) {
        const where = src.tensorOrigin ? ` (${src.tensorOrigin(c, name)})` : '';
        throw new ModelError(`${src.name}: ${c} tensor ${name}${where} holds ${bad} non-finite value${bad === 1 ? '' : 's'} (NaN/Inf): this checkpoint is corrupt or was saved after a diverged run; use another file`);
      }
      const t = gpu.upload(data, shape, dtype, 'weights', name);
      uploaded.push(t);
      w.set(name, t);
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
