import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { ShapeError } from '../../src/gpu/errors.ts';
import { flashAttention, naiveAttention } from '../../src/ops/attention.ts';
import { defineCaseTests, testGpu } from '../helpers.ts';

defineCaseTests('attention');

const shapeError =
  (op: string, ...parts: string[]) =>
  (e: unknown) =>
    e instanceof ShapeError && e.message.startsWith(`${op}:`) && parts.every((p) => e.message.includes(p));

describe('attention bad input', () => {
  it('head-dim, length, rank, dtype and layout mismatches name the op and the shapes', async () => {
    const gpu = await testGpu();
    const z = (shape: number[], d: 'f32' | 'f16' = 'f32') => gpu.zeros(shape, d);
    assert.throws(
      () => flashAttention(gpu, z([1, 2, 8, 40]), z([1, 2, 8, 64]), z([1, 2, 8, 64])),
      shapeError('flashAttention', 'head dim', 'q [1,2,8,40]', 'k [1,2,8,64]'),
    );
    assert.throws(
      () => flashAttention(gpu, z([1, 2, 8, 40]), z([1, 2, 9, 40]), z([1, 2, 7, 40])),
      shapeError('flashAttention', "v must have k's shape", 'v [1,2,7,40]'),
    );
    assert.throws(() => flashAttention(gpu, z([2, 8, 40]), z([1, 2, 8, 40]), z([1, 2, 8, 40])), shapeError('flashAttention', 'q must be rank 4', '[2,8,40]'));
    assert.throws(
      () => flashAttention(gpu, z([1, 1, 4, 300]), z([1, 1, 4, 300]), z([1, 1, 4, 300])),
      shapeError('flashAttention', 'head dim 300 is not supported'),
    );
    assert.throws(
      () => flashAttention(gpu, z([1, 1, 4, 40], 'f16'), z([1, 1, 4, 40]), z([1, 1, 4, 40])),
      shapeError('flashAttention', 'dtype', 'f16[1,1,4,40]'),
    );
    assert.throws(
      () => naiveAttention(gpu, z([1, 4, 2, 40]), z([1, 4, 2, 40]), z([1, 4, 2, 40]), { layout: 'bnhd' }),
      shapeError('naiveAttention', "layout 'bhnd' only"),
    );
    assert.throws(
      () => flashAttention(gpu, z([1, 1, 4, 40]), z([1, 1, 5, 40]), z([1, 1, 5, 40]), { causal: true }),
      shapeError('flashAttention', 'causal attention needs as many keys as queries'),
    );
  });
});
