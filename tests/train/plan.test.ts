// The training planner on the tiny SD1-style UNet: the peak a dry run plans equals, to the byte, the peak a
// real run of the same configuration measures on lavapipe; a generous budget keeps everything on the GPU
// without recompute; a tight one gets the placement with the fewest store bytes per step that fits (checkpointing
// when it streams less); an impossible one says how much memory the run needs. Plus the planner's accounting store.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import type { Gpu } from '../../src/gpu/device.ts';
import { nodeGpu } from '../../src/gpu/node.ts';
import type { DType } from '../../src/gpu/tensor.ts';
import { readSafetensors } from '../../src/io/safetensors.ts';
import { clipParams, unetParams } from '../../src/models/shapes.ts';
import { clipConfigFromJson } from '../../src/nn/clip.ts';
import { unetConfigFromJson } from '../../src/nn/unet.ts';
import { SD_SCHEDULE } from '../../src/sample/schedulers.ts';
import { MemoryChunkStore, type ChunkStore } from '../../src/store/chunkstore.ts';
import { DryRunChunkStore } from '../../src/store/dryrun-store.ts';
import {
  dryRunPeak,
  optimizerChunkCount,
  planBaseWeights,
  planTraining,
  trainableShapes,
  type Plan,
  type PlanDataShape,
  type PlanModel,
} from '../../src/train/plan.ts';
import { DreamBoothTrainer, type TrainSettings } from '../../src/train/trainer.ts';
import { EMA_DEFAULTS } from '../../src/train/ema.ts';
import { planChunks } from '../../src/train/optimizer-chunks.ts';
import { trainableSpec } from '../../src/train/trainable.ts';
import { FIXTURES } from '../helpers.ts';
import { base, fixture, makeTrainer } from './tiny-trainer.ts';

type Mode = 'lora' | 'full';
const cfg = unetConfigFromJson(JSON.parse(base.metadata.config));
const dataShape: PlanDataShape = { latentShape: [4, 8, 8], contextShape: [7, 32], withClass: true };
const dryGpu = () => nodeGpu({ dryRun: true });
const model = (mode: Mode, dtype: DType): PlanModel => ({
  config: cfg,
  dtype,
  schedule: { ...SD_SCHEDULE, prediction: fixture(mode).prediction },
  name: 'tiny',
});
const settingsOf = (mode: Mode, over: Partial<TrainSettings> = {}): TrainSettings => ({ ...fixture(mode).settings, ...over });

/** Peak GPU bytes of two real steps (the first makes the streaming staging set) on a fresh lavapipe device. */
async function realPeak(mode: Mode, dtype: DType, over: Partial<TrainSettings>): Promise<number> {
  const gpu = await nodeGpu();
  try {
    const { trainer, fx, free } = await makeTrainer(gpu, dtype, mode, new MemoryChunkStore(), over);
    let peak = 0;
    for (const inputs of fx.inputs.slice(0, 2)) {
      const r = await trainer.trainStep(inputs);
      assert.ok(r.applied, `real step applied (${r.skipped ?? ''})`);
      peak = Math.max(peak, r.gpuPeakBytes);
    }
    free();
    return peak;
  } finally {
    gpu.destroy();
  }
}

/** A real trainer with text-encoder LoRA: the tiny CLIP (tests/fixtures/modules/clip_sd1) stays on the GPU and trains. */
async function textEncoderTrainer(gpu: Gpu, over: Partial<TrainSettings>, store: ChunkStore = new MemoryChunkStore()) {
  const clip = readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'modules', 'clip_sd1.safetensors'))));
  const fx = fixture('lora');
  const upload = (names: Iterable<string>, from: typeof base) =>
    new Map([...names].map((n) => [n, gpu.upload(from.tensors.get(n)!.data, from.tensors.get(n)!.shape, 'f32', 'weights', n)]));
  const te = {
    config: clipConfigFromJson(JSON.parse(clip.metadata.config)),
    weights: upload(clipParams(clipConfigFromJson(JSON.parse(clip.metadata.config))).keys(), clip),
  };
  const ids = Int32Array.from({ length: 7 }, (_, i) => (i * 37) % 1000);
  const data = { ...fx.data, instance: fx.data.instance.map((x) => ({ ...x, ids })), classes: fx.data.classes.map((x) => ({ ...x, ids })) };
  const model = { config: cfg, weights: upload(unetParams(cfg).keys(), base), schedule: { ...SD_SCHEDULE, prediction: fx.prediction }, textEncoder: te };
  const trainer = await DreamBoothTrainer.create(gpu, model, data, { ...fx.settings, textEncoderLora: true, ...over }, store, 'run');
  return { trainer, fx };
}

