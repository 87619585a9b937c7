// One interface over both model layouts: a ModelSource gives, per component (unet, vae, text_encoder),
// the diffusers config.json and the tensors by their diffusers names, read one at a time on demand.
//   - a single-file checkpoint (A1111/ComfyUI: model.diffusion_model.*, first_stage_model.*,
//     cond_stage_model.transformer.* for SD1 or cond_stage_model.model.* for SD2's OpenCLIP): names go
//     through the key maps, configs are inferred from shapes (config.json overrides win), the VAE's
//     1x1-conv attention projections become linears, OpenCLIP's fused q/k/v rows are read as three
//     slices, and EMA copies, schedule buffers and index tensors are left out;
//   - a diffusers folder (model_index.json, unet/, vae/, text_encoder/, scheduler/ with their configs;
//     diffusion_pytorch_model[.fp16].safetensors / model[.fp16].safetensors), from disk, a dropped
//     folder or a hub download, all through FolderReader.
// Nothing here touches a GPU: loaders (load.ts), inspection and exports all build on this.
import { SafetensorsFile, type NamedTensor } from '../io/safetensors.ts';
import type { ByteSource } from '../io/source.ts';
import type { ClipTokenizerFiles } from '../io/tokenizer.ts';
import { detectDiffusers, detectSingleFile, ModelError, predictionFor, type Component, type Family, type Prediction } from './detect.ts';
import { clipToDiffusers, isVaeAttentionProjection, openClipToDiffusers, unetToDiffusers, vaeToDiffusers, type UnetLayout } from './keymap.ts';

export type Json = Record<string, unknown>;

/** A diffusers folder as a lookup of relative paths (Node: the file system; browser: a dropped folder). */
export interface FolderReader {
  name: string;
  exists(path: string): Promise<boolean>;
  readJson(path: string): Promise<Json>;
  open(path: string): Promise<ByteSource>;
}

/**
 * A folder's JSON file through its reader, named in the message when it is not a JSON object (readers
 * throw JSON.parse's bare SyntaxError, which names no file).
 */
export async function readJsonFile(dir: FolderReader, path: string): Promise<Json> {
  let j: unknown;
  try {
    j = await dir.readJson(path);
  } catch (e) {
    if (e instanceof SyntaxError) throw new ModelError(`${dir.name}: ${path}: invalid JSON (${e.message})`);
    throw e;
  }
  if (typeof j !== 'object' || j === null || Array.isArray(j))
    throw new ModelError(`${dir.name}: ${path}: not a JSON object (it holds ${j === null ? 'null' : Array.isArray(j) ? 'an array' : typeof j})`);
  return j as Json;
}

/** A FolderReader over files already at hand (a dropped folder's Files, a hub download's cache entries). */
export function folderFromSources(name: string, files: Map<string, ByteSource>): FolderReader {
  return {
    name,
    exists: async (p) => files.has(p),
    readJson: async (p) => {
      const f = files.get(p);
      if (!f) throw new ModelError(`${name}: ${p} is missing`);
      return JSON.parse(new TextDecoder().decode(await f.read(0, f.size))) as Json;
    },
    open: async (p) => {
      const f = files.get(p);
      if (!f) throw new ModelError(`${name}: ${p} is missing`);
      return f;
    },
  };
}

export interface SourceOptions {
  /** config.json values that replace the folder's or the inferred ones, per component (diffusers keys). */
  overrides?: { unet?: Json; vae?: Json; text_encoder?: Json; scheduler?: Json };
  /** Skip architecture detection (custom widths whose family nothing in the files tells). */
  family?: Family;
}

