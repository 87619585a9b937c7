// `npm run lab:pretrain -- ...` (the lab's entry, cli.ts): trains the demo model from scratch (pretrain.ts) on the
// procedural captioned scenes (synthetic.ts), with checkpoints and resume, and writes it as a diffusers folder.
//   pretrain --out <dir> [--size small|small-f4|tiny] [--steps N] [--vae-steps N] [--batch N] [--resolution px]
//            [--data-size N] [--data-seed N] [--exclude star,...] [--seed N] [--lr x] [--vae-lr x] [--vae-crop px]
//            [--ema-decay x] [--token-std x] [--solid-share p] [--bare-share p] [--prediction v_prediction|epsilon] [--checkpoint-every N] [--bpe <bpe_simple_vocab_16e6.txt.gz>]
//            [--vae-from <diffusers folder>] [--init-from <diffusers folder>] [--overwrite]
//   pretrain --resume <dir> [--steps N] [--vae-steps N]   (more VAE steps only while the VAE stage runs)
//   pretrain --resume <dir> --export      (writes <dir>/model from the last checkpoint, part-way, and trains nothing)
// --vae-from starts the UNet stage on another run's VAE; --init-from also goes on training its UNet and text
// encoder (a new run: fresh optimizer state, the EMA from those weights; the model's size, settings, prediction
// type and tokenizer unless flags change the settings), so training can continue from a model when the run's
// checkpoints are gone or finished.
// The run folder holds pretrain.json (size and settings, validated on resume), tokenizer/ (vocab.json and
// merges.txt, built once from CLIP's BPE list), store/ (checkpoints) and, at the end, model/ (the diffusers
// folder: fp16 weights, configs, tokenizer).
import { cpSync, existsSync, mkdirSync, readFileSync, rmSync } from 'node:fs';
import { takeRunLock } from '../../src/io/runlock.ts';
import { onStopSignal, SIGNAL_EXIT_CODES, type StopSignal } from '../../src/cli/signals.ts';
import { checkOutFolder, claimEntries, recordWritten, setAsideWritten, writeOutput, type SetAside } from '../../src/io/outpath.ts';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { gunzipSync } from 'node:zlib';
import type { Gpu } from '../../src/gpu/device.ts';
import { ClipTokenizer } from '../../src/io/tokenizer.ts';
import { clipTokenizerFromBpe } from './demo.ts';
import { StorageFullError } from '../../src/store/chunkstore.ts';
import { FsChunkStore } from '../../src/store/fs-store.ts';
import {
  checkPretrainSettings,
  PRETRAIN_DEFAULTS,
  PRETRAIN_SIZES,
  Pretrainer,
  type PretrainedDenoiser,
  pretrainedModelFiles,
  savedPretrainSettings,
  type PretrainConfigs,
  type PretrainedVae,
  type PretrainSettings,
} from './pretrain.ts';
import { readSafetensors } from '../../src/io/safetensors.ts';
import { SHAPES, type ShapeName } from './synthetic.ts';
import { numberFlag, parseFlags, readJsonFile, stringFlag, UsageError, type Flags, type ParsedFlags } from '../../src/cli/args.ts';

export const USAGE =
  'usage: pretrain --out <dir> [--size small|small-f4|tiny] [--steps N] [--vae-steps N] [--batch N] [--resolution px] [--data-size N] [--data-seed N] ' +
  '[--exclude star,...] [--seed N] [--lr x] [--vae-lr x] [--vae-crop px] [--ema-decay x] [--token-std x] [--solid-share p] [--bare-share p] [--prediction v_prediction|epsilon] [--checkpoint-every N] [--bpe <file.txt.gz>] [--vae-from <diffusers folder>] [--init-from <diffusers folder>] [--overwrite] | pretrain --resume <dir> [--steps N] [--vae-steps N] | pretrain --resume <dir> --export';

