// Masked loss in training (issue 15): a photo's loss mask at latent resolution weights its loss per position.
// A mask of ones trains exactly as no mask (the masked gradient multiplies by 1.0); a mask that hides part of
// the photo changes the trained weights well past rounding; masks survive the preprocessing cache; bad masks
// are refused by name.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { MemoryChunkStore } from '../../src/store/chunkstore.ts';
import { loadTrainData, saveTrainData } from '../../src/train/preprocess.ts';
import { DreamBoothTrainer, type TrainData } from '../../src/train/trainer.ts';
import { unetConfigFromJson } from '../../src/nn/unet.ts';
import { SD_SCHEDULE } from '../../src/sample/schedulers.ts';
import { nodeGpu } from '../../src/gpu/node.ts';
import { dryRunPeak } from '../../src/train/plan.ts';
import { testGpu } from '../helpers.ts';
import { base, fixture } from './tiny-trainer.ts';

const cfg = unetConfigFromJson(JSON.parse(base.metadata.config));
const STEPS = 3;
const plane = 8 * 8;
/** The left half of every latent row kept, the right half masked out. */
const leftHalf = Float32Array.from({ length: plane }, (_, i) => (i % 8 < 4 ? 1 : 0));

/** LoRA values after STEPS steps of the reference fixture's inputs, with `masks` on the instance photos. */
async function trainWith(masks: (Float32Array | undefined)[]): Promise<Map<string, Float32Array>> {
  const gpu = await testGpu();
  const fx = fixture('lora');
  const data: TrainData = { ...fx.data, instance: fx.data.instance.map((x, i) => ({ ...x, ...(masks[i] ? { mask: masks[i] } : {}) })) };
  const weights = new Map();
  for (const [k, t] of base.tensors)
    if (!['sample', 'timestep', 'encoder_hidden_states', 'out'].includes(k)) weights.set(k, gpu.upload(t.data, t.shape, 'f32', 'weights', k));
  const model = { config: cfg, weights, schedule: { ...SD_SCHEDULE, prediction: fx.prediction } };
  const trainer = await DreamBoothTrainer.create(gpu, model, data, fx.settings, new MemoryChunkStore(), 'run', fx.init);
  for (const inputs of fx.inputs.slice(0, STEPS)) assert.ok((await trainer.trainStep(inputs)).applied);
  const values = await trainer.trainedValues();
  trainer.destroy();
  for (const w of weights.values()) gpu.free(w);
  return values;
}

function maxDiff(a: Map<string, Float32Array>, b: Map<string, Float32Array>): number {
  let m = 0;
  for (const [k, v] of a) for (let i = 0; i < v.length; i++) m = Math.max(m, Math.abs(v[i] - b.get(k)![i]));
  return m;
}

describe('masked loss in training', () => {
  it('a mask of ones trains bit for bit as no mask; half a mask changes the weights well past rounding', async () => {
    const plain = await trainWith([undefined, undefined]);
    const ones = await trainWith([new Float32Array(plane).fill(1), new Float32Array(plane).fill(1)]);
    assert.equal(maxDiff(plain, ones), 0, 'a mask of ones is no mask');
    const half = await trainWith([leftHalf, undefined]);
    const moved = Math.max(...[...plain.values()].map((v) => Math.max(...v.map(Math.abs))));
    const d = maxDiff(plain, half);
    // Three AdamW steps at lr 1e-3 move LoRA values by ~3e-3; a different loss moves them by a large part of that.
    assert.ok(d > 1e-4 && d > 1e-3 * moved, `masked run differs by ${d} (values up to ${moved})`);
  });

  it("the planner counts the mask: a masked run's dry-run peak = its real peak, to the byte", async () => {
    const fx = fixture('lora');
    const schedule = { ...SD_SCHEDULE, prediction: fx.prediction };
    const settings = { ...fx.settings, activationCheckpointing: false, residentChunks: Infinity };
    const shape = { latentShape: [4, 8, 8] as [number, number, number], contextShape: [7, 32] as [number, number], withClass: true };
    const planned = await dryRunPeak(() => nodeGpu({ dryRun: true }), { config: cfg, dtype: 'f32', schedule }, { ...shape, masked: true }, settings);
    const unmasked = await dryRunPeak(() => nodeGpu({ dryRun: true }), { config: cfg, dtype: 'f32', schedule }, shape, settings);
    const gpu = await nodeGpu();
    try {
      const weights = new Map();
      for (const [k, t] of base.tensors)
        if (!['sample', 'timestep', 'encoder_hidden_states', 'out'].includes(k)) weights.set(k, gpu.upload(t.data, t.shape, 'f32', 'weights', k));
      const data: TrainData = { ...fx.data, instance: fx.data.instance.map((x) => ({ ...x, mask: leftHalf })) };
      const trainer = await DreamBoothTrainer.create(gpu, { config: cfg, weights, schedule }, data, settings, new MemoryChunkStore(), 'run', fx.init);
      let peak = 0;
      for (const inputs of fx.inputs.slice(0, 2)) peak = Math.max(peak, (await trainer.trainStep(inputs)).gpuPeakBytes);
      trainer.destroy();
      assert.equal(planned.peakBytes, peak);
      assert.ok(planned.peakBytes >= unmasked.peakBytes, 'the mask is counted, not dropped');
    } finally {
      gpu.destroy();
    }
  });

  it('masks survive the preprocessing cache', async () => {
    const store = new MemoryChunkStore();
    const fx = fixture('lora');
    const data: TrainData = { ...fx.data, instance: [{ ...fx.data.instance[0], mask: leftHalf }, fx.data.instance[1]] };
    await saveTrainData(store, 'run', data);
    const back = (await loadTrainData(store, 'run'))!;
    assert.deepEqual(back.instance[0].mask, leftHalf);
    assert.equal(back.instance[1].mask, undefined);
  });

  it('a mask of the wrong size or with values outside [0, 1] is refused by name', async () => {
    const gpu = await testGpu();
    const fx = fixture('lora');
    const create = (mask: Float32Array) =>
      DreamBoothTrainer.create(
        gpu,
        { config: cfg, weights: new Map(), schedule: SD_SCHEDULE },
        { ...fx.data, instance: [{ ...fx.data.instance[0], mask }] },
        fx.settings,
        new MemoryChunkStore(),
        'run',
      );
    await assert.rejects(create(new Float32Array(10)), /instance image 0's loss mask has 10 values, expected 8x8/);
    await assert.rejects(create(new Float32Array(plane).fill(2)), /instance image 0's loss mask has values outside \[0, 1\]/);
    await assert.rejects(create(new Float32Array(plane).fill(NaN)), /outside \[0, 1\] \(or non-finite/);
  });
});
