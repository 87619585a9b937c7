// The pretraining data for the demo model (issue 16): captioned pictures of coloured shapes, drawn on the fly
// from a seed, so nothing is downloaded or stored and every picture can be drawn again from (seed, index).
//
// A scene is one to three objects of one kind (shape, colour, fill pattern, size) placed in one region of the
// picture, on a background of one colour and pattern. Its caption says all of it, in a fixed grammar:
//   "two small red striped circles on the left on a dotted blue background"
//   "a green triangle on a grey background"            (medium size, solid fill, anywhere: left unsaid)
//   "a green triangle"                                  (the background left unsaid: captionOf's `background: false`)
// so a text encoder can learn every attribute from the words. A subject for DreamBooth is an object kind
// the pretraining data never shows (`exclude` a shape) and, unlike any pretraining object, a fixed second
// colour in its pattern ("a star with cyan dots"), so the fine-tuned model must learn it from the photos.
//
// Drawing: each pixel is the average of SS x SS sub-pixel samples (anti-aliased edges); a sample is inside
// an object when it is inside the object's outline (circle: distance; polygons: edge half-planes or the
// even-odd rule), and a pattern picks the object's colour or its second colour from the sample's position
// in the object's own frame (stripes: diagonal bands; dots: a disc per grid cell; checks: cell parity).
import { Rng } from '../../src/util/rng.ts';

export const SHAPES = ['circle', 'square', 'triangle', 'diamond', 'crescent', 'cross', 'star', 'ring'] as const;
export type ShapeName = (typeof SHAPES)[number];

/** Colour names and their sRGB values (0-255). */
export const COLOURS = {
  red: [220, 40, 40],
  green: [40, 170, 60],
  blue: [40, 80, 220],
  yellow: [240, 210, 40],
  orange: [245, 140, 30],
  purple: [140, 60, 180],
  pink: [245, 130, 190],
  cyan: [40, 200, 220],
  brown: [130, 80, 40],
  white: [245, 245, 245],
  black: [25, 25, 25],
  grey: [128, 128, 128],
} as const satisfies Record<string, readonly [number, number, number]>;
export type ColourName = keyof typeof COLOURS;
export const COLOUR_NAMES = Object.keys(COLOURS) as ColourName[];

export const PATTERNS = ['solid', 'striped', 'dotted', 'checkered'] as const;
export type PatternName = (typeof PATTERNS)[number];

export const SIZES = ['small', 'medium', 'large'] as const;
export type SizeName = (typeof SIZES)[number];

/** Where the objects sit; 'anywhere' is not said in the caption. */
export const PLACES = ['anywhere', 'left', 'right', 'top', 'bottom', 'center'] as const;
export type PlaceName = (typeof PLACES)[number];

export interface ObjectKind {
  shape: ShapeName;
  colour: ColourName;
  pattern: PatternName;
  /** The pattern's second colour; pretraining objects use `secondColour(colour)`, a subject may differ. */
  second?: ColourName;
}

export interface Scene {
  kind: ObjectKind;
  size: SizeName;
  place: PlaceName;
  /** Object centres and radii in picture units (0..1 across the picture), and each one's rotation. */
  objects: { x: number; y: number; r: number; angle: number }[];
  background: { colour: ColourName; pattern: PatternName };
}

/** The look of an object kind pretraining must never show (shape, colour and fill pattern). */
export type HeldOutLook = Pick<ObjectKind, 'shape' | 'colour' | 'pattern'>;

export interface SceneOptions {
  /** Shapes never drawn (the held-out subject's). */
  exclude?: readonly ShapeName[];
  /** Object kinds never drawn: a scene drawing one is drawn again (the `stars` data's held-out subject look). */
  holdOut?: readonly HeldOutLook[];
  /** At most this many objects (1-3; default 3). */
  maxCount?: number;
  /**
   * Probability that the objects are solid, and (drawn apart) that the background is: the rest take the other
   * patterns evenly. Absent, every pattern is equally likely (a quarter solid), as the first datasets drew.
   */
  solidShare?: number;
}

/** Radius of one object (fraction of the picture's side) per size word. */
const RADIUS: Record<SizeName, number> = { small: 0.11, medium: 0.17, large: 0.26 };

/** The region (x0, y0, x1, y1 in picture units) objects of a place keep their centres in. */
const REGION: Record<PlaceName, [number, number, number, number]> = {
  anywhere: [0, 0, 1, 1],
  left: [0, 0, 0.45, 1],
  right: [0.55, 0, 1, 1],
  top: [0, 0, 1, 0.45],
  bottom: [0, 0.55, 1, 1],
  center: [0.3, 0.3, 0.7, 0.7],
};

