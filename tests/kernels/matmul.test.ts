import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { ShapeError } from '../../src/gpu/errors.ts';
import { roundToF16 } from '../../src/util/half.ts';
import { linear, linearBackward, matmul, matmulBackward, matmulBackwardRef, matmulRef } from '../../src/ops/matmul.ts';
import {
  GPU_TILE_32,
  GPU_TILE_64,
  GPU_TILE_COLS_16,
  GPU_TILE_ROWS_16,
  GPU_TILES,
  pickTile,
  TILE_128,
  TILE_32,
  TILE_64,
  TILE_COLS_16,
  TILE_COLS_4,
  TILE_ROWS_16,
  TILE_ROWS_4,
  tileSharedBytes,
} from '../../src/ops/tiles.ts';
import { prefetchFits } from '../../src/ops/gemm.ts';
import { compare, describeCheck, randomValues } from '../../src/selftest/check.ts';
import { matmulTol } from '../../src/selftest/cases/matmul.ts';
import { assertChecks, defineCaseTests, testGpu } from '../helpers.ts';

defineCaseTests('matmul');

const shapeError =
  (op: string, ...parts: string[]) =>
  (e: unknown) =>
    e instanceof ShapeError && e.message.startsWith(`${op}:`) && parts.every((p) => e.message.includes(p));

describe('matmul bad input', () => {
  it('K mismatch names the op and both shapes', async () => {
    const gpu = await testGpu();
    const a = gpu.zeros([4, 5], 'f32');
    const b = gpu.zeros([6, 3], 'f32');
    assert.throws(() => matmul(gpu, a, b), shapeError('matmul', '[4,5]', '[6,3]', 'inner'));
    assert.throws(() => matmul(gpu, a, b, { transB: true }), shapeError('matmul', '[4,5]', '[6,3]'));
    assert.throws(() => matmulBackward(gpu, a, b, gpu.zeros([4, 3], 'f32')), shapeError('matmulBackward', '[4,5]', '[6,3]'));
    gpu.free(a, b);
  });

  it('batch, bias, out and dy shape mismatches', async () => {
    const gpu = await testGpu();
    const a = gpu.zeros([2, 4, 5], 'f32');
    const b = gpu.zeros([3, 5, 6], 'f32');
    assert.throws(() => matmul(gpu, a, b), shapeError('matmul', '[2,4,5]', '[3,5,6]', 'batch'));
    const b2 = gpu.zeros([5, 6], 'f32');
    assert.throws(() => matmul(gpu, a, b2, { bias: gpu.zeros([5], 'f32') }), shapeError('matmul', 'bias', '[6]', '[5]'));
    assert.throws(() => matmul(gpu, a, b2, { out: gpu.zeros([4, 6], 'f32') }), shapeError('matmul', 'out', '[2,4,6]', '[4,6]'));
    assert.throws(() => matmulBackward(gpu, a, b2, gpu.zeros([2, 4, 5], 'f32')), shapeError('matmulBackward', 'dy', '[2,4,6]', '[2,4,5]'));
    assert.throws(() => matmul(gpu, gpu.zeros([5], 'f32'), b2), shapeError('matmul', '[5]'));
  });

  it('dtype mismatch', async () => {
    const gpu = await testGpu();
    const a = gpu.zeros([4, 5], 'f16');
    const b = gpu.zeros([5, 3], 'f32');
    assert.throws(() => matmul(gpu, a, b), shapeError('matmul', 'dtype', 'f16[4,5]', 'f32[5,3]'));
    const b16 = gpu.zeros([5, 3], 'f16');
    assert.throws(() => matmul(gpu, a, b16, { bias: gpu.zeros([3], 'f32') }), shapeError('matmul', 'dtype'));
    assert.throws(() => linear(gpu, a, gpu.zeros([3, 5], 'f32')), shapeError('matmul', 'dtype'));
  });

  it('linear: wrong input features', async () => {
    const gpu = await testGpu();
    const x = gpu.zeros([2, 7], 'f32');
    const w = gpu.zeros([3, 8], 'f32');
    assert.throws(() => linear(gpu, x, w), shapeError('linear', '[2,7]', '[3,8]'));
    assert.throws(() => linearBackward(gpu, x, w, gpu.zeros([2, 3], 'f32')), shapeError('linearBackward', '[2,7]', '[3,8]'));
  });
});

describe("matmul rowBias (a 1x1 convolution's per-channel bias)", () => {
  it('adds bias[m] to row m of every batch, also with a batched a over a broadcast b; refuses a wrong shape or both biases', async () => {
    const gpu = await testGpu();
    const [B, M, K, N] = [3, 10, 7, 12];
    const av = randomValues(B * M * K, 91);
    const bv = randomValues(K * N, 92);
    const rv = randomValues(M, 93, 10); // |bias| up to 10, far above the tolerance if it lands on the wrong rows
    const [a, b, r] = [gpu.upload(av, [B, M, K], 'f32'), gpu.upload(bv, [K, N], 'f32'), gpu.upload(rv, [M], 'f32')];
    const y = matmul(gpu, a, b, { rowBias: r });
    assertChecks([compare('rowBias', await gpu.read(y), matmulRef(av, [B, M, K], bv, [K, N], { rowBias: rv }), matmulTol('f32'))]);
    assert.throws(() => matmul(gpu, a, b, { rowBias: b }), shapeError('matmul', 'rowBias', `[${M}]`));
    assert.throws(() => matmul(gpu, a, b, { rowBias: r, bias: gpu.zeros([N], 'f32') }), shapeError('matmul', 'not both'));
    gpu.free(a, b, r, y);
  });
});