export interface ModelSource {
  readonly name: string;
  readonly layout: 'single-file' | 'diffusers';
  readonly family: Family;
  readonly prediction: Prediction;
  /** Why the prediction type is what it is. */
  readonly predictionSource: string;
  /** diffusers config.json per component (the folder's, or inferred from a single file), overrides applied. */
  readonly configs: Record<Component, Json>;
  /** scheduler_config.json with overrides ({} for a single file without one). */
  readonly scheduler: Json;
  /** The component's tensors: diffusers name -> shape (as the engine wants it). */
  shapes(c: Component): Map<string, readonly number[]>;
  /** One tensor decoded to f32, read from the file only now. */
  read(c: Component, name: string): Promise<NamedTensor>;
  close(): Promise<void>;
  /** Where a config field's value came from, for messages: 'unet/config.json', 'the unet config override (--config)', ... */
  configOrigin?(c: Component, field: string): string;
  /** Where a tensor lives, for messages: its file in a folder, its key in a single file. */
  tensorOrigin?(c: Component, name: string): string;
  /**
   * Config values a single file cannot tell and no override gave, per component: SD's conventions
   * (heads of 64 or 8, 32 norm groups) fill them in `configs`, but hold only at SD's own widths.
   */
  readonly uninferred?: Partial<Record<Component, { fields: string[]; widths: string }>>;
}

/** Labels a config field by where its value came from: the override (--config) or the component's own config. */
function originOf(own: (c: Component) => string, overrides: SourceOptions['overrides']): (c: Component, field: string) => string {
  return (c, field) => (overrides?.[c] && field in overrides[c]! ? `the ${c} config override (--config)` : own(c));
}

export const COMPONENTS: readonly Component[] = ['unet', 'vae', 'text_encoder'];

/** Index buffers, not weights (CLIP's position_ids are I64 in many files). */
function isBuffer(name: string): boolean {
  return name.endsWith('position_ids');
}

// ---- single file ------------------------------------------------------------------------------------

function maxIndex(names: Iterable<string>, re: RegExp): number {
  let m = -1;
  for (const n of names) {
    const r = re.exec(n);
    if (r) m = Math.max(m, Number(r[1]));
  }
  return m;
}

/** UNet block layout and diffusers config inferred from single-file UNet names and shapes. */
export function inferUnet(shapes: Map<string, readonly number[]>, family: Family): { layout: UnetLayout; config: Json } {
  const names = [...shapes.keys()];
  const ops = names
    .map((n) => /^input_blocks\.(\d+)\.0\.op\.weight$/.exec(n))
    .filter((r): r is RegExpExecArray => !!r)
    .map((r) => Number(r[1]))
    .sort((a, b) => a - b);
  if (!ops.length) throw new ModelError('the UNet has no downsamplers (input_blocks.N.0.op): not an SD UNet');
  const L = ops[0] - 1;
  const blocks = ops.length + 1;
  const has = (prefix: string) => names.some((n) => n.startsWith(prefix));
  const downAttention = Array.from({ length: blocks }, (_, i) => has(`input_blocks.${1 + i * (L + 1)}.1.proj_in.`));
  const upAttention = Array.from({ length: blocks }, (_, i) => has(`output_blocks.${i * (L + 1)}.1.proj_in.`));
  const channels = Array.from({ length: blocks }, (_, i) => {
    const s = shapes.get(`input_blocks.${1 + i * (L + 1)}.0.out_layers.3.weight`);
    if (!s) throw new ModelError(`the UNet lacks input_blocks.${1 + i * (L + 1)}.0.out_layers.3.weight`);
    return s[0];
  });
  const toK = names.find((n) => n.endsWith('attn2.to_k.weight'));
  const projIn = names.find((n) => n.endsWith('proj_in.weight'));
  const config: Json = {
    block_out_channels: channels,
    layers_per_block: L,
    // diffusers' attention_head_dim holds head COUNTS for SD: 8 everywhere for SD1, channels / 64 for SD2.
    attention_head_dim: family === 'sd1' ? 8 : channels.map((c) => c / 64),
    cross_attention_dim: toK ? shapes.get(toK)![1] : 768,
    norm_num_groups: 32,
    use_linear_projection: projIn ? shapes.get(projIn)!.length === 2 : false,
    in_channels: shapes.get('input_blocks.0.0.weight')?.[1] ?? 4,
    out_channels: shapes.get('out.2.weight')?.[0] ?? 4,
    down_block_types: downAttention.map((a) => (a ? 'CrossAttnDownBlock2D' : 'DownBlock2D')),
    up_block_types: upAttention.map((a) => (a ? 'CrossAttnUpBlock2D' : 'UpBlock2D')),
  };
  return { layout: { blocks, layersPerBlock: L, downAttention, upAttention }, config };
}

