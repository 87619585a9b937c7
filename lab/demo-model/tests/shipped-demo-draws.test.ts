// The shipped demo model (public/demo-model/) draws what its caption says: sampled through the product's own
// txt2img at the model's 64 px, every pixel sorted to the nearest of the generator's 12 colours
// (lab/demo-model/synthetic.ts COLOURS), the colour a prompt names covers far more of the picture than it does when
// the prompt names another colour. A random or caption-blind model fails it: its pictures do not change with
// the colour word (the first pretraining runs, caption-blind, drew the same picture for every prompt). And the
// shape word sets the object's size as in the generator's pictures. The same checks run on the factor-4 model
// that is not shipped yet (lab/demo-model/models/pretrain-small-f4), plus its outline: a triangle fills far less of its
// enclosing disc than a circle, as the generator draws them (the shipped factor-8 model draws blobs and fails that).
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { before, describe, it } from 'node:test';
import { fileURLToPath } from 'node:url';
import type { Gpu } from '../../../src/gpu/device.ts';
import { loadTokenizer } from '../../../src/cli/sample.ts';
import { loadDiffusers, type LoadedModel } from '../../../src/models/load.ts';
import { nodeFolder } from '../../../src/models/folder-node.ts';
import { scheduleFromJson, SD_SCHEDULE } from '../../../src/sample/schedulers.ts';
import { txt2img } from '../../../src/sample/txt2img.ts';
import { CHECK_SAMPLING, discFill, largestColourRegion } from '../quality.ts';
import { COLOUR_NAMES, COLOURS, type ColourName } from '../synthetic.ts';
import { testGpu } from '../../../tests/helpers.ts';

const ROOT = join(dirname(fileURLToPath(import.meta.url)), '..', '..', '..');
const SEEDS = [1, 2, 3];
const TESTED: ColourName[] = ['red', 'green', 'blue', 'yellow'];

/** Share of the picture's pixels whose nearest generator colour is each of COLOUR_NAMES. */
function colourShares(rgb: Uint8Array): Map<ColourName, number> {
  const shares = new Map<ColourName, number>(COLOUR_NAMES.map((c) => [c, 0]));
  const n = rgb.length / 3;
  for (let p = 0; p < n; p++) {
    let best: ColourName = COLOUR_NAMES[0];
    let bestD = Infinity;
    for (const c of COLOUR_NAMES) {
      const [r, g, b] = COLOURS[c];
      const d = (rgb[3 * p] - r) ** 2 + (rgb[3 * p + 1] - g) ** 2 + (rgb[3 * p + 2] - b) ** 2;
      if (d < bestD) [best, bestD] = [c, d];
    }
    shares.set(best, shares.get(best)! + 1 / n);
  }
  return shares;
}

/** What one model measured (in the comments below) and whether its outline is checked. */
interface Drawn {
  name: string;
  dir: string;
  outline: boolean;
}

const MODELS: Drawn[] = [
  // The studio's demo model: factor-8 VAE, UNet step 6000.
  { name: 'the shipped demo model (public/demo-model)', dir: join(ROOT, 'public', 'demo-model'), outline: false },
  // The factor-4 model, UNet step 16700 (trained on past the shipped one, on the lent H200, then with --bare-share).
  { name: 'the factor-4 model (lab/demo-model/models/pretrain-small-f4)', dir: join(ROOT, 'lab', 'demo-model', 'models', 'pretrain-small-f4'), outline: true },
];

