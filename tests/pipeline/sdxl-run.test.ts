// An SDXL LoRA run through the one pipeline (pipeline/run.ts TrainingRun -> sdxl-run.ts), as `cli train` and the
// studio's worker drive it, on the tiny SDXL diffusers folder (tests/fixtures/models/make-tiny-sdxl.ts), 16 px:
// a wide photo at its aspect bucket and a square one with a loss mask, a class image (prior preservation), both
// text encoders' adapters; then the cache (both encoders' context, the pooled embedding, each photo's time ids
// as kohya computes them), Try it (SDXL conditioning, the decoder and encoders read back from the source), the
// kohya export read back (every trained tensor under its lora_unet_/lora_te1_/lora_te2_ key, equal to the
// trained master rounded to f16; the SDXL metadata) and a resume from the final checkpoint. A full-mode run is
// refused by name. The same 2-step run on int8 base weights (--base-weights int8) against the f16 base: planned and
// stored in int8, losses and trained up projections close. Kept to one step and no samples or validation (the trainer's tests cover those): every
// pipeline compile costs seconds on lavapipe.
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, describe, it } from 'node:test';
import { encode } from 'fast-png';
import { sdxlKohyaName, SDXL_KOHYA_VERSION } from '../../src/export/lora-sdxl.ts';
import { nodeGpu } from '../../src/gpu/node.ts';
import { decodeImageNode } from '../../src/io/image-node.ts';
import { SafetensorsFile } from '../../src/io/safetensors.ts';
import { BytesSource } from '../../src/io/source.ts';
import { nodeFolder } from '../../src/models/folder-node.ts';
import { tokenizerFilesFrom } from '../../src/models/source.ts';
import { TrainingRun, type OpenedModel, type RunEvent, type RunInput } from '../../src/pipeline/run.ts';
import { sdxlModelSummary } from '../../src/pipeline/sdxl-run.ts';
import { defaultSettings } from '../../src/pipeline/settings.ts';
import { MemoryChunkStore } from '../../src/store/chunkstore.ts';
import { loadTrainData } from '../../src/train/preprocess.ts';
import { roundToF16 } from '../../src/util/half.ts';
import { writeTinySdxl } from '../fixtures/models/make-tiny-sdxl.ts';
import { isInt8 } from '../../src/ops/int8.ts';
import { memorySink } from '../export/fixtures.ts';
import { testGpu } from '../helpers.ts';

const dir = mkdtempSync(join(tmpdir(), 'dbs-sdxl-run-'));
after(() => rmSync(dir, { recursive: true, force: true }));
const tiny = writeTinySdxl(dir);

async function opened(): Promise<OpenedModel> {
  const reader = nodeFolder(tiny.folder);
  const tokenizer = await tokenizerFilesFrom(reader);
  assert.ok(tokenizer);
  return { kind: 'diffusers', name: 'tiny-sdxl', reader, tokenizer };
}

/** A w x h PNG: a gradient photo, or (mask) white where `white(x, y)`. */
function png(w: number, h: number, white?: (x: number, y: number) => boolean): Blob {
  const data = new Uint8Array(w * h * 3);
  for (let y = 0; y < h; y++)
    for (let x = 0; x < w; x++) data.set(white ? (white(x, y) ? [255, 255, 255] : [0, 0, 0]) : [(x * 255) / w, (y * 255) / h, 90], 3 * (y * w + x));
  return new Blob([new Uint8Array(encode({ width: w, height: h, data, channels: 3, depth: 8 }))], { type: 'image/png' });
}

function input(steps: number, mode: 'lora' | 'full' = 'lora'): RunInput {
  return {
    runId: 'sdxl',
    prompt: 'a photo of sks toy',
    images: [
      { id: 'a', name: 'wide.png', blob: png(24, 16), caption: ' sks toy, Wide Shot ' },
      { id: 'b', name: 'square.png', blob: png(16, 16), mask: { name: 'mask of square.png', blob: png(16, 16, (x) => x < 8) } },
    ],
    classImages: [{ id: 'c', name: 'class.png', blob: png(16, 16, (x, y) => (x + y) % 3 === 0) }],
    settings: {
      ...defaultSettings(mode),
      resolution: 16,
      aspect: 'bucket',
      steps,
      lr: 1e-3,
      rank: 4,
      alpha: 4,
      trainTextEncoder: mode === 'lora',
      priorPreservation: true,
      classPrompt: 'a photo of a toy',
      sampleEvery: 0,
      validateEvery: 0,
      checkpointEvery: 0,
      budgetBytes: 2 ** 30,
    },
  };
}

