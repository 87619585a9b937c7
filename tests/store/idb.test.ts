// The IndexedDB store on fake-indexeddb: the shared contract (Blob and ArrayBuffer storage), plus
// transaction atomicity and how browser quota errors surface. e2e/store.test.ts runs it in real Chromium.
import 'fake-indexeddb/auto';
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { ChunkStoreError, StorageFullError } from '../../src/store/chunkstore.ts';
import { IdbChunkStore, storagePersistence } from '../../src/store/idb-store.ts';
import { defineContractSuite } from './contract.ts';
import { idbHarness, rawOpen, requestResult, testBytes } from './harnesses.ts';

defineContractSuite(idbHarness('blob'));
defineContractSuite(idbHarness('arraybuffer'));

let n = 0;
const fresh = () => IdbChunkStore.open(`dbs-idb-extra-${n++}`);

describe('IdbChunkStore specifics', () => {
  it('an aborted transaction (a crash mid-write) leaves the old record', async () => {
    const s = await fresh();
    await s.write('run/w/0000', testBytes(3000, 1));
    // A write that never commits: both records put, then the transaction dies (tab closed, crash).
    const db = await rawOpen(s.name);
    const tx = db.transaction(['chunks', 'sizes'], 'readwrite');
    tx.objectStore('chunks').put({ data: new Blob([testBytes(10, 2)]), length: 10, crc32: 0 }, 'run/w/0000');
    tx.objectStore('sizes').put(10, 'run/w/0000');
    tx.abort();
    await new Promise((r) => (tx.onabort = r));
    db.close();
    assert.deepEqual(await s.read('run/w/0000'), testBytes(3000, 1));
    assert.equal(await s.bytesUsed(), 3000);
  });

  it('keeps byte counts in their own object store, so bytesUsed/keys read no chunk data', async () => {
    const s = await fresh();
    await s.write('a', testBytes(123, 1));
    const db = await rawOpen(s.name);
    assert.deepEqual([...db.objectStoreNames].sort(), ['chunks', 'sizes']);
    assert.equal(await requestResult(db.transaction('sizes').objectStore('sizes').get('a')), 123);
    const rec = await requestResult<{ data: Blob | ArrayBuffer }>(db.transaction('chunks').objectStore('chunks').get('a'));
    assert.ok(rec.data instanceof Blob, 'stored as a Blob by default');
    db.close();
  });

  it('keySizes lists every key with its chunk length (the runs list sums them per run)', async () => {
    const s = await fresh();
    await s.write('run-b/x', testBytes(7, 1));
    await s.write('run-a/latents', testBytes(100, 2));
    await s.write('run-a/ckpt', testBytes(30, 3));
    await s.write('run-a/ckpt', testBytes(40, 4));
    assert.deepEqual(await s.keySizes(), [
      ['run-a/ckpt', 40],
      ['run-a/latents', 100],
      ['run-b/x', 7],
    ]);
    await s.delete('run-b/x');
    assert.deepEqual(
      (await s.keySizes()).map(([k]) => k),
      ['run-a/ckpt', 'run-a/latents'],
    );
  });

  it('maps a QuotaExceededError thrown by put() to StorageFullError, old version intact', async () => {
    const s = await fresh();
    await s.write('run/opt/0001', testBytes(500, 1));
    const put = IDBObjectStore.prototype.put;
    IDBObjectStore.prototype.put = function () {
      throw new DOMException('The quota has been exceeded.', 'QuotaExceededError');
    };
    try {
      await assert.rejects(s.write('run/opt/0001', testBytes(900, 2)), (e: unknown) => {
        assert.ok(e instanceof StorageFullError, String(e));
        assert.match(e.message, /could not write 900 bytes for chunk "run\/opt\/0001" \(the browser refused more storage for this site\)/);
        assert.equal((e.cause as DOMException).name, 'QuotaExceededError');
        return true;
      });
    } finally {
      IDBObjectStore.prototype.put = put;
    }
    assert.deepEqual(await s.read('run/opt/0001'), testBytes(500, 1));
  });

  it('maps a transaction aborted with QuotaExceededError (how Chrome reports it at commit) to StorageFullError', async () => {
    const s = await fresh();
    await s.write('k', testBytes(500, 1));
    const put = IDBObjectStore.prototype.put;
    // fake-indexeddb's internal abort-with-error, the path a failed commit takes in a browser.
    IDBObjectStore.prototype.put = function (this: IDBObjectStore, ...args: Parameters<IDBObjectStore['put']>) {
      const req = put.apply(this, args);
      const tx = this.transaction as unknown as { _abort(name: string): void; _state: string };
      queueMicrotask(() => tx._state !== 'finished' && tx._abort('QuotaExceededError'));
      return req;
    };
    try {
      await assert.rejects(s.write('k', testBytes(700, 2)), (e: unknown) => e instanceof StorageFullError && e.bytes === 700 && e.key === 'k');
    } finally {
      IDBObjectStore.prototype.put = put;
    }
    assert.deepEqual(await s.read('k'), testBytes(500, 1));
  });

  it('other failures are ChunkStoreErrors naming the key', async () => {
    const s = await fresh();
    const put = IDBObjectStore.prototype.put;
    IDBObjectStore.prototype.put = function () {
      throw new DOMException('could not clone', 'DataCloneError');
    };
    try {
      await assert.rejects(
        s.write('k/1', testBytes(5)),
        (e: unknown) =>
          e instanceof ChunkStoreError && e.key === 'k/1' && /could not write chunk "k\/1" \(5 bytes\) to IndexedDB .*DataCloneError/.test(e.message),
      );
    } finally {
      IDBObjectStore.prototype.put = put;
    }
    assert.equal(await s.read('k/1'), null);
  });

  it('closes itself for another tab upgrading the database, then fails clearly', async () => {
    const s = await fresh();
    await s.write('a', testBytes(4));
    const upgrade = indexedDB.open(s.name, 2);
    const db = await requestResult<IDBDatabase>(upgrade);
    db.close();
    await assert.rejects(s.read('a'), /closed because another tab upgraded or deleted the database/);
  });

  it('storagePersistence is null-safe without navigator.storage', async () => {
    const p = await storagePersistence();
    assert.equal(p.persisted, false);
  });

  it('storagePersistence reports what navigator.storage says', async () => {
    const desc = Object.getOwnPropertyDescriptor(globalThis, 'navigator');
    Object.defineProperty(globalThis, 'navigator', {
      configurable: true,
      value: { storage: { persisted: async () => true, estimate: async () => ({ quota: 1e9, usage: 2e8 }) } },
    });
    try {
      assert.deepEqual(await storagePersistence(), { persisted: true, quota: 1e9, usage: 2e8 });
    } finally {
      if (desc) Object.defineProperty(globalThis, 'navigator', desc);
      else delete (globalThis as { navigator?: unknown }).navigator;
    }
  });
});
