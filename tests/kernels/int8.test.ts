// Frozen int8 base weights (src/ops/int8.ts): the quantiser's round trip and its refusal, and the int8 GEMM and conv
// kernels (dequantized as they load the weight) against a dequantize-then-f64 reference on ragged sizes.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import type { Gpu } from '../../src/gpu/device.ts';
import type { DType } from '../../src/gpu/tensor.ts';
import { conv2d, conv2dBackwardInput, conv2dBackwardRef, conv2dRef } from '../../src/ops/conv2d.ts';
import { dequantizeInt8, int8Bytes, isInt8, quantizeInt8, toInt8, uploadInt8, INT8_TOLERANCE } from '../../src/ops/int8.ts';
import { matmul, matmulRef } from '../../src/ops/matmul.ts';
import { roundToF16 } from '../../src/util/half.ts';
import { recordDispatches, testGpu } from '../helpers.ts';

/** Deterministic normal values (Box-Muller over an LCG), rounded to f16 so f16 and f32 kernels see the same inputs. */
function normals(n: number, seed: number, sd = 1): Float32Array {
  let s = seed >>> 0;
  const u = () => ((s = (Math.imul(s, 1664525) + 1013904223) >>> 0) + 0.5) / 2 ** 32;
  const out = new Float32Array(n);
  for (let i = 0; i < n; i++) out[i] = sd * Math.sqrt(-2 * Math.log(u())) * Math.cos(2 * Math.PI * u());
  return roundToF16(out);
}

/**
 * |got - ref| <= rel·|ref| + K·2^-22·Σ|a·b| per element: the output's rounding (2^-11 in f16, 2^-24 in f32) plus
 * f32 accumulation over K terms (the kernels and the f64 reference sum in different orders). `absSum` is Σ|a·b|.
 */
function assertClose(got: Float32Array, ref: Float32Array, absSum: Float32Array, K: number, dtype: DType, what: string): void {
  const rel = dtype === 'f16' ? 2 ** -10 : 2 ** -22;
  let worst = 0;
  for (let i = 0; i < ref.length; i++) {
    const bound = rel * Math.abs(ref[i]) + K * 2 ** -22 * absSum[i] + 1e-30;
    worst = Math.max(worst, Math.abs(got[i] - ref[i]) / bound);
  }
  assert.ok(worst <= 1, `${what}: worst error ${worst.toFixed(2)} x its bound`);
}

// f32 on every case, f16 (where the device has it) on the first: each dtype and shape compiles its own pipelines,
// which is most of this file's time on lavapipe.
const dtypes = (gpu: Gpu, first: boolean): DType[] => (gpu.hasF16 && first ? ['f32', 'f16'] : ['f32']);

describe('int8 quantiser', () => {
  it('rounds a Gaussian weight within scale / 2 per element and well inside the tolerance', () => {
    const shape = [13, 37];
    const w = normals(13 * 37, 1, 0.05);
    const qz = quantizeInt8(w, shape)!;
    assert.ok(qz, 'a Gaussian weight must quantise');
    const back = dequantizeInt8(qz);
    for (let r = 0; r < 13; r++) for (let j = 0; j < 37; j++) assert.ok(Math.abs(back[r * 37 + j] - w[r * 37 + j]) <= qz.scale[r] * 0.5 * (1 + 1e-6));
    // absmax levels: ~0.9 % RMS error over mean |w| for Gaussian rows (file comment of src/ops/int8.ts), under 2 %
    assert.ok(qz.worstError < INT8_TOLERANCE / 1.5, `worst row error ${qz.worstError}`);
  });

  it('keeps a weight whose row has an outlier in f16, never silently degraded', async () => {
    const gpu = await testGpu();
    const shape = [4, 64];
    const w = normals(256, 2, 0.01);
    w[2 * 64 + 5] = 8; // 800 sigma: the rest of row 2 falls into the zero level (its error ~ its mean |w|)
    assert.equal(quantizeInt8(w, shape), null);
    const t = gpu.upload(w, shape, gpu.computeDType, 'weights');
    const kept = await toInt8(gpu, t);
    assert.equal(kept, t, 'the float weight is returned as it was');
    assert.ok(!isInt8(kept));
    // without the outlier the same weight is stored in int8, at 1 byte per element plus a scale per row
    w[2 * 64 + 5] = 0.01;
    const q = await toInt8(gpu, gpu.upload(w, shape, gpu.computeDType, 'weights'));
    assert.ok(isInt8(q));
    assert.equal(q.alloc.bytes, int8Bytes(shape));
    assert.equal(int8Bytes(shape), 256 + 4 * 4);
    gpu.free(kept, q);
  });
});

