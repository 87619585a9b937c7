// The studio's engine host: a module Web Worker that owns the WebGPU device, the IndexedDB chunk store and
// the training session, so the page never blocks on the GPU, on decoding or on storage. The page talks to
// it through Comlink (ui/studio/actions.ts starts the worker and wraps it); progress comes back through a
// proxied callback.
import * as Comlink from 'comlink';
import { encode as encodePng } from 'fast-png';
import { Gpu, type AdapterSummary } from '../gpu/device.ts';
import { GpuDeviceLostError, NoWebGpuError } from '../gpu/errors.ts';
import { viteShaderSource } from '../gpu/shaders-vite.ts';
import { idbDownloadCache } from '../io/cache-idb.ts';
import { idbTuningCache } from '../io/tuning-idb.ts';
import { downloadDiffusersModel, downloadFile } from '../io/hub.ts';
import { decodeImageBrowser } from '../io/image-browser.ts';
import { SafetensorsError, SafetensorsFile } from '../io/safetensors.ts';
import { blobSink } from '../io/sink-blob.ts';
import { BlobSource, BytesSource, type ByteSource } from '../io/source.ts';
import { describeGemmConfig, tuneGemm } from '../ops/tune.ts';
import { fetchShippedDemo } from '../models/shipped-demo.ts';
import { detectSingleFile, ModelError } from '../models/detect.ts';
import { inspectDiffusers, inspectSingleFile } from '../models/inspect.ts';
import { folderFromSources, openSingleFile, tokenizerFilesFrom, type ModelSource } from '../models/source.ts';
import { IdbChunkStore } from '../store/idb-store.ts';
import {
  EXPORT_FORMATS,
  modelShapeOf,
  RunError as StudioError,
  RunStorageFullError,
  TrainingRun,
  type ExportFormat,
  type OpenedModel,
  type RunInput,
  type RunEvent,
} from '../pipeline/run.ts';
import { openedIsSdxl, sdxlModelSummary } from '../pipeline/sdxl-run.ts';
import { isSdxlSingleFile } from '../models/sdxl.ts';
import type { ClipTokenizerFiles } from '../io/tokenizer.ts';
import type { SettingKey } from '../pipeline/settings.ts';
import { TOKENIZER_FILES } from '../export/full.ts';
import type { BundleModel } from '../pipeline/bundle.ts';
import { exportImported, openSource, readImportedLora, tryLora, type ReadLora } from '../pipeline/imported.ts';
import type { TryItOptions, TryItResult } from '../pipeline/tryit.ts';
import { bundleZip } from './bundle-zip.ts';
import { importedExportName, notSafetensorsMessage } from './imported-files.ts';
import { parseModelConfig, type ConfigOverrides } from './model-config.ts';

/** Where the model comes from (what the page persists, minus the File objects). */
export type ModelChoice =
  | { kind: 'demo' }
  | { kind: 'hub'; endpoint: string; repo: string }
  /**
   * A single checkpoint; `config`: the CLI's --config JSON given beside it (what the weights cannot say, for a model
   * that is not SD's standard shape); `endpoint`: the hub its tokenizer comes from (a single file carries none).
   */
  | { kind: 'file'; file: File; config?: File; endpoint?: string }
  | { kind: 'folder'; name: string; files: { path: string; file: File }[] };

export type WorkerEvent = RunEvent | { type: 'download'; path: string; loaded: number; total: number | null } | { type: 'device-lost'; message: string };

export interface ModelSummary {
  name: string;
  family: string;
  layout: string;
  prediction: string;
  parameters: number;
  /** Image sides must be multiples of this (VAE x UNet down-sampling: 64 for SD); aspect-ratio buckets use it. */
  resolutionFactor?: number;
  /** The picture side the model was trained at, where it is known (the shipped demo model's manifest says it). */
  nativeResolution?: number;
}

export type InitResult =
  | {
      ok: true;
      adapter: AdapterSummary;
      hasF16: boolean;
      /** The GEMM kernel config in force and where it came from (src/ops/tune.ts), one line. */
      gemm: string;
      /** Whether f16 GEMMs run on tensor cores and why (Gpu.tensorCoreNote), one line. */
      tensorCores: string;
    }
  | { ok: false; noWebGpu: boolean; message: string };

