// `cli train`: DreamBooth from the command line on the same trainer the studio runs.
//   train --model <path> --images <dir> --prompt "a photo of sks dog" [--class-prompt "a photo of a dog"
//         --class-images <dir | count>] --mode lora|full --steps N [--lr x] [--rank r] [--alpha a] --seed S
//         [--budget 4GiB] [--resolution R] [--flip] [--prior-weight w] [--offset-noise x] [--min-snr g]
//         [--train-text-encoder] [--checkpoint-every N] [--tokenizer <dir>] [--config <json>] --out <dir>
//   train --resume <dir>       continues an interrupted run (its settings are in <dir>/run.json)
// Writes <out>/run.json (the run's arguments), <out>/store (chunk store: cached latents and embeddings,
// optimizer chunks, checkpoints), a progress line per step, and the exports at the end.
import { existsSync, mkdirSync, readFileSync, statSync, writeFileSync } from 'node:fs';
import { basename, join } from 'node:path';
import type { Gpu } from '../gpu/device.ts';
import { nodeGpu } from '../gpu/node.ts';
import { checkImageSet, prepareImage } from '../io/image.ts';
import { loadImageDir } from '../io/image-node.ts';
import { SafetensorsFile } from '../io/safetensors.ts';
import { nodeFileSink } from '../io/sink-node.ts';
import { NodeFileSource } from '../io/source-node.ts';
import { nodeFolder } from '../models/folder-node.ts';
import { openDiffusers, openSingleFile } from '../models/source.ts';
import { writeKohyaLora, writePeftLora, type LoraInfo } from '../export/lora.ts';
import { TOKENIZER_FILES, writeSingleFile, zipDiffusers } from '../export/full.ts';
import type { TensorProvider } from '../export/provider.ts';
import { pipeToSink } from '../export/stream.ts';
import { scheduleFromJson, SD_SCHEDULE } from '../sample/schedulers.ts';
import { StorageFullError, formatBytes } from '../store/chunkstore.ts';
import { FsChunkStore } from '../store/fs-store.ts';
import { encodeTrainData, generateClassImage, loadTrainData, releaseEncoders, saveTrainData, type PreparedSet } from '../train/preprocess.ts';
import { planTraining } from '../train/plan.ts';
import { DreamBoothTrainer, TRAIN_DEFAULTS, type TrainMode, type TrainSettings } from '../train/trainer.ts';
import { configOverrides, loadModel } from './run.ts';
import { loadTokenizer } from './sample.ts';

const USAGE =
  'usage: train --model <path> --images <dir> --prompt "a photo of sks dog" [--class-prompt "a photo of a dog" --class-images <dir|count>] ' +
  '--mode lora|full --steps N [--lr x] [--rank r] [--alpha a] --seed S [--budget 4GiB] [--resolution 512] [--flip] [--prior-weight 1] ' +
  '[--offset-noise 0] [--min-snr gamma] [--train-text-encoder] [--checkpoint-every N] [--tokenizer dir] [--config json] --out <dir>   |   train --resume <dir>';

type Args = Record<string, string | true>;

function parseArgs(argv: string[]): Args {
  const a: Args = {};
  for (let i = 0; i < argv.length; i++) {
    const k = argv[i];
    if (!k.startsWith('--')) throw new Error(`unexpected argument ${JSON.stringify(k)}\n${USAGE}`);
    const v = argv[i + 1];
    if (v === undefined || v.startsWith('--')) a[k.slice(2)] = true;
    else {
      a[k.slice(2)] = v;
      i++;
    }
  }
  return a;
}

/** "4GiB", "512MiB", "3.5GB", a plain byte count. */
export function parseBytes(s: string): number {
  const m = /^(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|KB|MB|GB)?$/i.exec(s.trim());
  if (!m) throw new Error(`--budget: cannot read ${JSON.stringify(s)} as a size (e.g. 4GiB, 3500MiB)`);
  const unit = (m[2] ?? 'B').toLowerCase();
  const f: Record<string, number> = { b: 1, kib: 2 ** 10, mib: 2 ** 20, gib: 2 ** 30, kb: 1e3, mb: 1e6, gb: 1e9 };
  return Math.round(Number(m[1]) * f[unit]);
}

function num(a: Args, k: string, d: number): number {
  const v = a[k];
  if (v === undefined) return d;
  const x = Number(v);
  if (typeof v !== 'string' || !Number.isFinite(x)) throw new Error(`--${k} must be a number, got ${JSON.stringify(v)}`);
  return x;
}

