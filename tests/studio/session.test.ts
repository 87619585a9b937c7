// The studio's run, in Node on Dawn/lavapipe (f16 and f32), on the project's own demo model: the same
// session the browser worker drives. Prepare (decode, crop, cache, plan), train with samples, pause and
// resume bit-identically, export every format and read the files back, refuse bad input clearly.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { encode } from 'fast-png';
import { unzipSync } from 'fflate';
import type { Gpu } from '../../src/gpu/device.ts';
import { GpuOutOfMemoryError } from '../../src/gpu/errors.ts';
import { nodeGpu } from '../../src/gpu/node.ts';
import { decodeImageNode } from '../../src/io/image-node.ts';
import { parseHeader, readSafetensors } from '../../src/io/safetensors.ts';
import { unetLayout } from '../../src/export/full.ts';
import { blobSink } from '../../src/io/sink-blob.ts';
import { BytesSource } from '../../src/io/source.ts';
import { DEMO_CONFIGS, demoModelFiles, DEMO_RESOLUTION } from '../../lab/demo-model/demo.ts';
import { unetFromDiffusers } from '../../src/models/keymap.ts';
import { detectDiffusers } from '../../src/models/detect.ts';
import { folderFromSources, openDiffusers, tokenizerFilesFrom } from '../../src/models/source.ts';
import { MemoryChunkStore, type ChunkStore } from '../../src/store/chunkstore.ts';
import { defaultSettings, type RunSettings } from '../../src/pipeline/settings.ts';
import { RunError, TrainingRun, type ExportFormat, type OpenedModel, type RunEvent, type RunInput } from '../../src/pipeline/run.ts';
import { testGpu } from '../helpers.ts';

/** The schema's LoRA defaults with samples on (every 50 steps), as the page starts. */
const DEFAULT_SETTINGS: RunSettings = {
  ...defaultSettings('lora'),
  sampleEvery: 50,
  classPrompt: 'a photo of a dog',
  samplePrompt: 'a photo of sks dog',
};

async function demoModel(seed = 1): Promise<OpenedModel> {
  const files = new Map([...demoModelFiles(seed)].map(([p, b]) => [p, new BytesSource(b, p)]));
  const reader = folderFromSources('demo', files);
  const tokenizer = await tokenizerFilesFrom(reader);
  assert.ok(tokenizer);
  return { kind: 'diffusers', name: 'demo', reader, tokenizer };
}

/** A w x h PNG with a smooth colour pattern (different per `k`). */
function png(w: number, h: number, k: number): Blob {
  const data = new Uint8Array(w * h * 3);
  for (let y = 0; y < h; y++)
    for (let x = 0; x < w; x++) {
      const p = 3 * (y * w + x);
      data[p] = (x * 255) / w;
      data[p + 1] = (y * 255) / h;
      data[p + 2] = (k * 80) % 256;
    }
  return new Blob([new Uint8Array(encode({ width: w, height: h, data, channels: 3, depth: 8 }))], { type: 'image/png' });
}

function host(gpu: Gpu, store: ChunkStore, events: RunEvent[], onEvent?: (e: RunEvent) => void) {
  return {
    gpu,
    dryRunGpu: () => nodeGpu({ dryRun: true, disableF16: !gpu.hasF16 }),
    store,
    decode: async (blob: Blob, name: string) => decodeImageNode(new Uint8Array(await blob.arrayBuffer()), name),
    emit: (e: RunEvent) => {
      events.push(e);
      onEvent?.(e);
    },
    encodePng: (rgb: Uint8Array, width: number, height: number) => encode({ width, height, data: rgb, channels: 3, depth: 8 }),
  };
}

function run(settings: Partial<RunSettings> = {}, runId = 'r1'): RunInput {
  return {
    runId,
    prompt: 'a photo of sks toy',
    images: [
      { id: 'a', name: 'a.png', blob: png(40, 32, 1) },
      { id: 'b', name: 'b.png', blob: png(32, 48, 2), crop: { x: 0, y: 16, size: 32 }, caption: 'a photo of sks toy on a table' },
      { id: 'c', name: 'c.png', blob: png(32, 32, 3) },
    ],
    classImages: [],
    settings: {
      ...DEFAULT_SETTINGS,
      resolution: DEMO_RESOLUTION,
      steps: 4,
      sampleEvery: 2,
      sampleSteps: 2,
      classSteps: 2,
      samplePrompt: 'a photo of sks toy',
      checkpointEvery: 0,
      budgetBytes: 2 ** 30,
      ...settings,
    },
  };
}

