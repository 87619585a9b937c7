// The optimizer's chunked state (ChunkedAdamW, optimizer.ts): the trainable parameters' fp32 state (master
// weights, first and second moments) grouped into equal-size chunks in execution order: Colossal-AI Gemini's
// layout, with the chunk store (IndexedDB in the browser, files in Node) where Gemini has CPU memory. A chunk is
// either resident on the GPU (three f32 buffers of `chunkElems`, or one packed buffer in the compact modes) or
// stored; the budget decides how many stay resident. A stored chunk streams through one GPU staging set: the next
// chunk's bytes are read from the store while this one updates (one-ahead prefetch), and the updated state is
// written back while the following one updates (write-behind). Every store write is a new version key, so the
// versions a checkpoint names stay readable until a newer checkpoint commits (crash-safe resume).
//
// This module places, streams, measures and checkpoints that state; the step (optimizer.ts) and the fused-step
// protocol (optimizer-fused.ts) drive the updates through it.
import type { Gpu } from '../gpu/device.ts';
import { BYTES, Tensor, type DType } from '../gpu/tensor.ts';
import { adamwStats, adamwStateStats, masterLimit, type AdamWConfig, type AdamWParam, type AdamWStateStats } from '../ops/adamw.ts';
import { CODES, extOf, f16Of, mastersOf, momentsOf, packedSignals, packedStorageBuffers, type PackedParam } from '../ops/adamw-packed.ts';
import type { ChunkStore } from '../store/chunkstore.ts';
import { fromF16Bits } from '../util/half.ts';
import { FP32_MODE, hostState, initialBytes, isFp32Mode, packChunk, packedViews, type ChunkPack, type OptimizerMode } from './packed-state.ts';

export interface ParamSlot {
  name: string;
  shape: number[];
  numel: number;
  /** Element offset inside its chunk. */
  offset: number;
}

export interface Chunk {
  index: number;
  params: ParamSlot[];
  /**
   * The chunk's own learning rate (its parameters' group, e.g. text-encoder LoRA's), or undefined: the optimizer's.
   * Chunks never mix rates, so the step bound (adamwStepSafe) and every update of a chunk use one AdamW config.
   */
  lr?: number;
  /** Elements used (<= chunkElems). */
  elems: number;
  /** GPU state [master | m | v] as three f32 tensors of `elems` (fp32 mode), or null (stored, or a compact mode). */
  resident: ChunkState | null;
  /** Compact modes: the chunk's packed state on the GPU (packed-state.ts layout), or null when it lives in the store. */
  packed: Tensor | null;
  /** Store version of a stored chunk (the step that wrote it). */
  version: number;
  /**
   * Statistics of the chunk's state (for the step bound): a stored chunk's at `version`; a resident
   * chunk's only while fused updates keep them current (measured by the first fused step, refreshed by
   * each fused update, cleared by an unfused one and by restore); null when unknown.
   */
  stats: AdamWStateStats | null;
}

/** A trainable parameter as the optimizer is given it; `lr` sets a learning rate of its own (undefined: the optimizer's). */
export interface ParamSpec {
  name: string;
  shape: number[];
  lr?: number;
}

/**
 * Packs parameters (in order) into chunks of at most `chunkElems` elements (a bigger tensor gets its own). A
 * parameter whose learning rate differs from the chunk's so far starts a new chunk.
 */
export function planChunks(params: ParamSpec[], chunkElems: number): ChunkPlan[] {
  const chunks: ChunkPlan[] = [];
  let cur: ParamSlot[] = [];
  let used = 0;
  let lr: number | undefined;
  const close = () => {
    if (cur.length) chunks.push({ index: chunks.length, params: cur, elems: used, ...(lr !== undefined ? { lr } : {}) });
    cur = [];
    used = 0;
  };
  for (const p of params) {
    const numel = p.shape.reduce((a, b) => a * b, 1);
    if (used > 0 && (used + numel > chunkElems || p.lr !== lr)) close();
    lr = p.lr;
    cur.push({ name: p.name, shape: p.shape, numel, offset: used });
    used += numel;
  }
  close();
  return chunks;
}

export type ChunkPlan = Omit<Chunk, 'resident' | 'packed' | 'version' | 'stats'>;

/** An fp32 chunk's three state buffers (resident, or the staging set's views). */
export interface ChunkState {
  master: Tensor;
  m: Tensor;
  v: Tensor;
}

export interface ChunkedAdamWOptions {
  cfg: AdamWConfig;
  chunkElems: number;
  /** How many chunks (from the first) stay on the GPU; the rest stream through the store. */
  residentChunks: number;
  store: ChunkStore;
  /** Store key prefix of this run's optimizer chunks. */
  prefix: string;
  maxGradNorm?: number;
  /** How moments and masters are kept (packed-state.ts); default fp32 AdamW. */
  mode?: OptimizerMode;
}

