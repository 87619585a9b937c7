// `cli train`: DreamBooth from the command line through the same run pipeline as the studio
// (src/pipeline/run.ts), on Dawn with a folder chunk store.
//   train --model <path> --images <dir> --prompt "a photo of sks dog" --out <dir> [--class-prompt "a photo of a dog"
//         [--class-images <dir | count>]] [--tokenizer <dir>] [--config <json>] [--export <formats>] [--overwrite]
//         [every setting of the schema: --mode --steps --lr --rank --alpha --resolution --budget --seed ...]
//   train --resume <dir> [--model <path>] [--steps N] [--export <formats>]
// The run folder holds run.json (the run's inputs and settings, validated on resume), store/ (cached latents
// and embeddings, optimizer chunks, checkpoints), samples/ (with --sample-every), the exports, and a lock
// while a process trains in it. A folder that holds another run is refused unless --resume or --overwrite.
import { existsSync, mkdirSync, readFileSync, readdirSync, rmSync, statSync } from 'node:fs';
import { basename, extname, join, resolve } from 'node:path';
import { encode as encodePng } from 'fast-png';
import type { Gpu } from '../gpu/device.ts';
import { nodeGpu } from '../gpu/node.ts';
import { checkCaptionFiles, decodeImageNode, loadImageDir } from '../io/image-node.ts';
import { SafetensorsFile } from '../io/safetensors.ts';
import { asFingerprints, fingerprintChanges, folderFingerprints, modelFingerprints, type Fingerprints } from '../io/fingerprint.ts';
import { takeRunLock } from '../io/runlock.ts';
import { onStopSignal, SIGNAL_EXIT_CODES, type StopSignal } from './signals.ts';
import { checkOutFolder, claimEntries, recordWritten, refuseLeftAside, removeWritten, setAsideWritten, writeOutput, type SetAside } from '../io/outpath.ts';
import { nodeFileSink } from '../io/sink-node.ts';
import { NodeFileSource } from '../io/source-node.ts';
import type { ClipTokenizerFiles } from '../io/tokenizer.ts';
import { nodeFolder } from '../models/folder-node.ts';
import { tokenizerFilesFrom } from '../models/source.ts';
import {
  DEFAULT_EXPORTS,
  EXPORT_FORMATS,
  RunStorageFullError,
  TrainingRun,
  type ExportFormat,
  type ImageInput,
  type OpenedModel,
  type RunEvent,
} from '../pipeline/run.ts';
import {
  defaultSettings,
  parseSettingValue,
  refuseInactive,
  SETTINGS,
  SettingsError,
  validatePrompt,
  validateSettings,
  type RunSettings,
  type SettingKey,
  type TrainMode,
} from '../pipeline/settings.ts';
import { FsChunkStore } from '../store/fs-store.ts';
import { SnapshotBindingError } from '../store/snapshot.ts';
import { TOKENIZER_FILES } from '../export/full.ts';
import { formatBytes } from '../util/bytes.ts';
import { parseFlags, stringFlag, UsageError, type Flags, type ParsedFlags } from './args.ts';
import { checkBlackMasks, pairMasks, refuseMasksAsImages } from './masks.ts';
import { configOverrides } from './run.ts';
import { jsonSyntaxProblem } from '../util/describe.ts';

/** Flags of the run itself (inputs and the run folder); the settings' flags come from the schema. */
const INPUT_FLAGS: Flags = {
  model: { type: 'string', arg: '<path>', help: 'the base model: a diffusers folder, or a single .safetensors file (with --tokenizer)', default: 'required' },
  images: { type: 'string', arg: '<dir>', help: 'the folder of photos of the subject (a same-name .txt beside a photo is its caption)', default: 'required' },
  prompt: { type: 'string', arg: '<text>', help: 'the instance prompt: a rare token plus the class, e.g. "a photo of sks dog"', default: 'required' },
  out: { type: 'string', arg: '<dir>', help: 'the run folder (created if missing): run.json, store/, samples/, the exports', default: 'required' },
  resume: {
    type: 'string',
    arg: '<dir>',
    help: 'continue the run in <dir> from its last checkpoint (with it only --model, --steps, --export)',
    default: 'none',
  },
  overwrite: { type: 'boolean', help: 'replace the run in --out' },
  tokenizer: {
    type: 'string',
    arg: '<dir>',
    help: 'a folder with vocab.json and merges.txt (or tokenizer.json), for a single-file --model',
    default: "the model folder's tokenizer/",
  },
  config: { type: 'string', arg: '<json>', help: "config overrides of the model's components", default: 'none' },
  'class-images': {
    type: 'string',
    arg: '<dir | count>',
    help: 'with --class-prompt: a folder of class images, or how many to generate',
    default: `generate ${defaultSettings().classCount}`,
  },
  masks: { type: 'string', arg: '<dir>', help: 'loss masks: an image per photo with the same name, white where the subject is', default: 'none' },
  export: {
    type: 'string',
    arg: '<formats>',
    help: 'comma-separated: lora-kohya, lora-diffusers, full-single-file, diffusers-zip',
    default: "the mode's own two",
  },
};
const SETTING_FLAGS: Flags = Object.fromEntries(SETTINGS.filter((s) => s.flag).map((s) => [s.flag!, { type: s.kind === 'bool' ? 'boolean' : 'string' }]));
export const FLAGS: Flags = { ...INPUT_FLAGS, ...SETTING_FLAGS };
/**
 * What may change when a run is resumed: where the model is now, how long the run is, what it exports. Not
 * the budget: the plan it gives decides which optimizer chunks the checkpoint keeps on the GPU and which in
 * the store, and a resumed run must find them where the checkpoint put them.
 */
