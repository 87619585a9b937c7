// Does a pretrained model draw the shape its caption names? For each "a large <colour> <shape> on a <background>
// background" prompt, samples through the product's txt2img (DPM++ 2M, 15 steps, guidance 6: the draws test's
// settings) and scores every picture with lab/demo-model/quality.ts: the largest region of pixels nearest the named
// colour (its area in pixels) and how much of its enclosing disc it fills (discFill: a disc 1.00, a square about
// 0.84, a triangle about 0.6). The generator's own picture of the same prompt is scored beside it: what a model
// that draws the shape would score. Speckled or fragmented objects score low on both area and fill.
// --bare leaves the background out of the prompts ("a large green circle"), as pretraining's --bare-share does with
// that share of its captions; the generator's picture beside it keeps the pair's background.
//   bash scripts/gpu-env.sh npx tsx lab/demo-model/scripts/shape-scores.ts [--model public/demo-model] [--seeds 1,2,3,4] [--shapes circle,square,triangle,cross] [--bare]
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { loadTokenizer, modelSchedule } from '../../../src/cli/sample.ts';
import { nodeGpu } from '../../../src/gpu/node.ts';
import { loadDiffusers } from '../../../src/models/load.ts';
import { nodeFolder } from '../../../src/models/folder-node.ts';
import { txt2img } from '../../../src/sample/txt2img.ts';
import { CHECK_SAMPLING, discFill, largestColourRegion, median } from '../quality.ts';
import { drawScene, SHAPES, type ColourName, type Scene, type ShapeName } from '../synthetic.ts';

const { values } = parseArgs({
  options: {
    model: { type: 'string', default: 'public/demo-model' },
    seeds: { type: 'string', default: '1,2,3,4' },
    shapes: { type: 'string', default: 'circle,square,triangle,cross' },
    bare: { type: 'boolean', default: false },
  },
});
const seeds = values.seeds!.split(',').map(Number);
if (!seeds.length || !seeds.every((s) => Number.isInteger(s) && s >= 0))
  throw new Error(`--seeds ${values.seeds}: give whole numbers, comma-separated (e.g. 1,2,3,4)`);
const shapes = values.shapes!.split(',') as ShapeName[];
for (const s of shapes) if (!SHAPES.includes(s)) throw new Error(`--shapes: "${s}" is not a shape the generator draws (${SHAPES.join(', ')})`);
/** Object colour and background: each pair stands apart under the nearest-colour sort. */
const PAIRS: [ColourName, ColourName][] = [
  ['green', 'white'],
  ['red', 'black'],
];

const folder = values.model!;
const gpu = await nodeGpu();
const model = await loadDiffusers(gpu, nodeFolder(folder), { dtype: gpu.computeDType });
const tokenizer = loadTokenizer(join(folder, 'tokenizer'));
const schedule = modelSchedule(folder, model);
const side = (JSON.parse(readFileSync(join(folder, 'vae', 'config.json'), 'utf8')) as { sample_size: number }).sample_size;

/** The generator's picture of the prompt: one large solid object in the middle, unrotated. */
function generatorPicture(shape: ShapeName, colour: ColourName, background: ColourName): Uint8Array {
  const scene: Scene = {
    kind: { shape, colour, pattern: 'solid' },
    size: 'large',
    place: 'anywhere',
    objects: [{ x: 0.5, y: 0.5, r: 0.26, angle: 0 }],
    background: { colour: background, pattern: 'solid' },
  };
  return drawScene(scene, side);
}

const fmt = (xs: number[], digits: number) => xs.map((x) => x.toFixed(digits)).join(' ');
for (const [colour, background] of PAIRS)
  for (const shape of shapes) {
    const prompt = values.bare ? `a large ${colour} ${shape}` : `a large ${colour} ${shape} on a ${background} background`;
    const fills: number[] = [];
    const areas: number[] = [];
    for (const seed of seeds) {
      const img = await txt2img(gpu, model, tokenizer, { ...CHECK_SAMPLING, prompt, seed, width: side, height: side, schedule });
      const region = largestColourRegion(img.rgb, side, colour);
      fills.push(discFill(region, side));
      areas.push(region.length);
    }
    const target = largestColourRegion(generatorPicture(shape, colour, background), side, colour);
    console.log(
      `"${prompt}": fill ${median(fills).toFixed(2)} (seeds ${fmt(fills, 2)}), area ${median(areas)} px (${fmt(areas, 0)}); the generator's: fill ${discFill(target, side).toFixed(2)}, area ${target.length} px`,
    );
  }
gpu.destroy();
