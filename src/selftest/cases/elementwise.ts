// Element-wise, activation, GEGLU, channel-broadcast, upsample, softmax and timestep-embedding
// cases: forward and every gradient against PyTorch (float64 goldens) and the plain-TS references;
// finite differences of the GPU ops in f32.
import type { Gpu } from '../../gpu/device.ts';
import { roundToF16 } from '../../util/half.ts';
import type { DType, Tensor } from '../../gpu/tensor.ts';
import {
  concatChannels,
  pad2d,
  pad2dBackward,
  pad2dRef,
  splitChannels,
  transpose2d,
  activation,
  activationBackward,
  activationGradRef,
  activationRef,
  add,
  addChannel,
  addChannelBackward,
  addChannelBackwardRef,
  addBackward,
  addChannelRef,
  addRef,
  cast,
  scale,
  geglu,
  gegluBackward,
  gegluBackwardRef,
  gegluRef,
  mul,
  mulBackward,
  mulRef,
  timestepEmbedding,
  timestepEmbeddingRef,
  upsample2x,
  upsample2xBackward,
  upsample2xBackwardRef,
  upsample2xRef,
  type Activation,
} from '../../ops/elementwise.ts';
import { softmax, softmaxBackward, softmaxBackwardRef, softmaxRef } from '../../ops/softmax.ts';
import { compare, randomValues, type Check, type GoldenSet, type KernelCase, type Tolerance } from '../check.ts';
import { finiteDiff, sampleIndices } from './matmul.ts';

/**
 * f32: a handful of f32 operations per element (erf approximation 1.5e-7) or short f32 sums.
 * f16: one or two roundings to f16 (relative 4.9e-4 each) of values up to ~10.
 */
function tol(dtype: DType): Tolerance {
  return dtype === 'f32' ? { atol: 1e-5, rtol: 1e-5 } : { atol: 2e-3, rtol: 2e-3 };
}

/** Reads a tensor back and frees it. */
async function readFree(gpu: Gpu, t: Tensor): Promise<Float32Array> {
  const v = await gpu.read(t);
  gpu.free(t);
  return v;
}

function up(gpu: Gpu, golden: GoldenSet, name: string, dtype: DType): Tensor {
  const t = golden.get(name);
  return gpu.upload(t.data, t.shape, dtype);
}

function activationCase(kind: Activation, key: string): KernelCase {
  return {
    family: 'elementwise',
    name: `${kind} [4,65] fwd + dx (golden)`,
    async run({ gpu, dtype, golden }) {
      const x = golden.get(`${key}.in0`);
      const tx = up(gpu, golden, `${key}.in0`, dtype);
      const tdy = up(gpu, golden, `${key}.dy`, dtype);
      const y = await readFree(gpu, activation(gpu, kind, tx));
      const dx = await readFree(gpu, activationBackward(gpu, kind, tx, tdy));
      const dy = golden.get(`${key}.dy`).data;
      return [
        compare('y vs torch', y, golden.get(`${key}.out`).data, tol(dtype)),
        compare(
          'y vs ts ref',
          y,
          x.data.map((v) => activationRef(kind, v)),
          tol(dtype),
        ),
        compare('dx vs torch', dx, golden.get(`${key}.din0`).data, tol(dtype)),
        compare(
          'dx vs ts ref',
          dx,
          x.data.map((v, i) => dy[i] * activationGradRef(kind, v)),
          tol(dtype),
        ),
      ];
    },
  };
}

const rand = (n: number, seed: number, s = 1) => roundToF16(randomValues(n, seed, s));

