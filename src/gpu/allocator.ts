// GPU buffers with exact byte accounting by tag (current and peak) and a caching pool.
//
// Caching: a freed buffer is not destroyed but kept in a pool by size class and usage, and the next
// allocation of that class takes the idle buffer made first (the lowest serial number), so a training step that
// allocates the same sizes every step creates no GPUBuffer once warm and gets the very same buffers for the same
// tensors every step: the set of idle buffers at the start of a step is the same, and the choice does not depend
// on the order the last step freed them in (LIFO would permute them step to step). Gpu's bind-group cache relies
// on that (WebGPU zero-fills every new buffer, and creating and destroying them is
// the host's largest cost per dispatch). Size classes round a request up to a multiple of 1/8 of its power of
// two (at least 256 bytes), so the waste per buffer is under 12.5 % (under 256 bytes below 2 KiB).
//
// Accounting: `current`/`peak` count the bytes the engine asked for (rounded up to 4), exactly as without
// the pool, so memory plans and leak checks do not change; the pool and the class rounding are reported
// apart (`pool`, `reserved`). A reused buffer holds stale data: Gpu.zeros clears it, Gpu.tensor does not.
//
// Out of memory: allocations of 16 MiB and more are wrapped in an out-of-memory error scope. allocChecked
// awaits it, and on failure empties the pool and retries once before throwing GpuOutOfMemoryError; alloc
// cannot learn of a failure synchronously (WebGPU reports it asynchronously), so it surfaces at the next
// Gpu.sync(), which empties the pool first so the caller's retry finds the memory. When `reserveLimit` is set,
// idle pooled buffers are destroyed before a new buffer would push the reserved bytes over it.

import { GpuOutOfMemoryError } from './errors.ts';

const TAGS = ['weights', 'activations', 'gradients', 'optimizer', 'scratch'] as const;
export type Tag = (typeof TAGS)[number];

export interface Allocation {
  readonly buffer: GPUBuffer;
  /** Bytes asked for (rounded up to 4): what the accounting counts. */
  readonly bytes: number;
  /** The buffer's size class (>= bytes): what it occupies on the device (1/4 of that in a dry run: stand-ins). */
  readonly capacity: number;
  /** True when the buffer came from the pool (stale contents), false when newly created (zero-filled). */
  readonly reused: boolean;
  readonly tag: Tag;
  readonly label: string;
  freed: boolean;
}

export interface MemoryReport {
  current: number;
  peak: number;
  byTag: Record<Tag, { current: number; peak: number }>;
  live: number;
  /** Idle buffers kept for reuse: how many and their bytes (class sizes). Not part of current/peak. */
  pool: { buffers: number; bytes: number };
  /** Device bytes held: live allocations at their class sizes plus the pool. */
  reserved: number;
}

/** Pool counters since the allocator was made (benchmarks and tests read them; nothing decides on them). */
export interface PoolStats {
  /** Allocations served from the pool. */
  hits: number;
  /** Allocations that created a GPUBuffer. */
  misses: number;
  /** Pooled buffers destroyed to respect reserveLimit or after an out-of-memory error. */
  evicted: number;
}

/** Smallest size class. */
const MIN_CLASS = 256;

/**
 * The size class of a request: `bytes` rounded up to a multiple of 1/8 of its power of two (at least 256),
 * e.g. 1000 -> 1024, 1100 -> 1280, 9000 -> 9216, 5 MiB + 1 -> 5.5 MiB. Waste < 12.5 % of the request (< 256
 * bytes below 2 KiB).
 */
export function sizeClass(bytes: number): number {
  if (bytes <= MIN_CLASS) return MIN_CLASS;
  const step = Math.max(MIN_CLASS, 2 ** (Math.floor(Math.log2(bytes)) - 3));
  return Math.ceil(bytes / step) * step;
}

/** Allocations at least this large are checked with an out-of-memory error scope. */
const OOM_SCOPE_BYTES = 16 << 20;

const STORAGE_USAGE = GPUBufferUsageFlags();

function GPUBufferUsageFlags(): number {
  // GPUBufferUsage is a global in both hosts once WebGPU is installed; read lazily.
  const u = (globalThis as { GPUBufferUsage?: { STORAGE: number; COPY_SRC: number; COPY_DST: number } }).GPUBufferUsage;
  return u ? u.STORAGE | u.COPY_SRC | u.COPY_DST : 0x80 | 0x4 | 0x8;
}