export const f32Bytes = (a: Float32Array) => new Uint8Array(a.buffer, a.byteOffset, a.byteLength);

export class OptimizerChunks {
  readonly chunks: Chunk[];
  private staging: ChunkState | null = null;
  /** The gradients' inf/NaN flag (raised on the GPU, read once per step). */
  readonly flag: Tensor;
  /** Raised by adamwCheck when this step's update would make a value non-finite. */
  readonly updateFlag: Tensor;
  /** f32 [4] adamwStats output for a streamed chunk. */
  readonly statsOut: Tensor;
  readonly signals: Tensor[];
  /** The step's gradient norm (written by globalNorm into packedSignals' inputs buffer). */
  readonly normOut: Tensor;
  /** Step count of applied updates (AdamW's t). */
  applied = 0;
  /** Versions that the latest committed checkpoint names (not deleted when superseded). */
  private pinned = new Map<number, number>();

  private constructor(
    readonly gpu: Gpu,
    readonly o: ChunkedAdamWOptions,
    chunks: ChunkPlan[],
    /** The compute-dtype weight each parameter's update writes (f16(master) or the f32 master copy). */
    readonly weights: Map<string, Tensor>,
  ) {
    this.chunks = chunks.map((c) => ({ ...c, resident: null, packed: null, version: 0, stats: null }));
    this.cfgs = this.chunks.map((c) => (c.lr === undefined ? o.cfg : { ...o.cfg, lr: c.lr }));
    // The flags, the norm and the state statistics live in two buffers adamw_packed binds once each (packedSignals).
    ({ buffers: this.signals, updateFlag: this.updateFlag, flag: this.flag, stats: this.statsOut, norm: this.normOut } = packedSignals(gpu));
    this.mode = o.mode ?? FP32_MODE;
    if (!isFp32Mode(this.mode)) {
      const dtype = [...weights.values()][0]?.dtype ?? 'f32';
      // The device must bind as many storage buffers as the update kernel does in this mode.
      const need = packedStorageBuffers({
        q8: this.mode.optimizer === 'adamw8bit',
        ext: this.mode.master === 'compact' && dtype === 'f16',
        master: !(this.mode.master === 'compact' && dtype === 'f16'),
        copy: this.mode.master === 'fp32',
      });
      const limit = gpu.device.limits.maxStorageBuffersPerShaderStage;
      if (limit < need)
        throw new Error(
          `this GPU binds at most ${limit} storage buffers per shader; the optimizer mode ${this.mode.optimizer} + ${this.mode.master} master needs ${need}: ` +
            `choose the optimizer adamw (f32 moments) and the fp32 master`,
        );
      this.packs = this.chunks.map((c) =>
        packChunk(
          c.params.map((p) => p.numel),
          this.mode,
          dtype,
        ),
      );
      this.codes = gpu.upload(CODES, [CODES.length], 'f32', 'optimizer', 'opt.codes');
    }
  }

  /** How this optimizer keeps its state. */
  readonly mode: OptimizerMode;
  /** Each chunk's AdamW config: the optimizer's, with the chunk's own learning rate where it has one. */
  cfgs: AdamWConfig[];

  /**
   * A learning-rate schedule's factor for the coming step: every chunk's rate (its own or the optimizer's)
   * times `factor`. AdamW's moments do not depend on the rate, so the schedule is a pure function of the step.
   */
  setLrScale(factor: number): void {
    this.cfgs = this.chunks.map((c) => ({ ...this.o.cfg, lr: (c.lr ?? this.o.cfg.lr) * factor }));
  }
  /** Compact modes: each chunk's byte layout (null in fp32 mode). */
  readonly packs: ChunkPack[] | null = null;
  /** Compact modes: the 8-bit code tables on the GPU. */
  readonly codes: Tensor | null = null;
  private packedStaging: Tensor | null = null;

  /**
   * Places the state: resident chunks get GPU buffers; stored chunks are written to the store (version 0).
   * `initial(name)` gives a parameter's starting fp32 values.
   */
  static async create(
    gpu: Gpu,
    params: ParamSpec[],
    weights: Map<string, Tensor>,
    initial: (name: string) => Promise<Float32Array>,
    o: ChunkedAdamWOptions,
  ): Promise<OptimizerChunks> {
    const opt = new OptimizerChunks(gpu, o, planChunks(params, o.chunkElems), weights);
    if (gpu.dryRun) {
      await opt.createDry();
      return opt;
    }
    if (opt.packs) {
      await opt.createPacked(initial);
      return opt;
    }
    for (const c of opt.chunks) {
      opt.hostPackedChunks++;
      const master = new Float32Array(c.elems);
      for (const p of c.params) master.set(await initial(p.name), p.offset);
      if (c.index < o.residentChunks) {
        c.resident = {
          master: gpu.upload(master, [c.elems], 'f32', 'optimizer', `opt${c.index}.master`),
          m: gpu.zeros([c.elems], 'f32', 'optimizer', `opt${c.index}.m`),
          v: gpu.zeros([c.elems], 'f32', 'optimizer', `opt${c.index}.v`),
        };
      } else {
        const packed = new Float32Array(3 * c.elems);
        packed.set(master);
        await o.store.write(opt.key(c.index, 0), f32Bytes(packed));
        c.stats = opt.statsOf(c, packed);
      }
    }
    return opt;
  }

