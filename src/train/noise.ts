// What one training step draws (on the host, from the run's Rng) and the schedule it noises with, with the
// noise options of kohya's sd-scripts (library/custom_train_functions.py, train_util.py):
//
//   eps ~ N(0, I)                                                     always
//   + offset * N(0, 1) per sample and channel                          --offset-noise (Guttenberg's offset noise)
//   multires: eps += sum_i discount^i up(N(0, I) at (h, w) / r^i), r ~ U[2, 4) per level; eps /= std(eps)
//                                                                      --multires-noise-iterations / -discount
//   t ~ U{min..max-1} per sample                                       --min-timestep / --max-timestep
//   x_t noised with eps + gamma * N(0, I), the target still from eps  --ip-noise-gamma (input perturbation)
//
// Offset and multires noise are exclusive, as in sd-scripts (it applies one or the other). The draws come in
// a fixed order (noise, offset, multires levels, timesteps, perturbation), each only when its option is on,
// so a run without the options draws exactly what it always did.
//
// zeroTerminalSnr rescales the schedule (Lin et al. 2023, "Common Diffusion Noise Schedules and Sample Steps
// are Flawed"): sqrt(ā) shifted so its last value is 0 and scaled so its first is unchanged, then taken back
// through betas (sd-scripts' fix_noise_scheduler_betas_for_zero_terminal_snr).
import type { Rng } from '../util/rng.ts';

/** The noise options a step's draw reads (TrainSettings' fields; absent: off). */
export interface NoiseOptions {
  offsetNoise: number;
  multiresNoiseIterations?: number;
  multiresNoiseDiscount?: number;
  ipNoiseGamma?: number;
  minTimestep?: number;
  maxTimestep?: number;
}

/** One step's noise: eps (the target's), the perturbed eps the input is noised with (ip noise), timesteps. */
export interface StepNoise {
  noise: Float32Array;
  inputNoise?: Float32Array;
  timesteps: number[];
}

/** sd-scripts' default discount of the multires levels. */
export const MULTIRES_DISCOUNT_DEFAULT = 0.3;

/**
 * Draws a step's noise and timesteps for a batch of samples of latent shapes `shapes` ([C, h, w] each) from
 * `rng`; `T` is the schedule's length.
 */
export function drawStepNoise(rng: Rng, shapes: [number, number, number][], o: NoiseOptions, T: number): StepNoise {
  const c = shapes[0][0];
  const planes = shapes.map(([, h, w]) => h * w);
  const total = c * planes.reduce((a, b) => a + b, 0);
  const noise = rng.normals(total);
  if (o.offsetNoise > 0) {
    // Offset noise: one extra normal per sample and channel shifts the whole plane, so the model can learn
    // to change an image's mean brightness.
    const off = rng.normals(shapes.length * c);
    let start = 0;
    for (let b = 0; b < shapes.length; b++)
      for (let ch = 0; ch < c; ch++, start += planes[b]) for (let i = 0; i < planes[b]; i++) noise[start + i] += o.offsetNoise * off[b * c + ch];
  } else if ((o.multiresNoiseIterations ?? 0) > 0) {
    // sd-scripts noises the batch as one tensor: samples of one shape share the levels' r and the std; a
    // batch of mixed shapes (a bucketed photo beside a square class image) does each run of one shape so.
    let at = 0;
    for (let b = 0; b < shapes.length;) {
      let e = b + 1;
      while (e < shapes.length && shapes[e].join() === shapes[b].join()) e++;
      const n = (e - b) * c * planes[b];
      pyramidNoise(noise.subarray(at, at + n), [e - b, ...shapes[b]], o.multiresNoiseIterations!, o.multiresNoiseDiscount ?? MULTIRES_DISCOUNT_DEFAULT, {
        uniform: () => rng.uniform(),
        normals: (k) => rng.normals(k),
      });
      at += n;
      b = e;
    }
  }
  const lo = o.minTimestep ?? 0;
  const hi = o.maxTimestep ?? T;
  const timesteps = Array.from({ length: shapes.length }, () => lo + rng.int(hi - lo));
  if (!(o.ipNoiseGamma && o.ipNoiseGamma > 0)) return { noise, timesteps };
  const extra = rng.normals(total);
  const inputNoise = new Float32Array(total);
  for (let i = 0; i < total; i++) inputNoise[i] = noise[i] + o.ipNoiseGamma * extra[i];
  return { noise, inputNoise, timesteps };
}

