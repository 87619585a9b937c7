// SDXL base models (and derivatives with its architecture: Illustrious, Pony, NoobAI) in both layouts:
//   - the original SGM single file: model.diffusion_model.* (the UNet; label_emb.0.{0,2} = add_embedding
//     linear_1/2), conditioner.embedders.0.transformer.* (CLIP ViT-L, transformers names),
//     conditioner.embedders.1.model.* (OpenCLIP bigG: fused attn.in_proj rows split into q/k/v, and
//     text_projection [width, proj], used as x @ P, transposed into diffusers' [proj, width] linear), and
//     first_stage_model.* (the VAE);
//   - a diffusers folder: unet/, vae/, text_encoder/, text_encoder_2/ (CLIPTextModelWithProjection),
//     tokenizer/, tokenizer_2/, scheduler/.
// Detection from names, shapes and configs, before any weight is read; refiners (a conditioner with only the
// bigG embedder, aesthetic-score embeddings), inpainting UNets (9 input channels), mixed SD 1/SDXL keys, a
// missing embedder and text widths that do not add up to the UNet's cross-attention width are refused naming
// the file. The VAE is always loaded and run in f32: SDXL's VAE overflows in f16 (diffusers' force_upcast).
import type { Gpu } from '../gpu/device.ts';
import type { DType, Tensor } from '../gpu/tensor.ts';
import { SafetensorsFile, type NamedTensor } from '../io/safetensors.ts';
import type { Weights } from '../nn/blocks.ts';
import { clipConfigFromJson, type ClipTextConfig } from '../nn/clip.ts';
import { unetConfigFromJson, type UnetConfig } from '../nn/unet.ts';
import { vaeConfigFromJson, type VaeConfig } from '../nn/vae.ts';
import { ModelError, type Prediction } from './detect.ts';
import { clipToDiffusers, isVaeAttentionProjection, openClipToDiffusers, unetToDiffusers, vaeToDiffusers } from './keymap.ts';
import { allocateWeights, countBadValues, validateComponent } from './load.ts';
import { clipParams, unetParams, vaeParams } from './shapes.ts';
import { inferUnet, inferVae, readJsonFile, type FolderReader, type Json, type SourceOptions } from './source.ts';

export type SdxlComponent = 'unet' | 'vae' | 'text_encoder' | 'text_encoder_2';
export const SDXL_COMPONENTS: readonly SdxlComponent[] = ['unet', 'vae', 'text_encoder', 'text_encoder_2'];

/** SDXL's VAE latent scale (SD 1.x/2.x: 0.18215). */
export const SDXL_SCALING_FACTOR = 0.13025;
/** SDXL base's addition_time_embed_dim: not in the weights (label_emb's input is pooled + 6 x this). */
const SDXL_TIME_EMBED_DIM = 256;

const UNET = 'model.diffusion_model.';
const TE1 = 'conditioner.embedders.0.transformer.';
const TE2 = 'conditioner.embedders.1.model.';
const VAE = 'first_stage_model.';

/** Does a single file's key set look like SDXL (a conditioner or the UNet's label embedding)? */
export function isSdxlSingleFile(names: readonly string[]): boolean {
  return names.some((n) => n.startsWith('conditioner.embedders.') || n.startsWith(`${UNET}label_emb.`));
}

/** Does a diffusers folder's config set look like SDXL (text_time embeddings or an SDXL pipeline class)? */
export function isSdxlDiffusers(modelIndex: Json | undefined, unet: Json | undefined): boolean {
  const cls = modelIndex?._class_name;
  return unet?.addition_embed_type === 'text_time' || (typeof cls === 'string' && /StableDiffusionXL/.test(cls));
}

/**
 * Refuses what is not an SDXL base-architecture single file, naming the file and the reason; returns the
 * text widths (CLIP ViT-L, bigG) and the UNet's cross-attention width they add up to.
 */
