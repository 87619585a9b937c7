// AdamW over the trainable parameters with their fp32 state (master weights, first and second moments)
// grouped into equal-size chunks, resident on the GPU or streamed through the chunk store: the chunks
// themselves (residency, streaming, checkpoints) are OptimizerChunks (optimizer-chunks.ts), the update
// inside the backward pass is FusedSteps (optimizer-fused.ts); this module is the step.
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
import type { Tensor } from '../gpu/tensor.ts';
import { adamw, adamwCheck, adamwStats, adamwStepSafe, type AdamWStep } from '../ops/adamw.ts';
import { adamwPacked } from '../ops/adamw-packed.ts';
import { checkFinite, clearFlag, globalNorm, readFlag } from '../ops/reduce.ts';
import { FusedSteps, type FusedStep } from './optimizer-fused.ts';
import { OptimizerChunks, type Chunk, type ChunkedAdamWOptions, type ChunkState, type ParamSpec } from './optimizer-chunks.ts';

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

export class ChunkedAdamW {
  private readonly fused: FusedSteps;

  private constructor(
    /** The chunked state: residency, streaming, checkpoints. */
    private readonly st: OptimizerChunks,
  ) {
    this.fused = new FusedSteps(st);
  }

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
    return new ChunkedAdamW(await OptimizerChunks.create(gpu, params, weights, initial, o));
  }

  get chunks(): readonly Chunk[] {
    return this.st.chunks;
  }
  /** Step count of applied updates (AdamW's t). */
  get applied(): number {
    return this.st.applied;
  }
  get mode() {
    return this.st.mode;
  }
  get storedChunks(): number {
    return this.st.storedChunks;
  }
  /** Packed gradient buffers by parameter name (OptimizerChunks.gradSlots), for Tape.useGradSlots. */
  gradSlots(): Map<string, Tensor> {
    return this.st.gradSlots();
  }
  /** Chunks whose starting state create() built on the host (none on a dry-run Gpu). */
  get hostPackedChunks(): number {
    return this.st.hostPackedChunks;
  }
  /** The chunks in the order the last fused step's norm pass saw their gradients complete (backward order). */
  get lastFusedOrder(): number[] {
    return this.fused.lastFusedOrder;
  }

  /** A learning-rate schedule's factor for the coming step (OptimizerChunks.setLrScale). */
  setLrScale(factor: number): void {
    this.st.setLrScale(factor);
  }

  /**
   * One update from loss-scaled gradients (compute dtype, by parameter name). Reads the overflow flag
   * first, then proves the update finite (see the header); a skipped step changes nothing and returns
   * applied: false with the cause.
   */
  async step(grads: Map<string, Tensor>, lossScale: number): Promise<OptimizerStepResult> {
    const gpu = this.st.gpu;
    // each chunk's gradients as one tensor where they sit packed (OptimizerChunks.gradSlots): one pass per chunk
    const all = this.st.normInputs(grads);
    clearFlag(gpu, this.st.flag);
    // With clipping the norm is measured anyway, and it is inf or NaN exactly when some gradient is (or when
    // the f32 sum of squares overflows, past |g| ~ 1e19, which the step treats as the same overflow): one pass
    // over the gradients instead of two. The GPU flag then stays clear, and the step goes on only when finite.
    const normT = this.st.o.maxGradNorm !== undefined ? globalNorm(gpu, all, lossScale, this.st.normOut) : null;
    if (!normT) checkFinite(gpu, all, this.st.flag);
    let gradNorm = NaN;
    let overflow: boolean;
    if (normT) {
      gradNorm = (await gpu.read(normT))[0];
      overflow = !Number.isFinite(gradNorm);
      if (overflow) gradNorm = NaN;
    } else overflow = await readFlag(gpu, this.st.flag);
    if (overflow) {
      gpu.free(normT);
      return { applied: false, skipped: 'gradients', gradNorm };
    }
    const t = this.st.applied + 1;
    const clip = normT ? { norm: normT, maxNorm: this.st.o.maxGradNorm! } : undefined;
    const s: AdamWStep = { step: t, lossScale, flag: this.st.flag, clip };
    if (await this.updateWouldOverflow(grads, s, all, gradNorm)) {
      gpu.free(normT);
      return { applied: false, skipped: 'update', gradNorm };
    }
    // This step moves resident chunks without measuring them: their statistics are stale from here.
    for (const c of this.st.chunks) if (this.st.onGpu(c)) c.stats = null;
    if (this.st.packs) {
      await this.stepPacked(grads, s);
      gpu.free(normT);
      this.st.applied = t;
      return { applied: true, gradNorm };
    }
    const update = (state: ChunkState, c: Chunk) => {
      // one kernel for the chunk where its gradients and weights sit packed (the same math per element)
      const packed = this.st.chunkUpdate(state, c, grads);
      if (packed) adamw(gpu, packed.param, packed.grad, this.st.cfgs[c.index], s);
      else for (const p of c.params) adamw(gpu, this.st.paramState(state, p), grads.get(p.name)!, this.st.cfgs[c.index], s);
    };
    for (const c of this.st.chunks) if (c.resident) update(c.resident, c);
    // Stream the stored chunks: prefetch i+1 while i updates; write i back while i+1 updates.
    let writing: Promise<void> | null = null;
    await this.st.streamChunks(
      this.st.chunks.filter((c) => !c.resident),
      async (st, c) => {
        update(st, c);
        gpu.write(this.st.statsOut, [0, 0, 0, 0]);
        adamwStats(gpu, st, this.st.cfgs[c.index], this.st.statsOut);
        const packed = new Float32Array(3 * c.elems);
        packed.set(await gpu.read(st.master), 0);
        packed.set(await gpu.read(st.m), c.elems);
        packed.set(await gpu.read(st.v), 2 * c.elems);
        const [maxAbsMaster, maxAbsM, maxV, maxRatio] = await gpu.read(this.st.statsOut);
        if (writing) await writing;
        writing = this.st.writeChunk(c, t, packed, { maxAbsMaster, maxAbsM, maxV, maxRatio });
        writing.catch(() => {}); // awaited below; marked handled so a failure while we work on is not "unhandled"
      },
    );
    if (writing) await writing;
    gpu.free(normT);
    this.st.applied = t;
    return { applied: true, gradNorm };
  }

  /**
   * Whether this step's update would make any master, moment or compute copy non-finite, decided before
   * anything is written: resident chunks by adamwCheck; stored chunks by adamwStepSafe from their stats,
   * and by adamwCheck (streamed through the staging set: one extra read) only where that bound fails.
   */
  private async updateWouldOverflow(grads: Map<string, Tensor>, s: AdamWStep, all: Tensor[], gradNorm: number): Promise<boolean> {
    const gpu = this.st.gpu;
    clearFlag(gpu, this.st.updateFlag);
    const check = (state: ChunkState, c: Chunk) => {
      const packed = this.st.chunkUpdate(state, c, grads);
      if (packed) adamwCheck(gpu, packed.param, packed.grad, this.st.cfgs[c.index], s, this.st.updateFlag);
      else for (const p of c.params) adamwCheck(gpu, this.st.paramState(state, p), grads.get(p.name)!, this.st.cfgs[c.index], s, this.st.updateFlag);
    };
    const run = this.st.codes && { codes: this.st.codes, updateFlag: this.st.updateFlag, stats: this.st.statsOut, check: true };
    const checkPacked = (buf: Tensor, c: Chunk) =>
      c.params.forEach((p, i) => adamwPacked(gpu, this.st.packedParam(buf, c, i), grads.get(p.name)!, this.st.cfgs[c.index], s, run!));
    // Resident fp32 chunks: with clipping the gradient bound is known without another pass, so each chunk's
    // update is proven finite from its state's statistics (one reduction per chunk, one read-back for all),
    // and only a chunk the bound cannot prove is checked element by element. Without clipping the bound would
    // cost a norm pass, so every resident chunk is checked.
    const resident = this.st.chunks.filter((c) => c.resident);
    if (s.clip && resident.length) {
      const gradMax = Math.min(s.clip.maxNorm, Number.isNaN(gradNorm) ? Infinity : gradNorm);
      await this.st.measureResidentStats(resident.filter((c) => !c.stats));
      for (const c of resident) if (!adamwStepSafe(c.stats!, this.st.cfgs[c.index], s.step, gradMax, this.st.chunkLimit(c))) check(c.resident!, c);
    } else for (const c of resident) check(c.resident!, c);
    for (const c of this.st.chunks) if (c.packed) checkPacked(c.packed, c);
    const stored = this.st.chunks.filter((c) => !this.st.onGpu(c));
    if (stored.length) {
      const gradMax = await this.gradientBound(s, all, gradNorm);
      const unproven = stored.filter((c) => !adamwStepSafe(c.stats!, this.st.cfgs[c.index], s.step, gradMax, this.st.chunkLimit(c)));
      if (this.st.packs) await this.st.streamPacked(unproven, async (buf, c) => checkPacked(buf, c));
      else await this.st.streamChunks(unproven, async (st, c) => check(st, c));
    }
    return readFlag(gpu, this.st.updateFlag);
  }

  /**
   * An upper bound of |unscaled, clipped gradient| over every element: with clipping at most the max norm
   * (and at most the norm), without it the global norm (measured here, stored chunks only).
   */
  private async gradientBound(s: AdamWStep, all: Tensor[], gradNorm: number): Promise<number> {
    if (s.clip) return Math.min(s.clip.maxNorm, Number.isNaN(gradNorm) ? Infinity : gradNorm);
    const normT = globalNorm(this.st.gpu, all, s.lossScale);
    const norm = (await this.st.gpu.read(normT))[0];
    this.st.gpu.free(normT);
    return norm;
  }

  /** Compact modes' step, after the checks: resident chunks updated in place, stored ones streamed. */
  private async stepPacked(grads: Map<string, Tensor>, s: AdamWStep): Promise<void> {
    const gpu = this.st.gpu;
    const run = { codes: this.st.codes!, updateFlag: this.st.updateFlag, stats: this.st.statsOut, check: false };
    const update = (buf: Tensor, c: Chunk) =>
      c.params.forEach((p, i) => adamwPacked(gpu, this.st.packedParam(buf, c, i), grads.get(p.name)!, this.st.cfgs[c.index], s, run));
    for (const c of this.st.chunks) if (c.packed) update(c.packed, c);
    let writing: Promise<void> | null = null;
    await this.st.streamPacked(
      this.st.chunks.filter((c) => !this.st.onGpu(c)),
      async (buf, c) => {
        gpu.write(this.st.statsOut, [0, 0, 0, 0]);
        update(buf, c);
        const bytes = await this.st.readBytes(buf);
        const [maxAbsMaster, maxAbsM, maxV, maxRatio] = await gpu.read(this.st.statsOut);
        if (writing) await writing;
        writing = this.st.writeChunkBytes(c, s.step, bytes, { maxAbsMaster, maxAbsM, maxV, maxRatio });
        writing.catch(() => {}); // awaited below
      },
    );
    if (writing) await writing;
  }

  // ---- the fused-step protocol (optimizer-fused.ts) ----
  fusedBegin(lossScale: number): FusedStep {
    return this.fused.begin(lossScale);
  }
  fusedNorm(run: FusedStep, index: number, grads: Map<string, Tensor>): void {
    this.fused.norm(run, index, grads);
  }
  fusedDecide(run: FusedStep): Promise<{ skipped?: 'gradients'; gradNorm: number; needsCheck: boolean }> {
    return this.fused.decide(run);
  }
  fusedCheck(run: FusedStep, index: number, grads: Map<string, Tensor>): Promise<void> {
    return this.fused.check(run, index, grads);
  }
  fusedCheckResult(run: FusedStep): Promise<'update' | null> {
    return this.fused.checkResult(run);
  }
  fusedApply(run: FusedStep, index: number, grads: Map<string, Tensor>): Promise<void> {
    return this.fused.apply(run, index, grads);
  }
  fusedEnd(run: FusedStep): Promise<{ gradNorm: number }> {
    return this.fused.end(run);
  }
  fusedAbort(run: FusedStep): Promise<void> {
    return this.fused.abort(run);
  }

  // ---- masters and checkpoints (optimizer-chunks.ts) ----
  locate(name: string): { chunk: number; offset: number; numel: number } {
    return this.st.locate(name);
  }
  chunkMasters(index: number): Promise<Float32Array> {
    return this.st.chunkMasters(index);
  }
  master(name: string): Promise<Float32Array> {
    return this.st.master(name);
  }
  checkpointState(): Promise<{ files: Map<string, Uint8Array>; versions: Record<number, number>; applied: number }> {
    return this.st.checkpointState();
  }
  pin(versions: Record<number, number>): Promise<void> {
    return this.st.pin(versions);
  }
  restore(read: (name: string) => Promise<Uint8Array>, versions: Record<number, number>, applied: number): Promise<void> {
    return this.st.restore(read, versions, applied);
  }
  destroy(): void {
    this.st.destroy();
  }
}