/** Learning rate of the merged-export test: large, so that B A is large (see the test). */
const MERGE_LR = 5e-2;

/**
 * W + scale B A for a [out, in] layer with A [r, in] and B [out, r], in f64, and per element how far an
 * fp16 export of it may be off: the f32 merge rounds each of its r additions (<= 2^-24 of the running
 * sum's terms each), then the export rounds to f16 (half an ulp: 2^-11 relative, 2^-25 absolute in the
 * subnormal range). The bound below is both, doubled for margin; still ~1e-3 relative, far below the merge.
 */
function mergedReference(
  W: Float32Array,
  A: Float32Array,
  B: Float32Array,
  shape: readonly number[],
  scale: number,
): { value: Float64Array; tolerance: Float64Array } {
  const [out, inn] = shape;
  const r = A.length / inn;
  const value = new Float64Array(W.length);
  const tolerance = new Float64Array(W.length);
  for (let o = 0; o < out; o++)
    for (let i = 0; i < inn; i++) {
      let sum = W[o * inn + i];
      let magnitude = Math.abs(sum);
      for (let k = 0; k < r; k++) {
        const term = scale * B[o * r + k] * A[k * inn + i];
        sum += term;
        magnitude += Math.abs(term);
      }
      value[o * inn + i] = sum;
      tolerance[o * inn + i] = 2 * (2 ** -11 * Math.abs(sum) + 2 ** -25 + r * 2 ** -24 * magnitude);
    }
  return { value, tolerance };
}

async function sinkBytes(session: TrainingRun, f: ExportFormat): Promise<Uint8Array> {
  const sink = blobSink();
  await session.exportTo(f, sink);
  return new Uint8Array(await sink.blob().arrayBuffer());
}

describe('demo model', () => {
  it('is the same bytes for the same seed, different for another; a valid SD1 diffusers folder', async () => {
    const a = demoModelFiles(1);
    const b = demoModelFiles(1);
    const c = demoModelFiles(2);
    for (const [p, bytes] of a) assert.deepEqual(bytes, b.get(p), p);
    assert.notDeepEqual(a.get('unet/diffusion_pytorch_model.safetensors'), c.get('unet/diffusion_pytorch_model.safetensors'));
    const m = await demoModel();
    assert.equal(m.kind, 'diffusers');
    const src = await openDiffusers((m as Extract<OpenedModel, { kind: 'diffusers' }>).reader, {});
    assert.equal(src.family, 'sd1');
    assert.equal(src.prediction, 'epsilon');
    const shapes = new Map([...src.shapes('unet')].map(([n, s]) => [`unet/${n}`, s]));
    assert.ok(shapes.size > 100);
    await src.close();
    void detectDiffusers;
  });
});

