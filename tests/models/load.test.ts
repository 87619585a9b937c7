// Both layouts of the same tiny model load to the same engine weights: the UNet, VAE decoder and text
// encoder give bit-identical outputs from the diffusers folder and from the single-file checkpoint, and
// both equal the PyTorch goldens (f32 tolerances as in the module tests).
import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { describe, it } from 'node:test';
import { readSafetensors, SafetensorsFile } from '../../src/io/safetensors.ts';
import { NodeFileSource } from '../../src/io/source-node.ts';
import { loadDiffusers, loadSingleFile, type LoadedModel } from '../../src/models/load.ts';
import { ModelError } from '../../src/models/detect.ts';
import { writeSafetensors } from '../../src/io/safetensors.ts';
import { writeFileSync } from 'node:fs';
import { nodeFolder } from '../../src/models/folder-node.ts';
import { clipTextForward } from '../../src/nn/clip.ts';
import { unetForward } from '../../src/nn/unet.ts';
import { vaeDecode } from '../../src/nn/vae.ts';
import { compare } from '../../src/selftest/check.ts';
import { writeTinyModel } from '../fixtures/models/make-tiny.ts';
import { assertChecks, FIXTURES, testGpu } from '../helpers.ts';

const dir = mkdtempSync(join(tmpdir(), 'dbs-tiny-'));
const tiny = writeTinyModel(dir);
const folder = nodeFolder;
const fixture = (n: string) => readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'modules', `${n}.safetensors`)))).tensors;

async function outputs(model: LoadedModel) {
  const gpu = await testGpu();
  const u = fixture('unet_sd1');
  const up = (t: { data: Float32Array; shape: number[] }, d: 'f32' = 'f32') => gpu.upload(t.data, t.shape, d);
  const unet = unetForward(gpu, model.unet.config, model.unet.weights, up(u.get('sample')!), up(u.get('timestep')!), up(u.get('encoder_hidden_states')!));
  const v = fixture('vae');
  const image = vaeDecode(gpu, model.vae.config, model.vae.weights, up(v.get('latents')!));
  const c = fixture('clip_sd1');
  const ids = c.get('input_ids')!;
  const text = clipTextForward(gpu, model.textEncoder.config, model.textEncoder.weights, ids.data, ids.shape[0]);
  return { unet: await gpu.read(unet), image: await gpu.read(image), text: await gpu.read(text), golden: { unet: u.get('out')!.data, image: v.get('decoded')!.data, text: c.get('last_hidden_state')!.data } };
}

describe('loading both layouts of a tiny SD1 model', () => {
  it('diffusers folder and single file give identical outputs, equal to PyTorch', async () => {
    const gpu = await testGpu();
    const fromFolder = await loadDiffusers(gpu, folder(tiny.folder), { dtype: 'f32' });
    const file = await SafetensorsFile.open(await NodeFileSource.open(tiny.singleFile));
    const fromSingle = await loadSingleFile(gpu, file, { dtype: 'f32', family: 'sd1', overrides: tiny.overrides });
    await file.source.close?.();
    assert.equal(fromSingle.unet.weights.size, fromFolder.unet.weights.size, 'same UNet tensor set');
    assert.equal(fromSingle.vae.weights.size, fromFolder.vae.weights.size, 'same VAE tensor set');
    assert.equal(fromSingle.textEncoder.weights.size, fromFolder.textEncoder.weights.size, 'same text-encoder tensor set');
    assert.deepEqual([...fromSingle.unet.weights.keys()].sort(), [...fromFolder.unet.weights.keys()].sort());
    assert.deepEqual(fromSingle.unet.config, fromFolder.unet.config, 'inferred UNet config equals the diffusers config');
    const a = await outputs(fromFolder);
    const b = await outputs(fromSingle);
    const exact = { atol: 0, rtol: 0 };
    assertChecks([
      compare('unet: single file = folder', b.unet, a.unet, exact),
      compare('vae decode: single file = folder', b.image, a.image, exact),
      compare('text encoder: single file = folder', b.text, a.text, exact),
      compare('unet vs torch', a.unet, a.golden.unet, { atol: 5e-4, rtol: 2e-4 }),
      compare('vae decode vs torch', a.image, a.golden.image, { atol: 2e-4, rtol: 1e-4 }),
      compare('text encoder vs torch', a.text, a.golden.text, { atol: 1e-4, rtol: 1e-4 }),
    ]);
  });
});

