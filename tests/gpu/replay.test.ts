// The recorded step replay (src/gpu/replay.ts): a replayed step equals the live one bit for bit, a per-step value in a
// uniform keeps a step from ever being replayed, a queue write inside a segment refuses the capture, and the tiny
// trainer's steps with replay equal its steps without (losses, weights, optimizer state; f32 and f16), through a
// change of batch shape mid-run; a replay that finds the GPU's state other than its record's mid-step (forward or
// backward) runs that step live and turns itself off, leaving the run bit-identical to one without replay.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import type { Allocation } from '../../src/gpu/allocator.ts';
import type { Gpu } from '../../src/gpu/device.ts';
import { StepReplay, StepRun } from '../../src/gpu/replay.ts';
import type { Tensor } from '../../src/gpu/tensor.ts';
import { add, scale } from '../../src/ops/elementwise.ts';
import { MemoryChunkStore } from '../../src/store/chunkstore.ts';
import type { StepInputs } from '../../src/train/trainer.ts';
import { testGpu } from '../helpers.ts';
import { makeTrainer } from '../train/tiny-trainer.ts';

/**
 * `steps` steps of y = f(k) x_k + w (forward), g = dy_k + y (backward) through one StepReplay, with x_k and dy_k
 * uploaded per step (inputs) and w made before; returns g per step and the replay's stats.
 */
async function toySteps(gpu: Gpu, steps: number, factor: (k: number) => number, writeInside = false) {
  const replay = new StepReplay(gpu);
  const w = gpu.upload([0.5, -1, 2, 4], [4], 'f32', 'weights', 'w');
  const out: Float32Array[] = [];
  for (let k = 0; k < steps; k++) {
    const x = gpu.upload([k, k + 1, -k, 3], [4], 'f32', 'activations', 'x');
    const run = replay.begin('toy');
    const y = run.forward([x], () => {
      const a = scale(gpu, x, factor(k));
      if (writeInside) gpu.write(a, [1, 1, 1, 1]);
      const b = add(gpu, a, w);
      gpu.free(a);
      return b;
    });
    const dy = gpu.upload([1, 2, 3, 4 + k], [4], 'f32', 'gradients', 'dy');
    const grads = new Map<Tensor, Tensor>();
    run.backward(grads, [dy], () => {
      grads.set(w, add(gpu, dy, y));
      gpu.free(y, dy);
    });
    out.push(await gpu.read(grads.get(w)!));
    gpu.free(grads.get(w)!, x);
  }
  gpu.free(w);
  return { out, stats: replay.stats };
}

/** What toySteps computes, on the host (f32 products and sums of small integers and halves: exact). */
function toyWant(k: number, f: number): number[] {
  const x = [k, k + 1, -k, 3];
  const w = [0.5, -1, 2, 4];
  const dy = [1, 2, 3, 4 + k];
  return x.map((v, i) => dy[i] + (f * v + w[i]));
}

