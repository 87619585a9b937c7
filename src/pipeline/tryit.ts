// "Try it" (issue 15): a trained run's model next to its base model, for the same prompt and seed. The
// studio's panel (ui/studio/TryIt.tsx, through the worker) and any host with a TrainingRun call
// TrainingRun.tryIt, which runs this while the run is paused or done (never during a step: the GPU state is
// the run's).
//
//   fine-tuned: the model as trained, through txt2img (DPM-Solver++ 2M, CFG); a LoRA run scales its adapters
//               by loraScale x strength (UNet and, when trained, text encoder).
//   base:       LoRA: the same weight maps seen without their adapters (nothing reloaded; exactly the base,
//               the same as strength 0). Full fine-tune: the base UNet read again from the model's source into
//               temporary tensors, used for this image and freed (see baseUnet).
//
// Both PNGs carry their generation parameters the way AUTOMATIC1111 writes them (sample/parameters.ts).
// The trained weights, the optimizer's masters and the run's checkpoint are only read, never written.
import type { Gpu } from '../gpu/device.ts';
import type { DType, Tensor } from '../gpu/tensor.ts';
import type { ClipTokenizer } from '../io/tokenizer.ts';
import type { LoadedModel } from '../models/load.ts';
import type { Component } from '../models/detect.ts';
import type { ModelSource } from '../models/source.ts';
import { formatParameters, modelNameOf, pngWithParameters, type GenerationParameters } from '../sample/parameters.ts';
import type { ScheduleConfig } from '../sample/schedulers.ts';
import { checkTxt2ImgOptions, txt2img, type Txt2ImgOptions } from '../sample/txt2img.ts';
import { RunError, validatePrompt, type TrainMode } from './settings.ts';

export interface TryItOptions {
  prompt: string;
  negativePrompt?: string;
  /** Denoising steps (DPM-Solver++ 2M). */
  steps: number;
  /** Classifier-free guidance scale (A1111's "CFG scale"). */
  guidance: number;
  seed: number;
  /** LoRA runs: a multiple of the run's alpha / rank (1: as trained, 0: the base). Ignored by full fine-tunes. */
  strength?: number;
  /** Denoising steps done of both images together (`total` = 2 x steps: fine-tuned first, then base). */
  onStep?: (done: number, total: number) => void;
}

export interface TryItImage {
  png: Uint8Array;
  /** The PNG's "parameters" text (A1111's infotext). */
  parameters: string;
}

export interface TryItResult {
  /** The run's step the fine-tuned image was drawn at. */
  step: number;
  width: number;
  height: number;
  /** The LoRA strength used; null for a full fine-tune. */
  strength: number | null;
  base: TryItImage;
  tuned: TryItImage;
  seconds: number;
}

/** What tryIt needs of a run (TrainingRun hands it over). */
export interface TryItRun {
  gpu: Gpu;
  model: LoadedModel;
  /** The opened model's source (kept open by the run): the base weights a full fine-tune re-reads. */
  source: ModelSource;
  tokenizer: ClipTokenizer;
  schedule: ScheduleConfig;
  mode: TrainMode;
  step: number;
  appliedSteps: number;
  /** alpha / rank (1 for a full fine-tune). */
  loraScale: number;
  resolution: number;
  /** The base model's name (A1111's "Model"). */
  baseName: string;
  /** The fine-tuned result's name: the LoRA's (in `<lora:NAME:..>`) or the full checkpoint's. */
  tunedName: string;
  /** A LoRA's sshs_model_hash (export/addnet-hash.ts), for A1111's "Lora hashes". */
  tunedHash?: string;
}

/** The strongest LoRA strength accepted (A1111 takes any; past a few times the trained scale images break up). */
export const MAX_STRENGTH = 10;