export class Allocator {
  private current = 0;
  private peak = 0;
  private live = 0;
  /** Class bytes of the live allocations (device bytes they hold). */
  private liveCapacity = 0;
  private readonly tagCurrent = new Map<Tag, number>(TAGS.map((t) => [t, 0]));
  private readonly tagPeak = new Map<Tag, number>(TAGS.map((t) => [t, 0]));
  private pendingOom: Promise<GpuOutOfMemoryError | null>[] = [];
  /** Every allocation not yet freed (leak checks name them by label). */
  private readonly liveSet = new Set<Allocation>();
  /** Idle buffers by `${usage}:${class}`, each a min-heap on the buffers' serial numbers. */
  private readonly pool = new Map<string, SerialHeap>();
  private readonly serials = new WeakMap<GPUBuffer, number>();
  private nextSerial = 0;
  private poolBytes = 0;
  private poolBuffers = 0;
  /** GPUBuffers this allocator has created (dry-run stand-ins included), for benchmarks: read-only counting. */
  buffersCreated = 0;
  readonly poolStats: PoolStats = { hits: 0, misses: 0, evicted: 0 };
  /** Upper bound on reserved bytes (live at class size + pool) that the pool may hold; Infinity: no bound. */
  reserveLimit = Infinity;
  /**
   * Called with the buffers the pool destroys (after an eviction), so the owner can drop caches keyed on
   * them (Gpu's bind groups). Destroyed buffers are never handed out again.
   */
  onEvict: ((buffers: GPUBuffer[]) => void) | null = null;
  /**
   * How an evicted buffer is destroyed when the caller names no other way: the owner (Gpu) defers it past the
   * submit of the commands being recorded, which may still use it (a budget's makeRoom evicts mid-recording).
   */
  destroyEvicted: (buffer: GPUBuffer) => void = (b) => b.destroy();
  /** Told of every allocation and free while set: a step capture (src/gpu/replay.ts) records them to replay. */
  observer: { alloc(a: Allocation): void; free(a: Allocation): void } | null = null;

  /**
   * `dryRun`: account every byte but back each allocation with a 4-byte buffer (memory planning: the
   * real code paths run, allocate and free as they would, and no memory is used). `sizedDryRun`: a dry run on a
   * device that backs nothing (src/gpu/recording.ts), whose buffers are made at their real size so the ranges
   * bound to dispatches are the real ones.
   */
  constructor(
    private readonly device: GPUDevice,
    private readonly maxBufferSize: number,
    readonly dryRun = false,
    private readonly sizedDryRun = false,
  ) {}

  /** Buffer of `bytes` (rounded up to 4) from the pool or new. OOM of a new one is reported at the next takeOomErrors(). */
  alloc(bytes: number, tag: Tag, label: string, usage = STORAGE_USAGE): Allocation {
    const size = this.checkSize(bytes, tag, label);
    const capacity = this.capacityOf(size);
    const pooled = this.takePooled(usage, capacity);
    if (pooled) return this.record(pooled, size, capacity, true, tag, label);
    this.makeRoom(capacity);
    this.countCreated();
    if (this.dryRun)
      return this.record(this.created(this.device.createBuffer({ size: this.dryRunSize(capacity), usage, label })), size, capacity, false, tag, label);
    if (capacity >= OOM_SCOPE_BYTES) {
      this.device.pushErrorScope('out-of-memory');
      const buffer = this.created(this.device.createBuffer({ size: capacity, usage, label }));
      this.pendingOom.push(this.device.popErrorScope().then((e) => (e ? new GpuOutOfMemoryError(capacity, tag, label, e.message) : null)));
      return this.record(buffer, size, capacity, false, tag, label);
    }
    return this.record(this.created(this.device.createBuffer({ size: capacity, usage, label })), size, capacity, false, tag, label);
  }

