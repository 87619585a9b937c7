import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { ShapeError } from '../../src/gpu/errors.ts';
import { roundToF16 } from '../../src/util/half.ts';
import { groupNorm, groupNormBackward, groupNormBackwardRef, groupNormRef, layerNorm } from '../../src/ops/norm.ts';
import { compare, randomValues } from '../../src/selftest/check.ts';
import { normTol } from '../../src/selftest/cases/norm.ts';
import { assertChecks, defineCaseTests, testGpu } from '../helpers.ts';

defineCaseTests('norm');

const shapeError =
  (op: string, ...parts: string[]) =>
  (e: unknown) =>
    e instanceof ShapeError && e.message.startsWith(`${op}:`) && parts.every((p) => e.message.includes(p));

describe('norm bad input', () => {
  it('channels not divisible by groups, affine size, dy size, dtype', async () => {
    const gpu = await testGpu();
    const x = gpu.zeros([1, 6, 2, 2], 'f32');
    const g6 = gpu.zeros([6], 'f32');
    assert.throws(() => groupNorm(gpu, x, g6, g6, 4), shapeError('groupNorm', 'channels 6', '[1,6,2,2]', '4 groups'));
    assert.throws(() => groupNorm(gpu, x, gpu.zeros([5], 'f32'), g6, 3), shapeError('groupNorm', 'gamma must be [6]', '[5]'));
    assert.throws(() => groupNorm(gpu, x, gpu.zeros([6], 'f16'), gpu.zeros([6], 'f16'), 3), shapeError('groupNorm', 'dtype', 'f32[1,6,2,2]', 'f16[6]'));
    const f = groupNorm(gpu, x, g6, g6, 3);
    assert.throws(() => groupNormBackward(gpu, x, g6, f, gpu.zeros([1, 6, 2, 3], 'f32'), 3), shapeError('groupNormBackward', 'dy [1,6,2,3]', 'x [1,6,2,2]'));
    assert.throws(() => layerNorm(gpu, gpu.zeros([3, 8], 'f32'), gpu.zeros([3], 'f32'), gpu.zeros([3], 'f32')), shapeError('layerNorm', 'gamma must be [8]'));
  });
});

describe('GroupNorm larger than one storage binding (bindingLimit 2 KiB: one sample per dispatch)', () => {
  for (const dtype of ['f32', 'f16'] as const)
    it(`forward and backward chunked over samples [${dtype}]`, async () => {
      const gpu = await testGpu({ bindingLimit: 2048 });
      try {
        const shape = [5, 8, 6, 7]; // one sample = 336 elements: 1344 B (f32) / 672 B (f16)
        const n = 5 * 8 * 42;
        const x = roundToF16(randomValues(n, 1, 2));
        const gamma = roundToF16(randomValues(8, 2).map((v) => v + 1));
        const beta = roundToF16(randomValues(8, 3));
        const dy = roundToF16(randomValues(n, 4));
        const tx = gpu.upload(x, shape, dtype);
        const tg = gpu.upload(gamma, [8], dtype);
        const tb = gpu.upload(beta, [8], dtype);
        const f = groupNorm(gpu, tx, tg, tb, 4);
        const g = groupNormBackward(gpu, tx, tg, f, gpu.upload(dy, shape, dtype), 4);
        const ref = groupNormRef(x, shape, gamma, beta, 4);
        const gref = groupNormBackwardRef(x, shape, gamma, dy, 4);
        const tol = normTol(dtype);
        assertChecks([
          compare('y', await gpu.read(f.y), ref.y, tol),
          compare('dx', await gpu.read(g.dx), gref.dx, tol),
          compare('dgamma (accumulated over chunks)', await gpu.read(g.dgamma), gref.dgamma, tol),
          compare('dbeta (accumulated over chunks)', await gpu.read(g.dbeta), gref.dbeta, tol),
        ]);
      } finally {
        gpu.destroy();
      }
    });
});
