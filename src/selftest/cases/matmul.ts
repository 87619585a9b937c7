import type { KernelCase } from '../check.ts';

export const cases: KernelCase[] = [];
