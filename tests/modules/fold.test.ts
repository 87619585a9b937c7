// Layout moves and residual adds folded into the GEMMs around them, against the unfused ops, bit for bit:
// - Ops.project: a transformer's frozen proj_in / proj_out (a 1x1 conv for SD 1.x, a linear layer for SD 2.x)
//   reads or writes its operand transposed, so no transpose runs either way; each element is the same dot product in
//   the same order as the conv or linear and its transpose. The pattern is the transformer's, x + proj_out(proj_in(x)),
//   so on the pruned tape proj_in's dx is added into x's gradient (the residual's dy) in the GEMM's epilogue.
// - Ops.convAddPointwise: a ResNet's 1x1 shortcut adds into conv2's output in its GEMM's epilogue (no add pass).
// Ragged sizes (odd pixel counts, 5/6/7 channels, batch 1 and 3) so no shape-specialised path hides a difference;
// f32 and f16 (an epilogue that added before rounding to f16 would differ there). Then the tiny UNets (SD 1.x conv
// projections, SD 2.x linear ones) with the fold against the same step with the projections unfolded.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import type { Gpu } from '../../src/gpu/device.ts';
import type { DType, Tensor } from '../../src/gpu/tensor.ts';
import { readSafetensors } from '../../src/io/safetensors.ts';
import { Ops, Tape } from '../../src/nn/ops.ts';
import { unetConfigFromJson, unetForward } from '../../src/nn/unet.ts';
import { mseLossBackward } from '../../src/ops/reduce.ts';
import { Rng } from '../../src/util/rng.ts';
import { FIXTURES, recordDispatches, testGpu } from '../helpers.ts';

interface Result {
  bytes: Map<string, Uint8Array>;
  /** Dispatches by kernel entry, forward and backward (the poison fills of new tensors left out). */
  entries: Map<string, number>;
}

const bytesOf = async (gpu: Gpu, t: Tensor) => new Uint8Array(await gpu.readBytes(t.buffer, t.byteOffset, t.byteSize));

/** Runs `forward` on a tape and its backward from dy (or dy(y)); y and the gradients of `grads` as bytes. */
async function step(gpu: Gpu, tape: Tape, forward: () => Tensor, dy: Tensor | ((y: Tensor) => Tensor), grads: [string, Tensor][]): Promise<Result> {
  let y: Tensor | undefined;
  const seen = recordDispatches(gpu, () => {
    y = forward();
  });
  const bytes = new Map([['y', await bytesOf(gpu, y!)]]);
  seen.push(...recordDispatches(gpu, () => tape.backward(y!, typeof dy === 'function' ? dy(y!) : dy)));
  const entries = new Map<string, number>();
  for (const { entry } of seen) if (entry !== 'fill') entries.set(entry, (entries.get(entry) ?? 0) + 1);
  for (const [name, t] of grads) {
    const g = tape.take(t);
    assert.ok(g, `${name}: no gradient`);
    bytes.set(name, await bytesOf(gpu, g));
    gpu.free(g);
  }
  tape.dropGrads();
  return { bytes, entries };
}

const [C, D, H, W] = [5, 6, 3, 3];

/** y = x + proj_out(proj_in(x)) on x [batch, C, H, W], proj_in C -> D, proj_out D -> C, frozen; dx from dy. */
async function projectRun(gpu: Gpu, dtype: DType, batch: number, kind: 'conv' | 'linear', fold: boolean): Promise<Result> {
  const rng = new Rng(batch * 17 + (dtype === 'f16' ? 1 : 0) + (kind === 'conv' ? 2 : 0));
  const rand = (n: number) => Float32Array.from({ length: n }, () => 2 * rng.uniform() - 1);
  const wShape = (o: number, i: number) => (kind === 'conv' ? [o, i, 1, 1] : [o, i]);
  const w1 = gpu.upload(rand(D * C), wShape(D, C), dtype, 'weights', 'proj_in.w');
  const b1 = gpu.upload(rand(D), [D], dtype, 'weights', 'proj_in.b');
  const w2 = gpu.upload(rand(C * D), wShape(C, D), dtype, 'weights', 'proj_out.w');
  const b2 = gpu.upload(rand(C), [C], dtype, 'weights', 'proj_out.b');
  const x = gpu.upload(rand(batch * C * H * W), [batch, C, H, W], dtype, 'activations', 'x');
  const dy = gpu.upload(rand(batch * C * H * W), [batch, C, H, W], dtype, 'gradients', 'dy');
  const tape = new Tape(gpu, new Set<Tensor>());
  const F = new Ops(gpu, tape);
  const P = H * W;
  const pw = { stride: 1, padding: 0 };
  // The unfolded transformer ends (nn/unet.ts): conv then transpose, or transpose then linear; and back.
  const unfolded = (): Tensor => {
    const t = kind === 'conv' ? F.transpose(F.reshape(F.conv(x, w1, b1, pw), [batch, D, P])) : F.linear(F.transpose(F.reshape(x, [batch, C, P])), w1, b1);
    const u = kind === 'conv' ? F.conv(F.reshape(F.transpose(t), [batch, D, H, W]), w2, b2, pw) : F.transpose(F.linear(t, w2, b2));
    return F.add(F.reshape(u, x.shape), x);
  };
  const folded = () => F.add(F.reshape(F.project(F.project(x, w1, b1, 'tokens'), w2, b2, 'channels'), x.shape), x);
  const r = await step(gpu, tape, fold ? folded : unfolded, dy, [['dx', x]]);
  gpu.free(w1, b1, w2, b2, x);
  return r;
}

