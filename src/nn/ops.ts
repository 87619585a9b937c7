// Module-level operations with optional reverse-mode recording. Modules call these instead of the raw
// ops: without a tape they run the op and `release` frees temporaries at once (inference); with a tape
// each op also records its backward (a closure over exactly what that backward needs: the llm.c
// habit, one level up), `release` keeps everything, and `Tape.backward` replays the records in reverse,
// accumulating gradients per tensor, weights included.
import type { Allocation } from '../gpu/allocator.ts';
import type { Gpu } from '../gpu/device.ts';
import { BYTES, Tensor } from '../gpu/tensor.ts';
import { flashAttention, flashAttentionBackward, type AttentionOptions } from '../ops/attention.ts';
import { conv2d, conv2dBackward, conv2dBackwardInput, conv2dBackwardWeight, type Conv2dOptions } from '../ops/conv2d.ts';
import {
  activation,
  activationBackward,
  add,
  addChannel,
  addChannelBackward,
  cast,
  concatChannels,
  geglu,
  gegluBackward,
  scale,
  splitChannels,
  transpose2d,
  upsample2x,
  upsample2xBackward,
  type Activation,
} from '../ops/elementwise.ts';
import { colSum, linear, linearBackwardWeight, matmul, matmulBackward, type MatmulOptions } from '../ops/matmul.ts';
import { loraGroupDownGrads, loraGroupForward, memberView, packedLora } from '../ops/matmul-group.ts';
import { softmax, softmaxBackward } from '../ops/softmax.ts';
import { pad2d, pad2dBackward, repeat, type Pad2d } from '../ops/elementwise.ts';
import {
  groupNorm,
  groupNormBackwardParts,
  groupNormSilu,
  groupNormSiluBackwardParts,
  layerNorm,
  layerNormBackwardParts,
  type NormGrads,
  type NormInto,
  type NormParts,
} from '../ops/norm.ts';

export class Tape {
  private readonly records: (() => void)[] = [];
  /** Tensors made outside a recorded op that the backward still reads (freed when it ends). */
  private readonly kept: Tensor[] = [];
  /**
   * Gradient of each tensor that received one (activations are freed as they are consumed). A checkpointed
   * segment's sub-tape shares its parent's map (see `child`).
   */
  readonly grads: Map<Tensor, Tensor>;
  /**
   * Each trainable weight's first use in the forward: the index of the first record that reads it.
   * Records run in reverse, so once that record has run no later one touches the weight: its gradient
   * is final (backwardFused hands it over then).
   */
  private readonly firstUse = new Map<Tensor, number>();
  /** Weights whose gradient backwardFused has handed over (a gradient reaching one after that is a bug; shared with `child`). */
  private readonly handed: Set<Tensor>;
  /**
   * Tensors whose gradient reaches no trainable tensor (requires_grad false, as PyTorch propagates it):
   * inputs declared by `noGrad` and every output of a recorded op whose inputs are all frozen or in here.
   * A checkpointed segment's sub-tape shares its parent's set, so the re-run forward knows it too.
   */
  readonly constants: WeakSet<Tensor>;
  /**
   * `prune` (default true): ops compute no gradient for an input that needs none (a frozen weight, a
   * `constants` tensor) and frozen norms skip their parameter gradients. False gives the unpruned tape
   * (every non-weight tensor gets its gradient, every sum of gradients an add), the oracle the pruned one is
   * tested against.
   */
  readonly prune: boolean;
  /**
   * Gradient buffers handed to more than one holder (the add backward gives both operands dy itself):
   * the holders beyond the first, by allocation. `release` frees a buffer only when its last holder lets go.
   */
  private readonly shared: Map<Allocation, number>;
  /** Where a trainable weight's first gradient goes (useGradSlots); none by default. */
  private slots: ReadonlyMap<Tensor, Tensor> = new Map();

  /**
   * `trainable`: the weights that get gradients. Other tensors tagged 'weights' are frozen: the ops
   * skip their weight-gradient kernels (LoRA trains adapters only; the base UNet's dW is never formed).
   * Null: every tensor gets its gradient.
   */
  constructor(
    private readonly gpu: Gpu,
    readonly trainable: ReadonlySet<Tensor> | null = null,
    opts: { prune?: boolean; constants?: WeakSet<Tensor>; shared?: Map<Allocation, number>; grads?: Map<Tensor, Tensor>; handed?: Set<Tensor> } = {},
  ) {
    this.grads = opts.grads ?? new Map();
    this.handed = opts.handed ?? new Set();
    this.prune = opts.prune ?? true;
    this.constants = opts.constants ?? new WeakSet();
    this.shared = opts.shared ?? new Map();
  }

