// Aspect-ratio buckets (issue 15): a non-square photo trains at its own shape (about the square's pixel count,
// sides multiples of the model's factor, as kohya's bucket list) instead of a centre crop. The images: bucket
// choice, the region it is cut from, a rectangular resize. The trainer: a photo at a bucket beside a square class
// image runs one pass per sample, and per-sample passes train as the batched pass does (up to f32 summation
// order); the cache keeps each sample's shape; the planner's dry run of a bucketed run peaks where the real run does.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { nodeGpu } from '../../src/gpu/node.ts';
import { bucketFor, bucketRegion, cropPosition, prepareImage } from '../../src/io/image.ts';
import { unetConfigFromJson } from '../../src/nn/unet.ts';
import { SD_SCHEDULE } from '../../src/sample/schedulers.ts';
import { MemoryChunkStore } from '../../src/store/chunkstore.ts';
import { dryRunPeak } from '../../src/train/plan.ts';
import { loadTrainData, saveTrainData } from '../../src/train/preprocess.ts';
import { DreamBoothTrainer, type TrainData } from '../../src/train/trainer.ts';
import { Rng } from '../../src/util/rng.ts';
import { testGpu } from '../helpers.ts';
import { base, fixture, makeTrainer } from './tiny-trainer.ts';

const cfg = unetConfigFromJson(JSON.parse(base.metadata.config));

describe('aspect-ratio buckets: images', () => {
  it('picks the bucket nearest the photo aspect at about the square area (kohya SD 1.5 buckets at 512 px)', () => {
    assert.deepEqual(bucketFor({ width: 4000, height: 3000 }, 512, 64), { width: 576, height: 448 });
    assert.deepEqual(bucketFor({ width: 3000, height: 4000 }, 512, 64), { width: 448, height: 576 });
    assert.deepEqual(bucketFor({ width: 1920, height: 1080 }, 512, 64), { width: 640, height: 384 });
    assert.deepEqual(bucketFor({ width: 900, height: 900 }, 512, 64), { width: 512, height: 512 });
    // A panorama is held to the widest bucket (2:1 at most); every bucket fits the square's pixel count.
    const wide = bucketFor({ width: 5000, height: 1000 }, 512, 64);
    assert.ok(wide.width / wide.height <= 2 && wide.width * wide.height <= 512 * 512, JSON.stringify(wide));
    for (const b of [wide, bucketFor({ width: 1000, height: 5000 }, 768, 64)]) assert.ok(b.width % 64 === 0 && b.height % 64 === 0);
  });

  it('cuts the largest region of the bucket shape, placed along the slack by the crop slider', () => {
    const r = bucketRegion({ width: 1600, height: 1200 }, { width: 576, height: 448 });
    assert.ok(Math.abs(r.width / r.height - 576 / 448) < 1e-12 && r.height === 1200 && Math.abs(r.x - (1600 - r.width) / 2) < 1e-9);
    assert.equal(bucketRegion({ width: 1600, height: 1200 }, { width: 576, height: 448 }, 0).x, 0);
    assert.equal(cropPosition({ width: 1600, height: 1200 }, { x: 400, y: 0, size: 1200 }), 1);
  });

  it('resizes a region to a rectangular bucket (box filter: 2x2 block means for a factor of 2)', () => {
    const w = 8;
    const h = 4;
    const data = new Uint8ClampedArray(w * h * 4);
    for (let i = 0; i < w * h; i++) data.set([i * 4, 0, 255, 255], i * 4);
    const out = prepareImage(
      { width: w, height: h, data },
      { resolution: 4, bucket: { size: { width: 4, height: 2 }, region: { x: 0, y: 0, width: 8, height: 4 } } },
    );
    assert.equal(out.length, 3 * 4 * 2);
    // R of output (0, 0): the mean of source pixels 0, 1, 8, 9 (R = 4i), scaled to [-1, 1].
    assert.ok(Math.abs(out[0] - ((4 * (0 + 1 + 8 + 9)) / 4 / 127.5 - 1)) < 1e-6, String(out[0]));
    assert.ok(
      out.subarray(16).every((v) => v === 1),
      'B plane is 255 everywhere',
    );
  });
});