describe('step replay', () => {
  it('replays a constant step after two identical captures, reading each step’s new inputs', async () => {
    const gpu = await testGpu();
    const { out, stats } = await toySteps(gpu, 6, () => 2);
    // step 0 creates buffers (not captured), 1 and 2 are captured and equal, 3..5 replay
    assert.equal(stats.replayed, 3, `replayed steps (${stats.lastRefusal})`);
    out.forEach((g, k) => assert.deepEqual([...g], toyWant(k, 2), `step ${k}`)); // exact: integer and half arithmetic
  });

  it('never replays a step whose uniforms change per step, and says so', async () => {
    const gpu = await testGpu();
    const { out, stats } = await toySteps(gpu, 5, (k) => k + 1);
    assert.equal(stats.replayed, 0);
    assert.match(stats.lastRefusal, /changes its uniforms/);
    out.forEach((g, k) => assert.deepEqual([...g], toyWant(k, k + 1), `step ${k}`));
  });

  it('refuses to capture a segment that writes through the queue', async () => {
    const gpu = await testGpu();
    const { out, stats } = await toySteps(gpu, 4, () => 2, true);
    assert.equal(stats.replayed, 0);
    assert.match(stats.lastRefusal, /queue write/);
    out.forEach((g, k) =>
      assert.deepEqual(
        [...g],
        [1, 2, 3, 4 + k].map((d, i) => d + 1 + [0.5, -1, 2, 4][i]),
        `step ${k}`,
      ),
    );
  });

  const cases = [
    { dtype: 'f32', mode: 'lora', over: { activationCheckpointing: true }, steps: 4, name: 'LoRA + checkpointing' },
    { dtype: 'f16', mode: 'lora', over: {}, steps: 4, name: 'LoRA, through a change of batch shape', reshape: true },
    { dtype: 'f16', mode: 'full', over: {}, steps: 4, name: 'full fine-tune' },
  ] as const;
  for (const c of cases)
    it(`tiny trainer ${c.dtype} ${c.name}: replayed steps equal live ones bit for bit`, async () => {
      const gpu = await testGpu();
      const runs: { losses: number[]; replayed: number; weights: Float32Array[]; state: Uint8Array[] }[] = [];
      for (const replay of [true, false]) {
        const store = new MemoryChunkStore();
        const { trainer, fx, free } = await makeTrainer(gpu, c.dtype, c.mode, store, c.over);
        trainer.stepReplay = replay;
        // 4 steps: 0 fills the pool, 1 and 2 are captured alike, 3 replays. With `reshape`, 4 more steps of the instance
        // alone (another batch shape: a new structure, run live, captured twice, then replayed at step 7).
        const steps: StepInputs[] = fx.inputs.slice(0, c.steps);
        if ('reshape' in c)
          for (let k = 4; k < 8; k++) {
            const s = fx.inputs[k % fx.inputs.length];
            steps.push({ ...s, classIndex: null, timesteps: s.timesteps.slice(0, 1) });
          }
        const losses: number[] = [];
        for (const s of steps) losses.push((await trainer.trainStep(s)).loss);
        const weights = await Promise.all([...trainer.trainable.values()].map((t) => gpu.read(t)));
        // resident chunks' masters and moments, and every chunk version the store holds (streamed chunks')
        const state = [...(await trainer.optimizer.checkpointState()).files.values()];
        for (const key of (await store.keys()).sort()) state.push((await store.read(key))!);
        runs.push({ losses, replayed: trainer.replayStats!.replayed, weights, state });
        free();
      }
      const [on, off] = runs;
      assert.equal(on.replayed, 'reshape' in c ? 2 : 1, 'step 3 (and 7 after the shape change) replays');
      assert.equal(off.replayed, 0);
      // The inputs differ per step (timesteps, noise, samples): a replay that reused the captured step's would repeat its loss.
      assert.equal(new Set(on.losses).size, on.losses.length, `losses differ across steps: ${on.losses.join(', ')}`);
      on.losses.forEach((l, i) => assert.ok(Object.is(l, off.losses[i]), `step ${i} loss ${l} vs ${off.losses[i]}`));
      on.weights.forEach((w, i) => assert.deepEqual(w, off.weights[i], `trainable ${i}`));
      assert.equal(on.state.length, off.state.length);
      on.state.forEach((s, i) => assert.ok(Buffer.from(s).equals(Buffer.from(off.state[i])), `optimizer state file ${i}`));
    });

  it('a replay that meets another GPU state mid-step runs the step live, turns itself off and changes nothing', async () => {
    const gpu = await testGpu();
    const { forward, backward } = StepRun.prototype;
    type Run = { losses: number[]; warnings: (string | undefined)[]; weights: Float32Array[]; state: Uint8Array[]; rng: number; mem: number[] };
    const go = async (inject: 'none' | 'forward' | 'backward'): Promise<Run & { replay: boolean; replayed: number[] }> => {
      const store = new MemoryChunkStore();
      const { trainer, free } = await makeTrainer(gpu, 'f32', 'lora', store);
      trainer.stepReplay = inject !== 'none';
      const outside: Allocation[] = [];
      // Step index 3 replays (0 fills the pool, 1 and 2 are captured alike). 'backward': a buffer made and freed
      // between its forward and backward puts one more idle buffer in the pool; 'forward': the forward's first
      // allocation finds its recorded buffer taken by someone else.
      StepRun.prototype.backward = function (this: StepRun, ...a: Parameters<StepRun['backward']>) {
        if (inject === 'backward' && trainer.step === 3 && !outside.length) {
          outside.push(gpu.allocator.alloc(3 << 20, 'activations', 'outside'));
          gpu.allocator.free(outside[0]);
        }
        return backward.apply(this, a);
      };
      StepRun.prototype.forward = function (this: StepRun, ...a: Parameters<StepRun['forward']>) {
        const alloc = gpu.allocator.alloc;
        if (inject === 'forward' && trainer.step === 3 && !outside.length)
          gpu.allocator.alloc = (...b) => {
            gpu.allocator.alloc = alloc;
            outside.push(alloc.apply(gpu.allocator, b));
            return alloc.apply(gpu.allocator, b);
          };
        try {
          return forward.apply(this, a);
        } finally {
          gpu.allocator.alloc = alloc;
        }
      };
      const losses: number[] = [];
      const warnings: (string | undefined)[] = [];
      const replayed: number[] = [];
      try {
        // inputs drawn from the run's Rng: the step run again must not draw them again
        for (let k = 0; k < 5; k++) {
          if (k === 3) replayed.push(trainer.replayStats!.replayed);
          const r = await trainer.trainStep();
          losses.push(r.loss);
          warnings.push(r.warning);
          if (k === 3) outside.forEach((o) => gpu.allocator.free(o));
        }
      } finally {
        Object.assign(StepRun.prototype, { forward, backward });
      }
      if (inject !== 'none') assert.ok(outside[0]?.reused === (inject === 'forward'), `the ${inject} injection happened as meant`);
      const weights = await Promise.all([...trainer.trainable.values()].map((t) => gpu.read(t)));
      const state = [...(await trainer.optimizer.checkpointState()).files.values()];
      // the allocator's live bytes and allocations: what a leaked partial step would leave behind
      const m = gpu.allocator.report();
      const out = { losses, warnings, weights, state, rng: trainer.rng.state(), mem: [m.current, m.live] };
      const stats = { replay: trainer.stepReplay, replayed: [...replayed, trainer.replayStats!.replayed] };
      free();
      return { ...out, ...stats };
    };
    const off = await go('none');
    for (const where of ['backward', 'forward'] as const) {
      const on = await go(where);
      assert.equal(on.replay, false, `${where}: the replay is off after the mismatch`);
      assert.equal(on.replayed[1], on.replayed[0], `${where}: no replay from the mismatched step on`);
      assert.deepEqual(
        on.warnings.map((w) => w !== undefined),
        [false, false, false, true, false],
        `${where}: one warning, at the step that fell back`,
      );
      assert.match(on.warnings[3]!, /training continues without it/);
      assert.doesNotMatch(on.warnings[3]!, /stepReplay|report this/, 'no code field for the user to set');
      assert.equal(new Set(on.losses).size, on.losses.length, `losses differ across steps: ${on.losses.join(', ')}`);
      on.losses.forEach((l, i) => assert.ok(Object.is(l, off.losses[i]), `${where}: step ${i} loss ${l} vs ${off.losses[i]}`));
      on.weights.forEach((w, i) => assert.deepEqual(w, off.weights[i], `${where}: trainable ${i}`));
      assert.equal(on.state.length, off.state.length);
      on.state.forEach((s, i) => assert.ok(Buffer.from(s).equals(Buffer.from(off.state[i])), `${where}: optimizer state file ${i}`));
      assert.equal(on.rng, off.rng, `${where}: the Rng drew each step once`);
      assert.deepEqual(on.mem, off.mem, `${where}: live bytes and allocations after the run (a leaked partial step adds some)`);
    }
  });
});
