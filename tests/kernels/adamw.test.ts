import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { ShapeError } from '../../src/gpu/errors.ts';
import { roundToF16 } from '../../src/util/half.ts';
import type { DType } from '../../src/gpu/tensor.ts';
import {
  adamw,
  adamwAll,
  adamwCheck,
  adamwCheckRef,
  adamwParam,
  adamwRef,
  adamwStateStats,
  adamwStats,
  adamwStepSafe,
  clipFactorRef,
  F16_MAX,
  F32_MAX,
  masterLimit,
  type AdamWConfig,
} from '../../src/ops/adamw.ts';
import { DynamicLossScaler } from '../../src/ops/lossscale.ts';
import { globalNormRef, newFlag, readFlag } from '../../src/ops/reduce.ts';
import { compare, randomValues } from '../../src/selftest/check.ts';
import { viewOf } from '../../src/selftest/cases/reduce.ts';
import { assertChecks, defineCaseTests, testGpu } from '../helpers.ts';

defineCaseTests('adamw');

const CFG: AdamWConfig = { lr: 1e-2, beta1: 0.9, beta2: 0.99, eps: 1e-8, weightDecay: 0.05 };

describe('adamw bad input', () => {
  it('names the op and the shapes or dtypes', async () => {
    const gpu = await testGpu();
    const is = (re: RegExp) => (e: Error) => e instanceof ShapeError && re.test(e.message);
    const p = adamwParam(gpu, gpu.zeros([4, 4], 'f16'), new Float32Array(16));
    const flag = newFlag(gpu);
    const s = { step: 1, lossScale: 1, flag };
    const g = gpu.zeros([16], 'f16');
    assert.throws(() => adamw(gpu, p, gpu.zeros([15], 'f16'), CFG, s), is(/adamw: grad \[15\] does not match master \[4,4\]/));
    assert.throws(() => adamw(gpu, { ...p, m: gpu.zeros([4, 3], 'f32') }, g, CFG, s), is(/adamw: m \[4,3\] does not match master \[4,4\]/));
    assert.throws(() => adamw(gpu, { ...p, v: gpu.zeros([17], 'f32') }, g, CFG, s), is(/adamw: v \[17\] does not match master \[4,4\]/));
    assert.throws(() => adamw(gpu, { ...p, weight: gpu.zeros([2, 4], 'f16') }, g, CFG, s), is(/adamw: weight \[2,4\] does not match master \[4,4\]/));
    assert.throws(() => adamw(gpu, { ...p, master: gpu.zeros([4, 4], 'f16') }, g, CFG, s), is(/adamw: master must be f32, got f16 \[4,4\]/));
    assert.throws(() => adamw(gpu, { ...p, m: gpu.zeros([4, 4], 'f16') }, g, CFG, s), is(/adamw: m must be f32, got f16 \[4,4\]/));
    assert.throws(() => adamw(gpu, p, g, CFG, { ...s, flag: gpu.zeros([1], 'f16') }), is(/adamw: flag must be f32 \[1\], got f16\[1\]/));
    assert.throws(
      () => adamw(gpu, p, g, CFG, { ...s, clip: { norm: gpu.zeros([2], 'f32'), maxNorm: 1 } }),
      is(/adamw: clip norm must be f32 \[1\], got f32\[2\]/),
    );
    assert.throws(() => adamw(gpu, p, g, CFG, { ...s, clip: { norm: newFlag(gpu), maxNorm: 0 } }), is(/adamw: maxNorm must be > 0/));
    assert.throws(() => adamw(gpu, p, g, CFG, { ...s, step: 0 }), is(/adamw: step must be an integer >= 1, got 0/));
    assert.throws(() => adamw(gpu, p, g, CFG, { ...s, lossScale: Infinity }), is(/adamw: loss scale must be finite and > 0/));
    assert.throws(() => adamwAll(gpu, [p], [], CFG, s), is(/adamwAll: 1 parameters but 0 gradients/));
    assert.throws(() => adamwCheck(gpu, p, g, CFG, s, gpu.zeros([2], 'f32')), is(/adamwCheck: update flag must be f32 \[1\], got f32\[2\]/));
    assert.throws(() => adamwCheck(gpu, p, gpu.zeros([15], 'f16'), CFG, s, newFlag(gpu)), is(/adamw: grad \[15\] does not match master \[4,4\]/));
    const out = gpu.zeros([4], 'f32');
    assert.throws(() => adamwStats(gpu, { ...p, v: gpu.zeros([3], 'f32') }, CFG, out), is(/adamwStats: v \[3\] does not match master \[4,4\]/));
    assert.throws(() => adamwStats(gpu, p, CFG, gpu.zeros([3], 'f32')), is(/adamwStats: out must be f32 \[4\], got f32\[3\]/));
  });
});

