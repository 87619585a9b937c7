// AdamW over the trainable parameters with their fp32 state (master weights, first and second moments)
// grouped into equal-size chunks in execution order: Colossal-AI Gemini's layout, with the chunk store
// (IndexedDB in the browser, files in Node) where Gemini has CPU memory. A chunk is either resident on
// the GPU (three f32 buffers of `chunkElems`) or stored; the budget decides how many stay resident. A
// stored chunk streams through one GPU staging set per step: the next chunk's bytes are read from the
// store while this one updates (one-ahead prefetch), and the updated state is written back while the
// following one updates (write-behind). Every store write is a new version key, so the versions a
// checkpoint names stay readable until a newer checkpoint commits (crash-safe resume).
//
// The step never lets a non-finite value reach the weights: the gradients' inf/NaN flag is raised on the
// GPU and read once (4 bytes); a flagged step updates nothing (and moves no chunk through the store).
//
// Finite gradients can still blow the weights up (a learning rate of 1e30 overflows the fp32 master, or
// its f16 copy past 65504), so before anything is written the step proves its update finite, for every
// chunk, and skips whole (`skipped: 'update'`, every master, moment, weight and store key untouched) when
// it is not:
//   - resident chunks: adamwCheck computes the update and raises an update flag without writing (one more
//     GPU read of gradients and state, no writes: a few % of a step);
//   - stored chunks: their state is not on the GPU, and checking it exactly would read every stored chunk
//     from the store twice per step (the streamed run's bottleneck, 12 bytes per element). Instead each
//     chunk carries statistics of its state (max |master|, |m|, v, |m| / sqrt(v): adamwStats on the
//     staging set after each update, 16 bytes read back; computed on the host at create and restore), and
//     adamwStepSafe bounds the step from them and the gradient's norm. Normal learning rates pass it by
//     orders of magnitude, so the streamed pass reads and writes each chunk once as before; only a chunk
//     whose bound fails is streamed through adamwCheck first (the extra read is paid only then).
// Rolling back instead (write new versions, drop them on overflow) was rejected: every stored chunk's
// previous version would have to stay until the step commits (a third copy of the streamed state in the
// store, past the 2x the studio plans for), and the f16 weights of streamed chunks, written as each chunk
// updates, would have to be restored from the store.
import type { Gpu } from '../gpu/device.ts';
import { Tensor } from '../gpu/tensor.ts';
import {
  adamw,
  adamwCheck,
  adamwStats,
  adamwStateStats,
  adamwStepSafe,
  masterLimit,
  type AdamWConfig,
  type AdamWParam,
  type AdamWStateStats,
  type AdamWStep,
} from '../ops/adamw.ts';
import { adamwPacked, CODES, extOf, f16Of, mastersOf, momentsOf, packedSignals, packedStorageBuffers, type PackedParam } from '../ops/adamw-packed.ts';
import { addNormPartial, checkFinite, clearFlag, finishNorm, globalNorm, normPartials, readFlag, type NormPartials } from '../ops/reduce.ts';
import type { ChunkStore } from '../store/chunkstore.ts';
import { fromF16Bits } from '../util/half.ts';
import { FP32_MODE, hostState, initialBytes, isFp32Mode, packChunk, packedViews, type ChunkPack, type OptimizerMode } from './packed-state.ts';
/** For the planner (train/plan.ts): optimizer state bytes per element and per chunk in each mode (packed-state.ts). */
export { chunkStateBytes, stateBytesPerElement, type OptimizerMode } from './packed-state.ts';

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
  resident: { master: Tensor; m: Tensor; v: Tensor } | null;
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

type ChunkPlan = Omit<Chunk, 'resident' | 'packed' | 'version' | 'stats'>;

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

/** One fused step's state between the trainer's passes (ChunkedAdamW.fusedBegin). */
export interface FusedStep {
  lossScale: number;
  /** The norm's partial sums (pass 1), null once finished. */
  parts: NormPartials | null;
  phase: 'norm' | 'check' | 'apply' | 'over';
  /** The step's AdamW parameters (decided after pass 1). */
  s: AdamWStep | null;
  gradNorm: number;
  /** Chunks whose update the statistics could not prove finite (checked in pass 2). */
  unproven: Set<number>;
  /** Chunks handed over in the current pass. */
  done: Set<number>;
  /** Chunk indices in the order pass 1 saw their gradients complete. */
  order: number[];
  /** Stored chunks' bytes being read ahead of their gradients. */
  reads: Map<number, Promise<Uint8Array>>;
  /** The last stored chunk's write, still landing. */
  writing: Promise<void> | null;
  /** Resident chunks' statistics being read back (collected by fusedEnd). */
  statsReads: Map<number, Promise<Float32Array>>;
}

