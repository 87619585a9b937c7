// How many passes over the gradients an optimizer step makes, for resident fp32 chunks (LoRA): with clipping,
// one norm pass (which also detects inf/NaN: the norm is non-finite exactly when a gradient is) and the update,
// the update proven finite from each chunk's state statistics instead of a third, element-by-element check
// pass; without clipping, the inf/NaN pass, the check and the update. A LoRA's gradients and weights sit packed
// per chunk (optimizer-chunks.ts), so each pass is one dispatch per chunk, and a pass that comes back shows as a
// count `chunks` higher. (That the statistics never let a blow-up through is tests/train/nonfinite.test.ts, lr
// 1e30 with resident chunks.)
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import type { Gpu } from '../../src/gpu/device.ts';
import { ADAMW_DEFAULTS } from '../../src/ops/adamw.ts';
import { MemoryChunkStore } from '../../src/store/chunkstore.ts';
import { ChunkedAdamW } from '../../src/train/optimizer.ts';
import { uploadPacked, type ParamSpec } from '../../src/train/optimizer-chunks.ts';
import { Rng } from '../../src/util/rng.ts';
import { testGpu } from '../helpers.ts';
import { makeTrainer } from './tiny-trainer.ts';

describe('optimizer passes per step (resident fp32 chunks)', () => {
  for (const [clip, passes] of [
    [true, 2],
    [false, 3],
  ] as const)
    it(`${clip ? 'with' : 'without'} gradient clipping: ${passes} dispatches per chunk, plus a few`, async () => {
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
      // "A few": the norm's final reductions, one statistics reduction per chunk. One pass per tensor would be
      // `tensors` (> 20) dispatches more than one per chunk.
      const chunks = opt.chunks.length;
      const fixed = 4 * chunks + 4;
      assert.ok(tensors - chunks > fixed, `${tensors} tensors in ${chunks} chunks: a pass per tensor would show`);
      for (const n of counts) assert.ok(n >= passes * chunks && n <= passes * chunks + fixed, `${n} dispatches for ${tensors} tensors in ${chunks} chunks`);
      free();
    });
});

/**
 * LoRA's packed buffers (optimizer-chunks.ts uploadPacked, gradSlots): each chunk's gradients and weights side by side
 * as its state, so the norm and the update run once per chunk. Against the same optimizer on separate tensors: the
 * update is the same math per element, so bit for bit without clipping; with clipping the norm sums its squares in
 * another grouping (per chunk, not per tensor), so the clip factor, and the update, may differ by f32 roundings.
 */
describe('packed gradients and weights: one norm and one AdamW dispatch per chunk', () => {
  // ragged shapes (odd sizes, not multiples of 4) over 3 chunks of at most 40 elements
  const params: ParamSpec[] = [
    { name: 'a', shape: [3, 7] },
    { name: 'b', shape: [5, 3] },
    { name: 'c', shape: [1, 9] },
    { name: 'd', shape: [13] },
    { name: 'e', shape: [2, 11] },
  ];
  const rng = new Rng(7);
  const values = new Map(params.map((p) => [p.name, Float32Array.from({ length: p.shape.reduce((a, b) => a * b, 1) }, () => 2 * rng.uniform() - 1)]));
  const grads = new Map(params.map((p) => [p.name, Float32Array.from({ length: values.get(p.name)!.length }, () => 8 * rng.uniform() - 4)]));

  async function run(gpu: Gpu, packed: boolean, maxGradNorm: number | undefined) {
    const weights = packed
      ? uploadPacked(gpu, params, (n) => values.get(n)!, 'f32')
      : new Map(params.map((p) => [p.name, gpu.upload(values.get(p.name)!, p.shape, 'f32', 'weights', p.name)]));
    const opt = await ChunkedAdamW.create(gpu, params, weights, async (n) => values.get(n)!, {
      cfg: { ...ADAMW_DEFAULTS, lr: 0.05 },
      chunkElems: 40,
      residentChunks: Infinity,
      store: new MemoryChunkStore(),
      prefix: 'opt',
      maxGradNorm,
    });
    const slots = packed ? opt.gradSlots() : null;
    const g = new Map(
      params.map((p) => {
        const t = slots ? slots.get(p.name)! : gpu.tensor(p.shape, 'f32', 'gradients');
        gpu.write(t, grads.get(p.name)!);
        return [p.name, t];
      }),
    );
    // dispatches by kernel, the poison fills of new tensors left out (a pool miss in one run and not the other)
    const seen: string[] = [];
    const run = gpu.run;
    gpu.run = (k, call) => {
      seen.push(k.entry);
      return run.call(gpu, k, call);
    };
    const r = await opt.step(g, 1).finally(() => (gpu.run = run));
    const dispatches = seen.filter((e) => e !== 'fill').length;
    const out = { dispatches, chunks: opt.chunks.length, norm: r.gradNorm, masters: [] as Float32Array[], weights: [] as Float32Array[] };
    for (const c of opt.chunks) out.masters.push(await opt.chunkMasters(c.index));
    for (const p of params) out.weights.push(await gpu.read(weights.get(p.name)!));
    opt.destroy();
    if (!packed) gpu.free(...g.values());
    gpu.free(...weights.values());
    return out;
  }

  for (const clip of [false, true])
    it(`${clip ? 'clipped (norm > max): the same to f32 roundings' : 'no clipping: bit for bit'}; 5 tensors in 3 chunks`, async () => {
      const gpu = await testGpu();
      const maxGradNorm = clip ? 1 : undefined;
      const flat = await run(gpu, false, maxGradNorm);
      const packed = await run(gpu, true, maxGradNorm);
      assert.equal(packed.chunks, 3);
      // the per-tensor passes (2 with clipping, 3 without) become per-chunk: 5 tensors -> 3 chunks
      const passes = clip ? 2 : 3;
      assert.equal(flat.dispatches - packed.dispatches, passes * (params.length - packed.chunks), `${flat.dispatches} vs ${packed.dispatches} dispatches`);
      if (clip) {
        assert.ok(flat.norm > 4, `the norm (${flat.norm}) is past the clip, so the factor is used`);
        // the clip factor 1/norm differs by at most a few f32 ulps (2^-22 relative); each update moves a master by
        // about lr = 0.05, so the masters agree to 1e-7 absolute (the values are about 1)
        assert.ok(Math.abs(packed.norm - flat.norm) <= 4e-6 * flat.norm, `${packed.norm} vs ${flat.norm}`);
        packed.masters.forEach((m, i) =>
          m.forEach((v, j) => assert.ok(Math.abs(v - flat.masters[i][j]) <= 1e-7, `chunk ${i}[${j}]: ${v} vs ${flat.masters[i][j]}`)),
        );
      } else {
        assert.deepEqual(packed.masters, flat.masters);
        assert.deepEqual(packed.weights, flat.weights);
      }
      // and the update moved them: well past the tolerance above
      assert.ok(Math.abs(packed.masters[0][0] - values.get('a')![0]) > 1e-3);
    });
});
