// What a model file is: Stable Diffusion 1.x or 2.x (supported), SDXL or something else (refused,
// naming what it is), from tensor names and shapes alone, so it works on a safetensors header before
// any weight is read. A diffusers config.json, when given, overrides what the weights suggest.

export type Family = 'sd1' | 'sd2';
export type Prediction = 'epsilon' | 'v_prediction';
export type Component = 'unet' | 'vae' | 'text_encoder';

export interface Detected {
  family: Family;
  /** epsilon or v_prediction: weights cannot tell SD2's 512 epsilon models from 768 v models. */
  prediction: Prediction;
  /** Why the prediction type is what it is (config, or the default assumed). */
  predictionSource: string;
  layout: 'single-file' | 'diffusers';
  /** Text-encoder width: 768 (CLIP ViT-L, SD1) or 1024 (OpenCLIP ViT-H, SD2). */
  contextDim: number;
  /** Parameters and tensor counts per component (EMA copies excluded). */
  components: Record<Component, { tensors: number; parameters: number }>;
  ignored: { ema: number; other: number };
}

export class ModelError extends Error {
  override name = 'ModelError';
}

export type ShapeMap = Map<string, readonly number[]>;

const PREFIX: Record<Component, string[]> = {
  unet: ['model.diffusion_model.'],
  vae: ['first_stage_model.'],
  text_encoder: ['cond_stage_model.'],
};

function count(shape: readonly number[]): number {
  return shape.reduce((a, b) => a * b, 1);
}

function componentOf(name: string): Component | null {
  for (const [c, ps] of Object.entries(PREFIX) as [Component, string[]][]) if (ps.some((p) => name.startsWith(p))) return c;
  return null;
}

/** SDXL and other well-known non-SD1/2 layouts, named so the message can say what the file is. */
function refuseOthers(names: string[], what: string): void {
  const has = (p: string) => names.some((n) => n.startsWith(p));
  if (has('conditioner.embedders.') || names.includes('model.diffusion_model.label_emb.0.0.weight'))
    throw new ModelError(`${what} is an SDXL checkpoint: SDXL is not supported yet (SD 1.x and 2.x are)`);
  if (has('model.diffusion_model.joint_blocks.') || has('joint_blocks.'))
    throw new ModelError(`${what} is an SD3 (MMDiT) checkpoint: not supported yet (SD 1.x and 2.x are)`);
  if (has('double_blocks.') || has('model.diffusion_model.double_blocks.'))
    throw new ModelError(`${what} is a FLUX checkpoint: not supported yet (SD 1.x and 2.x are)`);
  if (names.some((n) => n.startsWith('lora_unet_') || n.startsWith('lora_te_') || n.includes('.lora_down.') || n.includes('lora_A')))
    throw new ModelError(`${what} is a LoRA, not a base model: load a full SD 1.x or 2.x checkpoint as the base`);
}

/** Detects a single-file (A1111/ComfyUI layout) checkpoint from its tensor names and shapes. */
export function detectSingleFile(shapes: ShapeMap, what = 'this file', config?: { prediction_type?: string }): Detected {
  const names = [...shapes.keys()];
  if (names.length === 0) throw new ModelError(`${what} holds no tensors: it is not a model`);
  refuseOthers(names, what);
  const components = { unet: { tensors: 0, parameters: 0 }, vae: { tensors: 0, parameters: 0 }, text_encoder: { tensors: 0, parameters: 0 } };
  const ignored = { ema: 0, other: 0 };
  for (const [n, s] of shapes) {
    if (n.startsWith('model_ema.')) {
      ignored.ema++;
      continue;
    }
    const c = componentOf(n);
    if (!c || n.endsWith('position_ids')) {
      ignored.other++;
      continue;
    }
    components[c].tensors++;
    components[c].parameters += count(s);
  }
  if (components.unet.tensors === 0)
    throw new ModelError(
      `${what} is not a Stable Diffusion checkpoint: it has no model.diffusion_model.* (UNet) tensors (${names.length} tensors, e.g. '${names[0]}')`,
    );
  const convIn = shapes.get('model.diffusion_model.input_blocks.0.0.weight');
  if (!convIn || convIn.length !== 4 || convIn[1] !== 4)
    throw new ModelError(
      `${what}: UNet input conv model.diffusion_model.input_blocks.0.0.weight is ${convIn ? `[${convIn}]` : 'missing'}, expected [C,4,3,3] (an inpainting or unusual UNet is not supported yet)`,
    );
  // Cross-attention key projection width = text-encoder width: 768 (SD1) or 1024 (SD2).
  const toK = names.find((n) => n.startsWith('model.diffusion_model.') && n.endsWith('attn2.to_k.weight'));
  if (!toK) throw new ModelError(`${what}: the UNet has no cross-attention (attn2.to_k) weights: not an SD 1.x/2.x UNet`);
  const contextDim = shapes.get(toK)![1];
  const sd2Text = names.some((n) => n.startsWith('cond_stage_model.model.'));
  const sd1Text = names.some((n) => n.startsWith('cond_stage_model.transformer.'));
  let family: Family;
  if (contextDim === 768 && !sd2Text) family = 'sd1';
  else if (contextDim === 1024 && !sd1Text) family = 'sd2';
  // Other widths (small test or custom models): the text encoder's key family decides.
  else if (contextDim !== 768 && contextDim !== 1024 && (sd1Text || sd2Text)) family = sd1Text ? 'sd1' : 'sd2';
  else if (contextDim !== 768 && contextDim !== 1024)
    throw new ModelError(
      `${what}: cross-attention width ${contextDim} is neither SD1's 768 nor SD2's 1024, and no text encoder says which family it is: unknown architecture`,
    );
  else family = contextDim === 768 ? 'sd1' : 'sd2';
  if ((family === 'sd1' && sd2Text) || (family === 'sd2' && sd1Text))
    throw new ModelError(
      `${what}: the UNet expects ${contextDim}-wide text embeddings but the text encoder is ${sd2Text ? "SD2's OpenCLIP" : "SD1's CLIP"}: mixed or corrupt checkpoint`,
    );
  const { prediction, source } = predictionFor(family, config);
  return { family, prediction, predictionSource: source, layout: 'single-file', contextDim, components, ignored };
}