/** Refusals that need no GPU: no finished step, a bad prompt, steps, guidance, seed or strength. */
export function checkTryIt(
  run: Pick<TryItRun, 'mode' | 'step' | 'appliedSteps' | 'resolution'> & { model: Pick<LoadedModel, 'vae' | 'unet'> },
  o: TryItOptions,
): void {
  if (run.step === 0)
    throw new RunError('Try it needs a finished training step: this run has none yet (the fine-tuned model is still the base model). Train at least one step.');
  if (run.appliedSteps === 0)
    throw new RunError(
      `none of this run's ${run.step} steps changed the weights (every update was skipped as non-finite): the fine-tuned model is the base model, so there is nothing to try`,
    );
  validatePrompt(o.prompt, 'the prompt');
  checkTxt2ImgOptions(run.model, { steps: o.steps, guidance: o.guidance, seed: o.seed, width: run.resolution, height: run.resolution });
  if (run.mode === 'lora' && o.strength !== undefined && !(Number.isFinite(o.strength) && Math.abs(o.strength) <= MAX_STRENGTH))
    throw new RunError(`the LoRA strength must be a number from -${MAX_STRENGTH} to ${MAX_STRENGTH} (1: as trained, 0: the base model), got ${o.strength}`);
}

/** A model's weights by component, read on demand (an SD ModelSource or an SdxlSource). */
interface PartSource<C extends string> {
  shapes(c: C): Map<string, readonly number[]>;
  read(c: C, name: string): Promise<{ data: Float32Array }>;
}

/** Uploads a component's tensors (those `keep` names) from the source in `dtype` (the compute dtype); all or nothing. */
export async function uploadPart<C extends string>(
  gpu: Gpu,
  source: PartSource<C>,
  c: C,
  keep: (name: string) => boolean = () => true,
  dtype: DType = gpu.computeDType,
): Promise<Map<string, Tensor>> {
  const out = new Map<string, Tensor>();
  try {
    for (const [name, shape] of source.shapes(c)) {
      if (!keep(name)) continue;
      const { data } = await source.read(c, name);
      out.set(name, gpu.upload(data, shape, dtype, 'weights', `base ${name}`));
    }
    return out;
  } catch (e) {
    gpu.free(...out.values());
    throw e;
  }
}

/** A weight map without LoRA adapters (a view: the tensors are the same objects). */
export function withoutAdapters(w: Map<string, Tensor>): Map<string, Tensor> {
  return new Map([...w].filter(([n]) => !/\.lora_[AB]\.weight$/.test(n)));
}

/**
 * The base UNet of a full fine-tune: its weights read again from the model's source into temporary tensors.
 * This costs one more UNet in the compute dtype on the GPU (1.7 GB for SD 1.5 in f16) for the base image;
 * a paused or finished run holds no training activations then, which in the plan are larger than that at
 * 512 px. The alternative, writing the base into the trained tensors and restoring them from the optimizer's
 * masters afterwards, would save the memory but rewrite the trained state: in the compact modes the compute
 * copy is the master's high half (train/packed-state.ts) and would have to be re-derived bit for bit, and a
 * failure half-way would leave the run damaged. Reading from the source leaves the trained state untouched.
 */
function baseUnet(run: TryItRun): Promise<Map<string, Tensor>> {
  return uploadPart<Component>(run.gpu, run.source, 'unet');
}

/** The sampling of Try it's images at the run's resolution: the fine-tuned one first (offset 0), then the base (offset steps). */
export function tryItSampling(o: TryItOptions, size: number, schedule: ScheduleConfig, loraScale: number, offset: number): Txt2ImgOptions {
  return {
    prompt: o.prompt,
    negativePrompt: o.negativePrompt ?? '',
    steps: o.steps,
    guidance: o.guidance,
    seed: o.seed,
    width: size,
    height: size,
    sampler: 'dpm++2m',
    schedule,
    loraScale,
    onStep: (i) => o.onStep?.(offset + i, 2 * o.steps),
  };
}

