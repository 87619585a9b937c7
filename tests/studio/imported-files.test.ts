// "Bring results back": the merged checkpoint is not named like the LoRA it came from, and a file that is not
// safetensors is refused in a person's words (its name, what it is, what to choose), where the reader said
// "header length 2481321132518023700 is out of bounds 2..104857600".
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { SafetensorsFile } from '../../src/io/safetensors.ts';
import { BytesSource } from '../../src/io/source.ts';
import { fileKind, importedExportName, notSafetensorsMessage } from '../../src/studio/imported-files.ts';

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
