// The noise, loss and EMA options (--zero-terminal-snr, --multires-noise-*, --ip-noise-gamma, --min/max-timestep,
// --debiased-estimation, --loss huber|smooth_l1 with --huber-delta/--huber-schedule, --ema*) against PyTorch
// references of sd-scripts' and diffusers' formulas (tests/fixtures/train/gen_noise_loss.py, golden JSON beside
// it); the schema refusing them by name; and a LoRA run with an EMA interrupted and resumed bit-identically.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import type { Gpu } from '../../src/gpu/device.ts';
import type { DType } from '../../src/gpu/tensor.ts';
import { defaultSettings, refuseInactive, SettingsError, SETTINGS, trainSettings, validateSettings, type RunSettings } from '../../src/pipeline/settings.ts';
import { MemoryChunkStore } from '../../src/store/chunkstore.ts';
import { processCaption } from '../../src/train/captions.ts';
import { EMA_DEFAULTS, emaDecay, emaUpdate } from '../../src/train/ema.ts';
import { huberCs, robustLoss } from '../../src/train/loss-options.ts';
import { drawStepNoise, pyramidNoise, zeroTerminalSnr } from '../../src/train/noise.ts';
import { lossWeights } from '../../src/train/objective.ts';
import type { TrainSettings } from '../../src/train/trainer.ts';
import { alphasCumprod, SD_SCHEDULE } from '../../src/sample/schedulers.ts';
import { Rng } from '../../src/util/rng.ts';
import { FIXTURES, testGpu } from '../helpers.ts';
import { fixture, makeTrainer } from './tiny-trainer.ts';

const g = JSON.parse(readFileSync(join(FIXTURES, 'train/noise_loss.json'), 'utf8'));
const acp = alphasCumprod(SD_SCHEDULE);
const close = (got: number, want: number, tol: number, what: string) =>
  assert.ok(Math.abs(got - want) <= tol * Math.max(1, Math.abs(want)), `${what}: ${got} vs ${want} (tolerance ${tol})`);

