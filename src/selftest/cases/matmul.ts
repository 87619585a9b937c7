// Matmul family cases: every transpose combination, batched and broadcast operands, bias, sizes that
// are not tile multiples, nn.Linear, tile configs (64x64, 128x128, rectangular, the skinny 4/16-row and
// 4/16-column ones), accumulation, split-K, and finite-difference gradients. Path cases also check that
// the GEMM ran on the path they cover (vec4 loads, bounds checks compiled out, split-K), so a wrong
// fast path fails a test instead of going untested.
// Each forward and gradient is compared with PyTorch (golden) and with the plain-TS reference.
import type { Gpu } from '../../gpu/device.ts';
import type { DType, Tensor } from '../../gpu/tensor.ts';
import { roundToF16 } from '../../util/half.ts';
import {
  linear,
  linearBackward,
  linearBackwardRef,
  linearRef,
  matmul,
  matmulBackward,
  matmulBackwardRef,
  matmulRef,
  traceGemms,
  type GemmTrace,
  TILE_128,
  TILE_64,
  TILE_COLS_16,
  TILE_COLS_4,
  TILE_ROWS_16,
  TILE_ROWS_4,
  type Tile,
} from '../../ops/matmul.ts';
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
  /** Forced split-K ranges of every GEMM (forward and backward). */
  splitK?: number;
  /** The forward's path: a check fails unless the GEMM ran as said. */
  expect?: Expect;
}

/** What a GEMM must have run as; unset fields are not checked. */
interface Expect {
  vecA?: boolean;
  vecB?: boolean;
  checked?: boolean;
  split?: boolean;
}

/** A check that passes when every traced GEMM ran on the expected path. */
function pathCheck(label: string, gemms: GemmTrace[], e: Expect): Check {
  const bad: string[] = [];
  if (gemms.length === 0) bad.push('no GEMM ran');
  for (const g of gemms) {
    if (e.split !== undefined && e.split !== g.config.splitK > 1) bad.push(`splitK ${g.config.splitK}`);
    for (const v of g.variants) {
      if (e.vecA !== undefined && v.vecA !== e.vecA) bad.push(`vecA ${v.vecA}`);
      if (e.vecB !== undefined && v.vecB !== e.vecB) bad.push(`vecB ${v.vecB}`);
      const checked = v.checkM || v.checkN || v.checkK;
      if (e.checked !== undefined && checked !== e.checked) bad.push(`bounds checks ${JSON.stringify(v)}`);
    }
  }
  const pass = bad.length === 0;
  return {
    label: `${label}: ${JSON.stringify(e)}${pass ? '' : ` but ${bad.join(', ')}`}`,
    pass,
    maxAbs: pass ? 0 : Infinity,
    maxRel: 0,
    tol: { atol: 0, rtol: 0 },
    n: gemms.length,
  };
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
  {
    name: 'vec_nn',
    transA: false,
    transB: false,
    bias: true,
    what: 'aligned [64,96]·[96,128] + bias: vec4 loads, no bounds checks',
    expect: { vecA: true, vecB: true, checked: false },
  },
  { name: 'vec_tt', transA: true, transB: true, bias: false, what: 'aligned [96,64]ᵀ·[128,96]ᵀ: vec4 loads', expect: { vecA: true, vecB: true } },
  {
    name: 'ragged',
    transA: false,
    transB: false,
    bias: true,
    what: 'K = 37 [67,37]·[37,45] + bias: scalar loads, bounds checks',
    expect: { vecA: false, vecB: false, checked: true },
  },
  {
    name: 'wgrad',
    transA: true,
    transB: false,
    bias: true,
    what: 'weight-gradient shape [1024,40]ᵀ·[1024,48] + bias, split-K 5',
    splitK: 5,
    expect: { split: true, vecA: true, vecB: true },
  },
  { name: 'wgrad', transA: true, transB: false, bias: true, what: 'weight-gradient shape [1024,40]ᵀ·[1024,48] + bias, heuristic config' },
];

