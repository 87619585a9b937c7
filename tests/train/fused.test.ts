// Fused optimizer updates (issue 14 Must-show 3, TrainSettings.fusedUpdates): every chunk updates inside the
// backward pass as its gradients become final. The math is the unfused step's (clipping by the global norm of a
// norm pass first, the overflow decided before any update), so the checks here are bit-for-bit, not within a
// tolerance: losses, gradient norms, masters, compute weights and the store's bytes equal the unfused run's.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import type { Gpu } from '../../src/gpu/device.ts';
import type { Tensor } from '../../src/gpu/tensor.ts';
import { MemoryChunkStore, type ChunkStore } from '../../src/store/chunkstore.ts';
import { DreamBoothTrainer, type StepReport, type TrainSettings } from '../../src/train/trainer.ts';
import { testGpu } from '../helpers.ts';
import { Ops, Tape } from '../../src/nn/ops.ts';
import { unetConfigFromJson, unetForward } from '../../src/nn/unet.ts';
import { trainSettings } from '../../src/pipeline/run.ts';
import { defaultSettings, validateSettings } from '../../src/pipeline/settings.ts';
import { base, makeTrainer } from './tiny-trainer.ts';

/** Raw bytes of the trainable weights, the resident chunks' state and the optimizer's store entries. */
async function snapshot(trainer: DreamBoothTrainer, store: ChunkStore): Promise<Map<string, Uint8Array>> {
  const gpu = trainer.gpu;
  const raw = async (t: Tensor) => new Uint8Array(await gpu.readBytes(t.buffer, t.byteOffset, t.byteSize));
  const out = new Map<string, Uint8Array>();
  for (const [name, t] of trainer.trainable) out.set(`weight ${name}`, await raw(t));
  for (const c of trainer.optimizer.chunks) {
    if (c.packed) out.set(`chunk ${c.index}`, await raw(c.packed));
    if (c.resident) for (const k of ['master', 'm', 'v'] as const) out.set(`chunk ${c.index} ${k}`, await raw(c.resident[k]));
  }
  for (const k of await store.keys(`${trainer.runId}/opt/`)) out.set(`store ${k}`, (await store.read(k))!);
  return out;
}

function assertSameBytes(got: Map<string, Uint8Array>, want: Map<string, Uint8Array>, what: string): void {
  assert.deepEqual([...got.keys()].sort(), [...want.keys()].sort(), `${what}: different state entries`);
  for (const [k, w] of want) assert.ok(Buffer.from(got.get(k)!).equals(Buffer.from(w)), `${what}: ${k} differs`);
}

/** Runs `steps` fixture steps; each step's report and its peak of gradient bytes. */
async function run(gpu: Gpu, over: Partial<TrainSettings>, steps: number, mode: 'lora' | 'full' = 'full') {
  const store = new MemoryChunkStore();
  const t = await makeTrainer(gpu, 'f16', mode, store, over);
  const reports: StepReport[] = [];
  const gradPeaks: number[] = [];
  for (let s = 0; s < steps; s++) {
    reports.push(await t.trainer.trainStep(t.fx.inputs[s]));
    gradPeaks.push(gpu.allocator.report().byTag.gradients.peak);
  }
  const state = await snapshot(t.trainer, store);
  const masters = await t.trainer.trainedValues();
  return { t, store, reports, gradPeaks, state, masters };
}

