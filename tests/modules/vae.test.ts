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
      for (const [k, t] of tensors) if (/^(encoder|decoder|quant_conv|post_quant_conv)\./.test(k)) weights.set(k, gpu.upload(t.data, t.shape, dtype, 'weights', k));
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
