// The LoRA layer's dispatch diet against the unfused ops, bit for bit: with alpha / rank = 1 loraLinear
// runs no scale (multiplying by 1 is exact), and on the pruned tape the add backward hands dy itself to
// both operands instead of copying it. Ragged sizes (odd features, K not a multiple of 4, batch 1 and 7)
// so no shape-specialised path hides a difference; f32 and f16.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import type { Gpu } from '../../src/gpu/device.ts';
import type { DType, Tensor } from '../../src/gpu/tensor.ts';
import { loraLinear } from '../../src/nn/lora.ts';
import { Ops, Tape } from '../../src/nn/ops.ts';
import { Rng } from '../../src/util/rng.ts';
import { recordDispatches, testGpu } from '../helpers.ts';

const [IN, OUT, RANK, TOKENS] = [7, 5, 3, 3];

interface Result {
  bytes: Map<string, Uint8Array>;
  /** Dispatches by kernel entry, forward and backward (the poison fills of new tensors left out). */
  entries: Map<string, number>;
}

async function run(gpu: Gpu, dtype: DType, batch: number, mode: 'lora' | 'unfused', prune: boolean): Promise<Result> {
  const rng = new Rng(batch * 31 + (dtype === 'f16' ? 1 : 0));
  const rand = (n: number) => Float32Array.from({ length: n }, () => 2 * rng.uniform() - 1);
  const w = new Map<string, Tensor>([
    ['p.weight', gpu.upload(rand(OUT * IN), [OUT, IN], dtype, 'weights', 'w')],
    ['p.lora_A.weight', gpu.upload(rand(RANK * IN), [RANK, IN], dtype, 'weights', 'a')],
    ['p.lora_B.weight', gpu.upload(rand(OUT * RANK), [OUT, RANK], dtype, 'weights', 'b')],
  ]);
  const x = gpu.upload(rand(batch * TOKENS * IN), [batch, TOKENS, IN], dtype, 'activations', 'x');
  const dy = gpu.upload(rand(batch * TOKENS * OUT), [batch, TOKENS, OUT], dtype, 'gradients', 'dy');
  const [a, b] = [w.get('p.lora_A.weight')!, w.get('p.lora_B.weight')!];
  const tape = new Tape(gpu, new Set([a, b]), { prune });
  const F = new Ops(gpu, tape);
  let y: Tensor | undefined;
  const seen = recordDispatches(gpu, () => {
    if (mode === 'lora') y = loraLinear(F, x, w, 'p', 1);
    else {
      // The layer spelled out with every op, the scale by 1 included.
      const base = F.linear(x, w.get('p.weight')!);
      y = F.add(base, F.scale(F.linear(F.linear(x, a), b), 1));
    }
  });
  // Read before the backward, which frees the forward's outputs.
  const bytes = new Map([['y', new Uint8Array(await gpu.readBytes(y!.buffer, y!.byteOffset, y!.byteSize))]]);
  seen.push(...recordDispatches(gpu, () => tape.backward(y!, dy)));
  const entries = new Map<string, number>();
  for (const { entry } of seen) if (entry !== 'fill') entries.set(entry, (entries.get(entry) ?? 0) + 1);
  for (const [name, t] of [
    ['dA', a],
    ['dB', b],
    ['dx', x],
  ] as const) {
    const g = tape.take(t);
    assert.ok(g, `${name}: no gradient`);
    bytes.set(name, new Uint8Array(await gpu.readBytes(g.buffer, g.byteOffset, g.byteSize)));
    gpu.free(g);
  }
  tape.dropGrads();
  gpu.free(...w.values(), x);
  return { bytes, entries };
}

void describe('LoRA dispatch diet vs the unfused ops', () => {
  for (const dtype of ['f32', 'f16'] as const)
    for (const batch of [1, 7])
      void it(`alpha / rank = 1 runs no scale; the add backward shares dy [${dtype}, batch ${batch}]`, async () => {
        const gpu = await testGpu();
        const unfused = await run(gpu, dtype, batch, 'unfused', false);
        const lora = await run(gpu, dtype, batch, 'lora', true);
        for (const [k, v] of unfused.bytes) assert.deepEqual(lora.bytes.get(k), v, `${k} differs from the unfused ops'`);
        // Saved: the scale's forward and backward, and the add backward's copy of dy, all scale dispatches; the
        // rest is the same kernels the same number of times.
        const scales = (r: Result) => [...r.entries].filter(([e]) => e.startsWith('scale')).reduce((n, [, c]) => n + c, 0);
        assert.equal(scales(unfused), 3, 'unfused: scale forward, scale backward, the copy of dy');
        assert.equal(scales(lora), 0, 'LoRA at scale 1 on the pruned tape: no scale dispatch');
        const rest = (r: Result) => [...r.entries].filter(([e]) => !e.startsWith('scale')).sort();
        assert.deepEqual(rest(lora), rest(unfused));
      });
});