export interface OptimizerStepResult {
  applied: boolean;
  /**
   * Why a step was not applied: 'gradients' (an inf/NaN in the loss-scaled gradients: the loss scale is
   * too high) or 'update' (finite gradients whose update would make a master, a moment or the compute
   * copy non-finite: the learning rate is too high or the weights are already huge).
   */
  skipped?: 'gradients' | 'update';
  /** Global norm of the unscaled gradients (when clipping), else NaN. */
  gradNorm: number;
}

const f32Bytes = (a: Float32Array) => new Uint8Array(a.buffer, a.byteOffset, a.byteLength);

export class ChunkedAdamW {
  readonly chunks: Chunk[];
  private staging: { master: Tensor; m: Tensor; v: Tensor } | null = null;
  private readonly flag: Tensor;
  /** Raised by adamwCheck when this step's update would make a value non-finite. */
  private readonly updateFlag: Tensor;
  /** f32 [4] adamwStats output for a streamed chunk. */
  private readonly statsOut: Tensor;
  private readonly signals: Tensor[];
  /** The step's gradient norm (written by globalNorm into packedSignals' inputs buffer). */
  private readonly normOut: Tensor;
  /** Step count of applied updates (AdamW's t). */
  applied = 0;
  /** Versions that the latest committed checkpoint names (not deleted when superseded). */
  private pinned = new Map<number, number>();

