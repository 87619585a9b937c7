// The planner's dry runs (src/train/plan.ts) stream optimizer chunks through a store like a real run does;
// this one only counts them.
import { checkQuota, ChunkStoreError, sortedKeys, validateKey, validatePrefix, type ChunkStore } from './chunkstore.ts';

/**
 * The planner's accounting store: a ChunkStore that keeps only each chunk's size. Writes record the length,
 * reads return a zero-filled array of that length (what a dry run's optimizer would have written: the dry
 * Gpu reads back zeros), and the bytes moved are counted. A MemoryChunkStore would hold every streamed
 * chunk for real: about 10 GB of JS memory for SD 1.5's full fine-tune, for values nobody looks at.
 * The same key rules apply as in the real stores, so a key that works here works on disk and in IndexedDB.
 */
export class DryRunChunkStore implements ChunkStore {
  readonly kind = 'memory' as const;
  private readonly sizes = new Map<string, number>();
  private used = 0;
  private closed = false;
  /** Bytes handed out by read() / taken by write() since the last resetCounters(). */
  bytesRead = 0;
  bytesWritten = 0;

  constructor(
    readonly name = 'dry-run',
    private readonly opts: { quotaBytes?: number } = {},
  ) {}

  async write(key: string, data: Uint8Array): Promise<void> {
    this.ensureOpen();
    validateKey(key);
    const old = this.sizes.get(key) ?? 0;
    checkQuota(key, data.length, this.opts.quotaBytes, this.used, old);
    this.sizes.set(key, data.length);
    this.used += data.length - old;
    this.bytesWritten += data.length;
  }

  async read(key: string): Promise<Uint8Array | null> {
    this.ensureOpen();
    validateKey(key);
    const n = this.sizes.get(key);
    if (n === undefined) return null;
    this.bytesRead += n;
    return new Uint8Array(n);
  }

  async delete(key: string): Promise<void> {
    this.ensureOpen();
    validateKey(key);
    const n = this.sizes.get(key);
    if (n === undefined) return;
    this.sizes.delete(key);
    this.used -= n;
  }

  async keys(prefix = ''): Promise<string[]> {
    this.ensureOpen();
    validatePrefix(prefix);
    return sortedKeys(this.sizes.keys(), prefix);
  }

  async bytesUsed(): Promise<number> {
    this.ensureOpen();
    return this.used;
  }

  async close(): Promise<void> {
    this.closed = true;
  }

  resetCounters(): void {
    this.bytesRead = 0;
    this.bytesWritten = 0;
  }

  private ensureOpen(): void {
    if (this.closed) throw new ChunkStoreError(`dry-run chunk store "${this.name}" is closed`);
  }
}