const RESUME_FLAGS = new Set(['resume', 'model', 'steps', 'export']);

export const TRAIN_USAGE =
  'usage: train --model <path> --images <dir> --prompt "a photo of sks dog" --out <dir> [--class-prompt "a photo of a dog" [--class-images <dir|count>]] [--masks <dir>] ' +
  '[--tokenizer dir] [--config json] [--export lora-kohya,lora-diffusers,full-single-file,diffusers-zip] [--overwrite] ' +
  SETTINGS.filter((s) => s.flag && s.key !== 'classPrompt')
    .map((s) => (s.kind === 'bool' ? `[--${s.flag}]` : `[--${s.flag} x]`))
    .join(' ') +
  '   |   train --resume <dir> [--model <path>] [--steps N] [--export formats]';

/** What run.json keeps: the run's inputs and its validated settings. */
interface RunFile {
  version: 2;
  inputs: {
    model: string;
    images: string;
    prompt: string;
    classImages?: string;
    /** Loss masks: a folder of images named like the photos (kohya's convention). */
    masks?: string;
    tokenizer?: string;
    config?: string;
    exports: ExportFormat[];
  };
  settings: RunSettings;
  /** The model's architecture when the run started (a moved model must be the same one). */
  modelKey?: string;
  /** What the run's inputs were when it started (fingerprint.ts), checked on resume; absent in older records. */
  fingerprints?: RunFingerprints;
}

/** Fingerprints of a run's inputs, by the flag that gave each. */
interface RunFingerprints {
  model: Fingerprints;
  images: Fingerprints;
  masks?: Fingerprints;
  classImages?: Fingerprints;
  tokenizer?: Fingerprints;
  config?: Fingerprints;
}

/** The fingerprints of a run's inputs as they are now (regular files only: nothing here can block). */
function fingerprintsOf(i: RunFile['inputs']): RunFingerprints {
  const classFolder = i.classImages !== undefined && !/^\d+$/.test(i.classImages) ? i.classImages : undefined;
  return {
    model: modelFingerprints(i.model),
    images: folderFingerprints(i.images),
    ...(i.masks !== undefined ? { masks: folderFingerprints(i.masks) } : {}),
    ...(classFolder !== undefined ? { classImages: folderFingerprints(classFolder) } : {}),
    ...(i.tokenizer !== undefined ? { tokenizer: statSync(i.tokenizer).isDirectory() ? folderFingerprints(i.tokenizer) : modelFingerprints(i.tokenizer) } : {}),
    ...(i.config !== undefined ? { config: modelFingerprints(i.config) } : {}),
  };
}

/**
 * On resume: the run's inputs must be what they were when it started. Another base model (even of the same
 * architecture) would take steps on other weights; a changed photo, mask or caption would train on latents
 * and embeddings cached from the old one. What changed is named, by the flag that gave it.
 */
function checkFingerprints(run: RunFile, now: RunFingerprints): void {
  const was = run.fingerprints!;
  if (typeof was !== 'object' || was === null)
    throw new UsageError(`this run's record of its inputs (run.json fingerprints) is damaged: start a new run with another --out`);
  const i = run.inputs;
  const checks: [keyof RunFingerprints, string, string | undefined][] = [
    ['model', '--model', i.model],
    ['images', '--images', i.images],
    ['masks', '--masks', i.masks],
    ['classImages', '--class-images', i.classImages],
    ['tokenizer', '--tokenizer', i.tokenizer],
    ['config', '--config', i.config],
  ];
  for (const [key, flag, path] of checks) {
    const recorded = asFingerprints(was[key]);
    if (was[key] === undefined) continue;
    if (!recorded) throw new UsageError(`${flag}: this run's record of it (run.json fingerprints.${key}) is damaged: start a new run with another --out`);
    const changes = fingerprintChanges(recorded, now[key] ?? {}, { added: key !== 'model' && key !== 'tokenizer' });
    if (!changes) continue;
    if (key === 'model')
      throw new UsageError(
        `--model ${path} is not the model this run started with (${changes} since): another base model, even of the same architecture, ` +
          `would train on other weights. Pass the run's own model with --model, or start a new run with another --out`,
      );
    throw new UsageError(
      `this run's ${flag} ${path} changed since it started (${changes}): the run trains on its inputs as they were (its latents and embeddings are cached from them). ` +
        `Put them back as they were, or start a new run with another --out`,
    );
  }
}

