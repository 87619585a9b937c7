// Both layouts of the same tiny model load to the same engine weights: the UNet, VAE decoder and text
// encoder give bit-identical outputs from the diffusers folder and from the single-file checkpoint, and
// both equal the PyTorch goldens (f32 tolerances as in the module tests).
import assert from 'node:assert/strict';
import { copyFileSync, cpSync, mkdtempSync, readFileSync, renameSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import type { Gpu } from '../../src/gpu/device.ts';
import type { DType } from '../../src/gpu/tensor.ts';
import { readSafetensors, SafetensorsFile, SafetensorsWriter, type TensorSpec } from '../../src/io/safetensors.ts';
import { nodeFileSink } from '../../src/io/sink-node.ts';
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
  return {
    unet: await gpu.read(unet),
    image: await gpu.read(image),
    text: await gpu.read(text),
    golden: { unet: u.get('out')!.data, image: v.get('decoded')!.data, text: c.get('last_hidden_state')!.data },
  };
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
    const m = new Map(
      [...f.tensors]
        .filter(([n]) => n !== drop)
        .map(([n, t]) => [
          n,
          reshape && n === reshape[0]
            ? {
                shape: reshape[1],
                data: t.data.subarray(
                  0,
                  reshape[1].reduce((a, b) => a * b, 1),
                ),
              }
            : t,
        ]),
    );
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
    await assert.rejects(
      load(p),
      (e: Error) =>
        e instanceof ModelError && /bad-missing\.safetensors: unet is missing 1 tensor\(s\), e\.g\. mid_block\.attentions\.0\.proj_out\.weight/.test(e.message),
    );
  });

  it('a misshaped tensor', async () => {
    const p = rewrite(null, ['first_stage_model.decoder.conv_out.bias', [2]]);
    await assert.rejects(
      load(p),
      (e: Error) => e instanceof ModelError && /vae tensor decoder\.conv_out\.bias is \[2\] but its config needs \[3\]/.test(e.message),
    );
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
    const ua = await gpu.read(
      unetForward(gpu, fromFolder.unet.config, fromFolder.unet.weights, up(u.get('sample')!), up(u.get('timestep')!), up(u.get('encoder_hidden_states')!)),
    );
    const ub = await gpu.read(
      unetForward(gpu, fromSingle.unet.config, fromSingle.unet.weights, up(u.get('sample')!), up(u.get('timestep')!), up(u.get('encoder_hidden_states')!)),
    );
    assertChecks([
      compare('text encoder: single file = folder', b, a, { atol: 0, rtol: 0 }),
      compare('text encoder vs torch', a, c.get('last_hidden_state')!.data, { atol: 1e-4, rtol: 1e-4 }),
      compare('unet: single file = folder', ub, ua, { atol: 0, rtol: 0 }),
      compare('unet vs torch', ua, u.get('out')!.data, { atol: 5e-4, rtol: 2e-4 }),
    ]);
  });
});