void describe('noise options = PyTorch', () => {
  void it('zero terminal SNR: the rescaled schedule of sd-scripts, its last value exactly 0', () => {
    const z = zeroTerminalSnr(acp);
    const { t, acp: want0, rescaled } = g.zero_terminal_snr as { t: number[]; acp: number[]; rescaled: number[] };
    // Both float64 (the schedule's own products in a different order than torch's linspace): 1e-12 relative.
    t.forEach((ti, i) => close(acp[ti], want0[i], 1e-12, `acp[${ti}]`));
    t.forEach((ti, i) => close(z[ti], rescaled[i], 1e-12, `rescaled acp[${ti}]`));
    assert.equal(z[999], 0);
    // The rescale moves the schedule well beyond the tolerance (acp[999] 0.0047 -> 0; mid-schedule by a few %).
    assert.ok(acp[999] > 4e-3 && Math.abs(z[500] - acp[500]) > 1e-3);
  });

  void it('multires noise: pyramid_noise_like with the same draws (levels stop at 1 pixel), over the std', () => {
    const p = g.pyramid as {
      shape: [number, number, number, number];
      iterations: number;
      discount: number;
      noise: number[];
      uniforms: number[];
      lows: number[][];
      out: number[];
    };
    const noise = Float32Array.from(p.noise);
    let u = 0;
    let level = 0;
    pyramidNoise(noise, p.shape, p.iterations, p.discount, {
      uniform: () => p.uniforms[u++],
      normals: (n) => {
        assert.equal(n, p.lows[level].length, `level ${level}'s field size`);
        return Float32Array.from(p.lows[level++]);
      },
    });
    // Three levels of six: the third reaches 1 pixel (8 / 3.8^2 < 1) and stops the pyramid.
    assert.equal(level, 3);
    // torch computes in float32 (upsample, sums, std): 2e-5 on values of about 1; the pyramid changes them by ~0.3.
    let moved = 0;
    noise.forEach((v, i) => {
      close(v, p.out[i], 2e-5, `pyramid[${i}]`);
      moved = Math.max(moved, Math.abs(v - p.noise[i]));
    });
    assert.ok(moved > 0.1, `the pyramid moved the noise by ${moved}`);
  });

  void it('a step draws as before with the options off; ip noise perturbs the input noise only; timesteps stay in range', () => {
    const shapes: [number, number, number][] = [
      [4, 8, 8],
      [4, 8, 8],
    ];
    const plain = drawStepNoise(new Rng(7), shapes, { offsetNoise: 0 }, 1000);
    const rng = new Rng(7);
    const want = rng.normals(512);
    assert.deepEqual(plain.noise, want);
    assert.deepEqual(plain.timesteps, [rng.int(1000), rng.int(1000)]);
    const ip = drawStepNoise(new Rng(7), shapes, { offsetNoise: 0, ipNoiseGamma: 0.1, minTimestep: 200, maxTimestep: 210 }, 1000);
    assert.deepEqual(ip.noise, plain.noise, 'the target noise is the plain draw');
    const r2 = new Rng(7);
    r2.normals(512);
    const ts = [200 + r2.int(10), 200 + r2.int(10)];
    assert.deepEqual(ip.timesteps, ts);
    const extra = r2.normals(512);
    // inputNoise = noise + 0.1 extra, in f32 (one rounding): 1e-6.
    ip.inputNoise!.forEach((v, i) => close(v, plain.noise[i] + 0.1 * extra[i], 1e-6, `inputNoise[${i}]`));
    for (let k = 0; k < 50; k++) {
      const d = drawStepNoise(new Rng(k), shapes, { offsetNoise: 0, minTimestep: 990, maxTimestep: 1000 }, 1000);
      assert.ok(d.timesteps.every((t) => t >= 990 && t < 1000));
    }
  });
});

void describe('loss options = PyTorch', () => {
  void it('min-SNR and debiased estimation weights (epsilon and v-prediction)', () => {
    const w = g.weights as Record<string, number[]> & { t: number[] };
    for (const prediction of ['epsilon', 'v_prediction'] as const) {
      const d = lossWeights(w.t, acp, { prediction, debiased: true });
      const m = lossWeights(w.t, acp, { prediction, minSnrGamma: 5 });
      // float64 on both sides: 1e-12 relative. Debiased weights span 0.03 (t = 0) to 14 (t = 999).
      w.t.forEach((t, i) => close(d[i], w[`debiased_${prediction}`][i], 1e-12, `debiased ${prediction} t=${t}`));
      w.t.forEach((t, i) => close(m[i], w[`min_snr_5_${prediction}`][i], 1e-12, `min-SNR ${prediction} t=${t}`));
    }
  });

  void it("the Huber parameter per timestep: sd-scripts' snr, exponential and constant schedules", () => {
    const h = g.huber_c as { t: number[]; c: number; snr: number[]; exponential: number[]; constant: number[] };
    for (const s of ['snr', 'exponential', 'constant'] as const) huberCs(h.t, acp, h.c, s).forEach((v, i) => close(v, h[s][i], 1e-12, `${s} t=${h.t[i]}`));
  });

  void it('huber and smooth_l1: loss and gradient with a mask and per-sample weights and c', () => {
    const r = g.robust;
    const [B, C, H, W] = r.shape as number[];
    for (const kind of ['huber', 'smooth_l1'] as const) {
      const got = robustLoss(r.pred, r.target, { batch: B, per: C * H * W, plane: H * W, weights: r.weights, mask: r.mask, kind, cs: r.cs, scale: 1 });
      // float64 sums against float64 autograd; the gradient is stored in f32: 1e-6 relative.
      close(got.loss, r[kind].loss, 1e-12, `${kind} loss`);
      got.grad.forEach((v, i) => close(v, r[kind].grad[i], 1e-6, `${kind} grad[${i}]`));
      // Not the l2 loss: its value differs from mean(m d^2) by far more than the tolerance.
      let l2 = 0;
      for (let b = 0; b < B; b++) {
        let s = 0;
        for (let i = 0; i < C * H * W; i++) s += r.mask[b * H * W + (i % (H * W))] * (r.pred[b * C * H * W + i] - r.target[b * C * H * W + i]) ** 2;
        l2 += (r.weights[b] * s) / (C * H * W);
      }
      assert.ok(Math.abs(l2 / B - got.loss) > 0.05, `${kind} ${got.loss} vs l2 ${l2 / B}`);
    }
    const scaled = robustLoss(r.pred, r.target, {
      batch: B,
      per: C * H * W,
      plane: H * W,
      weights: r.weights,
      mask: r.mask,
      kind: 'huber',
      cs: r.cs,
      scale: 1024,
    });
    scaled.grad.forEach((v, i) => close(v, 1024 * r.huber.grad[i], 1e-6, `scaled grad[${i}]`));
  });
});

