// Matmul family cases: every transpose combination, batched and broadcast operands, bias, sizes that
// are not tile multiples, nn.Linear, every tile config (tiles.ts: the CPU and GPU square and skinny tiles), accumulation, and finite-difference gradients.
// Each forward and gradient is compared with PyTorch (golden) and with the plain-TS reference.
import type { Gpu } from '../../gpu/device.ts';
import { Tensor, type DType } from '../../gpu/tensor.ts';
import { roundToF16 } from '../../util/half.ts';
import { linear, linearBackward, linearBackwardRef, linearRef, matmul, matmulBackward, matmulBackwardRef, matmulRef } from '../../ops/matmul.ts';
import { GPU_TILE_64, GPU_TILE_COLS_16, GPU_TILE_ROWS_16, directRefusal, prefetchRefusal, TILE_64, type Tile } from '../../ops/tiles.ts';
import { deepPrefetch, DIRECT_NAMED_TILES, NAMED_TC_TILES, NAMED_TILES, PREFETCH_TILES } from './tiles.ts';
import { TC_TILE_64, type TcTile } from '../../ops/gemm.ts';
import { compare, randomValues, type Check, type KernelCase, type Tolerance } from '../check.ts';

/**
 * f32: only the summation order differs from float64 (|error| ~ 1e-7 * K * |terms|; K <= 130 here).
 * f16: inputs are f16-exact and sums run in f32, so the error is the final rounding of the output
 * to f16 (relative 2^-11 = 4.9e-4), plus slack for values near zero.
 */
export function matmulTol(dtype: DType): Tolerance {
  return dtype === 'f32' ? { atol: 1e-4, rtol: 1e-4 } : { atol: 1e-2, rtol: 2e-3 };
}

interface GoldenCase {
  name: string;
  transA: boolean;
  transB: boolean;
  bias: boolean;
  what: string;
}

const GOLDEN_CASES: GoldenCase[] = [
  { name: 'nn', transA: false, transB: false, bias: true, what: '[37,19]·[19,41] + bias' },
  { name: 'tn', transA: true, transB: false, bias: true, what: '[19,37]ᵀ·[19,41] + bias' },
  { name: 'nt', transA: false, transB: true, bias: false, what: '[37,19]·[41,19]ᵀ' },
  { name: 'tt', transA: true, transB: true, bias: true, what: '[19,37]ᵀ·[41,19]ᵀ + bias' },
  { name: 'batched', transA: false, transB: false, bias: false, what: 'batched [3,21,13]·[3,13,22]' },
  { name: 'bcast', transA: false, transB: false, bias: true, what: 'broadcast b [2,3,21,17]·[17,29] + bias' },
  { name: 'bcast_tt', transA: true, transB: true, bias: false, what: 'broadcast b [3,17,25]ᵀ·[23,17]ᵀ' },
  { name: 'big', transA: false, transB: false, bias: true, what: 'past one tile [66,20]·[20,65] + bias' },
];

