// A recorded training step replayed. A warm step's forward and backward issue the same dispatches every step: the
// same kernels under the same defs, over the same buffers (the allocator hands the same pooled buffers to the same
// sequence of requests, allocator.ts), with the same uniforms (shapes and constants; what changes per step, the
// timesteps, the noise, the loss weights and scale, reaches them only through buffers the live code writes between
// the segments). So after two identical captures the segments are re-encoded from the record: the allocator's
// allocations and frees replayed (same buffers, exact accounting), then three encoder calls per dispatch. The op code,
// the tape's records and Gpu.run's checks, packing and bind-group look-ups do not run.
//
// A step is a session of two segments around live code: `forward` (the UNet's forward on the tape), then the loss
// (live: it reads the loss back and writes its weights), then `backward` (the tape's backward), whose result is the
// tape's gradient map. A replay is used only when all of this holds, else the step runs live and is captured again:
//   - the caller's structure key (shapes, dtype, mode, options) and the inputs' shapes equal the record's;
//   - two consecutive live captures under that key were identical: every dispatch's pipeline, bound ranges (buffers by
//     identity), uniform bytes and grid, every allocation's buffer, every output; a uniform that varies per step makes
//     two captures differ, so it can never be replayed stale (the difference is named in `stats.lastRefusal`);
//   - the inputs sit in the recorded buffers at the recorded offsets, the pool's idle buffers are the recorded set, the
//     GEMM kernel choices are the recorded ones, no buffer was evicted since (a captured bind group could bind a destroyed buffer), every buffer the record binds that
//     it did not allocate belongs to a live allocation, and no profile, timed pass or dry run is on.
// A capture is refused (the step stays live) on a queue write or read-back inside a segment, an allocation that created
// a buffer, a bound range of an unknown buffer, a free of an allocation made outside it and not an input, or an
// allocation left live that is no output. The forward's checks cover the backward's (the loss between is the same code
// on the same buffers); a backward that still finds its start different, or an allocation that gets another buffer
// than the recorded one, throws a ReplayMismatchError before that segment encodes a dispatch: the caller discards the
// step (StepRun.discard) and runs it live.
import type { Allocation, Tag } from './allocator.ts';
import type { Bindable, BufferWindow, Gpu } from './device.ts';
import { Tensor, type DType } from './tensor.ts';

/**
 * A replay that found the GPU's state other than the recorded step's once it had begun. Thrown before the segment it
 * concerns encodes a dispatch: the step's GPU work so far is the replayed forward's, into the step's own allocations.
 */
export class ReplayMismatchError extends Error {
  override readonly name = 'ReplayMismatchError';
}

/** One dispatch as Gpu.run encoded it, kept by a capture. */
export interface CapturedDispatch {
  /** The pipeline's key (shader:entry:defs), for messages. */
  readonly label: string;
  readonly pipeline: GPUComputePipeline;
  /** The bind group the dispatch used (its uniforms, if any, in the ring: baked into a buffer of their own). */
  readonly group: GPUBindGroup;
  readonly uniforms: Uint8Array | null;
  readonly windows: readonly (BufferWindow | null)[];
  readonly workgroups: readonly [number, number, number];
}

/** What Gpu.run and the queue calls tell a running capture. */
export interface CaptureSink {
  dispatch(d: CapturedDispatch, bound: readonly (Bindable | null)[]): void;
  refuse(reason: string): void;
}

/** A dispatch ready to re-encode. */
export interface ReplayDispatch {
  readonly pipeline: GPUComputePipeline;
  readonly group: GPUBindGroup;
  readonly x: number;
  readonly y: number;
  readonly z: number;
}

/** An allocation of the session by index (>= 0) or an input by -(i + 1). */
type Ref = number;
type AllocatorEvent = { alloc: true; bytes: number; tag: Tag; label: string; usage: number; buffer: GPUBuffer } | { alloc: false; ref: Ref };

/** A tensor a segment hands out: over a session allocation or input (ref), or a tensor that outlives the step. */
interface TensorRecord {
  ref: Ref | null;
  kept: Tensor | null;
  shape: readonly number[];
  dtype: DType;
  byteOffset: number;
  owner: boolean;
}

interface Placement {
  buffer: GPUBuffer;
  byteOffset: number;
  byteSize: number;
}