const notedClassFolders = new Set<string>();
/**
 * --class-images <dir | count>: a folder of that name, when one exists, is the folder (`--class-images 7`
 * with a folder 7 here means those images, and says so); otherwise a whole number is how many to generate.
 */
export function classImagesIsCount(value: string): boolean {
  if (!/^\d+$/.test(value)) return false;
  let folder = false;
  try {
    folder = statSync(value).isDirectory();
  } catch {
    // no such entry: a count
  }
  if (folder && !notedClassFolders.has(value)) {
    notedClassFolders.add(value);
    console.error(`--class-images ${value}: the folder ${resolve(value)} (its images are the class images; run elsewhere to generate ${value} instead)`);
  }
  return !folder;
}

/** The settings from the flags over the schema's defaults for the mode; options of the other mode refused. */
export function settingsFromFlags(values: ParsedFlags): RunSettings {
  const mode = (stringFlag(values, 'mode') ?? 'lora') as TrainMode;
  if (mode !== 'lora' && mode !== 'full') throw new SettingsError(`--mode must be lora or full, got ${JSON.stringify(mode)}`, 'mode');
  const s = defaultSettings(mode) as unknown as Record<SettingKey, unknown>;
  for (const spec of SETTINGS) {
    if (!spec.flag || values[spec.flag] === undefined) continue;
    if (spec.onlyMode && spec.onlyMode !== mode)
      throw new SettingsError(`--${spec.flag} applies to --mode ${spec.onlyMode} only: leave it out for --mode ${mode}`, spec.key);
    s[spec.key] = parseSettingValue(spec, values[spec.flag]!);
  }
  const settings = s as unknown as RunSettings;
  // Prior preservation on the command line: --class-prompt turns it on; --class-images gives them or a count.
  settings.priorPreservation = values['class-prompt'] !== undefined;
  const classImages = stringFlag(values, 'class-images');
  if (classImages !== undefined && !settings.priorPreservation)
    throw new SettingsError('--class-images needs --class-prompt (prior preservation uses both)', 'classPrompt');
  if (classImages !== undefined && classImagesIsCount(classImages)) settings.classCount = Number(classImages);
  if (settings.mode === 'lora' && values.alpha === undefined) settings.alpha = settings.rank;
  validateSettings(settings);
  // A flag that would do nothing as given (--sample-steps without --sample-every, ...) is refused by name.
  refuseInactive(settings, (spec) => values[spec.flag!] !== undefined);
  return settings;
}

function exportsFrom(value: string | undefined, mode: TrainMode, network = 'lora'): ExportFormat[] {
  // a LyCORIS network (--network locon, loha, lokr) has one LoRA layout, kohya's (export/lycoris.ts)
  const lycoris = mode === 'lora' && network !== 'lora';
  if (value === undefined) return lycoris ? ['lora-kohya'] : DEFAULT_EXPORTS[mode];
  const formats = value
    .split(',')
    .map((f) => f.trim())
    .filter(Boolean);
  const known = Object.keys(EXPORT_FORMATS) as ExportFormat[];
  for (const f of formats) {
    if (!known.includes(f as ExportFormat)) throw new UsageError(`--export: unknown format "${f}": use any of ${known.join(', ')} (comma-separated)`);
    if (!EXPORT_FORMATS[f as ExportFormat].modes.includes(mode))
      throw new UsageError(`--export ${f} holds LoRA adapters: a --mode ${mode} run exports full-single-file or diffusers-zip`);
  }
  if (!formats.length) throw new UsageError('--export needs at least one format');
  // lora-diffusers holds plain LoRA (diffusers loads no LyCORIS keys): refused before any work; full exports merge
  if (lycoris && formats.includes('lora-diffusers'))
    throw new UsageError(
      `--export lora-diffusers holds plain LoRA adapters: a --network ${network} run exports lora-kohya (LyCORIS keys, as A1111 and ComfyUI load them), full-single-file or diffusers-zip`,
    );
  return [...new Set(formats)] as ExportFormat[];
}

function needFolder(path: string, flag: string): void {
  if (!existsSync(path)) throw new UsageError(`--${flag} ${path} is not a folder of images: no such folder`);
  if (!statSync(path).isDirectory()) throw new UsageError(`--${flag} ${path} is not a folder of images: it is a file (give the folder that holds the photos)`);
}

