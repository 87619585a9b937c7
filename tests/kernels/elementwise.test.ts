import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { ShapeError } from '../../src/gpu/errors.ts';
import { activation, activationBackward, activationRef, addChannel, concatChannels, geglu, gegluBackward, mul, splitChannels, timestepEmbedding, transpose2d, upsample2xBackward } from '../../src/ops/elementwise.ts';
import { softmax, softmaxBackward, softmaxRef } from '../../src/ops/softmax.ts';
import { compare, randomValues } from '../../src/selftest/check.ts';
import { assertChecks, defineCaseTests, testGpu } from '../helpers.ts';

defineCaseTests('elementwise');

const shapeError = (op: string, ...parts: string[]) => (e: unknown) =>
  e instanceof ShapeError && e.message.startsWith(`${op}:`) && parts.every((p) => e.message.includes(p));

describe('element-wise bad input', () => {
  it('names the op and the shapes', async () => {
    const gpu = await testGpu();
    const z = (shape: number[], d: 'f32' | 'f16' = 'f32') => gpu.zeros(shape, d);
    assert.throws(() => mul(gpu, z([2, 3]), z([3, 2])), shapeError('mul', '[2,3]', '[3,2]'));
    assert.throws(() => mul(gpu, z([2, 3]), z([2, 3], 'f16')), shapeError('mul', 'dtype', 'f32[2,3]', 'f16[2,3]'));
    assert.throws(() => geglu(gpu, z([2, 7])), shapeError('geglu', '[2,7]', 'even'));
    assert.throws(() => gegluBackward(gpu, z([2, 8]), z([2, 3])), shapeError('gegluBackward', '[2,3]', '[2,8]'));
    assert.throws(() => addChannel(gpu, z([2, 4, 3, 3]), z([2, 3])), shapeError('addChannel', '[2,4]', '[2,3]'));
    assert.throws(() => upsample2xBackward(gpu, z([1, 2, 3, 3]), z([1, 2, 6, 5])), shapeError('upsample2xBackward', '[1,2,6,6]', '[1,2,6,5]'));
    assert.throws(() => activationBackward(gpu, 'silu', z([4]), z([5])), shapeError('siluBackward', '[4]', '[5]'));
    assert.throws(() => softmaxBackward(gpu, z([2, 5]), z([2, 4])), shapeError('softmaxBackward', '[2,4]', '[2,5]'));
    assert.throws(() => concatChannels(gpu, z([2, 3, 4, 4]), z([2, 2, 4, 5])), shapeError('concatChannels', '[2,3,4,4]', '[2,2,4,5]'));
    assert.throws(() => splitChannels(gpu, z([2, 3, 4, 4]), 2, 2), shapeError('splitChannels', 'channels [2, 4)', '[2,3,4,4]'));
    assert.throws(() => transpose2d(gpu, z([5])), shapeError('transpose2d', '[5]'));
    assert.throws(() => timestepEmbedding(gpu, z([3], 'f16'), 8, 'f32'), shapeError('timestepEmbedding', 'timesteps must be f32', 'f16 [3]'));
  });
});

describe('element-wise ops over tensors larger than one storage binding (bindingLimit 1 KiB)', () => {
  it('activations and softmax chunk their ranges', async () => {
    const gpu = await testGpu({ bindingLimit: 1024 });
    try {
      const x = randomValues(3000, 1, 3);
      const y = await gpu.read(activation(gpu, 'gelu', gpu.upload(x, [3000], 'f32')));
      const rows = randomValues(30 * 40, 2, 3); // 160-byte rows: 6 rows per binding
      const s = await gpu.read(softmax(gpu, gpu.upload(rows, [30, 40], 'f32')));
      assertChecks([
        compare('gelu', y, x.map((v) => activationRef('gelu', v)), { atol: 1e-5, rtol: 1e-5 }),
        compare('softmax rows', s, softmaxRef(rows, 40), { atol: 1e-6, rtol: 1e-5 }),
      ]);
    } finally {
      gpu.destroy();
    }
  });
});
