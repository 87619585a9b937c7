// --lr-warmup N: the learning rate rises linearly from 0 over N steps (transformers' constant schedule with
// warm-up), as the settings schema's entry says and the trainer applies it. AdamW's update is the rate times
// a term the rate does not change (weight decay included), so the same history at two warm-ups must give
// updates in the ratio of their rates.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { defaultSettings, SettingsError, trainSettings, validateSettings } from '../../src/pipeline/settings.ts';
import { MemoryChunkStore } from '../../src/store/chunkstore.ts';
import { lrFactor } from '../../src/train/trainer.ts';
import { testGpu } from '../helpers.ts';
import { makeTrainer } from './tiny-trainer.ts';

/** Sum over every trained value of |after - before|. */
function moved(before: Map<string, Float32Array>, after: Map<string, Float32Array>): number {
  let sum = 0;
  for (const [k, a] of before) {
    const b = after.get(k)!;
    for (let i = 0; i < a.length; i++) sum += Math.abs(b[i] - a[i]);
  }
  return sum;
}

void describe('learning-rate warm-up (--lr-warmup)', () => {
  void it('the factor rises as step / N over the first N updates, then stays 1', () => {
    assert.deepEqual(
      [0, 1, 2, 3, 4, 5, 100].map((k) => lrFactor({ lrWarmup: 4 }, k)),
      [0, 0.25, 0.5, 0.75, 1, 1, 1],
    );
    assert.equal(lrFactor({}, 0), 1, 'no warm-up: the constant rate from the first update');
  });

  void it('the schema carries it to the trainer and refuses a warm-up longer than the run by name', () => {
    assert.equal(trainSettings({ ...defaultSettings('lora'), lrWarmup: 3 }).lrWarmup, 3);
    assert.equal(trainSettings(defaultSettings('full')).lrWarmup, 0);
    assert.throws(
      () => validateSettings({ ...defaultSettings('lora'), steps: 10, lrWarmup: 11 }),
      (e: Error) => e instanceof SettingsError && /--lr-warmup 11 is longer than the run \(--steps 10\)/.test(e.message),
    );
    validateSettings({ ...defaultSettings('lora'), steps: 10, lrWarmup: 10 });
  });

  void it('the first update of a warmed-up run changes nothing; the second moves the weights by the warm-up ratio', async () => {
    const gpu = await testGpu();
    const run = async (lrWarmup: number) => {
      const { trainer, fx, free } = await makeTrainer(gpu, 'f32', 'lora', new MemoryChunkStore(), { lrWarmup });
      const start = await trainer.trainedValues();
      assert.equal((await trainer.trainStep(fx.inputs[0])).applied, true);
      const first = await trainer.trainedValues();
      await trainer.trainStep(fx.inputs[1]);
      const second = await trainer.trainedValues();
      free();
      return { first: moved(start, first), second: moved(first, second) };
    };
    const w2 = await run(2);
    const w4 = await run(4);
    assert.equal(w2.first, 0, 'rate 0 at the first update: every weight bit-identical');
    assert.equal(w4.first, 0);
    // Same history (the first update changed nothing), rates lr/2 and lr/4: the second update's movement is
    // in the ratio 2. Tolerance 1%: f32 rounding of w + dw at |dw| ~ 1e-3 |w| is ~1e-4 relative per value.
    assert.ok(w4.second > 0);
    assert.ok(Math.abs(w2.second / w4.second - 2) < 0.02, `ratio ${w2.second / w4.second}, expected 2`);
  });
});
