import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { ShapeError } from '../../src/gpu/errors.ts';
import type { Tensor } from '../../src/gpu/tensor.ts';
import { roundToF16 } from '../../src/util/half.ts';
import { TILE_32 } from '../../src/ops/tiles.ts';
import { conv2d, conv2dBackward, conv2dBackwardInput, conv2dBackwardRef, conv2dRef, sizeAccessors, type Lowering } from '../../src/ops/conv2d.ts';
import { compare, describeCheck, randomValues } from '../../src/selftest/check.ts';
import { assertChecks, defineCaseTests, recordDispatches, testGpu } from '../helpers.ts';

defineCaseTests('conv2d');

const shapeError =
  (op: string, ...parts: string[]) =>
  (e: unknown) =>
    e instanceof ShapeError && e.message.startsWith(`${op}:`) && parts.every((p) => e.message.includes(p));

describe('conv2d bad input', () => {
  it('wrong weight channels names the op and both shapes', async () => {
    const gpu = await testGpu();
    const x = gpu.zeros([1, 3, 5, 5], 'f32');
    const w = gpu.zeros([4, 2, 3, 3], 'f32');
    const opts = { stride: 1, padding: 1 };
    assert.throws(() => conv2d(gpu, x, w, null, opts), shapeError('conv2d', '[1,3,5,5]', '[4,2,3,3]', 'input channels'));
    assert.throws(() => conv2dBackward(gpu, x, w, gpu.zeros([1, 4, 5, 5], 'f32'), opts), shapeError('conv2dBackward', '[4,2,3,3]'));
  });

  it('bias, dy, rank, stride and padding mismatches', async () => {
    const gpu = await testGpu();
    const x = gpu.zeros([1, 3, 5, 5], 'f32');
    const w = gpu.zeros([4, 3, 3, 3], 'f32');
    const opts = { stride: 2, padding: 1 };
    assert.throws(() => conv2d(gpu, x, w, gpu.zeros([3], 'f32'), opts), shapeError('conv2d', 'bias', '[4]', '[3]'));
    // stride 2 of 5x5 with pad 1 gives 3x3, not 5x5
    assert.throws(() => conv2dBackward(gpu, x, w, gpu.zeros([1, 4, 5, 5], 'f32'), opts), shapeError('conv2dBackward', 'dy', '[1,4,3,3]', '[1,4,5,5]'));
    assert.throws(() => conv2d(gpu, gpu.zeros([3, 5, 5], 'f32'), w, null, opts), shapeError('conv2d', '[3,5,5]'));
    assert.throws(() => conv2d(gpu, x, w, null, { stride: 3, padding: 1 }), shapeError('conv2d', 'stride'));
    assert.throws(() => conv2d(gpu, x, w, null, { stride: 1, padding: -1 }), shapeError('conv2d', 'padding'));
    assert.throws(() => conv2d(gpu, gpu.zeros([1, 3, 1, 1], 'f32'), w, null, { stride: 1, padding: 0 }), shapeError('conv2d', 'empty output'));
  });

  it('dtype mismatch', async () => {
    const gpu = await testGpu();
    const x = gpu.zeros([1, 3, 5, 5], 'f16');
    const w = gpu.zeros([4, 3, 1, 1], 'f32');
    assert.throws(() => conv2d(gpu, x, w, null, { stride: 1, padding: 0 }), shapeError('conv2d', 'dtype', 'f16[1,3,5,5]', 'f32[4,3,1,1]'));
    const w16 = gpu.zeros([4, 3, 1, 1], 'f16');
    assert.throws(() => conv2d(gpu, x, w16, gpu.zeros([4], 'f32'), { stride: 1, padding: 0 }), shapeError('conv2d', 'dtype'));
    assert.throws(() => conv2dBackward(gpu, x, w16, gpu.zeros([1, 4, 5, 5], 'f32'), { stride: 1, padding: 0 }), shapeError('conv2dBackward', 'dtype'));
  });
});