for (const dtype of ['f32', 'f16'] as const) {
  describe(`studio session on the demo model (${dtype})`, () => {
    let gpuP: Promise<Gpu> | null = null;
    const getGpu = () => (gpuP ??= dtype === 'f16' ? testGpu() : testGpu({ disableF16: true }));

    it('trains with samples, pauses, resumes bit-identically, and exports all four formats', { timeout: 300_000 }, async () => {
      const gpu = await getGpu();
      if (dtype === 'f16') assert.ok(gpu.hasF16, 'lavapipe offers shader-f16');
      // Uninterrupted reference run.
      const refEvents: RunEvent[] = [];
      const ref = await TrainingRun.prepare(host(gpu, new MemoryChunkStore(), refEvents), await demoModel(), run());
      assert.equal(await ref.train(), 'done');
      const refValues = await ref.trainer.trainedValues();
      const refSamples = refEvents.filter((e): e is Extract<RunEvent, { type: 'sample' }> => e.type === 'sample');
      assert.deepEqual(
        refSamples.map((e) => e.step),
        [0, 2, 4],
        'a sample before training and every 2 steps',
      );
      for (const s of refSamples) {
        assert.deepEqual([...s.png.subarray(1, 4)], [0x50, 0x4e, 0x47], 'PNG signature');
        assert.equal(s.width, DEMO_RESOLUTION);
      }
      assert.notDeepEqual(refSamples[0].png, refSamples[2].png, 'training changes the sample');
      // "Not square" only for the photo left at its centre crop (a.png); b.png's crop was chosen. Nothing is
      // "blurry" or "upscaled": every photo's short side (32 px) is at the demo model's 32 px resolution.
      const warnings = refEvents.flatMap((e) => (e.type === 'warning' ? [e.message] : []));
      assert.ok(
        warnings.some((w) => /^a\.png is not square/.test(w)),
        warnings.join(' | '),
      );
      assert.ok(!warnings.some((w) => /^b\.png is not square/.test(w) || /blurry|upscaled/.test(w)), warnings.join(' | '));
      const steps = refEvents.filter((e): e is Extract<RunEvent, { type: 'step' }> => e.type === 'step');
      assert.equal(steps.length, 4);
      for (const s of steps) assert.ok(Number.isFinite(s.report.loss) && s.report.gpuBytes > 0 && s.storageBytes > 0);
      // Honest time: step 1 is warm-up (no s/step yet), later steps have s/step from warm steps only; every
      // sample reports denoising steps 0..N of its own; the ETA after the last step still counts the final
      // sample and checkpoint.
      assert.equal(steps[0].secondsPerStep, null);
      assert.equal(steps[0].warmupSeconds, steps[0].report.seconds);
      for (const s of steps.slice(1)) assert.ok(s.secondsPerStep !== null && s.secondsPerStep > 0 && s.warmupSeconds === steps[0].report.seconds);
      assert.ok(steps[3].etaSeconds !== null && steps[3].etaSeconds > 0, `ETA after the last step: ${steps[3].etaSeconds}`);
      for (const sample of refSamples) {
        const progress = refEvents.filter((e) => e.type === 'sample-progress' && e.step === sample.step);
        assert.deepEqual(
          progress.map((e) => e.type === 'sample-progress' && `${e.denoised}/${e.total}`),
          ['0/2', '1/2', '2/2'],
          `sample at step ${sample.step}`,
        );
        assert.ok(sample.seconds > 0);
      }
      const finalProgress = refEvents.filter((e) => e.type === 'sample-progress' && e.step === 4);
      assert.ok(
        finalProgress.every((e) => e.type === 'sample-progress' && e.etaSeconds !== null && e.etaSeconds > 0),
        'the ETA is not 0 while the final sample is drawn (the final checkpoint is still to come)',
      );
      const plan = refEvents.find((e) => e.type === 'plan');
      assert.ok(plan && plan.type === 'plan' && plan.plan.peakBytes <= plan.plan.budgetBytes && plan.plan.samplingBytes > 0 && plan.plan.trainableParams > 0);

      // Interrupted run: pause after step 2 (checkpoint), a fresh session on the same store resumes.
      const store = new MemoryChunkStore();
      const events: RunEvent[] = [];
      const beforeFirst = Date.now();
      let first: TrainingRun | null = null;
      first = await TrainingRun.prepare(
        host(gpu, store, events, (e) => e.type === 'step' && e.report.step === 2 && first!.pause()),
        await demoModel(),
        run(),
      );
      assert.equal(await first.train(), 'paused');
      assert.equal(first.step, 2);
      await first.destroy();
      // The clock moves on before the resume, so a start time taken at the resume (or at the export) is told apart.
      await new Promise((r) => setTimeout(r, 20));
      const beforeSecond = Date.now();
      const events2: RunEvent[] = [];
      const second = await TrainingRun.prepare(host(gpu, store, events2), await demoModel(), run());
      const resumed = events2.find((e) => e.type === 'resumed');
      assert.ok(resumed && resumed.type === 'resumed' && resumed.step === 2 && resumed.losses.length === 2);
      assert.ok(!events2.some((e) => e.type === 'phase' && e.phase === 'encoding'), 'latents come from the store on resume');
      assert.equal(await second.train(), 'done');
      const values = await second.trainer.trainedValues();
      for (const [n, v] of refValues) assert.deepEqual(values.get(n), v, `${n} bit-identical after pause and resume`);
      const lastSample = events2.filter((e) => e.type === 'sample').at(-1);
      assert.ok(lastSample && lastSample.type === 'sample');
      assert.deepEqual(lastSample.png, refSamples[2].png, 'the fixed-seed sample at step 4 matches the uninterrupted run');

      // Exports.
      const kohya = readSafetensors(await sinkBytes(second, 'lora-kohya'));
      assert.ok(
        [...kohya.tensors.keys()].every((k) => k.startsWith('lora_unet_')),
        'kohya names',
      );
      assert.equal(kohya.metadata.ss_network_dim, String(DEFAULT_SETTINGS.rank));
      // The run's real start, kept across the pause and the new session: not the resume's, not the export's time.
      const started = Number(kohya.metadata.ss_training_started_at) * 1000;
      assert.ok(started >= beforeFirst && started < beforeSecond, `ss_training_started_at ${started} in [${beforeFirst}, ${beforeSecond})`);
      assert.ok(Number(kohya.metadata.ss_training_finished_at) * 1000 >= beforeSecond, 'finished at the export');
      const peft = readSafetensors(await sinkBytes(second, 'lora-diffusers'));
      assert.ok(
        [...peft.tensors.keys()].every((k) => k.startsWith('unet.') && /lora_[AB]\.weight$/.test(k)),
        'PEFT names',
      );
      const full = await sinkBytes(second, 'full-single-file');
      const fullHeader = parseHeader(full.subarray(0, Number(new DataView(full.buffer, full.byteOffset).getBigUint64(0, true)) + 8), full.length);
      const fullNames = [...fullHeader.entries.keys()];
      assert.ok(
        fullNames.some((k) => k.startsWith('model.diffusion_model.')) &&
          fullNames.some((k) => k.startsWith('first_stage_model.')) &&
          fullNames.some((k) => k.startsWith('cond_stage_model.')),
      );
      const zip = unzipSync(await sinkBytes(second, 'diffusers-zip'));
      assert.ok(zip['model_index.json'] && zip['unet/diffusion_pytorch_model.safetensors'] && zip['tokenizer/vocab.json'], Object.keys(zip).join(', '));
      assert.match(second.exportName('lora-kohya'), /^demo-dreambooth-lora-step4-lora\.safetensors$/);
      await second.destroy();
      await ref.destroy();
    });

    it(
      'a LoRA run exported as a full checkpoint carries W + scale B A in every adapted layer (single file and diffusers zip)',
      { timeout: 300_000 },
      async (t) => {
        const gpu = await getGpu();
        // A high learning rate for a few steps: Adam moves every adapter element by about lr per step, so B A
        // grows far past the export's rounding and a merge that dropped, halved or transposed the adapters
        // (or returned W as it was) fails below. At the default 1e-4 the change would be below the tolerance.
        const s = await TrainingRun.prepare(host(gpu, new MemoryChunkStore(), []), await demoModel(), run({ lr: MERGE_LR, steps: 3, sampleEvery: 0 }));
        assert.equal(await s.train(), 'done');
        const values = await s.trainer.trainedValues();
        const layers = [...values.keys()].filter((n) => n.endsWith('.lora_A.weight')).map((n) => n.slice(0, -'.lora_A.weight'.length));
        assert.ok(layers.length >= 8, `adapted layers: ${layers.length}`);
        const single = readSafetensors(await sinkBytes(s, 'full-single-file')).tensors;
        const zip = unzipSync(await sinkBytes(s, 'diffusers-zip'));
        const zipUnet = readSafetensors(zip['unet/diffusion_pytorch_model.safetensors']).tensors;
        const layout = unetLayout(DEMO_CONFIGS.unet);
        let largestChange = 0;
        let largestTolerance = 0;
        for (const layer of layers) {
          const base = s.model.unet.weights.get(`${layer}.weight`)!;
          const W = await gpu.read(base);
          const expected = mergedReference(W, values.get(`${layer}.lora_A.weight`)!, values.get(`${layer}.lora_B.weight`)!, base.shape, s.trainer.loraScale);
          const exported = [
            ['single file', single.get(`model.diffusion_model.${unetFromDiffusers(`${layer}.weight`, layout)}`)],
            ['diffusers zip', zipUnet.get(`${layer}.weight`)],
          ] as const;
          for (const [where, tensor] of exported) {
            assert.ok(tensor, `${where} has ${layer}.weight`);
            assert.deepEqual(tensor.shape, base.shape, `${where} ${layer}.weight shape`);
            for (let j = 0; j < W.length; j++) {
              const err = Math.abs(tensor.data[j] - expected.value[j]);
              assert.ok(
                err <= expected.tolerance[j],
                `${where} ${layer}.weight[${j}]: exported ${tensor.data[j]}, W + scale B A = ${expected.value[j]} (W ${W[j]}), |diff| ${err} > ${expected.tolerance[j]}`,
              );
            }
          }
          for (let j = 0; j < W.length; j++) {
            largestChange = Math.max(largestChange, Math.abs(expected.value[j] - W[j]));
            largestTolerance = Math.max(largestTolerance, expected.tolerance[j]);
          }
        }
        // The merge moved weights by far more than the tolerance: W itself would not pass the check above.
        t.diagnostic(`${layers.length} layers: max |W' - W| ${largestChange.toExponential(2)}, largest tolerance ${largestTolerance.toExponential(2)}`);
        assert.ok(largestChange > 100 * largestTolerance, `max |W' - W| ${largestChange} vs tolerance ${largestTolerance}: train harder`);
        await s.destroy();
      },
    );

    it('full fine-tune with prior preservation from generated class images; LoRA formats refused', { timeout: 300_000 }, async () => {
      const gpu = await getGpu();
      const events: RunEvent[] = [];
      const s = await TrainingRun.prepare(
        host(gpu, new MemoryChunkStore(), events),
        await demoModel(),
        run({ mode: 'full', lr: 1e-4, steps: 2, sampleEvery: 0, priorPreservation: true, classPrompt: 'a photo of a toy', classCount: 2 }),
      );
      assert.equal(events.filter((e) => e.type === 'phase' && e.phase === 'class-images').length, 2);
      assert.equal(s.trainer.data.classes.length, 2);
      assert.equal(await s.train(), 'done');
      await assert.rejects(sinkBytes(s, 'lora-kohya'), /full fine-tune/);
      const full = readSafetensors(await sinkBytes(s, 'full-single-file'));
      assert.ok(full.tensors.size > 200);
      await s.destroy();
    });
  });
}