describe('adamwStepSafe: the bound that spares streamed chunks the exact check', () => {
  const cfg: AdamWConfig = { lr: 1e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weightDecay: 1e-2 };
  /** A state after `steps` reference steps from `init`, with gradients of mixed sizes (zeros and tiny ones too). */
  function history(init: Float32Array, steps: number, seed: number) {
    const st = { master: Float32Array.from(init), m: new Float32Array(init.length), v: new Float32Array(init.length) };
    for (let t = 1; t <= steps; t++) {
      const g = randomValues(init.length, seed + t, 0.5).map((x, i) => (i % 5 === 0 ? 0 : i % 5 === 1 ? x * 1e-15 : i % 5 === 2 ? x * 30 : x));
      adamwRef(st.master, st.m, st.v, g, cfg, t);
    }
    return st;
  }

  it('whenever it says safe, the exact f32 update sets no flag (lr 1e-8 .. 1e40, f16 and f32 limits, fresh and trained states)', () => {
    let proven = 0;
    let refuted = 0;
    for (const [steps, scale] of [
      [0, 1],
      [3, 1],
      [12, 20],
      [40, 1000],
    ] as const) {
      const st = history(randomValues(400, 90 + steps, scale), steps, 7 * steps);
      for (let e = -8; e <= 40; e += 0.5) {
        const c = { ...cfg, lr: 10 ** e };
        for (const limit of [F16_MAX, F32_MAX])
          for (const gScale of [1e-3, 1, 50]) {
            const t = steps + 1;
            const g = randomValues(400, 300 + e * 2, gScale);
            const gradMax = Math.max(...g.map(Math.abs));
            const safe = adamwStepSafe(adamwStateStats(st.master, st.m, st.v, c), c, t, gradMax, limit);
            const flagged = adamwCheckRef(st.master, st.m, st.v, g, c, t, limit);
            assert.ok(!(safe && flagged), `proven safe but the update flags: ${steps} steps, lr ${c.lr}, limit ${limit}, |g| <= ${gradMax}`);
            if (safe) proven++;
            if (flagged) refuted++;
          }
      }
    }
    // Both outcomes occur: the sweep spans the boundary rather than sitting on one side of it.
    assert.ok(proven > 100 && refuted > 100, `${proven} proven, ${refuted} flagged`);
  });

  it('proves normal steps (lr up to 1e-2, weights up to 1000, clipped gradients) and not lr 1e30 or a NaN statistic', () => {
    const st = history(randomValues(400, 5, 1000), 20, 11);
    const stats = adamwStateStats(st.master, st.m, st.v, cfg);
    for (const lr of [5e-6, 1e-4, 1e-2])
      for (const t of [1, 21, 10000]) assert.equal(adamwStepSafe(stats, { ...cfg, lr }, t, 1, F16_MAX), true, `lr ${lr} step ${t}`);
    assert.equal(adamwStepSafe(stats, { ...cfg, lr: 1e30 }, 21, 1, F16_MAX), false);
    assert.equal(adamwStepSafe({ ...stats, maxRatio: NaN }, cfg, 21, 1, F16_MAX), false);
    assert.equal(adamwStepSafe(stats, cfg, 21, Infinity, F32_MAX), false);
    assert.equal(masterLimit('f16'), 65504);
    assert.equal(masterLimit('f32'), F32_MAX);
  });
});

describe('DynamicLossScaler (torch.cuda.amp.GradScaler policy)', () => {
  it('starts at 2^16 with a growth interval of 2000', () => {
    const s = new DynamicLossScaler();
    assert.equal(s.scale, 2 ** 16);
    for (let i = 0; i < 1999; i++) assert.equal(s.update(false), true);
    assert.equal(s.scale, 2 ** 16);
    s.update(false);
    assert.equal(s.scale, 2 ** 17);
  });

  it('halves on overflow, skips the step, doubles after growthInterval good steps', () => {
    const s = new DynamicLossScaler({ growthInterval: 3 });
    assert.equal(s.scale, 65536);
    assert.equal(s.update(true), false);
    assert.equal(s.scale, 32768);
    assert.equal(s.update(false), true);
    assert.equal(s.update(false), true);
    assert.equal(s.scale, 32768);
    assert.equal(s.update(false), true);
    assert.equal(s.scale, 65536);
    assert.equal(s.update(false), true);
    assert.equal(s.update(true), false); // overflow resets the run of good steps
    assert.equal(s.update(false), true);
    assert.equal(s.update(false), true);
    assert.equal(s.scale, 32768);
    assert.deepEqual(s.state(), { scale: 32768, goodSteps: 2, skipped: 2 });
  });

  it('never drops below minScale and round-trips its state', () => {
    const s = new DynamicLossScaler({ initScale: 4, minScale: 1 });
    for (let i = 0; i < 5; i++) s.update(true);
    assert.equal(s.scale, 1);
    const t = new DynamicLossScaler();
    t.restore(s.state());
    assert.deepEqual(t.state(), s.state());
  });
});

