// The SDXL pieces against PyTorch (tests/fixtures/modules/gen_sdxl.py, a tiny SDXL-shaped model): the UNet
// with transformer_layers_per_block [1, 2], no attention in its first down block, linear projections and the
// text_time addition embedding, forward and every parameter gradient plus text_embeds'; both text encoders'
// penultimate hidden states concatenated and encoder 2's pooled, projected EOS row, forward and every weight
// gradient. Tolerances as the SD 1 tests justify them: outputs f32 5e-4 + 2e-4 relative, f16 5e-2 + 2e-2
// (some 60 ops deep, f16 activations between ops); gradients per tensor scaled by its largest golden value g,
// f32 1e-4 g, f16 1e-2 g (a few hundred ops deep).
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { readSafetensors } from '../../src/io/safetensors.ts';
import { clipConfigFromJson } from '../../src/nn/clip.ts';
import { Tape } from '../../src/nn/ops.ts';
import { sdxlTextEncode } from '../../src/nn/sdxl.ts';
import { unetConfigFromJson, unetForward } from '../../src/nn/unet.ts';
import { mseLoss, mseLossBackward } from '../../src/ops/reduce.ts';
import type { Gpu } from '../../src/gpu/device.ts';
import type { Tensor } from '../../src/gpu/tensor.ts';
import { compare, type Check } from '../../src/selftest/check.ts';
import { assertChecks, FIXTURES, testGpu } from '../helpers.ts';

const load = (n: string) => readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'modules', `${n}.safetensors`))));
const maxAbs = (d: Float32Array) => d.reduce((m, v) => Math.max(m, Math.abs(v)), 0);

/** One compare per golden gradient, scaled by its largest value (floored at `floor`). */
async function gradChecks(
  gpu: Gpu,
  tape: Tape,
  golden: Map<string, { data: Float32Array }>,
  prefix: string,
  weights: Map<string, Tensor>,
  k: number,
  floor = 0,
) {
  const checks: Check[] = [];
  for (const [n, t] of golden) {
    if (!n.startsWith(prefix)) continue;
    const g = tape.grads.get(weights.get(n.slice(prefix.length))!);
    assert.ok(g, `no gradient reached ${n.slice(prefix.length)}`);
    const scale = Math.max(maxAbs(t.data), floor);
    checks.push(compare(n, await gpu.read(g), t.data, { atol: k * scale + 1e-12, rtol: k }));
  }
  return checks;
}

describe('SDXL UNet (tiny) vs PyTorch', () => {
  for (const dtype of ['f32', 'f16'] as const)
    it(`forward and every gradient, text_time embedding and transformer depth [${dtype}]`, async () => {
      const gpu = await testGpu();
      const { tensors, metadata } = load('unet_sdxl');
      const cfg = unetConfigFromJson(JSON.parse(metadata.config));
      assert.deepEqual(cfg.transformerLayers, [1, 2]);
      assert.deepEqual(cfg.textTime, { timeEmbedDim: 8, projectionInputDim: 88 });
      const g = (k: string) => tensors.get(k)!;
      const weights = new Map<string, Tensor>();
      for (const [k, t] of tensors)
        if (!/^(grad|grad_input)\.|^(sample|timestep|encoder_hidden_states|text_embeds|time_ids|out|target|loss)$/.test(k))
          weights.set(k, gpu.upload(t.data, t.shape, dtype, 'weights', k));
      const up = (k: string, dt = dtype) => gpu.upload(g(k).data, g(k).shape, dt);
      const textEmbeds = up('text_embeds');
      const tape = new Tape(gpu);
      const out = unetForward(gpu, cfg, weights, up('sample'), up('timestep', 'f32'), up('encoder_hidden_states'), tape, 1, false, {
        textEmbeds,
        timeIds: up('time_ids', 'f32'),
      });
      const target = up('target');
      const outTol = dtype === 'f32' ? { atol: 5e-4, rtol: 2e-4 } : { atol: 5e-2, rtol: 2e-2 };
      const checks: Check[] = [compare('unet out', await gpu.read(out), g('out').data, outTol)];
      const lossT = mseLoss(gpu, out, target);
      checks.push(compare('loss', await gpu.read(lossT), g('loss').data, dtype === 'f32' ? { atol: 1e-6, rtol: 1e-4 } : { atol: 1e-3, rtol: 1e-2 }));
      tape.backward(out, mseLossBackward(gpu, out, target));
      const k = dtype === 'f32' ? 1e-4 : 1e-2;
      checks.push(...(await gradChecks(gpu, tape, tensors, 'grad.', weights, k)));
      const dText = tape.grads.get(textEmbeds);
      assert.ok(dText, 'the gradient reaches text_embeds');
      const want = g('grad_input.text_embeds').data;
      checks.push(compare('d text_embeds', await gpu.read(dText), want, { atol: k * maxAbs(want), rtol: k }));
      assert.equal(checks.length, 3 + weights.size, 'one gradient check per parameter');
      assertChecks(checks);
    });

  it('refuses missing SDXL inputs and time ids of the wrong length, naming them', async () => {
    const gpu = await testGpu();
    const { tensors, metadata } = load('unet_sdxl');
    const cfg = unetConfigFromJson(JSON.parse(metadata.config));
    const weights = new Map<string, Tensor>();
    for (const [k, t] of tensors)
      if (!k.includes('.') || k.startsWith('grad')) continue;
      else weights.set(k, gpu.upload(t.data, t.shape, 'f32', 'weights', k));
    const up = (k: string) => gpu.upload(tensors.get(k)!.data, tensors.get(k)!.shape, 'f32');
    const args = [up('sample'), up('timestep'), up('encoder_hidden_states')] as const;
    assert.throws(() => unetForward(gpu, cfg, weights, ...args), /needs text_embeds and time_ids/);
    const five = gpu.upload(new Float32Array(10), [2, 5], 'f32');
    assert.throws(
      () => unetForward(gpu, cfg, weights, ...args, null, 1, false, { textEmbeds: up('text_embeds'), timeIds: five }),
      /time_ids must be \[2,6\].*got \[2,5\]/,
    );
    assert.throws(
      () => unetForward(gpu, cfg, weights, ...args, null, 1, false, { textEmbeds: gpu.upload(new Float32Array(20), [2, 10], 'f32'), timeIds: up('time_ids') }),
      /text_embeds must be \[2,40\]/,
    );
  });
});