describe('matmul at ragged and extreme shapes', () => {
  // Shapes no tile divides, K not a multiple of 4 or of any staging depth, single rows/columns, and more batches
  // than one dispatch may have workgroups along z (65535): each must give matmulRef's result, not a wrong one.
  const shapes: { what: string; a: number[]; b: number[]; transA?: boolean; transB?: boolean }[] = [
    { what: '1x1x1', a: [1, 1], b: [1, 1] },
    { what: 'K = 7', a: [3, 7], b: [7, 5] },
    { what: 'M = N = 1, K = 301', a: [1, 301], b: [301, 1] },
    { what: 'odd M, N, K, both transposed', a: [13, 33], b: [17, 13], transA: true, transB: true },
    { what: '70000 batches (past 65535 workgroups along z)', a: [70000, 2, 3], b: [70000, 3, 2] },
  ];
  for (const dtype of ['f32', 'f16'] as const)
    it(`every shape gives the reference result [${dtype}]`, async (t) => {
      const gpu = await testGpu();
      const checks = [];
      for (const [i, s] of shapes.entries()) {
        const av = roundToF16(
          randomValues(
            s.a.reduce((p, d) => p * d, 1),
            20 + i,
          ),
        );
        const bv = roundToF16(
          randomValues(
            s.b.reduce((p, d) => p * d, 1),
            40 + i,
          ),
        );
        const ta = gpu.upload(av, s.a, dtype);
        const tb = gpu.upload(bv, s.b, dtype);
        const opts = { transA: s.transA, transB: s.transB };
        const y = matmul(gpu, ta, tb, opts);
        checks.push(compare(s.what, await gpu.read(y), matmulRef(av, s.a, bv, s.b, opts), matmulTol(dtype)));
        gpu.free(ta, tb, y);
      }
      for (const c of checks) t.diagnostic(describeCheck(c));
      assertChecks(checks);
    });
});

describe('matmul larger than one storage binding (bindingLimit 4096 bytes)', () => {
  for (const dtype of ['f32', 'f16'] as const)
    it(`row-chunked forward, K-chunked and row-chunked backward [${dtype}]`, async (t) => {
      const gpu = await testGpu({ bindingLimit: 4096 });
      try {
        const [B, M, K, N] = [3, 50, 40, 24];
        // a: 6000 elements (24 KB f32) - far past one 4 KB binding; b and c too.
        const a = roundToF16(randomValues(B * M * K, 1));
        const w = roundToF16(randomValues(N * K, 2));
        const bias = roundToF16(randomValues(N, 3));
        const dy = roundToF16(randomValues(B * M * N, 4));
        const ta = gpu.upload(a, [B, M, K], dtype);
        const tw = gpu.upload(w, [N, K], dtype);
        const tb = gpu.upload(bias, [N], dtype);
        const tdy = gpu.upload(dy, [B, M, N], dtype);
        assert.ok(ta.byteSize > 2 * gpu.maxBinding && tdy.byteSize > gpu.maxBinding, `a ${ta.byteSize} B, dy ${tdy.byteSize} B`);
        const d0 = gpu.dispatchCount;
        const y = linear(gpu, ta, tw, tb);
        assert.ok(gpu.dispatchCount - d0 >= Math.ceil(ta.byteSize / gpu.maxBinding), `forward ran as ${gpu.dispatchCount - d0} dispatches`);
        const gr = linearBackward(gpu, ta, tw, tdy, tb);
        // Split-K chunks of dW add partial sums in the output dtype: f16 rounds each partial.
        const tol = dtype === 'f32' ? matmulTol('f32') : { atol: 5e-2, rtol: 1e-2 };
        const ref = matmulBackwardRef(a, [B * M, K], w, [N, K], dy, { transB: true });
        const checks = [
          compare('y', await gpu.read(y), matmulRef(a, [B * M, K], w, [N, K], { transB: true, bias }), tol),
          compare('dx', await gpu.read(gr.dx), ref.da, tol),
          compare('dw', await gpu.read(gr.dw), ref.db, tol),
          compare('db', await gpu.read(gr.dbias!), ref.dbias, tol),
        ];
        // Batched b (not broadcast) and transposed a: per-batch dispatches, M / K chunks.
        const b3 = roundToF16(randomValues(B * K * N, 5));
        const tb3 = gpu.upload(b3, [B, K, N], dtype);
        const at = gpu.upload(a, [B, K, M], dtype);
        const y2 = matmul(gpu, at, tb3, { transA: true });
        checks.push(compare('batched aᵀ·b', await gpu.read(y2), matmulRef(a, [B, K, M], b3, [B, K, N], { transA: true }), tol));
        for (const c of checks) t.diagnostic(describeCheck(c));
        assertChecks(checks);
      } finally {
        gpu.destroy();
      }
    });

  it('rows wider than a binding split along K as well; a binding below one element is refused', async () => {
    const gpu = await testGpu({ bindingLimit: 1024 });
    try {
      // Every row of a [2, 600] and of bᵀ [3, 600] is 2400 bytes: the GEMM is cut along K too.
      const a = randomValues(2 * 600, 6);
      const b = randomValues(3 * 600, 7);
      const y = matmul(gpu, gpu.upload(a, [2, 600], 'f32'), gpu.upload(b, [3, 600], 'f32'), { transB: true });
      assertChecks([compare('y', await gpu.read(y), matmulRef(a, [2, 600], b, [3, 600], { transB: true }), { atol: 1e-4, rtol: 1e-4 })]);
    } finally {
      gpu.destroy();
    }
    const tiny = await testGpu({ bindingLimit: 2 });
    try {
      const a = tiny.zeros([2, 600], 'f32');
      assert.throws(() => matmul(tiny, a, tiny.zeros([600, 3], 'f32')), shapeError('matmul', 'storage bindings of 2 bytes'));
    } finally {
      tiny.destroy();
    }
  });
});