  /**
   * A tape for a checkpointed segment's re-run: same trainable set, constants, shared buffers and gradients.
   * Sharing the gradient map makes the re-run's backward sum each gradient in the plain tape's order: a
   * segment input that already holds a gradient (a skip connection's, from later in the forward) gets the
   * segment's contributions added one by one, ((s + a) + b), as without checkpointing, not s + (a + b); floating
   * point addition is not associative, so a private map would change the bits.
   */
  child(): Tape {
    const sub = new Tape(this.gpu, this.trainable, {
      prune: this.prune,
      constants: this.constants,
      shared: this.shared,
      grads: this.grads,
      handed: this.handed,
    });
    sub.slots = this.slots;
    return sub;
  }

  /**
   * Gives g (an owning gradient) one more holder: each holder hands it on (acc) or releases it once,
   * and only the last release frees it. Safe because no op writes into a gradient it was given.
   */
  share(g: Tensor): Tensor {
    this.shared.set(g.alloc, (this.shared.get(g.alloc) ?? 0) + 1);
    return g;
  }

  /** Frees gradients a backward is done with, minding buffers `share` gave to several holders. */
  release(...ts: (Tensor | null | undefined)[]): void {
    for (const t of ts) {
      if (!t) continue;
      const extra = t.owner ? this.shared.get(t.alloc) : undefined;
      if (!extra) this.gpu.free(t);
      else if (extra === 1) this.shared.delete(t.alloc);
      else this.shared.set(t.alloc, extra - 1);
    }
  }

  /** False for a frozen weight: nothing should compute or keep its gradient. */
  wants(t: Tensor): boolean {
    return !this.trainable || t.tag !== 'weights' || this.trainable.has(t);
  }

  /** Whether an op should compute t's gradient: a trainable weight, or a tensor a trainable one depends on. */
  needs(t: Tensor): boolean {
    return this.wants(t) && !(this.prune && this.constants.has(t));
  }

  /** Declares tensors whose gradient nobody wants (the step's inputs: noisy latents, cached text embeddings). */
  noGrad(...ts: Tensor[]): void {
    for (const t of ts) this.constants.add(t);
  }

  /** Marks y constant when none of the inputs it was computed from needs a gradient. */
  derive(y: Tensor, inputs: readonly (Tensor | null | undefined)[]): void {
    if (inputs.every((t) => !t || !this.needs(t))) this.constants.add(y);
  }

  record(backward: () => void): void {
    this.records.push(backward);
  }

  /**
   * Notes that the op about to be recorded (the next record) reads these weights. Only trainable
   * weights matter; a use noted inside an activation-checkpointed segment belongs to the segment's record.
   */
  use(...ts: (Tensor | null | undefined)[]): void {
    for (const t of ts) if (t && t.tag === 'weights' && this.trainable?.has(t) && !this.firstUse.has(t)) this.firstUse.set(t, this.records.length);
  }

  /** Keeps t alive until the backward has run, then frees it. */
  keep(...ts: Tensor[]): void {
    this.kept.push(...ts);
  }

  /** Adds g into the gradient of t (taking ownership of g); frozen weights drop it. */
  acc(t: Tensor, g: Tensor): void {
    if (!this.needs(t)) {
      this.release(g);
      return;
    }
    if (this.handed.has(t)) {
      this.release(g);
      throw new Error(`a gradient reached the weight ${t.alloc.label} after it was handed over as final: an op reads it without Tape.use (nn/ops.ts)`);
    }
    const prev = this.grads.get(t);
    if (!prev) {
      this.grads.set(t, g);
      return;
    }
    this.grads.set(t, add(this.gpu, prev, g));
    this.release(prev, g);
  }

  /**
   * Adds a gradient a GEMM (or a norm's dx kernel) computes: `make(into)` writes it into `into` with accumulate
   * (into += result) where t already holds a gradient buffer this tape alone holds, else into a new buffer it
   * returns. The epilogue rounds its result before adding (matmul.wgsl, norm.wgsl ACCUMULATE), so this is acc's GEMM + add bit for bit, one
   * dispatch fewer. A buffer `share` gave to several holders is never written into. The unpruned tape (the
   * oracle the pruned one is tested against) makes a new buffer and adds, as acc.
   */
  accGemm(t: Tensor, make: (into: Tensor | null, accumulate: boolean) => Tensor): void {
    if (!this.needs(t)) return;
    const prev = this.grads.get(t);
    if (!prev && !this.handed.has(t) && this.slots.has(t)) {
      const slot = this.slots.get(t)!;
      make(slot, false);
      this.grads.set(t, slot);
      return;
    }
    if (this.prune && prev && prev.dtype === t.dtype && !this.shared.has(prev.alloc) && !this.handed.has(t)) {
      make(prev, true);
      return;
    }
    this.acc(t, make(null, false));
  }

  /**
   * Gradient buffers for trainable weights (views the caller owns: the optimizer's packed gradients, so one
   * kernel sees a chunk's gradients side by side). A weight's first GEMM-made gradient is written there; a
   * gradient summed by an add ends up in a new buffer instead (the caller checks where each one is).
   */
  useGradSlots(slots: ReadonlyMap<Tensor, Tensor>): void {
    this.slots = slots;
  }

