// Issue 16, Must show 3 on the shipped demo model (public/demo-model, 64 px, stars held out of its pretraining):
// DreamBooth LoRA through the product's run pipeline (bench/quality-run.ts, the code bench:quality runs), with and
// without prior preservation, scored by src/train/quality.ts on samples of the same seeds before and after.
import assert from 'node:assert/strict';
import { dirname, join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { fileURLToPath } from 'node:url';
import type { Gpu } from '../../src/gpu/device.ts';
import type { LoadedModel } from '../../src/models/load.ts';
import { loadFeatureVae, qualityRun, qualitySettings, type QualitySettings } from '../../bench/quality-run.ts';
import { testGpu } from '../helpers.ts';

const MODEL = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'public', 'demo-model');

/** bench:quality --quick's LoRA run (rank 4, lr 1e-2, 100 steps; 8 class images for the prior), run seed 1. */
const LORA: QualitySettings = { ...qualitySettings('lora', true), prior: false, seed: 1 };

describe('DreamBooth quality on the shipped demo model', () => {
  let gpu: Gpu;
  let vae: LoadedModel['vae'];
  before(async () => {
    gpu = await testGpu();
    vae = await loadFeatureVae(gpu, MODEL);
  });
  after(() => gpu?.destroy());

  it('LoRA raises subject fidelity well above the base model, and prior preservation cuts the drift of the class prompt', async () => {
    const without = await qualityRun(gpu, MODEL, vae, LORA);
    const withPrior = await qualityRun(gpu, MODEL, vae, { ...LORA, prior: true });
    console.log(JSON.stringify({ without, withPrior }));
    // Measured (lavapipe, run seed 1, samples at seeds SAMPLE_SEED..): subject fidelity (cosine of the VAE encoder's
    // latents, samples vs photos) 0.235 before, 0.295 without prior, 0.354 with. The margin, 0.05, is a fifth of the
    // base model's figure and under the smaller rise (0.060); a run that learns nothing stays at 0.235 (the base
    // samples repeat exactly: same seeds). With samples at seeds 1000.. (bench:quality --quick --seeds 3,
    // bench/results/quality.json): 0.147 before; without prior 0.257 / 0.401 / 0.438 on run seeds 1-3, with prior
    // 0.380 / 0.072 / 0.455. Without prior the rise held on every seed; with prior it is a check of run seed 1.
    for (const [name, r] of [
      ['without prior', without],
      ['with prior', withPrior],
    ] as const)
      assert.ok(r.subject_fidelity_after > r.subject_fidelity_before + 0.05, `${name}: fidelity ${r.subject_fidelity_before} -> ${r.subject_fidelity_after}`);
    // Drift: "a star" samples, fine-tuned vs base, same seeds. Without prior preservation LoRA pulls the class toward
    // the subject; with it the stars stay closer. Run seed 1: VAE drift 0.970 -> 0.172 (0.18x), pixel drift 0.289 ->
    // 0.111 (0.38x). The samples' seeds are none of the class images' (SAMPLE_SEED): with samples at seeds 1000..,
    // run seed 1's first three class images were the very base samples drift compares against. Run seeds 2 and 3
    // (their class images at seeds 2000.. and 3000.., so not affected): VAE 0.670 -> 0.286, 0.761 -> 0.524; pixels
    // 0.272 -> 0.100, 0.280 -> 0.186 (ratios 0.37-0.69). Asserted on seed 1: below 0.7x, the bound every seed met.
    assert.ok(withPrior.drift < 0.7 * without.drift, `VAE drift with prior ${withPrior.drift}, without ${without.drift}`);
    assert.ok(withPrior.drift_pixels < 0.7 * without.drift_pixels, `pixel drift with prior ${withPrior.drift_pixels}, without ${without.drift_pixels}`);
  });
});
