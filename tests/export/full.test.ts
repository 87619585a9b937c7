// Full-model export of the tiny model with a "trained" UNet (every weight moved by a known delta): the
// single-file checkpoint from a single-file base (its exact key set, raw non-float tensors) and from
// diffusers folders (the standard key set; SD2 with OpenCLIP's fused q/k/v and its unused last block),
// and the diffusers folder as a streamed zip (unzipped with fflate). Each loads back with the model
// loaders, holds the trained UNet in fp16 and gives the same UNet output as the trained weights; every
// chunk written is at most one tensor.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { unzipSync } from 'fflate';
import { diffusersConfigs, openClipFromDiffusers, singleFilePlan, writeSingleFile, zipDiffusers } from '../../src/export/full.ts';
import { ExportError, mapProvider } from '../../src/export/provider.ts';
import { pipeToSink } from '../../src/export/stream.ts';
import type { Gpu } from '../../src/gpu/device.ts';
import { roundToF16 } from '../../src/util/half.ts';
import { readSafetensors, SafetensorsFile, SafetensorsWriter, type NamedTensor } from '../../src/io/safetensors.ts';
import { nodeFileSink } from '../../src/io/sink-node.ts';
import { NodeFileSource } from '../../src/io/source-node.ts';
import { BytesSource, type ByteSource } from '../../src/io/source.ts';
import { openClipToDiffusers } from '../../src/models/keymap.ts';
import { loadDiffusers, loadSingleFile, type LoadedModel } from '../../src/models/load.ts';
import { nodeFolder } from '../../src/models/folder-node.ts';
import { folderFromSources, openDiffusers, openSingleFile } from '../../src/models/source.ts';
import { clipTextForward } from '../../src/nn/clip.ts';
import { unetForward } from '../../src/nn/unet.ts';
import { compare } from '../../src/selftest/check.ts';
import { assertChecks, testGpu } from '../helpers.ts';
import { clipIds, memorySink, readAll, tempDir, tensorChunkSizes, tinyModel, tinySd2, trainedUnet, unetFixture, upload } from './fixtures.ts';

const tiny = tinyModel();
const trained = trainedUnet(tiny.folder);
const OPTS = { title: 'sks dog', date: new Date('2025-03-01T12:00:00Z') };
const openFile = async (p: string) => SafetensorsFile.open(await NodeFileSource.open(p));
const openBytes = (b: Uint8Array, name = 'out.safetensors') => SafetensorsFile.open(new BytesSource(b, name));

async function unetOut(gpu: Gpu, model: LoadedModel, family: 'sd1' | 'sd2' = 'sd1', weights = model.unet.weights) {
  const u = unetFixture(family);
  const up = (t: NamedTensor) => gpu.upload(t.data, t.shape, 'f32');
  return gpu.read(unetForward(gpu, model.unet.config, weights, up(u.get('sample')!), up(u.get('timestep')!), up(u.get('encoder_hidden_states')!)));
}

/** The reloaded UNet holds the trained weights in fp16 and gives the trained UNet's output. */
async function assertTrainedUnet(gpu: Gpu, model: LoadedModel, trainedW: Map<string, NamedTensor>, family: 'sd1' | 'sd2' = 'sd1') {
  assert.deepEqual([...model.unet.weights.keys()].sort(), [...trainedW.keys()].sort());
  for (const [n, t] of trainedW) assert.deepEqual(await gpu.read(model.unet.weights.get(n)!), roundToF16(t.data), `unet ${n} = fp16(trained)`);
  const fp16Trained = upload(gpu, new Map([...trainedW].map(([n, t]) => [n, { shape: t.shape, data: roundToF16(t.data) }])));
  const got = await unetOut(gpu, model, family);
  const f32 = await unetOut(gpu, model, family, upload(gpu, trainedW));
  const scale = Math.max(...f32.map(Math.abs));
  assertChecks([
    compare('unet from the export = unet with the fp16 trained weights', got, await unetOut(gpu, model, family, fp16Trained), { atol: 0, rtol: 0 }),
    // fp16 weights: about 1e-3 of the output's scale.
    compare('unet from the export vs the f32 trained weights', got, f32, { atol: 3e-3 * scale, rtol: 0 }),
  ]);
}