  /** First gradients of `ts` by one GEMM, `make(slots)`, where each needs one, has none and has a slot (useGradSlots); false: use accGemm. */
  accGemmGroup(ts: readonly Tensor[], make: (slots: readonly Tensor[]) => boolean): boolean {
    const slots = ts.map((t) => (this.needs(t) && !this.grads.has(t) && !this.handed.has(t) ? this.slots.get(t) : undefined));
    if (slots.some((t) => !t) || !make(slots as Tensor[])) return false;
    ts.forEach((t, i) => this.grads.set(t, slots[i]!));
    return true;
  }

  /** The gradient of t, removed from the map (null if nothing flowed into t). */
  take(t: Tensor): Tensor | null {
    const g = this.grads.get(t) ?? null;
    this.grads.delete(t);
    return g;
  }

  /**
   * Runs every recorded backward in reverse, starting from dy for the output y. Each op frees its
   * output and saved statistics once its own backward has run (everything that read them ran
   * before it), so the forward's activations are released as the backward walks past them.
   */
  backward(y: Tensor, dy: Tensor): void {
    this.grads.set(y, dy);
    for (let i = this.records.length - 1; i >= 0; i--) this.records[i]();
    this.records.length = 0;
    this.gpu.free(...this.kept);
    this.kept.length = 0;
    this.firstUse.clear();
  }

  /**
   * backward, handing each trainable weight to `onFinal` as soon as its gradient is final: right after
   * the record of its first use in the forward has run (see `use`), in backward order. `onFinal` may
   * take the gradients (take) and change the weights: no record still to run reads them. Trainable
   * weights with a gradient but no noted use are handed over at the end. Needs a trainable set.
   */
  async backwardFused(y: Tensor, dy: Tensor, onFinal: (weights: Tensor[]) => Promise<void>): Promise<void> {
    if (!this.trainable) throw new Error('backwardFused needs the tape to know its trainable weights');
    const finalAfter = new Map<number, Tensor[]>();
    for (const [t, i] of this.firstUse) finalAfter.set(i, [...(finalAfter.get(i) ?? []), t]);
    this.grads.set(y, dy);
    try {
      for (let i = this.records.length - 1; i >= 0; i--) {
        this.records[i]();
        const ready = finalAfter.get(i);
        if (!ready) continue;
        for (const t of ready) this.handed.add(t);
        await onFinal(ready);
      }
      const rest = [...this.grads.keys()].filter((t) => this.trainable!.has(t) && !this.handed.has(t));
      for (const t of rest) this.handed.add(t);
      if (rest.length) await onFinal(rest);
    } finally {
      this.records.length = 0;
      this.gpu.free(...this.kept);
      this.kept.length = 0;
      this.firstUse.clear();
      this.handed.clear();
    }
  }

  /** Frees the gradients of every tensor not in `keep` (call after taking what the caller needs). */
  dropGrads(keep: ReadonlySet<Tensor> = new Set()): void {
    for (const [t, g] of this.grads)
      if (!keep.has(t)) {
        this.release(g);
        this.grads.delete(t);
      }
  }
}

export class Ops {
  constructor(
    readonly gpu: Gpu,
    readonly tape: Tape | null = null,
    /** Where weight uses are noted (Tape.use): the tape, or the outer tape of a checkpointed segment's forward. */
    private readonly uses: Tape | null = tape,
  ) {}

  /** Frees temporaries when not recording (a tape keeps what the backward needs). */
  release(...ts: (Tensor | null | undefined)[]): void {
    if (!this.tape) this.gpu.free(...ts);
  }

  /**
   * Records the backward of an op whose output is y: `fn(dy)` runs when a gradient reached y; y and
   * the `saved` tensors are freed after it either way.
   */
  private rec(y: Tensor, saved: Tensor[], inputs: readonly (Tensor | null | undefined)[], fn: (dy: Tensor) => void): void {
    this.uses?.derive(y, inputs);
    const tape = this.tape;
    if (!tape) return;
    tape.record(() => {
      const dy = tape.take(y);
      if (dy) fn(dy);
      this.gpu.free(y, ...saved);
    });
  }

  /** Gradient wanted for this tensor (false for frozen weights and for tensors no trainable one depends on). */
  private needs(t: Tensor | null | undefined): boolean {
    return !!t && this.tape!.needs(t);
  }

