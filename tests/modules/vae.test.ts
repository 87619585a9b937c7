// The VAE module (encode to moments, decode latents) against a PyTorch forward of the same tiny
// AutoencoderKL, f32 and f16. Tolerances: f32 2e-4 absolute + 1e-4 relative (about 20 convs and norms
// vs float64), f16 3e-2 + 2e-2 (f16 activations between ops).
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { drawScene, subjectScene, SUBJECT_LOOK, toModelInput } from '../../lab/demo-model/synthetic.ts';
import type { Gpu } from '../../src/gpu/device.ts';
import { SDXL_BASE } from '../../src/models/sdxl.ts';
import { decodeTileSide, encodeTileSide, vaeDecodeImage, vaeEncodeMean } from '../../src/nn/vae-tiled.ts';
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

// A VAE encode whose activations pass one storage binding (SDXL at 1024 px: [128, 1024, 1024] f32 = 512 MiB, where
// SwiftShader binds 128 MiB) is tiled (nn/vae-tiled.ts). Here the shipped demo model's trained VAE (16-64 channels,
// factor 8) encodes a 128 px picture of the held-out subject: 1.07 MB of block-0 activations, refused by a 640 KiB
// binding, which takes 96 px tiles (stride 72: 2 x 2 of them, the second cut to 56 px by the edge).
describe('VAE encode in tiles past one storage binding', () => {
  it('the plain encode is refused; the tiled latent is close to the untiled one (computed under a large binding)', async () => {
    // SDXL base's VAE at 1024 px under 128 MiB: 480 px tiles (block 0's [128, 481, 481] f32 fits, 512 does not).
    assert.equal(encodeTileSide(SDXL_BASE.vae, 1024, 1024, 'f32', 128 * 2 ** 20), 480);
    assert.equal(encodeTileSide(SDXL_BASE.vae, 1024, 1024, 'f32', 2 ** 31), null, 'whole where it fits');
    const dir = join(FIXTURES, '..', '..', 'public', 'demo-model', 'vae');
    const cfg = vaeConfigFromJson(JSON.parse(readFileSync(join(dir, 'config.json'), 'utf8')));
    const { tensors } = readSafetensors(new Uint8Array(readFileSync(join(dir, 'diffusion_pytorch_model.safetensors'))));
    const R = 128;
    const image = toModelInput(drawScene(subjectScene(SUBJECT_LOOK, 1, 0), R), R);
    const size = { width: R, height: R };
    const small = await testGpu({ bindingLimit: 640 * 1024 });
    const upload = (gpu: Gpu) => new Map([...tensors].map(([k, t]) => [k, gpu.upload(t.data, t.shape, 'f32', 'weights', k)] as const));
    assert.equal(encodeTileSide(cfg, R, R, 'f32', small.maxBinding), 96);
    assert.equal(encodeTileSide(cfg, 64, 64, 'f32', small.maxBinding), null, 'a 64 px image is encoded whole');
    const ws = upload(small);
    assert.throws(() => vaeEncode(small, cfg, ws, small.upload(image, [1, 3, R, R], 'f32')), /exceeds a storage binding of 655360 bytes/);
    const tiled = await vaeEncodeMean(small, cfg, ws, image, size, 'f32');
    small.destroy();
    const gpu = await testGpu();
    const w = upload(gpu);
    const whole = await vaeEncodeMean(gpu, cfg, w, image, size, 'f32');
    gpu.free(...w.values());
    const rel = (a: Float32Array, b: Float32Array) => Math.sqrt(a.reduce((s, v, i) => s + (v - b[i]) ** 2, 0) / b.reduce((s, v) => s + v * v, 0));
    // Tolerance: each tile normalises with its own GroupNorm statistics and attends within itself (diffusers'
    // tiled_encode does the same), so the latent moves: 8.4 % relative RMS measured here (17 % with 64 px tiles,
    // 4.8 % for 192 px tiles of a 256 px picture). 12 % bounds it: tiles without the blend are 14.4 % away, the
    // latent shifted by one pixel (what a tile placed one latent pixel off approaches) 22.5 %.
    const lw = R / 8;
    const shifted = whole.map((_, i) => whole[i % lw === 0 ? i : i - 1]);
    const err = rel(tiled, whole);
    assert.ok(err < 0.12, `tiled vs whole: relative RMS ${err.toFixed(4)} (at most 0.12)`);
    assert.ok(rel(shifted, whole) > 2 * 0.12 * 0.9, `a one-pixel shift is ${rel(shifted, whole).toFixed(4)} away: the bound tells it apart`);
  });
});

