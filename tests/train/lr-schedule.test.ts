// Learning-rate schedules (--lr-scheduler, --lr-warmup, --lr-cycles, --lr-power) against transformers'
// get_scheduler formulas written out in Python (tests/fixtures/train/gen_lr_schedules.py, golden JSON beside
// it) and in the job bundle's ray_train.py, and a run with a decaying schedule interrupted and resumed: bit-identical to the uninterrupted one.
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { kohyaMetadata, type LoraAdapters, type LoraInfo } from '../../src/export/lora.ts';
import { RAY_TRAIN_PY } from '../../src/pipeline/bundle-ray.ts';
import { defaultSettings, SettingsError, trainSettings, validateSettings } from '../../src/pipeline/settings.ts';
import { MemoryChunkStore } from '../../src/store/chunkstore.ts';
import { effectiveScheduler, scheduleFactor, type LrScheduler } from '../../src/train/lr-schedule.ts';
import { lrFactor, type TrainSettings } from '../../src/train/trainer.ts';
import { lrPoints } from '../../src/ui/studio/LrChart.tsx';
import { FIXTURES, testGpu } from '../helpers.ts';
import { makeTrainer } from './tiny-trainer.ts';

interface Case {
  scheduler: LrScheduler;
  warmup: number;
  steps: number;
  lr: number;
  cycles: number;
  power: number;
  factors: number[];
}
const golden = JSON.parse(readFileSync(join(FIXTURES, 'train/lr_schedules.json'), 'utf8')) as { cases: Case[] };

void describe('learning-rate schedules', () => {
  void it("every schedule's factor equals transformers' formula at every step (24 cases, warm-ups 0 to the whole run)", () => {
    assert.equal(golden.cases.length, 24);
    for (const c of golden.cases) {
      // transformers' `constant` ignores a warm-up; ours is then constant_with_warmup (the golden's own case).
      if (c.scheduler === 'constant' && c.warmup > 0) continue;
      c.factors.forEach((want, step) => {
        const got = scheduleFactor({ scheduler: c.scheduler, warmup: c.warmup, steps: c.steps, lr: c.lr, cycles: c.cycles, power: c.power }, step);
        // 1e-14: the same double-precision formula; only libm's cos and pow may differ (by an ulp, 1.1e-16).
        assert.ok(Math.abs(got - want) <= 1e-14, `${c.scheduler} warm-up ${c.warmup} of ${c.steps}, step ${step}: ${got} vs ${want}`);
      });
    }
    // The schedules differ from each other: a wrong formula cannot pass another's golden values.
    const at = (scheduler: LrScheduler) => golden.cases.find((c) => c.scheduler === scheduler && c.warmup === 5)!.factors[12];
    assert.equal(new Set((['cosine', 'cosine_with_restarts', 'linear', 'polynomial'] as const).map(at)).size, 4);
  });

  void it("the studio's rate chart draws the golden rates (every step of a short run, evenly sampled in a long one)", () => {
    // (transformers' plain `constant` ignores a warm-up; a run's constant with one is constant_with_warmup.)
    for (const c of golden.cases.filter((k) => k.warmup < k.steps && !(k.scheduler === 'constant' && k.warmup > 0))) {
      const pts = lrPoints({
        ...defaultSettings('lora'),
        lr: c.lr,
        steps: c.steps,
        lrScheduler: c.scheduler,
        lrWarmup: c.warmup,
        lrCycles: c.cycles,
        lrPower: c.power,
      });
      assert.equal(pts.length, c.steps);
      // The chart multiplies the golden factor by the rate: 1e-12 relative (float64 both).
      pts.forEach(([t, v]) => assert.ok(Math.abs(v - c.lr * c.factors[t]) <= 1e-12 * c.lr, `${c.scheduler} step ${t}: ${v}`));
    }
    const long = lrPoints({ ...defaultSettings('lora'), steps: 100_000, lrScheduler: 'cosine' });
    assert.ok(long.length <= 301 && long[0][0] === 0 && long.at(-1)![0] === 99_999);
  });

  void it("constant with a warm-up is transformers' constant_with_warmup, and says so", () => {
    assert.equal(effectiveScheduler('constant', 3), 'constant_with_warmup');
    assert.equal(effectiveScheduler('constant', 0), 'constant');
    const withWarmup = golden.cases.find((c) => c.scheduler === 'constant_with_warmup' && c.warmup === 5)!;
    withWarmup.factors.forEach((want, step) => assert.equal(scheduleFactor({ ...withWarmup, scheduler: 'constant' }, step), want));
  });

  void it('the schema carries the schedule to the trainer; polynomial below its end rate is refused by name', () => {
    const s = { ...defaultSettings('lora'), lrScheduler: 'cosine_with_restarts' as const, lrCycles: 3, lrWarmup: 2 };
    const t = trainSettings(s);
    assert.deepEqual([t.lrScheduler, t.lrCycles, t.lrWarmup, t.lrPower], ['cosine_with_restarts', 3, 2, 1]);
    assert.equal(lrFactor(t, 1), 0.5);
    assert.throws(
      () => validateSettings({ ...defaultSettings('lora'), lrScheduler: 'polynomial', lr: 1e-8 }),
      (e: Error) => e instanceof SettingsError && /--lr-scheduler polynomial decays to 1e-7: --lr must be above it \(got 1e-8\)/.test(e.message),
    );
    assert.throws(() => validateSettings({ ...defaultSettings('lora'), lrScheduler: 'step' as LrScheduler }), /--lr-scheduler must be constant or/);
  });

  void it('a cosine run with warm-up, checkpointed at step 2 and crashed after 3, resumes to step 5 bit-identically', async () => {
    const gpu = await testGpu();
    const steps = 5;
    const over: Partial<TrainSettings> = { steps, lrScheduler: 'cosine', lrWarmup: 1, seed: 3 };
    const a = await makeTrainer(gpu, 'f32', 'lora', new MemoryChunkStore(), over);
    for (let s = 0; s < steps; s++) await a.trainer.trainStep();
    const want = await a.trainer.trainedValues();
    a.free();
    const store = new MemoryChunkStore();
    const b = await makeTrainer(gpu, 'f32', 'lora', store, over);
    for (let s = 0; s < 2; s++) await b.trainer.trainStep();
    await b.trainer.checkpoint();
    await b.trainer.trainStep();
    b.free();
    const c = await makeTrainer(gpu, 'f32', 'lora', store, over);
    assert.equal(await c.trainer.resume(), true);
    assert.equal(c.trainer.step, 2);
    while (c.trainer.step < steps) await c.trainer.trainStep();
    const got = await c.trainer.trainedValues();
    c.free();
    for (const [name, w] of want) assert.deepEqual(got.get(name), w, `${name} differs after resume`);
  });
});