export function detectSdxlSingleFile(shapes: Map<string, readonly number[]>, what: string): { width1: number; width2: number; contextDim: number } {
  const names = [...shapes.keys()];
  const has = (p: string) => names.some((n) => n.startsWith(p));
  if (has('cond_stage_model.'))
    throw new ModelError(`${what} mixes SD 1.x/2.x keys (cond_stage_model.*) with SDXL keys (conditioner.*, label_emb): a mixed or corrupt checkpoint`);
  if (has('conditioner.embedders.0.model.') && !has(TE2) && !has(TE1))
    throw new ModelError(
      `${what} is an SDXL refiner (its conditioner holds only the OpenCLIP bigG embedder, conditioner.embedders.0.model.*): refiners are not supported; load an SDXL base model or a derivative`,
    );
  const convIn = shapes.get(`${UNET}input_blocks.0.0.weight`);
  if (!convIn) throw new ModelError(`${what}: SDXL checkpoint without its UNet input conv ${UNET}input_blocks.0.0.weight`);
  if (convIn[1] === 9)
    throw new ModelError(
      `${what} is an SDXL inpainting model (UNet input conv [${convIn}], 9 channels): inpainting models are not supported; load an SDXL base model`,
    );
  if (convIn[1] !== 4) throw new ModelError(`${what}: UNet input conv ${UNET}input_blocks.0.0.weight is [${convIn}], expected 4 input channels`);
  if (!shapes.has(`${UNET}label_emb.0.0.weight`))
    throw new ModelError(`${what}: SDXL conditioner without the UNet's text_time embedding (${UNET}label_emb.0.0.weight): not an SDXL base UNet`);
  if (!has(TE1)) throw new ModelError(`${what}: SDXL checkpoint missing its CLIP ViT-L text encoder (${TE1}*)`);
  if (!has(TE2)) throw new ModelError(`${what}: SDXL checkpoint missing its OpenCLIP bigG text encoder (${TE2}*)`);
  const width1 = shapes.get(`${TE1}text_model.embeddings.token_embedding.weight`)?.[1];
  const width2 = shapes.get(`${TE2}token_embedding.weight`)?.[1];
  if (width1 === undefined) throw new ModelError(`${what}: missing ${TE1}text_model.embeddings.token_embedding.weight`);
  if (width2 === undefined) throw new ModelError(`${what}: missing ${TE2}token_embedding.weight`);
  const toK = names.find((n) => n.startsWith(UNET) && n.endsWith('attn2.to_k.weight'));
  if (!toK) throw new ModelError(`${what}: the UNet has no cross-attention (attn2.to_k) weights`);
  const contextDim = shapes.get(toK)![1];
  if (width1 + width2 !== contextDim)
    throw new ModelError(
      `${what}: the text encoders are ${width1} + ${width2} = ${width1 + width2} wide but the UNet's cross-attention (${toK}) expects ${contextDim}: mismatched or corrupt checkpoint`,
    );
  return { width1, width2, contextDim };
}

/** Refuses an SDXL diffusers folder that is not the base architecture, naming the folder and the reason. */
export function detectSdxlDiffusers(configs: { modelIndex?: Json; unet: Json; textEncoder?: Json; textEncoder2?: Json }, what: string): void {
  const { unet, textEncoder, textEncoder2 } = configs;
  const cls = configs.modelIndex?._class_name;
  if (!textEncoder && textEncoder2)
    throw new ModelError(
      `${what} is an SDXL refiner (${typeof cls === 'string' ? `${cls}, ` : ''}only text_encoder_2): refiners are not supported; load an SDXL base model or a derivative`,
    );
  if (unet.in_channels === 9)
    throw new ModelError(`${what} is an SDXL inpainting model (unet in_channels 9): inpainting models are not supported; load an SDXL base model`);
  if (unet.in_channels !== undefined && unet.in_channels !== 4) throw new ModelError(`${what}: unet in_channels ${unet.in_channels}, expected 4`);
  if (!textEncoder) throw new ModelError(`${what}: SDXL folder missing text_encoder/config.json (CLIP ViT-L)`);
  if (!textEncoder2) throw new ModelError(`${what}: SDXL folder missing text_encoder_2/config.json (OpenCLIP bigG)`);
  const [w1, w2, cross] = [textEncoder.hidden_size, textEncoder2.hidden_size, unet.cross_attention_dim];
  if (typeof w1 !== 'number' || typeof w2 !== 'number' || w1 + w2 !== cross)
    throw new ModelError(
      `${what}: the text encoders are ${w1} + ${w2} wide but unet/config.json's cross_attention_dim is ${cross}: they must add up (768 + 1280 = 2048 for SDXL)`,
    );
}