/** Number flags, the setting each sets, its range and what --help says of it. */
const NUMBER_FLAGS: [string, keyof PretrainSettings, { integer?: boolean; min?: number }, string][] = [
  ['steps', 'steps', { integer: true, min: 0 }, 'UNet (and text encoder) steps of stage 2; on --resume, more steps'],
  ['vae-steps', 'vaeSteps', { integer: true, min: 0 }, 'VAE steps of stage 1; on --resume, more while that stage runs'],
  ['batch', 'batch', { integer: true, min: 1 }, 'pictures per step'],
  ['resolution', 'resolution', { integer: true, min: 1 }, "picture side in px (a multiple of the VAE's factor)"],
  ['data-size', 'dataSize', { integer: true, min: 1 }, 'pictures in the dataset'],
  ['data-seed', 'dataSeed', { integer: true, min: 0 }, "the dataset generator's seed"],
  ['seed', 'seed', { integer: true, min: 0 }, "the run's own seed (batches, noise, timesteps, caption dropout)"],
  ['lr', 'lr', {}, 'learning rate of stage 2'],
  ['vae-lr', 'vaeLr', {}, 'learning rate of stage 1'],
  ['vae-crop', 'vaeCrop', { integer: true, min: 0 }, 'side in px of the random crops stage 1 trains on (0: whole pictures)'],
  ['ema-decay', 'emaDecay', {}, "the EMA's decay cap"],
  ['checkpoint-every', 'checkpointEvery', { integer: true, min: 0 }, 'checkpoint every N steps'],
  ['token-std', 'tokenStd', {}, "standard deviation of the text encoder's (frozen) token table at the start"],
  ['solid-share', 'solidShare', {}, 'share of pictures with solid objects, and apart from that of solid backgrounds'],
  ['bare-share', 'bareShare', {}, "share of stage 2's captions that leave the background unsaid"],
];
export const FLAGS: Flags = {
  ...Object.fromEntries(
    NUMBER_FLAGS.map(([f, key, o, help]) => [f, { type: 'string' as const, arg: '<n>', help, default: String(PRETRAIN_DEFAULTS[key] ?? 'none'), ...o }]),
  ),
  out: { type: 'string', arg: '<dir>', help: 'the run folder of a new run (pretrain.json, tokenizer/, store/, model/)', default: 'required (or --resume)' },
  resume: { type: 'string', arg: '<dir>', help: 'continue the run in <dir> from its last checkpoint', default: 'none' },
  size: { type: 'string', arg: `<${Object.keys(PRETRAIN_SIZES).join('|')}>`, help: "the model's size", default: 'small' },
  exclude: { type: 'string', arg: '<shape,...>', help: `shapes the dataset never draws (${SHAPES.join(', ')})`, default: PRETRAIN_DEFAULTS.exclude.join(',') },
  prediction: { type: 'string', arg: '<v_prediction|epsilon>', help: 'what the UNet learns to predict', default: PRETRAIN_DEFAULTS.prediction },
  bpe: { type: 'string', arg: '<file.txt.gz>', help: "CLIP's BPE merge list the tokenizer is built from", default: 'data/clip/bpe_simple_vocab_16e6.txt.gz' },
  'vae-from': { type: 'string', arg: '<diffusers folder>', help: "start stage 2 on another run's VAE", default: 'none' },
  'init-from': { type: 'string', arg: '<diffusers folder>', help: 'go on training a model: its VAE, UNet and text encoder (a new run)', default: 'none' },
  overwrite: { type: 'boolean', help: 'replace the run in --out' },
  export: { type: 'boolean', help: 'with --resume: write <dir>/model from the last checkpoint and train nothing' },
};

/** CLIP's BPE merge list, vendored in data/clip (MIT, with its licence). */
const DEFAULT_BPE = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'data', 'clip', 'bpe_simple_vocab_16e6.txt.gz');

interface RunFile {
  size: keyof typeof PRETRAIN_SIZES;
  settings: PretrainSettings;
  /** The diffusers folder whose VAE the run started from (`--vae-from`), for the record. */
  vaeFrom?: string;
  /** The diffusers folder whose VAE, UNet and text encoder the run went on from (`--init-from`). */
  initFrom?: string;
}

