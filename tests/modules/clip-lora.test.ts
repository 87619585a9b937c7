// LoRA on the CLIP text encoder's self-attention projections (PEFT layout, rank 4, alpha 8, random
// non-zero B): the forward with adapters and every adapter gradient of mean((out - target)^2), base
// weights frozen, against PyTorch autograd (gen_clip.py's write_lora), f32 and f16, with a tape that
// differentiates everything and with one whose trainable set is the adapters (then no base weight gets a
// gradient); no buffer outlives forward + backward or an inference forward. Tolerances as the UNet LoRA
// test: output f32 5e-4 + 2e-4, f16 5e-2 + 2e-2; gradients f32 1e-4 / f16 1e-2 of each tensor's largest
// golden value. Then PEFT's zero-B start (the adapted encoder is the plain one, bit for bit, and only B
// gets a gradient), and loraTargets / initLora on the tiny and SD-sized parameter names.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import type { Tensor } from '../../src/gpu/tensor.ts';
import { readSafetensors } from '../../src/io/safetensors.ts';
import { openClipToDiffusers } from '../../src/models/keymap.ts';
import { clipParams, SD15, unetParams } from '../../src/models/shapes.ts';
import { clipConfigFromJson, clipTextForward } from '../../src/nn/clip.ts';
import { initLora, loraShapes, loraTargets, type UniformRng } from '../../src/nn/lora.ts';
import { Tape } from '../../src/nn/ops.ts';
import { unetConfigFromJson } from '../../src/nn/unet.ts';
import { mseLossBackward } from '../../src/ops/reduce.ts';
import { compare, describeCheck, type Check } from '../../src/selftest/check.ts';
import { assertChecks, FIXTURES, testGpu } from '../helpers.ts';

const load = (n: string) => readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'modules', `${n}.safetensors`))));
const maxAbs = (d: ArrayLike<number>) => {
  let m = 0;
  for (let i = 0; i < d.length; i++) m = Math.max(m, Math.abs(d[i]));
  return m;
};

/** A test-only seeded uniform source (mulberry32), standing in for the trainer's RNG. */
function testRng(seed: number): UniformRng & { draws: number } {
  let st = seed >>> 0;
  return {
    draws: 0,
    next() {
      this.draws++;
      st = (st + 0x6d2b79f5) >>> 0;
      let t = st;
      t = Math.imul(t ^ (t >>> 15), t | 1);
      t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
      return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
    },
  };
}