describe('conv2d larger than one storage binding (bindingLimit 1-2 KiB)', () => {
  for (const dtype of ['f32', 'f16'] as const)
    it(`sample-chunked forward, dx, dw, db [${dtype}]`, async (t) => {
      // 2 f32 samples or 1 f16 sample of x [5,3,9,8] per binding.
      const gpu = await testGpu({ bindingLimit: dtype === 'f32' ? 2048 : 1024 });
      try {
        const xShape = [5, 3, 9, 8];
        const wShape = [4, 3, 3, 3];
        const opts = { stride: 2, padding: 1 };
        const x = roundToF16(randomValues(5 * 3 * 72, 1));
        const w = roundToF16(randomValues(4 * 27, 2, 0.3));
        const b = roundToF16(randomValues(4, 3));
        const tx = gpu.upload(x, xShape, dtype);
        const tw = gpu.upload(w, wShape, dtype);
        const tb = gpu.upload(b, [4], dtype);
        assert.ok(tx.byteSize > 2 * gpu.maxBinding, `x is ${tx.byteSize} bytes`);
        const d0 = gpu.dispatchCount;
        const y = conv2d(gpu, tx, tw, tb, opts);
        assert.ok(gpu.dispatchCount - d0 >= Math.ceil(tx.byteSize / gpu.maxBinding), `forward ran as ${gpu.dispatchCount - d0} dispatches`);
        const dy = roundToF16(randomValues(y.numel, 4));
        const tdy = gpu.upload(dy, y.shape, dtype);
        const gr = conv2dBackward(gpu, tx, tw, tdy, opts);
        const ref = conv2dBackwardRef(x, xShape, w, wShape, dy, opts);
        // dw / db add per-chunk partial sums in the output dtype: f16 rounds each partial.
        const tol = dtype === 'f32' ? { atol: 1e-4, rtol: 1e-4 } : { atol: 3e-2, rtol: 1e-2 };
        const checks = [
          compare('y', await gpu.read(y), conv2dRef(x, xShape, w, wShape, b, opts), tol),
          compare('dx', await gpu.read(gr.dx), ref.dx, tol),
          compare('dw', await gpu.read(gr.dw), ref.dw, tol),
          compare('db', await gpu.read(gr.db), ref.db, tol),
        ];
        for (const c of checks) t.diagnostic(describeCheck(c));
        assertChecks(checks);
      } finally {
        gpu.destroy();
      }
    });

  it('one sample larger than a binding is refused with ShapeError (3x3); the forward of a 1x1 conv, a plain GEMM, runs in pixel chunks', async () => {
    const gpu = await testGpu({ bindingLimit: 1024 });
    try {
      const xv = randomValues(2 * 3 * 144, 95);
      const x = gpu.upload(xv, [2, 3, 12, 12], 'f32'); // 1728 bytes per sample
      assert.throws(() => conv2d(gpu, x, gpu.zeros([2, 3, 3, 3], 'f32'), null, { stride: 1, padding: 1 }), shapeError('conv2d', 'one sample', '1024 bytes'));
      const wv = randomValues(2 * 3, 96);
      const opts = { stride: 1, padding: 0 };
      const y = conv2d(gpu, x, gpu.upload(wv, [2, 3, 1, 1], 'f32'), null, opts);
      assertChecks([compare('1x1 chunked', await gpu.read(y), conv2dRef(xv, [2, 3, 12, 12], wv, [2, 3, 1, 1], null, opts), { atol: 1e-5, rtol: 1e-5 })]);
    } finally {
      gpu.destroy();
    }
  });
});

