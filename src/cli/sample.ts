// `cli sample --model <path> --prompt "..." [--negative "..."] [--steps 25] [--guidance 7.5] [--seed 1]
//  [--sampler dpm++2m|ddim] [--width 512] [--height 512] [--tokenizer <dir>] [--config <json>] --out image.png`
import { existsSync, readFileSync, statSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { encode } from 'fast-png';
import type { Gpu } from '../gpu/device.ts';
import { ClipTokenizer } from '../io/tokenizer.ts';
import { txt2img } from '../sample/txt2img.ts';
import { scheduleFromJson, SD_SCHEDULE } from '../sample/schedulers.ts';
import { configOverrides, loadModel } from './run.ts';

/** The tokenizer folder: --tokenizer, or <model folder>/tokenizer. */
export function loadTokenizer(dir: string): ClipTokenizer {
  const p = (f: string) => join(dir, f);
  const json = (f: string) => (existsSync(p(f)) ? JSON.parse(readFileSync(p(f), 'utf8')) : undefined);
  const config = { ...json('special_tokens_map.json'), ...json('tokenizer_config.json') };
  if (existsSync(p('tokenizer.json'))) return ClipTokenizer.fromFiles({ tokenizerJson: json('tokenizer.json'), config });
  if (!existsSync(p('vocab.json')) || !existsSync(p('merges.txt'))) throw new Error(`${dir}: no tokenizer.json, or vocab.json and merges.txt`);
  return ClipTokenizer.fromFiles({ vocab: json('vocab.json'), merges: readFileSync(p('merges.txt'), 'utf8'), config });
}

export async function sampleCommand(gpu: Gpu, args: string[]): Promise<void> {
  const arg = (k: string) => (args.includes(k) ? args[args.indexOf(k) + 1] : undefined);
  const modelPath = arg('--model');
  const prompt = arg('--prompt');
  const out = arg('--out');
  if (!modelPath || prompt === undefined || !out) throw new Error('usage: sample --model <path> --prompt "..." --out image.png [--steps 25] [--seed 1] [--guidance 7.5] [--negative "..."] [--sampler dpm++2m|ddim] [--width 512] [--height 512] [--tokenizer <dir>] [--config <json>]');
  const isDir = existsSync(modelPath) && statSync(modelPath).isDirectory();
  const tokDir = arg('--tokenizer') ?? (isDir ? join(modelPath, 'tokenizer') : undefined);
  if (!tokDir) throw new Error('a single-file checkpoint carries no tokenizer: pass --tokenizer <folder with vocab.json and merges.txt>');
  const tokenizer = loadTokenizer(tokDir);
  const overrides = configOverrides(arg('--config'), 'unet');
  const model = await loadModel(gpu, modelPath, { dtype: gpu.computeDType, overrides });
  const schedJson = isDir && existsSync(join(modelPath, 'scheduler/scheduler_config.json')) ? JSON.parse(readFileSync(join(modelPath, 'scheduler/scheduler_config.json'), 'utf8')) : {};
  const schedule = { ...SD_SCHEDULE, ...scheduleFromJson({ ...schedJson, ...overrides?.scheduler }, model.prediction) };
  const sampler = (arg('--sampler') ?? 'dpm++2m') as 'ddim' | 'dpm++2m';
  if (sampler !== 'ddim' && sampler !== 'dpm++2m') throw new Error(`--sampler must be ddim or dpm++2m, got ${sampler}`);
  const num = (k: string, d: number) => {
    const v = arg(k);
    if (v === undefined) return d;
    const x = Number(v);
    if (!Number.isFinite(x)) throw new Error(`${k} must be a number, got ${v}`);
    return x;
  };
  const t0 = performance.now();
  const img = await txt2img(gpu, model, tokenizer, {
    prompt,
    negativePrompt: arg('--negative') ?? '',
    steps: num('--steps', 25),
    guidance: num('--guidance', 7.5),
    seed: num('--seed', 1),
    width: num('--width', 512),
    height: num('--height', 512),
    sampler,
    schedule,
    onStep: (i, n) => process.stderr.write(`step ${i}/${n} ${((performance.now() - t0) / 1000).toFixed(1)} s\n`),
  });
  writeFileSync(out, encode({ width: img.width, height: img.height, data: img.rgb, channels: 3, depth: 8 }));
  console.log(JSON.stringify({ out, width: img.width, height: img.height, sampler, steps: num('--steps', 25), seed: num('--seed', 1) }));
}
