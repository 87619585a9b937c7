// The training run's export (pipeline/run.ts, TrainingRun.exportTo): the four formats, kohya and PEFT LoRA, a
// single file and a diffusers zip, streamed to a ByteSink. A LoRA run exported as a full model has its adapters
// (plain LoRA or a LyCORIS network) merged into the UNet (export/merge.ts); a full fine-tune streams its masters chunk by chunk.
import type { Gpu } from '../gpu/device.ts';
import type { ByteSink } from '../io/safetensors.ts';
import type { TensorProvider } from '../io/tensor-provider.ts';
import type { LoadedModel } from '../models/load.ts';
import type { ModelSource } from '../models/source.ts';
import { effectiveScheduler } from '../train/lr-schedule.ts';
import type { DreamBoothTrainer } from '../train/trainer.ts';
import { chunkedProvider } from '../export/chunked.ts';
import { writeSingleFile, zipDiffusers } from '../export/full.ts';
import { kohyaLoraHash, writeKohyaLora, writePeftLora, type LoraAdapters, type LoraInfo } from '../export/lora.ts';
import { lycorisHash, writeLycoris, type LycorisAdapters } from '../export/lycoris.ts';
import { mergedLoraProvider, mergedLycorisProvider } from '../export/merge.ts';
import { networkSpecOf } from '../train/trainable.ts';
import { pipeToSink } from '../export/stream.ts';
import { phaseTicker } from './progress.ts';
import type { OpenedModel, RunEvent, RunInput } from './run-host.ts';
import { RunError, type RunSettings, type TrainMode } from './settings.ts';

export type ExportFormat = 'lora-kohya' | 'lora-diffusers' | 'full-single-file' | 'diffusers-zip';

/** The formats, the modes that offer them, their file names (command line) and suffixes (studio downloads). */
export const EXPORT_FORMATS: Record<ExportFormat, { modes: TrainMode[]; file: string; suffix: string; type: string }> = {
  'lora-kohya': { modes: ['lora'], file: 'lora-kohya.safetensors', suffix: '-lora.safetensors', type: 'application/octet-stream' },
  'lora-diffusers': { modes: ['lora'], file: 'lora-peft.safetensors', suffix: '-lora-diffusers.safetensors', type: 'application/octet-stream' },
  'full-single-file': { modes: ['lora', 'full'], file: 'model.safetensors', suffix: '.safetensors', type: 'application/octet-stream' },
  'diffusers-zip': { modes: ['lora', 'full'], file: 'model-diffusers.zip', suffix: '-diffusers.zip', type: 'application/zip' },
};

/** What a run exports when the user names nothing: its own kind of file in both layouts. */
export const DEFAULT_EXPORTS: Record<TrainMode, ExportFormat[]> = { lora: ['lora-kohya', 'lora-diffusers'], full: ['full-single-file', 'diffusers-zip'] };

/** The text encoder's own learning rate, where the run trains it at one (text-encoder LoRA with textEncoderLr > 0). */
function ownTextEncoderLr(s: RunSettings): { textEncoderLr?: number } {
  return s.mode === 'lora' && s.trainTextEncoder && s.textEncoderLr > 0 ? { textEncoderLr: s.textEncoderLr } : {};
}

/** An export's file name: the base model's name, the mode and the step, and the format's suffix. */
export function exportFileName(modelName: string, mode: TrainMode, step: number, format: ExportFormat): string {
  const base =
    modelName
      .replace(/\.(safetensors|ckpt)$/i, '')
      .replace(/[^A-Za-z0-9._-]+/g, '-')
      .slice(0, 60) || 'model';
  return `${base}-dreambooth-${mode}-step${step}${EXPORT_FORMATS[format].suffix}`;
}

/** What an export reads: the trained run, its base model and where it came from. */
export interface ExportSource {
  gpu: Gpu;
  emit: (e: RunEvent) => void;
  model: LoadedModel;
  opened: OpenedModel;
  source: ModelSource;
  trainer: DreamBoothTrainer;
  run: RunInput;
  /** When the run first started: kohya's ss_training_started_at. */
  startedAt: Date;
}

/** The UNet's tensors as the writer reads them, each read reported first (`done` read before it, of `total`). */
function countedReads(p: TensorProvider, onRead: (done: number, total: number) => void): TensorProvider {
  let done = 0;
  return {
    names: () => p.names(),
    shape: (n) => p.shape(n),
    read: async (n) => {
      onRead(done, p.names().length);
      const v = await p.read(n);
      done++;
      return v;
    },
  };
}

/** The trained LoRA adapters (`values`: trainedValues) as the LoRA writers read them. */
function trainedAdapters(r: Pick<ExportSource, 'trainer'>, values: Map<string, Float32Array>): LoraAdapters {
  const t = r.trainer;
  const provider = (keep: (n: string) => boolean): TensorProvider => {
    const names = [...values.keys()].filter(keep);
    return { names: () => names, shape: (n) => [...t.trainable.get(n)!.shape], read: async (n) => values.get(n)! };
  };
  const te = provider((n) => n.startsWith('text_model.'));
  return {
    rank: t.settings.rank,
    alpha: t.settings.alpha,
    unet: provider((n) => !n.startsWith('text_model.')),
    ...(te.names().length ? { textEncoder: te } : {}),
  };
}

