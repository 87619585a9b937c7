// ModelSource without a GPU: both layouts of the tiny SD1 and SD2 models give the same tensors under
// the same diffusers names, bit for bit, and the same configs; real-file extras (EMA copies and counters,
// schedule buffers, I64 position_ids) are left out; SD2's prediction type from the weights; and each
// kind of bad folder gets its own message.
import assert from 'node:assert/strict';
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { SafetensorsFile, SafetensorsWriter, writeSafetensors, type TensorSpec } from '../../src/io/safetensors.ts';
import { nodeFileSink } from '../../src/io/sink-node.ts';
import { BytesSource } from '../../src/io/source.ts';
import { NodeFileSource } from '../../src/io/source-node.ts';
import { clipConfigFromJson } from '../../src/nn/clip.ts';
import { unetConfigFromJson } from '../../src/nn/unet.ts';
import { vaeConfigFromJson } from '../../src/nn/vae.ts';
import { ModelError } from '../../src/models/detect.ts';
import { nodeFolder } from '../../src/models/folder-node.ts';
import { inspectDiffusers } from '../../src/models/inspect.ts';
import { COMPONENTS, folderFromSources, openDiffusers, openSingleFile, singleFilePrediction, type ModelSource } from '../../src/models/source.ts';
import { writeTinyModel } from '../fixtures/models/make-tiny.ts';

const dir = mkdtempSync(join(tmpdir(), 'dbs-source-'));

/** Rewrites a safetensors file tensor by tensor (streamed), adding raw extra tensors. */
async function withExtras(from: string, to: string, extras: { name: string; dtype: string; shape: number[]; bytes: Uint8Array }[]): Promise<void> {
  const src = await SafetensorsFile.open(await NodeFileSource.open(from));
  const specs: TensorSpec[] = src.names.map((name) => ({ name, dtype: src.entry(name).dtype, shape: src.entry(name).shape }));
  const w = new SafetensorsWriter(await nodeFileSink(to), [...specs, ...extras], src.metadata);
  for (const s of specs) await w.write(s.name, await src.readRaw(s.name));
  for (const e of extras) await w.write(e.name, e.bytes);
  await w.finish();
  await src.source.close?.();
}

function i64(values: number[]): Uint8Array {
  return new Uint8Array(BigInt64Array.from(values.map(BigInt)).buffer);
}

async function sameTensors(a: ModelSource, b: ModelSource): Promise<number> {
  let n = 0;
  for (const c of COMPONENTS) {
    const sa = a.shapes(c);
    const sb = b.shapes(c);
    assert.deepEqual([...sa.keys()].sort(), [...sb.keys()].sort(), `${c}: same diffusers names`);
    for (const [name, shape] of sa) {
      assert.deepEqual([...shape], [...sb.get(name)!], `${c} ${name}: shape`);
      const [ta, tb] = [await a.read(c, name), await b.read(c, name)];
      assert.deepEqual(ta.shape, [...shape], `${c} ${name}: read shape`);
      assert.ok(ta.data.length === tb.data.length && ta.data.every((v, i) => Object.is(v, tb.data[i])), `${c} ${name}: identical values`);
      n++;
    }
  }
  return n;
}

