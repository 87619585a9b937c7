// Token + position embeddings (CLIP's text embeddings), forward; plain-TS reference beside it.
import type { Gpu } from '../gpu/device.ts';
import { fmtShape, ShapeError } from '../gpu/errors.ts';
import { kernel } from '../gpu/kernel.ts';
import { expectSameDType, Tensor } from '../gpu/tensor.ts';

const WG = 256;

const EMBED = kernel({
  shader: 'embedding',
  entry: 'embed',
  uniforms: [
    { name: 'n', type: 'u32' },
    { name: 'dim', type: 'u32' },
    { name: 'len', type: 'u32' },
    { name: 'vocab', type: 'u32' },
  ],
  bindings: [
    { name: 'ids', type: 'u32', access: 'read' },
    { name: 'table', type: 'T', access: 'read' },
    { name: 'pos', type: 'T', access: 'read' },
    { name: 'out', type: 'T', access: 'read_write' },
  ],
});

/** out [B, L, D] = table[ids] + pos[0..L). ids: B*L token ids; table [V, D]; pos [P >= L, D]. */
export function embedding(gpu: Gpu, ids: ArrayLike<number>, batch: number, table: Tensor, pos: Tensor): Tensor {
  const op = 'embedding';
  expectSameDType(op, table, pos);
  if (table.shape.length !== 2 || pos.shape.length !== 2 || pos.shape[1] !== table.shape[1])
    throw new ShapeError(op, `table [V,D] and pos [P,D] must share D: table ${fmtShape(table.shape)}, pos ${fmtShape(pos.shape)}`);
  const [vocab, dim] = table.shape;
  if (ids.length % batch !== 0) throw new ShapeError(op, `${ids.length} ids do not split into ${batch} sequences`);
  const len = ids.length / batch;
  if (len > pos.shape[0]) throw new ShapeError(op, `${len} tokens per sequence but only ${pos.shape[0]} positions`);
  for (let i = 0; i < ids.length; i++)
    if (!Number.isInteger(ids[i]) || ids[i] < 0 || ids[i] >= vocab)
      throw new ShapeError(op, `token id ${ids[i]} at ${i} is outside the vocabulary of ${vocab}`);
  const idBuf = gpu.tensor([ids.length], 'f32', 'scratch', 'embedding.ids'); // 4-byte slots holding u32 ids
  gpu.writeRaw(idBuf, Uint32Array.from(ids));
  const out = gpu.tensor([batch, len, dim], table.dtype, 'activations', 'embedding');
  const n = out.numel;
  gpu.run(EMBED, {
    defs: { T: table.dtype, WG },
    uniforms: { n, dim, len, vocab },
    bindings: { ids: idBuf, table, pos, out },
    workgroups: gpu.grid(Math.ceil(n / WG)),
  });
  gpu.free(idBuf);
  return out;
}