interface Segment {
  idle: number[];
  inputs: Placement[];
  events: AllocatorEvent[];
  dispatches: CapturedDispatch[];
  /** Allocations made before the step that the segment binds: each must still be live at a replay. */
  outside: Allocation[];
  /** Where the live segment left the uniform ring (Gpu.skipUniforms). */
  ringEnd: number;
  baked: ReplayDispatch[] | null;
}

interface SessionRecord {
  key: string;
  evictions: number;
  /** The GEMM kernel choices in force (a frozen snapshot: setGemmConfig replaces it, so identity says unchanged). */
  gemm: object;
  forward: Segment;
  pred: TensorRecord;
  backward: Segment | null;
  grads: [Tensor, TensorRecord][];
  uniforms: GPUBuffer[];
}

export interface ReplayStats {
  /** Steps whose forward and backward were replayed. */
  replayed: number;
  /** Steps run live and captured. */
  captured: number;
  /** Why the last capture could not be replayed or the last replay did not run ('' when none). */
  lastRefusal: string;
}

/** A step's tensors by session index, shared by its two segments. */
class SessionAllocs {
  readonly list: Allocation[] = [];
  readonly index = new Map<Allocation, number>();
  add(a: Allocation): number {
    this.index.set(a, this.list.length);
    this.list.push(a);
    return this.list.length - 1;
  }
}

/** Records one segment: the allocator's events and Gpu.run's dispatches, classified against the session. */
class Capture implements CaptureSink {
  readonly seg: Segment;
  refused: string | null = null;
  private readonly outsideSet = new Set<Allocation>();
  /** Buffers of live session allocations and inputs (a window binding names a buffer, not an allocation). */
  private readonly known = new Map<GPUBuffer, number>();
  /** The allocations live before the segment by buffer, made on the first window of a buffer not known (a weight's slice). */
  private before: Map<GPUBuffer, Allocation> | null = null;

  constructor(
    gpu: Gpu,
    private readonly allocs: SessionAllocs,
    private readonly inputs: readonly Tensor[],
  ) {
    this.allocator = gpu.allocator;
    this.seg = { idle: gpu.allocator.idleSerials(), inputs: inputs.map(placement), events: [], dispatches: [], outside: [], ringEnd: 0, baked: null };
    for (const a of allocs.list) if (!a.freed) this.note(a.buffer);
    for (const t of inputs) this.note(t.buffer);
  }

  private note(b: GPUBuffer): void {
    this.known.set(b, (this.known.get(b) ?? 0) + 1);
  }

  private forget(b: GPUBuffer): void {
    const n = this.known.get(b) ?? 0;
    if (n <= 1) this.known.delete(b);
    else this.known.set(b, n - 1);
  }

  private readonly allocator: Gpu['allocator'];

  refuse(reason: string): void {
    this.refused ??= reason;
  }

  /** Notes an allocation made before the step that the segment binds (it must be live at every replay). */
  private outside(a: Allocation): void {
    if (this.outsideSet.has(a)) return;
    this.outsideSet.add(a);
    this.seg.outside.push(a);
  }

  alloc(a: Allocation): void {
    if (!a.reused) this.refuse(`allocation '${a.label}' created a buffer (the pool is not warm)`);
    this.allocs.add(a);
    this.note(a.buffer);
    this.seg.events.push({ alloc: true, bytes: a.bytes, tag: a.tag, label: a.label, usage: a.buffer.usage, buffer: a.buffer });
  }

  free(a: Allocation): void {
    const ref = this.refOf(a);
    if (ref === null) return this.refuse(`it frees '${a.label}', made before the step and not an input`);
    this.forget(a.buffer);
    this.seg.events.push({ alloc: false, ref });
  }

  refOf(a: Allocation): Ref | null {
    const i = this.allocs.index.get(a);
    if (i !== undefined) return i;
    const j = this.inputs.findIndex((t) => t.alloc === a);
    return j >= 0 ? -(j + 1) : null;
  }

