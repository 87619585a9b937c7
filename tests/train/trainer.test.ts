// The trainer under bad conditions: a non-finite loss and an f16 gradient overflow are skipped (weights
// bit-identical, scale lowered, reported); storage filling up mid-run stops the step with StorageFullError,
// the last checkpoint stays intact, and once space is freed the run resumes; no GPU buffer leaks per step;
// bad data and settings are refused with specific messages.
import { chunkedProvider } from '../../src/export/chunked.ts';
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { MemoryChunkStore, StorageFullError } from '../../src/store/chunkstore.ts';
import { testGpu } from '../helpers.ts';
import { fixture, makeTrainer } from './tiny-trainer.ts';

const same = (a: Map<string, Float32Array>, b: Map<string, Float32Array>) => {
  for (const [k, v] of a) assert.deepEqual(b.get(k), v, `${k} changed`);
};

describe('trainer: skipped steps, full storage, leaks, bad input', () => {
  it('a non-finite loss skips the step, lowers the scale and says so; the weights do not change', async () => {
    const gpu = await testGpu();
    const { trainer, fx, free } = await makeTrainer(gpu, 'f16', 'full', new MemoryChunkStore(), { residentChunks: 2 });
    await trainer.trainStep(fx.inputs[0]);
    const before = await trainer.trainedValues();
    const scale = trainer.scaler.scale;
    const noise = fx.inputs[1].noise.slice();
    noise[5] = NaN;
    const r = await trainer.trainStep({ ...fx.inputs[1], noise });
    assert.equal(r.applied, false);
    assert.match(r.skipped ?? '', /non-finite loss/);
    assert.equal(trainer.scaler.scale, scale / 2);
    same(before, await trainer.trainedValues());
    // The run goes on: the next good step applies.
    assert.equal((await trainer.trainStep(fx.inputs[2])).applied, true);
    free();
  });

  it('an f16 gradient overflow skips the update on the GPU (no weight sees inf) and halves the scale', async () => {
    const gpu = await testGpu();
    const { trainer, fx, free } = await makeTrainer(gpu, 'f16', 'lora', new MemoryChunkStore());
    await trainer.trainStep(fx.inputs[0]);
    const before = await trainer.trainedValues();
    trainer.scaler.scale = 2 ** 40; // the scaled gradients overflow f16
    const r = await trainer.trainStep(fx.inputs[1]);
    assert.equal(r.applied, false);
    assert.match(r.skipped ?? '', /inf\/NaN in the gradients/);
    assert.equal(trainer.scaler.scale, 2 ** 39);
    same(before, await trainer.trainedValues());
    free();
  });

  it('storage full mid-run: StorageFullError, the checkpoint intact, resumable once space is freed', async () => {
    const gpu = await testGpu();
    const quota: { quotaBytes?: number } = {};
    const store = new MemoryChunkStore('quota', quota);
    // Full fine-tune with every optimizer chunk streamed through the store.
    const { trainer, fx, free } = await makeTrainer(gpu, 'f32', 'full', store, { residentChunks: 0 });
    await trainer.trainStep(fx.inputs[0]);
    await trainer.checkpoint();
    quota.quotaBytes = await store.bytesUsed(); // the disk is now full
    await assert.rejects(trainer.trainStep(fx.inputs[1]), (e: unknown) => e instanceof StorageFullError && /Storage is full/.test((e as Error).message));
    free();
    // Space freed: a new trainer resumes from the checkpoint and reaches the uninterrupted run's state.
    quota.quotaBytes = undefined;
    const resumed = await makeTrainer(gpu, 'f32', 'full', store, { residentChunks: 0 });
    assert.equal(await resumed.trainer.resume(), true);
    assert.equal(resumed.trainer.step, 1);
    await resumed.trainer.trainStep(fx.inputs[1]);
    const ref = await makeTrainer(gpu, 'f32', 'full', new MemoryChunkStore(), { residentChunks: 0 });
    await ref.trainer.trainStep(fx.inputs[0]);
    await ref.trainer.trainStep(fx.inputs[1]);
    same(await ref.trainer.trainedValues(), await resumed.trainer.trainedValues());
    resumed.free();
    ref.free();
  });

  it('chunkedProvider (export/chunked.ts) over the optimizer streams the same values as trainedValues, chunk by chunk (resident and stored chunks, LRU of 1)', async () => {
    const gpu = await testGpu();
    const { trainer, fx, free } = await makeTrainer(gpu, 'f32', 'full', new MemoryChunkStore(), { residentChunks: 2 });
    await trainer.trainStep(fx.inputs[0]);
    assert.ok(trainer.optimizer.chunks.length > 3 && trainer.optimizer.storedChunks > 0);
    const all = await trainer.trainedValues();
    const p = chunkedProvider(trainer.optimizer, 1);
    // Reverse order: every read misses the one-chunk cache at chunk boundaries and must still be right.
    for (const n of [...p.names()].reverse()) assert.deepEqual(await p.read(n), all.get(n), n);
    assert.deepEqual(p.shape(p.names()[0]), [...trainer.trainable.get(p.names()[0])!.shape]);
    free();
  });

  it('steps leave no GPU buffer behind (checkpointing on, LoRA and full)', async () => {
    const gpu = await testGpu();
    for (const mode of ['lora', 'full'] as const) {
      const { trainer, fx, free } = await makeTrainer(gpu, 'f16', mode, new MemoryChunkStore(), { activationCheckpointing: true, residentChunks: 1 });
      await trainer.trainStep(fx.inputs[0]);
      const after1 = gpu.allocator.report().current;
      for (let s = 1; s < 4; s++) await trainer.trainStep(fx.inputs[s]);
      assert.equal(gpu.allocator.report().current, after1, `${mode}: GPU bytes grow across steps`);
      free();
    }
  });

  it('bad data and settings are refused by name', async () => {
    const gpu = await testGpu();
    const fx = fixture('lora');
    await assert.rejects(makeTrainer(gpu, 'f32', 'lora', new MemoryChunkStore(), { steps: 0 }), /steps must be a positive integer/);
    await assert.rejects(makeTrainer(gpu, 'f32', 'lora', new MemoryChunkStore(), { rank: 0 }), /LoRA rank must be a positive integer/);
    await assert.rejects(makeTrainer(gpu, 'f32', 'lora', new MemoryChunkStore(), { lr: -1 }), /learning rate must be > 0/);
    assert.ok(fx.data.instance.length > 0);
  });
});
