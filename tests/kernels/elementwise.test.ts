import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { ShapeError } from '../../src/gpu/errors.ts';
import { roundToF16 } from '../../src/util/half.ts';
import type { Tensor } from '../../src/gpu/tensor.ts';
import {
  activation,
  activationBackward,
  activationRef,
  add,
  addChannel,
  addChannelBackward,
  addChannelBackwardRef,
  addChannelRef,
  addRef,
  cast,
  concatChannels,
  geglu,
  gegluBackward,
  gegluBackwardRef,
  gegluRef,
  mul,
  mulRef,
  pad2d,
  pad2dBackward,
  pad2dRef,
  repeat,
  scale,
  splitChannels,
  timestepEmbedding,
  timestepEmbeddingRef,
  transpose2d,
  upsample2x,
  upsample2xBackward,
  upsample2xBackwardRef,
  upsample2xRef,
} from '../../src/ops/elementwise.ts';
import { softmax, softmaxBackward, softmaxRef } from '../../src/ops/softmax.ts';
import { compare, randomValues } from '../../src/selftest/check.ts';
import { assertChecks, defineCaseTests, testGpu } from '../helpers.ts';

defineCaseTests('elementwise');

const shapeError =
  (op: string, ...parts: string[]) =>
  (e: unknown) =>
    e instanceof ShapeError && e.message.startsWith(`${op}:`) && parts.every((p) => e.message.includes(p));

describe('element-wise bad input', () => {
  it('names the op and the shapes', async () => {
    const gpu = await testGpu();
    const z = (shape: number[], d: 'f32' | 'f16' = 'f32') => gpu.zeros(shape, d);
    assert.throws(() => mul(gpu, z([2, 3]), z([3, 2])), shapeError('mul', '[2,3]', '[3,2]'));
    assert.throws(() => mul(gpu, z([2, 3]), z([2, 3], 'f16')), shapeError('mul', 'dtype', 'f32[2,3]', 'f16[2,3]'));
    assert.throws(() => geglu(gpu, z([2, 7])), shapeError('geglu', '[2,7]', 'even'));
    assert.throws(() => gegluBackward(gpu, z([2, 8]), z([2, 3])), shapeError('gegluBackward', '[2,3]', '[2,8]'));
    assert.throws(() => addChannel(gpu, z([2, 4, 3, 3]), z([2, 3])), shapeError('addChannel', '[2,4]', '[2,3]'));
    assert.throws(() => upsample2xBackward(gpu, z([1, 2, 3, 3]), z([1, 2, 6, 5])), shapeError('upsample2xBackward', '[1,2,6,6]', '[1,2,6,5]'));
    assert.throws(() => activationBackward(gpu, 'silu', z([4]), z([5])), shapeError('siluBackward', '[4]', '[5]'));
    assert.throws(() => softmaxBackward(gpu, z([2, 5]), z([2, 4])), shapeError('softmaxBackward', '[2,4]', '[2,5]'));
    assert.throws(() => concatChannels(gpu, z([2, 3, 4, 4]), z([2, 2, 4, 5])), shapeError('concatChannels', '[2,3,4,4]', '[2,2,4,5]'));
    assert.throws(() => splitChannels(gpu, z([2, 3, 4, 4]), 2, 2), shapeError('splitChannels', 'channels [2, 4)', '[2,3,4,4]'));
    assert.throws(() => transpose2d(gpu, z([5])), shapeError('transpose2d', '[5]'));
    assert.throws(() => timestepEmbedding(gpu, z([3], 'f16'), 8, 'f32'), shapeError('timestepEmbedding', 'timesteps must be f32', 'f16 [3]'));
  });
});

describe('vec4 kernels (ranges of a multiple of 4 elements) against the scalar ones', () => {
  for (const dtype of ['f32', 'f16'] as const)
    it(`add, scale, SiLU and its backward give the same bits on 4k and 4k+3 elements [${dtype}]`, async () => {
      const gpu = await testGpu();
      // 4k elements run the vec4 entries, 4k+3 the scalar ones; the first 4k inputs are shared, so every
      // output element of the vec4 run must equal the scalar run's bit for bit (the same f32 math per element).
      const n = 1028;
      const xa = roundToF16(randomValues(n + 3, 21, 4));
      const xb = roundToF16(randomValues(n + 3, 22, 4));
      const ops = (len: number) => {
        const a = gpu.upload(xa.subarray(0, len), [len], dtype);
        const b = gpu.upload(xb.subarray(0, len), [len], dtype);
        return [add(gpu, a, b, -0.75), scale(gpu, a, 1 / 3), activation(gpu, 'silu', a), activationBackward(gpu, 'silu', a, b)];
      };
      const [vec, scalar] = [ops(n), ops(n + 3)];
      for (const [i, name] of ['add', 'scale', 'silu', 'siluBackward'].entries()) {
        const [v, s] = [await gpu.read(vec[i]), await gpu.read(scalar[i])];
        assert.equal(v.length, n);
        const differ = v.findIndex((value, j) => !Object.is(value, s[j]));
        assert.equal(differ, -1, `${name}: element ${differ} is ${v[differ]} (vec4) vs ${s[differ]} (scalar)`);
      }
      // And the vec4 results are right, not just equal: add against its reference (one rounding to the storage type).
      const tol = dtype === 'f32' ? { atol: 1e-6, rtol: 1e-6 } : { atol: 4e-3, rtol: 1e-3 };
      assertChecks([compare('add (vec4)', await gpu.read(vec[0]), addRef(xa.subarray(0, n), xb.subarray(0, n), -0.75), tol)]);
    });
});

