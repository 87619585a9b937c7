// Parameter enumerations: exactly the tensors of the tiny fixtures (names and shapes), and SD 1.5's
// published parameter counts (UNet 859,520,964; VAE 83,653,863; CLIP ViT-L text 123,060,480).
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { readSafetensors } from '../../src/io/safetensors.ts';
import { clipParams, paramCount, SD15, unetParams, vaeParams } from '../../src/models/shapes.ts';
import { clipConfigFromJson } from '../../src/nn/clip.ts';
import { unetConfigFromJson } from '../../src/nn/unet.ts';
import { vaeConfigFromJson } from '../../src/nn/vae.ts';
import { FIXTURES } from '../helpers.ts';

const load = (n: string) => readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'modules', `${n}.safetensors`))));

function same(expected: Map<string, number[]>, fixture: ReturnType<typeof load>, keep: (n: string) => boolean): void {
  const got = new Map([...fixture.tensors].filter(([n]) => keep(n)).map(([n, t]) => [n, t.shape]));
  assert.deepEqual([...expected.keys()].sort(), [...got.keys()].sort());
  for (const [n, s] of expected) assert.deepEqual(s, got.get(n), n);
}

describe('parameter shapes', () => {
  it('match the tiny fixtures exactly', () => {
    for (const n of ['unet_sd1', 'unet_sd2']) {
      const f = load(n);
      same(unetParams(unetConfigFromJson(JSON.parse(f.metadata.config))), f, (k) => !['sample', 'timestep', 'encoder_hidden_states', 'out'].includes(k));
    }
    const v = load('vae');
    same(vaeParams(vaeConfigFromJson(JSON.parse(v.metadata.config))), v, (k) => /^(encoder|decoder|quant_conv|post_quant_conv)\./.test(k));
    const c = load('clip_sd1');
    same(clipParams(clipConfigFromJson(JSON.parse(c.metadata.config))), c, (k) => k.startsWith('text_model.'));
  });

  it("give SD 1.5's parameter counts", () => {
    assert.equal(paramCount(unetParams(SD15.unet)), 859_520_964);
    assert.equal(paramCount(vaeParams(SD15.vae)), 83_653_863);
    assert.equal(paramCount(clipParams(SD15.textEncoder)), 123_060_480);
  });
});