describe('fused updates: the same step as the unfused one, less gradient memory', () => {
  for (const [mode, extra, what] of [
    [{ optimizer: 'adamw8bit', master: 'compact' }, {}, ''],
    [{ optimizer: 'adamw', master: 'fp32' }, {}, ''],
    // Checkpointed segments note their weights' use for the segment's record.
    [{ optimizer: 'adamw8bit', master: 'compact' }, { activationCheckpointing: true }, ', activation checkpointing'],
    // One pass per sample: the first pass's gradients wait on the tape (the update needs their sum) and only the
    // last pass's backward hands over, so the gradient peak is the unfused one (checked: not above it).
    [{ optimizer: 'adamw8bit', master: 'compact' }, { passPerSample: true }, ', one pass per sample'],
  ] as const)
    it(`full [f16] ${mode.optimizer}/${mode.master}${what}, half the chunks streamed, clipping binding: losses, norms, weights and store bytes bit-identical; gradient peak at most a quarter (one pass per step)`, async () => {
      const gpu = await testGpu();
      const steps = 3;
      // 16 Ki-element chunks: ~9 chunks of the tiny UNet; the first half resident, the rest streamed.
      const over: Partial<TrainSettings> = { ...mode, ...extra, chunkElems: 1 << 14, residentChunks: 4, maxGradNorm: 1e-3 };
      const a = await run(gpu, { ...over, fusedUpdates: false }, steps);
      const b = await run(gpu, { ...over, fusedUpdates: true }, steps);
      assert.ok(a.t.trainer.optimizer.storedChunks >= 3, `${a.t.trainer.optimizer.storedChunks} chunks streamed`);
      for (let s = 0; s < steps; s++) {
        assert.ok(a.reports[s].applied && b.reports[s].applied, `step ${s + 1} applied in both`);
        // Clipping binds (the norm is far above 1e-3), so a fused step that skipped or mis-scaled it would differ below.
        assert.ok(a.reports[s].gradNorm > 10 * over.maxGradNorm!, `step ${s + 1}: norm ${a.reports[s].gradNorm} should bind the clip`);
        assert.ok(Object.is(b.reports[s].loss, a.reports[s].loss), `step ${s + 1}: loss ${b.reports[s].loss} vs ${a.reports[s].loss}`);
        assert.ok(Object.is(b.reports[s].gradNorm, a.reports[s].gradNorm), `step ${s + 1}: norm ${b.reports[s].gradNorm} vs ${a.reports[s].gradNorm}`);
      }
      assertSameBytes(b.state, a.state, 'fused vs unfused');
      for (const [n, w] of a.masters) assert.deepEqual(b.masters.get(n), w, `${n}: master differs`);
      // Unfused: every gradient at once (2 bytes per weight in f16). Fused: the chunks' in flight only.
      const total = [...a.t.trainer.trainable.values()].reduce((n, t) => n + t.byteSize, 0);
      const peakA = Math.max(...a.gradPeaks);
      const peakB = Math.max(...b.gradPeaks);
      console.log(`gradient peak: unfused ${peakA} B, fused ${peakB} B (all gradients ${total} B)`);
      // (Below the sum: not every weight gradient is allocated under the 'gradients' tag; the fused run's are the same kernels.)
      assert.ok(peakA >= total / 2, `unfused peak ${peakA} holds most gradients (${total})`);
      if ('passPerSample' in extra) assert.ok(peakB <= peakA, `fused gradient peak ${peakB} should not exceed ${peakA}`);
      else assert.ok(peakB <= peakA / 4, `fused gradient peak ${peakB} should be at most a quarter of ${peakA}`);
      a.t.free();
      b.t.free();
    });
});

describe('activation checkpointing: the same step as without it', () => {
  // The re-run segments' backward must sum each gradient in the plain backward's order (a segment input that
  // already holds a skip connection's gradient): a different order changes low bits of the gradients (seen in
  // the norms at step 1), which AdamW turns into different weights by step 2 and losses by step 3.
  it('LoRA [f16] (the CLI run that showed it): losses, gradient norms, weights and optimizer state bit-identical over 3 steps', async () => {
    const gpu = await testGpu();
    const steps = 3;
    const a = await run(gpu, { activationCheckpointing: false }, steps, 'lora');
    const b = await run(gpu, { activationCheckpointing: true }, steps, 'lora');
    for (let s = 0; s < steps; s++) {
      assert.ok(a.reports[s].applied && b.reports[s].applied, `step ${s + 1} applied in both`);
      assert.ok(Object.is(b.reports[s].gradNorm, a.reports[s].gradNorm), `step ${s + 1}: norm ${b.reports[s].gradNorm} vs ${a.reports[s].gradNorm}`);
      assert.ok(Object.is(b.reports[s].loss, a.reports[s].loss), `step ${s + 1}: loss ${b.reports[s].loss} vs ${a.reports[s].loss}`);
    }
    assertSameBytes(b.state, a.state, 'checkpointing vs plain');
    a.t.free();
    b.t.free();
  });
});

