// The checks the loader makes before it reads a weight (src/models/check.ts), without a GPU: each bad
// config gets a message naming the file (or override) and the field, sizes that do not fit are refused
// at model level, a single file at non-SD widths asks for --config, and SD's real configs pass.
import assert from 'node:assert/strict';
import { cpSync, mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { SafetensorsFile } from '../../src/io/safetensors.ts';
import { NodeFileSource } from '../../src/io/source-node.ts';
import { analyseModel, checkModel } from '../../src/models/check.ts';
import { ModelError, type Component } from '../../src/models/detect.ts';
import { nodeFolder } from '../../src/models/folder-node.ts';
import { SD15 } from '../../src/models/shapes.ts';
import { openDiffusers, openSingleFile, tokenizerFilesFrom, type Json, type ModelSource, type SourceOptions } from '../../src/models/source.ts';
import { writeTinyModel } from '../fixtures/models/make-tiny.ts';

const dir = mkdtempSync(join(tmpdir(), 'dbs-check-'));
const tiny = writeTinyModel(dir);
let copies = 0;

/** A copy of the tiny diffusers folder with some config files edited (a function of the JSON) or replaced (text). */
function folderWith(edits: Partial<Record<Component | 'model_index' | 'tokenizer/vocab', ((j: Json) => Json) | string>>): string {
  const d = join(dir, `copy-${copies++}`);
  cpSync(tiny.folder, d, { recursive: true });
  for (const [k, edit] of Object.entries(edits)) {
    const p = join(d, k === 'model_index' ? 'model_index.json' : k.startsWith('tokenizer/') ? `${k}.json` : `${k}/config.json`);
    writeFileSync(p, typeof edit === 'string' ? edit : JSON.stringify(edit(JSON.parse(readFileSync(p, 'utf8')))));
  }
  return d;
}

/** checkModel on the folder (through the real source); resolves to the ModelError's message. */
async function refusal(path: string, o: SourceOptions = {}): Promise<string> {
  const src = await openDiffusers(nodeFolder(path), o);
  try {
    checkModel(src);
  } catch (e) {
    assert.ok(e instanceof ModelError, `a ModelError, not ${(e as Error).name}: ${(e as Error).message}`);
    return e.message;
  } finally {
    await src.close();
  }
  assert.fail('the model was accepted');
}

const set = (patch: Json) => (j: Json) => ({ ...j, ...patch });
const drop = (key: string) => (j: Json) => Object.fromEntries(Object.entries(j).filter(([k]) => k !== key));

/** A source of configs alone (no tensors): what the config checks make of real SD configs. */
function configsOnly(configs: Record<Component, Json>): ModelSource {
  return {
    name: 'configs',
    layout: 'diffusers',
    family: 'sd1',
    prediction: 'epsilon',
    predictionSource: 'test',
    configs,
    scheduler: {},
    shapes: () => new Map(),
    read: () => Promise.reject(new Error('no tensors')),
    close: async () => {},
  };
}

// As the hub ships them (runwayml/stable-diffusion-v1-5, stabilityai/stable-diffusion-2-1).
const SD15_UNET = {
  _class_name: 'UNet2DConditionModel',
  _diffusers_version: '0.6.0',
  act_fn: 'silu',
  attention_head_dim: 8,
  block_out_channels: [320, 640, 1280, 1280],
  center_input_sample: false,
  cross_attention_dim: 768,
  down_block_types: ['CrossAttnDownBlock2D', 'CrossAttnDownBlock2D', 'CrossAttnDownBlock2D', 'DownBlock2D'],
  downsample_padding: 1,
  flip_sin_to_cos: true,
  freq_shift: 0,
  in_channels: 4,
  layers_per_block: 2,
  mid_block_scale_factor: 1,
  norm_eps: 1e-5,
  norm_num_groups: 32,
  out_channels: 4,
  sample_size: 64,
  up_block_types: ['UpBlock2D', 'CrossAttnUpBlock2D', 'CrossAttnUpBlock2D', 'CrossAttnUpBlock2D'],
};
const SD21_UNET = {
  ...SD15_UNET,
  attention_head_dim: [5, 10, 20, 20],
  cross_attention_dim: 1024,
  dual_cross_attention: false,
  num_class_embeds: null,
  only_cross_attention: false,
  sample_size: 96,
  upcast_attention: true,
  use_linear_projection: true,
};
// Every field a recent diffusers writes when it re-saves an SD UNet, at the values it writes.
const RESAVED_UNET = {
  ...SD21_UNET,
  addition_embed_type: null,
  addition_embed_type_num_heads: 64,
  addition_time_embed_dim: null,
  attention_type: 'default',
  class_embed_type: null,
  class_embeddings_concat: false,
  conv_in_kernel: 3,
  conv_out_kernel: 3,
  cross_attention_norm: null,
  dropout: 0.0,
  encoder_hid_dim: null,
  encoder_hid_dim_type: null,
  mid_block_only_cross_attention: null,
  mid_block_type: 'UNetMidBlock2DCrossAttn',
  num_attention_heads: null,
  projection_class_embeddings_input_dim: null,
  resnet_out_scale_factor: 1.0,
  resnet_skip_time_act: false,
  resnet_time_scale_shift: 'default',
  reverse_transformer_layers_per_block: null,
  time_cond_proj_dim: null,
  time_embedding_act_fn: null,
  time_embedding_dim: null,
  time_embedding_type: 'positional',
  timestep_post_act: null,
  transformer_layers_per_block: 1,
};
const SD_VAE = {
  _class_name: 'AutoencoderKL',
  act_fn: 'silu',
  block_out_channels: [128, 256, 512, 512],
  down_block_types: Array(4).fill('DownEncoderBlock2D'),
  in_channels: 3,
  latent_channels: 4,
  layers_per_block: 2,
  norm_num_groups: 32,
  out_channels: 3,
  sample_size: 512,
  up_block_types: Array(4).fill('UpDecoderBlock2D'),
  force_upcast: true,
  latents_mean: null,
  latents_std: null,
  mid_block_add_attention: true,
  scaling_factor: 0.18215,
  shift_factor: null,
  use_post_quant_conv: true,
  use_quant_conv: true,
};
const SD15_TEXT = {
  architectures: ['CLIPTextModel'],
  attention_dropout: 0.0,
  bos_token_id: 0,
  dropout: 0.0,
  eos_token_id: 2,
  hidden_act: 'quick_gelu',
  hidden_size: 768,
  initializer_factor: 1.0,
  initializer_range: 0.02,
  intermediate_size: 3072,
  layer_norm_eps: 1e-5,
  max_position_embeddings: 77,
  model_type: 'clip_text_model',
  num_attention_heads: 12,
  num_hidden_layers: 12,
  pad_token_id: 1,
  projection_dim: 768,
  torch_dtype: 'float32',
  vocab_size: 49408,
};
const SD21_TEXT = {
  ...SD15_TEXT,
  hidden_act: 'gelu',
  hidden_size: 1024,
  intermediate_size: 4096,
  num_attention_heads: 16,
  num_hidden_layers: 23,
  projection_dim: 512,
};

describe('SD configs as shipped pass every config check', () => {
  it('SD 1.5, SD 2.1, and SD 2.1 as a recent diffusers re-saves it', () => {
    const sd15 = analyseModel(configsOnly({ unet: SD15_UNET, vae: SD_VAE, text_encoder: SD15_TEXT }));
    assert.deepEqual(sd15.problems, []);
    assert.deepEqual(sd15.configs, { unet: SD15.unet, vae: SD15.vae, textEncoder: SD15.textEncoder });
    for (const unet of [SD21_UNET, RESAVED_UNET]) assert.deepEqual(analyseModel(configsOnly({ unet, vae: SD_VAE, text_encoder: SD21_TEXT })).problems, []);
    // With no tensors at all, what is left is the tensor check: every parameter missing.
    assert.equal(sd15.tensors.unet!.missing.length, 686);
  });
});

describe('config files that are no JSON object name the file', () => {
  it('invalid JSON in a component config, model_index.json and a tokenizer file', async () => {
    await assert.rejects(
      openDiffusers(nodeFolder(folderWith({ unet: '{"block_out_channels": [16, 32],, }' }))),
      (e: Error) => e instanceof ModelError && /^copy-\d+: unet\/config\.json: invalid JSON \(.+\)$/.test(e.message),
    );
    await assert.rejects(openDiffusers(nodeFolder(folderWith({ model_index: '{"_class_name": ' }))), /: model_index\.json: invalid JSON \(/);
    await assert.rejects(tokenizerFilesFrom(nodeFolder(folderWith({ 'tokenizer/vocab': '{"a": 1' }))), /: tokenizer\/vocab\.json: invalid JSON \(/);
  });

  it('a config holding an array or null', async () => {
    await assert.rejects(openDiffusers(nodeFolder(folderWith({ vae: '[8, 16]' }))), /: vae\/config\.json: not a JSON object \(it holds an array\)/);
    await assert.rejects(openDiffusers(nodeFolder(folderWith({ text_encoder: 'null' }))), /: text_encoder\/config\.json: not a JSON object \(it holds null\)/);
  });
});

describe('a null, missing or mistyped field names the field and where its value came from', () => {
  it('in the config files', async () => {
    assert.match(
      await refusal(folderWith({ unet: set({ attention_head_dim: null }) })),
      /^copy-\d+: unet\/config\.json: attention_head_dim is null: expected a positive integer or a list of them, one per block/,
    );
    assert.match(
      await refusal(folderWith({ text_encoder: drop('vocab_size') })),
      /: text_encoder\/config\.json: vocab_size is missing: expected a positive integer$/,
    );
    assert.match(
      await refusal(folderWith({ unet: set({ layers_per_block: '1' }) })),
      /: unet\/config\.json: layers_per_block is "1": expected a positive integer/,
    );
    assert.match(await refusal(folderWith({ vae: set({ latent_channels: 0 }) })), /: vae\/config\.json: latent_channels is 0: expected a positive integer$/);
    assert.match(
      await refusal(folderWith({ vae: set({ block_out_channels: [8, -16] }) })),
      /: vae\/config\.json: block_out_channels is \[8,-16\]: expected a list of positive integers/,
    );
    // At the tiny widths hidden_act tells the family; given the family, the field itself is refused.
    assert.match(
      await refusal(folderWith({ text_encoder: set({ hidden_act: 'gelu_new' }) }), { family: 'sd1' }),
      /: text_encoder\/config\.json: hidden_act is "gelu_new": expected 'quick_gelu' \(SD1's CLIP\) or 'gelu'/,
    );
    assert.match(
      await refusal(folderWith({ unet: set({ down_block_types: ['SimpleCrossAttnDownBlock2D', 'DownBlock2D'] }) })),
      /: unet\/config\.json: down_block_types is \["SimpleCrossAttnDownBlock2D","DownBlock2D"\]: expected a list of 'CrossAttnDownBlock2D' or 'DownBlock2D'/,
    );
  });

  it('in an override (--config), which is named instead of the file', async () => {
    const msg = await refusal(tiny.folder, { overrides: { unet: { norm_num_groups: null } } });
    assert.match(msg, /^tiny-sd1-diffusers: the unet config override \(--config\): norm_num_groups is null: expected a positive integer$/);
  });
});

describe('settings the engine does not implement are refused by name', () => {
  for (const [c, patch, re] of [
    ['unet', { act_fn: 'mish' }, /unet\/config\.json: act_fn is "mish": the engine implements SD 1\.x\/2\.x's "silu" only/],
    [
      'unet',
      { transformer_layers_per_block: [1, 2] },
      /unet\/config\.json: transformer_layers_per_block is \[1,2\]: the engine implements SD 1\.x\/2\.x's 1 \(one transformer block per attention\) only/,
    ],
    ['unet', { num_attention_heads: 2 }, /unet\/config\.json: num_attention_heads is 2: .*null \(SD head counts go in attention_head_dim\)/],
    ['unet', { flip_sin_to_cos: false }, /unet\/config\.json: flip_sin_to_cos is false/],
    ['unet', { norm_eps: 1e-6 }, /unet\/config\.json: norm_eps is 0\.000001: .*1e-5 only/],
    ['vae', { shift_factor: 0.1159 }, /vae\/config\.json: shift_factor is 0\.1159: the engine implements SD 1\.x\/2\.x's null only/],
  ] as const)
    it(`${c} ${Object.keys(patch)[0]}`, async () => assert.match(await refusal(folderWith({ [c]: set(patch) })), re));
});

describe('sizes that do not fit are refused at model level, before any GPU work', () => {
  it('heads that do not divide a width', async () => {
    assert.match(
      await refusal(folderWith({ text_encoder: set({ num_attention_heads: 12 }) })),
      /^copy-\d+: text_encoder: hidden_size 32 is not divisible by num_attention_heads 12 \(text_encoder\/config\.json\): fix the config or pass --config with the model's text_encoder config$/,
    );
    assert.match(
      await refusal(folderWith({ unet: set({ attention_head_dim: 3 }) })),
      /: unet: block_out_channels\[0\] 16 is not divisible by attention_head_dim\[0\] 3 \(unet\/config\.json\)/,
    );
    // Block 1 has no attention in the tiny UNet's down path but the mid block uses heads[1].
    assert.match(
      await refusal(folderWith({ unet: set({ attention_head_dim: [2, 5] }) })),
      /: unet: block_out_channels\[1\] 32 is not divisible by attention_head_dim\[1\] 5/,
    );
    assert.match(
      await refusal(folderWith({ unet: set({ attention_head_dim: [2, 2, 2] }) })),
      /: unet: attention_head_dim has 3 entries but block_out_channels has 2 \(unet\/config\.json\)/,
    );
    // An override and the file together: both are named.
    assert.match(
      await refusal(tiny.folder, { overrides: { text_encoder: { num_attention_heads: 5 } } }),
      /hidden_size 32 is not divisible by num_attention_heads 5 \(text_encoder\/config\.json and the text_encoder config override \(--config\)\)/,
    );
  });

  it('heads wider than the attention kernel takes', () => {
    const a = analyseModel(configsOnly({ unet: SD15_UNET, vae: SD_VAE, text_encoder: { ...SD15_TEXT, num_attention_heads: 2 } }));
    assert.deepEqual(a.problems, [
      "text_encoder: hidden_size 768 over num_attention_heads 2 makes 384-wide heads; the engine's attention takes at most 256 (the text_encoder config)",
    ]);
  });

  it('norm groups that do not divide every normalised width', async () => {
    assert.match(
      await refusal(folderWith({ unet: set({ norm_num_groups: 5 }) })),
      /: unet: norm_num_groups 5 does not divide the 16 channels of down_blocks\.0\.resnets\.0\.norm1 \(unet\/config\.json\): fix the config/,
    );
    assert.match(
      await refusal(folderWith({ vae: set({ norm_num_groups: 3 }) })),
      /: vae: norm_num_groups 3 does not divide the 8 channels of encoder\.down_blocks\.0\.resnets\.0\.norm1/,
    );
  });

  it('a text encoder too short for a prompt, and a UNet expecting another text width', () => {
    const short = analyseModel(configsOnly({ unet: SD15_UNET, vae: SD_VAE, text_encoder: { ...SD15_TEXT, max_position_embeddings: 64 } }));
    assert.match(short.problems.join('\n'), /text_encoder: max_position_embeddings 64 is fewer than the 77 tokens of an SD prompt/);
    const mixed = analyseModel(configsOnly({ unet: SD15_UNET, vae: SD_VAE, text_encoder: SD21_TEXT }));
    assert.deepEqual(mixed.problems, [
      'the UNet expects 768-wide text embeddings (unet cross_attention_dim) but the text encoder is 1024 wide (text_encoder hidden_size): mixed or corrupt model',
    ]);
  });
});

describe("a single file at widths other than SD's needs the configs its shapes cannot tell", () => {
  const open = async (o: SourceOptions) => openSingleFile(await SafetensorsFile.open(await NodeFileSource.open(tiny.singleFile)), { family: 'sd1', ...o });

  it('names each component, the fields it needs and --config', async () => {
    const src = await open({});
    assert.throws(
      () => checkModel(src),
      (e: Error) =>
        e instanceof ModelError &&
        e.message.startsWith('tiny-sd1.safetensors: a single file holds no configs') &&
        e.message.includes(
          "unet (block_out_channels [16,32]; SD's are [320,640,1280,1280]) needs attention_head_dim, norm_num_groups; vae (block_out_channels [8,16]; SD's are [128,256,512,512]) needs norm_num_groups; text_encoder (hidden_size 32; SD1's is 768) needs num_attention_heads: pass --config",
        ),
    );
    await src.close();
  });

  it("asks only for what the overrides leave out, and loads the folder's configs once given all", async () => {
    const part = await open({ overrides: { unet: tiny.overrides.unet } });
    assert.throws(
      () => checkModel(part),
      (e: Error) => !e.message.includes('unet (') && e.message.includes('vae (') && e.message.includes('text_encoder ('),
    );
    await part.close();
    const full = await open({ overrides: tiny.overrides });
    const folder = await openDiffusers(nodeFolder(tiny.folder));
    assert.deepEqual(checkModel(full), checkModel(folder));
    await full.close();
    await folder.close();
  });
});
