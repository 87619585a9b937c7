import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { ShapeError } from '../../src/gpu/errors.ts';
import { roundToF16 } from '../../src/util/half.ts';
import type { DType } from '../../src/gpu/tensor.ts';
import {
  groupNorm,
  groupNormBackward,
  groupNormBackwardRef,
  groupNormRef,
  layerNorm,
  layerNormBackward,
  layerNormBackwardRef,
  layerNormRef,
  normLanes,
  setNormLanes,
} from '../../src/ops/norm.ts';
import { compare, randomValues, type Check } from '../../src/selftest/check.ts';
import { normTol } from '../../src/selftest/cases/norm.ts';
import { assertChecks, defineCaseTests, testGpu } from '../helpers.ts';

defineCaseTests('norm');

const shapeError =
  (op: string, ...parts: string[]) =>
  (e: unknown) =>
    e instanceof ShapeError && e.message.startsWith(`${op}:`) && parts.every((p) => e.message.includes(p));

describe('norm bad input', () => {
  it('channels not divisible by groups, affine size, dy size, dtype', async () => {
    const gpu = await testGpu();
    const x = gpu.zeros([1, 6, 2, 2], 'f32');
    const g6 = gpu.zeros([6], 'f32');
    assert.throws(() => groupNorm(gpu, x, g6, g6, 4), shapeError('groupNorm', 'channels 6', '[1,6,2,2]', '4 groups'));
    assert.throws(() => groupNorm(gpu, x, gpu.zeros([5], 'f32'), g6, 3), shapeError('groupNorm', 'gamma must be [6]', '[5]'));
    assert.throws(() => groupNorm(gpu, x, gpu.zeros([6], 'f16'), gpu.zeros([6], 'f16'), 3), shapeError('groupNorm', 'dtype', 'f32[1,6,2,2]', 'f16[6]'));
    const f = groupNorm(gpu, x, g6, g6, 3);
    assert.throws(() => groupNormBackward(gpu, x, g6, f, gpu.zeros([1, 6, 2, 3], 'f32'), 3), shapeError('groupNormBackward', 'dy [1,6,2,3]', 'x [1,6,2,2]'));
    assert.throws(() => layerNorm(gpu, gpu.zeros([3, 8], 'f32'), gpu.zeros([3], 'f32'), gpu.zeros([3], 'f32')), shapeError('layerNorm', 'gamma must be [8]'));
  });
});

describe('GroupNorm larger than one storage binding (bindingLimit 2 KiB: one sample per dispatch)', () => {
  // lanes 1: one invocation per segment; 8: several segments per workgroup; 256: one workgroup per segment.
  // Each dispatch starts at seg_offset = 4 * sample, which the slots and the param-grad walk must add.
  for (const dtype of ['f32', 'f16'] as const)
    it(`forward and backward chunked over samples, lanes 1, 8 and 256 [${dtype}]`, async () => {
      const gpu = await testGpu({ bindingLimit: 2048 });
      try {
        for (const lanes of [1, 8, 256]) {
          setNormLanes(lanes);
          const shape = [5, 8, 6, 7]; // one sample = 336 elements: 1344 B (f32) / 672 B (f16)
          const n = 5 * 8 * 42;
          const x = roundToF16(randomValues(n, 1, 2));
          const gamma = roundToF16(randomValues(8, 2).map((v) => v + 1));
          const beta = roundToF16(randomValues(8, 3));
          const dy = roundToF16(randomValues(n, 4));
          const tx = gpu.upload(x, shape, dtype);
          const tg = gpu.upload(gamma, [8], dtype);
          const tb = gpu.upload(beta, [8], dtype);
          const f = groupNorm(gpu, tx, tg, tb, 4);
          const g = groupNormBackward(gpu, tx, tg, f, gpu.upload(dy, shape, dtype), 4);
          const ref = groupNormRef(x, shape, gamma, beta, 4);
          const gref = groupNormBackwardRef(x, shape, gamma, dy, 4);
          const tol = normTol(dtype);
          assertChecks([
            compare(`y (lanes ${lanes})`, await gpu.read(f.y), ref.y, tol),
            compare(`dx (lanes ${lanes})`, await gpu.read(g.dx), gref.dx, tol),
            compare(`dgamma (accumulated over chunks, lanes ${lanes})`, await gpu.read(g.dgamma), gref.dgamma, tol),
            compare(`dbeta (accumulated over chunks, lanes ${lanes})`, await gpu.read(g.dbeta), gref.dbeta, tol),
          ]);
        }
      } finally {
        setNormLanes(null);
        gpu.destroy();
      }
    });
});