/** A single file's or folder's SDXL model: configs and tensors by diffusers names, read on demand. */
export interface SdxlSource {
  readonly name: string;
  readonly layout: 'single-file' | 'diffusers';
  readonly prediction: Prediction;
  readonly configs: Record<SdxlComponent, Json>;
  /**
   * A single file's configs are inferred with SDXL's standard sizes (64-wide heads, 32 norm groups); at other
   * widths those cannot be inferred: what each component would need from --config, one line (checked by sdxlConfigs).
   */
  readonly uninferred?: string;
  shapes(c: SdxlComponent): Map<string, readonly number[]>;
  read(c: SdxlComponent, name: string): Promise<NamedTensor>;
  /** Where a tensor lives, for messages. */
  tensorOrigin(c: SdxlComponent, name: string): string;
  close(): Promise<void>;
}

function sdxlPrediction(scheduler: Json | undefined, what: string): Prediction {
  const p = scheduler?.prediction_type;
  if (p === undefined || p === 'epsilon') return 'epsilon';
  if (p === 'v_prediction') return p;
  throw new ModelError(`${what}: prediction_type '${String(p)}' is not supported (epsilon or v_prediction)`);
}

function stripped(all: Map<string, readonly number[]>, prefix: string): Map<string, readonly number[]> {
  const m = new Map<string, readonly number[]>();
  for (const [n, s] of all) if (n.startsWith(prefix)) m.set(n.slice(prefix.length), s);
  return m;
}

const maxIndex = (names: Iterable<string>, re: RegExp) => Math.max(-1, ...[...names].map((n) => Number(re.exec(n)?.[1] ?? -1)));

/** label_emb (SGM's adm embedding) <-> add_embedding (diffusers), both ways. */
const LABEL_EMB: [string, string][] = [
  ['label_emb.0.0.', 'add_embedding.linear_1.'],
  ['label_emb.0.2.', 'add_embedding.linear_2.'],
];
export function sdxlUnetToDiffusers(name: string, layout: Parameters<typeof unetToDiffusers>[1]): string {
  for (const [a, b] of LABEL_EMB) if (name.startsWith(a)) return b + name.slice(a.length);
  return unetToDiffusers(name, layout);
}

/** Where a diffusers-named tensor lives in the single file. */
interface Ref {
  key: string;
  shape: readonly number[];
  part?: number;
  transpose?: boolean;
}

