// Placement of a DreamBooth run under a GPU memory budget, chosen automatically.
//
// Two knobs trade speed for GPU memory:
//   activation checkpointing   each UNet block keeps only its inputs and re-runs its forward in the backward
//                              (about one more forward per step, much smaller activation peak);
//   resident optimizer chunks  the optimizer state of the first `residentChunks` chunks stays on the GPU (12
//                              bytes per trainable element in fp32 AdamW, ~4 in 8-bit AdamW + compact master);
//                              the rest stream through the chunk store (IndexedDB / files) every step via one
//                              staging set.
// The planner does not estimate: it builds the real trainer on a dry-run Gpu (every allocation accounted,
// nothing backed, no dispatch) and runs real train steps, so the peak it reports is the allocator's peak of
// the actual code path: weights, gradients, activations, optimizer chunks, staging, scratch (a LyCORIS layer's
// materialised ΔW, W + s ΔW and DoRA's squares, norms and W' among them); and the store
// bytes are what the real optimizer writes and reads (DryRunChunkStore counts them, keeps only sizes). The
// optimizer's create packs no starting state in a dry run (ChunkedAdamW.createDry: same allocations, same
// store keys and byte lengths, no values): packing it on the host took a minute per dry run of full SD 1.5
// in the compact default, and no dry-run figure depends on the values. A full SD 1.5 plan now takes seconds
// (compact) to about a minute (fp32 AdamW, whose streamed step copies 200 MB chunks on the host).
//
// Policy: the placement with the fewest store bytes per step that fits the budget. Storage is the slow
// resource (IndexedDB moves ~100-300 MB/s; one streamed full-SD 1.5 step moved ~20 GB), while checkpointing
// costs about one more forward per step, so for each checkpointing setting the planner finds the most
// resident chunks that fit (least store traffic), and takes the setting that streams less; on a tie (both
// stream nothing, or the same chunks) no checkpointing wins (no recompute). No checkpointing with every
// chunk resident is tried first and ends the search when it fits. The peak grows with the resident count
// (each resident chunk adds its state; streaming adds one staging set the size of the largest streamed
// chunk), so the most resident chunks that fit are found by a search over the count: all resident, none
// resident, then a first probe where the chunk layout predicts the limit (and the count after it), then
// bisection. Every answer is a measured dry run; the prediction only orders the probes. Typically 4 dry
// runs per setting, at most 4 + log2(chunks).
import type { Gpu } from '../gpu/device.ts';
import type { DType } from '../gpu/tensor.ts';
import type { ClipTextConfig } from '../nn/clip.ts';
import type { UnetConfig } from '../nn/unet.ts';
import { clipParams, unetParams } from '../models/shapes.ts';
import { sdxlTextEncoder2Params } from '../models/sdxl.ts';
import { SD_SCHEDULE, type ScheduleConfig } from '../sample/schedulers.ts';
import { DryRunChunkStore } from '../store/dryrun-store.ts';
import { formatBytes } from '../util/bytes.ts';
import { planChunks, type ParamSpec } from './optimizer-chunks.ts';
import { FP32_MODE, stateBytesPerElement } from './packed-state.ts';
import { isHostOptimizer } from './host-optimizer.ts';
import { trainableSpec } from './trainable.ts';
import { unbackedInt8 } from '../ops/int8.ts';
import { DreamBoothTrainer, type TrainData, type TrainSettings } from './trainer.ts';

const GiB = 2 ** 30;

export interface PlanModel {
  config: UnetConfig;
  /** Weight and activation dtype of the run (the Gpu's computeDType in practice). */
  dtype: DType;
  /** The noise schedule; its prediction type matters (v-prediction allocates the v target). Default SD's epsilon. */
  schedule?: ScheduleConfig;
  /** For messages, e.g. "SD 1.5". */
  name?: string;
  /** The text encoder's config: needed with textEncoderLora (it then stays on the GPU and runs every step). */
  textEncoder?: ClipTextConfig;
  /** SDXL's second text encoder's config: needed with textEncoderLora on SDXL (both encoders then train). */
  textEncoder2?: ClipTextConfig;
  /**
   * How the UNet's frozen weights are stored in a LoRA run: 'f16' (the run's dtype; default) or 'int8' (every weight
   * of 2 or more dims in int8 with per-channel scales, src/ops/int8.ts: the planner assumes each round-trips).
   */
  baseWeights?: BaseWeights;
}

