// The offload-stream page of bench/train.ts (headless Chromium): how fast optimizer chunks move through
// IndexedDB, raw and through IdbChunkStore, in the same page and the same profile.
//   raw      plain IndexedDB: one put / get per chunk in its own transaction, the bytes as a Blob with
//            strict durability: the record format and flush the store uses, without the store's work;
//   raw-ab   plain IndexedDB with the bytes as an ArrayBuffer and the browser's default durability
//            (the naive way to do it), for context;
//   store    IdbChunkStore.write / read: key checks, CRC-32 on write and verify on read, the sizes record
//            in the same transaction.
// Chunks are incompressible (Chrome compresses large IndexedDB values; zeros would time the compressor).
// Each repetition writes a fresh key, reads it back (the bytes as an ArrayBuffer in the page), then
// deletes it outside the timed region. One untimed round per size warms every database up (the first
// write to a new database pays for creating its files), and the implementations take turns going first.
import { IdbChunkStore } from '../src/store/idb-store.ts';

export interface IdbBenchOptions {
  sizesMiB: number[];
  reps: number;
}

export interface IdbTiming {
  impl: 'raw' | 'raw-ab' | 'store';
  mib: number;
  writeMs: number[];
  readMs: number[];
}

function randomBytes(mib: number, seed: number): Uint8Array {
  const d = new Uint8Array(mib << 20);
  const words = new Uint32Array(d.buffer);
  for (let i = 0, x = seed >>> 0; i < words.length; i++) words[i] = x = (Math.imul(x, 1664525) + 1013904223) >>> 0;
  return d;
}

function request<T>(r: IDBRequest<T>): Promise<T> {
  return new Promise((res, rej) => {
    r.onsuccess = () => res(r.result);
    r.onerror = () => rej(r.error);
  });
}

function committed(tx: IDBTransaction): Promise<void> {
  return new Promise((res, rej) => {
    tx.oncomplete = () => res();
    tx.onabort = tx.onerror = () => rej(tx.error);
  });
}

async function openRaw(name: string): Promise<IDBDatabase> {
  const req = indexedDB.open(name, 1);
  req.onupgradeneeded = () => req.result.createObjectStore('chunks');
  return request(req);
}

/** Plain IndexedDB put and get of one chunk (Blob + strict, or ArrayBuffer + default durability). */
function rawChunks(db: IDBDatabase, asBlob: boolean) {
  return {
    async write(key: string, data: Uint8Array): Promise<void> {
      const tx = db.transaction('chunks', 'readwrite', asBlob ? { durability: 'strict' } : undefined);
      const done = committed(tx);
      tx.objectStore('chunks').put(asBlob ? new Blob([data as Uint8Array<ArrayBuffer>]) : data.slice().buffer, key);
      await done;
    },
    async read(key: string): Promise<Uint8Array> {
      const v = (await request(db.transaction('chunks').objectStore('chunks').get(key))) as Blob | ArrayBuffer;
      return new Uint8Array(v instanceof Blob ? await v.arrayBuffer() : v);
    },
    async delete(key: string): Promise<void> {
      const tx = db.transaction('chunks', 'readwrite');
      const done = committed(tx);
      tx.objectStore('chunks').delete(key);
      await done;
    },
  };
}

async function idb(o: IdbBenchOptions): Promise<{ timings: IdbTiming[]; userAgent: string }> {
  const raw = rawChunks(await openRaw('bench-raw'), true);
  const rawAb = rawChunks(await openRaw('bench-raw-ab'), false);
  const store = await IdbChunkStore.open('bench-store');
  const impls = { raw, 'raw-ab': rawAb, store } as const;
  const timings: IdbTiming[] = [];
  for (const mib of o.sizesMiB) {
    const rows = Object.fromEntries(Object.keys(impls).map((k) => [k, { impl: k, mib, writeMs: [], readMs: [] } as IdbTiming]));
    const names = Object.keys(impls) as (keyof typeof impls)[];
    for (let rep = -1; rep < o.reps; rep++) {
      const data = randomBytes(mib, 2 + rep * 7 + mib);
      // Interleaved per repetition, so a slower disk phase hits every implementation alike; rotated, so
      // none always follows another's write-back. Repetition -1 is the warm-up.
      for (let j = 0; j < names.length; j++) {
        const name = names[(j + Math.max(rep, 0)) % names.length];
        const impl = impls[name];
        const key = `bench/m${mib}/r${rep + 1}`;
        const t0 = performance.now();
        await impl.write(key, data);
        const t1 = performance.now();
        const back = await impl.read(key);
        const t2 = performance.now();
        if (!back || back.length !== data.length || back[data.length - 1] !== data[data.length - 1])
          throw new Error(`${name}: ${mib} MiB chunk did not round-trip`);
        if (rep >= 0) {
          rows[name].writeMs.push(t1 - t0);
          rows[name].readMs.push(t2 - t1);
        }
        await impl.delete(key);
      }
    }
    timings.push(...Object.values(rows));
  }
  await store.close();
  return { timings, userAgent: navigator.userAgent };
}

(window as unknown as { __trainBench: unknown }).__trainBench = { idb };
