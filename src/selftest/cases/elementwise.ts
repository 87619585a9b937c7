import { add, addRef, cast } from '../../ops/elementwise.ts';
import { roundToF16 } from '../../gpu/half.ts';
import { compare, type KernelCase } from '../check.ts';

export const cases: KernelCase[] = [
  {
    family: 'elementwise',
    name: 'add alpha=-0.5 (golden)',
    async run({ gpu, dtype, golden }) {
      const a = golden.get('add.a');
      const b = golden.get('add.b');
      const ta = gpu.upload(a.data, a.shape, dtype);
      const tb = gpu.upload(b.data, b.shape, dtype);
      const out = await gpu.read(add(gpu, ta, tb, -0.5));
      gpu.free(ta, tb);
      const tol = dtype === 'f32' ? { atol: 1e-6, rtol: 1e-6 } : { atol: 1e-3, rtol: 1e-3 };
      return [compare('vs torch', out, golden.get('add.out').data, tol), compare('vs ts ref', out, addRef(a.data, b.data, -0.5), tol)];
    },
  },
  {
    family: 'elementwise',
    name: 'cast f32 -> f16 -> f32 rounds to nearest even',
    dtypes: ['f16'],
    async run({ gpu }) {
      const values = [0, 1, -2.5, 65504, 70000, 1e-8, 3.14159265, 1 + 2 ** -11, 1 + 3 * 2 ** -11, -1e-5];
      const x = gpu.upload(values, [values.length], 'f32');
      const h = cast(gpu, x, 'f16');
      const back = cast(gpu, h, 'f32');
      const out = await gpu.read(back);
      gpu.free(x, h, back);
      return [compare('round trip = roundToF16', out, roundToF16(values), { atol: 0, rtol: 0 })];
    },
  },
];
