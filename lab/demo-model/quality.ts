// DreamBooth's quality measures (issue 16; the DreamBooth paper's DreamBench: subject fidelity, prompt fidelity,
// language drift), on features this project can compute itself, for lab/demo-model/bench/quality.ts and its test.
//
// Features. The paper uses DINO / CLIP image embeddings; we have neither, so two extractors are used and both
// reported:
//  - the model's own VAE encoder: the posterior mean latents (times the scaling factor), compared by cosine
//    similarity. The encoder was trained to keep what the pictures hold (shape outlines, fill pattern, colour),
//    so two pictures of the same subject have nearby latents; it is spatial (a star moved across the picture
//    moves its latents), which is why it is averaged over every sample/photo pair.
//  - a colour histogram (4 bins per RGB channel, 64 bins, normalised), compared by histogram intersection
//    (sum of bin minima, 1 for identical colour content). It ignores where things are, so it scores the
//    subject's colours (a yellow star with purple dots) wherever the subject is drawn; it does not see shape.
// Prompt fidelity ("a sks star on a red background"): the picture's border pixels, each given the nearest named
// colour of the generator (synthetic.ts COLOURS); the score is the fraction of border pixels nearest red.
// Shape ("a green triangle" draws a triangle): the largest region of pixels nearest the named colour, and how much
// of its enclosing disc it fills (discFill): a disc fills all of it, a triangle about 0.6.
// Drift: class-prompt samples of the fine-tuned model against the base model's for the same seeds: 1 - cosine of
// the VAE features, averaged over seeds (0: the same pictures).
// Also in pixels and in colours (1 - histogram intersection: position-free).
import type { Gpu } from '../../src/gpu/device.ts';
import type { LoadedModel } from '../../src/models/load.ts';
import { encodeImage } from '../../src/train/preprocess.ts';
import { COLOURS, toModelInput, type ColourName } from './synthetic.ts';

/**
 * How the demo model's drawing checks sample (lab/demo-model/tests/shipped-demo-draws.test.ts, lab/demo-model/scripts/shape-scores.ts):
 * DPM++ 2M, 15 steps, guidance 6, no negative prompt.
 */
export const CHECK_SAMPLING = { sampler: 'dpm++2m', steps: 15, guidance: 6, negativePrompt: '' } as const;

/** Bins per RGB channel of colourHistogram. */
export const HISTOGRAM_BINS = 4;

function checkRgb(rgb: Uint8Array, size: number, what: string): void {
  if (rgb.length !== size * size * 3) throw new Error(`${what}: ${rgb.length} bytes is not a ${size}x${size} RGB picture (${size * size * 3} bytes)`);
}

/** Normalised joint RGB histogram (HISTOGRAM_BINS^3 bins summing to 1) of RGB bytes. */
export function colourHistogram(rgb: Uint8Array): Float64Array {
  const b = HISTOGRAM_BINS;
  const h = new Float64Array(b * b * b);
  const pixels = rgb.length / 3;
  if (!Number.isInteger(pixels) || pixels === 0) throw new Error(`colourHistogram: ${rgb.length} bytes is not RGB pixels (a multiple of 3, at least one)`);
  const bin = (v: number) => Math.min(b - 1, Math.floor((v * b) / 256));
  for (let i = 0; i < pixels; i++) h[(bin(rgb[3 * i]) * b + bin(rgb[3 * i + 1])) * b + bin(rgb[3 * i + 2])] += 1 / pixels;
  return h;
}

/** Histogram intersection: sum of the bins' minima; 1 for the same colour content, 0 for none in common. */
export function histogramIntersection(a: Float64Array, b: Float64Array): number {
  if (a.length !== b.length) throw new Error(`histogramIntersection: ${a.length} bins vs ${b.length}`);
  let s = 0;
  for (let i = 0; i < a.length; i++) s += Math.min(a[i], b[i]);
  return s;
}

/** Cosine similarity of two feature vectors (0 when either is all zeros). */
export function cosine(a: ArrayLike<number>, b: ArrayLike<number>): number {
  if (a.length !== b.length) throw new Error(`cosine: vectors of ${a.length} and ${b.length} values`);
  let ab = 0;
  let aa = 0;
  let bb = 0;
  for (let i = 0; i < a.length; i++) {
    ab += a[i] * b[i];
    aa += a[i] * a[i];
    bb += b[i] * b[i];
  }
  return aa > 0 && bb > 0 ? ab / Math.sqrt(aa * bb) : 0;
}