  /** Compact modes: every chunk's starting bytes; resident chunks uploaded, the others written to the store. */
  async createPacked(initial: (name: string) => Promise<Float32Array>): Promise<void> {
    for (const c of this.chunks) {
      this.hostPackedChunks++;
      const values = await Promise.all(c.params.map((p) => initial(p.name)));
      // The f16 weights hold f16(initial) (the trainer uploads them so): the extension keeps the rest.
      const w16 = values.map((v, i) => (this.weightOf(c.params[i]).dtype === 'f16' ? v.map(f16Of) : undefined));
      const bytes = initialBytes(this.packs![c.index], values, w16, extOf);
      if (c.index < this.o.residentChunks) {
        c.packed = this.gpu.tensor([bytes.byteLength / 4], 'f32', 'optimizer', `opt${c.index}.packed`);
        this.gpu.writeRaw(c.packed, bytes);
      } else {
        await this.o.store.write(this.key(c.index, 0), bytes);
        c.stats = this.packedStats(c, bytes, (i) => w16[i] ?? values[i]);
      }
    }
  }

  /**
   * The planner's create (a dry-run Gpu: nothing is backed, every read gives zeros): the same GPU allocations
   * in the same order (tags, labels, sizes) and the same store keys and byte lengths as create, without the
   * starting values. Packing them on the host (f16 rounding, extension words, 8-bit codes, statistics over
   * every element) was a minute per dry run of a full SD 1.5 fine-tune, for bytes the dry-run store drops and a
   * dry GPU never holds. A stored chunk's statistics are those of an all-zero state: what the dry Gpu's zeros
   * packed to before, and what its steps read back for the statistics after every update.
   */
  async createDry(): Promise<void> {
    const zero = new Float32Array(1);
    const zeroStats = adamwStateStats(zero, zero, zero, this.o.cfg);
    for (const c of this.chunks) {
      const resident = c.index < this.o.residentChunks;
      if (this.packs) {
        const bytes = this.packs[c.index].bytes;
        if (resident) c.packed = this.gpu.tensor([bytes / 4], 'f32', 'optimizer', `opt${c.index}.packed`);
        else await this.o.store.write(this.key(c.index, 0), new Uint8Array(bytes));
      } else if (resident) {
        c.resident = {
          master: this.gpu.tensor([c.elems], 'f32', 'optimizer', `opt${c.index}.master`),
          m: this.gpu.zeros([c.elems], 'f32', 'optimizer', `opt${c.index}.m`),
          v: this.gpu.zeros([c.elems], 'f32', 'optimizer', `opt${c.index}.v`),
        };
      } else await this.o.store.write(this.key(c.index, 0), new Uint8Array(12 * c.elems));
      if (!resident) c.stats = { ...zeroStats };
    }
  }

  /**
   * Chunks whose starting state create() built on the host (read the initial values, packed them, measured their
   * statistics): every chunk on a real Gpu, none on a dry-run one (the planner's test holds it to 0).
   */
  hostPackedChunks = 0;

  weightOf(p: ParamSlot): Tensor {
    return this.weights.get(p.name) ?? noGradient(p.name);
  }

  /** Whether a chunk's state is on the GPU (either layout). */
  onGpu(c: Chunk): boolean {
    return c.resident !== null || c.packed !== null;
  }

  get storedChunks(): number {
    return this.chunks.filter((c) => !this.onGpu(c)).length;
  }

  /** Views of one parameter's state inside a packed chunk buffer (or the staging buffer), for adamw_packed. */
  packedParam(buf: Tensor, c: Chunk, i: number): PackedParam {
    return packedViews(buf, this.packs![c.index].params[i], this.weightOf(c.params[i]));
  }