/** Storage of a LoRA run's frozen UNet weights (src/ops/int8.ts). 'f16' is the run's dtype (f32 without shader-f16). */
export type BaseWeights = 'f16' | 'int8';

export interface PlanDataShape {
  /** One latent [C, h, w] (512 px: [4, 64, 64]). */
  latentShape: [number, number, number];
  /** One text embedding [tokens, width] (SD 1.5: [77, 768]). */
  contextShape: [number, number];
  /** Prior preservation: every step's batch is an instance and a class sample (batch 2). */
  withClass: boolean;
  /** Image pixels per latent pixel, for messages (the VAE's factor: 8 for SD). */
  vaeFactor?: number;
  /** Some photo has a loss mask (each step then holds a [B, h, w] f32 mask). */
  masked?: boolean;
  /**
   * The instance photos' largest aspect-ratio bucket's latent shape, when they train at buckets (a step then runs
   * the photo and the class image as two passes); absent: latentShape.
   */
  instanceShape?: [number, number, number];
}

/** One configuration that was dry-run. */
export interface PlanTrial {
  activationCheckpointing: boolean;
  residentChunks: number;
  /** Optimizer updates fused into the backward pass (full fine-tuning; see TrainSettings.fusedUpdates). */
  fusedUpdates: boolean;
  peakBytes: number;
}

export interface Plan extends PlanTrial {
  /** peakBytes <= budget. */
  fits: boolean;
  budgetBytes: number;
  /** Optimizer chunks in all (residentChunks of them on the GPU). */
  chunks: number;
  /**
   * Bytes the run reads from and writes to the store per applied step with this placement: the optimizer's
   * streamed chunks, and a full fine-tune's EMA (ema-store.ts: 8 bytes per element, plus the masters of streamed chunks).
   */
  storeReadBytesPerStep: number;
  storeWriteBytesPerStep: number;
  /** Bytes the run keeps in the store between steps: streamed optimizer chunks and a full fine-tune's EMA (4 bytes per element). */
  storeHeldBytes: number;
  /**
   * The chosen placement's peak per allocator tag (weights, activations, gradients, optimizer, scratch): each
   * tag's own highest point in the step, not necessarily at the moment of the total peak.
   */
  peakByTag: Record<string, number>;
  /** Every configuration dry-run, in the order tried. */
  tried: PlanTrial[];
  /** Why nothing fits, and the least memory the run needs. */
  message?: string;
  /** When nothing fits: the smallest budget that would (the least peak of any placement). */
  neededBytes?: number;
}

/** What one dry run measured. */
export interface DryRunResult extends PlanTrial {
  chunks: number;
  storeReadBytesPerStep: number;
  storeWriteBytesPerStep: number;
  storeHeldBytes: number;
  peakByTag: Record<string, number>;
  /** Optimizer chunks whose starting state was packed on the host: 0 (a dry run allocates and counts, it packs nothing). */
  hostPackedChunks: number;
}

// ---------------------------------------------------------------------------------------------- dry run

type ChunkSettings = Pick<TrainSettings, 'mode' | 'rank' | 'chunkElems' | 'textEncoderLora' | 'lr' | 'textEncoderLr'>;

/**
 * Trainable parameter shapes in the trainer's order (trainable.ts, the trainer's own trainableSpec): the
 * optimizer packs its chunks in this order, with the text encoder's adapters at their own rate where it differs.
 */
export function trainableShapes(model: Pick<PlanModel, 'config' | 'textEncoder' | 'textEncoder2'>, settings: Omit<ChunkSettings, 'chunkElems'>): ParamSpec[] {
  const withTe = settings.mode === 'lora' && settings.textEncoderLora;
  const te = withTe ? textEncoderOf(model) : undefined;
  return trainableSpec(model.config, te, settings, withTe ? model.textEncoder2 : undefined).flatMap((g) => g.params);
}

