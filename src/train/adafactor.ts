// Adafactor (Shazeer & Stern 2018), as transformers.optimization.Adafactor steps, per parameter:
//
//   t += 1;  RMS = |p|_2 / sqrt(n)
//   rho = relative step ? min(warmup init ? 1e-6 t : 1e-2, 1 / sqrt(t)) : lr
//   alpha = (scale parameter ? max(eps2, RMS) : 1) rho
//   beta2t = 1 - t^decay_rate;  u = g^2 + eps1
//   factored (2+ dims, [.., R, C]):  row = beta2t row + (1 - beta2t) mean_C(u);  col = beta2t col + (1 - beta2t) mean_R(u)
//                                    U = g rsqrt(row / mean_R(row)) rsqrt(col)
//   else:                            v = beta2t v + (1 - beta2t) u;  U = g rsqrt(v)
//   U /= max(1, RMS(U) / clip_threshold);  U *= alpha
//   with beta1: m = beta1 m + (1 - beta1) U;  U = m
//   p -= weight_decay alpha p;  p -= U
// transformers' defaults: eps (1e-30, 1e-3), clip_threshold 1, decay_rate -0.8, no beta1, relative step, scale
// parameter, no warm-up init. With a relative step the learning rate (and a schedule of it) is not read.
// The state is f32, each element computed in f64 and rounded once when stored; it runs on the host
// (train/host-optimizer.ts).

export interface AdafactorConfig {
  eps1: number;
  eps2: number;
  clipThreshold: number;
  decayRate: number;
  /** null: no first moment. */
  beta1: number | null;
  weightDecay: number;
  scaleParameter: boolean;
  relativeStep: boolean;
  warmupInit: boolean;
}

/** transformers' defaults. */
export const ADAFACTOR_DEFAULTS: AdafactorConfig = {
  eps1: 1e-30,
  eps2: 1e-3,
  clipThreshold: 1,
  decayRate: -0.8,
  beta1: null,
  weightDecay: 0,
  scaleParameter: true,
  relativeStep: true,
  warmupInit: false,
};

interface ParamState {
  /** [..., R] and [..., C] for a factored parameter (batch = the leading dims); v [n] otherwise. */
  row: Float32Array | null;
  col: Float32Array | null;
  v: Float32Array | null;
  m: Float32Array | null;
}

export class Adafactor {
  /** Steps taken (every parameter steps together here). */
  t = 0;
  private readonly st: ParamState[];
  /** [batch, R, C] of each parameter (factored), or null. */
  private readonly dims: ([number, number, number] | null)[];

  constructor(
    readonly cfg: AdafactorConfig,
    readonly shapes: readonly (readonly number[])[],
  ) {
    this.dims = shapes.map((s) => (s.length >= 2 ? [s.slice(0, -2).reduce((a, b) => a * b, 1), s.at(-2)!, s.at(-1)!] : null));
    this.st = shapes.map((s, i) => {
      const n = s.reduce((a, b) => a * b, 1);
      const d = this.dims[i];
      return {
        row: d ? new Float32Array(d[0] * d[1]) : null,
        col: d ? new Float32Array(d[0] * d[2]) : null,
        v: d ? null : new Float32Array(n),
        m: cfg.beta1 !== null ? new Float32Array(n) : null,
      };
    });
  }

  /** One step of `params` (in place) with `grads`, at learning rate `lr` (unused with a relative step). */
  step(params: Float32Array[], grads: readonly Float32Array[], lr: number): void {
    const c = this.cfg;
    const t = ++this.t;
    const beta2t = 1 - t ** c.decayRate;
    for (const [i, p] of params.entries()) {
      const g = grads[i];
      const n = p.length;
      const rms = Math.sqrt(p.reduce((a, x) => a + x * x, 0) / n);
      const rho = c.relativeStep ? Math.min(c.warmupInit ? 1e-6 * t : 1e-2, 1 / Math.sqrt(t)) : lr;
      const alpha = (c.scaleParameter ? Math.max(c.eps2, rms) : 1) * rho;
      const u = new Float64Array(n);
      const st = this.st[i];
      const dims = this.dims[i];
      if (dims && st.row && st.col) {
        const [B, R, C] = dims;
        for (let b = 0; b < B; b++) {
          for (let r = 0; r < R; r++) {
            let sum = 0;
            for (let k = 0; k < C; k++) sum += g[(b * R + r) * C + k] ** 2 + c.eps1;
            st.row[b * R + r] = beta2t * st.row[b * R + r] + (1 - beta2t) * (sum / C);
          }
          for (let k = 0; k < C; k++) {
            let sum = 0;
            for (let r = 0; r < R; r++) sum += g[(b * R + r) * C + k] ** 2 + c.eps1;
            st.col[b * C + k] = beta2t * st.col[b * C + k] + (1 - beta2t) * (sum / R);
          }
          let rowMean = 0;
          for (let r = 0; r < R; r++) rowMean += st.row[b * R + r];
          rowMean /= R;
          for (let r = 0; r < R; r++)
            for (let k = 0; k < C; k++) {
              const j = (b * R + r) * C + k;
              u[j] = g[j] / Math.sqrt(st.row[b * R + r] / rowMean) / Math.sqrt(st.col[b * C + k]);
            }
        }
      } else {
        const v = st.v!;
        for (let j = 0; j < n; j++) {
          v[j] = beta2t * v[j] + (1 - beta2t) * (g[j] * g[j] + c.eps1);
          u[j] = g[j] / Math.sqrt(v[j]);
        }
      }
      const uRms = Math.sqrt(u.reduce((a, x) => a + x * x, 0) / n);
      const f = alpha / Math.max(1, uRms / c.clipThreshold);
      const m = st.m;
      for (let j = 0; j < n; j++) {
        let upd = u[j] * f;
        if (m) upd = m[j] = c.beta1! * m[j] + (1 - c.beta1!) * upd;
        let x = p[j];
        if (c.weightDecay !== 0) x = Math.fround(x - c.weightDecay * alpha * x);
        p[j] = x - upd;
      }
    }
  }

  /** The state for a checkpoint: the step count, then each parameter's arrays (row, col or v, and m). */
  state(): { scalars: number[]; arrays: Float32Array[] } {
    return { scalars: [this.t], arrays: this.st.flatMap((s) => [s.row, s.col, s.v, s.m].filter((a): a is Float32Array => a !== null)) };
  }

  restore(scalars: readonly number[], arrays: readonly Float32Array[]): void {
    this.t = scalars[0];
    let k = 0;
    for (const s of this.st) for (const a of [s.row, s.col, s.v, s.m]) if (a) a.set(arrays[k++]);
  }
}
