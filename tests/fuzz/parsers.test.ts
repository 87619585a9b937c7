// Issue 46 item 6: a fuzzer for the parsers that read what users hand us: the safetensors header (and the
// tensors it describes), the image decoders (the header checks the studio runs before the browser decodes,
// and the full Node decode the command line runs) and the settings (command-line flags through the schema,
// and settings objects as run.json or the studio's saved workspace hold them).
//
// Inputs are random mutations of valid seeds: bytes flipped, set to boundary values, cut, repeated or
// inserted, plus mutations that know the format (JSON values swapped for others of any type or depth, tensor
// names with bytes that are not UTF-8, PNG chunks edited with their CRC recomputed, JPEG frame sizes, WebP
// canvas sizes). Every input must either parse or be refused with the project's own error type whose message
// names the file or the flag/field, never a raw TypeError, RangeError, stack overflow or the JSON engine's
// wording; and none may take longer than DBS_FUZZ_INPUT_MS.
//
// The loop runs in a worker thread so a hang can be stopped: the worker publishes each input (in shared
// memory) before trying it, and the test thread ends the worker when one input takes too long, keeping that
// input. In CI each target runs for a few seconds from a fixed seed; for a longer search:
//   DBS_FUZZ_SECONDS=600 DBS_FUZZ_SEED=7 node --import tsx --test tests/fuzz/parsers.test.ts
// Failing inputs are written to $TMPDIR/dbs-fuzz-<seed>/ and named in the failure.
import assert from 'node:assert/strict';
import { mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { isMainThread, parentPort, Worker, workerData } from 'node:worker_threads';
import { encode as encodePng } from 'fast-png';
import { encode as encodeJpeg } from 'jpeg-js';
import { parseFlags, UsageError } from '../../src/cli/args.ts';
import { FLAGS, settingsFromFlags } from '../../src/cli/train.ts';
import { assertComplete, ImageError, probeImage } from '../../src/io/image.ts';
import { decodeImageNode } from '../../src/io/image-node.ts';
import { readSafetensors, SafetensorsError, SafetensorsFile, SafetensorsWriter, writeSafetensors } from '../../src/io/safetensors.ts';
import { BytesSource } from '../../src/io/source.ts';
import { defaultSettings, SETTINGS, SettingsError, validateSettings, type RunSettings } from '../../src/pipeline/settings.ts';
import { Rng } from '../../src/util/rng.ts';
import { crc32, exifApp1, tiffWithOrientation } from '../fixtures/images/craft.ts';
import { FIXTURES } from '../helpers.ts';

const TARGETS = ['safetensors', 'images', 'settings'] as const;
type Target = (typeof TARGETS)[number];
/** Seconds per target: a few in CI (the three together stay well under 20 s), as long as asked on demand. */
const SECONDS = Number(process.env.DBS_FUZZ_SECONDS ?? 3);
const SEED = Number(process.env.DBS_FUZZ_SEED ?? 46);
/**
 * One input may take this long. Most take milliseconds; JSON.parse of a valid 10,000-deep value (the settings target)
 * took up to 0.7 s here, and several times that on this 2-core machine under a load of 17.
 */
const INPUT_MS = Number(process.env.DBS_FUZZ_INPUT_MS ?? 10_000);
/** Shared memory for the input being tried (bigger ones are published cut to this size). */
const INPUT_BYTES = 4 << 20;

/** Wording that only an unhandled engine error produces: never part of a message of ours. */
const LEAK =
  /Maximum call stack|in JSON at position|Unterminated string|Unexpected token|Unexpected end of JSON|Cannot read properties|is not a function|is not iterable|Invalid array length|Invalid typed array length|Array buffer allocation failed|\[object Object\]|offset is out of bounds/;

interface Failure {
  target: Target;
  index: number;
  error: string;
  input: Uint8Array;
}

// ---- random inputs ------------------------------------------------------------------------------------

class R extends Rng {
  pick<T>(xs: readonly T[]): T {
    return xs[this.int(xs.length)];
  }
  chance(p: number): boolean {
    return this.uniform() < p;
  }
  bytes(n: number): Uint8Array {
    return Uint8Array.from({ length: n }, () => this.int(256));
  }
}

/** The bytes of `parts` end to end (spreading megabyte arrays into a list is far too slow for a fuzz loop). */
function cat(...parts: ArrayLike<number>[]): Uint8Array {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

const INTERESTING_32 = [0, 1, 2, 7, 8, 255, 256, 0x7fff, 0xffff, 0x10000, 0x7fffffff, 0x80000000, 0xfffffffe, 0xffffffff];

/** One to four generic byte edits: the mutations that find most bugs in binary parsers. */
function mutateBytes(r: R, input: Uint8Array): Uint8Array {
  let b: Uint8Array = Uint8Array.from(input);
  for (let k = 1 + r.int(4); k > 0; k--) {
    const at = r.int(Math.max(1, b.length));
    switch (r.int(8)) {
      case 0:
        if (b.length) b[at] ^= 1 << r.int(8);
        break;
      case 1:
        if (b.length) b[at] = r.int(256);
        break;
      case 2:
        if (b.length) b[at] = r.pick([0, 1, 0x7f, 0x80, 0xfe, 0xff]);
        break;
      case 3: {
        if (b.length < 4) break;
        const p = Math.min(at, b.length - 4);
        new DataView(b.buffer).setUint32(p, r.pick(INTERESTING_32), r.chance(0.5));
        break;
      }
      case 4:
        b = b.slice(0, at);
        break;
      case 5:
        b = cat(b.subarray(0, at), b.subarray(at + 1 + r.int(32)));
        break;
      case 6:
        b = cat(b.subarray(0, at), r.bytes(1 + r.int(16)), b.subarray(at));
        break;
      default: {
        const from = r.int(Math.max(1, b.length));
        b = cat(b.subarray(0, at), b.subarray(from, from + 1 + r.int(64)), b.subarray(at));
      }
    }
  }
  return b;
}

/** `[[[...]]]` or `{"a":{"a":...}}` `depth` levels deep, as text (JSON.stringify of it would overflow the stack). */
function deepJson(r: R, depth: number): string {
  return r.chance(0.5) ? '['.repeat(depth) + ']'.repeat(depth) : '{"a":'.repeat(depth) + '1' + '}'.repeat(depth);
}

/** Any JSON value as text: boundary numbers, odd strings, nesting 10,000 levels deep now and then. */
function randomJson(r: R, depth = 0): string {
  switch (r.int(depth > 2 ? 4 : 7)) {
    case 0:
      return String(r.pick([0, -0, 1, -1, 0.5, 3, 64, 2 ** 31, 2 ** 32, 2 ** 53, 2 ** 53 + 2, 1e308, -1e308, 1e-320, 1e21]));
    case 1:
      return JSON.stringify(
        r.pick(['', 'F32', 'F16', 'BF16', 'I64', 'BOOL', 'f32', 'Q4_K', 'x'.repeat(5000), '\u0000', '\ud800', '__proto__', 'toString', '💥', '1e3', '0x10']),
      );
    case 2:
      return r.pick(['true', 'false', 'null']);
    case 3:
      return JSON.stringify(r.int(1000) - 500);
    case 4:
      return `[${Array.from({ length: r.int(4) }, () => randomJson(r, depth + 1)).join(',')}]`;
    case 5:
      return `{${Array.from({ length: r.int(4) }, () => `${JSON.stringify(r.pick(['dtype', 'shape', 'data_offsets', 'a', '__proto__', '']))}:${randomJson(r, depth + 1)}`).join(',')}}`;
    default:
      // 10,000 levels overflow the stack of any recursive reader (JSON.stringify fails from about 5,000 here); more
      // only slows JSON.parse down (the fixed cases below hold 200,000-deep values).
      return deepJson(r, r.chance(0.1) ? 10_000 : r.pick([10, 1000]));
  }
}

// ---- safetensors --------------------------------------------------------------------------------------

function stFile(headerBytes: Uint8Array, data: Uint8Array, length = headerBytes.length): Uint8Array {
  const out = new Uint8Array(8 + headerBytes.length + data.length);
  new DataView(out.buffer).setBigUint64(0, BigInt(length), true);
  out.set(headerBytes, 8);
  out.set(data, 8 + headerBytes.length);
  return out;
}

async function writerSeed(): Promise<Uint8Array> {
  const parts: Uint8Array[] = [];
  const w = new SafetensorsWriter(
    { write: async (c) => void parts.push(Uint8Array.from(c)), close: async () => undefined },
    [
      { name: 'ids', dtype: 'I64', shape: [3] },
      { name: 'w.bf16', dtype: 'BF16', shape: [2, 2] },
      { name: 'empty', dtype: 'F32', shape: [0, 4] },
    ],
    { format: 'pt', note: 'ünïcödé' },
  );
  await w.write('ids', new Uint8Array(24).fill(1));
  await w.write('w.bf16', new Uint8Array(8).fill(0x3f));
  await w.write('empty', new Float32Array(0));
  await w.finish();
  return cat(...parts);
}

async function safetensorsSeeds(): Promise<Uint8Array[]> {
  const t = (shape: number[], dtype?: 'F16' | 'F32') => ({
    shape,
    data: Float32Array.from({ length: shape.reduce((a, b) => a * b, 1) }, (_, i) => i / 7),
    dtype,
  });
  return [
    writeSafetensors(new Map([['a', t([2, 3])]])),
    writeSafetensors(
      new Map([
        ['down_blocks.0.attn.to_q.weight', t([4, 4], 'F16')],
        ['b', t([])],
      ]),
      { format: 'pt', 'modelspec.title': 'x' },
    ),
    await writerSeed(),
    stFile(new TextEncoder().encode('{}      '), new Uint8Array(0)),
  ];
}

/** A structure-aware mutation: the header's JSON edited (values of any type, names, nesting, duplicates), its length field kept or not. */
function mutateSafetensors(r: R, seed: Uint8Array): Uint8Array {
  const len = Number(new DataView(seed.buffer, seed.byteOffset).getBigUint64(0, true));
  const header = JSON.parse(new TextDecoder().decode(seed.subarray(8, 8 + len))) as Record<string, Record<string, unknown>>;
  const data = seed.subarray(8 + len);
  const names = Object.keys(header);
  // Edits as text, so values of any depth can be spliced in.
  const parts = new Map<string, string>(names.map((n) => [n, JSON.stringify(header[n])]));
  for (let k = 1 + r.int(3); k > 0; k--) {
    const name = names.length ? r.pick(names) : 'a';
    const entry = header[name] ?? {};
    switch (r.int(6)) {
      case 0: {
        const field = r.pick(['dtype', 'shape', 'data_offsets', 'extra']);
        parts.set(name, JSON.stringify({ ...entry, [field]: 0 }).replace(new RegExp(`"${field}":0`), `"${field}":${randomJson(r)}`));
        break;
      }
      case 1:
        parts.set(name, randomJson(r));
        break;
      case 2:
        parts.set(r.pick(['', '__proto__', '__metadata__', 'x'.repeat(3000), 'a\u0000b', 'tëst', name + name]), parts.get(name) ?? '{}');
        break;
      case 3:
        parts.set('__metadata__', r.chance(0.8) ? randomJson(r) : deepJson(r, 200_000));
        break;
      case 4: {
        const off = entry.data_offsets as number[] | undefined;
        const shift = r.pick([-1, 1, 4, -4, 2 ** 32]);
        if (off) parts.set(name, JSON.stringify({ ...entry, data_offsets: r.chance(0.5) ? [off[0] + shift, off[1]] : [off[0], off[1] + shift] }));
        break;
      }
      default:
        parts.delete(name);
    }
  }
  let text = `{${[...parts].map(([n, v]) => `${JSON.stringify(n)}:${v}`).join(',')}}`;
  if (r.chance(0.15) && parts.size) text = text.replace(/^\{/, `{${JSON.stringify([...parts.keys()][0])}:{},`); // a name given twice
  let bytes: Uint8Array = new TextEncoder().encode(text);
  if (r.chance(0.15)) {
    // Bytes that are not UTF-8 inside a name or value.
    const at = 1 + r.int(bytes.length - 1);
    bytes = cat(bytes.subarray(0, at), r.pick([[0xff], [0xc3], [0xed, 0xa0, 0x80], [0xf4, 0x90, 0x80, 0x80], [0x80]]), bytes.subarray(at));
  }
  if (r.chance(0.1)) bytes = bytes.subarray(0, r.int(bytes.length)); // cut inside the JSON, length field following
  const length = r.chance(0.85) ? bytes.length : r.pick([0, 1, bytes.length - 1, bytes.length + 1, 100 << 20, 2 ** 40]);
  return stFile(bytes, r.chance(0.8) ? data : data.subarray(0, r.int(data.length + 1)), length);
}

async function trySafetensors(bytes: Uint8Array, name: string): Promise<string | null> {
  const check = (e: unknown) => (e instanceof SafetensorsError && !LEAK.test(e.message) ? null : describeError(e));
  try {
    const f = await SafetensorsFile.open(new BytesSource(bytes, name));
    for (const n of f.names) {
      const e = f.entry(n);
      if (['F32', 'F16', 'BF16', 'F64'].includes(e.dtype)) await f.read(n);
      else await f.readRaw(n);
      if (e.shape.length && e.shape[0] > 0) await f.readRows(n, 0, 1);
    }
  } catch (e) {
    const bad = check(e) ?? (String((e as Error).message).includes(name) ? null : `the message does not name ${name}: ${(e as Error).message}`);
    if (bad) return bad;
  }
  try {
    readSafetensors(bytes); // the in-memory reader of small files: the same header rules
  } catch (e) {
    return check(e);
  }
  return null;
}

// ---- images -------------------------------------------------------------------------------------------

function pngChunks(png: Uint8Array): { type: string; data: Uint8Array }[] {
  const out: { type: string; data: Uint8Array }[] = [];
  const dv = new DataView(png.buffer, png.byteOffset, png.byteLength);
  for (let p = 8; p + 12 <= png.length;) {
    const len = dv.getUint32(p);
    out.push({ type: String.fromCharCode(...png.subarray(p + 4, p + 8)), data: png.slice(p + 8, p + 8 + len) });
    p += 12 + len;
  }
  return out;
}

function pngFrom(chunks: { type: string; data: Uint8Array }[]): Uint8Array {
  const parts = [Uint8Array.of(0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a)];
  for (const c of chunks) {
    const b = new Uint8Array(12 + c.data.length);
    const dv = new DataView(b.buffer);
    dv.setUint32(0, c.data.length);
    b.set(
      Uint8Array.from(c.type, (ch) => ch.charCodeAt(0)),
      4,
    );
    b.set(c.data, 8);
    dv.setUint32(8 + c.data.length, crc32(b.subarray(4, 8 + c.data.length)));
    parts.push(b);
  }
  return cat(...parts);
}

function imageSeeds(): Uint8Array[] {
  const files = ['quadrants.png', 'rgba.png', 'rgb16.png', 'palette.png', 'quadrants-o6.png', 'quadrants.jpg', 'quadrants-o6.jpg'];
  const webp = ['quadrants.webp', 'quadrants-lossy.webp', 'quadrants-o6.webp'];
  const seeds: Uint8Array[] = [...files, ...webp].map((f) => new Uint8Array(readFileSync(join(FIXTURES, 'images', f))));
  const grey = Uint8Array.from({ length: 9 * 7 }, (_, i) => i * 4);
  seeds.push(encodePng({ width: 9, height: 7, data: grey, channels: 1, depth: 8 }));
  seeds.push(encodePng({ width: 4, height: 4, data: new Uint16Array(16 * 2).fill(40000), channels: 2, depth: 16 }));
  const rgba = Uint8Array.from({ length: 16 * 12 * 4 }, (_, i) => (i * 37) & 0xff);
  seeds.push(new Uint8Array(encodeJpeg({ width: 16, height: 12, data: rgba }, 80).data));
  return seeds.map((s) => new Uint8Array(s));
}

/** A mutation that knows the format: PNG chunks with their CRC recomputed, JPEG frame sizes and EXIF, WebP sizes. */
function mutateImage(r: R, seed: Uint8Array): Uint8Array {
  if (seed[0] === 0x89) {
    const chunks = pngChunks(seed);
    const c = r.pick(chunks);
    const edit = c.type === 'IHDR' && r.chance(0.7) ? 'ihdr' : r.pick(['exif', 'drop', 'bytes', 'bytes', 'bytes']);
    if (edit === 'ihdr') {
      const dv = new DataView(c.data.buffer);
      const field = r.int(5);
      if (field < 2) dv.setUint32(field * 4, r.pick([0, 1, 3, 1000, 7071, 7072, 16384, 65535, 0x7fffffff, 0xffffffff]));
      else c.data[6 + field] = r.pick([0, 1, 2, 3, 4, 6, 7, 8, 16, 255]); // depth, colour type, compression...
    } else if (edit === 'exif')
      chunks.splice(1, 0, { type: 'eXIf', data: mutateBytes(r, tiffWithOrientation(1 + r.int(8), r.chance(0.5) ? 'II' : 'MM', true)) });
    else if (edit === 'drop') chunks.splice(r.int(chunks.length), 1);
    else c.data = mutateBytes(r, c.data);
    return pngFrom(chunks);
  }
  if (seed[0] === 0xff) {
    if (r.chance(0.3))
      return cat(
        seed.subarray(0, 2),
        exifApp1(mutateBytes(r, tiffWithOrientation(1 + r.int(8), r.chance(0.5) ? 'II' : 'MM', r.chance(0.5)))),
        seed.subarray(2),
      );
    const b = Uint8Array.from(seed);
    for (let p = 2; p + 9 < b.length; p++)
      if (b[p] === 0xff && b[p + 1] >= 0xc0 && b[p + 1] <= 0xc2) {
        // SOF: length (2), precision (1), height (2), width (2).
        new DataView(b.buffer).setUint16(p + 5 + 2 * r.int(2), r.pick([0, 1, 8, 7072, 8192, 65535]));
        break;
      }
    return b;
  }
  const b = Uint8Array.from(seed);
  if (b.length >= 30) {
    const dv = new DataView(b.buffer);
    const at = r.pick([4, 16, 24, 26, 27, 21]);
    if (at === 4 || at === 16) dv.setUint32(at, r.pick(INTERESTING_32), true);
    else dv.setUint16(at, r.pick([0, 1, 0x3fff, 0xffff]), true);
  }
  return b;
}

async function tryImage(bytes: Uint8Array, name: string): Promise<string | null> {
  const check = (e: unknown) =>
    e instanceof ImageError && e.file === name && e.message.includes(name) && !LEAK.test(e.message)
      ? null
      : e instanceof ImageError && !e.message.includes(name)
        ? `the message does not name ${name}: ${e.message}`
        : describeError(e);
  try {
    // What the studio runs on a photo or mask before the browser decodes it (ui/studio/photo-check.ts).
    const info = probeImage(bytes, name);
    assertComplete(bytes, info.kind, name);
  } catch (e) {
    const bad = check(e);
    if (bad) return bad;
  }
  try {
    const img = await decodeImageNode(bytes, name);
    if (img.data.length !== img.width * img.height * 4) return `decoded ${img.width}x${img.height} with ${img.data.length} bytes`;
  } catch (e) {
    return check(e);
  }
  return null;
}

// ---- settings -----------------------------------------------------------------------------------------

const RAW_VALUES = [
  '0',
  '1',
  '-1',
  '3',
  '0.5',
  '1e3',
  '1e-7',
  '0x10',
  '0o7',
  '0b1',
  ' 5 ',
  '',
  'NaN',
  'Infinity',
  '-Infinity',
  '1'.repeat(400),
  '4GiB',
  '1MiB',
  '1 KiB',
  '9'.repeat(40) + 'GiB',
  '1e400',
  '--steps',
  '=',
  'lora',
  'full',
  'adamw',
  'ünï',
  '\u0000',
  '💥',
  '-0',
];

function flagValue(r: R, flag: string): string {
  const spec = SETTINGS.find((s) => s.flag === flag);
  if (spec && r.chance(0.5)) {
    const d = spec.default as unknown;
    const v = typeof d === 'object' && d !== null ? (d as Record<string, unknown>).lora : d;
    const pool = [String(v), ...(spec.values ?? []), String(spec.min ?? 0), String(spec.max ?? 1), String((spec.max ?? 1) + 1)];
    return r.pick(pool);
  }
  return r.pick(RAW_VALUES);
}

function randomArgv(r: R): string[] {
  const flags = Object.keys(FLAGS);
  const argv: string[] = [];
  for (let k = r.int(8); k > 0; k--) {
    const f = r.chance(0.9) ? r.pick(flags) : r.pick(['stpes', 'x', '', 'help', 'STEPS', '-', '--']);
    const form = r.int(5);
    if (form === 0) argv.push(`--${f}=${flagValue(r, f)}`);
    else if (form === 1) argv.push(`--${f}`);
    else if (form === 2) argv.push(r.pick(['-s', '-', 'positional', '-5', '--']));
    else argv.push(`--${f}`, flagValue(r, f));
  }
  return argv;
}

/** A settings object as JSON text (run.json's settings, the studio's saved workspace): defaults with values swapped for any JSON. */
function randomSettingsJson(r: R): string {
  const s = defaultSettings(r.chance(0.5) ? 'lora' : 'full') as unknown as Record<string, unknown>;
  const parts = new Map(Object.entries(s).map(([k, v]) => [k, JSON.stringify(v)]));
  for (let k = 1 + r.int(3); k > 0; k--) {
    const key = r.chance(0.9) ? r.pick([...parts.keys()]) : r.pick(['__proto__', 'constructor', 'unknown', '']);
    if (r.chance(0.15)) parts.delete(key);
    else parts.set(key, r.chance(0.3) ? JSON.stringify(r.pick(RAW_VALUES)) : randomJson(r));
  }
  return `{${[...parts].map(([k, v]) => `${JSON.stringify(k)}:${v}`).join(',')}}`;
}

/** A settings input as text: a command line (a JSON list of words) or a settings object (JSON). */
function randomSettingsInput(r: R): string {
  return r.chance(0.5) ? JSON.stringify(randomArgv(r)) : randomSettingsJson(r);
}

function trySettings(text: string): string | null {
  const value = JSON.parse(text) as unknown;
  if (Array.isArray(value)) {
    try {
      const { values } = parseFlags(value as string[], FLAGS, 'usage: train ...');
      settingsFromFlags(values);
    } catch (e) {
      const named = (e instanceof UsageError || e instanceof SettingsError) && /--|usage/.test(e.message) && !LEAK.test(e.message);
      return named ? null : describeError(e);
    }
    return null;
  }
  try {
    validateSettings(value as RunSettings, (k) => `settings.${k}`);
  } catch (e) {
    const named = e instanceof SettingsError && e.message.includes('settings.') && !LEAK.test(e.message);
    return named ? null : describeError(e);
  }
  return null;
}

// ---- the loop (worker side) ---------------------------------------------------------------------------

function describeError(e: unknown): string {
  if (!(e instanceof Error)) return `threw a non-Error: ${String(e).slice(0, 200)}`;
  return `${e.name}: ${e.message.slice(0, 300)}\n${(e.stack ?? '').split('\n').slice(1, 4).join('\n')}`;
}

interface WorkerInput {
  target: Target;
  seconds: number;
  seed: number;
  beat: SharedArrayBuffer;
  current: SharedArrayBuffer;
}

interface FuzzResult {
  count: number;
  failures: Failure[];
  /** The slowest input's milliseconds (generation excluded). */
  slowestMs?: number;
}

async function fuzzLoop(w: WorkerInput): Promise<FuzzResult> {
  const beat = new Int32Array(w.beat);
  const current = new Uint8Array(w.current);
  const r = new R(w.seed * 31 + TARGETS.indexOf(w.target));
  const failures: Failure[] = [];
  const seen = new Set<string>();
  const seeds = w.target === 'safetensors' ? await safetensorsSeeds() : w.target === 'images' ? imageSeeds() : [];
  const deadline = Date.now() + w.seconds * 1000;
  let i = 0;
  let slowestMs = 0;
  for (; Date.now() < deadline; i++) {
    let input: Uint8Array;
    let run: () => Promise<string | null>;
    const name = `fuzz-${i}.${w.target === 'images' ? 'img' : 'safetensors'}`;
    if (w.target === 'settings') {
      const text = randomSettingsInput(r);
      input = new TextEncoder().encode(text);
      run = () => Promise.resolve(trySettings(text));
    } else {
      const seed = r.pick(seeds);
      const structured = r.chance(0.6);
      input =
        w.target === 'safetensors'
          ? structured
            ? mutateSafetensors(r, seed)
            : mutateBytes(r, seed)
          : structured
            ? mutateImage(r, seed)
            : mutateBytes(r, seed);
      if (r.chance(0.2)) input = mutateBytes(r, input);
      const bytes = input;
      run = () => (w.target === 'safetensors' ? trySafetensors(bytes, name) : tryImage(bytes, name));
    }
    // Publish the input, then the heartbeat: [inputs started, published length].
    current.set(input.subarray(0, current.length));
    Atomics.store(beat, 1, Math.min(input.length, current.length));
    Atomics.store(beat, 0, i + 1);
    const t0 = performance.now();
    const error = await run();
    slowestMs = Math.max(slowestMs, performance.now() - t0);
    if (error) {
      const kind = error.replace(/\d+/g, 'N').split('\n')[0];
      if (!seen.has(kind) && failures.length < 20) failures.push({ target: w.target, index: i, error, input });
      seen.add(kind);
    }
  }
  return { count: i, failures, slowestMs: Math.round(slowestMs) };
}

if (!isMainThread && (workerData as { fuzz?: boolean } | null)?.fuzz) {
  const w = workerData as WorkerInput;
  parentPort!.postMessage(await fuzzLoop(w));
}

// ---- the tests (test thread) --------------------------------------------------------------------------

/** Runs one target in a worker; a hang (no new input for INPUT_MS) ends it and is reported with its input. */
function fuzzInWorker(target: Target): Promise<FuzzResult> {
  const beat = new SharedArrayBuffer(8);
  const current = new SharedArrayBuffer(INPUT_BYTES);
  const data: WorkerInput & { fuzz: true } = { fuzz: true, target, seconds: SECONDS, seed: SEED, beat, current };
  // The worker loads this file through tsx, as the test runner did.
  const boot = `import('tsx/esm/api').then((m) => { m.register(); return import(${JSON.stringify(import.meta.url)}); })`;
  const worker = new Worker(boot, { eval: true, workerData: data, resourceLimits: { maxOldGenerationSizeMb: 2048 } });
  const beats = new Int32Array(beat);
  const input = () => new Uint8Array(current, 0, Atomics.load(beats, 1)).slice();
  return new Promise((resolve, reject) => {
    let last = -1;
    let since = Date.now();
    const timer = setInterval(() => {
      const now = Atomics.load(beats, 0);
      if (now !== last) [last, since] = [now, Date.now()];
      else if (now > 0 && Date.now() - since > INPUT_MS) {
        clearInterval(timer);
        const failure = { target, index: now - 1, error: `hang: one input ran for more than ${INPUT_MS} ms`, input: input() };
        void worker.terminate().then(() => resolve({ count: now, failures: [failure] }));
      }
    }, 100);
    worker.on('message', (m: FuzzResult) => {
      clearInterval(timer);
      void worker.terminate().then(() => resolve(m));
    });
    worker.on('error', (e) => {
      clearInterval(timer);
      const n = Atomics.load(beats, 0);
      if (n === 0) reject(e);
      else resolve({ count: n, failures: [{ target, index: n - 1, error: `crash: ${describeError(e)}`, input: input() }] });
    });
  });
}

function report(failures: Failure[]): string {
  const dir = join(tmpdir(), `dbs-fuzz-${SEED}`);
  mkdirSync(dir, { recursive: true });
  return failures
    .map((f) => {
      const file = join(dir, `${f.target}-${f.index}.bin`);
      writeFileSync(file, f.input);
      return `${f.target} input ${f.index} (${file}, ${f.input.length} bytes): ${f.error}`;
    })
    .join('\n\n');
}

/** A safetensors file from its header text or bytes (length field exact) and data. */
const stOf = (header: string | Uint8Array, data = new Uint8Array(0)) => stFile(typeof header === 'string' ? new TextEncoder().encode(header) : header, data);

async function refusal(p: Promise<unknown>): Promise<string> {
  return p.then(
    () => 'accepted',
    (e: Error) => `${e.name}: ${e.message}`,
  );
}

if (isMainThread)
  void describe('what the fuzzer found, kept as fixed cases', () => {
    const open = (bytes: Uint8Array, name: string) => refusal(SafetensorsFile.open(new BytesSource(bytes, name)));
    void it('safetensors: a 200,000-deep __metadata__ or shape is refused at once, not by a stack overflow', async () => {
      const deep = ['['.repeat(200_000) + ']'.repeat(200_000), '{"a":'.repeat(200_000) + '1' + '}'.repeat(200_000)];
      const headers = [...deep.map((d) => `{"__metadata__":${d}}`), `{"a":{"dtype":"F32","shape":${deep[0]},"data_offsets":[0,4]}}`];
      for (const h of headers) {
        assert.equal(
          await open(stOf(h, new Uint8Array(4)), 'deep.safetensors'),
          'SafetensorsError: deep.safetensors: the header nests more than 16 levels deep, where a safetensors header has 3 (tensors, their fields, shapes): the file is corrupt',
        );
      }
      // Within the depth limit, a value of the wrong shape is previewed (never JSON.stringify'd whole) in the message.
      assert.match(await open(stOf('{"__metadata__":[[[[[[1]]]]]]}'), 'meta.safetensors'), /__metadata__ must map names to strings, got \[\[\[\.\.\.\]\]\]$/);
    });
    void it('safetensors: a tensor name that is not UTF-8 is refused naming the byte, not renamed to U+FFFD', async () => {
      const header = cat(
        new TextEncoder().encode('{"lora_unet_'),
        [0xff, 0xfe],
        new TextEncoder().encode('":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'),
      );
      assert.match(
        await open(stOf(header, new Uint8Array(4)), 'name.safetensors'),
        /^SafetensorsError: name\.safetensors: the header is not UTF-8 text: byte 20 of the file \(after "\{\\"lora_unet_"\) is not UTF-8/,
      );
      assert.throws(() => readSafetensors(stOf(header, new Uint8Array(4))), /the header is not UTF-8 text/);
    });
    void it("safetensors: a header cut inside its JSON says so, not in the JSON engine's words", async () => {
      const r = await open(stOf('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b'), 'cut.safetensors');
      assert.equal(
        r,
        "SafetensorsError: cut.safetensors: the header's JSON is damaged: it stops in the middle (after 56 characters); the file is truncated or corrupt: use another copy",
      );
      // Node's JSON.parse gives no position for some errors ("Unexpected token 'Y', ... is not valid JSON"): found anyway.
      assert.match(
        await open(stOf('{"a":{"dtype":Y}}'), 'token.safetensors'),
        /the header's JSON is damaged: it is not valid JSON at line 1, column 15 \(near /,
      );
      assert.match(
        await open(stOf('{"a":1,,}'), 'comma.safetensors'),
        /the header's JSON is damaged: it is not valid JSON at line 1, column 8 \(near "\{\\"a\\":1,,\}"\)/,
      );
    });
    void it('images: a JPEG the decoder trips over (a TypeError inside jpeg-js) is named as damaged, without the TypeError', async () => {
      const bytes = new Uint8Array(readFileSync(join(FIXTURES, 'images', 'fuzz-decoder-typeerror.jpg')));
      assert.equal(
        await refusal(decodeImageNode(bytes, 'photo.jpg')),
        'ImageError: photo.jpg: could not decode the JPEG (its image data is damaged): save it again or use another file',
      );
    });
    void it('images: a small file whose header declares far more pixels than its data can hold is refused before decoding', async () => {
      // The fuzzer's case: a 0.7 KB JPEG declaring 48x65535 kept jpeg-js busy for seconds before failing.
      const jpeg = new Uint8Array(readFileSync(join(FIXTURES, 'images', 'quadrants.jpg')));
      const sof = jpeg.findIndex((b, i) => b === 0xff && jpeg[i + 1] === 0xc0);
      new DataView(jpeg.buffer).setUint16(sof + 5, 65535); // height
      assert.match(
        await refusal(decodeImageNode(jpeg, 'tall.jpg')),
        /^ImageError: tall\.jpg is not a valid JPEG: \d+ bytes of image data cannot hold the pixels its header declares \(at least 18432 bytes\)/,
      );
      assert.throws(() => assertComplete(jpeg, 'jpeg', 'tall.jpg'), /cannot hold the pixels/); // the studio's check too
      const png = pngChunks(new Uint8Array(readFileSync(join(FIXTURES, 'images', 'rgba.png'))));
      new DataView(png[0].data.buffer).setUint32(0, 7000); // width, CRC recomputed by pngFrom
      assert.match(await refusal(decodeImageNode(pngFrom(png), 'wide.png')), /^ImageError: wide\.png is not a valid PNG: \d+ bytes of image data cannot hold/);
      // The real files still decode.
      for (const f of ['quadrants.jpg', 'rgba.png', 'quadrants-o6.jpg', 'rgb16.png'])
        assert.equal(await refusal(decodeImageNode(new Uint8Array(readFileSync(join(FIXTURES, 'images', f))), f)), 'accepted');
    });
    void it('settings: a dash-led positional ("-5") is a usage error, not parseArgs\'s TypeError', () => {
      assert.throws(() => parseFlags(['--steps', '3', '-5'], FLAGS, 'usage: train'), {
        name: 'UsageError',
        message: /^unexpected argument "-5": every value follows its --flag/,
      });
      const { values, positionals } = parseFlags(['-5', '--steps', '3'], FLAGS, 'usage', { positionals: 1 });
      assert.deepEqual([{ ...values }, positionals], [{ steps: '3' }, ['-5']]);
    });
    void it('settings: a run record whose value is 200,000 levels deep is refused naming the field', () => {
      const s = { ...defaultSettings('lora'), steps: JSON.parse('['.repeat(200_000) + ']'.repeat(200_000)) as unknown } as unknown as RunSettings;
      assert.throws(() => validateSettings(s, (k) => `settings.${k}`), {
        name: 'SettingsError',
        message: 'settings.steps must be a finite number, got [[[...]]]',
      });
    });
  });

if (isMainThread)
  void describe(`parser fuzzer (seed ${SEED}, ${SECONDS} s per target)`, () => {
    for (const target of TARGETS)
      void it(`${target}: random and mutated inputs parse or get a named refusal, none hangs`, { timeout: (SECONDS + 60) * 1000 }, async (t) => {
        const { count, failures, slowestMs } = await fuzzInWorker(target);
        t.diagnostic(`${target}: ${count} inputs, the slowest ${slowestMs ?? '-'} ms`);
        // The count depends on the machine's load; the floor only says the loop ran.
        assert.ok(count >= 10, `only ${count} inputs were tried`);
        assert.equal(failures.length, 0, report(failures));
      });
  });