describe('conv2d sizes as pipeline constants', () => {
  it('sz_<name>() returns the constant def under CONST_SIZES and the uniform otherwise; a missing constant is refused', () => {
    const sizes = { GM: 70, GN: 144, GK: 81, Ci: 9, H: 12, W: 12, Co: 70, Ho: 12, Wo: 12, pad: 1 };
    const fixed = sizeAccessors({ CONST_SIZES: true, ...Object.fromEntries(Object.entries(sizes).map(([k, v]) => [`SZ_${k}`, v])) });
    for (const name of Object.keys(sizes)) {
      assert.ok(fixed.includes(`fn sz_${name}() -> u32 { return SZ_${name}; }`), name);
      assert.ok(sizeAccessors({ CONST_SIZES: false }).includes(`fn sz_${name}() -> u32 { return p.${name}; }`), name);
    }
    assert.throws(() => sizeAccessors({ CONST_SIZES: true, SZ_GM: 70 }), /CONST_SIZES without def SZ_GN/);
  });

  it('conv2d compiles the sizes in when asked (and by default only on GPUs), uniforms otherwise', async () => {
    const gpu = await testGpu();
    const x = gpu.zeros([1, 3, 6, 5], 'f32');
    const w = gpu.zeros([4, 3, 3, 3], 'f32');
    const gemms = (constSizes?: boolean) => {
      const out: Tensor[] = [];
      // the implicit GEMM (a CPU adapter's default lowering is im2col, whose GEMMs are matmuls)
      const opts = { stride: 2, padding: 1, constSizes, lowering: 'implicit' as const };
      const d = recordDispatches(gpu, () => out.push(conv2d(gpu, x, w, null, opts)));
      gpu.free(...out);
      return d.filter((r) => r.entry === 'conv_gemm').map((r) => r.defs);
    };
    const fixed = gemms(true);
    assert.equal(fixed.length, 1);
    // forward: GEMM rows Co, columns Ho*Wo = 3*3, reduction Ci*9
    assert.deepEqual(
      [fixed[0].CONST_SIZES, fixed[0].SZ_GM, fixed[0].SZ_GN, fixed[0].SZ_GK, fixed[0].SZ_H, fixed[0].SZ_W, fixed[0].SZ_Ho, fixed[0].SZ_Wo, fixed[0].SZ_pad],
      [true, 4, 9, 27, 6, 5, 3, 3, 1],
    );
    const uniform = gemms(false);
    assert.equal(uniform[0].CONST_SIZES, false);
    assert.equal(uniform[0].SZ_W, undefined);
    assert.equal(gemms()[0].CONST_SIZES, !gpu.facts.software);
    gpu.free(x, w);
  });
});