describe('pickTile', () => {
  // Shapes from the demo model's UNet step (conv GEMMs per sample: Co x pixels, batch 8) and SD 1.5's linears.
  it('small GEMMs get the 32x32 tile instead of a padded 128x128 one', () => {
    assert.equal(pickTile(32, 64, 8, 8), TILE_32); // 3x3 conv 32 ch at 8x8: TILE_128 would pad 8x
    assert.equal(pickTile(32, 288, 1, 8), TILE_32); // its weight gradient [Co, Ci*9]
    assert.equal(pickTile(64, 64, 1, 8), TILE_32); // one 64x64 tile would leave the CPU's other threads idle
  });
  it('bigger tiles once their padding is small and they fill the device', () => {
    assert.equal(pickTile(616, 64, 1, 8), TILE_64); // 77 tokens x 8 prompts; 10 workgroups fill a CPU adapter
    assert.equal(pickTile(616, 64, 1, 64), TILE_32); // but not a GPU
    assert.equal(pickTile(4096, 320, 1, 64), TILE_128); // 384 of 320 columns padded (1.2x), 96 workgroups
    assert.equal(pickTile(4096, 320, 1, 8), TILE_128);
  });
  it('GPUs get 4x4 register blocks in workgroups of 32-256 invocations, and enough of them to fill the device', () => {
    // 4096x320 (SD 1.5's attention projections at 64x64 latents): TILE_128 gives 96 workgroups, 64x64 gives 320
    assert.equal(pickTile(4096, 320, 1, 256, GPU_TILES), GPU_TILE_64);
    assert.equal(pickTile(4096, 2560, 1, 256, GPU_TILES), TILE_128); // 640 workgroups of 128x128
    assert.equal(pickTile(77, 320, 1, 256, GPU_TILES), GPU_TILE_32); // cross-attention k/v: nothing fills it
    // a side of at most 4 gets the 16-wide tile too: it prefetches (prefetchFits), a 4-wide one could not
    assert.equal(pickTile(2, 320, 1, 256, GPU_TILES), GPU_TILE_ROWS_16);
    assert.equal(pickTile(8, 128, 1, 256, GPU_TILES), GPU_TILE_ROWS_16);
    assert.equal(pickTile(64, 1, 8, 256, GPU_TILES), GPU_TILE_COLS_16);
    assert.equal(pickTile(64, 16, 8, 256, GPU_TILES), GPU_TILE_COLS_16);
    for (const t of [GPU_TILE_ROWS_16, GPU_TILE_COLS_16]) assert.ok(prefetchFits({ ...t, BK: 32 }), JSON.stringify(t));
    for (const t of [GPU_TILE_64, GPU_TILE_32, GPU_TILE_ROWS_16, GPU_TILE_COLS_16]) {
      const invocations = (t.BM / t.TM) * (t.BN / t.TN);
      assert.ok(invocations >= 32 && invocations <= 256 && t.TM === 4 && t.TN === 4, JSON.stringify(t));
      assert.ok(tileSharedBytes(t) <= 16384, `${JSON.stringify(t)} fits Chrome's default 16 KiB of workgroup memory`);
    }
  });
  it('skinny tiles where one side is at most 16', () => {
    assert.equal(pickTile(2, 320, 1, 8), TILE_ROWS_4);
    assert.equal(pickTile(8, 128, 1, 8), TILE_ROWS_16);
    assert.equal(pickTile(64, 1, 8, 8), TILE_COLS_4);
    assert.equal(pickTile(64, 16, 8, 8), TILE_COLS_16);
  });
});
