// Reductions: total and row sums, MSE loss and gradient, global norm over several tensors,
// against PyTorch (float64 goldens) and the TS references; the non-finite flag; finite differences.
import type { DType } from '../../gpu/tensor.ts';
import { checkFinite, clearFlag, globalNorm, globalNormRef, mseLoss, mseLossBackward, mseLossBackwardRef, mseLossRef, newFlag, readFlag, sumAll, sumAllRef, sumRows, sumRowsRef } from '../../ops/reduce.ts';
import { compare, randomValues, type Check, type KernelCase, type Tolerance } from '../check.ts';
import { finiteDiff, sampleIndices } from './matmul.ts';

/** Sums of up to 7000 f16-exact terms in f32 (tree order): relative ~1e-6 of the sum of |terms|. */
function sumTol(_dtype: DType): Tolerance {
  return { atol: 2e-4, rtol: 1e-5 };
}

export const cases: KernelCase[] = [
  {
    family: 'reduce',
    name: 'sum of all 7000 elements and row sums of [7,1000] (golden)',
    async run({ gpu, dtype, golden }) {
      const x = golden.get('sum.x');
      const tx = gpu.upload(x.data, x.shape, dtype);
      const all = await gpu.read(sumAll(gpu, tx));
      const rows = await gpu.read(sumRows(gpu, tx));
      return [
        compare('sum vs torch', all, golden.get('sum.all').data, sumTol(dtype)),
        compare('sum vs ts ref', all, [sumAllRef(x.data)], sumTol(dtype)),
        compare('row sums vs torch', rows, golden.get('sum.rows').data, sumTol(dtype)),
        compare('row sums vs ts ref', rows, sumRowsRef(x.data, 1000), sumTol(dtype)),
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
      const scaled = golden.get('mse.dpred').data.map((v) => v * 512);
      // Gradient: one f32 multiply, then f16 rounding (4.9e-4 relative) in the f16 variant.
      const gTol = dtype === 'f32' ? { atol: 1e-6, rtol: 1e-6 } : { atol: 1e-4, rtol: 1e-3 };
      return [
        compare('loss vs torch', loss, golden.get('mse.loss').data, { atol: 1e-6, rtol: 1e-5 }),
        compare('loss vs ts ref', loss, [mseLossRef(pred.data, target.data)], { atol: 1e-6, rtol: 1e-5 }),
        compare('dpred*scale vs torch', d, scaled, gTol),
        compare('dpred*scale vs ts ref', d, mseLossBackwardRef(pred.data, target.data, 512), gTol),
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
      const want = golden.get('norm.value').data;
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
    name: 'non-finite flag: clean tensors leave it 0; one inf, NaN or -inf anywhere sets it',
    async run({ gpu, dtype }) {
      const checks: Check[] = [];
      const flag = newFlag(gpu);
      const clean = [gpu.upload(randomValues(3001, 1, 100), [3001], dtype), gpu.upload(randomValues(5, 2), [5], dtype)];
      checkFinite(gpu, clean, flag);
      checks.push(compare('clean -> 0', [(await readFlag(gpu, flag)) ? 1 : 0], [0], { atol: 0, rtol: 0 }));
      for (const [label, bad] of [['inf', Infinity], ['nan', NaN], ['-inf', -Infinity]] as const) {
        const values = randomValues(3001, 3);
        values[2718] = bad;
        clearFlag(gpu, flag);
        checkFinite(gpu, [clean[1], gpu.upload(values, [3001], dtype)], flag);
        checks.push(compare(`${label} at #2718 -> 1`, [(await readFlag(gpu, flag)) ? 1 : 0], [1], { atol: 0, rtol: 0 }));
      }
      if (dtype === 'f16') {
        // 70000 overflows f16 storage to inf: the flag must see it.
        clearFlag(gpu, flag);
        checkFinite(gpu, [gpu.upload([1, 70000, 2], [3], 'f16')], flag);
        checks.push(compare('f16 overflow -> 1', [(await readFlag(gpu, flag)) ? 1 : 0], [1], { atol: 0, rtol: 0 }));
      }
      return checks;
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
      // The loss is quadratic: central differences are exact up to f32 rounding of the loss (~1e-7 / h).
      return [compare('dpred vs central difference', idx.map((i) => d[i]), fd, { atol: 5e-5, rtol: 1e-3 })];
    },
  },
];
