// The census's recorder: one DreamBooth training step (DreamBoothTrainer.trainStep, as bench/step.ts and `cli train`
// run it) of SD 1.5's UNet on a recording WebGPU device (src/gpu/recording.ts) that presents a named adapter profile
// and executes nothing. Weights are unbacked tensors of SD 1.5's real shapes (no weight file is read or made); the
// trainer, the tape, the ops and their kernel choices are the engine's own code, so the dispatches recorded are the
// ones the step would issue on that adapter. Reads map zeros (loss 0, no overflow: every step is applied).
//
// Kept to the engine APIs that commit 2756811 already had, so the same file records that commit's kernel choices
// from a worktree (bench/census.ts --at): `npx tsx bench/census-record.ts --profile nvidia-h200 --cases lora-128-2
// --step 1 [--dry] --out FILE` writes each case's dispatches, identical ones counted once with `count`. --dry (commits with GpuOptions.recording) runs a dry run that still encodes: the same dispatches without the
// optimizer's host-side packing.
import { writeFileSync } from 'node:fs';
import { Gpu } from '../src/gpu/device.ts';
import { PROFILES, type AdapterProfile } from '../src/gpu/profile.ts';
import { recordingGpu, type RecordedDispatch } from '../src/gpu/recording.ts';
import { nodeShaderSource } from '../src/gpu/shaders-node.ts';
import type { Tensor } from '../src/gpu/tensor.ts';
import * as loadModule from '../src/models/load.ts';
import { SD15, unetParams } from '../src/models/shapes.ts';
import { SD_SCHEDULE } from '../src/sample/schedulers.ts';
import { MemoryChunkStore } from '../src/store/chunkstore.ts';
import * as trainerModule from '../src/train/trainer.ts';
import type { TrainData, TrainMode, TrainSettings } from '../src/train/trainer.ts';
import { Rng } from '../src/util/rng.ts';

export interface CensusCase {
  mode: TrainMode;
  /** Image pixels (latents are px / 8). */
  resolution: number;
  /** 2: instance + class image (prior preservation, the default run); 1: instance only. */
  batch: 1 | 2;
}

/** A recorded dispatch and how many identical ones the step issued. */
export type CountedDispatch = RecordedDispatch & { count: number };

export interface StepRecord {
  profile: string;
  case: CensusCase;
  /** Which step of the run was recorded (1: the first, as the H200 profile timed; 2: a warm step). */
  step: number;
  dispatches: number;
  dtype: string;
  gemmConfig?: unknown;
  kernels: CountedDispatch[];
}

function stepData(c: CensusCase): TrainData {
  const rng = new Rng(1);
  const lat = c.resolution / 8;
  const sample = () => ({ latent: rng.normals(4 * lat * lat), context: rng.normals(77 * 768) });
  return { latentShape: [4, lat, lat], contextShape: [77, 768], instance: [sample(), sample()], classes: c.batch === 2 ? [sample()] : [] };
}

/** The trainer's defaults per mode: src/train/trainer.ts's TRAIN_DEFAULTS, or where later commits keep them (the settings schema). */
async function trainDefaults(): Promise<Record<TrainMode, TrainSettings>> {
  const own = (trainerModule as unknown as { TRAIN_DEFAULTS?: Record<TrainMode, TrainSettings> }).TRAIN_DEFAULTS;
  if (own) return own;
  const schema = (await import('../src/pipeline/settings.ts')) as unknown as { TRAIN_DEFAULTS: Record<TrainMode, TrainSettings> };
  return schema.TRAIN_DEFAULTS;
}

/** Identical dispatches (kernel, defs, grid, uniforms, bound sizes) folded into one entry with a count. */
export function fold(list: RecordedDispatch[]): CountedDispatch[] {
  const byKey = new Map<string, CountedDispatch>();
  for (const d of list) {
    const key = JSON.stringify([d.shader, d.entry, d.defs, d.workgroups, d.uniforms, d.bindings.map((b) => [b.name, b.bytes])]);
    const seen = byKey.get(key);
    if (seen) seen.count++;
    else byKey.set(key, { ...d, count: 1 });
  }
  return [...byKey.values()];
}

