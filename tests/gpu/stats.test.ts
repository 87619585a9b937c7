// Gpu.stats: the read-only counters bench/step.ts reports per training step (dispatches, GPUBuffers and bind
// groups created), checked against work whose count is known exactly, with the allocator's pool, the uniform
// ring, pooled read-back staging and the bind-group cache in play.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { describe, it } from 'node:test';
import { setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';
import { bindGroupCacheMax } from '../../src/gpu/device.ts';
import { nodeGpu } from '../../src/gpu/node.ts';
import { Tensor } from '../../src/gpu/tensor.ts';
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

  it('the bind-group cache stays bounded, and so does the memory behind it (lavapipe maps each bind group)', async () => {
    const gpu = await nodeGpu({ poison: false });
    const max = bindGroupCacheMax(gpu.facts.software);
    const n = max + 4096;
    // n windows of 4 floats, 256 bytes apart (the storage offset alignment): each dispatch binds its own window and
    // its own uniform slot (slots restart after each submission).
    const stride = 64;
    const big = gpu.upload(
      Float32Array.from({ length: n * stride }, (_, i) => (i % stride) + 1),
      [n * stride],
      'f32',
    );
    const window = (i: number) => new Tensor(big.alloc, [4], 'f32', big.byteOffset + i * stride * 4, false);
    // Submitted in rounds of 1024, as sampling and training submit. The second pass takes the windows in reverse,
    // so every (window, slot) pair is new (n - 1 is odd: i and n - 1 - i never share a slot).
    const pass = async (order: (i: number) => number) => {
      for (let i = 0; i < n; i++) {
        gpu.free(add(gpu, window(order(i)), window(order(i)), 2));
        if (i % 1024 === 1023) await gpu.sync();
      }
      await gpu.sync();
    };
    const mappings = () => readFileSync('/proc/self/maps', 'utf8').split('\n').length;
    setFlagsFromString('--expose-gc');
    const gc = runInNewContext('gc') as () => void;
    // Finalizers run on later turns than the gc() that found their objects dead, later still on a loaded machine: a few
    // rounds let every dropped bind group reach Dawn's pools before the mappings are counted (the bounds stay as they are).
    const collect = async () => {
      for (let k = 0; k < 5; k++) {
        gc();
        await new Promise((r) => setImmediate(r));
        await gpu.sync();
      }
    };
    const maps0 = mappings();
    const s0 = gpu.stats;
    const grownBy: number[] = [];
    for (const order of [(i: number) => i, (i: number) => n - 1 - i, (i: number) => i]) {
      const before = mappings();
      await pass(order);
      await collect();
      grownBy.push(mappings() - before);
    }
    const made = gpu.stats.bindGroupsCreated - s0.bindGroupsCreated;
    const grown = mappings() - maps0;
    console.log(
      `adapter ${gpu.facts.software ? 'cpu' : 'gpu'}: ${made} bind groups made, ${gpu.stats.bindGroupsCached} cached; mappings grew by ${grownBy.join(', ')} per pass`,
    );
    // The third pass repeats the first one's pairs, long evicted: all made again.
    assert.equal(made, 3 * n, 'a new bind group per (window, uniform slot)');
    assert.ok(gpu.stats.bindGroupsCached <= max, `${gpu.stats.bindGroupsCached} bind groups cached, over ${max}`);
    // Dropped bind groups, once collected, go back to Dawn's pools for reuse: the live ones peak at the cache plus
    // those dropped since the last collection (here a pass, n), and a third pass of n new ones maps next to nothing more
    // (a quarter of n allows for a collection that comes late; without the bound it maps all n). (Before this
    // bound the cache held 65,536, past Linux's 65,530 mappings per process; sampling the demo model crashed
    // lavapipe at about 62,000.)
    assert.ok(grown < n + max + n / 4, `${3 * n} bind groups grew the mappings by ${grown} (cache ${max}, ${n} per pass)`);
    assert.ok(grownBy[2] < n / 4, `the third pass of ${n} bind groups grew the mappings by ${grownBy[2]}`);
    const c = add(gpu, window(n - 1), window(n - 1), 5);
    assert.deepEqual([...(await gpu.read(c))], [6, 12, 18, 24]);
    gpu.free(big, c);
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
