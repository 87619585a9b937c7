// How well a pretrained model's VAE reconstructs the synthetic pictures: each of the 8 shapes (red, solid, on
// white) and 8 dataset pictures are encoded (latent means), decoded, and compared with the original (mean squared
// error in [-1, 1], the decoded picture clamped). Prints one line per picture and writes a PNG: originals on top,
// reconstructions below, each picture upscaled 3x. The UNet can draw no finer than this VAE decodes.
// --noise 0.05,0.1,... adds a row per level: the latent means plus Gaussian noise of that standard deviation per
// element, decoded (how much a UNet's error in latent space the decoder tolerates; the latents' RMS is printed).
//   bash scripts/gpu-env.sh npx tsx lab/demo-model/scripts/vae-reconstruction.ts [--model public/demo-model] [--noise 0.1,0.2] --out recon.png
import { readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { encode } from 'fast-png';
import { loadModel } from '../../../src/cli/run.ts';
import { nodeGpu } from '../../../src/gpu/node.ts';
import { vaeDecode, vaeEncode } from '../../../src/nn/vae.ts';
import { Rng } from '../../../src/util/rng.ts';
import { drawScene, sceneAt, SHAPES, subjectScene, toModelInput, type Scene } from '../synthetic.ts';

const { values } = parseArgs({
  options: { model: { type: 'string', default: 'public/demo-model' }, noise: { type: 'string', default: '' }, out: { type: 'string' } },
});
const noiseLevels = values.noise ? values.noise.split(',').map(Number) : [];
if (!values.out || !noiseLevels.every((x) => Number.isFinite(x) && x > 0)) {
  console.error('usage: npx tsx lab/demo-model/scripts/vae-reconstruction.ts [--model <diffusers folder>] [--noise <std>,<std>,...] --out <png>');
  process.exit(1);
}
const gpu = await nodeGpu();
const model = await loadModel(gpu, values.model!, { dtype: 'f32' });
const vae = model.vae;
// the picture size the VAE was trained at (its config's sample_size, as `cli grid` takes it)
const side = (JSON.parse(readFileSync(join(values.model!, 'vae/config.json'), 'utf8')) as { sample_size: number }).sample_size;
const scenes: Scene[] = [
  ...SHAPES.map((shape) => subjectScene({ shape, colour: 'red', pattern: 'solid' }, 1, 0, { colour: 'white', pattern: 'solid' })),
  ...Array.from({ length: 8 }, (_, i) => sceneAt(1, 100000 + i)),
];
const decoded: Uint8Array[] = [];
const noisyRows: Uint8Array[][] = noiseLevels.map(() => []);
const rng = new Rng(7);
let total = 0;
for (const scene of scenes) {
  const input = toModelInput(drawScene(scene, side), side);
  const image = gpu.upload(input, [1, 3, side, side], 'f32');
  const moments = vaeEncode(gpu, vae.config, vae.weights, image);
  const [, twoC, h, w] = moments.shape;
  const meanValues = (await gpu.read(moments)).slice(0, (twoC / 2) * h * w);
  const means = gpu.upload(meanValues, [1, twoC / 2, h, w], 'f32');
  const out = decodedRgb(await gpu.read(vaeDecode(gpu, vae.config, vae.weights, means)));
  for (const [row, std] of noiseLevels.entries()) {
    const z = rng.normals(meanValues.length);
    const noisy = gpu.upload(
      meanValues.map((x, i) => x + std * z[i]),
      means.shape,
      'f32',
    );
    const picture = vaeDecode(gpu, vae.config, vae.weights, noisy);
    noisyRows[row].push(decodedRgb(await gpu.read(picture)));
    gpu.free(noisy, picture);
  }
  gpu.free(image, moments, means);
  let mse = 0;
  for (let c = 0; c < 3; c++) for (let p = 0; p < side * side; p++) mse += (out[p * 3 + c] / 127.5 - 1 - input[c * side * side + p]) ** 2;
  mse /= input.length;
  total += mse;
  decoded.push(out);
  const k = scene.kind;
  const rms = Math.sqrt(meanValues.reduce((a, x) => a + x * x, 0) / meanValues.length);
  console.log(
    `${k.colour} ${k.pattern} ${k.shape} on ${scene.background.colour} ${scene.background.pattern}: mse ${mse.toFixed(4)}, latent rms ${rms.toFixed(3)}`,
  );
}
console.log(`mean mse ${(total / scenes.length).toFixed(4)} over ${scenes.length} pictures (${side} px, ${values.model})`);
writeFileSync(values.out, gridPng([scenes.map((s) => drawScene(s, side)), decoded, ...noisyRows], side, 3));
if (noiseLevels.length) console.log(`rows below the reconstructions: latent noise of std ${noiseLevels.join(', ')}`);
gpu.destroy();

/** A decoded [3, side, side] picture in [-1, 1] as interleaved 8-bit RGB, clamped. */
function decodedRgb(planes: Float32Array): Uint8Array {
  const n = planes.length / 3;
  const rgb = new Uint8Array(n * 3);
  for (let c = 0; c < 3; c++) for (let p = 0; p < n; p++) rgb[p * 3 + c] = Math.round((Math.max(-1, Math.min(1, planes[c * n + p])) + 1) * 127.5);
  return rgb;
}

/** Rows of RGB pictures, each upscaled `zoom` times (nearest), 2 px white gaps. */
function gridPng(rows: Uint8Array[][], side: number, zoom: number): Uint8Array {
  const cell = side * zoom + 2;
  const W = rows[0].length * cell;
  const H = rows.length * cell;
  const img = new Uint8Array(W * H * 3).fill(255);
  rows.forEach((row, r) =>
    row.forEach((pic, i) => {
      for (let y = 0; y < side * zoom; y++)
        for (let x = 0; x < side * zoom; x++)
          for (let c = 0; c < 3; c++) img[((r * cell + y) * W + i * cell + x) * 3 + c] = pic[(Math.floor(y / zoom) * side + Math.floor(x / zoom)) * 3 + c];
    }),
  );
  return encode({ width: W, height: H, data: img, channels: 3 });
}