  /** Statistics of a packed chunk's state measured on the host (weightValues: each parameter's f16 weights, compact f16 only). */
  private packedStats(c: Chunk, bytes: Uint8Array, weightValues: (i: number) => Float32Array): AdamWStateStats {
    const pack = this.packs![c.index];
    const all: AdamWStateStats = { maxAbsMaster: 0, maxAbsM: 0, maxV: 0, maxRatio: 0 };
    pack.params.forEach((p, i) => {
      const st = hostState(bytes, p, p.ext >= 0 ? weightValues(i) : undefined);
      const master = p.master < 0 && p.ext < 0 ? weightValues(i) : mastersOf(st, p.numel);
      const { m, v } = momentsOf(st, p.numel);
      const s = adamwStateStats(master, m, v, this.cfgs[c.index]);
      const max = (a: number, b: number) => (Number.isNaN(a) || Number.isNaN(b) ? NaN : Math.max(a, b));
      all.maxAbsMaster = max(all.maxAbsMaster, s.maxAbsMaster);
      all.maxAbsM = max(all.maxAbsM, s.maxAbsM);
      all.maxV = max(all.maxV, s.maxV);
      all.maxRatio = max(all.maxRatio, s.maxRatio);
    });
    return all;
  }

  /** Each parameter's compute weights of a chunk, read from the GPU (the compact master's high part). */
  async chunkWeights(c: Chunk): Promise<Float32Array[]> {
    return Promise.all(c.params.map((p) => this.gpu.read(this.weightOf(p))));
  }

  async readBytes(t: Tensor): Promise<Uint8Array> {
    if (this.gpu.dryRun) return new Uint8Array(t.byteSize);
    return new Uint8Array(await this.gpu.readBytes(t.buffer, t.byteOffset, t.byteSize));
  }

  private ensurePackedStaging(): Tensor {
    if (!this.packedStaging) {
      const bytes = Math.max(...this.chunks.filter((c) => !this.onGpu(c)).map((c) => this.packs![c.index].bytes));
      this.packedStaging = this.gpu.tensor([bytes / 4], 'f32', 'optimizer', 'opt.staging.packed');
    }
    return this.packedStaging;
  }

  /** Streams stored packed chunks through the staging buffer, reading chunk i + 1 while `visit` works on i. */
  async streamPacked(chunks: Chunk[], visit: (buf: Tensor, c: Chunk) => Promise<void>): Promise<void> {
    let next = chunks.length ? this.readRaw(chunks[0]) : null;
    for (let i = 0; i < chunks.length; i++) {
      const c = chunks[i];
      const bytes = await next!;
      next = i + 1 < chunks.length ? this.readRaw(chunks[i + 1]) : null;
      next?.catch(() => {}); // awaited on the next turn
      const st = this.ensurePackedStaging();
      const view = new Tensor(st.alloc, [bytes.byteLength / 4], 'f32', st.byteOffset, false);
      this.gpu.writeRaw(view, bytes);
      await visit(view, c);
    }
  }

  async readRaw(c: Chunk): Promise<Uint8Array> {
    const b = await this.o.store.read(this.key(c.index, c.version));
    if (!b) throw new Error(`optimizer chunk ${c.index} (version ${c.version}) is missing from the ${this.o.store.kind} store`);
    return this.checkPackedSize(c, b.byteOffset % 4 === 0 ? b : b.slice(), `optimizer chunk ${c.index} (version ${c.version})`);
  }

  private checkPackedSize(c: Chunk, b: Uint8Array, what: string): Uint8Array {
    const want = this.packs![c.index].bytes;
    if (b.byteLength !== want)
      throw new Error(
        `${what} holds ${b.byteLength} bytes, not the ${want} of this run's optimizer layout: it is damaged or from another run; start the run again`,
      );
    return b;
  }

  key(index: number, version: number): string {
    return `${this.o.prefix}/c${String(index).padStart(5, '0')}-v${version}`;
  }

  private ensureStaging(): ChunkState {
    if (!this.staging) {
      // A tensor larger than chunkElems has a chunk of its own: size the staging for the largest stored chunk.
      const n = Math.max(...this.chunks.filter((c) => !c.resident).map((c) => c.elems));
      this.staging = {
        master: this.gpu.tensor([n], 'f32', 'optimizer', 'opt.staging.master'),
        m: this.gpu.tensor([n], 'f32', 'optimizer', 'opt.staging.m'),
        v: this.gpu.tensor([n], 'f32', 'optimizer', 'opt.staging.v'),
      };
    }
    return this.staging;
  }

  /** The first `elems` of each staging buffer. */
  private chunkViews(st: ChunkState, elems: number): ChunkState {
    const view = (t: Tensor) => new Tensor(t.alloc, [elems], 'f32', t.byteOffset, false);
    return { master: view(st.master), m: view(st.m), v: view(st.v) };
  }

  /** Views of one parameter inside a chunk's three state buffers. */
  paramState(state: ChunkState, p: ParamSlot): AdamWParam {
    const view = (t: Tensor) => new Tensor(t.alloc, p.shape, 'f32', t.byteOffset + 4 * p.offset, false);
    return { master: view(state.master), m: view(state.m), v: view(state.v), weight: this.weights.get(p.name) };
  }

