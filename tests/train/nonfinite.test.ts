// No non-finite value reaches the trainable weights: a step whose AdamW update would make a master, a
// moment or the compute-dtype copy non-finite (a learning rate of 1e30: f16 weights past 65504) is skipped
// whole, with resident optimizer chunks and with chunks streamed through the store: every weight, master,
// moment and store entry bit-identical, the loss scale kept, the reason named. A normal learning rate streams
// each chunk once per step as before. Skipped steps in a row stop the run with TrainingStalledError, and the
// count survives a checkpoint.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import type { Tensor } from '../../src/gpu/tensor.ts';
import { MemoryChunkStore, type ChunkStore } from '../../src/store/chunkstore.ts';
import { TrainingStalledError, type DreamBoothTrainer } from '../../src/train/trainer.ts';
import { testGpu } from '../helpers.ts';
import { makeTrainer } from './tiny-trainer.ts';

/** A memory store that counts the bytes read and written through it. */
class CountingStore implements ChunkStore {
  readonly kind = 'memory' as const;
  readonly name = 'counting';
  readBytes = 0;
  writtenBytes = 0;
  private readonly inner = new MemoryChunkStore();

  async write(key: string, data: Uint8Array): Promise<void> {
    this.writtenBytes += data.length;
    await this.inner.write(key, data);
  }
  async read(key: string): Promise<Uint8Array | null> {
    const b = await this.inner.read(key);
    if (b) this.readBytes += b.length;
    return b;
  }
  delete(key: string): Promise<void> {
    return this.inner.delete(key);
  }
  keys(prefix?: string): Promise<string[]> {
    return this.inner.keys(prefix);
  }
  bytesUsed(): Promise<number> {
    return this.inner.bytesUsed();
  }
  close(): Promise<void> {
    return this.inner.close();
  }
  resetCounters(): void {
    this.readBytes = 0;
    this.writtenBytes = 0;
  }
}

/** The raw bytes of every piece of trainable state: compute-dtype weights, resident chunks, the optimizer's store entries. */
async function snapshot(trainer: DreamBoothTrainer, store: ChunkStore): Promise<Map<string, Uint8Array>> {
  const gpu = trainer.gpu;
  const raw = async (t: Tensor) => new Uint8Array(await gpu.readBytes(t.buffer, t.byteOffset, t.byteSize));
  const out = new Map<string, Uint8Array>();
  for (const [name, t] of trainer.trainable) out.set(`weight ${name}`, await raw(t));
  for (const c of trainer.optimizer.chunks)
    if (c.resident) for (const k of ['master', 'm', 'v'] as const) out.set(`chunk ${c.index} ${k}`, await raw(c.resident[k]));
  for (const k of await store.keys(`${trainer.runId}/opt/`)) out.set(`store ${k}`, (await store.read(k))!);
  return out;
}

function assertSame(after: Map<string, Uint8Array>, before: Map<string, Uint8Array>): void {
  assert.deepEqual([...after.keys()], [...before.keys()], 'the same weights, chunks and store keys');
  for (const [k, v] of before) assert.ok(Buffer.compare(after.get(k)!, v) === 0, `${k} changed`);
}

async function assertFinite(trainer: DreamBoothTrainer): Promise<void> {
  for (const [name, t] of trainer.trainable) assert.ok((await trainer.gpu.read(t)).every(Number.isFinite), `weight ${name} is not finite`);
  for (const [name, v] of await trainer.trainedValues()) assert.ok(v.every(Number.isFinite), `master ${name} is not finite`);
}

// f16: lr 1e30 makes the decay factor 1 - lr * wd = -1e28, so every weight of size ~1 lands past 65504.
// f32 holds 1e28 (that step is legitimately finite), so it gets a rate whose step size overflows f32.
const BLOW_UP = { f16: 1e30, f32: 1e39 } as const;

describe('a step whose update would make weights non-finite is skipped whole', () => {
  for (const dtype of ['f16', 'f32'] as const)
    for (const mode of ['lora', 'full'] as const)
      for (const placement of ['resident', 'streamed'] as const)
        it(`${mode} [${dtype}], ${placement} optimizer chunks, lr ${BLOW_UP[dtype]}: nothing changes, the reason names the update`, async () => {
          const gpu = await testGpu();
          const store = new CountingStore();
          const lr = BLOW_UP[dtype];
          const { trainer, fx, free } = await makeTrainer(gpu, dtype, mode, store, { lr, residentChunks: placement === 'resident' ? Infinity : 0 });
          assert.equal(trainer.optimizer.storedChunks > 0, placement === 'streamed');
          const before = await snapshot(trainer, store);
          const scale = trainer.scaler.scale;
          store.resetCounters();
          const r = await trainer.trainStep(fx.inputs[0]);
          assert.equal(r.applied, false);
          assert.ok(Number.isFinite(r.loss), 'the loss itself was finite');
          assert.match(
            r.skipped ?? '',
            new RegExp(`the update would make weights non-finite.*\\(learning rate ${String(lr).replace('+', '\\+')} too high\\?\\)`),
          );
          assert.equal(trainer.scaler.scale, scale, 'not a gradient overflow: the loss scale stays');
          assert.equal(trainer.appliedSteps, 0);
          assertSame(await snapshot(trainer, store), before);
          await assertFinite(trainer);
          assert.equal(store.writtenBytes, 0, 'nothing written to the store');
          // Streamed chunks could not be proven safe by their bound, so they were checked exactly (read once each).
          assert.equal(store.readBytes > 0, placement === 'streamed');
          free();
        });

  it('a normal learning rate: every step applied, each streamed chunk read and written once per step', async () => {
    const gpu = await testGpu();
    const store = new CountingStore();
    const { trainer, fx, free } = await makeTrainer(gpu, 'f16', 'full', store, { residentChunks: 1 });
    const storedElems = trainer.optimizer.chunks.filter((c) => !c.resident).reduce((n, c) => n + c.elems, 0);
    assert.ok(storedElems > 0);
    for (let s = 0; s < 3; s++) {
      store.resetCounters();
      const r = await trainer.trainStep(fx.inputs[s]);
      assert.ok(r.applied, `step ${s + 1}: ${r.skipped}`);
      // The bound proved every streamed chunk safe: no extra read for an exact check.
      assert.equal(store.readBytes, 12 * storedElems, `step ${s + 1} reads`);
      assert.equal(store.writtenBytes, 12 * storedElems, `step ${s + 1} writes`);
    }
    assert.equal(trainer.appliedSteps, 3);
    free();
  });
});