const COUNT_WORDS = ['', 'a', 'two', 'three'];

/** The second colour of a pretraining object's pattern: its colour lightened when dark, darkened when light. */
export function secondColour(c: ColourName): ColourName {
  const light: ColourName[] = ['yellow', 'white', 'pink', 'cyan', 'orange'];
  return light.includes(c) ? 'black' : 'white';
}

/** The rgb of a background pattern's second colour: its colour mixed half-way toward white (or black when light). */
function backgroundSecond(c: ColourName): [number, number, number] {
  const [r, g, b] = COLOURS[c];
  const toward = r + g + b > 450 ? 0 : 255;
  return [(r + toward) / 2, (g + toward) / 2, (b + toward) / 2];
}

const PLURAL: Record<ShapeName, string> = {
  circle: 'circles',
  square: 'squares',
  triangle: 'triangles',
  diamond: 'diamonds',
  crescent: 'crescents',
  cross: 'crosses',
  star: 'stars',
  ring: 'rings',
};

/** "a red striped circle", "two small green dotted stars"; a subject's own token goes in with `name`. */
export function describeObjects(kind: ObjectKind, count: number, size: SizeName, name?: string): string {
  const sizeWord = size === 'medium' ? '' : size;
  const patternWord = kind.pattern === 'solid' ? '' : kind.pattern;
  const noun = count === 1 ? kind.shape : PLURAL[kind.shape];
  const words = [sizeWord, kind.colour, patternWord, name ?? '', noun].filter((w) => w !== '');
  const article = count === 1 ? (/^[aeiou]/.test(words[0]) ? 'an' : 'a') : COUNT_WORDS[count];
  return `${article} ${words.join(' ')}`;
}

/**
 * The caption of a scene, in the fixed grammar of the file comment; `background: false` leaves the background
 * unsaid ("a green triangle"), as a person's prompt often does (pretraining's `bareShare`).
 */
export function captionOf(scene: Scene, opts: { background?: boolean } = {}): string {
  const where = scene.place === 'anywhere' ? '' : scene.place === 'center' ? ' in the center' : ` on the ${scene.place}`;
  const objects = `${describeObjects(scene.kind, scene.objects.length, scene.size)}${where}`;
  if (opts.background === false) return objects;
  const bgPattern = scene.background.pattern === 'solid' ? '' : `${scene.background.pattern} `;
  return `${objects} on a ${bgPattern}${scene.background.colour} background`;
}

/**
 * Seeds a generator for picture `index` of the dataset with `seed` (a 32-bit integer hash of both), so any
 * picture is drawn without drawing the ones before it (a resumed run streams from where it stopped).
 */
export function sceneRng(seed: number, index: number): Rng {
  let h = Math.imul(seed ^ 0x9e3779b9, 0x85ebca6b) ^ Math.imul(index + 1, 0xc2b2ae35);
  h ^= h >>> 16;
  h = Math.imul(h, 0x7feb352d);
  h ^= h >>> 15;
  return new Rng(h >>> 0);
}

const pick = <T>(rng: Rng, xs: readonly T[]): T => xs[rng.int(xs.length)];

/**
 * Places `count` objects of radius `r` with centres in `place`'s region, none overlapping another (centres
 * at least 2.1 r apart) and each fully inside the picture; null when the draws do not find room.
 */
function placeObjects(rng: Rng, count: number, r: number, place: PlaceName): Scene['objects'] | null {
  const [x0, y0, x1, y1] = REGION[place];
  const lo = (a: number) => Math.max(a, r + 0.02);
  const hi = (b: number) => Math.min(b, 1 - r - 0.02);
  const [ax, bx, ay, by] = [lo(x0), hi(x1), lo(y0), hi(y1)];
  const out: Scene['objects'] = [];
  for (let tries = 0; out.length < count && tries < 200; tries++) {
    const x = ax <= bx ? ax + rng.uniform() * (bx - ax) : (x0 + x1) / 2;
    const y = ay <= by ? ay + rng.uniform() * (by - ay) : (y0 + y1) / 2;
    if (out.every((o) => Math.hypot(o.x - x, o.y - y) >= 2.1 * r)) out.push({ x, y, r, angle: 0 });
  }
  return out.length === count ? out : null;
}

