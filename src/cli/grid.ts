// `cli grid --model <path> --prompts "a|b|..." [--seeds 1,2,3] [--steps 25] [--guidance 7.5]
//  [--negative "..."] [--sampler dpm++2m|ddim] [--width px] [--height px] [--scale 4] --out grid.png`
// One row per prompt, one column per seed, each image upscaled by --scale (nearest neighbour, so small models'
// pixels stay visible), and a JSON line per image with its prompt and seed. The README's demo-model grid is
// made with it (see README "The demo model").
import { existsSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { encode } from 'fast-png';
import type { Gpu } from '../gpu/device.ts';
import { MAX_IMAGE_SIDE } from '../sample/txt2img.ts';
import { numberFlag, parseFlags, readJsonFile, stringFlag, tableNumber, UsageError, type Flags } from './args.ts';
import { checkOutFile, writeOutput } from '../io/outpath.ts';
import { loadModel } from './run.ts';
import { loadTokenizer, modelSchedule, txt2imgCli } from './sample.ts';

/** grid's flags: what parses them and what --help says. */
export const GRID_FLAGS: Flags = {
  model: { type: 'string', arg: '<folder>', help: 'the model: a diffusers folder', default: 'required' },
  prompts: { type: 'string', arg: '<a|b|...>', help: 'the prompts, separated by |: one row each', default: 'required' },
  out: { type: 'string', arg: '<file.png>', help: 'the PNG to write', default: 'required' },
  negative: { type: 'string', arg: '<text>', help: 'the negative prompt of every image', default: 'none' },
  steps: { type: 'string', arg: '<n>', help: 'denoising steps', default: 25, min: 1, max: 1000, integer: true },
  guidance: { type: 'string', arg: '<x>', help: 'classifier-free guidance scale', default: 7.5, min: 0, max: 100 },
  seeds: { type: 'string', arg: '<1,2,...>', help: 'the seeds, comma-separated whole numbers: one column each', default: '1' },
  sampler: { type: 'string', arg: '<dpm++2m|ddim>', help: 'the sampler', default: 'dpm++2m' },
  width: { type: 'string', arg: '<px>', help: "each image's width", default: "the model's own size", min: 8, max: MAX_IMAGE_SIDE, integer: true },
  height: { type: 'string', arg: '<px>', help: "each image's height", default: "the model's own size", min: 8, max: MAX_IMAGE_SIDE, integer: true },
  scale: { type: 'string', arg: '<n>', help: 'each pixel drawn as an n x n block (small models)', default: 4, min: 1, max: 16, integer: true },
};
export const GRID_USAGE =
  'usage: grid --model <folder> --prompts "first prompt|second prompt|..." --out grid.png [--seeds 1,2,3] [--steps 25] [--guidance 7.5] [--negative "..."] [--sampler dpm++2m|ddim] [--width px] [--height px] [--scale 4]';

/** Gap in px between the images of the grid (white). */
const GAP = 2;

/** Comma-separated non-negative integers: the grid's seeds. */
function parseSeeds(text: string): number[] {
  const seeds = text.split(',').map((s) => s.trim());
  for (const s of seeds) if (!/^\d+$/.test(s)) throw new UsageError(`--seeds ${text}: use whole numbers separated by commas (e.g. 1,2,3)`);
  return seeds.map(Number);
}

export async function gridCommand(gpu: Gpu, args: string[]): Promise<void> {
  const { values } = parseFlags(args, GRID_FLAGS, GRID_USAGE);
  const arg = (k: string) => stringFlag(values, k);
  const modelPath = arg('model');
  const prompts = (arg('prompts') ?? '').split('|').map((p) => p.trim());
  const out = arg('out');
  if (!modelPath || arg('prompts') === undefined || !out) throw new UsageError(`grid needs --model, --prompts and --out\n${GRID_USAGE}`);
  if (prompts.some((p) => !p)) throw new UsageError(`--prompts ${arg('prompts')}: an empty prompt between the | separators`);
  if (!existsSync(modelPath) || !statSync(modelPath).isDirectory()) throw new UsageError(`--model ${modelPath}: give a diffusers model folder`);
  checkOutFile('--out', out, [{ flag: '--model', path: modelPath }]);
  const sampler = (arg('sampler') ?? 'dpm++2m') as 'ddim' | 'dpm++2m';
  if (sampler !== 'ddim' && sampler !== 'dpm++2m') throw new UsageError(`--sampler must be ddim or dpm++2m, got ${sampler}`);
  const seeds = parseSeeds(arg('seeds') ?? '1');
  const steps = tableNumber(values, GRID_FLAGS, 'steps');
  const guidance = tableNumber(values, GRID_FLAGS, 'guidance');
  const scale = tableNumber(values, GRID_FLAGS, 'scale');
  // The model's own size unless asked: sample_size latents times the VAE's factor.
  const vaeConfig = readJsonFile(join(modelPath, 'vae/config.json'), 'the VAE config') as { sample_size?: number };
  const side = vaeConfig.sample_size ?? 512;
  const width = numberFlag(values, 'width', side, GRID_FLAGS.width);
  const height = numberFlag(values, 'height', side, GRID_FLAGS.height);
  if ((width * scale + GAP) * seeds.length * (height * scale + GAP) * prompts.length > 64e6)
    throw new UsageError(`the grid would be over 64 megapixels: use fewer --prompts / --seeds or a smaller --scale`);

  const tokenizer = loadTokenizer(join(modelPath, 'tokenizer'));
  const model = await loadModel(gpu, modelPath, { dtype: gpu.computeDType });
  const schedule = modelSchedule(modelPath, model);

  const cellW = width * scale + GAP;
  const cellH = height * scale + GAP;
  const W = cellW * seeds.length - GAP;
  const H = cellH * prompts.length - GAP;
  const grid = new Uint8Array(W * H * 3).fill(255);
  for (const [row, prompt] of prompts.entries())
    for (const [col, seed] of seeds.entries()) {
      const negativePrompt = arg('negative') ?? '';
      const img = await txt2imgCli(gpu, model, tokenizer, { prompt, negativePrompt, steps, guidance, seed, width, height, sampler, schedule });
      // Nearest-neighbour upscale into the cell at (row, col).
      for (let y = 0; y < height * scale; y++)
        for (let x = 0; x < width * scale; x++) {
          const src = (Math.floor(y / scale) * width + Math.floor(x / scale)) * 3;
          const dst = ((row * cellH + y) * W + col * cellW + x) * 3;
          grid[dst] = img.rgb[src];
          grid[dst + 1] = img.rgb[src + 1];
          grid[dst + 2] = img.rgb[src + 2];
        }
      console.log(JSON.stringify({ row, col, prompt, seed }));
    }
  writeOutput(out, encode({ width: W, height: H, data: grid, channels: 3, depth: 8 }));
  console.log(JSON.stringify({ out, width: W, height: H, prompts: prompts.length, seeds, steps, guidance, sampler }));
}