void describe("EMA = diffusers' EMAModel", () => {
  void it('decay schedules (with and without warm-up, update_after_step, min decay) and the f32 update, bit for bit', () => {
    for (const c of g.ema as { cfg: Record<string, number | boolean>; params: number[][]; decays: number[]; shadows: number[][] }[]) {
      const s = {
        decay: c.cfg.decay as number,
        minDecay: c.cfg.min_decay as number,
        updateAfterStep: c.cfg.update_after_step as number,
        warmup: c.cfg.use_ema_warmup as boolean,
        invGamma: c.cfg.inv_gamma as number,
        power: c.cfg.power as number,
      };
      const shadow = Float32Array.from(c.params[0]);
      c.decays.forEach((d, i) => {
        assert.equal(emaDecay(s, i + 1), d, `decay of update ${i + 1} (${JSON.stringify(c.cfg)})`);
        emaUpdate(shadow, Float32Array.from(c.params[i + 1]), emaDecay(s, i + 1));
        assert.deepEqual([...shadow], c.shadows[i], `shadow after update ${i + 1}`);
      });
    }
  });
});

void describe('the schema: ranges, combinations and options that would do nothing, refused by name', () => {
  const bad = (over: Partial<RunSettings>, re: RegExp) =>
    assert.throws(
      () => validateSettings({ ...defaultSettings('lora'), ...over }),
      (e: Error) => e instanceof SettingsError && re.test(e.message),
      JSON.stringify(over),
    );
  void it('each range and combination', () => {
    bad({ multiresNoiseIterations: 21 }, /--multires-noise-iterations must be from 0 to 20, got 21/);
    bad({ multiresNoiseDiscount: 1.5 }, /--multires-noise-discount must be from 0 to 1/);
    bad({ ipNoiseGamma: -0.1 }, /--ip-noise-gamma must be from 0 to 1/);
    bad({ maxTimestep: 1001 }, /--max-timestep must be from 1 to 1000/);
    bad({ minTimestep: 500, maxTimestep: 500 }, /--min-timestep 500 must be below --max-timestep 500/);
    bad({ huberC: 0 }, /--huber-delta must be from 0.0001 to 1/);
    bad({ loss: 'l1' as RunSettings['loss'] }, /--loss must be l2 or huber or smooth_l1/);
    bad({ multiresNoiseIterations: 6, offsetNoise: 0.1 }, /--multires-noise-iterations and --offset-noise both reshape the noise/);
    bad({ ema: true, emaDecay: 1 }, /--ema-decay must be from 0 to 0.999999/);
    bad({ ema: true, emaDecay: 0.9, emaMinDecay: 0.95 }, /--ema-min-decay 0.95 is above --ema-decay 0.9/);
    bad({ exportEma: true }, /--export-ema exports the EMA: turn on --ema too/);
    // a full fine-tune keeps its EMA in the chunk store (ema-store.ts): accepted, and it reaches the trainer
    assert.deepEqual(trainSettings({ ...defaultSettings('full'), ema: true, emaDecay: 0.99 }).ema, { ...EMA_DEFAULTS, decay: 0.99 });
  });

  void it('a flag that does nothing as given is refused by its name', () => {
    const refused = (over: Partial<RunSettings>, flag: string, re: RegExp) =>
      assert.throws(
        () => refuseInactive({ ...defaultSettings('lora'), ...over }, (spec) => spec.flag === flag),
        (e: Error) => e instanceof SettingsError && e.message.startsWith(`--${flag} `) && re.test(e.message),
        flag,
      );
    refused({ huberC: 0.2 }, 'huber-delta', /--loss huber or smooth_l1 only/);
    refused({}, 'huber-schedule', /--loss huber or smooth_l1 only/);
    refused({}, 'multires-noise-discount', /add --multires-noise-iterations/);
    refused({}, 'ema-decay', /add --ema/);
    refused({ ema: true }, 'ema-power', /add --ema --ema-warmup/);
    refused({}, 'export-ema', /add --ema/);
    // Given where they act, nothing is refused.
    refuseInactive({ ...defaultSettings('lora'), loss: 'huber', ema: true, emaWarmup: true }, (spec) =>
      ['huber-delta', 'huber-schedule', 'ema-power', 'ema-decay'].includes(spec.flag ?? ''),
    );
  });

  void it('the defaults change nothing the trainer gets; each option reaches it', () => {
    const keys = new Set(SETTINGS.map((s) => s.key));
    for (const k of ['zeroTerminalSnr', 'loss', 'huberC', 'ema', 'exportEma', 'maxTimestep'] as const) assert.ok(keys.has(k), k);
    const t = trainSettings(defaultSettings('lora'));
    for (const k of ['zeroTerminalSnr', 'debiasedEstimation', 'multiresNoiseIterations', 'ipNoiseGamma', 'minTimestep', 'maxTimestep', 'loss', 'huberC', 'ema'])
      assert.equal(k in t, false, k);
    const on = trainSettings({
      ...defaultSettings('lora'),
      zeroTerminalSnr: true,
      debiasedEstimation: true,
      multiresNoiseIterations: 6,
      ipNoiseGamma: 0.1,
      minTimestep: 10,
      maxTimestep: 900,
      loss: 'smooth_l1',
      huberC: 0.2,
      huberSchedule: 'constant',
      ema: true,
      emaWarmup: true,
    });
    assert.deepEqual(
      {
        z: on.zeroTerminalSnr,
        d: on.debiasedEstimation,
        m: [on.multiresNoiseIterations, on.multiresNoiseDiscount],
        ip: on.ipNoiseGamma,
        t: [on.minTimestep, on.maxTimestep],
        l: [on.loss, on.huberC, on.huberSchedule],
        e: on.ema,
      },
      {
        z: true,
        d: true,
        m: [6, 0.3],
        ip: 0.1,
        t: [10, 900],
        l: ['smooth_l1', 0.2, 'constant'],
        e: { decay: 0.9999, minDecay: 0, updateAfterStep: 0, warmup: true, power: 2 / 3, invGamma: 1 },
      },
    );
  });
});