  /** A stored chunk's statistics, measured on the host from its packed [master | m | v]. */
  private statsOf(c: Chunk, packed: Float32Array): AdamWStateStats {
    const e = c.elems;
    return adamwStateStats(packed.subarray(0, e), packed.subarray(e, 2 * e), packed.subarray(2 * e, 3 * e), this.cfgs[c.index]);
  }

  /** Uploads a stored chunk's packed state into the staging set; returns its views. */
  stage(c: Chunk, bytes: Float32Array): ChunkState {
    const st = this.chunkViews(this.ensureStaging(), c.elems);
    this.gpu.write(st.master, bytes.subarray(0, c.elems));
    this.gpu.write(st.m, bytes.subarray(c.elems, 2 * c.elems));
    this.gpu.write(st.v, bytes.subarray(2 * c.elems, 3 * c.elems));
    return st;
  }

  /** Streams stored chunks through the staging set in order, reading chunk i + 1 while `visit` works on i. */
  async streamChunks(chunks: Chunk[], visit: (st: ChunkState, c: Chunk) => Promise<void>): Promise<void> {
    let next = chunks.length ? this.readChunk(chunks[0]) : null;
    for (let i = 0; i < chunks.length; i++) {
      const c = chunks[i];
      const bytes = await next!;
      next = i + 1 < chunks.length ? this.readChunk(chunks[i + 1]) : null;
      next?.catch(() => {}); // awaited on the next turn
      await visit(this.stage(c, bytes), c);
    }
  }

  /** Uploads a stored packed chunk's bytes into the staging buffer; returns the view. */
  stageBytes(c: Chunk, bytes: Uint8Array): Tensor {
    const st = this.ensurePackedStaging();
    const view = new Tensor(st.alloc, [bytes.byteLength / 4], 'f32', st.byteOffset, false);
    this.gpu.writeRaw(view, bytes);
    return view;
  }

  /**
   * Sets `stats` of fp32 resident chunks to their state's statistics now: adamwStats of each into its own
   * 256-byte slot (storage bindings start at aligned offsets) of one buffer, then a single read-back.
   */
  async measureResidentStats(chunks: Chunk[]): Promise<void> {
    if (!chunks.length) return;
    const SLOT = 64; // f32s per slot: 256 bytes, WebGPU's largest minStorageBufferOffsetAlignment
    const out = this.gpu.zeros([SLOT * chunks.length], 'f32', 'scratch', 'opt.residentStats');
    try {
      chunks.forEach((c, i) => adamwStats(this.gpu, c.resident!, this.cfgs[c.index], new Tensor(out.alloc, [4], 'f32', out.byteOffset + 4 * SLOT * i, false)));
      const all = await this.gpu.read(out);
      chunks.forEach((c, i) => {
        const [maxAbsMaster, maxAbsM, maxV, maxRatio] = all.subarray(i * SLOT, i * SLOT + 4);
        c.stats = { maxAbsMaster, maxAbsM, maxV, maxRatio };
      });
    } finally {
      this.gpu.free(out);
    }
  }

  /** An fp32 resident chunk's statistics now (adamwStats on the GPU, 16 bytes read back). */
  async measureResident(c: Chunk): Promise<AdamWStateStats> {
    this.gpu.write(this.statsOut, [0, 0, 0, 0]);
    adamwStats(this.gpu, c.resident!, this.cfgs[c.index], this.statsOut);
    const [maxAbsMaster, maxAbsM, maxV, maxRatio] = await this.gpu.read(this.statsOut);
    return { maxAbsMaster, maxAbsM, maxV, maxRatio };
  }

  /** The largest |master| a chunk's weight copies keep finite (F16_MAX when any copy is f16). */
  chunkLimit(c: Chunk): number {
    return Math.min(...c.params.map((p) => masterLimit(this.weights.get(p.name)?.dtype)));
  }

  async readChunk(c: Chunk): Promise<Float32Array> {
    const b = await this.o.store.read(this.key(c.index, c.version));
    if (!b) throw new Error(`optimizer chunk ${c.index} (version ${c.version}) is missing from the ${this.o.store.kind} store`);
    return new Float32Array(b.buffer, b.byteOffset, b.byteLength / 4);
  }

  /** New version first, then the superseded one goes (unless a checkpoint still names it). */
  async writeChunk(c: Chunk, version: number, packed: Float32Array, stats: AdamWStateStats): Promise<void> {
    await this.writeChunkBytes(c, version, f32Bytes(packed), stats);
  }

