// requires_grad pruning on the tape (nn/ops.ts): in a LoRA run (UNet adapters trainable, base frozen, the
// sample and text embeddings needing no gradient) the ops skip every gradient that reaches no trainable
// tensor: conv_in's and the first ResNet's input gradients, the time-embedding MLP, the k/v branches into
// the context, and the parameter gradients of frozen norms. The adapters' gradients must be bit-identical
// to the unpruned tape's (Tape { prune: false }: every non-weight tensor gets its gradient and the add
// backward copies dy for its second operand, as before), in f32 and f16, with and without activation checkpointing; and the dispatch count must fall by what the
// skipped kernels account for.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import type { Gpu } from '../../src/gpu/device.ts';
import type { Tensor } from '../../src/gpu/tensor.ts';
import { readSafetensors } from '../../src/io/safetensors.ts';
import { allocateWeights } from '../../src/models/load.ts';
import { Tape } from '../../src/nn/ops.ts';
import { unetConfigFromJson, unetForward } from '../../src/nn/unet.ts';
import { mseLossBackward } from '../../src/ops/reduce.ts';
import { FIXTURES, recordDispatches, testGpu } from '../helpers.ts';

const load = (n: string) => readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'modules', `${n}.safetensors`))));
const base = load('unet_sd1');
const lora = load('unet_sd1_lora');
const cfg = unetConfigFromJson(JSON.parse(base.metadata.config));
const inputs = ['sample', 'timestep', 'encoder_hidden_states', 'out'];
const adapterNames = [...lora.tensors.keys()].filter((k) => k.includes('.lora_') && !k.startsWith('grad.'));

interface Run {
  grads: Map<string, Uint8Array>;
  perEntry: Map<string, number>;
  dispatches: number;
}

/** One LoRA forward + backward on the tiny UNet; the adapters' gradients as raw bytes, dispatches by kernel entry. */
async function loraStep(gpu: Gpu, dtype: 'f16' | 'f32', prune: boolean, checkpointing: boolean, grouped = false): Promise<Run & { out: Uint8Array }> {
  const weights = new Map<string, Tensor>();
  const shapes = [...base.tensors].filter(([k]) => !inputs.includes(k)).map(([k, t]) => [k, t.shape] as const);
  // grouped: the loader's layout (every time_emb_proj weight end to end in one allocation, and every bias)
  if (grouped) for (const [k, t] of allocateWeights(gpu, shapes, dtype)) weights.set(k, t);
  for (const [k, t] of base.tensors)
    if (!inputs.includes(k)) {
      if (grouped) gpu.write(weights.get(k)!, t.data);
      else weights.set(k, gpu.upload(t.data, t.shape, dtype, 'weights', k));
    }
  for (const k of adapterNames) weights.set(k, gpu.upload(lora.tensors.get(k)!.data, lora.tensors.get(k)!.shape, dtype, 'weights', k));
  const g = (k: string) => base.tensors.get(k)!;
  const tape = new Tape(gpu, new Set(adapterNames.map((k) => weights.get(k)!)), { prune });
  const sample = gpu.upload(g('sample').data, g('sample').shape, dtype);
  const context = gpu.upload(g('encoder_hidden_states').data, g('encoder_hidden_states').shape, dtype);
  const timesteps = gpu.upload(g('timestep').data, [2], 'f32');
  // The trainer's declaration: its inputs need no gradient (the unpruned tape ignores it).
  tape.noGrad(sample, context);
  const target = gpu.upload(lora.tensors.get('target')!.data, lora.tensors.get('target')!.shape, dtype);
  const before = gpu.stats.dispatches;
  let out: Tensor | null = null;
  const seen = recordDispatches(gpu, () => {
    out = unetForward(gpu, cfg, weights, sample, timesteps, context, tape, Number(lora.metadata.lora_scale), checkpointing);
  });
  const y = out!;
  const outBytes = new Uint8Array(await gpu.readBytes(y.buffer, y.byteOffset, y.byteSize));
  seen.push(...recordDispatches(gpu, () => tape.backward(y, mseLossBackward(gpu, y, target))));
  const dispatches = gpu.stats.dispatches - before;
  const perEntry = new Map<string, number>();
  for (const { entry } of seen) perEntry.set(entry, (perEntry.get(entry) ?? 0) + 1);
  const grads = new Map<string, Uint8Array>();
  for (const k of adapterNames) {
    const gt = tape.take(weights.get(k)!);
    assert.ok(gt, `no gradient reached ${k}`);
    grads.set(k, new Uint8Array(await gpu.readBytes(gt.buffer, gt.byteOffset, gt.byteSize)));
    gpu.free(gt);
  }
  tape.dropGrads();
  gpu.free(...weights.values(), sample, context, timesteps, target);
  return { grads, perEntry, dispatches, out: outBytes };
}