/**
 * Hub repos whose tokenizer/ a single-file checkpoint of each family uses (fetched once, then cached); SDXL's also
 * gives tokenizer_2/ (OpenCLIP bigG's, padding with "!"). SDXL derivatives (Illustrious, Pony) keep these tokenizers.
 */
export const TOKENIZER_REPOS = {
  sd1: 'stable-diffusion-v1-5/stable-diffusion-v1-5',
  sd2: 'stabilityai/stable-diffusion-2-1',
  sdxl: 'stabilityai/stable-diffusion-xl-base-1.0',
} as const;

export const RUN_DB = 'dreambooth-studio-runs';

/**
 * Times a hardware GPU's GEMM kernels once (src/ops/tune.ts; a few seconds) and caches the fastest config in
 * IndexedDB, so later visits start with it; CPU adapters keep their defaults. A failed timing keeps the defaults.
 */
async function tuneStudioGpu(gpu: Gpu): Promise<string> {
  try {
    const r = await tuneGemm(gpu, { cache: idbTuningCache(), log: (l) => console.info(l) });
    return `${describeGemmConfig(r.config)} (${r.source === 'timed' ? `timed now in ${r.seconds.toFixed(1)} s` : r.source === 'cache' ? 'timed on an earlier visit' : 'defaults for a CPU adapter'})`;
  } catch (e) {
    if (e instanceof GpuDeviceLostError) throw e;
    return `${describeGemmConfig(gpu.gemmConfig)} (defaults: timing failed: ${(e as Error).message})`;
  }
}

class StudioWorker {
  private gpu: Gpu | null = null;
  private store: IdbChunkStore | null = null;
  private session: TrainingRun | null = null;
  private onEvent: (e: WorkerEvent) => void = () => {};
  private hubEndpoint = 'https://huggingface.co';
  /** The shipped demo model's files, fetched and checked once (a failed fetch is tried again next time). */
  private demo: ReturnType<typeof fetchShippedDemo> | null = null;
  /** The shipped demo model's own picture side, once it has been opened. */
  private demoResolution: number | undefined;
  /** A pause or cancel that arrived while the run was still preparing (no session to tell yet). */
  private pendingStop: 'pause' | 'cancel' | null = null;
  /** What init's GEMM tuning did, one line (InitResult.gemm). */
  private gemmNote = '';

  /** Opens the GPU once. `tensorCores: false` (the page's `?tensorCores=0`) turns tensor cores off; by default they run where the start-up check passes. */
  async init(opts: { tensorCores?: boolean } = {}): Promise<InitResult> {
    try {
      if (!this.gpu) {
        const gpu = await Gpu.create(navigator.gpu, {
          shaders: viteShaderSource(),
          tensorCores: opts.tensorCores,
          tensorCoreOptOut: 'the URL flag tensorCores=0',
        });
        gpu.onLost((e) => this.onEvent({ type: 'device-lost', message: e.message }));
        this.gemmNote = await tuneStudioGpu(gpu);
        this.gpu = gpu;
      }
      return { ok: true, adapter: this.gpu.adapter, hasF16: this.gpu.hasF16, gemm: this.gemmNote, tensorCores: this.gpu.tensorCoreNote };
    } catch (e) {
      return { ok: false, noWebGpu: e instanceof NoWebGpuError, message: (e as Error).message };
    }
  }

  setHubEndpoint(endpoint: string): void {
    this.hubEndpoint = endpoint;
  }

