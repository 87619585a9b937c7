// npm run bench:memory — peak GPU bytes per component at SD 1.5 shapes (512 px: 64x64 latents, 77 tokens) and at
// SDXL base's (1024 px: 128x128 latents, both text encoders, the VAE in f32 as SDXL needs),
// planned by running the real module code on a dry-run Gpu (every allocation accounted, nothing backed or
// computed), next to the peak measured on a real run of the tiny model, whose dry-run plan must agree.
// Writes bench/results/memory.json.
import { mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { Gpu } from '../src/gpu/device.ts';
import { nodeGpu } from '../src/gpu/node.ts';
import type { DType } from '../src/gpu/tensor.ts';
import { readSafetensors } from '../src/io/safetensors.ts';
import { clipParams, SD15, unetParams, vaeParams, type ParamShapes } from '../src/models/shapes.ts';
import { clipTextForward } from '../src/nn/clip.ts';
import { SDXL_BASE, sdxlTextEncoder2Params } from '../src/models/sdxl.ts';
import { sdxlPlanRows } from './sdxl-rows.ts';
import { sdxlTextEncode } from '../src/nn/sdxl.ts';
import { Tape } from '../src/nn/ops.ts';
import { unetConfigFromJson, unetForward, type UnetConfig } from '../src/nn/unet.ts';
import { encodeTileSide } from '../src/nn/vae-tiled.ts';
import { vaeDecode, vaeEncode } from '../src/nn/vae.ts';
import { mseLossBackward } from '../src/ops/reduce.ts';

const here = dirname(fileURLToPath(import.meta.url));
const MiB = 2 ** 20;

function weights(gpu: Gpu, shapes: ParamShapes, dtype: DType, data?: Map<string, { data: Float32Array }>) {
  const m = new Map();
  for (const [n, s] of shapes) m.set(n, data ? gpu.upload(data.get(n)!.data, s, dtype, 'weights', n) : gpu.tensor(s, dtype, 'weights', n));
  return m;
}

/** Peak bytes of `fn` above what was allocated before it (weights included in `before`). */
async function peakOf(gpu: Gpu, fn: () => Promise<unknown> | unknown): Promise<number> {
  await gpu.sync();
  const before = gpu.allocator.report().current;
  gpu.allocator.resetPeak();
  await fn();
  await gpu.sync();
  return gpu.allocator.report().peak - before;
}

interface Row {
  component: string;
  weightsMiB: number;
  activationsPeakMiB: number;
  totalPeakMiB: number;
  /** Wall time of the real run (with --real; includes the first run's pipeline compilation). */
  ms?: number;
  error?: string;
}

async function sd15(dtype: DType, dryRun: boolean): Promise<Row[]> {
  const gpu = await nodeGpu({ dryRun });
  const rows: Row[] = [];
  const add = async (component: string, w: number, peak: () => Promise<number>) => {
    try {
      const t0 = performance.now();
      const p = await peak();
      const ms = performance.now() - t0;
      rows.push({ component, weightsMiB: w / MiB, activationsPeakMiB: p / MiB, totalPeakMiB: (w + p) / MiB, ...(dryRun ? {} : { ms }) });
    } catch (e) {
      rows.push({ component, weightsMiB: w / MiB, activationsPeakMiB: NaN, totalPeakMiB: NaN, error: (e as Error).message });
    }
  };
  const wb = () => gpu.allocator.report().byTag.weights.current;

  const te = weights(gpu, clipParams(SD15.textEncoder), dtype);
  await add('text encoder (2 x 77 tokens)', wb(), () => peakOf(gpu, () => gpu.free(clipTextForward(gpu, SD15.textEncoder, te, new Array(154).fill(0), 2))));
  gpu.free(...te.values());

  const vae = weights(gpu, vaeParams(SD15.vae), dtype);
  const img = gpu.tensor([1, 3, 512, 512], dtype, 'activations');
  await add('VAE encode 512x512', wb(), () => peakOf(gpu, () => gpu.free(vaeEncode(gpu, SD15.vae, vae, img))));
  const lat = gpu.tensor([1, 4, 64, 64], dtype, 'activations');
  await add('VAE decode 64x64 latents', wb(), () => peakOf(gpu, () => gpu.free(vaeDecode(gpu, SD15.vae, vae, lat))));
  gpu.free(...vae.values(), img, lat);

  const unet = weights(gpu, unetParams(SD15.unet), dtype);
  const sample = gpu.tensor([2, 4, 64, 64], dtype, 'activations');
  const t = gpu.tensor([2], 'f32', 'activations');
  const ctx = gpu.tensor([2, 77, 768], dtype, 'activations');
  await add('UNet forward (batch 2: CFG)', wb(), () => peakOf(gpu, () => gpu.free(unetForward(gpu, SD15.unet, unet, sample, t, ctx))));
  const s1 = gpu.tensor([1, 4, 64, 64], dtype, 'activations');
  const c1 = gpu.tensor([1, 77, 768], dtype, 'activations');
  const t1 = gpu.tensor([1], 'f32', 'activations');
  await add('UNet forward + backward, batch 1, all activations kept', wb(), () =>
    peakOf(gpu, () => {
      const tape = new Tape(gpu);
      const out = unetForward(gpu, SD15.unet, unet, s1, t1, c1, tape);
      tape.backward(out, mseLossBackward(gpu, out, s1));
      gpu.free(...tape.grads.values());
    }),
  );
  gpu.destroy();
  return rows;
}

/** The same components at SDXL base's shapes (1024 px), planned by a dry run unless `dryRun` is false. */
async function sdxl(dtype: DType, dryRun: boolean): Promise<Row[]> {
  const gpu = await nodeGpu({ dryRun });
  const rows: Row[] = [];
  const add = async (component: string, w: number, peak: () => Promise<number>) => {
    try {
      const p = await peak();
      rows.push({ component, weightsMiB: w / MiB, activationsPeakMiB: p / MiB, totalPeakMiB: (w + p) / MiB });
    } catch (e) {
      rows.push({ component, weightsMiB: w / MiB, activationsPeakMiB: NaN, totalPeakMiB: NaN, error: (e as Error).message });
    }
  };
  const wb = () => gpu.allocator.report().byTag.weights.current;
  const te1 = { config: SDXL_BASE.textEncoder, weights: weights(gpu, clipParams(SDXL_BASE.textEncoder), dtype) };
  const te2 = { config: SDXL_BASE.textEncoder2, weights: weights(gpu, sdxlTextEncoder2Params(SDXL_BASE.textEncoder2), dtype) };
  const ids = new Array(154).fill(0);
  await add('SDXL both text encoders (2 x 77 tokens)', wb(), () =>
    peakOf(gpu, () => {
      const r = sdxlTextEncode(gpu, te1, te2, ids, ids, 2);
      gpu.free(r.context, r.pooled);
    }),
  );
  gpu.free(...te1.weights.values(), ...te2.weights.values());
  const vae = weights(gpu, vaeParams(SDXL_BASE.vae), 'f32');
  const img = gpu.tensor([1, 3, 1024, 1024], 'f32', 'activations');
  await add('SDXL VAE encode 1024x1024 (f32)', wb(), () => peakOf(gpu, () => gpu.free(vaeEncode(gpu, SDXL_BASE.vae, vae, img))));
  // What latent caching runs past one binding (nn/vae-tiled.ts): tiles one after another, so the largest tile's peak.
  const side = encodeTileSide(SDXL_BASE.vae, 1024, 1024, 'f32', gpu.maxBinding);
  if (side) {
    const tile = gpu.tensor([1, 3, side, side], 'f32', 'activations');
    await add(`SDXL VAE encode 1024x1024 (f32), in ${side} px tiles`, wb(), () => peakOf(gpu, () => gpu.free(vaeEncode(gpu, SDXL_BASE.vae, vae, tile))));
    gpu.free(tile);
  }
  const lat = gpu.tensor([1, 4, 128, 128], 'f32', 'activations');
  await add('SDXL VAE decode 128x128 latents (f32)', wb(), () => peakOf(gpu, () => gpu.free(vaeDecode(gpu, SDXL_BASE.vae, vae, lat))));
  gpu.free(...vae.values(), img, lat);
  const unet = weights(gpu, unetParams(SDXL_BASE.unet), dtype);
  const cond = (b: number) => ({
    sample: gpu.tensor([b, 4, 128, 128], dtype, 'activations'),
    t: gpu.tensor([b], 'f32', 'activations'),
    ctx: gpu.tensor([b, 77, 2048], dtype, 'activations'),
    added: { textEmbeds: gpu.tensor([b, 1280], dtype, 'activations'), timeIds: gpu.tensor([b, 6], 'f32', 'activations') },
  });
  const c2 = cond(2);
  await add('SDXL UNet forward (batch 2: CFG)', wb(), () =>
    peakOf(gpu, () => gpu.free(unetForward(gpu, SDXL_BASE.unet, unet, c2.sample, c2.t, c2.ctx, null, 1, false, c2.added))),
  );
  const c1 = cond(1);
  await add('SDXL UNet forward + backward, batch 1, all activations kept', wb(), () =>
    peakOf(gpu, () => {
      const tape = new Tape(gpu);
      const out = unetForward(gpu, SDXL_BASE.unet, unet, c1.sample, c1.t, c1.ctx, tape, 1, false, c1.added);
      tape.backward(out, mseLossBackward(gpu, out, c1.sample));
      gpu.free(...tape.grads.values());
    }),
  );
  gpu.destroy();
  return rows;
}

async function tiny(dryRun: boolean): Promise<number> {
  const gpu = await nodeGpu({ dryRun });
  const f = readSafetensors(new Uint8Array(readFileSync(join(here, '..', 'tests', 'fixtures', 'modules', 'unet_sd1.safetensors'))));
  const cfg: UnetConfig = unetConfigFromJson(JSON.parse(f.metadata.config));
  const w = weights(gpu, unetParams(cfg), 'f32', f.tensors);
  const up = (n: string, d: DType = 'f32') => gpu.upload(f.tensors.get(n)!.data, f.tensors.get(n)!.shape, d, 'activations');
  const [s, t, c] = [up('sample'), up('timestep'), up('encoder_hidden_states')];
  const peak = await peakOf(gpu, async () => gpu.free(unetForward(gpu, cfg, w, s, t, c)));
  gpu.destroy();
  return peak;
}

const dtype = (process.argv.includes('--f32') ? 'f32' : 'f16') as DType;
// --real: run SD 1.5 sizes for real (random weights; a GPU with a few GiB) and time them too.
const real = process.argv.includes('--real');
const rows = await sd15(dtype, !real);
// SDXL's sizes are only planned here (a real run needs a GPU with some 30 GiB for the kept-activations row).
const sdxlRows = await sdxl(dtype, true);
// SDXL LoRA training at 1024 px, f16 and int8 base weights, as the planner places it (bench/sdxl-rows.ts, dry runs).
console.log('SDXL LoRA rank 16 at 1024 px, batch 1, training step as planned (dry run) by base-weight storage:');
const sdxlLora = await sdxlPlanRows();
const measured = await tiny(false);
const planned = await tiny(true);
console.log(`SD 1.5 at 512 px, ${dtype} weights and activations (${real ? 'measured on a real run' : 'planned by a dry run of the real code'}):`);
for (const r of rows)
  console.log(
    r.error
      ? `  ${r.component.padEnd(56)} not runnable on this adapter: ${r.error}`
      : `  ${r.component.padEnd(56)} weights ${r.weightsMiB.toFixed(0).padStart(6)} MiB  activations peak ${r.activationsPeakMiB.toFixed(0).padStart(6)} MiB  total ${r.totalPeakMiB.toFixed(0).padStart(6)} MiB${r.ms !== undefined ? `  ${r.ms.toFixed(0)} ms` : ''}`,
  );
console.log(`SDXL base at 1024 px, ${dtype} weights (the VAE f32), planned by a dry run of the real code:`);
for (const r of sdxlRows)
  console.log(
    r.error
      ? `  ${r.component.padEnd(56)} not plannable: ${r.error}`
      : `  ${r.component.padEnd(56)} weights ${r.weightsMiB.toFixed(0).padStart(6)} MiB  activations peak ${r.activationsPeakMiB.toFixed(0).padStart(6)} MiB  total ${r.totalPeakMiB.toFixed(0).padStart(6)} MiB`,
  );
console.log(`tiny UNet forward (f32): measured peak ${measured} bytes, dry-run plan ${planned} bytes (${measured === planned ? 'equal' : 'DIFFER'})`);
const out = process.env.DBS_OUT
  ? join(process.env.DBS_OUT, `memory-${dtype}${real ? '-real' : ''}.json`)
  : join(here, 'results', `memory-${dtype}${real ? '-real' : ''}.json`);
mkdirSync(dirname(out), { recursive: true });
writeFileSync(
  out,
  JSON.stringify(
    { date: new Date().toISOString(), dtype, real, sd15: rows, sdxl: sdxlRows, sdxlLora, tiny: { measuredPeakBytes: measured, plannedPeakBytes: planned } },
    null,
    2,
  ),
);
console.log(`wrote ${out}`);
process.exit(0);