void describe('in the trainer (tiny UNet, LoRA, f32)', () => {
  void it('zero terminal SNR needs a v-prediction model: refused by name for an epsilon one', async () => {
    const gpu = await testGpu();
    await assert.rejects(makeTrainer(gpu, 'f32', 'lora', new MemoryChunkStore(), { zeroTerminalSnr: true }), /needs a v-prediction model.*--zero-terminal-snr/);
  });

  void it('the EMA follows the weights step by step, and a run checkpointed at 2, crashed after 3, resumes to 4 bit-identically', async () => {
    const gpu = await testGpu();
    const steps = 4;
    const ema = { decay: 0.9, minDecay: 0, updateAfterStep: 0, warmup: false, power: 2 / 3, invGamma: 1 };
    const over: Partial<TrainSettings> = {
      steps,
      seed: 5,
      ema,
      loss: 'huber',
      huberC: 0.1,
      ipNoiseGamma: 0.1,
      multiresNoiseIterations: 3,
      debiasedEstimation: true,
    };
    const a = await makeTrainer(gpu, 'f32', 'lora', new MemoryChunkStore(), over);
    const shadow = await a.trainer.trainedValues();
    for (let s = 0; s < steps; s++) {
      const r = await a.trainer.trainStep();
      assert.ok(r.applied && Number.isFinite(r.loss));
      const now = await a.trainer.trainedValues();
      for (const [n, v] of shadow) emaUpdate(v, now.get(n)!, emaDecay(ema, s + 1));
    }
    const want = await a.trainer.trainedValues({ ema: true });
    const raw = await a.trainer.trainedValues();
    // Samples and try-it draw inside withEmaWeights: the model's weights are the EMA's there (f32: exactly),
    // and the trained ones again afterwards.
    const read = async () => new Map(await Promise.all([...a.trainer.trainable].map(async ([n, t]) => [n, await gpu.read(t)] as const)));
    const inside = await a.trainer.withEmaWeights(read);
    const after = await read();
    for (const [n, v] of want) assert.deepEqual(inside.get(n), v, `${n} inside withEmaWeights`);
    for (const [n, v] of raw) assert.deepEqual(after.get(n), v, `${n} after withEmaWeights`);
    a.free();
    let apart = 0;
    for (const [n, v] of want) {
      assert.deepEqual(v, shadow.get(n), `${n}: the trainer's EMA is the step-by-step average`);
      v.forEach((x, i) => (apart = Math.max(apart, Math.abs(x - raw.get(n)![i]))));
    }
    assert.ok(apart > 1e-6, `the EMA differs from the weights (by ${apart})`);
    const store = new MemoryChunkStore();
    const b = await makeTrainer(gpu, 'f32', 'lora', store, over);
    for (let s = 0; s < 2; s++) await b.trainer.trainStep();
    await b.trainer.checkpoint();
    await b.trainer.trainStep();
    b.free();
    const c = await makeTrainer(gpu, 'f32', 'lora', store, over);
    assert.equal(await c.trainer.resume(), true);
    while (c.trainer.step < steps) await c.trainer.trainStep();
    const got = await c.trainer.trainedValues({ ema: true });
    const gotRaw = await c.trainer.trainedValues();
    c.free();
    for (const [n, v] of want) assert.deepEqual(got.get(n), v, `${n}'s EMA differs after resume`);
    for (const [n, v] of raw) assert.deepEqual(gotRaw.get(n), v, `${n} differs after resume`);
  });
});

