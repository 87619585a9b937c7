// Results brought back from other trainers (issue 17): a LoRA written by diffusers' train_dreambooth_lora.py
// (`pytorch_lora_weights.safetensors`: PEFT `unet.<module>.lora_A/B.weight`, the older `lora.down/up` and
// attention-processor `to_q_lora.down/up` spellings, `text_encoder.` keys, `.alpha` network alphas) or by
// kohya sd-scripts (lora_unet_* / lora_te_*), put onto a base model for sampling and exported in our
// formats; a full diffusers folder (train_dreambooth.py's output) is itself a model and exports with no LoRA.
// Host-neutral: the command line (cli/sample.ts, cli/export.ts) and the studio worker both use these.
//
//   readImportedLora(file)            export/lora.ts readLora: layouts, ranks, alphas; foreign keys refused
//   checkImportedLora(lora, shapes)   every adapted layer exists in the base with the adapter's in/out widths
//   applyLora(gpu, model, lora)       adapters uploaded next to the base weights (the engine's PEFT names);
//                                     the UNet and text encoder then run them with loraScale = lora.scale
//   exportImported(...)               kohya / PEFT LoRA files, or the base with the LoRA merged
//                                     (W + scale B A) as a single file or a diffusers zip
//   tryLora(gpu, opened, lora, ...)   the studio's "Try it": one image of the base with the LoRA
import type { Gpu } from '../gpu/device.ts';
import type { Tensor } from '../gpu/tensor.ts';
import type { ByteSink, SafetensorsFile } from '../io/safetensors.ts';
import type { TensorProvider } from '../io/tensor-provider.ts';
import type { LoadedModel } from '../models/load.ts';
import { countBadValues, loadModel } from '../models/load.ts';
import { openDiffusers, openSingleFile, type Json, type ModelSource } from '../models/source.ts';
import { ClipTokenizer } from '../io/tokenizer.ts';
import { scheduleFromJson, SD_SCHEDULE } from '../sample/schedulers.ts';
import { txt2img } from '../sample/txt2img.ts';
import { writeSingleFile, zipDiffusers } from '../export/full.ts';
import {
  adapterTensors,
  checkLoraForModel,
  readLora,
  writeKohyaLora,
  writePeftLora,
  type LoraComponent,
  type LoraInfo,
  type ReadLora,
} from '../export/lora.ts';
import { mergedLoraProvider } from '../export/merge.ts';
import { ExportError, mapProvider } from '../export/provider.ts';
import { pipeToSink } from '../export/stream.ts';
import type { ExportFormat, OpenedModel } from './run.ts';

export type { ReadLora };

/** A LoRA file read into engine layers (refusals name the file and the key). */
export async function readImportedLora(file: SafetensorsFile): Promise<ReadLora> {
  return readLora(file);
}

/** Adapted layers against the base's tensor shapes (diffusers names per component). */
export function checkImportedLora(
  lora: ReadLora,
  shapes: Record<LoraComponent, ReadonlyMap<string, readonly number[]>>,
  loraName: string,
  modelName: string,
): void {
  checkLoraForModel(lora, shapes, loraName, modelName);
}

/** The loaded model's weight shapes, per LoRA component (what checkImportedLora compares against). */
export function loadedShapes(model: LoadedModel): Record<LoraComponent, Map<string, readonly number[]>> {
  const shapes = (w: Map<string, Tensor>) => new Map([...w].map(([n, t]) => [n, t.shape] as const));
  return { unet: shapes(model.unet.weights), text_encoder: shapes(model.textEncoder.weights) };
}

/**
 * Uploads the LoRA's adapters into the loaded model's weight maps (`<layer>.lora_A.weight` / `.lora_B.weight`,
 * what nn/lora.ts loraLinear looks for) in the compute dtype; returns a function that takes them out again.
 * Run the UNet / text encoder with loraScale = lora.scale (times any user strength). Values past f16's range
 * are refused naming the key, before anything is uploaded.
 */
