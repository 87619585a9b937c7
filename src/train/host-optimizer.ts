// Prodigy and Adafactor (train/prodigy.ts, train/adafactor.ts) for LoRA runs: the fp32 masters and the
// optimizer's state live on the host, the gradients are read back each step and the updated weights written
// to the GPU. A LoRA's few million values make that a few tens of MB per step; full fine-tuning keeps
// ChunkedAdamW's GPU kernels (the schema refuses these optimizers there).
//
// It has the surface of ChunkedAdamW the trainer, the planner and the exporters use: one "chunk" holding
// every parameter (so chunkMasters / locate / chunkedProvider work unchanged), the loss-scaled step with its
// skips (an inf/NaN gradient: 'gradients'; an update that would make a weight non-finite, or past f16's
// range for f16 compute: 'update', with every master and state value put back), global-norm clipping as
// torch.nn.utils.clip_grad_norm_, and checkpoints that restore the state bit for bit.
import type { Gpu } from '../gpu/device.ts';
import type { DType, Tensor } from '../gpu/tensor.ts';
import { Adafactor, ADAFACTOR_DEFAULTS, type AdafactorConfig } from './adafactor.ts';
import { noGradient, type ParamSpec } from './optimizer-chunks.ts';
import type { OptimizerStepResult } from './optimizer.ts';
import { Prodigy, PRODIGY_DEFAULTS, type ProdigyConfig } from './prodigy.ts';
import type { TrainSettings } from './train-types.ts';

export type HostOptimizerKind = 'prodigy' | 'adafactor';
export const HOST_OPTIMIZERS: readonly HostOptimizerKind[] = ['prodigy', 'adafactor'];
export const isHostOptimizer = (k: string): k is HostOptimizerKind => (HOST_OPTIMIZERS as readonly string[]).includes(k);

/** f16's largest finite value: a weight past it cannot be the compute copy. */
const F16_MAX = 65504;

interface Slot {
  name: string;
  shape: number[];
  offset: number;
  numel: number;
}

export interface HostOptimizerOptions {
  kind: HostOptimizerKind;
  lr: number;
  weightDecay: number;
  /** Clip the unscaled gradients' global norm to this (absent: no clipping). */
  maxGradNorm?: number;
  prodigy?: Partial<ProdigyConfig>;
  adafactor?: Partial<AdafactorConfig>;
}

/** The host optimizer's options for a run's settings (its kind must be a host optimizer's). */
export function hostOptimizerOptions(s: TrainSettings): HostOptimizerOptions {
  return {
    kind: s.optimizer as HostOptimizerKind,
    lr: s.lr,
    weightDecay: s.weightDecay,
    ...(s.maxGradNorm > 0 ? { maxGradNorm: s.maxGradNorm } : {}),
    ...(s.prodigy ? { prodigy: s.prodigy } : {}),
    ...(s.adafactor ? { adafactor: s.adafactor } : {}),
  };
}

export class HostOptimizer {
  /** Steps applied (skipped ones excluded). */
  applied = 0;
  readonly storedChunks = 0;
  readonly hostPackedChunks = 0;
  private lrScale = 1;

  private constructor(
    private readonly gpu: Gpu,
    readonly chunks: readonly [{ index: 0; params: Slot[]; elems: number }],
    /** Every parameter's fp32 master, in chunk order. */
    private readonly masters: Float32Array,
    private readonly weights: Map<string, Tensor>,
    private readonly algo: Prodigy | Adafactor,
    private readonly o: HostOptimizerOptions,
    private readonly dtype: DType,
  ) {}

  static async create(
    gpu: Gpu,
    params: ParamSpec[],
    weights: Map<string, Tensor>,
    initial: (name: string) => Promise<Float32Array>,
    o: HostOptimizerOptions,
  ): Promise<HostOptimizer> {
    let offset = 0;
    const slots = params.map((p) => {
      const numel = p.shape.reduce((a, b) => a * b, 1);
      const s = { name: p.name, shape: [...p.shape], offset, numel };
      offset += numel;
      return s;
    });
    const masters = new Float32Array(offset);
    for (const s of slots) masters.set(await initial(s.name), s.offset);
    const views = slots.map((s) => masters.subarray(s.offset, s.offset + s.numel));
    const wd = o.weightDecay;
    const algo =
      o.kind === 'prodigy'
        ? new Prodigy({ ...PRODIGY_DEFAULTS, weightDecay: wd, ...o.prodigy }, views)
        : new Adafactor(
            { ...ADAFACTOR_DEFAULTS, weightDecay: wd, ...o.adafactor },
            slots.map((s) => s.shape),
          );
    const dtype = weights.get(slots[0].name)!.dtype;
    return new HostOptimizer(gpu, [{ index: 0, params: slots, elems: offset }], masters, weights, algo, o, dtype);
  }

  /** A learning-rate schedule's factor for the coming step. */
  setLrScale(factor: number): void {
    this.lrScale = factor;
  }