describe('norm lanes per segment (one pipeline; lanes is a uniform)', () => {
  it('normLanes: CPU adapters one lane up to 1024 elements, then one per 1024; GPUs one per element; at most 256', () => {
    const sizes = [1, 3, 64, 65, 256, 1024, 1025, 2560, 40960, 1 << 20];
    assert.deepEqual(
      sizes.map((n) => normLanes(n, true)),
      [1, 1, 1, 1, 1, 1, 2, 4, 64, 256],
    );
    assert.deepEqual(
      sizes.map((n) => normLanes(n, false)),
      [1, 4, 64, 128, 256, 256, 256, 256, 256, 256],
    );
    assert.throws(() => setNormLanes(3), /setNormLanes: lanes must be a power of two from 1 to 256, got 3/);
    assert.throws(() => setNormLanes(512), /got 512/);
    assert.equal(normLanes(64, true), 1, 'a refused setNormLanes changes nothing');
  });

  // Ragged shapes: segment lengths 1, 3, 65 and 130 (not multiples of any lane count), segment and channel
  // counts that leave slots of the last workgroup empty (5, 7, 3 and 9 segments; 1..10 channels). Every lane
  // count from 1 to 256 runs; a wrong slot, lane stride or tree step puts values of one segment into another's
  // statistics (or leaves outputs unwritten: the test GPU fills new tensors with NaN), and the comparison fails.
  const SHAPES: { kind: 'group' | 'layer'; shape: number[]; groups: number }[] = [
    { kind: 'layer', shape: [5, 1], groups: 1 },
    { kind: 'layer', shape: [7, 3], groups: 1 },
    { kind: 'layer', shape: [3, 65], groups: 1 },
    { kind: 'group', shape: [3, 6, 5, 13], groups: 3 },
  ];
  for (const dtype of ['f32', 'f16'] as DType[])
    it(`GroupNorm and LayerNorm with lanes 1, 2, 4, 8, 16, 32, 64, 128, 256 against the ts reference [${dtype}]`, async () => {
      const gpu = await testGpu();
      try {
        const checks: Check[] = [];
        for (const { kind, shape, groups } of SHAPES) {
          const n = shape.reduce((a, b) => a * b, 1);
          const c = kind === 'group' ? shape[1] : shape[shape.length - 1];
          const x = roundToF16(randomValues(n, 11, 2).map((v) => v + 0.5));
          const gamma = roundToF16(randomValues(c, 12).map((v) => v + 1));
          const beta = roundToF16(randomValues(c, 13));
          const dy = roundToF16(randomValues(n, 14));
          const ref = kind === 'group' ? groupNormRef(x, shape, gamma, beta, groups) : layerNormRef(x, shape, gamma, beta);
          const gref = kind === 'group' ? groupNormBackwardRef(x, shape, gamma, dy, groups) : layerNormBackwardRef(x, shape, gamma, dy);
          const [tx, tg, tb, tdy] = [gpu.upload(x, shape, dtype), gpu.upload(gamma, [c], dtype), gpu.upload(beta, [c], dtype), gpu.upload(dy, shape, dtype)];
          for (let lanes = 1; lanes <= 256; lanes *= 2) {
            setNormLanes(lanes);
            const f = kind === 'group' ? groupNorm(gpu, tx, tg, tb, groups) : layerNorm(gpu, tx, tg, tb);
            const g = kind === 'group' ? groupNormBackward(gpu, tx, tg, f, tdy, groups) : layerNormBackward(gpu, tx, tg, f, tdy);
            const what = `${kind} [${shape.join(',')}] lanes ${lanes}`;
            const tol = normTol(dtype);
            checks.push(
              compare(`${what} y`, await gpu.read(f.y), ref.y, tol),
              compare(`${what} mean`, await gpu.read(f.mean), ref.mean, normTol('f32')),
              compare(`${what} rstd`, await gpu.read(f.rstd), ref.rstd, { atol: 1e-5, rtol: 1e-4 }),
              compare(`${what} dx`, await gpu.read(g.dx), gref.dx, tol),
              compare(`${what} dgamma`, await gpu.read(g.dgamma), gref.dgamma, tol),
              compare(`${what} dbeta`, await gpu.read(g.dbeta), gref.dbeta, tol),
            );
            gpu.free(f.y, f.mean, f.rstd, g.dx, g.dgamma, g.dbeta);
          }
          gpu.free(tx, tg, tb, tdy);
        }
        assertChecks(checks);
      } finally {
        setNormLanes(null);
      }
    });
});
