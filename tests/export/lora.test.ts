// LoRA export: kohya and diffusers/PEFT files of random adapters (rank 4, alpha 8) on every UNet and
// text-encoder target of the tiny SD1 model. Headers (keys, dtypes, shapes, metadata) are checked, both
// files read back through readLora to the same adapters (fp16), every chunk written is one tensor, and the
// reloaded adapters give the same UNet and text-encoder outputs as the adapters they came from.
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { describe, it } from 'node:test';
import { roundToF16 } from '../../src/util/half.ts';
import { SafetensorsFile, writeSafetensors, type NamedTensor } from '../../src/io/safetensors.ts';
import { BytesSource } from '../../src/io/source.ts';
import {
  adapterTensors,
  kohyaLoraHash,
  kohyaMetadata,
  kohyaName,
  layerFromKohya,
  readLora,
  writeKohyaLora,
  writePeftLora,
  type LoraAdapters,
} from '../../src/export/lora.ts';
import { hashFixtureAdapters, hashFixtureFile } from '../fixtures/export/lora-hash-fixture.ts';
import { ExportError, mapProvider } from '../../src/export/provider.ts';
import { loadDiffusers } from '../../src/models/load.ts';
import { nodeFolder } from '../../src/models/folder-node.ts';
import { clipTextForward } from '../../src/nn/clip.ts';
import { unetForward } from '../../src/nn/unet.ts';
import { compare } from '../../src/selftest/check.ts';
import { assertChecks, testGpu } from '../helpers.ts';
import { clipIds, INFO, memorySink, randomAdapters, readFolderTensors, rounded, tensorChunkSizes, tinyModel, unetFixture, upload } from './fixtures.ts';

const HASH_GOLDEN = JSON.parse(readFileSync(new URL('../fixtures/export/addnet-hash.json', import.meta.url), 'utf8')) as Record<string, string>;
let fixtureFile: Promise<Uint8Array> | undefined;
const RANK = 4;
const ALPHA = 8;
const tiny = tinyModel();
const unetBase = readFolderTensors(tiny.folder, 'unet/diffusion_pytorch_model.safetensors');
const teBase = readFolderTensors(tiny.folder, 'text_encoder/model.safetensors');
const unetLora = randomAdapters(unetBase, false, RANK, 1);
const teLora = randomAdapters(teBase, true, RANK, 2);
const adapters: LoraAdapters = { rank: RANK, alpha: ALPHA, unet: mapProvider(unetLora), textEncoder: mapProvider(teLora) };
const layers = (m: Map<string, NamedTensor>) => [...m.keys()].filter((n) => n.endsWith('.lora_A.weight')).map((n) => n.slice(0, -'.lora_A.weight'.length));

async function exported(write: typeof writeKohyaLora) {
  const sink = memorySink();
  await write(sink, adapters, INFO);
  assert.ok(sink.closed, 'the sink is closed');
  const file = await SafetensorsFile.open(new BytesSource(sink.bytes(), 'lora.safetensors'));
  return { file, sink };
}

function assertOneTensorPerChunk(file: SafetensorsFile, chunks: number[]): void {
  assert.equal(chunks[0], file.header.dataStart, 'the first chunk is the header');
  assert.equal(file.header.dataStart % 8, 0, 'the data section is 8-byte aligned');
  assert.deepEqual(chunks.slice(1), tensorChunkSizes(file), 'then one chunk per tensor, in order');
}