/** Chunks: the header, then exactly one tensor each, in file order. */
function assertOneTensorPerChunk(file: SafetensorsFile, chunks: number[]) {
  assert.equal(chunks[0], file.header.dataStart);
  assert.deepEqual(chunks.slice(1), tensorChunkSizes(file));
}

/** The tiny single file plus an I64 position_ids tensor (as real SD1 files hold), via the io writer. */
async function baseWithPositionIds(): Promise<string> {
  const src = await openFile(tiny.singleFile);
  const ids = new Uint8Array(new BigInt64Array(Array.from({ length: 77 }, (_, i) => BigInt(i))).buffer);
  const specs = [
    ...src.names.map((n) => ({ name: n, dtype: src.entry(n).dtype, shape: src.entry(n).shape })),
    { name: 'cond_stage_model.transformer.text_model.embeddings.position_ids', dtype: 'I64', shape: [1, 77] },
  ];
  const path = join(tempDir(), 'base-with-ids.safetensors');
  const w = new SafetensorsWriter(await nodeFileSink(path), specs, src.metadata);
  for (const s of specs) await w.write(s.name, s.dtype === 'I64' ? ids : await src.readRaw(s.name));
  await w.finish();
  await src.source.close?.();
  return path;
}

describe('single-file export from a single-file base', () => {
  it('keeps the base key set exactly, fp16 floats, raw I64, the trained UNet; loads back to the trained outputs', async () => {
    const gpu = await testGpu();
    const basePath = await baseWithPositionIds();
    const base = await openFile(basePath);
    const outPath = join(tempDir(), 'model.safetensors');
    const counting = memorySink();
    const disk = await nodeFileSink(outPath);
    const both = {
      write: async (c: Uint8Array) => (await counting.write(c), await disk.write(c)),
      close: async () => (await counting.close(), await disk.close()),
    };
    await writeSingleFile(both, base, mapProvider(trained), { ...OPTS, family: 'sd1', overrides: tiny.overrides });
    const out = await openFile(outPath);
    assertOneTensorPerChunk(out, counting.chunks);
    assert.deepEqual(out.names, base.names, 'same keys, same order');
    for (const n of base.names) {
      const [b, o] = [base.entry(n), out.entry(n)];
      assert.deepEqual(o.shape, b.shape, n);
      assert.equal(o.dtype, b.dtype === 'I64' ? 'I64' : 'F16', n);
      if (!n.startsWith('model.diffusion_model.')) {
        if (b.dtype === 'I64' || b.dtype === 'F16') assert.deepEqual(await out.readRaw(n), await base.readRaw(n), `${n} copied raw`);
        else assert.deepEqual((await out.read(n)).data, roundToF16((await base.read(n)).data), `${n} converted to F16`);
      }
    }
    assert.equal(out.entry('model_ema.decay').dtype, 'F16', 'the F32 EMA scalar is converted too');
    assert.equal(out.metadata.format, 'pt');
    assert.equal(out.metadata['modelspec.architecture'], 'stable-diffusion-v1');
    assert.equal(out.metadata['modelspec.implementation'], 'https://github.com/Stability-AI/generative-models');
    assert.equal(out.metadata['modelspec.title'], 'sks dog');
    const model = await loadSingleFile(gpu, out, { dtype: 'f32', family: 'sd1', overrides: tiny.overrides });
    await assertTrainedUnet(gpu, model, trained);
    await base.source.close?.();
    await out.source.close?.();
  });

  it('refuses trained tensors the base does not have, or of another shape', async () => {
    const base = await openFile(tiny.singleFile);
    const extra = mapProvider(new Map([['down_blocks.9.resnets.0.conv1.weight', { shape: [1], data: new Float32Array(1) }]]));
    await assert.rejects(
      writeSingleFile(memorySink(), base, extra, { ...OPTS, family: 'sd1' }),
      (e: Error) => e instanceof ExportError && /down_blocks\.9/.test(e.message),
    );
    const reshaped = mapProvider(new Map([['conv_in.bias', { shape: [3], data: new Float32Array(3) }]]));
    await assert.rejects(writeSingleFile(memorySink(), base, reshaped, { ...OPTS, family: 'sd1' }), /conv_in\.bias' is \[3\]/);
    await base.source.close?.();
  });
});

describe('single-file export from a diffusers folder', () => {
  it('SD1: the standard key set (as the tiny single file), VAE 1x1 convs; loads back to the trained outputs', async () => {
    const gpu = await testGpu();
    const src = await openDiffusers(nodeFolder(tiny.folder));
    const sink = memorySink();
    await writeSingleFile(sink, src, mapProvider(trained), OPTS);
    const out = await openBytes(sink.bytes());
    assertOneTensorPerChunk(out, sink.chunks);
    const ref = await openFile(tiny.singleFile);
    const refKeys = ref.names.filter((n) => n !== 'model_ema.decay');
    assert.deepEqual([...out.names].sort(), [...refKeys].sort());
    for (const n of refKeys) assert.deepEqual(out.entry(n).shape, ref.entry(n).shape, n);
    assert.deepEqual(out.entry('first_stage_model.decoder.mid.attn_1.q.weight').shape.slice(2), [1, 1]);
    assert.ok(out.names.every((n) => out.entry(n).dtype === 'F16'));
    const model = await loadSingleFile(gpu, out, { dtype: 'f32', family: 'sd1', overrides: tiny.overrides });
    await assertTrainedUnet(gpu, model, trained);
    for (const [n, t] of await readAll(src, 'vae')) assert.deepEqual(await gpu.read(model.vae.weights.get(n)!), roundToF16(t.data), `vae ${n}`);
    await src.close();
    await ref.source.close?.();
  });

  it('SD2: OpenCLIP names with q/k/v fused, a 24th (unused) block, text_projection and logit_scale; the text encoder loads back equal', async () => {
    const gpu = await testGpu();
    const t2 = tinySd2();
    const src = await openDiffusers(nodeFolder(t2.folder));
    const trained2 = trainedUnet(t2.folder);
    const sink = memorySink();
    await writeSingleFile(sink, src, mapProvider(trained2), OPTS);
    const out = await openBytes(sink.bytes());
    assertOneTensorPerChunk(out, sink.chunks);
    const ref = await openFile(t2.singleFile);
    const want = [...ref.names.filter((n) => n !== 'model_ema.decay'), 'cond_stage_model.model.logit_scale'].sort();
    assert.deepEqual([...out.names].sort(), want, 'the key set of an SD2 single file');
    const layers = src.configs.text_encoder.num_hidden_layers as number;
    const width = src.configs.text_encoder.hidden_size as number;
    assert.deepEqual(out.entry('cond_stage_model.model.text_projection').shape, [width, width]);
    assert.deepEqual(out.entry('cond_stage_model.model.logit_scale').shape, []);
    for (const n of ref.names.filter((k) => k.startsWith('cond_stage_model.model.transformer.'))) {
      assert.deepEqual(out.entry(n).shape, ref.entry(n).shape, n);
      // make-tiny's extra block repeats the last one too, so every resblock equals the reference's.
      assert.deepEqual((await out.read(n)).data, roundToF16((await ref.read(n)).data), n);
    }
    // The tiny SD2 folder's scheduler says epsilon: SD2 512-base.
    assert.equal(out.metadata['modelspec.architecture'], 'stable-diffusion-v2-512');
    assert.equal(out.metadata['modelspec.prediction_type'], 'epsilon');
    assert.equal(out.metadata['modelspec.resolution'], '512x512');
    // Loaded back (detected as SD2 from the OpenCLIP keys): the unused block is dropped again.
    const model = await loadSingleFile(gpu, out, { dtype: 'f32', overrides: t2.overrides });
    assert.equal(model.family, 'sd2');
    assert.equal(model.textEncoder.config.layers, layers);
    await assertTrainedUnet(gpu, model, trained2, 'sd2');
    const ids = clipIds('sd2');
    const fp16Te = upload(gpu, await readAll(src, 'text_encoder', true));
    const a = await gpu.read(clipTextForward(gpu, model.textEncoder.config, model.textEncoder.weights, ids.data, ids.shape[0]));
    const b = await gpu.read(clipTextForward(gpu, model.textEncoder.config, fp16Te, ids.data, ids.shape[0]));
    assertChecks([compare('SD2 text encoder from the export = the folder fp16', a, b, { atol: 0, rtol: 0 })]);
    await src.close();
    await ref.source.close?.();
  });

  it('openClipFromDiffusers inverts keymap.openClipToDiffusers', async () => {
    const ref = await openFile(tinySd2().singleFile);
    for (const n of ref.names.filter((k) => k.startsWith('cond_stage_model.model.'))) {
      const key = n.slice('cond_stage_model.model.'.length);
      const t = openClipToDiffusers(key);
      if (!t) continue;
      t.names.forEach((d, i) => assert.deepEqual(openClipFromDiffusers(d), t.split ? { key, part: i } : { key }, d));
    }
    await ref.source.close?.();
  });
});

/** Unzips a zip stream (counting its chunk sizes) into a folder of BytesSources. */
async function unzip(stream: ReadableStream<Uint8Array>) {
  const sink = memorySink();
  await pipeToSink(stream, sink);
  const files = unzipSync(sink.bytes());
  const sources = new Map<string, ByteSource>(Object.entries(files).map(([p, b]) => [p, new BytesSource(b, p)]));
  return { files, chunks: sink.chunks, folder: folderFromSources('unzipped', sources) };
}

const text = (b: Uint8Array) => JSON.parse(new TextDecoder().decode(b));

describe('diffusers zip export', () => {
  it('from a diffusers base: every component, configs and tokenizer copied; loads back to the trained outputs', async () => {
    const gpu = await testGpu();
    const src = await openDiffusers(nodeFolder(tiny.folder));
    const { files, chunks, folder } = await unzip(zipDiffusers(src, mapProvider(trained), { ...OPTS, folder: nodeFolder(tiny.folder) }));
    assert.deepEqual(Object.keys(files).sort(), [
      'model_index.json',
      'scheduler/scheduler_config.json',
      'text_encoder/config.json',
      'text_encoder/model.safetensors',
      'tokenizer/merges.txt',
      'tokenizer/tokenizer_config.json',
      'tokenizer/vocab.json',
      'unet/config.json',
      'unet/diffusion_pytorch_model.safetensors',
      'vae/config.json',
      'vae/diffusion_pytorch_model.safetensors',
    ]);
    for (const p of ['tokenizer/vocab.json', 'tokenizer/merges.txt', 'unet/config.json', 'vae/config.json', 'text_encoder/config.json'])
      if (p.startsWith('tokenizer/')) assert.deepEqual(files[p], new Uint8Array(readFileSync(join(tiny.folder, p))), p);
      else assert.deepEqual(text(files[p]), JSON.parse(readFileSync(join(tiny.folder, p), 'utf8')), p);
    const index = text(files['model_index.json']);
    assert.deepEqual(
      [index.unet, index.vae, index.text_encoder, index.tokenizer, index.safety_checker],
      [
        ['diffusers', 'UNet2DConditionModel'],
        ['diffusers', 'AutoencoderKL'],
        ['transformers', 'CLIPTextModel'],
        ['transformers', 'CLIPTokenizer'],
        [null, null],
      ],
    );
    const sched = text(files['scheduler/scheduler_config.json']);
    const folderSched = JSON.parse(readFileSync(join(tiny.folder, 'scheduler/scheduler_config.json'), 'utf8'));
    assert.deepEqual(
      sched,
      { _class_name: 'DDIMScheduler', clip_sample: false, set_alpha_to_one: false, steps_offset: 1, trained_betas: null, ...folderSched },
      'the folder has no class name: DDIM settings under its values',
    );
    assert.deepEqual(index.scheduler, ['diffusers', 'DDIMScheduler']);
    let largest = 0;
    for (const p of ['unet/diffusion_pytorch_model.safetensors', 'vae/diffusion_pytorch_model.safetensors', 'text_encoder/model.safetensors']) {
      const f = await openBytes(files[p], p);
      assert.equal(f.metadata.format, 'pt', `${p}: transformers needs format=pt`);
      assert.ok(
        f.names.every((n) => f.entry(n).dtype === 'F16'),
        `${p} is fp16`,
      );
      largest = Math.max(largest, f.header.dataStart, ...tensorChunkSizes(f));
    }
    const total = chunks.reduce((a, b) => a + b, 0);
    assert.ok(
      Math.max(...chunks) <= largest,
      `no zip chunk (max ${Math.max(...chunks)}) is bigger than one tensor or header (${largest}) of the ${total}-byte zip`,
    );
    const model = await loadDiffusers(gpu, folder, { dtype: 'f32' });
    await assertTrainedUnet(gpu, model, trained);
    for (const [n, t] of await readAll(src, 'text_encoder'))
      assert.deepEqual(await gpu.read(model.textEncoder.weights.get(n)!), roundToF16(t.data), `text encoder ${n}`);
    await src.close();
  });

  it('from a single-file base: standard configs with the inferred values, a given tokenizer; loads back to the trained outputs', async () => {
    const gpu = await testGpu();
    const base = await openFile(tiny.singleFile);
    const tokenizer = new Map(
      ['vocab.json', 'merges.txt', 'tokenizer_config.json'].map((n) => [n, new Uint8Array(readFileSync(join(tiny.folder, 'tokenizer', n)))]),
    );
    const { files, folder } = await unzip(zipDiffusers(base, mapProvider(trained), { ...OPTS, family: 'sd1', overrides: tiny.overrides, tokenizer }));
    assert.ok(files['tokenizer/vocab.json']);
    const unetCfg = text(files['unet/config.json']);
    const folderCfg = JSON.parse(readFileSync(join(tiny.folder, 'unet/config.json'), 'utf8'));
    for (const k of Object.keys(folderCfg)) assert.deepEqual(unetCfg[k], folderCfg[k], `unet config ${k}`);
    assert.equal(unetCfg._class_name, 'UNet2DConditionModel');
    assert.equal(unetCfg.sample_size, 64);
    const vaeCfg = text(files['vae/config.json']);
    assert.equal(vaeCfg._class_name, 'AutoencoderKL');
    assert.equal(vaeCfg.down_block_types.length, vaeCfg.block_out_channels.length);
    assert.equal(text(files['text_encoder/config.json']).hidden_act, 'quick_gelu');
    const model = await loadDiffusers(gpu, folder, { dtype: 'f32' });
    assert.equal(model.family, 'sd1');
    await assertTrainedUnet(gpu, model, trained);
    await base.source.close?.();
  });

  it('single-file SD2 base configs: OpenCLIP text encoder, v-prediction scheduler', async () => {
    const base = await openFile(tinySd2().singleFile);
    const src = await openSingleFile(base, { overrides: tinySd2().overrides });
    const cfg = diffusersConfigs(src, 768);
    assert.equal(cfg.scheduler.prediction_type, 'v_prediction');
    assert.equal(cfg.text_encoder.hidden_act, 'gelu');
    assert.equal(cfg.text_encoder.projection_dim, 512);
    assert.equal(cfg.unet.use_linear_projection, true);
    assert.equal(cfg.unet.sample_size, 96);
    await base.source.close?.();
  });

  it('a trained tensor the base lacks fails the stream', async () => {
    const src = await openDiffusers(nodeFolder(tiny.folder));
    const bad = mapProvider(new Map([['nope.weight', { shape: [1], data: new Float32Array(1) }]]));
    await assert.rejects(pipeToSink(zipDiffusers(src, bad, OPTS), memorySink()), /nope\.weight/);
    await src.close();
  });
});

describe('plan without reading', () => {
  it('singleFilePlan names the tensors before any is read', async () => {
    const src = await openDiffusers(nodeFolder(tiny.folder));
    let reads = 0;
    const counting = { ...mapProvider(trained), read: async (n: string) => (reads++, trained.get(n)!.data) };
    const { tensors, metadata } = await singleFilePlan(src, counting, OPTS);
    assert.equal(reads, 0);
    assert.ok(tensors.length > trained.size);
    assert.equal(metadata['modelspec.sai_model_spec'], '1.0.0');
    // And a plan written to disk through the Node sink reads back whole.
    const p = join(tempDir(), 'plan.safetensors');
    await writeSingleFile(await nodeFileSink(p), src, counting, OPTS);
    assert.equal(reads, trained.size);
    assert.equal(readSafetensors(new Uint8Array(readFileSync(p))).tensors.size, tensors.length);
    await src.close();
  });
});
