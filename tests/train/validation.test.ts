// Validation loss (issue 15): fixed noise and timesteps per image, so the numbers are comparable across steps;
// validating does not change training (its noise is not drawn from the run's Rng); the instance loss falls as
// the subject is learnt; checkpoints keep the history and a resumed run continues it.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { MemoryChunkStore } from '../../src/store/chunkstore.ts';
import { testGpu } from '../helpers.ts';
import { makeTrainer } from './tiny-trainer.ts';

describe('validation loss', () => {
  it('is the same at the same weights, and validating changes nothing about training', async () => {
    const gpu = await testGpu();
    const a = await makeTrainer(gpu, 'f32', 'lora', new MemoryChunkStore());
    const b = await makeTrainer(gpu, 'f32', 'lora', new MemoryChunkStore());
    const first = await a.trainer.validate();
    assert.deepEqual(await a.trainer.validate(), first, 'validating twice at step 0');
    assert.equal(a.trainer.validation.length, 1, 'one record per step');
    assert.ok(first.instance > 0 && first.class !== null && first.class > 0, JSON.stringify(first));
    for (let s = 0; s < 3; s++) {
      await a.trainer.trainStep();
      await a.trainer.validate();
      await b.trainer.trainStep();
    }
    const va = await a.trainer.trainedValues();
    const vb = await b.trainer.trainedValues();
    for (const [k, v] of va) assert.deepEqual(v, vb.get(k), k);
    assert.deepEqual(
      a.trainer.validation.map((v) => v.step),
      [0, 1, 2, 3],
    );
    a.free();
    b.free();
  });

  it('the instance loss falls as the subject is learnt (full fine-tune, 12 steps)', async () => {
    const gpu = await testGpu();
    const { trainer, free } = await makeTrainer(gpu, 'f32', 'full', new MemoryChunkStore(), { lr: 1e-3 });
    const before = await trainer.validate();
    for (let s = 0; s < 12; s++) await trainer.trainStep();
    const after = await trainer.validate();
    free();
    assert.ok(after.instance < 0.9 * before.instance, `instance validation loss ${before.instance} -> ${after.instance}`);
  });

  it('a checkpoint keeps the history; a resumed run has it', async () => {
    const gpu = await testGpu();
    const store = new MemoryChunkStore();
    const a = await makeTrainer(gpu, 'f32', 'lora', store);
    await a.trainer.validate();
    await a.trainer.trainStep();
    await a.trainer.validate();
    await a.trainer.checkpoint();
    const history = a.trainer.validation.map((v) => ({ ...v }));
    a.free();
    const b = await makeTrainer(gpu, 'f32', 'lora', store);
    assert.ok(await b.trainer.resume());
    assert.deepEqual(b.trainer.validation, history);
    b.free();
  });
});
