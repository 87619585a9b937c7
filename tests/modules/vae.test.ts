// The VAE module (encode to moments, decode latents) against a PyTorch forward of the same tiny
// AutoencoderKL, f32 and f16. Tolerances: f32 2e-4 absolute + 1e-4 relative (about 20 convs and norms
// vs float64), f16 3e-2 + 2e-2 (f16 activations between ops).
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { readSafetensors } from '../../src/io/safetensors.ts';
import { vaeConfigFromJson, vaeDecode, vaeEncode } from '../../src/nn/vae.ts';
import { compare } from '../../src/selftest/check.ts';
import { assertChecks, FIXTURES, testGpu } from '../helpers.ts';

describe('VAE (tiny) vs PyTorch', () => {
  for (const dtype of ['f32', 'f16'] as const)
    it(`encode and decode [${dtype}]`, async () => {
      const gpu = await testGpu();
      const { tensors, metadata } = readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'modules', 'vae.safetensors'))));
      const cfg = vaeConfigFromJson(JSON.parse(metadata.config));
      const weights = new Map();
      for (const [k, t] of tensors)
        if (/^(encoder|decoder|quant_conv|post_quant_conv)\./.test(k)) weights.set(k, gpu.upload(t.data, t.shape, dtype, 'weights', k));
      const g = (k: string) => tensors.get(k)!;
      const moments = vaeEncode(gpu, cfg, weights, gpu.upload(g('image').data, g('image').shape, dtype));
      const image = vaeDecode(gpu, cfg, weights, gpu.upload(g('latents').data, g('latents').shape, dtype));
      const tol = dtype === 'f32' ? { atol: 2e-4, rtol: 1e-4 } : { atol: 3e-2, rtol: 2e-2 };
      assertChecks([
        compare('moments (mean, logvar)', await gpu.read(moments), g('moments').data, tol),
        compare('decoded image', await gpu.read(image), g('decoded').data, tol),
      ]);
      gpu.free(moments, image, ...weights.values());
    });
});

describe('VAE backward (tiny) vs PyTorch autograd', () => {
  for (const dtype of ['f32', 'f16'] as const)
    it(`every parameter gradient of sum(encode * r1) + sum(decode * r2) [${dtype}]`, async () => {
      const { Tape } = await import('../../src/nn/ops.ts');
      const gpu = await testGpu();
      const { tensors, metadata } = readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'modules', 'vae.safetensors'))));
      const cfg = vaeConfigFromJson(JSON.parse(metadata.config));
      const weights = new Map();
      for (const [k, t] of tensors)
        if (/^(encoder|decoder|quant_conv|post_quant_conv)\./.test(k)) weights.set(k, gpu.upload(t.data, t.shape, dtype, 'weights', k));
      const g = (k: string) => tensors.get(k)!;
      const up = (k: string) => gpu.upload(g(k).data, g(k).shape, dtype);
      const tape = new Tape(gpu);
      const moments = vaeEncode(gpu, cfg, weights, up('image'), tape);
      const image = vaeDecode(gpu, cfg, weights, up('latents'), tape);
      tape.grads.set(moments, up('r_enc'));
      tape.backward(image, up('r_dec'));
      // Per tensor, scaled by its largest golden value s: f32 1e-4 s + 1e-4 |e|, f16 1e-2 s + 1e-2 |e|, with s
      // floored at a tenth of the largest gradient (tensors whose true gradient is ~0 keep only rounding noise).
      const k = dtype === 'f32' ? 1e-4 : 1e-2;
      const maxOf = (d: Float32Array) => d.reduce((m, v) => Math.max(m, Math.abs(v)), 0);
      const grads = [...tensors].filter(([n]) => n.startsWith('grad.'));
      const globalMax = Math.max(...grads.map(([, t]) => maxOf(t.data)));
      const checks = [];
      for (const [n, t] of grads) {
        const got = tape.grads.get(weights.get(n.slice(5)));
        if (!got) throw new Error(`no gradient reached ${n.slice(5)}`);
        const scale = Math.max(maxOf(t.data), 0.1 * globalMax);
        checks.push(compare(n, await gpu.read(got), t.data, { atol: k * scale + 1e-12, rtol: k }));
      }
      assertChecks(checks);
    });
});
