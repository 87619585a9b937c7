// Browser host: the download cache in IndexedDB (idb-keyval). A file is stored as a list of Blob chunks
// under `<key>#<n>` plus a small record; partial downloads live under `partial:<key>` until `commit`
// moves the record to `file:<key>` in one write, so an interrupted download is never visible as a file.
// Reading assembles the chunk Blobs into one (lazy) Blob: multi-GB files never sit in one ArrayBuffer.
import { createStore, del, get, set, type UseStore } from 'idb-keyval';
import type { DownloadCache } from './hub.ts';
import { BlobSource } from './source.ts';

interface Record_ {
  chunks: number;
  size: number;
}

export function idbDownloadCache(dbName = 'dreambooth-studio-downloads'): DownloadCache {
  const store: UseStore = createStore(dbName, 'files');
  const partial = (key: string) => `partial:${key}`;
  const file = (key: string) => `file:${key}`;
  const chunk = (key: string, n: number) => `chunk:${key}#${n}`;
  return {
    async partialSize(key) {
      return ((await get<Record_>(partial(key), store)) ?? { size: 0 }).size;
    },
    async appendPartial(key, bytes) {
      const rec = (await get<Record_>(partial(key), store)) ?? { chunks: 0, size: 0 };
      await set(chunk(key, rec.chunks), new Blob([new Uint8Array(bytes)]), store);
      await set(partial(key), { chunks: rec.chunks + 1, size: rec.size + bytes.length }, store);
    },
    async dropPartial(key) {
      const rec = await get<Record_>(partial(key), store);
      await del(partial(key), store);
      if (rec) for (let i = 0; i < rec.chunks; i++) await del(chunk(key, i), store);
    },
    async commit(key) {
      const rec = (await get<Record_>(partial(key), store)) ?? { chunks: 0, size: 0 };
      await set(file(key), rec, store);
      await del(partial(key), store);
    },
    async open(key) {
      const rec = await get<Record_>(file(key), store);
      if (!rec) return null;
      const parts: Blob[] = [];
      for (let i = 0; i < rec.chunks; i++) {
        const b = await get<Blob>(chunk(key, i), store);
        if (!b) return null; // evicted storage: treat as not cached
        parts.push(b);
      }
      return new BlobSource(new Blob(parts), key.split('/').pop() ?? key);
    },
  };
}
