// An exponential moving average of the trained weights, as diffusers' EMAModel (training_utils.py) keeps it:
//
//   n = the update's number (1, 2, ...);  k = max(0, n - update_after_step - 1)
//   decay = 0                                          when k = 0
//         = 1 - (1 + k / inv_gamma)^-power             with use_ema_warmup
//         = (1 + k) / (10 + k)                         without
//   decay = max(min(decay, max_decay), min_decay)
//   shadow -= (1 - decay) (shadow - weight)            (in f32, as torch's sub_ on f32 tensors)
//
// WeightEma keeps the shadow on the host per optimizer chunk of fp32 masters (one read of a chunk per update), so
// it costs one chunk read and a pass over its elements per step: meant for LoRA's few million values. A full
// fine-tune's weight-sized shadow lives in the chunk store instead (StoredEma, ema-store.ts). The trainer
// updates it after every step (diffusers steps it after every optimizer step, a skipped fp16 step included: the
// weights then stand still and the average moves toward them) and checkpoints it, so a resumed run continues
// it bit for bit.

/** The EMA's settings (diffusers' EMAModel arguments). */
export interface EmaSettings {
  /** The largest decay (max_decay; diffusers' `decay`). */
  decay: number;
  minDecay: number;
  updateAfterStep: number;
  /** use_ema_warmup: the power-law warm-up instead of (1 + k) / (10 + k). */
  warmup: boolean;
  power: number;
  invGamma: number;
}

/** diffusers' defaults. */
export const EMA_DEFAULTS: EmaSettings = { decay: 0.9999, minDecay: 0, updateAfterStep: 0, warmup: false, power: 2 / 3, invGamma: 1 };

/** The decay of the `n`-th update (diffusers' get_decay(optimization_step)). */
export function emaDecay(s: EmaSettings, n: number): number {
  const k = Math.max(0, n - s.updateAfterStep - 1);
  if (k <= 0) return 0;
  const d = s.warmup ? 1 - (1 + k / s.invGamma) ** -s.power : (1 + k) / (10 + k);
  return Math.max(Math.min(d, s.decay), s.minDecay);
}

/** shadow -= (1 - decay) (shadow - weight), elementwise in f32 (each operation rounded as torch's). */
export function emaUpdate(shadow: Float32Array, weight: ArrayLike<number>, decay: number): void {
  const f = Math.fround;
  const oneMinus = f(1 - decay);
  for (let i = 0; i < shadow.length; i++) shadow[i] = f(shadow[i] - f(oneMinus * f(shadow[i] - weight[i])));
}

/** What the trainer needs of an EMA, wherever its shadow lives (host: WeightEma; chunk store: StoredEma). */
export interface ChunkEma {
  readonly settings: EmaSettings;
  /** Updates made (diffusers' optimization_step). */
  readonly updates: number;
  /** One update toward the current weights, `read(i)` giving chunk i's fp32 masters. */
  update(read: (chunk: number) => Promise<Float32Array>): Promise<void>;
  /** Chunk i's averaged masters (the caller's copy may be the EMA's own: do not write into it). */
  chunk(index: number): Promise<Float32Array>;
  /** Files the checkpoint must hold (the host shadow), beside the update count in its record. */
  files(): Map<string, Uint8Array>;
  /** After a checkpoint committed: what it names must stay (a stored shadow's version). */
  pin(): Promise<void>;
  /** Restores the checkpoint's shadow at its update count. */
  restore(read: (name: string) => Promise<Uint8Array>, updates: number): Promise<void>;
}

/** The shadow of a set of chunks on the host: each chunk's masters' average, and the number of updates made. */
export class WeightEma implements ChunkEma {
  private constructor(
    readonly settings: EmaSettings,
    /** Per optimizer chunk, the averaged masters. */
    readonly shadow: Float32Array[],
    /** Updates made (diffusers' optimization_step). */
    public updates: number,
  ) {}

  /** Starts from the current weights (diffusers copies the model's parameters). */
  static async start(settings: EmaSettings, chunks: number, read: (chunk: number) => Promise<Float32Array>): Promise<WeightEma> {
    const shadow: Float32Array[] = [];
    for (let i = 0; i < chunks; i++) shadow.push(Float32Array.from(await read(i)));
    return new WeightEma(settings, shadow, 0);
  }

  /** One update toward the current weights. */
  async update(read: (chunk: number) => Promise<Float32Array>): Promise<void> {
    const decay = emaDecay(this.settings, ++this.updates);
    for (const [i, s] of this.shadow.entries()) emaUpdate(s, await read(i), decay);
  }

  async chunk(index: number): Promise<Float32Array> {
    return this.shadow[index];
  }

  /** The checkpoint holds the whole shadow (files()): nothing in a store to keep. */
  async pin(): Promise<void> {}

  /** The checkpoint's files (one per chunk) and the update count for its record. */
  files(): Map<string, Uint8Array> {
    return new Map(this.shadow.map((s, i) => [`ema-c${i}`, new Uint8Array(s.buffer.slice(s.byteOffset, s.byteOffset + s.byteLength))]));
  }

  /** Restores a checkpoint's shadow (files named as files() names them), checking each chunk's size. */
  async restore(read: (name: string) => Promise<Uint8Array>, updates: number): Promise<void> {
    for (const [i, s] of this.shadow.entries()) {
      const b = await read(`ema-c${i}`);
      if (b.byteLength !== s.byteLength)
        throw new Error(
          `this run's checkpoint holds an EMA chunk ${i} of ${b.byteLength} bytes, not ${s.byteLength}: it cannot be resumed; start the run again`,
        );
      s.set(new Float32Array(b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength)));
    }
    this.updates = updates;
  }
}
