// Browser host: the chunk store in IndexedDB (also runs in Node on fake-indexeddb, for tests).
//
// Two object stores in one database:
//   chunks: key -> { data, length, crc32 }   the bytes and their integrity check, one record per chunk
//   sizes:  key -> length                    small records, so keys() and bytesUsed() never load chunk data
// A write puts both records in one readwrite transaction. IndexedDB transactions are atomic, also across a
// crash or a closed tab, so a reader sees the old record pair or the new one, never a torn chunk. Writes ask
// for `durability: 'strict'` (flushed before `complete`), because a checkpoint's HEAD must be on disk
// before the older snapshot it replaces is deleted.
//
// Bytes as Blob (default) or ArrayBuffer, measured by e2e/store.test.ts (Chromium 156 headless, on-disk
// profile, incompressible data, 2-core VM, four runs): 64 MiB as Blob writes in 250-325 ms and reads +
// verifies in 70-90 ms; as ArrayBuffer it writes in 270-680 ms and reads + verifies in 120-180 ms. At 16 MiB
// the two are close (writes 70-180 vs 90-110 ms, reads 25-33 vs 34-37 ms). Chrome keeps IndexedDB Blobs as
// files beside the database and returns a file-backed Blob; large ArrayBuffers are also moved out of line
// ("large value wrapping") but are serialised and compressed on the way, which costs time on weights and
// optimizer states that do not compress. Both are charged to the origin's quota inside the write's
// transaction (a full quota aborts it with QuotaExceededError; tested with a lowered quota). Hence Blob;
// `storeAs: 'arraybuffer'` remains for comparison.
import {
  ChunkStoreError,
  chunkCheck,
  checkQuota,
  isQuotaError,
  sortedKeys,
  StorageFullError,
  validateKey,
  validatePrefix,
  verifyChunk,
  type ChunkStore,
} from './chunkstore.ts';

const CHUNKS = 'chunks';
const SIZES = 'sizes';
const VERSION = 1;

interface ChunkRecord {
  data: Blob | ArrayBuffer;
  length: number;
  crc32: number;
}

export interface IdbChunkStoreOptions {
  /** Simulates a small quota (checked inside the write's transaction); the browser's own quota applies anyway. */
  quotaBytes?: number;
  /** How chunk bytes are stored; see the file comment. */
  storeAs?: 'blob' | 'arraybuffer';
  /** The IndexedDB factory; defaults to the global `indexedDB`. */
  factory?: IDBFactory;
}

export class IdbChunkStore implements ChunkStore {
  readonly kind = 'indexeddb' as const;
  private closedReason: string | null = null;

  private constructor(
    readonly name: string,
    private readonly db: IDBDatabase,
    private readonly opts: IdbChunkStoreOptions,
  ) {
    // Another tab upgrading or deleting the database waits for us to close; let it, and fail later calls clearly.
    db.onversionchange = () => {
      db.close();
      this.closedReason = 'closed because another tab upgraded or deleted the database';
    };
    // Fired when the browser closes the connection itself (site data cleared, storage failure).
    db.onclose = () => {
      this.closedReason = 'closed by the browser (site data cleared or a storage failure)';
    };
  }

  static async open(dbName: string, opts: IdbChunkStoreOptions = {}): Promise<IdbChunkStore> {
    const factory = opts.factory ?? (globalThis as { indexedDB?: IDBFactory }).indexedDB;
    if (!factory) throw new ChunkStoreError(`IndexedDB is not available here, so the chunk store "${dbName}" cannot be opened`);
    const req = factory.open(dbName, VERSION);
    req.onupgradeneeded = () => {
      const db = req.result;
      if (!db.objectStoreNames.contains(CHUNKS)) db.createObjectStore(CHUNKS);
      if (!db.objectStoreNames.contains(SIZES)) db.createObjectStore(SIZES);
    };
    req.onblocked = () => {}; // resolves once older connections close (they close on versionchange, above)
    try {
      return new IdbChunkStore(dbName, await requestDone(req), opts);
    } catch (err) {
      throw new ChunkStoreError(`could not open the IndexedDB chunk store "${dbName}": ${describe(err)}`, undefined, { cause: err });
    }
  }

