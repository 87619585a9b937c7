// Exact byte accounting for every GPU buffer the engine creates, by tag, current and peak.
// Large allocations are wrapped in an out-of-memory error scope; a failure surfaces as a typed
// GpuOutOfMemoryError (immediately from allocChecked, or at the next Gpu.sync() from alloc).

import { GpuOutOfMemoryError } from './errors.ts';

export const TAGS = ['weights', 'activations', 'gradients', 'optimizer', 'scratch'] as const;
export type Tag = (typeof TAGS)[number];

export interface Allocation {
  readonly buffer: GPUBuffer;
  readonly bytes: number;
  readonly tag: Tag;
  readonly label: string;
  freed: boolean;
}

export interface MemoryReport {
  current: number;
  peak: number;
  byTag: Record<Tag, { current: number; peak: number }>;
  live: number;
}

/** Allocations at least this large are checked with an out-of-memory error scope. */
const OOM_SCOPE_BYTES = 16 << 20;

export const STORAGE_USAGE = GPUBufferUsageFlags();

function GPUBufferUsageFlags(): number {
  // GPUBufferUsage is a global in both hosts once WebGPU is installed; read lazily.
  const u = (globalThis as { GPUBufferUsage?: { STORAGE: number; COPY_SRC: number; COPY_DST: number } }).GPUBufferUsage;
  return u ? u.STORAGE | u.COPY_SRC | u.COPY_DST : 0x80 | 0x4 | 0x8;
}

export class Allocator {
  private current = 0;
  private peak = 0;
  private live = 0;
  private readonly tagCurrent = new Map<Tag, number>(TAGS.map((t) => [t, 0]));
  private readonly tagPeak = new Map<Tag, number>(TAGS.map((t) => [t, 0]));
  private pendingOom: Promise<GpuOutOfMemoryError | null>[] = [];
  /** Every allocation not yet freed (leak checks name them by label). */
  private readonly liveSet = new Set<Allocation>();
  /** GPUBuffers this allocator has created (dry-run stand-ins included), for benchmarks: read-only counting. */
  buffersCreated = 0;

  /**
   * `dryRun`: account every byte but back each allocation with a 4-byte buffer (memory planning: the
   * real code paths run, allocate and free as they would, and no memory is used).
   */
  constructor(
    private readonly device: GPUDevice,
    private readonly maxBufferSize: number,
    readonly dryRun = false,
  ) {}

  /** Storage buffer of `bytes` (rounded up to 4). OOM is reported at the next takeOomErrors(). */
  alloc(bytes: number, tag: Tag, label: string, usage = STORAGE_USAGE): Allocation {
    const size = this.checkSize(bytes, tag, label);
    this.buffersCreated++;
    if (this.dryRun) return this.record(this.device.createBuffer({ size: 4, usage, label }), size, tag, label);
    if (size >= OOM_SCOPE_BYTES) {
      this.device.pushErrorScope('out-of-memory');
      const buffer = this.device.createBuffer({ size, usage, label });
      this.pendingOom.push(this.device.popErrorScope().then((e) => (e ? new GpuOutOfMemoryError(size, tag, label, e.message) : null)));
      return this.record(buffer, size, tag, label);
    }
    return this.record(this.device.createBuffer({ size, usage, label }), size, tag, label);
  }

  /** Like alloc, but awaits the out-of-memory scope and throws GpuOutOfMemoryError at once. */
  async allocChecked(bytes: number, tag: Tag, label: string, usage = STORAGE_USAGE): Promise<Allocation> {
    const size = this.checkSize(bytes, tag, label);
    this.buffersCreated++;
    this.device.pushErrorScope('out-of-memory');
    const buffer = this.device.createBuffer({ size, usage, label });
    const err = await this.device.popErrorScope();
    if (err) {
      buffer.destroy();
      throw new GpuOutOfMemoryError(size, tag, label, err.message);
    }
    return this.record(buffer, size, tag, label);
  }

  /**
   * Releases an allocation from the accounting. The buffer is destroyed now, or handed to `defer`
   * when commands that use it are recorded but not yet submitted (destroying it then would
   * invalidate the submission; destroying after submit is fine).
   */
  free(a: Allocation, defer?: (b: GPUBuffer) => void): void {
    if (a.freed) return;
    a.freed = true;
    this.liveSet.delete(a);
    if (defer) defer(a.buffer);
    else a.buffer.destroy();
    this.current -= a.bytes;
    this.live--;
    this.tagCurrent.set(a.tag, this.tagCurrent.get(a.tag)! - a.bytes);
  }

  async takeOomErrors(): Promise<GpuOutOfMemoryError[]> {
    const pending = this.pendingOom;
    this.pendingOom = [];
    return (await Promise.all(pending)).filter((e): e is GpuOutOfMemoryError => e !== null);
  }

  resetPeak(): void {
    this.peak = this.current;
    for (const t of TAGS) this.tagPeak.set(t, this.tagCurrent.get(t)!);
  }

  report(): MemoryReport {
    const byTag = {} as MemoryReport['byTag'];
    for (const t of TAGS) byTag[t] = { current: this.tagCurrent.get(t)!, peak: this.tagPeak.get(t)! };
    return { current: this.current, peak: this.peak, byTag, live: this.live };
  }

  private checkSize(bytes: number, tag: Tag, label: string): number {
    const size = Math.max(4, Math.ceil(bytes / 4) * 4);
    if (size > this.maxBufferSize) throw new GpuOutOfMemoryError(size, tag, label, `larger than the device's maxBufferSize (${this.maxBufferSize})`);
    return size;
  }

  private record(buffer: GPUBuffer, bytes: number, tag: Tag, label: string): Allocation {
    this.current += bytes;
    this.live++;
    if (this.current > this.peak) this.peak = this.current;
    const t = this.tagCurrent.get(tag)! + bytes;
    this.tagCurrent.set(tag, t);
    if (t > this.tagPeak.get(tag)!) this.tagPeak.set(tag, t);
    const a: Allocation = { buffer, bytes, tag, label, freed: false };
    this.liveSet.add(a);
    return a;
  }

  /** The allocations alive now (a snapshot), for leak checks: diff two snapshots to name what stayed. */
  liveAllocations(): Allocation[] {
    return [...this.liveSet];
  }
}