void describe('the EMA of a full fine-tune (tiny UNet; optimizer chunks streamed, the EMA in the chunk store)', () => {
  const steps = 3;
  const ema = { decay: 0.9, minDecay: 0, updateAfterStep: 0, warmup: true, power: 2 / 3, invGamma: 1 };
  // 4096-element chunks, one resident: the rest stream, so the EMA reads their masters from the store
  const overAll: Partial<TrainSettings> = { steps, seed: 5, ema, lr: 1e-3, residentChunks: 1 };
  const emaKeys = async (store: MemoryChunkStore) => (await store.keys('run/ema/')).map((k) => k.slice('run/ema/'.length));
  const input = fixture('full').inputs[0];
  type Values = Map<string, Float32Array>;

  /** Checkpointed after 1 step, crashed after 2, resumed to `steps`: the EMA and the weights equal the uninterrupted run's. */
  async function crashAndResume(gpu: Gpu, dtype: DType, over: Partial<TrainSettings>, want: Values, raw: Values) {
    const store = new MemoryChunkStore();
    const b = await makeTrainer(gpu, dtype, 'full', store, over);
    const chunks = b.trainer.optimizer.chunks.length;
    await b.trainer.trainStep(input);
    await b.trainer.checkpoint();
    await b.trainer.trainStep(input);
    // the checkpoint's versions stay beside the newer ones until a later checkpoint commits
    const at = (v: number) => Array.from({ length: chunks }, (_, i) => `c${String(i).padStart(5, '0')}-v${v}`);
    assert.deepEqual(await emaKeys(store), [...at(1), ...at(2)].sort());
    b.free();
    const c = await makeTrainer(gpu, dtype, 'full', store, over);
    assert.equal(await c.trainer.resume(), true);
    assert.deepEqual(await emaKeys(store), at(1), "a resume keeps only the checkpoint's versions");
    while (c.trainer.step < steps) await c.trainer.trainStep(input);
    await c.trainer.checkpoint();
    assert.deepEqual(await emaKeys(store), at(steps), "a later checkpoint releases the earlier one's versions");
    const got = await c.trainer.trainedValues({ ema: true });
    const gotRaw = await c.trainer.trainedValues();
    c.free();
    for (const [n, v] of want) assert.deepEqual(got.get(n), v, `${n}'s EMA differs after resume`);
    for (const [n, v] of raw) assert.deepEqual(gotRaw.get(n), v, `${n} differs after resume`);
  }

  void it('f32: the loss falls; the EMA is the step-by-step average, in the store; samples and the export use it; resumes bit-identically', async () => {
    const gpu = await testGpu();
    const store = new MemoryChunkStore();
    const a = await makeTrainer(gpu, 'f32', 'full', store, overAll);
    const chunks = a.trainer.optimizer.chunks.length;
    assert.ok(a.trainer.storedChunks > 0 && chunks > a.trainer.storedChunks, `${a.trainer.storedChunks} of ${chunks} chunks streamed`);
    const shadow = await a.trainer.trainedValues();
    const losses: number[] = [];
    for (let s = 0; s < steps; s++) {
      const r = await a.trainer.trainStep(input);
      assert.ok(r.applied);
      losses.push(r.loss);
      const now = await a.trainer.trainedValues();
      for (const [n, v] of shadow) emaUpdate(v, now.get(n)!, emaDecay(ema, s + 1));
    }
    // the same sample each step: the full fine-tune lowers its loss (2 % is far above f32 noise, ~1e-6)
    assert.ok(losses.at(-1)! < 0.98 * losses[0], `losses ${losses.map((l) => l.toFixed(5)).join(' ')} do not fall by 2%`);
    // one version per chunk in the store, at the update count (the older ones deleted as each was replaced)
    assert.deepEqual(
      await emaKeys(store),
      Array.from({ length: chunks }, (_, i) => `c${String(i).padStart(5, '0')}-v${steps}`),
    );
    const want = await a.trainer.trainedValues({ ema: true });
    const raw = await a.trainer.trainedValues();
    let apart = 0;
    for (const [n, v] of want) {
      assert.deepEqual(v, shadow.get(n), `${n}: the stored EMA is the step-by-step average`);
      v.forEach((x, i) => (apart = Math.max(apart, Math.abs(x - raw.get(n)![i]))));
    }
    assert.ok(apart > 1e-6, `the EMA differs from the weights (by ${apart})`);
    // the full export streams trainedChunks: the EMA's with --export-ema, the masters without
    for (const [o, src] of [[{ ema: true }, want] as const, [{}, raw] as const]) {
      const tc = a.trainer.trainedChunks(o);
      for (const c of tc.chunks) {
        const vals = await tc.chunkMasters(c.index);
        for (const p of c.params) assert.deepEqual(vals.slice(p.offset, p.offset + p.numel), src.get(p.name), `${p.name} exported (${JSON.stringify(o)})`);
      }
    }
    const read = async () => new Map(await Promise.all([...a.trainer.trainable].map(async ([n, t]) => [n, await gpu.read(t)] as const)));
    const inside = await a.trainer.withEmaWeights(read);
    const after = await read();
    a.free();
    for (const [n, v] of want) assert.deepEqual(inside.get(n), v, `${n} inside withEmaWeights`);
    for (const [n, v] of raw) assert.deepEqual(after.get(n), v, `${n} after withEmaWeights`);
    await crashAndResume(gpu, 'f32', overAll, want, raw);
  });

  void it("f16, full fine-tuning's default state (adamw8bit, compact masters rebuilt from the weights): resumes bit-identically", async () => {
    const gpu = await testGpu();
    const over: Partial<TrainSettings> = { ...overAll, optimizer: 'adamw8bit', master: 'compact' };
    const a = await makeTrainer(gpu, 'f16', 'full', new MemoryChunkStore(), over);
    for (let s = 0; s < steps; s++) await a.trainer.trainStep(input);
    const want = await a.trainer.trainedValues({ ema: true });
    const raw = await a.trainer.trainedValues();
    a.free();
    await crashAndResume(gpu, 'f16', over, want, raw);
  });
});

