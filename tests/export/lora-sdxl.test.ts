// SDXL kohya LoRA export: module names as kohya's sdxl_train_network.py writes them (SGM UNet paths such as
// lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q, lora_te1_/lora_te2_ for the two encoders), every
// UNet key naming a real module of the tiny SDXL single file, the values and alpha as trained, and the SDXL
// metadata (ss_base_model_version sdxl_base_v1-0, modelspec.architecture stable-diffusion-xl-v1-base/lora).
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, describe, it } from 'node:test';
import { sdxlKohyaName, writeSdxlKohyaLora, writeSdxlPeftLora, type SdxlLoraAdapters } from '../../src/export/lora-sdxl.ts';
import { mapProvider } from '../../src/export/provider.ts';
import { SafetensorsFile, type NamedTensor } from '../../src/io/safetensors.ts';
import { BytesSource } from '../../src/io/source.ts';
import { NodeFileSource } from '../../src/io/source-node.ts';
import type { UnetLayout } from '../../src/models/keymap.ts';
import { loraTargets } from '../../src/nn/lora.ts';
import { roundToF16 } from '../../src/util/half.ts';
import { writeTinySdxl } from '../fixtures/models/make-tiny-sdxl.ts';
import { INFO, memorySink } from './fixtures.ts';

const SDXL_BASE: UnetLayout = { blocks: 3, layersPerBlock: 2, downAttention: [false, true, true], upAttention: [true, true, false] };
const dir = mkdtempSync(join(tmpdir(), 'lora-sdxl-'));
after(() => rmSync(dir, { recursive: true, force: true }));

function tinyAdapters() {
  const tiny = writeTinySdxl(dir);
  let seed = 1;
  const rand = () => ((seed = (seed * 16807) % 2147483647) / 2147483647 - 0.5) * 0.2;
  const adapters = (weights: Map<string, NamedTensor>, kind: 'unet' | 'text_encoder') => {
    const m = new Map<string, NamedTensor>();
    for (const layer of loraTargets(kind, weights.keys())) {
      const [o, i] = weights.get(`${layer}.weight`)!.shape;
      m.set(`${layer}.lora_A.weight`, { shape: [4, i], data: roundToF16(Float32Array.from({ length: 4 * i }, rand)) });
      m.set(`${layer}.lora_B.weight`, { shape: [o, 4], data: roundToF16(Float32Array.from({ length: 4 * o }, rand)) });
    }
    return m;
  };
  const unet = adapters(tiny.weights.unet, 'unet');
  const te1 = adapters(tiny.weights.text_encoder, 'text_encoder');
  const te2 = adapters(tiny.weights.text_encoder_2, 'text_encoder');
  const layout: UnetLayout = { blocks: 2, layersPerBlock: 1, downAttention: [false, true], upAttention: [true, false] };
  const a: SdxlLoraAdapters = { rank: 4, alpha: 8, layout, unet: mapProvider(unet), textEncoder: mapProvider(te1), textEncoder2: mapProvider(te2) };
  return { tiny, unet, te1, te2, layout, a };
}

