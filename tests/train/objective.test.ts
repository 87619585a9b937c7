// The DreamBooth objective pieces against plain-TS references of diffusers' formulas, f32 and f16:
// add_noise and get_velocity with one timestep per sample, min-SNR-gamma and prior weights, the
// weighted MSE and its gradient (also by finite differences).
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { roundToF16 } from '../../src/util/half.ts';
import { alphasCumprod, SD_SCHEDULE } from '../../src/sample/schedulers.ts';
import { compare, randomValues } from '../../src/selftest/check.ts';
import { addNoise, lossWeights, velocity, weightedMse, weightedMseBackward } from '../../src/train/objective.ts';
import { assertChecks, testGpu } from '../helpers.ts';

const acp = alphasCumprod(SD_SCHEDULE);
const shape = [3, 4, 8, 8];
const per = 256;
const x0 = roundToF16(randomValues(3 * per, 1));
const eps = roundToF16(randomValues(3 * per, 2));
const ts = [1, 500, 999];

describe('DreamBooth objective', () => {
  for (const dtype of ['f32', 'f16'] as const)
    it(`noised latents and v targets per sample [${dtype}]`, async () => {
      const gpu = await testGpu();
      const tx = gpu.upload(x0, shape, dtype);
      const te = gpu.upload(eps, shape, dtype);
      const xt = await gpu.read(addNoise(gpu, tx, te, ts, acp));
      const v = await gpu.read(velocity(gpu, tx, te, ts, acp));
      const refX = x0.map((x, i) => Math.sqrt(acp[ts[Math.floor(i / per)]]) * x + Math.sqrt(1 - acp[ts[Math.floor(i / per)]]) * eps[i]);
      const refV = x0.map((x, i) => Math.sqrt(acp[ts[Math.floor(i / per)]]) * eps[i] - Math.sqrt(1 - acp[ts[Math.floor(i / per)]]) * x);
      const tol = dtype === 'f32' ? { atol: 1e-6, rtol: 1e-6 } : { atol: 2e-3, rtol: 2e-3 };
      assertChecks([compare('x_t', xt, refX, tol), compare('v', v, refV, tol)]);
    });

  it('min-SNR-gamma and prior-preservation weights', () => {
    const snr = (t: number) => acp[t] / (1 - acp[t]);
    const w = lossWeights([1, 999], acp, { prediction: 'epsilon', minSnrGamma: 5 });
    assert.ok(Math.abs(w[0] - 5 / snr(1)) < 1e-12, 'high SNR is capped at gamma');
    assert.equal(w[1], 1, 'low SNR keeps weight 1 for epsilon');
    const wv = lossWeights([999], acp, { prediction: 'v_prediction', minSnrGamma: 5 });
    assert.ok(Math.abs(wv[0] - snr(999) / (snr(999) + 1)) < 1e-12);
    assert.deepEqual(lossWeights([10, 10], acp, { prediction: 'epsilon', classWeights: [1, 0.5] }), [1, 0.5]);
  });

  it('weighted MSE, its gradient, and finite differences (f32)', async () => {
    const gpu = await testGpu();
    const weights = [1, 0.5, 2];
    const pred = randomValues(3 * per, 3);
    const target = randomValues(3 * per, 4);
    const tp = gpu.upload(pred, shape, 'f32');
    const tt = gpu.upload(target, shape, 'f32');
    let ref = 0;
    for (let b = 0; b < 3; b++) {
      let s = 0;
      for (let i = 0; i < per; i++) s += (pred[b * per + i] - target[b * per + i]) ** 2;
      ref += (weights[b] * s) / per;
    }
    ref /= 3;
    const loss = await weightedMse(gpu, tp, tt, weights);
    const grad = await gpu.read(weightedMseBackward(gpu, tp, tt, weights, 1024));
    const refGrad = pred.map((p, i) => ((2 * 1024 * weights[Math.floor(i / per)]) / (per * 3)) * (p - target[i]));
    const h = 1e-2;
    const fd: number[] = [];
    const idx = [5, 300, 700];
    for (const i of idx) {
      const plus = pred.slice();
      plus[i] += h;
      const minus = pred.slice();
      minus[i] -= h;
      gpu.write(tp, plus);
      const lp = await weightedMse(gpu, tp, tt, weights);
      gpu.write(tp, minus);
      const lm = await weightedMse(gpu, tp, tt, weights);
      fd.push(((lp - lm) / (2 * h)) * 1024);
    }
    assertChecks([
      compare('loss', [loss], [ref], { atol: 1e-6, rtol: 1e-5 }),
      compare('dpred x scale', grad, refGrad, { atol: 1e-5, rtol: 1e-5 }),
      // quadratic loss: central differences exact up to f32 rounding of the loss (~1e-7 / h, x 1024)
      compare(
        'dpred vs central difference',
        idx.map((i) => grad[i]),
        fd,
        { atol: 5e-2, rtol: 1e-2 },
      ),
    ]);
  });
});