/** A fresh run's run.json from its flags, checked before any work. */
function newRun(values: ParsedFlags): RunFile {
  const missing = ['model', 'images', 'prompt', 'out'].filter((k) => values[k] === undefined);
  if (missing.length) throw new UsageError(`train needs ${missing.map((k) => `--${k}`).join(', ')}\n${TRAIN_USAGE}`);
  const settings = settingsFromFlags(values);
  const prompt = stringFlag(values, 'prompt')!;
  validatePrompt(prompt, '--prompt');
  const model = stringFlag(values, 'model')!;
  if (!existsSync(model)) throw new UsageError(`--model ${model}: no such file or folder`);
  const images = stringFlag(values, 'images')!;
  needFolder(images, 'images');
  const classImages = stringFlag(values, 'class-images');
  if (classImages !== undefined && !classImagesIsCount(classImages)) needFolder(classImages, 'class-images');
  const masks = stringFlag(values, 'masks');
  if (masks !== undefined) {
    needFolder(masks, 'masks');
    refuseMasksAsImages(masks, images);
    pairMasks(imageFiles(images), imageFiles(masks), masks); // by name before any work; the pixels once decoded
  }
  const tokenizer = stringFlag(values, 'tokenizer');
  if (tokenizer !== undefined && !existsSync(tokenizer)) throw new UsageError(`--tokenizer ${tokenizer}: no such folder`);
  const config = stringFlag(values, 'config');
  if (config !== undefined) configOverrides(config, 'unet'); // read and checked now: a bad file names itself before any work
  const run: RunFile = {
    version: 2,
    inputs: {
      model: resolve(model),
      images: resolve(images),
      prompt,
      exports: exportsFrom(stringFlag(values, 'export'), settings.mode, settings.network),
      ...(classImages !== undefined ? { classImages: classImagesIsCount(classImages) ? classImages : resolve(classImages) } : {}),
      ...(masks !== undefined ? { masks: resolve(masks) } : {}),
      ...(tokenizer !== undefined ? { tokenizer: resolve(tokenizer) } : {}),
      ...(config !== undefined ? { config: resolve(config) } : {}),
    },
    settings,
  };
  run.fingerprints = fingerprintsOf(run.inputs);
  return run;
}

/** run.json of a folder, validated (never trusted): its settings through the schema, its inputs by type. */
function readRunFile(dir: string): RunFile {
  const path = join(dir, 'run.json');
  if (!existsSync(path)) throw new UsageError(`--resume ${dir}: no run.json there (not a training output folder)`);
  let j: RunFile;
  const text = readFileSync(path, 'utf8');
  try {
    j = JSON.parse(text);
  } catch (e) {
    throw new UsageError(`${path}: invalid JSON (${jsonSyntaxProblem(e, text)}): this run's record is damaged; start a new run with another --out`);
  }
  if (j?.version !== 2 || typeof j.inputs !== 'object' || typeof j.settings !== 'object')
    throw new UsageError(`${path}: not a run record of this version (no version 2 inputs and settings): start a new run with another --out`);
  for (const k of ['model', 'images', 'prompt'] as const)
    if (typeof j.inputs[k] !== 'string') throw new UsageError(`${path}: inputs.${k} is ${JSON.stringify(j.inputs[k])}, not text: the run record is damaged`);
  if (j.inputs.masks !== undefined && typeof j.inputs.masks !== 'string')
    throw new UsageError(`${path}: inputs.masks is ${JSON.stringify(j.inputs.masks)}, not text: the run record is damaged`);
  try {
    validateSettings({ ...defaultSettings(j.settings.mode === 'full' ? 'full' : 'lora'), ...j.settings }, (k) => `settings.${k}`);
  } catch (e) {
    throw new UsageError(`${path}: ${(e as Error).message}: the run record is damaged`);
  }
  // Records made before the optimizer modes existed were fp32 AdamW runs (today's full default is 8-bit +
  // compact): their checkpoints resume in the mode they were made in.
  const before = { optimizer: 'adamw', master: 'fp32' } as const;
  j.settings = { ...defaultSettings(j.settings.mode), ...before, ...j.settings };
  j.inputs.exports = exportsFrom(Array.isArray(j.inputs.exports) ? j.inputs.exports.join(',') : undefined, j.settings.mode, j.settings.network);
  return j;
}