void describe('requires_grad pruning (tiny UNet, LoRA)', () => {
  for (const dtype of ['f32', 'f16'] as const)
    for (const checkpointing of [false, true])
      void it(`adapter gradients bit-identical to the unpruned tape, fewer dispatches [${dtype}${checkpointing ? ', checkpointing' : ''}]`, async () => {
        const gpu = await testGpu();
        const full = await loraStep(gpu, dtype, false, checkpointing);
        const pruned = await loraStep(gpu, dtype, true, checkpointing);
        for (const k of adapterNames) assert.deepEqual(pruned.grads.get(k), full.grads.get(k), `${k}: pruned gradient differs from the unpruned one`);
        const saved = (e: string) => (full.perEntry.get(e) ?? 0) - (pruned.perEntry.get(e) ?? 0);
        // Every norm is frozen: the unpruned tape ran one parameter-gradient dispatch per norm layer (one binding
        // chunk each at these sizes), the pruned one none.
        const norms = [...base.tensors.keys()].filter((k) => /norm[^.]*\.weight$/.test(k)).length;
        assert.equal(full.perEntry.get('norm_bwd_params'), norms, 'unpruned: one norm parameter gradient per norm');
        assert.equal(pruned.perEntry.get('norm_bwd_params') ?? 0, 0, 'pruned: frozen norms get no parameter gradient');
        // Each ResNet's frozen time_emb_proj output gets no gradient: no plane sums (addChannel's dt).
        const resnets = [...base.tensors.keys()].filter((k) => k.endsWith('time_emb_proj.weight')).length;
        assert.equal(saved('sum_planes'), resnets, 'one plane sum per ResNet skipped');
        assert.equal(pruned.perEntry.get('sum_planes') ?? 0, 0);
        // The input side, counted from the tiny UNet's layout (down_blocks.0: ResNet then transformer):
        //   SiLU backward: the time MLP's two (each ResNet's SiLUs run inside its GroupNorm + SiLU kernels);
        //   norm dx: the first ResNet's norm1/norm2, the first transformer's GroupNorm and its LayerNorm norm1
        //     (its input is proj_in's output, still frozen);
        //   add copies (scale by 1): none left on the pruned tape (an operand that needs no gradient gets none, two
        //     that do share dy): one per add, i.e. per adapted projection, 4 residuals per transformer, 1 per ResNet;
        //   split: conv_in's skip into the last up block's concat.
        assert.equal(saved('act_bwd4'), 2, 'SiLU backward skipped: time MLP 2');
        assert.equal(saved('norm_bwd_input'), 4, 'norm dx skipped: first ResNet 2 + first transformer 2');
        const transformers = [...base.tensors.keys()].filter((k) => k.endsWith('transformer_blocks.0.norm1.weight')).length;
        const adds = adapterNames.length / 2 + 4 * transformers + resnets;
        assert.equal(saved('scale4'), adds, 'every add copy skipped');
        assert.equal(saved('split_channels'), 1, "conv_in's skip gradient skipped");
        const counted = norms + resnets + 2 + 4 + adds + 1;
        // The rest (GEMMs of conv_in, the first ResNet, the time MLP, time_emb_proj and the k/v dx into the
        // context, and the sums that gathered them) comes on top.
        assert.ok(full.dispatches - pruned.dispatches > counted, `${full.dispatches} - ${pruned.dispatches} dispatches: at least ${counted} fewer`);
        assert.ok(saved('matmul') >= 8, `time_emb_proj dx GEMMs alone are 8 (saved ${saved('matmul')})`);
      });
});

void describe('time_emb_proj merged into one GEMM (tiny UNet, LoRA)', () => {
  for (const dtype of ['f32', 'f16'] as const)
    for (const checkpointing of [false, true])
      void it(`output and adapter gradients bit-identical to per-layer projections, one GEMM per ResNet fewer [${dtype}${checkpointing ? ', checkpointing' : ''}]`, async () => {
        const gpu = await testGpu();
        const separate = await loraStep(gpu, dtype, true, checkpointing);
        const merged = await loraStep(gpu, dtype, true, checkpointing, true);
        // Bit-identical: each projection element is the same K-long dot product plus bias in the merged GEMM (only
        // the number of output columns changes), and addChannel reads the same value at its column.
        assert.deepEqual(merged.out, separate.out, 'UNet output differs');
        for (const k of adapterNames) assert.deepEqual(merged.grads.get(k), separate.grads.get(k), `${k}: gradient differs`);
        const resnets = [...base.tensors.keys()].filter((k) => k.endsWith('time_emb_proj.weight')).length;
        assert.ok(resnets >= 2);
        // The ResNets' projections: one GEMM for all instead of one each. Checkpointing re-runs a ResNet's forward
        // in the backward, and with it, unmerged, its projection: one more saved per ResNet, but the first one's,
        // whose output (from the constant sample through frozen layers) needs no gradient and is not re-run.
        const saved = (separate.perEntry.get('matmul') ?? 0) - (merged.perEntry.get('matmul') ?? 0);
        assert.equal(saved, checkpointing ? 2 * resnets - 2 : resnets - 1, 'GEMMs saved');
        // Nothing else changes (the poison fills of the projections' outputs aside: one tensor instead of one each)
        const others = (r: Run) => [...r.perEntry].filter(([e]) => e !== 'matmul' && e !== 'fill').map(([e, n]) => `${e} ${n}`);
        assert.deepEqual(others(merged), others(separate), 'other dispatches');
      });
});