  /** Opens a model and says what it is (family, layout, size), refusing anything that is not SD 1.x / 2.x or SDXL. */
  async inspect(choice: ModelChoice, onEvent?: (e: WorkerEvent) => void): Promise<ModelSummary> {
    if (onEvent) this.onEvent = onEvent;
    if (choice.kind === 'file') {
      const src = new BlobSource(choice.file, choice.file.name);
      if (!/\.safetensors$/i.test(choice.file.name))
        throw new ModelError(
          `${choice.file.name}: only .safetensors checkpoints can be loaded (a .ckpt is a pickle that could run code; convert it to safetensors first)`,
        );
      const overrides = await configOf(choice);
      const o = overrides ? { overrides } : {};
      const file = await SafetensorsFile.open(src);
      // An SDXL checkpoint (SGM layout) trains LoRA through the same pipeline as an SDXL folder (pipeline/sdxl-run.ts).
      if (isSdxlSingleFile(file.names)) return sdxlModelSummary({ kind: 'single-file', name: choice.file.name, file, ...o });
      const info = await inspectSingleFile(src, undefined, overrides);
      const factor = await factorOf(async () => openSingleFile(file, o));
      return { name: choice.file.name, family: info.family, layout: info.layout, prediction: info.prediction, parameters: total(info.components), ...factor };
    }
    const opened = await this.open(choice);
    if (opened.kind !== 'diffusers') throw new Error('unreachable');
    // An SDXL folder or hub model trains LoRA through the same pipeline (pipeline/sdxl-run.ts).
    if (await openedIsSdxl(opened)) return sdxlModelSummary(opened);
    const info = await inspectDiffusers(opened.reader);
    const factor = await factorOf(() => openSource(opened));
    return {
      name: opened.name,
      family: info.family,
      layout: info.layout,
      prediction: info.prediction,
      parameters: total(info.components),
      ...factor,
      ...(choice.kind === 'demo' ? { nativeResolution: this.demoResolution } : {}),
    };
  }

  private async open(choice: ModelChoice): Promise<OpenedModel> {
    if (choice.kind === 'demo') {
      // The pretrained demo model the page ships (public/demo-model/), each file checked against its manifest:
      // fetched once per worker, so Train, Try it and export after loading it download and check nothing again.
      this.demo ??= fetchShippedDemo(import.meta.env.BASE_URL, {
        onProgress: (loaded, total) => this.onEvent({ type: 'download', path: 'demo model', loaded, total }),
      }).catch((e: unknown) => {
        this.demo = null;
        throw e;
      });
      const { manifest, files } = await this.demo;
      this.demoResolution = manifest.resolution;
      return this.diffusers(manifest.name, new Map<string, ByteSource>([...files].map(([p, b]) => [p, new BytesSource(b, p)])));
    }
    if (choice.kind === 'folder') {
      const files = new Map<string, ByteSource>(choice.files.map(({ path, file }) => [path, new BlobSource(file, path)]));
      return this.diffusers(choice.name, files);
    }
    if (choice.kind === 'hub') {
      const m = await downloadDiffusersModel(choice.repo, {
        endpoint: choice.endpoint,
        cache: idbDownloadCache(),
        onProgress: (p) => this.onEvent({ type: 'download', ...p }),
      });
      return this.diffusers(choice.repo, m.files);
    }
    const file = await SafetensorsFile.open(new BlobSource(choice.file, choice.file.name));
    const overrides = await configOf(choice);
    const sdxl = isSdxlSingleFile(file.names);
    const family = sdxl ? 'sdxl' : detectSingleFile(new Map(file.names.map((n) => [n, file.entry(n).shape] as const)), choice.file.name).family;
    // A single file has no tokenizer: the family's standard one from the hub (cached after the first time).
    const endpoint = choice.endpoint ?? this.hubEndpoint;
    const one = await this.hubTokenizer(TOKENIZER_REPOS[family], 'tokenizer', endpoint, choice.file.name, family);
    const two = sdxl ? await this.hubTokenizer(TOKENIZER_REPOS.sdxl, 'tokenizer_2', endpoint, choice.file.name, family) : null;
    return {
      kind: 'single-file',
      name: choice.file.name,
      file,
      tokenizer: one.tokenizer,
      tokenizerFiles: one.files,
      ...(two ? { tokenizer2: two.tokenizer } : {}),
      ...(overrides ? { overrides } : {}),
    };
  }

