// Prodigy (Mishchenko & Defazio 2023, "Prodigy: An Expeditiously Adaptive Parameter-Free Learner"), as the
// reference implementation prodigyopt.Prodigy steps (one parameter group, slice_p 1, decoupled weight decay):
//
//   dlr = d lr bc,  bc = sqrt(1 - beta2^(k+1)) / (1 - beta1^(k+1)) with bias correction, else 1
//   per parameter:  num += (d / d0) dlr <g, p0 - p>
//                   m = beta1 m + d (1 - beta1) g;   v = beta2 v + d^2 (1 - beta2) g^2
//                   s = beta3 s + (d / d0) (safeguard warm-up ? d : dlr) g;   den += |s|_1
//   (no gradient anywhere, den = 0: nothing moves)
//   D = beta3 D + num;  d_hat = d_coef D / den;  d = max(d, d_hat) while d is still d0;
//   d_max = max(d_max, d_hat);  d = min(d_max, d growth_rate)
//   per parameter:  p -= wd dlr p;  p -= dlr m / (sqrt(v) + d eps)        (the new d in the denominator)
//   k += 1
// beta3 defaults to sqrt(beta2); the learning rate (usually 1) scales the step d found, and a schedule scales it.
// The state is f32 (as torch keeps it) and every element is computed in f64 and rounded once when stored; the
// sums (num, den) are f64. It runs on the host: train/host-optimizer.ts holds the parameters.

export interface ProdigyConfig {
  beta1: number;
  beta2: number;
  /** null: sqrt(beta2). */
  beta3: number | null;
  eps: number;
  weightDecay: number;
  useBiasCorrection: boolean;
  safeguardWarmup: boolean;
  d0: number;
  dCoef: number;
  growthRate: number;
}

/** prodigyopt's defaults. */
export const PRODIGY_DEFAULTS: ProdigyConfig = {
  beta1: 0.9,
  beta2: 0.999,
  beta3: null,
  eps: 1e-8,
  weightDecay: 0,
  useBiasCorrection: false,
  safeguardWarmup: false,
  d0: 1e-6,
  dCoef: 1,
  growthRate: Infinity,
};

export class Prodigy {
  d: number;
  dMax: number;
  dNumerator = 0;
  k = 0;
  /** Per parameter: s, p0 (the starting values), m, v. */
  readonly s: Float32Array[];
  readonly p0: Float32Array[];
  readonly m: Float32Array[];
  readonly v: Float32Array[];

  constructor(
    readonly cfg: ProdigyConfig,
    params: readonly Float32Array[],
  ) {
    this.d = cfg.d0;
    this.dMax = cfg.d0;
    this.s = params.map((p) => new Float32Array(p.length));
    this.p0 = params.map((p) => Float32Array.from(p));
    this.m = params.map((p) => new Float32Array(p.length));
    this.v = params.map((p) => new Float32Array(p.length));
  }

  /** One step of `params` (updated in place) with their gradients `grads`, at learning rate `lr`. */
  step(params: Float32Array[], grads: readonly Float32Array[], lr: number): void {
    const { beta1, beta2, eps, weightDecay: wd, d0 } = this.cfg;
    const beta3 = this.cfg.beta3 ?? Math.sqrt(beta2);
    const k = this.k;
    const bc = this.cfg.useBiasCorrection ? Math.sqrt(1 - beta2 ** (k + 1)) / (1 - beta1 ** (k + 1)) : 1;
    const d = this.d;
    const dlr = d * lr * bc;
    let delta = 0;
    let den = 0;
    const sAlpha = (d / d0) * (this.cfg.safeguardWarmup ? d : dlr);
    for (const [i, p] of params.entries()) {
      const g = grads[i];
      const { s, p0, m, v } = { s: this.s[i], p0: this.p0[i], m: this.m[i], v: this.v[i] };
      let dot = 0;
      for (let j = 0; j < p.length; j++) {
        dot += g[j] * (p0[j] - p[j]);
        if (beta1 > 0) m[j] = m[j] * beta1 + d * (1 - beta1) * g[j];
        v[j] = v[j] * beta2 + d * d * (1 - beta2) * g[j] * g[j];
        s[j] = s[j] * beta3 + sAlpha * g[j];
        den += Math.abs(s[j]);
      }
      delta += (d / d0) * dlr * dot;
    }
    if (den === 0) return;
    const numerator = this.dNumerator * beta3 + delta;
    if (lr > 0) {
      const dHat = (this.cfg.dCoef * numerator) / den;
      if (this.d === d0) this.d = Math.max(this.d, dHat);
      this.dMax = Math.max(this.dMax, dHat);
      this.d = Math.min(this.dMax, this.d * this.cfg.growthRate);
    }
    this.dNumerator = numerator;
    const dNew = this.d;
    for (const [i, p] of params.entries()) {
      const { m, v } = { m: this.m[i], v: this.v[i] };
      const g = grads[i];
      for (let j = 0; j < p.length; j++) {
        const denom = Math.sqrt(v[j]) + dNew * eps;
        let x = p[j];
        if (wd !== 0) x = Math.fround(x - wd * dlr * x);
        p[j] = beta1 > 0 ? x - (dlr * m[j]) / denom : x - (dlr * dNew * g[j]) / denom;
      }
    }
    this.k = k + 1;
  }

  /** The state for a checkpoint: scalars, then the arrays (s, p0, m, v per parameter). */
  state(): { scalars: number[]; arrays: Float32Array[] } {
    return { scalars: [this.d, this.dMax, this.dNumerator, this.k], arrays: this.s.flatMap((s, i) => [s, this.p0[i], this.m[i], this.v[i]]) };
  }

  restore(scalars: readonly number[], arrays: readonly Float32Array[]): void {
    [this.d, this.dMax, this.dNumerator, this.k] = scalars;
    this.s.forEach((s, i) => {
      s.set(arrays[4 * i]);
      this.p0[i].set(arrays[4 * i + 1]);
      this.m[i].set(arrays[4 * i + 2]);
      this.v[i].set(arrays[4 * i + 3]);
    });
  }
}