describe('Tape.backwardFused hands each weight over once, when its gradient is final', () => {
  for (const checkpointing of [false, true])
    it(`tiny UNet [f32]${checkpointing ? ' with activation checkpointing' : ''}: every weight once, in many hand-overs, its gradient then = the plain backward's bit for bit; time_embedding.linear_1 last`, async () => {
      const gpu = await testGpu();
      const weights = new Map<string, Tensor>();
      for (const [k, t] of base.tensors)
        if (!['sample', 'timestep', 'encoder_hidden_states', 'out'].includes(k)) weights.set(k, gpu.upload(t.data, t.shape, 'f32', 'weights', k));
      const cfg = unetConfigFromJson(JSON.parse(base.metadata.config));
      const input = (k: string, dtype: 'f32' = 'f32') => gpu.upload(base.tensors.get(k)!.data, base.tensors.get(k)!.shape, dtype);
      const names = new Map([...weights].map(([n, t]) => [t, n]));
      const run = async (fused: boolean) => {
        const tape = new Tape(gpu, new Set(weights.values()));
        const [x, t, c] = [input('sample'), input('timestep'), input('encoder_hidden_states')];
        const out = unetForward(gpu, cfg, weights, x, t, c, tape, 1, checkpointing);
        const dy = gpu.upload(new Float32Array(out.numel).fill(1e-2), out.shape, 'f32');
        const grads = new Map<string, Float32Array>();
        const handovers: string[][] = [];
        if (fused)
          await tape.backwardFused(out, dy, async (ws) => {
            handovers.push(ws.map((w) => names.get(w)!));
            for (const w of ws) {
              const g = tape.take(w)!;
              grads.set(names.get(w)!, await gpu.read(g));
              gpu.free(g);
            }
          });
        else {
          tape.backward(out, dy);
          for (const [n, w] of weights) grads.set(n, await gpu.read(tape.take(w)!));
        }
        tape.dropGrads();
        gpu.free(x, t, c);
        return { grads, handovers };
      };
      const plain = await run(false);
      const fused = await run(true);
      const handed = fused.handovers.flat();
      assert.equal(handed.length, weights.size, 'every weight handed over');
      assert.equal(new Set(handed).size, weights.size, 'each once');
      assert.ok(fused.handovers.length >= 10, `${fused.handovers.length} hand-overs: weights go as the backward passes them, not all at the end`);
      assert.ok(fused.handovers.at(-1)!.includes('time_embedding.linear_1.weight'), `last hand-over: ${fused.handovers.at(-1)}`);
      assert.ok(
        fused.handovers[0].every((n) => n.startsWith('conv_out') || n.startsWith('conv_norm_out')),
        `first hand-over: ${fused.handovers[0]}`,
      );
      for (const [n, g] of plain.grads) assert.deepEqual(fused.grads.get(n), g, `${n}: gradient at hand-over differs from the plain backward's`);
      for (const w of weights.values()) gpu.free(w);
    });

  it('a weight read by an op that does not note its use: the gradient arriving after the hand-over throws, naming the weight', async () => {
    const gpu = await testGpu();
    const w = gpu.upload(new Float32Array([1, 2, 3, 4, 5, 6]), [2, 3], 'f32', 'weights', 'probe.weight');
    const x = gpu.upload(new Float32Array([1, 0, 1, 0, 1, 0]), [2, 3], 'f32');
    const tape = new Tape(gpu, new Set([w]));
    const F = new Ops(gpu, tape);
    const a = F.matmul(x, w, { transB: true }); // x w^T, reading w without Tape.use (record 0)
    const b = F.linear(x, w); // x w^T again, noting w's use (record 1): w is handed over after record 1
    const y = F.add(a, b);
    const dy = gpu.upload(new Float32Array(y.numel).fill(1), y.shape, 'f32');
    await assert.rejects(
      tape.backwardFused(y, dy, async (ws) => {
        for (const t of ws) gpu.free(tape.take(t));
      }),
      /a gradient reached the weight probe\.weight after it was handed over as final: an op reads it without Tape\.use/,
    );
    tape.dropGrads();
    gpu.free(w, x);
  });
});

