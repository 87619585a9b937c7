// LoRA files: the engine trains adapters in PEFT naming (nn/unet.ts loraLinear: `<layer>.lora_A.weight`
// [r, in], `<layer>.lora_B.weight` [out, r], y += (alpha / r) (x A^T) B^T) on the UNet's attention
// projections (to_q, to_k, to_v, to_out.0) and optionally the text encoder's (q_proj, k_proj, v_proj,
// out_proj). They are written in two layouts, streamed tensor by tensor, and read back from either.
//
// 1. kohya sd-scripts (networks/lora.py), the layout every SD UI reads:
//      lora_unet_<diffusers UNet module path, '.' -> '_'>.lora_down.weight   = A  [r, in]   F16
//      lora_unet_<...>.lora_up.weight                                        = B  [out, r]  F16
//      lora_unet_<...>.alpha                                                 = alpha, shape [] (0-d) F32
//      lora_te_text_model_encoder_layers_<i>_self_attn_<q|k|v|out>_proj.*    (text encoder, same parts)
//    kohya trains SD1/2 on a diffusers-named UNet and CLIPTextModel, so the module paths are diffusers'
//    (lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q, ..._to_out_0), and the
//    applied delta is (alpha / r) * up @ down. What the loaders accept (read from their key-mapping code):
//    - A1111 (extensions-builtin/Lora/networks.py): splits each key at its FIRST '.', so the module part
//      must be dot-free; convert_diffusers_name_to_compvis maps lora_unet_{down,mid,up}_block(s)_*_
//      attentions_* and lora_te_text_model_encoder_layers_<i>_* onto its CompVis modules (SD2: the
//      OpenCLIP resblock, where *_q_proj/_k_proj/_v_proj land on rows of the fused in_proj_weight);
//      reads `alpha` with .item() and scales by alpha / lora_down.shape[0].
//    - ComfyUI (comfy/lora.py): model_lora_keys_unet maps "lora_unet_" + diffusers name with '.' -> '_'
//      (from utils.unet_to_diffusers) and model_lora_keys_clip maps lora_te_text_model_encoder_layers_
//      <i>_self_attn_<q|k|v|out>_proj for clip_l (SD1) and clip_h (SD2); load_lora pairs .lora_up/
//      .lora_down and takes `.alpha` with .item().
//    - diffusers (loaders/lora_conversion_utils.py _convert_non_diffusers_lora_to_diffusers): any
//      "lora_unet_"/"lora_te_" key is converted to its diffusers module, `.alpha` becomes network_alphas.
//    kohya itself stores alpha as a 0-d tensor in the save dtype (F16 in fp16 files); all three loaders
//    call .item(), so the F32 scalar written here is read the same way and keeps alpha exact.
//
// 2. diffusers/PEFT (`pytorch_lora_weights.safetensors`, read by StableDiffusionPipeline.load_lora_weights):
//      unet.<diffusers UNet module path>.lora_A.weight / .lora_B.weight
//      text_encoder.text_model.encoder.layers.<i>.self_attn.<q|k|v|out>_proj.lora_A.weight / .lora_B.weight
//    Without alphas in the file, diffusers builds its LoraConfig with lora_alpha = r (peft_utils
//    get_peft_kwargs), i.e. scale 1. So alpha / r is FOLDED into lora_B here: every loader applies the
//    trained delta with no extra setting. rank and the trained alpha go in the metadata
//    (dreambooth_studio.lora_rank / .lora_alpha / .lora_alpha_folded = "true") for people and for
//    readLora; diffusers' own `lora_adapter_metadata` key is NOT written, since when present diffusers
//    takes lora_alpha from it and would scale the folded B a second time.
//    Of the other UIs, ComfyUI maps this layout's text-encoder keys (text_encoder.text_model...) but for
//    SD1/2 UNets only the older attention-processor spelling (unet.<...>.attn1.processor.to_q), and A1111
//    not at all: the kohya file is the one to share, this one is for diffusers pipelines.
import type { NamedTensor, SafetensorsFile } from '../io/safetensors.ts';
import type { ByteSink } from '../io/safetensors.ts';
import type { Family, Prediction } from '../models/detect.ts';
import { addnetModelHash, hashedSafetensorsChunks } from './addnet-hash.ts';
import { modelspec } from './modelspec.ts';
import { ExportError, type TensorProvider } from './provider.ts';
import { pump, pyBool, pyFloat, pyJson, safetensorsChunks, type OutTensor, type PyJson } from './stream.ts';