  /**
   * Like alloc, but awaits the out-of-memory scope: on failure empties the pool and retries once, then
   * throws GpuOutOfMemoryError.
   */
  async allocChecked(bytes: number, tag: Tag, label: string, usage = STORAGE_USAGE): Promise<Allocation> {
    const size = this.checkSize(bytes, tag, label);
    const capacity = this.capacityOf(size);
    const pooled = this.takePooled(usage, capacity);
    if (pooled) return this.record(pooled, size, capacity, true, tag, label);
    this.makeRoom(capacity);
    let buffer = await this.createChecked(capacity, usage, label);
    if (typeof buffer === 'string' && this.poolBuffers > 0) {
      this.trimPool();
      buffer = await this.createChecked(capacity, usage, label);
    }
    if (typeof buffer === 'string') throw new GpuOutOfMemoryError(capacity, tag, label, buffer);
    return this.record(buffer, size, capacity, false, tag, label);
  }

  /**
   * Releases an allocation from the accounting and keeps its buffer in the pool for the next allocation of
   * its class. Reuse needs no wait: commands recorded or submitted later run after those already recorded
   * (WebGPU orders a queue's work), so the next user's writes cannot overtake the last one's reads.
   */
  free(a: Allocation): void {
    if (a.freed) return;
    a.freed = true;
    this.observer?.free(a);
    this.liveSet.delete(a);
    this.current -= a.bytes;
    this.liveCapacity -= a.capacity;
    this.live--;
    this.tagCurrent.set(a.tag, this.tagCurrent.get(a.tag)! - a.bytes);
    const key = poolKey(a.buffer.usage, a.capacity);
    let heap = this.pool.get(key);
    if (!heap) this.pool.set(key, (heap = new SerialHeap(a.capacity)));
    heap.push(a.buffer, this.serials.get(a.buffer)!);
    this.poolBytes += a.capacity;
    this.poolBuffers++;
  }

  /**
   * Destroys idle pooled buffers, the largest classes first, until at most `keepBytes` stay pooled (default:
   * none). `defer` receives the buffers instead of destroying them, for a caller with recorded commands that may
   * still use them (destroying before the submit would invalidate it).
   */
  trimPool(keepBytes = 0, defer?: (b: GPUBuffer) => void): void {
    if (this.poolBytes <= keepBytes) return;
    const evicted: GPUBuffer[] = [];
    const byLargest = [...this.pool].sort((a, b) => b[1].capacity - a[1].capacity);
    for (const [key, heap] of byLargest) {
      while (this.poolBytes > keepBytes && heap.size > 0) {
        evicted.push(heap.pop()!);
        this.poolBytes -= heap.capacity;
        this.poolBuffers--;
        this.poolStats.evicted++;
      }
      if (heap.size === 0) this.pool.delete(key);
      if (this.poolBytes <= keepBytes) break;
    }
    this.onEvict?.(evicted);
    for (const b of evicted) (defer ?? this.destroyEvicted)(b);
  }

  /** Out-of-memory errors of alloc() calls since the last take; the pool is emptied when there are any. */
  async takeOomErrors(defer?: (b: GPUBuffer) => void): Promise<GpuOutOfMemoryError[]> {
    const pending = this.pendingOom;
    this.pendingOom = [];
    const errors = (await Promise.all(pending)).filter((e): e is GpuOutOfMemoryError => e !== null);
    if (errors.length) this.trimPool(0, defer);
    return errors;
  }

  resetPeak(): void {
    this.peak = this.current;
    for (const t of TAGS) this.tagPeak.set(t, this.tagCurrent.get(t)!);
  }

  report(): MemoryReport {
    const byTag = {} as MemoryReport['byTag'];
    for (const t of TAGS) byTag[t] = { current: this.tagCurrent.get(t)!, peak: this.tagPeak.get(t)! };
    return {
      current: this.current,
      peak: this.peak,
      byTag,
      live: this.live,
      pool: { buffers: this.poolBuffers, bytes: this.poolBytes },
      reserved: this.liveCapacity + this.poolBytes,
    };
  }

  /**
   * The serial numbers of the idle buffers, ascending. Allocation is a function of this set and the requests, so two
   * equal sets hand out the same buffers to the same sequence of allocations and frees (src/gpu/replay.ts relies on it).
   */
  idleSerials(): number[] {
    const out: number[] = [];
    for (const heap of this.pool.values()) heap.serialsInto(out);
    return out.sort((a, b) => a - b);
  }

  /** The allocations alive now (a snapshot), for leak checks: diff two snapshots to name what stayed. */
  liveAllocations(): Allocation[] {
    return [...this.liveSet];
  }

