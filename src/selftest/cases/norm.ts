// GroupNorm / LayerNorm cases: forward, saved mean/rstd, dx, dgamma, dbeta against PyTorch (golden,
// computed in float64) and the plain-TS reference; a large-group case (many loop trips per
// invocation); finite differences of the GPU op in f32.
import { roundToF16 } from '../../util/half.ts';
import type { DType } from '../../gpu/tensor.ts';
import {
  groupNorm,
  groupNormBackward,
  groupNormBackwardRef,
  groupNormRef,
  layerNorm,
  layerNormBackward,
  layerNormBackwardRef,
  layerNormRef,
} from '../../ops/norm.ts';
import { compare, randomValues, type Check, type KernelCase, type Tolerance } from '../check.ts';
import { finiteDiff, sampleIndices } from './matmul.ts';

/**
 * f32: f32 sums over segments of <= a few thousand elements, against float64 goldens.
 * f16: outputs rounded to f16 (relative 4.9e-4 of values up to ~4) plus the f16 rounding of dy*gamma
 * products feeding the sums; parameter gradients are f32 sums of f16-exact products.
 */
export function normTol(dtype: DType): Tolerance {
  return dtype === 'f32' ? { atol: 2e-5, rtol: 1e-4 } : { atol: 4e-3, rtol: 4e-3 };
}

interface GoldenNorm {
  name: string;
  kind: 'group' | 'layer';
  groups: number;
  eps: number;
  what: string;
}

const GOLDEN: GoldenNorm[] = [
  { name: 'gn32', kind: 'group', groups: 32, eps: 1e-5, what: 'GroupNorm 32 groups, x [2,64,5,7]' },
  { name: 'gn4', kind: 'group', groups: 4, eps: 1e-6, what: 'GroupNorm 4 groups, x [3,12,6,5] mean 3' },
  { name: 'ln', kind: 'layer', groups: 1, eps: 1e-5, what: 'LayerNorm x [2,9,40]' },
];

function goldenCase(c: GoldenNorm): KernelCase {
  return {
    family: 'norm',
    name: `${c.what} fwd + dx/dgamma/dbeta (golden)`,
    async run({ gpu, dtype, golden }) {
      const g = (k: string) => golden.get(`${c.name}.${k}`);
      const [x, gamma, beta, dy] = ['x', 'gamma', 'beta', 'dy'].map(g);
      const tx = gpu.upload(x.data, x.shape, dtype);
      const tg = gpu.upload(gamma.data, gamma.shape, dtype);
      const tb = gpu.upload(beta.data, beta.shape, dtype);
      const tdy = gpu.upload(dy.data, dy.shape, dtype);
      const fwd = c.kind === 'group' ? groupNorm(gpu, tx, tg, tb, c.groups, c.eps) : layerNorm(gpu, tx, tg, tb, c.eps);
      const grads = c.kind === 'group' ? groupNormBackward(gpu, tx, tg, fwd, tdy, c.groups) : layerNormBackward(gpu, tx, tg, fwd, tdy);
      const ref =
        c.kind === 'group'
          ? groupNormRef(x.data, x.shape, gamma.data, beta.data, c.groups, c.eps)
          : layerNormRef(x.data, x.shape, gamma.data, beta.data, c.eps);
      const gref =
        c.kind === 'group'
          ? groupNormBackwardRef(x.data, x.shape, gamma.data, dy.data, c.groups, c.eps)
          : layerNormBackwardRef(x.data, x.shape, gamma.data, dy.data, c.eps);
      const tol = normTol(dtype);
      const y = await gpu.read(fwd.y);
      const dx = await gpu.read(grads.dx);
      const dgamma = await gpu.read(grads.dgamma);
      const dbeta = await gpu.read(grads.dbeta);
      const checks: Check[] = [
        compare('y vs torch', y, g('y').data, tol),
        compare('y vs ts ref', y, ref.y, tol),
        compare('mean vs ts ref', await gpu.read(fwd.mean), ref.mean, normTol('f32')),
        compare('rstd vs ts ref', await gpu.read(fwd.rstd), ref.rstd, { atol: 1e-5, rtol: 1e-4 }),
        compare('dx vs torch', dx, g('dx').data, tol),
        compare('dx vs ts ref', dx, gref.dx, tol),
        compare('dgamma vs torch', dgamma, g('dgamma').data, tol),
        compare('dgamma vs ts ref', dgamma, gref.dgamma, tol),
        compare('dbeta vs torch', dbeta, g('dbeta').data, tol),
        compare('dbeta vs ts ref', dbeta, gref.dbeta, tol),
      ];
      gpu.free(tx, tg, tb, tdy, fwd.y, fwd.mean, fwd.rstd, grads.dx, grads.dgamma, grads.dbeta);
      return checks;
    },
  };
}

const rand = (n: number, seed: number, scale = 1) => roundToF16(randomValues(n, seed, scale));

