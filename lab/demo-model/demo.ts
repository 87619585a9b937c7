// The studio's demo model: a small Stable-Diffusion-1-shaped model the project generates itself, in the
// real diffusers layout (model_index.json, unet/ vae/ text_encoder/ with config.json and safetensors,
// scheduler/, tokenizer/), so a newcomer runs the whole flow (load, train, sample, export) in seconds with
// no download. Same seed, same bytes. Its weights are random: samples look like coloured noise that
// training visibly pulls toward the photos; it is a tour of the product, not an image model.
//
// Initialisation (what makes a random SD stack numerically tame): every matrix and conv kernel
// N(0, 1/fan_in) (LeCun), so each layer roughly preserves activation variance; norm scales 1, biases 0;
// embeddings N(0, 0.02^2) as CLIP does.
import { writeSafetensors, type NamedTensor } from '../../src/io/safetensors.ts';
import { clipParams, unetParams, vaeParams, type ParamShapes } from '../../src/models/shapes.ts';
import { clipConfigFromJson } from '../../src/nn/clip.ts';
import { unetConfigFromJson } from '../../src/nn/unet.ts';
import { vaeConfigFromJson } from '../../src/nn/vae.ts';
import { Rng } from '../../src/util/rng.ts';

/** diffusers config.json of each component (the sizes the studio's e2e tests train at in software). */
export const DEMO_CONFIGS = {
  unet: {
    block_out_channels: [16, 32],
    layers_per_block: 1,
    attention_head_dim: 2,
    cross_attention_dim: 32,
    norm_num_groups: 8,
    use_linear_projection: false,
    in_channels: 4,
    out_channels: 4,
    sample_size: 16,
    down_block_types: ['CrossAttnDownBlock2D', 'DownBlock2D'],
    up_block_types: ['UpBlock2D', 'CrossAttnUpBlock2D'],
  },
  // Two blocks: the VAE downsamples by 2, so 32 px images train on 16x16 latents.
  vae: { block_out_channels: [8, 16], layers_per_block: 1, norm_num_groups: 4, latent_channels: 4, scaling_factor: 0.18215, in_channels: 3, out_channels: 3 },
  text_encoder: {
    vocab_size: 514,
    hidden_size: 32,
    num_hidden_layers: 2,
    num_attention_heads: 2,
    intermediate_size: 64,
    max_position_embeddings: 77,
    hidden_act: 'quick_gelu',
    layer_norm_eps: 1e-5,
  },
  scheduler: {
    _class_name: 'DDIMScheduler',
    prediction_type: 'epsilon',
    beta_schedule: 'scaled_linear',
    beta_start: 0.00085,
    beta_end: 0.012,
    num_train_timesteps: 1000,
  },
} as const;

/** The resolution the demo model trains and samples at by default. */
export const DEMO_RESOLUTION = 32;

/**
 * GPT-2/CLIP byte-level alphabet: the 256 bytes as printable characters (printable Latin-1 bytes map to
 * themselves, the rest to U+0100 onwards), the base vocabulary of every CLIP BPE tokenizer.
 */
export function byteAlphabet(): string[] {
  const bs: number[] = [];
  for (let b = 33; b <= 126; b++) bs.push(b);
  for (let b = 161; b <= 172; b++) bs.push(b);
  for (let b = 174; b <= 255; b++) bs.push(b);
  const cs = [...bs];
  let extra = 0;
  for (let b = 0; b < 256; b++) if (!bs.includes(b)) cs.push(256 + extra++);
  return cs.map((c) => String.fromCharCode(c));
}

/**
 * A CLIP tokenizer with no merges: every byte is a token, and a byte that ends a word its "</w>" form
 * (512 tokens), then <|startoftext|> and <|endoftext|>. Any prompt tokenizes (one token per character).
 */
export function byteTokenizer(): { vocab: Record<string, number>; merges: string } {
  const bytes = byteAlphabet();
  const tokens = [...bytes, ...bytes.map((t) => `${t}</w>`), '<|startoftext|>', '<|endoftext|>'];
  const vocab: Record<string, number> = {};
  tokens.forEach((t, i) => (vocab[t] = i));
  return { vocab, merges: '#version: 0.2\n' };
}

/**
 * CLIP's BPE tokenizer (vocab.json + merges.txt) from its merge list (bpe_simple_vocab_16e6.txt, one merge
 * per line after a header): the 256 byte tokens, their "</w>" forms, one token per merge in order (each merge's
 * result is the next id), then <|startoftext|> and <|endoftext|>; `size` 49408 is CLIP's own, a smaller one
 * keeps the first merges (a tokenizer for a tiny text encoder).
 */
export function clipTokenizerFromBpe(bpeText: string, size = 49408): { vocab: Record<string, number>; merges: string } {
  const merges = bpeText.split('\n').slice(1, 1 + size - 512 - 2);
  if (merges.length !== size - 514 || merges.some((m) => m.split(' ').length !== 2))
    throw new Error(`the BPE merge list has ${merges.length} usable merges; a ${size}-token CLIP tokenizer needs ${size - 514}`);
  const bytes = byteAlphabet();
  const tokens = [...bytes, ...bytes.map((t) => `${t}</w>`), ...merges.map((m) => m.split(' ').join('')), '<|startoftext|>', '<|endoftext|>'];
  const vocab: Record<string, number> = {};
  tokens.forEach((t, i) => (vocab[t] = i));
  return { vocab, merges: `#version: 0.2\n${merges.join('\n')}\n` };
}