  dispatch(d: CapturedDispatch, bound: readonly (Bindable | null)[]): void {
    for (const b of bound) {
      if (!b) continue;
      if (b instanceof Tensor) {
        if (this.allocs.index.has(b.alloc) || this.inputs.some((t) => t.alloc === b.alloc) || this.outsideSet.has(b.alloc)) continue;
        if (b.alloc.freed) return this.refuse(`${d.label} binds '${b.alloc.label}', which is freed`);
        this.outside(b.alloc);
      } else if (!this.known.has(b.buffer)) {
        this.before ??= new Map(this.allocator.liveAllocations().map((a) => [a.buffer, a]));
        const a = this.before.get(b.buffer);
        if (!a || a.freed) return this.refuse(`${d.label} binds a range of a buffer the step neither allocated nor was given`);
        this.outside(a);
      }
    }
    this.seg.dispatches.push(d);
  }
}

function placement(t: Tensor): Placement {
  return { buffer: t.buffer, byteOffset: t.byteOffset, byteSize: t.byteSize };
}

function samePlacement(a: Placement, b: Placement): boolean {
  return a.buffer === b.buffer && a.byteOffset === b.byteOffset && a.byteSize === b.byteSize;
}

function sameNumbers(a: readonly number[], b: readonly number[]): boolean {
  return a.length === b.length && a.every((x, i) => x === b[i]);
}

function sameBytes(a: Uint8Array | null, b: Uint8Array | null): boolean {
  if (!a || !b) return a === b;
  return a.byteLength === b.byteLength && a.every((x, i) => x === b[i]);
}

/** The first difference between two captures of a segment, or null when they are identical. */
function segmentDifference(a: Segment, b: Segment, what: string): string | null {
  if (!sameNumbers(a.idle, b.idle)) return `${what}: the pool's idle buffers differ between two steps`;
  if (a.inputs.length !== b.inputs.length || a.inputs.some((p, i) => !samePlacement(p, b.inputs[i]))) return `${what}: its inputs moved between two steps`;
  if (a.events.length !== b.events.length) return `${what}: ${a.events.length} vs ${b.events.length} allocations and frees`;
  for (let i = 0; i < a.events.length; i++) {
    const [x, y] = [a.events[i], b.events[i]];
    const same =
      x.alloc && y.alloc ? x.buffer === y.buffer && x.bytes === y.bytes && x.tag === y.tag && x.usage === y.usage : !x.alloc && !y.alloc && x.ref === y.ref;
    if (!same) return `${what}: allocation event ${i} differs between two steps`;
  }
  if (a.outside.length !== b.outside.length || a.outside.some((x, i) => x !== b.outside[i])) return `${what}: it binds other tensors made before the step`;
  if (a.dispatches.length !== b.dispatches.length) return `${what}: ${a.dispatches.length} vs ${b.dispatches.length} dispatches`;
  for (let i = 0; i < a.dispatches.length; i++) {
    const [x, y] = [a.dispatches[i], b.dispatches[i]];
    if (x.pipeline !== y.pipeline) return `${what}: dispatch ${i} runs ${x.label}, then ${y.label}`;
    if (!sameNumbers(x.workgroups, y.workgroups)) return `${what}: dispatch ${i} (${x.label}) changes its grid between two steps`;
    if (!sameBytes(x.uniforms, y.uniforms)) return `${what}: dispatch ${i} (${x.label}) changes its uniforms between two steps (a per-step value in a uniform)`;
    const wx = x.windows;
    const wy = y.windows;
    if (wx.length !== wy.length || wx.some((w, j) => (w && wy[j] ? !samePlacement(asPlacement(w), asPlacement(wy[j]!)) : w !== wy[j])))
      return `${what}: dispatch ${i} (${x.label}) binds other ranges between two steps`;
  }
  return null;
}

function asPlacement(w: BufferWindow): Placement {
  return { buffer: w.buffer, byteOffset: w.offset, byteSize: w.size };
}

function sameTensorRecord(a: TensorRecord, b: TensorRecord): boolean {
  return a.ref === b.ref && a.kept === b.kept && a.dtype === b.dtype && a.byteOffset === b.byteOffset && a.owner === b.owner && sameNumbers(a.shape, b.shape);
}

