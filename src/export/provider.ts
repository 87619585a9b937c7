// Trained state handed to the exporters lazily: names and shapes up front, each tensor's values read only
// when the exporter writes it (from the GPU, an IndexedDB checkpoint or a file), so an export never holds
// more than the tensor being written.
import type { NamedTensor } from '../io/safetensors.ts';
import type { Component } from '../models/detect.ts';
import type { ModelSource } from '../models/source.ts';

export interface TensorProvider {
  names(): string[];
  shape(name: string): number[];
  read(name: string): Promise<Float32Array>;
}

export class ExportError extends Error {
  override name = 'ExportError';
}

/** Tensors already in memory (tests, small adapters) as a provider. */
export function mapProvider(tensors: Map<string, NamedTensor>): TensorProvider {
  const get = (name: string) => {
    const t = tensors.get(name);
    if (!t) throw new ExportError(`no tensor '${name}'`);
    return t;
  };
  return {
    names: () => [...tensors.keys()],
    shape: (name) => [...get(name).shape],
    read: async (name) => get(name).data,
  };
}

/** One component of a model source (diffusers names) as a provider. */
export function sourceProvider(src: ModelSource, c: Component): TensorProvider {
  const shapes = src.shapes(c);
  return {
    names: () => [...shapes.keys()],
    shape: (name) => {
      const s = shapes.get(name);
      if (!s) throw new ExportError(`${src.name}: no ${c} tensor '${name}'`);
      return [...s];
    },
    read: async (name) => (await src.read(c, name)).data,
  };
}

export function sameShape(a: readonly number[], b: readonly number[]): boolean {
  return a.length === b.length && a.every((d, i) => d === b[i]);
}