/** A resumed run's record with what may change applied; anything else given is refused. */
function resumeRun(values: ParsedFlags): { out: string; run: RunFile } {
  const out = stringFlag(values, 'resume')!;
  for (const k of Object.keys(values))
    if (!RESUME_FLAGS.has(k) && values[k] !== undefined)
      throw new UsageError(
        `--${k} cannot be given with --resume: the run in ${out} keeps the settings it started with (its checkpoint depends on them). ` +
          `With --resume only --model (the model moved), --steps (extend the run) and --export may be given; start a new run with another --out to change --${k}`,
      );
  const run = readRunFile(out);
  const model = stringFlag(values, 'model');
  if (model !== undefined) {
    if (!existsSync(model)) throw new UsageError(`--model ${model}: no such file or folder`);
    run.inputs.model = resolve(model);
  } else if (!existsSync(run.inputs.model)) throw new UsageError(`this run's model ${run.inputs.model} is gone: pass --model <its new path> with --resume`);
  if (values.steps !== undefined) {
    const before = run.settings.steps;
    run.settings.steps = parseSettingValue(
      SETTINGS.find((s) => s.key === 'steps')!,
      values.steps,
    ) as number;
    // More steps extend the run from its checkpoint; fewer than it has done are refused once the checkpoint is read.
    if (run.settings.steps !== before) console.error(`--steps: the run had ${before} steps; it now runs to step ${run.settings.steps}`);
  }
  if (values.export !== undefined) run.inputs.exports = exportsFrom(stringFlag(values, 'export'), run.settings.mode, run.settings.network);
  validateSettings(run.settings);
  // Before any work: the inputs are the run's own (a record from before fingerprints gets them now).
  const i = run.inputs;
  for (const [flag, path] of [
    ['--images', i.images],
    ['--masks', i.masks],
    ['--class-images', i.classImages && !/^\d+$/.test(i.classImages) ? i.classImages : undefined],
    ['--tokenizer', i.tokenizer],
    ['--config', i.config],
  ])
    if (path !== undefined && !existsSync(path))
      throw new UsageError(
        `this run's ${flag} ${path} is gone: put it back where it was (a resumed run trains on its own inputs), or start a new run with another --out`,
      );
  const now = fingerprintsOf(run.inputs);
  if (run.fingerprints !== undefined) checkFingerprints(run, now);
  run.fingerprints = now;
  return { out, run };
}

// ---- the run folder: one run, one process ---------------------------------------------------------------

/** Files a run writes into its folder (removed by --overwrite). */
const RUN_FILES = ['run.json', 'store', 'samples', ...Object.values(EXPORT_FORMATS).map((f) => f.file)];

function isRunFolder(out: string): boolean {
  return existsSync(join(out, 'run.json')) || existsSync(join(out, 'store'));
}

/** The run folder, created if need be; a file in its place or a folder that cannot be written is named. */
function makeRunFolder(out: string): void {
  if (existsSync(out) && !statSync(out).isDirectory()) throw new UsageError(`--out ${out} is a file: give a folder for the run (it is created if missing)`);
  try {
    mkdirSync(out, { recursive: true });
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).code;
    const why =
      code === 'EACCES' || code === 'EPERM'
        ? 'no permission to create it'
        : code === 'EROFS'
          ? 'the disk is read-only'
          : code === 'ENOSPC'
            ? 'the disk is full'
            : code === 'ENOTDIR'
              ? 'a file stands where a folder of its path should be'
              : `${code ?? (e as Error).message}`;
    throw new UsageError(`--out ${out}: cannot create the run folder (${why}): choose another --out`);
  }
}

/** A new run's caption files (--images), refused by name when one is not UTF-8 text or is empty (CaptionError). */
export async function checkNewRunCaptions(values: ParsedFlags): Promise<void> {
  const images = stringFlag(values, 'images');
  if (images !== undefined && existsSync(images) && statSync(images).isDirectory()) await checkCaptionFiles(images);
}

// ---- the command --------------------------------------------------------------------------------------

export async function trainCommand(gpu: Gpu, argv: string[]): Promise<void> {
  const { values } = parseFlags(argv, FLAGS, TRAIN_USAGE);
  let out: string;
  let run: RunFile;
  if (values.resume !== undefined) ({ out, run } = resumeRun(values));
  else {
    run = newRun(values);
    out = stringFlag(values, 'out')!;
    if (isRunFolder(out)) {
      if (values.overwrite !== true)
        throw new UsageError(
          `${out} holds another run (run.json, store/): continue it with --resume ${out}, replace it with --overwrite, or choose another --out`,
        );
    } else if (values.overwrite === true) throw new UsageError(`--overwrite: ${out} holds no run to replace (leave --overwrite out)`);
    const i = run.inputs;
    checkOutFolder(
      '--out',
      out,
      [
        { flag: '--model', path: i.model },
        { flag: '--images', path: i.images },
        { flag: '--masks', path: i.masks },
        { flag: '--class-images', path: i.classImages },
        { flag: '--tokenizer', path: i.tokenizer },
        { flag: '--config', path: i.config },
      ],
      'a folder for the run',
    );
    // Only what this project wrote there is replaced (the folder's manifest); anything else of that name is refused.
    claimEntries('--out', out, RUN_FILES);
    refuseLeftAside('--out', out);
  }
  // A caption file that cannot be its photo's caption is refused before the run folder is made.
  if (values.resume === undefined) await checkNewRunCaptions(values);
  const created = !existsSync(out);
  makeRunFolder(out);
  const unlock = takeRunLock(out, 'training in it');
  const state: RunState = { training: false, pause: null, signal: null, replaced: null };
  const isNew = values.resume === undefined;
  // --overwrite sets the old run aside; it is removed only once the new run has passed every check (trainIn).
  if (isNew && values.overwrite === true)
    try {
      state.replaced = setAsideWritten(out);
    } catch (e) {
      unlock();
      throw e;
    }
  // Stopped while loading or encoding, nothing is trained yet: the lock goes (and a new run's files), so the
  // identical retry starts cleanly. Stopped while training, the step in flight finishes and is checkpointed.
  const offSignals = onStopSignal(
    (signal) => {
      state.signal = signal;
      if (!state.training || !state.pause) {
        console.error(`${signal}: stopped before training began; nothing was trained`);
        if (isNew) abandonNewRun(out, created, state);
        unlock();
        process.exit(SIGNAL_EXIT_CODES[signal]);
      }
      console.error(`${signal}: pausing: finishing the step and saving a checkpoint (a second signal stops at once)`);
      state.pause();
    },
    () => unlock(),
  );
  try {
    await trainIn(gpu, out, run, values.resume !== undefined, state);
  } catch (e) {
    // A new run refused before its first step (no photos, a rank or budget that does not fit, ...) leaves no
    // trace: what it wrote goes, and the folder too if it made it, so the corrected retry is not "another run".
    if (isNew && !state.training) abandonNewRun(out, created, state);
    throw e;
  } finally {
    offSignals();
    unlock();
  }
}

