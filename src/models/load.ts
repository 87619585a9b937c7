// Loads a Stable Diffusion model into engine tensors from a ModelSource (source.ts: a single-file
// checkpoint through the key maps, or a diffusers folder), one tensor at a time. Every tensor's name and
// shape is checked against the parameters the configs call for BEFORE any weight is read or uploaded.
import type { Gpu } from '../gpu/device.ts';
import type { DType } from '../gpu/tensor.ts';
import type { SafetensorsFile } from '../io/safetensors.ts';
import { clipConfigFromJson, type ClipTextConfig } from '../nn/clip.ts';
import type { Weights } from '../nn/blocks.ts';
import { unetConfigFromJson, type UnetConfig } from '../nn/unet.ts';
import { vaeConfigFromJson, type VaeConfig } from '../nn/vae.ts';
import { ModelError, type Component, type Family, type Prediction } from './detect.ts';
import { clipParams, unetParams, vaeParams, type ParamShapes } from './shapes.ts';
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
  const missing: string[] = [];
  for (const [name, shape] of expected) {
    const got = actual.get(name);
    if (!got) missing.push(name);
    else if (got.length !== shape.length || got.some((d, i) => d !== shape[i]))
      throw new ModelError(`${what}: ${component} tensor ${name} is [${got}] but its config needs [${shape}]`);
  }
  if (missing.length)
    throw new ModelError(`${what}: ${component} is missing ${missing.length} tensor(s), e.g. ${missing.slice(0, 3).join(', ')}`);
  const extra = [...actual.keys()].filter((n) => !expected.has(n));
  if (extra.length) throw new ModelError(`${what}: ${component} has ${extra.length} tensor(s) its config does not use, e.g. ${extra.slice(0, 3).join(', ')}`);
}

/** Configs from the source, every tensor checked, then uploaded one by one in `dtype`. */
export async function loadModel(gpu: Gpu, src: ModelSource, dtype: DType): Promise<LoadedModel> {
  const unetConfig = unetConfigFromJson(src.configs.unet);
  const vaeConfig = vaeConfigFromJson(src.configs.vae);
  const teConfig = clipConfigFromJson(src.configs.text_encoder);
  const expected: [Component, string, ParamShapes][] = [
    ['unet', 'unet', unetParams(unetConfig)],
    ['vae', 'vae', vaeParams(vaeConfig)],
    ['text_encoder', 'text encoder', clipParams(teConfig)],
  ];
  for (const [c, label, params] of expected) validateComponent(src.name, label, params, src.shapes(c));
  const upload = async (c: Component): Promise<Weights> => {
    const w: Weights = new Map();
    for (const [name, shape] of src.shapes(c)) w.set(name, gpu.upload((await src.read(c, name)).data, shape, dtype, 'weights', name));
    return w;
  };
  return {
    family: src.family,
    prediction: src.prediction,
    unet: { config: unetConfig, weights: await upload('unet') },
    vae: { config: vaeConfig, weights: await upload('vae') },
    textEncoder: { config: teConfig, weights: await upload('text_encoder') },
  };
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
