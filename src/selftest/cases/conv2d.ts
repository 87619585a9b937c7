// Conv2d family cases: 3x3 stride 1 pad 1, 3x3 stride 2 pad 1 (odd and even sizes), 1x1; forward
// and dx/dw/db against PyTorch (golden) and the plain-TS reference; every tile config (incl. the skinny ones) on shapes
// that span several tiles; accumulation into f32 gradient buffers; finite differences (stride 2).
import { roundToF16 } from '../../util/half.ts';
import type { DType } from '../../gpu/tensor.ts';
import { conv2d, conv2dBackward, conv2dBackwardRef, conv2dRef, type Conv2dOptions } from '../../ops/conv2d.ts';
import { directRefusal, GPU_TILE_64, prefetchRefusal, TILE_32, type Tile } from '../../ops/tiles.ts';
import { deepPrefetch, DIRECT_NAMED_TILES, NAMED_TILES, PREFETCH_TILES } from './tiles.ts';
import { compare, randomValues, type Check, type KernelCase, type Tolerance } from '../check.ts';
import { finiteDiff, sampleIndices, shapeCheck } from './matmul.ts';

/**
 * f32: summation order only (reductions of <= 300 terms of magnitude <= ~3).
 * f16: f16-exact inputs, f32 sums, one final rounding to f16 (relative 4.9e-4) plus slack near 0.
 */
function convTol(dtype: DType): Tolerance {
  return dtype === 'f32' ? { atol: 1e-4, rtol: 1e-4 } : { atol: 1e-2, rtol: 2e-3 };
}

interface GoldenConv {
  name: string;
  opts: Conv2dOptions;
  what: string;
}

const GOLDEN: GoldenConv[] = [
  { name: 'k3s1', opts: { stride: 1, padding: 1 }, what: '3x3 s1 p1, x [2,3,7,9] -> 5 ch' },
  { name: 'k3s2', opts: { stride: 2, padding: 1 }, what: '3x3 s2 p1, x [2,5,9,7] -> 3 ch' },
  { name: 'k3s2e', opts: { stride: 2, padding: 1 }, what: '3x3 s2 p1, x [1,3,8,6] -> 7 ch' },
  { name: 'k1', opts: { stride: 1, padding: 0 }, what: '1x1, x [2,7,5,6] -> 5 ch' },
];

function goldenCase(c: GoldenConv): KernelCase {
  return {
    family: 'conv2d',
    name: `${c.name}: ${c.what} fwd + dx/dw/db (golden)`,
    async run({ gpu, dtype, golden }) {
      const g = (k: string) => golden.get(`${c.name}.${k}`);
      const [x, w, b, dy] = ['x', 'w', 'b', 'dy'].map(g);
      const tx = gpu.upload(x.data, x.shape, dtype);
      const tw = gpu.upload(w.data, w.shape, dtype);
      const tb = gpu.upload(b.data, b.shape, dtype);
      const tdy = gpu.upload(dy.data, dy.shape, dtype);
      const y = conv2d(gpu, tx, tw, tb, c.opts);
      const gr = conv2dBackward(gpu, tx, tw, tdy, c.opts);
      const tol = convTol(dtype);
      const yRef = conv2dRef(x.data, x.shape, w.data, w.shape, b.data, c.opts);
      const ref = conv2dBackwardRef(x.data, x.shape, w.data, w.shape, dy.data, c.opts);
      const out = await gpu.read(y);
      const dx = await gpu.read(gr.dx);
      const dw = await gpu.read(gr.dw);
      const db = await gpu.read(gr.db);
      const checks: Check[] = [
        shapeCheck('y shape', y.shape, g('y').shape),
        compare('y vs torch', out, g('y').data, tol),
        compare('y vs ts ref', out, yRef, tol),
        compare('dx vs torch', dx, g('dx').data, tol),
        compare('dx vs ts ref', dx, ref.dx, tol),
        compare('dw vs torch', dw, g('dw').data, tol),
        compare('dw vs ts ref', dw, ref.dw, tol),
        compare('db vs torch', db, g('db').data, tol),
        compare('db vs ts ref', db, ref.db, tol),
      ];
      gpu.free(tx, tw, tb, tdy, y, gr.dx, gr.dw, gr.db);
      return checks;
    },
  };
}

function rand(n: number, seed: number, scale = 1): Float32Array {
  return roundToF16(randomValues(n, seed, scale));
}

/** Several tiles in every GEMM dimension (Co = 70 rows, 120 / 30 pixels, K up to 630), vs TS ref. */
function tileCase(tile: Tile, label: string): KernelCase {
  return tiledCase({ tile }, `${label} tile`);
}

/**
 * The same with split-K forced into 3 chunks (src/ops/gemm.ts) in every GEMM: forward K = 81 (chunks 32, 32, 17),
 * grad input 630, grad weight 288 (stride 1) or 72 (stride 2); the forward's bias is added once, in the reduce pass.
 */
