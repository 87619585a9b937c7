// The DreamBooth objective pieces against plain-TS references of diffusers' formulas, f32 and f16:
// add_noise and get_velocity with one timestep per sample, min-SNR-gamma and prior weights, the
// weighted MSE and its gradient (also by finite differences); the masked loss (sd-scripts' apply_masked_loss)
// against PyTorch (tests/fixtures/train/gen_masked.py).
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { roundToF16 } from '../../src/util/half.ts';
import { alphasCumprod, SD_SCHEDULE } from '../../src/sample/schedulers.ts';
import { compare, randomValues } from '../../src/selftest/check.ts';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { readSafetensors } from '../../src/io/safetensors.ts';
import { addNoise, velocity, weightedMse, weightedMseBackward } from '../../src/ops/loss.ts';
import { latentMask, lossWeights } from '../../src/train/objective.ts';
import { assertChecks, FIXTURES, testGpu } from '../helpers.ts';

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
    const grad = await gpu.read(weightedMseBackward(gpu, tp, tt, weights, null, 1024));
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

  // The masked loss against PyTorch: the instance photo's painted mask (a disc of 1, a grey band of 0.5, 0
  // elsewhere) pooled to latent resolution, the class image unmasked. Inputs are f16-representable, so the f16
  // run sees the same values; its gradient is stored in f16 (rtol 1e-3 > f16's 2^-11 rounding).
  const golden = readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'train', 'masked_loss.safetensors'))));
  const g = (name: string) => golden.tensors.get(name)!;
  for (const dtype of ['f32', 'f16'] as const)
    it(`masked loss and gradient = PyTorch (interpolate "area", loss * mask, plain mean) [${dtype}]`, async () => {
      const gpu = await testGpu();
      const [B, C, h, w] = g('pred').shape;
      const pixels = g('mask').data;
      const plane = pixels.length / B;
      const side = Math.sqrt(plane);
      const perSampleMask = Array.from({ length: B }, (_, b) => latentMask(pixels.subarray(b * plane, (b + 1) * plane), side, side / h));
      const maskData = new Float32Array(B * h * w);
      perSampleMask.forEach((m, b) => maskData.set(m, b * h * w));
      const weights = Array.from(g('weights').data);
      const scale = Number(golden.metadata.scale);
      const tp = gpu.upload(g('pred').data, [B, C, h, w], dtype);
      const tt = gpu.upload(g('target').data, [B, C, h, w], dtype);
      const mask = gpu.upload(maskData, [B, h, w], 'f32');
      const loss = await weightedMse(gpu, tp, tt, weights, mask);
      const grad = await gpu.read(weightedMseBackward(gpu, tp, tt, weights, mask, scale));
      const unmaskedLoss = await weightedMse(gpu, tp, tt, weights);
      const unmaskedGrad = await gpu.read(weightedMseBackward(gpu, tp, tt, weights, null, scale));
      const gradTol = dtype === 'f32' ? { atol: 1e-5, rtol: 1e-5 } : { atol: 1e-3, rtol: 1e-3 };
      assertChecks([
        // sums of 64 values in {0, 0.5, 1} and a division by 64: exact in f32
        compare('mask at latent resolution', maskData, g('mask_latent').data, { atol: 0, rtol: 0 }),
        // f32 squares summed over 256 elements per sample against float64
        compare('masked loss', [loss], g('loss').data, { atol: 1e-6, rtol: 1e-5 }),
        compare('masked dpred x scale', grad, g('grad').data, gradTol),
      ]);
      // The mask does something: the loss drops well past the tolerance, positions the mask zeroes get no
      // gradient at all, the rest does, and the unmasked class sample's gradient is the unmasked one.
      assert.ok(unmaskedLoss - loss > 0.1, `masked ${loss} vs unmasked ${unmaskedLoss}`);
      const per = C * h * w;
      let zeroed = 0;
      for (let i = 0; i < per; i++) {
        const m = maskData[i % (h * w)];
        if (m === 0) {
          assert.ok(grad[i] === 0, `element ${i} under a zero mask: ${grad[i]}`);
          zeroed++;
        } else assert.notEqual(grad[i], 0, `element ${i} under mask ${m}`);
      }
      assert.ok(zeroed > per / 4, `${zeroed} of ${per} instance elements masked out`);
      assert.deepEqual(Array.from(grad.subarray(per)), Array.from(unmaskedGrad.subarray(per)), 'the class sample (mask of ones) is unchanged');
      await assert.rejects(async () => weightedMse(gpu, tp, tt, weights, gpu.upload(maskData.subarray(0, h * w), [1, h, w], 'f32')), /must be f32 \[2, 8, 8\]/);
    });
});
