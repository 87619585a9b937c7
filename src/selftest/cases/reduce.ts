// Reductions: total, row and column sums, MSE loss and gradient, global norm over several tensors,
// against PyTorch (float64 goldens) and the TS references; the non-finite flag on f16/f32 bit
// patterns; views at unaligned offsets; finite differences of the MSE gradient.
import type { Gpu } from '../../gpu/device.ts';
import { roundToF16 } from '../../util/half.ts';
import { Tensor, type DType } from '../../gpu/tensor.ts';
import {
  checkFinite,
  checkFiniteRef,
  clearFlag,
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
} from '../../ops/reduce.ts';
import { compare, randomValues, type Check, type KernelCase, type Tolerance } from '../check.ts';
import { finiteDiff, sampleIndices } from './matmul.ts';

/**
 * f32 sums of up to 7000 f16-exact terms of size ~1 (tree order vs float64): a few 1e-7 of the
 * sum of |terms|, so atol 2e-4 on sums up to ~2000, rtol 1e-5.
 */
const SUM_TOL: Tolerance = { atol: 2e-4, rtol: 1e-5 };
/** The same sums stored as f16: plus half an f16 ulp (2^-11 relative). */
const SUM_F16_TOL: Tolerance = { atol: 2e-4, rtol: 6e-4 };
const EXACT: Tolerance = { atol: 0, rtol: 0 };

function outTol(dtype: DType): Tolerance {
  return dtype === 'f16' ? SUM_F16_TOL : SUM_TOL;
}

/** A non-owning view of `count` elements of `t` from element `start` (any byte offset). */
export function viewOf(t: Tensor, start: number, shape: number[]): Tensor {
  return new Tensor(t.alloc, shape, t.dtype, t.byteOffset + start * (t.dtype === 'f16' ? 2 : 4), false);
}

async function flagValue(gpu: Gpu, flag: Tensor): Promise<number> {
  return (await gpu.read(flag))[0];
}