function initTensor(name: string, shape: number[], rng: Rng): NamedTensor {
  const n = shape.reduce((a, b) => a * b, 1);
  let data: Float32Array;
  if (shape.length === 1) data = name.endsWith('.weight') ? new Float32Array(n).fill(1) : new Float32Array(n);
  else {
    const embedding = name.includes('embedding');
    const fanIn = shape.slice(1).reduce((a, b) => a * b, 1);
    const std = embedding ? 0.02 : 1 / Math.sqrt(fanIn);
    data = rng.normals(n);
    for (let i = 0; i < n; i++) data[i] *= std;
  }
  return { shape, data };
}

/** Every tensor of `params` initialised as the file comment says, in order, from `rng`. */
export function initWeights(params: ParamShapes, rng: Rng): Map<string, NamedTensor> {
  const out = new Map<string, NamedTensor>();
  for (const [name, shape] of params) out.set(name, initTensor(name, shape, rng));
  return out;
}

/** A diffusers model folder's configs (config.json of each component, as diffusers writes them). */
export interface DiffusersConfigs {
  unet: Record<string, unknown>;
  vae: Record<string, unknown>;
  text_encoder: Record<string, unknown>;
  scheduler: Record<string, unknown>;
}

/**
 * The files of a diffusers StableDiffusionPipeline folder (paths relative to it): model_index.json, each
 * component's config and safetensors (`dtype` F32 or F16), the scheduler config and a CLIP tokenizer.
 */
export function diffusersModelFiles(
  configs: DiffusersConfigs,
  weights: { unet: Map<string, NamedTensor>; vae: Map<string, NamedTensor>; text_encoder: Map<string, NamedTensor> },
  tokenizer: { vocab: Record<string, number>; merges: string },
  meta: Record<string, string>,
  dtype: 'F32' | 'F16' = 'F32',
): Map<string, Uint8Array> {
  const enc = new TextEncoder();
  const json = (o: unknown) => enc.encode(JSON.stringify(o, null, 2));
  const typed = (m: Map<string, NamedTensor>) => new Map([...m].map(([n, t]) => [n, { ...t, dtype }]));
  const files = new Map<string, Uint8Array>();
  files.set(
    'model_index.json',
    json({
      _class_name: 'StableDiffusionPipeline',
      _diffusers_version: '0.30.0',
      unet: ['diffusers', 'UNet2DConditionModel'],
      vae: ['diffusers', 'AutoencoderKL'],
      text_encoder: ['transformers', 'CLIPTextModel'],
      tokenizer: ['transformers', 'CLIPTokenizer'],
      scheduler: ['diffusers', 'DDIMScheduler'],
    }),
  );
  files.set('unet/config.json', json({ _class_name: 'UNet2DConditionModel', ...configs.unet }));
  files.set('vae/config.json', json({ _class_name: 'AutoencoderKL', ...configs.vae }));
  files.set('text_encoder/config.json', json({ architectures: ['CLIPTextModel'], model_type: 'clip_text_model', ...configs.text_encoder }));
  files.set('scheduler/scheduler_config.json', json(configs.scheduler));
  files.set('unet/diffusion_pytorch_model.safetensors', writeSafetensors(typed(weights.unet), meta));
  files.set('vae/diffusion_pytorch_model.safetensors', writeSafetensors(typed(weights.vae), meta));
  files.set('text_encoder/model.safetensors', writeSafetensors(typed(weights.text_encoder), meta));
  files.set('tokenizer/vocab.json', json(tokenizer.vocab));
  files.set('tokenizer/merges.txt', enc.encode(tokenizer.merges));
  files.set(
    'tokenizer/tokenizer_config.json',
    json({ model_max_length: 77, pad_token: '<|endoftext|>', bos_token: '<|startoftext|>', eos_token: '<|endoftext|>' }),
  );
  return files;
}

/** The demo model's files (diffusers layout, paths relative to the model folder). */
export function demoModelFiles(seed = 1): Map<string, Uint8Array> {
  const rng = new Rng(seed);
  const meta = { format: 'pt', generator: 'DreamBooth Studio demo model', seed: String(seed) };
  // The order of the draws (UNet, VAE, text encoder) is part of "same seed, same bytes".
  const unet = initWeights(unetParams(unetConfigFromJson(DEMO_CONFIGS.unet)), rng);
  const vae = initWeights(vaeParams(vaeConfigFromJson(DEMO_CONFIGS.vae)), rng);
  const textEncoder = initWeights(clipParams(clipConfigFromJson(DEMO_CONFIGS.text_encoder)), rng);
  return diffusersModelFiles(DEMO_CONFIGS, { unet, vae, text_encoder: textEncoder }, byteTokenizer(), meta);
}