/** Number of optimizer chunks the trainer will make for these settings. */
export function optimizerChunkCount(model: Pick<PlanModel, 'config' | 'textEncoder' | 'textEncoder2'>, settings: ChunkSettings): number {
  return planChunks(trainableShapes(model, settings), settings.chunkElems).length;
}

function textEncoderOf(model: Pick<PlanModel, 'textEncoder'>): ClipTextConfig {
  if (!model.textEncoder) throw new Error("planning text-encoder LoRA needs the text encoder's config (PlanModel.textEncoder)");
  return model.textEncoder;
}

/**
 * Zero latents, embeddings and token ids of the run's shapes: one instance sample (+ one class sample); for an
 * SDXL UNet (text_time) also the pooled embedding, tokenizer-2 ids and time ids.
 */
function dryData(d: PlanDataShape, unet: UnetConfig): TrainData {
  const [c, h, w] = d.latentShape;
  const [l, e] = d.contextShape;
  const tt = unet.textTime;
  const sdxl = () =>
    tt ? { pooled: new Float32Array(tt.projectionInputDim - 6 * tt.timeEmbedDim), ids2: new Int32Array(l), timeIds: Float32Array.of(h, w, 0, 0, h, w) } : {};
  const sample = () => ({ latent: new Float32Array(c * h * w), context: new Float32Array(l * e), ids: new Int32Array(l), ...sdxl() });
  const [, ih, iw] = d.instanceShape ?? d.latentShape;
  const bucketed = d.instanceShape && (ih !== h || iw !== w);
  const instance = {
    ...sample(),
    ...(bucketed ? { latent: new Float32Array(c * ih * iw), latentShape: d.instanceShape } : {}),
    ...(d.masked ? { mask: new Float32Array(ih * iw) } : {}),
  };
  return { latentShape: d.latentShape, contextShape: d.contextShape, instance: [instance], classes: d.withClass ? [sample()] : [] };
}

/**
 * Peak GPU bytes of training with `settings` (its activationCheckpointing and residentChunks), measured by
 * building the real trainer on a fresh dry-run Gpu from `makeGpu` and running real steps. The optimizer's
 * staging set is made lazily by the first step that streams, so with streamed chunks a second step is run:
 * the peak is the larger of the two (the steady state).
 */
