// The LoRA layer's dispatch diet against the unfused ops, bit for bit: with alpha / rank = 1 loraLinear
// runs no scale (multiplying by 1 is exact), adds the up projection into the base output in its GEMM's
// epilogue, and adds every dx share into x's gradient in the GEMM's epilogue (Tape.accGemm; the epilogue
// rounds before adding); on the pruned tape the add backward hands dy itself to both operands instead of
// copying it. Two adapted layers read the same x (as q and k do), so x's gradient sums four GEMMs, and their
// outputs are added, so the pruned tape shares dy between them. Ragged sizes (odd features, K not a multiple
// of 4, batch 1 and 7) so no shape-specialised path hides a difference; f32 and f16.
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
  const w = new Map<string, Tensor>();
  for (const l of ['p', 'q']) {
    w.set(`${l}.weight`, gpu.upload(rand(OUT * IN), [OUT, IN], dtype, 'weights', `${l}.w`));
    w.set(`${l}.lora_A.weight`, gpu.upload(rand(RANK * IN), [RANK, IN], dtype, 'weights', `${l}.a`));
    w.set(`${l}.lora_B.weight`, gpu.upload(rand(OUT * RANK), [OUT, RANK], dtype, 'weights', `${l}.b`));
  }
  const x = gpu.upload(rand(batch * TOKENS * IN), [batch, TOKENS, IN], dtype, 'activations', 'x');
  const dy = gpu.upload(rand(batch * TOKENS * OUT), [batch, TOKENS, OUT], dtype, 'gradients', 'dy');
  const adapters = ['p', 'q'].flatMap((l) => [w.get(`${l}.lora_A.weight`)!, w.get(`${l}.lora_B.weight`)!]);
  const tape = new Tape(gpu, new Set(adapters), { prune });
  const F = new Ops(gpu, tape);
  let y: Tensor | undefined;
  // The layer spelled out with every op, the scale by 1 included.
  const unfused = (l: string) =>
    F.add(F.linear(x, w.get(`${l}.weight`)!), F.scale(F.linear(F.linear(x, w.get(`${l}.lora_A.weight`)!), w.get(`${l}.lora_B.weight`)!), 1));
  const layer = (l: string) => (mode === 'lora' ? loraLinear(F, x, w, l, 1) : unfused(l));
  const seen = recordDispatches(gpu, () => {
    y = F.add(layer('p'), layer('q'));
  });
  // Read before the backward, which frees the forward's outputs.
  const bytes = new Map([['y', new Uint8Array(await gpu.readBytes(y!.buffer, y!.byteOffset, y!.byteSize))]]);
  seen.push(...recordDispatches(gpu, () => tape.backward(y!, dy)));
  const entries = new Map<string, number>();
  for (const { entry } of seen) if (entry !== 'fill') entries.set(entry, (entries.get(entry) ?? 0) + 1);
  for (const [name, t] of [
    ['p dA', adapters[0]],
    ['p dB', adapters[1]],
    ['q dA', adapters[2]],
    ['q dB', adapters[3]],
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
      void it(`alpha / rank = 1: no scale, no add but the outputs' own, dy shared [${dtype}, batch ${batch}]`, async () => {
        const gpu = await testGpu();
        const unfused = await run(gpu, dtype, batch, 'unfused', false);
        const lora = await run(gpu, dtype, batch, 'lora', true);
        for (const [k, v] of unfused.bytes) assert.deepEqual(lora.bytes.get(k), v, `${k} differs from the unfused ops'`);
        const count = (r: Result, f: (e: string) => boolean) => [...r.entries].filter(([e]) => f(e)).reduce((n, [, c]) => n + c, 0);
        const isScale = (e: string) => e.startsWith('scale');
        const isAdd = (e: string) => e === 'add' || e === 'add4';
        // Saved: per layer the scale's forward and backward and the add backward's copy of dy, and the outputs'
        // add's copy (unpruned tape), all scale dispatches; per layer its forward add; x's gradient sums four
        // GEMMs' shares, three adds that the epilogues now do. The rest is the same kernels the same number of times.
        assert.equal(count(unfused, isScale), 7, 'unfused: 2 x (scale forward, scale backward, copy of dy) + the copy of dy for q');
        assert.equal(count(lora, isScale), 0, 'LoRA at scale 1 on the pruned tape: no scale dispatch');
        assert.equal(count(unfused, isAdd), 6, "unfused: 2 layers' adds, the outputs' add, 3 adds into dx");
        assert.equal(count(lora, isAdd), 1, "LoRA: the outputs' add only");
        const rest = (r: Result) => [...r.entries].filter(([e]) => !isScale(e) && !isAdd(e)).sort();
        assert.deepEqual(rest(lora), rest(unfused));
      });
});