  async writeChunkBytes(c: Chunk, version: number, bytes: Uint8Array, stats: AdamWStateStats): Promise<void> {
    await this.o.store.write(this.key(c.index, version), bytes);
    const old = c.version;
    c.version = version;
    c.stats = stats;
    if (this.pinned.get(c.index) !== old) await this.o.store.delete(this.key(c.index, old));
  }

  /** Where a parameter's state sits: its chunk and element offset there. */
  locate(name: string): { chunk: number; offset: number; numel: number } {
    for (const c of this.chunks) {
      const p = c.params.find((q) => q.name === name);
      if (p) return { chunk: c.index, offset: p.offset, numel: p.numel };
    }
    throw new Error(`no trainable parameter ${name}`);
  }

  /** The fp32 masters of one chunk (its first `elems` values), from the GPU or the store. */
  async chunkMasters(index: number): Promise<Float32Array> {
    const c = this.chunks[index];
    if (this.packs) {
      const bytes = c.packed ? await this.readBytes(c.packed) : await this.readRaw(c);
      const weights = await this.chunkWeights(c);
      const out = new Float32Array(c.elems);
      this.packs[index].params.forEach((p, i) => {
        // An fp32 master from the bytes; a compact one is the weight (+ its extension words).
        const master = p.master < 0 && p.ext < 0 ? weights[i] : mastersOf(hostState(bytes, p, weights[i]), p.numel);
        out.set(master, c.params[i].offset);
      });
      return out;
    }
    const src = c.resident ? await this.gpu.read(c.resident.master) : await this.readChunk(c);
    return src.subarray(0, c.elems);
  }

  /** fp32 master values of one parameter (from the GPU or the store). */
  async master(name: string): Promise<Float32Array> {
    const at = this.locate(name);
    return (await this.chunkMasters(at.chunk)).slice(at.offset, at.offset + at.numel);
  }

  /**
   * What a checkpoint holds: resident chunks' bytes (read back) as files, stored chunks by version
   * (their version keys stay until a later checkpoint commits: call `pin` once it has).
   */
  async checkpointState(): Promise<{ files: Map<string, Uint8Array>; versions: Record<number, number>; applied: number }> {
    const files = new Map<string, Uint8Array>();
    const versions: Record<number, number> = {};
    for (const c of this.chunks) {
      if (c.resident) {
        const packed = new Float32Array(3 * c.elems);
        packed.set(await this.gpu.read(c.resident.master), 0);
        packed.set(await this.gpu.read(c.resident.m), c.elems);
        packed.set(await this.gpu.read(c.resident.v), 2 * c.elems);
        files.set(`opt-c${c.index}`, f32Bytes(packed));
      } else if (c.packed) files.set(`opt-c${c.index}`, await this.readBytes(c.packed));
      else versions[c.index] = c.version;
      // A compact master's high part is the compute weight: the checkpoint keeps it (as its raw bits).
      if (this.mode.master === 'compact') files.set(`opt-w${c.index}`, await this.weightBits(c));
    }
    return { files, versions, applied: this.applied };
  }

  /** After a checkpoint committed: its versions stay; versions only the previous one named can go. */
  async pin(versions: Record<number, number>): Promise<void> {
    const before = this.pinned;
    this.pinned = new Map(Object.entries(versions).map(([k, v]) => [Number(k), v]));
    for (const [i, v] of before) if (this.chunks[i].version !== v && this.pinned.get(i) !== v) await this.o.store.delete(this.key(i, v));
  }

  /**
   * Restores a checkpoint: resident chunks from its files, stored chunks at its versions (newer versions
   * written after it, by a run that then crashed, are deleted), and the weights recomputed from the masters.
   */
  async restore(read: (name: string) => Promise<Uint8Array>, versions: Record<number, number>, applied: number): Promise<void> {
    if (this.packs) await this.restorePacked(read, versions);
    for (const c of this.packs ? [] : this.chunks) {
      let packed: Float32Array;
      if (c.resident) {
        const b = await read(`opt-c${c.index}`);
        if (b.byteLength !== 3 * c.elems * 4)
          throw new Error(
            `the checkpoint's optimizer chunk ${c.index} holds ${b.byteLength} bytes, not the ${3 * c.elems * 4} of this run's layout: the checkpoint is damaged or from another run; start the run again`,
          );
        packed = new Float32Array(b.buffer, b.byteOffset, b.byteLength / 4);
        this.gpu.write(c.resident.master, packed.subarray(0, c.elems));
        this.gpu.write(c.resident.m, packed.subarray(c.elems, 2 * c.elems));
        this.gpu.write(c.resident.v, packed.subarray(2 * c.elems));
        c.stats = null;
      } else {
        c.version = versions[c.index];
        if (c.version === undefined) throw new Error(`checkpoint names no version for optimizer chunk ${c.index}`);
        packed = await this.readChunk(c);
        c.stats = this.statsOf(c, packed);
      }
      for (const p of c.params) {
        const w = this.weights.get(p.name);
        if (w) this.gpu.write(w, packed.subarray(p.offset, p.offset + p.numel));
      }
    }
    this.pinned = new Map(Object.entries(versions).map(([k, v]) => [Number(k), v]));
    const keep = new Set(this.chunks.filter((c) => !this.onGpu(c)).map((c) => this.key(c.index, c.version)));
    for (const k of await this.o.store.keys(`${this.o.prefix}/`)) if (!keep.has(k)) await this.o.store.delete(k);
    this.applied = applied;
  }