function str(a: Args, k: string): string | undefined {
  const v = a[k];
  if (v === true) throw new Error(`--${k} needs a value`);
  return v;
}

function settingsFrom(a: Args, mode: TrainMode): TrainSettings {
  const d = TRAIN_DEFAULTS[mode];
  if (a['train-text-encoder'] === true && mode !== 'lora') throw new Error('--train-text-encoder trains text-encoder LoRA adapters: use it with --mode lora');
  const minSnr = str(a, 'min-snr');
  return {
    ...d,
    steps: num(a, 'steps', d.steps),
    lr: num(a, 'lr', d.lr),
    rank: mode === 'lora' ? num(a, 'rank', d.rank) : 0,
    alpha: mode === 'lora' ? num(a, 'alpha', a.rank !== undefined ? num(a, 'rank', d.rank) : d.alpha) : 0,
    seed: num(a, 'seed', 0),
    priorLossWeight: num(a, 'prior-weight', d.priorLossWeight),
    offsetNoise: num(a, 'offset-noise', d.offsetNoise),
    minSnrGamma: minSnr === undefined ? null : num(a, 'min-snr', 5),
    checkpointEvery: num(a, 'checkpoint-every', d.checkpointEvery),
    textEncoderLora: a['train-text-encoder'] === true,
  };
}

/** Images of a folder, prepared at the resolution (centre crop; flipped copies too with --flip). */
async function imageSet(dir: string, prompt: string, resolution: number, flip: boolean, what: string): Promise<PreparedSet> {
  if (!existsSync(dir) || !statSync(dir).isDirectory()) throw new Error(`--${what}: ${dir} is not a folder of images`);
  const { images, errors } = await loadImageDir(dir);
  for (const e of errors) console.error(`warning: skipped ${e.message}`);
  const report = checkImageSet(images.map((i) => ({ name: i.name, width: i.image.width, height: i.image.height })), { resolution });
  for (const w of report.warnings) console.error(`warning: ${w}`);
  if (report.errors.length) throw new Error(`${dir}: ${report.errors.join('; ')}`);
  const set: PreparedSet = { images: [], prompts: [] };
  for (const im of images)
    for (const f of flip ? [false, true] : [false]) {
      set.images.push(prepareImage(im.image, { resolution, crop: 'center', flip: f, name: im.name }));
      set.prompts.push(im.caption ?? prompt);
    }
  return set;
}

const mib = (b: number) => `${(b / 2 ** 20).toFixed(1)} MiB`;

function eta(seconds: number): string {
  const s = Math.max(0, Math.round(seconds));
  return `${Math.floor(s / 3600)}:${String(Math.floor(s / 60) % 60).padStart(2, '0')}:${String(s % 60).padStart(2, '0')}`;
}