export type LoraComponent = 'unet' | 'text_encoder';

/** Trained adapters in engine (PEFT) naming, read lazily. */
export interface LoraAdapters {
  rank: number;
  alpha: number;
  /** `<diffusers UNet module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]. */
  unet: TensorProvider;
  /** `text_model.encoder.layers.<i>.self_attn.<q|k|v|out>_proj.lora_A.weight` / `.lora_B.weight`. */
  textEncoder?: TensorProvider;
}

/** What the metadata says about the training run. */
export interface LoraInfo {
  family: Family;
  prediction: Prediction;
  /** Training resolution in pixels (square). */
  resolution: number;
  steps: number;
  lr: number;
  textEncoderLr?: number;
  instancePrompt: string;
  classPrompt?: string;
  /** Instance images (kohya counts repeats in). */
  numImages: number;
  /** Prior-preservation (class) images. */
  numClassImages?: number;
  baseModelName: string;
  /** SHA-256 of the base model file, hex. */
  baseModelHash?: string;
  title: string;
  /** When the file was made (training end). */
  date: Date;
  startedAt?: Date;
  seed?: number;
  /** The learning-rate schedule (transformers' name, e.g. cosine) and its warm-up steps. */
  lrScheduler?: string;
  lrWarmup?: number;
  batchSize?: number;
  /** CLIP skip used in training (1 = last layer). */
  clipSkip?: number;
  /** Per instance image its caption, when captions replace the instance prompt (ss_tag_frequency counts their tags). */
  captions?: readonly string[];
  /** Caption dropout and tag shuffling (train/captions.ts), recorded as sd-scripts records its own. */
  captionOptions?: { dropout: number; shuffle: boolean; keepTokens: number };
}

// ---- engine targets and names ----------------------------------------------------------------------

/** UNet layers the engine puts adapters on (nn/unet.ts attention projections). */
const UNET_TARGET =
  /^(?:(?:down|up)_blocks\.\d+\.attentions\.\d+|mid_block\.attentions\.\d+)\.transformer_blocks\.\d+\.attn[12]\.(?:to_q|to_k|to_v|to_out\.0)$/;
/** Text-encoder layers (CLIPTextModel self-attention projections). */
const TE_TARGET = /^text_model\.encoder\.layers\.\d+\.self_attn\.(?:q_proj|k_proj|v_proj|out_proj)$/;

export function isLoraTarget(component: LoraComponent, layer: string): boolean {
  return (component === 'unet' ? UNET_TARGET : TE_TARGET).test(layer);
}

/** kohya module name of an engine layer: lora_unet_/lora_te_ + the path with '.' -> '_'. */
export function kohyaName(component: LoraComponent, layer: string): string {
  return `${component === 'unet' ? 'lora_unet' : 'lora_te'}_${layer.replace(/\./g, '_')}`;
}

const KOHYA_UNET = /^lora_unet_(down_blocks_\d+|up_blocks_\d+|mid_block)_attentions_(\d+)_transformer_blocks_(\d+)_(attn[12])_(to_q|to_k|to_v|to_out_0)$/;
const KOHYA_TE = /^lora_te_text_model_encoder_layers_(\d+)_self_attn_(q_proj|k_proj|v_proj|out_proj)$/;

/** Engine layer of a kohya module name (inverse of kohyaName for the engine's targets), or null. */
export function layerFromKohya(name: string): { component: LoraComponent; layer: string } | null {
  let m = KOHYA_UNET.exec(name);
  if (m) {
    const block = m[1].replace(/^(down_blocks|up_blocks)_(\d+)$/, '$1.$2');
    return { component: 'unet', layer: `${block}.attentions.${m[2]}.transformer_blocks.${m[3]}.${m[4]}.${m[5] === 'to_out_0' ? 'to_out.0' : m[5]}` };
  }
  m = KOHYA_TE.exec(name);
  if (m) return { component: 'text_encoder', layer: `text_model.encoder.layers.${m[1]}.self_attn.${m[2]}` };
  return null;
}

interface Layer {
  component: LoraComponent;
  layer: string;
  provider: TensorProvider;
}

