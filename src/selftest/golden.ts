// Golden fixtures (PyTorch outputs) as a GoldenSet, from bytes either host provides.
import { readSafetensors } from '../io/safetensors.ts';
import type { GoldenSet } from './check.ts';

export function goldenFromBytes(family: string, bytes: Uint8Array): GoldenSet {
  const { tensors } = readSafetensors(bytes);
  return {
    has: (name) => tensors.has(name),
    get: (name) => {
      const t = tensors.get(name);
      if (!t) throw new Error(`golden '${family}' has no tensor '${name}'`);
      return t;
    },
  };
}

export const EMPTY_GOLDEN: GoldenSet = {
  has: () => false,
  get: (name) => {
    throw new Error(`no golden fixture loaded (wanted '${name}')`);
  },
};
