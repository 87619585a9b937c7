// The compact optimizer modes (issue 14) in the trainer: 8-bit moments ('adamw8bit') and the compact master
// ('compact': f16 weight + extension) resume bit-identically after a crash, refuse to resume in another mode
// (naming the setting and both values), stream a third of the fp32 mode's bytes through the store, keep the
// "never write a non-finite value" guarantee with resident and streamed chunks, and train like fp32 AdamW.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import type { Tensor } from '../../src/gpu/tensor.ts';
import { MemoryChunkStore, type ChunkStore } from '../../src/store/chunkstore.ts';
import { chunkStateBytes, stateBytesPerElement, type OptimizerMode } from '../../src/train/packed-state.ts';
import type { DreamBoothTrainer, TrainSettings } from '../../src/train/trainer.ts';
import { TRAIN_DEFAULTS } from '../../src/pipeline/settings.ts';
import { testGpu } from '../helpers.ts';
import { nodeGpu } from '../../src/gpu/node.ts';
import { unetConfigFromJson } from '../../src/nn/unet.ts';
import { SD_SCHEDULE } from '../../src/sample/schedulers.ts';
import { trainSettings } from '../../src/pipeline/run.ts';
import { defaultSettings, validateSettings } from '../../src/pipeline/settings.ts';
import { dryRunPeak } from '../../src/train/plan.ts';
import { base, fixture, makeTrainer } from './tiny-trainer.ts';

const COMPACT_MODES: OptimizerMode[] = [
  { optimizer: 'adamw8bit', master: 'compact' },
  { optimizer: 'adamw8bit', master: 'fp32' },
  { optimizer: 'adamw', master: 'compact' },
];
const label = (m: OptimizerMode) => `${m.optimizer}/${m.master}`;

/** A memory store that counts the bytes read and written through it. */
class CountingStore extends MemoryChunkStore {
  readBytes = 0;
  writtenBytes = 0;
  override async write(key: string, data: Uint8Array): Promise<void> {
    this.writtenBytes += data.length;
    await super.write(key, data);
  }
  override async read(key: string): Promise<Uint8Array | null> {
    const b = await super.read(key);
    if (b) this.readBytes += b.length;
    return b;
  }
}

/** Raw bytes of the trainable weights, the resident packed chunks and the optimizer's store entries. */
async function snapshot(trainer: DreamBoothTrainer, store: ChunkStore): Promise<Map<string, Uint8Array>> {
  const gpu = trainer.gpu;
  const raw = async (t: Tensor) => new Uint8Array(await gpu.readBytes(t.buffer, t.byteOffset, t.byteSize));
  const out = new Map<string, Uint8Array>();
  for (const [name, t] of trainer.trainable) out.set(`weight ${name}`, await raw(t));
  for (const c of trainer.optimizer.chunks) if (c.packed) out.set(`chunk ${c.index}`, await raw(c.packed));
  for (const k of await store.keys(`${trainer.runId}/opt/`)) out.set(`store ${k}`, (await store.read(k))!);
  return out;
}

