// `npm run bench:quality [-- --model <diffusers folder>] [--quick] [--seeds N] [--rank R] [--train-text-encoder
//   [--text-encoder-lr x]] [--out file.json] [--figure file.png]`   (--rank and the text-encoder flags change the LoRA runs only)
// Issue 16, Must show 3: DreamBooth on a pretrained model with a subject held out of pretraining (a yellow star
// with purple dots; stars are excluded from `lab:pretrain`'s data by default), 4 photos of it, LoRA and full,
// each with and without prior preservation, through the product's run pipeline (lab/demo-model/bench/quality-run.ts).
// Per run, before (the base model) and after fine-tuning, on samples of the same seeds:
//   subject_fidelity_*  mean cosine of VAE-encoder latents of "a sks star" samples vs the photos (all pairs)
//   subject_colour_*    mean colour-histogram intersection of the same pairs
//   prompt_fidelity     share of border pixels nearest red in "a sks star on a red background" samples
//   drift               1 - cosine of VAE latents of "a star" samples, fine-tuned vs base, same seeds (also in
//                       pixels, and in colours: 1 - histogram intersection, position-free)
// Each configuration is trained with several run seeds; the table and bench/results/quality.json give the
// median over them (and every seed's figures). Default model: the shipped demo model (public/demo-model, 64 px);
// `--model tests/fixtures/models/pretrained-tiny` runs it on the tests' 16 px fixture (bench/results/quality-tiny.json).
import { mkdirSync, writeFileSync } from 'node:fs';
import { cpus, loadavg } from 'node:os';
import { dirname, join, relative, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';
import { encode as encodePng } from 'fast-png';
import { nodeGpu } from '../../../src/gpu/node.ts';
import { median } from '../quality.ts';
import { gitCommit } from '../../../bench/git.ts';
import {
  BACKGROUND_PROMPT,
  CLASS_PROMPT,
  INSTANCE_PROMPT,
  loadFeatureVae,
  modelResolution,
  PHOTO_SEED,
  PHOTOS,
  qualityRun,
  qualitySettings,
  SUBJECT,
  type QualityResult,
  type QualitySettings,
} from './quality-run.ts';

const ROOT = join(dirname(fileURLToPath(import.meta.url)), '..', '..', '..');
export const DEFAULT_MODEL = join(ROOT, 'public', 'demo-model');

const { values } = parseArgs({
  options: {
    model: { type: 'string' },
    quick: { type: 'boolean' },
    seeds: { type: 'string' },
    rank: { type: 'string' },
    'train-text-encoder': { type: 'boolean' },
    'text-encoder-lr': { type: 'string' },
    out: { type: 'string' },
    figure: { type: 'string' },
  },
});
const quick = values.quick === true;
const model = resolve(values.model ?? DEFAULT_MODEL);
const seeds = Number(values.seeds ?? (quick ? 1 : 3));
if (!Number.isInteger(seeds) || seeds < 1 || seeds > 100) throw new Error(`--seeds ${values.seeds}: use a whole number of run seeds from 1 to 100`);
const rank = values.rank === undefined ? undefined : Number(values.rank);
if (rank !== undefined && !(Number.isInteger(rank) && rank >= 1 && rank <= 64)) throw new Error(`--rank ${values.rank}: use a LoRA rank from 1 to 64`);
const teLr = values['text-encoder-lr'] === undefined ? undefined : Number(values['text-encoder-lr']);
if (teLr !== undefined && !(teLr > 0 && teLr <= 1 && values['train-text-encoder']))
  throw new Error(`--text-encoder-lr ${values['text-encoder-lr']}: give a learning rate above 0 and at most 1, with --train-text-encoder`);
const outFile = resolve(values.out ?? join(ROOT, 'bench', 'results', 'quality.json'));

/** The four configurations: LoRA and full, each without and with prior preservation. */
function configurations(): Omit<QualitySettings, 'seed'>[] {
  const lora = {
    ...qualitySettings('lora', quick),
    ...(rank ? { rank } : {}),
    trainTextEncoder: values['train-text-encoder'] === true,
    ...(teLr ? { textEncoderLr: teLr } : {}),
  };
  const full = qualitySettings('full', quick);
  return [
    { ...lora, prior: false },
    { ...lora, prior: true },
    { ...full, prior: false },
    { ...full, prior: true },
  ];
}

const FIELDS: (keyof QualityResult)[] = [
  'subject_fidelity_before',
  'subject_fidelity_after',
  'subject_colour_before',
  'subject_colour_after',
  'prompt_fidelity_before',
  'prompt_fidelity',
  'drift',
  'drift_pixels',
  'drift_colour',
  'final_loss',
  'train_seconds',
  'sample_seconds',
];

const gpu = await nodeGpu();
const a = gpu.adapter;
const machine = {
  adapter: `${a.vendor} ${a.architecture} ${a.description}`.trim(),
  cpu: cpus()[0]?.model.trim() ?? 'unknown CPU',
  cores: cpus().length,
  node: process.version,
  f16: gpu.hasF16,
};
const loadStart = loadavg()[0];
const resolution = modelResolution(model);
console.log(`model ${relative(ROOT, model) || model} (${resolution} px), ${machine.adapter}, load ${loadStart.toFixed(1)}${quick ? '   [--quick]' : ''}`);
const vae = await loadFeatureVae(gpu, model);
const runs = [];
// --figure: run seed 1's "a sks star" samples, one row per picture set (see writeFigure).
const figureRows: { label: string; images: Uint8Array[] }[] = [];
const t0 = performance.now();
for (const c of configurations()) {
  const perSeed: QualityResult[] = [];
  for (let seed = 1; seed <= seeds; seed++) {
    const keep = (s: { photos: Uint8Array[]; base: Uint8Array[]; tuned: Uint8Array[] }) => {
      if (seed !== 1) return;
      if (!figureRows.length) figureRows.push({ label: 'photos', images: s.photos }, { label: 'base', images: s.base });
      figureRows.push({ label: `${c.mode}${c.prior ? '+prior' : ''}`, images: s.tuned });
    };
    const r = await qualityRun(gpu, model, vae, { ...c, seed }, (m) => console.error(m), keep);
    perSeed.push(r);
    console.error(`${c.mode} prior=${c.prior} seed ${seed}: ${JSON.stringify(r)}`);
  }
  const medians = Object.fromEntries(FIELDS.map((f) => [f, median(perSeed.map((r) => r[f]))])) as unknown as QualityResult;
  runs.push({ name: `${c.mode}${c.prior ? '+prior' : ''}`, settings: c, ...medians, seeds: perSeed });
}
const seconds = (performance.now() - t0) / 1000;

const f3 = (x: number) => x.toFixed(3);
console.log(`\nmedians over ${seeds} run seed(s):`);
console.log('run          fidelity before->after   colour before->after   prompt before->after   drift  (pixels, colours)  loss    train s');
for (const r of runs)
  console.log(
    `${r.name.padEnd(12)} ${f3(r.subject_fidelity_before)} -> ${f3(r.subject_fidelity_after)}         ${f3(r.subject_colour_before)} -> ${f3(r.subject_colour_after)}          ` +
      `${f3(r.prompt_fidelity_before)} -> ${f3(r.prompt_fidelity)}         ${f3(r.drift)}  (${f3(r.drift_pixels)}, ${f3(r.drift_colour)})   ${r.final_loss.toFixed(3)}  ${r.train_seconds.toFixed(0)}`,
  );
console.log(`total ${seconds.toFixed(0)} s`);
if (values.figure) writeFigure(resolve(values.figure), figureRows, resolution);

/**
 * One PNG: a row per picture set (the 4 photos; the base model's "a sks star" samples; each configuration's, run
 * seed 1, the same sample seeds), pictures upscaled 3x nearest-neighbour, 4 px white gaps.
 */
function writeFigure(file: string, rows: { label: string; images: Uint8Array[] }[], size: number): void {
  const scale = 3;
  const gap = 4;
  const cell = size * scale + gap;
  const cols = Math.max(...rows.map((r) => r.images.length));
  const W = cell * cols - gap;
  const H = cell * rows.length - gap;
  const out = new Uint8Array(W * H * 3).fill(255);
  for (const [row, r] of rows.entries())
    for (const [col, rgb] of r.images.entries())
      for (let y = 0; y < size * scale; y++)
        for (let x = 0; x < size * scale; x++) {
          const src = (Math.floor(y / scale) * size + Math.floor(x / scale)) * 3;
          const dst = ((row * cell + y) * W + col * cell + x) * 3;
          out.set(rgb.subarray(src, src + 3), dst);
        }
  writeFileSync(file, encodePng({ width: W, height: H, data: out, channels: 3, depth: 8 }));
  console.log(`wrote ${file}: rows ${rows.map((r) => r.label).join(', ')}`);
}

mkdirSync(dirname(outFile), { recursive: true });
writeFileSync(
  outFile,
  JSON.stringify(
    {
      bench: 'quality',
      date: new Date().toISOString(),
      commit: gitCommit(),
      machine,
      loadAverage: { start: loadStart, end: loadavg()[0] },
      model: { path: relative(ROOT, model) || model, resolution },
      quick,
      runSeeds: seeds,
      subject: SUBJECT,
      photos: { count: PHOTOS, seed: PHOTO_SEED },
      prompts: { instance: INSTANCE_PROMPT, background: BACKGROUND_PROMPT, class: CLASS_PROMPT },
      features: {
        subject_fidelity: 'mean cosine similarity of the base model VAE encoder posterior means (scaled latents), over sample x photo pairs',
        subject_colour: 'mean colour-histogram intersection (4 bins per channel) over sample x photo pairs',
        prompt_fidelity: 'mean share of border pixels (outer size/8 px) whose nearest named colour is red',
        drift: 'mean over seeds of 1 - cosine of VAE latents, class-prompt samples fine-tuned vs base (same seeds)',
        drift_pixels: 'mean absolute 8-bit difference / 255 of the same samples',
        drift_colour: 'mean over seeds of 1 - colour-histogram intersection of the same samples (position-free)',
      },
      seconds,
      runs,
    },
    null,
    2,
  ) + '\n',
);
console.log(`wrote ${relative(ROOT, outFile)}`);
gpu.destroy();
