import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { ShapeError } from '../../src/gpu/errors.ts';
import { adamw, adamwParam } from '../../src/ops/adamw.ts';
import { DynamicLossScaler } from '../../src/ops/lossscale.ts';
import { newFlag } from '../../src/ops/reduce.ts';
import { defineCaseTests, testGpu } from '../helpers.ts';

defineCaseTests('adamw');

describe('adamw bad input', () => {
  it('size mismatch between master and gradient names the op and shapes', async () => {
    const gpu = await testGpu();
    const p = adamwParam(gpu, gpu.zeros([4, 4], 'f16'), new Float32Array(16));
    const cfg = { lr: 1, beta1: 0.9, beta2: 0.99, eps: 1e-8, weightDecay: 0 };
    assert.throws(
      () => adamw(gpu, p, gpu.zeros([15], 'f16'), cfg, { step: 1, lossScale: 1, flag: newFlag(gpu) }),
      (e: Error) => e instanceof ShapeError && /adamw: grad \[15\] does not match master \[4,4\]/.test(e.message),
    );
    assert.throws(() => adamw(gpu, p, gpu.zeros([16], 'f16'), cfg, { step: 0, lossScale: 1, flag: newFlag(gpu) }), /step must be >= 1/);
  });
});

describe('DynamicLossScaler', () => {
  it('halves on overflow, skips the step, doubles after growthInterval good steps', () => {
    const s = new DynamicLossScaler({ growthInterval: 3 });
    assert.equal(s.scale, 65536);
    assert.equal(s.update(true), false);
    assert.equal(s.scale, 32768);
    assert.equal(s.update(false), true);
    assert.equal(s.update(false), true);
    assert.equal(s.scale, 32768);
    assert.equal(s.update(false), true);
    assert.equal(s.scale, 65536);
    assert.equal(s.update(false), true);
    assert.equal(s.update(true), false); // overflow resets the run of good steps
    assert.equal(s.update(false), true);
    assert.equal(s.update(false), true);
    assert.equal(s.scale, 32768);
    assert.deepEqual(s.state(), { scale: 32768, goodSteps: 2, skipped: 2 });
  });

  it('never drops below minScale and round-trips its state', () => {
    const s = new DynamicLossScaler({ initScale: 4, minScale: 1 });
    for (let i = 0; i < 5; i++) s.update(true);
    assert.equal(s.scale, 1);
    const t = new DynamicLossScaler();
    t.restore(s.state());
    assert.deepEqual(t.state(), s.state());
  });
});
