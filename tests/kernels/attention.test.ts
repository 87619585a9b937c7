import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { ShapeError } from '../../src/gpu/errors.ts';
import type { Gpu } from '../../src/gpu/device.ts';
import { adapterFacts } from '../../src/gpu/adapter.ts';
import {
  attentionPlan,
  backwardTiling,
  flashAttention,
  flashAttentionBackward,
  forwardTiling,
  fusedPlan,
  MAX_HEAD_DIM,
  naiveAttention,
} from '../../src/ops/attention.ts';
import { randomValues } from '../../src/selftest/check.ts';
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

describe('attention kernel plans', () => {
  /**
   * A device with this much workgroup memory (and, where given, subgroups) for the planning functions; its adapter
   * profile built as Gpu.create builds it (src/gpu/adapter.ts), from an NVIDIA adapter or Mesa's llvmpipe.
   */
  const fakeGpu = (wgBytes: number, subgroupMinSize = 0, maxBinding = 128 << 20, vendor = 'nvidia') => {
    const limits = { maxComputeWorkgroupStorageSize: wgBytes, maxStorageBufferBindingSize: maxBinding };
    const features = subgroupMinSize > 0 ? ['subgroups'] : [];
    const facts = adapterFacts({ vendor, architecture: '', device: '', description: '', features, limits, subgroupMinSize });
    return { device: { limits }, hasSubgroups: facts.subgroups, maxBinding, facts, adapter: { vendor, subgroupMinSize } } as unknown as Gpu;
  };

  it('the tiled forward fits the device: every head dim on 32 and 48 KiB, fewer on 16 KiB; subgroups only when wide enough', () => {
    for (const [bytes, sg] of [
      [16384, 0],
      [32768, 0],
      [32768, 32],
      [49152, 32],
    ])
      for (let D = 1; D <= MAX_HEAD_DIM; D++) {
        const t = forwardTiling(fakeGpu(bytes, sg), D);
        if (bytes >= 32768) assert.ok(t, `D${D} on ${bytes} B has a tiling`);
        if (t) assert.ok(t.bytes <= bytes, `D${D}: ${t.bytes} B of workgroup memory on a ${bytes} B device`);
        if (t) assert.equal(t.subgroups, sg >= 8);
      }
    // SD 1.5's head dims on NVIDIA (48 KiB, 32-lane subgroups): Q resident (32-key tiles at D40, 16 at D80), and
    // staged in chunks at D160.
    assert.deepEqual(
      [40, 80, 160].map((D) => {
        const t = forwardTiling(fakeGpu(49152, 32), D)!;
        return [t.BK, t.KC === t.D4S];
      }),
      [
        [32, true],
        [16, true],
        [16, false],
      ],
    );
    assert.equal(forwardTiling(fakeGpu(16384), 160), null, 'D160 fits no tile in 16 KiB: the row kernel runs');
    assert.equal(forwardTiling(fakeGpu(32768, 4), 40)?.subgroups, false, '4-lane subgroups cannot hold an 8-lane row group');
    // GPUs run the tiled forward by default, CPU adapters the row kernel (unless a caller pins 'tiled').
    const sizes = { B: 1, H: 8, N: 4096, M: 4096, D: 40 };
    assert.ok(attentionPlan(fakeGpu(32768, 32), sizes).forward);
    const cpu = fakeGpu(32768, 8, 128 << 20, 'llvmpipe');
    assert.ok(cpu.facts.software);
    assert.equal(attentionPlan(cpu, sizes).forward, null);
    assert.ok(attentionPlan(cpu, sizes, { forward: 'tiled' }).forward);
  });

  it('the register-tiled backward fits the device and runs self-attention on GPUs; cross-attention keeps the fused kernel', () => {
    for (const bytes of [16384, 32768, 49152])
      for (let D = 1; D <= MAX_HEAD_DIM; D++) {
        const t = backwardTiling(fakeGpu(bytes), D);
        if (t) assert.ok(t.bytes <= bytes, `D${D}: ${t.bytes} B of workgroup memory on a ${bytes} B device`);
        if (bytes === 49152 && D <= 160) assert.ok(t, `D${D} has a tiling on 48 KiB`);
      }
    // SD 1.5's head dims on 48 KiB: 64 resident rows at D40, 32 at D80, 16 at D160; none for D160 on 16 KiB.
    assert.deepEqual(
      [40, 80, 160].map((D) => [backwardTiling(fakeGpu(49152), D)!.BQ, backwardTiling(fakeGpu(49152), D)!.BS]),
      [
        [64, 16],
        [32, 16],
        [16, 8],
      ],
    );
    assert.equal(backwardTiling(fakeGpu(16384), 160), null);
    const gpu = fakeGpu(49152, 32);
    const self = { B: 2, H: 8, N: 4096, M: 4096, D: 40 };
    const plan = attentionPlan(gpu, self, {}, 'f16');
    assert.ok(plan.tiledBackward && !plan.backward, 'self-attention at 4096 tokens: the tiled backward, no dQ scratch');
    const cross = attentionPlan(gpu, { ...self, M: 77 }, {}, 'f16');
    assert.ok(!cross.tiledBackward && cross.backward, 'cross-attention (77 keys): the fused backward splitting the queries');
    assert.ok(attentionPlan(gpu, { ...self, M: 77 }, { backward: 'tiled' }).tiledBackward, 'pinned: tiled');
    const cpu = fakeGpu(49152, 8, 128 << 20, 'llvmpipe');
    assert.equal(attentionPlan(cpu, self).tiledBackward, null, 'CPU adapters: the separate kernels');
    assert.equal(attentionPlan(cpu, self).backward, null);
    // Where no tile fits (D160 on 16 KiB), a pinned 'tiled' gets the fused kernel (or the separate ones).
    const small = attentionPlan(fakeGpu(16384), { ...self, D: 160 }, { backward: 'tiled' });
    assert.equal(small.tiledBackward, null);
  });

  it('the fused backward keeps its dQ scratch under the budget by slicing b*heads, and gives way where one does not fit', () => {
    const gpu = fakeGpu(32768);
    const sd = { B: 2, H: 8, N: 4096, M: 4096, D: 40 };
    // SD 1.5's 64x64 self-attention: 64 key blocks, 32x q per b*head: by default (2x q) the separate kernels run.
    assert.equal(fusedPlan(gpu, sd), null);
    assert.equal(fusedPlan(gpu, sd, {}, 'f16'), null);
    const plan = fusedPlan(gpu, sd, { dqScratchBytes: 128 << 20 })!;
    assert.equal(plan.bytesPerBh, 64 * 4096 * 40 * 4);
    assert.equal(plan.bhPerDispatch, 3, 'three b*heads fit 128 MiB');
    assert.equal(fusedPlan(gpu, sd, { dqScratchBytes: plan.bytesPerBh - 1 }), null, 'one b*head over the budget: separate kernels');
    assert.equal(fusedPlan(gpu, sd, { backward: 'separate', dqScratchBytes: 128 << 20 }), null);
    assert.equal(fusedPlan(fakeGpu(32768, 0, 16 << 20), sd, { dqScratchBytes: 128 << 20 }), null, 'the budget is at most one storage binding');
    // CPU adapters take the separate kernels unless a caller pins 'fused'.
    const cpu = fakeGpu(32768, 0, 128 << 20, 'llvmpipe');
    assert.equal(fusedPlan(cpu, { ...sd, M: 77 }), null);
    assert.ok(fusedPlan(cpu, { ...sd, M: 77 }, { backward: 'fused' }));
    // Cross-attention: 77 keys are 2 key blocks (2x q per b*head): every b*head in one dispatch in f32, half in
    // f16 (q is half the bytes), queries split.
    const cross = fusedPlan(gpu, { ...sd, M: 77 })!;
    assert.equal(cross.bhPerDispatch, 16);
    assert.ok(cross.bhPerDispatch * cross.bytesPerBh <= 2 * 2 * 8 * 4096 * 40 * 4);
    assert.ok(cross.qSplit < 4096);
    assert.equal(fusedPlan(gpu, { ...sd, M: 77 }, {}, 'f16')?.bhPerDispatch, 8);
  });

  it('slicing the fused backward by b*heads changes no bit of dQ, dK, dV (block-ordered sums)', async () => {
    const gpu = await testGpu();
    const [B, H, N, M, D] = [2, 3, 70, 90, 40];
    const up = (n: number, seed: number, rows: number) => gpu.upload(randomValues(n, seed), [B, H, rows, D], 'f32');
    const q = up(B * H * N * D, 1, N);
    const k = up(B * H * M * D, 2, M);
    const v = up(B * H * M * D, 3, M);
    const dy = up(B * H * N * D, 4, N);
    const f = flashAttention(gpu, q, k, v);
    const grads = async (dqScratchBytes?: number) => {
      const kernels = { backward: 'fused' as const, dqScratchBytes };
      assert.equal(attentionPlan(gpu, { B, H, N, M, D }, kernels).backward?.bhPerDispatch, dqScratchBytes ? 1 : B * H);
      const g = flashAttentionBackward(gpu, q, k, v, f.out, f.lse, dy, { kernels });
      const r = await Promise.all([g.dq, g.dk, g.dv].map((t) => gpu.read(t)));
      gpu.free(g.dq, g.dk, g.dv);
      return r;
    };
    const whole = await grads();
    const sliced = await grads(2 * N * D * 4);
    for (let i = 0; i < 3; i++) assert.deepEqual(sliced[i], whole[i]);
    assert.ok(whole[0].some((x) => x !== 0) && whole[1].some((x) => x !== 0));
    gpu.free(q, k, v, dy, f.out, f.lse);
  });
});
