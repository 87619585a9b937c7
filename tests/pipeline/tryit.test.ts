// "Try it" through the shared run pipeline (TrainingRun.tryIt, pipeline/tryit.ts) on the demo model in Node
// (Dawn/lavapipe): after training steps the fine-tuned image differs from the base image for the same seed;
// the base image is exactly what a freshly loaded base model draws (LoRA: adapters left out; full: the base
// UNet re-read from the source); LoRA strength 0 is the base; the trained state and the checkpoint are not
// changed; no finished step, and a run that is training, are refused with what to do.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { decode, encode } from 'fast-png';
import type { Gpu } from '../../src/gpu/device.ts';
import { nodeGpu } from '../../src/gpu/node.ts';
import { decodeImageNode } from '../../src/io/image-node.ts';
import { SafetensorsFile } from '../../src/io/safetensors.ts';
import { BytesSource } from '../../src/io/source.ts';
import { demoModelFiles, DEMO_RESOLUTION } from '../../lab/demo-model/demo.ts';
import { loadModel } from '../../src/models/load.ts';
import { folderFromSources, openDiffusers, tokenizerFilesFrom } from '../../src/models/source.ts';
import { TrainingRun, type OpenedModel, type RunEvent, type RunInput } from '../../src/pipeline/run.ts';
import { defaultSettings, type RunSettings } from '../../src/pipeline/settings.ts';
import type { TryItOptions } from '../../src/pipeline/tryit.ts';
import { readPngParameters } from '../../src/sample/parameters.ts';
import { txt2img } from '../../src/sample/txt2img.ts';
import { MemoryChunkStore, type ChunkStore } from '../../src/store/chunkstore.ts';
import { testGpu } from '../helpers.ts';

async function demoModel(): Promise<OpenedModel> {
  const files = new Map([...demoModelFiles(1)].map(([p, b]) => [p, new BytesSource(b, p)]));
  const reader = folderFromSources('demo-sd1-tiny', files);
  const tokenizer = await tokenizerFilesFrom(reader);
  assert.ok(tokenizer);
  return { kind: 'diffusers', name: 'demo-sd1-tiny', reader, tokenizer };
}

function photo(k: number): Blob {
  const [w, h] = [32, 32];
  const data = new Uint8Array(w * h * 3);
  for (let p = 0; p < w * h; p++) {
    data[3 * p] = ((p % w) * 255) / w;
    data[3 * p + 1] = (Math.floor(p / w) * 255) / h;
    data[3 * p + 2] = (k * 90) % 256;
  }
  return new Blob([new Uint8Array(encode({ width: w, height: h, data, channels: 3, depth: 8 }))], { type: 'image/png' });
}

function host(gpu: Gpu, store: ChunkStore, onEvent: (e: RunEvent) => void = () => {}) {
  return {
    gpu,
    dryRunGpu: () => nodeGpu({ dryRun: true, disableF16: !gpu.hasF16 }),
    store,
    decode: async (blob: Blob, name: string) => decodeImageNode(new Uint8Array(await blob.arrayBuffer()), name),
    emit: onEvent,
    encodePng: (rgb: Uint8Array, width: number, height: number) => encode({ width, height, data: rgb, channels: 3, depth: 8 }),
  };
}

/** Two photos, two steps, a learning rate large enough that two steps change the 8-bit pixels. */
function input(mode: 'lora' | 'full', sampleEvery: number): RunInput {
  const settings: RunSettings = {
    ...defaultSettings(mode),
    resolution: DEMO_RESOLUTION,
    steps: 2,
    lr: mode === 'lora' ? 3e-2 : 3e-3,
    sampleEvery,
    sampleSteps: 2,
    checkpointEvery: 0,
    validateEvery: 0,
    budgetBytes: 2 ** 30,
  };
  return {
    runId: `tryit-${mode}`,
    prompt: 'a photo of sks toy',
    images: [
      { id: 'a', name: 'a.png', blob: photo(1) },
      { id: 'b', name: 'b.png', blob: photo(2) },
    ],
    classImages: [],
    settings,
  };
}

const OPTIONS: TryItOptions = { prompt: 'a photo of sks toy', negativePrompt: 'blurry', steps: 3, guidance: 6, seed: 11 };

const pixels = (png: Uint8Array) => decode(png).data as Uint8Array;

/** What a freshly loaded base model draws with the same options (the oracle for the base image). */
async function freshBase(gpu: Gpu, opened: OpenedModel, run: TrainingRun): Promise<Uint8Array> {
  if (opened.kind !== 'diffusers') throw new Error('unreachable');
  const source = await openDiffusers(opened.reader);
  const model = await loadModel(gpu, source, gpu.computeDType);
  try {
    const img = await txt2img(gpu, model, run.tokenizer, {
      prompt: OPTIONS.prompt,
      negativePrompt: OPTIONS.negativePrompt!,
      steps: OPTIONS.steps,
      guidance: OPTIONS.guidance,
      seed: OPTIONS.seed,
      width: DEMO_RESOLUTION,
      height: DEMO_RESOLUTION,
      sampler: 'dpm++2m',
      schedule: run.schedule,
    });
    return img.rgb;
  } finally {
    for (const part of [model.unet.weights, model.vae.weights, model.textEncoder.weights]) gpu.free(...part.values());
    await source.close();
  }
}

/** Every key and value of the store (the run's cache, optimizer state and checkpoint). */
async function storeContents(store: ChunkStore): Promise<Map<string, string>> {
  const out = new Map<string, string>();
  for (const k of await store.keys('')) out.set(k, Buffer.from((await store.read(k))!).toString('base64'));
  return out;
}