  /**
   * Activation checkpointing: runs `fn` without recording (its temporaries are freed at once) and
   * keeps only its inputs; the backward re-runs `fn` on the same inputs under a fresh tape that shares the
   * outer tape's gradients (`child`) and backpropagates through that, so every gradient has the plain backward's bits.
   * Trades one extra forward of the segment for its activations. `fn` must not free its inputs.
   */
  checkpoint(fn: (F: Ops) => Tensor): Tensor {
    const tape = this.tape;
    if (!tape) return fn(this);
    const y = fn(new Ops(this.gpu, null, tape));
    tape.record(() => {
      const dy = tape.take(y);
      this.gpu.free(y);
      if (!dy) return;
      const sub = tape.child();
      const y2 = fn(new Ops(this.gpu, sub));
      sub.backward(y2, dy);
    });
    return y;
  }

  /** A tensor made by a raw op that needs no gradient (requires_grad false): kept like `keep`. */
  constant(t: Tensor): Tensor {
    this.uses?.noGrad(t);
    return this.keep(t);
  }

  /** A tensor made by a raw op (not through Ops) that the backward reads: freed after the backward. */
  keep(t: Tensor): Tensor {
    this.tape?.keep(t);
    return t;
  }

  linear(x: Tensor, w: Tensor, b?: Tensor | null): Tensor {
    this.uses?.use(w, b);
    const y = linear(this.gpu, x, w, b);
    this.rec(y, [], [x, w, b], (dy) => {
      this.linearGrads(x, w, b, dy);
      this.tape!.release(dy);
    });
    return y;
  }

  /**
   * linear's backward: dW (and db) where wanted, by linearBackwardWeight (linearBackward's kernels), and dx = dy W
   * (skipped when x needs none: a frozen layer's input, the text embeddings under a k/v adapter) added into x's
   * gradient in the GEMM's epilogue (Tape.accGemm). Does not release dy.
   */
  private linearGrads(x: Tensor, w: Tensor, b: Tensor | null | undefined, dy: Tensor, which: 'both' | 'weight' | 'input' = 'both'): void {
    const tape = this.tape!;
    if (which === 'input') {
      // dW comes from the caller (linearGroup: every member's in one GEMM)
    } else if (b && (this.needs(w) || this.needs(b))) {
      const g = linearBackwardWeight(this.gpu, x, w, dy, b);
      tape.acc(w, g.dw);
      if (g.dbias) tape.acc(b, g.dbias);
    } else if (!b) tape.accGemm(w, (into, accumulate) => linearBackwardWeight(this.gpu, x, w, dy, null, into ? { dw: into, accumulate } : undefined).dw);
    if (which === 'weight' || !this.needs(x)) return;
    const rows = dy.numel / w.shape[0];
    tape.accGemm(x, (into, accumulate) => {
      const dx = matmul(this.gpu, dy.reshape([rows, w.shape[0]]), w, into ? { out: into.reshape([rows, w.shape[1]]), accumulate } : {});
      return new Tensor(dx.alloc, x.shape, dx.dtype, dx.byteOffset, dx.owner);
    });
  }

  /**
   * A linear layer with a LoRA adapter at scale 1 (alpha = rank): y = x Wᵀ (+ b) + (x Aᵀ) Bᵀ, the adapter's up
   * projection added into y in its GEMM's epilogue (no add dispatch; bit for bit linear, linear, linear and add, as
   * the epilogue rounds before adding). Its backward runs the three layers' backwards in the order the tape would
   * (up, down, base), so every gradient, x's sum included, has the same bits; dy is not copied.
   */
  loraLinear(x: Tensor, w: Tensor, b: Tensor | null, a: Tensor, up: Tensor): Tensor {
    this.uses?.use(w, b);
    const y = linear(this.gpu, x, w, b);
    this.uses?.use(a);
    const h = linear(this.gpu, x, a);
    this.uses?.use(up);
    const rows = h.numel / a.shape[0];
    matmul(this.gpu, h.reshape([rows, a.shape[0]]), up, { transB: true, out: y.reshape([rows, up.shape[0]]), accumulate: true });
    if (!this.tape) this.gpu.free(h);
    this.uses?.derive(h, [x, a]);
    this.rec(y, [h], [x, w, b, a, up], (dy) => {
      this.adapterGrads(x, a, up, h, dy);
      this.linearGrads(x, w, b, dy);
      this.tape!.release(dy);
    });
    return y;
  }

  /** loraLinear's adapter backward: dB, dh = dy B, the down projection's backward; with `into` (linearGroup's packed dh), dh there and no dA. */
  private adapterGrads(x: Tensor, a: Tensor, up: Tensor, h: Tensor, dy: Tensor, into: Tensor | null = null): Tensor | null {
    if (!this.needs(up) && !this.needs(h)) return null;
    this.tape!.accGemm(up, (into, accumulate) => linearBackwardWeight(this.gpu, h, up, dy, null, into ? { dw: into, accumulate } : undefined).dw);
    if (!this.needs(h)) return null;
    const rows = h.numel / a.shape[0];
    const dh = matmul(this.gpu, dy.reshape([rows, up.shape[0]]), up, into ? { out: into.reshape([rows, a.shape[0]]) } : {});
    const dhT = into ?? new Tensor(dh.alloc, h.shape, dh.dtype, dh.byteOffset, dh.owner);
    this.linearGrads(x, a, null, dhT, into ? 'input' : 'both');
    if (!into) this.gpu.free(dh);
    return into;
  }

