// npm run bench:kernels:node — our kernels on Dawn in Node (lavapipe here; a real GPU with DBS_SYSTEM_VULKAN=1)
// against PyTorch (bench/peers/torch_kernels.py) on the SD 1.5 shapes of bench/shapes.json, in every dtype the
// adapter has (f16 where shader-f16 exists, and f32): ours on GPU timestamps around R back-to-back runs, torch on
// CUDA events around R runs (or CPU wall time where torch has no CUDA), median of --reps measurements (>= 10).
// Writes bench/results/kernels-<adapter>.json: kernels-lavapipe.json, kernels-node-nvidia-h200.json, ...
// Flags: --quick (scaled-down shapes), --reps N (default 10), --dtypes f16,f32, --only id,id, --out FILE,
// --budget SECONDS (per variant), --target-ms MS (length of one measurement, default 5), --naive-reps N (quick: 0, not timed),
// --naive-max-mib MIB (naive attention not timed past this much of scores; its peak is still planned),
// --no-torch, --torch-device cpu|cuda (default: cuda when torch has it). PYTHON picks the interpreter
// (default /usr/bin/python3, Debian's python3-torch).
import { execFileSync } from 'node:child_process';
import { existsSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { cpus, loadavg } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { nodeGpu, DAWN_DISABLE, DAWN_ENABLE } from '../src/gpu/node.ts';
import { describeGemmConfig } from '../src/ops/tune.ts';
import { tuneCliGpu } from '../src/cli/gpu-tuning.ts';
import {
  adapterSlug,
  benchOurs,
  compare,
  comparisonTable,
  flashTiledVsRows,
  flashVsNaive,
  flops,
  pickLimits,
  table,
  timestampsQuantized,
  type Measurement,
  type Pass,
  type ShapeCase,
} from './core.ts';
import { gitCommit } from './git.ts';

const started = performance.now();
const loadAtStart = loadavg();
const here = dirname(fileURLToPath(import.meta.url));
const args = process.argv.slice(2);
const arg = (name: string) => (args.includes(name) ? args[args.indexOf(name) + 1] : undefined);
const quick = args.includes('--quick');
const reps = Number(arg('--reps')) || 10;
// Naive attention is issue 2's baseline, not a peer: --quick does not time it unless --naive-reps N asks.
const naiveReps = arg('--naive-reps') !== undefined ? Number(arg('--naive-reps')) : quick ? 0 : reps;
const budgetMs = (Number(arg('--budget')) || 600) * 1000;
const targetMs = Number(arg('--target-ms')) || 5;
const naiveMaxScoreBytes = arg('--naive-max-mib') ? Number(arg('--naive-max-mib')) * 2 ** 20 : Infinity;
const only = arg('--only')?.split(',');
const size = quick ? 'quick' : 'full';
const shapes: ShapeCase[] = (JSON.parse(readFileSync(join(here, 'shapes.json'), 'utf8')) as Record<string, ShapeCase[]>)[size].filter(
  (c) => !only || only.includes(c.id),
);
const commit = gitCommit();

const gpu = await nodeGpu();
await tuneCliGpu(gpu, process.env, (l) => console.log(l)); // a GPU's tuned GEMM config (src/ops/tune.ts), as the CLI runs
const dtypes = (arg('--dtypes')?.split(',') ?? (gpu.hasF16 ? ['f16', 'f32'] : ['f32'])).filter((d) => d === 'f32' || gpu.hasF16);
const adapter = `${gpu.adapter.vendor} ${gpu.adapter.architecture} ${gpu.adapter.device} ${gpu.adapter.description}`.replace(/\s+/g, ' ').trim();
const slug = adapterSlug(gpu.adapter);
console.log(`adapter: ${adapter}; features ${gpu.adapter.features.join(' ')}; dtypes ${dtypes.join(',')}; shapes ${size}; reps ${reps}; commit ${commit}`);
console.log(`tensor cores: ${gpu.tensorCoreNote}`);
console.log(`GEMM config: ${describeGemmConfig(gpu.gemmConfig)}`);

const results: Measurement[] = [];
const rawNs: number[] = [];
for (const dtype of dtypes) {
  const g = dtype === gpu.computeDType ? gpu : await nodeGpu({ disableF16: true });
  if (g !== gpu) await tuneCliGpu(g, process.env, (l) => console.log(l)); // the f32 device has its own cache entry
  const planner = await nodeGpu({ dryRun: true, disableF16: dtype === 'f32' });
  for (const c of shapes) {
    const ms = await benchOurs(g, c, { reps, naiveReps, budgetMs, targetMs, planner, naiveMaxScoreBytes }, rawNs);
    results.push(...ms);
    for (const m of ms)
      console.log(`  ${dtype} ${m.label} ${m.impl}: ${m.gpuMs?.toFixed(3) ?? '-'} ms GPU, ${m.ms.toFixed(3)} ms wall${m.note ? ` (${m.note})` : ''}`);
  }
  planner.destroy();
  if (g !== gpu) g.destroy();
}

interface TorchResult {
  id: string;
  impl: string;
  pass: Pass;
  dtype: string;
  ms: number;
  all: number[];
  repeat: number;
}
let torchInfo: Record<string, unknown>;
const notRun: Record<string, string> = {};
try {
  if (args.includes('--no-torch')) throw new Error('--no-torch');
  const py = process.env.PYTHON ?? (existsSync('/usr/bin/python3') ? '/usr/bin/python3' : 'python3');
  const torchArgs = [join(here, 'peers', 'torch_kernels.py'), size, String(reps), '--dtypes', dtypes.join(','), '--target-ms', String(targetMs)];
  if (arg('--torch-device')) torchArgs.push('--device', arg('--torch-device')!);
  if (only) torchArgs.push('--only', only.join(','));
  const raw = execFileSync(py, torchArgs, { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });
  const parsed = JSON.parse(raw.trim().split('\n').pop()!) as {
    device?: string;
    torch?: string;
    time?: string;
    error?: string;
    notRun?: Record<string, string>;
    results?: TorchResult[];
  };
  torchInfo = { device: parsed.device, torch: parsed.torch, time: parsed.time, error: parsed.error, notRun: parsed.notRun };
  if (parsed.error) notRun.torch = parsed.error;
  Object.assign(notRun, parsed.notRun);
  for (const r of parsed.results ?? []) {
    const c = shapes.find((s) => s.id === r.id)!;
    results.push({ ...r, label: c.label, gpuMs: r.ms, gflops: flops(c, r.pass) / r.ms / 1e6, note: `${parsed.time}; ${r.repeat} runs per measurement` });
  }
} catch (e) {
  notRun.torch = `PyTorch peer not run: ${(e as Error).message.split('\n')[0]}`;
  torchInfo = { error: notRun.torch };
}

const cases = compare(results, true, notRun);
console.log(`\n${table(results)}\n\n${comparisonTable(cases)}\n`);
for (const [peer, why] of Object.entries(notRun)) console.log(`not run: ${peer}: ${why}`);
const flashNaive = flashVsNaive(results, true);
for (const [k, v] of Object.entries(flashNaive)) console.log(`${k}: ${typeof v === 'number' ? v.toFixed(2) : v}`);
const tiledVsRows = flashTiledVsRows(results, true);
for (const [k, v] of Object.entries(tiledVsRows)) console.log(`${k}: ${v.toFixed(2)}`);
const quantized = timestampsQuantized(rawNs);
const seconds = (performance.now() - started) / 1000;
console.log(`timestamps quantized: ${quantized ?? 'no timestamps'} (${rawNs.length} measurements); ${seconds.toFixed(0)} s`);

const outFile = arg('--out') ?? join(here, 'results', `kernels-${slug === 'lavapipe' ? slug : `node-${slug}`}.json`);
mkdirSync(dirname(outFile), { recursive: true });
writeFileSync(
  outFile,
  JSON.stringify(
    {
      date: new Date().toISOString(),
      commit,
      machine: {
        cpus: cpus().length,
        loadAverage1mAtStart: loadAtStart[0],
        loadAverage1mAtEnd: loadavg()[0],
        note: 'load averages above the core count mean other work shared the CPU: timings are then noisy',
      },
      host: 'node (Dawn, the webgpu package)',
      dawnToggles: { enabled: DAWN_ENABLE, disabled: DAWN_DISABLE },
      adapter,
      features: gpu.adapter.features,
      tensorCores: gpu.tensorCoreNote,
      gemmConfig: describeGemmConfig(gpu.gemmConfig),
      limits: pickLimits(gpu.adapter.limits),
      dtypes,
      shapes: size,
      reps,
      naiveReps,
      targetMsPerMeasurement: targetMs,
      timestamps: {
        quantized,
        measurements: rawNs.length,
        check: 'quantized = every raw timestamp duration a multiple of 65.536 us',
      },
      method:
        'ours: GPU timestamps around R back-to-back runs recorded into one compute pass (R fills targetMsPerMeasurement), divided by R; median of reps measurements; torch: the same R-run measurements with CUDA events, or CPU wall time without CUDA',
      torch: torchInfo,
      seconds: Math.round(seconds),
      cases,
      flashVsNaive: flashNaive,
      flashTiledVsRows: tiledVsRows,
      results,
    },
    null,
    2,
  ),
);
console.log(`wrote ${outFile}`);
gpu.destroy();
process.exit(0);
