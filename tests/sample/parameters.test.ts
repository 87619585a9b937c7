// The "parameters" text of a generated image, as AUTOMATIC1111 writes it, and the PNG chunk that carries it:
// written by us and read back (fast-png with its CRC check, our iTXt reader), and PNGs written by PIL the way
// A1111 saves them (tests/fixtures/images/make_a1111_png.py) read by us.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { describe, it } from 'node:test';
import { decode, encode } from 'fast-png';
import { formatParameters, modelNameOf, pngWithParameters, quoteValue, readPngParameters, type GenerationParameters } from '../../src/sample/parameters.ts';

const FIXTURES = new URL('../fixtures/images/', import.meta.url);

const base: GenerationParameters = {
  prompt: 'a photo of sks dog',
  negativePrompt: 'blurry, lowres',
  steps: 20,
  guidance: 7.5,
  seed: 42,
  width: 512,
  height: 512,
  sampler: 'dpm++2m',
  model: 'v1-5-pruned-emaonly.safetensors',
};

describe('A1111 parameters text', () => {
  it('writes prompt, negative prompt and the settings line in A1111 order', () => {
    assert.equal(
      formatParameters(base),
      'a photo of sks dog\nNegative prompt: blurry, lowres\nSteps: 20, Sampler: DPM++ 2M, CFG scale: 7.5, Seed: 42, Size: 512x512, Model: v1-5-pruned-emaonly',
    );
  });

  it('puts a LoRA into the prompt as <lora:NAME:STRENGTH>', () => {
    const text = formatParameters({ ...base, lora: { name: 'sks-dog', strength: 0.8 } });
    assert.equal(text.split('\n')[0], 'a photo of sks dog <lora:sks-dog:0.8>');
    assert.equal(formatParameters({ ...base, lora: { name: 'x', strength: 1 } }).split('\n')[0], 'a photo of sks dog <lora:x:1>');
  });

  it('writes the LoRA\'s short hash as A1111\'s Lora hashes: "name: <12 hex>"', () => {
    const hash = '1d3a20b81db41a06d10deadfe81c4dfb8d2701432cad4a456657b34601888942';
    const text = formatParameters({ ...base, lora: { name: 'sks-dog', strength: 0.8, hash } });
    assert.equal(
      text.split('\n')[2],
      'Steps: 20, Sampler: DPM++ 2M, CFG scale: 7.5, Seed: 42, Size: 512x512, Model: v1-5-pruned-emaonly, Lora hashes: "sks-dog: 1d3a20b81db4"',
    );
    // A1111 drops ':' and ',' from the alias so the pair list stays parseable.
    assert.match(formatParameters({ ...base, lora: { name: 'a:b,c', strength: 1, hash } }), /Lora hashes: "abc: 1d3a20b81db4"$/);
    assert.doesNotMatch(formatParameters({ ...base, lora: { name: 'x', strength: 1 } }), /Lora hashes/);
  });

  it('leaves out the negative prompt line when there is none (as A1111 does)', () => {
    assert.equal(
      formatParameters({ ...base, negativePrompt: '', sampler: 'ddim', width: 32, height: 48 }),
      'a photo of sks dog\nSteps: 20, Sampler: DDIM, CFG scale: 7.5, Seed: 42, Size: 32x48, Model: v1-5-pruned-emaonly',
    );
  });

  it("quotes values holding ',', ':' or a newline as JSON strings (infotext_utils.quote)", () => {
    assert.equal(quoteValue('plain-name'), 'plain-name');
    assert.equal(quoteValue('a, b'), '"a, b"');
    assert.equal(quoteValue('a:b'), '"a:b"');
    assert.match(formatParameters({ ...base, model: 'my, model.safetensors' }), /, Model: "my, model"$/);
  });

  it('names the model as A1111 does: the file name without folder and extension', () => {
    assert.equal(modelNameOf('models/Stable-diffusion/v1-5.ckpt'), 'v1-5');
    assert.equal(modelNameOf('stable-diffusion-v1-5/stable-diffusion-v1-5'), 'stable-diffusion-v1-5');
    assert.equal(modelNameOf('demo-sd1-tiny'), 'demo-sd1-tiny');
  });
});

describe('the PNG chunk', () => {
  const rgb = Uint8Array.from({ length: 4 * 3 * 3 }, (_, i) => (i * 37) % 256);

  it('a Latin-1 text goes in a tEXt chunk that fast-png reads back, pixels unchanged', () => {
    const text = formatParameters({ ...base, lora: { name: 'sks', strength: 0.5 }, prompt: 'café' });
    const png = pngWithParameters(rgb, 4, 3, text);
    const back = decode(png, { checkCrc: true });
    assert.equal(back.text.parameters, text);
    assert.deepEqual([...back.data], [...rgb]);
    assert.equal(readPngParameters(png), text);
  });

  it('other text goes in an iTXt chunk (UTF-8) with a valid CRC, read back by our reader', () => {
    const text = formatParameters({ ...base, prompt: 'ein Hund — 犬 🐕' });
    const png = pngWithParameters(rgb, 4, 3, text);
    const back = decode(png, { checkCrc: true }); // throws on a bad CRC
    assert.deepEqual([...back.data], [...rgb]);
    assert.equal(readPngParameters(png), text);
  });

  it('a PNG without parameters reads as null', () => {
    assert.equal(readPngParameters(encode({ width: 4, height: 3, data: rgb, channels: 3, depth: 8 })), null);
  });

  it('reads what PIL writes the way A1111 saves images (tEXt and iTXt)', () => {
    assert.equal(
      readPngParameters(readFileSync(new URL('a1111-parameters.png', FIXTURES))),
      'a photo of sks dog <lora:demo-lora:0.8>\nNegative prompt: blurry, lowres\nSteps: 20, Sampler: DPM++ 2M, CFG scale: 7.5, Seed: 42, Size: 32x32, Model: demo-sd1-tiny',
    );
    assert.equal(
      readPngParameters(readFileSync(new URL('a1111-parameters-utf8.png', FIXTURES))),
      'ein Foto von sks Hund — 犬\nSteps: 4, Sampler: DPM++ 2M, CFG scale: 5, Seed: 7, Size: 8x8, Model: "a:b"',
    );
  });
});
