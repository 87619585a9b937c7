// SDXL LoRA files in kohya sd-scripts' layout (sdxl_train_network.py), the one A1111, ComfyUI and diffusers
// read for SDXL. Unlike SD 1/2 (lora.ts), kohya trains SDXL on its own SGM-named UNet, so the UNet module
// paths are the original implementation's, and the two text encoders get their own prefixes:
//   lora_unet_<SGM UNet module, '.' -> '_'>          e.g. lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q,
//                                                          lora_unet_middle_block_1_transformer_blocks_9_attn2_to_out_0
//   lora_te1_text_model_encoder_layers_<i>_self_attn_<q|k|v|out>_proj   (CLIP ViT-L, transformers names)
//   lora_te2_text_model_encoder_layers_<i>_self_attn_<q|k|v|out>_proj   (OpenCLIP bigG as CLIPTextModelWithProjection)
// each with .lora_down.weight = A [r, in] (F16), .lora_up.weight = B [out, r] (F16) and .alpha (0-d F32), applied
// as (alpha / r) up @ down. Metadata: lora.ts's ss_* fields with ss_base_model_version sdxl_base_v1-0 and ss_v2
// False, and modelspec with architecture stable-diffusion-xl-v1-base/lora and, as kohya's sai_model_spec.py
// writes for SDXL LoRAs, the Stability AI implementation (the module names are SGM's).
// The diffusers file (writeSdxlPeftLora) keeps diffusers names under unet., text_encoder. and text_encoder_2.
import type { ByteSink } from '../io/safetensors.ts';
import { unetFromDiffusers, type UnetLayout } from '../models/keymap.ts';
import { FOLDED_KEYS, isLoraTarget, kohyaMetadata, type LoraInfo } from './lora.ts';
import { addnetModelHash, hashedSafetensorsChunks } from './addnet-hash.ts';
import { IMPL_STABILITY_AI, isoDate, SAI_MODEL_SPEC_VERSION } from './modelspec.ts';
import { ExportError, type TensorProvider } from './provider.ts';
import { pump, pyFloat, type OutTensor, safetensorsChunks } from './stream.ts';

export const SDXL_KOHYA_VERSION = 'sdxl_base_v1-0';
export const SDXL_LORA_ARCHITECTURE = 'stable-diffusion-xl-v1-base/lora';

/** Adapters on an SDXL model in engine (PEFT, diffusers-named) layout. */
export interface SdxlLoraAdapters {
  rank: number;
  alpha: number;
  /** The UNet's block layout (keymap.ts), to name its modules as SGM does. */
  layout: UnetLayout;
  unet: TensorProvider;
  textEncoder?: TensorProvider;
  textEncoder2?: TensorProvider;
}

type Part = 'unet' | 'te1' | 'te2';

/** kohya's SDXL module name of an engine layer. */
export function sdxlKohyaName(part: Part, layer: string, layout: UnetLayout): string {
  const path = part === 'unet' ? unetFromDiffusers(layer, layout) : layer;
  return `lora_${part}_${path.replace(/\./g, '_')}`;
}

/** Every adapter layer, validated (target, both halves, rank), in kohya's order: te1, te2, unet. */
function sdxlLayers(a: SdxlLoraAdapters): { part: Part; layer: string; provider: TensorProvider }[] {
  if (!Number.isInteger(a.rank) || a.rank < 1) throw new ExportError(`LoRA rank must be a positive integer, got ${a.rank}`);
  if (!Number.isFinite(a.alpha) || a.alpha <= 0) throw new ExportError(`LoRA alpha must be a positive number, got ${a.alpha}`);
  const out: { part: Part; layer: string; provider: TensorProvider }[] = [];
  const groups: [Part, TensorProvider | undefined][] = [
    ['te1', a.textEncoder],
    ['te2', a.textEncoder2],
    ['unet', a.unet],
  ];
  for (const [part, provider] of groups) {
    if (!provider) continue;
    const layers = [...new Set(provider.names().map((n) => /^(.*)\.lora_[AB]\.weight$/.exec(n)?.[1] ?? n))];
    for (const layer of layers) {
      if (!isLoraTarget(part === 'unet' ? 'unet' : 'text_encoder', layer))
        throw new ExportError(`${part} adapter tensor '${layer}' is not <layer>.lora_A/B.weight on one of the engine's LoRA targets`);
      const [A, B] = [`${layer}.lora_A.weight`, `${layer}.lora_B.weight`];
      if (!provider.names().includes(A) || !provider.names().includes(B)) throw new ExportError(`${part} adapter '${layer}' lacks its lora_A or lora_B weight`);
      const [sa, sb] = [provider.shape(A), provider.shape(B)];
      if (sa[0] !== a.rank || sb[1] !== a.rank) throw new ExportError(`${part} adapter '${layer}': lora_A [${sa}] and lora_B [${sb}] are not rank ${a.rank}`);
      out.push({ part, layer, provider });
    }
  }
  if (!out.length) throw new ExportError('no LoRA adapters to export');
  return out;
}