/** An SGM single-file SDXL checkpoint as an SdxlSource. The caller keeps `file` unless it calls close(). */
export async function openSdxlSingleFile(file: SafetensorsFile, o: SourceOptions & { overrides?: { text_encoder_2?: Json } } = {}): Promise<SdxlSource> {
  const what = file.source.name;
  const all = new Map(file.names.map((n) => [n, file.entry(n).shape] as const));
  const { width1, width2 } = detectSdxlSingleFile(all, what);
  const refs: Record<SdxlComponent, Map<string, Ref>> = { unet: new Map(), vae: new Map(), text_encoder: new Map(), text_encoder_2: new Map() };

  const unetShapes = stripped(all, UNET);
  const inferred = inferUnet(unetShapes, 'sd2'); // heads = channels / 64, as SDXL's [5, 10, 20]
  const depth = inferred.layout.downAttention.map((a, i) =>
    a ? maxIndex(unetShapes.keys(), new RegExp(`^input_blocks\\.${1 + i * (inferred.layout.layersPerBlock + 1)}\\.1\\.transformer_blocks\\.(\\d+)\\.`)) + 1 : 1,
  );
  const proj2 = all.get(`${TE2}text_projection`);
  if (!proj2 || proj2.length !== 2) throw new ModelError(`${what}: the OpenCLIP bigG text encoder lacks its text_projection (${TE2}text_projection)`);
  const addIn = unetShapes.get('label_emb.0.0.weight')![1];
  const unetConfig: Json = {
    ...inferred.config,
    transformer_layers_per_block: depth,
    addition_embed_type: 'text_time',
    addition_time_embed_dim: (addIn - proj2[1]) / 6,
    projection_class_embeddings_input_dim: addIn,
    ...o.overrides?.unet,
  };
  for (const [n, shape] of unetShapes) refs.unet.set(sdxlUnetToDiffusers(n, inferred.layout), { key: UNET + n, shape });

  const vaeShapes = stripped(all, VAE);
  const vaeConfig: Json = { ...inferVae(vaeShapes), scaling_factor: SDXL_SCALING_FACTOR, force_upcast: true, ...o.overrides?.vae };
  const vaeBlocks = (vaeConfig.block_out_channels as unknown[]).length;
  for (const [n, shape] of vaeShapes) {
    const d = vaeToDiffusers(n, vaeBlocks);
    refs.vae.set(d, { key: VAE + n, shape: isVaeAttentionProjection(d) && shape.length === 4 ? shape.slice(0, 2) : shape });
  }

  const te1 = stripped(all, TE1);
  for (const [n, shape] of te1) if (!n.endsWith('position_ids')) refs.text_encoder.set(clipToDiffusers(n), { key: TE1 + n, shape });
  const te1Config: Json = {
    architectures: ['CLIPTextModel'],
    vocab_size: te1.get('text_model.embeddings.token_embedding.weight')![0],
    hidden_size: width1,
    num_hidden_layers: maxIndex(te1.keys(), /^text_model\.encoder\.layers\.(\d+)\./) + 1,
    num_attention_heads: width1 / 64,
    intermediate_size: te1.get('text_model.encoder.layers.0.mlp.fc1.weight')?.[0],
    max_position_embeddings: te1.get('text_model.embeddings.position_embedding.weight')?.[0],
    hidden_act: 'quick_gelu',
    ...o.overrides?.text_encoder,
  };

  const te2 = stripped(all, TE2);
  for (const [n, shape] of te2) {
    if (n === 'text_projection') {
      refs.text_encoder_2.set('text_projection.weight', { key: TE2 + n, shape: [shape[1], shape[0]], transpose: true });
      continue;
    }
    const target = openClipToDiffusers(n);
    if (!target) continue; // logit_scale
    if (!target.split) refs.text_encoder_2.set(target.names[0], { key: TE2 + n, shape });
    else {
      if (shape[0] % 3) throw new ModelError(`${what}: ${TE2}${n} [${shape}] cannot be split into q, k and v`);
      target.names.forEach((name, part) => refs.text_encoder_2.set(name, { key: TE2 + n, shape: [shape[0] / 3, ...shape.slice(1)], part }));
    }
  }
  const te2Config: Json = {
    architectures: ['CLIPTextModelWithProjection'],
    vocab_size: te2.get('token_embedding.weight')![0],
    hidden_size: width2,
    num_hidden_layers: maxIndex(te2.keys(), /^transformer\.resblocks\.(\d+)\./) + 1,
    num_attention_heads: width2 / 64,
    intermediate_size: te2.get('transformer.resblocks.0.mlp.c_fc.weight')?.[0],
    max_position_embeddings: te2.get('positional_embedding')?.[0],
    hidden_act: 'gelu',
    projection_dim: proj2[1],
    ...o.overrides?.text_encoder_2,
  };
  const scheduler = { ...o.overrides?.scheduler };
  const uninferred = uninferredSdxl(
    { unet: unetConfig, vae: vaeConfig, text_encoder: te1Config, text_encoder_2: te2Config },
    (o.overrides ?? {}) as Partial<Record<SdxlComponent, Json>>,
  );
  return {
    name: what,
    layout: 'single-file',
    ...(uninferred ? { uninferred } : {}),
    prediction: sdxlPrediction(scheduler, what),
    configs: { unet: unetConfig, vae: vaeConfig, text_encoder: te1Config, text_encoder_2: te2Config },
    shapes: (c) => new Map([...refs[c]].map(([n, r]) => [n, r.shape] as const)),
    tensorOrigin: (c, name) => refs[c].get(name)?.key ?? name,
    async read(c, name) {
      const r = refs[c].get(name);
      if (!r) throw new ModelError(`${what}: no ${c} tensor '${name}'`);
      if (r.part !== undefined) return { shape: [...r.shape], data: (await file.readSlice(r.key, r.part * r.shape[0], r.shape[0])).data };
      const t = await file.read(r.key);
      if (!r.transpose) return { shape: [...r.shape], data: t.data };
      const [rows, cols] = r.shape; // stored [cols, rows]
      const out = new Float32Array(t.data.length);
      for (let i = 0; i < rows; i++) for (let j = 0; j < cols; j++) out[i * cols + j] = t.data[j * rows + i];
      return { shape: [rows, cols], data: out };
    },
    close: async () => file.source.close?.(),
  };
}

