// The quality measures of lab/demo-model/quality.ts on pictures with known answers: each must score its property
// at the top when it holds and lower when it breaks (CPU only, no model).
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import {
  borderColourShare,
  colourFidelity,
  colourDrift,
  colourHistogram,
  cosine,
  discFill,
  featureDrift,
  featureFidelity,
  histogramIntersection,
  largestColourRegion,
  median,
  nearestColour,
  pixelDrift,
  promptFidelity,
} from '../quality.ts';
import { COLOURS, drawScene, subjectScene, type ColourName, type Scene, type ShapeName } from '../synthetic.ts';

const SIZE = 16;

function flat(colour: ColourName, size = SIZE): Uint8Array {
  const out = new Uint8Array(size * size * 3);
  for (let i = 0; i < size * size; i++) out.set(COLOURS[colour], 3 * i);
  return out;
}

/** A `fg` square covering the middle half of a `bg` picture. */
function squareOn(fg: ColourName, bg: ColourName, size = SIZE): Uint8Array {
  const out = flat(bg, size);
  for (let y = size / 4; y < (3 * size) / 4; y++) for (let x = size / 4; x < (3 * size) / 4; x++) out.set(COLOURS[fg], 3 * (y * size + x));
  return out;
}

describe('quality measures', () => {
  it('colour histogram: sums to 1; identical pictures intersect at 1, disjoint colours at 0, shared colours in between', () => {
    const a = squareOn('yellow', 'blue');
    const h = colourHistogram(a);
    assert.ok(Math.abs(h.reduce((s, x) => s + x, 0) - 1) < 1e-12);
    assert.equal(histogramIntersection(h, colourHistogram(a)), 1);
    assert.equal(histogramIntersection(colourHistogram(flat('yellow')), colourHistogram(flat('blue'))), 0);
    // The square covers a quarter of the picture: a yellow square on red shares exactly that quarter with a yellow square on blue.
    assert.equal(histogramIntersection(h, colourHistogram(squareOn('yellow', 'red'))), 0.25);
    assert.throws(() => colourHistogram(new Uint8Array(4)), /not RGB pixels/);
  });

  it('colour fidelity: the subject photos score above photos of another colour of the same shape', () => {
    const star = { shape: 'star', colour: 'yellow', pattern: 'dotted', second: 'purple' } as const;
    const photos = [0, 1, 2, 3].map((i) => drawScene(subjectScene(star, 16, i), SIZE));
    const same = [4, 5].map((i) => drawScene(subjectScene(star, 16, i), SIZE));
    const other = [4, 5].map((i) => drawScene(subjectScene({ ...star, colour: 'green', second: 'white' }, 16, i), SIZE));
    const mine = colourFidelity(same, photos);
    const theirs = colourFidelity(other, photos);
    assert.ok(mine > theirs + 0.05, `same subject ${mine} vs another colour ${theirs}`);
    assert.equal(colourFidelity(photos.slice(0, 1), photos.slice(0, 1)), 1);
  });

  it('cosine and feature fidelity: 1 for the same vector, 0 orthogonal, -1 opposite; averaged over all pairs', () => {
    const x = Float32Array.of(1, 2, 3);
    assert.ok(Math.abs(cosine(x, x) - 1) < 1e-12);
    assert.equal(cosine(Float32Array.of(1, 0), Float32Array.of(0, 1)), 0);
    assert.ok(Math.abs(cosine(x, Float32Array.of(-1, -2, -3)) + 1) < 1e-12);
    assert.equal(cosine(x, new Float32Array(3)), 0);
    // Two samples (one matching, one orthogonal) against one photo: mean (1 + 0) / 2.
    assert.ok(Math.abs(featureFidelity([Float32Array.of(1, 0), Float32Array.of(0, 1)], [Float32Array.of(2, 0)]) - 0.5) < 1e-12);
    assert.throws(() => cosine(x, Float32Array.of(1)), /vectors of 3 and 1/);
  });

  it('nearest colour: every named colour is its own nearest; a reddish value is red', () => {
    for (const [name, c] of Object.entries(COLOURS)) assert.equal(nearestColour(c[0], c[1], c[2]), name);
    assert.equal(nearestColour(200, 60, 50), 'red');
  });

  it('prompt fidelity: a red background scores 1 whatever the subject in the middle; another background 0; half and half 0.5', () => {
    assert.equal(borderColourShare(squareOn('yellow', 'red'), SIZE, 'red'), 1);
    assert.equal(borderColourShare(squareOn('red', 'blue'), SIZE, 'red'), 0, 'a red subject on blue is not a red background');
    assert.equal(promptFidelity([squareOn('yellow', 'red'), squareOn('yellow', 'green')], SIZE, 'red'), 0.5);
    assert.throws(() => borderColourShare(new Uint8Array(5), SIZE, 'red'), /not a 16x16 RGB picture/);
  });

  it('drift: 0 for the same pictures, larger the more they change', () => {
    const a = [Float32Array.of(1, 2), Float32Array.of(3, 1)];
    assert.ok(Math.abs(featureDrift(a, a)) < 1e-12);
    assert.ok(featureDrift(a, [Float32Array.of(2, 1), Float32Array.of(3, 1)]) > 0);
    assert.equal(pixelDrift([flat('red')], [flat('red')]), 0);
    const small = pixelDrift([squareOn('yellow', 'red')], [flat('red')]);
    const large = pixelDrift([flat('yellow')], [flat('red')]);
    assert.ok(small > 0 && large > small, `${small} ${large}`);
    assert.throws(() => featureDrift(a, a.slice(1)), /seed by seed/);
  });

  it('shape: the largest region of a colour is the object; its disc fill tells a circle from a square from a triangle at any size, place and rotation', () => {
    const size = 64;
    /** One solid green `shape` on white, drawn by the generator at radius `r` (picture units), centre (x, y). */
    const fillOf = (shape: ShapeName, r: number, x: number, y: number, angle: number) => {
      const scene: Scene = {
        kind: { shape, colour: 'green', pattern: 'solid' },
        size: 'large',
        place: 'anywhere',
        objects: [{ x, y, r, angle }],
        background: { colour: 'white', pattern: 'solid' },
      };
      const rgb = drawScene(scene, size);
      const region = largestColourRegion(rgb, size, 'green');
      // The region is the whole object: every green pixel (the anti-aliased edge sorts to green or white).
      const green = Array.from({ length: size * size }, (_, p) => nearestColour(rgb[3 * p], rgb[3 * p + 1], rgb[3 * p + 2])).filter((c) => c === 'green');
      assert.equal(region.length, green.length, `${shape}: one region holds every green pixel`);
      return discFill(region, size);
    };
    const placements = [
      [0.26, 0.45, 0.55, 0],
      [0.26, 0.5, 0.4, 0.2],
      [0.17, 0.3, 0.7, -0.2],
      [0.11, 0.75, 0.25, 0.1],
    ] as const;
    const range = (shape: ShapeName) => {
      const fills = placements.map(([r, x, y, a]) => fillOf(shape, r, x, y, a));
      return [Math.min(...fills), Math.max(...fills)];
    };
    const [circleLo] = range('circle');
    const [squareLo, squareHi] = range('square');
    const [triangleLo, triangleHi] = range('triangle');
    // Measured: circle 1.00, square 0.83-0.84, triangle 0.58-0.61. The gaps (>= 0.1) are asserted, not the values.
    assert.ok(circleLo > 0.95, `circle ${circleLo}`);
    assert.ok(squareHi < circleLo - 0.1 && squareLo > triangleHi + 0.1, `square ${squareLo}-${squareHi}, circle from ${circleLo}, triangle to ${triangleHi}`);
    assert.ok(triangleLo > 0.5, `triangle ${triangleLo}`);
    // Two blobs: the larger one is the region.
    const two = squareOn('green', 'white', size);
    two.set(COLOURS.green, 0);
    assert.equal(largestColourRegion(two, size, 'green').length, (size / 2) ** 2);
    assert.deepEqual(largestColourRegion(flat('white', size), size, 'green'), []);
    assert.equal(discFill([], size), 0);
    assert.throws(() => largestColourRegion(new Uint8Array(7), size, 'green'), /not a 64x64 RGB picture/);
  });

  it('colour drift: 0 for the same colours wherever they are (a checkerboard shifted by one square, every pixel changed), 1 for no colour in common', () => {
    const board = (shift: number) => {
      const out = new Uint8Array(SIZE * SIZE * 3);
      for (let y = 0; y < SIZE; y++)
        for (let x = 0; x < SIZE; x++) out.set(COLOURS[(((x >> 2) + (y >> 2) + shift) & 1) === 0 ? 'green' : 'white'], 3 * (y * SIZE + x));
      return out;
    };
    const shifted = [board(1)];
    assert.equal(colourDrift(shifted, [board(0)]), 0);
    assert.ok(pixelDrift(shifted, [board(0)]) > 0.3, 'every pixel differs');
    assert.equal(colourDrift([flat('red')], [flat('blue')]), 1);
    // A quarter of the picture recoloured: a quarter of the histogram moves.
    assert.equal(colourDrift([squareOn('yellow', 'red')], [flat('red')]), 0.25);
    assert.throws(() => colourDrift([flat('red')], []), /seed by seed/);
  });

  it('median', () => {
    assert.equal(median([3, 1, 2]), 2);
    assert.equal(median([4, 1, 3, 2]), 2.5);
    assert.throws(() => median([]), /no values/);
  });
});