describe('model sources: both layouts, one interface', () => {
  for (const family of ['sd1', 'sd2'] as const)
    it(`tiny ${family}: single file and diffusers folder give identical tensors and configs`, async () => {
      const tiny = writeTinyModel(dir, family);
      // A real single file also carries EMA counters, the DDPM schedule and I64 position_ids.
      const real = join(dir, `tiny-${family}-real.safetensors`);
      const te =
        family === 'sd1'
          ? { name: 'cond_stage_model.transformer.text_model.embeddings.position_ids', dtype: 'I64', shape: [1, 4], bytes: i64([0, 1, 2, 3]) }
          : { name: 'cond_stage_model.model.logit_scale', dtype: 'F32', shape: [], bytes: new Uint8Array(new Float32Array([4.6]).buffer) };
      await withExtras(tiny.singleFile, real, [
        { name: 'model_ema.num_updates', dtype: 'I32', shape: [], bytes: new Uint8Array(new Int32Array([1000]).buffer) },
        { name: 'alphas_cumprod', dtype: 'F32', shape: [4], bytes: new Uint8Array(new Float32Array([0.99, 0.9, 0.5, 0.1]).buffer) },
        te,
      ]);
      const file = await SafetensorsFile.open(await NodeFileSource.open(real));
      const single = await openSingleFile(file, { overrides: tiny.overrides });
      const folder = await openDiffusers(nodeFolder(tiny.folder));
      assert.equal(single.family, family, 'detected from the text encoder keys');
      assert.equal(folder.family, family, 'detected from the text encoder config');
      assert.equal(single.layout, 'single-file');
      assert.equal(folder.prediction, 'epsilon', 'the folder scheduler says epsilon');
      assert.equal(single.prediction, family === 'sd1' ? 'epsilon' : 'v_prediction', 'family default without a config');
      const n = await sameTensors(single, folder);
      assert.ok(n > 300, `${n} tensors compared`);
      assert.deepEqual(unetConfigFromJson(single.configs.unet), unetConfigFromJson(folder.configs.unet));
      assert.deepEqual(vaeConfigFromJson(single.configs.vae), vaeConfigFromJson(folder.configs.vae));
      assert.deepEqual(clipConfigFromJson(single.configs.text_encoder), clipConfigFromJson(folder.configs.text_encoder));
      await assert.rejects(single.read('unet', 'nope.weight'), /no unet tensor 'nope\.weight'/);
      await single.close();
      await folder.close();
    });

  it('a diffusers text encoder with I64 position_ids (older transformers) loads without them', async () => {
    const tiny = writeTinyModel(mkdtempSync(join(tmpdir(), 'dbs-source-')), 'sd1');
    const p = join(tiny.folder, 'text_encoder', 'model.safetensors');
    await withExtras(p, `${p}.new`, [{ name: 'text_model.embeddings.position_ids', dtype: 'I64', shape: [1, 3], bytes: i64([0, 1, 2]) }]);
    rmSync(p);
    writeFileSync(p, new Uint8Array(await (await import('node:fs/promises')).readFile(`${p}.new`)));
    rmSync(`${p}.new`);
    const src = await openDiffusers(nodeFolder(tiny.folder));
    assert.ok(!src.shapes('text_encoder').has('text_model.embeddings.position_ids'));
    const info = await inspectDiffusers(nodeFolder(tiny.folder));
    assert.equal(info.tensorCount, 369, 'the file holds it');
    assert.equal(info.components.text_encoder.parameters, 51616, 'but it is no parameter');
    await src.close();
  });

  it('a folder given as Files in memory (dropped folder, hub download) reads the same', async () => {
    const tiny = writeTinyModel(mkdtempSync(join(tmpdir(), 'dbs-source-')), 'sd1');
    const { readFileSync } = await import('node:fs');
    const paths = [
      'model_index.json',
      'unet/config.json',
      'vae/config.json',
      'text_encoder/config.json',
      'scheduler/scheduler_config.json',
      'unet/diffusion_pytorch_model.safetensors',
      'vae/diffusion_pytorch_model.safetensors',
      'text_encoder/model.safetensors',
    ];
    const files = new Map(paths.map((p) => [p, new BytesSource(new Uint8Array(readFileSync(join(tiny.folder, p))), p)] as const));
    const a = await openDiffusers(folderFromSources('dropped', files));
    const b = await openDiffusers(nodeFolder(tiny.folder));
    await sameTensors(a, b);
    await b.close();
  });
});

describe('SD2 prediction type of a single file', () => {
  const probe = 'model.diffusion_model.output_blocks.11.1.transformer_blocks.0.norm1.bias';
  const fileWith = async (values: Float32Array) =>
    SafetensorsFile.open(new BytesSource(writeSafetensors(new Map([[probe, { shape: [values.length], data: values }]])), 'sd2.safetensors'));
  const spread = (s: number) => Float32Array.from({ length: 320 }, (_, i) => (i % 2 ? s : -s));

  it('v when the LayerNorm bias spreads wider than 0.09 (768-v), epsilon when not (512-base)', async () => {
    const v = await singleFilePrediction(await fileWith(spread(0.2)), 'sd2');
    assert.equal(v.prediction, 'v_prediction');
    assert.match(v.source, /std 0\.200 .* > 0\.09/);
    assert.equal((await singleFilePrediction(await fileWith(spread(0.05)), 'sd2')).prediction, 'epsilon');
  });

  it('a scheduler config wins; SD1 is epsilon without reading anything', async () => {
    const c = await singleFilePrediction(await fileWith(spread(0.2)), 'sd2', { prediction_type: 'epsilon' });
    assert.deepEqual(c, { prediction: 'epsilon', source: 'scheduler config' });
    assert.equal((await singleFilePrediction(await fileWith(spread(0.2)), 'sd1')).prediction, 'epsilon');
  });
});