/**
 * The sizes a single file's shapes cannot tell at widths other than SDXL's, for the components whose configs
 * (inferred: heads = width / 64, 32 norm groups) would not fit and that --config does not give; null when none.
 */
function uninferredSdxl(configs: Record<SdxlComponent, Json>, given: Partial<Record<SdxlComponent, Json>>): string | null {
  const widths = (c: Json) => (Array.isArray(c.block_out_channels) ? (c.block_out_channels as number[]) : []);
  const needs: [SdxlComponent, string, number[]][] = [
    ['unet', 'attention_head_dim', widths(configs.unet).filter((w) => w % 64)],
    ['unet', 'norm_num_groups', widths(configs.unet).filter((w) => w % 32)],
    ['vae', 'norm_num_groups', widths(configs.vae).filter((w) => w % 32)],
    ['text_encoder', 'num_attention_heads', [configs.text_encoder.hidden_size as number].filter((w) => w % 64)],
    ['text_encoder_2', 'num_attention_heads', [configs.text_encoder_2.hidden_size as number].filter((w) => w % 64)],
  ];
  const missing = needs.filter(([c, field, off]) => off.length && !(given[c] && field in given[c]));
  if (!missing.length) return null;
  const parts = missing.map(([c, field, off]) => `${c} ${field} (widths ${off.join(', ')})`);
  const example: Record<string, Json> = {};
  for (const [c, field] of missing) example[c] = { ...example[c], [field]: '...' };
  return `a single file holds no configs, and at widths other than SDXL's these values cannot be inferred from the tensor shapes: ${parts.join('; ')}: give the model's configs (--config, or a .json chosen with the checkpoint in the studio), e.g. ${JSON.stringify(example)}`;
}

/** Weight files per component in an SDXL diffusers folder, full precision first. */
const SDXL_WEIGHT_FILES: Record<SdxlComponent, string[]> = {
  unet: ['unet/diffusion_pytorch_model.safetensors', 'unet/diffusion_pytorch_model.fp16.safetensors'],
  vae: ['vae/diffusion_pytorch_model.safetensors', 'vae/diffusion_pytorch_model.fp16.safetensors'],
  text_encoder: ['text_encoder/model.safetensors', 'text_encoder/model.fp16.safetensors'],
  text_encoder_2: ['text_encoder_2/model.safetensors', 'text_encoder_2/model.fp16.safetensors'],
};