void describe('Transformer projections read their operand transposed (Ops.project) vs conv or linear and a transpose', () => {
  for (const kind of ['conv', 'linear'] as const)
    for (const dtype of ['f32', 'f16'] as const)
      for (const batch of [1, 3])
        void it(`no transpose either way, dx added in the epilogue, the same bits [${kind}, ${dtype}, batch ${batch}]`, async () => {
          const gpu = await testGpu();
          const unfolded = await projectRun(gpu, dtype, batch, kind, false);
          const folded = await projectRun(gpu, dtype, batch, kind, true);
          for (const [k, v] of unfolded.bytes) assert.deepEqual(folded.bytes.get(k), v, `${k} differs from the unfolded ops'`);
          // Unfolded: two transposes forward, two backward, and (linear) x's gradient summed by an add (the
          // transpose's dx; the conv adds its dx in the epilogue); folded: none, the GEMMs and the residual add only.
          assert.equal(unfolded.entries.get('transpose2d'), 4, 'unfolded: 4 transposes');
          assert.equal(folded.entries.get('transpose2d') ?? 0, 0, 'folded: no transpose');
          const adds = (r: Result) => (r.entries.get('add') ?? 0) + (r.entries.get('add4') ?? 0);
          assert.equal(adds(unfolded), kind === 'conv' ? 1 : 2, "unfolded: the residual (and x's gradient sum)");
          assert.equal(adds(folded), 1, 'folded: the residual only');
          assert.equal(folded.entries.get('matmul'), 4, 'folded: 2 GEMMs forward, 2 backward');
        });

  void it('a trained projection is refused, naming the op (its dW would sum in another order)', async () => {
    const gpu = await testGpu();
    const w = gpu.upload(new Float32Array(D * C), [D, C], 'f32', 'weights', 'w');
    const x = gpu.upload(new Float32Array(C * 4), [1, C, 4], 'f32', 'activations', 'x');
    const F = new Ops(gpu, new Tape(gpu, new Set([w])));
    assert.throws(() => F.project(x, w, null, 'tokens'), /Ops\.project: the projection is trained/);
    gpu.free(w, x);
  });
});

/** y = conv2(b) + shortcut(x), conv2 3x3 D -> 7, shortcut 1x1 C -> 7; gradients of x, b and (when trained) the weights. */
async function shortcutRun(gpu: Gpu, dtype: DType, batch: number, trained: boolean, fold: boolean): Promise<Result> {
  const rng = new Rng(batch * 19 + (dtype === 'f16' ? 1 : 0));
  const rand = (n: number) => Float32Array.from({ length: n }, () => 2 * rng.uniform() - 1);
  const O = 7;
  const w2 = gpu.upload(rand(O * D * 9), [O, D, 3, 3], dtype, 'weights', 'conv2.w');
  const b2 = gpu.upload(rand(O), [O], dtype, 'weights', 'conv2.b');
  const ws = gpu.upload(rand(O * C), [O, C, 1, 1], dtype, 'weights', 'shortcut.w');
  const bs = gpu.upload(rand(O), [O], dtype, 'weights', 'shortcut.b');
  const x = gpu.upload(rand(batch * C * H * W), [batch, C, H, W], dtype, 'activations', 'x');
  const b = gpu.upload(rand(batch * D * H * W), [batch, D, H, W], dtype, 'activations', 'b');
  const dy = gpu.upload(rand(batch * O * H * W), [batch, O, H, W], dtype, 'gradients', 'dy');
  const weights = [w2, b2, ws, bs];
  const tape = new Tape(gpu, new Set(trained ? weights : []));
  const F = new Ops(gpu, tape);
  const [c3, pw] = [
    { stride: 1, padding: 1 },
    { stride: 1, padding: 0 },
  ];
  // resnetForward's order: conv2, then the shortcut, then short + h2
  const unfolded = () => {
    const h2 = F.conv(b, w2, b2, c3);
    return F.add(F.conv(x, ws, bs, pw), h2);
  };
  const folded = () => F.convAddPointwise(b, w2, b2, c3, x, ws, bs);
  const names: [string, Tensor][] = [
    ['dx', x],
    ['db', b],
  ];
  if (trained) names.push(['dw2', w2], ['db2', b2], ['dws', ws], ['dbs', bs]);
  const r = await step(gpu, tape, fold ? folded : unfolded, dy, names);
  gpu.free(...weights, x, b);
  return r;
}