describe('loading refuses missing and misshaped tensors, naming them', () => {
  const rewrite = (drop: string | null, reshape: [string, number[]] | null) => {
    const f = readSafetensors(new Uint8Array(readFileSync(tiny.singleFile)));
    const m = new Map([...f.tensors].filter(([n]) => n !== drop).map(([n, t]) => [n, reshape && n === reshape[0] ? { shape: reshape[1], data: t.data.subarray(0, reshape[1].reduce((a, b) => a * b, 1)) } : t]));
    const p = join(dir, `bad-${drop ? 'missing' : 'shape'}.safetensors`);
    writeFileSync(p, writeSafetensors(m));
    return p;
  };
  const load = async (p: string) => {
    const file = await SafetensorsFile.open(await NodeFileSource.open(p));
    try {
      return await loadSingleFile(await testGpu(), file, { dtype: 'f32', family: 'sd1', overrides: tiny.overrides });
    } finally {
      await file.source.close?.();
    }
  };

  it('a missing tensor', async () => {
    const p = rewrite('model.diffusion_model.middle_block.1.proj_out.weight', null);
    await assert.rejects(load(p), (e: Error) => e instanceof ModelError && /bad-missing\.safetensors: unet is missing 1 tensor\(s\), e\.g\. mid_block\.attentions\.0\.proj_out\.weight/.test(e.message));
  });

  it('a misshaped tensor', async () => {
    const p = rewrite(null, ['first_stage_model.decoder.conv_out.bias', [2]]);
    await assert.rejects(load(p), (e: Error) => e instanceof ModelError && /vae tensor decoder\.conv_out\.bias is \[2\] but its config needs \[3\]/.test(e.message));
  });
});

describe('loading both layouts of a tiny SD2 model (OpenCLIP text encoder, linear projections)', () => {
  it('single file (fused q/k/v, an unused last block) and diffusers folder agree, and match PyTorch', async () => {
    const gpu = await testGpu();
    const t2 = writeTinyModel(mkdtempSync(join(tmpdir(), 'dbs-tiny2-')), 'sd2');
    const fromFolder = await loadDiffusers(gpu, folder(t2.folder), { dtype: 'f32' });
    const file = await SafetensorsFile.open(await NodeFileSource.open(t2.singleFile));
    const fromSingle = await loadSingleFile(gpu, file, { dtype: 'f32', overrides: t2.overrides });
    await file.source.close?.();
    assert.equal(fromSingle.family, 'sd2', 'detected from the OpenCLIP keys');
    assert.equal(fromSingle.prediction, 'v_prediction');
    assert.equal(fromSingle.textEncoder.config.layers, fromFolder.textEncoder.config.layers, 'the extra OpenCLIP block is dropped');
    assert.equal(fromSingle.textEncoder.config.act, 'gelu');
    assert.ok(fromSingle.unet.config.linearProjection);
    const c = fixture('clip_sd2');
    const ids = c.get('input_ids')!;
    const a = await gpu.read(clipTextForward(gpu, fromFolder.textEncoder.config, fromFolder.textEncoder.weights, ids.data, ids.shape[0]));
    const b = await gpu.read(clipTextForward(gpu, fromSingle.textEncoder.config, fromSingle.textEncoder.weights, ids.data, ids.shape[0]));
    const u = fixture('unet_sd2');
    const up = (t: { data: Float32Array; shape: number[] }) => gpu.upload(t.data, t.shape, 'f32');
    const ua = await gpu.read(unetForward(gpu, fromFolder.unet.config, fromFolder.unet.weights, up(u.get('sample')!), up(u.get('timestep')!), up(u.get('encoder_hidden_states')!)));
    const ub = await gpu.read(unetForward(gpu, fromSingle.unet.config, fromSingle.unet.weights, up(u.get('sample')!), up(u.get('timestep')!), up(u.get('encoder_hidden_states')!)));
    assertChecks([
      compare('text encoder: single file = folder', b, a, { atol: 0, rtol: 0 }),
      compare('text encoder vs torch', a, c.get('last_hidden_state')!.data, { atol: 1e-4, rtol: 1e-4 }),
      compare('unet: single file = folder', ub, ua, { atol: 0, rtol: 0 }),
      compare('unet vs torch', ua, u.get('out')!.data, { atol: 5e-4, rtol: 2e-4 }),
    ]);
  });
});