/** The adapters' layers (text encoder first, as kohya orders them), each with a lora_A/lora_B pair of rank r. */
function layersOf(adapters: LoraAdapters): Layer[] {
  const { rank, alpha } = adapters;
  if (!Number.isInteger(rank) || rank < 1) throw new ExportError(`LoRA rank must be a positive integer, got ${rank}`);
  if (!Number.isFinite(alpha) || alpha <= 0) throw new ExportError(`LoRA alpha must be a positive number, got ${alpha}`);
  const out: Layer[] = [];
  const groups: [LoraComponent, TensorProvider | undefined][] = [
    ['text_encoder', adapters.textEncoder],
    ['unet', adapters.unet],
  ];
  for (const [component, provider] of groups) {
    if (!provider) continue;
    const layers = new Map<string, Set<'A' | 'B'>>();
    for (const n of provider.names()) {
      const m = /^(.*)\.lora_([AB])\.weight$/.exec(n);
      if (!m) throw new ExportError(`${component} adapter tensor '${n}' is not <layer>.lora_A.weight or <layer>.lora_B.weight`);
      if (!isLoraTarget(component, m[1]))
        throw new ExportError(
          `${component} adapter on '${m[1]}': the engine's LoRA targets are ${component === 'unet' ? 'to_q, to_k, to_v and to_out.0 of the UNet attentions' : 'q_proj, k_proj, v_proj and out_proj of the text encoder'}`,
        );
      if (!layers.has(m[1])) layers.set(m[1], new Set());
      layers.get(m[1])!.add(m[2] as 'A' | 'B');
    }
    for (const [layer, parts] of layers) {
      if (parts.size !== 2) throw new ExportError(`${component} adapter '${layer}' lacks its lora_${parts.has('A') ? 'B' : 'A'}.weight`);
      const a = provider.shape(`${layer}.lora_A.weight`);
      const b = provider.shape(`${layer}.lora_B.weight`);
      if (a.length !== 2 || b.length !== 2 || a[0] !== rank || b[1] !== rank)
        throw new ExportError(`${component} adapter '${layer}': lora_A [${a}] and lora_B [${b}] are not [${rank}, in] and [out, ${rank}] for rank ${rank}`);
      out.push({ component, layer, provider });
    }
  }
  if (!out.length) throw new ExportError('no LoRA adapters to export');
  return out;
}

const f16 = (name: string, shape: number[], data: () => Promise<Float32Array>): OutTensor => ({ name, dtype: 'F16', shape, data });

// ---- kohya ------------------------------------------------------------------------------------------

/** kohya's ss_base_model_version (model_util.get_model_version_str_for_sd1_sd2): sd_v1, sd_v2, sd_v2_v. */
function kohyaModelVersion(family: Family, prediction: Prediction): string {
  return `sd_${family === 'sd1' ? 'v1' : 'v2'}${prediction === 'v_prediction' ? '_v' : ''}`;
}

/** The ss_* training metadata kohya's train_network.py writes (str() of its Python values), for what we know. */
export function kohyaMetadata(adapters: LoraAdapters, info: LoraInfo): Record<string, string> {
  const started = info.startedAt ?? info.date;
  const comment = [`DreamBooth Studio`, `instance prompt: ${info.instancePrompt}`, ...(info.classPrompt ? [`class prompt: ${info.classPrompt}`] : [])].join(
    '; ',
  );
  const md: Record<string, string> = {
    ss_session_id: String(Math.floor(started.getTime() / 1000) >>> 0),
    ss_training_started_at: pyFloat(started.getTime() / 1000),
    ss_training_finished_at: pyFloat(info.date.getTime() / 1000),
    ss_output_name: info.title,
    ss_learning_rate: pyFloat(info.lr),
    ss_unet_lr: pyFloat(info.lr),
    ss_num_train_images: String(info.numImages),
    ss_num_reg_images: String(info.numClassImages ?? 0),
    ss_max_train_steps: String(info.steps),
    ss_steps: String(info.steps),
    ss_network_module: 'networks.lora',
    ss_network_dim: String(adapters.rank),
    ss_network_alpha: pyFloat(adapters.alpha),
    ss_mixed_precision: 'fp16',
    ss_v2: pyBool(info.family === 'sd2'),
    ss_base_model_version: kohyaModelVersion(info.family, info.prediction),
    ss_resolution: `(${info.resolution}, ${info.resolution})`,
    ss_training_comment: comment,
    ss_sd_model_name: info.baseModelName,
    ...kohyaDatasets(info),
  };
  if (adapters.textEncoder) md.ss_text_encoder_lr = pyFloat(info.textEncoderLr ?? info.lr);
  if (info.baseModelHash) md.ss_new_sd_model_hash = info.baseModelHash;
  if (info.clipSkip !== undefined) md.ss_clip_skip = String(info.clipSkip);
  if (info.seed !== undefined) md.ss_seed = String(info.seed);
  if (info.lrScheduler !== undefined) md.ss_lr_scheduler = info.lrScheduler;
  if (info.lrWarmup !== undefined) md.ss_lr_warmup_steps = String(info.lrWarmup);
  if (info.batchSize !== undefined) md.ss_batch_size_per_device = String(info.batchSize);
  if (info.captionOptions) md.ss_caption_dropout_rate = pyFloat(info.captionOptions.dropout);
  return md;
}