/** A LyCORIS run's adapters (export/lycoris.ts), or null for plain LoRA. */
function lycorisAdapters(r: Pick<ExportSource, 'trainer'>, adapters: LoraAdapters): LycorisAdapters | null {
  const t = r.trainer;
  const network = networkSpecOf(t.settings);
  if (network.type === 'lora') return null;
  const weights = (c: string) => (c === 'unet' ? t.model.weights : t.model.textEncoder?.weights);
  return { ...adapters, network, baseShape: (c, layer) => weights(c)!.get(`${layer}.weight`)!.shape };
}

/** sshs_model_hash of the kohya LoRA an export would write now (A1111's "Lora hashes" of a Try it image). */
export async function trainedLoraHash(r: Pick<ExportSource, 'trainer' | 'run'>): Promise<string> {
  const adapters = trainedAdapters(r, await r.trainer.trainedValues({ ema: r.run.settings.exportEma }));
  const lycoris = lycorisAdapters(r, adapters);
  return lycoris ? lycorisHash(lycoris) : kohyaLoraHash(adapters);
}

/** Streams the trained model in `format` to `sink` (LoRA formats for LoRA runs; full formats for both). */
export async function exportRun(r: ExportSource, format: ExportFormat, sink: ByteSink): Promise<void> {
  const t = r.trainer;
  const s = r.run.settings;
  if (!EXPORT_FORMATS[format].modes.includes(s.mode))
    throw new RunError(`${format} holds LoRA adapters: this is a full fine-tune, export a full checkpoint (full-single-file or diffusers-zip)`);
  r.emit({ type: 'phase', phase: 'exporting', message: `Writing ${format}` });
  // LoRA adapters are small: read them all. A full fine-tune streams its masters chunk by chunk.
  // --export-ema: the EMA of the weights instead of the last step's.
  const values = s.mode === 'lora' ? await t.trainedValues({ ema: s.exportEma }) : new Map<string, Float32Array>();
  const title = `${r.opened.name} dreambooth ${s.mode}`;
  if (format === 'lora-kohya' || format === 'lora-diffusers') {
    const info: LoraInfo = {
      family: r.model.family,
      prediction: r.model.prediction,
      resolution: s.resolution,
      steps: t.step,
      lr: s.lr,
      ...ownTextEncoderLr(s),
      lrScheduler: effectiveScheduler(s.lrScheduler, s.lrWarmup),
      lrWarmup: s.lrWarmup,
      instancePrompt: r.run.prompt,
      ...(s.priorPreservation ? { classPrompt: s.classPrompt, numClassImages: t.data.classes.length } : {}),
      numImages: t.data.instance.length,
      captions: t.data.instance.map((x) => x.prompt ?? r.run.prompt),
      ...(t.settings.captions ? { captionOptions: t.settings.captions } : {}),
      baseModelName: r.opened.name,
      title,
      date: new Date(),
      startedAt: r.startedAt,
      seed: s.seed,
    };
    const lycoris = lycorisAdapters(r, trainedAdapters(r, values));
    if (lycoris && format === 'lora-diffusers')
      throw new RunError(
        `lora-diffusers holds plain LoRA adapters: a ${lycoris.network.type} network exports lora-kohya (LyCORIS keys), full-single-file or diffusers-zip`,
      );
    if (lycoris) await writeLycoris(sink, lycoris, info);
    else await (format === 'lora-kohya' ? writeKohyaLora : writePeftLora)(sink, trainedAdapters(r, values), info);
    return;
  }
  // Full formats: the trained UNet over the base's other components. A LoRA run is merged into the UNet
  // first (W + scale B A; a LyCORIS network's W + s ΔW, DoRA's renormalised), which is what "export a full
  // checkpoint" of a LoRA run means.
  if ([...values.keys()].some((n) => n.startsWith('text_model.')))
    r.emit({
      type: 'warning',
      message: 'The text-encoder LoRA is not merged into full exports (they carry the base text encoder): export a LoRA format to keep it.',
    });
  const weights = r.model.unet.weights;
  const baseWeights = { shape: (n: string) => weights.get(n)!.shape, read: (n: string) => r.gpu.read(weights.get(n)!) };
  const network = networkSpecOf(t.settings);
  // A full export's long part: the UNet's tensors (merged, or streamed from the masters), i of n with the time
  // left, at most four reports a second.
  let tick: ((done: number) => void) | null = null;
  const unet = countedReads(
    s.mode === 'full'
      ? chunkedProvider(t.trainedChunks({ ema: s.exportEma }))
      : network.type === 'lora'
        ? mergedLoraProvider(baseWeights, values, t.loraScale)
        : mergedLycorisProvider(baseWeights, values, network),
    (done, total) =>
      (tick ??= phaseTicker(`Writing ${format}: UNet tensor`, total, (message, p) => r.emit({ type: 'phase', phase: 'exporting', message, ...p }), {
        every: 0.25,
      }))(done),
  );
  const opts = { title, date: new Date(), resolution: s.resolution, ...(r.opened.overrides ? { overrides: r.opened.overrides } : {}) };
  const base = r.opened.kind === 'diffusers' ? r.source : r.opened.file;
  if (format === 'full-single-file') await writeSingleFile(sink, base, unet, opts);
  else
    await pipeToSink(
      zipDiffusers(base, unet, {
        ...opts,
        ...(r.opened.kind === 'diffusers' ? { folder: r.opened.reader } : { tokenizer: r.opened.tokenizerFiles ?? new Map() }),
      }),
      sink,
    );
}
