// Architecture detection from names and shapes: SD1 and SD2 single files (fp16/fp32 alike, EMA keys
// ignored), diffusers configs, and a specific refusal for SDXL, LoRAs, mixed files and non-models.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { detectDiffusers, detectSingleFile, ModelError, type ShapeMap } from '../../src/models/detect.ts';

function sdSingleFile(family: 'sd1' | 'sd2', extra: [string, number[]][] = []): ShapeMap {
  const ctx = family === 'sd1' ? 768 : 1024;
  const m: ShapeMap = new Map<string, readonly number[]>([
    ['model.diffusion_model.input_blocks.0.0.weight', [320, 4, 3, 3]],
    ['model.diffusion_model.input_blocks.0.0.bias', [320]],
    ['model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight', [320, ctx]],
    ['first_stage_model.encoder.conv_in.weight', [128, 3, 3, 3]],
    ['model_ema.decay', []],
    ['model_ema.diffusion_modelinput_blocks00weight', [320, 4, 3, 3]],
  ]);
  if (family === 'sd1') m.set('cond_stage_model.transformer.text_model.embeddings.token_embedding.weight', [49408, 768]);
  else m.set('cond_stage_model.model.token_embedding.weight', [49408, 1024]);
  for (const [k, v] of extra) m.set(k, v);
  return m;
}

describe('model detection', () => {
  it('SD1 single file: family, epsilon, parameters per component, EMA ignored', () => {
    const d = detectSingleFile(sdSingleFile('sd1'));
    assert.equal(d.family, 'sd1');
    assert.equal(d.prediction, 'epsilon');
    assert.equal(d.contextDim, 768);
    assert.deepEqual(d.components.unet, { tensors: 3, parameters: 320 * 36 + 320 + 320 * 768 });
    assert.deepEqual(d.components.text_encoder, { tensors: 1, parameters: 49408 * 768 });
    assert.deepEqual(d.ignored, { ema: 2, other: 0 });
  });

  it('SD2 single file: v-prediction by default, epsilon when the scheduler config says so', () => {
    const d = detectSingleFile(sdSingleFile('sd2'));
    assert.equal(d.family, 'sd2');
    assert.equal(d.prediction, 'v_prediction');
    assert.match(d.predictionSource, /default/);
    const e = detectSingleFile(sdSingleFile('sd2'), 'x', { prediction_type: 'epsilon' });
    assert.equal(e.prediction, 'epsilon');
    assert.equal(e.predictionSource, 'scheduler config');
  });

  it('refuses SDXL, LoRAs, mixed text encoders and files that are no model, each with its own message', () => {
    const xl = new Map<string, readonly number[]>([
      ['conditioner.embedders.0.transformer.text_model.final_layer_norm.weight', [768]],
      ['model.diffusion_model.input_blocks.0.0.weight', [320, 4, 3, 3]],
    ]);
    assert.throws(
      () => detectSingleFile(xl, 'sdxl.safetensors'),
      (e: Error) => e instanceof ModelError && /sdxl\.safetensors is an SDXL checkpoint: SDXL is not supported yet/.test(e.message),
    );
    const lora = new Map<string, readonly number[]>([['lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight', [4, 320]]]);
    assert.throws(() => detectSingleFile(lora, 'x.safetensors'), /is a LoRA, not a base model/);
    const mixed = sdSingleFile('sd1', [['cond_stage_model.model.token_embedding.weight', [49408, 1024]]]);
    assert.throws(() => detectSingleFile(mixed), /mixed or corrupt checkpoint/);
    const other = new Map<string, readonly number[]>([['encoder.layer.0.weight', [10, 10]]]);
    assert.throws(
      () => detectSingleFile(other, 'bert.safetensors'),
      /bert\.safetensors is not a Stable Diffusion checkpoint: it has no model\.diffusion_model/,
    );
    assert.throws(() => detectSingleFile(new Map(), 'empty.safetensors'), /holds no tensors/);
    const inpaint = sdSingleFile('sd1', [['model.diffusion_model.input_blocks.0.0.weight', [320, 9, 3, 3]]]);
    assert.throws(() => detectSingleFile(inpaint), /expected \[C,4,3,3\]/);
  });

  it('diffusers folders from their configs', () => {
    const counts = { unet: { tensors: 1, parameters: 1 }, vae: { tensors: 1, parameters: 1 }, text_encoder: { tensors: 1, parameters: 1 } };
    const sd2 = detectDiffusers(
      {
        modelIndex: { _class_name: 'StableDiffusionPipeline' },
        unet: { cross_attention_dim: 1024, in_channels: 4 },
        scheduler: { prediction_type: 'epsilon' },
      },
      counts,
    );
    assert.deepEqual([sd2.family, sd2.prediction, sd2.layout], ['sd2', 'epsilon', 'diffusers']);
    assert.throws(
      () => detectDiffusers({ modelIndex: { _class_name: 'StableDiffusionXLPipeline' }, unet: { cross_attention_dim: 2048 } }, counts),
      /StableDiffusionXLPipeline model: not supported yet/,
    );
    assert.throws(() => detectDiffusers({ unet: { cross_attention_dim: 2048, addition_embed_type: 'text_time' } }, counts), /SDXL model/);
    assert.throws(() => detectDiffusers({}, counts, 'my-folder'), /my-folder is not a diffusers Stable Diffusion folder: unet\/config\.json is missing/);
  });
});