  /** The compute weights of a chunk's parameters as raw bits, concatenated (f16: 2 bytes each, f32: 4). */
  async weightBits(c: Chunk): Promise<Uint8Array> {
    const parts = await Promise.all(
      c.params.map(async (p) => {
        const w = this.weightOf(p);
        if (this.gpu.dryRun) return new Uint8Array(w.byteSize);
        return new Uint8Array(await this.gpu.readBytes(w.buffer, w.byteOffset, w.byteSize));
      }),
    );
    const out = new Uint8Array(parts.reduce((n, b) => n + b.byteLength, 0));
    let at = 0;
    for (const b of parts) {
      out.set(b, at);
      at += b.byteLength;
    }
    return out;
  }

  /** Compact modes' restore: packed bytes (files or store versions) and the weights (their bits, or f(fp32 master)). */
  async restorePacked(read: (name: string) => Promise<Uint8Array>, versions: Record<number, number>): Promise<void> {
    for (const c of this.chunks) {
      const pack = this.packs![c.index];
      let bytes: Uint8Array;
      if (c.packed) {
        bytes = this.checkPackedSize(c, (await read(`opt-c${c.index}`)).slice(), `the checkpoint's optimizer chunk ${c.index}`);
        this.gpu.writeRaw(c.packed, bytes);
      } else {
        c.version = versions[c.index];
        if (c.version === undefined) throw new Error(`checkpoint names no version for optimizer chunk ${c.index}`);
        bytes = await this.readRaw(c);
      }
      const weights = this.mode.master === 'compact' ? this.decodeWeights(c, await read(`opt-w${c.index}`)) : null;
      pack.params.forEach((p, i) => {
        const values = weights ? weights[i] : hostState(bytes, p).master!;
        this.gpu.write(this.weightOf(c.params[i]), values);
      });
      c.stats = c.packed ? null : this.packedStats(c, bytes, (i) => weights?.[i] ?? hostState(bytes, pack.params[i]).master!);
    }
  }

  /** The weight values of a chunk's checkpointed bits (weightBits), checked for size. */
  private decodeWeights(c: Chunk, bits: Uint8Array): Float32Array[] {
    const sizes = c.params.map((p) => this.weightOf(p).byteSize);
    const want = sizes.reduce((a, b) => a + b, 0);
    if (bits.byteLength !== want)
      throw new Error(
        `the checkpoint's weights of optimizer chunk ${c.index} hold ${bits.byteLength} bytes, not ${want}: the checkpoint is damaged or from another run; start the run again`,
      );
    let at = 0;
    return c.params.map((p, i) => {
      const raw = bits.slice(at, at + sizes[i]);
      at += sizes[i];
      return this.weightOf(p).dtype === 'f16' ? fromF16Bits(new Uint16Array(raw.buffer, 0, p.numel)) : new Float32Array(raw.buffer, 0, p.numel);
    });
  }

  // ---- packed gradients and weights: one kernel per chunk instead of one per parameter ----

  /** Each chunk's gradient buffer (gradSlots), by chunk index. */
  private gradArenas: (Tensor | null)[] = [];

  /**
   * Gradient buffers for every parameter, packed per chunk as the chunk's state is ([elems], parameters at their
   * offsets; Tape.useGradSlots writes the gradients there): the norm and, where the weights are packed too
   * (packedWeight), AdamW then run once per chunk, the same math per element. Made once and kept (a LoRA's
   * gradients are small; a full fine-tune's would hold every gradient at once, so it asks for none). A chunk
   * whose parameters differ in dtype gets none.
   */
  gradSlots(): Map<string, Tensor> {
    const out = new Map<string, Tensor>();
    this.chunks.forEach((c, i) => {
      const dtypes = new Set(c.params.map((p) => this.weights.get(p.name)?.dtype));
      const dtype = [...dtypes][0];
      if (dtypes.size !== 1 || !dtype) return;
      const arena = (this.gradArenas[i] ??= this.gpu.tensor([c.elems], dtype, 'gradients', `opt.grads.${i}`));
      for (const p of c.params) out.set(p.name, new Tensor(arena.alloc, p.shape, dtype, arena.byteOffset + BYTES[dtype] * p.offset, false));
    });
    return out;
  }