  /** A hub repo's `sub`/ tokenizer files (vocab.json and merges.txt required), for the single file `what`. */
  private async hubTokenizer(
    repo: string,
    sub: string,
    endpoint: string,
    what: string,
    family: string,
  ): Promise<{ tokenizer: ClipTokenizerFiles; files: Map<string, Uint8Array> }> {
    const files = new Map<string, Uint8Array>();
    for (const f of TOKENIZER_FILES.filter((f) => f !== 'tokenizer.json' && f !== 'added_tokens.json')) {
      try {
        const src = await downloadFile(repo, `${sub}/${f}`, {
          endpoint,
          cache: idbDownloadCache(),
          onProgress: (p) => this.onEvent({ type: 'download', ...p }),
        });
        files.set(f, await src.read(0, src.size));
      } catch (e) {
        if (f === 'vocab.json' || f === 'merges.txt')
          throw new StudioError(
            `${what} carries no tokenizer, and the ${family.toUpperCase()} tokenizer (${sub}/) could not be fetched from ${endpoint}/${repo}: ${(e as Error).message}. Load the model as a diffusers folder instead.`,
          );
      }
    }
    const reader = folderFromSources(sub, new Map([...files].map(([f, b]) => [`${sub}/${f}`, new BytesSource(b, f)])));
    const tokenizer = await tokenizerFilesFrom(reader, `${sub}/`);
    if (!tokenizer) throw new StudioError(`the ${family} tokenizer download (${sub}/) is incomplete`);
    return { tokenizer, files };
  }

  private async diffusers(name: string, files: Map<string, ByteSource>): Promise<OpenedModel> {
    const reader = folderFromSources(name, files);
    const tokenizer = await tokenizerFilesFrom(reader);
    if (!tokenizer) throw new ModelError(`${name}: no tokenizer/ folder (vocab.json and merges.txt, or tokenizer.json): not a complete diffusers model`);
    return { kind: 'diffusers', name, reader, tokenizer };
  }

  private async openStore(): Promise<IdbChunkStore> {
    return (this.store ??= await IdbChunkStore.open(RUN_DB));
  }

  /**
   * Loads the model and the photos, caches latents, plans, resumes from the last checkpoint of
   * `run.runId`; then trains unless `trainNow` is false (e.g. to export a stopped run).
   */
  async start(
    choice: ModelChoice,
    run: RunInput,
    onEvent: (e: WorkerEvent) => void,
    trainNow = true,
    /** The page's labels of the settings, so messages name what the user sees. */
    labels: Partial<Record<SettingKey, string>> = {},
  ): Promise<'done' | 'paused' | 'cancelled' | 'ready'> {
    this.onEvent = onEvent;
    this.pendingStop = null;
    const gpu = this.gpu;
    if (!gpu) throw new StudioError('the GPU is not ready');
    if (this.session) {
      await this.session.destroy();
      this.session = null;
    }
    const opened = await this.open(choice);
    const store = await this.openStore();
    this.session = await TrainingRun.prepare(
      {
        gpu,
        dryRunGpu: () => Gpu.create(navigator.gpu, { shaders: viteShaderSource(), dryRun: true, disableF16: !gpu.hasF16 }),
        store,
        decode: (blob, name, resolution) => decodeImageBrowser(blob, name, resolution),
        emit: (e) => this.onEvent(e),
        encodePng: (rgb, width, height) => encodePng({ width, height, data: rgb, channels: 3, depth: 8 }),
        settingName: (k) => (labels[k] ? `"${labels[k]}"` : k),
      },
      opened,
      run,
    );
    if (this.pendingStop === 'cancel') return 'cancelled';
    return trainNow ? this.train(onEvent) : 'ready';
  }

  /** Continues a prepared, paused session. */
  async train(onEvent: (e: WorkerEvent) => void): Promise<'done' | 'paused' | 'cancelled'> {
    this.onEvent = onEvent;
    if (!this.session) throw new StudioError('no run is loaded');
    const stop = this.pendingStop;
    this.pendingStop = null;
    if (stop === 'cancel') return 'cancelled';
    if (stop === 'pause') return 'paused';
    try {
      return await this.session.train();
    } catch (e) {
      // The name survives the worker boundary (Comlink sends name and message): the page shows its storage screen.
      if (e instanceof RunStorageFullError) throw new RunStorageFullError(`${e.message} Free some space (or pick a smaller run), then resume.`, e.step);
      throw e;
    }
  }

  pause(): void {
    if (this.session?.isRunning) this.session.pause();
    else this.pendingStop = 'pause';
  }

