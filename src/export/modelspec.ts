// Stability AI's model metadata spec ("modelspec.*" keys in the safetensors __metadata__), as kohya
// sd-scripts writes it (library/sai_model_spec.py): UIs read architecture, title, resolution and
// prediction type from it without looking at the tensors.
//   architecture: stable-diffusion-v1 | stable-diffusion-v2-512 | stable-diffusion-v2-768-v (SD2 + v
//     prediction), with "/lora" appended for a LoRA (kohya's spelling; the spec's README lists
//     "stable-diffusion-v1-lora");
//   implementation: "diffusers" for SD1/SD2 LoRAs (kohya's IMPL_DIFFUSERS: the module names are
//     diffusers'), "https://github.com/Stability-AI/generative-models" for full checkpoints (kohya's
//     IMPL_STABILITY_AI: the single-file keys are the original implementation's);
//   resolution "512x512"; prediction_type "epsilon" | "v"; date ISO-8601; encoder_layer = clip skip.
import type { Family, Prediction } from '../models/detect.ts';

export const SAI_MODEL_SPEC_VERSION = '1.0.0';
const IMPL_DIFFUSERS = 'diffusers';
export const IMPL_STABILITY_AI = 'https://github.com/Stability-AI/generative-models';

export function architecture(family: Family, prediction: Prediction): string {
  if (family === 'sd1') return 'stable-diffusion-v1';
  return prediction === 'v_prediction' ? 'stable-diffusion-v2-768-v' : 'stable-diffusion-v2-512';
}

/** The training resolution SD models of this kind are used at (kohya's default when none is given). */
export function defaultResolution(family: Family, prediction: Prediction): number {
  return family === 'sd2' && prediction === 'v_prediction' ? 768 : 512;
}

/** ISO-8601 to the second, UTC. */
export function isoDate(d: Date): string {
  return d.toISOString().replace(/\.\d{3}Z$/, 'Z');
}

export interface ModelSpecInfo {
  family: Family;
  prediction: Prediction;
  lora: boolean;
  title: string;
  date: Date;
  resolution: number;
  description?: string;
  /** Words that call up the trained subject (the instance prompt). */
  triggerPhrase?: string;
  /** CLIP skip (1 = the text encoder's last layer as configured). */
  encoderLayer?: number;
}

export function modelspec(o: ModelSpecInfo): Record<string, string> {
  const m: Record<string, string> = {
    'modelspec.sai_model_spec': SAI_MODEL_SPEC_VERSION,
    'modelspec.architecture': architecture(o.family, o.prediction) + (o.lora ? '/lora' : ''),
    'modelspec.implementation': o.lora ? IMPL_DIFFUSERS : IMPL_STABILITY_AI,
    'modelspec.title': o.title,
    'modelspec.resolution': `${o.resolution}x${o.resolution}`,
    'modelspec.date': isoDate(o.date),
    'modelspec.prediction_type': o.prediction === 'v_prediction' ? 'v' : 'epsilon',
  };
  if (o.description) m['modelspec.description'] = o.description;
  if (o.triggerPhrase) m['modelspec.trigger_phrase'] = o.triggerPhrase;
  if (o.encoderLayer !== undefined) m['modelspec.encoder_layer'] = String(o.encoderLayer);
  return m;
}
