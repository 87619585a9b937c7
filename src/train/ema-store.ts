// The EMA of a full fine-tune's weights: the same average as train/ema.ts (diffusers' EMAModel: emaDecay,
// emaUpdate, in f32), but weight-sized (3.4 GB of f32 for SD 1.5's UNet), so it lives in the chunk store
// (IndexedDB in the browser, files in Node) beside the optimizer's chunks, one key per optimizer chunk:
//
//   <run>/ema/c<chunk>-v<n>     the chunk's averaged fp32 masters after n updates (4 bytes per element)
//
// Each update streams the chunks one at a time: read chunk i's shadow (version n) and its current masters
// (ChunkedAdamW.chunkMasters: the GPU for a resident chunk, the store for a streamed one), average them on the
// host, write version n+1, then delete version n unless the last committed checkpoint names it. Host memory
// is one chunk's shadow and masters; the store holds one version of each chunk, two while a checkpoint pins
// an older one. A checkpoint names the update count (its record's `ema`), not bytes: its versions stay until
// a later checkpoint commits (pin), exactly as the optimizer's stored chunks do, so a run that crashes after
// its checkpoint resumes to the checkpoint's shadow bit for bit, and newer versions are deleted then.
//
// Per step this moves 8 bytes per trained element through the store (the shadow read and written), plus the
// masters of streamed optimizer chunks (12 bytes per element read in fp32 AdamW); the planner's dry runs
// count these bytes as the real run moves them. A dry run (no values) skips the arithmetic.
import type { ChunkStore } from '../store/chunkstore.ts';
import { emaDecay, emaUpdate, type ChunkEma, type EmaSettings } from './ema.ts';
import { f32Bytes } from './optimizer-chunks.ts';

export class StoredEma implements ChunkEma {
  /** The update count the last committed checkpoint names (its versions are kept); -1: none yet. */
  private pinned = -1;

  private constructor(
    readonly settings: EmaSettings,
    private readonly store: ChunkStore,
    /** Store key prefix of this run's EMA chunks. */
    private readonly prefix: string,
    /** Elements per chunk (the optimizer's chunks'). */
    private readonly sizes: readonly number[],
    /** A planner's dry run: store traffic only, no arithmetic. */
    private readonly dry: boolean,
    public updates: number,
  ) {}

  /** Starts from the current weights (diffusers copies the model's parameters): version 0 of every chunk. */
  static async start(
    settings: EmaSettings,
    store: ChunkStore,
    prefix: string,
    sizes: readonly number[],
    read: (chunk: number) => Promise<Float32Array>,
    dry = false,
  ): Promise<StoredEma> {
    const ema = new StoredEma(settings, store, prefix, sizes, dry, 0);
    for (const [i, n] of sizes.entries()) await store.write(ema.key(i, 0), f32Bytes((await read(i)).subarray(0, n)));
    return ema;
  }

  key(index: number, updates: number): string {
    return `${this.prefix}/c${String(index).padStart(5, '0')}-v${updates}`;
  }

  /** One update toward the current weights, chunk by chunk (see the header). */
  async update(read: (chunk: number) => Promise<Float32Array>): Promise<void> {
    const n = this.updates + 1;
    const decay = emaDecay(this.settings, n);
    for (const i of this.sizes.keys()) {
      const [shadow, weight] = await Promise.all([this.chunk(i), read(i)]);
      if (!this.dry) emaUpdate(shadow, weight, decay);
      await this.store.write(this.key(i, n), f32Bytes(shadow));
      if (this.updates !== this.pinned) await this.store.delete(this.key(i, this.updates));
    }
    this.updates = n;
  }

  /** Chunk i's averaged masters, read from the store (a fresh copy). */
  async chunk(index: number): Promise<Float32Array> {
    return this.readVersion(index, this.updates);
  }

  private async readVersion(index: number, updates: number): Promise<Float32Array> {
    const b = await this.store.read(this.key(index, updates));
    const want = 4 * this.sizes[index];
    if (!b || b.byteLength !== want)
      throw new Error(
        `the EMA's chunk ${index} after ${updates} updates (${this.key(index, updates)}, ${want} bytes) is ${b ? `${b.byteLength} bytes` : 'missing'} in the ${this.store.kind} store: this run cannot be resumed; start it again`,
      );
    return new Float32Array(b.buffer, b.byteOffset, this.sizes[index]);
  }

  /** The shadow stays in the store: the checkpoint holds no EMA files, only the update count. */
  files(): Map<string, Uint8Array> {
    return new Map();
  }

  /** After a checkpoint committed at this update count: its versions stay; the previous checkpoint's can go. */
  async pin(): Promise<void> {
    const old = this.pinned;
    this.pinned = this.updates;
    if (old >= 0 && old !== this.updates) for (const i of this.sizes.keys()) await this.store.delete(this.key(i, old));
  }

  /** Back to a checkpoint's shadow (`updates` as its record says): every chunk checked, newer versions deleted. */
  async restore(_read: (name: string) => Promise<Uint8Array>, updates: number): Promise<void> {
    for (const i of this.sizes.keys()) await this.readVersion(i, updates);
    const keep = new Set(this.sizes.map((_, i) => this.key(i, updates)));
    for (const k of await this.store.keys(`${this.prefix}/`)) if (!keep.has(k)) await this.store.delete(k);
    this.updates = updates;
    this.pinned = updates;
  }
}