function goldenCase(c: GoldenCase): KernelCase {
  return {
    family: 'matmul',
    name: `${c.name}: ${c.what} fwd + da/db${c.bias ? '/dbias' : ''} (golden)`,
    async run({ gpu, dtype, golden }) {
      const g = (k: string) => golden.get(`${c.name}.${k}`);
      const a = g('a');
      const b = g('b');
      const dyG = g('dy');
      const ta = gpu.upload(a.data, a.shape, dtype);
      const tb = gpu.upload(b.data, b.shape, dtype);
      const tbias = c.bias ? gpu.upload(g('bias').data, g('bias').shape, dtype) : undefined;
      const tdy = gpu.upload(dyG.data, dyG.shape, dtype);
      const opts = { transA: c.transA, transB: c.transB, bias: tbias };
      const y = matmul(gpu, ta, tb, opts);
      const grads = matmulBackward(gpu, ta, tb, tdy, opts);
      const tol = matmulTol(dtype);
      const yRef = matmulRef(a.data, a.shape, b.data, b.shape, { ...opts, bias: c.bias ? g('bias').data : undefined });
      const gRef = matmulBackwardRef(a.data, a.shape, b.data, b.shape, dyG.data, opts);
      const out = await gpu.read(y);
      const da = await gpu.read(grads.da);
      const db = await gpu.read(grads.db);
      const checks: Check[] = [
        compare('y vs torch', out, g('y').data, tol),
        compare('y vs ts ref', out, yRef, tol),
        compare('da vs torch', da, g('da').data, tol),
        compare('da vs ts ref', da, gRef.da, tol),
        compare('db vs torch', db, g('db').data, tol),
        compare('db vs ts ref', db, gRef.db, tol),
        shapeCheck('y shape', y.shape, g('y').shape),
        shapeCheck('da shape', grads.da.shape, a.shape),
        shapeCheck('db shape', grads.db.shape, b.shape),
      ];
      if (c.bias) {
        const dbias = await gpu.read(grads.dbias!);
        checks.push(compare('dbias vs torch', dbias, g('dbias').data, tol), compare('dbias vs ts ref', dbias, gRef.dbias, tol));
      }
      gpu.free(ta, tb, tbias, tdy, y, grads.da, grads.db, grads.dbias);
      return checks;
    },
  };
}

/** A Check that passes when two shapes are equal. */
export function shapeCheck(label: string, actual: readonly number[], expected: readonly number[]): Check {
  const pass = actual.length === expected.length && actual.every((d, i) => d === expected[i]);
  return {
    label: `${label} [${actual.join(',')}] vs [${expected.join(',')}]`,
    pass,
    maxAbs: pass ? 0 : Infinity,
    maxRel: 0,
    tol: { atol: 0, rtol: 0 },
    n: actual.length,
  };
}

/** Random f16-representable values, so both dtypes see the same inputs. */
function rand(n: number, seed: number): Float32Array {
  return roundToF16(randomValues(n, seed));
}

/** Forward + backward against the TS reference with a forced tile config. */
function tileCase(tile: Tile, label: string): KernelCase {
  return tiledCase({ tile }, `${label} tile`, [2, 130, 37, 135]);
}

/**
 * The same on tensor cores with a forced tile, f16 only, at a ragged shape whose K (301) is neither a multiple of
 * the 32-deep staging step nor of 4; not run where the device has no tensor cores.
 */
function tcTileCase(tcTile: TcTile, label: string): KernelCase {
  return {
    ...tiledCase({ tcTile }, `tensor-core ${label} tile`, [2, 130, 301, 135]),
    dtypes: ['f16'],
    requires: (gpu) => (gpu.tensorCores ? null : `no tensor cores (${gpu.tensorCoreNote})`),
  };
}

/**
 * Split-K forced into 3 chunks (src/ops/gemm.ts) on the same shape: the chunks of K = 301 are 112, 112 and 77 long,
 * so the last is ragged; forward and every gradient sum their partials in the reduce pass, bias added once there.
 */
function splitKCase(): KernelCase {
  return tiledCase({ splitK: 3 }, 'split-K (3 chunks)', [2, 130, 301, 135]);
}

/** The same split on the prefetching core: chunks of whole 32-deep steps (128, 128, 45), the prefetch stopping at each chunk's end. */
function prefetchSplitKCase(): KernelCase {
  return tiledCase({ tile: deepPrefetch(GPU_TILE_64), splitK: 3 }, 'GPU 64x64 32-deep prefetch tile, split-K (3 chunks)', [2, 130, 301, 135]);
}

/** The same split on tensor cores (f16; not run where the device has none). */
function tcSplitKCase(): KernelCase {
  return {
    ...tiledCase({ tcTile: TC_TILE_64, splitK: 3 }, 'tensor-core 64x64 tile, split-K (3 chunks)', [2, 130, 301, 135]),
    dtypes: ['f16'],
    requires: (gpu) => (gpu.tensorCores ? null : `no tensor cores (${gpu.tensorCoreNote})`),
  };
}

