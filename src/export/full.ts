// Full fine-tuned models: the base model with the trained UNet, in the two layouts people load.
//
// - writeSingleFile: one fp16 safetensors in the A1111/ComfyUI (CompVis) layout.
//   From a single-file base (a SafetensorsFile): EXACTLY the base's key set, in its order: every float
//   tensor converted to F16 (F16 ones copied as raw bytes), non-float tensors (CLIP's I64 position_ids,
//   EMA counters) copied raw, and the UNet keys (model.diffusion_model.*, located with
//   keymap.unetFromDiffusers for the layout inferred from the file) carrying the trained values.
//   From a ModelSource (a diffusers folder): the standard key set of diffusers'
//   convert_diffusers_to_original_stable_diffusion rules: model.diffusion_model.* (keymap),
//   first_stage_model.* with the VAE attention projections as 1x1 convs [C, C, 1, 1] (the original
//   AttnBlock uses Conv2d), and
//     SD1: cond_stage_model.transformer.text_model.* (CLIP ViT-L keeps its HF names);
//     SD2: cond_stage_model.model.* in OpenCLIP names, q/k/v fused back into attn.in_proj_weight/bias
//       (rows q, k, v). diffusers' CLIPTextModel holds only the 23 blocks SD2 uses (it conditions on the
//       penultimate block), but a real SD2 file has 24 and every loader expects that: A1111 and ComfyUI
//       build 24 blocks and run all but the last, and our own openSingleFile drops the file's last
//       block. So, as kohya's convert_text_encoder_state_dict_to_sd_v2 (make_dummy_weights) does, the
//       last used block is repeated as the unused 24th, with text_projection = ones [C, C] and
//       logit_scale = 1 (neither used by SD) to complete the OpenCLIP key set.
//   No position_ids are invented for a diffusers base (loaders rebuild them; A1111 and ComfyUI load
//   non-strictly). Metadata: format "pt" and modelspec.* for a full checkpoint.
// - zipDiffusers: a diffusers folder as a streamed zip (client-zip; entries stored, zip64 past 4 GB):
//   model_index.json, unet/ (trained), vae/, text_encoder/ (fp16 safetensors with {"format": "pt"},
//   which transformers requires), tokenizer/ (copied from the base folder or given), scheduler/.
//   Configs come from the base folder, or for a single-file base from diffusers' standard SD1/SD2
//   configs with everything the weights tell (block widths, heads, layers) filled in.
// Every safetensors is produced tensor by tensor (stream.ts): memory holds one tensor at a time.
import { makeZip } from 'client-zip';
import { SafetensorsFile, type ByteSink } from '../io/safetensors.ts';
import type { ByteSource } from '../io/source.ts';
import { sameShape, type TensorProvider } from '../io/tensor-provider.ts';
import type { Component, Family } from '../models/detect.ts';
import { isVaeAttentionProjection, openClipFromDiffusers, unetFromDiffusers, vaeFromDiffusers, type UnetLayout } from '../models/keymap.ts';
import { COMPONENTS, inferUnet, openSingleFile, type FolderReader, type Json, type ModelSource, type SourceOptions } from '../models/source.ts';
import { unetConfigFromJson } from '../nn/unet.ts';
import { defaultResolution, modelspec } from './modelspec.ts';
import { ExportError } from './provider.ts';
import { numel, pump, safetensorsChunks, safetensorsSize, type OutTensor } from './stream.ts';

// The OpenCLIP name table lives in models/keymap.ts (loading reads it forward); the export reads it back.
export { openClipFromDiffusers };

export interface FullExportOptions {
  title: string;
  date: Date;
  description?: string;
  /** Pixels; default 768 for SD2 v-prediction, else 512 (modelspec.resolution, configs' sample_size). */
  resolution?: number;
  /** For a SafetensorsFile base: the family when the weights cannot tell (custom widths). */
  family?: Family;
  /** For a SafetensorsFile base: config.json values the weights do not hold (see SourceOptions). */
  overrides?: SourceOptions['overrides'];
}

const FLOAT = new Set(['F16', 'F32', 'BF16', 'F64']);

function fullMetadata(src: ModelSource, o: FullExportOptions): Record<string, string> {
  const resolution = o.resolution ?? defaultResolution(src.family, src.prediction);
  return {
    format: 'pt',
    ...modelspec({ family: src.family, prediction: src.prediction, lora: false, title: o.title, date: o.date, resolution, description: o.description }),
  };
}

