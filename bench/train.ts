// npm run bench:train — training benchmarks, written to bench/results/train.json (train-quick.json with --quick):
//   1. seconds per DreamBooth step on the tiny SD1-style UNet (the tests' weights and reference-run settings,
//      random latents, batch instance + class), ours on Dawn (whatever GPU it finds: lavapipe here) in f32 and
//      f16, against the same step in PyTorch on the CPU (bench/peers/torch_train.py, float32), LoRA and full;
//   2. SD 1.5 at 512 px (64x64 latents, 77 tokens, batch 2 with prior preservation, f16): the placement
//      src/train/plan.ts picks (dry runs of the real trainer) for LoRA rank 8 (and with the text encoder too),
//      full fine-tuning with fp32 AdamW and with the default 8-bit AdamW + compact master (each with its updates
//      fused into the backward pass, TrainSettings.fusedUpdates, and without: the baseline, planned with
//      planTraining's 'never'; the product's planner fuses such a run when that streams less), each under the
//      --budget-gib budget (default 4 GiB) and under 8 GiB: its peak GPU bytes (and per allocator tag) against
//      the targets (full <= 4 GiB, LoRA rank 8 <= 3 GiB), the no-checkpointing / all-resident peak beside it,
//      the optimizer bytes that stream through the store per step (`store_bytes_per_step`, against issue 14's
//      <= 4 GB for full fine-tuning) and how long the planner took (`planSeconds`);
//   3. the offload stream in headless Chromium: raw IndexedDB put/get of random 16 and 64 MiB chunks against
//      IdbChunkStore's write/read (bench/train-page.ts, bundled with Vite's library mode like e2e/store.test.ts),
//      and what each SD 1.5 plan's store traffic costs per step at the store's rates measured in the same page
//      (`projected_s_per_step`, written on every plan row; null with the reason when Chromium is missing).
//   4. SDXL LoRA at 1024 px (bench/sdxl-rows.ts: rank 16, batch 1, f16 base under 7.5 GiB and int8 base under 6 GiB,
//      issue 47's targets): the dry-run planner's peak by allocator tag, store traffic per step and plan time.
// Flags: --quick (fewer steps, 16 MiB chunks only), --out FILE, --budget-gib N (default 4), --sdxl (part 4 only,
// written to train-sdxl.json: the SD 1.5 plans take minutes each on lavapipe).
import { execFileSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { cpus, loadavg, tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';
import { build } from 'vite';
import { CHROMIUM_FLAGS, serve } from '../e2e/browser.ts';
import type { Gpu } from '../src/gpu/device.ts';
import { nodeGpu } from '../src/gpu/node.ts';
import type { DType } from '../src/gpu/tensor.ts';
import { readSafetensors } from '../src/io/safetensors.ts';
import { sdxlPlanRows } from './sdxl-rows.ts';
import { SD15, unetParams } from '../src/models/shapes.ts';
import { unetConfigFromJson } from '../src/nn/unet.ts';
import { SD_SCHEDULE } from '../src/sample/schedulers.ts';
import { MemoryChunkStore } from '../src/store/chunkstore.ts';
import { planTraining, storeBytesPerStep, type Plan } from '../src/train/plan.ts';
import { Rng } from '../src/util/rng.ts';
import { median } from './core.ts';
import type { MasterKind, OptimizerKind } from '../src/train/packed-state.ts';
import { TRAIN_DEFAULTS } from '../src/pipeline/settings.ts';
import { DreamBoothTrainer, type TrainData, type TrainMode, type TrainSettings } from '../src/train/trainer.ts';
import type { IdbBenchOptions, IdbTiming } from './train-page.ts';

const here = dirname(fileURLToPath(import.meta.url));
const root = join(here, '..');
const args = process.argv.slice(2);
const arg = (name: string) => (args.includes(name) ? args[args.indexOf(name) + 1] : undefined);
const quick = args.includes('--quick');
const GiB = 2 ** 30;
const PYTHON = '/usr/bin/python3';
const STEPS = quick ? { warmup: 1, timed: 3 } : { warmup: 2, timed: 10 };
const BUDGET = (Number(arg('--budget-gib')) || 4) * GiB;
const TARGETS: Record<TrainMode, number> = { full: 4 * GiB, lora: 3 * GiB };
const IDB: IdbBenchOptions = quick ? { sizesMiB: [16], reps: 2 } : { sizesMiB: [16, 64], reps: 9 };

const gib = (n: number) => `${(n / GiB).toFixed(2)} GiB`;
const mb = (n: number) => `${(n / 1e6).toFixed(0)} MB`;

// ---------------------------------------------------------------------------------------------- 1. tiny steps

interface StepTiming {
  medianS: number;
  all: number[];
  applied: number;
}

// The tiny run: the tests' SD1-style UNet (tests/fixtures/modules/unet_sd1, the weights gen_unet.py makes) with
// the reference runs' settings (tests/fixtures/train/gen_train.py), random latents and embeddings.
const TINY_UNET = readSafetensors(new Uint8Array(readFileSync(join(root, 'tests', 'fixtures', 'modules', 'unet_sd1.safetensors'))));
const TINY_CONFIG = unetConfigFromJson(JSON.parse(TINY_UNET.metadata.config));
const TINY: Record<TrainMode, { settings: TrainSettings; prediction: 'epsilon' | 'v_prediction' }> = {
  lora: { settings: { ...TRAIN_DEFAULTS.lora, lr: 1e-3, rank: 4, alpha: 8, checkpointEvery: 0, chunkElems: 4096 }, prediction: 'epsilon' },
  full: {
    settings: { ...TRAIN_DEFAULTS.full, lr: 1e-4, minSnrGamma: 5, priorLossWeight: 0.5, checkpointEvery: 0, chunkElems: 4096 },
    prediction: 'v_prediction',
  },
};

/** Two instance samples and one class sample ([4, 8, 8] latents, [7, 32] embeddings). */
function tinyData(): TrainData {
  const rng = new Rng(1);
  const sample = () => ({ latent: rng.normals(4 * 8 * 8), context: rng.normals(7 * 32) });
  return { latentShape: [4, 8, 8], contextShape: [7, 32], instance: [sample(), sample()], classes: [sample()] };
}

async function tinyTrainer(gpu: Gpu, mode: TrainMode, dtype: DType): Promise<DreamBoothTrainer> {
  const weights = new Map();
  for (const name of unetParams(TINY_CONFIG).keys()) {
    const t = TINY_UNET.tensors.get(name)!;
    weights.set(name, gpu.upload(t.data, t.shape, dtype, 'weights', name));
  }
  const model = { config: TINY_CONFIG, weights, schedule: { ...SD_SCHEDULE, prediction: TINY[mode].prediction } };
  // Every optimizer chunk resident: what the planner picks for a model this small.
  return DreamBoothTrainer.create(gpu, model, tinyData(), { ...TINY[mode].settings, residentChunks: Infinity }, new MemoryChunkStore(), 'bench');
}

/** Our trainer on the tiny UNet, Rng-drawn batches. */
async function oursTiny(mode: TrainMode, dtype: DType): Promise<StepTiming> {
  const gpu = await nodeGpu();
  try {
    const trainer = await tinyTrainer(gpu, mode, dtype);
    for (let i = 0; i < STEPS.warmup; i++) await trainer.trainStep();
    const all: number[] = [];
    let applied = 0;
    for (let i = 0; i < STEPS.timed; i++) {
      const t0 = performance.now();
      const r = await trainer.trainStep(); // ends with gpu.sync(): the step's GPU work is done
      all.push((performance.now() - t0) / 1000);
      if (r.applied) applied++;
    }
    trainer.destroy();
    return { medianS: median(all), all, applied };
  } finally {
    gpu.destroy();
  }
}

/** The same step in PyTorch on the CPU, or why it could not run. */
function torchTiny(mode: TrainMode): (StepTiming & { torch: string; threads: number }) | { error: string } {
  const { settings: s, prediction } = TINY[mode];
  const peerArgs = [
    join(here, 'peers', 'torch_train.py'),
    '--mode',
    mode,
    '--steps',
    String(STEPS.timed),
    '--warmup',
    String(STEPS.warmup),
    '--lr',
    String(s.lr),
    '--prediction',
    prediction,
    '--prior-weight',
    String(s.priorLossWeight),
    '--max-grad-norm',
    String(s.maxGradNorm),
    '--weight-decay',
    String(s.weightDecay),
    ...(mode === 'lora' ? ['--rank', String(s.rank), '--alpha', String(s.alpha)] : []),
    ...(s.minSnrGamma !== null ? ['--min-snr', String(s.minSnrGamma)] : []),
  ];
  if (!existsSync(PYTHON)) return { error: `${PYTHON} not found: no PyTorch peer` };
  try {
    const out = execFileSync(PYTHON, peerArgs, { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });
    const r = JSON.parse(out.trim().split('\n').pop()!);
    return { medianS: r.medianS, all: r.all, applied: r.steps, torch: r.torch, threads: r.threads };
  } catch (e) {
    const err = e as { stderr?: string; message: string };
    const why = /No module named 'torch'/.test(err.stderr ?? '')
      ? `PyTorch is not installed for ${PYTHON}`
      : (err.stderr?.trim().split('\n').pop() ?? err.message);
    return { error: `no PyTorch peer: ${why}` };
  }
}

// ---------------------------------------------------------------------------------------------- 2. SD 1.5 plans

/** One SD 1.5 configuration the planner places: the run kind and its optimizer mode. */
interface Sd15Case {
  mode: TrainMode;
  textEncoderLora: boolean;
  optimizer: OptimizerKind;
  master: MasterKind;
  /** Optimizer updates fused into the backward pass (TrainSettings.fusedUpdates; full fine-tuning only). */
  fusedUpdates: boolean;
  /** Short name for the log and the JSON ("full 8-bit + compact"). */
  label: string;
}

interface Sd15Row {
  mode: TrainMode;
  label: string;
  rank?: number;
  textEncoderLora: boolean;
  optimizer: OptimizerKind;
  master: MasterKind;
  fusedUpdates: boolean;
  budgetBytes: number;
  /** Peak GPU target (full <= 4 GiB, LoRA <= 3 GiB). */
  targetBytes: number;
  /**
   * Peak within the target, judged at the --budget-gib budget only; null under a larger budget (the planner then
   * spends the memory on speed: no checkpointing, more resident chunks, by design).
   */
  pass: boolean | null;
  /** Issue 14's store-traffic target for full fine-tuning (<= 4 GB read + written per step); null for LoRA. */
  storeTargetBytes: number | null;
  store_target_pass: boolean | null;
  plan: Plan;
  /** No activation checkpointing, every optimizer chunk resident (the fastest placement), for comparison. */
  unconstrainedPeakBytes: number;
  /** Wall time of planTraining (all its dry runs). */
  planSeconds: number;
  /** Bytes the optimizer reads from plus writes to the store per applied step with the chosen placement. */
  store_bytes_per_step: number;
  /** Seconds of IndexedDB time those bytes take per step at the rates measured in the same run (part 3). */
  projected_s_per_step: number | null;
  projected_s_note?: string;
}

const STORE_TARGET = 4e9;

async function sd15Plan(c: Sd15Case, budgetBytes: number): Promise<Sd15Row> {
  const { mode, textEncoderLora, optimizer, master, fusedUpdates } = c;
  const settings = { ...TRAIN_DEFAULTS[mode], textEncoderLora, optimizer, master, fusedUpdates }; // LoRA: rank 8 (alpha 8)
  const t0 = performance.now();
  const plan = await planTraining(
    () => nodeGpu({ dryRun: true }),
    { config: SD15.unet, dtype: 'f16', name: 'SD 1.5', textEncoder: SD15.textEncoder },
    { latentShape: [4, 64, 64], contextShape: [77, 768], withClass: true },
    settings,
    budgetBytes,
    // The unfused rows are the baseline: the product's planner ('auto') would fuse them when that streams less.
    'never',
  );
  const planSeconds = (performance.now() - t0) / 1000;
  // The planner always tries the fastest placement first.
  const first = plan.tried[0];
  if (first.activationCheckpointing || first.residentChunks !== plan.chunks) throw new Error('the planner did not start with no checkpointing, all resident');
  const storeBytes = storeBytesPerStep(plan);
  const storeTargetBytes = mode === 'full' ? STORE_TARGET : null;
  return {
    mode,
    label: c.label,
    ...(mode === 'lora' ? { rank: settings.rank } : {}),
    textEncoderLora,
    optimizer,
    master,
    fusedUpdates,
    budgetBytes,
    targetBytes: TARGETS[mode],
    pass: budgetBytes > BUDGET ? null : plan.fits && plan.peakBytes <= TARGETS[mode],
    storeTargetBytes,
    store_target_pass: storeTargetBytes === null ? null : plan.fits && storeBytes <= storeTargetBytes,
    plan,
    unconstrainedPeakBytes: first.peakBytes,
    planSeconds,
    store_bytes_per_step: storeBytes,
    projected_s_per_step: null,
  };
}

// ---------------------------------------------------------------------------------------------- 3. IndexedDB

interface IdbRow {
  mib: number;
  impl: IdbTiming['impl'];
  writeMBps: number;
  readMBps: number;
  writeMs: number[];
  readMs: number[];
}

/** Bundles bench/train-page.ts (and the store it imports) into `dir/www` with a blank page around it. */
async function bundlePage(dir: string): Promise<void> {
  await build({
    configFile: false,
    root: dir,
    logLevel: 'warn',
    build: {
      outDir: join(dir, 'www'),
      emptyOutDir: true,
      minify: false,
      lib: { entry: join(here, 'train-page.ts'), formats: ['es'], fileName: () => 'train-page.js' },
    },
  });
  // tsx's keepNames wraps named functions in page.evaluate callbacks in a Node-only `__name` helper.
  writeFileSync(
    join(dir, 'www', 'index.html'),
    '<!doctype html><title>train bench</title><link rel="icon" href="data:,"><script>window.__name = (f) => f;</script><script type="module" src="/train-page.js"></script>',
  );
}

async function idbBench(): Promise<{ rows: IdbRow[]; browser: string } | { error: string }> {
  const exe = process.env.CHROMIUM_PATH ?? '/usr/bin/chromium';
  if (!existsSync(exe)) return { error: `${exe} not found: the IndexedDB part needs Chromium (scripts/ensure-deps.sh --browser)` };
  const dir = mkdtempSync(join(tmpdir(), 'dbs-bench-train-'));
  try {
    await bundlePage(dir);
    const server = await serve(join(dir, 'www'));
    // An on-disk profile (not incognito), so IndexedDB writes real files, as in a user's browser.
    const ctx = await chromium.launchPersistentContext(join(dir, 'profile'), {
      executablePath: exe,
      headless: true,
      args: [...CHROMIUM_FLAGS, '--disable-webgpu'],
    });
    try {
      const page = ctx.pages()[0] ?? (await ctx.newPage());
      page.on('console', (m) => console.log(`[page] ${m.text()}`));
      await page.goto(server.url);
      await page.waitForFunction(() => (window as unknown as { __trainBench?: unknown }).__trainBench !== undefined, null, { timeout: 60_000 });
      const r = (await page.evaluate((o) => (window as unknown as { __trainBench: { idb: (x: unknown) => Promise<unknown> } }).__trainBench.idb(o), IDB)) as {
        timings: IdbTiming[];
        userAgent: string;
      };
      const rows = r.timings.map((t) => ({
        mib: t.mib,
        impl: t.impl,
        writeMBps: (t.mib * 2 ** 20) / 1e6 / (median(t.writeMs) / 1000),
        readMBps: (t.mib * 2 ** 20) / 1e6 / (median(t.readMs) / 1000),
        writeMs: t.writeMs.map((x) => Math.round(x * 10) / 10),
        readMs: t.readMs.map((x) => Math.round(x * 10) / 10),
      }));
      return { rows, browser: `Chromium ${ctx.browser()?.version() ?? r.userAgent}` };
    } finally {
      await ctx.close();
      await server.close();
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

// ---------------------------------------------------------------------------------------------- main

async function machine(): Promise<{ line: string; adapter: string; cpu: string; cores: number; node: string; f16: boolean }> {
  const gpu = await nodeGpu();
  const a = gpu.adapter;
  const f16 = gpu.hasF16;
  gpu.destroy();
  const adapter = `${a.vendor} ${a.architecture} ${a.description}`.trim();
  const lavapipe = /llvmpipe/i.test(a.description) ? 'lavapipe' : a.description || a.vendor;
  const cpu = cpus()[0]?.model.trim() ?? 'unknown CPU';
  const cores = cpus().length;
  return { line: `${lavapipe} (Dawn) / ${cores}-core CPU (${cpu})`, adapter, cpu, cores, node: process.version, f16 };
}

const m = await machine();
const LOAD_START = loadavg()[0];
console.log(`machine: ${m.line}, load average ${LOAD_START.toFixed(1)}${quick ? '   [--quick]' : ''}\n`);

const SDXL_TITLE = '4. SDXL LoRA rank 16 at 1024 px (128x128 latents, 77x2048 context), batch 1: dry-run plans by base-weight storage';
const sdxlSection = (rows: Awaited<ReturnType<typeof sdxlPlanRows>>) => ({ resolution: 1024, latentShape: [4, 128, 128], batch: 1, rank: 16, rows });
if (args.includes('--sdxl')) {
  console.log(SDXL_TITLE);
  const rows = await sdxlPlanRows();
  const out = arg('--out') ?? join(here, 'results', 'train-sdxl.json');
  mkdirSync(dirname(out), { recursive: true });
  const body = { date: new Date().toISOString(), machine: m, loadAverage: { start: LOAD_START, end: loadavg()[0] }, sdxl: sdxlSection(rows) };
  writeFileSync(out, JSON.stringify(body, null, 2));
  console.log(`\nwrote ${out}`);
  process.exit(0);
}

console.log(`1. tiny UNet DreamBooth step (batch 2: instance + class), median of ${STEPS.timed} after ${STEPS.warmup} warm-up`);
const tiny: Record<string, unknown>[] = [];
for (const mode of ['lora', 'full'] as const) {
  const peer = torchTiny(mode);
  const ours: Partial<Record<DType, StepTiming>> = {};
  for (const dtype of m.f16 ? (['f32', 'f16'] as const) : (['f32'] as const)) ours[dtype] = await oursTiny(mode, dtype);
  const row: Record<string, unknown> = { mode, ours, torch: peer };
  const parts = Object.entries(ours).map(
    ([d, t]) => `ours ${d} ${t!.medianS.toFixed(4)} s/step${t!.applied < STEPS.timed ? ` (${t!.applied}/${STEPS.timed} applied)` : ''}`,
  );
  if ('error' in peer) console.log(`  ${mode.padEnd(4)}: ${parts.join(', ')}; ${peer.error}`);
  else {
    const ratios = Object.fromEntries(Object.entries(ours).map(([d, t]) => [d, t!.medianS / peer.medianS]));
    row.oursOverTorch = ratios;
    console.log(
      `  ${mode.padEnd(4)}: ${parts.join(', ')}; PyTorch CPU f32 (${peer.threads} threads, torch ${peer.torch}) ${peer.medianS.toFixed(4)} s/step; ` +
        `ours/torch ${Object.entries(ratios)
          .map(([d, r]) => `${d} ${r.toFixed(2)}x`)
          .join(', ')}`,
    );
  }
  tiny.push(row);
}

console.log(`\n2. SD 1.5 at 512 px (64x64 latents, 77 tokens, batch 2 with prior preservation), f16: planned peak GPU bytes and store traffic`);
const sd15: Sd15Row[] = [];
// Each plan under the --budget-gib budget (default 4 GiB) and under 8 GiB (issue 14: full SD 1.5 should stream
// nothing there); the peak target stays the mode's (full <= 4 GiB, LoRA <= 3 GiB), the store target 4 GB per step.
// The text-encoder LoRA row is extra (the text encoder then stays on the GPU); it is held to the LoRA target.
// Full fine-tuning in both optimizer modes, with its updates fused into the backward pass and without (the default).
const CASES: Sd15Case[] = [
  { mode: 'lora', textEncoderLora: false, optimizer: 'adamw', master: 'fp32', fusedUpdates: false, label: 'LoRA rank 8' },
  { mode: 'lora', textEncoderLora: true, optimizer: 'adamw', master: 'fp32', fusedUpdates: false, label: 'LoRA rank 8 + TE' },
  { mode: 'full', textEncoderLora: false, optimizer: 'adamw', master: 'fp32', fusedUpdates: false, label: 'full fp32 AdamW' },
  { mode: 'full', textEncoderLora: false, optimizer: 'adamw', master: 'fp32', fusedUpdates: true, label: 'full fp32 AdamW fused' },
  { mode: 'full', textEncoderLora: false, optimizer: 'adamw8bit', master: 'compact', fusedUpdates: false, label: 'full 8-bit + compact' },
  { mode: 'full', textEncoderLora: false, optimizer: 'adamw8bit', master: 'compact', fusedUpdates: true, label: 'full 8-bit + compact fused' },
];
const BUDGETS = [...new Set([BUDGET, 8 * GiB])];
for (const budget of BUDGETS)
  for (const c of CASES) {
    const r = await sd15Plan(c, budget);
    sd15.push(r);
    const p = r.plan;
    const name = `${c.label} @ ${gib(budget)}`;
    const placement = `${p.activationCheckpointing ? 'activation checkpointing' : 'no checkpointing'}, ${p.residentChunks}/${p.chunks} optimizer chunks resident`;
    const storeTarget = r.storeTargetBytes === null ? '' : `; store <= ${mb(r.storeTargetBytes)}/step: ${r.store_target_pass ? 'PASS' : 'FAIL'}`;
    console.log(
      `  ${name.padEnd(32)}: peak ${gib(p.peakBytes)} (${placement}; ${mb(p.storeReadBytesPerStep)} read + ${mb(p.storeWriteBytesPerStep)} written through the store per step) ` +
        `vs ${gib(r.unconstrainedPeakBytes)} with no checkpointing, all resident; target <= ${gib(r.targetBytes)}: ${r.pass === null ? 'n/a at this budget' : r.pass ? 'PASS' : 'FAIL'}${storeTarget}` +
        `  [${p.tried.length} dry runs, ${r.planSeconds.toFixed(1)} s]${p.message ? `\n    ${p.message}` : ''}`,
    );
  }

console.log(`\n3. offload stream: IndexedDB in headless Chromium, random chunks, median of ${IDB.reps}`);
const idb = await idbBench();
const idbRatios: { mib: number; writeStoreOverRaw: number; readStoreOverRaw: number }[] = [];
if ('error' in idb) {
  console.log(`  skipped: ${idb.error}`);
  // A plan that streams nothing costs no storage time at any rate; one that streams cannot be projected.
  for (const r of sd15) {
    r.projected_s_per_step = r.store_bytes_per_step === 0 ? 0 : null;
    r.projected_s_note = r.store_bytes_per_step === 0 ? 'nothing streams' : idb.error;
  }
} else {
  for (const mib of IDB.sizesMiB) {
    const at = (impl: IdbRow['impl']) => idb.rows.find((r) => r.mib === mib && r.impl === impl)!;
    const [raw, rawAb, store] = [at('raw'), at('raw-ab'), at('store')];
    const ratio = { mib, writeStoreOverRaw: store.writeMBps / raw.writeMBps, readStoreOverRaw: store.readMBps / raw.readMBps };
    idbRatios.push(ratio);
    const f = (r: IdbRow) => `write ${r.writeMBps.toFixed(0).padStart(4)} MB/s, read ${r.readMBps.toFixed(0).padStart(4)} MB/s`;
    console.log(
      `  ${String(mib).padStart(2)} MiB  raw (Blob, strict) ${f(raw)} | IdbChunkStore ${f(store)} | store/raw write ${ratio.writeStoreOverRaw.toFixed(2)}x, read ${ratio.readStoreOverRaw.toFixed(2)}x`,
    );
    console.log(`          raw (ArrayBuffer, default durability) ${f(rawAb)}`);
  }
  console.log(`  (${idb.browser})`);
  // What each plan's store traffic costs per step at these rates (largest chunk size measured; the optimizer
  // overlaps the store with GPU work, but reads and writes share the disk, so this is their sum).
  const big = Math.max(...IDB.sizesMiB);
  const store = idb.rows.find((r) => r.mib === big && r.impl === 'store')!;
  for (const r of sd15) {
    r.projected_s_per_step = r.plan.storeReadBytesPerStep / 1e6 / store.readMBps + r.plan.storeWriteBytesPerStep / 1e6 / store.writeMBps;
    r.projected_s_note = `IdbChunkStore at ${big} MiB chunks: write ${store.writeMBps.toFixed(0)} MB/s, read ${store.readMBps.toFixed(0)} MB/s`;
    if (r.store_bytes_per_step > 0)
      console.log(
        `  ${r.label} @ ${gib(r.budgetBytes)}: ${mb(r.store_bytes_per_step)} through IdbChunkStore per step = about ${r.projected_s_per_step.toFixed(1)} s/step of storage time at the ${big} MiB rates`,
      );
  }
}

console.log(`\n${SDXL_TITLE}`);
const sdxl = await sdxlPlanRows();

const out = arg('--out') ?? join(here, 'results', quick ? 'train-quick.json' : 'train.json');
mkdirSync(dirname(out), { recursive: true });
writeFileSync(
  out,
  JSON.stringify(
    {
      date: new Date().toISOString(),
      quick,
      machine: m,
      // The 1-minute load average at the start and the end: this machine is shared, and the timings (tiny steps,
      // IndexedDB rates, planSeconds) stretch with the load; the plans' bytes do not.
      loadAverage: { start: LOAD_START, end: loadavg()[0] },
      tiny: { steps: STEPS, rows: tiny },
      sd15: { resolution: 512, latentShape: [4, 64, 64], contextShape: [77, 768], batch: 2, dtype: 'f16', budgetBytes: BUDGET, rows: sd15 },
      idb: 'error' in idb ? idb : { options: IDB, browser: idb.browser, rows: idb.rows, ratios: idbRatios },
      sdxl: sdxlSection(sdxl),
    },
    null,
    2,
  ),
);
console.log(`\nwrote ${out}`);
process.exit(0);