/** The dataset folders as the sd-scripts job bundle lays them out (pipeline/bundle-sdscripts.ts). */
export const KOHYA_DIRS = { instance: 'instance_images', class: 'class_images' } as const;

/** sd-scripts' BaseDataset.set_tag_frequency: each caption split at ',', stripped, lower-cased, counted. */
export function tagFrequency(captions: readonly string[]): Map<string, number> {
  const freq = new Map<string, number>();
  for (const caption of captions)
    for (let tag of caption.split(',')) {
      tag = tag.trim().toLowerCase();
      if (tag) freq.set(tag, (freq.get(tag) ?? 0) + 1);
    }
  return freq;
}

/**
 * ss_datasets, ss_tag_frequency and ss_dataset_dirs as sd-scripts' train_network.py writes them (json.dumps of
 * its per-dataset dicts) for the one DreamBooth dataset a run is: the instance subset (class_tokens = the
 * instance prompt, or per-image captions) and, with prior preservation, the regularisation subset
 * (is_reg). Photos are used once per epoch (num_repeats 1), at one square resolution (one bucket, no
 * bucketing); A1111 shows ss_tag_frequency as the LoRA's training tags.
 */
function kohyaDatasets(info: LoraInfo): Record<string, string> {
  const reg = info.classPrompt !== undefined && (info.numClassImages ?? 0) > 0;
  const instanceCaptions = info.captions ?? Array<string>(info.numImages).fill(info.instancePrompt);
  const frequency = new Map<string, PyJson>([[KOHYA_DIRS.instance, tagFrequency(instanceCaptions)]]);
  if (reg) frequency.set(KOHYA_DIRS.class, tagFrequency(Array<string>(info.numClassImages!).fill(info.classPrompt!)));
  const shuffled = (isReg: boolean) => (!isReg && info.captionOptions?.shuffle) || false;
  const subset = (dir: string, count: number, tokens: string, isReg: boolean) =>
    new Map<string, PyJson>([
      ['img_count', count],
      ['num_repeats', 1],
      ['color_aug', false],
      ['flip_aug', false],
      ['random_crop', false],
      ['shuffle_caption', shuffled(isReg)],
      ['keep_tokens', shuffled(isReg) ? info.captionOptions!.keepTokens : 0],
      ['keep_tokens_separator', ''],
      ['secondary_separator', null],
      ['enable_wildcard', false],
      ['caption_prefix', null],
      ['caption_suffix', null],
      ['image_dir', dir],
      ['class_tokens', tokens],
      ['is_reg', isReg],
    ]);
  const subsets = [subset(KOHYA_DIRS.instance, info.numImages, info.instancePrompt, false)];
  if (reg) subsets.push(subset(KOHYA_DIRS.class, info.numClassImages!, info.classPrompt!, true));
  const images = info.numImages + (reg ? info.numClassImages! : 0);
  const dataset = new Map<string, PyJson>([
    ['is_dreambooth', true],
    ['batch_size_per_device', info.batchSize ?? 1],
    ['num_train_images', info.numImages],
    ['num_reg_images', reg ? info.numClassImages! : 0],
    ['resolution', [info.resolution, info.resolution]],
    ['enable_bucket', false],
    ['min_bucket_reso', null],
    ['max_bucket_reso', null],
    ['tag_frequency', frequency],
    [
      'bucket_info',
      new Map([
        [
          'buckets',
          new Map([
            [
              '0',
              new Map<string, PyJson>([
                ['resolution', [info.resolution, info.resolution]],
                ['count', images],
              ]),
            ],
          ]),
        ],
      ]),
    ],
    ['subsets', subsets],
  ]);
  return {
    ss_datasets: pyJson([dataset]),
    ss_tag_frequency: pyJson(frequency),
    ss_dataset_dirs: pyJson(
      new Map([
        [
          KOHYA_DIRS.instance,
          new Map([
            ['n_repeats', 1],
            ['img_count', info.numImages],
          ]),
        ],
      ]),
    ),
  };
}

