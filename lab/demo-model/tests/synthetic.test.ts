// The demo model's pretraining data (lab/demo-model/synthetic.ts): the pictures say what their captions say.
// No GPU: the generator is plain CPU code. Checks read pixels back, so a renderer that drew the wrong colour,
// count, shape or place, or a caption that disagreed with the scene, fails here.
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { describe, it } from 'node:test';
import {
  captionOf,
  checkDatasetOptions,
  COLOUR_NAMES,
  COLOURS,
  drawScene,
  insideShape,
  PATTERNS,
  PLACES,
  sceneAt,
  SHAPES,
  subjectScene,
  toModelInput,
  type Scene,
} from '../synthetic.ts';

const SIZE = 64;
const px = (img: Uint8Array, x: number, y: number) => {
  const o = (Math.min(SIZE - 1, Math.floor(y * SIZE)) * SIZE + Math.min(SIZE - 1, Math.floor(x * SIZE))) * 3;
  return [img[o], img[o + 1], img[o + 2]];
};
/** A point well inside each outline, in the object's frame (the ring's centre is its hole). */
const INTERIOR: Record<string, [number, number]> = { ring: [0.72, 0], crescent: [-0.75, 0] };

/**
 * Connected regions (4-neighbour) of at least 3 pixels nearer in colour to `rgb` than to `bg` (anti-aliased
 * edges count when they are more object than background; a lone part-covered pixel at a star's tip is not a region).
 */
function regionsOf(img: Uint8Array, rgb: readonly number[], bg: readonly number[]): number {
  const dist = (i: number, c: readonly number[]) => (img[i * 3] - c[0]) ** 2 + (img[i * 3 + 1] - c[1]) ** 2 + (img[i * 3 + 2] - c[2]) ** 2;
  const is = (i: number) => dist(i, rgb) < dist(i, bg);
  const seen = new Uint8Array(SIZE * SIZE);
  let regions = 0;
  for (let i = 0; i < SIZE * SIZE; i++) {
    if (seen[i] || !is(i)) continue;
    let pixels = 0;
    const stack = [i];
    seen[i] = 1;
    while (stack.length) {
      const j = stack.pop()!;
      pixels++;
      const [x, y] = [j % SIZE, Math.floor(j / SIZE)];
      for (const [nx, ny] of [
        [x - 1, y],
        [x + 1, y],
        [x, y - 1],
        [x, y + 1],
      ])
        if (nx >= 0 && ny >= 0 && nx < SIZE && ny < SIZE && !seen[ny * SIZE + nx] && is(ny * SIZE + nx)) {
          seen[ny * SIZE + nx] = 1;
          stack.push(ny * SIZE + nx);
        }
    }
    if (pixels >= 3) regions++;
  }
  return regions;
}