function recordDifference(a: SessionRecord, b: SessionRecord): string | null {
  if (a.key !== b.key) return 'the step changed structure';
  if (a.evictions !== b.evictions) return 'the pool evicted buffers between two steps';
  if (a.gemm !== b.gemm) return 'the GEMM kernel choices changed between two steps';
  const f = segmentDifference(a.forward, b.forward, 'forward');
  if (f) return f;
  if (!a.backward || !b.backward) return 'a backward was not captured';
  const g = segmentDifference(a.backward, b.backward, 'backward');
  if (g) return g;
  if (!sameTensorRecord(a.pred, b.pred)) return 'the forward hands out another tensor';
  if (a.grads.length !== b.grads.length || a.grads.some(([t, r], i) => t !== b.grads[i][0] || !sameTensorRecord(r, b.grads[i][1])))
    return 'the backward leaves other gradients';
  return null;
}

/**
 * The step replay of one trainer (or any caller with the same shape of step): `begin(key)` per step, then the step's
 * forward and backward through the returned StepRun. Off in dry runs.
 */
/** Structure keys a StepReplay keeps armed records for. */
const ARMED_KEYS = 4;

export class StepReplay {
  readonly stats: ReplayStats = { replayed: 0, captured: 0, lastRefusal: '' };
  /**
   * The records replayed, by structure key (a run whose steps alternate between a few shapes replays each), and per
   * key the last capture waiting for a second identical one. At most ARMED_KEYS are kept; the oldest goes first.
   */
  private readonly armed = new Map<string, SessionRecord>();
  private readonly candidates = new Map<string, SessionRecord>();

  constructor(readonly gpu: Gpu) {}

  begin(key: string): StepRun {
    return new StepRun(this, key);
  }

  /** The armed record for this key when every precondition of its forward holds now, else null (and why). */
  replayable(key: string, inputs: readonly Tensor[]): SessionRecord | null {
    const r = this.armed.get(key);
    if (!r) return null;
    const why = this.blocker(r, inputs);
    if (why) {
      this.stats.lastRefusal = `not replayed: ${why}`;
      return null;
    }
    return r;
  }

  private blocker(r: SessionRecord, inputs: readonly Tensor[]): string | null {
    const gpu = this.gpu;
    if (!gpu.canReplay) return 'a dry run, profile or capture is on';
    if (gpu.evictions !== r.evictions) return 'the pool evicted buffers since the capture';
    if (gpu.gemmConfig !== r.gemm) return 'the GEMM kernel choices changed since the capture';
    if (inputs.length !== r.forward.inputs.length || inputs.some((t, i) => t.alloc.freed || !samePlacement(placement(t), r.forward.inputs[i])))
      return 'the inputs are not in the recorded buffers';
    for (const a of [...r.forward.outside, ...r.backward!.outside]) if (a.freed) return `'${a.label}', bound by the record, was freed`;
    if (!sameNumbers(gpu.allocator.idleSerials(), r.forward.idle)) return "the pool's idle buffers differ from the recorded step's";
    return null;
  }

  /** A finished live capture: armed when it equals the one before under its key, else kept as the candidate. */
  captured(r: SessionRecord): void {
    this.stats.captured++;
    const prev = this.candidates.get(r.key);
    const diff = prev ? recordDifference(prev, r) : 'first capture';
    if (diff) {
      this.candidates.set(r.key, r);
      if (prev) this.stats.lastRefusal = `not armed: ${diff}`;
      return;
    }
    this.candidates.delete(r.key);
    this.disarm(r.key);
    for (const seg of [r.forward, r.backward!]) seg.baked = this.bake(r, seg);
    this.armed.set(r.key, r);
    if (this.armed.size > ARMED_KEYS) this.disarm(this.armed.keys().next().value!);
  }

  refused(key: string, reason: string): void {
    this.stats.lastRefusal = `not captured: ${reason}`;
    this.candidates.delete(key);
  }

  /** Drops a key's armed record, or every one (their uniform buffers destroyed once what is recorded is submitted). */
  disarm(key?: string): void {
    for (const [k, r] of [...this.armed]) {
      if (key !== undefined && k !== key) continue;
      this.gpu.flush();
      for (const b of r.uniforms) b.destroy();
      this.armed.delete(k);
    }
  }

