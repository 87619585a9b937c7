// The UNet module (forward) against a PyTorch forward of the same tiny UNet2DConditionModel, with
// SD1-style conv projections and SD2-style linear projections, f32 and f16. Tolerances: f32 5e-4
// absolute + 2e-4 relative (some 60 ops deep vs float64), f16 5e-2 + 2e-2 (f16 activations).
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { readSafetensors } from '../../src/io/safetensors.ts';
import { unetConfigFromJson, unetForward } from '../../src/nn/unet.ts';
import { compare } from '../../src/selftest/check.ts';
import { assertChecks, FIXTURES, testGpu } from '../helpers.ts';

describe('UNet (tiny) vs PyTorch', () => {
  for (const name of ['unet_sd1', 'unet_sd2'])
    for (const dtype of ['f32', 'f16'] as const)
      it(`${name} [${dtype}]`, async () => {
        const gpu = await testGpu();
        const { tensors, metadata } = readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'modules', `${name}.safetensors`))));
        const cfg = unetConfigFromJson(JSON.parse(metadata.config));
        const inputs = new Set(['sample', 'timestep', 'encoder_hidden_states', 'out']);
        const weights = new Map();
        for (const [k, t] of tensors) if (!inputs.has(k)) weights.set(k, gpu.upload(t.data, t.shape, dtype, 'weights', k));
        const g = (k: string) => tensors.get(k)!;
        const out = unetForward(
          gpu,
          cfg,
          weights,
          gpu.upload(g('sample').data, g('sample').shape, dtype),
          gpu.upload(g('timestep').data, g('timestep').shape, 'f32'),
          gpu.upload(g('encoder_hidden_states').data, g('encoder_hidden_states').shape, dtype),
        );
        const tol = dtype === 'f32' ? { atol: 5e-4, rtol: 2e-4 } : { atol: 5e-2, rtol: 2e-2 };
        assertChecks([compare('unet out', await gpu.read(out), g('out').data, tol)]);
        gpu.free(out, ...weights.values());
      });
});

describe('dry-run memory planning', () => {
  it('plans exactly the peak bytes a real UNet forward allocates, computing nothing', async () => {
    const { readFileSync: read } = await import('node:fs');
    const { unetParams } = await import('../../src/models/shapes.ts');
    const { tensors, metadata } = readSafetensors(new Uint8Array(read(join(FIXTURES, 'modules', 'unet_sd1.safetensors'))));
    const cfg = unetConfigFromJson(JSON.parse(metadata.config));
    const peak = async (dryRun: boolean) => {
      const gpu = await testGpu({ dryRun });
      const w = new Map([...unetParams(cfg)].map(([n, s]) => [n, gpu.upload(tensors.get(n)!.data, s, 'f32', 'weights', n)]));
      const up = (n: string) => gpu.upload(tensors.get(n)!.data, tensors.get(n)!.shape, 'f32');
      const [s, t, c] = [up('sample'), up('timestep'), up('encoder_hidden_states')];
      await gpu.sync();
      const before = gpu.allocator.report().current;
      gpu.allocator.resetPeak();
      const out = await gpu.read(unetForward(gpu, cfg, w, s, t, c));
      const p = gpu.allocator.report().peak - before;
      gpu.destroy();
      return { p, out };
    };
    const real = await peak(false);
    const plan = await peak(true);
    assert.ok(real.p > 0);
    assert.equal(plan.p, real.p);
    assert.ok(
      plan.out.every((v) => v === 0),
      'a dry run computes nothing',
    );
  });
});
