// `npm run cli -- inspect` on tiny files in the real formats: a single-file SD1 checkpoint, a diffusers
// SD2 folder, and the refusals (pickle, SDXL, not a model) as the CLI prints them.
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdirSync, mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { describe, it } from 'node:test';
import { fileURLToPath } from 'node:url';
import { writeSafetensors } from '../../src/io/safetensors.ts';

const root = join(dirname(fileURLToPath(import.meta.url)), '..', '..');
const dir = mkdtempSync(join(tmpdir(), 'dbs-inspect-'));

function st(path: string, tensors: [string, number[]][]): void {
  mkdirSync(dirname(path), { recursive: true });
  writeFileSync(path, writeSafetensors(new Map(tensors.map(([n, shape]) => [n, { shape, data: new Float32Array(shape.reduce((a, b) => a * b, 1)), dtype: 'F16' as const }]))));
}

function cli(...args: string[]): { code: number; out: string; err: string } {
  try {
    const out = execFileSync(process.execPath, ['--import', 'tsx', join(root, 'src/cli/main.ts'), ...args], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });
    return { code: 0, out, err: '' };
  } catch (e) {
    const x = e as { status: number; stdout: string; stderr: string };
    return { code: x.status, out: x.stdout, err: x.stderr };
  }
}

describe('cli inspect', () => {
  it('a single-file SD1 checkpoint', () => {
    const path = join(dir, 'sd1.safetensors');
    st(path, [
      ['model.diffusion_model.input_blocks.0.0.weight', [8, 4, 3, 3]],
      ['model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight', [8, 768]],
      ['first_stage_model.encoder.conv_in.weight', [4, 3, 3, 3]],
      ['cond_stage_model.transformer.text_model.embeddings.token_embedding.weight', [10, 768]],
      ['model_ema.decay', [1]],
    ]);
    const r = cli('inspect', path);
    assert.equal(r.code, 0, r.err);
    const j = JSON.parse(r.out);
    assert.equal(j.architecture, 'sd1');
    assert.equal(j.predictionType, 'epsilon');
    assert.equal(j.tensorCount, 5);
    assert.deepEqual(j.parameters, { unet: 8 * 36 + 8 * 768, vae: 108, text_encoder: 7680 });
  });

  it('a diffusers SD2 folder with an epsilon scheduler', () => {
    const d = join(dir, 'sd2-base');
    mkdirSync(join(d, 'unet'), { recursive: true });
    mkdirSync(join(d, 'scheduler'), { recursive: true });
    writeFileSync(join(d, 'model_index.json'), JSON.stringify({ _class_name: 'StableDiffusionPipeline' }));
    writeFileSync(join(d, 'unet', 'config.json'), JSON.stringify({ cross_attention_dim: 1024, in_channels: 4 }));
    writeFileSync(join(d, 'scheduler', 'scheduler_config.json'), JSON.stringify({ prediction_type: 'epsilon' }));
    mkdirSync(join(d, 'vae'), { recursive: true });
    mkdirSync(join(d, 'text_encoder'), { recursive: true });
    writeFileSync(join(d, 'vae', 'config.json'), JSON.stringify({ block_out_channels: [4] }));
    writeFileSync(join(d, 'text_encoder', 'config.json'), JSON.stringify({ hidden_size: 1024, hidden_act: 'gelu' }));
    st(join(d, 'unet', 'diffusion_pytorch_model.fp16.safetensors'), [['conv_in.weight', [8, 4, 3, 3]]]);
    st(join(d, 'vae', 'diffusion_pytorch_model.safetensors'), [['encoder.conv_in.weight', [4, 3, 3, 3]]]);
    st(join(d, 'text_encoder', 'model.safetensors'), [['text_model.embeddings.token_embedding.weight', [10, 1024]]]);
    const r = cli('inspect', d);
    assert.equal(r.code, 0, r.err);
    const j = JSON.parse(r.out);
    assert.deepEqual([j.architecture, j.predictionType, j.layout, j.tensorCount], ['sd2', 'epsilon', 'diffusers', 3]);
  });

  it('refusals exit 1 with their message', () => {
    const ckpt = join(dir, 'model.ckpt');
    writeFileSync(ckpt, Buffer.from([0x50, 0x4b, 0x03, 0x04, ...new Array(60).fill(0)]));
    assert.match(cli('inspect', ckpt).err, /model\.ckpt: this is a PyTorch pickle checkpoint/);
    const xl = join(dir, 'xl.safetensors');
    st(xl, [['conditioner.embedders.0.transformer.text_model.final_layer_norm.weight', [4]]]);
    const r = cli('inspect', xl);
    assert.equal(r.code, 1);
    assert.match(r.err, /xl\.safetensors is an SDXL checkpoint/);
    assert.match(cli('inspect', join(dir, 'nope.safetensors')).err, /no such file or folder/);
  });
});
