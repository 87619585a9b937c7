// Prodigy and Adafactor against PyTorch implementations of prodigyopt's and transformers' step
// (tests/fixtures/train/gen_optimizers.py, golden JSON beside it): parameters after each of 6 steps, Prodigy's d.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { Adafactor, ADAFACTOR_DEFAULTS, type AdafactorConfig } from '../../src/train/adafactor.ts';
import { Prodigy, PRODIGY_DEFAULTS, type ProdigyConfig } from '../../src/train/prodigy.ts';
import { FIXTURES } from '../helpers.ts';

interface Case {
  optimizer: 'prodigy' | 'adafactor';
  name: string;
  kw: Record<string, number | boolean | number[]>;
  params: number[][][];
  d?: number[];
}
const g = JSON.parse(readFileSync(join(FIXTURES, 'train/optimizers.json'), 'utf8')) as {
  shapes: number[][];
  init: number[][];
  grads: number[][][];
  cases: Case[];
};

function prodigyConfig(kw: Case['kw']): { cfg: ProdigyConfig; lr: number } {
  const betas = (kw.betas as number[] | undefined) ?? [PRODIGY_DEFAULTS.beta1, PRODIGY_DEFAULTS.beta2];
  const cfg: ProdigyConfig = {
    ...PRODIGY_DEFAULTS,
    beta1: betas[0],
    beta2: betas[1],
    weightDecay: (kw.weight_decay as number | undefined) ?? 0,
    useBiasCorrection: kw.use_bias_correction === true,
    safeguardWarmup: kw.safeguard_warmup === true,
    dCoef: (kw.d_coef as number | undefined) ?? 1,
    growthRate: (kw.growth_rate as number | undefined) ?? Infinity,
  };
  return { cfg, lr: kw.lr as number };
}

function adafactorConfig(kw: Case['kw']): { cfg: AdafactorConfig; lr: number } {
  const cfg: AdafactorConfig = {
    ...ADAFACTOR_DEFAULTS,
    relativeStep: kw.relative_step !== false,
    scaleParameter: kw.scale_parameter !== false,
    warmupInit: kw.warmup_init === true,
    beta1: (kw.beta1 as number | undefined) ?? null,
    weightDecay: (kw.weight_decay as number | undefined) ?? 0,
  };
  return { cfg, lr: (kw.lr as number | undefined) ?? NaN };
}

void describe('Prodigy and Adafactor = their reference steps in PyTorch (6 steps, a matrix, a 3-d tensor and a vector)', () => {
  for (const c of g.cases)
    void it(`${c.optimizer}: ${c.name}`, () => {
      const params = g.init.map((p) => Float32Array.from(p));
      const opt = c.optimizer === 'prodigy' ? prodigyConfig(c.kw) : adafactorConfig(c.kw);
      const algo = c.optimizer === 'prodigy' ? new Prodigy(opt.cfg as ProdigyConfig, params) : new Adafactor(opt.cfg as AdafactorConfig, g.shapes);
      let moved = 0;
      for (let s = 0; s < g.grads.length; s++) {
        algo.step(
          params,
          g.grads[s].map((x) => Float32Array.from(x)),
          opt.lr,
        );
        if (c.d) {
          // d is a ratio of f64 sums here and f32 dot products in torch: 1e-5 relative.
          const d = (algo as Prodigy).d;
          assert.ok(Math.abs(d - c.d[s]) <= 1e-5 * c.d[s], `step ${s + 1}: d ${d} vs ${c.d[s]}`);
        }
        params.forEach((p, i) =>
          p.forEach((v, j) => {
            const want = c.params[s][i][j];
            // Both keep f32 parameters, rounded once per step here and two or three times in torch: a few ulp of
            // the larger of the value and where it started (a value that crossed zero keeps the start's rounding).
            const scale = Math.max(Math.abs(want), Math.abs(g.init[i][j]));
            const tol = 4 * 2 ** (Math.floor(Math.log2(scale || 1)) - 23);
            assert.ok(Math.abs(v - want) <= tol, `step ${s + 1}, parameter ${i}[${j}]: ${v} vs ${want} (tolerance ${tol})`);
            if (s === g.grads.length - 1) moved = Math.max(moved, Math.abs(want - g.init[i][j]) / tol);
          }),
        );
      }
      // The run moves the parameters by many times the tolerance (else the comparison proves little).
      assert.ok(moved > 10, `the parameters moved only ${moved} tolerances`);
    });
});