describe('kohya LoRA export', () => {
  it('names, dtypes, shapes, scalar alpha and the ss_*/modelspec metadata', async () => {
    const { file, sink } = await exported(writeKohyaLora);
    assertOneTensorPerChunk(file, sink.chunks);
    const unetLayers = layers(unetLora);
    const teLayers = layers(teLora);
    assert.equal(unetLayers.length, 4 * 2 * 4, '4 transformers x attn1/attn2 x q/k/v/out');
    assert.equal(teLayers.length, 2 * 4);
    assert.equal(file.names.length, 3 * (unetLayers.length + teLayers.length));
    for (const n of [
      'lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight',
      'lora_unet_mid_block_attentions_0_transformer_blocks_0_attn2_to_k.lora_up.weight',
      'lora_unet_up_blocks_1_attentions_1_transformer_blocks_0_attn2_to_out_0.alpha',
      'lora_te_text_model_encoder_layers_1_self_attn_out_proj.lora_down.weight',
    ])
      assert.ok(file.header.entries.has(n), n);
    for (const [c, ls, src] of [
      ['unet', unetLayers, unetLora],
      ['text_encoder', teLayers, teLora],
    ] as const)
      for (const l of ls) {
        const k = kohyaName(c, l);
        assert.deepEqual(layerFromKohya(k), { component: c, layer: l });
        const alpha = file.entry(`${k}.alpha`);
        assert.deepEqual([alpha.dtype, alpha.shape], ['F32', []], `${k}.alpha is an F32 scalar`);
        assert.deepEqual((await file.read(`${k}.alpha`)).data, Float32Array.of(ALPHA));
        const down = file.entry(`${k}.lora_down.weight`);
        const up = file.entry(`${k}.lora_up.weight`);
        assert.deepEqual([down.dtype, down.shape], ['F16', src.get(`${l}.lora_A.weight`)!.shape]);
        assert.deepEqual([up.dtype, up.shape], ['F16', src.get(`${l}.lora_B.weight`)!.shape]);
        assert.equal(down.shape[0], RANK);
        assert.equal(up.shape[1], RANK);
      }
    const md = file.metadata;
    const expected: Record<string, string> = {
      ss_network_module: 'networks.lora',
      ss_network_dim: '4',
      ss_network_alpha: '8.0',
      ss_base_model_version: 'sd_v1',
      ss_v2: 'False',
      ss_resolution: '(512, 512)',
      ss_num_train_images: '5',
      ss_num_reg_images: '100',
      ss_max_train_steps: '800',
      ss_steps: '800',
      ss_learning_rate: '0.0001',
      ss_unet_lr: '0.0001',
      ss_text_encoder_lr: '0.0001',
      ss_output_name: 'sks dog',
      ss_sd_model_name: 'tiny-sd1.safetensors',
      ss_new_sd_model_hash: 'ab'.repeat(32),
      ss_mixed_precision: 'fp16',
      ss_clip_skip: '1',
      ss_training_started_at: '1740826800.5',
      ss_training_finished_at: '1740830400.0',
      'modelspec.sai_model_spec': '1.0.0',
      'modelspec.architecture': 'stable-diffusion-v1/lora',
      'modelspec.implementation': 'diffusers',
      'modelspec.title': 'sks dog',
      'modelspec.resolution': '512x512',
      'modelspec.date': '2025-03-01T12:00:00Z',
      'modelspec.prediction_type': 'epsilon',
      'modelspec.encoder_layer': '1',
      'modelspec.trigger_phrase': 'a photo of sks dog, café',
    };
    for (const [k, v] of Object.entries(expected)) assert.equal(md[k], v, k);
    assert.match(md.ss_training_comment, /instance prompt: a photo of sks dog, café; class prompt: a photo of a dog/);
    // sd-scripts' tag rule: the instance prompt split at ',' into two tags, once per photo.
    assert.deepEqual(JSON.parse(md.ss_tag_frequency), { instance_images: { 'a photo of sks dog': 5, café: 5 }, class_images: { 'a photo of a dog': 100 } });
  });

  it('sshs_model_hash / sshs_legacy_hash as addnet computes them (Python hashlib golden)', async () => {
    const bytes = await (fixtureFile ??= hashFixtureFile());
    const file = await SafetensorsFile.open(new BytesSource(bytes));
    const md = file.metadata;
    // The golden is Python's hashlib over this same file (tests/fixtures/export/addnet-hash.py); exact strings.
    assert.equal(md.sshs_model_hash, HASH_GOLDEN.sshs_model_hash);
    assert.equal(md.sshs_legacy_hash, HASH_GOLDEN.sshs_legacy_hash);
    // And node:crypto over the file's own bytes: the data after the header, and the 64 KiB at 1 MiB (in the data).
    const sha = (b: Uint8Array) => createHash('sha256').update(b).digest('hex');
    assert.ok(file.header.dataStart < 0x100000 && bytes.length > 0x110000, 'the legacy window lies in the tensor data');
    assert.equal(md.sshs_model_hash, sha(bytes.subarray(file.header.dataStart)));
    assert.equal(md.sshs_legacy_hash, sha(bytes.subarray(0x100000, 0x110000)).slice(0, 8));
    // The model hash is the data's alone: other metadata, same hash; a tensor changed, another hash.
    assert.equal(await kohyaLoraHash(hashFixtureAdapters()), md.sshs_model_hash);
    const unet = adapters.unet;
    const first = unet.names()[0];
    const bumped = { ...unet, read: async (n: string) => (n === first ? (await unet.read(n)).map((v, i) => (i === 0 ? v + 0.25 : v)) : unet.read(n)) };
    assert.notEqual(await kohyaLoraHash({ ...adapters, unet: bumped }), await kohyaLoraHash(adapters), 'one value changed, another hash');
  });

  it('ss_datasets, ss_tag_frequency and ss_output_name parse as sd-scripts writes them', async () => {
    const md = (await SafetensorsFile.open(new BytesSource(await (fixtureFile ??= hashFixtureFile())))).metadata;
    // Python's json.dumps (', ' and ': ', \u escapes, key order) byte for byte.
    assert.equal(md.ss_tag_frequency, HASH_GOLDEN.ss_tag_frequency);
    assert.equal(md.ss_output_name, 'sks dog');
    const [ds] = JSON.parse(md.ss_datasets) as Record<string, unknown>[];
    assert.deepEqual([ds.is_dreambooth, ds.num_train_images, ds.num_reg_images, ds.resolution], [true, 3, 2, [512, 512]]);
    assert.deepEqual(ds.tag_frequency, JSON.parse(md.ss_tag_frequency));
    const subsets = ds.subsets as Record<string, unknown>[];
    assert.deepEqual(
      subsets.map((x) => [x.image_dir, x.class_tokens, x.is_reg, x.img_count, x.num_repeats]),
      [
        ['instance_images', 'a photo of sks dog', false, 3, 1],
        ['class_images', 'a photo of a dog', true, 2, 1],
      ],
    );
    assert.deepEqual(JSON.parse(md.ss_dataset_dirs), { instance_images: { n_repeats: 1, img_count: 3 } });
  });

  it('SD2 metadata: kohya model versions and modelspec architectures', () => {
    const md = (family: 'sd1' | 'sd2', prediction: 'epsilon' | 'v_prediction') => kohyaMetadata(adapters, { ...INFO, family, prediction, resolution: 768 });
    assert.equal(md('sd2', 'v_prediction').ss_base_model_version, 'sd_v2_v');
    assert.equal(md('sd2', 'epsilon').ss_base_model_version, 'sd_v2');
    assert.equal(md('sd2', 'epsilon').ss_v2, 'True');
    assert.equal(md('sd2', 'epsilon').ss_resolution, '(768, 768)');
  });

  it('reads back through readLora to the same adapters (fp16) with scale alpha / rank', async () => {
    const { file } = await exported(writeKohyaLora);
    const back = await readLora(file);
    assert.deepEqual([back.format, back.rank, back.alpha, back.scale, back.skipped], ['kohya', RANK, ALPHA, ALPHA / RANK, []]);
    assert.deepEqual(adapterTensors(back, 'unet'), rounded(unetLora));
    assert.deepEqual(adapterTensors(back, 'text_encoder'), rounded(teLora));
  });
});