function loraModelspec(info: LoraInfo): Record<string, string> {
  return modelspec({
    family: info.family,
    prediction: info.prediction,
    lora: true,
    title: info.title,
    date: info.date,
    resolution: info.resolution,
    triggerPhrase: info.instancePrompt,
    encoderLayer: info.clipSkip,
    description: `DreamBooth LoRA of "${info.instancePrompt}" on ${info.baseModelName}`,
  });
}

/** The kohya file's tensors in order: per module alpha, lora_down, lora_up. */
function kohyaTensors(adapters: LoraAdapters): OutTensor[] {
  const out: OutTensor[] = [];
  for (const { component, layer, provider } of layersOf(adapters)) {
    const k = kohyaName(component, layer);
    out.push({ name: `${k}.alpha`, dtype: 'F32', shape: [], data: async () => Float32Array.of(adapters.alpha) });
    out.push(f16(`${k}.lora_down.weight`, provider.shape(`${layer}.lora_A.weight`), () => provider.read(`${layer}.lora_A.weight`)));
    out.push(f16(`${k}.lora_up.weight`, provider.shape(`${layer}.lora_B.weight`), () => provider.read(`${layer}.lora_B.weight`)));
  }
  return out;
}

/** sshs_model_hash of the kohya file of `adapters` (metadata aside): A1111's "Lora hashes" before an export. */
export async function kohyaLoraHash(adapters: LoraAdapters): Promise<string> {
  return addnetModelHash(kohyaTensors(adapters));
}

/**
 * Writes a kohya sd-scripts LoRA (A1111, ComfyUI, diffusers) to `sink`, one tensor at a time, and closes it;
 * the adapters are read twice, first for the file's sshs_* hashes (addnet-hash.ts).
 */
export async function writeKohyaLora(sink: ByteSink, adapters: LoraAdapters, info: LoraInfo): Promise<void> {
  await pump(hashedSafetensorsChunks(kohyaTensors(adapters), { ...kohyaMetadata(adapters, info), ...loraModelspec(info) }), sink);
}

// ---- diffusers / PEFT -------------------------------------------------------------------------------

const PEFT_PREFIX: Record<LoraComponent, string> = { unet: 'unet', text_encoder: 'text_encoder' };

/** Metadata keys recording the rank, the trained alpha and that alpha / rank is already in lora_B. */
export const FOLDED_KEYS = {
  rank: 'dreambooth_studio.lora_rank',
  alpha: 'dreambooth_studio.lora_alpha',
  folded: 'dreambooth_studio.lora_alpha_folded',
} as const;

function peftTensors(adapters: LoraAdapters): OutTensor[] {
  const scale = adapters.alpha / adapters.rank;
  const out: OutTensor[] = [];
  for (const { component, layer, provider } of layersOf(adapters)) {
    const p = `${PEFT_PREFIX[component]}.${layer}`;
    out.push(f16(`${p}.lora_A.weight`, provider.shape(`${layer}.lora_A.weight`), () => provider.read(`${layer}.lora_A.weight`)));
    out.push(
      f16(`${p}.lora_B.weight`, provider.shape(`${layer}.lora_B.weight`), async () => {
        const b = await provider.read(`${layer}.lora_B.weight`);
        return scale === 1 ? b : b.map((v) => v * scale);
      }),
    );
  }
  return out;
}

/** Writes a diffusers `pytorch_lora_weights.safetensors` (alpha / rank folded into lora_B) and closes `sink`. */
export async function writePeftLora(sink: ByteSink, adapters: LoraAdapters, info: LoraInfo): Promise<void> {
  const metadata = {
    format: 'pt',
    ...loraModelspec(info),
    [FOLDED_KEYS.rank]: String(adapters.rank),
    [FOLDED_KEYS.alpha]: pyFloat(adapters.alpha),
    [FOLDED_KEYS.folded]: 'true',
    'dreambooth_studio.training': JSON.stringify({
      baseModel: info.baseModelName,
      baseModelHash: info.baseModelHash,
      instancePrompt: info.instancePrompt,
      classPrompt: info.classPrompt,
      steps: info.steps,
      lr: info.lr,
      textEncoderLr: info.textEncoderLr,
      resolution: info.resolution,
      numImages: info.numImages,
      numClassImages: info.numClassImages,
    }),
  };
  await pump(safetensorsChunks(peftTensors(adapters), metadata), sink);
}