export async function dryRunPeak(makeGpu: () => Promise<Gpu>, model: PlanModel, dataShape: PlanDataShape, settings: TrainSettings): Promise<DryRunResult> {
  const gpu = await makeGpu();
  try {
    if (!gpu.dryRun) throw new Error('the training planner needs a dry-run Gpu (e.g. nodeGpu({ dryRun: true }) or Gpu.create(..., { dryRun: true }))');
    // Unbacked weights of every tensor the run keeps on the GPU: the UNet, and the text encoder when it trains.
    const unbacked = (shapes: Map<string, number[]>) => new Map([...shapes].map(([name, shape]) => [name, gpu.tensor(shape, model.dtype, 'weights', name)]));
    const int8 = settings.mode === 'lora' && model.baseWeights === 'int8';
    const weights = new Map(
      [...unetParams(model.config)].map(([name, shape]) => [
        name,
        int8 && shape.length >= 2 ? unbackedInt8(gpu, shape, model.dtype, name) : gpu.tensor(shape, model.dtype, 'weights', name),
      ]),
    );
    const withTe = settings.mode === 'lora' && settings.textEncoderLora;
    const te = withTe ? { config: textEncoderOf(model), weights: unbacked(clipParams(textEncoderOf(model))) } : undefined;
    const te2Config = withTe ? model.textEncoder2 : undefined;
    const te2 = te2Config ? { config: te2Config, weights: unbacked(sdxlTextEncoder2Params(te2Config)) } : undefined;
    const store = new DryRunChunkStore();
    const s: TrainSettings = { ...settings, checkpointEvery: 0 };
    const trainerModel = {
      config: model.config,
      weights,
      schedule: model.schedule ?? SD_SCHEDULE,
      ...(te ? { textEncoder: te } : {}),
      ...(te2 ? { textEncoder2: te2 } : {}),
    };
    const trainer = await DreamBoothTrainer.create(gpu, trainerModel, dryData(dataShape, model.config), s, store, 'plan');
    // Prodigy and Adafactor keep their state on the host: one chunk, nothing on the GPU or in the store.
    const opt = trainer.hostOptimizer ?? trainer.optimizer;
    const steps = opt.storedChunks > 0 ? 2 : 1;
    let peak = 0;
    const byTag: Record<string, number> = {};
    for (let i = 0; i < steps; i++) {
      store.resetCounters();
      const r = await trainer.trainStep();
      if (!r.applied) throw new Error(`dry-run step ${i + 1} was not applied (${r.skipped ?? 'no reason given'}): the plan would miss the optimizer's memory`);
      if (r.gpuPeakBytes >= peak) {
        peak = r.gpuPeakBytes;
        for (const [t, v] of Object.entries(gpu.allocator.report().byTag)) byTag[t] = v.peak;
      }
    }
    const result: DryRunResult = {
      activationCheckpointing: settings.activationCheckpointing,
      residentChunks: Math.min(settings.residentChunks, opt.chunks.length),
      fusedUpdates: settings.mode === 'full' && !!settings.fusedUpdates,
      peakBytes: peak,
      chunks: opt.chunks.length,
      storeReadBytesPerStep: store.bytesRead,
      storeWriteBytesPerStep: store.bytesWritten,
      storeHeldBytes: await store.bytesUsed(),
      peakByTag: byTag,
      hostPackedChunks: opt.hostPackedChunks,
    };
    trainer.destroy();
    return result;
  } finally {
    gpu.destroy();
  }
}

// ---------------------------------------------------------------------------------------------- policy

/** Bytes the optimizer moves through the store (read + written) per applied step. */
export const storeBytesPerStep = (r: Pick<DryRunResult, 'storeReadBytesPerStep' | 'storeWriteBytesPerStep'>) =>
  r.storeReadBytesPerStep + r.storeWriteBytesPerStep;

/** "3.75 GiB"; MiB below a tenth of a GiB (tiny test models), so the figure never reads 0.00. */
const gib = (n: number) => formatBytes(n, { digits: 2, unit: n >= GiB / 10 ? 'GiB' : 'MiB' });

function describeRun(model: PlanModel, s: TrainSettings): string {
  const network = s.network && s.network !== 'lora' ? `${s.network}${s.dora ? ' + DoRA' : ''} ` : '';
  const kind = s.mode === 'full' ? 'full DreamBooth' : `${network}LoRA DreamBooth (rank ${s.rank}${s.textEncoderLora ? ', text encoder too' : ''})`;
  return `${model.name ? `${model.name} ` : ''}${kind}`;
}

/**
 * The largest resident count whose peak the chunk layout predicts to fit, from the measured all-streamed
 * peak: each resident chunk adds its state, and the staging set shrinks to the largest chunk still streamed.
 * Only a starting point for the search (the answer is always measured).
 */
export function predictResident(chunkElems: number[], streamedPeak: number, budgetBytes: number, bytesPerElem = 12): number {
  const maxFrom = (r: number) => Math.max(0, ...chunkElems.slice(r));
  let best = 0;
  let resident = 0;
  for (let r = 1; r < chunkElems.length; r++) {
    resident += chunkElems[r - 1];
    const peak = streamedPeak + bytesPerElem * (resident + maxFrom(r) - maxFrom(0));
    if (peak <= budgetBytes) best = r;
  }
  return best;
}

/**
 * Picks the placement with the fewest store bytes per step whose peak fits `budgetBytes` (no checkpointing
 * on a tie; see the file comment), by dry runs of the real trainer. `settings`' own activationCheckpointing and residentChunks are ignored: they are
 * what is being chosen. When nothing fits, `fits` is false, the plan is the smallest one tried, and
 * `message` says how much memory the run needs.
 */