for (const dtype of ['f32', 'f16'] as DType[]) {
  describe(`adamw past a small storage binding (bindingLimit 1 KiB) [${dtype}]`, () => {
    it('walks master, moments, gradient and weight copy in windows, views at odd offsets included', async () => {
      const gpu = await testGpu({ bindingLimit: 1024 });
      try {
        // 3000 elements: 16 windows of at most 192 f32. The gradient and the weight copy are views
        // starting 3 elements into their buffers, so their windows start off alignment.
        const n = 3000;
        const init = roundToF16(randomValues(n, 31));
        const wBuf = gpu.zeros([n + 3], dtype);
        const weight = viewOf(wBuf, 3, [n]);
        const p = adamwParam(gpu, weight, init);
        const flag = newFlag(gpu);
        const ref = { master: Float32Array.from(init), m: new Float32Array(n), v: new Float32Array(n) };
        const scale = 512;
        for (let step = 1; step <= 2; step++) {
          const g = roundToF16(randomValues(n + 3, 40 + step, 0.02 * scale));
          const gBuf = gpu.upload(g, [n + 3], dtype);
          const grad = viewOf(gBuf, 3, [n]);
          adamwAll(gpu, [p], [grad], CFG, { step, lossScale: scale, flag, maxNorm: 0.3 });
          const gv = g.subarray(3);
          adamwRef(ref.master, ref.m, ref.v, gv, CFG, step, scale, clipFactorRef(globalNormRef([gv], scale), 0.3));
          gpu.free(gBuf);
        }
        const master = await gpu.read(p.master);
        const whole = await gpu.read(wBuf);
        assertChecks([
          compare(
            'clipping was active',
            [clipFactorRef(globalNormRef([roundToF16(randomValues(n + 3, 42, 0.02 * scale)).subarray(3)], scale), 0.3) < 1 ? 1 : 0],
            [1],
            { atol: 0, rtol: 0 },
          ),
          compare('master vs ts ref', master, ref.master, { atol: 1e-6, rtol: 1e-5 }),
          compare('m vs ts ref', await gpu.read(p.m), ref.m, { atol: 1e-8, rtol: 1e-5 }),
          compare('v vs ts ref', await gpu.read(p.v), ref.v, { atol: 1e-10, rtol: 1e-5 }),
          compare(`weight copy = ${dtype}(master)`, whole.subarray(3), dtype === 'f16' ? roundToF16(master) : master, { atol: 0, rtol: 0 }),
          compare('elements before the view untouched', whole.subarray(0, 3), [0, 0, 0], { atol: 0, rtol: 0 }),
        ]);
      } finally {
        gpu.destroy();
      }
    });
  });
}

for (const dtype of ['f32', 'f16'] as DType[]) {
  describe(`adamw check and stats past a small storage binding (bindingLimit 1 KiB) [${dtype}]`, () => {
    it('the check sees an element in the last window and writes nothing; the stats take the maxima of every window', async () => {
      const gpu = await testGpu({ bindingLimit: 1024 });
      try {
        const n = 3000;
        const cfg: AdamWConfig = { ...CFG, lr: 10, weightDecay: 0 };
        const init = roundToF16(randomValues(n, 33));
        init[2990] = 65500; // pushed past 65504 by a negative gradient at lr 10 (see the self-test case)
        const weight = gpu.upload(init, [n], dtype);
        const p = adamwParam(gpu, weight, init);
        const g = roundToF16(randomValues(n, 34, 0.1));
        g[2990] = -0.05;
        const grad = gpu.upload(g, [n], dtype);
        const flag = newFlag(gpu);
        const updateFlag = newFlag(gpu);
        const before = await Promise.all([p.master, p.m, p.v, weight].map((t) => gpu.read(t)));
        adamwCheck(gpu, p, grad, cfg, { step: 1, lossScale: 1, flag }, updateFlag);
        const want = adamwCheckRef(init, new Float32Array(n), new Float32Array(n), g, cfg, 1, masterLimit(dtype));
        assert.equal(want, dtype === 'f16', 'the reference flags it exactly with an f16 copy');
        assert.equal(await readFlag(gpu, updateFlag), want);
        const after = await Promise.all([p.master, p.m, p.v, weight].map((t) => gpu.read(t)));
        after.forEach((a, i) => assert.deepEqual(a, before[i], 'nothing written'));
        // Stats over windows: the largest |master| sits in the last window, the largest ratio in the first.
        const m = randomValues(n, 35, 1e-3);
        const v = randomValues(n, 36, 1e-6).map(Math.abs);
        v[7] = 0;
        gpu.write(p.m, m);
        gpu.write(p.v, v);
        const out = gpu.zeros([4], 'f32');
        adamwStats(gpu, p, cfg, out);
        const r = adamwStateStats(init, m, v, cfg);
        const got = await gpu.read(out);
        const wantStats = [r.maxAbsMaster, r.maxAbsM, r.maxV, r.maxRatio];
        got.forEach((x, i) => assert.ok(Math.abs(x - wantStats[i]) <= 1e-6 * wantStats[i], `stat ${i}: ${x} vs ${wantStats[i]}`));
        assert.equal(got[0], 65500);
      } finally {
        gpu.destroy();
      }
    });
  });
}