describe('CLIP text-encoder LoRA (tiny) vs PyTorch', () => {
  for (const dtype of ['f32', 'f16'] as const)
    for (const frozen of [false, true])
      it(`forward with adapters and adapter gradients [${dtype}]${frozen ? ', base frozen (only the adapters trainable)' : ''}`, async (t) => {
        const gpu = await testGpu();
        const base = load('clip_sd1');
        const lora = load('clip_sd1_lora');
        const cfg = clipConfigFromJson(JSON.parse(lora.metadata.config));
        const scale = Number(lora.metadata.lora_scale);
        assert.equal(scale, Number(lora.metadata.alpha) / Number(lora.metadata.rank));
        const ids = lora.tensors.get('input_ids')!;
        assert.deepEqual([...ids.data], [...base.tensors.get('input_ids')!.data], 'the LoRA golden uses clip_sd1 input_ids');

        const weights = new Map<string, Tensor>();
        const baseNames: string[] = [];
        for (const [k, t] of base.tensors)
          if (k.startsWith('text_model.')) {
            weights.set(k, gpu.upload(t.data, t.shape, dtype, 'weights', k));
            baseNames.push(k);
          }
        const adapters = [...lora.tensors].filter(([k]) => k.includes('.lora_') && !k.startsWith('grad.'));
        for (const [k, t] of adapters) weights.set(k, gpu.upload(t.data, t.shape, dtype, 'weights', k));
        // Every adapter sits on a loraTargets layer, and every target has both A and B.
        const targets = loraTargets('text_encoder', baseNames);
        assert.deepEqual(adapters.map(([k]) => k).sort(), targets.flatMap((l) => [`${l}.lora_A.weight`, `${l}.lora_B.weight`]).sort());
        assert.equal(adapters.length, 2 * 4 * cfg.layers, '2 tensors x 4 projections x layers');

        const tt = lora.tensors.get('target')!;
        const target = gpu.upload(tt.data, tt.shape, dtype);
        const before = gpu.allocator.report().current;
        // Frozen: the tape's trainable set is the adapters, so the base weights' dW/db are never formed
        // (dx still flows through them down to the earlier layers' adapters).
        const trainable = frozen ? new Set(adapters.map(([k]) => weights.get(k)!)) : null;
        const tape = new Tape(gpu, trainable);
        const out = clipTextForward(gpu, cfg, weights, ids.data, ids.shape[0], tape, scale);
        const outVals = await gpu.read(out);
        // d mean((out - t)^2) / d out = 2 (out - t) / N, then the recorded backward down to the adapters.
        tape.backward(out, mseLossBackward(gpu, out, target));

        const plain = base.tensors.get('last_hidden_state')!.data;
        const checks: Check[] = [
          compare('out with LoRA', outVals, lora.tensors.get('out')!.data, dtype === 'f32' ? { atol: 5e-4, rtol: 2e-4 } : { atol: 5e-2, rtol: 2e-2 }),
          compare('the adapters change the output', [outVals.some((v, i) => Math.abs(v - plain[i]) > 1e-2) ? 1 : 0], [1], { atol: 0, rtol: 0 }),
        ];
        // Every adapter's gradient must have arrived and match autograd's (requires_grad on A and B only).
        const k = dtype === 'f32' ? 1e-4 : 1e-2;
        for (const [name] of adapters) {
          const grad = tape.grads.get(weights.get(name)!);
          assert.ok(grad, `no gradient reached ${name}`);
          const want = lora.tensors.get(`grad.${name}`)!.data;
          const s = maxAbs(want);
          assert.ok(s > 0, `golden gradient of ${name} is non-trivial`);
          checks.push(compare(`d${name}`, await gpu.read(grad), want, { atol: k * s + 1e-12, rtol: k }));
        }
        // Gradients reach only the adapters when the base is frozen; unfrozen, the projections and norms get
        // theirs too (a trainer would not read them). The embedding tables never get one.
        const baseWithGrad = baseNames.filter((n) => tape.grads.has(weights.get(n)!));
        if (frozen) assert.deepEqual(baseWithGrad, [], 'frozen base weights got gradients');
        else assert.equal(baseWithGrad.length, baseNames.length - 2, 'every base weight but the two embedding tables');
        assert.ok(!baseWithGrad.some((n) => n.includes('.embeddings.')));
        // Frozen means untouched: forward and backward leave every base weight as uploaded.
        if (dtype === 'f32')
          for (const n of baseNames) checks.push(compare(`${n} unchanged`, await gpu.read(weights.get(n)!), base.tensors.get(n)!.data, { atol: 0, rtol: 0 }));
        for (const c of checks) if (!c.label.endsWith(' unchanged')) t.diagnostic(describeCheck(c));
        assertChecks(checks);
        // The backward frees every activation (the embedding output included): only gradients remain.
        tape.dropGrads();
        await gpu.sync();
        assert.equal(gpu.allocator.report().current, before, 'forward + backward leaves no buffer behind');
        gpu.free(target, ...weights.values());
      });

  it('inference (no tape) with adapters frees every temporary [f32]', async () => {
    const gpu = await testGpu();
    const base = load('clip_sd1');
    const lora = load('clip_sd1_lora');
    const cfg = clipConfigFromJson(JSON.parse(lora.metadata.config));
    const weights = new Map<string, Tensor>();
    for (const [k, t] of [...base.tensors, ...lora.tensors]) if (k.startsWith('text_model.')) weights.set(k, gpu.upload(t.data, t.shape, 'f32', 'weights', k));
    const ids = lora.tensors.get('input_ids')!;
    const before = gpu.allocator.report().current;
    const out = clipTextForward(gpu, cfg, weights, ids.data, ids.shape[0], null, Number(lora.metadata.lora_scale));
    assertChecks([compare('out with LoRA', await gpu.read(out), lora.tensors.get('out')!.data, { atol: 5e-4, rtol: 2e-4 })]);
    gpu.free(out);
    await gpu.sync();
    assert.equal(gpu.allocator.report().current, before, 'only the output outlives the forward');
    gpu.free(...weights.values());
  });
});

