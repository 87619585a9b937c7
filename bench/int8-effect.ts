// npm run bench:int8 [-- --steps N] — int8 frozen base weights (src/ops/int8.ts) on a model that has learned
// something: the shipped demo model (public/demo-model, an SD 1-architecture model pretrained on the synthetic
// shapes data, the held-out subject a yellow dotted star). Issue 47 item 4's measurement, three figures:
//   1. forward error: the UNet's output with its int8 base against the f16 base, relative RMS
//      ||out_int8 - out_f16|| / ||out_f16||, on noisy latents of the subject's photos at several timesteps;
//   2. the LoRA gradient cosine: one step's LoRA gradients (the same batch, noise and timesteps) on each base;
//   3. a short LoRA DreamBooth trained on each base from the same seed: the validation loss (fixed noise and
//      timesteps) before and after, each step's loss against the other base's (the same draws), and the cosine of
//      the two trained LoRAs' up projections.
// The f16 base is the reference: int8 is what it is measured against, so the figures are differences, not
// quality. Writes bench/results/int8-effect.json after each stage (`complete` and `stagesDone` say how far it got).
import { mkdirSync, readFileSync, readdirSync, statSync, writeFileSync } from 'node:fs';
import { dirname, join, relative } from 'node:path';
import { fileURLToPath } from 'node:url';
import { drawScene, subjectScene, SUBJECT_LOOK, toModelInput } from '../lab/demo-model/synthetic.ts';
import type { Gpu } from '../src/gpu/device.ts';
import { nodeGpu } from '../src/gpu/node.ts';
import { BytesSource, type ByteSource } from '../src/io/source.ts';
import { ClipTokenizer } from '../src/io/tokenizer.ts';
import { loadDiffusers, type LoadedModel } from '../src/models/load.ts';
import { folderFromSources } from '../src/models/source.ts';
import { SHIPPED_DEMO_RESOLUTION } from '../src/models/shipped-demo.ts';
import { unetForward } from '../src/nn/unet.ts';
import { quantizeWeights } from '../src/ops/int8.ts';
import { TRAIN_DEFAULTS } from '../src/pipeline/settings.ts';
import { alphasCumprod, scheduleFromJson } from '../src/sample/schedulers.ts';
import { MemoryChunkStore } from '../src/store/chunkstore.ts';
import { encodeImage, encodePrompt } from '../src/train/preprocess.ts';
import { DreamBoothTrainer, type TrainData, type TrainSettings } from '../src/train/trainer.ts';
import { Rng } from '../src/util/rng.ts';
import { cosine } from '../lab/demo-model/quality.ts';

const here = dirname(fileURLToPath(import.meta.url));
const DEMO = join(here, '..', 'public', 'demo-model');
const args = process.argv.slice(2);
const arg = (name: string) => (args.includes(name) ? args[args.indexOf(name) + 1] : undefined);
const STEPS = Number(arg('--steps') ?? 30);
const TAIL = 5; // final loss: the mean of the last TAIL steps
const PROMPT = 'a photo of sks star';
const R = SHIPPED_DEMO_RESOLUTION;

function demoFiles(): Map<string, ByteSource> {
  const out = new Map<string, ByteSource>();
  const walk = (dir: string) => {
    for (const name of readdirSync(dir)) {
      const p = join(dir, name);
      if (statSync(p).isDirectory()) walk(p);
      else out.set(relative(DEMO, p), new BytesSource(new Uint8Array(readFileSync(p)), relative(DEMO, p)));
    }
  };
  walk(DEMO);
  return out;
}

const load = (gpu: Gpu): Promise<LoadedModel> => loadDiffusers(gpu, folderFromSources('demo-sd1-small', demoFiles()), { dtype: 'f16' });

function relRms(a: Float32Array, b: Float32Array): number {
  let d = 0;
  let n = 0;
  for (let i = 0; i < a.length; i++) {
    d += (a[i] - b[i]) ** 2;
    n += b[i] ** 2;
  }
  return Math.sqrt(d / n);
}

const gpu = await nodeGpu();
const f16 = await load(gpu);
const int8 = await load(gpu);
const q = await quantizeWeights(gpu, int8.unet.weights);
console.log(`demo UNet: ${q.int8} weights in int8, ${q.kept.length} kept in f16${q.kept.length ? ` (${q.kept.join(', ')})` : ''}`);