// The decode, tiled the same way (diffusers' tiled_decode): SDXL at 1024 px reads [256, 1024, 1024] f32 (1 GiB) in
// its last up block. Here the demo VAE decodes the 16 x 16 latent of the held-out subject's 128 px picture: its last
// up block reads [32, 128, 128] f32 (2 MiB), refused by a 1.25 MiB binding, which takes 12-latent-pixel (96 px)
// tiles at a stride of 9 (72 px; 2 x 2 tiles, the second cut to 7), blended over 24 px. The stitch is checked exactly
// against the top row's two tiles decoded alone, the result loosely against the untiled decode.
describe('VAE decode in tiles past one storage binding', () => {
  it('the plain decode is refused; the tiled image is the blended tiles, close to the untiled one', async () => {
    // SDXL base's VAE, 128 x 128 latents under 128 MiB: 44-latent-pixel (352 px) tiles ([256, 352, 352] f32 fits).
    assert.equal(decodeTileSide(SDXL_BASE.vae, 128, 128, 'f32', 128 * 2 ** 20), 44);
    assert.equal(decodeTileSide(SDXL_BASE.vae, 128, 128, 'f32', 2 ** 31), null, 'whole where it fits');
    const dir = join(FIXTURES, '..', '..', 'public', 'demo-model', 'vae');
    const cfg = vaeConfigFromJson(JSON.parse(readFileSync(join(dir, 'config.json'), 'utf8')));
    const { tensors } = readSafetensors(new Uint8Array(readFileSync(join(dir, 'diffusion_pytorch_model.safetensors'))));
    const upload = (gpu: Gpu) => new Map([...tensors].map(([k, t]) => [k, gpu.upload(t.data, t.shape, 'f32', 'weights', k)] as const));
    const [R, L] = [128, 16];
    const gpu = await testGpu();
    const w = upload(gpu);
    const latent = await vaeEncodeMean(gpu, cfg, w, toModelInput(drawScene(subjectScene(SUBJECT_LOOK, 1, 0), R), R), { width: R, height: R }, 'f32');
    const decode = (lat: Float32Array, h: number, wd: number) => vaeDecodeImage(gpu, cfg, w, lat, { width: wd, height: h }, 'f32');
    const whole = await decode(latent, L, L);
    // The top row's two tiles decoded alone: latent rows 0-11, columns 0-11 and 9-15.
    const cut = (x0: number, tw: number) => latent.filter((_, i) => Math.floor((i % (L * L)) / L) < 12 && i % L >= x0 && i % L < x0 + tw);
    const [t0, t1] = [await decode(cut(0, 12), 12, 12), await decode(cut(9, 7), 12, 7)];
    gpu.free(...w.values());
    const small = await testGpu({ bindingLimit: 1280 * 1024 });
    assert.equal(decodeTileSide(cfg, L, L, 'f32', small.maxBinding), 12);
    assert.equal(decodeTileSide(cfg, 8, 8, 'f32', small.maxBinding), null, '8 x 8 latents are decoded whole');
    const ws = upload(small);
    assert.throws(() => vaeDecode(small, cfg, ws, small.upload(latent, [1, 4, L, L], 'f32')), /exceeds a storage binding of 1310720 bytes/);
    const tiled = await vaeDecodeImage(small, cfg, ws, latent, { width: L, height: L }, 'f32');
    small.destroy();
    // The top 72 rows (no tile above them), from diffusers' formula: columns 0-71 from tile 0, 72-95 ramp linearly
    // from tile 0 to tile 1 (weight (x - 72) / 24 on tile 1), 96-127 from tile 1. Largest difference.
    const stitchError = (img: Float32Array) => {
      let most = 0;
      for (let c = 0; c < 3; c++)
        for (let y = 0; y < 72; y++)
          for (let x = 0; x < R; x++) {
            const a = t0[(c * 96 + y) * 96 + Math.min(x, 95)];
            const b = t1[(c * 96 + y) * 56 + Math.max(x - 72, 0)];
            const e = x < 72 ? a : x < 96 ? a * (1 - (x - 72) / 24) + b * ((x - 72) / 24) : b;
            most = Math.max(most, Math.abs(img[(c * R + y) * R + x] - e));
          }
      return most;
    };
    const rel = (a: Float32Array, b: Float32Array) => Math.sqrt(a.reduce((s, v, i) => s + (v - b[i]) ** 2, 0) / b.reduce((s, v) => s + v * v, 0));
    // Wrong stitches: the tiles cropped without the blend (tile 1 from column 72 on), and the tiled image shifted one
    // latent pixel (8 px) to the right.
    const unblended = tiled.map((v, i) =>
      Math.floor(i / R) % R < 72 && i % R >= 72 ? t1[Math.floor(i / (R * R)) * 96 * 56 + (Math.floor(i / R) % R) * 56 + (i % R) - 72] : v,
    );
    const shifted = tiled.map((_, i) => tiled[i % R < 8 ? i : i - 8]);
    // Tolerance 1e-5: the tiles are the same f32 decodes on another device (a smaller binding may pick another conv
    // lowering, summing in another order); measured 3e-8. Without the blend the seam is 0.40 off, a tile placed one
    // latent pixel off 0.83 (image values span about [-1, 1]).
    assert.ok(stitchError(tiled) < 1e-5, `tiled vs the blended tiles: ${stitchError(tiled)} (at most 1e-5)`);
    assert.ok(stitchError(unblended) > 1000 * 1e-5, `no blend: ${stitchError(unblended)} off, told apart`);
    assert.ok(stitchError(shifted) > 1000 * 1e-5, `shifted: ${stitchError(shifted)} off, told apart`);
    // Against the untiled image: each tile normalises with its own GroupNorm statistics and attends within itself
    // (diffusers' tiled_decode does the same), so the image moves: 9.8 % relative RMS measured here; 12 % bounds it.
    const err = rel(tiled, whole);
    assert.ok(err < 0.12, `tiled vs whole: relative RMS ${err.toFixed(4)} (at most 0.12)`);
  });
});
