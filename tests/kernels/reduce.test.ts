import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { ShapeError } from '../../src/gpu/errors.ts';
import { roundToF16 } from '../../src/util/half.ts';
import type { DType } from '../../src/gpu/tensor.ts';
import {
  checkFinite,
  globalNorm,
  globalNormRef,
  mseLoss,
  mseLossBackward,
  mseLossBackwardRef,
  mseLossRef,
  newFlag,
  readFlag,
  sumAll,
  sumAllRef,
  sumColumns,
  sumColumnsRef,
  sumRows,
  sumRowsRef,
} from '../../src/ops/reduce.ts';
import { compare, randomValues } from '../../src/selftest/check.ts';
import { viewOf } from '../../src/selftest/cases/reduce.ts';
import { assertChecks, defineCaseTests, testGpu } from '../helpers.ts';

defineCaseTests('reduce');

describe('reduce bad input', () => {
  it('names the op and the shapes', async () => {
    const gpu = await testGpu();
    const is = (re: RegExp) => (e: Error) => e instanceof ShapeError && re.test(e.message);
    assert.throws(() => mseLoss(gpu, gpu.zeros([2, 3], 'f32'), gpu.zeros([3, 2], 'f32')), is(/mseLoss: pred \[2,3\] and target \[3,2\] differ/));
    assert.throws(() => mseLossBackward(gpu, gpu.zeros([2, 3], 'f32'), gpu.zeros([6], 'f32')), is(/mseLossBackward: pred \[2,3\] and target \[6\] differ/));
    assert.throws(() => mseLoss(gpu, gpu.zeros([4], 'f16'), gpu.zeros([4], 'f32')), is(/mseLoss: dtype mismatch: f16\[4\] vs f32\[4\]/));
    assert.throws(() => mseLossBackward(gpu, gpu.zeros([4], 'f16'), gpu.zeros([4], 'f32')), is(/mseLossBackward: dtype mismatch: f16\[4\] vs f32\[4\]/));
    assert.throws(() => globalNorm(gpu, []), is(/globalNorm: no tensors/));
    assert.throws(() => globalNorm(gpu, [gpu.zeros([4], 'f32')], 0), is(/globalNorm: loss scale must be > 0/));
    assert.throws(() => checkFinite(gpu, [gpu.zeros([4], 'f32')], gpu.zeros([1], 'f16')), is(/checkFinite: flag must be f32 \[1\], got f16\[1\]/));
    assert.throws(() => checkFinite(gpu, [gpu.zeros([4], 'f32')], gpu.zeros([2], 'f32')), is(/checkFinite: flag must be f32 \[1\], got f32\[2\]/));
    assert.throws(() => sumRows(gpu, gpu.zeros([3, 0], 'f32')), is(/sumRows: needs a non-empty tensor with a last dim, got \[3,0\]/));
    assert.throws(() => sumColumns(gpu, gpu.zeros([], 'f32')), is(/sumColumns: needs a non-empty tensor with a last dim, got \[\]/));
  });
});

/** Values that are the same in f16 and f32 storage. */
function values(n: number, seed: number, scale = 1): Float32Array {
  return roundToF16(randomValues(n, seed, scale));
}

for (const dtype of ['f32', 'f16'] as DType[]) {
  describe(`reductions past a small storage binding (bindingLimit 1 KiB) [${dtype}]`, () => {
    it('sums (three passes), row and column sums, MSE, its gradient, norm and the flag walk binding-sized windows', async () => {
      // 1 KiB bindings hold 192 f32 / 384 f16 elements after the 256-byte alignment slack: segments
      // shrink to that, so 100000 elements need 3 passes, and every op runs many dispatches.
      const gpu = await testGpu({ bindingLimit: 1024 });
      try {
        const n = 100_000;
        const x = values(n, 7);
        const y = values(n, 8);
        const tx = gpu.upload(x, [n], dtype);
        const ty = gpu.upload(y, [n], dtype);
        const r = values(13 * 1000, 9);
        const tr = gpu.upload(r, [13, 1000], dtype);
        const c = values(500 * 37, 10);
        const tc = gpu.upload(c, [500, 37], dtype);
        const before = gpu.dispatchCount;
        const sum = await gpu.read(sumAll(gpu, tx));
        assert.ok(gpu.dispatchCount - before >= 3, `sumAll ran ${gpu.dispatchCount - before} dispatches`);
        const rows = await gpu.read(sumRows(gpu, tr));
        const rowsT = await gpu.read(sumRows(gpu, tr, dtype));
        const cols = await gpu.read(sumColumns(gpu, tc));
        const loss = await gpu.read(mseLoss(gpu, tx, ty));
        const d = await gpu.read(mseLossBackward(gpu, tx, ty, 4096));
        const norm = await gpu.read(globalNorm(gpu, [tr, tx, viewOf(ty, 5, [777])], 16));
        const flag = newFlag(gpu);
        checkFinite(gpu, [tx, ty, tr, tc], flag);
        const clean = await readFlag(gpu, flag);
        const bad = x.slice();
        bad[n - 5] = NaN;
        checkFinite(gpu, [gpu.upload(bad, [n], dtype)], flag);
        const gTol = dtype === 'f32' ? { atol: 1e-6, rtol: 1e-6 } : { atol: 1e-4, rtol: 1e-3 };
        assertChecks([
          // 100000 terms of |x| <= 1 in f32: error ~1e-7 * sum|x| = 5e-3 worst case, far less in practice.
          compare('sum (3 passes)', sum, [sumAllRef(x)], { atol: 2e-3, rtol: 1e-5 }),
          compare('row sums [13,1000]', rows, sumRowsRef(r, 1000), { atol: 2e-4, rtol: 1e-5 }),
          compare(`row sums stored ${dtype}`, rowsT, dtype === 'f16' ? roundToF16(sumRowsRef(r, 1000)) : sumRowsRef(r, 1000), { atol: 2e-4, rtol: 6e-4 }),
          compare('column sums [500,37]', cols, sumColumnsRef(c, 37), { atol: 2e-4, rtol: 1e-5 }),
          compare('mse', loss, [mseLossRef(x, y)], { atol: 1e-6, rtol: 1e-5 }),
          compare('dpred x 4096', d, mseLossBackwardRef(x, y, 4096), gTol),
          compare('norm / 16 over three tensors (one a view)', norm, [globalNormRef([r, x, y.subarray(5, 782)], 16)], { atol: 1e-5, rtol: 1e-5 }),
          compare('clean flag', [clean ? 1 : 0], [0], { atol: 0, rtol: 0 }),
          compare('NaN in the last window', [(await readFlag(gpu, flag)) ? 1 : 0], [1], { atol: 0, rtol: 0 }),
        ]);
        // Column sums need two rows per binding (that is how a pass makes progress): 200 f32 columns
        // (or 400 f16) do not fit twice in 1 KiB, and the error says so.
        const wide = dtype === 'f32' ? 200 : 400;
        assert.throws(
          () => sumColumns(gpu, gpu.zeros([4, wide], dtype)),
          (e: Error) => e instanceof ShapeError && new RegExp(`sumColumns: \\[4,${wide}\\]: two rows of ${wide} ${dtype} must fit`).test(e.message),
        );
      } finally {
        gpu.destroy();
      }
    });
  });
}