describe('fused updates: settings', () => {
  it('off by default; full fine-tuning only: refused for LoRA by the flag and by the trainer', async () => {
    assert.equal(defaultSettings('full').fusedUpdates, false);
    assert.equal(trainSettings({ ...defaultSettings('full'), fusedUpdates: true }).fusedUpdates, true);
    assert.throws(() => validateSettings({ ...defaultSettings('lora'), fusedUpdates: true }), /--fused-updates/);
    const gpu = await testGpu();
    await assert.rejects(
      makeTrainer(gpu, 'f16', 'lora', new MemoryChunkStore(), { fusedUpdates: true }),
      /fused updates are for full fine-tuning.*turn fusedUpdates \(--fused-updates\) off for a lora run/,
    );
  });
});

describe('fused updates: an overflow in the last chunk of the backward', () => {
  it('full [f16] compact default, chunk 0 resident, the rest streamed: only conv_in.weight (last chunk) overflows; every weight, state and store byte unchanged, the scale halves, the next step applies', async () => {
    const gpu = await testGpu();
    const store = new MemoryChunkStore();
    // 64 Ki-element chunks: chunk 0 holds the time embedding and conv_in, whose gradients are final last.
    const t = await makeTrainer(gpu, 'f16', 'full', store, { chunkElems: 1 << 16, residentChunks: 1, fusedUpdates: true });
    const opt = t.trainer.optimizer;
    assert.ok(opt.storedChunks >= 1);
    const conv = opt.locate('conv_in.weight');
    assert.equal(conv.chunk, 0);
    assert.equal(opt.locate('time_embedding.linear_1.weight').chunk, 0);
    // conv_in.weight's input channel 0 multiplies nothing (zero weights) but sees 60000 in the latent: its
    // gradient sum_{positions} dy * x overflows f16 at the loss scale, and no other gradient sees the channel.
    const w = t.trainer.trainable.get('conv_in.weight')!;
    const wv = await gpu.read(w);
    const [cout, cin, kh, kw] = w.shape;
    for (let o = 0; o < cout; o++) wv.fill(0, (o * cin + 0) * kh * kw, (o * cin + 1) * kh * kw);
    gpu.write(w, wv);
    // The masters start from the weights as loaded: a second trainer over the edited weights.
    // Epsilon prediction: the target (the noise) does not see the latent's channel 0 either.
    const model = { ...t.trainer.model, schedule: { ...t.trainer.model.schedule, prediction: 'epsilon' as const } };
    const t2 = await DreamBoothTrainer.create(gpu, model, t.trainer.data, t.trainer.settings, store, 'run2');
    const inputs = { ...t.fx.inputs[0], timesteps: [1, 1] };
    const hot = (latent: Float32Array) => {
      const x = latent.slice();
      x.fill(60000, 0, 64); // channel 0 of the [4, 8, 8] latent
      return x;
    };
    const data = t2.data;
    const saved = data.instance.map((s) => s.latent);
    const savedClass = data.classes.map((s) => s.latent);
    data.instance.forEach((s) => (s.latent = hot(s.latent)));
    data.classes.forEach((s) => (s.latent = hot(s.latent)));
    const before = await snapshot(t2, store);
    const scale = t2.scaler.scale;
    const r = await t2.trainStep(inputs);
    assert.equal(r.applied, false);
    assert.match(r.skipped!, /inf\/NaN in the gradients/);
    assert.equal(t2.scaler.scale, scale / 2, 'the loss scale halves');
    assert.equal(t2.appliedSteps, 0);
    // The norm pass saw chunk 0 complete last: the overflow was in the last chunk of the backward.
    assert.equal(t2.optimizer.lastFusedOrder.at(-1), 0, `completion order ${t2.optimizer.lastFusedOrder}`);
    assertSameBytes(await snapshot(t2, store), before, 'after the overflow');
    // Only conv_in.weight's gradient is non-finite: the unfused tape's gradients of the same step say so.
    const bad = await nonFiniteGradients(t2, inputs);
    assert.deepEqual(bad, ['conv_in.weight']);
    data.instance.forEach((s, i) => (s.latent = saved[i]));
    data.classes.forEach((s, i) => (s.latent = savedClass[i]));
    const next = await t2.trainStep(t.fx.inputs[1]);
    assert.ok(next.applied, `the next step is applied (${next.skipped})`);
    t2.destroy();
    t.free();
  });
});