/** Shapes the tile divides (FITS: loaders and epilogue without bounds checks), 64x64 tile, every transpose. */
function fitsCase(): KernelCase {
  return tiledCase({ tile: TILE_64 }, 'tile-dividing shape (no bounds checks), 64x64', [2, 128, 64, 192]);
}

/**
 * M and N multiples of 4 but of no tile, K = 37: the transposed A and the plain B load whole vec4 groups (A_VEC4,
 * B_VEC4) while the edge tiles still mask rows, columns and the reduction.
 */
function vec4Case(): KernelCase {
  return tiledCase({}, 'aligned operands (vec4 loads) at ragged tiles', [2, 132, 37, 140]);
}

/**
 * K a multiple of 4 but not of the 16- or 32-deep step, M and N of no tile: operands contiguous in k (A [M, K], Bᵀ
 * stored [N, K]; the backward's dY·Wᵀ too, N being a multiple of 4) are staged in 4x4 quads of vec4 loads along k
 * (gemm.ts operandStaging), with the edge tiles masking rows, columns and the last partial step.
 */
function quadsCase(tile: Tile | undefined, label: string): KernelCase {
  return tiledCase(tile ? { tile } : {}, `k-contiguous operands (vec4 quads along k) at ragged tiles${label}`, [2, 130, 44, 132]);
}

/**
 * vec4 loads of batched operands that start inside their buffers: a [3, 24, 20]ᵀ and b [3, 24, 28] are views 4 and
 * 8 elements into larger uploads (offsets multiples of 4, so still vec4-aligned), so each batch's group index needs
 * the window offset and the batch stride; and views 1 element in, which must fall back to scalar loads.
 */
function vec4OffsetCase(): KernelCase {
  return {
    family: 'matmul',
    name: 'vec4 loads (along m/n and along k) of batched views at element offsets 4/8 (aligned) and 1 (scalar fallback) (ts ref)',
    async run({ gpu, dtype }) {
      const checks: Check[] = [];
      const [B, K, M, N] = [3, 24, 20, 28];
      const a = rand(B * K * M, 31);
      const b = rand(B * K * N, 32);
      for (const [offA, offB] of [
        [4, 8],
        [1, 1],
      ]) {
        const ta = gpu.upload(new Float32Array([...rand(offA, 33), ...a]), [offA + a.length], dtype);
        const tb = gpu.upload(new Float32Array([...rand(offB, 34), ...b]), [offB + b.length], dtype);
        const bytes = dtype === 'f16' ? 2 : 4;
        const va = new Tensor(ta.alloc, [B, K, M], dtype, ta.byteOffset + offA * bytes, false);
        const vb = new Tensor(tb.alloc, [B, K, N], dtype, tb.byteOffset + offB * bytes, false);
        const y = matmul(gpu, va, vb, { transA: true });
        const want = matmulRef(a, [B, K, M], b, [B, K, N], { transA: true });
        checks.push(compare(`offsets ${offA}/${offB}`, await gpu.read(y), want, matmulTol(dtype)));
        // the same data as a [3, 20, 24] · ([3, 28, 24])ᵀ: both contiguous in k, staged as quads along k when aligned
        const qa = new Tensor(ta.alloc, [B, M, K], dtype, ta.byteOffset + offA * bytes, false);
        const qb = new Tensor(tb.alloc, [B, N, K], dtype, tb.byteOffset + offB * bytes, false);
        const yq = matmul(gpu, qa, qb, { transB: true });
        const wantQ = matmulRef(a, [B, M, K], b, [B, N, K], { transB: true });
        checks.push(compare(`k-contiguous, offsets ${offA}/${offB}`, await gpu.read(yq), wantQ, matmulTol(dtype)));
        gpu.free(ta, tb, y, yq);
      }
      return checks;
    },
  };
}

