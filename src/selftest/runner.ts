// Runs kernel cases on a Gpu for each dtype it supports; used by the page and by the e2e test.
import type { Gpu } from '../gpu/device.ts';
import type { DType } from '../gpu/tensor.ts';
import type { Check, GoldenSet, KernelCase } from './check.ts';

export interface CaseResult {
  family: string;
  name: string;
  dtype: DType;
  pass: boolean;
  checks: Check[];
  error?: string;
  ms: number;
}

export async function runCase(gpu: Gpu, c: KernelCase, dtype: DType, golden: GoldenSet): Promise<CaseResult> {
  const t0 = performance.now();
  try {
    const checks = await c.run({ gpu, dtype, golden });
    return { family: c.family, name: c.name, dtype, pass: checks.length > 0 && checks.every((k) => k.pass), checks, ms: performance.now() - t0 };
  } catch (e) {
    return { family: c.family, name: c.name, dtype, pass: false, checks: [], error: String((e as Error)?.stack ?? e), ms: performance.now() - t0 };
  }
}

/** The dtypes a case runs in on this device: none where it cannot run at all (see notRunReason). */
export function dtypesFor(gpu: Gpu, c: KernelCase): DType[] {
  if (notRunReason(gpu, c)) return [];
  return (c.dtypes ?? ['f32', 'f16']).filter((d) => d === 'f32' || gpu.hasF16);
}

/** Why a case cannot run on this device (reported as "not run"), or null. */
export function notRunReason(gpu: Gpu, c: KernelCase): string | null {
  return c.requires?.(gpu) ?? null;
}
