// Numerical checks shared by the Node test suite and the in-page self-test.

import type { Gpu } from '../gpu/device.ts';
import type { DType } from '../gpu/tensor.ts';
import type { NamedTensor } from '../io/safetensors.ts';

export interface Tolerance {
  atol: number;
  rtol: number;
}

export interface Check {
  label: string;
  pass: boolean;
  /** Largest |actual - expected|. */
  maxAbs: number;
  /** Largest |actual - expected| / |expected| over elements with |expected| > atol. */
  maxRel: number;
  tol: Tolerance;
  n: number;
  /** First failing element, when any. */
  firstBad?: { index: number; actual: number; expected: number };
}

/** Element-wise |a - e| <= atol + rtol * |e| (torch.allclose), and both sides finite where e is. */
export function compare(label: string, actual: ArrayLike<number>, expected: ArrayLike<number>, tol: Tolerance): Check {
  if (actual.length !== expected.length)
    return { label: `${label} (length ${actual.length} vs ${expected.length})`, pass: false, maxAbs: Infinity, maxRel: Infinity, tol, n: 0 };
  let maxAbs = 0;
  let maxRel = 0;
  let firstBad: Check['firstBad'];
  for (let i = 0; i < expected.length; i++) {
    const a = actual[i];
    const e = expected[i];
    const d = Math.abs(a - e);
    const ok = Number.isFinite(e) ? Number.isFinite(a) && d <= tol.atol + tol.rtol * Math.abs(e) : Object.is(a, e) || (Number.isNaN(a) && Number.isNaN(e));
    if (!ok && !firstBad) firstBad = { index: i, actual: a, expected: e };
    if (Number.isFinite(d)) {
      maxAbs = Math.max(maxAbs, d);
      if (Math.abs(e) > tol.atol) maxRel = Math.max(maxRel, d / Math.abs(e));
    } else if (!Object.is(a, e)) maxAbs = Infinity;
  }
  return { label, pass: !firstBad, maxAbs, maxRel, tol, n: expected.length, firstBad };
}

export function describeCheck(c: Check): string {
  const base = `${c.pass ? 'ok  ' : 'FAIL'} ${c.label}: n=${c.n} maxAbs=${c.maxAbs.toExponential(2)} maxRel=${c.maxRel.toExponential(2)} (atol ${c.tol.atol}, rtol ${c.tol.rtol})`;
  return c.firstBad ? `${base} first bad #${c.firstBad.index}: got ${c.firstBad.actual}, want ${c.firstBad.expected}` : base;
}

export interface GoldenSet {
  get(name: string): NamedTensor;
  has(name: string): boolean;
}

export interface CaseContext {
  gpu: Gpu;
  dtype: DType;
  golden: GoldenSet;
}

export interface KernelCase {
  /** Op family, also the golden fixture file name (tests/fixtures/kernels/<family>.safetensors). */
  family: string;
  name: string;
  /** Which dtypes the case runs in (default both). */
  dtypes?: DType[];
  /**
   * Why this device cannot run the case (a path it lacks, e.g. tensor cores), or null when it can. A case that
   * cannot run is reported as not run, never as passed.
   */
  requires?: (gpu: Gpu) => string | null;
  run(ctx: CaseContext): Promise<Check[]>;
}

/** Deterministic pseudo-random values in [-scale, scale) (mulberry32), for cases without goldens. */
export function randomValues(n: number, seed: number, scale = 1): Float32Array {
  let s = seed >>> 0;
  const out = new Float32Array(n);
  for (let i = 0; i < n; i++) {
    s = (s + 0x6d2b79f5) >>> 0;
    let t = s;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    out[i] = ((((t ^ (t >>> 14)) >>> 0) / 4294967296) * 2 - 1) * scale;
  }
  return out;
}