describe('fused updates: an update that would overflow', () => {
  it('full [f16] compact default, learning rate 1e30: the check pass finds it before any chunk updates; every byte unchanged, the scale kept', async () => {
    const gpu = await testGpu();
    const store = new MemoryChunkStore();
    const t = await makeTrainer(gpu, 'f16', 'full', store, { chunkElems: 1 << 14, residentChunks: 4, fusedUpdates: true, lr: 1e30 });
    const before = await snapshot(t.trainer, store);
    const scale = t.trainer.scaler.scale;
    const r = await t.trainer.trainStep(t.fx.inputs[0]);
    assert.equal(r.applied, false);
    assert.match(r.skipped!, /would make weights non-finite/);
    assert.equal(t.trainer.scaler.scale, scale, 'the loss scale is kept');
    assertSameBytes(await snapshot(t.trainer, store), before, 'after the refused update');
    t.free();
  });
});

/** Names of the trainable parameters whose gradient for `inputs` holds an inf or NaN (a plain, unfused backward). */
async function nonFiniteGradients(trainer: DreamBoothTrainer, inputs: Parameters<DreamBoothTrainer['trainStep']>[0]): Promise<string[]> {
  const probe = trainer as unknown as {
    forwardBackward(i: typeof inputs, scale: number): Promise<{ tape: import('../../src/nn/ops.ts').Tape }>;
  };
  const { tape } = await probe.forwardBackward(inputs, trainer.scaler.scale);
  const bad: string[] = [];
  for (const [name, t] of trainer.trainable) {
    const g = tape.take(t);
    if (!g) continue;
    if (!(await trainer.gpu.read(g)).every(Number.isFinite)) bad.push(name);
    trainer.gpu.free(g);
  }
  tape.dropGrads();
  return bad;
}

describe('fused updates: steady state', () => {
  it('full [f16] compact default, checkpointing, streamed chunks: no GPUBuffer or bind group created after warm-up', async () => {
    const gpu = await testGpu();
    const over: Partial<TrainSettings> = { chunkElems: 1 << 14, residentChunks: 4, activationCheckpointing: true, fusedUpdates: true };
    const { trainer, fx, free } = await makeTrainer(gpu, 'f16', 'full', new MemoryChunkStore(), over);
    for (let s = 0; s < 3; s++) await trainer.trainStep(fx.inputs[s]);
    const before = gpu.stats;
    for (let s = 3; s < 6; s++) assert.ok((await trainer.trainStep(fx.inputs[s])).applied);
    const after = gpu.stats;
    assert.ok(after.dispatches - before.dispatches > 300, 'the steps dispatch work');
    assert.equal(after.buffersCreated - before.buffersCreated, 0, 'GPUBuffers created in 3 warm steps');
    assert.equal(after.bindGroupsCreated - before.bindGroupsCreated, 0, 'bind groups created in 3 warm steps');
    free();
  });
});

describe('fused updates resume bit-identically', () => {
  it('full [f16] compact default, half the chunks streamed: checkpoint at step 3, crash after step 5, resume to step 8 = uninterrupted (and = unfused)', async () => {
    const gpu = await testGpu();
    const steps = 8;
    const over: Partial<TrainSettings> = { chunkElems: 1 << 14, residentChunks: 4, offsetNoise: 0.1, seed: 7, fusedUpdates: true };
    const a = await makeTrainer(gpu, 'f16', 'full', new MemoryChunkStore(), { ...over, fusedUpdates: false });
    for (let s = 0; s < steps; s++) assert.ok((await a.trainer.trainStep()).applied);
    const want = await a.trainer.trainedValues();
    a.free();
    const store = new MemoryChunkStore();
    const b = await makeTrainer(gpu, 'f16', 'full', store, over);
    for (let s = 0; s < 3; s++) await b.trainer.trainStep();
    await b.trainer.checkpoint();
    for (let s = 0; s < 2; s++) await b.trainer.trainStep();
    b.free();
    const c = await makeTrainer(gpu, 'f16', 'full', store, over);
    assert.equal(await c.trainer.resume(), true);
    assert.equal(c.trainer.step, 3);
    while (c.trainer.step < steps) await c.trainer.trainStep();
    const got = await c.trainer.trainedValues();
    for (const [n, w] of want) assert.deepEqual(got.get(n), w, `${n}: master differs after resume`);
    c.free();
  });
});