  /**
   * Linear layers over the same x whose frozen weights lie end to end in one allocation (`stack` [S, N, K], a view
   * over the layers' weights `ws`), as one GEMM: y [S, rows, N], layer s's output the view `ys[s]` (`owner` holds
   * the buffer). Each layer's LoRA adapter (scale 1) adds its up projection into its slice in the epilogue; packed
   * adapters (ops/matmul-group.ts packedLora) run their down projections, up projections and dA as one batched GEMM
   * each, with each member's bits. The backward runs each layer's backward as loraLinear's, last layer first (the
   * order the tape runs the separate layers' records), so every gradient, x's sum included, has their bits.
   */
  linearGroup(x: Tensor, stack: Tensor, ws: readonly Tensor[], adapters: readonly ({ a: Tensor; up: Tensor } | null)[]): { ys: Tensor[]; owner: Tensor } {
    const [S, N, K] = stack.shape;
    const rows = x.numel / K;
    this.uses?.use(...ws);
    const y = matmul(this.gpu, x.reshape([rows, K]), stack, { transB: true });
    const ys = ws.map((_, s) => new Tensor(y.alloc, [...x.shape.slice(0, -1), N], y.dtype, y.byteOffset + s * rows * N * BYTES[y.dtype], false));
    const packed = packedLora(adapters);
    let hAll: Tensor | null = null;
    const hs = adapters.map((ad, s) => {
      if (!ad || packed) return null;
      this.uses?.use(ad.a, ad.up);
      const h = linear(this.gpu, x, ad.a);
      matmul(this.gpu, h.reshape([rows, ad.a.shape[0]]), ad.up, { transB: true, out: ys[s].reshape([rows, N]), accumulate: true });
      this.uses?.derive(h, [x, ad.a]);
      return h;
    });
    if (packed) {
      packed.as.forEach((a, s) => this.uses?.use(a, packed.ups[s]));
      hAll = loraGroupForward(this.gpu, x, packed, y);
      packed.as.forEach((a, s) => this.uses?.derive((hs[s] = memberView(hAll!, s, [...x.shape.slice(0, -1), packed.r])), [x, a]));
    }
    ys.forEach((t, s) => this.uses?.derive(t, [x, ws[s], adapters[s]?.a, adapters[s]?.up]));
    const tape = this.tape;
    if (!tape) this.gpu.free(hAll, ...hs);
    else
      tape.record(() => {
        const dhAll = packed ? this.gpu.tensor([S, rows, packed.r], x.dtype, 'gradients', 'lora.dh') : null;
        const dhs: (Tensor | null)[] = ws.map(() => null);
        for (let s = S - 1; s >= 0; s--) {
          const dy = tape.take(ys[s]);
          if (!dy) continue;
          const [ad, h] = [adapters[s], hs[s]];
          if (ad && h) dhs[s] = this.adapterGrads(x, ad.a, ad.up, h, dy, dhAll && memberView(dhAll, s, h.shape));
          this.linearGrads(x, ws[s], null, dy);
          tape.release(dy);
        }
        // dA for every member in one GEMM into the A's gradient slots (Tape.accGemmGroup), else each as linearGrads
        const all = packed && dhs.every((d) => d) && tape.accGemmGroup(packed.as, (slots) => loraGroupDownGrads(this.gpu, x, packed, dhAll!, slots));
        if (packed && !all) dhs.forEach((dh, s) => dh && this.linearGrads(x, packed.as[s], null, dh, 'weight'));
        this.gpu.free(y, hAll, dhAll, ...hs);
      });
    return { ys, owner: y };
  }

  /** True when t needs no gradient (a frozen weight, a constant), or nothing records. */
  frozen(t: Tensor): boolean {
    return !this.uses || !this.uses.needs(t);
  }

  conv(x: Tensor, w: Tensor, b: Tensor | null, opts: Conv2dOptions): Tensor {
    this.uses?.use(w, b);
    const y = conv2d(this.gpu, x, w, b, opts);
    this.rec(y, [], [x, w, b], (dy) => {
      this.convGrads(x, w, b, opts, dy);
      this.tape!.release(dy);
    });
    return y;
  }