/** A run's progress as the signal handler sees it. */
interface RunState {
  /** Training has begun (a refusal after this keeps the run's files: it is resumable). */
  training: boolean;
  /** Asks the run to stop at the end of the step in flight, with a checkpoint. */
  pause: (() => void) | null;
  /** The stop signal received, if any (its exit code is the command's). */
  signal: StopSignal | null;
  /** The run --overwrite replaces, set aside until this one has passed every check. */
  replaced: SetAside | null;
}

/**
 * Removes what a refused new run wrote (its manifest's entries), puts back the run an --overwrite set aside,
 * and removes the folder if the run created it and it is empty.
 */
function abandonNewRun(out: string, created: boolean, state: RunState): void {
  removeWritten(out);
  state.replaced?.restore();
  state.replaced = null;
  rmSync(join(out, 'lock'), { force: true });
  if (created && readdirSync(out).length === 0) rmSync(out, { recursive: true, force: true });
}

/** Opens the model the CLI way: a diffusers folder, or a single file with --tokenizer; --config overrides. */
async function openModel(run: RunFile): Promise<{ opened: OpenedModel; close: () => Promise<void> }> {
  const { model, tokenizer: tokDir, config } = run.inputs;
  const overrides = config ? configOverrides(config, 'unet') : undefined;
  if (statSync(model).isDirectory()) {
    const reader = nodeFolder(model);
    const tokenizer = tokDir ? await tokenizerFilesFrom(nodeFolder(tokDir), '') : await tokenizerFilesFrom(reader);
    if (!tokenizer) throw new UsageError(`${tokDir ?? join(model, 'tokenizer')}: no tokenizer.json, or vocab.json and merges.txt`);
    return { opened: { kind: 'diffusers', name: basename(model), reader, tokenizer, ...(overrides ? { overrides } : {}) }, close: async () => undefined };
  }
  if (!tokDir) throw new UsageError('a single-file checkpoint carries no tokenizer: pass --tokenizer <folder with vocab.json and merges.txt>');
  // SDXL: a folder holding tokenizer/ and tokenizer_2/ (as `cli sample` takes it) gives both tokenizers.
  const both = existsSync(join(tokDir, 'tokenizer_2'));
  const tokenizer: ClipTokenizerFiles | null = await tokenizerFilesFrom(nodeFolder(tokDir), both ? 'tokenizer/' : '');
  if (!tokenizer) throw new UsageError(`--tokenizer ${tokDir}: no ${both ? 'tokenizer/ with ' : ''}tokenizer.json, or vocab.json and merges.txt`);
  const tokenizer2 = both ? await tokenizerFilesFrom(nodeFolder(tokDir), 'tokenizer_2/') : null;
  if (both && !tokenizer2) throw new UsageError(`--tokenizer ${tokDir}: tokenizer_2/ has no tokenizer.json, or vocab.json and merges.txt`);
  // A single file has no tokenizer: the diffusers zip gets the one training used, so diffusers loads it.
  const tokenizerFiles = new Map<string, Uint8Array>();
  for (const f of TOKENIZER_FILES) if (existsSync(join(tokDir, f))) tokenizerFiles.set(f, readFileSync(join(tokDir, f)));
  const file = await SafetensorsFile.open(await NodeFileSource.open(model));
  return {
    opened: {
      kind: 'single-file',
      name: basename(model),
      file,
      tokenizer,
      tokenizerFiles,
      ...(tokenizer2 ? { tokenizer2 } : {}),
      ...(overrides ? { overrides } : {}),
    },
    close: async () => file.source.close?.(),
  };
}

/**
 * A folder's images as pipeline inputs (decoded here; a file that is not an image is named and skipped). With
 * `caption`, a caption file that is not UTF-8 text or is empty is refused (CaptionError).
 */
