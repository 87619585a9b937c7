import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { ShapeError } from '../../src/gpu/errors.ts';
import { roundToF16 } from '../../src/util/half.ts';
import type { DType } from '../../src/gpu/tensor.ts';
import { adamw, adamwAll, adamwParam, adamwRef, clipFactorRef, type AdamWConfig } from '../../src/ops/adamw.ts';
import { DynamicLossScaler } from '../../src/ops/lossscale.ts';
import { globalNormRef, newFlag } from '../../src/ops/reduce.ts';
import { compare, randomValues } from '../../src/selftest/check.ts';
import { viewOf } from '../../src/selftest/cases/reduce.ts';
import { assertChecks, defineCaseTests, testGpu } from '../helpers.ts';

defineCaseTests('adamw');

const CFG: AdamWConfig = { lr: 1e-2, beta1: 0.9, beta2: 0.99, eps: 1e-8, weightDecay: 0.05 };

describe('adamw bad input', () => {
  it('names the op and the shapes or dtypes', async () => {
    const gpu = await testGpu();
    const is = (re: RegExp) => (e: Error) => e instanceof ShapeError && re.test(e.message);
    const p = adamwParam(gpu, gpu.zeros([4, 4], 'f16'), new Float32Array(16));
    const flag = newFlag(gpu);
    const s = { step: 1, lossScale: 1, flag };
    const g = gpu.zeros([16], 'f16');
    assert.throws(() => adamw(gpu, p, gpu.zeros([15], 'f16'), CFG, s), is(/adamw: grad \[15\] does not match master \[4,4\]/));
    assert.throws(() => adamw(gpu, { ...p, m: gpu.zeros([4, 3], 'f32') }, g, CFG, s), is(/adamw: m \[4,3\] does not match master \[4,4\]/));
    assert.throws(() => adamw(gpu, { ...p, v: gpu.zeros([17], 'f32') }, g, CFG, s), is(/adamw: v \[17\] does not match master \[4,4\]/));
    assert.throws(() => adamw(gpu, { ...p, weight: gpu.zeros([2, 4], 'f16') }, g, CFG, s), is(/adamw: weight \[2,4\] does not match master \[4,4\]/));
    assert.throws(() => adamw(gpu, { ...p, master: gpu.zeros([4, 4], 'f16') }, g, CFG, s), is(/adamw: master must be f32, got f16 \[4,4\]/));
    assert.throws(() => adamw(gpu, { ...p, m: gpu.zeros([4, 4], 'f16') }, g, CFG, s), is(/adamw: m must be f32, got f16 \[4,4\]/));
    assert.throws(() => adamw(gpu, p, g, CFG, { ...s, flag: gpu.zeros([1], 'f16') }), is(/adamw: flag must be f32 \[1\], got f16\[1\]/));
    assert.throws(() => adamw(gpu, p, g, CFG, { ...s, clip: { norm: gpu.zeros([2], 'f32'), maxNorm: 1 } }), is(/adamw: clip norm must be f32 \[1\], got f32\[2\]/));
    assert.throws(() => adamw(gpu, p, g, CFG, { ...s, clip: { norm: newFlag(gpu), maxNorm: 0 } }), is(/adamw: maxNorm must be > 0/));
    assert.throws(() => adamw(gpu, p, g, CFG, { ...s, step: 0 }), is(/adamw: step must be an integer >= 1, got 0/));
    assert.throws(() => adamw(gpu, p, g, CFG, { ...s, lossScale: Infinity }), is(/adamw: loss scale must be finite and > 0/));
    assert.throws(() => adamwAll(gpu, [p], [], CFG, s), is(/adamwAll: 1 parameters but 0 gradients/));
  });
});

describe('DynamicLossScaler (torch.cuda.amp.GradScaler policy)', () => {
  it('starts at 2^16 with a growth interval of 2000', () => {
    const s = new DynamicLossScaler();
    assert.equal(s.scale, 2 ** 16);
    for (let i = 0; i < 1999; i++) assert.equal(s.update(false), true);
    assert.equal(s.scale, 2 ** 16);
    s.update(false);
    assert.equal(s.scale, 2 ** 17);
  });

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

for (const dtype of ['f32', 'f16'] as DType[]) {
  describe(`adamw past a small storage binding (bindingLimit 1 KiB) [${dtype}]`, () => {
    it('walks master, moments, gradient and weight copy in windows, views at odd offsets included', async () => {
      const gpu = await testGpu({ bindingLimit: 1024 });
      try {
        // 3000 elements: 16 windows of at most 192 f32. The gradient and the weight copy are views
        // starting 3 elements into their buffers, so their windows start off alignment.
        const n = 3000;
        const init = roundToF16(randomValues(n, 31));
        const wBuf = gpu.zeros([n + 3], dtype);
        const weight = viewOf(wBuf, 3, [n]);
        const p = adamwParam(gpu, weight, init);
        const flag = newFlag(gpu);
        const ref = { master: Float32Array.from(init), m: new Float32Array(n), v: new Float32Array(n) };
        const scale = 512;
        for (let step = 1; step <= 2; step++) {
          const g = roundToF16(randomValues(n + 3, 40 + step, 0.02 * scale));
          const gBuf = gpu.upload(g, [n + 3], dtype);
          const grad = viewOf(gBuf, 3, [n]);
          adamwAll(gpu, [p], [grad], CFG, { step, lossScale: scale, flag, maxNorm: 0.3 });
          const gv = g.subarray(3);
          adamwRef(ref.master, ref.m, ref.v, gv, CFG, step, scale, clipFactorRef(globalNormRef([gv], scale), 0.3));
          gpu.free(gBuf);
        }
        const master = await gpu.read(p.master);
        const whole = await gpu.read(wBuf);
        assertChecks([
          compare('clipping was active', [clipFactorRef(globalNormRef([roundToF16(randomValues(n + 3, 42, 0.02 * scale)).subarray(3)], scale), 0.3) < 1 ? 1 : 0], [1], { atol: 0, rtol: 0 }),
          compare('master vs ts ref', master, ref.master, { atol: 1e-6, rtol: 1e-5 }),
          compare('m vs ts ref', await gpu.read(p.m), ref.m, { atol: 1e-8, rtol: 1e-5 }),
          compare('v vs ts ref', await gpu.read(p.v), ref.v, { atol: 1e-10, rtol: 1e-5 }),
          compare(`weight copy = ${dtype}(master)`, whole.subarray(3), dtype === 'f16' ? roundToF16(master) : master, { atol: 0, rtol: 0 }),
          compare('elements before the view untouched', whole.subarray(0, 3), [0, 0, 0], { atol: 0, rtol: 0 }),
        ]);
      } finally {
        gpu.destroy();
      }
    });
  });
}
