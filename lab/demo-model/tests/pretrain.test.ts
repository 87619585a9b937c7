// Pretraining the demo model (lab/demo-model/pretrain.ts) at a size lavapipe runs in seconds: both stages learn
// (their losses must fall), a run killed at any checkpoint resumes to exactly the state an uninterrupted run
// reaches (bit-identical weights, EMA and losses, across the stage boundary too), and settings that cannot
// be honoured are refused before any work.
import assert from 'node:assert/strict';
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { describe, it } from 'node:test';
import { ClipTokenizer } from '../../../src/io/tokenizer.ts';
import { loadDiffusers } from '../../../src/models/load.ts';
import { nodeFolder } from '../../../src/models/folder-node.ts';
import { MemoryChunkStore } from '../../../src/store/chunkstore.ts';
import { splitChannels } from '../../../src/ops/elementwise.ts';
import { vaeDecode, vaeEncode } from '../../../src/nn/vae.ts';
import { clipConfigFromJson, clipTextForward } from '../../../src/nn/clip.ts';
import {
  checkPretrainSettings,
  cropPicture,
  pretrainedModelFiles,
  Pretrainer,
  PRETRAIN_DEFAULTS,
  PRETRAIN_SIZES,
  savedPretrainSettings,
  type PretrainSettings,
} from '../pretrain.ts';
import { tinyTokenizer } from '../../../tests/fixtures/models/make-tiny.ts';
import { testGpu } from '../../../tests/helpers.ts';
import { roundToF16 } from '../../../src/util/half.ts';
import { Rng } from '../../../src/util/rng.ts';
import { readSafetensors } from '../../../src/io/safetensors.ts';

/** The SD 1.x layout at toy size: a factor-2 VAE (16 px pictures, 8x8 latents), a two-level UNet. */
const TINY = PRETRAIN_SIZES.tiny;
const tok = tinyTokenizer(1024);
const tokenizer = ClipTokenizer.fromFiles({ vocab: tok.vocab, merges: tok.merges });
const SETTINGS: PretrainSettings = {
  ...PRETRAIN_DEFAULTS,
  resolution: 16,
  dataSize: 64,
  batch: 4,
  vaeSteps: 6,
  vaeLr: 3e-3,
  steps: 6,
  lr: 1e-3,
  emaEvery: 2,
  checkpointEvery: 0,
  // Random crops in stage 1, so a resume must also restore the offsets' Rng draws ('learns' trains on wholes).
  vaeCrop: 8,
};

async function allState(p: Pretrainer) {
  const w = await p.finalWeights();
  const flat = new Map<string, Float32Array>();
  for (const [c, m] of Object.entries(w)) for (const [n, t] of m) flat.set(`${c}/${n}`, t.data as Float32Array);
  return { flat, losses: structuredClone(p.losses), stage: p.stage, step: p.step, scale: p.scalingFactor };
}