async function folderImages(dir: string, caption: boolean): Promise<ImageInput[]> {
  const { images, errors } = await loadImageDir(dir, { onWarning: (m) => console.error(`warning: ${m}`), refuseBadCaptions: caption });
  for (const e of errors) console.error(`warning: skipped ${e.message}`);
  return images.map((im, i) => ({ id: String(i), name: im.name, pixels: im.image, ...(caption && im.caption !== undefined ? { caption: im.caption } : {}) }));
}

/** A folder's image file names (not captions, hidden files or folders): what the mask pairing sees before decoding. */
function imageFiles(dir: string): string[] {
  return readdirSync(dir, { withFileTypes: true })
    .filter((e) => !e.name.startsWith('.') && !e.isDirectory() && extname(e.name).toLowerCase() !== '.txt')
    .map((e) => e.name);
}

/**
 * Attaches each photo's loss mask from `dir` (masks.ts pairs them: the photo's name, kohya's convention).
 * Every photo needs one (a white image trains a photo whole), so a missing mask is an error that names the
 * photos, not a silently unmasked photo; a mask that matches no photo is named and ignored; masks that are
 * all black would train nothing and are refused.
 */
async function attachMasks(images: ImageInput[], dir: string): Promise<ImageInput[]> {
  const { images: masks, errors } = await loadImageDir(dir, { onWarning: (m) => console.error(`warning: --masks ${m}`) });
  if (errors.length) throw new UsageError(`--masks ${dir}: ${errors.map((e) => e.message).join('; ')}`);
  const pairs = pairMasks(
    images.map((im) => im.name),
    masks.map((m) => m.name),
    dir,
  );
  const byName = new Map(masks.map((m) => [m.name, m]));
  const used = new Set(pairs.values());
  for (const m of masks) if (!used.has(m.name)) console.error(`warning: --masks ${join(dir, m.name)} matches no photo; ignored`);
  checkBlackMasks(
    images.map((im) => ({ photo: im.name, mask: pairs.get(im.name)!, image: byName.get(pairs.get(im.name)!)!.image })),
    dir,
    (m) => console.error(`warning: ${m}`),
  );
  return images.map((im) => {
    const m = byName.get(pairs.get(im.name)!)!;
    return { ...im, mask: { name: join(basename(dir), m.name), pixels: m.image } };
  });
}

const mib = (b: number) => formatBytes(b, { unit: 'MiB' });

function clock(seconds: number): string {
  const s = Math.max(0, Math.round(seconds));
  return `${Math.floor(s / 3600)}:${String(Math.floor(s / 60) % 60).padStart(2, '0')}:${String(s % 60).padStart(2, '0')}`;
}

/** Phases whose message the terminal shows (the step lines say the rest). */
const LONG_PHASES: ReadonlySet<string> = new Set(['loading', 'class-images', 'encoding', 'validating', 'checkpoint', 'exporting']);

/** Progress for a terminal: a line per step on stdout, everything else on stderr. */
function printEvent(e: RunEvent, out: string): void {
  switch (e.type) {
    case 'phase':
      // The long ones (class images, encoding, validation, the warm-up step, an export) say i of n and the time left.
      if (LONG_PHASES.has(e.phase) || (e.phase === 'training' && e.etaSeconds !== undefined)) console.error(e.message);
      break;
    case 'warning':
      console.error(`warning: ${e.message}`);
      break;
    case 'plan': {
      const p = e.plan;
      console.error(
        `plan: peak ${mib(p.peakBytes)} of the ${mib(p.budgetBytes)} budget, activation checkpointing ${p.activationCheckpointing ? 'on' : 'off'}, ${p.residentChunks}/${p.chunks} optimizer chunks resident${p.fusedUpdates ? ', fused updates' : ''}`,
      );
      break;
    }
    case 'resumed':
      console.error(`resumed at step ${e.step} from the last checkpoint`);
      break;
    case 'step': {
      const r = e.report;
      // The session's first step compiles the GPU pipelines: shown as warm-up, not as s/step. The ETA counts
      // samples and checkpoints too; "~" marks one that rests on a first estimate (timing.ts).
      const pace = e.secondsPerStep === null ? `warm-up ${(e.warmupSeconds ?? r.seconds).toFixed(2)} s` : `${e.secondsPerStep.toFixed(2)} s/step`;
      const eta = e.etaSeconds === null ? '?' : `${e.provisional ? '~' : ''}${clock(e.etaSeconds)}`;
      console.log(
        `step ${r.step}/${e.steps} loss ${r.loss.toFixed(5)} ${pace} ETA ${eta} ` +
          `gpu ${mib(r.gpuBytes)} (peak ${mib(r.gpuPeakBytes)}) storage ${mib(e.storageBytes)}${r.skipped ? ` SKIPPED: ${r.skipped}` : ''}`,
      );
      break;
    }
    case 'sample': {
      recordWritten(out, ['samples']);
      mkdirSync(join(out, 'samples'), { recursive: true });
      const file = join(out, 'samples', `step-${String(e.step).padStart(6, '0')}.png`);
      writeOutput(file, e.png);
      console.error(`sample: ${file} (${e.seconds.toFixed(1)} s)`);
      break;
    }
    case 'validation': {
      const v = e.report;
      const cls = v.class === null ? '' : `, class images ${v.class.toFixed(5)}`;
      console.error(`validation loss at step ${v.step}: photos ${v.instance.toFixed(5)}${cls} (${e.seconds.toFixed(1)} s)`);
      break;
    }
    case 'checkpoint':
      break;
  }
}