describe('compact optimizer modes: defaults, bytes per element', () => {
  it('full fine-tuning defaults to 8-bit moments and the compact master; LoRA keeps fp32 AdamW', () => {
    assert.equal(TRAIN_DEFAULTS.full.optimizer, 'adamw8bit');
    assert.equal(TRAIN_DEFAULTS.full.master, 'compact');
    assert.equal(TRAIN_DEFAULTS.lora.optimizer, 'adamw');
    assert.equal(TRAIN_DEFAULTS.lora.master, 'fp32');
    // The run schema (CLI flags and the page) has the same defaults and names a bad value by its flag.
    assert.equal(defaultSettings('full').optimizer, 'adamw8bit');
    assert.equal(defaultSettings('full').master, 'compact');
    assert.equal(defaultSettings('lora').optimizer, 'adamw');
    assert.equal(defaultSettings('lora').master, 'fp32');
    assert.throws(
      () => validateSettings({ ...defaultSettings('full'), optimizer: 'sgd' as never }),
      /--optimizer must be adamw or adamw8bit or prodigy or adafactor, got "sgd"/,
    );
    assert.throws(() => validateSettings({ ...defaultSettings('full'), master: 'bf16' as never }), /--master must be fp32 or compact, got "bf16"/);
    assert.equal(trainSettings(defaultSettings('full')).optimizer, 'adamw8bit');
    assert.equal(trainSettings({ ...defaultSettings('full'), master: 'fp32' }).master, 'fp32');
    // State bytes per element of a large tensor: 4 (fp32 master) or 2 (extension) + 8 (f32 m, v) or 2 + 8/256.
    assert.equal(stateBytesPerElement({ optimizer: 'adamw', master: 'fp32' }, 'f16'), 12);
    assert.equal(stateBytesPerElement({ optimizer: 'adamw8bit', master: 'compact' }, 'f16'), 4.03125);
    assert.equal(stateBytesPerElement({ optimizer: 'adamw8bit', master: 'fp32' }, 'f16'), 6.03125);
    assert.equal(stateBytesPerElement({ optimizer: 'adamw', master: 'compact' }, 'f16'), 10);
    assert.equal(stateBytesPerElement({ optimizer: 'adamw8bit', master: 'compact' }, 'f32'), 2.03125);
    // SD 1.5's largest tensor (1280 x 1280 x 3 x 3): the layout's bytes match the per-element figure.
    const n = 1280 * 1280 * 9;
    assert.equal(chunkStateBytes([n], { optimizer: 'adamw8bit', master: 'compact' }, 'f16'), 4.03125 * n);
  });

  it('full [f16], default compact mode, streamed chunks: each step reads and writes each stored chunk once, as many bytes as its layout holds, about half the fp32 mode on the tiny UNet', async () => {
    const gpu = await testGpu();
    const perStep = new Map<string, number>();
    for (const mode of [{ optimizer: 'adamw', master: 'fp32' } as const, COMPACT_MODES[0]]) {
      const store = new CountingStore();
      const { trainer, fx, free } = await makeTrainer(gpu, 'f16', 'full', store, { ...mode, residentChunks: 1 });
      const stored = trainer.optimizer.chunks.filter((c) => !c.packed && !c.resident);
      const want = stored.reduce(
        (n, c) =>
          n +
          chunkStateBytes(
            c.params.map((p) => p.numel),
            mode,
            'f16',
          ),
        0,
      );
      for (let s = 0; s < 2; s++) {
        store.readBytes = 0;
        store.writtenBytes = 0;
        const r = await trainer.trainStep(fx.inputs[s]);
        assert.ok(r.applied, `${label(mode)} step ${s + 1}: ${r.skipped}`);
        assert.equal(store.readBytes, want, `${label(mode)} step ${s + 1} reads`);
        assert.equal(store.writtenBytes, want, `${label(mode)} step ${s + 1} writes`);
      }
      perStep.set(label(mode), want / stored.reduce((n, c) => n + c.elems, 0));
      free();
    }
    // The tiny UNet keeps 65K of its 203K elements in tensors under 4096 (f32 moments: 2 + 8 bytes) and pads each
    // tensor to a block of 256: measured 6.23 bytes per element against fp32's 12 (SD 1.5, almost all large
    // tensors: 4.03). The exact bytes are checked against the layout above; here the saving must be real.
    const ratio = perStep.get('adamw8bit/compact')! / perStep.get('adamw/fp32')!;
    console.log(
      `store bytes per element per step (each way): fp32 ${perStep.get('adamw/fp32')}, compact ${perStep.get('adamw8bit/compact')!.toFixed(2)} (x${ratio.toFixed(3)})`,
    );
    assert.ok(ratio < 0.6, `compact/fp32 store bytes ${ratio}`);
  });
});