describe('pretraining the demo model', () => {
  it('learns: the VAE reconstruction loss and then the noise-prediction loss fall', async () => {
    const gpu = await testGpu();
    const s: PretrainSettings = { ...SETTINGS, vaeSteps: 30, steps: 30, vaeCrop: 0 };
    const p = await Pretrainer.create(gpu, tokenizer, s, new MemoryChunkStore(), 'learn', TINY);
    try {
      const enc0 = await gpu.read(p.weights.vae.get('encoder.conv_in.weight')!);
      while (await p.trainStep());
      const mean = (xs: number[]) => xs.reduce((a, b) => a + b, 0) / xs.length;
      const { vae, unet } = p.losses;
      assert.equal(vae.length, 30);
      assert.equal(unet.length, 30);
      // Reconstruction from random weights starts near the pictures' variance (~0.5); 30 steps of AdamW at 3e-3
      // must bring it well down (to under 0.6 of the start; measured 0.44). A gradient that never reached the encoder (the mean's split) would leave
      // conv_in unchanged, so that is checked too.
      assert.ok(mean(vae.slice(-5)) < 0.6 * mean(vae.slice(0, 5)), `VAE loss ${mean(vae.slice(0, 5))} -> ${mean(vae.slice(-5))}`);
      const enc1 = await gpu.read(p.weights.vae.get('encoder.conv_in.weight')!);
      assert.ok(
        enc1.some((v, i) => v !== enc0[i]),
        'the encoder trained',
      );
      // The noise-prediction loss starts near 1 (unit-variance noise, near-zero predictions) and falls as the
      // UNet learns: at least 20% lower (noisy: batch 4).
      assert.ok(mean(unet.slice(-8)) < 0.8 * mean(unet.slice(0, 8)), `UNet loss ${mean(unet.slice(0, 8))} -> ${mean(unet.slice(-8))}`);
      assert.ok(p.scalingFactor > 0 && Number.isFinite(p.scalingFactor));
      assert.equal(p.stage, 'done');
    } finally {
      p.destroy();
    }
  });

  it('trains the VAE on random crops (vaeCrop) into one that reconstructs whole pictures', async () => {
    const gpu = await testGpu();
    // Half-side crops: the stage sees 8 px squares of the 16 px pictures, a quarter of the pixels per step.
    const s: PretrainSettings = { ...SETTINGS, vaeSteps: 30, steps: 0, vaeCrop: 8 };
    const p = await Pretrainer.create(gpu, tokenizer, s, new MemoryChunkStore(), 'crop', TINY);
    const R = s.resolution;
    const pictures = [0, 1, 2, 3].map((i) => p.picture(i).image);
    // the UNet stage's captions, taken without drawing, are the drawn pictures'
    for (let i = 0; i < 64; i++) assert.equal(p.captionOf(i), p.picture(i).caption, `picture ${i}`);
    // Whole-picture reconstruction error of the VAE as it stands (encode, decode the mean; no tape).
    const wholeMse = async () => {
      let sum = 0;
      for (const img of pictures) {
        const x = gpu.upload(img, [1, 3, R, R], 'f32', 'activations', 'x');
        const moments = vaeEncode(gpu, p.vaeConfig, p.weights.vae, x);
        const mean = splitChannels(gpu, moments, 0, p.vaeConfig.latentChannels);
        const recon = await gpu.read(vaeDecode(gpu, p.vaeConfig, p.weights.vae, mean));
        sum += recon.reduce((a, v, i) => a + (v - img[i]) ** 2, 0) / img.length;
        gpu.free(x, moments, mean);
      }
      return sum / pictures.length;
    };
    try {
      const before = await wholeMse();
      while (await p.trainStep());
      const after = await wholeMse();
      // Measured 0.62 -> 0.20 on whole pictures after 30 crop steps; a stage that ignored the crops' content (or
      // a convolution that only fits crops) would not halve the whole-picture error.
      assert.ok(after < 0.5 * before, `whole-picture reconstruction ${before} -> ${after}`);
    } finally {
      p.destroy();
    }
  });

  it('crops pictures by offset, channel by channel', () => {
    const R = 4;
    const img = Float32Array.from({ length: 3 * R * R }, (_, i) => i);
    // Channel c, row y, column x of the 2 px crop at (1, 2) is pixel (c, y + 2, x + 1) of the picture.
    assert.deepEqual([...cropPicture(img, R, 2, 1, 2)], [9, 10, 13, 14, 25, 26, 29, 30, 41, 42, 45, 46]);
    assert.throws(() => cropPicture(img, R, 2, 3, 0), /does not fit a 4 px picture/);
  });

  it('resumes from a checkpoint in either stage to exactly the uninterrupted run, and ships a folder the loader reads', async () => {
    const gpu = await testGpu();
    const straight = await Pretrainer.create(gpu, tokenizer, SETTINGS, new MemoryChunkStore(), 'a', TINY);
    while (await straight.trainStep());
    const want = await allState(straight);
    // What ships is a diffusers folder the project's own loader reads: EMA UNet weights in f16, the measured scale.
    const dir = mkdtempSync(join(tmpdir(), 'pretrained-'));
    try {
      for (const [path, bytes] of await pretrainedModelFiles(straight, tok)) {
        mkdirSync(dirname(join(dir, path)), { recursive: true });
        writeFileSync(join(dir, path), bytes);
      }
      const model = await loadDiffusers(gpu, nodeFolder(dir), { dtype: 'f32' });
      assert.equal(model.vae.config.scalingFactor, straight.scalingFactor);
      assert.equal(model.prediction, 'v_prediction', "the scheduler config carries the run's prediction type");
      const name = 'conv_in.weight';
      const ema = want.flat.get(`unet/${name}`)!;
      assert.deepEqual(await gpu.read(model.unet.weights.get(name)!), roundToF16(ema));
      assert.notDeepEqual(ema, await gpu.read(straight.weights.unet.get(name)!), 'the EMA, not the last weights, ships');
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
    straight.destroy();
    // Killed after 4 VAE steps (mid stage 1), and after 3 UNet steps (mid stage 2, EMA mid-interval).
    for (const killAt of [4, SETTINGS.vaeSteps + 3]) {
      const store = new MemoryChunkStore();
      const first = await Pretrainer.create(gpu, tokenizer, SETTINGS, store, 'b', TINY);
      for (let i = 0; i < killAt; i++) await first.trainStep();
      await first.checkpoint();
      for (let i = 0; i < 2; i++) await first.trainStep(); // work after the checkpoint is lost with the process
      first.destroy();
      const second = await Pretrainer.create(gpu, tokenizer, SETTINGS, store, 'b', TINY);
      assert.equal(await second.resume(), true);
      while (await second.trainStep());
      const got = await allState(second);
      second.destroy();
      assert.deepEqual(got.losses, want.losses, `losses after a kill at step ${killAt}`);
      assert.equal(got.scale, want.scale);
      for (const [name, v] of want.flat) assert.deepEqual(got.flat.get(name), v, `${name} after a kill at step ${killAt}`);
    }
  });

  it("keeps the UNet stage's EMA (diffusers' warm-up decay, every emaEvery steps) within f32 rounding of an f64 reference", async () => {
    const gpu = await testGpu();
    const s: PretrainSettings = { ...SETTINGS, vaeSteps: 1, steps: 7, emaEvery: 2 };
    const p = await Pretrainer.create(gpu, tokenizer, s, new MemoryChunkStore(), 'e', TINY);
    await p.trainStep(); // the VAE stage
    const trained = (c: 'unet' | 'text_encoder') =>
      [...p.weights[c]].filter(([n]) => !n.endsWith('_embedding.weight')).map(([n, t]) => [`${c}/${n}`, t] as const);
    const weights = [...trained('unet'), ...trained('text_encoder')];
    const ref = new Map<string, Float64Array>();
    for (const [name, t] of weights) ref.set(name, Float64Array.from(await gpu.read(t)));
    let updates = 0;
    for (let step = 1; step <= 5; step++) {
      await p.trainStep();
      if (step % s.emaEvery !== 0) continue;
      const n = updates++ * s.emaEvery;
      const d = Math.min(s.emaDecay, (1 + n) / (10 + n)) ** s.emaEvery; // 0.01, then 0.0625 (updates 1, 2)
      for (const [name, t] of weights) {
        const w = await gpu.read(t);
        const e = ref.get(name)!;
        for (let i = 0; i < e.length; i++) e[i] = d * e[i] + (1 - d) * w[i];
      }
    }
    const shipped = await p.finalWeights();
    let worst = 0;
    let moved = 0;
    for (const [name, t] of weights) {
      const [c, ...rest] = name.split('/');
      const got = shipped[c as 'unet' | 'text_encoder'].get(rest.join('/'))!.data as Float32Array;
      const last = await gpu.read(t);
      const e = ref.get(name)!;
      for (let i = 0; i < e.length; i++) {
        worst = Math.max(worst, Math.abs(got[i] - e[i]) / (Math.abs(e[i]) + 1e-3));
        moved = Math.max(moved, Math.abs(last[i] - e[i]) / (Math.abs(e[i]) + 1e-3));
      }
    }
    p.destroy();
    // Two f32 roundings per update (scale, then add) over 2 updates: a few 1e-7 relative. The last weights sit
    // far from the EMA (step 5 against an average of steps 0-4 at lr 1e-3), so an EMA that was never updated, or
    // whose decay lost its ^emaEvery, misses by orders of magnitude more than the tolerance.
    assert.ok(worst < 2e-6, `EMA vs f64 reference: worst relative error ${worst}`);
    assert.ok(moved > 1e-3, `the last weights differ from the EMA (${moved}), so the comparison can fail`);
  });

  it('writes the model part-way through the UNet stage (pretrain --export) without changing the run', async () => {
    const gpu = await testGpu();
    const straight = await Pretrainer.create(gpu, tokenizer, SETTINGS, new MemoryChunkStore(), 'e1', TINY);
    while (await straight.trainStep());
    const want = await allState(straight);
    straight.destroy();
    const p = await Pretrainer.create(gpu, tokenizer, SETTINGS, new MemoryChunkStore(), 'e2', TINY);
    for (let i = 0; i < SETTINGS.vaeSteps - 1; i++) await p.trainStep();
    // In stage 1 the UNet is untrained: nothing to write, part-way or not.
    await assert.rejects(pretrainedModelFiles(p, tok, { partWay: true }), /pretraining is not finished \(stage vae, step 5\)/);
    for (let i = 0; i < 4; i++) await p.trainStep(); // the last VAE step, then 3 UNet steps
    await assert.rejects(pretrainedModelFiles(p, tok), /pretraining is not finished \(stage unet, step 3\)/, 'only part-way writes accept an unfinished run');
    const files = await pretrainedModelFiles(p, tok, { partWay: true });
    const unet = readSafetensors(files.get('unet/diffusion_pytorch_model.safetensors')!);
    assert.equal(unet.metadata.step, '3');
    assert.equal(unet.metadata.stage, 'unet');
    const name = 'conv_in.weight';
    const now = await allState(p);
    assert.deepEqual(unet.tensors.get(name)!.data, roundToF16(now.flat.get(`unet/${name}`)!), 'the EMA weights of step 3 ship');
    assert.notDeepEqual(now.flat.get(`unet/${name}`), want.flat.get(`unet/${name}`), 'step 3 is not the end of the run');
    // Writing the model touched nothing: the run goes on to exactly the uninterrupted run's end.
    while (await p.trainStep());
    const got = await allState(p);
    p.destroy();
    assert.deepEqual(got.losses, want.losses);
    for (const [n, v] of want.flat) assert.deepEqual(got.flat.get(n), v, n);
  });

  it('starts the UNet stage from a trained VAE (--vae-from): its weights and latent scale, no VAE stage', async () => {
    const gpu = await testGpu();
    const first = await Pretrainer.create(gpu, tokenizer, SETTINGS, new MemoryChunkStore(), 'v1', TINY);
    for (let i = 0; i < SETTINGS.vaeSteps + 1; i++) await first.trainStep();
    const vae = new Map([...(await first.finalWeights()).vae].map(([n, t]) => [n, t.data as Float32Array]));
    const scale = first.scalingFactor;
    first.destroy();
    assert.notEqual(scale, 1, 'stage 1 measured a scale');
    await assert.rejects(
      Pretrainer.create(gpu, tokenizer, SETTINGS, new MemoryChunkStore(), 'v2', TINY, { weights: vae, scalingFactor: scale }),
      /vaeSteps 6: a run that starts from a trained VAE has no VAE stage/,
    );
    const p = await Pretrainer.create(gpu, tokenizer, { ...SETTINGS, vaeSteps: 0 }, new MemoryChunkStore(), 'v3', TINY, { weights: vae, scalingFactor: scale });
    assert.equal(p.stage, 'unet');
    assert.equal(p.scalingFactor, scale);
    for (const [n, t] of p.weights.vae) assert.deepEqual(await gpu.read(t), vae.get(n), n);
    const r = (await p.trainStep())!;
    assert.equal(r.stage, 'unet');
    assert.ok(Number.isFinite(r.loss));
    for (const [n, t] of p.weights.vae) assert.deepEqual(await gpu.read(t), vae.get(n), `${n} stays frozen in the UNet stage`);
    p.destroy();
    const short = new Map([...vae].map(([n, v]) => [n, n === 'encoder.conv_in.weight' ? v.subarray(1) : v]));
    await assert.rejects(
      Pretrainer.create(gpu, tokenizer, { ...SETTINGS, vaeSteps: 0 }, new MemoryChunkStore(), 'v4', TINY, { weights: short, scalingFactor: scale }),
      /the VAE to start from has \d+ values for encoder\.conv_in\.weight, not \d+: it is not this size's VAE/,
    );
  });

  it('goes on training a UNet and text encoder (--init-from): their weights, a lower loss than from scratch, the steps in all', async () => {
    const gpu = await testGpu();
    // A model trained 30 UNet steps, then two new runs on its VAE: one from scratch, one going on from its UNet
    // and text encoder. Both draw the same batches, timesteps and noise (same seed, both start in the UNet stage).
    const first = await Pretrainer.create(gpu, tokenizer, { ...SETTINGS, vaeSteps: 20, vaeCrop: 0, steps: 30 }, new MemoryChunkStore(), 'i1', TINY);
    while (await first.trainStep());
    const trained = await first.finalWeights();
    const scale = first.scalingFactor;
    first.destroy();
    const f32 = (c: 'vae' | 'unet' | 'text_encoder') => new Map([...trained[c]].map(([n, t]) => [n, t.data as Float32Array]));
    const vae = { weights: f32('vae'), scalingFactor: scale };
    const denoiser = { unet: f32('unet'), text_encoder: f32('text_encoder') };
    const s: PretrainSettings = { ...SETTINGS, vaeSteps: 0, steps: 4 };
    const firstLosses = async (from: typeof denoiser | undefined, id: string) => {
      const p = await Pretrainer.create(gpu, tokenizer, { ...s, initSteps: from ? 30 : 0 }, new MemoryChunkStore(), id, TINY, vae, from);
      try {
        if (from)
          for (const c of ['unet', 'text_encoder'] as const)
            for (const [n, t] of p.weights[c]) assert.deepEqual(await gpu.read(t), from[c].get(n), `${c}/${n}`);
        while (await p.trainStep());
        const files = await pretrainedModelFiles(p, tok);
        return { losses: p.losses.unet, meta: readSafetensors(files.get('unet/diffusion_pytorch_model.safetensors')!).metadata };
      } finally {
        p.destroy();
      }
    };
    const scratch = await firstLosses(undefined, 'i2');
    const onward = await firstLosses(denoiser, 'i3');
    const sum = (xs: number[]) => xs.reduce((a, b) => a + b, 0);
    // From scratch the first 4 losses run 1.55 -> 0.91; going on from 30 trained steps, 0.72 -> 0.58 (sums: 0.56x).
    // Paired batches, so the gap is the weights' alone; 0.85 leaves the noise of 4 steps of batch 4 room, and a
    // run that ignored the weights it was given scores 1.
    assert.ok(sum(onward.losses) < 0.85 * sum(scratch.losses), `first 4 UNet losses: going on ${onward.losses}, from scratch ${scratch.losses}`);
    assert.deepEqual([scratch.meta.step, scratch.meta.total_steps], ['4', '4']);
    assert.deepEqual([onward.meta.step, onward.meta.total_steps], ['4', '34'], 'the export counts the steps the model had before');
    await assert.rejects(
      Pretrainer.create(gpu, tokenizer, s, new MemoryChunkStore(), 'i4', TINY, undefined, denoiser),
      /a UNet to go on training needs the VAE it was trained on/,
    );
    const short = { ...denoiser, unet: new Map([...denoiser.unet].map(([n, v]) => [n, n === 'conv_in.weight' ? v.subarray(1) : v])) };
    await assert.rejects(
      Pretrainer.create(gpu, tokenizer, s, new MemoryChunkStore(), 'i5', TINY, vae, short),
      /the UNet to start from has \d+ values for conv_in\.weight, not \d+: it is not this size's UNet/,
    );
  });

  it('tokenStd spreads captions apart in the frozen text encoder (at 0.02 two unrelated captions start half alike)', async () => {
    const gpu = await testGpu();
    const captions = ['a red circle on a blue background', 'two small green striped squares on the left on a dotted white background'];
    const spread = async (tokenStd: number) => {
      // The small size's text encoder (the demo model's: 64 wide, the 49408-token table), untrained.
      const p = await Pretrainer.create(
        gpu,
        tokenizer,
        { ...SETTINGS, resolution: 64, tokenStd },
        new MemoryChunkStore(),
        `t${tokenStd}`,
        PRETRAIN_SIZES.small,
      );
      const ids = new Float32Array(2 * 77);
      captions.forEach((c, b) => ids.set(tokenizer.encodePadded(c), b * 77));
      const cfg = clipConfigFromJson(PRETRAIN_SIZES.small.text_encoder);
      const ctx = await gpu.read(clipTextForward(gpu, cfg, p.weights.text_encoder, ids, 2, null));
      p.destroy();
      // Mean over the caption positions 1..8 of cos(caption 0, caption 1) at the same position.
      const D = cfg.hiddenSize;
      let sum = 0;
      for (let t = 1; t <= 8; t++) {
        const a = ctx.subarray(t * D, (t + 1) * D);
        const b = ctx.subarray((77 + t) * D, (77 + t + 1) * D);
        const dot = a.reduce((acc, v, i) => acc + v * b[i], 0);
        sum += dot / Math.hypot(...a) / Math.hypot(...b);
      }
      return sum / 8;
    };
    const [small, large] = [await spread(0.02), await spread(1)];
    console.log(`mean cosine of two captions' encodings: tokenStd 0.02 ${small.toFixed(3)}, 1 ${large.toFixed(3)}`);
    // Measured: 0.53 at 0.02, 0.12 at 1 (untrained small text encoder, positions 1-8).
    assert.ok(small > 0.4, `at CLIP's 0.02 the encodings start close (${small})`);
    assert.ok(large < 0.25 && large < small - 0.25, `at 1 they start far apart (${large} vs ${small})`);
  });

  it('predicts v by default and eps when asked (the first UNet loss differs); a run saved before its later settings (prediction, tokenStd, initSteps, solidShare, bareShare) resumes as it began', async () => {
    const gpu = await testGpu();
    const firstUnetLoss = async (prediction: PretrainSettings['prediction']) => {
      const p = await Pretrainer.create(gpu, tokenizer, { ...SETTINGS, vaeSteps: 0, prediction }, new MemoryChunkStore(), `p-${prediction}`, TINY);
      const r = (await p.trainStep())!;
      p.destroy();
      return r.loss;
    };
    const [v, eps] = [await firstUnetLoss('v_prediction'), await firstUnetLoss('epsilon')];
    assert.ok(Number.isFinite(v) && Number.isFinite(eps) && Math.abs(v - eps) > 1e-3 * eps, `v loss ${v}, eps loss ${eps}`);
    assert.equal(PRETRAIN_DEFAULTS.prediction, 'v_prediction');
    const { prediction, tokenStd, initSteps, solidShare, bareShare, ...older } = SETTINGS;
    assert.ok(prediction && tokenStd && initSteps === 0 && solidShare === 0.5 && bareShare === null);
    const saved = savedPretrainSettings(older);
    assert.deepEqual(
      { prediction: saved.prediction, tokenStd: saved.tokenStd, initSteps: saved.initSteps, solidShare: saved.solidShare, bareShare: saved.bareShare },
      { prediction: 'epsilon', tokenStd: 0.02, initSteps: 0, solidShare: null, bareShare: null },
      'a run saved before these settings draws its data and trains as it began',
    );
  });

  it('leaves the background out of bareShare of the captions it does not drop; a bareShare of null draws no more than before', async () => {
    const gpu = await testGpu();
    const N = 2000;
    const captions = async (bareShare: number | null) => {
      const p = await Pretrainer.create(
        gpu,
        tokenizer,
        { ...SETTINGS, vaeSteps: 0, dataSize: N, bareShare },
        new MemoryChunkStore(),
        `bare-${bareShare}`,
        TINY,
      );
      const out = Array.from({ length: N }, (_, i) => ({ got: p.trainingCaption(i), whole: p.captionOf(i) }));
      p.destroy();
      return out;
    };
    // bareShare 0.4 with dropCaption 0.1: about 0.1 empty, 0.9 x 0.4 = 0.36 without the background, the rest whole.
    // Over 2000 draws one standard deviation of a share near 0.36 is 0.011: the bounds are about 3 of them.
    const some = await captions(0.4);
    const share = (f: (c: { got: string; whole: string }) => boolean) => some.filter(f).length / N;
    const empty = share((c) => c.got === '');
    const bare = share((c) => c.got !== '' && c.got !== c.whole);
    assert.ok(Math.abs(empty - 0.1) < 0.025, `empty captions ${empty}`);
    assert.ok(Math.abs(bare - 0.36) < 0.035, `captions without their background ${bare}`);
    for (const c of some)
      if (c.got !== '' && c.got !== c.whole) {
        assert.ok(c.whole.startsWith(`${c.got} on a `) && c.whole.endsWith(' background'), `"${c.got}" is "${c.whole}" less its background`);
        assert.doesNotMatch(c.got, /background/);
      }
    // null: every caption whole or dropped, and the run's Rng draws one uniform per caption, as before the setting
    // (so runs saved before it, whose bareShare is null, draw the same batches, noise and timesteps on resume).
    const none = await captions(null);
    const rng = new Rng(SETTINGS.seed);
    for (const c of none) assert.equal(c.got, rng.uniform() < SETTINGS.dropCaption ? '' : c.whole);
  });

  it('lengthens the VAE stage on resume while it runs (as if started that long), and refuses fewer steps or a stage that has ended', async () => {
    const gpu = await testGpu();
    const s: PretrainSettings = { ...SETTINGS, vaeSteps: 5, steps: 2 };
    // The run as if started with 5 VAE steps: the whole VAE stage, then 1 UNet step.
    const whole = await Pretrainer.create(gpu, tokenizer, s, new MemoryChunkStore(), 'v', TINY);
    for (let i = 0; i < 6; i++) await whole.trainStep();
    const want = await allState(whole);
    whole.destroy();
    assert.equal(want.stage, 'unet');
    // Started for 3 VAE steps, stopped after 2, resumed for 5.
    const store = new MemoryChunkStore();
    const short = await Pretrainer.create(gpu, tokenizer, { ...s, vaeSteps: 3 }, store, 'v', TINY);
    for (let i = 0; i < 2; i++) await short.trainStep();
    await short.checkpoint();
    short.destroy();
    const fewer = await Pretrainer.create(gpu, tokenizer, { ...s, vaeSteps: 2 }, store, 'v', TINY);
    await assert.rejects(fewer.resume(), /VAE stage was started for 3 steps: resume with at least that many, not 2/);
    fewer.destroy();
    const longer = await Pretrainer.create(gpu, tokenizer, s, store, 'v', TINY);
    assert.equal(await longer.resume(), true);
    for (let i = 0; i < 4; i++) await longer.trainStep();
    const got = await allState(longer);
    // Bit for bit: the stage ran 5 steps (a stage that ended at the saved 3 would be 2 UNet steps in, step 2).
    assert.equal(got.stage, 'unet');
    assert.equal(got.step, want.step);
    assert.deepEqual(got.losses, want.losses);
    assert.equal(got.scale, want.scale);
    for (const [name, v] of want.flat) assert.deepEqual(got.flat.get(name), v, name);
    // Its VAE stage has ended (the UNet trains on its latents): more VAE steps are refused, naming --vae-from.
    await longer.checkpoint();
    longer.destroy();
    const after = await Pretrainer.create(gpu, tokenizer, { ...s, vaeSteps: 8 }, store, 'v', TINY);
    await assert.rejects(after.resume(), /VAE stage ended at 5 steps \(stage unet\), so it cannot have 8: .*--vae-from/);
    after.destroy();
  });

  it('refuses a resume with other settings, naming the setting', async () => {
    const gpu = await testGpu();
    const store = new MemoryChunkStore();
    const p = await Pretrainer.create(gpu, tokenizer, SETTINGS, store, 'c', TINY);
    await p.trainStep();
    await p.checkpoint();
    p.destroy();
    const q = await Pretrainer.create(gpu, tokenizer, { ...SETTINGS, dataSeed: 2 }, store, 'c', TINY);
    await assert.rejects(q.resume(), /checkpoint was made with dataSeed = 1, not 2/);
    q.destroy();
  });

  it("gives every size's UNet the latents its VAE makes (channels, and side = picture side / VAE factor)", () => {
    for (const [size, cfg] of Object.entries(PRETRAIN_SIZES)) {
      const factor = 2 ** (cfg.vae.block_out_channels.length - 1);
      assert.equal(cfg.unet.sample_size, cfg.vae.sample_size / factor, `${size}: UNet sample_size`);
      assert.equal(cfg.unet.in_channels, cfg.vae.latent_channels, `${size}: UNet in_channels`);
    }
    // The factor-4 size: 64 px pictures to 16x16 latents; the other components are the demo model's.
    const f4 = PRETRAIN_SIZES['small-f4'];
    assert.equal(f4.vae.sample_size / 2 ** (f4.vae.block_out_channels.length - 1), 16);
    assert.deepEqual(f4.unet.block_out_channels, PRETRAIN_SIZES.small.unet.block_out_channels);
    assert.deepEqual(f4.text_encoder, PRETRAIN_SIZES.small.text_encoder);
    checkPretrainSettings({ ...PRETRAIN_DEFAULTS, vaeCrop: 36 }, f4); // a multiple of 4 (not of 8)
    assert.throws(() => checkPretrainSettings({ ...PRETRAIN_DEFAULTS, vaeCrop: 36 }, PRETRAIN_SIZES.small), /vaeCrop 36: .* factor 8/);
  });

  it('refuses settings it cannot honour before any work, naming them', () => {
    const bad: [Partial<PretrainSettings>, RegExp][] = [
      [{ resolution: 60 }, /dataset size 60: use a multiple of 8/],
      [{ dataSeed: -3 }, /dataset seed -3/],
      [{ dataSize: 0 }, /dataset count 0/],
      [{ exclude: ['moon' as 'star'] }, /exclude "moon"/],
      [{ batch: 0 }, /batch 0: use a whole number from 1 to 256/],
      [{ lr: 0 }, /lr 0: use a learning rate between 0 and 1/],
      [{ emaDecay: 1 }, /emaDecay 1/],
      [{ dropCaption: 1 }, /dropCaption 1/],
      [{ steps: 1.5 }, /steps 1\.5/],
      [{ vaeCrop: 12 }, /vaeCrop 12: use 0 \(whole pictures\) or a multiple of the VAE's factor 8/],
      [{ vaeCrop: 72 }, /vaeCrop 72: use a whole number from 0 to 64/],
      [{ solidShare: 2 }, /dataset solidShare 2: use a probability from 0 to 1/],
      [{ initSteps: -1 }, /initSteps -1: use a whole number/],
      [{ bareShare: 1.5 }, /bareShare 1\.5: use a probability from 0 to 1/],
      [{ bareShare: NaN }, /bareShare NaN/],
      // Data that would show the DreamBooth subject's look in pretraining (synthetic.ts dataSceneOptions).
      [{ exclude: [] }, /dataset exclude \[\]: the v1 data holds the subject out by excluding "star"/],
      [{ data: 'stars' }, /dataset exclude \[star\]: the stars data is the one that shows stars/],
      [{ data: 'v2' as 'v1' }, /dataset data "v2": use one of v1, stars/],
    ];
    for (const [change, msg] of bad) assert.throws(() => checkPretrainSettings({ ...PRETRAIN_DEFAULTS, ...change }), msg);
    assert.doesNotThrow(() => checkPretrainSettings(PRETRAIN_DEFAULTS));
    assert.doesNotThrow(() => checkPretrainSettings({ ...PRETRAIN_DEFAULTS, bareShare: 0.3 }));
    assert.doesNotThrow(() => checkPretrainSettings({ ...PRETRAIN_DEFAULTS, data: 'stars', exclude: [] }));
  });
});