describe('diffusers/PEFT LoRA export', () => {
  it('unet./text_encoder. PEFT names, F16, alpha / rank folded into lora_B, rank and alpha in the metadata', async () => {
    const { file, sink } = await exported(writePeftLora);
    assertOneTensorPerChunk(file, sink.chunks);
    assert.equal(file.names.length, 2 * (layers(unetLora).length + layers(teLora).length));
    for (const [prefix, src] of [
      ['unet', unetLora],
      ['text_encoder', teLora],
    ] as const)
      for (const [n, t] of src) {
        const e = file.entry(`${prefix}.${n}`);
        assert.deepEqual([e.dtype, e.shape], ['F16', t.shape], n);
        const want = n.endsWith('lora_B.weight') ? t.data.map((v) => (v * ALPHA) / RANK) : t.data;
        assert.deepEqual((await file.read(`${prefix}.${n}`)).data, roundToF16(want), `${n}: B holds (alpha / r) B`);
      }
    assert.ok(file.header.entries.has('unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0.lora_B.weight'));
    assert.ok(file.header.entries.has('text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight'));
    assert.ok(!file.names.some((n) => n.endsWith('.alpha')), 'no alpha tensors (diffusers would not rename them)');
    const md = file.metadata;
    assert.equal(md.format, 'pt');
    assert.equal(md['dreambooth_studio.lora_rank'], '4');
    assert.equal(md['dreambooth_studio.lora_alpha'], '8.0');
    assert.equal(md['dreambooth_studio.lora_alpha_folded'], 'true');
    assert.equal(md.lora_adapter_metadata, undefined, 'no diffusers adapter config: it would apply alpha a second time');
    assert.equal(md['modelspec.architecture'], 'stable-diffusion-v1/lora');
  });

  it('reads back through readLora with scale 1 and the same product scale * B', async () => {
    const { file } = await exported(writePeftLora);
    const back = await readLora(file);
    assert.deepEqual([back.format, back.rank, back.alpha, back.scale, back.skipped], ['peft', RANK, RANK, 1, []]);
    const want = rounded(new Map([...unetLora, ...teLora]), ALPHA / RANK);
    assert.deepEqual(new Map([...adapterTensors(back, 'unet'), ...adapterTensors(back, 'text_encoder')]), want);
    // Against the unrounded adapters: the effective B (scale x B) within fp16 rounding.
    for (const [n, t] of [...unetLora, ...teLora]) {
      if (!n.endsWith('lora_B.weight')) continue;
      const got = back.adapters.get(n.slice(0, -'.lora_B.weight'.length))!.B.data;
      assertChecks([
        compare(
          n,
          got,
          t.data.map((v) => (v * ALPHA) / RANK),
          { atol: 1e-3, rtol: 1e-3 },
        ),
      ]);
    }
  });
});