// GroupNorm + SiLU (every ResNet's norm1/norm2 pair) as one kernel each way against groupNorm then act('silu'):
// the fused forward rounds the norm output as a store would before the SiLU, and the fused backward forms the
// SiLU backward's stored dn from x and the saved statistics, so every output is the unfused ops' bits. Odd
// channels per group and odd planes (C = 9 in 3 groups, 5 x 3), batch 1 and 7, f32 and f16; with trainable
// gamma/beta (both backward kernels run) and with a frozen norm (dx only). A fused kernel that skipped the
// rounding of n or of dn would differ in f16 in many elements (checked: any byte differing fails).
async function normSiluRun(gpu: Gpu, dtype: DType, batch: number, fused: boolean, trainNorm: boolean): Promise<Result> {
  const [C, G, H, W] = [9, 3, 5, 3];
  const rng = new Rng(batch * 17 + (dtype === 'f16' ? 1 : 0));
  const rand = (n: number, s = 1, o = 0) => Float32Array.from({ length: n }, () => o + s * (2 * rng.uniform() - 1));
  const x = gpu.upload(rand(batch * C * H * W, 3, 0.5), [batch, C, H, W], dtype, 'activations', 'x');
  const gamma = gpu.upload(rand(C, 0.5, 1), [C], dtype, 'weights', 'gamma');
  const beta = gpu.upload(rand(C, 0.5), [C], dtype, 'weights', 'beta');
  const dy = gpu.upload(rand(x.numel), x.shape, dtype, 'gradients', 'dy');
  const tape = new Tape(gpu, new Set(trainNorm ? [gamma, beta] : []), { prune: true });
  const F = new Ops(gpu, tape);
  let y: Tensor | undefined;
  const seen = recordDispatches(gpu, () => {
    y = fused ? F.groupNormSilu(x, gamma, beta, G, 1e-5) : F.act('silu', F.groupNorm(x, gamma, beta, G, 1e-5));
  });
  const bytes = new Map([['y', new Uint8Array(await gpu.readBytes(y!.buffer, y!.byteOffset, y!.byteSize))]]);
  seen.push(...recordDispatches(gpu, () => tape.backward(y!, dy)));
  const entries = new Map<string, number>();
  for (const { entry } of seen) if (entry !== 'fill') entries.set(entry, (entries.get(entry) ?? 0) + 1);
  for (const [name, t] of [['dx', x], ...(trainNorm ? [['dgamma', gamma] as const, ['dbeta', beta] as const] : [])] as const) {
    const g = tape.take(t);
    assert.ok(g, `${name}: no gradient`);
    bytes.set(name, new Uint8Array(await gpu.readBytes(g.buffer, g.byteOffset, g.byteSize)));
    gpu.free(g);
  }
  tape.dropGrads();
  gpu.free(x, gamma, beta, dy);
  return { bytes, entries };
}

void describe('GroupNorm + SiLU fused vs the unfused ops', () => {
  for (const dtype of ['f32', 'f16'] as const)
    for (const batch of [1, 7])
      for (const trainNorm of [true, false])
        void it(`one dispatch each way, the same bits [${dtype}, batch ${batch}, ${trainNorm ? 'trainable' : 'frozen'} norm]`, async () => {
          const gpu = await testGpu();
          const unfused = await normSiluRun(gpu, dtype, batch, false, trainNorm);
          const fused = await normSiluRun(gpu, dtype, batch, true, trainNorm);
          assert.equal(fused.bytes.size, unfused.bytes.size);
          for (const [k, v] of unfused.bytes) assert.deepEqual(fused.bytes.get(k), v, `${k} differs from the unfused ops'`);
          const acts = (r: Result) =>
            (r.entries.get('act_fwd4') ?? 0) + (r.entries.get('act_fwd') ?? 0) + (r.entries.get('act_bwd4') ?? 0) + (r.entries.get('act_bwd') ?? 0);
          assert.equal(acts(unfused), 2, 'unfused: the SiLU forward and backward');
          assert.equal(acts(fused), 0, 'fused: no SiLU dispatch');
          const norms = (r: Result) => [...r.entries].filter(([e]) => e.startsWith('norm_')).sort();
          assert.deepEqual(norms(fused), norms(unfused), 'the same norm kernels, once each');
          assert.equal(fused.entries.get('norm_bwd_params') ?? 0, trainNorm ? 1 : 0);
        });
});