export async function trainCommand(gpu: Gpu, argv: string[]): Promise<void> {
  let a = parseArgs(argv);
  const resumeDir = str(a, 'resume');
  if (resumeDir) {
    const runFile = join(resumeDir, 'run.json');
    if (!existsSync(runFile)) throw new Error(`--resume ${resumeDir}: no run.json there (not a training output folder)`);
    a = { ...JSON.parse(readFileSync(runFile, 'utf8')), out: resumeDir };
  }
  const modelPath = str(a, 'model');
  const out = str(a, 'out');
  const prompt = str(a, 'prompt');
  const imagesDir = str(a, 'images');
  if (!modelPath || !out || prompt === undefined || !imagesDir) throw new Error(USAGE);
  const mode = (str(a, 'mode') ?? 'lora') as TrainMode;
  if (mode !== 'lora' && mode !== 'full') throw new Error(`--mode must be lora or full, got ${mode}`);
  const settings = settingsFrom(a, mode);
  const budget = parseBytes(str(a, 'budget') ?? '4GiB');
  mkdirSync(out, { recursive: true });
  if (!resumeDir) writeFileSync(join(out, 'run.json'), JSON.stringify(a, null, 2));
  const store = await FsChunkStore.open(join(out, 'store'));
  const runId = 'run';
  const isDir = statSync(modelPath).isDirectory();
  const overrides = configOverrides(str(a, 'config'), 'unet');
  const model = await loadModel(gpu, modelPath, { dtype: gpu.computeDType, overrides });
  const resolution = num(a, 'resolution', 512);
  const schedJson = isDir && existsSync(join(modelPath, 'scheduler/scheduler_config.json')) ? JSON.parse(readFileSync(join(modelPath, 'scheduler/scheduler_config.json'), 'utf8')) : {};
  const schedule = { ...SD_SCHEDULE, ...scheduleFromJson({ ...schedJson, ...overrides?.scheduler }, model.prediction) };

  // Latents and embeddings: from the store (a resumed run), or encoded now and stored.
  let data = await loadTrainData(store, runId);
  if (!data) {
    const tokDir = str(a, 'tokenizer') ?? (isDir ? join(modelPath, 'tokenizer') : undefined);
    if (!tokDir) throw new Error('a single-file checkpoint carries no tokenizer: pass --tokenizer <folder with vocab.json and merges.txt>');
    const tokenizer = loadTokenizer(tokDir);
    const flip = a.flip === true;
    const instance = await imageSet(imagesDir, prompt, resolution, flip, 'images');
    let classes: PreparedSet | null = null;
    const classPrompt = str(a, 'class-prompt');
    const classImages = str(a, 'class-images');
    if (classPrompt !== undefined && classImages !== undefined) {
      if (/^\d+$/.test(classImages)) {
        // Prior-preservation images generated by the base model itself (what diffusers does).
        const n = Number(classImages);
        classes = { images: [], prompts: [] };
        for (let i = 0; i < n; i++) {
          classes.images.push(await generateClassImage(gpu, model, tokenizer, schedule, { prompt: classPrompt, seed: settings.seed, index: i, steps: num(a, 'class-steps', 25), resolution }));
          classes.prompts.push(classPrompt);
          console.error(`class image ${i + 1}/${n} generated`);
        }
      } else classes = await imageSet(classImages, classPrompt, resolution, false, 'class-images');
    } else if (classPrompt !== undefined || classImages !== undefined) throw new Error('prior preservation needs both --class-prompt and --class-images');
    data = await encodeTrainData(gpu, model, tokenizer, resolution, instance, classes, (d, n) => console.error(`encoded ${d}/${n} images`));
    await saveTrainData(store, runId, data);
  }
  releaseEncoders(gpu, model, settings.textEncoderLora);

  // Placement under the budget: the planner dry-runs the real step (no GPU memory used) and picks activation
  // checkpointing and how many optimizer chunks stay resident.
  const plan = await planTraining(
    () => nodeGpu({ dryRun: true }),
    { config: model.unet.config, dtype: gpu.computeDType, schedule, textEncoder: settings.textEncoderLora ? model.textEncoder.config : undefined },
    { latentShape: data.latentShape, contextShape: data.contextShape, withClass: data.classes.length > 0, vaeFactor: resolution / data.latentShape[1] },
    settings,
    budget,
  );
  if (!plan.fits) throw new Error(plan.message ?? `the run does not fit the ${formatBytes(budget)} budget`);
  settings.activationCheckpointing = plan.activationCheckpointing;
  settings.residentChunks = plan.residentChunks;
  console.error(`plan: peak ${mib(plan.peakBytes)} of the ${mib(budget)} budget, activation checkpointing ${plan.activationCheckpointing ? 'on' : 'off'}, ${plan.residentChunks}/${plan.chunks} optimizer chunks resident`);
  const trainer = await DreamBoothTrainer.create(gpu, { config: model.unet.config, weights: model.unet.weights, schedule, textEncoder: model.textEncoder }, data, settings, store, runId);
  if (await trainer.resume()) console.error(`resumed at step ${trainer.step} from the last checkpoint`);
  console.error(`training ${mode} for ${settings.steps} steps (${trainer.optimizer.storedChunks} optimizer chunks streamed through the store)`);
  const times: number[] = [];
  try {
    while (trainer.step < settings.steps) {
      const r = await trainer.trainStep();
      times.push(r.seconds);
      const recent = times.slice(-10).sort((x, y) => x - y);
      const sPerStep = recent[Math.floor(recent.length / 2)];
      const storage = await store.bytesUsed();
      console.log(
        `step ${r.step}/${settings.steps} loss ${r.loss.toFixed(5)} ${sPerStep.toFixed(2)} s/step ETA ${eta(sPerStep * (settings.steps - r.step))} ` +
          `gpu ${mib(r.gpuBytes)} (peak ${mib(r.gpuPeakBytes)}) storage ${mib(storage)}${r.skipped ? ` SKIPPED: ${r.skipped}` : ''}`,
      );
    }
    await trainer.checkpoint();
  } catch (e) {
    if (e instanceof StorageFullError) {
      throw new Error(`${e.message}\nTraining paused at step ${trainer.step}; the last checkpoint is intact. After freeing space: npm run cli -- train --resume ${out}`);
    }
    throw e;
  }
  await exportRun(trainer, modelPath, out, { mode, prompt, classPrompt: str(a, 'class-prompt'), resolution, family: model.family, prediction: model.prediction, overrides, tokenizerDir: str(a, 'tokenizer') });
  trainer.destroy();
  await store.close();
}