export const cases: KernelCase[] = [
  {
    family: 'elementwise',
    name: 'add alpha=-0.5 (golden) and its backward; scale by -0.5',
    async run({ gpu, dtype, golden }) {
      const a = golden.get('add.a');
      const b = golden.get('add.b');
      const tb = up(gpu, golden, 'add.b', dtype);
      const out = await readFree(gpu, add(gpu, up(gpu, golden, 'add.a', dtype), tb, -0.5));
      // One rounding of a - 0.5 b (|values| < 5) to the storage type.
      const t = dtype === 'f32' ? { atol: 1e-6, rtol: 1e-6 } : { atol: 1e-3, rtol: 1e-3 };
      // add's backward with dout = b: da = b, db = -0.5 b; scale(b, -0.5) is exact (power of two).
      const g = addBackward(gpu, tb, -0.5);
      const halfB = b.data.map((v) => -0.5 * v);
      return [
        compare('vs torch', out, golden.get('add.out').data, t),
        compare('vs ts ref', out, addRef(a.data, b.data, -0.5), t),
        compare('backward da = dout', await gpu.read(g.da), b.data, { atol: 0, rtol: 0 }),
        compare('backward db = -0.5 dout', await gpu.read(g.db), halfB, { atol: 0, rtol: 0 }),
        compare('scale -0.5', await readFree(gpu, scale(gpu, tb, -0.5)), halfB, { atol: 0, rtol: 0 }),
        compare(
          'scale 1/3',
          await readFree(gpu, scale(gpu, tb, 1 / 3)),
          b.data.map((v) => v / 3),
          t,
        ),
      ];
    },
  },
  {
    family: 'elementwise',
    name: 'mul [5,33] fwd + da/db (golden)',
    async run({ gpu, dtype, golden }) {
      const ta = up(gpu, golden, 'mul.in0', dtype);
      const tb = up(gpu, golden, 'mul.in1', dtype);
      const tdy = up(gpu, golden, 'mul.dy', dtype);
      const g = mulBackward(gpu, ta, tb, tdy);
      const a = golden.get('mul.in0').data;
      const b = golden.get('mul.in1').data;
      const dy = golden.get('mul.dy').data;
      const y = await gpu.read(mul(gpu, ta, tb));
      return [
        compare('y vs torch', y, golden.get('mul.out').data, tol(dtype)),
        compare('y vs ts ref', y, mulRef(a, b), tol(dtype)),
        compare('da vs torch', await gpu.read(g.da), golden.get('mul.din0').data, tol(dtype)),
        compare('db vs ts ref', await gpu.read(g.db), mulRef(dy, a), tol(dtype)),
        compare('db vs torch', await gpu.read(g.db), golden.get('mul.din1').data, tol(dtype)),
      ];
    },
  },
  activationCase('silu', 'silu'),
  activationCase('gelu', 'gelu'),
  activationCase('quickGelu', 'quick_gelu'),
  {
    family: 'elementwise',
    name: 'GELU erf accuracy: negative tail x in [-10,-1] (golden) and a sweep of [-9, 9] (ts ref, f32)',
    dtypes: ['f32'],
    async run({ gpu, golden }) {
      const x = golden.get('gelu_tail.in0');
      const tx = up(gpu, golden, 'gelu_tail.in0', 'f32');
      const y = await readFree(gpu, activation(gpu, 'gelu', tx));
      const dx = await readFree(gpu, activationBackward(gpu, 'gelu', tx, up(gpu, golden, 'gelu_tail.dy', 'f32')));
      const sweep = Float32Array.from({ length: 1801 }, (_, i) => -9 + i * 0.01);
      const ys = await readFree(gpu, activation(gpu, 'gelu', gpu.upload(sweep, [sweep.length], 'f32')));
      // Phi(x) = erfc(|x|/sqrt2)/2 in the tail: the fit's 1.2e-7 relative error plus f32 rounding of
      // the exp argument -x^2/2 (~1e-7 relative of up to 50) and of exp itself: ~1e-5 relative at x = -10.
      // No atol: values go down to 1e-22, so this is a relative test.
      const tail = { atol: 0, rtol: 2e-5 };
      // Sweep: erf within ~1.2e-7 absolute, times |x| <= 9, plus f32 rounding of y.
      const sweepTol = { atol: 2e-6, rtol: 2e-6 };
      return [
        compare('tail y vs torch', y, golden.get('gelu_tail.out').data, tail),
        compare('tail dx vs torch', dx, golden.get('gelu_tail.din0').data, tail),
        compare(
          'tail y vs ts ref',
          y,
          x.data.map((v) => activationRef('gelu', v)),
          tail,
        ),
        compare(
          'sweep y vs ts ref (float64 erfc)',
          ys,
          sweep.map((v) => activationRef('gelu', v)),
          sweepTol,
        ),
      ];
    },
  },
  {
    family: 'elementwise',
    name: 'GEGLU [2,3,38] -> [2,3,19] fwd + dx (golden)',
    async run({ gpu, dtype, golden }) {
      const x = golden.get('geglu.in0').data;
      const dy = golden.get('geglu.dy').data;
      const tx = up(gpu, golden, 'geglu.in0', dtype);
      const y = await gpu.read(geglu(gpu, tx));
      const dx = await gpu.read(gegluBackward(gpu, tx, up(gpu, golden, 'geglu.dy', dtype)));
      return [
        compare('y vs torch', y, golden.get('geglu.out').data, tol(dtype)),
        compare('y vs ts ref', y, gegluRef(x, 19), tol(dtype)),
        compare('dx vs torch', dx, golden.get('geglu.din0').data, tol(dtype)),
        compare('dx vs ts ref', dx, gegluBackwardRef(x, dy, 19), tol(dtype)),
      ];
    },
  },
  {
    family: 'elementwise',
    name: 'channel add x [2,5,3,7] + t [2,5] fwd + dx/dt (golden)',
    async run({ gpu, dtype, golden }) {
      const tx = up(gpu, golden, 'add_channel.in0', dtype);
      const tt = up(gpu, golden, 'add_channel.in1', dtype);
      const tdy = up(gpu, golden, 'add_channel.dy', dtype);
      const y = await gpu.read(addChannel(gpu, tx, tt));
      const g = addChannelBackward(gpu, tx, tt, tdy);
      const dt = await gpu.read(g.dt);
      // dt sums 21 values: f16 output rounding of a sum up to ~8.
      const sumTol = dtype === 'f32' ? { atol: 1e-5, rtol: 1e-5 } : { atol: 5e-3, rtol: 2e-3 };
      return [
        compare('y vs torch', y, golden.get('add_channel.out').data, tol(dtype)),
        compare('y vs ts ref', y, addChannelRef(golden.get('add_channel.in0').data, golden.get('add_channel.in1').data), tol(dtype)),
        compare('dx vs torch', await gpu.read(g.dx), golden.get('add_channel.din0').data, tol(dtype)),
        compare('dt vs torch', dt, golden.get('add_channel.din1').data, sumTol),
        compare('dt vs ts ref', dt, addChannelBackwardRef(golden.get('add_channel.dy').data, 10), sumTol),
      ];
    },
  },
  {
    family: 'elementwise',
    name: 'nearest 2x upsample [2,3,5,4] fwd + dx (golden)',
    async run({ gpu, dtype, golden }) {
      const x = golden.get('upsample.in0');
      const tx = up(gpu, golden, 'upsample.in0', dtype);
      const y = await gpu.read(upsample2x(gpu, tx));
      const dx = await gpu.read(upsample2xBackward(gpu, tx, up(gpu, golden, 'upsample.dy', dtype)));
      return [
        compare('y vs torch', y, golden.get('upsample.out').data, { atol: 0, rtol: 0 }),
        compare('y vs ts ref', y, upsample2xRef(x.data, x.shape), { atol: 0, rtol: 0 }),
        compare('dx vs torch', dx, golden.get('upsample.din0').data, tol(dtype)),
        compare('dx vs ts ref', dx, upsample2xBackwardRef(golden.get('upsample.dy').data, x.shape), tol(dtype)),
      ];
    },
  },
  {
    family: 'elementwise',
    name: 'softmax over 77 keys, x [3,7,77] fwd + dx (golden)',
    async run({ gpu, dtype, golden }) {
      const x = golden.get('softmax.in0').data;
      const tx = up(gpu, golden, 'softmax.in0', dtype);
      const ty = softmax(gpu, tx);
      const y = await gpu.read(ty);
      const dx = await gpu.read(softmaxBackward(gpu, ty, up(gpu, golden, 'softmax.dy', dtype)));
      const yRef = softmaxRef(x, 77);
      // Probabilities up to 1: f16 rounding 4.9e-4 relative; dx from f16 y adds the same again.
      const t = dtype === 'f32' ? { atol: 1e-6, rtol: 1e-5 } : { atol: 1e-3, rtol: 4e-3 };
      return [
        compare('y vs torch', y, golden.get('softmax.out').data, t),
        compare('y vs ts ref', y, yRef, t),
        compare('dx vs torch', dx, golden.get('softmax.din0').data, t),
        compare('dx vs ts ref', dx, softmaxBackwardRef(yRef, golden.get('softmax.dy').data, 77), t),
      ];
    },
  },
  {
    family: 'elementwise',
    name: 'timestep embedding dim 320 and 33 (odd), t up to 999 (golden)',
    async run({ gpu, dtype, golden }) {
      const t = golden.get('temb.t');
      const tt = gpu.upload(t.data, t.shape, 'f32');
      const e320 = await gpu.read(timestepEmbedding(gpu, tt, 320, dtype));
      const e33 = await gpu.read(timestepEmbedding(gpu, tt, 33, dtype));
      // f32 argument t*freq carries ~1e-7 relative error, i.e. ~1e-4 absolute at t=999; WGSL bounds
      // sin/cos to 2^-11 absolute on [-pi, pi]. f16 storage adds 4.9e-4.
      const et = dtype === 'f32' ? { atol: 5e-4, rtol: 0 } : { atol: 1.5e-3, rtol: 0 };
      return [
        compare('dim 320 vs torch', e320, golden.get('temb.out320').data, et),
        compare('dim 320 vs ts ref', e320, timestepEmbeddingRef(t.data, 320), et),
        compare('dim 33 vs torch', e33, golden.get('temb.out33').data, et),
        compare('dim 33 vs ts ref', e33, timestepEmbeddingRef(t.data, 33), et),
      ];
    },
  },
  {
    family: 'elementwise',
    name: 'finite differences: GELU, SiLU, GEGLU, softmax, channel add (f32)',
    dtypes: ['f32'],
    async run({ gpu }) {
      const checks: Check[] = [];
      // Central differences, h = 1e-2: truncation O(h^2 f''') plus f32 rounding ~1e-6/h.
      const fdTol = { atol: 2e-3, rtol: 1e-2 };
      const sumOf = (y: Float32Array, r: Float32Array) => y.reduce((s, v, i) => s + v * r[i], 0);
      for (const kind of ['gelu', 'silu'] as const) {
        const x = rand(40, 3, 3);
        const r = rand(40, 4);
        const tx = gpu.upload(x, [40], 'f32');
        const dx = await gpu.read(activationBackward(gpu, kind, tx, gpu.upload(r, [40], 'f32')));
        const idx = sampleIndices(40, 5, 5);
        const fd = await finiteDiff(gpu, tx, x, idx, 1e-2, async () => sumOf(await gpu.read(activation(gpu, kind, tx)), r));
        checks.push(
          compare(
            `${kind} dx vs central difference`,
            idx.map((i) => dx[i]),
            fd,
            fdTol,
          ),
        );
      }
      {
        const x = rand(2 * 16, 6, 2);
        const r = rand(16, 7);
        const tx = gpu.upload(x, [2, 16], 'f32');
        const dx = await gpu.read(gegluBackward(gpu, tx, gpu.upload(r, [2, 8], 'f32')));
        const idx = sampleIndices(32, 6, 8);
        const fd = await finiteDiff(gpu, tx, x, idx, 1e-2, async () => sumOf(await gpu.read(geglu(gpu, tx)), r));
        checks.push(
          compare(
            'geglu dx vs central difference',
            idx.map((i) => dx[i]),
            fd,
            fdTol,
          ),
        );
      }
      {
        const x = rand(3 * 11, 9, 2);
        const r = rand(3 * 11, 10);
        const tx = gpu.upload(x, [3, 11], 'f32');
        const dx = await gpu.read(softmaxBackward(gpu, softmax(gpu, tx), gpu.upload(r, [3, 11], 'f32')));
        const idx = sampleIndices(33, 6, 11);
        const fd = await finiteDiff(gpu, tx, x, idx, 1e-2, async () => sumOf(await gpu.read(softmax(gpu, tx)), r));
        checks.push(
          compare(
            'softmax dx vs central difference',
            idx.map((i) => dx[i]),
            fd,
            fdTol,
          ),
        );
      }
      {
        const x = rand(2 * 3 * 4, 12);
        const t = rand(6, 13);
        const r = rand(24, 14);
        const tx = gpu.upload(x, [2, 3, 2, 2], 'f32');
        const tt = gpu.upload(t, [2, 3], 'f32');
        const dt = await gpu.read(addChannelBackward(gpu, tx, tt, gpu.upload(r, [2, 3, 2, 2], 'f32')).dt);
        const idx = [0, 3, 5];
        const fd = await finiteDiff(gpu, tt, t, idx, 1e-2, async () => sumOf(await gpu.read(addChannel(gpu, tx, tt)), r));
        checks.push(
          compare(
            'channel add dt vs central difference',
            idx.map((i) => dt[i]),
            fd,
            fdTol,
          ),
        );
      }
      return checks;
    },
  },
  {
    family: 'elementwise',
    name: 'zero pad (0,1,0,1) and (2,1,3,0) of [2,3,5,4], and its backward (ts ref, exact)',
    async run({ gpu, dtype }) {
      const checks: Check[] = [];
      const shape = [2, 3, 5, 4];
      const x = rand(120, 31);
      for (const pad of [
        { top: 0, bottom: 1, left: 0, right: 1 },
        { top: 2, bottom: 1, left: 3, right: 0 },
      ]) {
        const tx = gpu.upload(x, shape, dtype);
        const y = pad2d(gpu, tx, pad);
        const padded = pad2dRef(x, shape, pad);
        const back = await gpu.read(pad2dBackward(gpu, tx, gpu.upload(padded, y.shape, dtype), pad));
        const label = `${pad.top},${pad.bottom},${pad.left},${pad.right}`;
        checks.push(compare(`pad ${label}`, await gpu.read(y), padded, { atol: 0, rtol: 0 }), compare(`crop ${label} = x`, back, x, { atol: 0, rtol: 0 }));
      }
      return checks;
    },
  },
  {
    family: 'elementwise',
    name: 'transpose [2,3,5,7] last dims and back; channel concat [2,3,4,5]+[2,2,4,5] and split back (exact)',
    async run({ gpu, dtype }) {
      const exact = { atol: 0, rtol: 0 };
      const x = rand(210, 41);
      const tx = gpu.upload(x, [2, 3, 5, 7], dtype);
      const t = transpose2d(gpu, tx);
      const want = new Float32Array(210);
      for (let m = 0; m < 6; m++) for (let r = 0; r < 5; r++) for (let c = 0; c < 7; c++) want[m * 35 + c * 5 + r] = x[m * 35 + r * 7 + c];
      const a = rand(120, 42);
      const b = rand(80, 43);
      const ta = gpu.upload(a, [2, 3, 4, 5], dtype);
      const tb = gpu.upload(b, [2, 2, 4, 5], dtype);
      const cat = concatChannels(gpu, ta, tb);
      const catWant = new Float32Array(200);
      for (let n = 0; n < 2; n++) {
        catWant.set(a.subarray(n * 60, n * 60 + 60), n * 100);
        catWant.set(b.subarray(n * 40, n * 40 + 40), n * 100 + 60);
      }
      return [
        compare('transpose', await gpu.read(t), want, exact),
        compare('transpose back', await gpu.read(transpose2d(gpu, t)), x, exact),
        compare('concat', await gpu.read(cat), catWant, exact),
        compare('split first 3 channels = x', await gpu.read(splitChannels(gpu, cat, 0, 3)), a, exact),
        compare('split last 2 channels = y', await gpu.read(splitChannels(gpu, cat, 3, 2)), b, exact),
      ];
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