describe('compact modes resume bit-identically', () => {
  const cases: [string, 'lora' | 'full', 'f16' | 'f32', OptimizerMode][] = [
    ...COMPACT_MODES.map((m) => [label(m), 'full', 'f16', m] as [string, 'full', 'f16', OptimizerMode]),
    ['adamw8bit/compact', 'full', 'f32', COMPACT_MODES[0]],
    ['adamw8bit/compact', 'lora', 'f16', COMPACT_MODES[0]],
  ];
  for (const [name, mode, dtype, opt] of cases)
    it(`${mode} [${dtype}] ${name}: checkpoint at step 3, crash after step 5, resume to step 8 = uninterrupted`, async () => {
      const gpu = await testGpu();
      const steps = 8;
      const probe = await makeTrainer(gpu, dtype, mode, new MemoryChunkStore(), opt);
      const half = Math.ceil(probe.trainer.optimizer.chunks.length / 2);
      probe.free();
      // Half the chunks resident, half streamed; Rng-drawn inputs with offset noise.
      const over: Partial<TrainSettings> = { ...opt, residentChunks: half, offsetNoise: 0.1, seed: 7 };
      const a = await makeTrainer(gpu, dtype, mode, new MemoryChunkStore(), over);
      assert.ok(a.trainer.optimizer.storedChunks > 0 && a.trainer.optimizer.storedChunks < a.trainer.optimizer.chunks.length);
      for (let s = 0; s < steps; s++) assert.ok((await a.trainer.trainStep()).applied);
      const want = await a.trainer.trainedValues();
      const wantWeights = new Map<string, Float32Array>();
      for (const [n, t] of a.trainer.trainable) wantWeights.set(n, await gpu.read(t));
      a.free();
      const store = new MemoryChunkStore();
      const b = await makeTrainer(gpu, dtype, mode, store, over);
      for (let s = 0; s < 3; s++) await b.trainer.trainStep();
      await b.trainer.checkpoint();
      for (let s = 0; s < 2; s++) await b.trainer.trainStep();
      b.free();
      const c = await makeTrainer(gpu, dtype, mode, store, over);
      assert.equal(await c.trainer.resume(), true);
      assert.equal(c.trainer.step, 3);
      while (c.trainer.step < steps) await c.trainer.trainStep();
      const got = await c.trainer.trainedValues();
      for (const [n, w] of want) assert.deepEqual(got.get(n), w, `${n}: master differs after resume`);
      for (const [n, t] of c.trainer.trainable) assert.deepEqual(await gpu.read(t), wantWeights.get(n), `${n}: weight differs after resume`);
      c.free();
    });
});

describe('a run refuses to resume in another optimizer mode', () => {
  it('checkpointed with adamw8bit/compact, resumed with adamw or fp32: refused naming the setting and both values, nothing changed', async () => {
    const gpu = await testGpu();
    const store = new MemoryChunkStore();
    const a = await makeTrainer(gpu, 'f16', 'full', store, { ...COMPACT_MODES[0], residentChunks: 2 });
    await a.trainer.trainStep(a.fx.inputs[0]);
    await a.trainer.checkpoint();
    a.free();
    for (const [over, re] of [
      [{ optimizer: 'adamw', master: 'compact' }, /checkpoint was made with optimizer = 'adamw8bit', not 'adamw'.*resume with optimizer 'adamw8bit'/],
      [{ optimizer: 'adamw8bit', master: 'fp32' }, /checkpoint was made with master = 'compact', not 'fp32'.*resume with master 'compact'/],
    ] as const) {
      const keys = await store.keys();
      const b = await makeTrainer(gpu, 'f16', 'full', store, { ...over, residentChunks: 2 });
      const before = await snapshot(b.trainer, store);
      await assert.rejects(b.trainer.resume(), re);
      assert.equal(b.trainer.step, 0);
      const after = await snapshot(b.trainer, store);
      for (const [k, v] of before) assert.deepEqual(after.get(k), v, `${k} changed`);
      assert.deepEqual(
        (await store.keys()).filter((k) => !k.startsWith('run/opt/')),
        keys.filter((k) => !k.startsWith('run/opt/')),
        'the checkpoint is intact',
      );
      b.free();
    }
  });
});