  private checkSize(bytes: number, tag: Tag, label: string): number {
    const size = Math.max(4, Math.ceil(bytes / 4) * 4);
    if (size > this.maxBufferSize) throw new GpuOutOfMemoryError(size, tag, label, `larger than the device's maxBufferSize (${this.maxBufferSize})`);
    return size;
  }

  /** The class size, capped at the device's largest buffer (a request near the cap takes the cap). */
  private capacityOf(size: number): number {
    return Math.min(sizeClass(size), Math.max(size, Math.floor(this.maxBufferSize / 4) * 4));
  }

  private takePooled(usage: number, capacity: number): GPUBuffer | null {
    const key = poolKey(usage, capacity);
    const heap = this.pool.get(key);
    const buffer = heap?.pop();
    if (!buffer) return null;
    if (heap!.size === 0) this.pool.delete(key);
    this.poolBytes -= capacity;
    this.poolBuffers--;
    this.poolStats.hits++;
    return buffer;
  }

  /** Evicts idle buffers when a new one of `capacity` would push the reserved bytes over reserveLimit. */
  private makeRoom(capacity: number): void {
    const over = this.liveCapacity + this.poolBytes + capacity - this.reserveLimit;
    if (over > 0 && this.poolBytes > 0) this.trimPool(Math.max(0, this.poolBytes - over));
  }

  private created(buffer: GPUBuffer): GPUBuffer {
    this.serials.set(buffer, this.nextSerial++);
    return buffer;
  }

  private countCreated(): void {
    this.buffersCreated++;
    this.poolStats.misses++;
  }

  /** The size of a dry run's buffer: a 4-byte placeholder, or the real size on a device that backs nothing. */
  private dryRunSize(capacity: number): number {
    return this.sizedDryRun ? capacity : 4;
  }

  /** A new buffer, or the out-of-memory message when the device refused it. */
  private async createChecked(capacity: number, usage: number, label: string): Promise<GPUBuffer | string> {
    this.countCreated();
    if (this.dryRun) return this.created(this.device.createBuffer({ size: this.dryRunSize(capacity), usage, label }));
    this.device.pushErrorScope('out-of-memory');
    const buffer = this.device.createBuffer({ size: capacity, usage, label });
    const err = await this.device.popErrorScope();
    if (!err) return this.created(buffer);
    buffer.destroy();
    return err.message;
  }

  private record(buffer: GPUBuffer, bytes: number, capacity: number, reused: boolean, tag: Tag, label: string): Allocation {
    this.current += bytes;
    this.liveCapacity += capacity;
    this.live++;
    if (this.current > this.peak) this.peak = this.current;
    const t = this.tagCurrent.get(tag)! + bytes;
    this.tagCurrent.set(tag, t);
    if (t > this.tagPeak.get(tag)!) this.tagPeak.set(tag, t);
    const a: Allocation = { buffer, bytes, capacity, reused, tag, label, freed: false };
    this.liveSet.add(a);
    this.observer?.alloc(a);
    return a;
  }
}

function poolKey(usage: number, capacity: number): string {
  return `${usage}:${capacity}`;
}

/** A min-heap of idle buffers of one class, ordered by serial number (creation order). */
class SerialHeap {
  private readonly items: { buffer: GPUBuffer; serial: number }[] = [];
  constructor(readonly capacity: number) {}

  get size(): number {
    return this.items.length;
  }

  serialsInto(out: number[]): void {
    for (const it of this.items) out.push(it.serial);
  }

  push(buffer: GPUBuffer, serial: number): void {
    const a = this.items;
    a.push({ buffer, serial });
    for (let i = a.length - 1; i > 0;) {
      const parent = (i - 1) >> 1;
      if (a[parent].serial <= a[i].serial) break;
      [a[parent], a[i]] = [a[i], a[parent]];
      i = parent;
    }
  }

  /** The buffer with the lowest serial. */
  pop(): GPUBuffer | undefined {
    const a = this.items;
    if (a.length === 0) return undefined;
    const top = a[0].buffer;
    const last = a.pop()!;
    if (a.length > 0) {
      a[0] = last;
      for (let i = 0; ;) {
        const l = 2 * i + 1;
        const r = l + 1;
        let m = i;
        if (l < a.length && a[l].serial < a[m].serial) m = l;
        if (r < a.length && a[r].serial < a[m].serial) m = r;
        if (m === i) break;
        [a[m], a[i]] = [a[i], a[m]];
        i = m;
      }
    }
    return top;
  }
}