describe('bad folders each get their own message', () => {
  const folderWith = (name: string, files: Record<string, string | Uint8Array>) => {
    const d = join(dir, name);
    for (const [p, body] of Object.entries(files)) {
      mkdirSync(join(d, p, '..'), { recursive: true });
      writeFileSync(join(d, p), body);
    }
    return nodeFolder(d);
  };
  const configs = {
    'model_index.json': JSON.stringify({ _class_name: 'StableDiffusionPipeline' }),
    'unet/config.json': JSON.stringify({ cross_attention_dim: 768, in_channels: 4 }),
    'vae/config.json': JSON.stringify({ block_out_channels: [4] }),
    'text_encoder/config.json': JSON.stringify({ hidden_size: 768, hidden_act: 'quick_gelu' }),
  };
  const st = writeSafetensors(new Map([['w', { shape: [1], data: [0] }]]));

  it('weights only as a pickle .bin', async () => {
    const d = folderWith('pickle', { ...configs, 'unet/diffusion_pytorch_model.bin': new Uint8Array([0x50, 0x4b, 3, 4]) });
    await assert.rejects(
      openDiffusers(d),
      (e: Error) =>
        e instanceof ModelError &&
        /unet weights are only in unet\/diffusion_pytorch_model\.bin, a PyTorch pickle, .*convert it to \.safetensors/.test(e.message),
    );
  });

  it('sharded weights', async () => {
    const d = folderWith('sharded', { ...configs, 'unet/diffusion_pytorch_model.safetensors.index.json': '{}' });
    await assert.rejects(openDiffusers(d), /unet weights are sharded .*not supported yet/);
  });

  it('missing weights, a missing component config, no UNet config at all', async () => {
    await assert.rejects(
      openDiffusers(folderWith('noweights', configs)),
      /unet weights are missing: expected unet\/diffusion_pytorch_model\.safetensors or unet\/diffusion_pytorch_model\.fp16\.safetensors/,
    );
    const { 'vae/config.json': _, ...noVae } = configs;
    await assert.rejects(openDiffusers(folderWith('novae', noVae)), /novae: vae\/config\.json is missing/);
    await assert.rejects(
      openDiffusers(folderWith('photos', { 'cat.jpg': 'not a model' })),
      /photos is not a diffusers Stable Diffusion folder: it has neither model_index\.json nor unet\/config\.json/,
    );
  });

  it('SDXL, another UNet class, a mixed text encoder, an unknown width', async () => {
    const weights = { 'unet/diffusion_pytorch_model.safetensors': st, 'vae/diffusion_pytorch_model.safetensors': st, 'text_encoder/model.safetensors': st };
    const xl = folderWith('xl', { ...configs, ...weights, 'model_index.json': JSON.stringify({ _class_name: 'StableDiffusionXLPipeline' }) });
    await assert.rejects(openDiffusers(xl), /xl is a StableDiffusionXLPipeline model: not supported yet/);
    const video = folderWith('video', {
      ...configs,
      ...weights,
      'unet/config.json': JSON.stringify({ _class_name: 'UNetSpatioTemporalConditionModel', cross_attention_dim: 1024 }),
    });
    await assert.rejects(openDiffusers(video), /its unet is a UNetSpatioTemporalConditionModel/);
    const mixed = folderWith('mixed', { ...configs, ...weights, 'text_encoder/config.json': JSON.stringify({ hidden_size: 1024, hidden_act: 'gelu' }) });
    await assert.rejects(openDiffusers(mixed), /expects 768-wide text embeddings but the text encoder is 1024 wide/);
    const odd = folderWith('odd', {
      ...configs,
      ...weights,
      'unet/config.json': JSON.stringify({ cross_attention_dim: 96 }),
      'text_encoder/config.json': JSON.stringify({ hidden_size: 96 }),
    });
    await assert.rejects(openDiffusers(odd), /cross_attention_dim 96 is neither SD1's 768 nor SD2's 1024.*unknown architecture/);
  });
});