export async function planTraining(
  makeGpu: () => Promise<Gpu>,
  model: PlanModel,
  dataShape: PlanDataShape,
  settings: TrainSettings,
  budgetBytes: number,
  /** 'auto': fuse when it streams strictly less (the product's rule); 'never': the unfused placement only (a benchmark's baseline). */
  fuse: 'auto' | 'never' = 'auto',
): Promise<Plan> {
  const layout = planChunks(trainableShapes(model, settings), settings.chunkElems).map((c) => c.elems);
  const chunks = layout.length;
  const tried: DryRunResult[] = [];
  const measure = async (activationCheckpointing: boolean, residentChunks: number, fusedUpdates: boolean) => {
    const r = await dryRunPeak(makeGpu, model, dataShape, { ...settings, activationCheckpointing, residentChunks, fusedUpdates });
    tried.push(r);
    return r;
  };
  const plan = (r: DryRunResult, fits: boolean, message?: string): Plan => ({
    ...(fits ? {} : { neededBytes: r.peakBytes }),
    activationCheckpointing: r.activationCheckpointing,
    residentChunks: r.residentChunks,
    fusedUpdates: r.fusedUpdates,
    peakBytes: r.peakBytes,
    fits,
    budgetBytes,
    chunks: r.chunks,
    storeReadBytesPerStep: r.storeReadBytesPerStep,
    storeWriteBytesPerStep: r.storeWriteBytesPerStep,
    storeHeldBytes: r.storeHeldBytes,
    peakByTag: r.peakByTag,
    tried: tried.map(({ activationCheckpointing, residentChunks, fusedUpdates, peakBytes }) => ({
      activationCheckpointing,
      residentChunks,
      fusedUpdates,
      peakBytes,
    })),
    ...(message ? { message } : {}),
  });

  // The most resident chunks that fit with this checkpointing setting (and fusing), or null when nothing does.
  const mostResident = async (ckpt: boolean, fused: boolean): Promise<DryRunResult | null> => {
    const all = await measure(ckpt, chunks, fused);
    if (all.peakBytes <= budgetBytes) return all;
    const none = await measure(ckpt, 0, fused);
    if (none.peakBytes > budgetBytes) return null;
    // Invariant: `lo` resident chunks fit, `hi` do not.
    let best = none;
    let lo = 0;
    let hi = chunks;
    const probe = async (n: number) => {
      const r = await measure(ckpt, n, fused);
      if (r.peakBytes <= budgetBytes) {
        lo = n;
        best = r;
      } else hi = n;
    };
    // The state's bytes per element in the run's optimizer mode (12 for fp32 AdamW, ~4 for 8-bit + compact).
    const guess = predictResident(
      layout,
      none.peakBytes,
      budgetBytes,
      stateBytesPerElement(isHostOptimizer(settings.optimizer) ? FP32_MODE : { optimizer: settings.optimizer, master: settings.master }, model.dtype),
    );
    for (const n of [guess, guess + 1]) if (n > lo && n < hi) await probe(n);
    while (hi - lo > 1) await probe((lo + hi) >> 1);
    return best;
  };
  // The placement with the fewest store bytes among `fused`'s (no checkpointing on a tie), or null.
  const bestOf = async (fused: boolean): Promise<DryRunResult | null> => {
    const fast = await mostResident(false, fused);
    if (fast && storeBytesPerStep(fast) === 0) return fast;
    const lean = await mostResident(true, fused);
    // Checkpointing only when it streams strictly less.
    return fast && lean ? (storeBytesPerStep(lean) < storeBytesPerStep(fast) ? lean : fast) : (fast ?? lean);
  };
  // Fused updates cost one more forward and backward per step but free the gradient set, so more optimizer
  // chunks stay on the GPU: they are tried when the unfused placement streams or does not fit, and chosen
  // only when they stream strictly less (a store byte costs far more time than the GPU's extra pass: at the
  // IndexedDB rates bench:train measures, 1 GB is seconds; SD 1.5's extra pass on a GPU is well under one).
  // `settings.fusedUpdates` on asks for them always; LoRA never fuses (its gradients are small).
  const canFuse = settings.mode === 'full';
  let best = settings.fusedUpdates && canFuse ? await bestOf(true) : await bestOf(false);
  if (canFuse && fuse === 'auto' && !settings.fusedUpdates && (!best || storeBytesPerStep(best) > 0)) {
    const fused = await bestOf(true);
    if (fused && (!best || storeBytesPerStep(fused) < storeBytesPerStep(best))) best = fused;
  }
  if (best) return plan(best, true);
  // Nothing fits: report the smallest configuration (checkpointing, everything streamed).
  const least = tried.reduce((a, b) => (b.peakBytes < a.peakBytes ? b : a));
  const px = dataShape.latentShape[1] * (dataShape.vaeFactor ?? 8);
  const message =
    `${describeRun(model, settings)} needs at least ${gib(least.peakBytes)} of GPU memory at ${px} px; the budget is ${gib(budgetBytes)} ` +
    `(${model.dtype}, batch ${dataShape.withClass ? 2 : 1}, even with activation checkpointing${canFuse ? ', updates fused into the backward pass' : ''} and every optimizer chunk streamed through storage)`;
  return plan(least, false, message);
}