export function inferVae(shapes: Map<string, readonly number[]>): Json {
  const names = [...shapes.keys()];
  const blocks = maxIndex(names, /^encoder\.down\.(\d+)\./) + 1;
  if (blocks < 1) throw new ModelError('the VAE has no encoder.down.* blocks');
  return {
    block_out_channels: Array.from({ length: blocks }, (_, i) => shapes.get(`encoder.down.${i}.block.0.conv2.weight`)?.[0]),
    layers_per_block: maxIndex(names, /^encoder\.down\.0\.block\.(\d+)\./) + 1,
    norm_num_groups: 32,
    latent_channels: shapes.get('post_quant_conv.weight')?.[0] ?? 4,
    scaling_factor: 0.18215,
  };
}

/** CLIPTextModel config from SD1 names (text_model.*) or SD2 OpenCLIP names. */
function inferClip(shapes: Map<string, readonly number[]>, family: Family): Json {
  const names = [...shapes.keys()];
  if (family === 'sd1') {
    const tok = shapes.get('text_model.embeddings.token_embedding.weight');
    if (!tok) throw new ModelError('the text encoder lacks its token embedding (cond_stage_model.transformer.text_model.embeddings.token_embedding.weight)');
    return {
      vocab_size: tok[0],
      hidden_size: tok[1],
      num_hidden_layers: maxIndex(names, /^text_model\.encoder\.layers\.(\d+)\./) + 1,
      num_attention_heads: tok[1] / 64,
      intermediate_size: shapes.get('text_model.encoder.layers.0.mlp.fc1.weight')?.[0],
      max_position_embeddings: shapes.get('text_model.embeddings.position_embedding.weight')?.[0],
      hidden_act: 'quick_gelu',
    };
  }
  const tok = shapes.get('token_embedding.weight');
  if (!tok) throw new ModelError('the OpenCLIP text encoder lacks cond_stage_model.model.token_embedding.weight');
  return {
    vocab_size: tok[0],
    hidden_size: tok[1],
    // SD2 conditions on the penultimate block's output: one block fewer than the file holds.
    num_hidden_layers: maxIndex(names, /^transformer\.resblocks\.(\d+)\./),
    num_attention_heads: tok[1] / 64,
    intermediate_size: shapes.get('transformer.resblocks.0.mlp.c_fc.weight')?.[0],
    max_position_embeddings: shapes.get('positional_embedding')?.[0],
    hidden_act: 'gelu',
  };
}

/** Where a diffusers-named tensor lives in the single file: a whole tensor, or one third of fused q/k/v rows. */
interface Ref {
  key: string;
  shape: readonly number[];
  /** 0, 1, 2 = q, k, v rows of a fused in_proj tensor. */
  part?: number;
}

/** SD 1.x/2.x widths, the only ones at which SD's head-count and norm-group conventions are known to hold. */
const SD_UNET_WIDTHS = [320, 640, 1280, 1280];
const SD_VAE_WIDTHS = [128, 256, 512, 512];
const SD_TEXT_WIDTH: Record<Family, number> = { sd1: 768, sd2: 1024 };

/**
 * The config values inferUnet/inferVae/inferClip assumed by convention, for each component whose widths
 * are not SD's (so the convention cannot be trusted) and that no override supplies.
 */
