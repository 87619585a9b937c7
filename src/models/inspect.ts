// Inspection of a model on disk or from the browser: architecture, prediction type, tensor counts and
// parameters per component, read from safetensors headers only.
import { SafetensorsFile } from '../io/safetensors.ts';
import type { ByteSource } from '../io/source.ts';
import { detectDiffusers, detectSingleFile, ModelError, type Component, type Detected } from './detect.ts';

export interface Inspection extends Detected {
  tensorCount: number;
  files: string[];
}

export async function inspectSingleFile(source: ByteSource, config?: { prediction_type?: string }): Promise<Inspection> {
  const f = await SafetensorsFile.open(source);
  const shapes = new Map(f.names.map((n) => [n, f.entry(n).shape] as const));
  return { ...detectSingleFile(shapes, source.name, config), tensorCount: shapes.size, files: [source.name] };
}

/** A diffusers folder as a lookup of relative paths (Node: the file system; browser: a dropped folder). */
export interface FolderReader {
  name: string;
  exists(path: string): Promise<boolean>;
  readJson(path: string): Promise<Record<string, unknown>>;
  open(path: string): Promise<ByteSource>;
}

const WEIGHTS: Record<Component, string[]> = {
  unet: ['unet/diffusion_pytorch_model.safetensors', 'unet/diffusion_pytorch_model.fp16.safetensors'],
  vae: ['vae/diffusion_pytorch_model.safetensors', 'vae/diffusion_pytorch_model.fp16.safetensors'],
  text_encoder: ['text_encoder/model.safetensors', 'text_encoder/model.fp16.safetensors'],
};

export async function inspectDiffusers(dir: FolderReader): Promise<Inspection> {
  if (!(await dir.exists('model_index.json'))) throw new ModelError(`${dir.name} is not a diffusers folder: model_index.json is missing`);
  const modelIndex = await dir.readJson('model_index.json');
  const unet = (await dir.exists('unet/config.json')) ? await dir.readJson('unet/config.json') : undefined;
  const scheduler = (await dir.exists('scheduler/scheduler_config.json')) ? await dir.readJson('scheduler/scheduler_config.json') : undefined;
  const counts = {} as Record<Component, { tensors: number; parameters: number }>;
  const files: string[] = [];
  let tensorCount = 0;
  for (const [c, candidates] of Object.entries(WEIGHTS) as [Component, string[]][]) {
    let found: string | undefined;
    for (const p of candidates) if (await dir.exists(p)) { found = p; break; }
    if (!found) {
      const bin = candidates[0].replace(/\.safetensors$/, '.bin');
      const why = (await dir.exists(bin)) ? ` (${bin} is a pickle: convert it to .safetensors)` : '';
      throw new ModelError(`${dir.name}: ${c} weights are missing: expected ${candidates.join(' or ')}${why}`);
    }
    const f = await SafetensorsFile.open(await dir.open(found));
    counts[c] = { tensors: f.names.length, parameters: f.names.reduce((s, n) => s + f.entry(n).shape.reduce((a, b) => a * b, 1), 0) };
    tensorCount += f.names.length;
    files.push(found);
  }
  return { ...detectDiffusers({ modelIndex, unet, scheduler }, counts, dir.name), tensorCount, files };
}