describe('synthetic captioned scenes', () => {
  it('are the pictures the shipped demo model was pretrained on (SHA-256 of 48 dataset pictures and 8 subject photos at 64 px)', () => {
    // Pins the renderer: a change to drawing (even one rounding) changes what a resumed or repeated pretraining run
    // sees. The hash was taken with the renderer that drew public/demo-model's data, before it was made faster.
    const h = createHash('sha256');
    for (let i = 0; i < 48; i++) h.update(drawScene(sceneAt(1, i, { exclude: ['star'] }), SIZE));
    const star = { shape: 'star', colour: 'yellow', pattern: 'dotted', second: 'purple' } as const;
    for (let i = 0; i < 8; i++) h.update(drawScene(subjectScene(star, 1, i), SIZE));
    assert.equal(h.digest('hex'), 'ec36cf6e2ca531432c749c6070a592279b6d797091130e29ceafd739070d91e7');
  });

  it('are drawn again identically from (seed, index), and differ between indices and seeds', () => {
    const a = sceneAt(7, 123);
    assert.deepEqual(sceneAt(7, 123), a);
    assert.deepEqual(drawScene(sceneAt(7, 123), SIZE), drawScene(a, SIZE));
    assert.notDeepEqual(sceneAt(7, 124), a);
    assert.notDeepEqual(sceneAt(8, 123), a);
  });

  it('caption every attribute in the fixed grammar', () => {
    const one: Scene = {
      kind: { shape: 'triangle', colour: 'green', pattern: 'solid' },
      size: 'medium',
      place: 'anywhere',
      objects: [{ x: 0.5, y: 0.5, r: 0.17, angle: 0 }],
      background: { colour: 'grey', pattern: 'solid' },
    };
    assert.equal(captionOf(one), 'a green triangle on a grey background');
    const two: Scene = {
      ...one,
      kind: { shape: 'circle', colour: 'red', pattern: 'striped' },
      size: 'small',
      place: 'left',
      objects: [one.objects[0], one.objects[0]],
      background: { colour: 'blue', pattern: 'dotted' },
    };
    assert.equal(captionOf(two), 'two small red striped circles on the left on a dotted blue background');
    const an: Scene = { ...one, kind: { shape: 'crescent', colour: 'orange', pattern: 'checkered' }, size: 'large', place: 'center' };
    assert.equal(captionOf(an), 'a large orange checkered crescent in the center on a grey background');
    assert.equal(captionOf({ ...an, size: 'medium' }), 'an orange checkered crescent in the center on a grey background');
    const three: Scene = { ...one, kind: { shape: 'cross', colour: 'blue', pattern: 'solid' }, objects: [0, 1, 2].map(() => one.objects[0]) };
    assert.equal(captionOf(three), 'three blue crosses on a grey background');
    // The background left unsaid (pretraining's bareShare): the rest of the caption word for word.
    assert.equal(captionOf(one, { background: false }), 'a green triangle');
    assert.equal(captionOf(two, { background: false }), 'two small red striped circles on the left');
    assert.equal(captionOf(an, { background: false }), 'a large orange checkered crescent in the center');
    assert.equal(captionOf(two, { background: true }), captionOf(two));
  });

  it('draw each object in its colour at its place, on the background colour, as many as the caption says', () => {
    let checkedCounts = 0;
    for (let i = 0; i < 300; i++) {
      const s = sceneAt(11, i);
      const img = drawScene(s, SIZE);
      const [x0, y0, x1, y1] = {
        anywhere: [0, 0, 1, 1],
        left: [0, 0, 0.45, 1],
        right: [0.55, 0, 1, 1],
        top: [0, 0, 1, 0.45],
        bottom: [0, 0.55, 1, 1],
        center: [0.3, 0.3, 0.7, 0.7],
      }[s.place];
      for (const o of s.objects) {
        assert.ok(o.x >= x0 && o.x <= x1 && o.y >= y0 && o.y <= y1, `scene ${i}: an object of "${captionOf(s)}" sits outside its region`);
        assert.ok(o.x - o.r >= 0 && o.x + o.r <= 1 && o.y - o.r >= 0 && o.y + o.r <= 1, `scene ${i}: an object leaves the picture`);
        if (s.kind.pattern === 'solid') {
          const [u, v] = INTERIOR[s.kind.shape] ?? [0, 0];
          const [c, sn] = [Math.cos(o.angle), Math.sin(o.angle)];
          const at = px(img, o.x + o.r * (c * u - sn * v), o.y + o.r * (sn * u + c * v));
          assert.deepEqual(at, [...COLOURS[s.kind.colour]], `scene ${i} "${captionOf(s)}": object pixel`);
        }
      }
      if (s.background.pattern === 'solid') {
        // A pixel far from every object shows the background exactly.
        for (const [x, y] of [
          [0.01, 0.01],
          [0.99, 0.01],
          [0.01, 0.99],
          [0.99, 0.99],
        ])
          if (s.objects.every((o) => Math.hypot(o.x - x, o.y - y) > o.r * 1.5 + 2 / SIZE))
            assert.deepEqual(px(img, x, y), [...COLOURS[s.background.colour]], `scene ${i}: background pixel`);
        if (s.kind.pattern === 'solid' && s.kind.shape !== 'cross') {
          // Solid objects on a solid background: one region of the object's colour per object (none overlap).
          assert.equal(regionsOf(img, COLOURS[s.kind.colour], COLOURS[s.background.colour]), s.objects.length, `scene ${i} "${captionOf(s)}"`);
          checkedCounts++;
        }
      }
    }
    assert.ok(checkedCounts >= 10, `only ${checkedCounts} scenes had their objects counted`);
  });

  it('draw patterns with both colours inside the object', () => {
    for (const pattern of PATTERNS.filter((p) => p !== 'solid')) {
      const s: Scene = {
        kind: { shape: 'square', colour: 'red', pattern },
        size: 'large',
        place: 'anywhere',
        objects: [{ x: 0.5, y: 0.5, r: 0.3, angle: 0 }],
        background: { colour: 'blue', pattern: 'solid' },
      };
      const img = drawScene(s, SIZE);
      const seen = new Set<string>();
      for (let y = 0.3; y <= 0.7; y += 1 / SIZE) for (let x = 0.3; x <= 0.7; x += 1 / SIZE) seen.add(px(img, x, y).join());
      assert.ok(seen.has(COLOURS.red.join()) && seen.has(COLOURS.white.join()), `${pattern}: red and its white pattern both show`);
    }
  });

  it('tell the shapes apart: every pair of outlines differs in at least a fifth of their area', () => {
    const N = 48;
    const masks = SHAPES.map((shape) => {
      const m = new Uint8Array(N * N);
      for (let y = 0; y < N; y++) for (let x = 0; x < N; x++) m[y * N + x] = insideShape(shape, ((x + 0.5) / N) * 2 - 1, ((y + 0.5) / N) * 2 - 1) ? 1 : 0;
      return m;
    });
    for (let a = 0; a < SHAPES.length; a++)
      for (let b = a + 1; b < SHAPES.length; b++) {
        let inter = 0;
        let union = 0;
        for (let i = 0; i < N * N; i++) {
          inter += masks[a][i] & masks[b][i];
          union += masks[a][i] | masks[b][i];
        }
        assert.ok(inter / union < 0.8, `${SHAPES[a]} and ${SHAPES[b]} overlap ${(inter / union).toFixed(2)} of their union`);
      }
  });

  it('cover every shape, colour, pattern and place, and never draw an excluded shape', () => {
    const all = Array.from({ length: 1500 }, (_, i) => sceneAt(3, i));
    for (const [name, values, got] of [
      ['shape', SHAPES, all.map((s) => s.kind.shape)],
      ['colour', COLOUR_NAMES, all.map((s) => s.kind.colour)],
      ['pattern', PATTERNS, all.map((s) => s.kind.pattern)],
      ['place', PLACES, all.map((s) => s.place)],
      ['count', [1, 2, 3], all.map((s) => s.objects.length)],
    ] as const)
      for (const v of values) assert.ok((got as readonly unknown[]).includes(v), `no scene with ${name} ${v}`);
    const held = Array.from({ length: 1500 }, (_, i) => sceneAt(3, i, { exclude: ['star'] }));
    assert.equal(held.filter((s) => s.kind.shape === 'star').length, 0);
    assert.ok(all.filter((s) => s.kind.shape === 'star').length > 100);
  });

  it('make solidShare of the objects solid and, drawn apart, of the backgrounds; the other patterns share the rest', () => {
    const shares = (solidShare: number | undefined) => {
      const scenes = Array.from({ length: 2000 }, (_, i) => sceneAt(5, i, { solidShare }));
      const share = (f: (s: Scene) => boolean) => scenes.filter(f).length / scenes.length;
      return {
        objects: share((s) => s.kind.pattern === 'solid'),
        backgrounds: share((s) => s.background.pattern === 'solid'),
        both: share((s) => s.kind.pattern === 'solid' && s.background.pattern === 'solid'),
        striped: share((s) => s.kind.pattern === 'striped'),
      };
    };
    // 2000 scenes: a share of 0.5 has a standard deviation of 0.011, so 0.04 is 3.5 of them.
    const near = (got: number, want: number, what: string) => assert.ok(Math.abs(got - want) < 0.04, `${what}: ${got}, want ${want}`);
    const half = shares(0.5);
    near(half.objects, 0.5, 'solid objects at 0.5');
    near(half.backgrounds, 0.5, 'solid backgrounds at 0.5');
    near(half.both, 0.25, 'plain on plain at 0.5 (independent draws)');
    near(half.striped, 0.5 / 3, 'striped objects at 0.5');
    const old = shares(undefined);
    near(old.objects, 0.25, 'solid objects without solidShare (every pattern alike)');
    near(old.both, 1 / 16, 'plain on plain without solidShare');
    assert.deepEqual([shares(0).objects, shares(0).backgrounds, shares(1).objects, shares(1).backgrounds], [0, 0, 1, 1]);
  });

  it('draw a subject with its own second colour, on backgrounds of other colours', () => {
    const kind = { shape: 'star', colour: 'yellow', pattern: 'dotted', second: 'purple' } as const;
    for (let i = 0; i < 4; i++) {
      const s = subjectScene(kind, 5, i);
      assert.equal(s.objects.length, 1);
      assert.ok(!['yellow', 'purple'].includes(s.background.colour));
      const img = drawScene(s, SIZE);
      const colours = new Set<string>();
      for (let p = 0; p < SIZE * SIZE; p++) colours.add(`${img[p * 3]},${img[p * 3 + 1]},${img[p * 3 + 2]}`);
      assert.ok(colours.has(COLOURS.purple.join()) && colours.has(COLOURS.yellow.join()), `photo ${i} shows the star's yellow and its purple dots`);
    }
    assert.notDeepEqual(subjectScene(kind, 5, 0), subjectScene(kind, 5, 1));
  });

  it('convert to the model input range [-1, 1], channels first', () => {
    const img = drawScene(sceneAt(1, 0), 16);
    const x = toModelInput(img, 16);
    assert.equal(x.length, 3 * 256);
    assert.equal(x[0], Math.fround(img[0] / 127.5 - 1));
    assert.equal(x[256], Math.fround(img[1] / 127.5 - 1));
    assert.ok(x.every((v) => v >= -1 && v <= 1));
  });

  it('refuse a seed, size, count or exclusion the generator cannot honour, by name', () => {
    assert.throws(() => checkDatasetOptions({ seed: -1, size: 64, factor: 8 }, '--data-seed'), /--data-seed seed -1: use an integer from 0 to 4294967295/);
    assert.throws(() => checkDatasetOptions({ seed: 1.5, size: 64, factor: 8 }), /seed 1\.5/);
    assert.throws(() => checkDatasetOptions({ seed: 1, size: 60, factor: 8 }, '--size'), /--size size 60: use a multiple of 8/);
    assert.throws(() => checkDatasetOptions({ seed: 1, size: 8, factor: 8 }), /from 16 to 512 px/);
    assert.throws(() => checkDatasetOptions({ seed: 1, size: 1024, factor: 8 }), /from 16 to 512 px/);
    assert.throws(() => checkDatasetOptions({ seed: 1, size: 64, factor: 8, count: 0 }), /count 0/);
    assert.throws(() => checkDatasetOptions({ seed: 1, size: 64, factor: 8, exclude: ['moon'] }), /exclude "moon": not a shape/);
    assert.throws(() => checkDatasetOptions({ seed: 1, size: 64, factor: 8, exclude: [...SHAPES] }), /every shape is excluded/);
    assert.throws(() => checkDatasetOptions({ seed: 1, size: 64, factor: 8, solidShare: 1.5 }), /solidShare 1\.5: use a probability from 0 to 1/);
    assert.throws(() => checkDatasetOptions({ seed: 1, size: 64, factor: 8, solidShare: NaN }), /solidShare NaN/);
    assert.doesNotThrow(() => checkDatasetOptions({ seed: 0xffffffff, size: 64, factor: 8, count: 1000, exclude: ['star'], solidShare: 0.5 }));
  });
});
