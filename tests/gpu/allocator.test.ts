// The caching allocator (src/gpu/allocator.ts) and what Gpu builds on it: size classes, exact accounting with the
// pool reported apart, reuse, zeros() on a reused buffer, poisoning, the reserve limit, trimming, the
// out-of-memory retry, and queue writes into a reused buffer that recorded commands still read.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { Allocator, sizeClass } from '../../src/gpu/allocator.ts';
import { GpuOutOfMemoryError } from '../../src/gpu/errors.ts';
import { nodeGpu } from '../../src/gpu/node.ts';
import { add } from '../../src/ops/elementwise.ts';

const MiB = 2 ** 20;

describe('caching allocator', () => {
  it('size classes: at least the request, multiples of 256, under 12.5 % waste, monotonic', () => {
    let last = 0;
    for (let bytes = 4; bytes < 64 * MiB; bytes = Math.ceil(bytes * 1.37) + 4) {
      const c = sizeClass(bytes);
      assert.ok(c >= bytes && c % 256 === 0, `${bytes} -> ${c}`);
      if (bytes > 2048) assert.ok((c - bytes) / bytes < 0.125, `${bytes} -> ${c} wastes ${((c - bytes) / bytes) * 100} %`);
      assert.ok(c >= last, 'monotonic');
      last = c;
    }
    assert.equal(sizeClass(1000), 1024);
    assert.equal(sizeClass(1100), 1280);
    assert.equal(sizeClass(9000), 9216);
    assert.equal(sizeClass(5 * MiB + 1), 5.5 * MiB);
  });

  it('accounting counts the bytes asked for; the pool and class rounding are reported apart; a free buffer is reused', async () => {
    const gpu = await nodeGpu({ poison: false });
    const al = gpu.allocator;
    const base = al.report();
    const a = gpu.tensor([1100 / 4], 'f32', 'activations', 'a'); // 1100 bytes -> class 1280
    const b = gpu.tensor([3, 5], 'f16', 'gradients', 'b'); // 30 -> 32 bytes -> class 256
    let r = al.report();
    assert.equal(r.current - base.current, 1100 + 32);
    assert.equal(r.byTag.activations.current - base.byTag.activations.current, 1100);
    assert.equal(r.reserved - base.reserved, 1280 + 256);
    const bufferA = a.buffer;
    gpu.free(a, b);
    r = al.report();
    assert.equal(r.current, base.current, 'freed bytes leave the accounting');
    assert.equal(r.pool.bytes - base.pool.bytes, 1280 + 256, 'and wait in the pool at their class size');
    const hits = al.poolStats.hits;
    const created = al.buffersCreated;
    const c = gpu.tensor([1080 / 4], 'f32', 'scratch', 'c'); // same class as a
    assert.equal(c.buffer, bufferA, 'the pooled buffer of the class is handed out again');
    assert.equal(al.poolStats.hits, hits + 1);
    assert.equal(al.buffersCreated, created, 'no buffer created');
    assert.equal(al.report().current - base.current, 1080, 'accounted at the new request');
    gpu.free(c);
    gpu.trimPool();
    r = al.report();
    assert.deepEqual(r.pool, { buffers: 0, bytes: 0 }, 'trimPool empties the pool');
    assert.equal(r.reserved, r.current === 0 ? 0 : r.reserved);
    gpu.destroy();
  });

  it('zeros() clears a reused buffer; tensor() under poison is NaN', async () => {
    const gpu = await nodeGpu({ poison: false });
    const dirty = gpu.upload([1, 2, 3, 4, 5, 6, 7, 8], [8], 'f32');
    gpu.free(dirty);
    const z = gpu.zeros([8], 'f32');
    assert.ok(z.alloc.reused, 'the dirty buffer came back');
    assert.deepEqual([...(await gpu.read(z))], [0, 0, 0, 0, 0, 0, 0, 0]);
    gpu.destroy();
    const poisoned = await nodeGpu({ poison: true });
    const t = poisoned.tensor([5], 'f16', 'scratch');
    assert.ok(
      (await poisoned.read(t)).every((v) => Number.isNaN(v)),
      'f16 words are NaN',
    );
    const u = poisoned.tensor([3], 'f32', 'scratch');
    assert.ok(
      (await poisoned.read(u)).every((v) => Number.isNaN(v)),
      'f32 words are NaN',
    );
    poisoned.destroy();
  });

  it('a queue write into a reused buffer waits for the recorded commands that read its last contents', async () => {
    const gpu = await nodeGpu({ poison: false });
    const a = gpu.upload([1, 2, 3, 4], [4], 'f32');
    const x = add(gpu, a, a); // 2a
    await gpu.sync(); // x is computed
    const y = add(gpu, x, x); // 4a, recorded, not submitted: reads x
    gpu.free(x);
    const ids = gpu.tensor([4], 'f32', 'scratch'); // x's buffer, while y's dispatch is not yet submitted
    assert.equal(ids.buffer, x.buffer);
    gpu.writeRaw(ids, Uint32Array.from([1e9, 1e9, 1e9, 1e9]));
    const w = gpu.tensor([4], 'f32', 'scratch');
    gpu.free(w);
    const again = gpu.tensor([4], 'f32', 'scratch');
    gpu.write(again, [-1, -1, -1, -1]);
    assert.deepEqual([...(await gpu.read(y))], [4, 8, 12, 16], 'y saw x, not the later writes');
    gpu.destroy();
  });

  it('reserveLimit: idle buffers are destroyed before a new buffer would pass it', async () => {
    const gpu = await nodeGpu({ poison: false });
    const al = gpu.allocator;
    gpu.trimPool();
    const held = al.report().reserved;
    al.reserveLimit = held + 3 * MiB;
    const ts = [1, 2, 3].map(() => gpu.tensor([MiB / 4], 'f32', 'scratch')); // 3 MiB live
    gpu.free(...ts); // 3 MiB idle
    const evicted = al.poolStats.evicted;
    const big = gpu.tensor([(2 * MiB) / 4], 'f32', 'scratch'); // a new class: 2 MiB must be made room for
    assert.equal(al.poolStats.evicted - evicted, 2, 'two idle 1 MiB buffers destroyed');
    assert.ok(al.report().reserved <= al.reserveLimit);
    gpu.free(big);
    gpu.destroy();
  });

  it('reserveLimit: a buffer evicted while recorded commands still read it is destroyed only after their submit', async () => {
    // A training run under a tight --budget evicts mid-step: destroying at once made the next submit fail
    // validation ("used in submit while destroyed").
    const gpu = await nodeGpu({ poison: false });
    const al = gpu.allocator;
    gpu.trimPool();
    const n = MiB / 4;
    const x = gpu.upload(
      Array.from({ length: n }, (_, i) => i % 7),
      [n],
      'f32',
    );
    await gpu.sync();
    al.reserveLimit = al.report().reserved + 2 * MiB;
    const y = add(gpu, x, x); // recorded, not submitted: reads x
    gpu.free(x); // x's buffer idles in the pool while y's dispatch still names it
    const evicted = al.poolStats.evicted;
    const big = gpu.tensor([(2 * MiB) / 4], 'f32', 'scratch'); // a new class: room is made by evicting x's buffer
    assert.ok(al.poolStats.evicted > evicted, 'the idle buffer was evicted while the add was only recorded');
    const got = await gpu.read(y);
    for (const i of [0, 1, 6, n - 1]) assert.equal(got[i], 2 * (i % 7), `y[${i}] = 2 x[${i}]`);
    gpu.free(y, big);
    gpu.destroy();
  });

  it('a cached bind group never outlives its buffers: the same dispatches after an eviction bind the new ones', async () => {
    // A warm step reuses its bind groups (same pooled buffers, same ranges). When the pool's buffers are destroyed
    // (a budget, trimPool) the next step gets new buffers: a stale cached group would bind a destroyed buffer and
    // the submit would fail validation, or read the wrong memory.
    const gpu = await nodeGpu({ poison: false });
    const n = 4096;
    const x = gpu.upload(
      Array.from({ length: n }, (_, i) => i % 5),
      [n],
      'f32',
    );
    const step = async () => {
      const t = add(gpu, x, x);
      const y = add(gpu, t, x);
      gpu.free(t);
      const got = await gpu.read(y);
      gpu.free(y);
      return got;
    };
    await step();
    const warm = gpu.stats.bindGroupsCreated;
    await step();
    assert.equal(gpu.stats.bindGroupsCreated, warm, 'a warm step reuses its bind groups');
    gpu.trimPool(); // destroys the idle buffers t and y came from, and empties the bind-group cache
    const got = await step();
    assert.equal(gpu.stats.bindGroupsCreated - warm, 2, 'both dispatches bind the new buffers through new groups');
    for (const i of [0, 1, 4, n - 1]) assert.equal(got[i], 3 * (i % 5), `y[${i}] = 3 x[${i}]`);
    // A refused dispatch records nothing: the count stays, and the next dispatch runs as before.
    const d = gpu.stats.dispatches;
    assert.throws(() => add(gpu, x, x, Number.NaN), /uniform 'alpha' is missing or not a number/);
    assert.equal(gpu.stats.dispatches, d);
    assert.equal((await step())[4], 12);
    gpu.destroy();
  });
});