/** What a new run starts from instead of the initialisation: a trained VAE, and with --init-from the UNet and text encoder. */
interface Start {
  vae?: PretrainedVae;
  denoiser?: PretrainedDenoiser;
  /** The UNet steps the denoiser had had in all. */
  denoiserSteps?: number;
  /** The settings the denoiser was trained with (the new run's, unless flags say otherwise), its prediction type from its scheduler. */
  settings?: PretrainSettings;
}

function readStart(flag: string, dir: string, withDenoiser: boolean, configs: PretrainConfigs): Start {
  const vae = readVaeFrom(flag, dir, configs.vae);
  if (!withDenoiser) return { vae };
  const { denoiser, steps, settings } = readDenoiserFrom(flag, dir, configs);
  if (!['vocab.json', 'merges.txt'].every((f) => existsSync(join(dir, 'tokenizer', f))))
    throw new UsageError(`${flag}: no tokenizer/vocab.json and tokenizer/merges.txt there, the tokenizer its text encoder reads; give <run>/model of a run`);
  const scheduler = join(dir, 'scheduler', 'scheduler_config.json');
  const prediction = existsSync(scheduler) ? (readJsonFile(scheduler, 'the scheduler config') as { prediction_type?: unknown }).prediction_type : undefined;
  if (prediction !== 'epsilon' && prediction !== 'v_prediction')
    throw new UsageError(
      `${flag}: its scheduler/scheduler_config.json names no prediction_type (epsilon or v_prediction), so what its UNet predicts is unknown`,
    );
  return { vae, denoiser, denoiserSteps: steps, settings: { ...settings, prediction } };
}

/** The size whose VAE and UNet widths a diffusers folder's configs have (undefined when none does, or the configs are unreadable). */
function sizeOf(dir: string): RunFile['size'] | undefined {
  const widths = (c: string) => {
    const path = join(dir, c, 'config.json');
    return existsSync(path) ? JSON.stringify((readJsonFile(path, `the ${c} config`) as { block_out_channels?: unknown }).block_out_channels) : undefined;
  };
  const [vae, unet] = [widths('vae'), widths('unet')];
  return (Object.keys(PRETRAIN_SIZES) as RunFile['size'][]).find(
    (k) => JSON.stringify(PRETRAIN_SIZES[k].vae.block_out_channels) === vae && JSON.stringify(PRETRAIN_SIZES[k].unet.block_out_channels) === unet,
  );
}

/** A component's config.json and fp16/f32 weights in a diffusers folder, its config checked against the size's. */
function readComponent(flag: string, dir: string, component: 'vae' | 'unet' | 'text_encoder', want: Record<string, unknown>, keys: readonly string[]) {
  const what = { vae: 'VAE', unet: 'UNet', text_encoder: 'text encoder' }[component];
  const file = component === 'text_encoder' ? 'model.safetensors' : 'diffusion_pytorch_model.safetensors';
  const configPath = join(dir, component, 'config.json');
  const weightsPath = join(dir, component, file);
  if (!existsSync(configPath) || !existsSync(weightsPath))
    throw new UsageError(`${flag}: no ${component}/config.json and ${component}/${file} there; give a diffusers folder (e.g. <run>/model)`);
  const config = readJsonFile(configPath, `the ${what} config`) as Record<string, unknown>;
  for (const k of keys)
    if (JSON.stringify(config[k]) !== JSON.stringify(want[k]))
      throw new UsageError(
        `${flag}: its ${what} has ${k} ${JSON.stringify(config[k])}, this size's has ${JSON.stringify(want[k])}: start from a ${what} of the same size`,
      );
  const { tensors, metadata } = readSafetensors(new Uint8Array(readFileSync(weightsPath)));
  return { config, metadata, weights: new Map([...tensors].map(([n, t]) => [n, Float32Array.from(t.data)])) };
}

/**
 * `--vae-from`: the VAE of a diffusers folder (a finished or `--export`ed pretraining run of the same size),
 * its config checked against the size's, its weights widened to f32, its latent scale from its config.
 */