/** Why a resumed run's model must match: the same architecture as when the run started. */
function modelKeyOf(r: TrainingRun): string {
  return JSON.stringify({ family: r.model.family, prediction: r.model.prediction, unet: r.model.unet.config });
}

async function trainIn(gpu: Gpu, out: string, run: RunFile, resuming: boolean, state: RunState): Promise<void> {
  const { inputs, settings } = run;
  // A new run's record goes first, so a run killed while encoding is still this folder's run (and
  // resumable); a resumed one is rewritten only once its model is known to be the run's. Each entry is
  // listed in the folder's manifest before it is written (outpath.ts).
  recordWritten(out, ['run.json', 'store']);
  if (!resuming) writeOutput(join(out, 'run.json'), JSON.stringify(run, null, 2));
  const { opened, close } = await openModel(run);
  try {
    const photos = await folderImages(inputs.images, true);
    const images = inputs.masks ? await attachMasks(photos, inputs.masks) : photos;
    const classImages = inputs.classImages && !/^\d+$/.test(inputs.classImages) ? await folderImages(inputs.classImages, false) : [];
    const store = await FsChunkStore.open(join(out, 'store'));
    try {
      const tr = await TrainingRun.prepare(
        {
          gpu,
          dryRunGpu: () => nodeGpu({ dryRun: true }),
          store,
          decode: async (blob, name) => decodeImageNode(new Uint8Array(await blob.arrayBuffer()), name),
          emit: (e) => printEvent(e, out),
          encodePng: (rgb, width, height) => encodePng({ width, height, data: rgb, channels: 3, depth: 8 }),
        },
        opened,
        { runId: 'run', prompt: inputs.prompt, images, classImages, settings },
      ).catch((e: unknown) => {
        // A checkpoint (or cache) record edited after it was written: named, never resumed from.
        if (e instanceof SnapshotBindingError)
          throw new UsageError(
            `this run's last checkpoint (${e.key} in ${join(out, 'store')}) cannot be trusted: ${e.detail}. Start the run again with another --out`,
          );
        throw e;
      });
      try {
        const key = modelKeyOf(tr);
        if (resuming && run.modelKey && run.modelKey !== key)
          throw new UsageError(`--model ${inputs.model} is not the model this run started with (its architecture differs): pass the run's own model`);
        run.modelKey = key;
        writeOutput(join(out, 'run.json'), JSON.stringify(run, null, 2));
        // Every check passed: the run --overwrite replaces goes now, before the first step.
        state.replaced?.discard();
        state.replaced = null;
        state.training = true;
        await trainAndExport(tr, out, run, inputs.exports, state);
      } finally {
        await tr.destroy();
      }
    } finally {
      await store.close();
    }
  } finally {
    await close();
  }
}

async function trainAndExport(tr: TrainingRun, out: string, run: RunFile, exports: ExportFormat[], state: RunState): Promise<void> {
  const s = run.settings;
  console.error(`training ${s.mode} for ${s.steps} steps (${tr.trainer.storedChunks} optimizer chunks streamed through the store)`);
  // A stop signal (signals.ts) pauses at the next step boundary with a checkpoint; a second one stops at once.
  state.pause = () => tr.pause();
  let result: Awaited<ReturnType<TrainingRun['train']>>;
  try {
    result = await tr.train();
  } catch (e) {
    if (e instanceof RunStorageFullError) throw new Error(`${e.message}\nAfter freeing space: npm run cli -- train --resume ${out}`, { cause: e });
    throw e;
  } finally {
    state.pause = null;
  }
  if (result !== 'done') {
    console.error(`paused at step ${tr.step} with a checkpoint: continue with npm run cli -- train --resume ${out}`);
    process.exitCode = SIGNAL_EXIT_CODES[state.signal ?? 'SIGINT'];
    return;
  }
  const sizes: Record<string, number> = {};
  for (const format of exports) {
    const file = EXPORT_FORMATS[format].file;
    recordWritten(out, [file]);
    await tr.exportTo(format, await nodeFileSink(join(out, file)));
    sizes[file] = statSync(join(out, file)).size;
  }
  console.log(JSON.stringify({ done: true, steps: tr.step, mode: s.mode, exports: sizes, finalLoss: tr.trainer.losses.at(-1) }));
}