function tiledCase(choice: { tile?: Tile; tcTile?: TcTile; splitK?: number }, label: string, [B, M, K, N]: number[]): KernelCase {
  return {
    family: 'matmul',
    name: `${label}, every transpose, [${B},${M},${K}]·[${K},${N}] (ts ref)`,
    async run({ gpu, dtype }) {
      const checks: Check[] = [];
      for (const transA of [false, true])
        for (const transB of [false, true]) {
          const aShape = transA ? [B, K, M] : [B, M, K];
          const bShape = transB ? [N, K] : [K, N];
          const a = rand(B * M * K, 11);
          const b = rand(K * N, 12);
          const bias = rand(N, 13);
          const dy = rand(B * M * N, 14);
          const ta = gpu.upload(a, aShape, dtype);
          const tb = gpu.upload(b, bShape, dtype);
          const tbias = gpu.upload(bias, [N], dtype);
          const tdy = gpu.upload(dy, [B, M, N], dtype);
          const opts = { transA, transB, bias: tbias, ...choice };
          const y = matmul(gpu, ta, tb, opts);
          const gr = matmulBackward(gpu, ta, tb, tdy, opts);
          const ref = matmulBackwardRef(a, aShape, b, bShape, dy, { transA, transB });
          const tol = matmulTol(dtype);
          const tag = `${transA ? 't' : 'n'}${transB ? 't' : 'n'}`;
          checks.push(
            compare(`${tag} y`, await gpu.read(y), matmulRef(a, aShape, b, bShape, { transA, transB, bias }), tol),
            compare(`${tag} da`, await gpu.read(gr.da), ref.da, tol),
            compare(`${tag} db`, await gpu.read(gr.db), ref.db, tol),
            compare(`${tag} dbias`, await gpu.read(gr.dbias!), ref.dbias, tol),
          );
          gpu.free(ta, tb, tbias, tdy, y, gr.da, gr.db, gr.dbias);
        }
      return checks;
    },
  };
}

/** sum(y * r) in float64 from GPU values. */
function dot(y: ArrayLike<number>, r: ArrayLike<number>): number {
  let s = 0;
  for (let i = 0; i < y.length; i++) s += y[i] * r[i];
  return s;
}

/**
 * Central differences of L = sum(f(...) * r) with respect to a few elements of `t`, read back from
 * the GPU op itself: (L(t + h e_i) - L(t - h e_i)) / 2h.
 */
export async function finiteDiff(gpu: Gpu, t: Tensor, values: Float32Array, indices: number[], h: number, loss: () => Promise<number>): Promise<number[]> {
  const out: number[] = [];
  for (const i of indices) {
    const v = values.slice();
    v[i] = values[i] + h;
    gpu.write(t, v);
    const lp = await loss();
    v[i] = values[i] - h;
    gpu.write(t, v);
    const lm = await loss();
    out.push((lp - lm) / (2 * h));
  }
  gpu.write(t, values);
  return out;
}

/** Picks `count` spread-out element indices of an n-element tensor. */
export function sampleIndices(n: number, count: number, seed: number): number[] {
  const r = randomValues(count, seed);
  return Array.from(r, (x) => Math.min(n - 1, Math.floor(((x + 1) / 2) * n)));
}