/** Picture `index` of the dataset with `seed`: every attribute drawn uniformly, the objects placed without overlap. */
/** A fill pattern: solid with probability `solidShare`, else one of the others; without it, any of the four evenly. */
function pickPattern(rng: Rng, solidShare: number | undefined): PatternName {
  if (solidShare === undefined) return pick(rng, PATTERNS);
  return rng.uniform() < solidShare ? 'solid' : pick(rng, PATTERNS.slice(1));
}

export function sceneAt(seed: number, index: number, opts: SceneOptions = {}): Scene {
  const shapes = SHAPES.filter((s) => !(opts.exclude ?? []).includes(s));
  const maxCount = opts.maxCount ?? 3;
  const rng = sceneRng(seed, index);
  for (;;) {
    const colour = pick(rng, COLOUR_NAMES);
    const kind: ObjectKind = { shape: pick(rng, shapes), colour, pattern: pickPattern(rng, opts.solidShare) };
    if (isHeldOut(kind, opts.holdOut)) continue; // a held-out look: draw the scene again from the same Rng
    const size = pick(rng, SIZES);
    const place = pick(rng, PLACES);
    const count = 1 + rng.int(maxCount);
    // The background differs from the objects' colour, so every object stands out.
    const bgColour = pick(
      rng,
      COLOUR_NAMES.filter((c) => c !== colour && c !== secondColour(colour)),
    );
    const background = { colour: bgColour, pattern: pickPattern(rng, opts.solidShare) };
    const objects = placeObjects(rng, count, RADIUS[size], place);
    if (!objects) continue; // e.g. three large objects do not fit on the left: draw the scene again
    for (const o of objects) o.angle = kind.shape === 'circle' || kind.shape === 'ring' ? 0 : (rng.uniform() - 0.5) * 0.5;
    return { kind, size, place, objects, background };
  }
}

/** Does `kind` have the shape, colour and pattern of one of `looks`? */
export function isHeldOut(kind: Pick<ObjectKind, 'shape' | 'colour' | 'pattern'>, looks: readonly HeldOutLook[] = []): boolean {
  return looks.some((l) => l.shape === kind.shape && l.colour === kind.colour && l.pattern === kind.pattern);
}

// ------------------------------------------------------------------------------------------- data versions

/**
 * DreamBooth's subject on the demo model: a yellow star with purple dots. Pretraining's objects take their
 * pattern's second colour from their own colour (`secondColour`: black or white), so no pretraining object ever
 * has purple in its pattern; the `stars` data also holds out the subject's shape, colour and fill together
 * (yellow dotted stars, whose dots would be black), so the nearest pretraining object differs from the subject in
 * its pattern's presence as well as its colour.
 */
export const SUBJECT_LOOK: Required<ObjectKind> = { shape: 'star', colour: 'yellow', pattern: 'dotted', second: 'purple' };

/**
 * The pretraining datasets by name:
 * - `v1`: stars excluded altogether (the shipped and the factor-4 models were trained on it; the default of
 *   saved runs and of the engine's `npm run lab:pretrain`). The class "star" is then unknown to the base model.
 * - `stars`: every shape in every colour and fill, stars included, with the subject's look held out
 *   (`SUBJECT_LOOK`): DreamBooth's setting of a known class and an unseen instance (issue 49).
 */
export const DATA_VERSIONS = ['v1', 'stars'] as const;
export type DataVersion = (typeof DATA_VERSIONS)[number];

/** The scene options of a data version, refusing (by name) options that would show the held-out subject. */
export function dataSceneOptions(version: DataVersion, o: { exclude?: readonly ShapeName[]; solidShare?: number }, field = 'dataset'): SceneOptions {
  if (!(DATA_VERSIONS as readonly string[]).includes(version)) throw new Error(`${field} data "${String(version)}": use one of ${DATA_VERSIONS.join(', ')}`);
  const exclude = o.exclude ?? (version === 'v1' ? ['star'] : []);
  if (version === 'v1' && !exclude.includes(SUBJECT_LOOK.shape))
    throw new Error(
      `${field} exclude [${exclude.join(', ')}]: the v1 data holds the subject out by excluding "star"; without it, it draws yellow dotted stars (the held-out subject's look). Keep star excluded, or use data "stars", which shows stars and holds out only the subject's look`,
    );
  if (version === 'stars' && exclude.includes('star'))
    throw new Error(`${field} exclude [${exclude.join(', ')}]: the stars data is the one that shows stars; leave "star" out of exclude, or use data "v1"`);
  return { exclude, solidShare: o.solidShare, ...(version === 'stars' ? { holdOut: [SUBJECT_LOOK] } : {}) };
}