/** The kohya file's tensors in order (te1, te2, unet, as kohya), per module alpha, lora_down, lora_up. */
export function sdxlKohyaTensors(a: SdxlLoraAdapters): OutTensor[] {
  return sdxlLayers(a).flatMap(({ part, layer, provider }) => {
    const k = sdxlKohyaName(part, layer, a.layout);
    const [A, B] = [`${layer}.lora_A.weight`, `${layer}.lora_B.weight`];
    return [
      { name: `${k}.alpha`, dtype: 'F32', shape: [], data: async () => Float32Array.of(a.alpha) },
      { name: `${k}.lora_down.weight`, dtype: 'F16', shape: provider.shape(A), data: () => provider.read(A) },
      { name: `${k}.lora_up.weight`, dtype: 'F16', shape: provider.shape(B), data: () => provider.read(B) },
    ] satisfies OutTensor[];
  });
}

/** diffusers' SDXL LoRA prefixes (StableDiffusionXLPipeline.load_lora_weights). */
const PEFT_SDXL: Record<Part, string> = { unet: 'unet', te1: 'text_encoder', te2: 'text_encoder_2' };

/**
 * diffusers' SDXL `pytorch_lora_weights.safetensors`: unet.<diffusers module>, text_encoder.<...>,
 * text_encoder_2.<...> with lora_A / lora_B, alpha / rank folded into lora_B as lora.ts's PEFT file does
 * (diffusers assumes lora_alpha = r when the file has no alphas), rank and alpha in the metadata.
 */
export function sdxlPeftTensors(a: SdxlLoraAdapters): OutTensor[] {
  const scale = a.alpha / a.rank;
  return sdxlLayers(a).flatMap(({ part, layer, provider }) => {
    const p = `${PEFT_SDXL[part]}.${layer}`;
    const [A, B] = [`${layer}.lora_A.weight`, `${layer}.lora_B.weight`];
    return [
      { name: `${p}.lora_A.weight`, dtype: 'F16', shape: provider.shape(A), data: () => provider.read(A) },
      { name: `${p}.lora_B.weight`, dtype: 'F16', shape: provider.shape(B), data: async () => (await provider.read(B)).map((v) => v * scale) },
    ] satisfies OutTensor[];
  });
}

/** Writes the diffusers SDXL LoRA (alpha / rank folded into lora_B) to `sink` and closes it. */
export async function writeSdxlPeftLora(sink: ByteSink, a: SdxlLoraAdapters, info: Omit<LoraInfo, 'family'>): Promise<void> {
  const spec = Object.fromEntries(Object.entries(sdxlKohyaMetadata(a, info)).filter(([k]) => k.startsWith('modelspec.')));
  const metadata = { format: 'pt', ...spec, [FOLDED_KEYS.rank]: String(a.rank), [FOLDED_KEYS.alpha]: pyFloat(a.alpha), [FOLDED_KEYS.folded]: 'true' };
  await pump(safetensorsChunks(sdxlPeftTensors(a), metadata), sink);
}

/** ss_* (as lora.ts, the family-derived fields SDXL's) and modelspec.* metadata of an SDXL LoRA. */
export function sdxlKohyaMetadata(a: SdxlLoraAdapters, info: Omit<LoraInfo, 'family'>): Record<string, string> {
  const md = kohyaMetadata({ rank: a.rank, alpha: a.alpha, unet: a.unet, textEncoder: a.textEncoder ?? a.textEncoder2 }, { ...info, family: 'sd1' });
  md.ss_v2 = 'False';
  md.ss_base_model_version = SDXL_KOHYA_VERSION;
  const spec: Record<string, string> = {
    'modelspec.sai_model_spec': SAI_MODEL_SPEC_VERSION,
    'modelspec.architecture': SDXL_LORA_ARCHITECTURE,
    'modelspec.implementation': IMPL_STABILITY_AI,
    'modelspec.title': info.title,
    'modelspec.resolution': `${info.resolution}x${info.resolution}`,
    'modelspec.date': isoDate(info.date),
    'modelspec.prediction_type': info.prediction === 'v_prediction' ? 'v' : 'epsilon',
    'modelspec.description': `DreamBooth LoRA of "${info.instancePrompt}" on ${info.baseModelName}`,
    'modelspec.trigger_phrase': info.instancePrompt,
  };
  return { ...md, ...spec };
}

/** sshs_model_hash of the kohya file of `a` (metadata aside): A1111's "Lora hashes" of a Try it image. */
export async function sdxlKohyaLoraHash(a: SdxlLoraAdapters): Promise<string> {
  return addnetModelHash(sdxlKohyaTensors(a));
}

/** Writes an SDXL kohya LoRA, with its sshs_* hashes (addnet-hash.ts), to `sink` one tensor at a time, and closes it. */
export async function writeSdxlKohyaLora(sink: ByteSink, a: SdxlLoraAdapters, info: Omit<LoraInfo, 'family'>): Promise<void> {
  await pump(hashedSafetensorsChunks(sdxlKohyaTensors(a), sdxlKohyaMetadata(a, info)), sink);
}