void describe("A ResNet's 1x1 shortcut added in its GEMM's epilogue (Ops.convAddPointwise) vs conv, conv and add", () => {
  for (const dtype of ['f32', 'f16'] as const)
    for (const batch of [1, 3])
      for (const trained of [false, true])
        void it(`no add dispatch, the same bits [${dtype}, batch ${batch}, ${trained ? 'trained' : 'frozen'} convs]`, async () => {
          const gpu = await testGpu();
          const unfolded = await shortcutRun(gpu, dtype, batch, trained, false);
          const folded = await shortcutRun(gpu, dtype, batch, trained, true);
          assert.equal(folded.bytes.size, unfolded.bytes.size);
          for (const [k, v] of unfolded.bytes) assert.deepEqual(folded.bytes.get(k), v, `${k} differs from the unfolded ops'`);
          const adds = (r: Result) => (r.entries.get('add') ?? 0) + (r.entries.get('add4') ?? 0);
          assert.equal(adds(unfolded), 1, 'unfolded: the add');
          assert.equal(adds(folded), 0, 'folded: no add');
          const total = (r: Result) => [...r.entries.values()].reduce((a, n) => a + n, 0);
          assert.equal(total(folded), total(unfolded) - 1, 'one dispatch fewer, the rest unchanged');
        });
});

/**
 * A frozen conv's dx added into its input's gradient in the GEMM's epilogue (Ops.conv through Tape.accGemm) against dx
 * and an add (the unpruned tape): y = concat(conv(x), x), so x's gradient (a split of dy) is there before the conv's
 * backward runs, as for a UNet skip feeding a downsampler. 3x3 (lowered to im2col on this adapter, and the implicit
 * GEMM), 3x3 stride 2 (upsampled back) and 1x1.
 */
async function convDxRun(gpu: Gpu, dtype: DType, batch: number, kind: '3x3' | '3x3 implicit' | 'stride 2' | '1x1', prune: boolean): Promise<Result> {
  const rng = new Rng(batch * 23 + (dtype === 'f16' ? 1 : 0));
  const rand = (n: number) => Float32Array.from({ length: n }, () => 2 * rng.uniform() - 1);
  const [O, S] = [7, 6];
  const k = kind === '1x1' ? 1 : 3;
  const w = gpu.upload(rand(O * C * k * k), [O, C, k, k], dtype, 'weights', 'w');
  const b = gpu.upload(rand(O), [O], dtype, 'weights', 'b');
  const x = gpu.upload(rand(batch * C * S * S), [batch, C, S, S], dtype, 'activations', 'x');
  const dy = gpu.upload(rand(batch * (O + C) * S * S), [batch, O + C, S, S], dtype, 'gradients', 'dy');
  const tape = new Tape(gpu, new Set<Tensor>(), { prune });
  const F = new Ops(gpu, tape);
  const opts = { stride: kind === 'stride 2' ? 2 : 1, padding: k === 3 ? 1 : 0, ...(kind === '3x3 implicit' ? { lowering: 'implicit' as const } : {}) };
  const forward = () => {
    const c = F.conv(x, w, b, opts);
    return F.concat(kind === 'stride 2' ? F.upsample(c) : c, x);
  };
  const r = await step(gpu, tape, forward, dy, [['dx', x]]);
  gpu.free(w, b, x);
  return r;
}

