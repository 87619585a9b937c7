// The fused-step protocol of ChunkedAdamW (optimizer.ts; the trainer's fusedUpdates, ARCHITECTURE "Fused updates"),
// on the chunked state OptimizerChunks keeps (optimizer-chunks.ts).
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
import type { Tensor } from '../gpu/tensor.ts';
import { adamw, adamwCheck, adamwStats, adamwStepSafe, type AdamWStep } from '../ops/adamw.ts';
import { adamwPacked } from '../ops/adamw-packed.ts';
import { addNormPartial, checkFinite, clearFlag, finishNorm, normPartials, readFlag, type NormPartials } from '../ops/reduce.ts';
import { f32Bytes, noGradient, type OptimizerChunks } from './optimizer-chunks.ts';

/** One fused step's state between the trainer's passes (FusedSteps.begin, ChunkedAdamW.fusedBegin). */
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

export class FusedSteps {
  constructor(private readonly st: OptimizerChunks) {}

  /** The chunks in the order the last fused step's norm pass saw their gradients complete (backward order). */
  lastFusedOrder: number[] = [];

  /** Starts a fused step: clears the overflow flag and lays out the norm's partial sums. */
  begin(lossScale: number): FusedStep {
    clearFlag(this.st.gpu, this.st.flag);
    const like = this.st.chunks.flatMap((c) => c.params.map((p) => this.st.weightOf(p)));
    const parts = normPartials(this.st.gpu, like);
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
  norm(run: FusedStep, index: number, grads: Map<string, Tensor>): void {
    if (run.phase !== 'norm') throw new Error(`fusedNorm in the ${run.phase} phase`);
    const c = this.st.chunks[index];
    const gs = c.params.map((p) => grads.get(p.name) ?? noGradient(p.name));
    checkFinite(this.st.gpu, gs, this.st.flag);
    let at = this.st.chunks.slice(0, index).reduce((n, k) => n + k.params.length, 0);
    for (const g of gs) addNormPartial(this.st.gpu, run.parts!, at++, g);
    run.done.add(index);
    run.order.push(index);
  }

  /**
   * After pass 1: the step's gradient norm and overflow, and which chunks' updates the statistics cannot
   * prove finite (those need the check pass). A skipped result ends the step (nothing was written).
   */
  async decide(run: FusedStep): Promise<{ skipped?: 'gradients'; gradNorm: number; needsCheck: boolean }> {
    const gpu = this.st.gpu;
    this.expectEvery(run, 'norm');
    this.lastFusedOrder = [...run.order];
    const normT = finishNorm(gpu, run.parts!, run.lossScale, this.st.normOut);
    run.parts = null;
    const overflow = await readFlag(gpu, this.st.flag);
    if (overflow) {
      run.phase = 'over';
      return { skipped: 'gradients', gradNorm: NaN, needsCheck: false };
    }
    const norm = (await gpu.read(normT))[0];
    run.gradNorm = this.st.o.maxGradNorm !== undefined ? norm : NaN;
    const clip = this.st.o.maxGradNorm !== undefined ? { norm: normT, maxNorm: this.st.o.maxGradNorm } : undefined;
    run.s = { step: this.st.applied + 1, lossScale: run.lossScale, flag: this.st.flag, clip };
    // |unscaled, clipped g| <= min(maxNorm, N) with clipping, <= N without (gradientBound's rule).
    const gradMax = clip ? Math.min(clip.maxNorm, norm) : norm;
    for (const c of this.st.chunks) {
      // fp32 resident chunks are measured on the GPU; a compact one without statistics (the first fused step after
      // create or restore) goes through the check pass once (measuring it would read its whole state back to the host).
      if (c.resident && !c.stats) c.stats = await this.st.measureResident(c);
      if (!c.stats || !adamwStepSafe(c.stats, this.st.cfgs[c.index], run.s.step, gradMax, this.st.chunkLimit(c))) run.unproven.add(c.index);
    }
    clearFlag(gpu, this.st.updateFlag);
    run.phase = run.unproven.size ? 'check' : 'apply';
    run.done = new Set();
    if (run.phase === 'apply') this.prefetch(run);
    return { gradNorm: run.gradNorm, needsCheck: run.unproven.size > 0 };
  }

  /** Pass 2, one chunk's final gradients: adamwCheck where the statistics proved nothing (writes nothing). */
  async check(run: FusedStep, index: number, grads: Map<string, Tensor>): Promise<void> {
    if (run.phase !== 'check') throw new Error(`fusedCheck in the ${run.phase} phase`);
    run.done.add(index);
    if (!run.unproven.has(index)) return;
    const c = this.st.chunks[index];
    const s = run.s!;
    if (this.st.packs) {
      const buf = c.packed ?? this.st.stageBytes(c, await this.st.readRaw(c));
      const r = { codes: this.st.codes!, updateFlag: this.st.updateFlag, stats: this.st.statsOut, check: true };
      c.params.forEach((p, i) =>
        adamwPacked(this.st.gpu, this.st.packedParam(buf, c, i), grads.get(p.name) ?? noGradient(p.name), this.st.cfgs[c.index], s, r),
      );
    } else {
      const st = c.resident ?? this.st.stage(c, await this.st.readChunk(c));
      for (const p of c.params)
        adamwCheck(this.st.gpu, this.st.paramState(st, p), grads.get(p.name) ?? noGradient(p.name), this.st.cfgs[c.index], s, this.st.updateFlag);
    }
  }

  /** After pass 2: 'update' when some chunk's update would leave a non-finite value (the step is skipped whole). */
  async checkResult(run: FusedStep): Promise<'update' | null> {
    this.expectEvery(run, 'check');
    if (await readFlag(this.st.gpu, this.st.updateFlag)) {
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
  async apply(run: FusedStep, index: number, grads: Map<string, Tensor>): Promise<void> {
    if (run.phase !== 'apply') throw new Error(`fusedApply in the ${run.phase} phase`);
    const gpu = this.st.gpu;
    const c = this.st.chunks[index];
    const s = run.s!;
    run.done.add(index);
    // A stored chunk's bytes: read ahead, or now (the order changed); then the next one is read ahead.
    let read: Promise<Uint8Array> = Promise.resolve(new Uint8Array(0));
    if (!this.st.onGpu(c)) {
      read = run.reads.get(index) ?? (this.st.packs ? this.st.readRaw(c) : this.st.readChunk(c).then(f32Bytes));
      run.reads.delete(index);
      this.prefetch(run);
    }
    gpu.write(this.st.statsOut, [0, 0, 0, 0]);
    let bytes: Uint8Array | null = null;
    if (this.st.packs) {
      const buf = c.packed ?? this.st.stageBytes(c, await read);
      const r = { codes: this.st.codes!, updateFlag: this.st.updateFlag, stats: this.st.statsOut, check: false };
      c.params.forEach((p, i) => adamwPacked(gpu, this.st.packedParam(buf, c, i), grads.get(p.name) ?? noGradient(p.name), this.st.cfgs[c.index], s, r));
      if (!c.packed) bytes = await this.st.readBytes(buf);
    } else {
      const st = c.resident ?? this.st.stage(c, await read.then((b) => new Float32Array(b.buffer, b.byteOffset, b.byteLength / 4)));
      for (const p of c.params) adamw(gpu, this.st.paramState(st, p), grads.get(p.name) ?? noGradient(p.name), this.st.cfgs[c.index], s);
      adamwStats(gpu, st, this.st.cfgs[c.index], this.st.statsOut);
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
      const read = gpu.read(this.st.statsOut);
      read.catch(() => {});
      run.statsReads.set(index, read);
      return;
    }
    const [maxAbsMaster, maxAbsM, maxV, maxRatio] = await gpu.read(this.st.statsOut);
    const stats = { maxAbsMaster, maxAbsM, maxV, maxRatio };
    if (run.writing) await run.writing;
    run.writing = this.st.writeChunkBytes(c, s.step, bytes, stats);
    run.writing.catch(() => {}); // awaited by the next stored chunk or fusedEnd
  }

  /** After pass 3: the last write lands; the step counts as applied (every chunk must have been updated). */
  async end(run: FusedStep): Promise<{ gradNorm: number }> {
    if (run.writing) await run.writing;
    run.writing = null;
    this.expectEvery(run, 'apply');
    for (const [i, read] of run.statsReads) {
      const [maxAbsMaster, maxAbsM, maxV, maxRatio] = await read;
      this.st.chunks[i].stats = { maxAbsMaster, maxAbsM, maxV, maxRatio };
    }
    run.statsReads.clear();
    run.phase = 'over';
    this.st.applied = run.s!.step;
    return { gradNorm: run.gradNorm };
  }

  /** Ends a fused step early (a non-finite loss, an error): frees what it holds; nothing else changes. */
  async abort(run: FusedStep): Promise<void> {
    if (run.parts) this.st.gpu.free(run.parts.partials);
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
    const missing = this.st.chunks.filter((c) => !run.done.has(c.index));
    if (missing.length) noGradient(missing[0].params[0].name);
  }

  /** Starts reading the next stored chunk not yet updated, in the order pass 1 saw them complete (one ahead). */
  private prefetch(run: FusedStep): void {
    if (run.reads.size > 0) return;
    const next = run.order.map((i) => this.st.chunks[i]).find((c) => !this.st.onGpu(c) && !run.done.has(c.index));
    if (!next) return;
    const read = this.st.packs ? this.st.readRaw(next) : this.st.readChunk(next).then(f32Bytes);
    read.catch(() => {}); // awaited when the chunk's gradients are final
    run.reads.set(next.index, read);
  }
}