interface CaptionCase {
  caption: string;
  dropout: number;
  shuffle: boolean;
  keepTokens: number;
  uniforms: number[];
  out: string;
}
const captionGolden = JSON.parse(readFileSync(join(FIXTURES, 'train/captions.json'), 'utf8')) as { cases: CaptionCase[] };

void describe('captions: dropout and tag shuffling (--caption-dropout, --shuffle-tags, --keep-tokens)', () => {
  void it("each caption equals sd-scripts' process_caption given the same uniforms, and uses exactly those", () => {
    assert.equal(captionGolden.cases.length, 112);
    let shuffled = 0;
    let dropped = 0;
    for (const c of captionGolden.cases) {
      let used = 0;
      const got = processCaption(c.caption, { dropout: c.dropout, shuffle: c.shuffle, keepTokens: c.keepTokens }, () => c.uniforms[used++]);
      const what = `${JSON.stringify(c.caption)} dropout ${c.dropout} shuffle ${c.shuffle} keep ${c.keepTokens}`;
      assert.equal(got, c.out, what);
      assert.equal(used, c.uniforms.length, `${what}: uniforms drawn`);
      if (c.out === '') dropped++;
      else if (c.out !== c.caption) shuffled++;
    }
    // The golden exercises both effects (a shuffle that kept the order would pass with no shuffle at all).
    assert.ok(dropped >= 10 && shuffled >= 40, `${dropped} dropped, ${shuffled} reordered`);
  });

  void it('ranges, a --keep-tokens without --shuffle-tags refused by name; the defaults give the trainer nothing', () => {
    const bad = (over: Partial<RunSettings>, re: RegExp) =>
      assert.throws(
        () => validateSettings({ ...defaultSettings('lora'), ...over }),
        (e: Error) => e instanceof SettingsError && re.test(e.message),
        JSON.stringify(over),
      );
    bad({ captionDropout: 1 }, /--caption-dropout must be from 0 to 0.99/);
    bad({ keepTokens: -1 }, /--keep-tokens must be from 0 to 75/);
    assert.throws(
      () => refuseInactive({ ...defaultSettings('lora'), keepTokens: 1 }, (spec) => spec.flag === 'keep-tokens'),
      (e: Error) => e instanceof SettingsError && /^--keep-tokens keeps tags in place while they are shuffled: add --shuffle-tags/.test(e.message),
    );
    assert.equal('captions' in trainSettings(defaultSettings('lora')), false);
    assert.deepEqual(trainSettings({ ...defaultSettings('lora'), captionDropout: 0.1 }).captions, { dropout: 0.1, shuffle: false, keepTokens: 0 });
    assert.deepEqual(trainSettings({ ...defaultSettings('full'), shuffleTags: true, keepTokens: 2, captionDropout: 0.05 }).captions, {
      dropout: 0.05,
      shuffle: true,
      keepTokens: 2,
    });
  });

  void it("the trainer draws each step's caption from its Rng (after the noise) and a resumed run draws the same, bit-identically", async () => {
    const gpu = await testGpu();
    const steps = 4;
    const over: Partial<TrainSettings> = { steps, seed: 9, captions: { dropout: 0.3, shuffle: true, keepTokens: 1 } };
    const prompts = ['sks dog, red collar, grass, sunny', 'sks dog, close-up, blurry background, indoors'];
    // The tiny UNet has no text encoder: a stand-in maps each text to a distinct [7, 32] context (so a caption
    // that changes changes the step) and records what the trainer asked for.
    const base = fixture('lora').data.instance[0].context;
    const make = (log: string[]) => ({
      prompts,
      encoder: {
        ids: (t: string) => Int32Array.from(t, (ch) => ch.charCodeAt(0)),
        context: (t: string) => {
          log.push(t);
          let h = 7;
          for (const ch of t) h = Math.imul(h ^ ch.charCodeAt(0), 0x01000193);
          return Promise.resolve(base.map((v, i) => v + 0.5 * Math.sin(h + i)));
        },
      },
    });
    const encoded: string[] = [];
    const a = await makeTrainer(gpu, 'f32', 'lora', new MemoryChunkStore(), over, make(encoded));
    const trained: string[] = [];
    for (let s = 0; s < steps; s++) {
      const inputs = a.trainer.drawInputs();
      trained.push(inputs.caption!);
      await a.trainer.trainStep(inputs);
    }
    const want = await a.trainer.trainedValues();
    a.free();
    // Seed 9 draws a dropped caption and shuffled ones; the first tag always leads a kept caption.
    assert.ok(trained.includes(''), JSON.stringify(trained));
    assert.ok(
      trained.some((t, i) => t !== '' && t !== prompts[i % 2]),
      JSON.stringify(trained),
    );
    for (const t of trained) assert.ok(t === '' || t.startsWith('sks dog, '), t);
    // Each distinct caption is encoded once (the trainer keeps the encodings).
    assert.deepEqual(encoded, [...new Set(trained)]);
    const store = new MemoryChunkStore();
    const b = await makeTrainer(gpu, 'f32', 'lora', store, over, make([]));
    for (let s = 0; s < 2; s++) await b.trainer.trainStep();
    await b.trainer.checkpoint();
    await b.trainer.trainStep();
    b.free();
    const resumed: string[] = [];
    const c = await makeTrainer(gpu, 'f32', 'lora', store, over, make(resumed));
    assert.equal(await c.trainer.resume(), true);
    const after: string[] = [];
    while (c.trainer.step < steps) {
      const inputs = c.trainer.drawInputs();
      after.push(inputs.caption!);
      await c.trainer.trainStep(inputs);
    }
    const got = await c.trainer.trainedValues();
    c.free();
    assert.deepEqual(after, trained.slice(2));
    for (const [n, v] of want) assert.deepEqual(got.get(n), v, `${n} differs after resume`);
    // Without caption processing the photo's cached context trains and nothing more is drawn.
    const d = await makeTrainer(gpu, 'f32', 'lora', new MemoryChunkStore(), { steps, seed: 9 });
    const plain = d.trainer.drawInputs();
    d.free();
    const e = await makeTrainer(gpu, 'f32', 'lora', new MemoryChunkStore(), over, make([]));
    const captioned = e.trainer.drawInputs();
    e.free();
    assert.equal(plain.caption, undefined);
    assert.deepEqual(captioned.noise, plain.noise, 'the noise is drawn first, as before');
  });
});
