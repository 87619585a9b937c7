// The measured-vs-modelled table of scripts/device-bench.sh: a profiled step measured on a GPU (bench/step.ts's JSON,
// sd15-lora at 128 px) beside what bench/results/census.json modelled for it, and the cost model recalibrated on the
// new measurement (the step's own dispatches recorded again here on the H200 profile: no GPU work). Writes --out.
// Usage: npx tsx bench/census-compare.ts --step bench/results/step-128-simt.json [--label simt] [--out FILE]
import { readFileSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { NVIDIA_H200 } from '../src/gpu/profile.ts';
import { recordStep } from './census-record.ts';
import { calibrate, FAMILIES, H200, measuredProfile, modelStep, type ModelParams } from './costmodel.ts';

const here = dirname(fileURLToPath(import.meta.url));
const args = process.argv.slice(2);
const arg = (n: string) => (args.includes(n) ? args[args.indexOf(n) + 1] : undefined);
const stepFile = arg('--step');
if (!stepFile) throw new Error('--step FILE: a bench/step.ts result with a profiled sd15-lora case is required');
const measured = measuredProfile(JSON.parse(readFileSync(stepFile, 'utf8')), arg('--label') ?? 'measured');
const census = JSON.parse(readFileSync(join(here, 'results', 'census.json'), 'utf8')) as { calibration: { params: Record<string, number> } };
const cp = census.calibration.params;
const committed: ModelParams = {
  loadLatencyS: cp.load_latency_us / 1e6,
  stepLatencyS: cp.step_latency_us / 1e6,
  floorS: cp.floor_us / 1e6,
  arrayFmaCycles: cp.array_fma_cycles,
  hostPerDispatchS: cp.host_us_per_dispatch / 1e6,
  warmOverProfiled: cp.warm_over_profiled,
};
// The profiled step is the run's first (bench/step.ts profiles its warm-up).
const record = await recordStep(NVIDIA_H200, { mode: 'lora', resolution: 128, batch: 2 }, 1, { dry: true });
const before = modelStep(H200, committed, record.kernels);
const refit = calibrate(H200, [{ kernels: record.kernels, measured }]);
const table = FAMILIES.map((f) => ({
  family: f,
  measured_ms: measured.families[f].ms,
  measured_dispatches: measured.families[f].dispatches,
  census_dispatches: before.byFamily[f].dispatches,
  modelled_ms_committed_params: Math.round(before.byFamily[f].ms * 10) / 10,
  modelled_ms_recalibrated: Math.round(refit.steps[0].byFamily[f].ms * 10) / 10,
}));
const stepModelled = (p: ModelParams, gpuMs: number) => (before.dispatches * p.hostPerDispatchS * 1000 + gpuMs * p.warmOverProfiled) / 1000;
console.log(`measured (${stepFile}) vs MODELLED, sd15-lora 128 px batch 2:`);
console.log('family      measured ms  dispatches (measured/census)  modelled ms (census.json params)  modelled ms (recalibrated)');
for (const r of table)
  console.log(
    `${r.family.padEnd(10)} ${r.measured_ms.toFixed(1).padStart(12)}  ${`${r.measured_dispatches}/${r.census_dispatches}`.padStart(28)}  ${r.modelled_ms_committed_params.toFixed(1).padStart(32)}  ${r.modelled_ms_recalibrated.toFixed(1).padStart(26)}`,
  );
console.log(`step s: measured ${measured.stepS}, modelled ${stepModelled(committed, before.gpuMs).toFixed(4)} (census.json params)`);
console.log(`recalibrated params: ${JSON.stringify(refit.params)}`);
const out = arg('--out') ?? join(here, 'results', 'census-measured.json');
writeFileSync(
  out,
  `${JSON.stringify({ step_file: stepFile, measured_step_s: measured.stepS, modelled_step_s: stepModelled(committed, before.gpuMs), table, recalibrated: refit.params }, null, 2)}\n`,
);
console.log(`wrote ${out}`);
process.exit(0);