/** A photo of a subject (one object of `kind`) at a random place, size and background; for DreamBooth's instance set. */
export function subjectScene(kind: ObjectKind, seed: number, index: number, background?: Scene['background']): Scene {
  const rng = sceneRng(seed ^ 0x5bd1e995, index);
  const size: SizeName = rng.uniform() < 0.5 ? 'medium' : 'large';
  const objects = placeObjects(rng, 1, RADIUS[size], 'anywhere')!;
  objects[0].angle = (rng.uniform() - 0.5) * 0.5;
  const taken = [kind.colour, kind.second ?? secondColour(kind.colour)];
  const bg = background ?? {
    colour: pick(
      rng,
      COLOUR_NAMES.filter((c) => !taken.includes(c)),
    ),
    pattern: 'solid' as const,
  };
  return { kind, size, place: 'anywhere', objects, background: bg };
}

// ------------------------------------------------------------------------------------------- drawing

/** Is (u, v), in the object's frame (centre 0, radius 1, unrotated), inside the outline of `shape`? */
export function insideShape(shape: ShapeName, u: number, v: number): boolean {
  switch (shape) {
    case 'circle':
      return u * u + v * v <= 1;
    case 'ring': {
      const d = u * u + v * v;
      return d <= 1 && d >= 0.45 * 0.45;
    }
    case 'square':
      return Math.abs(u) <= 0.8 && Math.abs(v) <= 0.8;
    case 'diamond':
      return Math.abs(u) + Math.abs(v) <= 1;
    case 'cross':
      return (Math.abs(u) <= 0.3 && Math.abs(v) <= 0.95) || (Math.abs(v) <= 0.3 && Math.abs(u) <= 0.95);
    case 'triangle':
      return insidePolygon(TRIANGLE, u, v);
    case 'crescent': {
      // The unit disc less a disc of radius 0.8 moved up and right: a moon opening to the upper right.
      const du = u - 0.45;
      const dv = v + 0.1;
      return u * u + v * v <= 1 && du * du + dv * dv > 0.8 * 0.8;
    }
    case 'star':
      return insidePolygon(STAR, u, v);
  }
}

/** Vertices on the unit circle starting at the top, every 2π/n, radii alternating through `radii`. */
function regular(n: number, radii: number[]): [number, number][] {
  return Array.from({ length: n }, (_, i) => {
    const a = -Math.PI / 2 + (2 * Math.PI * i) / n;
    const r = radii[i % radii.length];
    return [r * Math.cos(a), r * Math.sin(a)];
  });
}
// The triangle spans y -1..0.5 around its centroid; moved down by 0.25 so its box is centred (-0.75..0.75).
const TRIANGLE = regular(3, [1]).map(([x, y]) => [x, y + 0.25] as [number, number]);
const STAR = regular(10, [1, 0.42]);

/** Even-odd rule: a horizontal ray from (u, v) crosses the outline an odd number of times. */
function insidePolygon(poly: [number, number][], u: number, v: number): boolean {
  let inside = false;
  for (let i = 0, j = poly.length - 1; i < poly.length; j = i++) {
    const [xi, yi] = poly[i];
    const [xj, yj] = poly[j];
    if (yi > v !== yj > v && u < ((xj - xi) * (v - yi)) / (yj - yi) + xi) inside = !inside;
  }
  return inside;
}

/** Does the pattern show its second colour at (u, v) (frame units, `cell` = one pattern period)? */
export function patternSecond(pattern: PatternName, u: number, v: number, cell: number): boolean {
  switch (pattern) {
    case 'solid':
      return false;
    case 'striped':
      return Math.floor((u + v) / cell) % 2 !== 0;
    case 'dotted': {
      const fu = u / cell - Math.floor(u / cell) - 0.5;
      const fv = v / cell - Math.floor(v / cell) - 0.5;
      return fu * fu + fv * fv <= 0.3 * 0.3;
    }
    case 'checkered':
      return (Math.floor(u / cell) + Math.floor(v / cell)) % 2 !== 0;
  }
}

/** Sub-pixel samples per pixel side: 4 x 4 = 16 samples average into each pixel. */
const SS = 4;

/**
 * A radius (object frame) past which no outline reaches: the triangle's corners, the farthest points, are at
 * |(±0.866, 0.75)| = 1.15; every other shape stays within the unit circle.
 */
const OUTLINE_BOUND = 1.5;

/**
 * The rgb (0-255) a sample at (x, y) (picture units) takes, as a function; what it needs of the scene (each
 * object's rotation, the four colours) is computed once per scene, so a sample allocates nothing: drawing a
 * 64 px picture (65536 samples) took 6.7 ms and allocated about 11 MB when each sample built them anew.
 */
