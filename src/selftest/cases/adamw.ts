// AdamW against torch.optim.AdamW over 4 steps (the last two clipped by clip_grad_norm_), with
// loss-scaled gradients in f16 or f32; skip-on-overflow leaves every buffer bit-identical.
import { roundToF16 } from '../../gpu/half.ts';
import { adamw, adamwParam, adamwRef, type AdamWConfig } from '../../ops/adamw.ts';
import { checkFinite, clearFlag, globalNorm, newFlag, readFlag } from '../../ops/reduce.ts';
import { compare, randomValues, type Check, type KernelCase } from '../check.ts';

export const cases: KernelCase[] = [
  {
    family: 'adamw',
    name: 'AdamW 4 steps vs torch.optim.AdamW (steps 3-4 clipped to norm 0.5), grads x 1024 (golden)',
    async run({ gpu, dtype, golden }) {
      const [lr, beta1, beta2, eps, weightDecay, scale, maxNorm] = golden.get('config').data;
      const cfg: AdamWConfig = { lr, beta1, beta2, eps, weightDecay };
      const p0 = golden.get('p0').data;
      const weight = gpu.upload(p0, [300], dtype, 'weights');
      const param = adamwParam(gpu, weight, p0);
      const flag = newFlag(gpu);
      const ref = { master: Float32Array.from(p0), m: new Float32Array(300), v: new Float32Array(300) };
      const checks: Check[] = [];
      // Master weights, m, v are f32 in both variants; differences are f32 rounding of ~10 ops per step.
      const t = { atol: 1e-6, rtol: 1e-5 };
      for (let step = 1; step <= 4; step++) {
        const gData = golden.get(`grad${step}`).data;
        const grad = gpu.upload(gData, [300], dtype, 'gradients');
        clearFlag(gpu, flag);
        checkFinite(gpu, [grad], flag);
        const norm = step >= 3 ? globalNorm(gpu, [grad], scale) : null;
        adamw(gpu, param, grad, cfg, { step, lossScale: scale, flag, clip: norm ? { norm, maxNorm } : undefined });
        let clipFactor = 1;
        if (norm) {
          const n = (await gpu.read(norm))[0];
          checks.push(compare(`step ${step} norm vs torch`, [n], golden.get(`norm${step}`).data, { atol: 1e-6, rtol: 1e-5 }));
          clipFactor = Math.min(1, maxNorm / (golden.get(`norm${step}`).data[0] + 1e-6));
        }
        adamwRef(ref.master, ref.m, ref.v, gData, cfg, step, scale, clipFactor);
        const master = await gpu.read(param.master);
        checks.push(
          compare(`step ${step} master vs torch`, master, golden.get(`p${step}`).data, t),
          compare(`step ${step} master vs ts ref`, master, ref.master, t),
          compare(`step ${step} exp_avg vs torch`, await gpu.read(param.m), golden.get(`m${step}`).data, t),
          compare(`step ${step} exp_avg_sq vs torch`, await gpu.read(param.v), golden.get(`v${step}`).data, { atol: 1e-9, rtol: 1e-5 }),
          compare(`step ${step} ${dtype} weight = round(master)`, await gpu.read(weight), dtype === 'f16' ? roundToF16(master) : master, { atol: 0, rtol: 0 }),
        );
        gpu.free(grad, norm);
      }
      return checks;
    },
  },
  {
    family: 'adamw',
    name: 'overflow: an inf gradient sets the flag and the step is skipped bit-exactly',
    async run({ gpu, dtype }) {
      const n = 1000;
      const init = roundToF16(randomValues(n, 1));
      const weight = gpu.upload(init, [n], dtype, 'weights');
      const param = adamwParam(gpu, weight, init);
      const flag = newFlag(gpu);
      const cfg: AdamWConfig = { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weightDecay: 0.01 };
      // A first clean step so m and v are non-zero.
      const g1 = gpu.upload(randomValues(n, 2, 100), [n], dtype, 'gradients');
      clearFlag(gpu, flag);
      checkFinite(gpu, [g1], flag);
      adamw(gpu, param, g1, cfg, { step: 1, lossScale: 128, flag });
      const before = await Promise.all([param.master, param.m, param.v, weight].map((t) => gpu.read(t)));
      const bad = randomValues(n, 3, 100);
      bad[777] = Infinity;
      const g2 = gpu.upload(bad, [n], dtype, 'gradients');
      clearFlag(gpu, flag);
      checkFinite(gpu, [g2], flag);
      adamw(gpu, param, g2, cfg, { step: 2, lossScale: 128, flag });
      const after = await Promise.all([param.master, param.m, param.v, weight].map((t) => gpu.read(t)));
      const exact = { atol: 0, rtol: 0 };
      return [
        compare('flag set', [(await readFlag(gpu, flag)) ? 1 : 0], [1], exact),
        compare('master untouched', after[0], before[0], exact),
        compare('m untouched', after[1], before[1], exact),
        compare('v untouched', after[2], before[2], exact),
        compare('weight untouched', after[3], before[3], exact),
        compare('first step did move the weights', [before[0].some((v, i) => v !== init[i]) ? 1 : 0], [1], exact),
      ];
    },
  },
];
