// LoRA on the UNet's attention projections (PEFT layout, rank 4, alpha 8): the forward with adapters and
// every adapter gradient (base weights frozen) against PyTorch autograd, f32 and f16. Tolerances as the
// UNet tests: output f32 5e-4 + 2e-4, f16 5e-2 + 2e-2; gradients f32 1e-4 / f16 1e-2 of each tensor's scale.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { readSafetensors } from '../../src/io/safetensors.ts';
import { Tape } from '../../src/nn/ops.ts';
import { unetConfigFromJson, unetForward } from '../../src/nn/unet.ts';
import { mseLossBackward } from '../../src/ops/reduce.ts';
import { compare, type Check } from '../../src/selftest/check.ts';
import { assertChecks, FIXTURES, testGpu } from '../helpers.ts';

const load = (n: string) => readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'modules', `${n}.safetensors`))));

describe('UNet LoRA (tiny) vs PyTorch', () => {
  for (const dtype of ['f32', 'f16'] as const)
    for (const frozen of [false, true])
      it(`forward with adapters and adapter gradients [${dtype}]${frozen ? ', base frozen, checkpointing' : ''}`, async () => {
        const gpu = await testGpu();
        const base = load('unet_sd1');
        const lora = load('unet_sd1_lora');
        const cfg = unetConfigFromJson(JSON.parse(base.metadata.config));
        const scale = Number(lora.metadata.lora_scale);
        const weights = new Map();
        for (const [k, t] of base.tensors)
          if (!['sample', 'timestep', 'encoder_hidden_states', 'out'].includes(k)) weights.set(k, gpu.upload(t.data, t.shape, dtype, 'weights', k));
        const adapters = [...lora.tensors].filter(([k]) => k.includes('.lora_') && !k.startsWith('grad.'));
        for (const [k, t] of adapters) weights.set(k, gpu.upload(t.data, t.shape, dtype, 'weights', k));
        const g = (k: string) => base.tensors.get(k)!;
        // Frozen: only the adapters are trainable, so no base-weight gradient is formed at all.
        const trainable = frozen ? new Set(adapters.map(([k]) => weights.get(k))) : null;
        const tape = new Tape(gpu, trainable);
        const out = unetForward(
          gpu,
          cfg,
          weights,
          gpu.upload(g('sample').data, g('sample').shape, dtype),
          gpu.upload(g('timestep').data, [2], 'f32'),
          gpu.upload(g('encoder_hidden_states').data, g('encoder_hidden_states').shape, dtype),
          tape,
          scale,
          frozen,
        );
        const target = gpu.upload(lora.tensors.get('target')!.data, lora.tensors.get('target')!.shape, dtype);
        const outVals = await gpu.read(out);
        tape.backward(out, mseLossBackward(gpu, out, target));
        const checks: Check[] = [
          compare('out with LoRA', outVals, lora.tensors.get('out')!.data, dtype === 'f32' ? { atol: 5e-4, rtol: 2e-4 } : { atol: 5e-2, rtol: 2e-2 }),
          compare('the adapters change the output', [outVals.some((v, i) => Math.abs(v - g('out').data[i]) > 1e-3) ? 1 : 0], [1], { atol: 0, rtol: 0 }),
        ];
        const k = dtype === 'f32' ? 1e-4 : 1e-2;
        for (const [name] of adapters) {
          const grad = tape.grads.get(weights.get(name));
          assert.ok(grad, `no gradient reached ${name}`);
          const want = lora.tensors.get(`grad.${name}`)!.data;
          const s = want.reduce((m, v) => Math.max(m, Math.abs(v)), 0);
          checks.push(compare(`d${name}`, await gpu.read(grad), want, { atol: k * s + 1e-12, rtol: k }));
        }
        assert.equal(adapters.length, 2 * 4 * 2 * 4, '2 tensors x 4 projections x 2 attentions x 4 transformers');
        if (frozen) for (const [k, t] of weights) if (!k.includes('.lora_')) assert.equal(tape.grads.get(t), undefined, `frozen ${k} got a gradient`);
        assertChecks(checks);
      });
});