function goldenCase(c: GoldenCase): KernelCase {
  return {
    family: 'matmul',
    name: `${c.name}: ${c.what} fwd + da/db${c.bias ? '/dbias' : ''} (golden)${c.splitK ? ` split-K ${c.splitK}` : ''}`,
    async run({ gpu, dtype, golden }) {
      const g = (k: string) => golden.get(`${c.name}.${k}`);
      const a = g('a');
      const b = g('b');
      const dyG = g('dy');
      const ta = gpu.upload(a.data, a.shape, dtype);
      const tb = gpu.upload(b.data, b.shape, dtype);
      const tbias = c.bias ? gpu.upload(g('bias').data, g('bias').shape, dtype) : undefined;
      const tdy = gpu.upload(dyG.data, dyG.shape, dtype);
      const opts = { transA: c.transA, transB: c.transB, bias: tbias, splitK: c.splitK };
      const { result: y, gemms } = traceGemms(() => matmul(gpu, ta, tb, opts));
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
      if (c.expect) checks.push(pathCheck('forward path', gemms, c.expect));
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
  return {
    family: 'matmul',
    name: `${label} tile, every transpose, [2,130,36]·[36,135] (ts ref)`,
    async run({ gpu, dtype }) {
      const checks: Check[] = [];
      const [B, M, K, N] = [2, 130, 36, 135];
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
          const opts = { transA, transB, bias: tbias, tile };
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

interface PathSpec {
  label: string;
  /** Batch of a and b (0: unbatched, i.e. broadcast over the other's batch). */
  batchA: number;
  batchB: number;
  M: number;
  K: number;
  N: number;
  bias?: boolean;
  /** Add into a previous output (an f32 one when the inputs are f16). */
  accumulate?: boolean;
  tile?: Tile;
  splitK?: number;
  expect: Expect;
}

/**
 * One forward GEMM, every transpose, against the TS reference, with a check that it ran on the path it
 * is meant to cover (vec4 loads or not, bounds checks or not, split-K or not).
 */
function pathCase(s: PathSpec): KernelCase {
  return {
    family: 'matmul',
    name: `${s.label}: [${s.batchA || '-'}|${s.batchB || '-'}] ${s.M}x${s.K}x${s.N}${s.bias ? ' + bias' : ''}${s.accumulate ? ', accumulate' : ''}, every transpose (ts ref)`,
    async run({ gpu, dtype }) {
      const checks: Check[] = [];
      const { M, K, N } = s;
      const batch = Math.max(s.batchA, s.batchB, 1);
      const lead = (n: number) => (n ? [n] : []);
      for (const transA of [false, true])
        for (const transB of [false, true]) {
          const aShape = [...lead(s.batchA), ...(transA ? [K, M] : [M, K])];
          const bShape = [...lead(s.batchB), ...(transB ? [N, K] : [K, N])];
          const a = rand(Math.max(s.batchA, 1) * M * K, 51);
          const b = rand(Math.max(s.batchB, 1) * K * N, 52);
          const bias = s.bias ? rand(N, 53) : undefined;
          const prev = rand(batch * M * N, 54);
          const ta = gpu.upload(a, aShape, dtype);
          const tb = gpu.upload(b, bShape, dtype);
          const tbias = bias ? gpu.upload(bias, [N], dtype) : undefined;
          const outShape = [...(s.batchA || s.batchB ? [batch] : []), M, N];
          const out = s.accumulate ? gpu.upload(prev, outShape, 'f32') : undefined;
          const { result: y, gemms } = traceGemms(() =>
            matmul(gpu, ta, tb, { transA, transB, bias: tbias, out, accumulate: s.accumulate, tile: s.tile, splitK: s.splitK }),
          );
          let want = matmulRef(a, aShape, b, bShape, { transA, transB, bias });
          if (s.accumulate) want = want.map((v, i) => v + prev[i]);
          const tag = `${transA ? 't' : 'n'}${transB ? 't' : 'n'}`;
          // An f32 output of f16 inputs is not rounded to f16: the f32 tolerance holds.
          checks.push(compare(`${tag} y`, await gpu.read(y), want, matmulTol(s.accumulate ? 'f32' : dtype)), pathCheck(`${tag} path`, gemms, s.expect));
          gpu.free(ta, tb, tbias, y);
        }
      return checks;
    },
  };
}

/** Tiles of the candidate set not covered by the heuristic's picks in the other cases. */
const RECT_128x64: Tile = { BM: 128, BN: 64, BK: 32, TM: 8, TN: 8 };
const RECT_64x128: Tile = { BM: 64, BN: 128, BK: 32, TM: 8, TN: 8 };
const TILE_32: Tile = { BM: 32, BN: 32, BK: 32, TM: 4, TN: 4 };

const PATH_CASES: PathSpec[] = [
  // Every dim a multiple of the tile and of 4: vec4 loads, no bounds checks.
  {
    label: 'aligned 64x64x32',
    batchA: 0,
    batchB: 0,
    M: 64,
    K: 96,
    N: 128,
    bias: true,
    tile: { BM: 64, BN: 64, BK: 32, TM: 4, TN: 4 },
    expect: { vecA: true, vecB: true, checked: false },
  },
  { label: 'aligned rectangular 128x64', batchA: 0, batchB: 0, M: 128, K: 64, N: 128, tile: RECT_128x64, expect: { vecA: true, vecB: true, checked: false } },
  { label: 'rectangular 64x128, ragged', batchA: 0, batchB: 0, M: 70, K: 44, N: 131, bias: true, tile: RECT_64x128, expect: { checked: true } },
  {
    label: 'odd M/N/K (scalar loads)',
    batchA: 0,
    batchB: 0,
    M: 33,
    K: 23,
    N: 29,
    bias: true,
    tile: TILE_32,
    expect: { vecA: false, vecB: false, checked: true },
  },
  // K multiple of 4 but M, N ragged: vec4 loads of the K-contiguous operands only.
  { label: 'K % 4 = 0, M and N odd', batchA: 0, batchB: 0, M: 37, K: 40, N: 35, expect: { checked: true } },
  {
    label: 'batch 1',
    batchA: 1,
    batchB: 1,
    M: 64,
    K: 64,
    N: 64,
    tile: { BM: 64, BN: 64, BK: 32, TM: 8, TN: 8 },
    expect: { vecA: true, vecB: true, checked: false },
  },
  { label: 'large batch, b broadcast (stride 0)', batchA: 65, batchB: 0, M: 5, K: 12, N: 7, bias: true, expect: { checked: true } },
  { label: 'large batch, a broadcast (stride 0), aligned', batchA: 0, batchB: 40, M: 8, K: 16, N: 16, expect: { vecA: true, vecB: true } },
  {
    label: 'accumulate into f32 with bias, aligned',
    batchA: 2,
    batchB: 2,
    M: 64,
    K: 32,
    N: 64,
    bias: true,
    accumulate: true,
    expect: { vecA: true, vecB: true },
  },
  // Split-K: aligned (vec4, whole BK ranges) and ragged K (last range short, checks), with accumulate.
  {
    label: 'split-K 8, aligned',
    batchA: 0,
    batchB: 0,
    M: 64,
    K: 2048,
    N: 64,
    tile: { BM: 64, BN: 64, BK: 32, TM: 8, TN: 8 },
    splitK: 8,
    expect: { split: true, vecA: true, vecB: true, checked: false },
  },
  {
    label: 'split-K 3, ragged K, accumulate + bias',
    batchA: 0,
    batchB: 0,
    M: 19,
    K: 301,
    N: 21,
    bias: true,
    accumulate: true,
    splitK: 3,
    expect: { split: true, checked: true },
  },
];

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
  tileCase(TILE_64, '64x64'),
  tileCase(TILE_128, '128x128'),
  tileCase(TILE_ROWS_4, '4-row'),
  tileCase(TILE_ROWS_16, '16-row'),
  tileCase(TILE_COLS_4, '4-column'),
  tileCase(TILE_COLS_16, '16-column'),
  tileCase(RECT_128x64, '128x64 BK 32'),
  ...PATH_CASES.map(pathCase),
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