  private constructor(
    private readonly gpu: Gpu,
    private readonly o: ChunkedAdamWOptions,
    chunks: ChunkPlan[],
    /** The compute-dtype weight each parameter's update writes (f16(master) or the f32 master copy). */
    private readonly weights: Map<string, Tensor>,
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
  private cfgs: AdamWConfig[];

  /**
   * A learning-rate schedule's factor for the coming step: every chunk's rate (its own or the optimizer's)
   * times `factor`. AdamW's moments do not depend on the rate, so the schedule is a pure function of the step.
   */
  setLrScale(factor: number): void {
    this.cfgs = this.chunks.map((c) => ({ ...this.o.cfg, lr: (c.lr ?? this.o.cfg.lr) * factor }));
  }
  /** Compact modes: each chunk's byte layout (null in fp32 mode). */
  private readonly packs: ChunkPack[] | null = null;
  /** Compact modes: the 8-bit code tables on the GPU. */
  private readonly codes: Tensor | null = null;
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
  ): Promise<ChunkedAdamW> {
    const opt = new ChunkedAdamW(gpu, o, planChunks(params, o.chunkElems), weights);
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
  private async createPacked(initial: (name: string) => Promise<Float32Array>): Promise<void> {
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
  private async createDry(): Promise<void> {
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

  private weightOf(p: ParamSlot): Tensor {
    return this.weights.get(p.name) ?? fail(p.name);
  }

  /** Whether a chunk's state is on the GPU (either layout). */
  private onGpu(c: Chunk): boolean {
    return c.resident !== null || c.packed !== null;
  }

  get storedChunks(): number {
    return this.chunks.filter((c) => !this.onGpu(c)).length;
  }

  /** Views of one parameter's state inside a packed chunk buffer (or the staging buffer), for adamw_packed. */
  private packedParam(buf: Tensor, c: Chunk, i: number): PackedParam {
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
  private async chunkWeights(c: Chunk): Promise<Float32Array[]> {
    return Promise.all(c.params.map((p) => this.gpu.read(this.weightOf(p))));
  }

  private async readBytes(t: Tensor): Promise<Uint8Array> {
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
  private async streamPacked(chunks: Chunk[], visit: (buf: Tensor, c: Chunk) => Promise<void>): Promise<void> {
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

  private async readRaw(c: Chunk): Promise<Uint8Array> {
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

  /** Compact modes' step, after the checks: resident chunks updated in place, stored ones streamed. */
  private async stepPacked(grads: Map<string, Tensor>, s: AdamWStep): Promise<void> {
    const gpu = this.gpu;
    const run = { codes: this.codes!, updateFlag: this.updateFlag, stats: this.statsOut, check: false };
    const update = (buf: Tensor, c: Chunk) =>
      c.params.forEach((p, i) => adamwPacked(gpu, this.packedParam(buf, c, i), grads.get(p.name)!, this.cfgs[c.index], s, run));
    for (const c of this.chunks) if (c.packed) update(c.packed, c);
    let writing: Promise<void> | null = null;
    await this.streamPacked(
      this.chunks.filter((c) => !this.onGpu(c)),
      async (buf, c) => {
        gpu.write(this.statsOut, [0, 0, 0, 0]);
        update(buf, c);
        const bytes = await this.readBytes(buf);
        const [maxAbsMaster, maxAbsM, maxV, maxRatio] = await gpu.read(this.statsOut);
        if (writing) await writing;
        writing = this.writeChunkBytes(c, s.step, bytes, { maxAbsMaster, maxAbsM, maxV, maxRatio });
        writing.catch(() => {}); // awaited below
      },
    );
    if (writing) await writing;
  }

  private key(index: number, version: number): string {
    return `${this.o.prefix}/c${String(index).padStart(5, '0')}-v${version}`;
  }

  private ensureStaging(): { master: Tensor; m: Tensor; v: Tensor } {
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
  private chunkViews(st: { master: Tensor; m: Tensor; v: Tensor }, elems: number): { master: Tensor; m: Tensor; v: Tensor } {
    const view = (t: Tensor) => new Tensor(t.alloc, [elems], 'f32', t.byteOffset, false);
    return { master: view(st.master), m: view(st.m), v: view(st.v) };
  }

  /** Views of one parameter inside a chunk's three state buffers. */
  private paramState(state: { master: Tensor; m: Tensor; v: Tensor }, p: ParamSlot): AdamWParam {
    const view = (t: Tensor) => new Tensor(t.alloc, p.shape, 'f32', t.byteOffset + 4 * p.offset, false);
    return { master: view(state.master), m: view(state.m), v: view(state.v), weight: this.weights.get(p.name) };
  }

  /** A stored chunk's statistics, measured on the host from its packed [master | m | v]. */
  private statsOf(c: Chunk, packed: Float32Array): AdamWStateStats {
    const e = c.elems;
    return adamwStateStats(packed.subarray(0, e), packed.subarray(e, 2 * e), packed.subarray(2 * e, 3 * e), this.cfgs[c.index]);
  }

  /** Uploads a stored chunk's packed state into the staging set; returns its views. */
  private stage(c: Chunk, bytes: Float32Array): { master: Tensor; m: Tensor; v: Tensor } {
    const st = this.chunkViews(this.ensureStaging(), c.elems);
    this.gpu.write(st.master, bytes.subarray(0, c.elems));
    this.gpu.write(st.m, bytes.subarray(c.elems, 2 * c.elems));
    this.gpu.write(st.v, bytes.subarray(2 * c.elems, 3 * c.elems));
    return st;
  }

  /** Streams stored chunks through the staging set in order, reading chunk i + 1 while `visit` works on i. */
  private async streamChunks(chunks: Chunk[], visit: (st: { master: Tensor; m: Tensor; v: Tensor }, c: Chunk) => Promise<void>): Promise<void> {
    let next = chunks.length ? this.readChunk(chunks[0]) : null;
    for (let i = 0; i < chunks.length; i++) {
      const c = chunks[i];
      const bytes = await next!;
      next = i + 1 < chunks.length ? this.readChunk(chunks[i + 1]) : null;
      next?.catch(() => {}); // awaited on the next turn
      await visit(this.stage(c, bytes), c);
    }
  }

  /**
   * One update from loss-scaled gradients (compute dtype, by parameter name). Reads the overflow flag
   * first, then proves the update finite (see the header); a skipped step changes nothing and returns
   * applied: false with the cause.
   */
  async step(grads: Map<string, Tensor>, lossScale: number): Promise<OptimizerStepResult> {
    const gpu = this.gpu;
    const all = this.chunks.flatMap((c) => c.params.map((p) => grads.get(p.name) ?? fail(p.name)));
    clearFlag(gpu, this.flag);
    // With clipping the norm is measured anyway, and it is inf or NaN exactly when some gradient is (or when
    // the f32 sum of squares overflows, past |g| ~ 1e19, which the step treats as the same overflow): one pass
    // over the gradients instead of two. The GPU flag then stays clear, and the step goes on only when finite.
    const normT = this.o.maxGradNorm !== undefined ? globalNorm(gpu, all, lossScale, this.normOut) : null;
    if (!normT) checkFinite(gpu, all, this.flag);
    let gradNorm = NaN;
    let overflow: boolean;
    if (normT) {
      gradNorm = (await gpu.read(normT))[0];
      overflow = !Number.isFinite(gradNorm);
      if (overflow) gradNorm = NaN;
    } else overflow = await readFlag(gpu, this.flag);
    if (overflow) {
      gpu.free(normT);
      return { applied: false, skipped: 'gradients', gradNorm };
    }
    const t = this.applied + 1;
    const clip = normT ? { norm: normT, maxNorm: this.o.maxGradNorm! } : undefined;
    const s: AdamWStep = { step: t, lossScale, flag: this.flag, clip };
    if (await this.updateWouldOverflow(grads, s, all, gradNorm)) {
      gpu.free(normT);
      return { applied: false, skipped: 'update', gradNorm };
    }
    // This step moves resident chunks without measuring them: their statistics are stale from here.
    for (const c of this.chunks) if (this.onGpu(c)) c.stats = null;
    if (this.packs) {
      await this.stepPacked(grads, s);
      gpu.free(normT);
      this.applied = t;
      return { applied: true, gradNorm };
    }
    const update = (state: { master: Tensor; m: Tensor; v: Tensor }, c: Chunk) => {
      for (const p of c.params) adamw(gpu, this.paramState(state, p), grads.get(p.name)!, this.cfgs[c.index], s);
    };
    for (const c of this.chunks) if (c.resident) update(c.resident, c);
    // Stream the stored chunks: prefetch i+1 while i updates; write i back while i+1 updates.
    let writing: Promise<void> | null = null;
    await this.streamChunks(
      this.chunks.filter((c) => !c.resident),
      async (st, c) => {
        update(st, c);
        gpu.write(this.statsOut, [0, 0, 0, 0]);
        adamwStats(gpu, st, this.cfgs[c.index], this.statsOut);
        const packed = new Float32Array(3 * c.elems);
        packed.set(await gpu.read(st.master), 0);
        packed.set(await gpu.read(st.m), c.elems);
        packed.set(await gpu.read(st.v), 2 * c.elems);
        const [maxAbsMaster, maxAbsM, maxV, maxRatio] = await gpu.read(this.statsOut);
        if (writing) await writing;
        writing = this.writeChunk(c, t, packed, { maxAbsMaster, maxAbsM, maxV, maxRatio });
        writing.catch(() => {}); // awaited below; marked handled so a failure while we work on is not "unhandled"
      },
    );
    if (writing) await writing;
    gpu.free(normT);
    this.applied = t;
    return { applied: true, gradNorm };
  }

  /**
   * Whether this step's update would make any master, moment or compute copy non-finite, decided before
   * anything is written: resident chunks by adamwCheck; stored chunks by adamwStepSafe from their stats,
   * and by adamwCheck (streamed through the staging set: one extra read) only where that bound fails.
   */
  private async updateWouldOverflow(grads: Map<string, Tensor>, s: AdamWStep, all: Tensor[], gradNorm: number): Promise<boolean> {
    const gpu = this.gpu;
    clearFlag(gpu, this.updateFlag);
    const check = (state: { master: Tensor; m: Tensor; v: Tensor }, c: Chunk) => {
      for (const p of c.params) adamwCheck(gpu, this.paramState(state, p), grads.get(p.name)!, this.cfgs[c.index], s, this.updateFlag);
    };
    const run = this.codes && { codes: this.codes, updateFlag: this.updateFlag, stats: this.statsOut, check: true };
    const checkPacked = (buf: Tensor, c: Chunk) =>
      c.params.forEach((p, i) => adamwPacked(gpu, this.packedParam(buf, c, i), grads.get(p.name)!, this.cfgs[c.index], s, run!));
    // Resident fp32 chunks: with clipping the gradient bound is known without another pass, so each chunk's
    // update is proven finite from its state's statistics (one reduction per chunk, one read-back for all),
    // and only a chunk the bound cannot prove is checked element by element. Without clipping the bound would
    // cost a norm pass, so every resident chunk is checked.
    const resident = this.chunks.filter((c) => c.resident);
    if (s.clip && resident.length) {
      const gradMax = Math.min(s.clip.maxNorm, Number.isNaN(gradNorm) ? Infinity : gradNorm);
      await this.measureResidentStats(resident.filter((c) => !c.stats));
      for (const c of resident) if (!adamwStepSafe(c.stats!, this.cfgs[c.index], s.step, gradMax, this.chunkLimit(c))) check(c.resident!, c);
    } else for (const c of resident) check(c.resident!, c);
    for (const c of this.chunks) if (c.packed) checkPacked(c.packed, c);
    const stored = this.chunks.filter((c) => !this.onGpu(c));
    if (stored.length) {
      const gradMax = await this.gradientBound(s, all, gradNorm);
      const unproven = stored.filter((c) => !adamwStepSafe(c.stats!, this.cfgs[c.index], s.step, gradMax, this.chunkLimit(c)));
      if (this.packs) await this.streamPacked(unproven, async (buf, c) => checkPacked(buf, c));
      else await this.streamChunks(unproven, async (st, c) => check(st, c));
    }
    return readFlag(gpu, this.updateFlag);
  }

  /**
   * An upper bound of |unscaled, clipped gradient| over every element: with clipping at most the max norm
   * (and at most the norm), without it the global norm (measured here, stored chunks only).
   */
  private async gradientBound(s: AdamWStep, all: Tensor[], gradNorm: number): Promise<number> {
    if (s.clip) return Math.min(s.clip.maxNorm, Number.isNaN(gradNorm) ? Infinity : gradNorm);
    const normT = globalNorm(this.gpu, all, s.lossScale);
    const norm = (await this.gpu.read(normT))[0];
    this.gpu.free(normT);
    return norm;
  }

  // ---- fused updates (the trainer's fusedUpdates; ARCHITECTURE "Fused updates") -------------------------
  //
  // A step whose chunks update inside the backward pass, as each chunk's gradients become final, so the
  // whole gradient set never exists at once. The trainer runs the step's forward and backward twice:
  //   1. the norm pass (fusedNorm per chunk): each final gradient is checked for inf/NaN (the step's flag)
  //      and its sums of squares go to its own range of one partials buffer; then it is freed. fusedDecide
  //      finishes the norm: N = sqrt(sum over every element g^2) / lossScale, the bits globalNorm gives
  //      (normPartials lays the partials out from the shapes, so the order of arrival does not matter).
  //      An overflow anywhere, in the last chunk of the backward as well as the first, is known here, before
  //      anything was written: the step is skipped whole (nothing to roll back). Clipping then scales every
  //      gradient by min(1, maxNorm / N), exactly as the unfused step does.
  //   2. (only when a chunk's update cannot be proven finite from its statistics) the check pass
  //      (fusedCheck): adamwCheck on those chunks, still writing nothing.
  //   3. the update pass (fusedApply): each chunk updated as its gradients become final, then freed. Its
  //      forward and backward are those of pass 1 on the same weights (the trainer compares the loss bits
  //      before the backward), so its gradients are the same and every decision taken holds.
  // The update math is the unfused step's, chunk by chunk: the weights come out bit-identical to it. The
  // price is one more forward and backward per step; the gain is the gradient memory (one chunk's at a
  // time instead of every weight's), which the planner can give to resident chunks instead of the store.

  /** The chunks in the order the last fused step's norm pass saw their gradients complete (backward order). */
  lastFusedOrder: number[] = [];

  /** Starts a fused step: clears the overflow flag and lays out the norm's partial sums. */
  fusedBegin(lossScale: number): FusedStep {
    clearFlag(this.gpu, this.flag);
    const like = this.chunks.flatMap((c) => c.params.map((p) => this.weightOf(p)));
    const parts = normPartials(this.gpu, like);
    return {
      lossScale,
      parts,
      phase: 'norm',
      s: null,
      gradNorm: NaN,
      unproven: new Set(),
      done: new Set(),
      order: [],
      reads: new Map(),
      writing: null,
      statsReads: new Map(),
    };
  }

  /** Pass 1, one chunk's final gradients: the inf/NaN flag and the norm's partial sums (nothing written). */
  fusedNorm(run: FusedStep, index: number, grads: Map<string, Tensor>): void {
    if (run.phase !== 'norm') throw new Error(`fusedNorm in the ${run.phase} phase`);
    const c = this.chunks[index];
    const gs = c.params.map((p) => grads.get(p.name) ?? fail(p.name));
    checkFinite(this.gpu, gs, this.flag);
    let at = this.chunks.slice(0, index).reduce((n, k) => n + k.params.length, 0);
    for (const g of gs) addNormPartial(this.gpu, run.parts!, at++, g);
    run.done.add(index);
    run.order.push(index);
  }

  /**
   * After pass 1: the step's gradient norm and overflow, and which chunks' updates the statistics cannot
   * prove finite (those need the check pass). A skipped result ends the step (nothing was written).
   */
  async fusedDecide(run: FusedStep): Promise<{ skipped?: 'gradients'; gradNorm: number; needsCheck: boolean }> {
    const gpu = this.gpu;
    this.expectEvery(run, 'norm');
    this.lastFusedOrder = [...run.order];
    const normT = finishNorm(gpu, run.parts!, run.lossScale, this.normOut);
    run.parts = null;
    const overflow = await readFlag(gpu, this.flag);
    if (overflow) {
      run.phase = 'over';
      return { skipped: 'gradients', gradNorm: NaN, needsCheck: false };
    }
    const norm = (await gpu.read(normT))[0];
    run.gradNorm = this.o.maxGradNorm !== undefined ? norm : NaN;
    const clip = this.o.maxGradNorm !== undefined ? { norm: normT, maxNorm: this.o.maxGradNorm } : undefined;
    run.s = { step: this.applied + 1, lossScale: run.lossScale, flag: this.flag, clip };
    // |unscaled, clipped g| <= min(maxNorm, N) with clipping, <= N without (gradientBound's rule).
    const gradMax = clip ? Math.min(clip.maxNorm, norm) : norm;
    for (const c of this.chunks) {
      // fp32 resident chunks are measured on the GPU; a compact one without statistics (the first fused step after
      // create or restore) goes through the check pass once (measuring it would read its whole state back to the host).
      if (c.resident && !c.stats) c.stats = await this.measureResident(c);
      if (!c.stats || !adamwStepSafe(c.stats, this.cfgs[c.index], run.s.step, gradMax, this.chunkLimit(c))) run.unproven.add(c.index);
    }
    clearFlag(gpu, this.updateFlag);
    run.phase = run.unproven.size ? 'check' : 'apply';
    run.done = new Set();
    if (run.phase === 'apply') this.prefetch(run);
    return { gradNorm: run.gradNorm, needsCheck: run.unproven.size > 0 };
  }

  /** Pass 2, one chunk's final gradients: adamwCheck where the statistics proved nothing (writes nothing). */
  async fusedCheck(run: FusedStep, index: number, grads: Map<string, Tensor>): Promise<void> {
    if (run.phase !== 'check') throw new Error(`fusedCheck in the ${run.phase} phase`);
    run.done.add(index);
    if (!run.unproven.has(index)) return;
    const c = this.chunks[index];
    const s = run.s!;
    if (this.packs) {
      const buf = c.packed ?? this.stageBytes(c, await this.readRaw(c));
      const r = { codes: this.codes!, updateFlag: this.updateFlag, stats: this.statsOut, check: true };
      c.params.forEach((p, i) => adamwPacked(this.gpu, this.packedParam(buf, c, i), grads.get(p.name) ?? fail(p.name), this.cfgs[c.index], s, r));
    } else {
      const st = c.resident ?? this.stage(c, await this.readChunk(c));
      for (const p of c.params) adamwCheck(this.gpu, this.paramState(st, p), grads.get(p.name) ?? fail(p.name), this.cfgs[c.index], s, this.updateFlag);
    }
  }

  /** After pass 2: 'update' when some chunk's update would leave a non-finite value (the step is skipped whole). */
  async fusedCheckResult(run: FusedStep): Promise<'update' | null> {
    this.expectEvery(run, 'check');
    if (await readFlag(this.gpu, this.updateFlag)) {
      run.phase = 'over';
      return 'update';
    }
    run.phase = 'apply';
    run.done = new Set();
    this.prefetch(run);
    return null;
  }

  /**
   * Pass 3, one chunk's final gradients: the chunk's AdamW update. A resident chunk updates in place; a
   * stored one was read ahead (prefetch: the next stored chunk in the order the norm pass saw them
   * complete, read while this one updates and the backward goes on) and its new state is written back
   * while the following chunks update (write-behind). The statistics come back with every update.
   */
  async fusedApply(run: FusedStep, index: number, grads: Map<string, Tensor>): Promise<void> {
    if (run.phase !== 'apply') throw new Error(`fusedApply in the ${run.phase} phase`);
    const gpu = this.gpu;
    const c = this.chunks[index];
    const s = run.s!;
    run.done.add(index);
    // A stored chunk's bytes: read ahead, or now (the order changed); then the next one is read ahead.
    let read: Promise<Uint8Array> = Promise.resolve(new Uint8Array(0));
    if (!this.onGpu(c)) {
      read = run.reads.get(index) ?? (this.packs ? this.readRaw(c) : this.readChunk(c).then(f32Bytes));
      run.reads.delete(index);
      this.prefetch(run);
    }
    gpu.write(this.statsOut, [0, 0, 0, 0]);
    let bytes: Uint8Array | null = null;
    if (this.packs) {
      const buf = c.packed ?? this.stageBytes(c, await read);
      const r = { codes: this.codes!, updateFlag: this.updateFlag, stats: this.statsOut, check: false };
      c.params.forEach((p, i) => adamwPacked(gpu, this.packedParam(buf, c, i), grads.get(p.name) ?? fail(p.name), this.cfgs[c.index], s, r));
      if (!c.packed) bytes = await this.readBytes(buf);
    } else {
      const st = c.resident ?? this.stage(c, await read.then((b) => new Float32Array(b.buffer, b.byteOffset, b.byteLength / 4)));
      for (const p of c.params) adamw(gpu, this.paramState(st, p), grads.get(p.name) ?? fail(p.name), this.cfgs[c.index], s);
      adamwStats(gpu, st, this.cfgs[c.index], this.statsOut);
      if (!c.resident) {
        const packed = new Float32Array(3 * c.elems);
        packed.set(await gpu.read(st.master), 0);
        packed.set(await gpu.read(st.m), c.elems);
        packed.set(await gpu.read(st.v), 2 * c.elems);
        bytes = f32Bytes(packed);
      }
    }
    if (!bytes) {
      // A resident chunk's statistics are read back without waiting (the copy is queued in order, so the next
      // chunk's use of the same buffer cannot change it): no stall of the backward per chunk; fusedEnd collects them.
      const read = gpu.read(this.statsOut);
      read.catch(() => {});
      run.statsReads.set(index, read);
      return;
    }
    const [maxAbsMaster, maxAbsM, maxV, maxRatio] = await gpu.read(this.statsOut);
    const stats = { maxAbsMaster, maxAbsM, maxV, maxRatio };
    if (run.writing) await run.writing;
    run.writing = this.writeChunkBytes(c, s.step, bytes, stats);
    run.writing.catch(() => {}); // awaited by the next stored chunk or fusedEnd
  }

  /** After pass 3: the last write lands; the step counts as applied (every chunk must have been updated). */
  async fusedEnd(run: FusedStep): Promise<{ gradNorm: number }> {
    if (run.writing) await run.writing;
    run.writing = null;
    this.expectEvery(run, 'apply');
    for (const [i, read] of run.statsReads) {
      const [maxAbsMaster, maxAbsM, maxV, maxRatio] = await read;
      this.chunks[i].stats = { maxAbsMaster, maxAbsM, maxV, maxRatio };
    }
    run.statsReads.clear();
    run.phase = 'over';
    this.applied = run.s!.step;
    return { gradNorm: run.gradNorm };
  }

  /** Ends a fused step early (a non-finite loss, an error): frees what it holds; nothing else changes. */
  async fusedAbort(run: FusedStep): Promise<void> {
    if (run.parts) this.gpu.free(run.parts.partials);
    run.parts = null;
    for (const r of run.reads.values()) r.catch(() => {});
    run.reads.clear();
    run.statsReads.clear();
    if (run.writing) await run.writing.catch(() => {});
    run.phase = 'over';
  }

  /** Every chunk must have handed over its gradients in the phase (else a parameter got none). */
  private expectEvery(run: FusedStep, phase: FusedStep['phase']): void {
    if (run.phase !== phase) throw new Error(`the fused step is in the ${run.phase} phase, not ${phase}`);
    const missing = this.chunks.filter((c) => !run.done.has(c.index));
    if (missing.length) fail(missing[0].params[0].name);
  }

  /** Starts reading the next stored chunk not yet updated, in the order pass 1 saw them complete (one ahead). */
  private prefetch(run: FusedStep): void {
    if (run.reads.size > 0) return;
    const next = run.order.map((i) => this.chunks[i]).find((c) => !this.onGpu(c) && !run.done.has(c.index));
    if (!next) return;
    const read = this.packs ? this.readRaw(next) : this.readChunk(next).then(f32Bytes);
    read.catch(() => {}); // awaited when the chunk's gradients are final
    run.reads.set(next.index, read);
  }

  /** Uploads a stored packed chunk's bytes into the staging buffer; returns the view. */
  private stageBytes(c: Chunk, bytes: Uint8Array): Tensor {
    const st = this.ensurePackedStaging();
    const view = new Tensor(st.alloc, [bytes.byteLength / 4], 'f32', st.byteOffset, false);
    this.gpu.writeRaw(view, bytes);
    return view;
  }

  /**
   * Sets `stats` of fp32 resident chunks to their state's statistics now: adamwStats of each into its own
   * 256-byte slot (storage bindings start at aligned offsets) of one buffer, then a single read-back.
   */
  private async measureResidentStats(chunks: Chunk[]): Promise<void> {
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
  private async measureResident(c: Chunk): Promise<AdamWStateStats> {
    this.gpu.write(this.statsOut, [0, 0, 0, 0]);
    adamwStats(this.gpu, c.resident!, this.cfgs[c.index], this.statsOut);
    const [maxAbsMaster, maxAbsM, maxV, maxRatio] = await this.gpu.read(this.statsOut);
    return { maxAbsMaster, maxAbsM, maxV, maxRatio };
  }

  /** The largest |master| a chunk's weight copies keep finite (F16_MAX when any copy is f16). */
  private chunkLimit(c: Chunk): number {
    return Math.min(...c.params.map((p) => masterLimit(this.weights.get(p.name)?.dtype)));
  }

  private async readChunk(c: Chunk): Promise<Float32Array> {
    const b = await this.o.store.read(this.key(c.index, c.version));
    if (!b) throw new Error(`optimizer chunk ${c.index} (version ${c.version}) is missing from the ${this.o.store.kind} store`);
    return new Float32Array(b.buffer, b.byteOffset, b.byteLength / 4);
  }

  /** New version first, then the superseded one goes (unless a checkpoint still names it). */
  private async writeChunk(c: Chunk, version: number, packed: Float32Array, stats: AdamWStateStats): Promise<void> {
    await this.writeChunkBytes(c, version, f32Bytes(packed), stats);
  }

  private async writeChunkBytes(c: Chunk, version: number, bytes: Uint8Array, stats: AdamWStateStats): Promise<void> {
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
  private async weightBits(c: Chunk): Promise<Uint8Array> {
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
  private async restorePacked(read: (name: string) => Promise<Uint8Array>, versions: Record<number, number>): Promise<void> {
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

  destroy(): void {
    for (const c of this.chunks) if (c.packed) this.gpu.free(c.packed);
    this.gpu.free(this.packedStaging, this.codes);
    for (const c of this.chunks) if (c.resident) this.gpu.free(c.resident.master, c.resident.m, c.resident.v);
    if (this.staging) this.gpu.free(this.staging.master, this.staging.m, this.staging.v);
    this.gpu.free(...this.signals);
  }
}

function fail(name: string): never {
  throw new Error(`no gradient reached trainable parameter ${name}`);
}