export function predictionFor(family: Family, config?: { prediction_type?: string }): { prediction: Prediction; source: string } {
  const p = config?.prediction_type;
  if (p === 'epsilon' || p === 'v_prediction') return { prediction: p, source: 'scheduler config' };
  if (p !== undefined) throw new ModelError(`prediction_type '${p}' is not supported (epsilon or v_prediction)`);
  return family === 'sd1'
    ? { prediction: 'epsilon', source: 'SD1 default' }
    : { prediction: 'v_prediction', source: 'SD2 default (768-v models); pass a scheduler config for SD2 512-base epsilon models' };
}

/**
 * Detects a diffusers folder from its configs (model_index.json, unet/config.json, the scheduler's and
 * the text encoder's). Cross-attention width 768 is SD1, 1024 is SD2; other widths (small test or
 * custom models) take the family from the text encoder: OpenCLIP (SD2) converts with hidden_act
 * "gelu", CLIP ViT-L (SD1) has "quick_gelu".
 */
export function detectDiffusers(
  configs: { modelIndex?: Record<string, unknown>; unet?: Record<string, unknown>; scheduler?: Record<string, unknown>; textEncoder?: Record<string, unknown> },
  counts: Record<Component, { tensors: number; parameters: number }>,
  what = 'this folder',
): Detected {
  if (!configs.unet) throw new ModelError(`${what} is not a diffusers Stable Diffusion folder: unet/config.json is missing`);
  const cls = configs.modelIndex?._class_name;
  if (typeof cls === 'string' && /XL|StableDiffusion3|Flux|Kandinsky|Wuerstchen|StableCascade|PixArt|Sana|Lumina|HunyuanDiT|AuraFlow/i.test(cls))
    throw new ModelError(`${what} is a ${cls} model: not supported yet (SD 1.x and 2.x are)`);
  if (configs.unet.addition_embed_type === 'text_time')
    throw new ModelError(`${what} is an SDXL model (its UNet takes text_time embeddings): not supported yet`);
  const unetCls = configs.unet._class_name;
  if (typeof unetCls === 'string' && unetCls !== 'UNet2DConditionModel')
    throw new ModelError(`${what}: its unet is a ${unetCls}, not an SD 1.x/2.x UNet2DConditionModel: not supported yet`);
  if (configs.unet.in_channels !== undefined && configs.unet.in_channels !== 4)
    throw new ModelError(`${what}: unet in_channels ${configs.unet.in_channels} (inpainting or depth models are not supported yet)`);
  const cross = configs.unet.cross_attention_dim;
  const te = configs.textEncoder;
  const teWidth = te?.hidden_size;
  if (typeof cross !== 'number') throw new ModelError(`${what}: unet/config.json has no numeric cross_attention_dim: not an SD 1.x/2.x UNet`);
  if (typeof teWidth === 'number' && teWidth !== cross)
    throw new ModelError(`${what}: the UNet expects ${cross}-wide text embeddings but the text encoder is ${teWidth} wide: mixed or corrupt model`);
  let family: Family;
  if (cross === 768) family = 'sd1';
  else if (cross === 1024) family = 'sd2';
  else if (te?.hidden_act === 'gelu' || te?.hidden_act === 'quick_gelu') family = te.hidden_act === 'gelu' ? 'sd2' : 'sd1';
  else
    throw new ModelError(
      `${what}: unet cross_attention_dim ${cross} is neither SD1's 768 nor SD2's 1024, and the text encoder config does not say which family it is: unknown architecture`,
    );
  const { prediction, source } = predictionFor(family, configs.scheduler as { prediction_type?: string } | undefined);
  return { family, prediction, predictionSource: source, layout: 'diffusers', contextDim: cross, components: counts, ignored: { ema: 0, other: 0 } };
}