describe('SDXL kohya LoRA', () => {
  it("names SDXL base's modules as kohya does", () => {
    const n = (l: string) => sdxlKohyaName('unet', l, SDXL_BASE);
    assert.equal(n('down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q'), 'lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q');
    assert.equal(n('down_blocks.2.attentions.1.transformer_blocks.9.attn2.to_k'), 'lora_unet_input_blocks_8_1_transformer_blocks_9_attn2_to_k');
    assert.equal(n('mid_block.attentions.0.transformer_blocks.3.attn2.to_out.0'), 'lora_unet_middle_block_1_transformer_blocks_3_attn2_to_out_0');
    assert.equal(n('up_blocks.0.attentions.2.transformer_blocks.9.attn1.to_v'), 'lora_unet_output_blocks_2_1_transformer_blocks_9_attn1_to_v');
    assert.equal(n('up_blocks.1.attentions.0.transformer_blocks.1.attn1.to_q'), 'lora_unet_output_blocks_3_1_transformer_blocks_1_attn1_to_q');
    assert.equal(
      sdxlKohyaName('te2', 'text_model.encoder.layers.31.self_attn.out_proj', SDXL_BASE),
      'lora_te2_text_model_encoder_layers_31_self_attn_out_proj',
    );
  });

  it('writes every adapter of the tiny SDXL model with its values, alpha and SDXL metadata', async () => {
    const { tiny, unet, te1, te2, layout, a } = tinyAdapters();
    const sink = memorySink();
    await writeSdxlKohyaLora(sink, a, { ...INFO, resolution: 1024, baseModelName: 'tiny-sdxl.safetensors' });
    const file = await SafetensorsFile.open(new BytesSource(sink.bytes(), 'lora.safetensors'));
    const md = file.header.metadata;
    assert.equal(md.ss_base_model_version, 'sdxl_base_v1-0');
    assert.equal(md['modelspec.architecture'], 'stable-diffusion-xl-v1-base/lora');
    assert.equal(md['modelspec.resolution'], '1024x1024');
    assert.equal(md.ss_v2, 'False');
    assert.equal(md.ss_network_dim, '4');
    assert.equal(md.ss_network_alpha, '8.0');
    assert.equal(md.ss_resolution, '(1024, 1024)');
    // Every UNet module is a real SGM module of the single file (what A1111 and ComfyUI match against).
    const single = await SafetensorsFile.open(await NodeFileSource.open(tiny.singleFile));
    const sgm = new Set(
      single.names.filter((k) => k.startsWith('model.diffusion_model.') && k.endsWith('.weight')).map((k) => k.slice(22, -7).replace(/\./g, '_')),
    );
    await single.source.close?.();
    const groups = { lora_unet_: unet, lora_te1_: te1, lora_te2_: te2 };
    let count = 0;
    for (const [prefix, src] of Object.entries(groups)) {
      const layers = new Set([...src.keys()].map((k) => k.replace(/\.lora_[AB]\.weight$/, '')));
      assert.ok(layers.size > 0);
      for (const layer of layers) {
        const module = prefix === 'lora_unet_' ? sdxlKohyaName('unet', layer, layout) : `${prefix}${layer.replace(/\./g, '_')}`;
        if (prefix === 'lora_unet_') assert.ok(sgm.has(module.slice(10)), `${module} names a module of the SGM UNet`);
        assert.deepEqual((await file.read(`${module}.lora_down.weight`)).data, src.get(`${layer}.lora_A.weight`)!.data);
        assert.deepEqual((await file.read(`${module}.lora_up.weight`)).data, src.get(`${layer}.lora_B.weight`)!.data);
        assert.deepEqual([...(await file.read(`${module}.alpha`)).data], [8]);
        count += 3;
      }
    }
    assert.equal(file.names.length, count, 'nothing else in the file');
  });

  it('writes the diffusers SDXL LoRA: unet., text_encoder., text_encoder_2. with alpha / rank folded into lora_B', async () => {
    const { unet, te1, te2, a } = tinyAdapters();
    const sink = memorySink();
    await writeSdxlPeftLora(sink, a, { ...INFO, resolution: 1024, baseModelName: 'tiny-sdxl.safetensors' });
    const file = await SafetensorsFile.open(new BytesSource(sink.bytes(), 'pytorch_lora_weights.safetensors'));
    assert.equal(file.header.metadata['modelspec.architecture'], 'stable-diffusion-xl-v1-base/lora');
    assert.equal(file.header.metadata['dreambooth_studio.lora_alpha_folded'], 'true');
    let count = 0;
    for (const [prefix, src] of [
      ['unet', unet],
      ['text_encoder', te1],
      ['text_encoder_2', te2],
    ] as const)
      for (const [n, t] of src) {
        const got = (await file.read(`${prefix}.${n}`)).data;
        // lora_B carries alpha / rank = 2 (exact in f16: a power of two).
        assert.deepEqual(got, n.endsWith('lora_B.weight') ? t.data.map((v) => v * 2) : t.data, `${prefix}.${n}`);
        count++;
      }
    assert.equal(file.names.length, count);
  });
});
