// Dynamic loss scaling (torch.cuda.amp.GradScaler's policy): gradients are computed from
// loss * scale so small f16 gradients do not flush to zero; a step whose gradients hold an inf or
// NaN is skipped and the scale halves; after `growthInterval` good steps in a row it doubles.
// Unlike GradScaler the scale is kept within [minScale, maxScale] (f32 uniforms stay finite).
// The skip itself happens on the GPU (adamw reads the non-finite flag); the host learns of it by
// reading the flag once per step (updateFromFlag) before it picks the next step's scale.
import type { Gpu } from '../gpu/device.ts';
import type { Tensor } from '../gpu/tensor.ts';
import { readFlag } from './reduce.ts';

export interface LossScalerOptions {
  initScale: number;
  growthFactor: number;
  backoffFactor: number;
  growthInterval: number;
  minScale: number;
  maxScale: number;
}

export const LOSS_SCALER_DEFAULTS: LossScalerOptions = {
  initScale: 2 ** 16,
  growthFactor: 2,
  backoffFactor: 0.5,
  growthInterval: 2000,
  minScale: 1,
  maxScale: 2 ** 24,
};

export class DynamicLossScaler {
  scale: number;
  private goodSteps = 0;
  skipped = 0;
  private readonly o: LossScalerOptions;

  constructor(opts: Partial<LossScalerOptions> = {}) {
    this.o = { ...LOSS_SCALER_DEFAULTS, ...opts };
    this.scale = this.o.initScale;
  }

  /** Records the outcome of a step; returns true when the optimizer update was applied. */
  update(overflow: boolean): boolean {
    if (overflow) {
      this.scale = Math.max(this.o.minScale, this.scale * this.o.backoffFactor);
      this.goodSteps = 0;
      this.skipped++;
      return false;
    }
    if (++this.goodSteps >= this.o.growthInterval) {
      this.scale = Math.min(this.o.maxScale, this.scale * this.o.growthFactor);
      this.goodSteps = 0;
    }
    return true;
  }

  /** Reads the step's non-finite flag (4 bytes) and records the outcome; true when the step applied. */
  async updateFromFlag(gpu: Gpu, flag: Tensor): Promise<boolean> {
    return this.update(await readFlag(gpu, flag));
  }

  state(): { scale: number; goodSteps: number; skipped: number } {
    return { scale: this.scale, goodSteps: this.goodSteps, skipped: this.skipped };
  }

  restore(s: { scale: number; goodSteps: number; skipped: number }): void {
    this.scale = s.scale;
    this.goodSteps = s.goodSteps;
    this.skipped = s.skipped;
  }
}