export function applyLora(gpu: Gpu, model: LoadedModel, lora: ReadLora): () => void {
  const parts: [LoraComponent, Map<string, Tensor>][] = [
    ['unet', model.unet.weights],
    ['text_encoder', model.textEncoder.weights],
  ];
  for (const [, pair] of lora.adapters)
    for (const [key, t] of [
      [pair.keys.A, pair.A],
      [pair.keys.B, pair.B],
    ] as const) {
      const bad = countBadValues(t.data, gpu.computeDType);
      if (bad.nonFinite || bad.beyondF16) throw new ExportError(`'${key}' holds values past f16's range (|x| >= 65520): this LoRA cannot run in f16`);
    }
  const added: [Map<string, Tensor>, string, Tensor][] = [];
  for (const [component, weights] of parts)
    for (const [name, t] of adapterTensors(lora, component)) {
      if (weights.has(name)) throw new ExportError(`the model already holds '${name}': take the other LoRA off first`);
      const tensor = gpu.upload(t.data, t.shape, gpu.computeDType, 'weights', name);
      weights.set(name, tensor);
      added.push([weights, name, tensor]);
    }
  return () => {
    for (const [weights, name, tensor] of added) {
      weights.delete(name);
      gpu.free(tensor);
    }
  };
}

/** What the imported LoRA's metadata tells for the LoRA exports' own metadata (kohya ss_*, diffusers' training record). */
function importedInfo(source: ModelSource, lora: ReadLora, loraName: string): LoraInfo {
  const md = lora.metadata;
  const num = (v: string | undefined, d: number) => (v !== undefined && Number.isFinite(Number(v)) ? Number(v) : d);
  const res = /^\((\d+),/.exec(md.ss_resolution ?? '');
  const training = (() => {
    try {
      return JSON.parse(md['dreambooth_studio.training'] ?? '{}') as Record<string, unknown>;
    } catch {
      return {};
    }
  })();
  const title = loraName.replace(/\.safetensors$/i, '');
  // A text-encoder rate of its own, when the file records one (kohya writes it for every LoRA with text-encoder adapters).
  const recordedTextEncoderLr = (v: string) => (v !== '' && Number.isFinite(Number(v)) && Number(v) > 0 ? { textEncoderLr: Number(v) } : {});
  return {
    family: source.family,
    prediction: source.prediction,
    resolution: res ? Number(res[1]) : num(String(training.resolution ?? ''), source.family === 'sd2' && source.prediction === 'v_prediction' ? 768 : 512),
    steps: num(md.ss_max_train_steps ?? String(training.steps ?? ''), 0),
    lr: num(md.ss_learning_rate ?? String(training.lr ?? ''), 0),
    ...recordedTextEncoderLr(md.ss_text_encoder_lr ?? String(training.textEncoderLr ?? '')),
    instancePrompt: typeof training.instancePrompt === 'string' ? training.instancePrompt : (md['modelspec.trigger_phrase'] ?? ''),
    numImages: num(md.ss_num_train_images, 0),
    baseModelName: md.ss_sd_model_name ?? source.name,
    title,
    date: new Date(),
  };
}

export interface ImportedExport {
  opened: OpenedModel;
  /** The base model's source (opened from `opened`). */
  source: ModelSource;
  /** The LoRA to export or merge; null: the base as it is (a full diffusers folder written as one file). */
  lora: ReadLora | null;
  loraName: string;
  format: ExportFormat;
  sink: ByteSink;
  onWarning?: (message: string) => void;
}

/**
 * Writes an imported result in one of our formats: the LoRA formats re-write the adapters (kohya, PEFT with
 * alpha / rank folded into B); the full formats write the base with the UNet adapters merged
 * (W + scale B A, one layer at a time, read from the base's file, no GPU) or, with no LoRA, the base itself.
 */
export async function exportImported(o: ImportedExport): Promise<void> {
  const { source, lora, format, sink } = o;
  if (format === 'lora-kohya' || format === 'lora-diffusers') {
    if (!lora) throw new ExportError(`${format} holds LoRA adapters: give a LoRA file to export (a full model exports as full-single-file or diffusers-zip)`);
    const te = adapterTensors(lora, 'text_encoder');
    const adapters = {
      rank: lora.rank,
      alpha: lora.alpha,
      unet: mapProvider(adapterTensors(lora, 'unet')),
      ...(te.size ? { textEncoder: mapProvider(te) } : {}),
    };
    await (format === 'lora-kohya' ? writeKohyaLora : writePeftLora)(sink, adapters, importedInfo(source, lora, o.loraName));
    return;
  }
  let unet: TensorProvider = mapProvider(new Map());
  if (lora) {
    const values = new Map([...adapterTensors(lora, 'unet')].map(([n, t]) => [n, t.data] as const));
    const shapes = source.shapes('unet');
    unet = mergedLoraProvider({ shape: (n) => shapes.get(n)!, read: async (n) => (await source.read('unet', n)).data }, values, lora.scale);
    if (adapterTensors(lora, 'text_encoder').size)
      o.onWarning?.('The text-encoder LoRA is not merged into full exports (they carry the base text encoder): export a LoRA format to keep it.');
  }
  const title = lora ? `${o.opened.name} + ${o.loraName}` : o.opened.name;
  const opts = { title, date: new Date(), ...(o.opened.overrides ? { overrides: o.opened.overrides } : {}) };
  const base = o.opened.kind === 'diffusers' ? source : o.opened.file;
  if (format === 'full-single-file') await writeSingleFile(sink, base, unet, opts);
  else
    await pipeToSink(
      zipDiffusers(base, unet, {
        ...opts,
        ...(o.opened.kind === 'diffusers' ? { folder: o.opened.reader } : { tokenizer: o.opened.tokenizerFiles ?? new Map() }),
      }),
      sink,
    );
}

/** The base model's source, as the run pipeline opens it. */
export function openSource(opened: OpenedModel): Promise<ModelSource> {
  const o = opened.overrides ? { overrides: opened.overrides } : {};
  return opened.kind === 'diffusers' ? openDiffusers(opened.reader, o) : openSingleFile(opened.file, o);
}

export interface TryOptions {
  prompt: string;
  seed: number;
  steps: number;
  /** Square image side (a multiple of the model's factor). */
  size: number;
  guidance?: number;
  /** LoRA strength: a multiple of the file's own alpha / rank. */
  strength?: number;
}

/**
 * "Try it": one image from the base model with the LoRA applied (DPM-Solver++ 2M, CFG), everything freed
 * afterwards. The LoRA is checked against the model before its weights reach the GPU.
 */
export async function tryLora(
  gpu: Gpu,
  opened: OpenedModel,
  lora: ReadLora | null,
  loraName: string,
  o: TryOptions,
): Promise<{ rgb: Uint8Array; width: number; height: number }> {
  const source = await openSource(opened);
  let model: LoadedModel | null = null;
  try {
    if (lora) checkImportedLora(lora, { unet: source.shapes('unet'), text_encoder: source.shapes('text_encoder') }, loraName, opened.name);
    model = await loadModel(gpu, source, gpu.computeDType);
    if (lora) applyLora(gpu, model, lora);
    const schedule = { ...SD_SCHEDULE, ...scheduleFromJson(source.scheduler as Json, model.prediction) };
    return await txt2img(gpu, model, ClipTokenizer.fromFiles(opened.tokenizer), {
      prompt: o.prompt,
      steps: o.steps,
      guidance: o.guidance ?? 7.5,
      seed: o.seed,
      width: o.size,
      height: o.size,
      sampler: 'dpm++2m',
      schedule,
      ...(lora ? { loraScale: lora.scale * (o.strength ?? 1) } : {}),
    });
  } finally {
    if (model) for (const part of [model.unet.weights, model.vae.weights, model.textEncoder.weights]) gpu.free(...part.values());
    await source.close();
  }
}