/** Peak GPU bytes of two real steps with text-encoder LoRA. */
async function realPeakWithTextEncoder(over: Partial<TrainSettings>): Promise<number> {
  const gpu = await nodeGpu();
  try {
    const { trainer, fx } = await textEncoderTrainer(gpu, over);
    let peak = 0;
    for (const inputs of fx.inputs.slice(0, 2)) peak = Math.max(peak, (await trainer.trainStep(inputs)).gpuPeakBytes);
    trainer.destroy();
    return peak;
  } finally {
    gpu.destroy();
  }
}

async function plannedPeak(mode: Mode, dtype: DType, over: Partial<TrainSettings>): Promise<number> {
  return (await dryRunPeak(dryGpu, model(mode, dtype), dataShape, settingsOf(mode, over))).peakBytes;
}

/**
 * Asserts that `plan` streams the fewest store bytes of any placement that fits: one more resident chunk does not
 * fit with its checkpointing setting; without checkpointing, the other setting cannot keep one more chunk resident;
 * with checkpointing, no checkpointing cannot keep as many (on a tie no checkpointing wins). Full fine-tuning also
 * weighs fused updates: chosen, no unfused placement keeps as many chunks resident (fusing only when it streams
 * strictly less); not chosen while streaming, no fused placement keeps one more.
 */
async function assertFewestStoreBytes(mode: Mode, plan: Plan, budget: number): Promise<void> {
  const fits = async (activationCheckpointing: boolean, residentChunks: number, fusedUpdates = plan.fusedUpdates) =>
    (await plannedPeak(mode, 'f32', { activationCheckpointing, residentChunks, fusedUpdates })) <= budget;
  const r = plan.residentChunks;
  if (r < plan.chunks) assert.ok(!(await fits(plan.activationCheckpointing, r + 1)), 'one more resident chunk would not fit');
  if (plan.activationCheckpointing) assert.ok(!(await fits(false, r)), 'no checkpointing cannot keep as many chunks resident');
  else if (r < plan.chunks) assert.ok(!(await fits(true, r + 1)), 'checkpointing cannot keep one more chunk resident');
  if (mode !== 'full') assert.equal(plan.fusedUpdates, false, 'LoRA never fuses');
  else if (plan.fusedUpdates)
    for (const c of [false, true]) assert.ok(!(await fits(c, r, false)), `unfused (checkpointing ${c}) cannot keep as many chunks resident`);
  else if (r < plan.chunks)
    for (const c of [false, true]) assert.ok(!(await fits(c, r + 1, true)), `fused (checkpointing ${c}) cannot keep one more chunk resident`);
}

