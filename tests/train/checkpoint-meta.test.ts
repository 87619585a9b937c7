// A checkpoint's record is checked before anything is restored (trainer.resume -> checkCheckpointMeta): a
// record edited or damaged so that it cannot be true (a step past the run, losses that do not match the
// steps, a chunk version for a chunk the layout lacks, a negative loss scale) is refused with CheckpointError,
// and the trainer is left as it was (step 0, weights untouched); the unedited record resumes.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { MemoryChunkStore } from '../../src/store/chunkstore.ts';
import { commitSnapshot, openSnapshot } from '../../src/store/snapshot.ts';
import { CheckpointError } from '../../src/train/trainer.ts';
import { testGpu } from '../helpers.ts';
import { makeTrainer } from './tiny-trainer.ts';

type Meta = Record<string, unknown> & {
  step: number;
  losses: unknown[];
  settings: { steps: number };
  scaler: { scale: number };
  versions: Record<string, number>;
};

const EDITS: [string, (m: Meta) => void, RegExp][] = [
  ['a step past the run', (m) => (m.step = m.settings.steps + 5), /step \d+ is not within 0\.\.\d+/],
  ['a fractional step', (m) => (m.step = 1.5), /step 1\.5 is not within/],
  ['losses that do not match the steps', (m) => m.losses.pop(), /losses for 2 steps/],
  ['more applied steps than steps', (m) => (m.applied = 7), /7 applied steps at step 2/],
  ['a negative loss scale', (m) => (m.scaler.scale = -1), /loss scale/],
  [
    'a GEMM config no device has',
    (m) => (m.gemm = { registerBlock: 5, fillWorkgroups: 8, splitK: false, bk: 16, prefetch: false }),
    /GEMM config: registerBlock is 5, expected one of 8, 4/,
  ],
  ['a version for a chunk the layout lacks', (m) => (m.versions = { ...m.versions, 999: 1 }), /chunk 999 version 1 for a layout of \d+ chunks/],
];

describe('checkpoint records are validated, not trusted', () => {
  for (const [what, edit, message] of EDITS)
    it(`${what}: refused, nothing restored`, async () => {
      const gpu = await testGpu();
      const store = new MemoryChunkStore();
      const a = await makeTrainer(gpu, 'f32', 'full', store, { residentChunks: 1 });
      for (let s = 0; s < 2; s++) await a.trainer.trainStep(a.fx.inputs[s]);
      await a.trainer.checkpoint();
      a.free();
      // Rewrite the record with the same files: only the meta changes (checksums stay valid).
      const snap = (await openSnapshot<Meta>(store, 'run/ckpt'))!;
      const files = new Map<string, Uint8Array>();
      for (const n of snap.names) files.set(n, await snap.read(n));
      const meta = structuredClone(snap.meta);
      edit(meta);
      await commitSnapshot(store, 'run/ckpt', files, meta);

      const b = await makeTrainer(gpu, 'f32', 'full', store, { residentChunks: 1 });
      const name = [...b.trainer.trainable.keys()][0];
      const before = await gpu.read(b.trainer.trainable.get(name)!);
      await assert.rejects(
        b.trainer.resume(),
        (e: Error) => e instanceof CheckpointError && /last checkpoint is damaged/.test(e.message) && message.test(e.message),
      );
      assert.equal(b.trainer.step, 0);
      assert.deepEqual(await gpu.read(b.trainer.trainable.get(name)!), before, 'weights untouched');
      b.free();
    });

  it('the unedited record resumes at its step', async () => {
    const gpu = await testGpu();
    const store = new MemoryChunkStore();
    const a = await makeTrainer(gpu, 'f32', 'full', store, { residentChunks: 1 });
    for (let s = 0; s < 2; s++) await a.trainer.trainStep(a.fx.inputs[s]);
    await a.trainer.checkpoint();
    a.free();
    const b = await makeTrainer(gpu, 'f32', 'full', store, { residentChunks: 1 });
    assert.equal(await b.trainer.resume(), true);
    assert.equal(b.trainer.step, 2);
    b.free();
  });

  it('a resume applies the GEMM config the run trained with (split-K changes the order of sums), whatever the device has since', async () => {
    const gpu = await testGpu();
    const before = gpu.gemmConfig;
    const trained = { registerBlock: 4, fillWorkgroups: 64, splitK: true, bk: 32, prefetch: true, direct: false } as const;
    try {
      gpu.setGemmConfig(trained);
      const store = new MemoryChunkStore();
      const a = await makeTrainer(gpu, 'f32', 'full', store, { residentChunks: 1 });
      for (let s = 0; s < 2; s++) await a.trainer.trainStep(a.fx.inputs[s]);
      await a.trainer.checkpoint();
      a.free();
      gpu.setGemmConfig({ registerBlock: 8, fillWorkgroups: 8, splitK: false, bk: 16, prefetch: false, direct: true }); // as if this adapter's tuning had changed
      const b = await makeTrainer(gpu, 'f32', 'full', store, { residentChunks: 1 });
      assert.equal(await b.trainer.resume(), true);
      assert.deepEqual(gpu.gemmConfig, trained);
      b.free();
    } finally {
      gpu.setGemmConfig(before);
    }
  });
});