describe('addChannelBackward plane sums with several lanes per plane', () => {
  it('sums planes of 4096 (64 lanes each) and 300 (16 lanes, not a multiple) against float64 sums', async () => {
    const gpu = await testGpu();
    for (const shape of [
      [2, 3, 64, 64],
      [3, 5, 10, 30],
    ]) {
      const [n, c] = shape;
      const inner = shape[2] * shape[3];
      const dy = randomValues(n * c * inner, 31, 2);
      const dt = await gpu.read(addChannelBackward(gpu, gpu.zeros(shape, 'f32'), gpu.zeros([n, c], 'f32'), gpu.upload(dy, shape, 'f32')).dt);
      for (let plane = 0; plane < n * c; plane++) {
        let exact = 0;
        let magnitude = 0;
        for (let j = 0; j < inner; j++) {
          exact += dy[plane * inner + j];
          magnitude += Math.abs(dy[plane * inner + j]);
        }
        // f32 partial sums of <= 64 terms, then <= 64 partials: each rounding is <= 2^-24 of the running sum,
        // so the error is below (64 + 64) * 2^-24 * sum|dy| ~ 7.6e-6 sum|dy|.
        const bound = 8e-6 * magnitude;
        assert.ok(Math.abs(dt[plane] - exact) <= bound, `[${shape}] plane ${plane}: ${dt[plane]} vs ${exact} (bound ${bound})`);
      }
    }
  });
});

describe('element-wise ops over tensors larger than one storage binding (bindingLimit 1 KiB)', () => {
  it('activations and softmax chunk their ranges', async () => {
    const gpu = await testGpu({ bindingLimit: 1024 });
    try {
      const x = randomValues(3000, 1, 3);
      const y = await gpu.read(activation(gpu, 'gelu', gpu.upload(x, [3000], 'f32')));
      const rows = randomValues(30 * 40, 2, 3); // 160-byte rows: 6 rows per binding
      const s = await gpu.read(softmax(gpu, gpu.upload(rows, [30, 40], 'f32')));
      assertChecks([
        compare(
          'gelu',
          y,
          x.map((v) => activationRef('gelu', v)),
          { atol: 1e-5, rtol: 1e-5 },
        ),
        compare('softmax rows', s, softmaxRef(rows, 40), { atol: 1e-6, rtol: 1e-5 }),
      ]);
    } finally {
      gpu.destroy();
    }
  });
});

