// Gpu.stats: the read-only counters bench/step.ts reports per training step (dispatches, GPUBuffers and bind
// groups created), checked against work whose count is known exactly, with the allocator's pool, the uniform
// ring, pooled read-back staging and the bind-group cache in play.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { nodeGpu } from '../../src/gpu/node.ts';
import { add } from '../../src/ops/elementwise.ts';

const delta = (a: { buffersCreated: number; dispatches: number; bindGroupsCreated: number }, b: typeof a) => [
  b.buffersCreated - a.buffersCreated,
  b.dispatches - a.dispatches,
  b.bindGroupsCreated - a.bindGroupsCreated,
];

describe('Gpu.stats', () => {
  it('counts dispatches, bind groups and every GPUBuffer created; a repeat of the same work creates nothing', async () => {
    const gpu = await nodeGpu({ poison: false });
    const s0 = gpu.stats;
    const a = gpu.upload([1, 2, 3, 4], [4], 'f32');
    const s1 = gpu.stats;
    assert.deepEqual(delta(s0, s1), [1, 0, 0], 'one tensor: one buffer, no dispatch');
    const c = add(gpu, a, a, 2); // an output tensor, the uniform ring (first use), one dispatch, one bind group
    const s2 = gpu.stats;
    assert.deepEqual(delta(s1, s2), [2, 1, 1]);
    assert.deepEqual([...(await gpu.read(c))], [3, 6, 9, 12]);
    const s3 = gpu.stats;
    assert.deepEqual(delta(s2, s3), [1, 0, 0], 'a read: one staging buffer');
    gpu.free(c);
    assert.deepEqual(gpu.stats, s3, 'freeing creates nothing');
    // The same work again: the output comes from the pool, the uniforms from the ring, the bind group from the
    // cache (same buffers, same offsets), the staging buffer from its pool.
    const c2 = add(gpu, a, a, 3);
    assert.deepEqual([...(await gpu.read(c2))], [4, 8, 12, 16], 'new uniform values reach the reused slot');
    assert.deepEqual(delta(s3, gpu.stats), [0, 1, 0]);
    gpu.free(a, c2);
    gpu.destroy();
  });

  it('a dry-run Gpu counts its stand-in buffers and records no dispatch', async () => {
    const gpu = await nodeGpu({ dryRun: true });
    const s0 = gpu.stats;
    const a = gpu.tensor([1024], 'f32', 'scratch');
    add(gpu, a, a);
    assert.deepEqual(delta(s0, gpu.stats), [2, 0, 0]);
    gpu.destroy();
  });
});
