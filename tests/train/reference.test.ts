// 20 DreamBooth steps of the engine's trainer on the tiny SD1-style UNet against PyTorch (float64, the same
// injected noise and timesteps: tests/fixtures/train/gen_train.py), for LoRA (epsilon) and the full UNet
// (v-prediction, min-SNR-gamma 5, prior weight 0.5); then interruption and resume, bit-identical.
// Tolerances:
//   per-step loss: f32 1e-4 relative (+1e-6); f16 3e-2 relative (f16 activations, loss scale).
//   final weights: |ours - ref| <= tol * max|ref - init| + 1e-7 per tensor, tol f32 2e-2, f16 0.25: Adam's
//   update m / sqrt(v) divides by the gradient's size, so elements whose gradient is near rounding noise
//   can move by up to lr per step in either direction; the bound is against the run's largest change.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { MemoryChunkStore } from '../../src/store/chunkstore.ts';
import type { TrainSettings } from '../../src/train/trainer.ts';
import { testGpu } from '../helpers.ts';
import { base, makeTrainer } from './tiny-trainer.ts';

describe('DreamBooth steps vs PyTorch (tiny UNet, 20 steps, injected noise and timesteps)', () => {
  for (const mode of ['lora', 'full'] as const)
    for (const dtype of ['f32', 'f16'] as const)
      it(`${mode} [${dtype}]: per-step loss and final weights`, async () => {
        const gpu = await testGpu();
        // Half the optimizer chunks resident, half streamed through the store: both paths in one run.
        const store = new MemoryChunkStore();
        const probe = await makeTrainer(gpu, dtype, mode, new MemoryChunkStore());
        const half = Math.ceil(probe.trainer.optimizer.chunks.length / 2);
        probe.free();
        const { trainer, fx, free } = await makeTrainer(gpu, dtype, mode, store, { residentChunks: half });
        assert.ok(trainer.optimizer.storedChunks > 0 && trainer.optimizer.storedChunks < trainer.optimizer.chunks.length, 'some chunks resident, some stored');
        const rtol = dtype === 'f32' ? 1e-4 : 3e-2;
        for (let s = 0; s < fx.inputs.length; s++) {
          const r = await trainer.trainStep(fx.inputs[s]);
          assert.ok(r.applied, `step ${s + 1} applied (${r.skipped ?? ''})`);
          const want = fx.losses[s];
          assert.ok(Math.abs(r.loss - want) <= rtol * Math.abs(want) + 1e-6, `step ${s + 1} loss ${r.loss} vs PyTorch ${want}`);
        }
        const tol = dtype === 'f32' ? 2e-2 : 0.25;
        const trained = await trainer.trainedValues();
        assert.equal(trained.size, fx.finals.size, 'every trainable tensor');
        let worst = 0;
        for (const [name, want] of fx.finals) {
          const got = trained.get(name)!;
          const start = mode === 'lora' ? fx.init.get(name)! : base.tensors.get(name)!.data;
          let moved = 0;
          let err = 0;
          for (let i = 0; i < want.length; i++) {
            moved = Math.max(moved, Math.abs(want[i] - start[i]));
            err = Math.max(err, Math.abs(got[i] - want[i]));
          }
          assert.ok(moved > 0, `${name} moved in the reference`);
          assert.ok(err <= tol * moved + 1e-7, `${name}: max error ${err} vs largest change ${moved}`);
          worst = Math.max(worst, err / moved);
        }
        free();
        console.log(`${mode} ${dtype}: worst final-weight error ${(worst * 100).toFixed(3)}% of the largest change`);
      });
});

describe('resume: an interrupted run reaches bit-identical trainable state', () => {
  for (const mode of ['lora', 'full'] as const)
    it(`${mode} [f16], checkpoint at step 3, crash after step 5, resume to step 8`, async () => {
      const gpu = await testGpu();
      const steps = 8;
      // Uninterrupted reference run (its own store), Rng-drawn inputs with offset noise.
      const over: Partial<TrainSettings> = { residentChunks: 1, offsetNoise: 0.1, seed: 7 };
      const a = await makeTrainer(gpu, 'f16', mode, new MemoryChunkStore(), over);
      for (let s = 0; s < steps; s++) await a.trainer.trainStep();
      const want = await a.trainer.trainedValues();
      a.free();
      // Interrupted: checkpoint at 3, two more steps, then the trainer is dropped (a crash, tab closed).
      const store = new MemoryChunkStore();
      const b = await makeTrainer(gpu, 'f16', mode, store, over);
      for (let s = 0; s < 3; s++) await b.trainer.trainStep();
      await b.trainer.checkpoint();
      for (let s = 0; s < 2; s++) await b.trainer.trainStep();
      b.free();
      // A new process: fresh weights from the model, state from the store's checkpoint.
      const c = await makeTrainer(gpu, 'f16', mode, store, over);
      assert.equal(await c.trainer.resume(), true);
      assert.equal(c.trainer.step, 3);
      while (c.trainer.step < steps) await c.trainer.trainStep();
      const got = await c.trainer.trainedValues();
      for (const [name, w] of want) assert.deepEqual(got.get(name), w, `${name} differs after resume`);
      // The store holds the live chunk versions plus those the checkpoint names (none of the crashed
      // steps' leftovers); a new checkpoint releases the old versions.
      const stored = c.trainer.optimizer.storedChunks;
      assert.ok((await store.keys('run/opt/')).length <= 2 * stored);
      await c.trainer.checkpoint();
      assert.equal((await store.keys('run/opt/')).length, stored);
      c.free();
    });
});