  private views(): Float32Array[] {
    return this.chunks[0].params.map((s) => this.masters.subarray(s.offset, s.offset + s.numel));
  }

  /** One update from loss-scaled gradients (see the header for the skips). */
  async step(grads: Map<string, Tensor>, lossScale: number): Promise<OptimizerStepResult> {
    const slots = this.chunks[0].params;
    const raw = await Promise.all(slots.map((s) => this.gpu.read(grads.get(s.name) ?? noGradient(s.name))));
    let sq = 0;
    const g = raw.map((r) => {
      const out = new Float32Array(r.length);
      for (let i = 0; i < r.length; i++) {
        out[i] = r[i] / lossScale;
        sq += out[i] * out[i];
      }
      return out;
    });
    const norm = Math.sqrt(sq);
    if (!Number.isFinite(norm)) return { applied: false, skipped: 'gradients', gradNorm: NaN };
    const max = this.o.maxGradNorm;
    if (max !== undefined) {
      // torch.nn.utils.clip_grad_norm_: scale by max / (norm + 1e-6) when that is below 1.
      const coef = max / (norm + 1e-6);
      if (coef < 1) for (const x of g) for (let i = 0; i < x.length; i++) x[i] *= coef;
    }
    const before = { masters: this.masters.slice(), state: this.algo.state() };
    const saved = { scalars: [...before.state.scalars], arrays: before.state.arrays.map((a) => a.slice()) };
    this.algo.step(this.views(), g, this.o.lr * this.lrScale);
    const limit = this.dtype === 'f16' ? F16_MAX : Infinity;
    if (!this.masters.every((x) => Number.isFinite(x) && Math.abs(x) <= limit) || !this.algo.state().arrays.every((a) => a.every(Number.isFinite))) {
      this.masters.set(before.masters);
      this.algo.restore(saved.scalars, saved.arrays);
      return { applied: false, skipped: 'update', gradNorm: max !== undefined ? norm : NaN };
    }
    for (const s of slots) this.gpu.write(this.weights.get(s.name)!, this.masters.subarray(s.offset, s.offset + s.numel));
    this.applied++;
    return { applied: true, gradNorm: max !== undefined ? norm : NaN };
  }

  locate(name: string): { chunk: number; offset: number; numel: number } {
    const s = this.chunks[0].params.find((p) => p.name === name);
    if (!s) throw new Error(`no trainable parameter ${name}`);
    return { chunk: 0, offset: s.offset, numel: s.numel };
  }

  async chunkMasters(index: number): Promise<Float32Array> {
    if (index !== 0) throw new Error(`chunk ${index} does not exist (one chunk)`);
    return this.masters.slice();
  }

  async master(name: string): Promise<Float32Array> {
    const at = this.locate(name);
    return this.masters.slice(at.offset, at.offset + at.numel);
  }

  /** The checkpoint's one file: [f64: scalar count, scalars] then [f32: masters, the state's arrays]. */
  async checkpointState(): Promise<{ files: Map<string, Uint8Array>; versions: Record<number, number>; applied: number }> {
    const st = this.algo.state();
    const head = Float64Array.from([st.scalars.length, ...st.scalars]);
    const total = head.byteLength + 4 * (this.masters.length + st.arrays.reduce((a, b) => a + b.length, 0));
    const bytes = new Uint8Array(total);
    bytes.set(new Uint8Array(head.buffer), 0);
    const f = new Float32Array(bytes.buffer, head.byteLength);
    f.set(this.masters, 0);
    let at = this.masters.length;
    for (const a of st.arrays) {
      f.set(a, at);
      at += a.length;
    }
    return { files: new Map([['opt-host', bytes]]), versions: {}, applied: this.applied };
  }

  async pin(): Promise<void> {}

  async restore(read: (name: string) => Promise<Uint8Array>, _versions: Record<number, number>, applied: number): Promise<void> {
    const st = this.algo.state();
    const b = await read('opt-host');
    const headBytes = 8 * (1 + st.scalars.length);
    const want = headBytes + 4 * (this.masters.length + st.arrays.reduce((a, x) => a + x.length, 0));
    const copy = b.slice();
    const n = copy.byteLength >= 8 ? new Float64Array(copy.buffer, 0, 1)[0] : -1;
    if (copy.byteLength !== want || n !== st.scalars.length)
      throw new Error(`this run's checkpoint holds ${copy.byteLength} bytes of ${this.o.kind} state, not ${want}: it cannot be resumed; start the run again`);
    const scalars = [...new Float64Array(copy.buffer, 8, n)];
    const f = new Float32Array(copy.buffer, headBytes);
    this.masters.set(f.subarray(0, this.masters.length));
    let at = this.masters.length;
    const arrays = st.arrays.map((a) => {
      const v = f.subarray(at, at + a.length);
      at += a.length;
      return v;
    });
    this.algo.restore(scalars, arrays);
    for (const s of this.chunks[0].params) this.gpu.write(this.weights.get(s.name)!, this.masters.subarray(s.offset, s.offset + s.numel));
    this.applied = applied;
  }

  destroy(): void {}
}