describe('an SDXL LoRA run through the pipeline (tiny SDXL, 16 px)', () => {
  it('buckets, time ids, both encoders, mask, prior preservation, try it, kohya export read back, resume', { timeout: 600_000 }, async () => {
    const gpu = await testGpu();
    const store = new MemoryChunkStore();
    const events: RunEvent[] = [];
    const host = {
      gpu,
      dryRunGpu: () => nodeGpu({ dryRun: true, disableF16: !gpu.hasF16 }),
      store,
      decode: async (blob: Blob, name: string) => decodeImageNode(new Uint8Array(await blob.arrayBuffer()), name),
      emit: (e: RunEvent) => events.push(e),
      encodePng: (rgb: Uint8Array, width: number, height: number) => encode({ width, height, data: rgb, channels: 3, depth: 8 }),
    };
    // What the studio shows of the model before a run (headers and configs only).
    const params = (['unet', 'vae', 'text_encoder', 'text_encoder_2'] as const).reduce(
      (a, c) => a + [...tiny.weights[c].values()].reduce((n, t) => n + t.data.length, 0),
      0,
    );
    assert.deepEqual(await sdxlModelSummary(await opened()), {
      name: 'tiny-sdxl',
      family: 'sdxl',
      layout: 'diffusers',
      prediction: 'epsilon',
      parameters: params,
      resolutionFactor: 4,
    });
    await assert.rejects(
      TrainingRun.prepare(host, await opened(), input(2, 'full')),
      /tiny-sdxl is an SDXL model: SDXL trains LoRA adapters here.*--mode to lora/,
    );

    const run = await TrainingRun.prepare(host, await opened(), input(1));
    assert.equal(run.family, 'sdxl');
    // The cache: the wide photo at its bucket (20 x 12 px: latents 6 x 10), time ids [orig h, w, crop top, left,
    // target h, w] with the 24 x 16 photo's 24 x 14.4 region at y 0.8 scaled by 20/24 (top 0.67 -> 1); the
    // square photo and the class image uncropped at 16 px; both encoders' context (32 + 48 wide) and
    // the pooled embedding (40); token ids of both tokenizers for the text encoders' adapters.
    const data = await loadTrainData(store, 'sdxl');
    assert.ok(data);
    const [wide, square] = data.instance;
    assert.deepEqual(wide.latentShape, [4, 6, 10]);
    assert.deepEqual([...wide.timeIds!], [16, 24, 1, 0, 12, 20]);
    assert.deepEqual([...square.timeIds!], [16, 16, 0, 0, 16, 16]);
    assert.deepEqual([...data.classes[0].timeIds!], [16, 16, 0, 0, 16, 16]);
    assert.deepEqual(data.contextShape, [77, 80]);
    assert.equal(square.pooled!.length, 40);
    assert.ok(square.mask && square.ids2, 'the mask and tokenizer 2 ids are cached');
    assert.ok(events.some((e) => e.type === 'plan'));

    assert.equal(await run.train(), 'done');
    const trained = await run.trainer.trainedValues();
    assert.ok(
      [...trained.keys()].some((n) => n.startsWith('text_encoder_2.')) && [...trained.keys()].some((n) => n.startsWith('text_model.')),
      'both encoders adapted',
    );

    // Try it: the tuned and base images differ (the adapters changed the model).
    const tried = await run.tryIt({ prompt: 'a photo of sks toy', steps: 1, guidance: 5, seed: 1 });
    assert.equal(tried.width, 16);
    assert.notDeepEqual(tried.tuned.png, tried.base.png);

    // The kohya export, read back: every trained tensor under its kohya key, values the masters rounded to f16.
    const sink = memorySink();
    await run.exportTo('lora-kohya', sink);
    const file = await SafetensorsFile.open(new BytesSource(sink.bytes(), 'lora.safetensors'));
    assert.equal(file.metadata.ss_base_model_version, SDXL_KOHYA_VERSION);
    assert.equal(file.metadata['modelspec.architecture'], 'stable-diffusion-xl-v1-base/lora');
    // each photo's caption (the prompt for the one without), tags stripped and lower-cased as sd-scripts counts them
    assert.deepEqual(JSON.parse(file.metadata.ss_tag_frequency), {
      instance_images: { 'sks toy': 1, 'wide shot': 1, 'a photo of sks toy': 1 },
      class_images: { 'a photo of a toy': 1 },
    });
    // Try it's PNG names this LoRA as A1111 does: the first 12 hex digits of the export's sshs_model_hash.
    const hash = file.metadata.sshs_model_hash;
    assert.match(hash, /^[0-9a-f]{64}$/);
    assert.match(tried.tuned.parameters, new RegExp(`, Lora hashes: "[^"]+: ${hash.slice(0, 12)}"$`));
    assert.ok(!tried.base.parameters.includes('Lora hashes'));
    const c = run.model.unet.config;
    const layout = { blocks: c.blockOutChannels.length, layersPerBlock: c.layersPerBlock, downAttention: c.downAttention, upAttention: c.upAttention };
    assert.equal(file.names.length, (trained.size / 2) * 3, 'alpha, down and up per adapted layer');
    for (const [name, value] of trained) {
      const m = /^(text_encoder_2\.)?(.*)\.lora_([AB])\.weight$/.exec(name)!;
      const part = m[1] ? 'te2' : m[2].startsWith('text_model.') ? 'te1' : 'unet';
      const key = `${sdxlKohyaName(part, m[2], layout)}.lora_${m[3] === 'A' ? 'down' : 'up'}.weight`;
      assert.deepEqual((await file.read(key)).data, roundToF16(value), key);
    }
    await run.destroy();

    // Resume: prepared again with more steps, the run continues from its final checkpoint with the same losses.
    const losses = [...run.trainer.losses];
    const again = await TrainingRun.prepare(host, await opened(), input(2));
    assert.equal(again.step, 1);
    assert.deepEqual(again.trainer.losses, losses);
    await again.destroy();
  });

  it('int8 base weights: planned, stored in int8, and train like the f16 base', { timeout: 600_000 }, async (t) => {
    const gpu = await testGpu();
    const runWith = async (baseWeights: 'f16' | 'int8') => {
      const events: RunEvent[] = [];
      const host = {
        gpu,
        dryRunGpu: () => nodeGpu({ dryRun: true, disableF16: !gpu.hasF16 }),
        store: new MemoryChunkStore(),
        decode: async (blob: Blob, name: string) => decodeImageNode(new Uint8Array(await blob.arrayBuffer()), name),
        emit: (e: RunEvent) => events.push(e),
        encodePng: (rgb: Uint8Array, width: number, height: number) => encode({ width, height, data: rgb, channels: 3, depth: 8 }),
      };
      const base = input(2);
      const settings = { ...base.settings, baseWeights, trainTextEncoder: false, priorPreservation: false };
      const run = await TrainingRun.prepare(host, await opened(), { ...base, classImages: [], settings });
      const plan = events.find((e) => e.type === 'plan');
      assert.ok(plan && plan.type === 'plan' && plan.plan.baseWeights === baseWeights, `the plan says ${baseWeights}`);
      const stored = [...run.model.unet.weights.values()].filter(isInt8).length;
      assert.equal(await run.train(), 'done');
      const trained = await run.trainer.trainedValues();
      const losses = [...run.trainer.losses];
      await run.destroy();
      return { stored, trained, losses };
    };
    const f16 = await runWith('f16');
    const int8 = await runWith('int8');
    assert.equal(f16.stored, 0);
    // every UNet weight of 2+ dims of the tiny model (uniform init: ~0.4 % round trip) is stored in int8
    assert.ok(int8.stored > 20, `${int8.stored} weights in int8`);
    // The same run on the int8 base (measured: losses 0.1-0.2 % apart, cosine 0.984): each step's loss within 1 % of
    // the f16 base's (the weights differ by ~0.4 % RMS), yet not identical (the int8 weights are what ran); the
    // adapters' updates point the same way: the up projections start at zero, so their trained values are the whole
    // update the two steps' gradients made.
    for (let i = 0; i < f16.losses.length; i++)
      assert.ok(Math.abs(int8.losses[i] - f16.losses[i]) <= 0.01 * f16.losses[i], `step ${i + 1}: ${int8.losses[i]} vs ${f16.losses[i]}`);
    assert.notDeepEqual(int8.losses, f16.losses);
    let dot = 0;
    let na = 0;
    let nb = 0;
    for (const [name, a] of f16.trained) {
      if (!name.endsWith('.lora_B.weight')) continue;
      const b = int8.trained.get(name)!;
      for (let j = 0; j < a.length; j++) {
        dot += a[j] * b[j];
        na += a[j] * a[j];
        nb += b[j] * b[j];
      }
    }
    const cos = dot / Math.sqrt(na * nb);
    t.diagnostic(`${int8.stored} weights in int8; losses f16 ${f16.losses.join(', ')} int8 ${int8.losses.join(', ')}; up projections' cosine ${cos}`);
    assert.ok(cos > 0.95 && na > 0, `the up projections' cosine ${cos}`);
  });
});