type Image = { rgb: Uint8Array; width: number; height: number };

/**
 * Both images as PNGs with A1111's parameters: a LoRA run's (strength not null) fine-tuned image names the LoRA
 * in the prompt, a full fine-tune's names the fine-tuned checkpoint as its model.
 */
export function tryItResult(
  run: Pick<TryItRun, 'step' | 'baseName' | 'tunedName' | 'tunedHash'>,
  o: TryItOptions,
  tuned: Image,
  base: Image,
  strength: number | null,
  t0: number,
): TryItResult {
  const params: GenerationParameters = {
    prompt: o.prompt,
    negativePrompt: o.negativePrompt ?? '',
    steps: o.steps,
    guidance: o.guidance,
    seed: o.seed,
    width: tuned.width,
    height: tuned.height,
    sampler: 'dpm++2m',
    model: run.baseName,
  };
  const tunedParams = formatParameters(
    strength !== null ? { ...params, lora: { name: run.tunedName, strength, hash: run.tunedHash } } : { ...params, model: modelNameOf(run.tunedName) },
  );
  const baseParams = formatParameters(params);
  return {
    step: run.step,
    width: tuned.width,
    height: tuned.height,
    strength,
    tuned: { png: pngWithParameters(tuned.rgb, tuned.width, tuned.height, tunedParams), parameters: tunedParams },
    base: { png: pngWithParameters(base.rgb, base.width, base.height, baseParams), parameters: baseParams },
    seconds: (performance.now() - t0) / 1000,
  };
}

/** Fine-tuned and base images for the same prompt and seed (see the file's head). */
export async function generateTryIt(run: TryItRun, o: TryItOptions): Promise<TryItResult> {
  checkTryIt(run, o);
  const { gpu, model } = run;
  const t0 = performance.now();
  const lora = run.mode === 'lora';
  const strength = lora ? (o.strength ?? 1) : null;
  const size = run.resolution;
  const temporary: Map<string, Tensor>[] = [];
  try {
    // The VAE decoder and text encoder stay on the GPU only when the run samples (pipeline/run.ts
    // releaseFor): otherwise they come from the source for this call.
    const vae = model.vae.weights.size ? model.vae.weights : await uploadPart(gpu, run.source, 'vae', (n) => !/^(encoder|quant_conv)\./.test(n));
    const textEncoder = model.textEncoder.weights.size ? model.textEncoder.weights : await uploadPart(gpu, run.source, 'text_encoder');
    for (const w of [vae, textEncoder]) if (w !== model.vae.weights && w !== model.textEncoder.weights) temporary.push(w);
    const withWeights = (unet: Map<string, Tensor>, te: Map<string, Tensor>): LoadedModel => ({
      ...model,
      unet: { config: model.unet.config, weights: unet },
      vae: { config: model.vae.config, weights: vae },
      textEncoder: { config: model.textEncoder.config, weights: te },
    });
    const steps = o.steps;
    const draw = (m: LoadedModel, loraScale: number, offset: number) => txt2img(gpu, m, run.tokenizer, tryItSampling(o, size, run.schedule, loraScale, offset));
    o.onStep?.(0, 2 * steps);
    const tuned = await draw(withWeights(model.unet.weights, textEncoder), run.loraScale * (strength ?? 1), 0);
    let base: Awaited<ReturnType<typeof txt2img>>;
    if (lora) base = await draw(withWeights(withoutAdapters(model.unet.weights), withoutAdapters(textEncoder)), 1, steps);
    else {
      const unet = await baseUnet(run);
      temporary.push(unet);
      base = await draw(withWeights(unet, textEncoder), 1, steps);
    }
    return tryItResult(run, o, tuned, base, strength, t0);
  } finally {
    for (const w of temporary) gpu.free(...w.values());
    // What the two images left in the allocator's pool goes back to the device: training continues
    // within the plan.
    gpu.trimPool();
  }
}