describe('loading refuses weights it cannot honour, naming the tensor and where it lives', () => {
  /**
   * Rewrites a safetensors file tensor by tensor from its raw bytes; `edit` may replace a tensor's
   * dtype and bytes (the rest are copied as stored).
   */
  async function rewriteRaw(
    path: string,
    edit: (name: string, dtype: string, bytes: Uint8Array) => { dtype: string; bytes: Uint8Array } | null,
  ): Promise<void> {
    const src = await SafetensorsFile.open(await NodeFileSource.open(path));
    const out: { spec: TensorSpec; bytes: Uint8Array }[] = [];
    for (const name of src.names) {
      const e = src.entry(name);
      const raw = await src.readRaw(name);
      const changed = edit(name, e.dtype, raw);
      out.push({ spec: { name, dtype: changed?.dtype ?? e.dtype, shape: e.shape }, bytes: changed?.bytes ?? raw });
    }
    await src.source.close?.();
    const w = new SafetensorsWriter(
      await nodeFileSink(`${path}.new`),
      out.map((o) => o.spec),
      src.metadata,
    );
    for (const o of out) await w.write(o.spec.name, o.bytes);
    await w.finish();
    renameSync(`${path}.new`, path);
  }
  const u16 = (bytes: Uint8Array) => new Uint16Array(bytes.slice().buffer);
  const f32 = (bytes: Uint8Array) => new Float32Array(bytes.slice().buffer);
  /** f32 -> bf16 by keeping the upper half of the bits (how BF16 checkpoints store it, truncated). */
  const bf16 = (values: Float32Array) => new Uint8Array(Uint16Array.from(new Uint32Array(values.buffer), (b) => b >>> 16).buffer);
  const weightBytes = (gpu: Gpu) => gpu.allocator.report().byTag.weights.current;

  async function loadFile(gpu: Gpu, p: string, dtype: DType = 'f32') {
    const file = await SafetensorsFile.open(await NodeFileSource.open(p));
    try {
      return await loadSingleFile(gpu, file, { dtype, family: 'sd1', overrides: tiny.overrides });
    } finally {
      await file.source.close?.();
    }
  }

  it('NaN and Inf in a UNet tensor of an f16 single file (checked after conversion)', async () => {
    const gpu = await testGpu();
    const p = join(mkdtempSync(join(tmpdir(), 'dbs-nan-')), 'tiny-nan.safetensors');
    copyFileSync(tiny.singleFile, p);
    await rewriteRaw(p, (name, dtype, bytes) => {
      if (name !== 'model.diffusion_model.input_blocks.1.0.in_layers.2.weight') return null;
      assert.equal(dtype, 'F16');
      const v = u16(bytes);
      v.set([0x7e00, 0x7c00, 0xfc00], 5); // NaN, +Inf, -Inf in f16
      return { dtype, bytes: new Uint8Array(v.buffer) };
    });
    const before = weightBytes(gpu);
    await assert.rejects(
      loadFile(gpu, p),
      (e: Error) =>
        e instanceof ModelError &&
        e.message ===
          'tiny-nan.safetensors: unet tensor down_blocks.0.resnets.0.conv1.weight (model.diffusion_model.input_blocks.1.0.in_layers.2.weight) holds 3 non-finite values (NaN/Inf): this checkpoint is corrupt or was saved after a diverged run; use another file',
    );
    assert.equal(weightBytes(gpu), before, 'the tensors uploaded before it are freed');
  });

  it('an Inf in a BF16 VAE and a NaN in an F32 text encoder of a diffusers folder', async () => {
    const gpu = await testGpu();
    const d = join(mkdtempSync(join(tmpdir(), 'dbs-nan-')), 'folder');
    cpSync(tiny.folder, d, { recursive: true });
    await rewriteRaw(join(d, 'vae/diffusion_pytorch_model.safetensors'), (name, dtype, bytes) => {
      const v = f32(bytes);
      if (name === 'decoder.conv_out.weight') v[7] = Infinity;
      return { dtype: 'BF16', bytes: bf16(v) };
    });
    const before = weightBytes(gpu);
    // The UNet is loaded first and whole: its weights must go again when the VAE is refused.
    await assert.rejects(
      loadDiffusers(gpu, folder(d), { dtype: 'f32' }),
      (e: Error) =>
        e instanceof ModelError &&
        /^folder: vae tensor decoder\.conv_out\.weight \(vae\/diffusion_pytorch_model\.safetensors\) holds 1 non-finite value \(NaN\/Inf\): this checkpoint is corrupt/.test(
          e.message,
        ),
    );
    assert.equal(weightBytes(gpu), before, 'the UNet uploaded before it is freed');
    await rewriteRaw(join(d, 'vae/diffusion_pytorch_model.safetensors'), (name, dtype, bytes) => {
      if (name !== 'decoder.conv_out.weight') return null;
      const v = new Uint16Array(bytes.slice().buffer);
      v[7] = 0x3f80; // 1.0: the BF16 VAE is finite again
      return { dtype, bytes: new Uint8Array(v.buffer) };
    });
    await rewriteRaw(join(d, 'text_encoder/model.safetensors'), (name, dtype, bytes) => {
      if (name !== 'text_model.final_layer_norm.weight') return null;
      const v = f32(bytes);
      v[0] = NaN;
      return { dtype, bytes: new Uint8Array(v.buffer) };
    });
    await assert.rejects(
      loadDiffusers(gpu, folder(d), { dtype: 'f32' }),
      (e: Error) =>
        e instanceof ModelError &&
        /^folder: text_encoder tensor text_model\.final_layer_norm\.weight \(text_encoder\/model\.safetensors\) holds 1 non-finite value \(NaN\/Inf\)/.test(
          e.message,
        ),
    );
    assert.equal(weightBytes(gpu), before);
  });

  it("values past f16's range are refused for f16 weights and load in f32", async () => {
    const gpu = await testGpu();
    const d = join(mkdtempSync(join(tmpdir(), 'dbs-big-')), 'folder');
    cpSync(tiny.folder, d, { recursive: true });
    await rewriteRaw(join(d, 'text_encoder/model.safetensors'), (name, dtype, bytes) => {
      if (name !== 'text_model.final_layer_norm.bias') return null;
      const v = f32(bytes);
      v[0] = 65520; // the first value f16 rounds to Inf (65504 is its largest)
      v[1] = -1e6;
      v[2] = 65504;
      return { dtype, bytes: new Uint8Array(v.buffer) };
    });
    await assert.rejects(
      loadDiffusers(gpu, folder(d), { dtype: 'f16' }),
      (e: Error) =>
        e instanceof ModelError &&
        /: text_encoder tensor text_model\.final_layer_norm\.bias \(text_encoder\/model\.safetensors\) holds 2 values beyond f16's range \(\|x\| >= 65520\), which would be Inf in f16 weights: load it in f32/.test(
          e.message,
        ),
    );
    const m = await loadDiffusers(gpu, folder(d), { dtype: 'f32' });
    assert.equal(m.textEncoder.weights.size, 36);
  });

  it('a config whose heads do not divide its width is refused before anything is allocated', async () => {
    const gpu = await testGpu();
    const d = join(mkdtempSync(join(tmpdir(), 'dbs-heads-')), 'folder');
    cpSync(tiny.folder, d, { recursive: true });
    const te = JSON.parse(readFileSync(join(d, 'text_encoder/config.json'), 'utf8'));
    writeFileSync(join(d, 'text_encoder/config.json'), JSON.stringify({ ...te, num_attention_heads: 12 }));
    gpu.allocator.resetPeak();
    const { current } = gpu.allocator.report();
    await assert.rejects(
      loadDiffusers(gpu, folder(d), { dtype: 'f32' }),
      (e: Error) =>
        e instanceof ModelError &&
        /^folder: text_encoder: hidden_size 32 is not divisible by num_attention_heads 12 \(text_encoder\/config\.json\): fix the config or pass --config with the model's text_encoder config$/.test(
          e.message,
        ),
    );
    assert.equal(gpu.allocator.report().peak, current, 'no GPU buffer was created');
  });
});