function trainedProvider(trainer: DreamBoothTrainer, values: Map<string, Float32Array>): TensorProvider {
  return {
    names: () => [...values.keys()],
    shape: (n) => [...trainer.trainable.get(n)!.shape],
    read: async (n) => values.get(n)!,
  };
}

async function exportRun(
  trainer: DreamBoothTrainer, modelPath: string, out: string,
  o: { mode: TrainMode; prompt: string; classPrompt?: string; resolution: number; family: LoraInfo['family']; prediction: LoraInfo['prediction']; overrides: ReturnType<typeof configOverrides>; tokenizerDir?: string },
): Promise<void> {
  const files: string[] = [];
  const title = `${basename(modelPath)} dreambooth ${o.mode}`;
  if (o.mode === 'lora') {
    const values = await trainer.trainedValues();
    const s = trainer.settings;
    const info: LoraInfo = {
      family: o.family, prediction: o.prediction, resolution: o.resolution, steps: trainer.step, lr: s.lr, instancePrompt: o.prompt, classPrompt: o.classPrompt,
      numImages: trainer.data.instance.length, numClassImages: trainer.data.classes.length, baseModelName: basename(modelPath), title, date: new Date(), seed: s.seed,
    };
    const part = (te: boolean) => new Map([...values].filter(([n]) => n.startsWith('text_model.') === te));
    const teValues = part(true);
    const adapters = { rank: s.rank, alpha: s.alpha, unet: trainedProvider(trainer, part(false)), ...(teValues.size ? { textEncoder: trainedProvider(trainer, teValues) } : {}) };
    for (const [file, write] of [['lora-kohya.safetensors', writeKohyaLora], ['lora-peft.safetensors', writePeftLora]] as const) {
      await write(await nodeFileSink(join(out, file)), adapters, info);
      files.push(file);
    }
  } else {
    // Streamed chunk by chunk: a full fine-tune's masters are never all in memory at once.
    const trained = trainer.trainedProvider();
    const isDir = statSync(modelPath).isDirectory();
    const opts = { title, date: new Date(), resolution: o.resolution, overrides: o.overrides };
    if (isDir) {
      const folder = nodeFolder(modelPath);
      const src = await openDiffusers(folder, {});
      await writeSingleFile(await nodeFileSink(join(out, 'model.safetensors')), src, trained, opts);
      await pipeToSink(zipDiffusers(src, trained, { ...opts, folder }), await nodeFileSink(join(out, 'model-diffusers.zip')));
      await src.close();
      files.push('model.safetensors', 'model-diffusers.zip');
    } else {
      const file = await SafetensorsFile.open(await NodeFileSource.open(modelPath));
      try {
        await writeSingleFile(await nodeFileSink(join(out, 'model.safetensors')), file, trained, opts);
        const src = await openSingleFile(file, { overrides: o.overrides });
        // A single file has no tokenizer: the zip gets the one training used (--tokenizer), so diffusers loads it.
        const tokenizer = new Map<string, Uint8Array>();
        if (o.tokenizerDir) for (const f of TOKENIZER_FILES) if (existsSync(join(o.tokenizerDir, f))) tokenizer.set(f, readFileSync(join(o.tokenizerDir, f)));
        await pipeToSink(zipDiffusers(src, trained, { ...opts, tokenizer }), await nodeFileSink(join(out, 'model-diffusers.zip')));
      } finally {
        await file.source.close?.();
      }
      files.push('model.safetensors', 'model-diffusers.zip');
    }
  }
  const sizes = Object.fromEntries(files.map((f) => [f, statSync(join(out, f)).size]));
  console.log(JSON.stringify({ done: true, steps: trainer.step, mode: o.mode, exports: sizes, finalLoss: trainer.losses.at(-1) }));
}
