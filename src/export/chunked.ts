// A full fine-tune's trained values for an export, read one optimizer chunk at a time: the fp32 masters sit
// in chunks (on the GPU or in the chunk store), and reading them all at once would need 4 bytes per weight
// (3.4 GB for SD 1.5's UNet). The exporters ask for one tensor at a time in their own order, mostly in the
// chunks' order, so an LRU of a few chunks reads each chunk about once.
import type { TensorProvider } from '../io/tensor-provider.ts';
import { ExportError } from './provider.ts';

/**
 * Tensors packed into chunks: each chunk lists its tensors (name, shape, element offset and count), in
 * order, and reads whole. The optimizer (`DreamBoothTrainer.optimizer`, a ChunkedAdamW) is one as it is, so
 * export/ needs nothing from train/.
 */
export interface ChunkedTensors {
  readonly chunks: readonly {
    readonly index: number;
    readonly params: readonly { readonly name: string; readonly shape: readonly number[]; readonly offset: number; readonly numel: number }[];
  }[];
  /** The chunk's values; a tensor is the `numel` values from its `offset`. */
  chunkMasters(index: number): Promise<Float32Array>;
}

/** The chunked tensors as a provider keeping the last `cacheChunks` chunks read (at least one). */
export function chunkedProvider(src: ChunkedTensors, cacheChunks = 4): TensorProvider {
  if (!(Number.isInteger(cacheChunks) && cacheChunks >= 1))
    throw new ExportError(`chunkedProvider: cacheChunks must be a positive integer, got ${cacheChunks}`);
  const slots = new Map<string, { chunk: number; shape: readonly number[]; offset: number; numel: number }>();
  for (const c of src.chunks) for (const p of c.params) slots.set(p.name, { chunk: c.index, shape: p.shape, offset: p.offset, numel: p.numel });
  const slot = (name: string) => {
    const s = slots.get(name);
    if (!s) throw new ExportError(`no trained tensor '${name}'`);
    return s;
  };
  // Map order is the LRU order: a hit moves its chunk to the end, a miss evicts the first.
  const cache = new Map<number, Float32Array>();
  return {
    names: () => [...slots.keys()],
    shape: (name) => [...slot(name).shape],
    read: async (name) => {
      const at = slot(name);
      let values = cache.get(at.chunk);
      if (values) cache.delete(at.chunk);
      else {
        values = await src.chunkMasters(at.chunk);
        if (cache.size >= cacheChunks) cache.delete(cache.keys().next().value!);
      }
      cache.set(at.chunk, values);
      return values.slice(at.offset, at.offset + at.numel);
    },
  };
}