describe('studio session: bad input', () => {
  it('a text file among the photos is named in the message; an empty prompt is refused; nothing is stored', { timeout: 120_000 }, async () => {
    const gpu = await testGpu();
    const store = new MemoryChunkStore();
    const bad = run();
    bad.images[1] = { id: 'x', name: 'notes.txt', blob: new Blob(['hello, not an image']) };
    await assert.rejects(TrainingRun.prepare(host(gpu, store, []), await demoModel(), bad), /notes\.txt/);
    const empty = run();
    empty.prompt = ' ';
    await assert.rejects(
      TrainingRun.prepare(host(gpu, store, []), await demoModel(), empty),
      (e: Error) => e instanceof RunError && /prompt is empty/.test(e.message),
    );
    assert.deepEqual(await store.keys(), []);
    await assert.rejects(TrainingRun.prepare(host(gpu, store, []), await demoModel(), run({ resolution: 30 })), /multiple of 4/);
    await assert.rejects(TrainingRun.prepare(host(gpu, store, []), await demoModel(), run({ budgetBytes: 2 ** 20 })), /needs at least .* of GPU memory/);
  });

  it('a device with less memory than the budget: the out-of-memory error says what the step needs and what to change', { timeout: 120_000 }, async () => {
    const gpu = await testGpu();
    const session = await TrainingRun.prepare(host(gpu, new MemoryChunkStore(), []), await demoModel(), run({ sampleEvery: 0 }));
    // The fault a real device raises at the step's sync when it cannot back an allocation (lavapipe uses host
    // memory and cannot be exhausted safely in a test), injected into the real trainer's step.
    const trainStep = session.trainer.trainStep.bind(session.trainer);
    let calls = 0;
    session.trainer.trainStep = async (...a) => {
      if (++calls === 2) throw new GpuOutOfMemoryError(64 * 2 ** 20, 'activations', 'conv2d', 'Not enough memory left');
      return trainStep(...a);
    };
    await assert.rejects(session.train(), (e: Error) => {
      assert.ok(e instanceof RunError, e.name);
      assert.match(e.message, /ran out of memory at step 2 \(64(\.0)? MiB for activations 'conv2d'\)/);
      assert.match(
        e.message,
        /This step needs about [\d.]+ [KMG]i?B of GPU memory \((with|without) activation checkpointing, \d+ of \d+ optimizer chunks on the GPU(, updates fused into the backward pass)?\), planned under the budget of 1(\.0)? GiB/,
      );
      assert.match(e.message, /--budget/);
      return true;
    });
    assert.equal(session.trainer.step, 1, 'the first step stands');
    await session.destroy();
  });
});