describe('skipped steps in a row stop the run (TrainingStalledError)', () => {
  const stalled = (n: number, reason: RegExp) => (e: unknown) => {
    assert.ok(e instanceof TrainingStalledError, `got ${e}`);
    assert.equal(e.name, 'TrainingStalledError');
    assert.equal(e.skippedInARow, n);
    assert.match(e.message, new RegExp(`${n} steps in a row were skipped`));
    assert.match(e.message, reason);
    assert.match(e.message, /Lower the learning rate \(--lr \/ Learning rate\), check the model's weights, or use f32/);
    return true;
  };

  it('lora [f16], lr 1e30, maxConsecutiveSkips 3: two skipped reports, the third skip throws; weights as they started', async () => {
    const gpu = await testGpu();
    const store = new MemoryChunkStore();
    const { trainer, fx, free } = await makeTrainer(gpu, 'f16', 'lora', store, { lr: 1e30, maxConsecutiveSkips: 3 });
    const before = await snapshot(trainer, store);
    for (let s = 0; s < 2; s++) assert.equal((await trainer.trainStep(fx.inputs[s])).applied, false);
    await assert.rejects(trainer.trainStep(fx.inputs[2]), stalled(3, /learning rate 1e\+30 too high\?/));
    assert.equal(trainer.appliedSteps, 0);
    assert.equal(trainer.step, 3);
    assertSame(await snapshot(trainer, store), before);
    await assertFinite(trainer);
    free();
  });

  it('full [f32], lr 1e30: whatever skips the steps, the run stops after 3 in a row and no weight is non-finite', async () => {
    const gpu = await testGpu();
    const { trainer, fx, free } = await makeTrainer(gpu, 'f32', 'full', new MemoryChunkStore(), { lr: 1e30, maxConsecutiveSkips: 3, residentChunks: 2 });
    let error: unknown;
    for (let s = 0; s < 8 && !error; s++) {
      try {
        await trainer.trainStep(fx.inputs[s]);
      } catch (e) {
        error = e;
      }
      await assertFinite(trainer);
    }
    assert.ok(error, 'the run stopped');
    stalled(3, /step skipped/)(error);
    assert.ok(trainer.step <= trainer.appliedSteps + 3, `${trainer.step} steps, ${trainer.appliedSteps} applied`);
    free();
  });

  it('an applied step resets the count (gradient overflows at a forced loss scale)', async () => {
    const gpu = await testGpu();
    const { trainer, fx, free } = await makeTrainer(gpu, 'f16', 'lora', new MemoryChunkStore(), { maxConsecutiveSkips: 3 });
    const overflow = async (s: number) => {
      trainer.scaler.scale = 2 ** 40; // the scaled gradients overflow f16
      return trainer.trainStep(fx.inputs[s]);
    };
    for (let s = 0; s < 2; s++) assert.match((await overflow(s)).skipped ?? '', /inf\/NaN in the gradients/);
    trainer.scaler.scale = 1024;
    assert.equal((await trainer.trainStep(fx.inputs[2])).applied, true);
    for (let s = 3; s < 5; s++) assert.equal((await overflow(s)).applied, false);
    await assert.rejects(overflow(5), stalled(3, /inf\/NaN in the gradients/));
    assert.equal(trainer.appliedSteps, 1);
    free();
  });

  it('the count survives a checkpoint: resumed after 2 skips, the next skip throws', async () => {
    const gpu = await testGpu();
    const store = new MemoryChunkStore();
    const over = { lr: 1e30, maxConsecutiveSkips: 3 };
    const a = await makeTrainer(gpu, 'f16', 'lora', store, over);
    for (let s = 0; s < 2; s++) await a.trainer.trainStep(a.fx.inputs[s]);
    await a.trainer.checkpoint();
    a.free();
    const b = await makeTrainer(gpu, 'f16', 'lora', store, over);
    assert.equal(await b.trainer.resume(), true);
    await assert.rejects(b.trainer.trainStep(b.fx.inputs[2]), stalled(3, /learning rate 1e\+30 too high\?/));
    b.free();
  });

  it('maxConsecutiveSkips must be a positive integer', async () => {
    const gpu = await testGpu();
    await assert.rejects(
      makeTrainer(gpu, 'f32', 'lora', new MemoryChunkStore(), { maxConsecutiveSkips: 0 }),
      /maxConsecutiveSkips .* must be a positive integer, got 0/,
    );
  });
});