export const cases: KernelCase[] = [
  ...GOLDEN_CASES.map(goldenCase),
  {
    family: 'matmul',
    name: 'linear [2,5,24] -> 18 fwd + dx/dw/db (golden)',
    async run({ gpu, dtype, golden }) {
      const g = (k: string) => golden.get(`linear.${k}`);
      const x = gpu.upload(g('x').data, g('x').shape, dtype);
      const w = gpu.upload(g('w').data, g('w').shape, dtype);
      const b = gpu.upload(g('b').data, g('b').shape, dtype);
      const dy = gpu.upload(g('dy').data, g('dy').shape, dtype);
      const y = linear(gpu, x, w, b);
      const gr = linearBackward(gpu, x, w, dy, b);
      const tol = matmulTol(dtype);
      const yRef = linearRef(g('x').data, g('x').shape, g('w').data, g('w').shape, g('b').data);
      const ref = linearBackwardRef(g('x').data, g('x').shape, g('w').data, g('w').shape, g('dy').data);
      const checks = [
        compare('y vs torch', await gpu.read(y), g('y').data, tol),
        compare('y vs ts ref', await gpu.read(y), yRef, tol),
        compare('dx vs torch', await gpu.read(gr.dx), g('dx').data, tol),
        compare('dx vs ts ref', await gpu.read(gr.dx), ref.dx, tol),
        compare('dw vs torch', await gpu.read(gr.dw), g('dw').data, tol),
        compare('dw vs ts ref', await gpu.read(gr.dw), ref.dw, tol),
        compare('db vs torch', await gpu.read(gr.dbias!), g('db').data, tol),
        compare('db vs ts ref', await gpu.read(gr.dbias!), ref.dbias, tol),
        shapeCheck('y shape', y.shape, g('y').shape),
        shapeCheck('dx shape', gr.dx.shape, g('x').shape),
      ];
      gpu.free(x, w, b, dy, y, gr.dx, gr.dw, gr.dbias);
      return checks;
    },
  },
  ...NAMED_TILES.map(([tile, label]) => tileCase(tile, label)),
  ...NAMED_TC_TILES.map(([tile, label]) => tcTileCase(tile, label)),
  // the direct core: f32 only past the square tile, as it is dtype-blind too (the loaders convert); then its
  // split-K (chunks of whole 4-k steps) and its quads along k (gemm_ak4 / gemm_bk4 straight into registers)
  ...DIRECT_NAMED_TILES.map(([tile, label], i): KernelCase => ({ ...tileCase(tile, label), requires: directRefusal, ...(i === 0 ? {} : { dtypes: ['f32'] }) })),
  {
    ...tiledCase({ tile: DIRECT_NAMED_TILES[0][0], splitK: 3 }, `${DIRECT_NAMED_TILES[0][1]} tile, split-K (3 chunks)`, [2, 130, 301, 135]),
    dtypes: ['f32'],
    requires: directRefusal,
  },
  { ...quadsCase(DIRECT_NAMED_TILES[0][0], `, ${DIRECT_NAMED_TILES[0][1]} tile`), dtypes: ['f32'], requires: directRefusal },
  // f32 only past the first: the prefetch is dtype-blind (the loaders convert), and each tile variant costs lavapipe
  // about a minute of pipeline compiles per dtype
  ...PREFETCH_TILES.map(([tile, label], i): KernelCase => ({ ...tileCase(tile, label), requires: prefetchRefusal, ...(i === 0 ? {} : { dtypes: ['f32'] }) })),
  // What pickTile gives a GPU where a side is at most 4 (the 16-wide prefetching tiles), at ragged shapes: 3 rows over
  // 7 batches and 3 columns in one, K = 301 (not a multiple of 4 or of the 32-deep step); f32 as the other prefetch cases
  ...[[deepPrefetch(GPU_TILE_ROWS_16), [7, 3, 301, 135]] as const, [deepPrefetch(GPU_TILE_COLS_16), [1, 135, 301, 3]] as const].map(
    ([tile, shape]): KernelCase => ({
      ...tiledCase({ tile }, `GPU ${tile.BM}x${tile.BN} prefetch tile at a side <= 4`, [...shape]),
      dtypes: ['f32'],
      requires: prefetchRefusal,
    }),
  ),
  splitKCase(),
  { ...prefetchSplitKCase(), dtypes: ['f32'], requires: prefetchRefusal },
  tcSplitKCase(),
  fitsCase(),
  vec4Case(),
  quadsCase(undefined, ''),
  // f32 only: the staging is dtype-blind (the loaders convert); 2 quads per invocation, and the guarded half
  { ...quadsCase(deepPrefetch(TILE_64), ', 64x64 32-deep prefetch tile'), dtypes: ['f32'], requires: prefetchRefusal },
  { ...quadsCase(deepPrefetch(GPU_TILE_64), ', GPU 64x64 32-deep prefetch tile'), dtypes: ['f32'], requires: prefetchRefusal },
  vec4OffsetCase(),
  {
    family: 'matmul',
    name: 'accumulate: out += a·b + bias; backward twice into f32 gradient buffers (ts ref)',
    async run({ gpu, dtype }) {
      const [M, K, N] = [9, 70, 13];
      const a = rand(M * K, 21);
      const b = rand(N * K, 22);
      const bias = rand(N, 23);
      const prev = rand(M * N, 24);
      const dy = rand(M * N, 25);
      const ta = gpu.upload(a, [M, K], dtype);
      const tb = gpu.upload(b, [N, K], dtype);
      const tbias = gpu.upload(bias, [N], dtype);
      const out = gpu.upload(prev, [M, N], dtype);
      matmul(gpu, ta, tb, { transB: true, bias: tbias, out, accumulate: true });
      const want = matmulRef(a, [M, K], b, [N, K], { transB: true, bias }).map((v, i) => v + prev[i]);
      // Gradients accumulate onto what is already there (twice the gradient after two calls), here
      // into f32 buffers whatever the operand dtype (f32 master gradients of f16 weights).
      const tdy = gpu.upload(dy, [M, N], dtype);
      const into = { da: gpu.zeros([M, K], 'f32'), db: gpu.zeros([N, K], 'f32'), dbias: gpu.zeros([N], 'f32') };
      for (let i = 0; i < 2; i++) matmulBackward(gpu, ta, tb, tdy, { transB: true, bias: tbias, accumulate: true, into });
      const ref = matmulBackwardRef(a, [M, K], b, [N, K], dy, { transB: true });
      const tol = matmulTol(dtype);
      const twice = (x: Float32Array) => x.map((v) => 2 * v);
      const checks = [
        compare('out += a·bᵀ + bias', await gpu.read(out), want, tol),
        // f32 outputs: no f16 rounding anywhere, so the f32 tolerance holds for both dtypes.
        compare('da accumulated twice (f32 out)', await gpu.read(into.da), twice(ref.da), matmulTol('f32')),
        compare('db accumulated twice (f32 out)', await gpu.read(into.db), twice(ref.db), matmulTol('f32')),
        compare('dbias accumulated twice (f32 out)', await gpu.read(into.dbias), twice(ref.dbias), matmulTol('f32')),
      ];
      gpu.free(ta, tb, tbias, out, tdy, into.da, into.db, into.dbias);
      return checks;
    },
  },
  {
    family: 'matmul',
    name: 'finite differences of sum(y*r) vs da/db/dbias, batched [2,6,9]ᵀ·[7,6]ᵀ + bias',
    dtypes: ['f32'],
    async run({ gpu }) {
      const [B, M, K, N] = [2, 9, 6, 7];
      const aShape = [B, K, M];
      const bShape = [N, K];
      const a = rand(B * M * K, 31);
      const b = rand(N * K, 32);
      const bias = rand(N, 33);
      const r = rand(B * M * N, 34);
      const ta = gpu.upload(a, aShape, 'f32');
      const tb = gpu.upload(b, bShape, 'f32');
      const tbias = gpu.upload(bias, [N], 'f32');
      const tr = gpu.upload(r, [B, M, N], 'f32');
      const opts = { transA: true, transB: true, bias: tbias };
      const loss = async () => {
        const y = matmul(gpu, ta, tb, opts);
        const v = dot(await gpu.read(y), r);
        gpu.free(y);
        return v;
      };
      const gr = matmulBackward(gpu, ta, tb, tr, opts);
      // L is linear in each operand, so the central difference is exact up to f32 rounding of y
      // (~1e-7 * |L| / h with |L| ~ 10, h = 0.05): atol 2e-3 + rtol 1e-2.
      const h = 0.05;
      const tol = { atol: 2e-3, rtol: 1e-2 };
      const checks: Check[] = [];
      for (const [label, t, v, grad] of [
        ['a', ta, a, gr.da],
        ['b', tb, b, gr.db],
        ['bias', tbias, bias, gr.dbias!],
      ] as const) {
        const idx = sampleIndices(v.length, 5, 40 + checks.length);
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
      gpu.free(ta, tb, tbias, tr, gr.da, gr.db, gr.dbias);
      return checks;
    },
  },
];