void describe("the job bundle's ray_train.py", () => {
  void it("lr_factor gives the golden factors too (python3, the script's own function)", () => {
    const start = RAY_TRAIN_PY.indexOf('def lr_factor');
    const fn = RAY_TRAIN_PY.slice(start, RAY_TRAIN_PY.indexOf('def class_items'));
    const cases = golden.cases.filter((c) => !(c.scheduler === 'constant' && c.warmup > 0));
    const py = `import json, math, sys\n${fn}\ncases = json.load(sys.stdin)\nprint(json.dumps([[lr_factor({"lrScheduler": c["scheduler"], "lrWarmup": c["warmup"], "steps": c["steps"], "lr": c["lr"], "lrCycles": c["cycles"], "lrPower": c["power"]}, k) for k in range(len(c["factors"]))] for c in cases]))`;
    const out = JSON.parse(execFileSync('python3', ['-c', py], { input: JSON.stringify(cases), encoding: 'utf8' })) as number[][];
    cases.forEach((c, i) =>
      c.factors.forEach((want, k) => assert.ok(Math.abs(out[i][k] - want) <= 1e-14, `${c.scheduler} step ${k}: ${out[i][k]} vs ${want}`)),
    );
  });
});

void describe('kohya metadata', () => {
  void it('records the schedule as ss_lr_scheduler and ss_lr_warmup_steps (constant + warm-up: constant_with_warmup)', () => {
    const info: LoraInfo = {
      family: 'sd1',
      prediction: 'epsilon',
      resolution: 64,
      steps: 10,
      lr: 1e-4,
      instancePrompt: 'sks',
      numImages: 1,
      baseModelName: 'm',
      title: 't',
      date: new Date(0),
    };
    const adapters: LoraAdapters = { rank: 1, alpha: 1, unet: {} as LoraAdapters['unet'] };
    const md = kohyaMetadata(adapters, { ...info, lrScheduler: effectiveScheduler('constant', 4), lrWarmup: 4 });
    assert.deepEqual([md.ss_lr_scheduler, md.ss_lr_warmup_steps], ['constant_with_warmup', '4']);
    assert.equal(kohyaMetadata(adapters, { ...info, lrScheduler: 'cosine', lrWarmup: 0 }).ss_lr_scheduler, 'cosine');
  });
});