  async write(key: string, data: Uint8Array): Promise<void> {
    this.ensureOpen();
    validateKey(key);
    const check = chunkCheck(data);
    const record: ChunkRecord = { data: this.encode(data), ...check };
    const tx = this.transaction([CHUNKS, SIZES], 'readwrite', `write chunk "${key}"`, key);
    const done = transactionDone(tx);
    /** Why this write aborted its own transaction: the simulated quota, or a put() that threw. */
    let failure: unknown = null;
    const put = () => {
      tx.objectStore(CHUNKS).put(record, key);
      tx.objectStore(SIZES).put(check.length, key);
    };
    const failWith = (err: unknown) => {
      failure = err;
      abortQuietly(tx);
    };
    const quota = this.opts.quotaBytes;
    try {
      if (quota === undefined) put();
      else {
        // The simulated quota is checked inside the same transaction as the put, so two concurrent writers
        // cannot both pass the check on stale totals. Requests complete in the order issued, so `old` has
        // its result when `all` succeeds.
        const old = tx.objectStore(SIZES).get(key);
        const all = tx.objectStore(SIZES).getAll();
        all.onsuccess = () => {
          try {
            const used = (all.result as number[]).reduce((a, b) => a + b, 0);
            checkQuota(key, data.length, quota, used, (old.result as number | undefined) ?? 0);
            put();
          } catch (err) {
            failWith(err);
          }
        };
      }
    } catch (err) {
      // put() itself can throw (a quota error in some browsers, DataCloneError): nothing was written.
      failWith(err);
    }
    try {
      await done;
    } catch (err) {
      throw await this.writeError(failure ?? err, key, data.length);
    }
  }

  async read(key: string): Promise<Uint8Array | null> {
    this.ensureOpen();
    validateKey(key);
    let rec: ChunkRecord | undefined;
    try {
      const tx = this.transaction(CHUNKS, 'readonly', `read chunk "${key}"`, key);
      rec = (await requestDone(tx.objectStore(CHUNKS).get(key))) as ChunkRecord | undefined;
    } catch (err) {
      if (err instanceof ChunkStoreError) throw err;
      throw new ChunkStoreError(`could not read chunk "${key}" from IndexedDB "${this.name}": ${describe(err)}`, key, { cause: err });
    }
    if (rec === undefined) return null;
    const bytes = await this.decode(key, rec);
    verifyChunk(key, bytes, rec, `IndexedDB "${this.name}"`);
    return bytes;
  }

  async delete(key: string): Promise<void> {
    this.ensureOpen();
    validateKey(key);
    const tx = this.transaction([CHUNKS, SIZES], 'readwrite', `delete chunk "${key}"`, key);
    const done = transactionDone(tx);
    tx.objectStore(CHUNKS).delete(key);
    tx.objectStore(SIZES).delete(key);
    try {
      await done;
    } catch (err) {
      throw new ChunkStoreError(`could not delete chunk "${key}" from IndexedDB "${this.name}": ${describe(err)}`, key, { cause: err });
    }
  }

  async keys(prefix = ''): Promise<string[]> {
    this.ensureOpen();
    validatePrefix(prefix);
    const keys = (await this.readSizes('list keys', (os) => os.getAllKeys())) as string[];
    return sortedKeys(keys, prefix);
  }

  async bytesUsed(): Promise<number> {
    this.ensureOpen();
    const sizes = (await this.readSizes('sum chunk sizes', (os) => os.getAll())) as number[];
    return sizes.reduce((a, b) => a + b, 0);
  }

  /** Every key with its chunk's length (from the small `sizes` store: no chunk data is read). */
  async keySizes(): Promise<[string, number][]> {
    this.ensureOpen();
    // Both requests in one transaction: the same records, in the same (key) order.
    let keys: IDBRequest | null = null;
    const sizes = (await this.readSizes('list chunk sizes', (os) => ((keys = os.getAllKeys()), os.getAll()))) as number[];
    const names = (keys as IDBRequest | null)?.result as string[];
    return names.map((k, i) => [k, sizes[i]]);
  }

  async close(): Promise<void> {
    if (this.closedReason === null) this.db.close();
    this.closedReason ??= 'closed';
  }

  /** Starts a transaction; strict durability for writes (see the file comment). */
  private transaction(stores: string | string[], mode: IDBTransactionMode, what: string, key?: string): IDBTransaction {
    try {
      return this.db.transaction(stores, mode, mode === 'readwrite' ? { durability: 'strict' } : undefined);
    } catch (err) {
      // E.g. InvalidStateError when the browser closed the connection between our check and this call.
      throw new ChunkStoreError(`could not ${what} in IndexedDB "${this.name}": ${describe(err)}`, key, { cause: err });
    }
  }