describe('compact modes never write a non-finite value', () => {
  for (const placement of ['resident', 'streamed'] as const)
    it(`full [f16] adamw8bit/compact, ${placement} chunks, lr 1e30: the step is skipped whole, nothing changes`, async () => {
      const gpu = await testGpu();
      const store = new CountingStore();
      const { trainer, fx, free } = await makeTrainer(gpu, 'f16', 'full', store, {
        ...COMPACT_MODES[0],
        lr: 1e30,
        residentChunks: placement === 'resident' ? Infinity : 0,
      });
      const before = await snapshot(trainer, store);
      store.writtenBytes = 0;
      const r = await trainer.trainStep(fx.inputs[0]);
      assert.equal(r.applied, false);
      assert.match(r.skipped ?? '', /the update would make weights non-finite/);
      const after = await snapshot(trainer, store);
      for (const [k, v] of before) assert.deepEqual(after.get(k), v, `${k} changed`);
      assert.equal(store.writtenBytes, 0);
      for (const [n, v] of await trainer.trainedValues()) assert.ok(v.every(Number.isFinite), `${n} not finite`);
      free();
    });
});

describe('compact modes against the 20-step PyTorch reference (fp32 AdamW in float64)', () => {
  // The reference is fp32 AdamW; the compact modes are held to the tolerances the fp32 mode's f16 run meets
  // (tests/train/reference.test.ts: loss 3e-2 relative; final weights 0.25 of the tensor's largest change).
  // 8-bit moments change each update by at most the code spacing near the value (~1.5% relative near the block
  // maximum, up to ~10% in the sparsest part of the map); Adam's m / sqrt(v) halves the v error, and a step
  // moves a weight by about lr, so a per-element difference of a fraction of lr per step stays within the
  // per-tensor bound over 20 steps.
  for (const [mode, opt] of [
    ['full', COMPACT_MODES[0]],
    ['lora', COMPACT_MODES[0]],
  ] as const)
    it(`${mode} [f16] ${label(opt)}: per-step loss and final weights within the f16 run's tolerances`, async () => {
      const gpu = await testGpu();
      const { trainer, fx, free } = await makeTrainer(gpu, 'f16', mode, new MemoryChunkStore(), { ...opt, residentChunks: 3 });
      let worstLoss = 0;
      for (let s = 0; s < fx.inputs.length; s++) {
        const r = await trainer.trainStep(fx.inputs[s]);
        assert.ok(r.applied, `step ${s + 1} applied (${r.skipped ?? ''})`);
        const rel = Math.abs(r.loss - fx.losses[s]) / Math.abs(fx.losses[s]);
        worstLoss = Math.max(worstLoss, rel);
        assert.ok(rel <= 3e-2, `step ${s + 1} loss ${r.loss} vs PyTorch ${fx.losses[s]}`);
      }
      const trained = await trainer.trainedValues();
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
        assert.ok(err <= 0.25 * moved + 1e-7, `${name}: max error ${err} vs largest change ${moved}`);
        worst = Math.max(worst, err / moved);
      }
      free();
      console.log(
        `${mode} f16 ${label(opt)} vs PyTorch: worst loss ${(worstLoss * 100).toFixed(3)}%, worst final-weight error ${(worst * 100).toFixed(2)}% of the largest change`,
      );
    });
});