describe('SDXL text encoders (tiny) vs PyTorch', () => {
  for (const dtype of ['f32', 'f16'] as const)
    it(`penultimate hidden states concatenated, pooled projection, and every gradient [${dtype}]`, async () => {
      const gpu = await testGpu();
      const { tensors, metadata } = load('clip_sdxl');
      const enc = (p: 'te1' | 'te2') => {
        const weights = new Map<string, Tensor>();
        for (const [k, t] of tensors) if (k.startsWith(`${p}.`)) weights.set(k.slice(4), gpu.upload(t.data, t.shape, dtype, 'weights', k));
        return { config: clipConfigFromJson(JSON.parse(metadata[p])), weights };
      };
      const [te1, te2] = [enc('te1'), enc('te2')];
      assert.equal(te1.config.projectionDim, undefined, "a CLIPTextModel config's projection_dim names no weight");
      assert.equal(te2.config.projectionDim, 40);
      const tape = new Tape(gpu);
      const ids = (k: string) => tensors.get(k)!.data;
      const r = sdxlTextEncode(gpu, te1, te2, ids('input_ids'), ids('input_ids_2'), 2, tape);
      assert.deepEqual(r.context.shape, [2, 77, 80]);
      assert.deepEqual(r.pooled.shape, [2, 40]);
      const tol = dtype === 'f32' ? { atol: 1e-4, rtol: 1e-4 } : { atol: 2e-2, rtol: 1e-2 };
      const checks: Check[] = [
        compare('prompt_embeds', await gpu.read(r.context), tensors.get('prompt_embeds')!.data, tol),
        compare('pooled', await gpu.read(r.pooled), tensors.get('pooled')!.data, tol),
      ];
      // d(sum(prompt * r1) + sum(pooled * r2)): two outputs, so the pooled one's backward is recorded first
      // by adding both seeds on one tape (pooled's tape records precede the context's transposes).
      const up = (k: string) => gpu.upload(tensors.get(k)!.data, tensors.get(k)!.shape, dtype);
      tape.grads.set(r.pooled, up('r2'));
      tape.backward(r.context, up('r1'));
      // The key-projection bias's true gradient is 0 (softmax ignores a constant per row), so the scale is
      // floored at a tenth of the largest gradient, as in clip.test.ts.
      const k = dtype === 'f32' ? 1e-4 : 1e-2;
      const globalMax = Math.max(...[...tensors].filter(([n]) => n.startsWith('grad.')).map(([, t]) => maxAbs(t.data)));
      checks.push(...(await gradChecks(gpu, tape, tensors, 'grad.te1.', te1.weights, k, 0.1 * globalMax)));
      checks.push(...(await gradChecks(gpu, tape, tensors, 'grad.te2.', te2.weights, k, 0.1 * globalMax)));
      // Encoder 1 conditions on its penultimate block: its last block and final norm get no gradient.
      for (const [n, t] of te1.weights) if (n.includes('layers.2.') || n.includes('final_layer_norm')) assert.equal(tape.grads.get(t), undefined, n);
      assert.equal(checks.filter((c) => c.label.startsWith('grad.te2.text_projection')).length, 1);
      assertChecks(checks);
    });
});