function uninferredFields(configs: Record<Component, Json>, family: Family, overrides: SourceOptions['overrides']): ModelSource['uninferred'] {
  const same = (a: unknown, b: number[]) => Array.isArray(a) && a.length === b.length && a.every((x, i) => x === b[i]);
  const standard: Record<Component, [boolean, string, string[]]> = {
    unet: [
      same(configs.unet.block_out_channels, SD_UNET_WIDTHS),
      `block_out_channels [${configs.unet.block_out_channels}]; SD's are [${SD_UNET_WIDTHS}]`,
      ['attention_head_dim', 'norm_num_groups'],
    ],
    vae: [
      same(configs.vae.block_out_channels, SD_VAE_WIDTHS),
      `block_out_channels [${configs.vae.block_out_channels}]; SD's are [${SD_VAE_WIDTHS}]`,
      ['norm_num_groups'],
    ],
    text_encoder: [
      configs.text_encoder.hidden_size === SD_TEXT_WIDTH[family],
      `hidden_size ${configs.text_encoder.hidden_size}; ${family.toUpperCase()}'s is ${SD_TEXT_WIDTH[family]}`,
      ['num_attention_heads'],
    ],
  };
  const out: ModelSource['uninferred'] = {};
  for (const c of COMPONENTS) {
    const [isStandard, widths, assumed] = standard[c];
    const fields = isStandard ? [] : assumed.filter((f) => !(overrides?.[c] && f in overrides[c]!));
    if (fields.length) out[c] = { fields, widths };
  }
  return out;
}

function stripped(file: SafetensorsFile, prefix: string): Map<string, readonly number[]> {
  const m = new Map<string, readonly number[]>();
  for (const n of file.names) if (n.startsWith(prefix)) m.set(n.slice(prefix.length), file.entry(n).shape);
  return m;
}

const V_PROBE = 'model.diffusion_model.output_blocks.11.1.transformer_blocks.0.norm1.bias';

/**
 * SD2 files do not say whether they predict epsilon (512-base) or v (768-v). ComfyUI's test, used for
 * SD-sized SD2 UNets when no config says: population std of one LayerNorm bias above 0.09 means v.
 */
async function sd2PredictionFromWeights(file: SafetensorsFile): Promise<{ prediction: Prediction; source: string } | null> {
  if (!file.header.entries.has(V_PROBE)) return null;
  const x = (await file.read(V_PROBE)).data;
  const mean = x.reduce((a, b) => a + b, 0) / x.length;
  const std = Math.sqrt(x.reduce((a, b) => a + (b - mean) ** 2, 0) / x.length);
  return {
    prediction: std > 0.09 ? 'v_prediction' : 'epsilon',
    source: `weights: std ${std.toFixed(3)} of ${V_PROBE.slice(22)} ${std > 0.09 ? '>' : '<='} 0.09 (ComfyUI's SD2 test); a scheduler config overrides it`,
  };
}

/**
 * What the file itself says of its prediction type: Stability AI's `modelspec.prediction_type` ("v" or
 * "epsilon", as our exports and kohya write it) or a `-v` architecture ("stable-diffusion-v2-768-v") in its
 * metadata, else a `v_pred` marker tensor (ComfyUI's test for v-prediction SD1 checkpoints); null when silent.
 */
function predictionFromFile(file: SafetensorsFile): { prediction: Prediction; source: string } | null {
  const m = file.metadata;
  const spec = m['modelspec.prediction_type']?.trim().toLowerCase();
  if (spec === 'v' || spec === 'v_prediction') return { prediction: 'v_prediction', source: `the file's metadata (modelspec.prediction_type "${spec}")` };
  if (spec === 'epsilon' || spec === 'eps') return { prediction: 'epsilon', source: `the file's metadata (modelspec.prediction_type "${spec}")` };
  if (/-v(\/|$)/.test(m['modelspec.architecture'] ?? ''))
    return { prediction: 'v_prediction', source: `the file's metadata (modelspec.architecture "${m['modelspec.architecture']}")` };
  if (file.header.entries.has('v_pred')) return { prediction: 'v_prediction', source: "the file's v_pred marker tensor" };
  return null;
}

/**
 * A single file's prediction type: the scheduler config's, else what the file says of itself (metadata, marker),
 * else for SD2 the weights test, else the family default.
 */
export async function singleFilePrediction(file: SafetensorsFile, family: Family, scheduler?: Json): Promise<{ prediction: Prediction; source: string }> {
  const fromConfig = predictionFor(family, scheduler as { prediction_type?: string } | undefined);
  if (scheduler?.prediction_type !== undefined) return fromConfig;
  const own = predictionFromFile(file);
  if (own) return own;
  if (family !== 'sd2') return fromConfig;
  return (await sd2PredictionFromWeights(file)) ?? fromConfig;
}