  cancel(): void {
    if (this.session?.isRunning) this.session.cancel();
    else this.pendingStop = 'cancel';
  }

  /** Deletes a run's chunks (cached latents, optimizer state, checkpoints). */
  async discard(runId: string): Promise<void> {
    if (this.session?.run.runId === runId) {
      await this.session.destroy();
      this.session = null;
    }
    await TrainingRun.discard(await this.openStore(), runId);
  }

  /** Unloads the run (its GPU state) and keeps its stored chunks: another run of the list is opened. */
  async closeSession(): Promise<void> {
    if (this.session) {
      await this.session.destroy();
      this.session = null;
    }
  }

  /** Each chunk key with its byte length (the runs list sums them per run: keys are `<runId>/…`). */
  async chunkSizes(): Promise<[string, number][]> {
    return (await this.openStore()).keySizes();
  }

  /** The trained model as a file: a Blob (kept by the browser's blob store, which spills to disk). */
  async exportModel(format: ExportFormat): Promise<{ blob: Blob; name: string; size: number }> {
    if (!this.session) throw new StudioError('no trained run to export: train first');
    if (this.session.isRunning) throw new StudioError('pause the run before exporting');
    const sink = blobSink(EXPORT_FORMATS[format].type);
    await this.session.exportTo(format, sink);
    const blob = sink.blob();
    return { blob, name: this.session.exportName(format), size: blob.size };
  }

  /**
   * The trained model streamed into a file the page chose (showSaveFilePicker, or any FileSystemFileHandle):
   * bytes go to disk as they are made, nothing is held in memory. A failure aborts the write, so a half file
   * never replaces what was there.
   */
  async exportToFile(format: ExportFormat, handle: FileSystemFileHandle): Promise<{ name: string; size: number }> {
    if (!this.session) throw new StudioError('no trained run to export: train first');
    if (this.session.isRunning) throw new StudioError('pause the run before exporting');
    const writer = (await handle.createWritable()).getWriter();
    try {
      await this.session.exportTo(format, { write: (c) => writer.write(c as Uint8Array<ArrayBuffer>), close: () => writer.close() });
    } catch (e) {
      await writer.abort().catch(() => undefined);
      throw e;
    }
    return { name: handle.name, size: (await handle.getFile()).size };
  }

  /**
   * "Try it" on the loaded run (paused or done): fine-tuned and base images for the same seed, PNGs with
   * A1111's parameters text (TrainingRun.tryIt; refused while training and with no finished step).
   */
  async tryIt(o: Omit<TryItOptions, 'onStep'>, onStep?: (done: number, total: number) => void): Promise<TryItResult> {
    if (!this.session) throw new StudioError('no run is loaded: Try it needs a run with a finished training step');
    return this.session.tryIt({ ...o, ...(onStep ? { onStep } : {}) });
  }

  /** Whether a run is loaded (exports need one). */
  hasSession(): boolean {
    return this.session !== null;
  }

  // ---- outgrowing the tab (issue 17) ----------------------------------------------------------------------

  /**
   * The run as a job bundle for diffusers' DreamBooth scripts and Ray Train (pipeline/bundle.ts), zipped:
   * the photos decoded here and cropped as the run would train them.
   */
  async bundle(choice: ModelChoice, run: Omit<RunInput, 'runId'>): Promise<{ blob: Blob; name: string; size: number }> {
    const r = run.settings.resolution;
    const decode = async (items: RunInput['images']) =>
      Promise.all(
        items.map(async (p) => ({
          name: p.name,
          image: p.pixels ?? (await decodeImageBrowser(p.blob!, p.name, r)),
          ...(p.crop ? { crop: p.crop } : {}),
          ...(p.caption ? { caption: p.caption } : {}),
          ...(p.mask ? { mask: { name: p.mask.name, image: p.mask.pixels ?? (await decodeImageBrowser(p.mask.blob!, p.mask.name, r)) } } : {}),
        })),
      );
    const model: BundleModel =
      choice.kind === 'hub'
        ? { kind: 'hub', name: choice.repo, hubId: choice.repo }
        : choice.kind === 'file'
          ? { kind: 'single-file', name: choice.file.name }
          : choice.kind === 'folder'
            ? { kind: 'diffusers', name: choice.name }
            : { kind: 'demo', name: 'demo-sd1-small' };
    return bundleZip({ prompt: run.prompt, images: await decode(run.images), classImages: await decode(run.classImages), settings: run.settings, model });
  }