describe('CLIP text-encoder LoRA at PEFT init (B = 0)', () => {
  it('output and every base gradient equal the plain encoder bit for bit; dA = 0, dB != 0 [f32]', async () => {
    const gpu = await testGpu();
    const base = load('clip_sd1');
    const cfg = clipConfigFromJson(JSON.parse(base.metadata.config));
    const ids = base.tensors.get('input_ids')!;
    const r = base.tensors.get('r')!;
    const shapes = new Map([...base.tensors].map(([n, t]) => [n, t.shape]));
    const targets = loraTargets('text_encoder', shapes.keys());
    const init = initLora(targets, shapes, 4, testRng(7));
    const lshapes = loraShapes(targets, shapes, 4);

    // One run: loss sum(out * r) (clip.test.ts's), gradients of every text_model weight and adapter.
    const run = async (withLora: boolean) => {
      const weights = new Map<string, Tensor>();
      for (const [k, t] of base.tensors) if (k.startsWith('text_model.')) weights.set(k, gpu.upload(t.data, t.shape, 'f32', 'weights', k));
      if (withLora) for (const [k, d] of init) weights.set(k, gpu.upload(d, lshapes.get(k)!, 'f32', 'weights', k));
      const tape = new Tape(gpu);
      const out = clipTextForward(gpu, cfg, weights, ids.data, ids.shape[0], tape, 2);
      const outVals = await gpu.read(out);
      tape.backward(out, gpu.upload(r.data, r.shape, 'f32'));
      const grads = new Map<string, Float32Array>();
      for (const [k, t] of weights) {
        const g = tape.grads.get(t);
        if (g) grads.set(k, await gpu.read(g));
      }
      tape.dropGrads();
      gpu.free(...weights.values());
      return { outVals, grads };
    };
    const plain = await run(false);
    const adapted = await run(true);
    const exact = { atol: 0, rtol: 0 };
    // y + 2 (x A^T) 0^T = y exactly, and the adapter's share of dx is (dy 0) A = 0 exactly, so nothing moves.
    const checks: Check[] = [compare('out', adapted.outVals, plain.outVals, exact)];
    for (const [k, g] of plain.grads) checks.push(compare(`d${k}`, adapted.grads.get(k)!, g, exact));
    for (const layer of targets) {
      // dA = scale (dy B)^T x = 0 while B = 0; dB = scale dy^T (x A^T) is what the first step moves.
      const dA = adapted.grads.get(`${layer}.lora_A.weight`)!;
      const dB = adapted.grads.get(`${layer}.lora_B.weight`)!;
      checks.push(compare(`d${layer}.lora_A is 0`, dA, new Float32Array(dA.length), exact));
      checks.push(compare(`d${layer}.lora_B is non-zero`, [maxAbs(dB) > 0 ? 1 : 0], [1], exact));
    }
    assertChecks(checks);
  });
});