describe("the planner's dry run in the compact default", () => {
  // plan.ts measures a placement by running the real trainer on a dry-run Gpu: in the compact modes too, its peak
  // must equal a real run's to the byte and its store bytes per step the layout's.
  it('full [f16] adamw8bit/compact, checkpointing, 2 chunks resident: dry-run peak = real peak; store bytes = the layout', async () => {
    const over: Partial<TrainSettings> = { ...COMPACT_MODES[0], activationCheckpointing: true, residentChunks: 2 };
    const fx = fixture('full');
    const cfg = unetConfigFromJson(JSON.parse(base.metadata.config));
    const plan = await dryRunPeak(
      () => nodeGpu({ dryRun: true }),
      { config: cfg, dtype: 'f16', schedule: { ...SD_SCHEDULE, prediction: fx.prediction }, name: 'tiny' },
      { latentShape: [4, 8, 8], contextShape: [7, 32], withClass: true },
      { ...fx.settings, ...over },
    );
    const gpu = await nodeGpu();
    try {
      const { trainer, free } = await makeTrainer(gpu, 'f16', 'full', new MemoryChunkStore(), over);
      let peak = 0;
      for (const inputs of fx.inputs.slice(0, 2)) peak = Math.max(peak, (await trainer.trainStep(inputs)).gpuPeakBytes);
      const stored = trainer.optimizer.chunks.filter((c) => !c.packed);
      const layoutBytes = stored.reduce(
        (n, c) =>
          n +
          chunkStateBytes(
            c.params.map((p) => p.numel),
            COMPACT_MODES[0],
            'f16',
          ),
        0,
      );
      free();
      assert.equal(plan.peakBytes, peak, 'planned peak = real peak');
      assert.equal(plan.storeReadBytesPerStep, layoutBytes);
      assert.equal(plan.storeWriteBytesPerStep, layoutBytes);
    } finally {
      gpu.destroy();
    }
  });
});

describe('steady state in the compact default', () => {
  it('full [f16] adamw8bit/compact, chunks streamed, checkpointing: no GPUBuffer or bind group created after warm-up', async () => {
    const gpu = await testGpu();
    const { trainer, fx, free } = await makeTrainer(gpu, 'f16', 'full', new MemoryChunkStore(), {
      ...COMPACT_MODES[0],
      activationCheckpointing: true,
      residentChunks: 1,
    });
    for (let s = 0; s < 3; s++) await trainer.trainStep(fx.inputs[s]);
    const before = gpu.stats;
    const bytes = gpu.allocator.report().current;
    for (let s = 3; s < 6; s++) assert.ok((await trainer.trainStep(fx.inputs[s])).applied);
    const after = gpu.stats;
    assert.ok(after.dispatches - before.dispatches > 300, 'the steps dispatch work');
    assert.equal(after.buffersCreated - before.buffersCreated, 0, 'GPUBuffers created in 3 warm steps');
    assert.equal(after.bindGroupsCreated - before.bindGroupsCreated, 0, 'bind groups created in 3 warm steps');
    assert.equal(gpu.allocator.report().current, bytes, 'GPU bytes grow across steps');
    free();
  });
});

describe('resume after a lost device in the compact default', () => {
  it('full [f16] adamw8bit/compact: the device is destroyed after step 5 (checkpoint at 3); a new device resumes to step 8 = uninterrupted', async () => {
    const over: Partial<TrainSettings> = { ...COMPACT_MODES[0], residentChunks: 4, seed: 9 };
    const gpu = await testGpu();
    const a = await makeTrainer(gpu, 'f16', 'full', new MemoryChunkStore(), over);
    for (let s = 0; s < 8; s++) await a.trainer.trainStep();
    const want = await a.trainer.trainedValues();
    a.free();
    const store = new MemoryChunkStore();
    const lost = await nodeGpu();
    const b = await makeTrainer(lost, 'f16', 'full', store, over);
    for (let s = 0; s < 3; s++) await b.trainer.trainStep();
    await b.trainer.checkpoint();
    for (let s = 0; s < 2; s++) await b.trainer.trainStep();
    lost.destroy(); // the device is gone with every resident chunk and weight on it; nothing is freed
    const c = await makeTrainer(gpu, 'f16', 'full', store, over);
    assert.equal(await c.trainer.resume(), true);
    while (c.trainer.step < 8) await c.trainer.trainStep();
    const got = await c.trainer.trainedValues();
    for (const [n, w] of want) assert.deepEqual(got.get(n), w, `${n} differs after resuming on a new device`);
    c.free();
  });
});