/** Pixels that differ by more than `by` (8-bit). */
function differing(a: Uint8Array, b: Uint8Array, by = 0): number {
  let n = 0;
  for (let i = 0; i < a.length; i++) if (Math.abs(a[i] - b[i]) > by) n++;
  return n;
}

for (const mode of ['lora', 'full'] as const)
  describe(`Try it, ${mode}`, () => {
    it('refuses step 0 and a training run; after training: tuned differs from base, base = a fresh base model, state untouched', async () => {
      const gpu = await testGpu();
      const opened = await demoModel();
      const store = new MemoryChunkStore();
      // LoRA without samples: the VAE decoder and text encoder were freed and come back from the source.
      // The run pauses after its first step (as the page's Pause does).
      const pauseAfterStep1 = (e: RunEvent) => e.type === 'step' && e.report.step === 1 && run.pause();
      const run: TrainingRun = await TrainingRun.prepare(host(gpu, store, pauseAfterStep1), opened, input(mode, mode === 'lora' ? 0 : 2));
      try {
        await assert.rejects(run.tryIt(OPTIONS), /needs a finished training step: this run has none yet/);
        let training = run.train();
        await assert.rejects(run.tryIt(OPTIONS), /the run is training: pause it/);
        assert.equal(await training, 'paused');
        // While paused: both images at step 1.
        const paused = await run.tryIt(OPTIONS);
        assert.equal(paused.step, 1);
        assert.equal(decode(paused.tuned.png).width, DEMO_RESOLUTION);
        training = run.train();
        assert.equal(await training, 'done');
        assert.equal(run.step, 2);

        const masters = await run.trainer.trainedValues();
        const compute = new Map<string, Float32Array>();
        for (const [n, t] of run.trainer.trainable) compute.set(n, await gpu.read(t));
        const stored = await storeContents(store);

        let progress = 0;
        const r = await run.tryIt({ ...OPTIONS, strength: 1, onStep: (done, total) => (assert.equal(total, 2 * OPTIONS.steps), (progress = done)) });
        assert.equal(progress, 2 * OPTIONS.steps);
        assert.equal(r.step, 2);
        const [tuned, base] = [pixels(r.tuned.png), pixels(r.base.png)];
        // Two steps at a large learning rate move the image: at least 5% of the 8-bit values change.
        const moved = differing(tuned, base);
        assert.ok(moved > tuned.length / 20, `tuned differs from base in ${moved} of ${tuned.length} values`);
        // The base image is the base model's, bit for bit: same weights, kernels and seed.
        assert.equal(differing(base, await freshBase(gpu, opened, run)), 0, 'base image = a freshly loaded base model');

        // The PNGs carry A1111's parameters text.
        assert.equal(readPngParameters(r.tuned.png), r.tuned.parameters);
        assert.equal(readPngParameters(r.base.png), r.base.parameters);
        assert.equal(
          r.base.parameters,
          `a photo of sks toy\nNegative prompt: blurry\nSteps: 3, Sampler: DPM++ 2M, CFG scale: 6, Seed: 11, Size: ${DEMO_RESOLUTION}x${DEMO_RESOLUTION}, Model: demo-sd1-tiny`,
        );
        if (mode === 'lora') {
          // A1111's Lora hashes: the first 12 hex digits of the sshs_model_hash of the LoRA this run exports.
          const parts: Uint8Array[] = [];
          await run.exportTo('lora-kohya', { write: async (c) => void parts.push(c.slice()), close: async () => {} });
          const hash = (await SafetensorsFile.open(new BytesSource(Buffer.concat(parts)))).metadata.sshs_model_hash;
          assert.match(hash, /^[0-9a-f]{64}$/);
          const name = 'demo-sd1-tiny-dreambooth-lora-step2-lora';
          assert.match(
            r.tuned.parameters,
            new RegExp(`^a photo of sks toy <lora:${name}:1>\n.*Model: demo-sd1-tiny, Lora hashes: "${name}: ${hash.slice(0, 12)}"$`, 's'),
          );
        } else assert.match(r.tuned.parameters, /, Model: demo-sd1-tiny-dreambooth-full-step2$/);

        if (mode === 'lora') {
          // Strength 0 scales the adapters to nothing: the base image exactly.
          const zero = await run.tryIt({ ...OPTIONS, strength: 0 });
          assert.equal(differing(pixels(zero.tuned.png), base), 0, 'strength 0 = base');
          assert.match(zero.tuned.parameters, /<lora:[^:]+:0>/);
          await assert.rejects(run.tryIt({ ...OPTIONS, strength: Number.NaN }), /LoRA strength must be a number from -10 to 10/);
        }
        await assert.rejects(run.tryIt({ ...OPTIONS, steps: 0 }), /steps must be a whole number/);
        await assert.rejects(run.tryIt({ ...OPTIONS, prompt: ' ' }), /the prompt is empty/);

        // Nothing of the trained state moved: masters, compute weights, the store (checkpoint included).
        const mastersAfter = await run.trainer.trainedValues();
        for (const [n, v] of masters) assert.deepEqual(mastersAfter.get(n), v, `master ${n}`);
        for (const [n, t] of run.trainer.trainable) assert.deepEqual(await gpu.read(t), compute.get(n), `compute ${n}`);
        assert.deepEqual(await storeContents(store), stored);
        // And the same call again draws the same images.
        const again = await run.tryIt({ ...OPTIONS, strength: 1 });
        assert.deepEqual(again.tuned.png, r.tuned.png);
        assert.deepEqual(again.base.png, r.base.png);
      } finally {
        await run.destroy();
      }
    });
  });