/** A single-file checkpoint as a ModelSource. The caller keeps ownership of `file` unless it calls close(). */
export async function openSingleFile(file: SafetensorsFile, o: SourceOptions = {}): Promise<ModelSource> {
  const what = file.source.name;
  const all = new Map(file.names.map((n) => [n, file.entry(n).shape] as const));
  const sched = { ...o.overrides?.scheduler };
  const det = o.family ? null : detectSingleFile(all, what, sched as { prediction_type?: string });
  const family = o.family ?? det!.family;
  const { prediction, source: predictionSource } = await singleFilePrediction(file, family, sched);

  const refs: Record<Component, Map<string, Ref>> = { unet: new Map(), vae: new Map(), text_encoder: new Map() };
  const unetShapes = stripped(file, 'model.diffusion_model.');
  const unet = inferUnet(unetShapes, family);
  const unetConfig = { ...unet.config, ...o.overrides?.unet };
  for (const [n, shape] of unetShapes) refs.unet.set(unetToDiffusers(n, unet.layout), { key: `model.diffusion_model.${n}`, shape });

  const vaeShapes = stripped(file, 'first_stage_model.');
  const vaeConfig = { ...inferVae(vaeShapes), ...o.overrides?.vae };
  const vaeBlocks = (vaeConfig.block_out_channels as unknown[]).length;
  for (const [n, shape] of vaeShapes) {
    const d = vaeToDiffusers(n, vaeBlocks);
    // Attention projections are 1x1 convs [C, C, 1, 1] in the single file, linears [C, C] in diffusers.
    refs.vae.set(d, { key: `first_stage_model.${n}`, shape: isVaeAttentionProjection(d) && shape.length === 4 ? shape.slice(0, 2) : shape });
  }

  const tePrefix = family === 'sd1' ? 'cond_stage_model.transformer.' : 'cond_stage_model.model.';
  const teRaw = stripped(file, tePrefix);
  const teNamed = family === 'sd1' ? new Map([...teRaw].map(([n, s]) => [clipToDiffusers(n), s] as const)) : teRaw;
  const teConfig = { ...inferClip(teNamed, family), ...o.overrides?.text_encoder };
  const layers = teConfig.num_hidden_layers as number;
  for (const [n, shape] of teRaw) {
    if (isBuffer(n)) continue;
    if (family === 'sd1') {
      refs.text_encoder.set(clipToDiffusers(n), { key: tePrefix + n, shape });
      continue;
    }
    const layer = /^transformer\.resblocks\.(\d+)\./.exec(n);
    if (layer && Number(layer[1]) >= layers) continue; // blocks past the penultimate are unused
    const target = openClipToDiffusers(n);
    if (!target) continue; // text_projection, logit_scale: not part of CLIPTextModel
    if (!target.split) refs.text_encoder.set(target.names[0], { key: tePrefix + n, shape });
    else {
      if (shape[0] % 3) throw new ModelError(`${what}: ${tePrefix}${n} [${shape}] cannot be split into q, k and v`);
      target.names.forEach((name, part) => refs.text_encoder.set(name, { key: tePrefix + n, shape: [shape[0] / 3, ...shape.slice(1)], part }));
    }
  }

  const configs = { unet: unetConfig, vae: vaeConfig, text_encoder: teConfig };
  return {
    name: what,
    layout: 'single-file',
    family,
    prediction,
    predictionSource,
    configs,
    scheduler: sched,
    configOrigin: originOf((c) => `the ${c} config inferred from the weights`, o.overrides),
    tensorOrigin: (c, name) => {
      const r = refs[c].get(name);
      return r ? `${r.key}${r.part === undefined ? '' : ` rows ${r.part * r.shape[0]}..${(r.part + 1) * r.shape[0] - 1}`}` : name;
    },
    uninferred: uninferredFields(configs, family, o.overrides),
    shapes: (c) => new Map([...refs[c]].map(([n, r]) => [n, r.shape] as const)),
    async read(c, name) {
      const r = refs[c].get(name);
      if (!r) throw new ModelError(`${what}: no ${c} tensor '${name}'`);
      const t = r.part === undefined ? await file.read(r.key) : await file.readSlice(r.key, r.part * r.shape[0], r.shape[0]);
      return { shape: [...r.shape], data: t.data };
    },
    close: async () => file.source.close?.(),
  };
}

