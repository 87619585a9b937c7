// bash scripts/gpu-env.sh npx tsx bench/fused.ts [budget GiB, default 4] — fused optimizer updates
// (TrainSettings.fusedUpdates) against the unfused step for full SD 1.5 at 512 px (prior preservation, batch 2),
// 8-bit moments + compact master, as the planner sees them: planTraining's dry runs of the real trainer on a
// dry-run Gpu (nothing backed or computed). Prints, for each, the chosen placement, its peak, the peak of each
// allocator tag and the store bytes per step; writes bench/results/fused.json.
import { mkdirSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { nodeGpu } from '../src/gpu/node.ts';
import { SD15 } from '../src/models/shapes.ts';
import { planTraining } from '../src/train/plan.ts';
import { TRAIN_DEFAULTS } from '../src/pipeline/settings.ts';

const here = dirname(fileURLToPath(import.meta.url));
const GiB = 2 ** 30;
const budgetGiB = Number(process.argv[2] ?? 4);
if (!(budgetGiB > 0)) throw new Error(`the budget (first argument, GiB) must be a positive number, got ${process.argv[2]}`);

const rows = [];
for (const fusedUpdates of [false, true]) {
  const settings = { ...TRAIN_DEFAULTS.full, optimizer: 'adamw8bit' as const, master: 'compact' as const, fusedUpdates };
  const t0 = performance.now();
  const p = await planTraining(
    () => nodeGpu({ dryRun: true }),
    { config: SD15.unet, dtype: 'f16', name: 'SD 1.5' },
    { latentShape: [4, 64, 64], contextShape: [77, 768], withClass: true },
    settings,
    budgetGiB * GiB,
    'never', // the unfused row is the baseline; fused rows ask for fusing themselves
  );
  const row = {
    fused_updates: fusedUpdates,
    budget_bytes: budgetGiB * GiB,
    fits: p.fits,
    peak_bytes: p.peakBytes,
    activation_checkpointing: p.activationCheckpointing,
    resident_chunks: p.residentChunks,
    chunks: p.chunks,
    store_read_bytes_per_step: p.storeReadBytesPerStep,
    store_write_bytes_per_step: p.storeWriteBytesPerStep,
    peak_by_tag: p.peakByTag,
    plan_seconds: (performance.now() - t0) / 1000,
  };
  rows.push(row);
  console.log(
    `${fusedUpdates ? 'fused  ' : 'unfused'}: peak ${(p.peakBytes / GiB).toFixed(3)} GiB of ${budgetGiB}, checkpointing ${p.activationCheckpointing ? 'on' : 'off'}, ` +
      `${p.residentChunks}/${p.chunks} chunks resident, store ${(p.storeReadBytesPerStep / 1e9).toFixed(2)} GB read + ${(p.storeWriteBytesPerStep / 1e9).toFixed(2)} GB written per step, ` +
      `gradients ${(p.peakByTag.gradients / GiB).toFixed(3)} GiB (planned in ${row.plan_seconds.toFixed(1)} s)`,
  );
}
mkdirSync(join(here, 'results'), { recursive: true });
writeFileSync(join(here, 'results', 'fused.json'), JSON.stringify({ model: 'SD 1.5 full, 512 px, batch 2, adamw8bit + compact', rows }, null, 2) + '\n');
