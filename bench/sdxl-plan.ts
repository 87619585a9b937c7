// npx tsx bench/sdxl-plan.ts [--budget-gib 7.5] [--int8-budget-gib 6] [--only f16|int8|auto] — the training
// planner's placement for SDXL LoRA (issue 47 items 4 and 7): SDXL base 1.0's shapes (src/models/sdxl.ts SDXL_BASE:
// UNet 2.57 B parameters; frozen base weights f16, or int8 with per-channel scales, src/ops/int8.ts), 1024 px
// (128 x 128 latents), 77 tokens of both encoders' context (2048 wide), pooled embedding and time ids, batch 1, LoRA
// rank 16 (alpha 16) on the UNet's attention projections, fp32 AdamW. planTraining dry-runs the real trainer on
// a dry-run Gpu (every allocation counted, nothing computed), so the planned peak is the real step's. Rows: f16
// base under the budget (default 7.5 GiB, issue 47's f16 target) and under 24 GiB (the fastest placement); int8
// base under 6 GiB (issue 47's int8 target); 'auto' (planBaseWeights) under 6 GiB, saying which it chose; each with peak by
// allocator tag, the optimizer's store traffic per step and the planner's wall time (bench/sdxl-rows.ts, shared with
// bench:train and bench:memory). Writes
// bench/results/sdxl-plan.json. Modelled nothing: these are the dry-run allocator's counts.
import { mkdirSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { BaseWeights } from '../src/train/plan.ts';
import { sdxlPlanRows } from './sdxl-rows.ts';

const here = dirname(fileURLToPath(import.meta.url));
const args = process.argv.slice(2);
const GiB = 2 ** 30;
const arg = (name: string) => (args.includes(name) ? args[args.indexOf(name) + 1] : undefined);
const budgetArg = Number(arg('--budget-gib') ?? 7.5);
const int8Budget = Number(arg('--int8-budget-gib') ?? 6);
const only = arg('--only');

const cases: [BaseWeights | 'auto', number][] = [
  ['f16', budgetArg * GiB],
  ['f16', 24 * GiB],
  ['int8', int8Budget * GiB],
  ['auto', int8Budget * GiB],
];
const rows = await sdxlPlanRows(cases.filter(([b]) => !only || b === only));
mkdirSync(join(here, 'results'), { recursive: true });
writeFileSync(join(here, 'results', only ? `sdxl-plan-${only}.json` : 'sdxl-plan.json'), JSON.stringify({ date: new Date().toISOString(), rows }, null, 2));