// ---- diffusers folder -------------------------------------------------------------------------------

/** Weight files per component, full precision first, then the fp16 variant. */
const WEIGHT_FILES: Record<Component, string[]> = {
  unet: ['unet/diffusion_pytorch_model.safetensors', 'unet/diffusion_pytorch_model.fp16.safetensors'],
  vae: ['vae/diffusion_pytorch_model.safetensors', 'vae/diffusion_pytorch_model.fp16.safetensors'],
  text_encoder: ['text_encoder/model.safetensors', 'text_encoder/model.fp16.safetensors'],
};

/** The component's safetensors file in a folder; a specific message for pickles and sharded weights. */
async function findWeights(dir: FolderReader, c: Component): Promise<string> {
  const candidates = WEIGHT_FILES[c];
  for (const p of candidates) if (await dir.exists(p)) return p;
  for (const p of candidates) {
    const bin = p.replace(/\.safetensors$/, '.bin');
    if (await dir.exists(bin))
      throw new ModelError(`${dir.name}: ${c} weights are only in ${bin}, a PyTorch pickle, which is never opened here: convert it to .safetensors first`);
    if (await dir.exists(`${p}.index.json`))
      throw new ModelError(`${dir.name}: ${c} weights are sharded (${p}.index.json): sharded checkpoints are not supported yet`);
  }
  throw new ModelError(`${dir.name}: ${c} weights are missing: expected ${candidates.join(' or ')}`);
}

export interface DiffusersFolder {
  modelIndex?: Json;
  configs: Record<Component, Json>;
  scheduler: Json;
  files: Record<Component, SafetensorsFile>;
  paths: Record<Component, string>;
}

/** Reads a folder's configs and opens its weight files (headers only). */
export async function readDiffusersFolder(dir: FolderReader, o: SourceOptions = {}): Promise<DiffusersFolder> {
  const json = async (p: string) => ((await dir.exists(p)) ? readJsonFile(dir, p) : undefined);
  const modelIndex = await json('model_index.json');
  const unet = await json('unet/config.json');
  if (!unet) {
    const what = modelIndex ? 'unet/config.json is missing' : 'it has neither model_index.json nor unet/config.json';
    throw new ModelError(`${dir.name} is not a diffusers Stable Diffusion folder: ${what}`);
  }
  const need = async (p: string) => {
    const j = await json(p);
    if (!j) throw new ModelError(`${dir.name}: ${p} is missing`);
    return j;
  };
  const configs: Record<Component, Json> = {
    unet: { ...unet, ...o.overrides?.unet },
    vae: { ...(await need('vae/config.json')), ...o.overrides?.vae },
    text_encoder: { ...(await need('text_encoder/config.json')), ...o.overrides?.text_encoder },
  };
  const scheduler = { ...(await json('scheduler/scheduler_config.json')), ...o.overrides?.scheduler };
  const files = {} as Record<Component, SafetensorsFile>;
  const paths = {} as Record<Component, string>;
  try {
    for (const c of COMPONENTS) {
      paths[c] = await findWeights(dir, c);
      files[c] = await SafetensorsFile.open(await dir.open(paths[c]));
    }
  } catch (e) {
    // The files opened before the one that failed are closed, not left to the garbage collector.
    for (const c of COMPONENTS) await files[c]?.source.close?.();
    throw e;
  }
  return { modelIndex, configs, scheduler, files, paths };
}

