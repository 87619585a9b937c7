// The partial backwards requires_grad pruning runs (nn/ops.ts) against the full ones, bit for bit: conv2d's
// dw + db without dx, linear's dW + dbias without dx, and each half of the group/layer norm backward. Ragged
// sizes (odd channels and features, K not a multiple of 4, batch 1 and 7, 3x3 / 1x1 / strided convs) so a
// shape-specialised kernel choice cannot differ between the two calls unnoticed; f32 and f16.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import type { Gpu } from '../../src/gpu/device.ts';
import type { DType, Tensor } from '../../src/gpu/tensor.ts';
import { conv2d, conv2dBackward, conv2dBackwardWeight, type Conv2dOptions } from '../../src/ops/conv2d.ts';
import { linearBackward, linearBackwardWeight } from '../../src/ops/matmul.ts';
import { groupNorm, groupNormBackward, groupNormBackwardParts, layerNorm, layerNormBackward, layerNormBackwardParts } from '../../src/ops/norm.ts';
import { Rng } from '../../src/util/rng.ts';
import { testGpu } from '../helpers.ts';

const bytes = async (gpu: Gpu, t: Tensor) => new Uint8Array(await gpu.readBytes(t.buffer, t.byteOffset, t.byteSize));

function randomUpload(gpu: Gpu, rng: Rng, shape: number[], dtype: DType): Tensor {
  const n = shape.reduce((a, b) => a * b, 1);
  return gpu.upload(
    Float32Array.from({ length: n }, () => 2 * rng.uniform() - 1),
    shape,
    dtype,
  );
}

const CONVS: { name: string; ci: number; co: number; k: number; hw: number; opts: Conv2dOptions }[] = [
  { name: '3x3 pad 1', ci: 3, co: 5, k: 3, hw: 7, opts: { stride: 1, padding: 1 } },
  { name: '1x1', ci: 5, co: 3, k: 1, hw: 5, opts: { stride: 1, padding: 0 } },
  { name: '3x3 stride 2', ci: 7, co: 3, k: 3, hw: 9, opts: { stride: 2, padding: 1 } },
];

void describe('partial backwards equal the full ones bit for bit', () => {
  for (const dtype of ['f32', 'f16'] as const)
    for (const batch of [1, 7]) {
      void it(`conv2dBackwardWeight = conv2dBackward's dw, db [${dtype}, batch ${batch}]`, async () => {
        const gpu = await testGpu();
        const rng = new Rng(batch + (dtype === 'f16' ? 100 : 0));
        for (const c of CONVS) {
          const x = randomUpload(gpu, rng, [batch, c.ci, c.hw, c.hw], dtype);
          const w = randomUpload(gpu, rng, [c.co, c.ci, c.k, c.k], dtype);
          const y = conv2d(gpu, x, w, null, c.opts);
          const dy = randomUpload(gpu, rng, [...y.shape], dtype);
          const full = conv2dBackward(gpu, x, w, dy, c.opts);
          const part = conv2dBackwardWeight(gpu, x, w, dy, { ...c.opts, bias: true });
          assert.deepEqual(await bytes(gpu, part.dw), await bytes(gpu, full.dw), `${c.name}: dw`);
          assert.deepEqual(await bytes(gpu, part.db!), await bytes(gpu, full.db), `${c.name}: db`);
          assert.equal(conv2dBackwardWeight(gpu, x, w, dy, { ...c.opts, bias: false }).db, null, `${c.name}: no bias, no db`);
          gpu.free(x, w, y, dy, full.dx, full.dw, full.db, part.dw, part.db!);
        }
      });

      void it(`linearBackwardWeight = linearBackward's dW, dbias [${dtype}, batch ${batch}]`, async () => {
        const gpu = await testGpu();
        const rng = new Rng(batch + (dtype === 'f16' ? 200 : 50));
        // rows 3 * batch (odd for batch 1 and 7), K = 7 and 13 (not multiples of 4), N = 5 and 9.
        for (const [k, n] of [
          [7, 5],
          [13, 9],
        ]) {
          const x = randomUpload(gpu, rng, [batch, 3, k], dtype);
          const w = randomUpload(gpu, rng, [n, k], dtype);
          const b = randomUpload(gpu, rng, [n], dtype);
          const dy = randomUpload(gpu, rng, [batch, 3, n], dtype);
          const full = linearBackward(gpu, x, w, dy, b);
          const part = linearBackwardWeight(gpu, x, w, dy, b);
          assert.deepEqual(await bytes(gpu, part.dw), await bytes(gpu, full.dw), `K ${k} N ${n}: dW`);
          assert.deepEqual(await bytes(gpu, part.dbias!), await bytes(gpu, full.dbias!), `K ${k} N ${n}: dbias`);
          assert.equal(linearBackwardWeight(gpu, x, w, dy, null).dbias, undefined, 'no bias, no dbias');
          gpu.free(x, w, b, dy, full.dx, full.dw, full.dbias!, part.dw, part.dbias!);
        }
      });

      void it(`norm backward halves = the full backward's dx and dgamma, dbeta [${dtype}, batch ${batch}]`, async () => {
        const gpu = await testGpu();
        const rng = new Rng(batch + (dtype === 'f16' ? 300 : 150));
        const x = randomUpload(gpu, rng, [batch, 6, 3, 5], dtype);
        const gamma = randomUpload(gpu, rng, [6], dtype);
        const beta = randomUpload(gpu, rng, [6], dtype);
        const dy = randomUpload(gpu, rng, [batch, 6, 3, 5], dtype);
        const g = groupNorm(gpu, x, gamma, beta, 3);
        const full = groupNormBackward(gpu, x, gamma, g, dy, 3);
        const dxOnly = groupNormBackwardParts(gpu, x, gamma, g, dy, 3, { dx: true, params: false });
        const paramsOnly = groupNormBackwardParts(gpu, x, gamma, g, dy, 3, { dx: false, params: true });
        assert.equal(dxOnly.dgamma, undefined);
        assert.equal(paramsOnly.dx, undefined);
        assert.deepEqual(await bytes(gpu, dxOnly.dx!), await bytes(gpu, full.dx), 'group norm dx');
        assert.deepEqual(await bytes(gpu, paramsOnly.dgamma!), await bytes(gpu, full.dgamma), 'group norm dgamma');
        assert.deepEqual(await bytes(gpu, paramsOnly.dbeta!), await bytes(gpu, full.dbeta), 'group norm dbeta');
        // Layer norm over 7 features (not a multiple of 4), rows 3 * batch.
        const xl = randomUpload(gpu, rng, [batch, 3, 7], dtype);
        const gl = randomUpload(gpu, rng, [7], dtype);
        const bl = randomUpload(gpu, rng, [7], dtype);
        const dyl = randomUpload(gpu, rng, [batch, 3, 7], dtype);
        const l = layerNorm(gpu, xl, gl, bl);
        const fullL = layerNormBackward(gpu, xl, gl, l, dyl);
        const dxL = layerNormBackwardParts(gpu, xl, gl, l, dyl, { dx: true, params: false });
        const pL = layerNormBackwardParts(gpu, xl, gl, l, dyl, { dx: false, params: true });
        assert.deepEqual(await bytes(gpu, dxL.dx!), await bytes(gpu, fullL.dx), 'layer norm dx');
        assert.deepEqual(await bytes(gpu, pL.dgamma!), await bytes(gpu, fullL.dgamma), 'layer norm dgamma');
        assert.deepEqual(await bytes(gpu, pL.dbeta!), await bytes(gpu, fullL.dbeta), 'layer norm dbeta');
      });
    }
});