describe('conv2d lowering: implicit GEMM or im2col + plain GEMMs', () => {
  // the kernels a convolution ran (not the NaN fill of new tensors under DBS_GPU_POISON)
  const entries = (d: { entry: string }[]) => [...new Set(d.map((r) => r.entry))].filter((e) => e !== 'fill').sort();

  it('a CPU adapter whose matmuls run the direct core lowers to im2col; a forced tile, split-K or sizes keep the implicit GEMM', async () => {
    const gpu = await testGpu();
    const x = gpu.zeros([2, 3, 6, 5], 'f32');
    const w = gpu.zeros([4, 3, 3, 3], 'f32');
    const dy = gpu.zeros([2, 4, 6, 5], 'f32');
    const run = (opts: object) => {
      const out: Tensor[] = [];
      const d = recordDispatches(gpu, () => {
        out.push(conv2d(gpu, x, w, null, { stride: 1, padding: 1, ...opts }));
        const g = conv2dBackward(gpu, x, w, dy, { stride: 1, padding: 1, ...opts });
        out.push(g.dx, g.dw, g.db);
      });
      gpu.free(...out);
      return entries(d);
    };
    // grad weight is the implicit GEMM under either lowering
    const lowered = ['bias_grad', 'col2im', 'conv_gemm', 'im2col', 'matmul'];
    const implicit = ['bias_grad', 'conv_gemm'];
    assert.deepEqual(run({}), gpu.facts.software && gpu.gemmConfig.direct ? lowered : implicit);
    assert.deepEqual(run({ lowering: 'im2col' }), lowered);
    assert.deepEqual(run({ lowering: 'implicit' }), implicit);
    for (const forced of [{ tile: TILE_32 }, { splitK: 1 }, { constSizes: false }]) assert.deepEqual(run(forced), implicit, JSON.stringify(forced));
    gpu.free(x, w, dy);
  });

  it('x too large for one binding with its im2col matrix runs the implicit GEMM (bindingLimit 4 KiB)', async () => {
    const gpu = await testGpu({ bindingLimit: 4096 });
    try {
      // x is 1440 bytes, its im2col matrix 9x that: only the implicit GEMM's sample chunks fit.
      const x = gpu.zeros([1, 3, 12, 10], 'f32');
      const w = gpu.zeros([2, 3, 3, 3], 'f32');
      const out: Tensor[] = [];
      const d = recordDispatches(gpu, () => out.push(conv2d(gpu, x, w, null, { stride: 1, padding: 1 })));
      assert.deepEqual(entries(d), ['conv_gemm']);
      gpu.free(x, w, ...out);
    } finally {
      gpu.destroy();
    }
  });

  for (const dtype of ['f32', 'f16'] as const)
    it(`both lowerings match the float64 reference and each other: forward, dx, dw, db, accumulate, 1x1 [${dtype}]`, async () => {
      const gpu = await testGpu();
      // not square (a swapped height and width fails), odd sizes, stride 2 with an even and an odd side
      const shapes: [number[], number[], number, number][] = [
        [[2, 5, 9, 7], [6, 5, 3, 3], 1, 1],
        [[2, 5, 9, 8], [6, 5, 3, 3], 2, 1],
        [[3, 4, 5, 6], [7, 4, 1, 1], 1, 0],
      ];
      // f32: summation order only. f16: f16-exact inputs, f32 sums (dcol in f32), one rounding.
      const tol = dtype === 'f32' ? { atol: 1e-4, rtol: 1e-4 } : { atol: 1e-2, rtol: 2e-3 };
      const checks = [];
      for (const [xShape, wShape, stride, padding] of shapes) {
        const x = roundToF16(
          randomValues(
            xShape.reduce((a, b) => a * b),
            11,
          ),
        );
        const w = roundToF16(
          randomValues(
            wShape.reduce((a, b) => a * b),
            12,
            0.3,
          ),
        );
        const b = roundToF16(randomValues(wShape[0], 13));
        const tx = gpu.upload(x, xShape, dtype);
        const tw = gpu.upload(w, wShape, dtype);
        const tb = gpu.upload(b, [wShape[0]], dtype);
        const yRef = conv2dRef(x, xShape, w, wShape, b, { stride, padding });
        const dy = roundToF16(randomValues(yRef.length, 14));
        const tdy = gpu.upload(dy, [xShape[0], wShape[0], ...[2, 3].map((i) => Math.floor((xShape[i] + 2 * padding - wShape[i]) / stride) + 1)], dtype);
        const ref = conv2dBackwardRef(x, xShape, w, wShape, dy, { stride, padding });
        const label = `${wShape[2]}x${wShape[3]} s${stride} x [${xShape}]`;
        const got: Record<Lowering, Float32Array[]> = { implicit: [], im2col: [] };
        for (const lowering of ['implicit', 'im2col'] as const) {
          const opts = { stride, padding, lowering };
          const y = conv2d(gpu, tx, tw, tb, opts);
          const gr = conv2dBackward(gpu, tx, tw, tdy, opts);
          const dxOnly = conv2dBackwardInput(gpu, tx, tw, tdy, opts);
          // twice into f32 buffers that start at 1: accumulation adds onto what is there
          const into = {
            dx: gpu.upload(new Float32Array(tx.numel).fill(1), xShape, 'f32'),
            dw: gpu.upload(new Float32Array(tw.numel).fill(1), wShape, 'f32'),
            db: gpu.zeros([wShape[0]], 'f32'),
          };
          for (let i = 0; i < 2; i++) conv2dBackward(gpu, tx, tw, tdy, { ...opts, accumulate: true, into });
          const vals = await Promise.all([y, gr.dx, gr.dw, gr.db, dxOnly, into.dx, into.dw].map((t) => gpu.read(t)));
          got[lowering] = vals;
          const plus1x2 = (v: Float32Array) => v.map((e) => 1 + 2 * e);
          checks.push(
            compare(`${lowering} ${label} y`, vals[0], yRef, tol),
            compare(`${lowering} ${label} dx`, vals[1], ref.dx, tol),
            compare(`${lowering} ${label} dw`, vals[2], ref.dw, tol),
            compare(`${lowering} ${label} db`, vals[3], ref.db, tol),
            compare(`${lowering} ${label} dx alone`, vals[4], ref.dx, tol),
            compare(`${lowering} ${label} 1 + 2 dx accumulated (f32)`, vals[5], plus1x2(ref.dx), { atol: 1e-4, rtol: 1e-4 }),
            compare(`${lowering} ${label} 1 + 2 dw accumulated (f32)`, vals[6], plus1x2(ref.dw), { atol: 1e-4, rtol: 1e-4 }),
          );
          gpu.free(y, gr.dx, gr.dw, gr.db, dxOnly, into.dx, into.dw, into.db);
        }
        got.im2col.forEach((v, i) => checks.push(compare(`${label} im2col vs implicit [${i}]`, v, got.implicit[i], tol)));
        gpu.free(tx, tw, tb, tdy);
      }
      assertChecks(checks);
    });
});