export const cases: KernelCase[] = [
  {
    family: 'reduce',
    name: 'sum of 7000 elements, row sums of [7,1000], column sums of [3,100,37], f32 and storage-dtype outputs (golden)',
    async run({ gpu, dtype, golden }) {
      const x = golden.get('sum.x');
      const c = golden.get('cols.x');
      const tx = gpu.upload(x.data, x.shape, dtype);
      const tc = gpu.upload(c.data, c.shape, dtype);
      const all = await gpu.read(sumAll(gpu, tx));
      const rows = await gpu.read(sumRows(gpu, tx));
      const rowsT = await gpu.read(sumRows(gpu, tx, dtype));
      const cols = await gpu.read(sumColumns(gpu, tc));
      const colsT = await gpu.read(sumColumns(gpu, tc, dtype));
      gpu.free(tx, tc);
      const rowsWant = golden.get('sum.rows').data;
      const colsWant = golden.get('cols.sum').data;
      return [
        compare('sum vs torch', all, golden.get('sum.all').data, SUM_TOL),
        compare('sum vs ts ref', all, [sumAllRef(x.data)], SUM_TOL),
        compare('row sums vs torch', rows, rowsWant, SUM_TOL),
        compare('row sums vs ts ref', rows, sumRowsRef(x.data, 1000), SUM_TOL),
        compare(`row sums stored ${dtype} vs torch`, rowsT, dtype === 'f16' ? roundToF16(rowsWant) : rowsWant, outTol(dtype)),
        compare('column sums vs torch', cols, colsWant, SUM_TOL),
        compare('column sums vs ts ref', cols, sumColumnsRef(c.data, 37), SUM_TOL),
        compare(`column sums stored ${dtype} vs torch`, colsT, dtype === 'f16' ? roundToF16(colsWant) : colsWant, outTol(dtype)),
      ];
    },
  },
  {
    family: 'reduce',
    name: 'MSE loss [2,4,9,11] and its gradient x loss scale 512 (golden)',
    async run({ gpu, dtype, golden }) {
      const pred = golden.get('mse.pred');
      const target = golden.get('mse.target');
      const tp = gpu.upload(pred.data, pred.shape, dtype);
      const tt = gpu.upload(target.data, target.shape, dtype);
      const loss = await gpu.read(mseLoss(gpu, tp, tt));
      const d = await gpu.read(mseLossBackward(gpu, tp, tt, 512));
      const d32 = await gpu.read(mseLossBackward(gpu, tp, tt, 512, 'f32'));
      gpu.free(tp, tt);
      const scaled = golden.get('mse.dpred').data.map((v) => v * 512); // exact: a power of two
      // Loss: a mean of 792 squares accumulated in f32. Gradient: one f32 multiply (1e-6), then
      // f16 storage rounding (4.9e-4 relative) in the f16 variant.
      const lossTol = { atol: 1e-6, rtol: 1e-5 };
      const f32Tol = { atol: 1e-6, rtol: 1e-6 };
      const gTol = dtype === 'f32' ? f32Tol : { atol: 1e-4, rtol: 1e-3 };
      return [
        compare('loss vs torch', loss, golden.get('mse.loss').data, lossTol),
        compare('loss vs ts ref', loss, [mseLossRef(pred.data, target.data)], lossTol),
        compare(`dpred*scale (${dtype}) vs torch`, d, scaled, gTol),
        compare(`dpred*scale (${dtype}) vs ts ref`, d, mseLossBackwardRef(pred.data, target.data, 512), gTol),
        compare('dpred*scale stored f32 vs torch', d32, scaled, f32Tol),
      ];
    },
  },
  {
    family: 'reduce',
    name: 'global norm over three tensors, and divided by a loss scale (golden)',
    async run({ gpu, dtype, golden }) {
      const ts = [0, 1, 2].map((i) => golden.get(`norm.t${i}`));
      const tt = ts.map((t) => gpu.upload(t.data, t.shape, dtype));
      const norm = await gpu.read(globalNorm(gpu, tt));
      const scaled = await gpu.read(globalNorm(gpu, tt, 8));
      gpu.free(...tt);
      const want = golden.get('norm.value').data;
      // sqrt of an f32 sum of 5564 squares: relative error ~1e-7 .. 1e-6.
      const t = { atol: 1e-5, rtol: 1e-5 };
      return [
        compare('norm vs torch', norm, want, t),
        compare('norm vs ts ref', norm, [globalNormRef(ts.map((x) => x.data))], t),
        compare('norm / 8 vs torch', scaled, [want[0] / 8], t),
      ];
    },
  },
  {
    family: 'reduce',
    name: 'non-finite flag: clean tensors (incl. max, subnormal, -0) leave it 0; one inf, NaN or -inf sets it to 1.0 and it stays set',
    async run({ gpu, dtype }) {
      const checks: Check[] = [];
      const flag = newFlag(gpu);
      const max = dtype === 'f16' ? 65504 : 3.4028234663852886e38;
      const tiny = dtype === 'f16' ? 2 ** -24 : 2 ** -149;
      const edge = [max, -max, tiny, -tiny, -0, 0, 1];
      const clean = [gpu.upload(randomValues(3001, 1, 100), [3001], dtype), gpu.upload(edge, [edge.length], dtype)];
      checkFinite(gpu, clean, flag);
      checks.push(compare('clean (incl. max, subnormal, -0) -> 0', [await flagValue(gpu, flag)], [0], EXACT));
      for (const [label, bad] of [
        ['inf', Infinity],
        ['nan', NaN],
        ['-inf', -Infinity],
      ] as const) {
        const values = randomValues(3001, 3);
        values[2718] = bad;
        clearFlag(gpu, flag);
        const tb = gpu.upload(values, [3001], dtype);
        checkFinite(gpu, [clean[1], tb], flag);
        checks.push(compare(`${label} at #2718 -> 1.0 (ref says ${checkFiniteRef([values])})`, [await flagValue(gpu, flag)], [1], EXACT));
        checkFinite(gpu, clean, flag); // a later clean check does not clear it
        checks.push(compare(`${label}: still 1 after a clean check`, [(await readFlag(gpu, flag)) ? 1 : 0], [1], EXACT));
        gpu.free(tb);
      }
      // Only the view's own elements count: an inf just past the end of an odd-length view (the other
      // half of its last 32-bit word in f16) or just before its start must not set the flag.
      const backing = gpu.upload([Infinity, 1, 2, 3, Infinity, 5], [6], dtype);
      clearFlag(gpu, flag);
      checkFinite(gpu, [viewOf(backing, 1, [3])], flag);
      checks.push(compare('view [1,4) between two infs -> 0', [await flagValue(gpu, flag)], [0], EXACT));
      checkFinite(gpu, [viewOf(backing, 3, [2])], flag);
      checks.push(compare('view [3,5) holding the inf -> 1', [await flagValue(gpu, flag)], [1], EXACT));
      if (dtype === 'f16') {
        // 70000 overflows f16 storage to inf: the flag must see it.
        clearFlag(gpu, flag);
        const over = gpu.upload([1, 70000, 2], [3], 'f16');
        checkFinite(gpu, [over], flag);
        checks.push(compare('f16 overflow -> 1', [await flagValue(gpu, flag)], [1], EXACT));
        gpu.free(over);
      }
      gpu.free(flag, backing, ...clean);
      return checks;
    },
  },
  {
    family: 'reduce',
    name: 'views at unaligned offsets: sums, MSE, gradient and norm over elements [3, 5003) of a buffer',
    async run({ gpu, dtype }) {
      const n = 5000;
      const a = roundToF16(randomValues(n + 10, 11, 2));
      const b = roundToF16(randomValues(n + 10, 12, 2));
      const ta = gpu.upload(a, [n + 10], dtype);
      const tb = gpu.upload(b, [n + 10], dtype);
      const va = viewOf(ta, 3, [50, 100]);
      const vb = viewOf(tb, 3, [50, 100]);
      const xa = a.subarray(3, 3 + n);
      const xb = b.subarray(3, 3 + n);
      const sum = await gpu.read(sumAll(gpu, va));
      const rows = await gpu.read(sumRows(gpu, va));
      const cols = await gpu.read(sumColumns(gpu, va));
      const loss = await gpu.read(mseLoss(gpu, va, vb));
      const d = await gpu.read(mseLossBackward(gpu, va, vb, 1000));
      const norm = await gpu.read(globalNorm(gpu, [va, vb], 4));
      gpu.free(ta, tb);
      const gTol = dtype === 'f32' ? { atol: 1e-6, rtol: 1e-6 } : { atol: 1e-4, rtol: 1e-3 };
      return [
        compare('sum', sum, [sumAllRef(xa)], SUM_TOL),
        compare('row sums', rows, sumRowsRef(xa, 100), SUM_TOL),
        compare('column sums', cols, sumColumnsRef(xa, 100), SUM_TOL),
        compare('mse', loss, [mseLossRef(xa, xb)], { atol: 1e-6, rtol: 1e-5 }),
        compare('dpred', d, mseLossBackwardRef(xa, xb, 1000), gTol),
        compare('norm', norm, [globalNormRef([xa, xb], 4)], { atol: 1e-5, rtol: 1e-5 }),
      ];
    },
  },
  {
    family: 'reduce',
    name: 'finite differences of the MSE loss vs its gradient (f32)',
    dtypes: ['f32'],
    async run({ gpu }) {
      const pred = randomValues(60, 4);
      const target = randomValues(60, 5);
      const tp = gpu.upload(pred, [6, 10], 'f32');
      const tt = gpu.upload(target, [6, 10], 'f32');
      const d = await gpu.read(mseLossBackward(gpu, tp, tt));
      const idx = sampleIndices(60, 6, 6);
      const fd = await finiteDiff(gpu, tp, pred, idx, 1e-2, async () => (await gpu.read(mseLoss(gpu, tp, tt)))[0]);
      gpu.free(tp, tt);
      // The loss is quadratic, so central differences are exact up to the f32 rounding of the loss
      // (~1e-7 / (2h) = 5e-6); gradients are ~1e-2.
      return [
        compare(
          'dpred vs central difference (h=1e-2)',
          idx.map((i) => d[i]),
          fd,
          { atol: 5e-5, rtol: 1e-3 },
        ),
      ];
    },
  },
];