/**
 * Multi-resolution (pyramid) noise in place on `noise` [B, C, H, W] (sd-scripts' pyramid_noise_like): for
 * level i = 0.. iterations-1, r = 2 + 2 U[0, 1), a [B, C, floor(H / r^i), floor(W / r^i)] normal field (at
 * least 1x1) upsampled bilinearly (align_corners false) to [H, W] and added times discount^i; it stops after
 * the first level that reaches 1 pixel. Then the whole tensor is divided by its (unbiased) std.
 */
export function pyramidNoise(
  noise: Float32Array,
  shape: [number, number, number, number],
  iterations: number,
  discount: number,
  draw: { uniform: () => number; normals: (n: number) => Float32Array },
): void {
  const [B, C, H, W] = shape;
  if (noise.length !== B * C * H * W) throw new Error(`pyramidNoise: ${noise.length} values for [${shape.join(', ')}]`);
  const acc = Float64Array.from(noise);
  for (let i = 0; i < iterations; i++) {
    const r = draw.uniform() * 2 + 2;
    const hn = Math.max(1, Math.trunc(H / r ** i));
    const wn = Math.max(1, Math.trunc(W / r ** i));
    const low = draw.normals(B * C * hn * wn);
    const up = upsampleBilinear(low, B * C, hn, wn, H, W);
    const f = discount ** i;
    for (let k = 0; k < acc.length; k++) acc[k] += up[k] * f;
    if (hn === 1 || wn === 1) break;
  }
  let mean = 0;
  for (const v of acc) mean += v;
  mean /= acc.length;
  let ss = 0;
  for (const v of acc) ss += (v - mean) ** 2;
  const std = Math.sqrt(ss / Math.max(1, acc.length - 1));
  for (let k = 0; k < acc.length; k++) noise[k] = acc[k] / std;
}

/**
 * torch.nn.Upsample(size=(H, W), mode="bilinear") (align_corners false) of `planes` planes [hin, win]:
 * source coordinate (dst + 0.5) in / out - 0.5, clamped at 0, between the two nearest source pixels.
 */
export function upsampleBilinear(src: ArrayLike<number>, planes: number, hin: number, win: number, hout: number, wout: number): Float64Array {
  const out = new Float64Array(planes * hout * wout);
  const coord = (dst: number, n: number, m: number) => {
    const s = Math.max(0, ((dst + 0.5) * n) / m - 0.5);
    const i0 = Math.floor(s);
    return { i0, i1: i0 < n - 1 ? i0 + 1 : i0, l: s - i0 };
  };
  const ys = Array.from({ length: hout }, (_, y) => coord(y, hin, hout));
  const xs = Array.from({ length: wout }, (_, x) => coord(x, win, wout));
  for (let p = 0; p < planes; p++) {
    const base = p * hin * win;
    for (let y = 0; y < hout; y++) {
      const { i0: y0, i1: y1, l: ly } = ys[y];
      for (let x = 0; x < wout; x++) {
        const { i0: x0, i1: x1, l: lx } = xs[x];
        const top = (1 - lx) * src[base + y0 * win + x0] + lx * src[base + y0 * win + x1];
        const bottom = (1 - lx) * src[base + y1 * win + x0] + lx * src[base + y1 * win + x1];
        out[(p * hout + y) * wout + x] = (1 - ly) * top + ly * bottom;
      }
    }
  }
  return out;
}

/**
 * The zero-terminal-SNR schedule for alphas-cumprod `acp`: sqrt(ā) - sqrt(ā_T), scaled back to sqrt(ā_0) at
 * t = 0, squared, then through betas (alpha_t = ā_t / ā_{t-1}) and their cumulative product again, as
 * sd-scripts does. The last value is exactly 0: the last timestep is pure noise.
 */
export function zeroTerminalSnr(acp: Float64Array): Float64Array {
  const n = acp.length;
  const s0 = Math.sqrt(acp[0]);
  const sT = Math.sqrt(acp[n - 1]);
  const k = s0 / (s0 - sT);
  const bar = Float64Array.from(acp, (a) => ((Math.sqrt(a) - sT) * k) ** 2);
  const out = new Float64Array(n);
  let prod = 1;
  for (let t = 0; t < n; t++) {
    const alpha = t === 0 ? bar[0] : bar[t] / bar[t - 1];
    const beta = 1 - alpha;
    prod *= 1 - beta;
    out[t] = prod;
  }
  return out;
}