  /** Chunk c's gradients as one [elems] tensor, when every one of them sits in its gradSlots view; else null. */
  packedGrad(c: Chunk, grads: ReadonlyMap<string, Tensor>): Tensor | null {
    const arena = this.gradArenas[c.index];
    if (!arena) return null;
    const at = (p: ParamSlot) => arena.byteOffset + BYTES[arena.dtype] * p.offset;
    const ok = c.params.every((p) => {
      const g = grads.get(p.name);
      return !!g && g.alloc === arena.alloc && g.byteOffset === at(p) && g.dtype === arena.dtype;
    });
    return ok ? new Tensor(arena.alloc, [c.elems], arena.dtype, arena.byteOffset, false) : null;
  }

  /**
   * Chunk c's compute-copy weights as one [elems] tensor, when they sit side by side in one buffer as the chunk's
   * state does (packedWeights made them so); undefined when no parameter has a copy; null otherwise.
   */
  packedWeight(c: Chunk): Tensor | null | undefined {
    const ws = c.params.map((p) => this.weights.get(p.name));
    if (ws.every((w) => !w)) return undefined;
    const first = ws[0];
    if (!first || c.params[0].offset !== 0) return null;
    const ok = ws.every(
      (w, i) => !!w && w.alloc === first.alloc && w.dtype === first.dtype && w.byteOffset === first.byteOffset + BYTES[first.dtype] * c.params[i].offset,
    );
    return ok ? new Tensor(first.alloc, [c.elems], first.dtype, first.byteOffset, false) : null;
  }

  /** Chunk c's update as one AdamW parameter and gradient (packedGrad, packedWeight), or null where it is not packed. */
  chunkUpdate(state: ChunkState, c: Chunk, grads: ReadonlyMap<string, Tensor>): { param: AdamWParam; grad: Tensor } | null {
    const grad = this.packedGrad(c, grads);
    const weight = grad && this.packedWeight(c);
    if (!grad || weight === null) return null;
    const view = (t: Tensor) => new Tensor(t.alloc, [c.elems], 'f32', t.byteOffset, false);
    return { param: { master: view(state.master), m: view(state.m), v: view(state.v), weight }, grad };
  }

  /** The tensors a norm or finiteness pass reads: each chunk's packed gradient where it has one, else its parameters'. */
  normInputs(grads: ReadonlyMap<string, Tensor>): Tensor[] {
    return this.chunks.flatMap((c) => {
      const packed = this.packedGrad(c, grads);
      return packed ? [packed] : c.params.map((p) => grads.get(p.name) ?? noGradient(p.name));
    });
  }

  destroy(): void {
    this.gpu.free(...this.gradArenas);
    for (const c of this.chunks) if (c.packed) this.gpu.free(c.packed);
    this.gpu.free(this.packedStaging, this.codes);
    for (const c of this.chunks) if (c.resident) this.gpu.free(c.resident.master, c.resident.m, c.resident.v);
    if (this.staging) this.gpu.free(this.staging.master, this.staging.m, this.staging.v);
    this.gpu.free(...this.signals);
  }
}

/**
 * Uploads trainable parameters side by side in one buffer, dense in `params` order, as the optimizer's chunks lay
 * out their state, so a chunk's compute copies are one tensor to its update (OptimizerChunks.packedWeight). The
 * first tensor owns the buffer and the others are views: a model's weights are freed together. Where a parameter's
 * bytes are not a multiple of 4 (queue writes into a view must be), each is uploaded on its own instead.
 */
export function uploadPacked(gpu: Gpu, params: readonly ParamSpec[], values: (name: string) => Float32Array, dtype: DType): Map<string, Tensor> {
  const out = new Map<string, Tensor>();
  const sizes = params.map((p) => p.shape.reduce((a, b) => a * b, 1));
  if (!params.length || sizes.some((n) => (n * BYTES[dtype]) % 4 !== 0)) {
    for (const p of params) out.set(p.name, gpu.upload(values(p.name), p.shape, dtype, 'weights', p.name));
    return out;
  }
  const all = new Float32Array(sizes.reduce((a, b) => a + b, 0));
  let at = 0;
  const arena = gpu.tensor([all.length], dtype, 'weights', `${params[0].name} (+${params.length - 1} packed)`);
  params.forEach((p, i) => {
    all.set(values(p.name), at);
    out.set(p.name, new Tensor(arena.alloc, p.shape, dtype, arena.byteOffset + BYTES[dtype] * at, i === 0));
    at += sizes[i];
  });
  gpu.write(arena, all);
  return out;
}

/** A parameter of a chunk that got no gradient: the tape or the trainable set is wrong. */
export function noGradient(name: string): never {
  throw new Error(`no gradient reached trainable parameter ${name}`);
}
