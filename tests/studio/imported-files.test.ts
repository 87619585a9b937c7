// "Bring results back": the merged checkpoint is not named like the LoRA it came from, and a file that is not
// safetensors is refused in a person's words (its name, what it is, what to choose), where the reader said
// "header length 2481321132518023700 is out of bounds 2..104857600".
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { SafetensorsFile } from '../../src/io/safetensors.ts';
import { BytesSource } from '../../src/io/source.ts';
import { fileKind, importedExportName, notSafetensorsMessage } from '../../src/studio/imported-files.ts';
import { parseModelConfig } from '../../src/studio/model-config.ts';

const bytes = (...b: (number | string)[]) => new Uint8Array(b.flatMap((x) => (typeof x === 'string' ? [...x].map((c) => c.charCodeAt(0)) : [x])));

describe('files brought back', () => {
  it('export names: LoRA formats keep the LoRA name; a merged full model names the model and the LoRA', () => {
    assert.equal(importedExportName('rex.safetensors', 'demo model', 'lora-kohya'), 'rex-lora.safetensors');
    assert.equal(importedExportName('rex.safetensors', 'demo model', 'lora-diffusers'), 'rex-lora-diffusers.safetensors');
    assert.equal(importedExportName('rex.safetensors', 'sd15.safetensors', 'full-single-file'), 'sd15+rex-merged.safetensors');
    assert.equal(importedExportName('rex.safetensors', 'sd15', 'diffusers-zip'), 'sd15+rex-merged-diffusers.zip');
    assert.equal(importedExportName(null, 'sd15.safetensors', 'full-single-file'), 'sd15.safetensors', 'no LoRA: the model itself');
  });

  it('what a wrong file is, and the message naming it', async () => {
    assert.equal(fileKind(bytes(0xff, 0xd8, 0xff, 0xe0)), 'a JPEG image');
    assert.equal(fileKind(bytes(0x89, 'PNG')), 'a PNG image');
    assert.equal(fileKind(bytes('RIFF', 0, 0, 0, 0, 'WEBP')), 'a WebP image');
    assert.equal(fileKind(bytes('PK', 3, 4)), 'a zip archive (a PyTorch .ckpt/.bin, or a zipped folder)');
    assert.equal(fileKind(bytes('# my notes\n')), 'a text file');
    assert.equal(fileKind(new Uint8Array()), 'an empty file');
    const jpeg = notSafetensorsMessage('holiday.jpg', bytes(0xff, 0xd8, 0xff, 0xe0), 'LoRA');
    assert.equal(
      jpeg,
      "holiday.jpg is a JPEG image, not a safetensors file. Choose the LoRA as a .safetensors file (kohya's, or diffusers' pytorch_lora_weights.safetensors).",
    );
    assert.match(notSafetensorsMessage('old.ckpt', bytes('PK', 3, 4), 'LoRA'), /convert it to \.safetensors first\.$/);
    // The issue's file: 8 bytes read as a header length of 2481321132518023700. The reader's refusal is what
    // the worker turns into this message (its test for "not a safetensors file").
    const issue = bytes(0x14, '"hello": 1, "world": 2}');
    await assert.rejects(SafetensorsFile.open(new BytesSource(issue, 'weird.safetensors')), /not a safetensors file \(header length 2481321132518023700/);
    const msg = notSafetensorsMessage('weird.safetensors', issue, 'LoRA');
    assert.match(msg, /^weird\.safetensors is not a safetensors file\. Choose the LoRA/);
    assert.doesNotMatch(msg, /header length|out of bounds/);
  });
});

describe("a checkpoint's config given beside it", () => {
  const json = (v: unknown) => new TextEncoder().encode(typeof v === 'string' ? v : JSON.stringify(v));
  it("reads the CLI's --config forms: per component, or one bare object for the UNet", () => {
    const c = { unet: { attention_head_dim: [2, 4] }, text_encoder_2: { num_attention_heads: 3 }, scheduler: { prediction_type: 'v_prediction' } };
    assert.deepEqual(parseModelConfig(json(c), 'xl.json'), c);
    assert.deepEqual(parseModelConfig(json({ norm_num_groups: 8 }), 'unet.json'), { unet: { norm_num_groups: 8 } });
  });

  it('refuses what is not one, naming the file and what is wrong', () => {
    assert.throws(() => parseModelConfig(json('{"unet": '), 'xl.json'), /^Error: xl\.json: not a JSON config/);
    assert.throws(() => parseModelConfig(new Uint8Array([0xff, 0xfe, 0x7b]), 'xl.json'), /xl\.json: not a JSON config/);
    assert.throws(() => parseModelConfig(json([1]), 'xl.json'), /xl\.json: a model config is a JSON object .* not an array/);
    assert.throws(() => parseModelConfig(json({ unet: {}, text_encoder3: {} }), 'xl.json'), /xl\.json: 'text_encoder3' is not a model component/);
    assert.throws(() => parseModelConfig(json({ vae: 4 }), 'xl.json'), /xl\.json: 'vae' must be an object of config\.json values, not 4/);
  });
});