describe('aspect-ratio buckets: training', () => {
  it('per-sample passes train as the batched pass does (f32, LoRA, 3 steps: within summation-order rounding)', async () => {
    const gpu = await testGpu();
    const batched = await makeTrainer(gpu, 'f32', 'lora', new MemoryChunkStore());
    const perSample = await makeTrainer(gpu, 'f32', 'lora', new MemoryChunkStore(), { passPerSample: true });
    for (const inputs of batched.fx.inputs.slice(0, 3)) {
      const a = await batched.trainer.trainStep(inputs);
      const b = await perSample.trainer.trainStep(inputs);
      // f32 losses of 256 elements per sample: the same terms, summed in another order at most.
      assert.ok(Math.abs(a.loss - b.loss) <= 1e-6 * Math.abs(a.loss), `loss ${a.loss} vs ${b.loss}`);
    }
    const va = await batched.trainer.trainedValues();
    const vb = await perSample.trainer.trainedValues();
    let diff = 0;
    let size = 0;
    for (const [k, v] of va)
      for (let i = 0; i < v.length; i++) {
        diff = Math.max(diff, Math.abs(v[i] - vb.get(k)![i]));
        size = Math.max(size, Math.abs(v[i]));
      }
    // Gradients differ by f32 rounding (dW summed per pass, then added); Adam's normalised steps of lr 1e-3 keep
    // that near 1e-7 of the values; a wrong weighting of a pass would move them by ~lr.
    assert.ok(diff < 1e-5, `trained values differ by ${diff} (values up to ${size})`);
    // ...but they do differ: the per-sample passes ran (a switch that did nothing would give 0).
    assert.ok(diff > 0, 'per-sample passes sum the gradients in another order, so some value differs in its last bits');
    batched.free();
    perSample.free();
  });

  it('a photo at a bucket beside a square class image: trains, leaves no GPU buffer behind, cache keeps the shape, plan = real peak', async () => {
    const fx = fixture('lora');
    const rng = new Rng(5);
    const bucket: [number, number, number] = [4, 8, 12];
    const data: TrainData = {
      ...fx.data,
      instance: [{ ...fx.data.instance[0], latent: rng.normals(4 * 8 * 12), latentShape: bucket }, fx.data.instance[1]],
    };
    const store = new MemoryChunkStore();
    await saveTrainData(store, 'run', data);
    const back = (await loadTrainData(store, 'run'))!;
    assert.deepEqual(back.instance[0].latentShape, bucket);
    assert.equal(back.instance[1].latentShape, undefined);

    const settings = { ...fx.settings, activationCheckpointing: false, residentChunks: Infinity };
    const schedule = { ...SD_SCHEDULE, prediction: fx.prediction };
    const planned = await dryRunPeak(
      () => nodeGpu({ dryRun: true }),
      { config: cfg, dtype: 'f32', schedule },
      { latentShape: [4, 8, 8], contextShape: [7, 32], withClass: true, instanceShape: bucket },
      settings,
    );
    const gpu = await nodeGpu();
    try {
      const weights = new Map();
      for (const [k, t] of base.tensors)
        if (!['sample', 'timestep', 'encoder_hidden_states', 'out'].includes(k)) weights.set(k, gpu.upload(t.data, t.shape, 'f32', 'weights', k));
      // Every step on the bucketed photo (one instance sample), drawn from the run's Rng (noise sized per sample).
      const only: TrainData = { ...data, instance: [data.instance[0]] };
      const trainer = await DreamBoothTrainer.create(gpu, { config: cfg, weights, schedule }, only, settings, store, 'run', fx.init);
      const first = await trainer.trainStep();
      const after1 = gpu.allocator.report().current;
      let peak = first.gpuPeakBytes;
      for (let s = 0; s < 3; s++) {
        const r = await trainer.trainStep();
        assert.ok(r.applied && Number.isFinite(r.loss), JSON.stringify(r));
        peak = Math.max(peak, r.gpuPeakBytes);
      }
      assert.equal(gpu.allocator.report().current, after1, 'GPU bytes do not grow across steps');
      assert.equal(planned.peakBytes, peak, 'the dry run peaks where the real run does');
      const v = await trainer.validate();
      assert.ok(Number.isFinite(v.instance) && v.class !== null, 'validation runs at the bucket shape too');
      trainer.destroy();
    } finally {
      gpu.destroy();
    }
  });
});