function readVaeFrom(flag: string, dir: string, want: PretrainConfigs['vae']): PretrainedVae {
  const { config, weights } = readComponent(flag, dir, 'vae', want, ['block_out_channels', 'layers_per_block', 'norm_num_groups', 'latent_channels']);
  const scalingFactor = config.scaling_factor;
  if (typeof scalingFactor !== 'number' || !(scalingFactor > 0) || scalingFactor === 1)
    throw new UsageError(`${flag}: its VAE config has no measured scaling_factor (${String(scalingFactor)}): use a VAE a pretraining run finished`);
  return { weights, scalingFactor };
}

/** A model's pretraining settings from its UNet's metadata ({} when it has none). */
function parseSettings(flag: string, json: string | undefined): Partial<PretrainSettings> {
  try {
    return JSON.parse(json ?? '{}') as Partial<PretrainSettings>;
  } catch {
    throw new UsageError(`${flag}: its UNet's settings metadata is not JSON: use <run>/model of a pretraining run`);
  }
}

/**
 * `--init-from`: the UNet and text encoder of a pretraining run's model (finished or `--export`ed part-way) to
 * go on training, and the UNet steps they had had in all (its `total_steps`; `step`, or its settings' `steps`,
 * for a model written before runs kept a total).
 */
function readDenoiserFrom(flag: string, dir: string, want: PretrainConfigs): { denoiser: PretrainedDenoiser; steps: number; settings: PretrainSettings } {
  const unetKeys = Object.keys(want.unet).filter((k) => k !== 'sample_size');
  const unet = readComponent(flag, dir, 'unet', want.unet, unetKeys);
  const te = readComponent(flag, dir, 'text_encoder', want.text_encoder, Object.keys(want.text_encoder));
  const saved = parseSettings(flag, unet.metadata.settings);
  // A finished run written before models kept their step is at its settings' last step.
  const steps = Number(unet.metadata.total_steps ?? unet.metadata.step ?? saved.steps);
  if (unet.metadata.generator !== 'DreamBooth Studio pretrain' || !Number.isInteger(steps) || steps < 1)
    throw new UsageError(`${flag}: its UNet was not written by a pretraining run (no step count in its metadata): use <run>/model of a run`);
  return { denoiser: { unet: unet.weights, text_encoder: te.weights }, steps, settings: savedPretrainSettings(saved) };
}

function settingsFrom(values: ParsedFlags, base: PretrainSettings): PretrainSettings {
  const s: PretrainSettings = { ...base };
  for (const [flag, key, o] of NUMBER_FLAGS) (s[key] as number) = numberFlag(values, flag, base[key] as number, o);
  const exclude = stringFlag(values, 'exclude');
  if (exclude !== undefined) {
    const names = exclude === '' ? [] : exclude.split(',').map((x) => x.trim());
    for (const n of names)
      if (!(SHAPES as readonly string[]).includes(n)) throw new UsageError(`--exclude ${n}: not a shape the generator draws (${SHAPES.join(', ')})`);
    s.exclude = names as ShapeName[];
  }
  const prediction = stringFlag(values, 'prediction');
  if (prediction !== undefined) {
    if (prediction !== 'epsilon' && prediction !== 'v_prediction') throw new UsageError(`--prediction ${prediction}: use epsilon or v_prediction`);
    s.prediction = prediction;
  }
  return s;
}

/** The run folder's tokenizer: built once from the BPE list, then read back on resume. */
function runTokenizer(dir: string, vocabSize: number, bpePath: string | undefined) {
  const vocabPath = join(dir, 'tokenizer', 'vocab.json');
  const mergesPath = join(dir, 'tokenizer', 'merges.txt');
  if (!existsSync(vocabPath)) {
    const bpe = bpePath ?? DEFAULT_BPE;
    if (!existsSync(bpe)) throw new UsageError(`--bpe ${bpe}: no such file; give CLIP's merge list bpe_simple_vocab_16e6.txt.gz`);
    const files = clipTokenizerFromBpe(gunzipSync(readFileSync(bpe)).toString('utf8'), vocabSize);
    recordWritten(dir, ['tokenizer']);
    mkdirSync(join(dir, 'tokenizer'), { recursive: true });
    writeOutput(vocabPath, JSON.stringify(files.vocab));
    writeOutput(mergesPath, files.merges);
  }
  const files = { vocab: JSON.parse(readFileSync(vocabPath, 'utf8')) as Record<string, number>, merges: readFileSync(mergesPath, 'utf8') };
  return { files, tokenizer: ClipTokenizer.fromFiles(files) };
}

