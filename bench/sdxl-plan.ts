// npx tsx bench/sdxl-plan.ts [--budget-gib 7.5] [--int8-budget-gib 6] [--only f16|int8|auto] — the training
// planner's placement for SDXL LoRA (issue 47 items 4 and 7): SDXL base 1.0's shapes (src/models/sdxl.ts SDXL_BASE:
// UNet 2.57 B parameters; frozen base weights f16, or int8 with per-channel scales, src/ops/int8.ts), 1024 px
// (128 x 128 latents), 77 tokens of both encoders' context (2048 wide), pooled embedding and time ids, batch 1, LoRA
// rank 16 (alpha 16) on the UNet's attention projections, fp32 AdamW. planTraining dry-runs the real trainer on
// a dry-run Gpu (every allocation counted, nothing computed), so the planned peak is the real step's. Rows: f16
// base under the budget (default 7.5 GiB, issue 47's f16 target) and under 24 GiB (the fastest placement); int8
// base under 6 GiB (issue 47's int8 target); 'auto' (planBaseWeights) under 6 GiB, saying which it chose; each with peak by
// allocator tag, the optimizer's store traffic per step and the planner's wall time. Writes
// bench/results/sdxl-plan.json. Modelled nothing: these are the dry-run allocator's counts.
import { mkdirSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { nodeGpu } from '../src/gpu/node.ts';
import { SDXL_BASE } from '../src/models/sdxl.ts';
import { TRAIN_DEFAULTS } from '../src/pipeline/settings.ts';
import { planBaseWeights, storeBytesPerStep, type BaseWeights } from '../src/train/plan.ts';

const here = dirname(fileURLToPath(import.meta.url));
const args = process.argv.slice(2);
const GiB = 2 ** 30;
const arg = (name: string) => (args.includes(name) ? args[args.indexOf(name) + 1] : undefined);
const budgetArg = Number(arg('--budget-gib') ?? 7.5);
const int8Budget = Number(arg('--int8-budget-gib') ?? 6);
const only = arg('--only');
const gib = (n: number) => `${(n / GiB).toFixed(2)} GiB`;

const settings = { ...TRAIN_DEFAULTS.lora, rank: 16, alpha: 16, textEncoderLora: false };
const rows = [];
const cases: [BaseWeights | 'auto', number][] = [
  ['f16', budgetArg * GiB],
  ['f16', 24 * GiB],
  ['int8', int8Budget * GiB],
  ['auto', int8Budget * GiB],
];
for (const [base, budget] of cases.filter(([b]) => !only || b === only)) {
  const t0 = performance.now();
  const plan = await planBaseWeights(
    () => nodeGpu({ dryRun: true }),
    { config: SDXL_BASE.unet, dtype: 'f16', name: 'SDXL base' },
    { latentShape: [4, 128, 128], contextShape: [77, 2048], withClass: false, vaeFactor: 8 },
    settings,
    budget,
    base,
  );
  const planSeconds = (performance.now() - t0) / 1000;
  const row = {
    case: `SDXL LoRA rank 16, 1024 px, batch 1, ${base} base weights`,
    baseWeights: plan.baseWeights,
    baseWeightsReason: plan.baseWeightsReason,
    budgetBytes: budget,
    fits: plan.fits,
    peakBytes: plan.peakBytes,
    peakByTag: plan.peakByTag,
    activationCheckpointing: plan.activationCheckpointing,
    residentChunks: plan.residentChunks,
    chunks: plan.chunks,
    store_bytes_per_step: storeBytesPerStep(plan),
    tried: plan.tried,
    planSeconds,
    ...(plan.message ? { message: plan.message } : {}),
  };
  rows.push(row);
  const tags = Object.entries(plan.peakByTag)
    .map(([t, v]) => `${t} ${gib(v)}`)
    .join(', ');
  console.log(
    `${base} base, budget ${gib(budget)}: ${plan.baseWeights} (${plan.baseWeightsReason}), ${plan.fits ? 'fits' : 'does not fit'}, peak ${gib(plan.peakBytes)} (${tags}); checkpointing ${plan.activationCheckpointing}, ${plan.residentChunks}/${plan.chunks} chunks resident, store ${(storeBytesPerStep(plan) / 1e6).toFixed(0)} MB/step; planned in ${planSeconds.toFixed(1)} s`,
  );
}
mkdirSync(join(here, 'results'), { recursive: true });
writeFileSync(join(here, 'results', only ? `sdxl-plan-${only}.json` : 'sdxl-plan.json'), JSON.stringify({ date: new Date().toISOString(), rows }, null, 2));
