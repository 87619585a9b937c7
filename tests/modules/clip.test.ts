// The CLIP text encoder module against a PyTorch forward of the same tiny model (SD1-like with
// quick-GELU, SD2-like with GELU), in f32 and f16. Tolerances: f32 1e-4 absolute + 1e-4 relative
// (two blocks of f32 matmuls and norms vs float64), f16 2e-2 + 1e-2 (f16 activations between ops).
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { clipConfigFromJson, clipTextForward } from '../../src/nn/clip.ts';
import { readSafetensors } from '../../src/io/safetensors.ts';
import { compare } from '../../src/selftest/check.ts';
import { assertChecks, FIXTURES, testGpu } from '../helpers.ts';

describe('CLIP text encoder (tiny) vs PyTorch', () => {
  for (const name of ['clip_sd1', 'clip_sd2'])
    for (const dtype of ['f32', 'f16'] as const)
      it(`${name} [${dtype}]`, async () => {
        const gpu = await testGpu();
        const { tensors, metadata } = readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'modules', `${name}.safetensors`))));
        const cfg = clipConfigFromJson(JSON.parse(metadata.config));
        const weights = new Map();
        for (const [k, t] of tensors) if (k.startsWith('text_model.')) weights.set(k, gpu.upload(t.data, t.shape, dtype, 'weights', k));
        const ids = tensors.get('input_ids')!;
        const out = clipTextForward(gpu, cfg, weights, ids.data, ids.shape[0]);
        const tol = dtype === 'f32' ? { atol: 1e-4, rtol: 1e-4 } : { atol: 2e-2, rtol: 1e-2 };
        assertChecks([compare('last_hidden_state', await gpu.read(out), tensors.get('last_hidden_state')!.data, tol)]);
        gpu.free(out, ...weights.values());
      });
});

describe('CLIP text encoder backward (tiny) vs PyTorch autograd', () => {
  for (const name of ['clip_sd1', 'clip_sd2'])
    for (const dtype of ['f32', 'f16'] as const)
      it(`every non-embedding weight gradient of sum(out * r), ${name} [${dtype}]`, async () => {
        const { Tape } = await import('../../src/nn/ops.ts');
        const gpu = await testGpu();
        const { tensors, metadata } = readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'modules', `${name}.safetensors`))));
        const cfg = clipConfigFromJson(JSON.parse(metadata.config));
        const weights = new Map();
        for (const [k, t] of tensors) if (k.startsWith('text_model.')) weights.set(k, gpu.upload(t.data, t.shape, dtype, 'weights', k));
        const ids = tensors.get('input_ids')!;
        const tape = new Tape(gpu);
        const out = clipTextForward(gpu, cfg, weights, ids.data, ids.shape[0], tape);
        const r = tensors.get('r')!;
        tape.backward(out, gpu.upload(r.data, r.shape, dtype));
        // Per tensor, scaled by its largest golden value g: f32 1e-4 g + 1e-4 |e|, f16 1e-2 g + 1e-2 |e|.
        // The key-projection bias has a true gradient of exactly 0 (softmax ignores a constant added to a
        // row of scores), so g is floored at a tenth of the model's largest gradient: what remains there
        // is rounding noise of the dK sums.
        const k = dtype === 'f32' ? 1e-4 : 1e-2;
        const maxOf = (d: Float32Array) => d.reduce((m, v) => Math.max(m, Math.abs(v)), 0);
        const globalMax = Math.max(...[...tensors].filter(([n]) => n.startsWith('grad.')).map(([, t]) => maxOf(t.data)));
        const checks = [];
        for (const [n, t] of tensors) {
          if (!n.startsWith('grad.')) continue;
          const g = tape.grads.get(weights.get(n.slice(5)));
          if (!g) throw new Error(`no gradient reached ${n.slice(5)}`);
          const scale = Math.max(maxOf(t.data), 0.1 * globalMax);
          checks.push(compare(n, await gpu.read(g), t.data, { atol: k * scale + 1e-12, rtol: k }));
        }
        assertChecks(checks);
      });
});

describe('embedding bad input', () => {
  it('an id outside the vocabulary or too many tokens is refused, naming the op', async () => {
    const { embedding } = await import('../../src/ops/embedding.ts');
    const assert = (await import('node:assert/strict')).default;
    const gpu = await testGpu();
    const table = gpu.zeros([10, 4], 'f32');
    const pos = gpu.zeros([3, 4], 'f32');
    assert.throws(() => embedding(gpu, [1, 2, 10], 1, table, pos), /embedding: token id 10 at 2 is outside the vocabulary of 10/);
    assert.throws(() => embedding(gpu, [1, 2, 3, 4], 1, table, pos), /embedding: 4 tokens per sequence but only 3 positions/);
    assert.throws(() => embedding(gpu, [1, 2], 1, table, gpu.zeros([3, 5], 'f32')), /embedding: table \[V,D\] and pos \[P,D\] must share D/);
  });
});
