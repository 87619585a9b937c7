// Results brought back from other trainers (issue 17, pipeline/imported.ts): LoRA files in the layouts
// diffusers' train_dreambooth_lora.py writes (PEFT lora_A/lora_B; the older lora.down/lora.up with .alpha
// network alphas; attention-processor to_q_lora.down/up) and kohya's, all holding the same adapters,
// give the tiny UNet and text encoder exactly the outputs of our own LoRA of those weights; they export
// to kohya and to a merged single file equal to our own LoRA's exports; a full diffusers folder exports
// as a single file; LoRAs of another architecture or rank layout are refused naming the key; and the
// command line runs both (`cli sample --lora`, `cli export`).
import assert from 'node:assert/strict';
import { execFileSync, spawnSync } from 'node:child_process';
import { readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { SafetensorsFile, writeSafetensors, type NamedTensor } from '../../src/io/safetensors.ts';
import { BytesSource } from '../../src/io/source.ts';
import { writeSingleFile } from '../../src/export/full.ts';
import { kohyaName, readLora, writeKohyaLora, writePeftLora, type LoraAdapters } from '../../src/export/lora.ts';
import { mergedLoraProvider } from '../../src/export/merge.ts';
import { mapProvider } from '../../src/export/provider.ts';
import { loadDiffusers } from '../../src/models/load.ts';
import { nodeFolder } from '../../src/models/folder-node.ts';
import { openDiffusers } from '../../src/models/source.ts';
import { clipTextForward } from '../../src/nn/clip.ts';
import { unetForward } from '../../src/nn/unet.ts';
import { applyLora, checkImportedLora, exportImported, loadedShapes, readImportedLora } from '../../src/pipeline/imported.ts';
import type { OpenedModel } from '../../src/pipeline/run.ts';
import { roundToF16 } from '../../src/util/half.ts';
import { testGpu } from '../helpers.ts';
import { clipIds, INFO, memorySink, randomAdapters, readFolderTensors, tempDir, tinyModel, unetFixture } from '../export/fixtures.ts';
import { cliArgs } from '../cli.ts';

const RANK = 4;
const ALPHA = 8; // scale alpha / rank = 2
const tiny = tinyModel();
const unetBase = readFolderTensors(tiny.folder, 'unet/diffusion_pytorch_model.safetensors');
const teBase = readFolderTensors(tiny.folder, 'text_encoder/model.safetensors');
/** Our own LoRA: engine (PEFT) names without prefix, applied at scale ALPHA / RANK. */
const ownUnet = randomAdapters(unetBase, false, RANK, 11);
const ownTe = randomAdapters(teBase, true, RANK, 12);
const layersOf = (m: Map<string, NamedTensor>) => [...m.keys()].filter((n) => n.endsWith('.lora_A.weight')).map((n) => n.slice(0, -'.lora_A.weight'.length));
const A = (m: Map<string, NamedTensor>, l: string) => m.get(`${l}.lora_A.weight`)!;
const B = (m: Map<string, NamedTensor>, l: string) => m.get(`${l}.lora_B.weight`)!;
/** B times 2 (alpha / rank folded in): exact in binary floating point, so x A^T (2B)^T = 2 (x A^T B^T) bit for bit. */
const B2 = (t: NamedTensor): NamedTensor => ({ shape: t.shape, data: t.data.map((v) => v * 2) });
const scalar = (v: number): NamedTensor => ({ shape: [], data: Float32Array.of(v) });

/** The same adapters in each layout another trainer writes (F32, so nothing is rounded on the way). */
function styles(): Record<string, { tensors: Map<string, NamedTensor>; metadata?: Record<string, string> }> {
  const peft = new Map<string, NamedTensor>();
  const old = new Map<string, NamedTensor>();
  const processor = new Map<string, NamedTensor>();
  const kohya = new Map<string, NamedTensor>();
  // What train_dreambooth_lora.py of diffusers 0.40 saves: convert_state_dict_to_diffusers(get_peft_model_state_dict(..))
  // (utils/state_dict_utils.py PEFT_TO_DIFFUSERS): the UNet's lora_A/B become lora.down/up, the text encoder's
  // lora_linear_layer.down/up; no alphas (lora_alpha = rank), so alpha / rank is in up here.
  const script = new Map<string, NamedTensor>();
  for (const l of layersOf(ownUnet)) script.set(`unet.${l}.lora.down.weight`, A(ownUnet, l)).set(`unet.${l}.lora.up.weight`, B2(B(ownUnet, l)));
  for (const l of layersOf(ownTe))
    script.set(`text_encoder.${l}.lora_linear_layer.down.weight`, A(ownTe, l)).set(`text_encoder.${l}.lora_linear_layer.up.weight`, B2(B(ownTe, l)));
  for (const l of layersOf(ownUnet)) {
    peft.set(`unet.${l}.lora_A.weight`, A(ownUnet, l)).set(`unet.${l}.lora_B.weight`, B(ownUnet, l));
    old.set(`unet.${l}.lora.down.weight`, A(ownUnet, l)).set(`unet.${l}.lora.up.weight`, B(ownUnet, l)).set(`unet.${l}.alpha`, scalar(ALPHA));
    // diffusers <= 0.20: unet.<attention>.processor.to_q_lora.down.weight (to_out.0 -> to_out_lora), no alpha.
    const m = /^(.*)\.(to_q|to_k|to_v|to_out)(?:\.0)?$/.exec(l)!;
    processor.set(`unet.${m[1]}.processor.${m[2]}_lora.down.weight`, A(ownUnet, l)).set(`unet.${m[1]}.processor.${m[2]}_lora.up.weight`, B2(B(ownUnet, l)));
    const k = kohyaName('unet', l);
    kohya.set(`${k}.lora_down.weight`, A(ownUnet, l)).set(`${k}.lora_up.weight`, B(ownUnet, l)).set(`${k}.alpha`, scalar(ALPHA));
  }
  for (const l of layersOf(ownTe)) {
    peft.set(`text_encoder.${l}.lora_A.weight`, A(ownTe, l)).set(`text_encoder.${l}.lora_B.weight`, B(ownTe, l));
    old
      .set(`text_encoder.${l}.lora.down.weight`, A(ownTe, l))
      .set(`text_encoder.${l}.lora.up.weight`, B(ownTe, l))
      .set(`text_encoder.${l}.alpha`, scalar(ALPHA));
    const m = /^(.*\.self_attn)\.(q|k|v|out)_proj$/.exec(l)!;
    processor.set(`text_encoder.${m[1]}.to_${m[2]}_lora.down.weight`, A(ownTe, l)).set(`text_encoder.${m[1]}.to_${m[2]}_lora.up.weight`, B2(B(ownTe, l)));
    const k = kohyaName('text_encoder', l);
    kohya.set(`${k}.lora_down.weight`, A(ownTe, l)).set(`${k}.lora_up.weight`, B(ownTe, l)).set(`${k}.alpha`, scalar(ALPHA));
  }
  return {
    'diffusers PEFT lora_A/lora_B + lora_adapter_metadata': {
      tensors: peft,
      metadata: {
        lora_adapter_metadata: JSON.stringify({ 'unet.r': RANK, 'unet.lora_alpha': ALPHA, 'text_encoder.r': RANK, 'text_encoder.lora_alpha': ALPHA }),
      },
    },
    'train_dreambooth_lora.py 0.40 output (unet lora.down/up, text_encoder lora_linear_layer)': { tensors: script },
    'diffusers lora.down/lora.up + .alpha network alphas': { tensors: old },
    'diffusers attention processors (to_q_lora.down/up, alpha folded)': { tensors: processor },
    'kohya lora_unet_/lora_te_ + alpha': { tensors: kohya },
  };
}

const open = (m: Map<string, NamedTensor>, name: string, md: Record<string, string> = {}) =>
  SafetensorsFile.open(new BytesSource(writeSafetensors(m, md), name));

describe('imported LoRA files on the tiny SD1 model', () => {
  it('every layout gives bit for bit the UNet and text-encoder outputs of our own LoRA of the same weights', async () => {
    const gpu = await testGpu();
    const model = await loadDiffusers(gpu, nodeFolder(tiny.folder), { dtype: gpu.computeDType });
    const u = unetFixture();
    const up = (t: NamedTensor) => gpu.upload(t.data, t.shape, gpu.computeDType);
    const ids = clipIds();
    const outputs = async (scale: number) => ({
      unet: await gpu.read(
        unetForward(
          gpu,
          model.unet.config,
          model.unet.weights,
          up(u.get('sample')!),
          gpu.upload(u.get('timestep')!.data, [u.get('timestep')!.shape[0]], 'f32'),
          up(u.get('encoder_hidden_states')!),
          null,
          scale,
        ),
      ),
      text: await gpu.read(clipTextForward(gpu, model.textEncoder.config, model.textEncoder.weights, ids.data, ids.shape[0], null, scale)),
    });
    const plain = await outputs(1);
    // Ours: the engine's own adapters next to the weights (what a LoRA run trains), at alpha / rank.
    const ownTensors = [...ownUnet, ...ownTe].map(([n, t]) => [n, up(t)] as const);
    for (const [n, t] of ownTensors) (n.startsWith('text_model.') ? model.textEncoder.weights : model.unet.weights).set(n, t);
    const own = await outputs(ALPHA / RANK);
    for (const [n, t] of ownTensors) {
      (n.startsWith('text_model.') ? model.textEncoder.weights : model.unet.weights).delete(n);
      gpu.free(t);
    }
    const moved = Math.max(...own.unet.map((v, i) => Math.abs(v - plain.unet[i])));
    assert.ok(moved > 0.05, `the adapters change the UNet output (max |delta| ${moved})`);
    for (const [style, { tensors, metadata }] of Object.entries(styles())) {
      const lora = await readImportedLora(await open(tensors, 'pytorch_lora_weights.safetensors', metadata));
      assert.equal(lora.adapters.size, layersOf(ownUnet).length + layersOf(ownTe).length, `${style}: every layer read`);
      assert.deepEqual(lora.skipped, [], `${style}: nothing skipped`);
      checkImportedLora(lora, loadedShapes(model), 'lora', 'tiny');
      const remove = applyLora(gpu, model, lora);
      const got = await outputs(lora.scale);
      remove();
      // Tolerance 0: the same values reach the same kernels in the same order (a folded alpha of 2 is exact).
      assert.deepEqual(got.unet, own.unet, `${style}: UNet output`);
      assert.deepEqual(got.text, own.text, `${style}: text-encoder output`);
    }
    assert.ok(![...model.unet.weights.keys()].some((n) => n.includes('lora_')), 'applyLora takes its adapters off again');
  });

  it('exports: kohya re-written from a diffusers file, and the merged single file equal to our own LoRA merged', async () => {
    const peft = styles()['diffusers lora.down/lora.up + .alpha network alphas'];
    const lora = await readImportedLora(await open(peft.tensors, 'pytorch_lora_weights.safetensors'));
    const source = await openDiffusers(nodeFolder(tiny.folder));
    const opened: OpenedModel = { kind: 'diffusers', name: 'tiny', reader: nodeFolder(tiny.folder), tokenizer: {} };
    try {
      checkImportedLora(lora, { unet: source.shapes('unet'), text_encoder: source.shapes('text_encoder') }, 'lora', 'tiny');
      // kohya: the same F16 adapters our own LoRA's kohya export holds (alpha 8, rank 4), read back alike.
      const kohya = memorySink();
      await exportImported({ opened, source, lora, loraName: 'pytorch_lora_weights.safetensors', format: 'lora-kohya', sink: kohya });
      const ownAdapters: LoraAdapters = { rank: RANK, alpha: ALPHA, unet: mapProvider(ownUnet), textEncoder: mapProvider(ownTe) };
      const ownKohya = memorySink();
      await writeKohyaLora(ownKohya, ownAdapters, INFO);
      const back = await SafetensorsFile.open(new BytesSource(kohya.bytes(), 'imported-kohya.safetensors'));
      const ownBack = await SafetensorsFile.open(new BytesSource(ownKohya.bytes(), 'own-kohya.safetensors'));
      assert.deepEqual([...back.names].sort(), [...ownBack.names].sort(), 'same kohya keys');
      for (const n of ownBack.names) assert.deepEqual((await back.read(n)).data, (await ownBack.read(n)).data, n);
      assert.equal(back.metadata.ss_network_dim, '4');
      assert.equal(back.metadata.ss_network_alpha, '8.0');
      // Merged single file: byte for byte what the run pipeline's merge of our own adapters writes.
      const merged = memorySink();
      const warnings: string[] = [];
      await exportImported({ opened, source, lora, loraName: 'l', format: 'full-single-file', sink: merged, onWarning: (m) => warnings.push(m) });
      const shapes = source.shapes('unet');
      const ownValues = new Map([...ownUnet].map(([n, t]) => [n, t.data] as const));
      const ownMerged = memorySink();
      await writeSingleFile(
        ownMerged,
        source,
        mergedLoraProvider({ shape: (n) => shapes.get(n)!, read: async (n) => (await source.read('unet', n)).data }, ownValues, ALPHA / RANK),
        { title: 'tiny + l', date: new Date(0) },
      );
      const got = await SafetensorsFile.open(new BytesSource(merged.bytes(), 'merged.safetensors'));
      const want = await SafetensorsFile.open(new BytesSource(ownMerged.bytes(), 'own.safetensors'));
      assert.deepEqual(got.names, want.names);
      let changed = 0;
      for (const n of want.names) {
        const g = (await got.read(n)).data;
        assert.deepEqual(g, (await want.read(n)).data, n);
        if (/attn1\.to_q\.weight$/.test(n)) changed++;
      }
      assert.ok(changed > 0, 'the merged layers are in the file');
      assert.match(warnings.join('\n'), /text-encoder LoRA is not merged/);
    } finally {
      await source.close();
    }
  });

  it('a full diffusers folder (train_dreambooth.py output) exports as a single file holding its weights', async () => {
    const source = await openDiffusers(nodeFolder(tiny.folder));
    const opened: OpenedModel = { kind: 'diffusers', name: 'tiny', reader: nodeFolder(tiny.folder), tokenizer: {} };
    try {
      const sink = memorySink();
      await exportImported({ opened, source, lora: null, loraName: '', format: 'full-single-file', sink });
      const file = await SafetensorsFile.open(new BytesSource(sink.bytes(), 'full.safetensors'));
      const q = 'model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight';
      assert.ok(file.names.includes(q), q);
      // The single file is F16 (our full-export dtype): the folder's F32 weights rounded to nearest even.
      assert.deepEqual((await file.read(q)).data, roundToF16(unetBase.get('down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight')!.data));
      await assert.rejects(
        exportImported({ opened, source, lora: null, loraName: '', format: 'lora-kohya', sink: memorySink() }),
        /lora-kohya holds LoRA adapters: give a LoRA file/,
      );
    } finally {
      await source.close();
    }
  });
});

describe('imported LoRA refusals name the key', () => {
  const l = 'down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k';
  const good = () => new Map<string, NamedTensor>([...ownUnet].filter(([n]) => n.startsWith(l)).map(([n, t]) => [`unet.${n}`, t]));
  const shapesOf = async (folder: string) => {
    const s = await openDiffusers(nodeFolder(folder));
    const out = { unet: s.shapes('unet'), text_encoder: s.shapes('text_encoder') };
    await s.close();
    return out;
  };

  it('another architecture: SDXL keys (kohya te1/te2, input_blocks, text_encoder_2), SD3/FLUX, an SD 2.x LoRA (1024-wide text) on SD 1.x, a deeper UNet', async () => {
    for (const key of [
      'lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight',
      'lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight',
      'lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight',
      'text_encoder_2.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight',
      'transformer.transformer_blocks.0.attn.to_q.lora_A.weight',
    ]) {
      const m = good().set(key, { shape: [4, 8], data: new Float32Array(32) });
      await assert.rejects(
        readImportedLora(await open(m, 'sdxl.safetensors')),
        (e: Error) => e.message.includes(`'${key}'`) && /LoRA for (SDXL|SD3)/.test(e.message),
        key,
      );
    }
    // An SD 2.x LoRA: its cross-attention to_k reads 1024-wide text (OpenCLIP-H); SD 1.x's (and the tiny SD1's) is narrower.
    const sd1Shapes = await shapesOf(tiny.folder);
    const [out, inSd1] = sd1Shapes.unet.get(`${l}.weight`)!;
    assert.notEqual(inSd1, 1024);
    const sd2 = new Map<string, NamedTensor>([
      [`unet.${l}.lora_A.weight`, { shape: [RANK, 1024], data: new Float32Array(RANK * 1024).fill(0.01) }],
      [`unet.${l}.lora_B.weight`, { shape: [out, RANK], data: new Float32Array(out * RANK).fill(0.01) }],
    ]);
    const lora = await readImportedLora(await open(sd2, 'sd2-lora.safetensors'));
    assert.throws(
      () => checkImportedLora(lora, sd1Shapes, 'sd2-lora.safetensors', 'tiny-sd1'),
      (e: Error) =>
        e.message.includes(`'unet.${l}.lora_A.weight' is [4,1024], made for a layer with 1024 inputs, but tiny-sd1's '${l}.weight' is [${out},${inSd1}]`),
    );
    // A layer the model lacks (a UNet with more transformer blocks).
    const extra = good().set(
      'unet.down_blocks.0.attentions.0.transformer_blocks.5.attn1.to_q.lora_A.weight',
      A(ownUnet, l.replace('attn2.to_k', 'attn1.to_q')),
    );
    extra.set('unet.down_blocks.0.attentions.0.transformer_blocks.5.attn1.to_q.lora_B.weight', B(ownUnet, l.replace('attn2.to_k', 'attn1.to_q')));
    const lx = await readImportedLora(await open(extra, 'deeper.safetensors'));
    assert.throws(
      () => checkImportedLora(lx, sd1Shapes, 'deeper.safetensors', 'tiny-sd1'),
      /transformer_blocks\.5\.attn1\.to_q\.lora_A\.weight' adapts the UNet layer .* which tiny-sd1 does not have/,
    );
  });

  it('bad rank layouts: down/up ranks differ, a missing half, a non-scalar alpha, non-finite values', async () => {
    const m1 = good();
    const b = m1.get(`unet.${l}.lora_B.weight`)!;
    m1.set(`unet.${l}.lora_B.weight`, { shape: [b.shape[0], 3], data: b.data.slice(0, b.shape[0] * 3) });
    await assert.rejects(
      readImportedLora(await open(m1, 'r.safetensors')),
      (e: Error) => e.message.includes(`'unet.${l}.lora_A.weight' [4,`) && /do not share a rank/.test(e.message),
    );
    const m2 = good();
    m2.delete(`unet.${l}.lora_B.weight`);
    await assert.rejects(readImportedLora(await open(m2, 'half.safetensors')), (e: Error) =>
      e.message.includes(`'unet.${l}.lora_A.weight' has no matching up`),
    );
    const m3 = good().set(`unet.${l}.alpha`, { shape: [2], data: Float32Array.of(4, 4) });
    await assert.rejects(readImportedLora(await open(m3, 'alpha.safetensors')), (e: Error) => e.message.includes(`'unet.${l}.alpha' must be one number`));
    const m4 = good();
    const a = m4.get(`unet.${l}.lora_A.weight`)!;
    m4.set(`unet.${l}.lora_A.weight`, { shape: a.shape, data: a.data.map((v, i) => (i === 5 ? NaN : v)) });
    await assert.rejects(readImportedLora(await open(m4, 'nan.safetensors')), (e: Error) =>
      e.message.includes(`'unet.${l}.lora_A.weight' holds a non-finite value`),
    );
  });
});

describe('command line: sample --lora and export', () => {
  const dir = tempDir();
  const cli = (...args: string[]) => execFileSync(process.execPath, cliArgs(...args), { stdio: ['ignore', 'pipe', 'pipe'] }).toString();
  /** diffusers' older file (lora.down/up, alpha folded into up) and our own PEFT export: the same F16 values. */
  async function files(): Promise<{ diffusers: string; ours: string }> {
    const sink = memorySink();
    await writePeftLora(sink, { rank: RANK, alpha: ALPHA, unet: mapProvider(ownUnet), textEncoder: mapProvider(ownTe) }, INFO);
    const ours = join(dir, 'ours-peft.safetensors');
    writeFileSync(ours, sink.bytes());
    const m = new Map<string, NamedTensor & { dtype: 'F16' }>();
    const prefixed: [string, NamedTensor][] = [
      ...[...ownUnet].map(([n, t]): [string, NamedTensor] => [`unet.${n}`, t]),
      ...[...ownTe].map(([n, t]): [string, NamedTensor] => [`text_encoder.${n}`, t]),
    ];
    for (const [n, t] of prefixed) {
      const key = n.replace('.lora_A.weight', '.lora.down.weight').replace('.lora_B.weight', '.lora.up.weight');
      m.set(key, { shape: t.shape, data: n.endsWith('lora_B.weight') ? t.data.map((v) => v * 2) : t.data, dtype: 'F16' });
    }
    const diffusers = join(dir, 'pytorch_lora_weights.safetensors');
    writeFileSync(diffusers, writeSafetensors(m));
    return { diffusers, ours };
  }

  it('sample --lora: a diffusers file draws the same image as our own LoRA, and not the base image', async () => {
    const { diffusers, ours } = await files();
    const png = (name: string, ...extra: string[]) => {
      const out = join(dir, `${name}.png`);
      cli(
        'sample',
        '--model',
        tiny.folder,
        '--prompt',
        'a photo of sks dog',
        '--width',
        '16',
        '--height',
        '16',
        '--steps',
        '2',
        '--seed',
        '3',
        '--out',
        out,
        ...extra,
      );
      return new Uint8Array(readFileSync(out));
    };
    const withDiffusers = png('diffusers', '--lora', diffusers);
    assert.deepEqual(png('ours', '--lora', ours), withDiffusers);
    assert.notDeepEqual(png('base'), withDiffusers);
  });

  it('export: a diffusers LoRA as kohya, a full folder as a single file; a bad LoRA refused with nothing written', async () => {
    const { diffusers } = await files();
    const kohya = join(dir, 'k.safetensors');
    const res = JSON.parse(cli('export', '--model', tiny.folder, '--lora', diffusers, '--format', 'lora-kohya', '--out', kohya));
    assert.equal(res.layers, layersOf(ownUnet).length + layersOf(ownTe).length);
    const back = await readLora(await SafetensorsFile.open(new BytesSource(new Uint8Array(readFileSync(kohya)), 'k')));
    assert.equal(back.format, 'kohya');
    assert.equal(back.scale, 1, 'the folded alpha stays in lora_up');
    const single = join(dir, 'full.safetensors');
    JSON.parse(cli('export', '--model', tiny.folder, '--format', 'full-single-file', '--out', single));
    assert.ok(readFileSync(single).length > 1000);
    const bad = join(dir, 'sdxl.safetensors');
    writeFileSync(
      bad,
      writeSafetensors(new Map([['lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight', { shape: [4, 8], data: new Float32Array(32) }]])),
    );
    const r = spawnSync(
      process.execPath,
      cliArgs('export', '--model', tiny.folder, '--lora', bad, '--format', 'lora-kohya', '--out', join(dir, 'no.safetensors')),
    );
    assert.equal(r.status, 1);
    assert.match(r.stderr.toString(), /'lora_te2_text_model_encoder_layers_0_self_attn_q_proj\.lora_down\.weight' is a key of a LoRA for SDXL/);
    assert.throws(() => readFileSync(join(dir, 'no.safetensors')), 'nothing written');
  });
});