/**
 * A device with `capacity` bytes whose createBuffer fails like WebGPU's on exhaustion (an out-of-memory error
 * in the enclosing error scope): lavapipe uses host memory and cannot be filled safely in a test.
 */
function smallDevice(capacity: number) {
  let used = 0;
  const scopes: (string | null)[] = [];
  const device = {
    pushErrorScope: () => scopes.push(null),
    popErrorScope: async () => {
      const e = scopes.pop();
      return e ? { message: e } : null;
    },
    createBuffer: ({ size, usage }: { size: number; usage: number }) => {
      const fits = used + size <= capacity;
      if (fits) used += size;
      else if (scopes.length) scopes[scopes.length - 1] = `not enough memory for ${size} bytes`;
      let destroyed = false;
      return {
        size,
        usage,
        destroy: () => {
          if (fits && !destroyed) used -= size;
          destroyed = true;
        },
      };
    },
  };
  return { device: device as unknown as GPUDevice, used: () => used };
}

describe('caching allocator: out of memory', () => {
  it('allocChecked empties the pool and retries once; it throws only when the memory is not there', async () => {
    const dev = smallDevice(8 * MiB);
    const al = new Allocator(dev.device, 1 << 30);
    const idle = [0, 1, 2].map(() => al.alloc(2 * MiB, 'scratch', 'idle'));
    for (const a of idle) al.free(a);
    assert.equal(dev.used(), 6 * MiB);
    const big = await al.allocChecked(4 * MiB, 'activations', 'big'); // 6 + 4 > 8: fails, trims, retries
    assert.equal(big.bytes, 4 * MiB);
    assert.equal(al.report().pool.bytes, 0, 'the pool was emptied for it');
    assert.equal(al.poolStats.evicted, 3);
    await assert.rejects(al.allocChecked(5 * MiB, 'activations', 'too big'), (e: unknown) => e instanceof GpuOutOfMemoryError && /too big/.test(String(e)));
  });

  it('an alloc() that ran out surfaces at takeOomErrors, which empties the pool so a retry finds the memory', async () => {
    const dev = smallDevice(40 * MiB);
    const al = new Allocator(dev.device, 1 << 30);
    const idle = al.alloc(32 * MiB, 'scratch', 'idle');
    al.free(idle);
    const failed = al.alloc(16 * MiB, 'activations', 'step'); // 32 + 16 > 40
    const errors = await al.takeOomErrors();
    assert.equal(errors.length, 1);
    assert.match(errors[0].message, /step/);
    assert.equal(al.report().pool.bytes, 0);
    al.free(failed);
    al.trimPool();
    assert.equal((await al.allocChecked(16 * MiB, 'activations', 'retry')).bytes, 16 * MiB);
  });
});
