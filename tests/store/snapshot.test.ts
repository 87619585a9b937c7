// Snapshots (checkpoint sets) on every store: commits replace the set atomically, failures and crashes at
// any point before HEAD keep the previous snapshot readable, and leftovers are cleaned up.
import assert from 'node:assert/strict';
import { after, describe, it } from 'node:test';
import { ChunkStoreError, MemoryChunkStore, StorageFullError, type ChunkStore } from '../../src/store/chunkstore.ts';
import { commitSnapshot, dropSnapshots, headKey, openSnapshot, SnapshotBindingError } from '../../src/store/snapshot.ts';
import { fsHarness, idbHarness, memoryHarness, testBytes, type StoreHarness } from './harnesses.ts';

const files = (seed: number, sizes = [3000, 10, 5000]): Map<string, Uint8Array> => new Map(sizes.map((n, i) => [`f${i}.bin`, testBytes(n, seed * 10 + i)]));

async function* streamed(m: Map<string, Uint8Array>): AsyncIterable<[string, Uint8Array]> {
  for (const e of m) {
    await new Promise((r) => setTimeout(r, 1)); // a producer that takes its time (GPU read-back)
    yield e;
  }
}

async function assertSnapshot(store: ChunkStore, prefix: string, seq: number, expected: Map<string, Uint8Array>, meta: object): Promise<void> {
  const snap = await openSnapshot(store, prefix);
  assert.ok(snap, 'a snapshot is there');
  assert.equal(snap.seq, seq);
  assert.deepEqual(snap.meta, meta);
  assert.deepEqual(snap.names, [...expected.keys()]);
  for (const [name, data] of expected) assert.deepEqual(await snap.read(name), data, name);
}