// ---- reading either layout back ---------------------------------------------------------------------

export interface LoraPair {
  component: LoraComponent;
  /** [r, in] */
  A: NamedTensor;
  /** [out, r], scaled so that every pair applies with the same `scale`. */
  B: NamedTensor;
  /** The file's keys of A and B (for messages). */
  keys: { A: string; B: string };
}

export interface ReadLora {
  format: 'kohya' | 'peft';
  /** The most common rank. */
  rank: number;
  /** rank * scale: the kohya alpha, or for a folded PEFT file the rank itself. */
  alpha: number;
  /** alpha / rank, the loraScale to run every pair with (unetForward's loraScale). */
  scale: number;
  /** By engine layer: a diffusers UNet module path, or text_model.encoder.layers.<i>.self_attn.<x>_proj. */
  adapters: Map<string, LoraPair>;
  /** File keys of modules the engine cannot apply (other layers than its targets, SDXL encoders, LoCon/LoHa parts). */
  skipped: string[];
  metadata: Record<string, string>;
}

/** PEFT-like key -> engine layer and part: lora_A/B, diffusers' lora.down/up and lora_linear_layer, the old attention-processor names. */
function parsePeftKey(key: string): { component: LoraComponent; layer: string; part: 'A' | 'B' | 'alpha' } | null {
  let component: LoraComponent;
  let rest = key;
  if (rest.startsWith('unet.')) {
    component = 'unet';
    rest = rest.slice(5);
  } else if (rest.startsWith('text_encoder.')) {
    component = 'text_encoder';
    rest = rest.slice(13);
  } else component = rest.startsWith('text_model.') ? 'text_encoder' : 'unet';
  const suffixes: [string, 'A' | 'B' | 'alpha'][] = [
    ['.lora_A.weight', 'A'],
    ['.lora_B.weight', 'B'],
    ['.lora.down.weight', 'A'],
    ['.lora.up.weight', 'B'],
    ['.lora_linear_layer.down.weight', 'A'],
    ['.lora_linear_layer.up.weight', 'B'],
    ['.alpha', 'alpha'],
  ];
  for (const [s, part] of suffixes) if (rest.endsWith(s)) return { component, layer: rest.slice(0, -s.length), part };
  let m = /^(.*)\.processor\.(to_q|to_k|to_v|to_out)_lora\.(down|up)\.weight$/.exec(rest);
  if (m) return { component, layer: `${m[1]}.${m[2] === 'to_out' ? 'to_out.0' : m[2]}`, part: m[3] === 'down' ? 'A' : 'B' };
  m = /^(.*\.self_attn)\.to_(q|k|v|out)_lora\.(down|up)\.weight$/.exec(rest);
  if (m) return { component, layer: `${m[1]}.${m[2]}_proj`, part: m[3] === 'down' ? 'A' : 'B' };
  return null;
}

/** diffusers' lora_adapter_metadata (flattened LoraConfig per component): its lora_alpha, if any. */
function peftConfigAlpha(metadata: Record<string, string>): Partial<Record<LoraComponent, number>> {
  const raw = metadata.lora_adapter_metadata;
  if (!raw) return {};
  let cfg: Record<string, unknown>;
  try {
    cfg = JSON.parse(raw) as Record<string, unknown>;
  } catch {
    throw new ExportError(`lora_adapter_metadata is not JSON: ${raw.slice(0, 80)}`);
  }
  const out: Partial<Record<LoraComponent, number>> = {};
  for (const c of ['unet', 'text_encoder'] as const) if (typeof cfg[`${c}.lora_alpha`] === 'number') out[c] = cfg[`${c}.lora_alpha`] as number;
  return out;
}

function mostCommon(values: number[]): number {
  const counts = new Map<number, number>();
  for (const v of values) counts.set(v, (counts.get(v) ?? 0) + 1);
  return [...counts].sort((a, b) => b[1] - a[1])[0][0];
}

