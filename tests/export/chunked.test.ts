// chunkedProvider: a full fine-tune's fp32 masters for the exporters, one optimizer chunk at a time, over the
// real optimizer of a trained tiny UNet (resident chunks on the GPU, the rest in the chunk store).
import assert from 'node:assert/strict';
import { after, describe, it } from 'node:test';
import { chunkedProvider } from '../../src/export/chunked.ts';
import { ExportError } from '../../src/export/provider.ts';
import { MemoryChunkStore } from '../../src/store/chunkstore.ts';
import { testGpu } from '../helpers.ts';
import { makeTrainer } from '../train/tiny-trainer.ts';

// One trained step (the masters differ from the loaded weights), shared by the tests: lavapipe is slow.
let run: ReturnType<typeof makeTrainer> | undefined;
async function trained() {
  run ??= (async () => {
    const t = await makeTrainer(await testGpu(), 'f32', 'full', new MemoryChunkStore(), { residentChunks: 2 });
    await t.trainer.trainStep(t.fx.inputs[0]);
    assert.ok(t.trainer.optimizer.chunks.length > 3 && t.trainer.optimizer.storedChunks > 0, 'the fixture needs resident and stored chunks');
    return t;
  })();
  return run;
}
after(async () => (await run)?.free());

describe('export/chunked: trained values one optimizer chunk at a time', () => {
  it("gives every trained tensor equal to the masters, in the trainer's order, resident and stored chunks, LRU of 1", async () => {
    const { trainer } = await trained();
    const all = await trainer.trainedValues();
    const p = chunkedProvider(trainer.optimizer, 1);
    assert.deepEqual(p.names(), [...trainer.trainable.keys()]);
    // Reverse order: every read misses the one-chunk cache at chunk boundaries and must still be right.
    for (const n of [...p.names()].reverse()) {
      assert.deepEqual(await p.read(n), all.get(n), n);
      assert.deepEqual(p.shape(n), [...trainer.trainable.get(n)!.shape], n);
    }
  });

  it('reads each chunk once for an export in chunk order, and keeps at most cacheChunks', async () => {
    const { trainer } = await trained();
    const opt = trainer.optimizer;
    const reads: number[] = [];
    const counted = { chunks: opt.chunks, chunkMasters: (i: number) => (reads.push(i), opt.chunkMasters(i)) };
    const inOrder = chunkedProvider(counted, 1);
    for (const n of inOrder.names()) await inOrder.read(n);
    assert.deepEqual(
      reads,
      opt.chunks.map((c) => c.index),
    );
    // Two chunks alternately under a cache of 2: read once each; under a cache of 1: read every time.
    const first = opt.chunks[0].params[0].name;
    const last = opt.chunks.at(-1)!.params[0].name;
    for (const [cache, expected] of [
      [2, 2],
      [1, 6],
    ] as const) {
      reads.length = 0;
      const p = chunkedProvider(counted, cache);
      for (let k = 0; k < 3; k++) {
        await p.read(first);
        await p.read(last);
      }
      assert.equal(reads.length, expected, `cache of ${cache}`);
    }
  });

  it('refuses an unknown tensor and a cache of no chunks by name', async () => {
    const { trainer } = await trained();
    const p = chunkedProvider(trainer.optimizer);
    await assert.rejects(p.read('nope.weight'), (e: Error) => e instanceof ExportError && /'nope\.weight'/.test(e.message));
    assert.throws(
      () => p.shape('nope.weight'),
      (e: Error) => e instanceof ExportError && /'nope\.weight'/.test(e.message),
    );
    assert.throws(
      () => chunkedProvider(trainer.optimizer, 0),
      (e: Error) => e instanceof ExportError && /cacheChunks must be a positive integer, got 0/.test(e.message),
    );
  });
});