/** A plan with the base-weight storage it chose. */
export interface BasePlan extends Plan {
  baseWeights: BaseWeights;
  /** Why that storage: for the run's log and the page. */
  baseWeightsReason: string;
}

/**
 * The planner under a base-weight choice: 'f16' or 'int8' as asked; 'auto' keeps f16 when it fits the budget and
 * otherwise plans int8 (frozen weights at about half the bytes), keeping it when it fits or needs less. Full
 * fine-tuning trains every weight, and a LyCORIS network adds its delta into the base weights, so both are always f16
 * (asking for int8 there is refused by the settings).
 */
export async function planBaseWeights(
  makeGpu: () => Promise<Gpu>,
  model: PlanModel,
  dataShape: PlanDataShape,
  settings: TrainSettings,
  budgetBytes: number,
  choice: BaseWeights | 'auto',
): Promise<BasePlan> {
  const run = (baseWeights: BaseWeights) => planTraining(makeGpu, { ...model, baseWeights }, dataShape, settings, budgetBytes);
  // A LyCORIS network adds its delta into the frozen weight's tensor (nn/lycoris.ts), which int8 cannot hold.
  const lycoris = settings.network !== undefined && settings.network !== 'lora';
  if (settings.mode !== 'lora' || choice === 'f16' || lycoris)
    return {
      ...(await run('f16')),
      baseWeights: 'f16',
      baseWeightsReason:
        choice === 'f16'
          ? 'f16 base weights as asked'
          : lycoris
            ? `--network ${settings.network} adds its delta into the base weights: f16`
            : 'full fine-tuning trains every weight: f16',
    };
  if (choice === 'int8') return { ...(await run('int8')), baseWeights: 'int8', baseWeightsReason: 'int8 base weights as asked' };
  const f16 = await run('f16');
  if (f16.fits) return { ...f16, baseWeights: 'f16', baseWeightsReason: `f16 base weights fit the budget (peak ${gib(f16.peakBytes)} of ${gib(budgetBytes)})` };
  const int8 = await run('int8');
  if (int8.fits)
    return {
      ...int8,
      baseWeights: 'int8',
      baseWeightsReason: `f16 base weights need ${gib(f16.peakBytes)}, over the budget of ${gib(budgetBytes)}: int8 base weights (peak ${gib(int8.peakBytes)})`,
    };
  // Neither fits: the f16 plan's refusal, with what int8 base weights would need.
  const message = `${f16.message ?? ''} (with int8 base weights: ${gib(int8.peakBytes)})`;
  return { ...f16, message, baseWeights: 'f16', baseWeightsReason: 'neither f16 nor int8 base weights fit the budget' };
}