describe('item-wise ops over tensors larger than one storage binding', () => {
  for (const dtype of ['f32', 'f16'] as const)
    it(`GEGLU, upsample, channel add, pad, transpose, concat/split, repeat, mul, cast, timestep embedding split into ranges [${dtype}]`, async () => {
      const limit = dtype === 'f32' ? 1024 : 512;
      const gpu = await testGpu({ bindingLimit: limit });
      try {
        const checks = [];
        // Every tensor that must be chunked is asserted larger than one binding, so the test cannot pass unchunked.
        // Item sizes are chosen so a binding holds whole items at 16-byte aligned starts (lavapipe's alignment).
        const big = (t: Tensor) => {
          assert.ok(t.byteSize > limit, `${t} should exceed the ${limit}-byte binding`);
          return t;
        };
        const rand = (n: number, seed: number) => roundToF16(randomValues(n, seed, 2));
        const upl = (v: Float32Array, shape: number[]) => gpu.upload(v, shape, dtype);
        // One rounding to the storage type of values up to ~8 (f16: 4.9e-4 relative); sums of a few terms.
        const tol = dtype === 'f32' ? { atol: 1e-5, rtol: 1e-5 } : { atol: 4e-3, rtol: 2e-3 };
        const exact = { atol: 0, rtol: 0 };

        // GEGLU x [7, 3, 26] -> [7, 3, 13]: rows of 26 and 13 elements (odd byte sizes).
        const gx = rand(7 * 3 * 26, 1);
        const gdy = rand(7 * 3 * 13, 2);
        const tgx = big(upl(gx, [7, 3, 26]));
        const tgdy = big(upl(gdy, [7, 3, 13]));
        checks.push(compare('geglu', await gpu.read(geglu(gpu, tgx)), gegluRef(gx, 13), tol));
        checks.push(compare('gegluBackward', await gpu.read(gegluBackward(gpu, tgx, tgdy)), gegluBackwardRef(gx, gdy, 13), tol));

        // Nearest upsample of [3, 5, 4, 5] (15 planes of 20 -> 80 elements) and its backward.
        const ux = rand(300, 3);
        const ud = rand(1200, 4);
        const tux = big(upl(ux, [3, 5, 4, 5]));
        checks.push(compare('upsample2x', await gpu.read(big(upsample2x(gpu, tux))), upsample2xRef(ux, [3, 5, 4, 5]), exact));
        checks.push(
          compare('upsample2xBackward', await gpu.read(upsample2xBackward(gpu, tux, upl(ud, [3, 5, 8, 10]))), upsample2xBackwardRef(ud, [3, 5, 4, 5]), tol),
        );

        // Channel add x [3, 5, 3, 7] + t [3, 5] and its backward (dt: 15 plane sums of 21).
        const cx = rand(315, 5);
        const ct = rand(15, 6);
        const cd = rand(315, 7);
        const tcx = big(upl(cx, [3, 5, 3, 7]));
        const tct = upl(ct, [3, 5]);
        checks.push(compare('addChannel', await gpu.read(addChannel(gpu, tcx, tct)), addChannelRef(cx, ct), tol));
        const cg = addChannelBackward(gpu, tcx, tct, big(upl(cd, [3, 5, 3, 7])));
        checks.push(compare('addChannelBackward dt', await gpu.read(cg.dt), addChannelBackwardRef(cd, 15), tol));

        // Zero pad (1, 2, 0, 1) of [3, 5, 4, 5] and the crop back.
        const pad = { top: 1, bottom: 2, left: 0, right: 1 };
        const padded = big(pad2d(gpu, tux, pad));
        checks.push(compare('pad2d', await gpu.read(padded), pad2dRef(ux, [3, 5, 4, 5], pad), exact));
        checks.push(compare('pad2dBackward', await gpu.read(pad2dBackward(gpu, tux, padded, pad)), ux, exact));

        // Transpose [16, 3, 7] (sixteen 21-element matrices) and back.
        const tx = rand(336, 8);
        const tt = transpose2d(gpu, big(upl(tx, [16, 3, 7])));
        checks.push(compare('transpose2d and back', await gpu.read(transpose2d(gpu, tt)), tx, exact));

        // Channel concat [9, 3, 2, 4] + [9, 2, 2, 4] and the split back.
        const ka = rand(216, 9);
        const kb = rand(144, 10);
        const cat = big(concatChannels(gpu, upl(ka, [9, 3, 2, 4]), upl(kb, [9, 2, 2, 4])));
        checks.push(compare('concat then split first 3', await gpu.read(splitChannels(gpu, cat, 0, 3)), ka, exact));
        checks.push(compare('concat then split last 2', await gpu.read(splitChannels(gpu, cat, 3, 2)), kb, exact));

        // repeat [20] 15 times; mul and cast over 600 elements; timestep embedding [9] x 50.
        const rx = rand(20, 11);
        const rep = await gpu.read(big(repeat(gpu, upl(rx, [20]), 15)));
        checks.push(
          compare(
            'repeat',
            rep,
            Float32Array.from({ length: 20 * 15 }, (_, i) => rx[i % 20]),
            exact,
          ),
        );
        const ma = rand(600, 12);
        const mb = rand(600, 13);
        const tma = big(upl(ma, [600]));
        checks.push(compare('mul', await gpu.read(mul(gpu, tma, upl(mb, [600]))), mulRef(ma, mb), tol));
        const other = dtype === 'f32' ? 'f16' : 'f32';
        checks.push(compare(`cast ${dtype} -> ${other} -> ${dtype}`, await gpu.read(cast(gpu, big(cast(gpu, tma, other)), dtype)), ma, exact));
        const steps = Float32Array.from([0, 1, 5, 50, 250, 500, 750, 900, 999]);
        const emb = big(timestepEmbedding(gpu, gpu.upload(steps, [9], 'f32'), 50, dtype));
        checks.push(compare('timestep embedding', await gpu.read(emb), timestepEmbeddingRef(steps, 50), { atol: dtype === 'f32' ? 5e-4 : 1.5e-3, rtol: 0 }));
        assertChecks(checks);
      } finally {
        gpu.destroy();
      }
    });

  it('refuses an item larger than one binding, naming the op', async () => {
    const gpu = await testGpu({ bindingLimit: 256 });
    try {
      assert.throws(() => geglu(gpu, gpu.zeros([2, 128], 'f32')), shapeError('geglu', '512 bytes', '256'));
    } finally {
      gpu.destroy();
    }
  });
});
