// npm run bench:census — what one training step dispatches, without a GPU, and what it would cost on one (MODELLED).
//
// For SD 1.5 LoRA (rank 8) and full fine-tuning at 128 and 512 px, batch 1 and 2, the step DreamBoothTrainer runs is
// recorded on a recording WebGPU device under a named adapter profile (bench/census-record.ts, src/gpu/recording.ts:
// the engine's own kernel choices for that adapter, nothing executed, no weights). Each dispatch's work (FLOPs,
// k-steps, load groups, bytes) and modelled GPU time come from bench/costmodel.ts, calibrated on the one profiled
// H200 step (commit 2756811), whose kernel choices are recorded the same way from a worktree of that commit
// (bench/results/census-records/, committed). flops_useful is what a PyTorch step computes (bench/peers/
// torch_flops.py: the same UNet on the meta device, autograd's requires_grad pruning); needs /usr/bin/python3 with
// torch, else null.
//
// Flags: --profile nvidia-h200 (default) | local (this machine's adapter; nothing is modelled for it: the cost model
// knows only the H200), --cases lora-128-2,... (default all eight), --quick (lora-128-2 only), --at COMMIT (census a
// commit's kernel choices from a git worktree, written to census-<commit>.json), --out FILE, --rerecord (record the
// calibration commits again), --dispatches FILE (every folded dispatch with its work and modelled ms).
import { execFileSync } from 'node:child_process';
import { copyFileSync, existsSync, mkdirSync, readFileSync, symlinkSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { nodeGpu } from '../src/gpu/node.ts';
import { PROFILES, profileOf, type AdapterProfile } from '../src/gpu/profile.ts';
import { SUBGROUP_LANES } from '../src/gpu/tensorcore.ts';
import { TC_BK, TC_TILES, tcSharedBytes } from '../src/ops/gemm.ts';
import { parseCase, recordStep, type CensusCase, type StepRecord } from './census-record.ts';
import { calibrate, dispatchSeconds, FAMILIES, H200, measuredProfile, modelStep, workOf, type MeasuredProfile, type ModelParams } from './costmodel.ts';

const here = dirname(fileURLToPath(import.meta.url));
const root = join(here, '..');
const args = process.argv.slice(2);
const arg = (n: string) => (args.includes(n) ? args[args.indexOf(n) + 1] : undefined);
const ALL_CASES = ['lora-128-1', 'lora-128-2', 'lora-512-1', 'lora-512-2', 'full-128-1', 'full-128-2', 'full-512-1', 'full-512-2'];
const cases = args.includes('--quick') ? ['lora-128-2'] : (arg('--cases')?.split(',') ?? ALL_CASES);
cases.forEach(parseCase); // refuses a malformed case before any work
const atArg = arg('--at');
const profileName = arg('--profile') ?? 'nvidia-h200';
if (profileName !== 'local' && !PROFILES[profileName])
  throw new Error(`--profile: "${profileName}" is not local or one of ${Object.keys(PROFILES).join(', ')}`);
if (atArg && profileName === 'local') throw new Error('--at records in a worktree with a named profile; use --profile nvidia-h200');

/** The profiled H200 step (calibration) and the profile before its GPU tiles (held out: not fitted). */
const CALIBRATION = { commit: '2756811', case: 'lora-128-2', step: 1 };
const HELD_OUT = {
  commit: '3f5718f',
  note: "2756811's parent (CPU 8x8 tiles on the GPU), profiled on the same H200: bench/results/logs/step-nvidia-h200-before.log",
  families: { conv2d: 830.8, matmul: 438.5, attention: 24.8, other: 18.7 + 3.0 + 6.4 + 2.0 + 0.1 },
};
/** PyTorch on the H200 (bench/results/step-nvidia-h200.json, sd15-lora 128 px batch 2): f32 with TF32 off, and AMP. */
const TORCH_MEASURED = { case: 'lora-128-2', f32: 0.12334, amp: 0.12891, matmulFlops: 25.9004e12 };

// ---------------------------------------------------------------------------------------------- recording elsewhere

function git(...a: string[]): string {
  return execFileSync('git', a, { cwd: root, encoding: 'utf8' }).trim();
}

/** The commit --at names, resolved once (HEAD may move while the census runs). */
const at = atArg ? git('rev-parse', '--short', atArg) : undefined;

/**
 * Records `list` at `commit` from a git worktree (made once under /tmp): the census files are copied in (and, where
 * the commit's src/gpu/device.ts and allocator.ts are still the ones before GpuOptions.recording, those two with it,
 * so the run can be a dry run that encodes); older commits record with a plain Gpu on the recording device.
 */
function recordAt(commit: string, list: string[], step: number): StepRecord[] {
  const sha = git('rev-parse', '--short', commit);
  const dir = `/tmp/dbs-census-${sha}`;
  if (!existsSync(dir)) {
    git('worktree', 'add', '--detach', dir, sha);
    symlinkSync(join(root, 'node_modules'), join(dir, 'node_modules'));
  }
  for (const f of ['src/gpu/profile.ts', 'src/gpu/recording.ts', 'bench/census-record.ts']) copyFileSync(join(root, f), join(dir, f));
  const beforeRecording = 'c1c6df0'; // the census's first commit: device.ts and allocator.ts as at 2113c7d
  let dry = readFileSync(join(dir, 'src/gpu/device.ts'), 'utf8').includes('recording?: boolean');
  try {
    git('diff', '--quiet', sha, beforeRecording, '--', 'src/gpu/device.ts', 'src/gpu/allocator.ts');
    for (const f of ['src/gpu/device.ts', 'src/gpu/allocator.ts']) copyFileSync(join(root, f), join(dir, f));
    dry = true;
  } catch {
    // differs: that commit's own Gpu (with or without the option)
  }
  const out = `${dir}/census-records.json`;
  execFileSync(
    'npx',
    ['tsx', 'bench/census-record.ts', '--profile', 'nvidia-h200', '--cases', list.join(','), '--step', String(step), ...(dry ? ['--dry'] : []), '--out', out],
    {
      cwd: dir,
      stdio: ['ignore', 'inherit', 'inherit'],
    },
  );
  return JSON.parse(readFileSync(out, 'utf8')) as StepRecord[];
}

/** The committed record of a calibration commit's step (recorded again with --rerecord or when missing). */
function calibrationRecord(commit: string): StepRecord {
  const file = join(here, 'results', 'census-records', `${commit}-${CALIBRATION.case}-step${CALIBRATION.step}.json`);
  if (!existsSync(file) || args.includes('--rerecord')) {
    mkdirSync(dirname(file), { recursive: true });
    writeFileSync(file, JSON.stringify(recordAt(commit, [CALIBRATION.case], CALIBRATION.step)[0]));
  }
  return JSON.parse(readFileSync(file, 'utf8')) as StepRecord;
}

// ---------------------------------------------------------------------------------------------- PyTorch

/** flops_useful per case from bench/peers/torch_flops.py, or why there is none. */
function torchFlops(list: string[]): Record<string, number> | { missing: string } {
  const python = process.env.PYTHON ?? '/usr/bin/python3';
  try {
    const out = execFileSync(python, [join(here, 'peers', 'torch_flops.py'), '--cases', list.join(',')], {
      encoding: 'utf8',
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    const j = JSON.parse(out.trim().split('\n').pop()!) as Record<string, { flops: number }>;
    return Object.fromEntries(list.map((c) => [c, j[c].flops]));
  } catch (e) {
    const err = e as { stderr?: string; message: string };
    return { missing: `no PyTorch FLOP count: ${(err.stderr ?? err.message).trim().split('\n').pop()}` };
  }
}

/** PyTorch eager seconds per step: measured where the H200 ran it, else MODELLED (see torch_basis). */
function torchStep(name: string, useful: number | null): { s: number | null; basis: string } {
  if (name === TORCH_MEASURED.case)
    return {
      s: TORCH_MEASURED.f32,
      basis: `measured: PyTorch f32 (TF32 off) on the H200, bench/results/step-nvidia-h200.json (AMP fp16: ${TORCH_MEASURED.amp} s)`,
    };
  if (useful === null) return { s: null, basis: 'none: no flops_useful to model it from' };
  const computeS = useful / TORCH_MEASURED.matmulFlops;
  const s = Math.max(TORCH_MEASURED.f32, computeS);
  return {
    s,
    basis: `modelled: max(${TORCH_MEASURED.f32} s, the measured 128 px batch-2 f32 step, bound by launches on the host; flops_useful / 25.9 TFLOP/s, the peer's measured f32 cuBLAS rate on the H200 = ${computeS.toFixed(4)} s)`,
  };
}

// ---------------------------------------------------------------------------------------------- the sheet

/** Item 3's static sheet: each tensor-core tile's workgroup bytes, accumulators, barriers and global bytes per MMA. */
function tileSheet(): string[] {
  const s = { M: 16, N: 16, K: 16 }; // the H200's f16 x f16 -> f32 shape
  const lines = ['tensor-core tiles (src/ops/gemm.ts, 16x16x16 f16 -> f32 fragments; static):'];
  lines.push('  tile        threads  wg bytes (<= 48 KiB)  accumulators/subgroup  barriers/k-step  epilogue barriers  global bytes/MMA');
  for (const t of TC_TILES) {
    const fm = t.BM / (t.SGM * s.M);
    const fn = t.BN / (t.SGN * s.N);
    const mmasPerStep = (t.BM / s.M) * (t.BN / s.N) * (TC_BK / s.K);
    const globalBytes = 2 * (t.BM + t.BN) * TC_BK; // f16 A and B tiles staged per k-step
    const bytes = tcSharedBytes(t, s);
    lines.push(
      `  ${`${t.BM}x${t.BN}`.padEnd(10)}  ${String(SUBGROUP_LANES * t.SGM * t.SGN).padStart(7)}  ${`${bytes}${bytes > 48 * 1024 ? ' OVER' : ''}`.padStart(20)}  ${String(fm * fn).padStart(21)}  ${'2'.padStart(15)}  ${String(2 * fm * fn).padStart(17)}  ${(globalBytes / mmasPerStep).toFixed(0).padStart(16)}`,
    );
  }
  return lines;
}

// ---------------------------------------------------------------------------------------------- main

const round = (x: number, d = 3) => Math.round(x * 10 ** d) / 10 ** d;

async function profileFor(): Promise<AdapterProfile> {
  if (profileName !== 'local') return PROFILES[profileName];
  const gpu = await nodeGpu();
  const p = profileOf(gpu);
  gpu.destroy();
  return p;
}

const profile = await profileFor();
const modelled = profile.name === 'nvidia-h200';

// calibration: the 2756811 record against its profile; the held-out profile checks it
const measured: MeasuredProfile = measuredProfile(JSON.parse(readFileSync(join(here, 'results', 'step-nvidia-h200.json'), 'utf8')), CALIBRATION.commit);
const fit = calibrate(H200, [{ kernels: calibrationRecord(CALIBRATION.commit).kernels, measured }]);
const params: ModelParams = fit.params;
const heldOut = modelStep(H200, params, calibrationRecord(HELD_OUT.commit).kernels);

// the cases
const records: StepRecord[] = at ? recordAt(at, cases, 2) : [];
if (!at) for (const c of cases) records.push(await recordStep(profile, parseCase(c), 2, { dry: true }));
const useful = torchFlops(cases);
const dispatchDump: Record<string, unknown[]> = {};
const rows = records.map((r, i) => {
  const name = cases[i];
  const c: CensusCase = r.case;
  const step = modelStep(H200, params, r.kernels);
  const flopsUseful = 'missing' in useful ? null : useful[name];
  const gpuMs = modelled ? step.gpuMs : null;
  const hostMs = modelled ? step.dispatches * params.hostPerDispatchS * 1000 : null;
  const stepS = gpuMs !== null && hostMs !== null ? (hostMs + gpuMs * params.warmOverProfiled) / 1000 : null;
  const torch = torchStep(name, flopsUseful);
  dispatchDump[name] = r.kernels.map((d) => {
    const w = workOf(d);
    return {
      kernel: w.kernel,
      defs: d.defs,
      workgroups: d.workgroups,
      threads: w.threads,
      k_steps: w.kSteps,
      load_groups: w.loadGroups,
      flops: w.flops,
      bytes_read: w.bytesRead,
      bytes_written: w.bytesWritten,
      count: d.count,
      modelled_ms: modelled ? round(dispatchSeconds(H200, params, w).s * 1000, 4) : null,
    };
  });
  return {
    name: `sd15-${c.mode}-${c.resolution}px-b${c.batch}`,
    mode: c.mode,
    resolution: c.resolution,
    batch: c.batch,
    dispatches: step.dispatches,
    flops_executed: step.flops,
    flops_useful: flopsUseful,
    modelled_gpu_ms: gpuMs === null ? null : round(gpuMs, 1),
    modelled_host_ms: hostMs === null ? null : round(hostMs, 1),
    modelled_step_s: stepS === null ? null : round(stepS, 4),
    torch_step_s: torch.s === null ? null : round(torch.s, 5),
    torch_basis: torch.basis,
    ratio_modelled: stepS !== null && torch.s !== null ? round(stepS / torch.s, 2) : null,
    _families: step.byFamily,
  };
});

const commit = at
  ? git('rev-parse', '--short', at)
  : `${git('rev-parse', '--short', 'HEAD')}${git('status', '--porcelain', '--untracked-files=no') ? '+dirty' : ''}`;
const calibration = {
  commit: CALIBRATION.commit,
  families: Object.fromEntries(
    FAMILIES.map((f) => [f, { measured_ms: round(measured.families[f].ms, 1), modelled_ms: round(fit.steps[0].byFamily[f].ms, 1) }]),
  ),
  params: {
    load_latency_us: round(params.loadLatencyS * 1e6, 3),
    step_latency_us: round(params.stepLatencyS * 1e6, 3),
    floor_us: round(params.floorS * 1e6, 2),
    array_fma_cycles: params.arrayFmaCycles,
    host_us_per_dispatch: round(params.hostPerDispatchS * 1e6, 2),
    warm_over_profiled: round(params.warmOverProfiled, 4),
    hardware: H200,
    method:
      "Every modelled figure is MODELLED, none measured. Per dispatch: floor + max(waves x k-steps x serialised load groups x load latency (+ serial FMAs / clock, x array_fma_cycles for kernels whose arrays sit in local memory), FLOPs / the family's isolated rate, bytes bound / bandwidth). Fitted on the H200 profile of commit 2756811 (the profiled first step of sd15-lora 128 px batch 2: each dispatch in its own timestamped pass), whose kernel choices were recorded by running the census instrument from a worktree of 2756811 (bench/results/census-records/; it reproduces that profile's 3587 dispatches and per-family counts exactly): floor on 'other', load latency on conv2d and matmul, array_fma_cycles on attention. In-sample fit. host ms = dispatches x host_us_per_dispatch (101.5 ms / 3587 measured); step s = (host + GPU x warm_over_profiled) / 1000, warm_over_profiled = the warm step's 408.6 ms GPU wait over the profile's 896.2 ms.",
    held_out: {
      commit: HELD_OUT.commit,
      note: HELD_OUT.note,
      families: Object.fromEntries(FAMILIES.map((f) => [f, { measured_ms: HELD_OUT.families[f], modelled_ms: round(heldOut.byFamily[f].ms, 1) }])),
    },
    census: {
      profile: profile.name,
      profile_source: profile.source,
      commit,
      step: 2,
      cases_recorded_as: at ? `a worktree of ${at}` : 'the working tree, a dry run that encodes (GpuOptions.recording)',
    },
  },
};
// census.json is the full H200 census; --at, --quick, --cases and other profiles write beside it
const partial = args.includes('--quick') || args.includes('--cases');
const out =
  arg('--out') ??
  join(
    here,
    'results',
    at ? `census-${commit}.json` : profile.name !== 'nvidia-h200' ? `census-${profile.name}.json` : partial ? 'census-partial.json' : 'census.json',
  );
mkdirSync(dirname(out), { recursive: true });
writeFileSync(out, `${JSON.stringify({ calibration, cases: rows.map(({ _families, ...r }) => r) }, null, 2)}\n`);
if (arg('--dispatches')) writeFileSync(arg('--dispatches')!, JSON.stringify(dispatchDump));

// ---------------------------------------------------------------------------------------------- report

const pct = (a: number, b: number) => `${a >= b ? '+' : ''}${((100 * a) / b - 100).toFixed(1)} %`;
console.log(`census of ${commit} under the ${profile.name} profile (${profile.source})`);
console.log(`calibration on ${CALIBRATION.commit} (MODELLED vs measured GPU ms; worst ${(100 * fit.worst).toFixed(1)} %):`);
for (const f of FAMILIES)
  console.log(
    `  ${f.padEnd(9)} ${fit.steps[0].byFamily[f].ms.toFixed(1).padStart(7)} vs ${measured.families[f].ms.toFixed(1).padStart(7)}  ${pct(fit.steps[0].byFamily[f].ms, measured.families[f].ms)}`,
  );
console.log(`held out, ${HELD_OUT.commit} (not fitted):`);
for (const f of FAMILIES)
  console.log(
    `  ${f.padEnd(9)} ${heldOut.byFamily[f].ms.toFixed(1).padStart(7)} vs ${HELD_OUT.families[f].toFixed(1).padStart(7)}  ${pct(heldOut.byFamily[f].ms, HELD_OUT.families[f])}`,
  );
console.log(`params: ${JSON.stringify(calibration.params, (k, v) => (['hardware', 'method', 'held_out', 'census'].includes(k) ? undefined : v))}`);
console.log('\ncase                     dispatches  GFLOP exec  GFLOP useful  GPU ms*  host ms*  step s*  torch s  ratio*  (* MODELLED)');
for (const r of rows) {
  const g = (x: number | null) => (x === null ? '-' : (x / 1e9).toFixed(1));
  console.log(
    `${r.name.padEnd(24)} ${String(r.dispatches).padStart(10)}  ${g(r.flops_executed).padStart(10)}  ${g(r.flops_useful).padStart(12)}  ${String(r.modelled_gpu_ms ?? '-').padStart(7)}  ${String(r.modelled_host_ms ?? '-').padStart(8)}  ${String(r.modelled_step_s ?? '-').padStart(7)}  ${String(r.torch_step_s ?? '-').padStart(7)}  ${String(r.ratio_modelled ?? '-').padStart(6)}`,
  );
  if (modelled) console.log(`    GPU ms by family*: ${FAMILIES.map((f) => `${f} ${r._families[f].ms.toFixed(1)} (${r._families[f].dispatches})`).join(', ')}`);
}
if ('missing' in useful) console.log(`flops_useful: ${useful.missing}`);
console.log(`\n${tileSheet().join('\n')}`);
console.log(`\nwrote ${out}`);
process.exit(0);
