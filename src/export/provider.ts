// Trained state handed to the exporters lazily (a TensorProvider, src/io/tensor-provider.ts: each tensor's
// values read only when the exporter writes it), the exporters' error, and providers over tensors in memory.
import type { NamedTensor } from '../io/safetensors.ts';
import type { TensorProvider } from '../io/tensor-provider.ts';

// The type lives below train/ (which produces providers); re-exported for the exporters' callers.
export type { TensorProvider };

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