describe('readLora on files from other trainers', () => {
  const A = (r: number, i: number, v: number) => ({ shape: [r, i], data: new Float32Array(r * i).fill(v) });
  const q = 'down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q';
  const k = 'down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_k';
  const open = (m: Map<string, NamedTensor>, md: Record<string, string> = {}) =>
    SafetensorsFile.open(new BytesSource(writeSafetensors(m, md), 'other.safetensors'));

  it('kohya: per-module alphas fold into B; modules the engine cannot apply are skipped', async () => {
    const m = new Map<string, NamedTensor>([
      [`${kohyaName('unet', q)}.lora_down.weight`, A(4, 16, 1)],
      [`${kohyaName('unet', q)}.lora_up.weight`, A(16, 4, 1)],
      [`${kohyaName('unet', q)}.alpha`, { shape: [], data: Float32Array.of(2) }],
      [`${kohyaName('unet', k)}.lora_down.weight`, A(4, 16, 1)],
      [`${kohyaName('unet', k)}.lora_up.weight`, A(16, 4, 1)],
      [`${kohyaName('unet', k)}.alpha`, { shape: [], data: Float32Array.of(4) }],
      ['lora_unet_down_blocks_0_attentions_0_transformer_blocks_1_attn1_to_v.lora_down.weight', A(4, 16, 1)],
      ['lora_unet_down_blocks_0_attentions_0_transformer_blocks_1_attn1_to_v.lora_up.weight', A(16, 4, 1)],
      ['lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight', A(4, 16, 1)],
      ['lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight', A(16, 4, 1)],
    ]);
    const back = await readLora(await open(m));
    // Scales: q 2/4, k 4/4, the alpha-less to_v 1 (kohya: no alpha = rank) -> most common is 1.
    assert.equal(back.scale, 1);
    assert.equal(back.alpha, 4);
    assert.deepEqual(back.adapters.get(q)!.B.data, new Float32Array(64).fill(0.5));
    assert.deepEqual(back.adapters.get(k)!.B.data, new Float32Array(64).fill(1));
    assert.ok(back.adapters.has('down_blocks.0.attentions.0.transformer_blocks.1.attn1.to_v'));
    assert.deepEqual(back.skipped.sort(), [
      'lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight',
      'lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight',
    ]);
  });

  it("diffusers training scripts' names (lora.down/up, lora_linear_layer, attention processors) and lora_adapter_metadata", async () => {
    const te = 'text_model.encoder.layers.0.self_attn.q_proj';
    const m = new Map<string, NamedTensor>([
      [`unet.${q}.lora.down.weight`, A(4, 16, 1)],
      [`unet.${q}.lora.up.weight`, A(16, 4, 1)],
      ['unet.down_blocks.0.attentions.0.transformer_blocks.0.attn2.processor.to_out_lora.down.weight', A(4, 16, 1)],
      ['unet.down_blocks.0.attentions.0.transformer_blocks.0.attn2.processor.to_out_lora.up.weight', A(16, 4, 1)],
      [`text_encoder.${te}.lora_linear_layer.down.weight`, A(4, 32, 1)],
      [`text_encoder.${te}.lora_linear_layer.up.weight`, A(32, 4, 1)],
    ]);
    const back = await readLora(
      await open(m, { lora_adapter_metadata: JSON.stringify({ 'unet.lora_alpha': 8, 'unet.r': 4, 'text_encoder.lora_alpha': 8, 'text_encoder.r': 4 }) }),
    );
    assert.deepEqual([back.format, back.rank, back.scale, back.skipped], ['peft', 4, 2, []]);
    assert.deepEqual([...back.adapters.keys()].sort(), [q, 'down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_out.0', te].sort());
    assert.equal(back.adapters.get(te)!.component, 'text_encoder');
  });

  it('refuses adapters off the engine targets and a file with nothing to apply', async () => {
    const bad: LoraAdapters = {
      rank: 4,
      alpha: 4,
      unet: mapProvider(
        new Map([
          ['conv_in.lora_A.weight', A(4, 4, 0)],
          ['conv_in.lora_B.weight', A(4, 4, 0)],
        ]),
      ),
    };
    await assert.rejects(writeKohyaLora(memorySink(), bad, INFO), (e: Error) => e instanceof ExportError && /conv_in/.test(e.message));
    const wrongRank: LoraAdapters = { ...adapters, rank: 8 };
    await assert.rejects(writePeftLora(memorySink(), wrongRank, INFO), (e: Error) => e instanceof ExportError && /rank 8/.test(e.message));
    const half: LoraAdapters = { rank: 4, alpha: 4, unet: mapProvider(new Map([[`${q}.lora_A.weight`, A(4, 16, 0)]])) };
    await assert.rejects(writeKohyaLora(memorySink(), half, INFO), /lacks its lora_B/);
    await assert.rejects(readLora(await open(new Map([['lora_unet_conv_in.lora_down.weight', A(4, 4, 0)]]))), /no LoRA adapters the engine can apply/);
  });
});