  /** conv's backward: the wanted ones of dx, dw, db (not releasing dy); a frozen conv's dx is added into x's gradient in the epilogue (Tape.accGemm). */
  private convGrads(x: Tensor, w: Tensor, b: Tensor | null, opts: Conv2dOptions, dy: Tensor): void {
    const tape = this.tape!;
    const needX = this.needs(x);
    if ((this.needs(w) || this.needs(b)) && needX) {
      const g = conv2dBackward(this.gpu, x, w, dy, opts);
      tape.acc(x, g.dx);
      tape.acc(w, g.dw);
      if (b) tape.acc(b, g.db);
      else this.gpu.free(g.db);
    } else if (this.needs(w) || this.needs(b)) {
      // A trainable conv on an input that needs no gradient (conv_in in a full fine-tune): no dx kernels.
      const g = conv2dBackwardWeight(this.gpu, x, w, dy, { ...opts, bias: !!b });
      tape.acc(w, g.dw);
      if (b && g.db) tape.acc(b, g.db);
    } else if (needX) tape.accGemm(x, (into, accumulate) => conv2dBackwardInput(this.gpu, x, w, dy, opts, into ? { dx: into, accumulate } : undefined));
  }

  /**
   * conv(x, w, b) + conv(xs, ws, bs) for a pointwise second conv (ws [Co, Ci, 1, 1], not int8; a ResNet's shortcut):
   * its GEMM (conv2d's own for a 1x1) adds into the first conv's output in the epilogue, which rounds before adding:
   * the bits of conv, conv and add, one dispatch fewer. The backward is those three records' (the add hands dy to
   * both): the pointwise conv's gradients, then the first's.
   */
  convAddPointwise(x: Tensor, w: Tensor, b: Tensor | null, opts: Conv2dOptions, xs: Tensor, ws: Tensor, bs: Tensor | null): Tensor {
    this.uses?.use(w, b, ws, bs);
    const y = conv2d(this.gpu, x, w, b, opts);
    const [n, co, ci] = [xs.shape[0], ws.shape[0], ws.shape[1]];
    const hw = xs.numel / (n * ci);
    if (ws.numel !== co * ci || y.shape[1] !== co || y.numel !== n * co * hw)
      throw new Error(`convAddPointwise: the second conv must be 1x1 from [${xs.shape}] onto the first's [${y.shape}], got weight [${ws.shape}]`);
    matmul(this.gpu, ws.reshape([co, ci]), xs.reshape([n, ci, hw]), { rowBias: bs ?? undefined, out: y.reshape([n, co, hw]), accumulate: true });
    this.rec(y, [], [x, w, b, xs, ws, bs], (dy) => {
      this.convGrads(xs, ws, bs, { stride: 1, padding: 0 }, dy);
      this.convGrads(x, w, b, opts, dy);
      this.tape!.release(dy);
    });
    return y;
  }

  /**
   * A pointwise projection with a frozen weight w [Co, Ci] (a 1x1 conv's, [Co, Ci, 1, 1], or a linear layer's) that
   * also moves between the channel-major [B, C, P] and token-major [B, P, C] layouts: one GEMM reading an operand
   * transposed, no transpose pass either way.
   *   to 'tokens'    x [B, Ci, ...P]: y[b] [P, Co] = x[b]ᵀ Wᵀ + bias per column    dx[b] [Ci, P] = Wᵀ dy[b]ᵀ
   *   to 'channels'  x [B, P, Ci]:    y[b] [Co, P] = W x[b]ᵀ + bias per row       dx[b] [P, Ci] = dy[b]ᵀ W
   * Each element is the same dot product over Ci (over Co for dx), in the same order, as the 1x1 conv or linear with a
   * transpose before or after it, so the same bits wherever the GEMMs split K alike (no split-K: always). A trained
   * projection's dW would sum over samples in another order: it runs as conv or linear and transpose (nn/unet.ts).
   */
  project(x: Tensor, w: Tensor, b: Tensor | null, to: 'tokens' | 'channels'): Tensor {
    if (!this.frozen(w) || (b && !this.frozen(b))) throw new Error('Ops.project: the projection is trained; run it as conv or linear and transpose');
    const [co, ci] = [w.shape[0], w.numel / w.shape[0]];
    const w2 = w.reshape([co, ci]);
    const [B, P] = [x.shape[0], x.numel / (x.shape[0] * ci)];
    const opts: MatmulOptions = to === 'tokens' ? { transA: true, transB: true, bias: b ?? undefined } : { transB: true, rowBias: b ?? undefined };
    const [xv, dxShape] = to === 'tokens' ? [x.reshape([B, ci, P]), [B, ci, P]] : [x.reshape([B, P, ci]), [B, P, ci]];
    const y = to === 'tokens' ? matmul(this.gpu, xv, w2, opts) : matmul(this.gpu, w2, xv, opts);
    this.rec(y, [], [x, w, b], (dy) => {
      this.tape!.accGemm(x, (into, accumulate) => {
        const o = { out: into?.reshape(dxShape), accumulate };
        const dx = to === 'tokens' ? matmul(this.gpu, w2, dy, { ...o, transA: true, transB: true }) : matmul(this.gpu, dy, w2, { ...o, transA: true });
        return new Tensor(dx.alloc, x.shape, dx.dtype, dx.byteOffset, dx.owner);
      });
      this.tape!.release(dy);
    });
    return y;
  }

