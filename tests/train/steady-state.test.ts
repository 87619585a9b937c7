// A warm training step creates no GPUBuffer and no bind group: tensors come from the allocator's pool, uniforms
// from the ring, read-backs from pooled staging buffers, and the bind groups of the last step are found again
// (the same buffers at the same offsets recur). Without the pool every activation is a new buffer (hundreds per
// step), so a regression shows as a count far above zero.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { MemoryChunkStore } from '../../src/store/chunkstore.ts';
import { testGpu } from '../helpers.ts';
import { makeTrainer } from './tiny-trainer.ts';

// The step replay (src/gpu/replay.ts) makes its uniform buffers and bind groups when it arms, after two identical
// captures of warm steps: steps 2 and 3 where the streamed mode's pool is still filling in step 1.
const WARMUP_STEPS = 4;
const CHECKED_STEPS = 3;

describe('steady state of a training step', () => {
  for (const [mode, over] of [
    ['lora', { activationCheckpointing: false }],
    ['lora', { activationCheckpointing: true }],
    ['full', { activationCheckpointing: true, residentChunks: 1 }], // optimizer chunks streamed through the store
  ] as const)
    it(`${mode}${over.activationCheckpointing ? ' + checkpointing' : ''}${'residentChunks' in over ? ' + streamed chunks' : ''}: no GPUBuffer or bind group created after warm-up`, async () => {
      const gpu = await testGpu();
      const { trainer, fx, free } = await makeTrainer(gpu, 'f16', mode, new MemoryChunkStore(), over);
      const input = (s: number) => fx.inputs[s % fx.inputs.length];
      for (let s = 0; s < WARMUP_STEPS; s++) await trainer.trainStep(input(s));
      const before = gpu.stats;
      const pool0 = { ...gpu.allocator.poolStats };
      let applied = 0;
      for (let s = 0; s < CHECKED_STEPS; s++) if ((await trainer.trainStep(input(WARMUP_STEPS + s))).applied) applied++;
      const after = gpu.stats;
      assert.equal(applied, CHECKED_STEPS, 'the checked steps train');
      assert.ok(after.dispatches - before.dispatches > 100 * CHECKED_STEPS, 'the steps dispatch work');
      assert.ok(gpu.allocator.poolStats.hits - pool0.hits > 100 * CHECKED_STEPS, 'tensors come from the pool');
      assert.equal(after.buffersCreated - before.buffersCreated, 0, `GPUBuffers created in ${CHECKED_STEPS} warm steps`);
      assert.equal(after.bindGroupsCreated - before.bindGroupsCreated, 0, `bind groups created in ${CHECKED_STEPS} warm steps`);
      free();
    });
});