  /**
   * Makes a segment's dispatches re-encodable without the ring: their uniforms in one buffer of their own, written
   * once, and a bind group each over it and the recorded ranges; a dispatch without uniforms keeps its bind group.
   */
  private bake(r: SessionRecord, seg: Segment): ReplayDispatch[] {
    const gpu = this.gpu;
    const align = gpu.device.limits.minUniformBufferOffsetAlignment;
    let bytes = 0;
    const offsets = seg.dispatches.map((d) => {
      if (!d.uniforms) return -1;
      const at = Math.ceil(bytes / align) * align;
      bytes = at + d.uniforms.byteLength;
      return at;
    });
    let buffer: GPUBuffer | null = null;
    if (bytes > 0) {
      const packed = new Uint8Array(Math.ceil(bytes / 4) * 4);
      seg.dispatches.forEach((d, i) => d.uniforms && packed.set(d.uniforms, offsets[i]));
      buffer = gpu.device.createBuffer({ size: packed.byteLength, usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST, label: 'replay-uniforms' });
      gpu.device.queue.writeBuffer(buffer, 0, packed.buffer, 0, packed.byteLength);
      r.uniforms.push(buffer);
    }
    let groups = 0;
    const out = seg.dispatches.map((d, i): ReplayDispatch => {
      const [x, y, z] = d.workgroups;
      if (!d.uniforms) return { pipeline: d.pipeline, group: d.group, x, y, z };
      const entries: GPUBindGroupEntry[] = [{ binding: 0, resource: { buffer: buffer!, offset: offsets[i], size: d.uniforms.byteLength } }];
      d.windows.forEach((w, j) => {
        if (w) entries.push({ binding: j + 1, resource: { buffer: w.buffer, offset: w.offset, size: w.size } });
      });
      groups++;
      return { pipeline: d.pipeline, group: gpu.device.createBindGroup({ layout: d.pipeline.getBindGroupLayout(0), entries }), x, y, z };
    });
    gpu.noteCreated(buffer ? 1 : 0, groups);
    return out;
  }
}

/** One step's forward and backward, replayed or run live (and captured). */
export class StepRun {
  private mode: 'replay' | 'capture' | 'live' = 'live';
  private record: SessionRecord | null = null;
  private readonly allocs = new SessionAllocs();
  private inputs: Tensor[] = [];
  /** The caller's key and the inputs' shapes and dtypes: what a record is filed under. */
  private fullKey = '';

  constructor(
    private readonly owner: StepReplay,
    private readonly key: string,
  ) {}

  /** The forward: `run` live (captured), or the record's dispatches; returns its output tensor either way. */
  forward(inputs: readonly Tensor[], run: () => Tensor): Tensor {
    this.inputs = [...inputs];
    const key = (this.fullKey = `${this.key}|${inputs.map((t) => `${t.dtype}[${t.shape.join(',')}]`).join(';')}`);
    const armed = this.owner.replayable(key, this.inputs);
    if (armed) {
      this.mode = 'replay';
      this.record = armed;
      this.replaySegment(armed.forward);
      return this.tensorOf(armed.pred);
    }
    this.mode = 'capture';
    const cap = this.start();
    let pred: Tensor;
    try {
      pred = run();
    } finally {
      this.stop();
    }
    const predRecord = this.recordOf(pred, cap);
    if (cap.refused || !predRecord) {
      this.abandon(cap.refused ?? 'the forward returns a tensor it cannot name');
      return pred;
    }
    const gpu = this.owner.gpu;
    this.record = { key, evictions: gpu.evictions, gemm: gpu.gemmConfig, forward: cap.seg, pred: predRecord, backward: null, grads: [], uniforms: [] };
    return pred;
  }