/**
 * Keys that belong to another architecture than SD 1.x/2.x (whose UNet and text encoder the engine runs):
 * SDXL's second text encoder and kohya's SGM-style UNet names (input_blocks / middle_block / output_blocks,
 * what sd-scripts writes for SDXL), SD3/FLUX transformers. Such a file is refused, naming the key: applying
 * only the layers whose names happen to match would run a different model's adapters.
 */
function foreignArchitecture(key: string): string | null {
  if (/^(?:lora_te[12]_|text_encoder_2\.|lora_te2\.)/.test(key)) return 'SDXL (it adapts a second text encoder)';
  if (/^lora_unet_(?:input_blocks|middle_block|output_blocks|label_emb)_/.test(key))
    return 'SDXL (kohya names its UNet input_blocks/middle_block/output_blocks)';
  if (/^(?:unet\.)?add_embedding\./.test(key)) return 'SDXL (its UNet has add_embedding)';
  if (/^(?:transformer\.|lora_transformer_|text_encoder_3\.)/.test(key)) return 'SD3 or FLUX (a transformer, not a UNet)';
  return null;
}

/** The first index of a NaN or +-Inf value, or -1. */
function firstNonFinite(values: Float32Array): number {
  for (let i = 0; i < values.length; i++) if (values[i] - values[i] !== 0) return i;
  return -1;
}

/** A tensor of the LoRA file, read and checked: finite values only (a non-finite adapter would poison every weight it touches). */
async function readFinite(file: SafetensorsFile, key: string): Promise<NamedTensor> {
  const t = await file.read(key);
  const bad = firstNonFinite(t.data);
  if (bad >= 0)
    throw new ExportError(`${file.source.name}: '${key}' holds a non-finite value (${t.data[bad]} at element ${bad}): the LoRA is corrupt, use another file`);
  return t;
}

/**
 * Reads a LoRA in kohya or PEFT/diffusers layout back into engine layers. kohya pairs apply with their
 * alpha / r; PEFT pairs with 1 (or lora_alpha / r when the file carries diffusers' adapter config, or a
 * network alpha `<module>.alpha` as diffusers' converted files do).
 * Modules whose own scale differs from the most common one get the ratio folded into B, so one
 * `scale` serves the whole file. Refused, naming the key: another architecture's keys, a down weight
 * without its up weight (or the reverse), down/up that do not share a rank, an alpha that is not one
 * positive number, non-finite values.
 */