/** The VAE encoder's posterior mean (scaled latents) of an RGB picture: the feature of subject fidelity and drift. */
export async function vaeFeature(gpu: Gpu, vae: LoadedModel['vae'], rgb: Uint8Array, size: number): Promise<Float32Array> {
  checkRgb(rgb, size, 'vaeFeature');
  return encodeImage(gpu, vae, toModelInput(rgb, size), size);
}

/** Mean of `score(s, p)` over every sample/photo pair. */
function meanOverPairs<T>(samples: readonly T[], photos: readonly T[], score: (s: T, p: T) => number): number {
  if (!samples.length || !photos.length) throw new Error('subject fidelity needs at least one sample and one photo');
  let sum = 0;
  for (const s of samples) for (const p of photos) sum += score(s, p);
  return sum / (samples.length * photos.length);
}

/** Subject fidelity under the VAE features: mean cosine similarity over sample/photo pairs. */
export function featureFidelity(samples: readonly Float32Array[], photos: readonly Float32Array[]): number {
  return meanOverPairs(samples, photos, cosine);
}

/** Subject fidelity under the colour histogram: mean histogram intersection over sample/photo pairs. */
export function colourFidelity(samples: readonly Uint8Array[], photos: readonly Uint8Array[]): number {
  const hs = samples.map(colourHistogram);
  const hp = photos.map(colourHistogram);
  return meanOverPairs(hs, hp, histogramIntersection);
}

/** The generator's named colour nearest to an RGB value (squared sRGB distance). */
export function nearestColour(r: number, g: number, b: number): ColourName {
  let best: ColourName = 'red';
  let bestD = Infinity;
  for (const [name, c] of Object.entries(COLOURS) as [ColourName, readonly number[]][]) {
    const d = (r - c[0]) ** 2 + (g - c[1]) ** 2 + (b - c[2]) ** 2;
    if (d < bestD) [best, bestD] = [name, d];
  }
  return best;
}

/**
 * Fraction of the picture's border pixels (the outer `width` rows and columns: where the background shows,
 * the subject being placed away from the edges) whose nearest named colour is `colour`.
 */
export function borderColourShare(rgb: Uint8Array, size: number, colour: ColourName, width = Math.max(1, Math.round(size / 8))): number {
  checkRgb(rgb, size, 'borderColourShare');
  if (!(width >= 1 && 2 * width <= size)) throw new Error(`borderColourShare: border width ${width} does not fit a ${size} px picture`);
  let hits = 0;
  let n = 0;
  for (let y = 0; y < size; y++)
    for (let x = 0; x < size; x++) {
      if (x >= width && x < size - width && y >= width && y < size - width) continue;
      const o = (y * size + x) * 3;
      if (nearestColour(rgb[o], rgb[o + 1], rgb[o + 2]) === colour) hits++;
      n++;
    }
  return hits / n;
}

/** Prompt fidelity: the mean border share of `colour` over the samples of "... on a <colour> background". */
export function promptFidelity(samples: readonly Uint8Array[], size: number, colour: ColourName): number {
  if (!samples.length) throw new Error('prompt fidelity needs at least one sample');
  return samples.reduce((s, rgb) => s + borderColourShare(rgb, size, colour), 0) / samples.length;
}

/** Drift: mean over seeds of 1 - cosine(fine-tuned sample's feature, base sample's feature); 0: unchanged. */
export function featureDrift(tuned: readonly Float32Array[], base: readonly Float32Array[]): number {
  return meanOverSeeds(tuned, base, (t, b) => 1 - cosine(t, b));
}

/** Mean of `score(tuned[i], base[i])` over seeds i (the samples of one seed, fine-tuned and base). */
function meanOverSeeds<T>(tuned: readonly T[], base: readonly T[], score: (t: T, b: T) => number): number {
  if (tuned.length !== base.length || !tuned.length) throw new Error(`drift compares samples seed by seed: ${tuned.length} fine-tuned vs ${base.length} base`);
  return tuned.reduce((s, t, i) => s + score(t, base[i]), 0) / tuned.length;
}

