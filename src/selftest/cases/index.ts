// Every kernel case, by family. The Node suite and the in-page self-test both run these.
import type { KernelCase } from '../check.ts';
import { cases as adamw } from './adamw.ts';
import { cases as attention } from './attention.ts';
import { cases as conv2d } from './conv2d.ts';
import { cases as elementwise } from './elementwise.ts';
import { cases as matmul } from './matmul.ts';
import { cases as norm } from './norm.ts';
import { cases as reduce } from './reduce.ts';

export const FAMILIES: Record<string, KernelCase[]> = { matmul, conv2d, attention, norm, elementwise, reduce, adamw };

export const ALL_CASES: KernelCase[] = Object.values(FAMILIES).flat();