/** The trained tensor names must be base UNet tensors of the same shapes. */
function checkTrained(trained: TensorProvider, baseShapes: Map<string, readonly number[]>, what: string): Set<string> {
  const names = new Set(trained.names());
  for (const n of names) {
    const s = baseShapes.get(n);
    if (!s) throw new ExportError(`trained UNet tensor '${n}' is not a UNet tensor of ${what}`);
    if (!sameShape(s, trained.shape(n))) throw new ExportError(`trained UNet tensor '${n}' is [${trained.shape(n)}] but ${what} has [${s}]`);
  }
  return names;
}

// ---- single file from a single file: the base's own key set ------------------------------------------

async function fromFileTensors(file: SafetensorsFile, trained: TensorProvider, o: FullExportOptions): Promise<{ tensors: OutTensor[]; src: ModelSource }> {
  const src = await openSingleFile(file, { family: o.family, overrides: o.overrides });
  const prefix = 'model.diffusion_model.';
  const unetShapes = new Map(file.names.filter((n) => n.startsWith(prefix)).map((n) => [n.slice(prefix.length), file.entry(n).shape] as const));
  const { layout } = inferUnet(unetShapes, src.family);
  const replaced = new Map<string, string>();
  for (const n of checkTrained(trained, src.shapes('unet'), file.source.name)) replaced.set(prefix + unetFromDiffusers(n, layout), n);
  const tensors = file.names.map((key): OutTensor => {
    const e = file.entry(key);
    const t = replaced.get(key);
    if (t !== undefined) return { name: key, dtype: 'F16', shape: e.shape, data: () => trained.read(t) };
    if (e.dtype === 'F16') return { name: key, dtype: 'F16', shape: e.shape, data: () => file.readRaw(key) };
    if (FLOAT.has(e.dtype)) return { name: key, dtype: 'F16', shape: e.shape, data: async () => (await file.read(key)).data };
    return { name: key, dtype: e.dtype, shape: e.shape, data: () => file.readRaw(key) };
  });
  return { tensors, src };
}

// ---- single file from a model source: the standard key set ------------------------------------------

/** UNet block layout from a diffusers UNet config. */
export function unetLayout(config: Json): UnetLayout {
  const c = unetConfigFromJson(config);
  return { blocks: c.blockOutChannels.length, layersPerBlock: c.layersPerBlock, downAttention: c.downAttention, upAttention: c.upAttention };
}

/** SD2's text encoder in OpenCLIP names: fused q/k/v, the unused 24th block, text_projection, logit_scale. */
function openClipTensors(src: ModelSource): OutTensor[] {
  const prefix = 'cond_stage_model.model.';
  const shapes = src.shapes('text_encoder');
  const layers = src.configs.text_encoder.num_hidden_layers as number;
  const width = src.configs.text_encoder.hidden_size as number;
  const out: OutTensor[] = [];
  const blockTensors = (block: number, from: number) => {
    for (const [n, shape] of shapes) {
      const m = /^text_model\.encoder\.layers\.(\d+)\./.exec(n);
      if (!m || Number(m[1]) !== from) continue;
      const { key, part } = openClipFromDiffusers(n);
      const name = prefix + key.replace(/^transformer\.resblocks\.\d+\./, `transformer.resblocks.${block}.`);
      if (part === undefined) out.push({ name, dtype: 'F16', shape, data: async () => (await src.read('text_encoder', n)).data });
      else if (part === 0) {
        const qkv = ['q', 'k', 'v'].map((x) => n.replace('.q_proj.', `.${x}_proj.`));
        out.push({
          name,
          dtype: 'F16',
          shape: [3 * shape[0], ...shape.slice(1)],
          data: async () => {
            const fused = new Float32Array(3 * numel(shape));
            for (let i = 0; i < 3; i++) fused.set((await src.read('text_encoder', qkv[i])).data, i * numel(shape));
            return fused;
          },
        });
      }
    }
  };
  for (const [n, shape] of shapes) {
    if (/^text_model\.encoder\.layers\./.test(n)) continue;
    out.push({ name: prefix + openClipFromDiffusers(n).key, dtype: 'F16', shape, data: async () => (await src.read('text_encoder', n)).data });
  }
  for (let l = 0; l < layers; l++) blockTensors(l, l);
  blockTensors(layers, layers - 1);
  out.push({ name: `${prefix}text_projection`, dtype: 'F16', shape: [width, width], data: async () => new Float32Array(width * width).fill(1) });
  out.push({ name: `${prefix}logit_scale`, dtype: 'F16', shape: [], data: async () => Float32Array.of(1) });
  return out;
}

