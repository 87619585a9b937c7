// The three chunk store implementations behind one test-side interface, so the contract suite
// (contract.ts) and the snapshot suite run unchanged against each. Each harness knows how to damage a
// stored chunk the way a bad disk would, and (where the store persists) how to reopen the same storage.
import 'fake-indexeddb/auto';
import { mkdtempSync, readFileSync, rmSync, truncateSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { MemoryChunkStore, type ChunkStore } from '../../src/store/chunkstore.ts';
import { chunkFileName, FsChunkStore } from '../../src/store/fs-store.ts';
import { IdbChunkStore } from '../../src/store/idb-store.ts';

export type Damage = 'flip' | 'truncate';

export interface StoreHarness {
  label: string;
  /** A new, empty store. */
  fresh(opts?: { quotaBytes?: number }): Promise<ChunkStore>;
  /** Closes `store` and opens the same storage again (absent for the memory store, which does not persist). */
  reopen?(store: ChunkStore, opts?: { quotaBytes?: number }): Promise<ChunkStore>;
  /** Damages the stored bytes of `key` underneath the store (its recorded length and checksum stay). */
  damage(store: ChunkStore, key: string, how: Damage): Promise<void>;
  /** Removes everything the harness created. */
  cleanup(): Promise<void>;
}

function damageBytes(bytes: Uint8Array, how: Damage): Uint8Array<ArrayBuffer> {
  if (how === 'truncate') return bytes.slice(0, Math.max(0, bytes.length - 7));
  const out = bytes.slice();
  out[out.length >> 1] ^= 0x40;
  return out;
}

export function memoryHarness(): StoreHarness {
  return {
    label: 'memory',
    fresh: async (opts = {}) => new MemoryChunkStore('test', opts),
    damage: async (store, key, how) => (store as MemoryChunkStore).damageForTest(key, (b) => damageBytes(b, how)),
    cleanup: async () => {},
  };
}

export function fsHarness(): StoreHarness {
  const root = mkdtempSync(join(tmpdir(), 'dbs-store-'));
  let n = 0;
  return {
    label: 'fs',
    fresh: (opts = {}) => FsChunkStore.open(join(root, `s${n++}`), opts),
    reopen: async (store, opts = {}) => {
      await store.close();
      return FsChunkStore.open((store as FsChunkStore).dir, opts);
    },
    // On disk: the payload follows a 16-byte header; damage the payload bytes of the real file.
    damage: async (store, key, how) => {
      const file = join((store as FsChunkStore).dir, chunkFileName(key));
      if (how === 'truncate') truncateSync(file, readFileSync(file).length - 7);
      else {
        const bytes = readFileSync(file);
        bytes[16 + ((bytes.length - 16) >> 1)] ^= 0x40;
        writeFileSync(file, bytes);
      }
    },
    cleanup: async () => rmSync(root, { recursive: true, force: true }),
  };
}

let idbCount = 0;

export function idbHarness(storeAs: 'blob' | 'arraybuffer' = 'blob'): StoreHarness {
  return {
    label: `indexeddb (${storeAs}, fake-indexeddb)`,
    fresh: (opts = {}) => IdbChunkStore.open(`dbs-test-${process.pid}-${idbCount++}`, { ...opts, storeAs }),
    reopen: async (store, opts = {}) => {
      await store.close();
      return IdbChunkStore.open(store.name, { ...opts, storeAs });
    },
    // Reach in with the raw IndexedDB API: rewrite the record's bytes, keep its length and CRC fields.
    damage: async (store, key, how) => {
      const db = await rawOpen(store.name);
      try {
        const rec = await requestResult<{ data: Blob | ArrayBuffer }>(db.transaction('chunks', 'readonly').objectStore('chunks').get(key));
        const bytes = rec.data instanceof Blob ? new Uint8Array(await rec.data.arrayBuffer()) : new Uint8Array(rec.data);
        const bad = damageBytes(bytes, how);
        const tx2 = db.transaction('chunks', 'readwrite');
        tx2.objectStore('chunks').put({ ...rec, data: rec.data instanceof Blob ? new Blob([bad]) : bad.buffer }, key);
        await new Promise<void>((resolve, reject) => {
          tx2.oncomplete = () => resolve();
          tx2.onabort = () => reject(tx2.error);
        });
      } finally {
        db.close();
      }
    },
    cleanup: async () => {},
  };
}

export function rawOpen(name: string): Promise<IDBDatabase> {
  return requestResult(indexedDB.open(name));
}

export function requestResult<T = unknown>(req: IDBRequest): Promise<T> {
  return new Promise((resolve, reject) => {
    req.onsuccess = () => resolve(req.result as T);
    req.onerror = () => reject(req.error);
  });
}

export const ALL_HARNESSES = (): StoreHarness[] => [memoryHarness(), fsHarness(), idbHarness('blob'), idbHarness('arraybuffer')];

/** Deterministic, non-repeating test bytes (a LCG), so a misplaced range can never compare equal by accident. */
export function testBytes(n: number, seed = 1): Uint8Array<ArrayBuffer> {
  const out = new Uint8Array(n);
  let x = seed >>> 0 || 1;
  const words = new Uint32Array(out.buffer, 0, n >>> 2);
  for (let i = 0; i < words.length; i++) {
    x = (Math.imul(x, 1664525) + 1013904223) >>> 0;
    words[i] = x;
  }
  for (let i = words.length * 4; i < n; i++) out[i] = (seed + i) & 0xff;
  return out;
}
