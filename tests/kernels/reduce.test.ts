import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { ShapeError } from '../../src/gpu/errors.ts';
import { checkFinite, globalNorm, globalNormRef, mseLoss, mseLossBackward, newFlag, readFlag, sumAll, sumAllRef } from '../../src/ops/reduce.ts';
import { compare, randomValues } from '../../src/selftest/check.ts';
import { assertChecks, defineCaseTests, testGpu } from '../helpers.ts';

defineCaseTests('reduce');

describe('reduce bad input', () => {
  it('names the op and the shapes', async () => {
    const gpu = await testGpu();
    assert.throws(() => mseLoss(gpu, gpu.zeros([2, 3], 'f32'), gpu.zeros([3, 2], 'f32')), (e: Error) => e instanceof ShapeError && /mseLoss: pred \[2,3\] and target \[3,2\] differ/.test(e.message));
    assert.throws(() => mseLossBackward(gpu, gpu.zeros([4], 'f16'), gpu.zeros([4], 'f32')), (e: Error) => e instanceof ShapeError && /mseLossBackward: dtype mismatch: f16\[4\] vs f32\[4\]/.test(e.message));
    assert.throws(() => globalNorm(gpu, []), /globalNorm: no tensors/);
  });
});

describe('reductions over tensors larger than one storage binding (bindingLimit 8 KiB)', () => {
  it('sum, norm and the non-finite check walk binding-sized ranges', async () => {
    const gpu = await testGpu({ bindingLimit: 8192 });
    try {
      const n = 3 * 2048 + 123; // f32: 24.5 KB, four ranges of whole 2048-element blocks
      const x = randomValues(n, 7);
      const tx = gpu.upload(x, [n], 'f32');
      const s = await gpu.read(sumAll(gpu, tx));
      const nrm = await gpu.read(globalNorm(gpu, [tx]));
      const flag = newFlag(gpu);
      const bad = x.slice();
      bad[n - 5] = NaN;
      checkFinite(gpu, [gpu.upload(bad, [n], 'f32')], flag);
      assertChecks([
        compare('sum', s, [sumAllRef(x)], { atol: 1e-4, rtol: 1e-5 }),
        compare('norm', nrm, [globalNormRef([x])], { atol: 1e-5, rtol: 1e-5 }),
        compare('NaN in the last range', [(await readFlag(gpu, flag)) ? 1 : 0], [1], { atol: 0, rtol: 0 }),
      ]);
    } finally {
      gpu.destroy();
    }
  });
});