export async function readLora(file: SafetensorsFile): Promise<ReadLora> {
  const names = file.names;
  for (const n of names) {
    const arch = foreignArchitecture(n);
    if (arch) throw new ExportError(`${file.source.name}: '${n}' is a key of a LoRA for ${arch}; this engine runs SD 1.x and 2.x: use a LoRA made for those`);
  }
  const kohya = names.some((n) => /^lora_(unet|te)_/.test(n));
  const configAlpha = kohya ? {} : peftConfigAlpha(file.metadata);
  // Keys grouped by module; a key of no engine target is skipped.
  const modules = new Map<string, { component: LoraComponent; layer: string; keys: [string, string][] }>();
  const skipped: string[] = [];
  for (const n of names) {
    let where: { component: LoraComponent; layer: string } | null;
    let part: string;
    if (kohya) {
      const dot = n.indexOf('.');
      where = dot < 0 ? null : layerFromKohya(n.slice(0, dot));
      const rest = n.slice(dot + 1);
      part = rest === 'lora_down.weight' ? 'A' : rest === 'lora_up.weight' ? 'B' : rest;
    } else {
      const p = parsePeftKey(n);
      where = p && isLoraTarget(p.component, p.layer) ? p : null;
      part = p?.part ?? '';
    }
    if (!where) {
      skipped.push(n);
      continue;
    }
    const id = `${where.component}:${where.layer}`;
    if (!modules.has(id)) modules.set(id, { ...where, keys: [] });
    modules.get(id)!.keys.push([n, part]);
  }
  const adapters = new Map<string, LoraPair>();
  const scales = new Map<string, number>();
  for (const { component, layer, keys } of modules.values()) {
    // A module with parts the engine does not know (kohya's dora_scale, LoHa's hada_*) is skipped whole.
    if (keys.some(([, part]) => !['A', 'B', 'alpha'].includes(part))) {
      skipped.push(...keys.map(([n]) => n));
      continue;
    }
    const get = (part: string) => keys.find(([, p]) => p === part)?.[0];
    const [a, b, al] = [get('A'), get('B'), get('alpha')];
    if (!a || !b)
      throw new ExportError(
        `${file.source.name}: '${a ?? b}' has no matching ${a ? 'up (lora_B / lora_up)' : 'down (lora_A / lora_down)'} weight for module '${layer}': the LoRA file is incomplete`,
      );
    const A = await readFinite(file, a);
    const B = await readFinite(file, b);
    const r = A.shape[0];
    if (A.shape.length !== 2 || B.shape.length !== 2 || B.shape[1] !== r || r < 1)
      throw new ExportError(
        `${file.source.name}: '${a}' [${A.shape}] and '${b}' [${B.shape}] do not share a rank (down must be [r, in] and up [out, r]): the LoRA's rank layout is not one the engine applies`,
      );
    let alpha = configAlpha[component];
    if (al) {
      const t = await readFinite(file, al);
      if (t.data.length !== 1 || t.data[0] < 0)
        throw new ExportError(`${file.source.name}: '${al}' must be one number of at least 0, got [${t.shape}] ${t.data.slice(0, 4).join(', ')}`);
      alpha = t.data[0];
    }
    // kohya: "if alpha == 0 or None, alpha is rank (no scaling)".
    scales.set(layer, alpha === undefined || alpha === 0 ? 1 : alpha / r);
    adapters.set(layer, { component, A, B, keys: { A: a, B: b } });
  }
  if (!adapters.size)
    throw new ExportError(
      `${file.source.name}: no LoRA adapters the engine can apply (its targets are the UNet's to_q/to_k/to_v/to_out.0 and the text encoder's q/k/v/out_proj); ${skipped.length} keys skipped, e.g. ${skipped.slice(0, 3).join(', ')}`,
    );
  const rank = mostCommon([...adapters.values()].map((p) => p.A.shape[0]));
  const scale = mostCommon([...scales.values()]);
  for (const [layer, p] of adapters) {
    const f = scales.get(layer)! / scale;
    if (f !== 1) p.B = { shape: p.B.shape, data: p.B.data.map((v) => v * f) };
  }
  return { format: kohya ? 'kohya' : 'peft', rank, alpha: rank * scale, scale, adapters, skipped, metadata: file.metadata };
}

/**
 * The adapters against the model they are to run on: every adapted layer exists there (`<layer>.weight`)
 * and the down weight's in-features and the up weight's out-features are the layer's. A LoRA for another
 * model (SD2's 1024-wide cross-attention on SD1's 768, another UNet's block layout) is refused naming the
 * key and both shapes.
 */
export function checkLoraForModel(
  lora: Pick<ReadLora, 'adapters'>,
  shapes: Record<LoraComponent, ReadonlyMap<string, readonly number[]>>,
  fileName: string,
  modelName: string,
): void {
  for (const [layer, { component, A, B, keys }] of lora.adapters) {
    const w = shapes[component].get(`${layer}.weight`);
    if (!w)
      throw new ExportError(
        `${fileName}: '${keys.A}' adapts ${component === 'unet' ? 'the UNet' : 'the text encoder'} layer '${layer}', which ${modelName} does not have: the LoRA was made for another model architecture`,
      );
    const inFeatures = w.slice(1).reduce((x, y) => x * y, 1);
    if (A.shape[1] !== inFeatures)
      throw new ExportError(
        `${fileName}: '${keys.A}' is [${A.shape}], made for a layer with ${A.shape[1]} inputs, but ${modelName}'s '${layer}.weight' is [${w}] (${inFeatures} inputs): the LoRA was made for another model (e.g. SD 2.x's 1024-wide text on SD 1.x's 768)`,
      );
    if (B.shape[0] !== w[0])
      throw new ExportError(
        `${fileName}: '${keys.B}' is [${B.shape}], made for a layer with ${B.shape[0]} outputs, but ${modelName}'s '${layer}.weight' is [${w}]: the LoRA was made for another model`,
      );
  }
}

/** One component's adapters as engine weights: `<layer>.lora_A.weight` / `<layer>.lora_B.weight`. */
export function adapterTensors(lora: Pick<ReadLora, 'adapters'>, component: LoraComponent): Map<string, NamedTensor> {
  const out = new Map<string, NamedTensor>();
  for (const [layer, p] of lora.adapters) {
    if (p.component !== component) continue;
    out.set(`${layer}.lora_A.weight`, p.A);
    out.set(`${layer}.lora_B.weight`, p.B);
  }
  return out;
}