/**
 * Records step `step` of a run of `c` on `profile`: everything the trainer dispatches inside that trainStep. All
 * optimizer state resident and no activation checkpointing (what planTraining picks on a GPU of the H200's size).
 */
export async function recordStep(profile: AdapterProfile, c: CensusCase, step = 2, opts: { dry?: boolean } = {}): Promise<StepRecord> {
  let recording = false;
  const recorded: RecordedDispatch[] = [];
  const gpu = await Gpu.create(
    recordingGpu(profile, (d) => {
      if (recording) recorded.push(d);
    }),
    // dry: a dry run that still encodes (GpuOptions.recording): the optimizer skips its host-side packing, which takes
    // minutes for a full fine-tune; commits before that option record with a plain Gpu (reads map zeros either way)
    { shaders: nodeShaderSource(), tensorCores: false, ...(opts.dry ? { dryRun: true, recording: true } : {}) },
  );
  // Laid out as the loader lays them out (grouped allocations where this commit's loader has them)
  const grouped = (loadModule as unknown as { allocateWeights?: (g: Gpu, s: Map<string, number[]>, d: string) => Map<string, Tensor> }).allocateWeights;
  const weights = grouped ? grouped(gpu, unetParams(SD15.unet), gpu.computeDType) : new Map<string, Tensor>();
  if (!grouped) for (const [name, shape] of unetParams(SD15.unet)) weights.set(name, gpu.tensor(shape, gpu.computeDType, 'weights', name));
  const settings: TrainSettings = { ...(await trainDefaults())[c.mode], checkpointEvery: 0, activationCheckpointing: false, residentChunks: Infinity };
  const trainer = await trainerModule.DreamBoothTrainer.create(
    gpu,
    { config: SD15.unet, weights, schedule: SD_SCHEDULE },
    stepData(c),
    settings,
    new MemoryChunkStore(),
    'census',
  );
  for (let i = 1; i <= step; i++) {
    recording = i === step;
    await trainer.trainStep();
  }
  recording = false;
  if (!recorded.length) throw new Error('census: the step reached the device with no dispatch (a dry run on a commit whose Gpu has no `recording` option?)');
  const gemm = (gpu as unknown as { gemmConfig?: unknown }).gemmConfig;
  trainer.destroy();
  gpu.destroy();
  return { profile: profile.name, case: c, step, dispatches: recorded.length, dtype: gpu.computeDType, gemmConfig: gemm, kernels: fold(recorded) };
}

/** `lora-128-2` -> a CensusCase (mode-resolution-batch). */
export function parseCase(s: string): CensusCase {
  const [mode, px, batch] = s.split('-');
  const c = { mode: mode as TrainMode, resolution: Number(px), batch: Number(batch) as 1 | 2 };
  if (!['lora', 'full'].includes(c.mode) || !(c.resolution >= 64 && c.resolution % 64 === 0) || ![1, 2].includes(c.batch))
    throw new Error(`census case "${s}": expected mode-px-batch, e.g. lora-128-2 (mode lora|full, px a multiple of 64, batch 1|2)`);
  return c;
}

// CLI (used from a worktree of another commit by bench/census.ts --at): one JSON array of StepRecords.
if (process.argv[1]?.endsWith('census-record.ts')) {
  const args = process.argv.slice(2);
  const arg = (n: string, d: string) => (args.includes(n) ? args[args.indexOf(n) + 1] : d);
  const profile = PROFILES[arg('--profile', 'nvidia-h200')];
  if (!profile) throw new Error(`--profile: unknown profile; use one of ${Object.keys(PROFILES).join(', ')}`);
  const out: StepRecord[] = [];
  for (const c of arg('--cases', 'lora-128-2').split(','))
    out.push(await recordStep(profile, parseCase(c), Number(arg('--step', '1')), { dry: args.includes('--dry') }));
  writeFileSync(arg('--out', '/dev/stdout'), JSON.stringify(out));
  process.exit(0);
}
