// Browser host: the per-adapter GEMM tuning cache (src/ops/tune.ts) in IndexedDB (idb-keyval), one record per key.
import { createStore, get, set } from 'idb-keyval';
import type { TuningCache } from '../ops/tune.ts';

export function idbTuningCache(dbName = 'dreambooth-studio-tuning'): TuningCache {
  const store = createStore(dbName, 'gemm');
  return {
    async load(key) {
      const v = await get<unknown>(key, store);
      return v === undefined ? null : typeof v === 'string' ? v : JSON.stringify(v);
    },
    async save(key, value) {
      await set(key, value, store);
    },
  };
}