function fromSourceTensors(src: ModelSource, trained: TensorProvider): OutTensor[] {
  const unetShapes = src.shapes('unet');
  const names = checkTrained(trained, unetShapes, src.name);
  const layout = unetLayout(src.configs.unet);
  const read = (c: Component, n: string) => async () => (await src.read(c, n)).data;
  const out: OutTensor[] = [];
  for (const [n, shape] of unetShapes)
    out.push({
      name: `model.diffusion_model.${unetFromDiffusers(n, layout)}`,
      dtype: 'F16',
      shape,
      data: names.has(n) ? () => trained.read(n) : read('unet', n),
    });
  const vaeBlocks = (src.configs.vae.block_out_channels as unknown[]).length;
  for (const [n, shape] of src.shapes('vae')) {
    const conv = isVaeAttentionProjection(n) && shape.length === 2 ? [...shape, 1, 1] : shape;
    out.push({ name: `first_stage_model.${vaeFromDiffusers(n, vaeBlocks)}`, dtype: 'F16', shape: conv, data: read('vae', n) });
  }
  if (src.family === 'sd1')
    for (const [n, shape] of src.shapes('text_encoder'))
      out.push({ name: `cond_stage_model.transformer.${n}`, dtype: 'F16', shape, data: read('text_encoder', n) });
  else out.push(...openClipTensors(src));
  return out;
}

/** The single file's tensors (in write order) and metadata, nothing read yet. */
export async function singleFilePlan(
  base: SafetensorsFile | ModelSource,
  trainedUnet: TensorProvider,
  o: FullExportOptions,
): Promise<{ tensors: OutTensor[]; metadata: Record<string, string> }> {
  if (base instanceof SafetensorsFile) {
    const { tensors, src } = await fromFileTensors(base, trainedUnet, o);
    return { tensors, metadata: fullMetadata(src, o) };
  }
  return { tensors: fromSourceTensors(base, trainedUnet), metadata: fullMetadata(base, o) };
}

/** Writes the fine-tuned model as one fp16 single-file checkpoint (A1111/ComfyUI layout) and closes `sink`. */
export async function writeSingleFile(sink: ByteSink, base: SafetensorsFile | ModelSource, trainedUnet: TensorProvider, o: FullExportOptions): Promise<void> {
  const { tensors, metadata } = await singleFilePlan(base, trainedUnet, o);
  await pump(safetensorsChunks(tensors, metadata), sink);
}

// ---- diffusers folder as a streamed zip --------------------------------------------------------------

export interface ZipOptions extends FullExportOptions {
  /** The base's diffusers folder: tokenizer/ is copied from it. */
  folder?: FolderReader;
  /** Tokenizer files (name in tokenizer/ -> contents) when the base has no folder (a single file). */
  tokenizer?: Map<string, Uint8Array | string>;
}

/** Files a CLIPTokenizer folder may hold. */
export const TOKENIZER_FILES = ['vocab.json', 'merges.txt', 'tokenizer_config.json', 'special_tokens_map.json', 'added_tokens.json', 'tokenizer.json'];

const blocks = (n: number, kind: string) => Array.from({ length: n }, () => kind);

/**
 * diffusers configs for the export. A diffusers base keeps its own; a single-file base gets the standard
 * SD1/SD2 configs (as in the runwayml / stabilityai repositories) with the values inferred from its
 * weights (and overrides) on top.
 */
export function diffusersConfigs(src: ModelSource, resolution: number): Record<Component | 'scheduler', Json> {
  // A base's own scheduler config (a folder's) is kept whole; otherwise SD's DDIM settings.
  const ddim: Json = {
    _class_name: 'DDIMScheduler',
    beta_end: 0.012,
    beta_schedule: 'scaled_linear',
    beta_start: 0.00085,
    clip_sample: false,
    num_train_timesteps: 1000,
    set_alpha_to_one: false,
    steps_offset: 1,
    trained_betas: null,
  };
  const scheduler: Json = { ...(src.scheduler._class_name ? {} : ddim), ...src.scheduler, prediction_type: src.prediction };
  if (src.layout === 'diffusers') return { ...src.configs, scheduler };
  const sd1 = src.family === 'sd1';
  const vaeBlocks = (src.configs.vae.block_out_channels as unknown[]).length;
  return {
    unet: {
      _class_name: 'UNet2DConditionModel',
      act_fn: 'silu',
      center_input_sample: false,
      downsample_padding: 1,
      flip_sin_to_cos: true,
      freq_shift: 0,
      mid_block_scale_factor: 1,
      norm_eps: 1e-5,
      sample_size: resolution / 8,
      ...src.configs.unet,
    },
    vae: {
      _class_name: 'AutoencoderKL',
      act_fn: 'silu',
      in_channels: 3,
      out_channels: 3,
      sample_size: resolution,
      down_block_types: blocks(vaeBlocks, 'DownEncoderBlock2D'),
      up_block_types: blocks(vaeBlocks, 'UpDecoderBlock2D'),
      ...src.configs.vae,
    },
    text_encoder: {
      architectures: ['CLIPTextModel'],
      model_type: 'clip_text_model',
      attention_dropout: 0,
      bos_token_id: 0,
      dropout: 0,
      eos_token_id: 2,
      initializer_factor: 1,
      initializer_range: 0.02,
      layer_norm_eps: 1e-5,
      pad_token_id: 1,
      projection_dim: sd1 ? 768 : 512,
      torch_dtype: 'float16',
      ...src.configs.text_encoder,
    },
    scheduler,
  };
}