export const cases: KernelCase[] = [
  ...GOLDEN.map(goldenCase),
  {
    family: 'norm',
    name: 'GroupNorm 32 groups, 2 large groups of 2x37x41 = 3034 elements, x [1,64,37,41] (ts ref)',
    async run({ gpu, dtype }) {
      const shape = [1, 64, 37, 41];
      const n = 64 * 37 * 41;
      // Shifted values rounded again, so the f16 and f32 kernels and the reference see the same inputs.
      const x = roundToF16(rand(n, 5, 2).map((v) => v + 1.5));
      const gamma = roundToF16(rand(64, 6, 0.5).map((v) => v + 1));
      const beta = rand(64, 7, 0.2);
      const dy = rand(n, 8);
      const tx = gpu.upload(x, shape, dtype);
      const tg = gpu.upload(gamma, [64], dtype);
      const tb = gpu.upload(beta, [64], dtype);
      const tdy = gpu.upload(dy, shape, dtype);
      const fwd = groupNorm(gpu, tx, tg, tb, 32);
      const grads = groupNormBackward(gpu, tx, tg, fwd, tdy, 32);
      const ref = groupNormRef(x, shape, gamma, beta, 32);
      const gref = groupNormBackwardRef(x, shape, gamma, dy, 32);
      const tol = normTol(dtype);
      // dgamma/dbeta are f32 sums of ~2700 terms of size ~1 from the same (f16-exact) inputs in both
      // dtypes: only the f32 summation order differs from the float64 reference.
      const sumTol = { atol: 2e-4, rtol: 1e-4 };
      const checks = [
        compare('y vs ts ref', await gpu.read(fwd.y), ref.y, tol),
        compare('dx vs ts ref', await gpu.read(grads.dx), gref.dx, tol),
        compare('dgamma vs ts ref', await gpu.read(grads.dgamma), gref.dgamma, sumTol),
        compare('dbeta vs ts ref', await gpu.read(grads.dbeta), gref.dbeta, sumTol),
      ];
      gpu.free(tx, tg, tb, tdy, fwd.y, fwd.mean, fwd.rstd, grads.dx, grads.dgamma, grads.dbeta);
      return checks;
    },
  },
  {
    family: 'norm',
    name: 'finite differences of sum(y*r): GroupNorm [2,6,3,3] 3 groups and LayerNorm [3,10]',
    dtypes: ['f32'],
    async run({ gpu }) {
      const checks: Check[] = [];
      for (const kind of ['group', 'layer'] as const) {
        const shape = kind === 'group' ? [2, 6, 3, 3] : [3, 10];
        const C = shape[1];
        const n = shape.reduce((a, b) => a * b, 1);
        const x = rand(n, 41);
        const gamma = rand(C, 42).map((v) => v + 1);
        const beta = rand(C, 43);
        const r = rand(n, 44);
        const tx = gpu.upload(x, shape, 'f32');
        const tg = gpu.upload(gamma, [C], 'f32');
        const tb = gpu.upload(beta, [C], 'f32');
        const tr = gpu.upload(r, shape, 'f32');
        const run = () => (kind === 'group' ? groupNorm(gpu, tx, tg, tb, 3) : layerNorm(gpu, tx, tg, tb));
        const loss = async () => {
          const f = run();
          const y = await gpu.read(f.y);
          gpu.free(f.y, f.mean, f.rstd);
          let s = 0;
          for (let i = 0; i < n; i++) s += y[i] * r[i];
          return s;
        };
        const f = run();
        const gr = kind === 'group' ? groupNormBackward(gpu, tx, tg, f, tr, 3) : layerNormBackward(gpu, tx, tg, f, tr);
        const dx = await gpu.read(gr.dx);
        const dgamma = await gpu.read(gr.dgamma);
        const dbeta = await gpu.read(gr.dbeta);
        const ix = sampleIndices(n, 6, 45);
        const ic = sampleIndices(C, 3, 46);
        // Central differences with h = 1e-2 in f32: truncation O(h^2) plus rounding ~1e-6/h.
        const fdTol = { atol: 3e-3, rtol: 2e-2 };
        checks.push(
          compare(
            `${kind} dx vs central difference`,
            ix.map((i) => dx[i]),
            await finiteDiff(gpu, tx, x, ix, 1e-2, loss),
            fdTol,
          ),
          compare(
            `${kind} dgamma vs central difference`,
            ic.map((i) => dgamma[i]),
            await finiteDiff(gpu, tg, gamma, ic, 1e-2, loss),
            fdTol,
          ),
          compare(
            `${kind} dbeta vs central difference`,
            ic.map((i) => dbeta[i]),
            await finiteDiff(gpu, tb, beta, ic, 1e-2, loss),
            fdTol,
          ),
        );
        gpu.free(tx, tg, tb, tr, f.y, f.mean, f.rstd, gr.dx, gr.dgamma, gr.dbeta);
      }
      return checks;
    },
  },
];