/** Writes the diffusers folder to <dir>/model, replacing an earlier one. */
function writeModel(dir: string, files: Map<string, Uint8Array>): void {
  recordWritten(dir, ['model']);
  rmSync(join(dir, 'model'), { recursive: true, force: true });
  for (const [path, bytes] of files) {
    mkdirSync(dirname(join(dir, 'model', path)), { recursive: true });
    writeOutput(join(dir, 'model', path), bytes);
  }
}

/** What a pretraining run writes at the top of its folder. */
const PRETRAIN_ENTRIES = ['pretrain.json', 'store', 'model', 'tokenizer'];

export async function pretrainCommand(gpu: Gpu, args: string[]): Promise<void> {
  const { values } = parseFlags(args, FLAGS, USAGE);
  const resumeDir = stringFlag(values, 'resume');
  const outDir = stringFlag(values, 'out');
  if (!!resumeDir === !!outDir) throw new UsageError(`pretrain needs --out <dir> (a new run) or --resume <dir>\n${USAGE}`);
  const dir = (resumeDir ?? outDir)!;
  const runPath = join(dir, 'pretrain.json');
  let run: RunFile;
  let start: Start = {};
  /** The run --overwrite replaces: set aside until this one's first step (src/io/outpath.ts), put back if it never comes. */
  let replaced: SetAside | null = null;
  if (resumeDir) {
    if (!existsSync(runPath)) throw new UsageError(`--resume ${dir}: no pretrain.json there (not a pretraining run folder)`);
    for (const f of Object.keys(values))
      if (!['resume', 'steps', 'vae-steps', 'export'].includes(f))
        throw new UsageError(`--${f} cannot change on --resume (the run keeps its own settings); only --steps and --vae-steps can`);
    run = JSON.parse(readFileSync(runPath, 'utf8')) as RunFile;
    // A setting added after the run began takes the value the run had before it existed.
    run.settings = savedPretrainSettings(run.settings);
    run.settings.steps = numberFlag(values, 'steps', run.settings.steps, { integer: true, min: run.settings.steps });
    // More VAE steps only while the VAE stage runs (Pretrainer.resume refuses them after it).
    run.settings.vaeSteps = numberFlag(values, 'vae-steps', run.settings.vaeSteps, { integer: true, min: run.settings.vaeSteps });
    // Before its first checkpoint a run that began from a model needs that model again (after, the checkpoint holds it).
    const from = run.initFrom ?? run.vaeFrom;
    if (from && existsSync(from))
      start = readStart(`the run's ${run.initFrom ? '--init-from' : '--vae-from'} ${from}`, from, !!run.initFrom, PRETRAIN_SIZES[run.size]);
  } else {
    if (values.export) throw new UsageError(`--export writes the model of an existing run: use it with --resume <dir>`);
    const vaeFromDir = stringFlag(values, 'vae-from');
    const initFromDir = stringFlag(values, 'init-from');
    // Going on from a model, the size is the model's unless --size says otherwise (and then must match it).
    const size = (stringFlag(values, 'size') ?? (initFromDir && sizeOf(initFromDir)) ?? 'small') as RunFile['size'];
    if (!(size in PRETRAIN_SIZES)) throw new UsageError(`--size ${size}: use ${Object.keys(PRETRAIN_SIZES).join(' or ')}`);
    if (vaeFromDir && initFromDir)
      throw new UsageError(`--vae-from and --init-from: --init-from ${initFromDir} starts from that model's VAE too; give one of them`);
    const fromDir = initFromDir ?? vaeFromDir;
    const fromFlag = initFromDir ? '--init-from' : '--vae-from';
    if (fromDir && values['vae-steps'] !== undefined && Number(values['vae-steps']) !== 0)
      throw new UsageError(
        `${fromFlag} and --vae-steps ${String(values['vae-steps'])}: a run that starts from a trained VAE has no VAE stage; leave --vae-steps out`,
      );
    if (fromDir) start = readStart(`${fromFlag} ${fromDir}`, fromDir, !!initFromDir, PRETRAIN_SIZES[size]);
    const prediction = stringFlag(values, 'prediction');
    if (start.settings && prediction && prediction !== start.settings.prediction)
      throw new UsageError(
        `--prediction ${prediction}: the model of --init-from ${initFromDir} predicts ${start.settings.prediction}; going on, it must predict the same (leave --prediction out)`,
      );
    // A new run trains with the defaults; one going on from a model, with the settings that model was trained with,
    // except its seed: the same seed would draw the same batches, timesteps and noise the model has already seen,
    // so going on draws with the next one unless --seed says otherwise.
    const base = start.settings
      ? { ...start.settings, seed: (start.settings.seed + 1) >>> 0 }
      : size === 'tiny'
        ? { ...PRETRAIN_DEFAULTS, resolution: 16 }
        : PRETRAIN_DEFAULTS;
    run = {
      size,
      settings: { ...settingsFrom(values, fromDir ? { ...base, vaeSteps: 0 } : base), initSteps: start.denoiserSteps ?? 0 },
      ...(vaeFromDir ? { vaeFrom: resolve(vaeFromDir) } : {}),
      ...(initFromDir ? { initFrom: resolve(initFromDir) } : {}),
    };
    // Checked before the folder is touched: a dataset seed or size that cannot be honoured costs nothing.
    checkPretrainSettings(run.settings, PRETRAIN_SIZES[size]);
    if (run.settings.steps === 0 && run.settings.vaeSteps === 0)
      throw new UsageError(
        `--steps 0 and --vae-steps ${run.settings.vaeSteps}: no stage would train a step, so the run would write an untrained model: give --steps N (the denoiser) or --vae-steps N (the VAE)`,
      );
    if (existsSync(runPath) && !values.overwrite)
      throw new UsageError(`--out ${dir} already holds a pretraining run: continue it with --resume ${dir}, or pass --overwrite`);
    if (!existsSync(runPath) && values.overwrite) throw new UsageError(`--overwrite: ${dir} holds no pretraining run to replace (leave --overwrite out)`);
    checkOutFolder('--out', dir, [
      { flag: '--vae-from', path: vaeFromDir },
      { flag: '--init-from', path: initFromDir },
      { flag: '--bpe', path: stringFlag(values, 'bpe') },
    ]);
    // Only what a pretraining run wrote there is replaced (the folder's manifest): a model folder's own
    // tokenizer/ or model/ is refused, never deleted.
    claimEntries('--out', dir, PRETRAIN_ENTRIES);
    mkdirSync(dir, { recursive: true });
    if (values.overwrite) replaced = setAsideWritten(dir);
    recordWritten(dir, ['pretrain.json', 'store', ...(initFromDir ? ['tokenizer'] : [])]);
    // The text encoder goes on reading the tokenizer it was trained with.
    if (initFromDir) cpSync(join(initFromDir, 'tokenizer'), join(dir, 'tokenizer'), { recursive: true });
  }
  // One process per run folder (the same lock as train's), and the stop signals: before the first step
  // nothing is lost, so the lock goes and the process exits; during training the step in flight finishes and
  // is checkpointed.
  const unlock = takeRunLock(dir, 'pretraining in it');
  const stop: PretrainStop = { signal: null, stepping: false };
  const offSignals = onStopSignal(
    (signal) => {
      stop.signal = signal;
      if (!stop.stepping) {
        console.error(`${signal}: stopped before a training step; nothing to save`);
        unlock();
        process.exit(SIGNAL_EXIT_CODES[signal]);
      }
      console.error(`${signal}: pausing: finishing the step and saving a checkpoint (a second signal stops at once)`);
    },
    () => unlock(),
  );
  try {
    await pretrainIn(gpu, dir, run, start, values, resumeDir, stop);
  } finally {
    if (stop.stepping) replaced?.discard();
    else replaced?.restore();
    offSignals();
    unlock();
  }
}