/** An SDXL diffusers folder as an SdxlSource (configs checked by detectSdxlDiffusers before any file opens). */
export async function openSdxlDiffusers(dir: FolderReader, o: { overrides?: Partial<Record<SdxlComponent | 'scheduler', Json>> } = {}): Promise<SdxlSource> {
  const json = async (p: string) => ((await dir.exists(p)) ? readJsonFile(dir, p) : undefined);
  const unet = await json('unet/config.json');
  if (!unet) throw new ModelError(`${dir.name} is not a diffusers folder: unet/config.json is missing`);
  const te1 = await json('text_encoder/config.json');
  const te2 = await json('text_encoder_2/config.json');
  detectSdxlDiffusers({ modelIndex: await json('model_index.json'), unet, textEncoder: te1, textEncoder2: te2 }, dir.name);
  const vae = await json('vae/config.json');
  if (!vae) throw new ModelError(`${dir.name}: vae/config.json is missing`);
  const configs: Record<SdxlComponent, Json> = {
    unet: { ...unet, ...o.overrides?.unet },
    vae: { ...vae, ...o.overrides?.vae },
    text_encoder: { ...te1, ...o.overrides?.text_encoder },
    text_encoder_2: { ...te2, ...o.overrides?.text_encoder_2 },
  };
  const scheduler = { ...(await json('scheduler/scheduler_config.json')), ...o.overrides?.scheduler };
  const files = {} as Record<SdxlComponent, SafetensorsFile>;
  const paths = {} as Record<SdxlComponent, string>;
  const closeAll = async () => {
    for (const c of SDXL_COMPONENTS) await files[c]?.source.close?.();
  };
  try {
    for (const c of SDXL_COMPONENTS) {
      let found: string | undefined;
      for (const p of SDXL_WEIGHT_FILES[c]) if (!found && (await dir.exists(p))) found = p;
      if (!found) throw new ModelError(`${dir.name}: ${c} weights are missing: expected ${SDXL_WEIGHT_FILES[c].join(' or ')}`);
      paths[c] = found;
      files[c] = await SafetensorsFile.open(await dir.open(found));
    }
  } catch (e) {
    await closeAll();
    throw e;
  }
  const shapes = {} as Record<SdxlComponent, Map<string, readonly number[]>>;
  for (const c of SDXL_COMPONENTS)
    shapes[c] = new Map(files[c].names.filter((n) => !n.endsWith('position_ids')).map((n) => [n, files[c].entry(n).shape] as const));
  return {
    name: dir.name,
    layout: 'diffusers',
    prediction: sdxlPrediction(scheduler, dir.name),
    configs,
    shapes: (c) => new Map(shapes[c]),
    tensorOrigin: (c) => paths[c],
    async read(c, name) {
      if (!shapes[c].has(name)) throw new ModelError(`${dir.name}: no ${c} tensor '${name}' in ${paths[c]}`);
      return files[c].read(name);
    },
    close: closeAll,
  };
}

export interface LoadedSdxl {
  family: 'sdxl';
  prediction: Prediction;
  unet: { config: UnetConfig; weights: Weights };
  /** Always f32 weights: decoded in f32 (SDXL's VAE overflows in f16). */
  vae: { config: VaeConfig; weights: Weights };
  textEncoder: { config: ClipTextConfig; weights: Weights };
  textEncoder2: { config: ClipTextConfig; weights: Weights };
}

/** SDXL base 1.0's configs (stabilityai/stable-diffusion-xl-base-1.0's config.json files), for the planner and benchmarks. */
export const SDXL_BASE = {
  unet: {
    blockOutChannels: [320, 640, 1280],
    layersPerBlock: 2,
    heads: [5, 10, 20],
    crossAttentionDim: 2048,
    groups: 32,
    linearProjection: true,
    downAttention: [false, true, true],
    upAttention: [true, true, false],
    inChannels: 4,
    outChannels: 4,
    transformerLayers: [1, 2, 10],
    textTime: { timeEmbedDim: SDXL_TIME_EMBED_DIM, projectionInputDim: 2816 },
  } satisfies UnetConfig,
  vae: { blockOutChannels: [128, 256, 512, 512], layersPerBlock: 2, groups: 32, latentChannels: 4, scalingFactor: SDXL_SCALING_FACTOR } satisfies VaeConfig,
  textEncoder: {
    vocabSize: 49408,
    hiddenSize: 768,
    layers: 12,
    heads: 12,
    intermediateSize: 3072,
    maxPositions: 77,
    act: 'quick_gelu',
    eps: 1e-5,
  } satisfies ClipTextConfig,
  textEncoder2: {
    vocabSize: 49408,
    hiddenSize: 1280,
    layers: 32,
    heads: 20,
    intermediateSize: 5120,
    maxPositions: 77,
    act: 'gelu',
    eps: 1e-5,
    projectionDim: 1280,
  } satisfies ClipTextConfig,
};