describe('training planner (tiny UNet)', () => {
  for (const [mode, dtype, over] of [
    ['full', 'f32', { activationCheckpointing: false, residentChunks: Infinity }],
    ['full', 'f32', { activationCheckpointing: true, residentChunks: 3 }],
    ['full', 'f16', { activationCheckpointing: true, residentChunks: 0 }],
    ['lora', 'f32', { activationCheckpointing: false, residentChunks: 0 }],
    ['lora', 'f16', { activationCheckpointing: true, residentChunks: Infinity }],
    // LyCORIS: each adapted layer materialises ΔW, W + s ΔW and (DoRA) the squares, norms and W' (nn/lycoris.ts)
    ['lora', 'f32', { network: 'loha', activationCheckpointing: false, residentChunks: Infinity }],
    ['lora', 'f16', { network: 'locon', convRank: 2, convAlpha: 1, dora: true, activationCheckpointing: true, residentChunks: 0 }],
  ] as const)
    it(`dry-run peak = real peak, to the byte: ${mode}${'network' in over ? ` ${over.network}${over.dora ? '+DoRA' : ''}` : ''} ${dtype}, checkpointing ${over.activationCheckpointing}, ${over.residentChunks} resident`, async () => {
      const planned = await plannedPeak(mode, dtype, over);
      const measured = await realPeak(mode, dtype, over);
      assert.equal(planned, measured);
    });

  it("a LyCORIS network's weight-sized temporaries are in the planned peak: one W + s ΔW per adapted layer over LoRA's, one W' more with DoRA", async () => {
    const over = { activationCheckpointing: false, residentChunks: Infinity };
    const peak = async (o: Partial<TrainSettings>) => plannedPeak('lora', 'f32', { ...over, ...o });
    const locon = { network: 'locon', convRank: 2, convAlpha: 1 } as const;
    const [lora, loha, loconPeak, dora] = [await peak({}), await peak({ network: 'loha' }), await peak(locon), await peak({ ...locon, dora: true })];
    // every adapted layer (attention projections and ResNet 3x3 convs) runs with its own materialised weight,
    // which the tape keeps for the backward: at least their f32 bytes together (measured: 4.7x them for LoHa)
    const layers = trainableSpec(cfg, undefined, settingsOf('lora', { network: 'loha' }))[0].layers;
    const weightBytes = layers.reduce((n, l) => n + 4 * base.tensors.get(`${l}.weight`)!.data.length, 0);
    assert.ok(loha - lora >= weightBytes, `LoHa plans ${loha - lora} bytes over LoRA; its adapted weights alone are ${weightBytes}`);
    assert.ok(dora - loconPeak >= weightBytes, `DoRA plans ${dora - loconPeak} bytes over LoCon; its W' alone are ${weightBytes}`);
  });

  it('dry-run peak = real peak with text-encoder LoRA (the text encoder on the GPU, its adapters in the optimizer)', async () => {
    const clip = readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'modules', 'clip_sd1.safetensors'))));
    const m = { ...model('lora', 'f32'), textEncoder: clipConfigFromJson(JSON.parse(clip.metadata.config)) };
    const over = { textEncoderLora: true, activationCheckpointing: true, residentChunks: 1 };
    const planned = await dryRunPeak(dryGpu, m, dataShape, settingsOf('lora', over));
    assert.equal(planned.chunks, optimizerChunkCount(m, settingsOf('lora', over)));
    const teAdapters = trainableShapes(m, settingsOf('lora', over)).filter((p) => p.name.startsWith('text_model.'));
    assert.equal(teAdapters.length, 2 * 4 * 2, 'lora_A and lora_B on q/k/v/out_proj of both CLIP layers');
    assert.equal(planned.peakBytes, await realPeakWithTextEncoder(over));
    await assert.rejects(dryRunPeak(dryGpu, model('lora', 'f32'), dataShape, settingsOf('lora', over)), /needs the text encoder's config/);
  });

  it("text-encoder LoRA at its own learning rate: its adapters get chunks of their own, and AdamW's first step moves them by that rate", async () => {
    const clip = readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'modules', 'clip_sd1.safetensors'))));
    const m = { ...model('lora', 'f32'), textEncoder: clipConfigFromJson(JSON.parse(clip.metadata.config)) };
    const lr = fixture('lora').settings.lr;
    const teLr = lr / 8;
    const over = { textEncoderLora: true, textEncoderLr: teLr };
    const gpu = await nodeGpu();
    try {
      const store = new MemoryChunkStore();
      const { trainer, fx } = await textEncoderTrainer(gpu, over, store);
      // The planner counts the chunks the trainer makes; no chunk mixes the two rates.
      assert.equal(trainer.optimizer.chunks.length, optimizerChunkCount(m, settingsOf('lora', over)));
      assert.equal((await dryRunPeak(dryGpu, m, dataShape, settingsOf('lora', over))).chunks, trainer.optimizer.chunks.length);
      for (const c of trainer.optimizer.chunks) {
        const te = c.params.map((p) => p.name.startsWith('text_model.'));
        assert.ok(
          te.every((x) => x === te[0]),
          `chunk ${c.index} mixes UNet and text-encoder adapters`,
        );
        assert.equal(c.lr, te[0] ? teLr : undefined, `chunk ${c.index}'s learning rate`);
      }
      // lora_B starts at zero, so AdamW's first update of it is lr * g / (|g| + eps) (bias-corrected moments
      // m = g, v = g^2; the decay of a zero weight is zero): +-lr wherever |g| >> eps. Its largest move is the
      // rate to ~1e-6 (eps / |g| and f32 rounding); 1e-4 relative allows for that and nothing near 8x.
      const before = new Map(await Promise.all([...trainer.trainable].map(async ([n, t]) => [n, await gpu.read(t)] as const)));
      assert.ok((await trainer.trainStep(fx.inputs[0])).applied);
      const largestMove = async (te: boolean) => {
        let max = 0;
        for (const [n, t] of trainer.trainable)
          if (n.includes('lora_B') === true && n.startsWith('text_model.') === te) {
            const after = await gpu.read(t);
            after.forEach((x, i) => (max = Math.max(max, Math.abs(x - before.get(n)![i]))));
          }
        return max;
      };
      const [unetMove, teMove] = [await largestMove(false), await largestMove(true)];
      assert.ok(Math.abs(unetMove / lr - 1) < 1e-4, `UNet lora_B moved at most ${unetMove}, lr ${lr}`);
      assert.ok(Math.abs(teMove / teLr - 1) < 1e-4, `text-encoder lora_B moved at most ${teMove}, its rate ${teLr}`);
      // A checkpoint resumes only at the rate it was made with.
      await trainer.checkpoint();
      trainer.destroy();
      const other = (await textEncoderTrainer(gpu, { ...over, textEncoderLr: lr / 2 }, store)).trainer;
      await assert.rejects(other.resume(), new RegExp(`made with textEncoderLr = ${teLr}, not ${lr / 2}`));
      other.destroy();
      const same = (await textEncoderTrainer(gpu, over, store)).trainer;
      assert.equal(await same.resume(), true);
      same.destroy();
    } finally {
      gpu.destroy();
    }
  });

  it('a generous budget: no checkpointing, every chunk resident, one dry run; its peak is the real one', async () => {
    const plan = await planTraining(dryGpu, model('full', 'f32'), dataShape, settingsOf('full'), 1 << 30);
    assert.equal(plan.fits, true);
    assert.equal(plan.activationCheckpointing, false);
    assert.equal(plan.residentChunks, plan.chunks);
    assert.equal(plan.chunks, optimizerChunkCount({ config: cfg }, settingsOf('full')));
    assert.equal(plan.tried.length, 1);
    assert.equal(plan.storeReadBytesPerStep, 0);
    assert.equal(plan.message, undefined);
    assert.equal(plan.peakBytes, await realPeak('full', 'f32', { activationCheckpointing: false, residentChunks: plan.residentChunks }));
  });

  for (const mode of ['full', 'lora'] as const)
    it(`${mode}: a budget between the checkpointed and the non-checkpointed peaks gets the placement with the fewest store bytes that fits`, async (t) => {
      const m = model(mode, 'f32');
      const s = settingsOf(mode);
      const least = await dryRunPeak(dryGpu, m, dataShape, { ...s, activationCheckpointing: true, residentChunks: 0 });
      const most = await dryRunPeak(dryGpu, m, dataShape, { ...s, activationCheckpointing: false, residentChunks: Infinity });
      assert.ok(least.peakBytes < most.peakBytes, `checkpointing and streaming save memory (${least.peakBytes} < ${most.peakBytes})`);
      const budget = Math.floor((least.peakBytes + most.peakBytes) / 2);
      const plan = await planTraining(dryGpu, m, dataShape, s, budget);
      t.diagnostic(
        `budget ${budget}: checkpointing ${plan.activationCheckpointing}, fused ${plan.fusedUpdates}, ${plan.residentChunks}/${plan.chunks} resident, peak ${plan.peakBytes} (${plan.tried.length} dry runs)`,
      );
      assert.equal(plan.fits, true);
      assert.ok(plan.peakBytes <= budget, `${plan.peakBytes} <= ${budget}`);
      assert.ok(plan.peakBytes < most.peakBytes);
      // Few dry runs: per checkpointing setting (and, full, fused or not) all / none resident, a predicted probe and
      // the count after it, then bisection over the resident count.
      const settingsTried = mode === 'full' ? 4 : 2;
      assert.ok(plan.tried.length <= settingsTried * (4 + Math.ceil(Math.log2(plan.chunks + 1))), `${plan.tried.length} dry runs`);
      await assertFewestStoreBytes(mode, plan, budget);
      // Streaming moves each streamed chunk's [master | m | v] in and out once per step.
      const streamed = plan.chunks - plan.residentChunks;
      assert.equal(plan.storeReadBytesPerStep > 0, streamed > 0);
      assert.equal(plan.storeReadBytesPerStep, plan.storeWriteBytesPerStep);
      const real = await realPeak(mode, 'f32', {
        activationCheckpointing: plan.activationCheckpointing,
        residentChunks: plan.residentChunks,
        fusedUpdates: plan.fusedUpdates,
      });
      assert.equal(plan.peakBytes, real, 'the chosen placement peaks where it was planned');
    });

  it('checkpointing wins when it streams less: a budget that fits every chunk only with checkpointing', async () => {
    const m = model('full', 'f32');
    const s = settingsOf('full');
    const lean = await dryRunPeak(dryGpu, m, dataShape, { ...s, activationCheckpointing: true, residentChunks: Infinity });
    const budget = lean.peakBytes;
    // The case this test is about: without checkpointing something fits too, but only by streaming.
    const fastNone = await dryRunPeak(dryGpu, m, dataShape, { ...s, activationCheckpointing: false, residentChunks: 0 });
    const fastAll = await dryRunPeak(dryGpu, m, dataShape, { ...s, activationCheckpointing: false, residentChunks: Infinity });
    assert.ok(
      fastNone.peakBytes <= budget && fastAll.peakBytes > budget,
      `no checkpointing fits only streamed (${fastNone.peakBytes}, ${fastAll.peakBytes} vs ${budget})`,
    );
    const plan = await planTraining(dryGpu, m, dataShape, s, budget);
    assert.equal(plan.fits, true);
    assert.equal(plan.activationCheckpointing, true);
    assert.equal(plan.residentChunks, plan.chunks);
    assert.equal(plan.storeReadBytesPerStep + plan.storeWriteBytesPerStep, 0);
  });

  it('fused updates are chosen when they keep more optimizer state on the GPU: a budget only fused updates fit without streaming', async () => {
    const m = model('full', 'f32');
    const s = settingsOf('full');
    const fusedAll = await dryRunPeak(dryGpu, m, dataShape, { ...s, activationCheckpointing: true, residentChunks: Infinity, fusedUpdates: true });
    const unfusedAll = await dryRunPeak(dryGpu, m, dataShape, { ...s, activationCheckpointing: true, residentChunks: Infinity });
    // The case: the gradient set the unfused step holds is what keeps the last chunks off the GPU.
    assert.ok(fusedAll.peakBytes < unfusedAll.peakBytes, `fused peak ${fusedAll.peakBytes} < unfused ${unfusedAll.peakBytes}`);
    const plan = await planTraining(dryGpu, m, dataShape, s, fusedAll.peakBytes);
    assert.equal(plan.fits, true);
    assert.equal(plan.fusedUpdates, true);
    assert.equal(plan.residentChunks, plan.chunks);
    assert.equal(plan.storeReadBytesPerStep + plan.storeWriteBytesPerStep, 0);
    // A generous budget streams nothing unfused: no extra pass is bought (one dry run).
    const roomy = await planTraining(dryGpu, m, dataShape, s, 1 << 30);
    assert.equal(roomy.fusedUpdates, false);
    assert.equal(roomy.tried.length, 1);
    // LoRA never fuses, whatever the budget.
    const lora = await planTraining(dryGpu, model('lora', 'f32'), dataShape, settingsOf('lora'), fusedAll.peakBytes);
    assert.equal(lora.fusedUpdates, false);
    assert.ok(lora.tried.every((t) => !t.fusedUpdates));
  });

  it('an impossible budget: fits false, the smallest placement, and how much memory is needed', async () => {
    const plan = await planTraining(dryGpu, model('full', 'f32'), dataShape, settingsOf('full'), 100_000);
    assert.equal(plan.fits, false);
    assert.equal(plan.activationCheckpointing, true);
    assert.equal(plan.residentChunks, 0);
    assert.equal(plan.peakBytes, Math.min(...plan.tried.map((t) => t.peakBytes)));
    assert.equal(plan.neededBytes, plan.peakBytes, 'the smallest budget that would fit');
    const mib = (plan.peakBytes / 2 ** 20).toFixed(2);
    assert.match(plan.message ?? '', new RegExp(`^tiny full DreamBooth needs at least ${mib} MiB of GPU memory at 64 px; the budget is 0\\.10 MiB`));
    assert.match(plan.message ?? '', /even with activation checkpointing, updates fused into the backward pass and every optimizer chunk streamed/);
  });

  // A dry run allocates every optimizer buffer and writes every stored chunk's bytes, but packs no starting state on the
  // host (that was a minute per dry run of full SD 1.5 in the compact default): the optimizer counts the chunks it
  // packed, and the count must be 0 in a dry run and every chunk in a real one (else the counter proves nothing).
  for (const [label, dtype, over] of [
    ['fp32 AdamW', 'f32', { optimizer: 'adamw', master: 'fp32' }],
    ['adamw8bit + compact master', 'f16', { optimizer: 'adamw8bit', master: 'compact' }],
  ] as const)
    it(`a dry run packs no optimizer state on the host (${label}, 2 chunks resident, the rest streamed); a real trainer packs every chunk`, async () => {
      const s = { ...over, activationCheckpointing: true, residentChunks: 2 };
      const dry = await dryRunPeak(dryGpu, model('full', dtype), dataShape, settingsOf('full', s));
      assert.ok(dry.chunks > 2 && dry.storeReadBytesPerStep > 0, `chunks are streamed (${dry.chunks} chunks)`);
      assert.equal(dry.hostPackedChunks, 0, 'chunks packed on the host in the dry run');
      const gpu = await nodeGpu();
      try {
        const { trainer, free } = await makeTrainer(gpu, dtype, 'full', new MemoryChunkStore(), s);
        assert.equal(trainer.optimizer.hostPackedChunks, dry.chunks, 'a real trainer packs every chunk');
        free();
      } finally {
        gpu.destroy();
      }
    });

  it("a full fine-tune's EMA is counted: 4 bytes per element held in the store, 8 moved per step, plus the streamed chunks' masters", async () => {
    const m = model('full', 'f32');
    const s = settingsOf('full', { activationCheckpointing: true, residentChunks: 2 });
    const off = await dryRunPeak(dryGpu, m, dataShape, s);
    const on = await dryRunPeak(dryGpu, m, dataShape, { ...s, ema: { ...EMA_DEFAULTS, decay: 0.9 } });
    const chunks = planChunks(trainableShapes(m, s), s.chunkElems);
    const elems = chunks.reduce((n, c) => n + c.elems, 0);
    // fp32 AdamW keeps [master | m | v] per streamed chunk: the EMA reads it whole for the masters
    const streamed = chunks.slice(2).reduce((n, c) => n + c.elems, 0);
    assert.ok(streamed > 0 && streamed < elems, `${streamed} of ${elems} elements streamed`);
    assert.equal(on.storeHeldBytes - off.storeHeldBytes, 4 * elems, 'the shadow held in the store');
    assert.equal(on.storeWriteBytesPerStep - off.storeWriteBytesPerStep, 4 * elems, 'the shadow written each step');
    assert.equal(on.storeReadBytesPerStep - off.storeReadBytesPerStep, 4 * elems + 12 * streamed, 'the shadow and the streamed masters read');
    // the EMA is on the host a chunk at a time: no GPU memory
    assert.equal(on.peakBytes, off.peakBytes);
  });

  it('base weights auto: f16 when it fits, int8 when only int8 fits; a LyCORIS network keeps f16 (it adds into them)', async () => {
    const m = model('lora', 'f16');
    const lora = settingsOf('lora');
    // An impossible budget reports each choice's smallest placement (checkpointing, everything streamed).
    const f16 = await planBaseWeights(dryGpu, m, dataShape, lora, 1, 'f16');
    const int8 = await planBaseWeights(dryGpu, m, dataShape, lora, 1, 'int8');
    assert.ok(int8.neededBytes! < f16.neededBytes!, `int8 needs less (${int8.neededBytes} vs ${f16.neededBytes})`);
    const between = Math.round((int8.neededBytes! + f16.neededBytes!) / 2); // f16 does not fit, int8 does
    const auto = await planBaseWeights(dryGpu, m, dataShape, lora, between, 'auto');
    assert.equal(auto.baseWeights, 'int8', auto.baseWeightsReason);
    assert.ok(auto.fits);
    assert.equal((await planBaseWeights(dryGpu, m, dataShape, lora, 1e12, 'auto')).baseWeights, 'f16', 'f16 when it fits');
    const loha = await planBaseWeights(dryGpu, m, dataShape, { ...lora, network: 'loha' }, between, 'auto');
    assert.equal(loha.baseWeights, 'f16');
    assert.match(loha.baseWeightsReason, /--network loha adds its delta into the base weights: f16/);
  });

  it('refuses a Gpu that is not a dry run', async () => {
    await assert.rejects(
      dryRunPeak(() => nodeGpu(), model('lora', 'f32'), dataShape, settingsOf('lora')),
      /needs a dry-run Gpu/,
    );
  });
});