describe('loraTargets and initLora', () => {
  const tinyUnet = unetParams(unetConfigFromJson(JSON.parse(load('unet_sd1').metadata.config)));
  const tinyClip = clipParams(clipConfigFromJson(JSON.parse(load('clip_sd1').metadata.config)));

  it('targets the attention projections of every transformer block / CLIP layer', () => {
    // Tiny UNet: transformers in down 0, mid, and up 1 (x2) = 4, each 2 attentions x 4 projections.
    const u = loraTargets('unet', tinyUnet.keys());
    assert.equal(u.length, 4 * 2 * 4);
    assert.ok(u.every((n) => /\.transformer_blocks\.0\.attn[12]\.(to_q|to_k|to_v|to_out\.0)$/.test(n)));
    assert.ok(u.includes('mid_block.attentions.0.transformer_blocks.0.attn2.to_out.0'));
    // Tiny CLIP: 2 layers x 4 projections.
    const c = loraTargets('text_encoder', tinyClip.keys());
    assert.deepEqual(
      c.slice(0, 4),
      ['q_proj', 'k_proj', 'v_proj', 'out_proj'].map((n) => `text_model.encoder.layers.0.self_attn.${n}`),
    );
    assert.equal(c.length, 2 * 4);
    // Neither kind picks the other's layers, biases, MLPs, norms, or adapters already present.
    assert.deepEqual(loraTargets('unet', tinyClip.keys()), []);
    assert.deepEqual(loraTargets('text_encoder', tinyUnet.keys()), []);
    const withAdapters = [...tinyClip.keys(), ...loraShapes(c, tinyClip, 4).keys()];
    assert.deepEqual(loraTargets('text_encoder', withAdapters), c);
    // SD 1.5 sizes: 16 transformer blocks x 8 = 128 UNet layers, 12 CLIP layers x 4 = 48.
    assert.equal(loraTargets('unet', unetParams(SD15.unet).keys()).length, 128);
    assert.equal(loraTargets('text_encoder', clipParams(SD15.textEncoder).keys()).length, 48);
  });

  it("SD2's fused OpenCLIP in_proj becomes split q/k/v targets once renamed", () => {
    const names = ['attn.in_proj_weight', 'attn.in_proj_bias', 'attn.out_proj.weight', 'attn.out_proj.bias', 'mlp.c_fc.weight', 'ln_1.weight'].flatMap((n) =>
      [0, 22].flatMap((l) => openClipToDiffusers(`transformer.resblocks.${l}.${n}`)!.names),
    );
    const t = loraTargets('text_encoder', names);
    assert.equal(t.length, 2 * 4);
    assert.deepEqual(
      t.filter((n) => n.includes('layers.22.')).sort(),
      ['k_proj', 'out_proj', 'q_proj', 'v_proj'].map((n) => `text_model.encoder.layers.22.self_attn.${n}`),
    );
  });

  it('PEFT init: A [r, in] ~ U(-1/sqrt(in), 1/sqrt(in)), B [out, r] = 0, deterministic per seed', () => {
    const u = loraTargets('unet', tinyUnet.keys());
    const rank = 4;
    const rng = testRng(123);
    const init = initLora(u, tinyUnet, rank, rng);
    const shapes = loraShapes(u, tinyUnet, rank);
    assert.equal(init.size, 2 * u.length);
    let drawn = 0;
    for (const layer of u) {
      const [o, i] = tinyUnet.get(`${layer}.weight`)!;
      const a = init.get(`${layer}.lora_A.weight`)!;
      const b = init.get(`${layer}.lora_B.weight`)!;
      assert.deepEqual(shapes.get(`${layer}.lora_A.weight`), [rank, i]);
      assert.deepEqual(shapes.get(`${layer}.lora_B.weight`), [o, rank]);
      assert.equal(a.length, rank * i);
      assert.equal(b.length, o * rank);
      assert.ok(
        b.every((v) => v === 0),
        `${layer} B = 0`,
      );
      const bound = Math.fround(1 / Math.sqrt(i));
      assert.ok(
        a.every((v) => Math.abs(v) <= bound),
        `${layer} A within ±1/sqrt(${i})`,
      );
      // A uniform sample fills its range: the extremes of rank*in >= 64 draws come near both ends.
      assert.ok(Math.max(...a) > 0.5 * bound && Math.min(...a) < -0.5 * bound, `${layer} A spans its range`);
      drawn += a.length;
    }
    // A mean over all adapters near 0 (|mean| of n uniform(-1,1)/sqrt(in) draws ~ bound / sqrt(3n)).
    const all = [...init].filter(([k]) => k.endsWith('lora_A.weight')).flatMap(([, a]) => [...a]);
    assert.ok(Math.abs(all.reduce((s, v) => s + v, 0) / all.length) < 0.02);
    assert.equal(rng.draws, drawn, 'one draw per A element, none for B');
    const again = initLora(u, tinyUnet, rank, testRng(123));
    for (const [k, v] of init) assert.deepEqual(again.get(k), v);
    assert.notDeepEqual(initLora(u, tinyUnet, rank, testRng(124)).get(`${u[0]}.lora_A.weight`), init.get(`${u[0]}.lora_A.weight`));
    assert.throws(() => initLora(['mid_block.attentions.0.proj_in'], tinyUnet, rank, testRng(1)), /lora: .*must be a linear weight \[out, in\]/);
    assert.throws(() => initLora(u, tinyUnet, 0, testRng(1)), /rank must be a positive integer/);
  });
});