// The subject's photos (the look the demo model never saw) and the prompt, encoded once by the f16 model's VAE and
// text encoder (the int8 storage is for the UNet's frozen weights only).
const tokenizer = ClipTokenizer.fromFiles({
  vocab: JSON.parse(readFileSync(join(DEMO, 'tokenizer', 'vocab.json'), 'utf8')) as Record<string, number>,
  merges: readFileSync(join(DEMO, 'tokenizer', 'merges.txt'), 'utf8'),
});
const context = await encodePrompt(gpu, f16.textEncoder, tokenizer, PROMPT);
const latents: Float32Array[] = [];
for (let i = 0; i < 4; i++) latents.push(await encodeImage(gpu, f16.vae, toModelInput(drawScene(subjectScene(SUBJECT_LOOK, 1, i), R), R), R));
const lat = R / 8;
const latentShape: [number, number, number] = [4, lat, lat];
const contextShape: [number, number] = [context.length / f16.textEncoder.config.hiddenSize, f16.textEncoder.config.hiddenSize];

// 1. Forward error at timesteps across the schedule, each on every photo with its own noise.
const schedule = scheduleFromJson(JSON.parse(readFileSync(join(DEMO, 'scheduler', 'scheduler_config.json'), 'utf8')) as Record<string, unknown>);
const acp = alphasCumprod(schedule);
const rng = new Rng(3);
const forward: { t: number; relRms: number }[] = [];
for (const t of [50, 250, 500, 750, 950]) {
  const n = latents.length;
  const x = new Float32Array(n * latents[0].length);
  for (let s = 0; s < n; s++) {
    const eps = rng.normals(latents[0].length);
    for (let i = 0; i < eps.length; i++) x[s * eps.length + i] = Math.sqrt(acp[t]) * latents[s][i] + Math.sqrt(1 - acp[t]) * eps[i];
  }
  const ctx = new Float32Array(n * context.length);
  for (let s = 0; s < n; s++) ctx.set(context, s * context.length);
  const outs: Float32Array[] = [];
  for (const m of [f16, int8]) {
    const xs = gpu.upload(x, [n, ...latentShape], 'f16', 'activations', 'x');
    const ts = gpu.upload(new Array<number>(n).fill(t), [n], 'f32', 'activations', 't');
    const cs = gpu.upload(ctx, [n, ...contextShape], 'f16', 'activations', 'ctx');
    const out = unetForward(gpu, m.unet.config, m.unet.weights, xs, ts, cs);
    outs.push(await gpu.read(out));
    gpu.free(xs, ts, cs, out);
  }
  forward.push({ t, relRms: relRms(outs[1], outs[0]) });
  console.log(`forward t=${t}: int8 vs f16 output relative RMS ${forward.at(-1)!.relRms.toExponential(3)}`);
}

// 2 and 3. The same LoRA run on each base, both trainers side by side: the first step's gradients (the cosine is
// written as soon as both exist), then each run's remaining steps and losses.
const data: TrainData = { latentShape, contextShape, instance: latents.map((latent) => ({ latent, context })), classes: [] };
const settings: TrainSettings = { ...TRAIN_DEFAULTS.lora, rank: 8, alpha: 8, lr: 1e-3, checkpointEvery: 0, priorLossWeight: 0, seed: 5 };
const trainerFor = (m: LoadedModel) =>
  DreamBoothTrainer.create(gpu, { config: m.unet.config, weights: new Map(m.unet.weights), schedule }, data, settings, new MemoryChunkStore(), 'int8-effect');