describe('DryRunChunkStore (the planner accounting store)', () => {
  it('keeps sizes only, reads zeros of the written length, counts bytes, follows the key rules', async () => {
    const s = new DryRunChunkStore();
    await s.write('run/opt/c00001-v0', new Uint8Array(12).fill(7));
    await s.write('run/opt/c00000-v0', new Uint8Array(4));
    await s.write('run/opt/c00001-v0', new Uint8Array(24).fill(9)); // replace
    assert.deepEqual(await s.read('run/opt/c00001-v0'), new Uint8Array(24));
    assert.equal(await s.read('run/opt/none'), null);
    assert.deepEqual(await s.keys('run/opt/'), ['run/opt/c00000-v0', 'run/opt/c00001-v0']);
    assert.equal(await s.bytesUsed(), 28);
    assert.equal(s.bytesWritten, 40);
    assert.equal(s.bytesRead, 24);
    await s.delete('run/opt/c00000-v0');
    await s.delete('run/opt/c00000-v0');
    assert.equal(await s.bytesUsed(), 24);
    await assert.rejects(s.write('a/../b', new Uint8Array(1)), /'\.\.' segments are not allowed/);
    const q = new DryRunChunkStore('q', { quotaBytes: 10 });
    await assert.rejects(q.write('k', new Uint8Array(11)), { name: 'StorageFullError' });
    await s.close();
    await assert.rejects(s.read('run/opt/c00001-v0'), /closed/);
  });
});