const WEIGHTS_PATH: Record<Component, string> = {
  unet: 'unet/diffusion_pytorch_model.safetensors',
  vae: 'vae/diffusion_pytorch_model.safetensors',
  text_encoder: 'text_encoder/model.safetensors',
};

/** A component's fp16 safetensors entry, its tensors read as client-zip pulls them. */
function weightsEntry(src: ModelSource, c: Component, trained: TensorProvider | null, date: Date): ZipEntry {
  const names = trained ? checkTrained(trained, src.shapes(c), src.name) : new Set<string>();
  const tensors: OutTensor[] = [...src.shapes(c)].map(([n, shape]) => ({
    name: n,
    dtype: 'F16',
    shape,
    data: trained && names.has(n) ? () => trained.read(n) : async () => (await src.read(c, n)).data,
  }));
  const metadata = { format: 'pt' };
  return { name: WEIGHTS_PATH[c], lastModified: date, size: safetensorsSize(tensors, metadata), input: safetensorsChunks(tensors, metadata) };
}

/** A file from a byte source in slices of at most 8 MiB. */
async function* sourceChunks(s: ByteSource): AsyncGenerator<Uint8Array> {
  const step = 8 << 20;
  try {
    for (let at = 0; at < s.size; at += step) yield await s.read(at, Math.min(step, s.size - at));
  } finally {
    await s.close?.();
  }
}

interface ZipEntry {
  name: string;
  input: Uint8Array | string | AsyncIterable<Uint8Array>;
  size?: number;
  lastModified: Date;
}

async function tokenizerEntries(o: ZipOptions): Promise<ZipEntry[]> {
  if (o.tokenizer) return [...o.tokenizer].map(([n, input]) => ({ name: `tokenizer/${n}`, input, lastModified: o.date }));
  const out: ZipEntry[] = [];
  if (o.folder)
    for (const n of TOKENIZER_FILES) {
      const p = `tokenizer/${n}`;
      if (!(await o.folder.exists(p))) continue;
      const s = await o.folder.open(p);
      out.push({ name: p, input: sourceChunks(s), size: s.size, lastModified: o.date });
    }
  return out;
}

const json = (v: unknown) => `${JSON.stringify(v, null, 2)}\n`;

async function* zipEntries(base: SafetensorsFile | ModelSource, trained: TensorProvider, o: ZipOptions): AsyncGenerator<ZipEntry> {
  const src = base instanceof SafetensorsFile ? await openSingleFile(base, { family: o.family, overrides: o.overrides }) : base;
  checkTrained(trained, src.shapes('unet'), src.name);
  const configs = diffusersConfigs(src, o.resolution ?? defaultResolution(src.family, src.prediction));
  const tokenizer = await tokenizerEntries(o);
  const entry = (name: string, v: unknown) => ({ name, input: json(v), lastModified: o.date });
  yield entry('model_index.json', {
    _class_name: 'StableDiffusionPipeline',
    _diffusers_version: '0.27.0',
    feature_extractor: [null, null],
    requires_safety_checker: false,
    safety_checker: [null, null],
    scheduler: ['diffusers', configs.scheduler._class_name],
    text_encoder: ['transformers', 'CLIPTextModel'],
    ...(tokenizer.length ? { tokenizer: ['transformers', 'CLIPTokenizer'] } : {}),
    unet: ['diffusers', 'UNet2DConditionModel'],
    vae: ['diffusers', 'AutoencoderKL'],
  });
  yield entry('scheduler/scheduler_config.json', configs.scheduler);
  for (const c of COMPONENTS) {
    yield entry(`${c}/config.json`, configs[c]);
    yield weightsEntry(src, c, c === 'unet' ? trained : null, o.date);
  }
  yield* tokenizer;
}

/**
 * The fine-tuned model as a diffusers folder in a zip, produced as it is read: each safetensors entry is
 * generated tensor by tensor while client-zip streams it out. Errors (a trained tensor the base lacks)
 * surface as the stream's error.
 */
export function zipDiffusers(base: SafetensorsFile | ModelSource, trainedUnet: TensorProvider, o: ZipOptions): ReadableStream<Uint8Array> {
  return makeZip(zipEntries(base, trainedUnet, o));
}