async function firstStep(trainer: DreamBoothTrainer): Promise<{ grads: Float32Array; losses: number[] }> {
  const losses = [(await trainer.trainStep()).loss];
  // The packed gradient slots still hold the first step's (loss-scaled) gradients: the cosine is scale-free.
  const parts = await Promise.all([...trainer.optimizer.gradSlots().values()].map((g) => gpu.read(g)));
  const grads = new Float32Array(parts.reduce((a, p) => a + p.length, 0));
  let o = 0;
  for (const p of parts) grads.set(p, (o += p.length) - p.length);
  return { grads, losses };
}
const mean = (xs: number[]) => xs.reduce((s, x) => s + x, 0) / xs.length;
const result: Record<string, unknown> = {
  date: new Date().toISOString(),
  model: 'public/demo-model (demo-sd1-small, f16)',
  data: `${latents.length} photos of the held-out subject (${SUBJECT_LOOK.colour} ${SUBJECT_LOOK.pattern} ${SUBJECT_LOOK.shape}) at ${R} px, prompt "${PROMPT}"`,
  int8Weights: q.int8,
  keptF16: q.kept,
  forward,
  forwardRelRmsMax: Math.max(...forward.map((f) => f.relRms)),
  lora: { rank: settings.rank, lr: settings.lr, steps: STEPS, seed: settings.seed },
  definitions: {
    relRms: '||unet_int8(x,t,c) - unet_f16(x,t,c)|| / ||unet_f16(x,t,c)|| over 4 noisy latents of the subject at timestep t',
    gradCosine: "cosine of the first step's LoRA gradients (every adapter, packed) on the int8 base against the f16 base",
    validation:
      "the trainer's validation loss (train/trainer.ts validate: fixed noise at 5 timesteps over the 4 photos, no Rng draw) before the first step and after the last: what the LoRA learned, free of the per-step timestep noise",
    stepLossRelDiffMax: 'max over steps of |loss_int8 - loss_f16| / loss_f16: both runs draw the same timesteps and noise each step',
    upCosine: "cosine of the trained up projections (lora_B, which start at 0: the learned part) on the int8 base against the f16 base's",
    first: `mean training loss of the first ${TAIL} steps (noisy: each step's timestep differs)`,
    final: `mean training loss of the last ${TAIL} steps`,
  },
};
// The JSON is rewritten after every stage, so a run stopped part way keeps what it measured: `complete` is false
// and `stagesDone` names the stages whose figures are in the file.
const stagesDone: string[] = [];
const OUT = join(here, 'results', 'int8-effect.json');
mkdirSync(dirname(OUT), { recursive: true });
function save(stage: string, complete = false): void {
  stagesDone.push(stage);
  writeFileSync(OUT, JSON.stringify({ complete, stagesDone, ...result }, null, 2) + '\n');
}
save('forward');

const trainers = { f16: await trainerFor(f16), int8: await trainerFor(int8) };
const before = { f16: (await trainers.f16.validate()).instance, int8: (await trainers.int8.validate()).instance };
const t0 = performance.now();
const a = await firstStep(trainers.f16);
const b = await firstStep(trainers.int8);
const firstS = (performance.now() - t0) / 1000;
result.gradCosine = cosine(b.grads, a.grads);
result.gradElements = a.grads.length;
console.log(`LoRA gradient cosine int8 vs f16: ${(result.gradCosine as number).toFixed(5)} (${a.grads.length} elements)`);
save('gradient');

const ups: Record<string, Float32Array> = {};
for (const [k, r] of [
  ['f16', a],
  ['int8', b],
] as const) {
  const t1 = performance.now();
  for (let i = 1; i < STEPS; i++) r.losses.push((await trainers[k].trainStep()).loss);
  const after = (await trainers[k].validate()).instance;
  const values = await trainers[k].trainedValues();
  ups[k] = Float32Array.from([...values].filter(([n]) => n.includes('lora_B')).flatMap(([, v]) => [...v]));
  trainers[k].destroy();
  const s = {
    validation: { before: before[k], after, drop: 1 - after / before[k] },
    first: mean(r.losses.slice(0, TAIL)),
    final: mean(r.losses.slice(-TAIL)),
    seconds: firstS / 2 + (performance.now() - t1) / 1000,
    losses: r.losses,
  };
  result[k] = s;
  console.log(
    `LoRA on the ${k} base, ${STEPS} steps: validation loss ${before[k].toFixed(4)} -> ${after.toFixed(4)} (${(100 * s.validation.drop).toFixed(1)} % lower), ${s.seconds.toFixed(1)} s`,
  );
  if (k === 'f16') save('lora-f16');
}
result.stepLossRelDiffMax = Math.max(...a.losses.map((l, i) => Math.abs(b.losses[i] - l) / l));
result.upCosine = cosine(ups.int8, ups.f16);
result.upElements = ups.f16.length;
console.log(
  `int8 vs f16 LoRA: per-step loss within ${(100 * (result.stepLossRelDiffMax as number)).toFixed(2)} %, trained up projections at cosine ${(result.upCosine as number).toFixed(4)}`,
);
save('lora-int8', true);
gpu.destroy();
process.exit(0);