void describe("A frozen conv's dx added into its input's gradient in the epilogue vs dx and an add", () => {
  for (const kind of ['3x3', '3x3 implicit', 'stride 2', '1x1'] as const)
    for (const dtype of ['f32', 'f16'] as const)
      for (const batch of [1, 3])
        void it(`no add dispatch, the same bits [${kind}, ${dtype}, batch ${batch}]`, async () => {
          const gpu = await testGpu();
          const unpruned = await convDxRun(gpu, dtype, batch, kind, false);
          const pruned = await convDxRun(gpu, dtype, batch, kind, true);
          assert.deepEqual(pruned.bytes, unpruned.bytes, 'y or dx differs from dx and an add');
          const adds = (r: Result) => (r.entries.get('add') ?? 0) + (r.entries.get('add4') ?? 0);
          assert.equal(adds(unpruned), 1, 'unpruned: dx, then an add');
          assert.equal(adds(pruned), 0, 'pruned: added in the epilogue');
        });
});

const load = (n: string) => readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'modules', `${n}.safetensors`))));

/**
 * One forward + backward of a tiny UNet with the attention's to_q and to_v trained (the rest frozen, as in LoRA); with
 * `unfold`, every proj_in and proj_out is in the trainable set too, which runs them as conv or linear and transpose
 * (their own gradients are not compared). The output and the to_q / to_v gradients as bytes.
 */
async function unetRun(gpu: Gpu, name: string, dtype: DType, unfold: boolean): Promise<Result> {
  const { tensors, metadata } = load(name);
  const cfg = unetConfigFromJson(JSON.parse(metadata.config));
  const inputs = new Set(['sample', 'timestep', 'encoder_hidden_states', 'out']);
  const weights = new Map<string, Tensor>();
  for (const [k, t] of tensors) if (!inputs.has(k)) weights.set(k, gpu.upload(t.data, t.shape, dtype, 'weights', k));
  const g = (k: string) => tensors.get(k)!;
  const sample = gpu.upload(g('sample').data, g('sample').shape, dtype);
  const timesteps = gpu.upload(g('timestep').data, [2], 'f32');
  const context = gpu.upload(g('encoder_hidden_states').data, g('encoder_hidden_states').shape, dtype);
  const trained = [...weights.keys()].filter((k) => /attn[12]\.to_[qv]\.weight$/.test(k));
  const projections = [...weights.keys()].filter((k) => /proj_(in|out)\.(weight|bias)$/.test(k));
  assert.ok(trained.length >= 4 && projections.length >= 4);
  const tape = new Tape(gpu, new Set([...trained, ...(unfold ? projections : [])].map((k) => weights.get(k)!)));
  tape.noGrad(sample, context);
  // The sample is the regression target: any fixed tensor of the output's shape does.
  const r = await step(
    gpu,
    tape,
    () => unetForward(gpu, cfg, weights, sample, timesteps, context, tape),
    (y) => mseLossBackward(gpu, y, sample),
    [...trained.map((k): [string, Tensor] => [k, weights.get(k)!])],
  );
  gpu.free(...weights.values(), sample, timesteps, context);
  return r;
}

void describe('Tiny UNets with the projections folded vs unfolded', () => {
  for (const [name, dtype] of [
    ['unet_sd1', 'f32'],
    ['unet_sd2', 'f16'],
  ] as const)
    void it(`${name} (${name === 'unet_sd1' ? '1x1 conv' : 'linear'} projections) [${dtype}]: no transpose, the same output and gradients`, async () => {
      const gpu = await testGpu();
      const unfolded = await unetRun(gpu, name, dtype, true);
      const folded = await unetRun(gpu, name, dtype, false);
      for (const [k, v] of unfolded.bytes) assert.deepEqual(folded.bytes.get(k), v, `${k} differs from the unfolded UNet's`);
      const transformers = [...load(name).tensors.keys()].filter((k) => k.endsWith('proj_in.weight')).length;
      // Unfolded: 2 transposes per transformer forward and 2 backward, but the first transformer's proj_in input (from
      // frozen layers over the constant sample) needs no gradient: SD 2.x's linear proj_in then needs no transposed
      // dy either, SD 1.x's trained 1x1 conv still does (for its dW).
      assert.equal(unfolded.entries.get('transpose2d'), 4 * transformers - (name === 'unet_sd1' ? 0 : 1));
      assert.equal(folded.entries.get('transpose2d') ?? 0, 0, 'folded: no transpose');
    });
});
