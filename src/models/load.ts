// Loads a Stable Diffusion model into engine tensors, from a single-file checkpoint (through the key
// maps) or a diffusers folder, streaming one tensor at a time from its ByteSource. Configs come from the
// diffusers config.json files, or for single files are inferred from tensor shapes with SD's known
// values (heads: 8 for SD1, head dim 64 for SD2; 32 groups) that a config override replaces.
import type { Gpu } from '../gpu/device.ts';
import type { DType, Tensor } from '../gpu/tensor.ts';
import { SafetensorsFile } from '../io/safetensors.ts';
import { clipConfigFromJson, type ClipTextConfig } from '../nn/clip.ts';
import type { Weights } from '../nn/blocks.ts';
import { unetConfigFromJson, type UnetConfig } from '../nn/unet.ts';
import { vaeConfigFromJson, type VaeConfig } from '../nn/vae.ts';
import { detectSingleFile, ModelError, type Family, type Prediction } from './detect.ts';
import type { FolderReader } from './inspect.ts';
import { clipToDiffusers, isVaeAttentionProjection, openClipToDiffusers, unetToDiffusers, vaeToDiffusers, type UnetLayout } from './keymap.ts';
import { clipParams, unetParams, vaeParams, type ParamShapes } from './shapes.ts';

export interface LoadedModel {
  family: Family;
  prediction: Prediction;
  unet: { config: UnetConfig; weights: Weights };
  vae: { config: VaeConfig; weights: Weights };
  textEncoder: { config: ClipTextConfig; weights: Weights };
}

export interface LoadOptions {
  dtype: DType;
  /** config.json values that replace inferred ones, per component (diffusers keys). */
  overrides?: { unet?: Record<string, unknown>; vae?: Record<string, unknown>; text_encoder?: Record<string, unknown>; scheduler?: Record<string, unknown> };
  /** Skip detection (tiny test models whose widths are not SD's). */
  family?: Family;
}

function maxIndex(names: string[], re: RegExp): number {
  let m = -1;
  for (const n of names) {
    const r = re.exec(n);
    if (r) m = Math.max(m, Number(r[1]));
  }
  return m;
}