function splitKCase(): KernelCase {
  return tiledCase({ splitK: 3 }, 'split-K (3 chunks)');
}

/**
 * Shapes the 32x32 tile divides in all three GEMMs (FITS: loaders without bounds checks), x [2,32,8,8] -> 64 ch 3x3
 * s1 p1: forward 64 x 64 x 288, grad input 32 x 64 x 576, grad weight 64 x 288 x 128; padding taps still read 0.
 */
function fitsCase(): KernelCase {
  return {
    family: 'conv2d',
    name: 'tile-dividing shapes (no bounds checks), 32x32 tile, x [2,32,8,8] -> 64 ch 3x3 s1 (ts ref)',
    async run({ gpu, dtype }) {
      const [xShape, wShape, opts] = [[2, 32, 8, 8], [64, 32, 3, 3], { stride: 1, padding: 1, tile: TILE_32 }];
      const x = rand(2 * 32 * 64, 81);
      const w = rand(64 * 32 * 9, 82, 0.2);
      const b = rand(64, 83);
      const [tx, tw, tb] = [gpu.upload(x, xShape, dtype), gpu.upload(w, wShape, dtype), gpu.upload(b, [64], dtype)];
      const y = conv2d(gpu, tx, tw, tb, opts);
      const dy = rand(y.numel, 84);
      const tdy = gpu.upload(dy, y.shape, dtype);
      const gr = conv2dBackward(gpu, tx, tw, tdy, opts);
      const ref = conv2dBackwardRef(x, xShape, w, wShape, dy, opts);
      const tol = convTol(dtype);
      const checks = [
        compare('y', await gpu.read(y), conv2dRef(x, xShape, w, wShape, b, opts), tol),
        compare('dx', await gpu.read(gr.dx), ref.dx, tol),
        compare('dw', await gpu.read(gr.dw), ref.dw, tol),
        compare('db', await gpu.read(gr.db), ref.db, tol),
      ];
      gpu.free(tx, tw, tb, y, tdy, gr.dx, gr.dw, gr.db);
      return checks;
    },
  };
}

function tiledCase(choice: Pick<Conv2dOptions, 'tile' | 'splitK' | 'constSizes'>, label: string): KernelCase {
  return {
    family: 'conv2d',
    name: `${label}, x [2,9,12,10] -> 70 ch, 3x3 s1 and s2 (ts ref)`,
    async run({ gpu, dtype }) {
      const checks: Check[] = [];
      // not square, so a kernel that swaps height and width fails
      const xShape = [2, 9, 12, 10];
      const wShape = [70, 9, 3, 3];
      const x = rand(2 * 9 * 120, 51);
      const w = rand(70 * 81, 52, 0.3);
      const b = rand(70, 53);
      const tx = gpu.upload(x, xShape, dtype);
      const tw = gpu.upload(w, wShape, dtype);
      const tb = gpu.upload(b, [70], dtype);
      for (const stride of [1, 2]) {
        const opts = { stride, padding: 1, ...choice };
        const y = conv2d(gpu, tx, tw, tb, opts);
        const dy = rand(y.numel, 54 + stride);
        const tdy = gpu.upload(dy, y.shape, dtype);
        const gr = conv2dBackward(gpu, tx, tw, tdy, opts);
        const ref = conv2dBackwardRef(x, xShape, w, wShape, dy, opts);
        const tol = convTol(dtype);
        checks.push(
          compare(`s${stride} y`, await gpu.read(y), conv2dRef(x, xShape, w, wShape, b, opts), tol),
          compare(`s${stride} dx`, await gpu.read(gr.dx), ref.dx, tol),
          compare(`s${stride} dw`, await gpu.read(gr.dw), ref.dw, tol),
          compare(`s${stride} db`, await gpu.read(gr.db), ref.db, tol),
        );
        gpu.free(y, tdy, gr.dx, gr.dw, gr.db);
      }
      gpu.free(tx, tw, tb);
      return checks;
    },
  };
}