describe('reloaded LoRA on the tiny model', () => {
  it('gives the same UNet and text-encoder outputs as the adapters it came from', async () => {
    const gpu = await testGpu();
    const model = await loadDiffusers(gpu, nodeFolder(tiny.folder), { dtype: 'f32' });
    const u = unetFixture();
    const up = (t: NamedTensor) => gpu.upload(t.data, t.shape, 'f32');
    const unet = async (lora: Map<string, NamedTensor>, scale: number) => {
      const w = upload(gpu, lora, new Map(model.unet.weights));
      return gpu.read(unetForward(gpu, model.unet.config, w, up(u.get('sample')!), up(u.get('timestep')!), up(u.get('encoder_hidden_states')!), null, scale));
    };
    const ids = clipIds();
    const text = async (lora: Map<string, NamedTensor>, scale: number) =>
      gpu.read(clipTextForward(gpu, model.textEncoder.config, upload(gpu, lora, new Map(model.textEncoder.weights)), ids.data, ids.shape[0], null, scale));
    const kohya = await readLora((await exported(writeKohyaLora)).file);
    const peft = await readLora((await exported(writePeftLora)).file);
    const s = ALPHA / RANK;
    const plain = await unet(new Map(), 1);
    const want = await unet(rounded(unetLora), s);
    const exact = await unet(unetLora, s);
    const wantText = await text(rounded(teLora), s);
    const checks = [
      compare('unet: kohya reloaded = its fp16 adapters', await unet(adapterTensors(kohya, 'unet'), kohya.scale), want, { atol: 0, rtol: 0 }),
      compare('unet: kohya reloaded vs f32 adapters', await unet(adapterTensors(kohya, 'unet'), kohya.scale), exact, { atol: 2e-3, rtol: 2e-3 }),
      compare('unet: PEFT reloaded vs f32 adapters', await unet(adapterTensors(peft, 'unet'), peft.scale), exact, { atol: 2e-3, rtol: 2e-3 }),
      compare('text: kohya reloaded = its fp16 adapters', await text(adapterTensors(kohya, 'text_encoder'), kohya.scale), wantText, { atol: 0, rtol: 0 }),
      compare('text: PEFT reloaded vs kohya', await text(adapterTensors(peft, 'text_encoder'), peft.scale), wantText, { atol: 2e-3, rtol: 2e-3 }),
    ];
    assertChecks(checks);
    const moved = Math.max(...want.map((v, i) => Math.abs(v - plain[i])));
    assert.ok(moved > 0.05, `the adapters change the UNet output (max |delta| ${moved})`);
  });
});