/** UNet block layout and diffusers config inferred from single-file UNet names and shapes. */
export function inferUnet(shapes: Map<string, readonly number[]>, family: Family): { layout: UnetLayout; config: Record<string, unknown> } {
  const names = [...shapes.keys()];
  const ops = names.map((n) => /^input_blocks\.(\d+)\.0\.op\.weight$/.exec(n)).filter((r): r is RegExpExecArray => !!r).map((r) => Number(r[1])).sort((a, b) => a - b);
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
  const config: Record<string, unknown> = {
    block_out_channels: channels,
    layers_per_block: L,
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

function inferVae(shapes: Map<string, readonly number[]>): Record<string, unknown> {
  const names = [...shapes.keys()];
  const blocks = maxIndex(names, /^encoder\.down\.(\d+)\./) + 1;
  const L = maxIndex(names, /^encoder\.down\.0\.block\.(\d+)\./) + 1;
  return {
    block_out_channels: Array.from({ length: blocks }, (_, i) => shapes.get(`encoder.down.${i}.block.0.conv2.weight`)?.[0]),
    layers_per_block: L,
    norm_num_groups: 32,
    latent_channels: shapes.get('post_quant_conv.weight')?.[0] ?? 4,
    scaling_factor: 0.18215,
  };
}

function inferClip(shapes: Map<string, readonly number[]>, family: Family): Record<string, unknown> {
  const names = [...shapes.keys()];
  if (family === 'sd1') {
    const tok = shapes.get('text_model.embeddings.token_embedding.weight');
    if (!tok) throw new ModelError('the text encoder lacks its token embedding');
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
  if (!tok) throw new ModelError('the OpenCLIP text encoder lacks token_embedding.weight');
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

function stripped(file: SafetensorsFile, prefix: string): Map<string, readonly number[]> {
  const m = new Map<string, readonly number[]>();
  for (const n of file.names) if (n.startsWith(prefix)) m.set(n.slice(prefix.length), file.entry(n).shape);
  return m;
}

async function upload(gpu: Gpu, file: SafetensorsFile, name: string, dtype: DType, shape?: readonly number[]): Promise<Tensor> {
  const t = await file.read(name);
  return gpu.upload(t.data, shape ?? t.shape, dtype, 'weights', name);
}

/** A single-file (A1111/ComfyUI) checkpoint. */
export async function loadSingleFile(gpu: Gpu, file: SafetensorsFile, o: LoadOptions): Promise<LoadedModel> {
  const all = new Map(file.names.map((n) => [n, file.entry(n).shape] as const));
  const det = o.family ? null : detectSingleFile(all, file.source.name, o.overrides?.scheduler as { prediction_type?: string } | undefined);
  const family = o.family ?? det!.family;
  const prediction = det?.prediction ?? ((o.overrides?.scheduler?.prediction_type as Prediction | undefined) ?? (family === 'sd1' ? 'epsilon' : 'v_prediction'));

  const unetShapes = stripped(file, 'model.diffusion_model.');
  const { layout, config: unetJson } = inferUnet(unetShapes, family);
  const unetConfig = unetConfigFromJson({ ...unetJson, ...o.overrides?.unet });
  const unet: Weights = new Map();
  for (const n of unetShapes.keys()) unet.set(unetToDiffusers(n, layout), await upload(gpu, file, `model.diffusion_model.${n}`, o.dtype));

  const vaeShapes = stripped(file, 'first_stage_model.');
  const vaeJson = inferVae(vaeShapes);
  const vaeConfig = vaeConfigFromJson({ ...vaeJson, ...o.overrides?.vae });
  const vae: Weights = new Map();
  for (const [n, shape] of vaeShapes) {
    const d = vaeToDiffusers(n, vaeConfig.blockOutChannels.length);
    // Attention projections are 1x1 convs [C, C, 1, 1] in the single file, linears [C, C] in diffusers.
    vae.set(d, await upload(gpu, file, `first_stage_model.${n}`, o.dtype, isVaeAttentionProjection(d) ? shape.slice(0, 2) : undefined));
  }

  const tePrefix = family === 'sd1' ? 'cond_stage_model.transformer.' : 'cond_stage_model.model.';
  const teShapes = new Map([...stripped(file, tePrefix)].map(([n, s]) => [family === 'sd1' ? clipToDiffusers(n) : n, s] as const));
  const teConfig = clipConfigFromJson({ ...inferClip(teShapes, family), ...o.overrides?.text_encoder });
  const te: Weights = new Map();
  for (const n of stripped(file, tePrefix).keys()) {
    if (n === 'embeddings.position_ids' || n === 'text_model.embeddings.position_ids') continue; // an index buffer, not a weight
    if (family === 'sd1') {
      te.set(clipToDiffusers(n), await upload(gpu, file, tePrefix + n, o.dtype));
      continue;
    }
    const layer = /^transformer\.resblocks\.(\d+)\./.exec(n);
    if (layer && Number(layer[1]) >= teConfig.layers) continue; // blocks past the penultimate are unused
    const target = openClipToDiffusers(n);
    if (!target) continue;
    const t = await file.read(tePrefix + n);
    if (!target.split) te.set(target.names[0], gpu.upload(t.data, t.shape, o.dtype, 'weights', target.names[0]));
    else {
      const rows = t.shape[0] / 3;
      const per = t.data.length / 3;
      target.names.forEach((name, i) =>
        te.set(name, gpu.upload(t.data.subarray(i * per, (i + 1) * per), t.shape.length === 2 ? [rows, t.shape[1]] : [rows], o.dtype, 'weights', name)),
      );
    }
  }
  return validate(file.source.name, { family, prediction, unet: { config: unetConfig, weights: unet }, vae: { config: vaeConfig, weights: vae }, textEncoder: { config: teConfig, weights: te } });
}

/**
 * Every tensor the component's config needs is present with its shape, and nothing unknown is left
 * over: otherwise a ModelError names the component, the tensor and both shapes.
 */
export function validateComponent(what: string, component: string, expected: ParamShapes, weights: Weights): void {
  const missing: string[] = [];
  for (const [name, shape] of expected) {
    const t = weights.get(name);
    if (!t) missing.push(name);
    else if (t.shape.length !== shape.length || t.shape.some((d, i) => d !== shape[i]))
      throw new ModelError(`${what}: ${component} tensor ${name} is [${t.shape}] but its config needs [${shape}]`);
  }
  if (missing.length)
    throw new ModelError(`${what}: ${component} is missing ${missing.length} tensor(s), e.g. ${missing.slice(0, 3).join(', ')}`);
  const extra = [...weights.keys()].filter((n) => !expected.has(n));
  if (extra.length) throw new ModelError(`${what}: ${component} has ${extra.length} tensor(s) its config does not use, e.g. ${extra.slice(0, 3).join(', ')}`);
}

function validate(what: string, m: LoadedModel): LoadedModel {
  validateComponent(what, 'unet', unetParams(m.unet.config), m.unet.weights);
  validateComponent(what, 'vae', vaeParams(m.vae.config), m.vae.weights);
  validateComponent(what, 'text encoder', clipParams(m.textEncoder.config), m.textEncoder.weights);
  return m;
}

async function loadComponent(gpu: Gpu, dir: FolderReader, candidates: string[], dtype: DType): Promise<Weights> {
  for (const p of candidates)
    if (await dir.exists(p)) {
      const file = await SafetensorsFile.open(await dir.open(p));
      const w: Weights = new Map();
      for (const n of file.names) if (!n.endsWith('position_ids')) w.set(n, await upload(gpu, file, n, dtype));
      await file.source.close?.();
      return w;
    }
  throw new ModelError(`${dir.name}: none of ${candidates.join(', ')} exists`);
}

/** A diffusers folder (model_index.json, unet/, vae/, text_encoder/, scheduler/). */
export async function loadDiffusers(gpu: Gpu, dir: FolderReader, o: LoadOptions): Promise<LoadedModel> {
  const unetJson = { ...(await dir.readJson('unet/config.json')), ...o.overrides?.unet };
  const vaeJson = { ...(await dir.readJson('vae/config.json')), ...o.overrides?.vae };
  const teJson = { ...(await dir.readJson('text_encoder/config.json')), ...o.overrides?.text_encoder };
  const sched = (await dir.exists('scheduler/scheduler_config.json')) ? await dir.readJson('scheduler/scheduler_config.json') : {};
  const family: Family = o.family ?? (unetJson.cross_attention_dim === 1024 ? 'sd2' : 'sd1');
  const p = (o.overrides?.scheduler?.prediction_type ?? sched.prediction_type) as Prediction | undefined;
  return validate(dir.name, {
    family,
    prediction: p ?? (family === 'sd1' ? 'epsilon' : 'v_prediction'),
    unet: { config: unetConfigFromJson(unetJson), weights: await loadComponent(gpu, dir, ['unet/diffusion_pytorch_model.safetensors', 'unet/diffusion_pytorch_model.fp16.safetensors'], o.dtype) },
    vae: { config: vaeConfigFromJson(vaeJson), weights: await loadComponent(gpu, dir, ['vae/diffusion_pytorch_model.safetensors', 'vae/diffusion_pytorch_model.fp16.safetensors'], o.dtype) },
    textEncoder: { config: clipConfigFromJson(teJson), weights: await loadComponent(gpu, dir, ['text_encoder/model.safetensors', 'text_encoder/model.fp16.safetensors'], o.dtype) },
  });
}