// A norm's dx added into its input's gradient in the kernel (Tape.accGemm; norm.wgsl ACCUMULATE) against dx and
// an add: y = x + silu(norm(x)), the residual pattern of every transformer block (LayerNorm), transformer and
// ResNet (GroupNorm, GroupNorm + SiLU). The pruned tape's kernel adds into x's gradient (the residual's dy, no
// longer shared once the branch is done); the unpruned tape makes dx and adds, as before. Ragged sizes, batch 1
// and 7, f32 and f16; a kernel that added without rounding dx to f16 first would differ in f16.
async function normAccRun(gpu: Gpu, kind: 'layerNorm' | 'groupNorm' | 'groupNormSilu', dtype: DType, batch: number, prune: boolean): Promise<Result> {
  const shape = kind === 'layerNorm' ? [batch, 5, 9] : [batch, 9, 5, 3];
  const channels = 9;
  const rng = new Rng(batch * 13 + (dtype === 'f16' ? 1 : 0));
  const rand = (n: number, s = 1, o = 0) => Float32Array.from({ length: n }, () => o + s * (2 * rng.uniform() - 1));
  const numel = shape.reduce((a, b) => a * b, 1);
  const x = gpu.upload(rand(numel, 3, 0.5), shape, dtype, 'activations', 'x');
  const gamma = gpu.upload(rand(channels, 0.5, 1), [channels], dtype, 'weights', 'gamma');
  const beta = gpu.upload(rand(channels, 0.5), [channels], dtype, 'weights', 'beta');
  const dy = gpu.upload(rand(numel), shape, dtype, 'gradients', 'dy');
  const tape = new Tape(gpu, new Set<Tensor>(), { prune });
  const F = new Ops(gpu, tape);
  const norm = (t: Tensor) =>
    kind === 'layerNorm'
      ? F.act('silu', F.layerNorm(t, gamma, beta, 1e-5))
      : kind === 'groupNorm'
        ? F.act('silu', F.groupNorm(t, gamma, beta, 3, 1e-5))
        : F.groupNormSilu(t, gamma, beta, 3, 1e-5);
  let y: Tensor | undefined;
  const seen = recordDispatches(gpu, () => {
    y = F.add(x, kind === 'groupNormSilu' ? F.scale(norm(x), 0.5) : norm(x));
  });
  seen.push(...recordDispatches(gpu, () => tape.backward(y!, dy)));
  const entries = new Map<string, number>();
  for (const { entry, defs } of seen)
    if (entry !== 'fill') {
      const key = defs.ACCUMULATE === true ? `${entry}+` : entry;
      entries.set(key, (entries.get(key) ?? 0) + 1);
    }
  const g = tape.take(x);
  assert.ok(g, 'dx: no gradient');
  const bytes = new Map([['dx', new Uint8Array(await gpu.readBytes(g.buffer, g.byteOffset, g.byteSize))]]);
  gpu.free(g);
  tape.dropGrads();
  gpu.free(x, gamma, beta, dy);
  return { bytes, entries };
}

void describe("Norm dx added into the input's gradient in the kernel vs dx and an add", () => {
  for (const kind of ['layerNorm', 'groupNorm', 'groupNormSilu'] as const)
    for (const dtype of ['f32', 'f16'] as const)
      for (const batch of [1, 7])
        void it(`${kind}: no add dispatch for dx, the same bits [${dtype}, batch ${batch}]`, async () => {
          const gpu = await testGpu();
          const unfused = await normAccRun(gpu, kind, dtype, batch, false);
          const fused = await normAccRun(gpu, kind, dtype, batch, true);
          assert.deepEqual(fused.bytes.get('dx'), unfused.bytes.get('dx'), "dx differs from the unfused ops'");
          const adds = (r: Result) => (r.entries.get('add') ?? 0) + (r.entries.get('add4') ?? 0);
          assert.equal(adds(unfused), 2, "unfused: the residual's add and the add of dx into x's gradient");
          assert.equal(adds(fused), 1, "fused: the residual's add only");
          assert.equal(fused.entries.get('norm_bwd_input+'), 1, 'the dx kernel accumulates');
        });
});