/** Snapshot-file keys under prefix (HEAD and other data excluded). */
const snapshotKeys = async (s: ChunkStore, prefix: string) => (await s.keys(`${prefix}/s`)).filter((k) => /\/s\d+\//.test(k));

/** `inner` with some methods replaced; every other call goes to `inner` itself. */
function wrap(inner: ChunkStore, over: Partial<Pick<ChunkStore, 'write' | 'delete'>>): ChunkStore {
  return {
    kind: inner.kind,
    name: inner.name,
    write: over.write ?? ((k, d) => inner.write(k, d)),
    read: (k) => inner.read(k),
    delete: over.delete ?? ((k) => inner.delete(k)),
    keys: (p) => inner.keys(p),
    bytesUsed: () => inner.bytesUsed(),
    close: () => inner.close(),
  };
}

/** A store that fails its nth write (counting from 1) with the given error; that write does not happen. */
function failingOnWrite(inner: ChunkStore, nth: number, error: () => Error): ChunkStore {
  let writes = 0;
  return wrap(inner, {
    write: async (key, data) => {
      if (++writes === nth) throw error();
      return inner.write(key, data);
    },
  });
}

function defineSnapshotSuite(h: StoreHarness): void {
  describe(`snapshots on ${h.label}`, () => {
    after(() => h.cleanup());

    it('commits, reopens, and deletes the previous snapshot’s chunks after a commit', async () => {
      const s = await h.fresh();
      assert.equal(await openSnapshot(s, 'run-abc/ckpt'), null);
      assert.equal(await commitSnapshot(s, 'run-abc/ckpt', files(1), { step: 100 }), 1);
      await assertSnapshot(s, 'run-abc/ckpt', 1, files(1), { step: 100 });
      assert.equal(await commitSnapshot(s, 'run-abc/ckpt', streamed(files(2, [7, 8])), { step: 200, lr: 1e-4 }), 2);
      await assertSnapshot(s, 'run-abc/ckpt', 2, files(2, [7, 8]), { step: 200, lr: 1e-4 });
      assert.deepEqual(await snapshotKeys(s, 'run-abc/ckpt'), ['run-abc/ckpt/s000002/f0.bin', 'run-abc/ckpt/s000002/f1.bin']);
      assert.equal(await s.bytesUsed(), 15 + (await s.read(headKey('run-abc/ckpt')))!.length);
      const snap = await openSnapshot(s, 'run-abc/ckpt');
      assert.deepEqual(
        snap?.files.map((f) => f.bytes),
        [7, 8],
      );
      assert.match(snap!.files[0].checksum, /^crc32:[0-9a-f]{8}$/);
    });

    it('a full disk in the middle of the third commit keeps the second readable and removes the partial files', async () => {
      const base = await h.fresh({ quotaBytes: 20_000 });
      await commitSnapshot(base, 'run/ckpt', files(1), { step: 1 });
      await commitSnapshot(base, 'run/ckpt', files(2), { step: 2 });
      const used = await base.bytesUsed();
      // 8000 + 9000 fits beside the second snapshot's ~8 KB, the third file does not.
      await assert.rejects(commitSnapshot(base, 'run/ckpt', files(3, [2000, 2000, 9000]), { step: 3 }), (e: unknown) => {
        assert.ok(e instanceof StorageFullError, String(e));
        assert.equal(e.key, 'run/ckpt/s000003/f2.bin');
        assert.match(e.message, /Free space .*then resume/);
        return true;
      });
      await assertSnapshot(base, 'run/ckpt', 2, files(2), { step: 2 });
      assert.deepEqual(
        (await snapshotKeys(base, 'run/ckpt')).filter((k) => k.includes('s000003')),
        [],
        'partial files deleted',
      );
      assert.equal(await base.bytesUsed(), used);
      // After freeing space (here: a smaller checkpoint) the next commit goes through as #3.
      assert.equal(await commitSnapshot(base, 'run/ckpt', files(4, [100]), { step: 4 }), 3);
      await assertSnapshot(base, 'run/ckpt', 3, files(4, [100]), { step: 4 });
    });

    it('a StorageFullError on HEAD itself also keeps the previous snapshot', async () => {
      const s = await h.fresh();
      await commitSnapshot(s, 'p', files(1), { step: 1 });
      const failing = failingOnWrite(s, 4, () => new StorageFullError('p/HEAD', 100)); // 3 files, then HEAD
      await assert.rejects(commitSnapshot(failing, 'p', files(2), { step: 2 }), StorageFullError);
      await assertSnapshot(s, 'p', 1, files(1), { step: 1 });
      assert.ok((await snapshotKeys(s, 'p')).every((k) => k.startsWith('p/s000001/')));
    });

    it('a crash before HEAD (partial files left) keeps the previous snapshot; open and the next commit clean up', async () => {
      const s = await h.fresh();
      await commitSnapshot(s, 'p', files(1), { step: 1 });
      await commitSnapshot(s, 'p', files(2), { step: 2 });
      // What a process killed mid-commit leaves: some files of #3, no HEAD change, no cleanup.
      await s.write('p/s000003/f0.bin', testBytes(50, 9));
      await s.write('p/s000003/f1.bin', testBytes(60, 9));
      await assertSnapshot(s, 'p', 2, files(2), { step: 2 });
      assert.deepEqual(
        (await snapshotKeys(s, 'p')).filter((k) => k.includes('s000003')),
        [],
        'openSnapshot removed the leftovers',
      );
      // Leftovers of a crashed attempt are also removed by the next commit (which reuses the number).
      await s.write('p/s000003/zzz.bin', testBytes(70, 9));
      assert.equal(await commitSnapshot(s, 'p', files(3, [5]), { step: 3 }), 3);
      assert.deepEqual(await snapshotKeys(s, 'p'), ['p/s000003/f0.bin']);
      await assertSnapshot(s, 'p', 3, files(3, [5]), { step: 3 });
    });

    it('a crash after HEAD but before the old files are deleted: the new snapshot is current, old files go later', async () => {
      const s = await h.fresh();
      await commitSnapshot(s, 'p', files(1), { step: 1 });
      const noDeletes = wrap(s, {
        delete: async () => {
          throw new Error('killed');
        },
      });
      assert.equal(await commitSnapshot(noDeletes, 'p', files(2, [11]), { step: 2 }), 2, 'the commit itself succeeded');
      assert.equal((await snapshotKeys(s, 'p')).filter((k) => k.startsWith('p/s000001/')).length, 3, 'old files still there');
      await assertSnapshot(s, 'p', 2, files(2, [11]), { step: 2 });
      assert.deepEqual(await snapshotKeys(s, 'p'), ['p/s000002/f0.bin']);
    });

    it('a producer failing mid-stream aborts the commit and keeps the previous snapshot', async () => {
      const s = await h.fresh();
      await commitSnapshot(s, 'p', files(1), { step: 1 });
      async function* broken(): AsyncIterable<[string, Uint8Array]> {
        yield ['a.bin', testBytes(100, 1)];
        throw new Error('GPU read-back failed');
      }
      await assert.rejects(commitSnapshot(s, 'p', broken(), { step: 2 }), /GPU read-back failed/);
      await assertSnapshot(s, 'p', 1, files(1), { step: 1 });
      assert.ok((await snapshotKeys(s, 'p')).every((k) => k.startsWith('p/s000001/')));
    });

    it('detects a file that does not match HEAD (checksum, size, missing) and unknown names', async () => {
      const s = await h.fresh();
      await commitSnapshot(s, 'p', files(1), { step: 1 });
      // Same length, other bytes: valid at the store level, wrong for this snapshot.
      await s.write('p/s000001/f0.bin', testBytes(3000, 999));
      await s.write('p/s000001/f1.bin', testBytes(11, 1));
      await s.delete('p/s000001/f2.bin');
      const snap = await openSnapshot(s, 'p');
      assert.ok(snap);
      await assert.rejects(
        snap.read('f0.bin'),
        (e: unknown) =>
          e instanceof ChunkStoreError && e.key === 'p/s000001/f0.bin' && /fails its checksum: crc32:[0-9a-f]{8}, the snapshot recorded crc32:/.test(e.message),
      );
      await assert.rejects(snap.read('f1.bin'), /has 11 bytes, the snapshot recorded 10/);
      await assert.rejects(snap.read('f2.bin'), /file "f2.bin" \(chunk "p\/s000001\/f2.bin"\) is missing from the store/);
      await assert.rejects(snap.read('nope.bin'), /has no file "nope.bin" \(it has: f0.bin, f1.bin, f2.bin\)/);
    });

    it('detects a chunk damaged underneath the store', async () => {
      const s = await h.fresh();
      await commitSnapshot(s, 'p', files(1), { step: 1 });
      await h.damage(s, 'p/s000001/f2.bin', 'flip');
      const snap = await openSnapshot(s, 'p');
      await assert.rejects(snap!.read('f2.bin'), (e: unknown) => e instanceof ChunkStoreError && e.key === 'p/s000001/f2.bin');
      assert.deepEqual(await snap!.read('f0.bin'), files(1).get('f0.bin'));
    });

    it('refuses a malformed HEAD, bad names, duplicate names and non-JSON meta without touching the snapshot', async () => {
      const s = await h.fresh();
      await commitSnapshot(s, 'p', files(1), { step: 1 });
      await assert.rejects(commitSnapshot(s, 'p', new Map([['../x', testBytes(1)]]), {}), /bad chunk key "p\/s000002\/..\/x"/);
      await assert.rejects(commitSnapshot(s, 'p', dup(), {}), /file "a" given twice/);
      await assert.rejects(commitSnapshot(s, 'p', files(2), { n: 1n } as object), /meta is not JSON-serialisable/);
      await assert.rejects(commitSnapshot(s, 'bad prefix', files(2), {}), /bad chunk key "bad prefix\/HEAD"/);
      await assertSnapshot(s, 'p', 1, files(1), { step: 1 });
      await s.write(headKey('q'), new TextEncoder().encode('{"seq":0,"files":[],"meta":{}}'));
      await assert.rejects(openSnapshot(s, 'q'), /snapshot record "q\/HEAD" is malformed: seq 0 is not a positive integer; dropSnapshots\("q"\)/);
      await s.write(headKey('q'), new TextEncoder().encode('{"seq":'));
      await assert.rejects(openSnapshot(s, 'q'), /snapshot record "q\/HEAD" is not valid JSON/);
      await assert.rejects(commitSnapshot(s, 'q', files(1), {}), ChunkStoreError);
      await dropSnapshots(s, 'q');
      assert.equal(await openSnapshot(s, 'q'), null);
    });

    it('dropSnapshots removes HEAD and every snapshot file, and nothing else under the prefix', async () => {
      const s = await h.fresh();
      await commitSnapshot(s, 'run', files(1), { step: 1 });
      await s.write('run/samples/0001', testBytes(9));
      await s.write('run/state', testBytes(9));
      await s.write('run/s000099/leftover', testBytes(9));
      await s.write('runner/s000001/x', testBytes(9)); // another prefix that merely starts the same
      await dropSnapshots(s, 'run');
      assert.equal(await openSnapshot(s, 'run'), null);
      assert.deepEqual(await s.keys(), ['run/samples/0001', 'run/state', 'runner/s000001/x']);
    });
  });
}

async function* dup(): AsyncIterable<[string, Uint8Array]> {
  yield ['a', testBytes(1)];
  yield ['a', testBytes(2)];
}

for (const h of [memoryHarness(), fsHarness(), idbHarness('blob')]) defineSnapshotSuite(h);

describe('snapshots: failing write on the store', () => {
  it('cleans up even when the failing write is the first file', async () => {
    const s = new MemoryChunkStore();
    await commitSnapshot(s, 'p', files(1), { step: 1 });
    await assert.rejects(
      commitSnapshot(
        failingOnWrite(s, 1, () => new StorageFullError('p/s000002/f0.bin', 3000)),
        'p',
        files(2),
        {},
      ),
      StorageFullError,
    );
    await assertSnapshot(s, 'p', 1, files(1), { step: 1 });
  });
});

describe('snapshots: a record bound to what was written', () => {
  /** HEAD rewritten through `edit` (a careful editor: the store's own checksum of the chunk is right). */
  async function editHead(s: ChunkStore, edit: (head: { meta: Record<string, unknown>; files: { bytes: number }[]; bind?: unknown }) => void) {
    const head = JSON.parse(new TextDecoder().decode((await s.read(headKey('p')))!));
    edit(head);
    await s.write(headKey('p'), new TextEncoder().encode(JSON.stringify(head)));
  }
  const meta = { step: 2, applied: 2, rng: 12345, losses: [0.5, 0.25] };

  it('refuses an edited counter, naming it and the value it was written with, and leaves the snapshot in place', async () => {
    const s = new MemoryChunkStore();
    await commitSnapshot(s, 'p', files(1), meta);
    await editHead(s, (h) => Object.assign(h.meta, { step: 5, losses: [0.5, 0.25, 0, 0, 0] }));
    const keys = await s.keys();
    await assert.rejects(
      openSnapshot(s, 'p'),
      (e: Error) => e instanceof SnapshotBindingError && /its record says step 5, but it was written at step 2/.test(e.message),
    );
    assert.deepEqual(await s.keys(), keys, 'nothing removed');
  });

  it('refuses a record whose bound copy was edited too (the digest), and an edited file list', async () => {
    const s = new MemoryChunkStore();
    await commitSnapshot(s, 'p', files(1), meta);
    await editHead(s, (h) => {
      h.meta.step = 1;
      (h.bind as { counters: Record<string, number> }).counters.step = 1;
    });
    await assert.rejects(openSnapshot(s, 'p'), /does not match the digest it was written with/);
    const t = new MemoryChunkStore();
    await commitSnapshot(t, 'p', files(1), meta);
    await editHead(t, (h) => (h.files[0].bytes += 1));
    await assert.rejects(openSnapshot(t, 'p'), /does not match the digest/);
  });

  it('opens an unedited record; refuses one whose binding was deleted (with or without an edit), changing nothing', async () => {
    const s = new MemoryChunkStore();
    await commitSnapshot(s, 'p', files(1), meta);
    await assertSnapshot(s, 'p', 1, files(1), meta);
    await editHead(s, (h) => delete h.bind);
    const keys = await s.keys();
    const unbound = (e: Error) => e instanceof SnapshotBindingError && /it has no binding to what was written/.test(e.message);
    await assert.rejects(openSnapshot(s, 'p'), unbound);
    await editHead(s, (h) => Object.assign(h.meta, { step: 1, applied: 1, losses: [0.5] }));
    await assert.rejects(openSnapshot(s, 'p'), unbound);
    assert.deepEqual(await s.keys(), keys, 'nothing removed');
  });
});