  groupNorm(x: Tensor, gamma: Tensor, beta: Tensor, groups: number, eps: number): Tensor {
    this.uses?.use(gamma, beta);
    const r = groupNorm(this.gpu, x, gamma, beta, groups, eps);
    if (!this.tape) this.gpu.free(r.mean, r.rstd);
    this.rec(r.y, [r.mean, r.rstd], [x, gamma, beta], (dy) => {
      this.normGrads(x, gamma, beta, (parts, into) => groupNormBackwardParts(this.gpu, x, gamma, r, dy, groups, parts, into));
      this.tape!.release(dy);
    });
    return r.y;
  }

  /** silu(groupNorm(x)), one dispatch each way; the bits of groupNorm then act('silu'). Keeps x and the statistics. */
  groupNormSilu(x: Tensor, gamma: Tensor, beta: Tensor, groups: number, eps: number): Tensor {
    this.uses?.use(gamma, beta);
    const r = groupNormSilu(this.gpu, x, gamma, beta, groups, eps);
    if (!this.tape) this.gpu.free(r.mean, r.rstd);
    this.rec(r.y, [r.mean, r.rstd], [x, gamma, beta], (dy) => {
      this.normGrads(x, gamma, beta, (parts, into) => groupNormSiluBackwardParts(this.gpu, x, gamma, beta, r, dy, groups, parts, into));
      this.tape!.release(dy);
    });
    return r.y;
  }

  layerNorm(x: Tensor, gamma: Tensor, beta: Tensor, eps: number): Tensor {
    this.uses?.use(gamma, beta);
    const r = layerNorm(this.gpu, x, gamma, beta, eps);
    if (!this.tape) this.gpu.free(r.mean, r.rstd);
    this.rec(r.y, [r.mean, r.rstd], [x, gamma, beta], (dy) => {
      this.normGrads(x, gamma, beta, (parts, into) => layerNormBackwardParts(this.gpu, x, gamma, r, dy, parts, into));
      this.tape!.release(dy);
    });
    return r.y;
  }

  /**
   * Which halves of a norm's backward to run: dx when x needs a gradient, dgamma/dbeta when either
   * parameter does (a frozen norm in a LoRA run skips them; the unpruned tape runs both, as it always did).
   */
  private normParts(x: Tensor, gamma: Tensor, beta: Tensor): { dx: boolean; params: boolean } {
    if (!this.tape!.prune) return { dx: true, params: true };
    return { dx: this.needs(x), params: this.needs(gamma) || this.needs(beta) };
  }

  /**
   * A norm's backward as two independent halves: the parameter gradients (when wanted), then dx, which the
   * kernel adds into x's gradient where x already holds one (Tape.accGemm: the bits of dx and an add).
   */
  private normGrads(x: Tensor, gamma: Tensor, beta: Tensor, run: (parts: NormParts, into?: NormInto) => Partial<NormGrads>): void {
    const parts = this.normParts(x, gamma, beta);
    if (parts.params) {
      const g = run({ dx: false, params: true });
      this.acc32(gamma, g.dgamma!);
      this.acc32(beta, g.dbeta!);
    }
    if (parts.dx) this.tape!.accGemm(x, (into, accumulate) => run({ dx: true, params: false }, into ? { dx: into, accumulate } : undefined).dx!);
  }

  /** Norm parameter gradients come out f32; keep them in the parameter's dtype like the others. */
  private acc32(p: Tensor, g: Tensor): void {
    if (p.dtype === 'f32' || !this.needs(p)) {
      this.tape!.acc(p, g);
      return;
    }
    this.tape!.acc(p, cast(this.gpu, g, p.dtype, 'gradients'));
    this.tape!.release(g);
  }

  act(kind: Activation, x: Tensor): Tensor {
    const y = activation(this.gpu, kind, x);
    this.rec(y, [], [x], (dy) => {
      this.tape!.acc(x, activationBackward(this.gpu, kind, x, dy));
      this.tape!.release(dy);
    });
    return y;
  }

  add(a: Tensor, b: Tensor): Tensor {
    const y = add(this.gpu, a, b);
    this.rec(y, [], [a, b], (dy) => {
      const [needA, needB] = [this.needs(a), this.needs(b)];
      // Both operands receive dy itself (one more holder when both need it; no copy). The unpruned tape
      // copies it for the second, as it always did.
      const tape = this.tape!;
      if (needA && needB) tape.acc(b, tape.prune ? tape.share(dy) : scale(this.gpu, dy, 1));
      else if (needB) tape.acc(b, dy);
      if (needA) tape.acc(a, dy);
      else if (!needB) tape.release(dy);
    });
    return y;
  }