/**
 * Three ResNets' time projections of one input e [batch, K], each added per channel to its x_i [batch, C_i, 3, 5]:
 * per layer (linear, addChannel), or merged (one linear over the weights concatenated along N, each addChannel
 * reading its columns of the [batch, sum C_i] result in place), as nn/unet.ts does. Ragged: K = 13, C = 5, 9, 3.
 */
async function timeProjRun(gpu: Gpu, dtype: DType, batch: number, merged: boolean): Promise<Result> {
  const [K, CS] = [13, [5, 9, 3]];
  const rng = new Rng(batch * 17 + (dtype === 'f16' ? 1 : 0));
  const rand = (n: number) => Float32Array.from({ length: n }, () => 2 * rng.uniform() - 1);
  const ws = CS.map((c) => rand(c * K));
  const bs = CS.map((c) => rand(c));
  const xs = CS.map((c) => gpu.upload(rand(batch * c * 15), [batch, c, 3, 5], dtype));
  const e = gpu.upload(rand(batch * K), [batch, K], dtype);
  // Frozen projections of an input that needs no gradient (the UNet's time embedding)
  const tape = new Tape(gpu, new Set(), { prune: true });
  tape.noGrad(e);
  const F = new Ops(gpu, tape);
  const ys: Tensor[] = [];
  const seen = recordDispatches(gpu, () => {
    if (merged) {
      const cat = (parts: Float32Array[]) => Float32Array.from(parts.flatMap((p) => [...p]));
      const n = CS.reduce((a, b) => a + b, 0);
      const wAll = gpu.upload(cat(ws), [n, K], dtype, 'weights');
      const all = F.linear(e, wAll, gpu.upload(cat(bs), [n], dtype, 'weights'));
      let column = 0;
      for (const [i, x] of xs.entries()) {
        ys.push(F.addChannel(x, all, column));
        column += CS[i];
      }
    } else
      for (const [i, x] of xs.entries()) {
        const t = F.linear(e, gpu.upload(ws[i], [CS[i], K], dtype, 'weights'), gpu.upload(bs[i], [CS[i]], dtype, 'weights'));
        ys.push(F.addChannel(x, t));
      }
  });
  const bytes = new Map<string, Uint8Array>();
  for (const [i, y] of ys.entries()) bytes.set(`y${i}`, new Uint8Array(await gpu.readBytes(y.buffer, y.byteOffset, y.byteSize)));
  const entries = new Map<string, number>();
  for (const { entry } of seen) if (entry !== 'fill') entries.set(entry, (entries.get(entry) ?? 0) + 1);
  return { bytes, entries };
}

void describe('Time projections merged into one GEMM vs one GEMM per layer', () => {
  for (const dtype of ['f32', 'f16'] as const)
    for (const batch of [1, 7])
      void it(`each layer's sum reads its columns in place, the same bits, 2 GEMMs fewer [${dtype}, batch ${batch}]`, async () => {
        const gpu = await testGpu();
        const separate = await timeProjRun(gpu, dtype, batch, false);
        const merged = await timeProjRun(gpu, dtype, batch, true);
        // Bit-identical: each projection element is the same 13-long dot product plus bias whatever N is (the
        // GEMM's reduction order per element does not depend on the output width), read where it lies.
        for (const k of separate.bytes.keys()) assert.deepEqual(merged.bytes.get(k), separate.bytes.get(k), `${k} differs`);
        assert.equal(separate.entries.get('matmul'), 3);
        assert.equal(merged.entries.get('matmul'), 1);
        assert.equal(merged.entries.get('add_channel'), 3);
      });
  void it('a column slice that would need a gradient is refused, naming the op', async () => {
    const gpu = await testGpu();
    const t = gpu.upload([1, 2, 3, 4], [1, 4], 'f32');
    const x = gpu.upload([1, 2], [1, 2, 1, 1], 'f32');
    const F = new Ops(gpu, new Tape(gpu, null));
    assert.throws(() => F.addChannel(x, t, 1), /addChannel: a column slice of t gets no gradient/);
    assert.throws(() => new Ops(gpu).addChannel(x, t, 3), /addChannel.*columns \[3,5\)/);
    gpu.free(t, x);
  });
});
