// npm run bench:step — one DreamBooth training step exactly as the trainer runs it (DreamBoothTrainer.trainStep:
// prior-preservation batch of 2, forward, loss, backward, optimizer), with the placement (activation
// checkpointing, resident optimizer chunks) that src/train/plan.ts planTraining picks under the budget, for
// LoRA rank 8 and full fine-tuning, in the adapter's compute dtype (f16 where it has shader-f16, else f32).
// Written to bench/results/step.json on a CPU adapter, step-<gpu>.json on a GPU (or --out FILE); its "quick" field says
// which run made it.
//
// Cases:
//   tiny   the tests' SD1-style UNet (tests/fixtures/modules/unet_sd1) at its 8x8 latents, as bench/train.ts
//          runs it; the PyTorch CPU peer is bench/peers/torch_train.py (the same step on the same UNet, f32).
//   sd15   SD 1.5's real UNet config (src/models/shapes.ts SD15.unet, 859.5 M parameters, random weights) at a
//          reduced resolution (default 128 px = 16x16 latents, 77x768 embeddings; --sd15-px N); the PyTorch peer is
//          bench/peers/torch_step.py (the same UNet and step in plain torch, f32, our plan's checkpointing).
//   sdxl-tiny  the tests' tiny SDXL UNet (tests/fixtures/modules/unet_sdxl: transformer depth [1, 2], linear
//          projections, text_time embedding) at 8x8 latents with an 80-wide context, a pooled embedding and time ids.
//   sdxl   SDXL base's UNet config (src/models/sdxl.ts SDXL_BASE.unet, 2.57 B parameters, random weights as sd15) at
//          --sdxl-px N (default 128 px = 16x16 latents; 1024 on a GPU), 77x2048 context, pooled 1280 and time ids.
//   The SDXL cases have no PyTorch peer here (bench/peers has none): their torch fields say so.
// Per case: s/step (median of the timed steps after warm-up), ours/PyTorch, the step's peak GPU bytes (the
// allocator's peak; trainStep resets it), dispatches, GPUBuffers and bind groups created per step (Gpu.stats),
// and host ms per step = wall time minus the time spent awaiting Gpu.sync / Gpu.readBytes (on lavapipe the GPU
// is the same CPU, so that wait is where the shaders run; what is left is JavaScript recording, uploads, the
// optimizer's host side; host_cpu_ms is the main thread's CPU time of it, which other processes' load does not
// inflate), and GPU ms per op family (shader file) and the costliest kernels, from timestamp queries
// around every dispatch of the warm-up step (each in its own compute pass; Dawn's timestamp quantization is off in
// the Node host), which is why the warm-up is never timed. A case stops timing after the first timed step (the warm-up, which compiles every
// pipeline, is not judged) that takes over --max-step-s (default 180) seconds, and says so: fewer than 5 steps
// with the reason (lavapipe runs about 3 GFLOP/s).
// Flags: --quick (1 warm-up + 5 timed; tiny, sd15 and sdxl-tiny LoRA), --cases tiny-lora,sd15-lora,... , --budget-gib N
// (default 4), --sd15-px N, --sdxl-px N, --max-step-s N, --out FILE, --torch-device cpu|cuda (the SD 1.5 peer's device; cuda
// also runs it with autocast fp16: torch_amp_s, ratio_amp), --append (keep the out file's other cases; each case has
// the date it was `measured`), --replay on|off|ab (the recorded step replay, src/gpu/replay.ts: on by default; ab runs
// each case twice, replay on then off, and adds the off run's host figures as `replay_off`).
import { execFileSync } from 'node:child_process';
import { existsSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { cpus, totalmem } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { Gpu, GpuProfile } from '../src/gpu/device.ts';
import { nodeGpu } from '../src/gpu/node.ts';
import { describeGemmConfig } from '../src/ops/tune.ts';
import { tuneCliGpu } from '../src/cli/gpu-tuning.ts';
import type { Tensor } from '../src/gpu/tensor.ts';
import { readSafetensors } from '../src/io/safetensors.ts';
import { SD15, unetParams } from '../src/models/shapes.ts';
import { SDXL_BASE } from '../src/models/sdxl.ts';
import { unetConfigFromJson, type UnetConfig } from '../src/nn/unet.ts';
import { SD_SCHEDULE, type ScheduleConfig } from '../src/sample/schedulers.ts';
import { MemoryChunkStore } from '../src/store/chunkstore.ts';
import { planTraining, type Plan } from '../src/train/plan.ts';
import { TRAIN_DEFAULTS } from '../src/pipeline/settings.ts';
import { DreamBoothTrainer, type TrainData, type TrainMode, type TrainSettings } from '../src/train/trainer.ts';
import { Rng } from '../src/util/rng.ts';
import { median } from './core.ts';

const here = dirname(fileURLToPath(import.meta.url));
const root = join(here, '..');
const args = process.argv.slice(2);
const arg = (name: string) => (args.includes(name) ? args[args.indexOf(name) + 1] : undefined);
const quick = args.includes('--quick');
const GiB = 2 ** 30;
// PYTHON picks the interpreter (default /usr/bin/python3, Debian's python3-torch; on a GPU machine the one with CUDA torch).
const PYTHON = process.env.PYTHON ?? '/usr/bin/python3';
const STEPS = { warmup: 1, timed: 5 };
const BUDGET = (Number(arg('--budget-gib')) || 4) * GiB;
const SD15_PX = Number(arg('--sd15-px')) || 128;
const SDXL_PX = Number(arg('--sdxl-px')) || 128;
const MAX_STEP_S = Number(arg('--max-step-s')) || 180;
const REPLAY = arg('--replay') ?? 'on';
if (!['on', 'off', 'ab'].includes(REPLAY)) throw new Error(`--replay: "${REPLAY}" is not on, off or ab`);
const ALL_CASES = ['tiny-lora', 'tiny-full', 'sd15-lora', 'sd15-full', 'sdxl-tiny-lora', 'sdxl-lora'] as const;
type CaseName = (typeof ALL_CASES)[number];
type CaseKind = 'tiny' | 'sd15' | 'sdxl-tiny' | 'sdxl';
const QUICK_CASES: CaseName[] = ['tiny-lora', 'tiny-full', 'sd15-lora', 'sdxl-tiny-lora'];

function selectedCases(): CaseName[] {
  const list = arg('--cases');
  if (!list) return quick ? QUICK_CASES : [...ALL_CASES];
  const names = list.split(',');
  for (const n of names)
    if (!(ALL_CASES as readonly string[]).includes(n)) throw new Error(`--cases: unknown case "${n}"; use a comma list of ${ALL_CASES.join(', ')}`);
  return names as CaseName[];
}

const round = (x: number, digits = 4) => Math.round(x * 10 ** digits) / 10 ** digits;
const gib = (n: number) => `${(n / GiB).toFixed(3)} GiB`;

// ---------------------------------------------------------------------------------------------- models

interface BenchModel {
  config: UnetConfig;
  schedule: ScheduleConfig;
  data: TrainData;
  /** The weights in `dtype` on `gpu` (fresh per case: each case has its own Gpu). */
  weights: (gpu: Gpu) => Map<string, Tensor>;
  /** Settings beside the mode's defaults (the tiny run's are the reference runs'). */
  settings: (mode: TrainMode) => Partial<TrainSettings>;
  resolution: number;
}

/** Random latents and contexts; for an SDXL UNet (`config.textTime`) also a pooled embedding and the time ids of a square photo. */
function sampleData(latentShape: [number, number, number], contextShape: [number, number], config?: UnetConfig): TrainData {
  const rng = new Rng(1);
  const [c, h, w] = latentShape;
  const tt = config?.textTime;
  const px = h * 8;
  const sdxl = () => (tt ? { pooled: rng.normals(tt.projectionInputDim - 6 * tt.timeEmbedDim), timeIds: Float32Array.from([px, px, 0, 0, px, px]) } : {});
  const sample = () => ({ latent: rng.normals(c * h * w), context: rng.normals(contextShape[0] * contextShape[1]), ...sdxl() });
  return { latentShape, contextShape, instance: [sample(), sample()], classes: [sample()] };
}

/** The tiny UNet with bench/train.ts's settings (the reference runs'); its weights from the fixture. */
function tinyModel(mode: TrainMode, fixture: 'unet_sd1' | 'unet_sdxl' = 'unet_sd1'): BenchModel {
  const file = readSafetensors(new Uint8Array(readFileSync(join(root, 'tests', 'fixtures', 'modules', `${fixture}.safetensors`))));
  const config = unetConfigFromJson(JSON.parse(file.metadata.config));
  const prediction = mode === 'lora' ? 'epsilon' : 'v_prediction';
  return {
    config,
    schedule: { ...SD_SCHEDULE, prediction },
    data: sampleData([4, 8, 8], [7, config.crossAttentionDim], config),
    resolution: 64,
    weights: (gpu) => {
      const out = new Map<string, Tensor>();
      for (const name of unetParams(config).keys()) {
        const t = file.tensors.get(name)!;
        out.set(name, gpu.upload(t.data, t.shape, gpu.computeDType, 'weights', name));
      }
      return out;
    },
    settings: (m) =>
      m === 'lora'
        ? { lr: 1e-3, rank: 8, alpha: 8, checkpointEvery: 0, chunkElems: 4096 }
        : { lr: 1e-4, minSnrGamma: 5, priorLossWeight: 0.5, checkpointEvery: 0, chunkElems: 4096 },
  };
}

/**
 * A real UNet config (SD 1.5's, SDXL base's) at `px` with random weights: fan-in scaled normals for matrices and kernels (so f16 activations stay
 * finite and steps are applied, as with real weights), norm scales 1, biases 0. The values come from one pool
 * of normals read at varying offsets: drawing 859.5 M fresh normals in JavaScript would take longer than the
 * step, and the timing does not depend on the values.
 */
function randomModel(config: UnetConfig, px: number): BenchModel {
  const lat = px / 8;
  const pool = new Rng(7).normals(1 << 20);
  return {
    config,
    schedule: SD_SCHEDULE,
    data: sampleData([4, lat, lat], [77, config.crossAttentionDim], config),
    resolution: px,
    weights: (gpu) => {
      const out = new Map<string, Tensor>();
      let offset = 0;
      for (const [name, shape] of unetParams(config)) {
        const n = shape.reduce((a, b) => a * b, 1);
        const values = new Float32Array(n);
        if (shape.length === 1) values.fill(/norm/.test(name) && name.endsWith('.weight') ? 1 : 0);
        else {
          const std = 1 / Math.sqrt(n / shape[0]);
          for (let i = 0; i < n; i++) values[i] = pool[(offset + i) % pool.length] * std;
          offset += 7919;
        }
        out.set(name, gpu.upload(values, shape, gpu.computeDType, 'weights', name));
      }
      return out;
    },
    settings: () => ({ checkpointEvery: 0 }), // LoRA rank 8 / alpha 8 and full: TRAIN_DEFAULTS
  };
}

// ---------------------------------------------------------------------------------------------- ours

interface OursResult {
  stepsS: number[];
  warmupS: number;
  applied: number;
  peakBytes: number;
  dispatches: number;
  buffersCreated: number;
  bindGroupsCreated: number;
  hostMs: number;
  /** Main-thread CPU ms per step outside the awaits (median; NaN where the OS does not say). */
  hostCpuMs: number;
  waitMs: number;
  /** GPU ms by op family / kernel of the profiled (warm-up) step, or why there is none. */
  profile: GpuProfile | { missing: string };
  /** The allocator's reserved bytes (live at class size + pool) and pool after the last step. */
  reservedBytes: number;
  poolBytes: number;
  dropped?: string;
  /** Per timed step: host ms, main-thread CPU ms, and whether its forward and backward were replayed. */
  hostAll: number[];
  hostCpuAll: number[];
  replayedAll: boolean[];
}

/**
 * Wraps the Gpu's sync and readBytes on this instance to add up the time spent awaiting them (nested calls,
 * readBytes -> sync, are counted once). Timing only: the wrapped methods are called unchanged.
 */
function timeWaits(gpu: Gpu): { ms: () => number; cpuMs: () => number } {
  let depth = 0;
  let start = 0;
  let startCpu = 0;
  let total = 0;
  let totalCpu = 0;
  const wrap =
    <A extends unknown[], R>(f: (...a: A) => Promise<R>) =>
    async (...a: A): Promise<R> => {
      if (depth++ === 0) [start, startCpu] = [performance.now(), mainThreadCpuMs()];
      try {
        return await f(...a);
      } finally {
        if (--depth === 0) [total, totalCpu] = [total + performance.now() - start, totalCpu + mainThreadCpuMs() - startCpu];
      }
    };
  gpu.sync = wrap(gpu.sync.bind(gpu));
  gpu.readBytes = wrap(gpu.readBytes.bind(gpu));
  return { ms: () => total, cpuMs: () => totalCpu };
}

/**
 * CPU ms the process's main thread (JavaScript and the Dawn calls it makes; not lavapipe's or Dawn's worker threads)
 * has run, from Linux's per-thread schedstat (ns); NaN elsewhere. Unlike wall time it does not grow when other
 * processes take the cores, so host costs compare across loaded runs.
 */
function mainThreadCpuMs(): number {
  try {
    return Number(readFileSync(`/proc/self/task/${process.pid}/schedstat`, 'utf8').split(' ')[0]) / 1e6;
  } catch {
    return NaN;
  }
}

async function ours(model: BenchModel, mode: TrainMode, plan: Plan, replay: boolean): Promise<OursResult> {
  const gpu = await nodeGpu();
  await tuneCliGpu(gpu); // as `cli train` runs: a GPU's tuned GEMM config (timed once by machine(), then cached)
  try {
    const waits = timeWaits(gpu);
    const settings: TrainSettings = {
      ...TRAIN_DEFAULTS[mode],
      ...model.settings(mode),
      activationCheckpointing: plan.activationCheckpointing,
      residentChunks: plan.residentChunks,
    };
    const weights = model.weights(gpu);
    const trainer = await DreamBoothTrainer.create(
      gpu,
      { config: model.config, weights, schedule: model.schedule },
      model.data,
      settings,
      new MemoryChunkStore(),
      'bench',
    );
    trainer.stepReplay = replay;
    // The warm-up step is the profiled one: each dispatch in its own timestamped pass (which slows it and creates
    // read-back buffers, so it is never a timed step). Its pipelines compile on the host, outside the timestamps.
    const w0 = performance.now();
    let profile: OursResult['profile'] = { missing: 'the adapter has no timestamp-query feature' };
    for (let i = 0; i < STEPS.warmup; i++) {
      const profiled = i === STEPS.warmup - 1 && gpu.hasTimestamps;
      if (profiled) gpu.startProfile();
      await trainer.trainStep();
      if (profiled) profile = await gpu.stopProfile();
    }
    const warmupS = (performance.now() - w0) / 1000 / STEPS.warmup;
    const stepsS: number[] = [];
    const counts = {
      dispatches: [] as number[],
      buffers: [] as number[],
      bindGroups: [] as number[],
      host: [] as number[],
      hostCpu: [] as number[],
      wait: [] as number[],
      peak: [] as number[],
      replayed: [] as boolean[],
    };
    let applied = 0;
    let dropped: string | undefined;
    for (let i = 0; i < STEPS.timed && !dropped; i++) {
      const s0 = gpu.stats;
      const wait0 = waits.ms();
      const waitCpu0 = waits.cpuMs();
      const cpu0 = mainThreadCpuMs();
      const replayed0 = trainer.replayStats?.replayed ?? 0;
      const t0 = performance.now();
      const r = await trainer.trainStep(); // ends with gpu.sync(): the step's GPU work is done
      const wall = performance.now() - t0;
      counts.hostCpu.push(mainThreadCpuMs() - cpu0 - (waits.cpuMs() - waitCpu0));
      const s1 = gpu.stats;
      const wait = waits.ms() - wait0;
      stepsS.push(wall / 1000);
      counts.dispatches.push(s1.dispatches - s0.dispatches);
      counts.buffers.push(s1.buffersCreated - s0.buffersCreated);
      counts.bindGroups.push(s1.bindGroupsCreated - s0.bindGroupsCreated);
      counts.wait.push(wait);
      counts.host.push(wall - wait);
      counts.peak.push(r.gpuPeakBytes);
      counts.replayed.push((trainer.replayStats?.replayed ?? 0) > replayed0);
      if (r.applied) applied++;
      // Lavapipe at SD 1.5 widths: stop once a steady-state step is over the limit (the warm-up is not judged:
      // it compiles every pipeline).
      if (wall / 1000 > MAX_STEP_S && i < STEPS.timed - 1)
        dropped = `stopped after ${i + 1} timed step(s): one took ${(wall / 1000).toFixed(0)} s, over --max-step-s ${MAX_STEP_S}`;
    }
    const mem = gpu.allocator.report();
    trainer.destroy();
    const med = median;
    return {
      stepsS,
      warmupS,
      applied,
      peakBytes: Math.max(...counts.peak),
      dispatches: med(counts.dispatches),
      buffersCreated: med(counts.buffers),
      bindGroupsCreated: med(counts.bindGroups),
      hostMs: med(counts.host),
      hostCpuMs: med(counts.hostCpu),
      waitMs: med(counts.wait),
      profile,
      reservedBytes: mem.reserved,
      poolBytes: mem.pool.bytes,
      ...(dropped ? { dropped } : {}),
      hostAll: counts.host,
      hostCpuAll: counts.hostCpu,
      replayedAll: counts.replayed,
    };
  } finally {
    gpu.destroy();
  }
}

// ---------------------------------------------------------------------------------------------- PyTorch peer

/** A PyTorch run of the same step: its median and what it ran on (the case JSON's `torch` record). */
interface PeerRun {
  medianS: number;
  torch: string;
  threads: number;
  dtype: 'f32' | 'amp-fp16';
  device: string;
  checkpointing: boolean;
  /** CUDA: torch.cuda.max_memory_allocated over the timed steps; CPU: the process's peak RSS. */
  peakBytes?: number;
  peakRssBytes?: number;
  /** The BLAS the peer's process mapped and its f32 1024^3 matmul GFLOP/s (Debian's torch with the reference BLAS is ~20x slower). */
  blas?: string;
  matmulGflops?: number;
}
type Peer = PeerRun | { error: string };

/** --torch-device cuda: the SD 1.5 peer runs on CUDA (f32 with TF32 off) and again with autocast fp16. */
const TORCH_DEVICE = arg('--torch-device') ?? 'cpu';
if (TORCH_DEVICE !== 'cpu' && TORCH_DEVICE !== 'cuda') throw new Error(`--torch-device: "${TORCH_DEVICE}" is not cpu or cuda`);

/**
 * Runs one peer script with /usr/bin/python3 and parses its last stdout line (one JSON object), or says why
 * it could not: a missing python or torch, or the script's own error (its last stderr line), is a missing
 * peer, never a result.
 */
function runPeer(script: string, peerArgs: string[]): Record<string, unknown> | { error: string } {
  if (!existsSync(PYTHON)) return { error: `no PyTorch peer: ${PYTHON} not found` };
  try {
    const out = execFileSync(PYTHON, [join(here, 'peers', script), ...peerArgs], {
      encoding: 'utf8',
      stdio: ['ignore', 'pipe', 'pipe'],
      maxBuffer: 16 << 20,
    });
    return JSON.parse(out.trim().split('\n').pop()!) as Record<string, unknown>;
  } catch (e) {
    const err = e as { stderr?: string; signal?: string | null; message: string };
    const why = /No module named 'torch'/.test(err.stderr ?? '')
      ? `PyTorch is not installed for ${PYTHON}`
      : err.signal
        ? `${script} was killed by ${err.signal}${err.signal === 'SIGKILL' ? ' (out of memory?)' : ''}`
        : (err.stderr?.trim().split('\n').pop() ?? err.message);
    return { error: `no PyTorch peer: ${why}` };
  }
}

/** The tiny step in PyTorch on the CPU (bench/peers/torch_train.py, f32), or why it could not run. */
function torchTiny(mode: TrainMode, settings: TrainSettings, prediction: string): Peer {
  const r = runPeer('torch_train.py', [
    ...['--mode', mode, '--steps', String(STEPS.timed), '--warmup', String(STEPS.warmup), '--lr', String(settings.lr), '--prediction', prediction],
    ...['--prior-weight', String(settings.priorLossWeight), '--max-grad-norm', String(settings.maxGradNorm), '--weight-decay', String(settings.weightDecay)],
    ...(mode === 'lora' ? ['--rank', String(settings.rank), '--alpha', String(settings.alpha)] : []),
    ...(settings.minSnrGamma !== null ? ['--min-snr', String(settings.minSnrGamma)] : []),
  ]);
  if ('error' in r) return r as { error: string };
  return { medianS: r.medianS as number, torch: r.torch as string, threads: r.threads as number, dtype: 'f32', device: 'cpu', checkpointing: false };
}

/**
 * The SD 1.5 step in PyTorch (bench/peers/torch_step.py: the same UNet, batch, objective, clipping, AdamW and
 * LoRA targets as TRAIN_DEFAULTS, random weights) at the case's resolution, with activation checkpointing when
 * our plan uses it; f32 (TF32 off) or autocast fp16 (CUDA). The script checks its parameter count against ours.
 */
function torchSd15(mode: TrainMode, px: number, checkpointing: boolean, device: 'cpu' | 'cuda', amp: boolean): Peer {
  let params = 0;
  for (const s of unetParams(SD15.unet).values()) params += s.reduce((a, b) => a * b, 1);
  const r = runPeer('torch_step.py', [
    ...['--mode', mode, '--px', String(px), '--steps', String(STEPS.timed), '--warmup', String(STEPS.warmup)],
    ...['--device', device, ...(amp ? ['--amp', 'fp16'] : ['--dtype', 'f32']), '--expect-params', String(params)],
    ...(checkpointing ? ['--checkpointing'] : []),
  ]);
  if ('error' in r) return r as { error: string };
  return {
    medianS: r.medianS as number,
    torch: r.torch as string,
    threads: r.threads as number,
    dtype: amp ? 'amp-fp16' : 'f32',
    device: r.device as string,
    checkpointing: r.checkpointing as boolean,
    ...(typeof r.peak_bytes === 'number' ? { peakBytes: r.peak_bytes } : {}),
    ...(typeof r.peak_rss_bytes === 'number' ? { peakRssBytes: r.peak_rss_bytes } : {}),
    ...(typeof r.blas === 'string' ? { blas: r.blas } : {}),
    ...(typeof r.matmulGflops === 'number' ? { matmulGflops: r.matmulGflops } : {}),
  };
}

/** The case JSON's record of a peer run. */
const peerRecord = (p: PeerRun) => ({
  version: p.torch,
  threads: p.threads,
  dtype: p.dtype,
  device: p.device,
  checkpointing: p.checkpointing,
  ...(p.peakBytes !== undefined ? { peak_bytes: p.peakBytes } : {}),
  ...(p.peakRssBytes !== undefined ? { peak_rss_bytes: p.peakRssBytes } : {}),
  ...(p.blas !== undefined ? { blas: p.blas, matmul_gflops: p.matmulGflops } : {}),
});

// ---------------------------------------------------------------------------------------------- main

async function machine() {
  const gpu = await nodeGpu();
  const tuning = await tuneCliGpu(gpu);
  const a = gpu.adapter;
  const out = {
    adapter: `${a.vendor} ${a.architecture} ${a.description}`.trim(),
    /** The GEMM kernel config the steps ran with (src/ops/tune.ts) and where it came from. */
    gemm: `${describeGemmConfig(gpu.gemmConfig)} (${tuning?.source ?? 'DBS_GPU_TUNE=off'})`,
    f16: gpu.hasF16,
    tensorCores: gpu.tensorCoreNote,
    timestampQuery: gpu.hasTimestamps,
    cpu: cpus()[0]?.model.trim() ?? 'unknown CPU',
    cores: cpus().length,
    memoryGiB: round(totalmem() / GiB, 1),
    node: process.version,
    /** A GPU (not a CPU adapter such as lavapipe): results go to step-<gpu>.json beside the CPU machine's step.json. */
    hardwareGpu: !gpu.facts.software,
    gpuSlug: (a.description || a.device || a.vendor || 'gpu')
      .toLowerCase()
      .replace(/[^a-z0-9]+/g, '-')
      .replace(/^-|-$/g, '')
      .slice(0, 40),
  };
  gpu.destroy();
  return out;
}

/** GPU ms by family (and the ten costliest kernels), rounded, for the JSON. */
function profileFields(p: OursResult['profile']): Record<string, unknown> {
  if ('missing' in p) return { gpu_ms_by_family: null, gpu_ms_by_family_missing: p.missing };
  const ms = (x: number) => round(x, 3);
  return {
    gpu_ms_by_family: Object.fromEntries(Object.entries(p.byFamily).map(([k, v]) => [k, ms(v.ms)])),
    gpu_dispatches_by_family: Object.fromEntries(Object.entries(p.byFamily).map(([k, v]) => [k, v.dispatches])),
    gpu_ms_total: ms(p.totalMs),
    gpu_ms_top_kernels: Object.fromEntries(
      Object.entries(p.byKernel)
        .slice(0, 10)
        .map(([k, v]) => [k, ms(v.ms)]),
    ),
  };
}

/** "matmul 41% conv2d 30% ..." for the console. */
function profileLine(p: OursResult['profile']): string {
  if ('missing' in p) return `GPU ms by family: ${p.missing}`;
  const parts = Object.entries(p.byFamily).map(([k, v]) => `${k} ${v.ms.toFixed(1)} (${((100 * v.ms) / p.totalMs).toFixed(0)}%)`);
  return `GPU ${p.totalMs.toFixed(1)} ms in the profiled step: ${parts.join(', ')}`;
}

const m = await machine();
const cases = selectedCases();
console.log(
  `machine: ${m.adapter} (Dawn) / ${m.cores}-core ${m.cpu}, ${m.memoryGiB} GiB; compute dtype ${m.f16 ? 'f16' : 'f32'}; timestamp-query ${m.timestampQuery ? 'yes' : 'no'}${quick ? '   [--quick]' : ''}`,
);
console.log(
  `one DreamBooth step (batch 2: instance + class), median of ${STEPS.timed} after ${STEPS.warmup} warm-up; placement: planTraining under ${gib(BUDGET)}\n`,
);

const rows: Record<string, unknown>[] = [];
for (const name of cases) {
  const kind = name.slice(0, name.lastIndexOf('-')) as CaseKind;
  const mode = name.slice(name.lastIndexOf('-') + 1) as TrainMode;
  const model =
    kind === 'tiny'
      ? tinyModel(mode)
      : kind === 'sdxl-tiny'
        ? tinyModel(mode, 'unet_sdxl')
        : kind === 'sd15'
          ? randomModel(SD15.unet, SD15_PX)
          : randomModel(SDXL_BASE.unet, SDXL_PX);
  const dtype = m.f16 ? 'f16' : 'f32';
  const settings: TrainSettings = { ...TRAIN_DEFAULTS[mode], ...model.settings(mode) };
  const p0 = performance.now();
  const plan = await planTraining(
    () => nodeGpu({ dryRun: true }),
    {
      config: model.config,
      dtype,
      schedule: model.schedule,
      name: { tiny: 'tiny UNet', sd15: 'SD 1.5', 'sdxl-tiny': 'tiny SDXL UNet', sdxl: 'SDXL base' }[kind],
    },
    { latentShape: model.data.latentShape, contextShape: model.data.contextShape, withClass: true },
    settings,
    BUDGET,
  );
  const planS = (performance.now() - p0) / 1000;
  const placement = `${plan.activationCheckpointing ? 'activation checkpointing' : 'no checkpointing'}, ${plan.residentChunks}/${plan.chunks} optimizer chunks resident`;
  if (!plan.fits) {
    console.log(`  ${name}: does not fit ${gib(BUDGET)}: ${plan.message ?? ''}`);
    rows.push({
      name,
      mode,
      resolution: model.resolution,
      dtype,
      ours_s: null,
      torch_s: null,
      ratio: null,
      dropped: `does not fit the budget: ${plan.message}`,
      plan,
    });
    continue;
  }
  const r = await ours(model, mode, plan, REPLAY !== 'off');
  const rOff = REPLAY === 'ab' ? await ours(model, mode, plan, false) : null;
  const peer: Peer =
    kind === 'tiny'
      ? torchTiny(mode, settings, model.schedule.prediction)
      : kind === 'sd15'
        ? torchSd15(mode, model.resolution, plan.activationCheckpointing, TORCH_DEVICE, false)
        : { error: 'no PyTorch peer: bench/peers has no SDXL step script' };
  // On CUDA, also the mixed-precision path a PyTorch user gets by default (autocast fp16, GradScaler, SDPA).
  const ampPeer: Peer | null =
    kind === 'sd15' && TORCH_DEVICE === 'cuda' ? torchSd15(mode, model.resolution, plan.activationCheckpointing, 'cuda', true) : null;
  const oursS = r.stepsS.length ? median(r.stepsS) : null;
  const torchS = 'error' in peer ? null : peer.medianS;
  const ratio = oursS !== null && torchS !== null ? oursS / torchS : null;
  rows.push({
    name,
    mode,
    resolution: model.resolution,
    latent_shape: model.data.latentShape,
    context_shape: model.data.contextShape,
    batch: 2,
    dtype,
    ...(mode === 'lora' ? { rank: settings.rank } : {}),
    placement: {
      activationCheckpointing: plan.activationCheckpointing,
      residentChunks: plan.residentChunks,
      chunks: plan.chunks,
      plannedPeakBytes: plan.peakBytes,
      planSeconds: round(planS, 1),
    },
    ours_s: oursS === null ? null : round(oursS),
    ours_all_s: r.stepsS.map((x) => round(x)),
    warmup_s: round(r.warmupS),
    applied: `${r.applied}/${r.stepsS.length}`,
    torch_s: torchS === null ? null : round(torchS, 5),
    ...('error' in peer ? { torch_missing: peer.error } : { torch: peerRecord(peer) }),
    ...(ampPeer && 'error' in ampPeer ? { torch_amp_s: null, ratio_amp: null, torch_amp_missing: ampPeer.error } : {}),
    ...(ampPeer && !('error' in ampPeer)
      ? { torch_amp_s: round(ampPeer.medianS, 5), ratio_amp: oursS === null ? null : round(oursS / ampPeer.medianS, 2), torch_amp: peerRecord(ampPeer) }
      : {}),
    ratio: ratio === null ? null : round(ratio, 2),
    peak_bytes: r.peakBytes,
    dispatches: r.dispatches,
    buffers_created: r.buffersCreated,
    bind_groups_created: r.bindGroupsCreated,
    host_ms: round(r.hostMs, 1),
    host_cpu_ms: Number.isNaN(r.hostCpuMs) ? null : round(r.hostCpuMs, 1),
    ...replayFields(r, rOff),
    wait_ms: round(r.waitMs, 1),
    reserved_bytes: r.reservedBytes,
    pool_bytes: r.poolBytes,
    ...profileFields(r.profile),
    ...(r.dropped ? { dropped: r.dropped } : {}),
  });
  const peerPart = (p: Peer) =>
    'error' in p
      ? `PyTorch: ${p.error}`
      : `PyTorch ${p.device} ${p.dtype}${p.checkpointing ? ' (checkpointing)' : ''} ${p.medianS.toFixed(4)} s/step, ours/torch ${oursS === null ? '-' : (oursS / p.medianS).toFixed(2)}x`;
  const torchPart = peerPart(peer) + (ampPeer ? `; ${peerPart(ampPeer)}` : '');
  console.log(
    `  ${name.padEnd(9)} ${model.resolution} px ${dtype} (${placement}): ${oursS!.toFixed(4)} s/step (${r.applied}/${r.stepsS.length} applied${r.dropped ? `; ${r.dropped}` : ''}); ${torchPart}\n` +
      `            peak ${gib(r.peakBytes)}, ${r.dispatches} dispatches, ${r.buffersCreated} GPUBuffers + ${r.bindGroupsCreated} bind groups created per step, host ${r.hostMs.toFixed(1)} ms (main-thread CPU ${r.hostCpuMs.toFixed(1)} ms) + ${r.waitMs.toFixed(1)} ms awaiting the GPU\n` +
      `            ${profileLine(r.profile)}` +
      (REPLAY === 'off' ? '' : `\n            ${replayLine(r, rOff)}`),
  );
}

/** Median host ms and main-thread CPU ms over the timed steps that were (or were not) replayed. */
function hostOf(r: OursResult, replayed: boolean): { host_ms: number | null; host_cpu_ms: number | null; steps: number } {
  const at = r.replayedAll.map((x, i) => (x === replayed ? i : -1)).filter((i) => i >= 0);
  const med = (xs: number[]) => (at.length ? round(median(at.map((i) => xs[i])), 1) : null);
  return { host_ms: med(r.hostAll), host_cpu_ms: med(r.hostCpuAll), steps: at.length };
}

function replayFields(r: OursResult, off: OursResult | null): Record<string, unknown> {
  const fields: Record<string, unknown> = {
    replay: REPLAY,
    host_ms_all: r.hostAll.map((x) => round(x, 1)),
    host_cpu_ms_all: r.hostCpuAll.map((x) => round(x, 1)),
    replayed_steps: r.replayedAll,
    host_replayed: hostOf(r, true),
    host_live: hostOf(r, false),
  };
  if (off) fields.replay_off = { host_ms: round(off.hostMs, 1), host_cpu_ms: round(off.hostCpuMs, 1), host_cpu_ms_all: off.hostCpuAll.map((x) => round(x, 1)) };
  return fields;
}

function replayLine(r: OursResult, off: OursResult | null): string {
  const on = hostOf(r, true);
  const live = off ? { host_cpu_ms: round(off.hostCpuMs, 1), steps: off.hostCpuAll.length } : hostOf(r, false);
  const ratio = on.host_cpu_ms && live.host_cpu_ms ? ` (${(live.host_cpu_ms / on.host_cpu_ms).toFixed(2)}x)` : '';
  return `replay: ${on.steps} timed steps replayed, main-thread CPU ${on.host_cpu_ms ?? '-'} ms vs ${live.host_cpu_ms ?? '-'} ms live${off ? ' (replay off run)' : ''} over ${live.steps}${ratio}`;
}

const out = arg('--out') ?? join(here, 'results', m.hardwareGpu ? `step-${m.gpuSlug}.json` : 'step.json');
mkdirSync(dirname(out), { recursive: true });
// --append: keep the file's other cases (each stamped with the date of the run that measured it), so a long case
// (sd15-full) can be measured on its own and join the --quick run's results.
const date = new Date().toISOString();
for (const r of rows) r.measured = date;
const kept: Record<string, unknown>[] =
  args.includes('--append') && existsSync(out)
    ? (JSON.parse(readFileSync(out, 'utf8')) as { cases: Record<string, unknown>[] }).cases.filter((c) => !rows.some((r) => r.name === c.name))
    : [];
writeFileSync(
  out,
  JSON.stringify(
    {
      date,
      quick,
      machine: m,
      adapter: m.adapter,
      steps: STEPS,
      budgetBytes: BUDGET,
      definitions: {
        ours_s: 'median wall seconds of DreamBoothTrainer.trainStep (ends with gpu.sync)',
        ratio: 'ours_s / torch_s',
        peak_bytes: "the allocator's peak over the timed steps (trainStep resets it each step)",
        dispatches: 'compute dispatches recorded per step (median; Gpu.stats)',
        buffers_created: 'GPUBuffers created per step (median): allocator tensors, uniforms, read-back staging',
        host_ms: 'wall ms per step minus ms spent awaiting Gpu.sync / Gpu.readBytes (median)',
        host_cpu_ms:
          "CPU ms of the process's main thread per step outside those awaits (median; Linux schedstat): host_ms without the time other processes or lavapipe's threads held the cores",
        gpu_ms_by_family:
          "GPU ms per op family (shader file) in the profiled step (the warm-up: every dispatch in its own compute pass with a timestamp pair, Dawn's timestamp quantization off); gpu_ms_top_kernels: the ten costliest shader.entry",
        reserved_bytes: 'device bytes the allocator holds after the timed steps: live buffers at their size class plus the idle pool (pool_bytes)',
      },
      cases: [...kept, ...rows],
    },
    null,
    2,
  ),
);
console.log(`\nwrote ${out}`);
process.exit(0);