  /**
   * x + t per channel; with `column`, t is several layers' projections side by side and this layer's are its
   * columns from `column` on (addChannel). Such a shared t must need no gradient (frozen projections).
   */
  addChannel(x: Tensor, t: Tensor, column: number | null = null): Tensor {
    if (column !== null && this.tape && this.needs(t)) throw new Error('addChannel: a column slice of t gets no gradient here; t must be frozen (nn/unet.ts)');
    const y = addChannel(this.gpu, x, t, column);
    this.rec(y, [], [x, t], (dy) => {
      // dt (a sum over each plane) only when t needs it: a frozen time-embedding projection does not.
      if (this.needs(t)) this.tape!.acc(t, addChannelBackward(this.gpu, x, t, dy).dt);
      if (this.needs(x)) this.tape!.acc(x, dy);
      else this.tape!.release(dy);
    });
    return y;
  }

  geglu(x: Tensor): Tensor {
    const y = geglu(this.gpu, x);
    this.rec(y, [], [x], (dy) => {
      this.tape!.acc(x, gegluBackward(this.gpu, x, dy));
      this.tape!.release(dy);
    });
    return y;
  }

  transpose(x: Tensor): Tensor {
    const y = transpose2d(this.gpu, x);
    this.rec(y, [], [x], (dy) => {
      this.tape!.acc(x, transpose2d(this.gpu, dy));
      this.tape!.release(dy);
    });
    return y;
  }

  concat(x: Tensor, s: Tensor): Tensor {
    const y = concatChannels(this.gpu, x, s);
    this.rec(y, [], [x, s], (dy) => {
      if (this.needs(x)) this.tape!.acc(x, splitChannels(this.gpu, dy, 0, x.shape[1]));
      if (this.needs(s)) this.tape!.acc(s, splitChannels(this.gpu, dy, x.shape[1], s.shape[1]));
      this.tape!.release(dy);
    });
    return y;
  }

  upsample(x: Tensor): Tensor {
    const y = upsample2x(this.gpu, x);
    this.rec(y, [], [x], (dy) => {
      this.tape!.acc(x, upsample2xBackward(this.gpu, x, dy));
      this.tape!.release(dy);
    });
    return y;
  }

  matmul(a: Tensor, b: Tensor, opts: Pick<MatmulOptions, 'transA' | 'transB'> = {}): Tensor {
    const y = matmul(this.gpu, a, b, opts);
    this.rec(y, [], [a, b], (dy) => {
      const g = matmulBackward(this.gpu, a, b, dy, opts);
      this.tape!.acc(a, g.da);
      this.tape!.acc(b, g.db);
      this.tape!.release(dy);
    });
    return y;
  }

  softmax(x: Tensor): Tensor {
    const y = softmax(this.gpu, x);
    this.rec(y, [], [x], (dy) => {
      this.tape!.acc(x, softmaxBackward(this.gpu, y, dy));
      this.tape!.release(dy);
    });
    return y;
  }

  scale(x: Tensor, s: number): Tensor {
    const y = scale(this.gpu, x, s);
    this.rec(y, [], [x], (dy) => {
      this.tape!.acc(x, scale(this.gpu, dy, s));
      this.tape!.release(dy);
    });
    return y;
  }

  pad(x: Tensor, p: Pad2d): Tensor {
    const y = pad2d(this.gpu, x, p);
    this.rec(y, [], [x], (dy) => {
      this.tape!.acc(x, pad2dBackward(this.gpu, x, dy, p));
      this.tape!.release(dy);
    });
    return y;
  }

  /** [times, ...x.shape]; the backward sums the copies. */
  repeat(x: Tensor, times: number): Tensor {
    const y = repeat(this.gpu, x, times);
    this.rec(y, [], [x], (dy) => {
      const summed = colSum(this.gpu, dy.reshape([times, x.numel]));
      this.tape!.acc(x, new Tensor(summed.alloc, x.shape, summed.dtype, summed.byteOffset, summed.owner));
      this.tape!.release(dy);
    });
    return y;
  }

  /** A view with another shape; its gradient flows back to x. */
  reshape(x: Tensor, shape: readonly number[]): Tensor {
    const y = x.reshape(shape);
    // y is a view (freeing it is a no-op); the gradient buffer changes hands with its shape.
    this.rec(y, [], [x], (dy) => this.tape!.acc(x, new Tensor(dy.alloc, x.shape, dy.dtype, dy.byteOffset, dy.owner)));
    return y;
  }

  attention(q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions): Tensor {
    const r = flashAttention(this.gpu, q, k, v, opts);
    if (!this.tape) this.gpu.free(r.lse);
    this.rec(r.out, [r.lse], [q, k, v], (dy) => {
      const g = flashAttentionBackward(this.gpu, q, k, v, r.out, r.lse, dy, opts);
      this.tape!.acc(q, g.dq);
      this.tape!.acc(k, g.dk);
      this.tape!.acc(v, g.dv);
      this.tape!.release(dy);
    });
    return r.out;
  }
}