  /** One read request on the small `sizes` store (never chunk data). */
  private async readSizes(what: string, request: (os: IDBObjectStore) => IDBRequest): Promise<unknown> {
    try {
      return await requestDone(request(this.transaction(SIZES, 'readonly', what).objectStore(SIZES)));
    } catch (err) {
      if (err instanceof ChunkStoreError) throw err;
      throw new ChunkStoreError(`could not ${what} in IndexedDB "${this.name}": ${describe(err)}`, undefined, { cause: err });
    }
  }

  private encode(data: Uint8Array): Blob | ArrayBuffer {
    // Both copy exactly the view's bytes (not the rest of a larger buffer it may sit in).
    if (this.opts.storeAs === 'arraybuffer') return data.slice().buffer;
    return new Blob([data as Uint8Array<ArrayBuffer>]);
  }

  private async decode(key: string, rec: ChunkRecord): Promise<Uint8Array> {
    const where = `IndexedDB "${this.name}"`;
    if (rec.data instanceof ArrayBuffer) return new Uint8Array(rec.data);
    if (typeof Blob !== 'undefined' && rec.data instanceof Blob) {
      try {
        return new Uint8Array(await rec.data.arrayBuffer());
      } catch (err) {
        // Chrome's Blob files can go missing (disk cleanup, profile damage): NotReadableError / NotFoundError.
        throw new ChunkStoreError(`chunk "${key}" is unreadable (${where}): its stored data could not be read back (${describe(err)})`, key, { cause: err });
      }
    }
    throw new ChunkStoreError(`chunk "${key}" is damaged (${where}): the record holds no Blob or ArrayBuffer`, key);
  }

  /** A failed write: quota errors become StorageFullError (with the browser's quota figures), others ChunkStoreError. */
  private async writeError(err: unknown, key: string, bytes: number): Promise<Error> {
    if (err instanceof StorageFullError || err instanceof ChunkStoreError) return err;
    if (isQuotaError(err)) {
      // The browser's figures help the user, but its quota can exceed the disk's free space: when the write
      // would have fit the quota, the disk itself is the likely limit.
      const p = await storagePersistence();
      const fits = p.quota !== undefined && (p.usage ?? 0) + bytes <= p.quota;
      const reason = `the browser refused more storage for this site${fits ? '; the disk itself may be full' : ''}`;
      return new StorageFullError(key, bytes, { reason, quota: p.quota, used: p.usage }, { cause: err });
    }
    return new ChunkStoreError(`could not write chunk "${key}" (${bytes} bytes) to IndexedDB "${this.name}": ${describe(err)}`, key, { cause: err });
  }

  private ensureOpen(): void {
    if (this.closedReason !== null) throw new ChunkStoreError(`IndexedDB chunk store "${this.name}" is ${this.closedReason}`);
  }
}

/**
 * How much this site may store and whether the browser promised not to evict it. Training state can be many
 * GiB: the studio shows this and asks for persistence (navigator.storage.persist) before a long run.
 * Safe where navigator.storage is absent (Node, insecure origins): `{ persisted: false }`.
 */
export async function storagePersistence(): Promise<{ persisted: boolean; quota?: number; usage?: number }> {
  const storage = (globalThis as { navigator?: { storage?: StorageManager } }).navigator?.storage;
  if (!storage) return { persisted: false };
  const persisted = typeof storage.persisted === 'function' ? await storage.persisted().catch(() => false) : false;
  const estimate: StorageEstimate = typeof storage.estimate === 'function' ? await storage.estimate().catch(() => ({})) : {};
  return { persisted, quota: estimate.quota, usage: estimate.usage };
}

// ---------------------------------------------------------------------------------------------- IDB helpers

function requestDone<T>(req: IDBRequest<T>): Promise<T> {
  return new Promise((resolve, reject) => {
    req.onsuccess = () => resolve(req.result);
    req.onerror = () => reject(req.error);
  });
}

/**
 * Resolves on `complete`; rejects on `abort` with the transaction's error. A quota failure can surface on the
 * failing request, on transaction.error, or only as an abort, so all three paths end here.
 */
function transactionDone(tx: IDBTransaction): Promise<void> {
  return new Promise((resolve, reject) => {
    tx.oncomplete = () => resolve();
    // (No preventDefault on request errors: that would stop the transaction from aborting.)
    tx.onabort = () => reject(tx.error ?? new DOMException('transaction aborted', 'AbortError'));
  });
}

function abortQuietly(tx: IDBTransaction): void {
  try {
    tx.abort();
  } catch {
    // already finished
  }
}

function describe(err: unknown): string {
  if (err instanceof Error || err instanceof DOMException) return `${err.name}: ${err.message}`;
  return String(err);
}
