// `npm run cli -- inspect` on tiny files in the real formats: a single-file SD1 checkpoint, a diffusers
// SD2 folder, and the refusals (pickle, SDXL, not a model) as the CLI prints them; and the problems
// inspect lists for a model the loader would refuse, from the loader's own checks.
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { cpSync, mkdirSync, mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { describe, it } from 'node:test';
import { readSafetensors, SafetensorsFile, writeSafetensors } from '../../src/io/safetensors.ts';
import { NodeFileSource } from '../../src/io/source-node.ts';
import { checkModel } from '../../src/models/check.ts';
import { nodeFolder } from '../../src/models/folder-node.ts';
import { inspectDiffusers, inspectSingleFile } from '../../src/models/inspect.ts';
import { vaeParams } from '../../src/models/shapes.ts';
import { openSingleFile } from '../../src/models/source.ts';
import { vaeConfigFromJson } from '../../src/nn/vae.ts';
import { writeTinyModel } from '../fixtures/models/make-tiny.ts';
import { cliArgs } from '../cli.ts';

const dir = mkdtempSync(join(tmpdir(), 'dbs-inspect-'));

function st(path: string, tensors: [string, number[]][]): void {
  mkdirSync(dirname(path), { recursive: true });
  writeFileSync(
    path,
    writeSafetensors(new Map(tensors.map(([n, shape]) => [n, { shape, data: new Float32Array(shape.reduce((a, b) => a * b, 1)), dtype: 'F16' as const }]))),
  );
}

function cli(...args: string[]): { code: number; out: string; err: string } {
  try {
    const out = execFileSync(process.execPath, cliArgs(...args), {
      encoding: 'utf8',
      stdio: ['ignore', 'pipe', 'pipe'],
    });
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
    // A handful of tensors: the report detects the model, and lists what the loader would refuse it for (exit 1).
    assert.equal(r.code, 1, r.err);
    assert.match(r.err, /the loader would refuse this model: (one problem|\d+ problems), listed under "problems"/);
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
    assert.equal(r.code, 1, r.err); // detected, with the problems of a partial model listed
    const j = JSON.parse(r.out);
    assert.ok(j.problems.length > 0);
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
    // inspect reads SDXL files (tests/models/cli-run-sdxl.test.ts); this one has a text encoder and no UNet.
    assert.match(r.err, /xl\.safetensors: SDXL checkpoint without its UNet input conv model\.diffusion_model\.input_blocks\.0\.0\.weight/);
    assert.match(cli('inspect', join(dir, 'nope.safetensors')).err, /no such file or folder/);
  });
});

describe('inspect lists what the loader would refuse', () => {
  const tiny = writeTinyModel(join(dir, 'tiny'));
  const single = async (p: string, overrides?: typeof tiny.overrides) => {
    const src = await NodeFileSource.open(p);
    try {
      return (await inspectSingleFile(src, undefined, overrides)).problems;
    } finally {
      await src.close();
    }
  };

  it('nothing for a sound model; a single file without its configs asks for them', async () => {
    assert.deepEqual((await inspectDiffusers(nodeFolder(tiny.folder))).problems, []);
    assert.deepEqual(await single(tiny.singleFile, tiny.overrides), []);
    const p = await single(tiny.singleFile);
    assert.equal(p.length, 1);
    assert.match(
      p[0],
      /^a single file holds no configs, .*unet .* needs attention_head_dim, norm_num_groups; vae .* needs norm_num_groups; text_encoder .* needs num_attention_heads: pass --config/,
    );
  });

  it('each missing and misshaped tensor, in the words the loader stops with', async () => {
    const f = readSafetensors(new Uint8Array(readFileSync(tiny.singleFile)));
    const bad = new Map([...f.tensors].filter(([n]) => n !== 'model.diffusion_model.middle_block.1.proj_out.weight'));
    bad.set('first_stage_model.decoder.conv_out.bias', { shape: [2], data: new Float32Array(2) });
    const p = join(dir, 'bad-tensors.safetensors');
    writeFileSync(p, writeSafetensors(bad));
    const problems = await single(p, tiny.overrides);
    assert.deepEqual(problems, [
      'unet tensor mid_block.attentions.0.proj_out.weight is missing',
      'vae tensor decoder.conv_out.bias is [2] but its config needs [3]',
    ]);
    // The loader's checks stop at the first component with a problem, in its summary words.
    const file = await SafetensorsFile.open(await NodeFileSource.open(p));
    const src = await openSingleFile(file, { overrides: tiny.overrides });
    assert.throws(() => checkModel(src), { message: 'bad-tensors.safetensors: unet is missing 1 tensor(s), e.g. mid_block.attentions.0.proj_out.weight' });
    await src.close();
  });

  it('config problems beside tensor problems, and at most 20 tensors of a kind then a count', async () => {
    const d = join(dir, 'no-vae');
    cpSync(tiny.folder, d, { recursive: true });
    const te = JSON.parse(readFileSync(join(d, 'text_encoder/config.json'), 'utf8'));
    writeFileSync(join(d, 'text_encoder/config.json'), JSON.stringify({ ...te, num_attention_heads: 12 }));
    const vae = readSafetensors(new Uint8Array(readFileSync(join(d, 'vae/diffusion_pytorch_model.safetensors')))).tensors;
    writeFileSync(
      join(d, 'vae/diffusion_pytorch_model.safetensors'),
      writeSafetensors(
        new Map([
          ['encoder.conv_in.weight', vae.get('encoder.conv_in.weight')!],
          ['extra.weight', { shape: [1], data: new Float32Array(1) }],
        ]),
      ),
    );
    const r = await inspectDiffusers(nodeFolder(d));
    assert.equal(r.family, 'sd1', 'detection still answers');
    const missing = vaeParams(vaeConfigFromJson(JSON.parse(readFileSync(join(d, 'vae/config.json'), 'utf8')))).size - 1;
    assert.ok(missing > 20);
    assert.equal(
      r.problems[0],
      "text_encoder: hidden_size 32 is not divisible by num_attention_heads 12 (text_encoder/config.json): fix the config or pass --config with the model's text_encoder config",
    );
    assert.equal(r.problems.filter((l) => / is missing$/.test(l)).length, 20);
    assert.ok(
      r.problems.every((l, i) => i === 0 || l.startsWith('vae ') || l.startsWith('...and ')),
      r.problems.join('\n'),
    );
    assert.ok(r.problems.includes(`...and ${missing - 20} more vae tensors missing (${missing} in all)`));
    assert.equal(r.problems.at(-1), 'vae tensor extra.weight is not used by its config');
  });
});