/** Text encoder 2's tensors (CLIPTextModelWithProjection): CLIP's and the text projection [projection, width]. */
export function sdxlTextEncoder2Params(te2: ClipTextConfig): Map<string, number[]> {
  const m = clipParams(te2);
  m.set('text_projection.weight', [te2.projectionDim ?? te2.hiddenSize, te2.hiddenSize]);
  return m;
}

/** The parsed engine configs of an SdxlSource, and each component's expected tensors. */
export function sdxlConfigs(src: SdxlSource) {
  if (src.uninferred) throw new ModelError(`${src.name}: ${src.uninferred}`);
  const unet = unetConfigFromJson(src.configs.unet);
  const vae = vaeConfigFromJson(src.configs.vae);
  const te1 = clipConfigFromJson(src.configs.text_encoder);
  const te2 = clipConfigFromJson(src.configs.text_encoder_2);
  if (!unet.textTime) throw new ModelError(`${src.name}: the unet config has no addition_embed_type 'text_time': not an SDXL UNet`);
  if (te2.projectionDim === undefined) throw new ModelError(`${src.name}: text_encoder_2 is not a CLIPTextModelWithProjection (no text_projection)`);
  const pooled = unet.textTime.projectionInputDim - 6 * unet.textTime.timeEmbedDim;
  if (pooled !== te2.projectionDim)
    throw new ModelError(
      `${src.name}: the UNet's add embedding takes ${unet.textTime.projectionInputDim} = ${pooled} pooled + 6 x ${unet.textTime.timeEmbedDim} time-id values, but text_encoder_2 projects to ${te2.projectionDim}`,
    );
  const te2Params = sdxlTextEncoder2Params(te2);
  return {
    unet,
    vae,
    te1,
    te2,
    expected: { unet: unetParams(unet), vae: vaeParams(vae), text_encoder: clipParams(te1), text_encoder_2: te2Params } as Record<
      SdxlComponent,
      Map<string, number[]>
    >,
  };
}

/**
 * Every component's tensor names and shapes checked against its config before anything is read; then each
 * tensor read, refused if non-finite (or past f16's range for f16 weights) naming it and where it lives, and
 * uploaded (`dtype`, the VAE in f32). A refusal frees what was uploaded.
 */
export async function loadSdxl(gpu: Gpu, src: SdxlSource, dtype: DType): Promise<LoadedSdxl> {
  const cfg = sdxlConfigs(src);
  for (const c of SDXL_COMPONENTS) validateComponent(src.name, c, cfg.expected[c], src.shapes(c));
  const uploaded: Tensor[] = [];
  const upload = async (c: SdxlComponent, dt: DType): Promise<Weights> => {
    // the loader's layout: the UNet's merged-GEMM groups end to end (load.ts allocateWeights)
    const w: Weights = allocateWeights(gpu, src.shapes(c), dt);
    uploaded.push(...w.values());
    for (const [name, t] of w) {
      const { data } = await src.read(c, name);
      const bad = countBadValues(data, dt);
      if (bad.nonFinite || bad.beyondF16)
        throw new ModelError(
          `${src.name}: ${c} tensor ${name} (${src.tensorOrigin(c, name)}) holds ${bad.nonFinite ? `${bad.nonFinite} non-finite values (NaN/Inf)` : `${bad.beyondF16} values beyond f16's range`}: use another file${bad.nonFinite ? '' : ' or load in f32'}`,
        );
      gpu.write(t, data);
    }
    return w;
  };
  try {
    return {
      family: 'sdxl',
      prediction: src.prediction,
      unet: { config: cfg.unet, weights: await upload('unet', dtype) },
      vae: { config: cfg.vae, weights: await upload('vae', 'f32') },
      textEncoder: { config: cfg.te1, weights: await upload('text_encoder', dtype) },
      textEncoder2: { config: cfg.te2, weights: await upload('text_encoder_2', dtype) },
    };
  } catch (e) {
    gpu.free(...uploaded);
    throw e;
  }
}
