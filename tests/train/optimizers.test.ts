// Prodigy and Adafactor against PyTorch implementations of prodigyopt's and transformers' step
// (tests/fixtures/train/gen_optimizers.py, golden JSON beside it): parameters after each of 6 steps, Prodigy's d.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { Adafactor, ADAFACTOR_DEFAULTS, type AdafactorConfig } from '../../src/train/adafactor.ts';
import { Prodigy, PRODIGY_DEFAULTS, type ProdigyConfig } from '../../src/train/prodigy.ts';
import { defaultSettings, refuseInactive, SettingsError, trainSettings, validateSettings, type RunSettings } from '../../src/pipeline/settings.ts';
import { MemoryChunkStore } from '../../src/store/chunkstore.ts';
import type { TrainSettings } from '../../src/train/trainer.ts';
import { FIXTURES, testGpu } from '../helpers.ts';
import { makeTrainer } from './tiny-trainer.ts';

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

void describe('Prodigy and Adafactor in a LoRA run (tiny UNet, f32)', () => {
  for (const optimizer of ['prodigy', 'adafactor'] as const)
    void it(`${optimizer}: the weights move, and a run checkpointed at 2, crashed after 3, resumes to 4 bit-identically`, async () => {
      const gpu = await testGpu();
      const steps = 4;
      const over: Partial<TrainSettings> = {
        steps,
        seed: 9,
        optimizer,
        lr: optimizer === 'prodigy' ? 1 : 1e-4,
        lrScheduler: optimizer === 'prodigy' ? 'cosine' : 'constant',
      };
      const a = await makeTrainer(gpu, 'f32', 'lora', new MemoryChunkStore(), over);
      const start = await a.trainer.trainedValues();
      for (let s = 0; s < steps; s++) assert.ok((await a.trainer.trainStep()).applied);
      const want = await a.trainer.trainedValues();
      assert.equal(a.trainer.appliedSteps, steps);
      assert.throws(() => a.trainer.optimizer, /optimizer is .*kept on the host/);
      a.free();
      let moved = 0;
      for (const [n, v] of want) v.forEach((x, i) => (moved = Math.max(moved, Math.abs(x - start.get(n)![i]))));
      // Prodigy's first steps are d0-sized (1e-6 relative); Adafactor's 1e-2 of each parameter's RMS.
      assert.ok(moved > 1e-7, `the weights moved by ${moved}`);
      const store = new MemoryChunkStore();
      const b = await makeTrainer(gpu, 'f32', 'lora', store, over);
      for (let s = 0; s < 2; s++) await b.trainer.trainStep();
      await b.trainer.checkpoint();
      await b.trainer.trainStep();
      b.free();
      const c = await makeTrainer(gpu, 'f32', 'lora', store, over);
      assert.equal(await c.trainer.resume(), true);
      while (c.trainer.step < steps) await c.trainer.trainStep();
      const got = await c.trainer.trainedValues();
      c.free();
      for (const [n, v] of want) assert.deepEqual(got.get(n), v, `${n} differs after resume`);
    });

  void it('the schema: where they apply, refused by name elsewhere; their options reach the trainer', () => {
    const lora = defaultSettings('lora');
    const bad = (over: Partial<RunSettings>, re: RegExp) =>
      assert.throws(
        () => validateSettings({ ...lora, ...over }),
        (e: Error) => e instanceof SettingsError && re.test(e.message),
        JSON.stringify(over),
      );
    bad({ mode: 'full', optimizer: 'prodigy', master: 'fp32' }, /--optimizer prodigy is for LoRA runs: .*17 GB .*AdamW's only/);
    bad({ mode: 'full', optimizer: 'adafactor', master: 'fp32' }, /--optimizer adafactor is for LoRA runs: .*3\.4 GB .*AdamW's only/);
    bad({ optimizer: 'adafactor', master: 'compact' }, /--optimizer adafactor keeps fp32 masters on the host: set --master fp32/);
    bad({ optimizer: 'adafactor', lrScheduler: 'cosine' }, /does not read the learning rate, so --lr-scheduler would do nothing/);
    bad({ optimizer: 'prodigy', trainTextEncoder: true, textEncoderLr: 1e-5 }, /has one step size for every parameter: leave --text-encoder-lr at 0/);
    bad({ optimizer: 'prodigy', prodigyDCoef: 0 }, /--prodigy-d-coef must be from 0.01 to 100/);
    const refused = (over: Partial<RunSettings>, flag: string, re: RegExp) =>
      assert.throws(
        () => refuseInactive({ ...lora, ...over }, (spec) => spec.flag === flag),
        (e: Error) => e instanceof SettingsError && e.message.startsWith(`--${flag} `) && re.test(e.message),
        flag,
      );
    refused({}, 'prodigy-d-coef', /--optimizer prodigy only/);
    refused({ optimizer: 'prodigy' }, 'adafactor-scale-parameter', /--optimizer adafactor only/);
    refused({ optimizer: 'adafactor' }, 'lr', /is not read by --optimizer adafactor with its relative step/);
    refuseInactive({ ...lora, optimizer: 'adafactor', adafactorRelativeStep: 'off' }, (spec) => spec.flag === 'lr');
    const p = trainSettings({ ...lora, optimizer: 'prodigy', lr: 1, prodigyDCoef: 2, prodigySafeguardWarmup: true });
    assert.deepEqual(p.prodigy, { dCoef: 2, d0: 1e-6, safeguardWarmup: true, useBiasCorrection: false });
    const f = trainSettings({ ...lora, optimizer: 'adafactor', adafactorScaleParameter: 'off' });
    assert.deepEqual(f.adafactor, { relativeStep: true, scaleParameter: false, warmupInit: false });
    assert.equal('prodigy' in trainSettings(lora) || 'adafactor' in trainSettings(lora), false);
  });
});
