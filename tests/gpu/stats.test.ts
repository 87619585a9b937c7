// Gpu.stats: the read-only counters bench/step.ts reports per training step (dispatches, GPUBuffers and bind
// groups created). Each counter is checked against work whose count is known exactly.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { nodeGpu } from '../../src/gpu/node.ts';
import { add } from '../../src/ops/elementwise.ts';
import { testGpu } from '../helpers.ts';

describe('Gpu.stats', () => {
  it('counts dispatches, bind groups and every GPUBuffer created (tensors, uniforms, read-back staging)', async () => {
    const gpu = await testGpu();
    const s0 = gpu.stats;
    const a = gpu.upload([1, 2, 3, 4], [4], 'f32');
    const s1 = gpu.stats;
    assert.deepEqual([s1.buffersCreated - s0.buffersCreated, s1.dispatches - s0.dispatches], [1, 0], 'one tensor: one buffer, no dispatch');
    const c = add(gpu, a, a, 2); // an output tensor and a uniform buffer (alpha), one dispatch, one bind group
    const s2 = gpu.stats;
    assert.deepEqual([s2.buffersCreated - s1.buffersCreated, s2.dispatches - s1.dispatches, s2.bindGroupsCreated - s1.bindGroupsCreated], [2, 1, 1]);
    assert.deepEqual([...(await gpu.read(c))], [3, 6, 9, 12]);
    const s3 = gpu.stats;
    assert.deepEqual([s3.buffersCreated - s2.buffersCreated, s3.dispatches - s2.dispatches], [1, 0], 'a read: one staging buffer');
    gpu.free(a, c);
    assert.deepEqual(gpu.stats, s3, 'freeing creates nothing');
  });

  it('a dry-run Gpu counts its stand-in buffers and records no dispatch', async () => {
    const gpu = await nodeGpu({ dryRun: true });
    const s0 = gpu.stats;
    const a = gpu.tensor([1024], 'f32', 'scratch');
    add(gpu, a, a);
    const s1 = gpu.stats;
    assert.deepEqual([s1.buffersCreated - s0.buffersCreated, s1.dispatches - s0.dispatches, s1.bindGroupsCreated - s0.bindGroupsCreated], [2, 0, 0]);
    gpu.destroy();
  });
});
