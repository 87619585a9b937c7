// `cli sample --model <path> --prompt "..." [--negative "..."] [--steps 25] [--guidance 7.5] [--seed 1]
//  [--sampler dpm++2m|ddim] [--width 512] [--height 512] [--tokenizer <dir>] [--config <json>]
//  [--lora <file.safetensors> [--lora-scale 1]] --out image.png`
// --lora: a LoRA from diffusers' train_dreambooth_lora.py (pytorch_lora_weights.safetensors) or kohya, or one
// of our exports, applied to the UNet (and text encoder) at its own alpha / rank times --lora-scale.
import { existsSync, readFileSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { encode } from 'fast-png';
import type { Gpu } from '../gpu/device.ts';
import { ClipTokenizer } from '../io/tokenizer.ts';
import { MAX_IMAGE_SIDE, SampleOptionError, txt2img } from '../sample/txt2img.ts';
import { promptWarning } from '../pipeline/run.ts';
import { parseFlags, readJsonFile, stringFlag, tableNumber, UsageError, type Flags } from './args.ts';
import { scheduleFromJson, SD_SCHEDULE, type ScheduleConfig } from '../sample/schedulers.ts';
import type { LoadedModel } from '../models/load.ts';
import { configOverrides, loadModel } from './run.ts';
import { isSdxlPath, sampleSdxl } from './run-sdxl.ts';
import { SafetensorsFile } from '../io/safetensors.ts';
import { needRegularFile, NodeFileSource } from '../io/source-node.ts';
import { checkOutFile, writeOutput } from '../io/outpath.ts';
import { applyLora, checkImportedLora, loadedShapes, readImportedLora, type ReadLora } from '../pipeline/imported.ts';

/** The tokenizer folder: --tokenizer, or <model folder>/tokenizer. */
export function loadTokenizer(dir: string): ClipTokenizer {
  const p = (f: string) => join(dir, f);
  const json = (f: string) => (existsSync(p(f)) ? readJsonFile(p(f), `the tokenizer's ${f}`) : undefined);
  const config = { ...json('special_tokens_map.json'), ...json('tokenizer_config.json') };
  if (existsSync(p('tokenizer.json'))) return ClipTokenizer.fromFiles({ tokenizerJson: json('tokenizer.json'), config });
  if (!existsSync(p('vocab.json')) || !existsSync(p('merges.txt'))) throw new Error(`${dir}: no tokenizer.json, or vocab.json and merges.txt`);
  needRegularFile(p('merges.txt'));
  try {
    return ClipTokenizer.fromFiles({ vocab: json('vocab.json') as Record<string, number>, merges: readFileSync(p('merges.txt'), 'utf8'), config });
  } catch (e) {
    throw new UsageError(`${dir}: ${(e as Error).message}`);
  }
}

/** sample's flags: what parses them and what --help says. */
export const SAMPLE_FLAGS: Flags = {
  model: { type: 'string', arg: '<path>', help: 'the model: a diffusers folder or a single .safetensors file (SD 1.x/2.x or SDXL)', default: 'required' },
  prompt: { type: 'string', arg: '<text>', help: 'what to draw', default: 'required' },
  out: { type: 'string', arg: '<file.png>', help: 'the PNG to write', default: 'required' },
  negative: { type: 'string', arg: '<text>', help: 'the negative prompt (classifier-free guidance pushes away from it)', default: 'none' },
  steps: { type: 'string', arg: '<n>', help: 'denoising steps', default: 25, min: 1, max: 1000, integer: true },
  guidance: { type: 'string', arg: '<x>', help: 'classifier-free guidance scale', default: 7.5, min: 0, max: 100 },
  seed: { type: 'string', arg: '<n>', help: 'the seed of the starting noise', default: 1, min: 0, max: Number.MAX_SAFE_INTEGER, integer: true },
  sampler: { type: 'string', arg: '<dpm++2m|ddim>', help: 'the sampler', default: 'dpm++2m' },
  width: {
    type: 'string',
    arg: '<px>',
    help: "the image's width (a multiple of the model's factor)",
    default: 512,
    min: 8,
    max: MAX_IMAGE_SIDE,
    integer: true,
  },
  height: {
    type: 'string',
    arg: '<px>',
    help: "the image's height (a multiple of the model's factor)",
    default: 512,
    min: 8,
    max: MAX_IMAGE_SIDE,
    integer: true,
  },
  tokenizer: { type: 'string', arg: '<dir>', help: 'a folder with vocab.json and merges.txt (or tokenizer.json)', default: "the model folder's tokenizer/" },
  config: { type: 'string', arg: '<json>', help: "config overrides of the model's components", default: 'none' },
  lora: { type: 'string', arg: '<file.safetensors>', help: 'a LoRA to apply (kohya or PEFT/diffusers keys)', default: 'none' },
  'lora-scale': { type: 'string', arg: '<x>', help: "with --lora: a multiplier of the LoRA's own scale", default: 1, min: -10, max: 10 },
};
export const SAMPLE_USAGE =
  'usage: sample --model <path> --prompt "..." --out image.png [--steps 25] [--seed 1] [--guidance 7.5] [--negative "..."] [--sampler dpm++2m|ddim] [--width 512] [--height 512] [--tokenizer <dir>] [--config <json>] [--lora <file.safetensors> [--lora-scale 1]]';

/** A prompt of nothing but special tokens (<|endoftext|>, ...) conditions on no words: refused, not sampled. */
export function refuseSpecialOnly(tokenizer: ClipTokenizer, prompt: string, flag: string): void {
  const ids = prompt.trim() ? tokenizer.encode(prompt) : [];
  const special = new Set([tokenizer.bosId, tokenizer.eosId, tokenizer.padId]);
  if (ids.length && ids.every((id) => special.has(id)))
    throw new UsageError(`${flag} ${JSON.stringify(prompt)} holds only special tokens (start, end or padding of text): describe the picture in words`);
}

/** A LoRA file read (and refused by key when it is for another architecture or rank layout) before the model loads. */
export async function readLoraFile(path: string, flag = '--lora'): Promise<ReadLora> {
  if (!existsSync(path)) throw new UsageError(`${flag} ${path}: no such file`);
  if (statSync(path).isDirectory())
    throw new UsageError(`${flag} ${path} is a folder: give the LoRA file (e.g. ${join(path, 'pytorch_lora_weights.safetensors')})`);
  const file = await SafetensorsFile.open(await NodeFileSource.open(path));
  try {
    return await readImportedLora(file);
  } finally {
    await file.source.close?.();
  }
}

/** The sampling schedule: SD's, with a model folder's scheduler config (if it has one) and `overrides` on top. */
export function modelSchedule(folder: string | null, model: LoadedModel, overrides?: Record<string, unknown>): ScheduleConfig {
  const path = folder && join(folder, 'scheduler/scheduler_config.json');
  const json = path && existsSync(path) ? readJsonFile(path, 'the scheduler config') : {};
  return { ...SD_SCHEDULE, ...scheduleFromJson({ ...json, ...overrides }, model.prediction, path || '--config scheduler') };
}

/** txt2img for the command line: its option errors (checked before any GPU work) become usage errors naming the flag. */
export function txt2imgCli(...args: Parameters<typeof txt2img>): ReturnType<typeof txt2img> {
  return txt2img(...args).catch((e: unknown) => {
    throw e instanceof SampleOptionError ? new UsageError(`--${e.message}`) : e;
  });
}

export async function sampleCommand(gpu: Gpu, args: string[]): Promise<void> {
  const { values } = parseFlags(args, SAMPLE_FLAGS, SAMPLE_USAGE);
  const arg = (k: string) => stringFlag(values, k);
  const modelPath = arg('model');
  const prompt = arg('prompt');
  const out = arg('out');
  if (!modelPath || prompt === undefined || !out) throw new UsageError(`sample needs --model, --prompt and --out\n${SAMPLE_USAGE}`);
  if (!existsSync(modelPath)) throw new UsageError(`--model ${modelPath}: no such file or folder`);
  checkOutFile('--out', out, [
    { flag: '--model', path: modelPath },
    { flag: '--lora', path: arg('lora') },
    { flag: '--tokenizer', path: arg('tokenizer') },
    { flag: '--config', path: arg('config') },
  ]);
  const sampler = (arg('sampler') ?? 'dpm++2m') as 'ddim' | 'dpm++2m';
  if (sampler !== 'ddim' && sampler !== 'dpm++2m') throw new UsageError(`--sampler must be ddim or dpm++2m, got ${sampler}`);
  // Ranges first (before the model loads); the sizes against the model's factor once it is known.
  const steps = tableNumber(values, SAMPLE_FLAGS, 'steps');
  const guidance = tableNumber(values, SAMPLE_FLAGS, 'guidance');
  const seed = tableNumber(values, SAMPLE_FLAGS, 'seed');
  const width = tableNumber(values, SAMPLE_FLAGS, 'width');
  const height = tableNumber(values, SAMPLE_FLAGS, 'height');
  const loraPath = arg('lora');
  if (values['lora-scale'] !== undefined && !loraPath) throw new UsageError('--lora-scale needs --lora <file>');
  const loraStrength = tableNumber(values, SAMPLE_FLAGS, 'lora-scale');
  const lora = loraPath ? await readLoraFile(loraPath) : null;
  const isDir = statSync(modelPath).isDirectory();
  if (await isSdxlPath(modelPath)) {
    if (lora) throw new UsageError(`--lora ${loraPath}: LoRAs on SDXL models are not supported yet`);
    const o = { prompt, negativePrompt: arg('negative') ?? '', steps, guidance, seed, width, height, sampler };
    const img = await sampleSdxl(gpu, modelPath, arg('tokenizer') ?? (isDir ? modelPath : undefined), configOverrides(arg('config'), 'unet'), o);
    writeOutput(out, encode({ width: img.width, height: img.height, data: img.rgb, channels: 3, depth: 8 }));
    console.log(JSON.stringify({ out, width: img.width, height: img.height, sampler, steps, seed, model: 'sdxl' }));
    return;
  }
  const tokDir = arg('tokenizer') ?? (isDir ? join(modelPath, 'tokenizer') : undefined);
  if (!tokDir) throw new UsageError('a single-file checkpoint carries no tokenizer: pass --tokenizer <folder with vocab.json and merges.txt>');
  const tokenizer = loadTokenizer(tokDir);
  refuseSpecialOnly(tokenizer, prompt, '--prompt');
  for (const [text, flag] of [
    [prompt, '--prompt'],
    [arg('negative') ?? '', '--negative'],
  ] as const) {
    const w = text ? promptWarning(tokenizer, text, flag) : null;
    if (w) console.error(`warning: ${w}`);
  }
  const overrides = configOverrides(arg('config'), 'unet');
  const model = await loadModel(gpu, modelPath, { dtype: gpu.computeDType, overrides });
  if (lora) {
    checkImportedLora(lora, loadedShapes(model), loraPath!, modelPath);
    applyLora(gpu, model, lora);
    console.error(
      `lora: ${lora.adapters.size} adapted layers (${lora.format}, rank ${lora.rank}, scale ${lora.scale} x ${loraStrength}), ${lora.skipped.length} keys skipped`,
    );
    if (lora.skipped.length)
      console.error(
        `warning: ${loraPath}: ${lora.skipped.length} keys adapt layers the engine has no LoRA on (e.g. ${lora.skipped.slice(0, 3).join(', ')}); they are left out`,
      );
  }
  const schedule = modelSchedule(isDir ? modelPath : null, model, overrides?.scheduler);
  const t0 = performance.now();
  const img = await txt2imgCli(gpu, model, tokenizer, {
    prompt,
    negativePrompt: arg('negative') ?? '',
    steps,
    guidance,
    seed,
    width,
    height,
    sampler,
    schedule,
    ...(lora ? { loraScale: lora.scale * loraStrength } : {}),
    onStep: (i, n) => process.stderr.write(`step ${i}/${n} ${((performance.now() - t0) / 1000).toFixed(1)} s\n`),
  });
  writeOutput(out, encode({ width: img.width, height: img.height, data: img.rgb, channels: 3, depth: 8 }));
  console.log(
    JSON.stringify({
      out,
      width: img.width,
      height: img.height,
      sampler,
      steps,
      seed,
      ...(lora ? { lora: loraPath, loraScale: lora.scale * loraStrength } : {}),
    }),
  );
}
