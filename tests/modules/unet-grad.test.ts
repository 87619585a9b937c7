// Every UNet parameter gradient of loss = mean((unet(sample, t, context) - target)^2) against PyTorch
// autograd (float64) for the tiny SD1-style and SD2-style UNets. Tolerance per tensor, scaled by its
// largest golden value g: f32 |d| <= 1e-4 g + 1e-4 |e| (a few hundred f32 ops deep), f16 1e-2 g + 1e-2 |e|
// (f16 activations and gradients between ops).
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { readSafetensors } from '../../src/io/safetensors.ts';
import { Tape } from '../../src/nn/ops.ts';
import { unetConfigFromJson, unetForward } from '../../src/nn/unet.ts';
import { mseLoss, mseLossBackward } from '../../src/ops/reduce.ts';
import { compare, type Check } from '../../src/selftest/check.ts';
import { assertChecks, FIXTURES, testGpu } from '../helpers.ts';

const load = (n: string) => readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'modules', `${n}.safetensors`))));

describe('UNet parameter gradients (tiny) vs PyTorch', () => {
  for (const name of ['unet_sd1', 'unet_sd2'])
    for (const dtype of ['f32', 'f16'] as const)
      for (const checkpointing of name === 'unet_sd1' ? [false, true] : [false])
        it(`${name} [${dtype}]${checkpointing ? ' with activation checkpointing' : ''}`, async () => {
          const gpu = await testGpu();
          const { tensors, metadata } = load(name);
          const golden = load(`${name}_grads`).tensors;
          const cfg = unetConfigFromJson(JSON.parse(metadata.config));
          const inputs = new Set(['sample', 'timestep', 'encoder_hidden_states', 'out']);
          const weights = new Map();
          for (const [k, t] of tensors) if (!inputs.has(k)) weights.set(k, gpu.upload(t.data, t.shape, dtype, 'weights', k));
          const g = (k: string) => tensors.get(k)!;
          const inSample = gpu.upload(g('sample').data, g('sample').shape, dtype);
          const inT = gpu.upload(g('timestep').data, [2], 'f32');
          const inCtx = gpu.upload(g('encoder_hidden_states').data, g('encoder_hidden_states').shape, dtype);
          const target = gpu.upload(golden.get('target')!.data, golden.get('target')!.shape, dtype);
          // With checkpointing, the plain backward's gradients first: the re-run segments must give their bits.
          const plain = new Map<string, Uint8Array>();
          if (checkpointing) {
            const tape = new Tape(gpu);
            const out = unetForward(gpu, cfg, weights, inSample, inT, inCtx, tape, 1, false);
            tape.backward(out, mseLossBackward(gpu, out, target));
            for (const [wname, wt] of weights) {
              const grad = tape.grads.get(wt)!;
              plain.set(wname, new Uint8Array(await gpu.readBytes(grad.buffer, grad.byteOffset, grad.byteSize)));
            }
            tape.dropGrads();
          }
          const before = gpu.allocator.report().current;
          const liveBefore = new Set(gpu.allocator.liveAllocations());
          const tape = new Tape(gpu);
          const out = unetForward(gpu, cfg, weights, inSample, inT, inCtx, tape, 1, checkpointing);
          const lossT = mseLoss(gpu, out, target);
          const loss = await gpu.read(lossT);
          gpu.free(lossT);
          tape.backward(out, mseLossBackward(gpu, out, target));
          if (checkpointing) {
            // Bit for bit, not within a tolerance: a segment input that already holds a gradient (a down block's
            // output, from the up block's skip concat) must get the segment's contributions in the plain order.
            const differ: string[] = [];
            for (const [wname, wt] of weights) {
              const grad = tape.grads.get(wt)!;
              const got = new Uint8Array(await gpu.readBytes(grad.buffer, grad.byteOffset, grad.byteSize));
              if (!Buffer.from(got).equals(Buffer.from(plain.get(wname)!))) differ.push(wname);
            }
            assert.deepEqual(differ, [], `gradients that differ from the plain backward's bits: ${differ.length} of ${weights.size}`);
          }
          const checks: Check[] = [compare('loss', loss, golden.get('loss')!.data, dtype === 'f32' ? { atol: 1e-6, rtol: 1e-4 } : { atol: 1e-3, rtol: 1e-2 })];
          const k = dtype === 'f32' ? 1e-4 : 1e-2;
          let count = 0;
          for (const [wname, wt] of weights) {
            const grad = tape.grads.get(wt);
            assert.ok(grad, `no gradient reached ${wname}`);
            const want = golden.get(`grad.${wname}`)!.data;
            const scale = want.reduce((m, v) => Math.max(m, Math.abs(v)), 0);
            checks.push(compare(`d${wname}`, await gpu.read(grad), want, { atol: k * scale + 1e-12, rtol: k }));
            count++;
          }
          assert.equal(count, [...golden.keys()].filter((x) => x.startsWith('grad.')).length, 'one gradient per parameter');
          assertChecks(checks);
          // Every activation the forward made is freed by the backward: only gradients remain.
          tape.dropGrads();
          await gpu.sync();
          const left = gpu.allocator.liveAllocations().filter((a) => !liveBefore.has(a));
          assert.equal(
            gpu.allocator.report().current,
            before,
            `forward + backward leaves no buffer behind: ${left.map((a) => `${a.label} (${a.bytes})`).join(', ')}`,
          );
        });
});