/** Tensors and parameters per component, index buffers left out. */
export function countTensors(files: Record<Component, SafetensorsFile>): Record<Component, { tensors: number; parameters: number }> {
  const out = {} as Record<Component, { tensors: number; parameters: number }>;
  for (const c of COMPONENTS) {
    const names = files[c].names.filter((n) => !isBuffer(n));
    out[c] = { tensors: names.length, parameters: names.reduce((s, n) => s + files[c].entry(n).shape.reduce((a, b) => a * b, 1), 0) };
  }
  return out;
}

/** A diffusers folder as a ModelSource (detection from its configs unless `family` is given). */
export async function openDiffusers(dir: FolderReader, o: SourceOptions = {}): Promise<ModelSource> {
  const f = await readDiffusersFolder(dir, o);
  try {
    if (o.family) return folderSource(dir, f, { family: o.family, ...predictionOf(predictionFor(o.family, f.scheduler as { prediction_type?: string })) }, o);
    const det = detectDiffusers(
      { modelIndex: f.modelIndex, unet: f.configs.unet, scheduler: f.scheduler, textEncoder: f.configs.text_encoder },
      countTensors(f.files),
      dir.name,
    );
    return folderSource(dir, f, det, o);
  } catch (e) {
    await closeFolder(f);
    throw e;
  }
}

function predictionOf(p: { prediction: Prediction; source: string }): { prediction: Prediction; predictionSource: string } {
  return { prediction: p.prediction, predictionSource: p.source };
}

export async function closeFolder(f: DiffusersFolder): Promise<void> {
  for (const c of COMPONENTS) await f.files[c].source.close?.();
}

/** An opened folder (readDiffusersFolder) as a ModelSource of the given family; closing it closes the folder's files. */
export function folderSource(
  dir: FolderReader,
  f: DiffusersFolder,
  det: { family: Family; prediction: Prediction; predictionSource: string },
  o: SourceOptions = {},
): ModelSource {
  const { family, prediction, predictionSource } = det;
  const shapes = {} as Record<Component, Map<string, readonly number[]>>;
  for (const c of COMPONENTS) shapes[c] = new Map(f.files[c].names.filter((n) => !isBuffer(n)).map((n) => [n, f.files[c].entry(n).shape] as const));
  return {
    name: dir.name,
    layout: 'diffusers',
    family,
    prediction,
    predictionSource,
    configs: f.configs,
    scheduler: f.scheduler,
    shapes: (c) => new Map(shapes[c]),
    configOrigin: originOf((c) => `${c}/config.json`, o.overrides),
    tensorOrigin: (c) => f.paths[c],
    async read(c, name) {
      if (!shapes[c].has(name)) throw new ModelError(`${dir.name}: no ${c} tensor '${name}' in ${f.paths[c]}`);
      return f.files[c].read(name);
    },
    close: () => closeFolder(f),
  };
}

/**
 * The CLIP tokenizer files in a folder reader (`prefix` 'tokenizer/' for a diffusers model folder, '' for a
 * tokenizer folder of its own): tokenizer.json, or vocab.json + merges.txt, with tokenizer_config.json and
 * special_tokens_map.json when present. Null when the folder has no tokenizer.
 */
export async function tokenizerFilesFrom(dir: FolderReader, prefix = 'tokenizer/'): Promise<ClipTokenizerFiles | null> {
  const p = (f: string) => `${prefix}${f}`;
  const optional = async (f: string) => ((await dir.exists(p(f))) ? await readJsonFile(dir, p(f)) : {});
  const config = { ...(await optional('special_tokens_map.json')), ...(await optional('tokenizer_config.json')) };
  if (await dir.exists(p('tokenizer.json'))) return { tokenizerJson: await readJsonFile(dir, p('tokenizer.json')), config };
  if (!(await dir.exists(p('vocab.json'))) || !(await dir.exists(p('merges.txt')))) return null;
  const merges = await dir.open(p('merges.txt'));
  try {
    return {
      vocab: (await readJsonFile(dir, p('vocab.json'))) as Record<string, number>,
      merges: new TextDecoder().decode(await merges.read(0, merges.size)),
      config,
    };
  } finally {
    await merges.close?.();
  }
}