/** What the signal handler told the training loop. */
interface PretrainStop {
  signal: StopSignal | null;
  /** The loop is stepping (a signal then waits for the step and a checkpoint). */
  stepping: boolean;
}

async function pretrainIn(
  gpu: Gpu,
  dir: string,
  run: RunFile,
  start: Start,
  values: ParsedFlags,
  resumeDir: string | undefined,
  stop: PretrainStop,
): Promise<void> {
  const runPath = join(dir, 'pretrain.json');
  const configs = PRETRAIN_SIZES[run.size];
  const { files: tokFiles, tokenizer } = runTokenizer(dir, configs.text_encoder.vocab_size, stringFlag(values, 'bpe'));
  if (!resumeDir) writeOutput(runPath, JSON.stringify(run, null, 2));
  const store = await FsChunkStore.open(join(dir, 'store'));
  // The run's checkpoints are written with its original step count; a longer --steps on resume extends it.
  // On resume everything comes back from the checkpoint; the model a run started from only seeds it.
  const p = await Pretrainer.create(gpu, tokenizer, run.settings, store, 'pretrain', configs, start.vae, start.denoiser);
  try {
    if (await p.resume()) {
      console.log(`resumed at ${p.stage} step ${p.step}`);
      writeOutput(runPath, JSON.stringify(run, null, 2)); // longer --steps / --vae-steps, once the checkpoint accepted them
    } else if (resumeDir && (run.initFrom ?? run.vaeFrom) && !start.vae) {
      const from = (run.initFrom ?? run.vaeFrom)!;
      throw new UsageError(`--resume ${dir}: the run started from ${from}, which is gone, and has no checkpoint yet; start it again with --out`);
    }
    if (values.export) {
      if (p.stage === 'vae' || (p.stage === 'unet' && p.step === 0))
        throw new UsageError(`--export ${dir}: the UNet stage has no checkpoint yet (stage ${p.stage}, step ${p.step}), so there is no model to write`);
      writeModel(dir, await pretrainedModelFiles(p, tokFiles, { partWay: true }));
      console.log(`wrote ${join(dir, 'model')} from the checkpoint at ${p.stage} step ${p.step} (EMA weights; the run itself is unchanged)`);
      return;
    }
    const t0 = performance.now();
    const recent: number[] = [];
    let last = 0;
    stop.stepping = true;
    for (;;) {
      const r = await p.trainStep();
      if (!r) break;
      if (stop.signal) {
        await p.checkpoint();
        console.error(`paused at ${p.stage} step ${p.step} with a checkpoint: continue with npm run lab:pretrain -- --resume ${dir}`);
        process.exitCode = SIGNAL_EXIT_CODES[stop.signal];
        return;
      }
      recent.push(r.loss);
      if (recent.length > 20) recent.shift();
      const total = r.stage === 'vae' ? run.settings.vaeSteps : run.settings.steps;
      if (r.step % 10 === 0 || r.step === total) {
        const now = performance.now();
        const mean = recent.reduce((a, b) => a + b, 0) / recent.length;
        console.log(`${r.stage} ${r.step}/${total} loss ${mean.toFixed(4)} (last ${recent.length}) ${((now - (last || t0)) / 1000 / 10).toFixed(2)} s/step`);
        last = now;
      }
      if (r.step === total) recent.length = 0;
    }
    const files = await pretrainedModelFiles(p, tokFiles);
    writeModel(dir, files);
    const mb = [...files.values()].reduce((a, b) => a + b.byteLength, 0) / 1e6;
    console.log(
      `wrote ${join(dir, 'model')} (${mb.toFixed(1)} MB; latent scale ${p.scalingFactor.toFixed(4)}) in ${((performance.now() - t0) / 1000).toFixed(0)} s`,
    );
  } catch (e) {
    if (e instanceof UsageError) throw e; // refused before any training: there is nothing to resume
    const hint = `the last checkpoint is kept: npm run lab:pretrain -- --resume ${dir}`;
    if (e instanceof StorageFullError) throw new Error(`${e.message}\nAfter freeing space, ${hint}`, { cause: e });
    throw new Error(`${(e as Error).message}\n${hint}`, { cause: e });
  } finally {
    p.destroy();
    await store.close();
  }
}