describe('int8 GEMM', () => {
  // x · Wᵀ (a linear's forward, B stored [N, K]) and dy · W (its dx, B stored [K, N]) on ragged sizes.
  for (const [M, N, K] of [
    [37, 29, 45],
    [5, 70, 131],
  ])
    it(`x · Wᵀ and dy · W at M ${M}, N ${N}, K ${K} equal the dequantized f64 reference`, async () => {
      const gpu = await testGpu();
      for (const dtype of dtypes(gpu, M === 37)) {
        const wv = normals(N * K, 3 + M, 0.1);
        const qz = quantizeInt8(wv, [N, K])!;
        const deq = dequantizeInt8(qz);
        const w = uploadInt8(gpu, qz, [N, K], dtype);
        const xv = normals(M * K, 4 + N);
        const x = gpu.upload(xv, [M, K], dtype);
        const biasV = normals(N, 5);
        const bias = gpu.upload(biasV, [N], dtype);
        let y = matmul(gpu, x, w, { transB: true, bias });
        const seen = recordDispatches(gpu, () => gpu.free(matmul(gpu, x, w, { transB: true })));
        assert.ok(
          seen.some((d) => d.defs.B_INT8 === true),
          'the GEMM reads the int8 weight itself',
        );
        const ref = matmulRef(xv, [M, K], deq, [N, K], { transB: true, bias: biasV });
        const abs = matmulRef(xv.map(Math.abs), [M, K], deq.map(Math.abs), [N, K], { transB: true, bias: biasV.map(Math.abs) });
        assertClose(await gpu.read(y), ref, abs, K, dtype, `${dtype} forward`);
        // dx = dy · W: the scale now belongs to the reduction index (W's stored row)
        const dyv = normals(M * N, 6 + K);
        const dy = gpu.upload(dyv, [M, N], dtype);
        gpu.free(y);
        y = matmul(gpu, dy, w);
        const dref = matmulRef(dyv, [M, N], deq, [N, K]);
        const dabs = matmulRef(dyv.map(Math.abs), [M, N], deq.map(Math.abs), [N, K]);
        assertClose(await gpu.read(y), dref, dabs, N, dtype, `${dtype} dx`);
        gpu.free(y, x, bias, dy, w);
      }
    });

  it('refuses an int8 weight as operand a or batched', async () => {
    const gpu = await testGpu();
    const qz = quantizeInt8(normals(12, 7), [3, 4])!;
    const w = uploadInt8(gpu, qz, [3, 4], 'f32');
    const x = gpu.zeros([4, 3], 'f32');
    assert.throws(() => matmul(gpu, w, x), /int8 weight is read only as an unbatched operand b/);
    gpu.free(w, x);
  });
});

describe('int8 conv2d', () => {
  const cases: [string, number[], number[], { stride: number; padding: number }][] = [
    ['3x3 stride 1', [2, 3, 7, 9], [5, 3, 3, 3], { stride: 1, padding: 1 }],
    ['3x3 stride 2', [1, 6, 9, 6], [7, 6, 3, 3], { stride: 2, padding: 1 }],
    ['1x1', [2, 5, 3, 5], [6, 5, 1, 1], { stride: 1, padding: 0 }],
  ];
  for (const [name, xShape, wShape, opts] of cases)
    it(`${name}: forward and grad input equal the dequantized f64 reference`, async () => {
      const gpu = await testGpu();
      const wn = wShape.reduce((a, b) => a * b);
      const xn = xShape.reduce((a, b) => a * b);
      const red = wn / wShape[0];
      for (const dtype of dtypes(gpu, name === cases[0][0])) {
        const qz = quantizeInt8(normals(wn, 11, 0.2), wShape)!;
        const deq = dequantizeInt8(qz);
        const w = uploadInt8(gpu, qz, wShape, dtype);
        const xv = normals(xn, 12);
        const x = gpu.upload(xv, xShape, dtype);
        const bv = normals(wShape[0], 13);
        const b = gpu.upload(bv, [wShape[0]], dtype);
        const seen = recordDispatches(gpu, () => gpu.free(conv2d(gpu, x, w, null, opts)));
        assert.ok(
          seen.some((d) => d.defs.W_INT8 === true),
          'the conv reads the int8 weight itself',
        );
        const y = conv2d(gpu, x, w, b, opts);
        const ref = conv2dRef(xv, xShape, deq, wShape, bv, opts);
        const abs = conv2dRef(xv.map(Math.abs), xShape, deq.map(Math.abs), wShape, bv.map(Math.abs), opts);
        assertClose(await gpu.read(y), ref, abs, red, dtype, `${dtype} ${name} forward`);
        const dyv = normals(y.numel, 14);
        const dy = gpu.upload(dyv, y.shape, dtype);
        const dx = conv2dBackwardInput(gpu, x, w, dy, opts);
        const dref = conv2dBackwardRef(xv, xShape, deq, wShape, dyv, opts).dx;
        const dabs = conv2dBackwardRef(xv, xShape, deq.map(Math.abs), wShape, dyv.map(Math.abs), opts).dx;
        assertClose(await gpu.read(dx), dref, dabs, wShape[0] * wShape[2] * wShape[3], dtype, `${dtype} ${name} grad input`);
        gpu.free(w, x, b, y, dy, dx);
      }
    });
});
