// The studio's demo model: a small Stable-Diffusion-1-shaped model the project generates itself, in the
// real diffusers layout (model_index.json, unet/ vae/ text_encoder/ with config.json and safetensors,
// scheduler/, tokenizer/), so a newcomer runs the whole flow (load, train, sample, export) in seconds with
// no download. Same seed, same bytes. Its weights are random: samples look like coloured noise that
// training visibly pulls toward the photos; it is a tour of the product, not an image model.
//
// Initialisation (what makes a random SD stack numerically tame): every matrix and conv kernel
// N(0, 1/fan_in) (LeCun), so each layer roughly preserves activation variance; norm scales 1, biases 0;
// embeddings N(0, 0.02^2) as CLIP does.
import { writeSafetensors, type NamedTensor } from '../io/safetensors.ts';
import { clipParams, unetParams, vaeParams, type ParamShapes } from './shapes.ts';
import { clipConfigFromJson } from '../nn/clip.ts';
import { unetConfigFromJson } from '../nn/unet.ts';
import { vaeConfigFromJson } from '../nn/vae.ts';
import { Rng } from '../util/rng.ts';

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

function initWeights(params: ParamShapes, rng: Rng): Map<string, NamedTensor> {
  const out = new Map<string, NamedTensor>();
  for (const [name, shape] of params) out.set(name, initTensor(name, shape, rng));
  return out;
}

/** The demo model's files (diffusers layout, paths relative to the model folder). */
export function demoModelFiles(seed = 1): Map<string, Uint8Array> {
  const rng = new Rng(seed);
  const enc = new TextEncoder();
  const json = (o: unknown) => enc.encode(JSON.stringify(o, null, 2));
  const tok = byteTokenizer();
  const files = new Map<string, Uint8Array>();
  const meta = { format: 'pt', generator: 'DreamBooth Studio demo model', seed: String(seed) };
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
  files.set('unet/config.json', json({ _class_name: 'UNet2DConditionModel', ...DEMO_CONFIGS.unet }));
  files.set('vae/config.json', json({ _class_name: 'AutoencoderKL', ...DEMO_CONFIGS.vae }));
  files.set('text_encoder/config.json', json({ architectures: ['CLIPTextModel'], model_type: 'clip_text_model', ...DEMO_CONFIGS.text_encoder }));
  files.set('scheduler/scheduler_config.json', json(DEMO_CONFIGS.scheduler));
  files.set('unet/diffusion_pytorch_model.safetensors', writeSafetensors(initWeights(unetParams(unetConfigFromJson(DEMO_CONFIGS.unet)), rng), meta));
  files.set('vae/diffusion_pytorch_model.safetensors', writeSafetensors(initWeights(vaeParams(vaeConfigFromJson(DEMO_CONFIGS.vae)), rng), meta));
  files.set('text_encoder/model.safetensors', writeSafetensors(initWeights(clipParams(clipConfigFromJson(DEMO_CONFIGS.text_encoder)), rng), meta));
  files.set('tokenizer/vocab.json', json(tok.vocab));
  files.set('tokenizer/merges.txt', enc.encode(tok.merges));
  files.set(
    'tokenizer/tokenizer_config.json',
    json({ model_max_length: 77, pad_token: '<|endoftext|>', bos_token: '<|startoftext|>', eos_token: '<|endoftext|>' }),
  );
  return files;
}