export const cases: KernelCase[] = [
  ...GOLDEN.map(goldenCase),
  ...NAMED_TILES.map(([tile, label]) => tileCase(tile, label)),
  { ...tileCase(...DIRECT_NAMED_TILES[0]), requires: directRefusal },
  // the prefetching core (a GPU's default) in f32 only: it is dtype-blind (the loaders convert), and each tile
  // variant costs lavapipe about a minute of pipeline compiles per dtype
  { ...tileCase(PREFETCH_TILES[0][0], PREFETCH_TILES[0][1]), dtypes: ['f32'], requires: prefetchRefusal },
  // the 16-column prefetching tile, what a GPU's convs over at most 16 pixels get (the UNet's 2x2 level)
  { ...tileCase(PREFETCH_TILES[2][0], PREFETCH_TILES[2][1]), dtypes: ['f32'], requires: prefetchRefusal },
  splitKCase(),
  {
    ...tiledCase({ tile: deepPrefetch(GPU_TILE_64), splitK: 3 }, 'GPU 64x64 32-deep prefetch tile, split-K (3 chunks)'),
    dtypes: ['f32'],
    requires: prefetchRefusal,
  },
  fitsCase(),
  // The layer's sizes compiled in as constants (GPUs' default) and as uniforms (CPU adapters'), each forced, so
  // every machine runs both: with split-K too (f32 only: the accessors are dtype-blind).
  tiledCase({ constSizes: true }, 'sizes as pipeline constants'),
  { ...tiledCase({ constSizes: true, splitK: 3 }, 'sizes as pipeline constants, split-K (3 chunks)'), dtypes: ['f32'] },
  { ...tiledCase({ constSizes: false }, 'sizes as uniforms'), dtypes: ['f32'] },
  {
    family: 'conv2d',
    name: 'backward twice into f32 gradient buffers (accumulate), 1x1 and 3x3 s2 (ts ref)',
    async run({ gpu, dtype }) {
      const checks: Check[] = [];
      for (const [k, stride, padding] of [
        [1, 1, 0],
        [3, 2, 1],
      ]) {
        const xShape = [2, 5, 7, 6];
        const wShape = [6, 5, k, k];
        const opts = { stride, padding };
        const x = rand(2 * 5 * 42, 61);
        const w = rand(6 * 5 * k * k, 62, 0.3);
        const tx = gpu.upload(x, xShape, dtype);
        const tw = gpu.upload(w, wShape, dtype);
        const y = conv2d(gpu, tx, tw, null, opts);
        const dy = rand(y.numel, 63);
        const tdy = gpu.upload(dy, y.shape, dtype);
        const into = { dx: gpu.zeros(xShape, 'f32'), dw: gpu.zeros(wShape, 'f32'), db: gpu.zeros([6], 'f32') };
        for (let i = 0; i < 2; i++) conv2dBackward(gpu, tx, tw, tdy, { ...opts, accumulate: true, into });
        const ref = conv2dBackwardRef(x, xShape, w, wShape, dy, opts);
        const twice = (v: Float32Array) => v.map((e) => 2 * e);
        // f32 outputs: no f16 rounding, so the f32 tolerance holds for both dtypes.
        const tol = convTol('f32');
        checks.push(
          compare(`${k}x${k} y (no bias)`, await gpu.read(y), conv2dRef(x, xShape, w, wShape, null, opts), convTol(dtype)),
          compare(`${k}x${k} dx x2`, await gpu.read(into.dx), twice(ref.dx), tol),
          compare(`${k}x${k} dw x2`, await gpu.read(into.dw), twice(ref.dw), tol),
          compare(`${k}x${k} db x2`, await gpu.read(into.db), twice(ref.db), tol),
        );
        gpu.free(tx, tw, y, tdy, into.dx, into.dw, into.db);
      }
      return checks;
    },
  },
  {
    family: 'conv2d',
    name: 'finite differences of sum(y*r) vs dx/dw/db, 3x3 stride 2 pad 1, x [2,3,7,6] -> 4 ch',
    dtypes: ['f32'],
    async run({ gpu }) {
      const xShape = [2, 3, 7, 6];
      const wShape = [4, 3, 3, 3];
      const opts = { stride: 2, padding: 1 };
      const x = rand(2 * 3 * 42, 71);
      const w = rand(4 * 27, 72, 0.5);
      const b = rand(4, 73);
      const tx = gpu.upload(x, xShape, 'f32');
      const tw = gpu.upload(w, wShape, 'f32');
      const tb = gpu.upload(b, [4], 'f32');
      const y0 = conv2d(gpu, tx, tw, tb, opts);
      const r = rand(y0.numel, 74);
      const tr = gpu.upload(r, y0.shape, 'f32');
      const loss = async () => {
        const y = conv2d(gpu, tx, tw, tb, opts);
        const v = await gpu.read(y);
        gpu.free(y);
        let s = 0;
        for (let i = 0; i < v.length; i++) s += v[i] * r[i];
        return s;
      };
      const gr = conv2dBackward(gpu, tx, tw, tr, opts);
      // L is linear in each of x, w, b: the central difference is exact up to f32 rounding of y
      // (~1e-7 * |L| / h, |L| ~ 10, h = 0.05). Tolerance atol 2e-3 + rtol 1e-2.
      const h = 0.05;
      const tol = { atol: 2e-3, rtol: 1e-2 };
      const checks: Check[] = [];
      for (const [label, t, v, grad] of [
        ['x', tx, x, gr.dx],
        ['w', tw, w, gr.dw],
        ['b', tb, b, gr.db],
      ] as const) {
        const idx = sampleIndices(v.length, 6, 80 + checks.length);
        const fd = await finiteDiff(gpu, t, v, idx, h, loss);
        const analytic = await gpu.read(grad);
        checks.push(
          compare(
            `d${label} vs central difference`,
            idx.map((i) => analytic[i]),
            fd,
            tol,
          ),
        );
      }
      gpu.free(tx, tw, tb, y0, tr, gr.dx, gr.dw, gr.db);
      return checks;
    },
  },
];