for (const { name, dir: MODEL, outline } of MODELS)
  describe(`${name} draws what its caption says`, () => {
    let gpu: Gpu;
    let model: LoadedModel;
    let sample: (prompt: string, seed: number) => Promise<Uint8Array>;
    let draw: (prompt: string) => Promise<Map<ColourName, number>>;
    let side: number;
    before(async () => {
      gpu = await testGpu();
      model = await loadDiffusers(gpu, nodeFolder(MODEL), { dtype: gpu.computeDType });
      const tokenizer = loadTokenizer(join(MODEL, 'tokenizer'));
      const schedule = {
        ...SD_SCHEDULE,
        ...scheduleFromJson(JSON.parse(readFileSync(join(MODEL, 'scheduler', 'scheduler_config.json'), 'utf8')), model.prediction),
      };
      side = (JSON.parse(readFileSync(join(MODEL, 'vae', 'config.json'), 'utf8')) as { sample_size: number }).sample_size;
      // Each picture drawn once (the size and outline checks read the same samples).
      const drawn = new Map<string, Uint8Array>();
      sample = async (prompt, seed) => {
        const key = `${seed} ${prompt}`;
        if (!drawn.has(key))
          drawn.set(key, (await txt2img(gpu, model, tokenizer, { ...CHECK_SAMPLING, prompt, seed, width: side, height: side, schedule })).rgb);
        return drawn.get(key)!;
      };
      // Mean colour shares over SEEDS (the same seeds for every prompt, so only the words differ).
      draw = async (prompt) => {
        const mean = new Map<ColourName, number>(COLOUR_NAMES.map((c) => [c, 0]));
        for (const seed of SEEDS) for (const [c, s] of colourShares(await sample(prompt, seed))) mean.set(c, mean.get(c)! + s / SEEDS.length);
        return mean;
      };
    });
    // The device is the file's shared one (tests/helpers.ts closes it after the last describe).

    // Thresholds: about half of what the shipped model measured (in the comment; README "The demo model").
    for (const [what, prompt, colours, minShare, minRatio] of [
      // Measured: own share 0.70-0.98 (shipped, step 6000) and 0.88-0.90 (factor 4, step 16700; 0.90-0.91 at 15200),
      // none under another colour's prompt.
      ['background', (c: string) => `a white circle on a ${c} background`, TESTED, 0.4, 5],
      // Objects are not asserted: on a named background they are blobs of roughly a fifth of the picture whose colour
      // is near the named one (a red circle on blue comes out red-orange) but not reliably nearest to it.
    ] as const)
      it(`the ${what} colour follows the caption ("${prompt('<colour>')}": ${colours.join(', ')})`, async () => {
        const shares = new Map<ColourName, Map<ColourName, number>>();
        for (const c of colours) shares.set(c, await draw(prompt(c)));
        for (const c of colours) {
          const own = shares.get(c)!.get(c)!;
          // The same colour's share when the prompt names each other tested colour instead.
          const others = colours.filter((o) => o !== c).map((o) => shares.get(o)!.get(c)!);
          const table = colours.map((o) => `${o}: ${shares.get(o)!.get(c)!.toFixed(3)}`).join(', ');
          console.log(`${c} share by prompt colour: ${table}`);
          assert.ok(own >= minShare, `"${prompt(c)}" covers only ${own.toFixed(3)} of the picture in ${c} (at least ${minShare}); by prompt colour ${table}`);
          assert.ok(
            own >= minRatio * Math.max(...others, 0.01),
            `"${prompt(c)}": ${c} covers ${own.toFixed(3)}, not ${minRatio}x its share under other colours (${table})`,
          );
        }
      });

    /** The largest green region of "a large green <shape> on a white background" at each of SEEDS. */
    const greenRegions = async (shape: string) => {
      const regions: number[][] = [];
      for (const seed of SEEDS) regions.push(largestColourRegion(await sample(`a large green ${shape} on a white background`, seed), side, 'green'));
      return regions;
    };
    const mean = (xs: number[]) => xs.reduce((a, b) => a + b, 0) / xs.length;

    // The shape word sets how much of the picture the object covers, as it does in the generator's pictures: a large
    // circle (840 px at 64 px) covers 2.5x a large triangle (336 px). The object is the largest region of pixels
    // nearest the named colour (lab/demo-model/quality.ts largestColourRegion). A caption-blind model, or one that draws
    // every shape alike, gives a ratio near 1.
    it('the shape word sets the object\'s size as in the generator\'s pictures ("a large green circle" vs "a large green triangle" on white)', async () => {
      const circle = (await greenRegions('circle')).map((r) => r.length);
      const triangle = (await greenRegions('triangle')).map((r) => r.length);
      console.log(`green region (px) by seed: circle ${circle.join(', ')}; triangle ${triangle.join(', ')}`);
      // Measured: shipped (step 6000) circle 755 / 746 / 808 px, triangle 291 / 237 / 261 (2.9x on the means); factor 4
      // (step 16700) circle 1003 / 1009 / 947, triangle 337 / 356 / 369 (2.8x; the generator's 840 and 336). Asserted:
      // 1.5x on the means, and every circle larger than every triangle.
      assert.ok(mean(circle) >= 1.5 * mean(triangle), `circle ${mean(circle)} px vs triangle ${mean(triangle)} px`);
      assert.ok(Math.min(...circle) > Math.max(...triangle), `circle ${circle.join(', ')} vs triangle ${triangle.join(', ')}`);
    });

    // "a green triangle gives a green triangle" (issue 16): the outline, not only the size. discFill is the share of
    // the region's enclosing disc (its 95th-percentile radius) it covers: the generator's circle 1.01, square 0.84,
    // triangle 0.61 (lab/demo-model/scripts/shape-scores.ts). A blob scores 0.8-0.9 whatever its shape word: the factor-4 model at
    // UNet step 11900 drew circles at 0.82 and triangles at 0.76 (4 seeds), a gap of 0.06 this check refuses.
    if (outline)
      it('the shape word sets the outline: "a large green triangle" fills far less of its enclosing disc than "a large green circle"', async () => {
        const circle = (await greenRegions('circle')).map((r) => discFill(r, side));
        const triangle = (await greenRegions('triangle')).map((r) => discFill(r, side));
        const show = (xs: number[]) => xs.map((x) => x.toFixed(2)).join(', ');
        console.log(`disc fill by seed: circle ${show(circle)}; triangle ${show(triangle)}`);
        // Measured (UNet step 16700, seeds 1-3): circle 0.96 / 0.96 / 0.95, triangle 0.63 / 0.84 / 0.74 (means 0.96 and
        // 0.74, a gap of 0.22; step 15200: 0.94 and 0.71). Asserted: a gap of at least 0.15 on the means (two thirds of
        // the measured one; the shipped factor-8 model: 0.82 vs 0.69, 0.13, with a triangle at 0.82 above a circle at
        // 0.80), every circle rounder than every triangle, and the best triangle within 0.1 of the generator's 0.61.
        assert.ok(mean(circle) - mean(triangle) >= 0.15, `disc fill: circle ${show(circle)} vs triangle ${show(triangle)}`);
        assert.ok(Math.min(...circle) > Math.max(...triangle), `disc fill: circle ${show(circle)} vs triangle ${show(triangle)}`);
        assert.ok(Math.min(...triangle) <= 0.71, `disc fill of the triangles ${show(triangle)}: none near the generator's 0.61`);
      });
  });