  /** A LoRA file read in full (its header and every adapter); a file that is not safetensors is named and said what it is. */
  private async importedLora(file: File | null): Promise<ReadLora | null> {
    if (!file) return null;
    let st: SafetensorsFile;
    try {
      st = await SafetensorsFile.open(new BlobSource(file, file.name));
    } catch (e) {
      if (e instanceof SafetensorsError && /not a safetensors file|pickle/.test(e.message))
        throw new StudioError(notSafetensorsMessage(file.name, new Uint8Array(await file.slice(0, 64).arrayBuffer()), 'LoRA'));
      throw e;
    }
    return readImportedLora(st);
  }

  /** Reads a LoRA the moment it is chosen, so a wrong file is refused then: its adapted layers, or what is wrong. */
  async checkLora(file: File): Promise<{ layers: number } | { error: string }> {
    try {
      const lora = await this.importedLora(file);
      return { layers: lora!.adapters.size };
    } catch (e) {
      return { error: (e as Error).message };
    }
  }

  /** "Try it": one image of `choice` with a LoRA trained elsewhere (or none), as PNG bytes. */
  async tryLora(
    choice: ModelChoice,
    loraFile: File | null,
    o: { prompt: string; seed: number; steps: number; size: number; strength: number },
  ): Promise<Uint8Array> {
    const gpu = this.gpu;
    if (!gpu) throw new StudioError('the GPU is not ready');
    if (this.session?.isRunning) throw new StudioError('pause the run first: trying a LoRA needs the GPU');
    const lora = await this.importedLora(loraFile);
    const img = await tryLora(gpu, await this.open(choice), lora, loraFile?.name ?? '', o);
    return encodePng({ width: img.width, height: img.height, data: img.rgb, channels: 3, depth: 8 });
  }

  /** A LoRA trained elsewhere (or a full model alone) in one of our formats, as a Blob. */
  async exportImported(
    choice: ModelChoice,
    loraFile: File | null,
    format: ExportFormat,
  ): Promise<{ blob: Blob; name: string; size: number; warnings: string[] }> {
    const lora = await this.importedLora(loraFile);
    const opened = await this.open(choice);
    const source = await openSource(opened);
    const sink = blobSink(EXPORT_FORMATS[format].type);
    const warnings: string[] = [];
    try {
      await exportImported({ opened, source, lora, loraName: loraFile?.name ?? '', format, sink, onWarning: (m) => warnings.push(m) });
    } finally {
      await source.close();
    }
    const blob = sink.blob();
    return { blob, name: importedExportName(loraFile?.name ?? null, opened.name, format), size: blob.size, warnings };
  }

  async storageBytes(): Promise<number> {
    return (await this.openStore()).bytesUsed();
  }

  /** Test hook: destroys the device as a driver reset would, to exercise the device-lost path for real. */
  loseDevice(): void {
    this.gpu?.device.destroy();
  }
}

/** The config JSON given beside a single checkpoint, as load overrides (refused naming the file when it is not one). */
async function configOf(choice: { config?: File }): Promise<ConfigOverrides | undefined> {
  if (!choice.config) return undefined;
  try {
    return parseModelConfig(new Uint8Array(await choice.config.arrayBuffer()), choice.config.name);
  } catch (e) {
    throw new ModelError((e as Error).message, { cause: e });
  }
}

/** The model's resolution factor, or nothing when its configs cannot say (inspect reports the problem). */
async function factorOf(open: () => Promise<ModelSource>): Promise<{ resolutionFactor?: number }> {
  try {
    return { resolutionFactor: modelShapeOf(await open(), false).resolutionFactor };
  } catch {
    return {};
  }
}

function total(c: Record<string, { parameters: number }>): number {
  return Object.values(c).reduce((a, x) => a + x.parameters, 0);
}

Comlink.expose(new StudioWorker());
export type StudioWorkerApi = StudioWorker;
