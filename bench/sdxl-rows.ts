// SDXL LoRA training rows for bench:train, bench:memory and bench:sdxl-plan (issue 47 items 4 and 7): the training
// planner's placement for SDXL base 1.0's shapes (src/models/sdxl.ts SDXL_BASE: UNet 2.57 B parameters), 1024 px
// (128 x 128 latents), 77 tokens of both encoders' context (2048 wide), pooled embedding and time ids, batch 1,
// LoRA rank 16 (alpha 16) on the UNet's attention projections, fp32 AdamW; frozen base weights f16, or int8 with
// per-output-channel scales (src/ops/int8.ts), or 'auto' (planBaseWeights chooses and says why). planTraining
// dry-runs the real trainer on a dry-run Gpu (every allocation counted, nothing computed), so a row's peak is the
// real step's planned peak: a dry-run plan, not a measurement on a GPU.
import { nodeGpu } from '../src/gpu/node.ts';
import { SDXL_BASE } from '../src/models/sdxl.ts';
import { TRAIN_DEFAULTS } from '../src/pipeline/settings.ts';
import { planBaseWeights, storeBytesPerStep, type BaseWeights } from '../src/train/plan.ts';

const GiB = 2 ** 30;
const gib = (n: number) => `${(n / GiB).toFixed(2)} GiB`;

export interface SdxlPlanRow {
  case: string;
  baseWeights: BaseWeights;
  baseWeightsReason: string;
  budgetBytes: number;
  fits: boolean;
  peakBytes: number;
  peakByTag: Record<string, number>;
  activationCheckpointing: boolean;
  residentChunks: number;
  chunks: number;
  /** Optimizer bytes read from plus written to the store per applied step with the chosen placement. */
  store_bytes_per_step: number;
  tried: unknown[];
  /** Wall time of the planner (all its dry runs). */
  planSeconds: number;
  message?: string;
}

/** The cases: f16 base under 7.5 GiB (its f16 target), int8 base under 6 GiB (its int8 target). */
export const SDXL_CASES: [BaseWeights | 'auto', number][] = [
  ['f16', 7.5 * GiB],
  ['int8', 6 * GiB],
];

/** Plans SDXL LoRA at 1024 px for each [base weights, budget] case, logging one line per row. */
export async function sdxlPlanRows(cases: [BaseWeights | 'auto', number][] = SDXL_CASES): Promise<SdxlPlanRow[]> {
  const settings = { ...TRAIN_DEFAULTS.lora, rank: 16, alpha: 16, textEncoderLora: false };
  const rows: SdxlPlanRow[] = [];
  for (const [base, budget] of cases) {
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
    const row: SdxlPlanRow = {
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
      `  ${base} base, budget ${gib(budget)}: ${plan.baseWeights} (${plan.baseWeightsReason}), ${plan.fits ? 'fits' : 'does not fit'}, planned peak ${gib(plan.peakBytes)} (${tags}); checkpointing ${plan.activationCheckpointing}, ${plan.residentChunks}/${plan.chunks} chunks resident, store ${(row.store_bytes_per_step / 1e6).toFixed(0)} MB/step; planned in ${planSeconds.toFixed(1)} s`,
    );
  }
  return rows;
}