  /** The backward: `run` live (captured), or the record's; leaves the gradients in `grads` (the tape's map) either way. */
  backward(grads: Map<Tensor, Tensor>, extraInputs: readonly Tensor[], run: () => void): void {
    this.inputs.push(...extraInputs);
    if (this.mode === 'live') return run();
    const r = this.record!;
    if (this.mode === 'replay') {
      const seg = r.backward!;
      const gpu = this.owner.gpu;
      if (grads.size !== 0 || !sameNumbers(gpu.allocator.idleSerials(), seg.idle) || this.inputs.some((t, i) => !samePlacement(placement(t), seg.inputs[i])))
        throw new ReplayMismatchError('the step replay found the backward not starting where the recorded one did, after a replayed forward');
      this.replaySegment(seg);
      for (const [t, rec] of r.grads) grads.set(t, this.tensorOf(rec));
      this.owner.stats.replayed++;
      return;
    }
    if (grads.size !== 0) {
      this.abandon('the tape holds gradients before the backward');
      return run();
    }
    const cap = this.start();
    try {
      run();
    } finally {
      this.stop();
    }
    if (cap.refused) return this.abandon(cap.refused);
    r.backward = cap.seg;
    const held = new Set<Allocation>();
    for (const [t, g] of grads) {
      const rec = this.recordOf(g, cap);
      if (!rec || this.allocs.index.has(t.alloc)) return this.abandon('the backward leaves a gradient it cannot name');
      if (rec.ref !== null) {
        if (held.has(g.alloc)) return this.abandon('two gradients share one buffer');
        held.add(g.alloc);
      }
      r.grads.push([t, rec]);
    }
    const leaked = this.allocs.list.find((a) => !a.freed && !held.has(a));
    if (leaked) return this.abandon(`'${leaked.label}', made in the step, stays live and is no output`);
    this.owner.captured(r);
  }

  /**
   * After a ReplayMismatchError: frees what the replay allocated and the inputs the recorded step consumes (the
   * backward's gradient in), so the allocator holds what it held before the step, less those inputs, as a live step
   * leaves it. Gradient slots need nothing: the replayed backward encoded no dispatch, and a step overwrites a slot
   * with its first gradient (Tape.accGemm).
   */
  discard(): void {
    const allocator = this.owner.gpu.allocator;
    for (const a of this.allocs.list) allocator.free(a);
    const r = this.record!;
    for (const seg of [r.forward, r.backward!])
      for (const e of seg.events) if (!e.alloc && e.ref < 0 && -e.ref - 1 < this.inputs.length) allocator.free(this.inputs[-e.ref - 1].alloc);
  }

  private start(): Capture {
    const gpu = this.owner.gpu;
    const cap = new Capture(gpu, this.allocs, this.inputs);
    gpu.captureSink = cap;
    gpu.allocator.observer = cap;
    return cap;
  }

  private stop(): void {
    const gpu = this.owner.gpu;
    (gpu.captureSink as Capture | null)!.seg.ringEnd = gpu.uniformFill;
    gpu.captureSink = null;
    gpu.allocator.observer = null;
  }

  private abandon(reason: string): void {
    this.mode = 'live';
    this.owner.refused(this.fullKey, reason);
  }

  private recordOf(t: Tensor, cap: Capture): TensorRecord | null {
    const ref = cap.refOf(t.alloc);
    if (ref === null && (t.owner || t.alloc.freed)) return null;
    return { ref, kept: ref === null ? t : null, shape: [...t.shape], dtype: t.dtype, byteOffset: t.byteOffset, owner: t.owner };
  }

  private tensorOf(r: TensorRecord): Tensor {
    if (r.kept) return r.kept;
    const a = r.ref! >= 0 ? this.allocs.list[r.ref!] : this.inputs[-r.ref! - 1].alloc;
    return new Tensor(a, r.shape, r.dtype, r.byteOffset, r.owner);
  }

  /** The allocator's events (each must hand out the recorded buffer), then the dispatches: three encoder calls each. */
  private replaySegment(seg: Segment): void {
    const allocator = this.owner.gpu.allocator;
    for (const e of seg.events) {
      if (e.alloc) {
        const a = allocator.alloc(e.bytes, e.tag, e.label, e.usage);
        this.allocs.add(a);
        if (a.buffer !== e.buffer) throw new ReplayMismatchError(`the step replay found '${e.label}' given another buffer than in the recorded step`);
      } else allocator.free(e.ref >= 0 ? this.allocs.list[e.ref] : this.inputs[-e.ref - 1].alloc);
    }
    const ds = seg.baked!;
    const pass = this.owner.gpu.replayPass(ds.length);
    let current: GPUComputePipeline | null = null;
    for (const d of ds) {
      if (current !== d.pipeline) {
        pass.setPipeline(d.pipeline);
        current = d.pipeline;
      }
      pass.setBindGroup(0, d.group);
      pass.dispatchWorkgroups(d.x, d.y, d.z);
    }
    this.owner.gpu.skipUniforms(seg.ringEnd);
  }
}