/**
 * Drift in colours: mean over seeds of 1 - histogram intersection of the fine-tuned and the base sample (0: the
 * same colours in any places; 1: no colour in common). Position-free, so a background pattern drawn a few pixels
 * off (a checkerboard shifted by one square is every pixel changed) counts as kept, and a background changed
 * to the photos' colour counts fully: on a model that draws fine patterns, latent and pixel drift are dominated by
 * such shifts.
 */
export function colourDrift(tuned: readonly Uint8Array[], base: readonly Uint8Array[]): number {
  return meanOverSeeds(tuned, base, (t, b) => 1 - histogramIntersection(colourHistogram(t), colourHistogram(b)));
}

/** Drift in pixels: mean absolute difference of the 8-bit values over seeds, in [0, 1]. */
export function pixelDrift(tuned: readonly Uint8Array[], base: readonly Uint8Array[]): number {
  if (tuned.length !== base.length || !tuned.length) throw new Error(`drift compares samples seed by seed: ${tuned.length} fine-tuned vs ${base.length} base`);
  let s = 0;
  for (let i = 0; i < tuned.length; i++) {
    if (tuned[i].length !== base[i].length) throw new Error(`pixelDrift: seed ${i}'s pictures differ in size`);
    let d = 0;
    for (let j = 0; j < tuned[i].length; j++) d += Math.abs(tuned[i][j] - base[i][j]);
    s += d / (255 * tuned[i].length);
  }
  return s / tuned.length;
}

/** Median of a non-empty list. */
export function median(xs: readonly number[]): number {
  if (!xs.length) throw new Error('median of no values');
  const s = [...xs].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}

/**
 * The largest 4-connected region of pixels whose nearest named colour is `colour`, as pixel indices (row-major);
 * empty when no pixel is nearest that colour. The object a prompt names, when its colour differs from the
 * background's.
 */
export function largestColourRegion(rgb: Uint8Array, size: number, colour: ColourName): number[] {
  checkRgb(rgb, size, 'largestColourRegion');
  const mask = new Uint8Array(size * size);
  for (let p = 0; p < size * size; p++) mask[p] = nearestColour(rgb[3 * p], rgb[3 * p + 1], rgb[3 * p + 2]) === colour ? 1 : 0;
  const seen = new Uint8Array(size * size);
  let best: number[] = [];
  for (let start = 0; start < size * size; start++) {
    if (!mask[start] || seen[start]) continue;
    // Breadth-first flood fill; the list is both the queue and the region.
    const region = [start];
    seen[start] = 1;
    for (let i = 0; i < region.length; i++) {
      const p = region[i];
      const x = p % size;
      const neighbours = [x > 0 ? p - 1 : -1, x < size - 1 ? p + 1 : -1, p - size, p + size];
      for (const q of neighbours)
        if (q >= 0 && q < size * size && mask[q] && !seen[q]) {
          seen[q] = 1;
          region.push(q);
        }
    }
    if (region.length > best.length) best = region;
  }
  return best;
}

/**
 * How much of its enclosing disc a region fills: area / (pi r^2 / 0.95), r being the 95th percentile of its
 * pixels' distances from their centroid. A disc of radius R has a 95th-percentile distance of R sqrt(0.95), so a
 * disc scores 1 at any size, position or rotation, and a shape that leaves more of its disc empty scores less
 * (the percentile, not the farthest pixel, so a stray pixel on the outline does not count). Measured on the
 * generator's own solid shapes at 64 px, four sizes and rotations each: circle 1.00, square and diamond 0.83-0.87,
 * ring 0.76-0.77, cross 0.66-0.69, triangle 0.58-0.61, star 0.54-0.64, crescent 0.35-0.37 (circle, square and
 * triangle are tested in tests/train/quality-metrics.test.ts). 0 for an empty region.
 */
export function discFill(region: readonly number[], size: number): number {
  if (!region.length) return 0;
  let cx = 0;
  let cy = 0;
  for (const p of region) {
    cx += (p % size) + 0.5;
    cy += Math.floor(p / size) + 0.5;
  }
  cx /= region.length;
  cy /= region.length;
  const d = region.map((p) => Math.hypot((p % size) + 0.5 - cx, Math.floor(p / size) + 0.5 - cy)).sort((a, b) => a - b);
  const r95 = d[Math.min(d.length - 1, Math.floor(0.95 * d.length))];
  return r95 > 0 ? (0.95 * region.length) / (Math.PI * r95 * r95) : 1;
}
