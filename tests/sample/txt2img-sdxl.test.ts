// SDXL sampling: sdxlDenoise against a PyTorch loop (tests/fixtures/modules/gen_sdxl.py sampling(): 2 DDIM steps,
// guidance 5, zero negative half, time ids [16, 16, 0, 0, 16, 16]) on the tiny SDXL model loaded from its
// diffusers folder; sdxlCond's empty negative prompt is exactly zero and its prompt half is the encoders'
// output; txt2imgSdxl draws an image of the asked size with the VAE in f32.
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, describe, it } from 'node:test';
import { readSafetensors } from '../../src/io/safetensors.ts';
import { ClipTokenizer } from '../../src/io/tokenizer.ts';
import { nodeFolder } from '../../src/models/folder-node.ts';
import { loadSdxl, openSdxlDiffusers } from '../../src/models/sdxl.ts';
import { tokenizerFilesFrom } from '../../src/models/source.ts';
import { sdxlTextEncode } from '../../src/nn/sdxl.ts';
import { SD_SCHEDULE } from '../../src/sample/schedulers.ts';
import { sdxlCond, sdxlDenoise, txt2imgSdxl } from '../../src/sample/txt2img-sdxl.ts';
import { compare } from '../../src/selftest/check.ts';
import { writeTinySdxl } from '../fixtures/models/make-tiny-sdxl.ts';
import { assertChecks, FIXTURES, testGpu } from '../helpers.ts';

const dir = mkdtempSync(join(tmpdir(), 'sdxl-sample-'));
after(() => rmSync(dir, { recursive: true, force: true }));
const tiny = writeTinySdxl(dir);

let shared: ReturnType<typeof load> | undefined;
/** One load of the tiny model for the file's tests. */
const setup = () => (shared ??= load());
async function load() {
  const gpu = await testGpu();
  const src = await openSdxlDiffusers(nodeFolder(tiny.folder));
  const model = await loadSdxl(gpu, src, 'f32');
  await src.close();
  const tok = async (p: string) => ClipTokenizer.fromFiles((await tokenizerFilesFrom(nodeFolder(tiny.folder), p))!);
  return { gpu, model, tokenizers: [await tok('tokenizer/'), await tok('tokenizer_2/')] as [ClipTokenizer, ClipTokenizer] };
}

describe('SDXL sampling', () => {
  it('guided DDIM steps with SDXL conditioning match PyTorch', async () => {
    const { gpu, model } = await setup();
    const g = readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'modules', 'sample_sdxl.safetensors')))).tensors;
    const up = (k: string) => gpu.upload(g.get(k)!.data, g.get(k)!.shape, 'f32');
    const x = await sdxlDenoise(gpu, model, { context: up('context'), pooled: up('pooled') }, g.get('x')!.data, {
      steps: 2,
      guidance: 5,
      sampler: 'ddim',
      schedule: SD_SCHEDULE,
      width: 16,
      height: 16,
    });
    // Measured 5.0e-5 at |x| <= 8.9 (f32 UNet against float64; guidance 5 carries up to 11x the UNet's error);
    // the tolerance leaves 40x headroom, and a 1% change of the pooled text embedding moves the result by 3.0e-2.
    assertChecks([compare('latents', x, g.get('out')!.data, { atol: 2e-3, rtol: 5e-4 })]);
  });

  it('an empty negative prompt is zeros; the prompt half is the encoders output', async () => {
    const { gpu, model, tokenizers } = await setup();
    const cond = await sdxlCond(gpu, model, tokenizers, 'a red cube');
    const [ctx, pooled] = [await gpu.read(cond.context), await gpu.read(cond.pooled)];
    assert.ok(ctx.subarray(0, ctx.length / 2).every((v) => v === 0) && pooled.subarray(0, pooled.length / 2).every((v) => v === 0));
    const [i1, i2] = [tokenizers[0].encodePadded('a red cube'), tokenizers[1].encodePadded('a red cube')];
    const r = sdxlTextEncode(gpu, model.textEncoder, model.textEncoder2, i1, i2, 1);
    assert.deepEqual(ctx.subarray(ctx.length / 2), await gpu.read(r.context));
    assert.deepEqual(pooled.subarray(pooled.length / 2), await gpu.read(r.pooled));
    assert.ok(Math.max(...(await gpu.read(r.pooled)).map(Math.abs)) > 0.1, 'the prompt half is not zero');
    const withNeg = await sdxlCond(gpu, model, tokenizers, 'a red cube', 'blurry');
    assert.ok(
      (await gpu.read(withNeg.pooled)).subarray(0, 40).some((v) => v !== 0),
      'a given negative prompt is encoded',
    );
  });

  it('txt2imgSdxl draws an image of the asked size', async () => {
    const { gpu, model, tokenizers } = await setup();
    const img = await txt2imgSdxl(gpu, model, tokenizers, {
      prompt: 'a red cube',
      steps: 2,
      guidance: 5,
      seed: 1,
      width: 16,
      height: 24,
      sampler: 'dpm++2m',
      schedule: SD_SCHEDULE,
    });
    assert.equal(img.width, 16);
    assert.equal(img.height, 24);
    assert.equal(img.rgb.length, 16 * 24 * 3);
    assert.ok(new Set(img.rgb).size > 8, 'not a flat image');
  });
});
