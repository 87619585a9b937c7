// How many passes over the gradients an optimizer step makes (dispatches per trainable tensor), for resident
// fp32 chunks (LoRA): with clipping, one norm pass (which also detects inf/NaN: the norm is non-finite exactly
// when a gradient is) and the update, the update proven finite from each chunk's state statistics instead of
// a third, element-by-element check pass; without clipping, the inf/NaN pass, the check and the update. Each
// pass is one dispatch per tensor, so a pass that comes back shows as a count `tensors` higher. (That the
// statistics never let a blow-up through is tests/train/nonfinite.test.ts, lr 1e30 with resident chunks.)
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { MemoryChunkStore } from '../../src/store/chunkstore.ts';
import { testGpu } from '../helpers.ts';
import { makeTrainer } from './tiny-trainer.ts';

describe('optimizer passes per step (resident fp32 chunks)', () => {
  for (const [clip, passes] of [
    [true, 2],
    [false, 3],
  ] as const)
    it(`${clip ? 'with' : 'without'} gradient clipping: ${passes} dispatches per trainable tensor, plus a few per chunk`, async () => {
      const gpu = await testGpu();
      const { trainer, fx, free } = await makeTrainer(gpu, 'f32', 'lora', new MemoryChunkStore(), { maxGradNorm: clip ? 1 : 0 });
      const opt = trainer.optimizer;
      const tensors = opt.chunks.reduce((n, c) => n + c.params.length, 0);
      assert.ok(opt.chunks.every((c) => c.resident) && tensors > 20, `${tensors} tensors, all resident`);
      const step = opt.step.bind(opt);
      const counts: number[] = [];
      opt.step = async (grads, scale) => {
        const d0 = gpu.stats.dispatches;
        const r = await step(grads, scale);
        counts.push(gpu.stats.dispatches - d0);
        assert.ok(r.applied, r.skipped ?? '');
        return r;
      };
      for (let s = 0; s < 3; s++) await trainer.trainStep(fx.inputs[s % fx.inputs.length]);
      // "A few per chunk": the norm's final reductions, one statistics reduction per chunk.
      const fixed = 4 * opt.chunks.length + 4;
      for (const n of counts)
        assert.ok(n >= passes * tensors && n <= passes * tensors + fixed, `${n} dispatches for ${tensors} tensors in ${opt.chunks.length} chunks`);
      free();
    });
});