function scenePainter(scene: Scene): (x: number, y: number) => readonly number[] {
  const shape = scene.kind.shape;
  const pattern = scene.kind.pattern;
  const objects = scene.objects.map((o) => ({ x: o.x, y: o.y, r: o.r, cos: Math.cos(-o.angle), sin: Math.sin(-o.angle) }));
  const first = COLOURS[scene.kind.colour];
  const second = COLOURS[scene.kind.second ?? secondColour(scene.kind.colour)];
  const bg = scene.background;
  const bgFirst = COLOURS[bg.colour];
  const bgSecond = backgroundSecond(bg.colour);
  return (x, y) => {
    for (const o of objects) {
      const dx = (x - o.x) / o.r;
      const dy = (y - o.y) / o.r;
      if (dx * dx + dy * dy > OUTLINE_BOUND * OUTLINE_BOUND) continue; // outside every outline: skip the test
      const u = o.cos * dx - o.sin * dy;
      const v = o.sin * dx + o.cos * dy;
      if (!insideShape(shape, u, v)) continue;
      // Object patterns are in the object's frame: a period of 0.5 radius gives about four bands across it.
      return patternSecond(pattern, u + 4, v + 4, 0.5) ? second : first;
    }
    // Background patterns: a period of 1/8 of the picture.
    return patternSecond(bg.pattern, x, y, 0.125) ? bgSecond : bgFirst;
  };
}

/** The scene drawn at `size` x `size` pixels: RGB bytes, row-major, rows top to bottom. */
export function drawScene(scene: Scene, size: number): Uint8Array {
  const out = new Uint8Array(size * size * 3);
  const sampleColour = scenePainter(scene);
  for (let py = 0; py < size; py++)
    for (let px = 0; px < size; px++) {
      let r = 0;
      let g = 0;
      let b = 0;
      for (let sy = 0; sy < SS; sy++)
        for (let sx = 0; sx < SS; sx++) {
          const c = sampleColour((px + (sx + 0.5) / SS) / size, (py + (sy + 0.5) / SS) / size);
          r += c[0];
          g += c[1];
          b += c[2];
        }
      const o = (py * size + px) * 3;
      out[o] = Math.round(r / (SS * SS));
      out[o + 1] = Math.round(g / (SS * SS));
      out[o + 2] = Math.round(b / (SS * SS));
    }
  return out;
}

/** RGB bytes to the model's input: CHW floats in [-1, 1] (as the VAE encoder takes images). */
export function toModelInput(rgb: Uint8Array, size: number): Float32Array {
  const plane = size * size;
  const out = new Float32Array(3 * plane);
  for (let i = 0; i < plane; i++) for (let c = 0; c < 3; c++) out[c * plane + i] = rgb[i * 3 + c] / 127.5 - 1;
  return out;
}

// ------------------------------------------------------------------------------------------- checks

/** The sizes a dataset can draw at: the model's factor times 2 at least (objects need pixels), at most 512. */
export function checkDatasetOptions(
  o: { seed: number; size: number; factor: number; count?: number; exclude?: readonly string[]; solidShare?: number },
  field = 'dataset',
): void {
  if (o.solidShare !== undefined && !(o.solidShare >= 0 && o.solidShare <= 1))
    throw new Error(`${field} solidShare ${o.solidShare}: use a probability from 0 to 1 (e.g. 0.5; 0.25 is every pattern alike)`);
  if (!Number.isInteger(o.seed) || o.seed < 0 || o.seed > 0xffffffff)
    throw new Error(`${field} seed ${o.seed}: use an integer from 0 to 4294967295 (the generator's seed is 32 bits)`);
  if (!Number.isInteger(o.size) || o.size < 16 || o.size > 512 || o.size % o.factor !== 0)
    throw new Error(
      `${field} size ${o.size}: use a multiple of ${o.factor} (the model's factor) from 16 to 512 px; shapes need at least 16 px to be told apart`,
    );
  if (o.count !== undefined && (!Number.isInteger(o.count) || o.count < 1 || o.count > 2 ** 31))
    throw new Error(`${field} count ${o.count}: use a whole number of pictures from 1 to 2147483648`);
  for (const s of o.exclude ?? [])
    if (!(SHAPES as readonly string[]).includes(s)) throw new Error(`${field} exclude "${s}": not a shape the generator draws (${SHAPES.join(', ')})`);
  if ((o.exclude ?? []).length >= SHAPES.length) throw new Error(`${field} exclude: every shape is excluded, so nothing is left to draw`);
}
