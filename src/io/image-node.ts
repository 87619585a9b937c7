// Node host for image loading (CLI, tests): decode JPEG with jpeg-js, PNG with fast-png and WebP with
// @jsquash/webp (libwebp compiled to wasm), then apply the EXIF orientation, which none of them does. Plus
// loading a file or a whole folder of training images with kohya-style captions (photo.jpg + photo.txt).
import { readdir, readFile } from 'node:fs/promises';
import { createRequire } from 'node:module';
import { basename, extname, join } from 'node:path';
import { decode as decodePng, type DecodedPng } from 'fast-png';
import { decode as decodeJpeg } from 'jpeg-js';
import decodeWebp, { init as initWebpModule } from '@jsquash/webp/decode.js';
import {
  applyOrientation,
  assertComplete,
  assertDecodable,
  exifOrientation,
  ImageError,
  imageSize,
  KIND_NAME,
  MAX_DECODE_PIXELS,
  sniffImage,
  type ImageKind,
  type Orientation,
  type RgbaImage,
} from './image.ts';

/**
 * jpeg-js's own limits, a second line of defence behind the header check (assertDecodable). Its memory
 * accounting counts ~256 bytes per 8x8 block per component (coefficients) plus the component planes and the
 * RGBA output: about 19 bytes per pixel for a 4:4:4 colour image, so 50 MP needs ~950 MB. Past the limit it
 * throws instead of exhausting memory on a crafted "JPEG bomb".
 */
const JPEG_MAX_MEMORY_MB = 1024;

function decodeJpegRgba(bytes: Uint8Array): RgbaImage {
  const img = decodeJpeg(bytes, {
    useTArray: true,
    formatAsRGBA: true,
    // Tolerant: accept the small spec violations many cameras produce. Truncation is caught beforehand.
    tolerantDecoding: true,
    maxResolutionInMP: MAX_DECODE_PIXELS / 1e6,
    maxMemoryUsageInMB: JPEG_MAX_MEMORY_MB,
  });
  return { width: img.width, height: img.height, data: img.data };
}

// ---------------------------------------------------------------------------------------------------------
// PNG: fast-png returns the samples as stored (1 to 4 channels, 1/2/4-bit packed, 8-bit or 16-bit, or palette
// indices); everything becomes RGBA8 here.

/** Sample `i` (0-based in the row) of a row, at any bit depth, as an integer. */
function sampleReader(png: DecodedPng): (row: number, i: number) => number {
  const { data, depth, width, channels } = png;
  if (depth >= 8) {
    const perRow = width * channels;
    return (row, i) => data[row * perRow + i];
  }
  // 1, 2 and 4 bits: packed most-significant first, each row starting on a byte boundary.
  const stride = Math.ceil((width * channels * depth) / 8);
  const mask = (1 << depth) - 1;
  return (row, i) => {
    const bit = i * depth;
    return (data[row * stride + (bit >> 3)] >> (8 - depth - (bit & 7))) & mask;
  };
}

/** Maps a sample of `depth` bits to 0..255: exact for low depths (v * 255 / max), rounded for 16 bits. */
function to8Bit(depth: number): (v: number) => number {
  if (depth === 8) return (v) => v;
  if (depth === 16) return (v) => Math.round(v / 257); // 257 = 65535 / 255
  const scale = 255 / ((1 << depth) - 1);
  return (v) => v * scale;
}

function pngToRgba(png: DecodedPng, name: string): RgbaImage {
  const { width, height, channels, depth } = png;
  const read = sampleReader(png);
  const out = new Uint8Array(width * height * 4);
  if (png.palette) {
    // Indexed: fast-png appends tRNS alphas to the palette entries ([r, g, b] or [r, g, b, a]).
    const palette = png.palette;
    for (let y = 0; y < height; y++)
      for (let x = 0; x < width; x++) {
        // An index past the palette is an encoder bug; draw it black like libpng's permissive mode.
        const entry = palette[read(y, x)] ?? [0, 0, 0, 255];
        out.set([entry[0], entry[1], entry[2], entry[3] ?? 255], (y * width + x) * 4);
      }
    return { width, height, data: out };
  }
  if (channels < 1 || channels > 4) throw new ImageError(name, `${name}: PNG with ${channels} channels`);
  const eight = to8Bit(depth);
  const grey = channels <= 2;
  const hasAlpha = channels === 2 || channels === 4;
  // tRNS on grey / RGB images names one colour (at the stored depth) that is fully transparent.
  const key = png.transparency && !hasAlpha && png.transparency.length >= (grey ? 1 : 3) ? png.transparency : undefined;
  for (let y = 0; y < height; y++)
    for (let x = 0; x < width; x++) {
      const s = x * channels;
      const o = (y * width + x) * 4;
      const r = read(y, s);
      const g = grey ? r : read(y, s + 1);
      const b = grey ? r : read(y, s + 2);
      let a = hasAlpha ? eight(read(y, s + channels - 1)) : 255;
      if (key && r === key[0] && (grey || (g === key[1] && b === key[2]))) a = 0;
      out[o] = eight(r);
      out[o + 1] = eight(g);
      out[o + 2] = eight(b);
      out[o + 3] = a;
    }
  return { width, height, data: out };
}

// ---------------------------------------------------------------------------------------------------------
// WebP: @jsquash/webp's decode.js exports init(module?) and decode(buffer). Left to itself it fetches
// webp_dec.wasm from a URL beside the script, which Node cannot do, so compile the wasm file from
// node_modules once and hand the WebAssembly.Module to init (its emscripten glue then instantiates that
// module instead of fetching). The package has no "exports" map, so require.resolve finds the file.

let webpReady: Promise<void> | undefined;

function ensureWebp(): Promise<void> {
  webpReady ??= (async () => {
    const wasmPath = createRequire(import.meta.url).resolve('@jsquash/webp/codec/dec/webp_dec.wasm');
    const module = await WebAssembly.compile(await readFile(wasmPath));
    // The published .d.ts only declares init(options); the JS also takes the module first (see decode.js).
    await (initWebpModule as unknown as (m: WebAssembly.Module) => Promise<void>)(module);
  })();
  return webpReady;
}

async function decodeWebpRgba(bytes: Uint8Array): Promise<RgbaImage> {
  await ensureWebp();
  // The decoder copies from an ArrayBuffer: pass exactly our bytes, not the whole underlying buffer.
  const buffer = bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength) as ArrayBuffer;
  const img = await decodeWebp(buffer);
  return { width: img.width, height: img.height, data: img.data };
}

// ---------------------------------------------------------------------------------------------------------

async function decodeRaw(bytes: Uint8Array, kind: ImageKind, name: string): Promise<RgbaImage> {
  try {
    if (kind === 'jpeg') return decodeJpegRgba(bytes);
    if (kind === 'png') return pngToRgba(decodePng(bytes), name);
    return await decodeWebpRgba(bytes);
  } catch (e) {
    if (e instanceof ImageError) throw e;
    const why = e instanceof Error ? e.message : String(e);
    throw new ImageError(name, `${name}: could not decode the ${KIND_NAME[kind]} (${why})`);
  }
}

/**
 * Decodes a JPEG, PNG or WebP file to RGBA8, upright (EXIF orientation applied). The header is checked
 * first, so an oversized image (> MAX_DECODE_PIXELS) or a truncated file is refused before any decoding.
 */
export async function decodeImageNode(bytes: Uint8Array, name: string): Promise<RgbaImage> {
  const kind = sniffImage(bytes, name);
  const size = imageSize(bytes, kind, name);
  assertDecodable(size, name);
  assertComplete(bytes, kind, name);
  const orientation: Orientation = exifOrientation(bytes, kind);
  const img = await decodeRaw(bytes, kind, name);
  if (img.width !== size.width || img.height !== size.height)
    throw new ImageError(name, `${name}: the header says ${size.width}x${size.height} but the decoder returned ${img.width}x${img.height}`);
  return applyOrientation(img, orientation);
}

// ---------------------------------------------------------------------------------------------------------
// Files and folders.

export interface LoadedImage {
  /** File name (no folder). */
  name: string;
  path: string;
  /** Upright pixels. */
  image: RgbaImage;
  /** From a same-named .txt beside the image (kohya convention), when there is one. */
  caption?: string;
}

const stem = (file: string) => basename(file, extname(file));

/** The caption file's first line, trimmed (kohya reads only the first line); undefined when absent or empty. */
async function readCaption(path: string): Promise<string | undefined> {
  let text: string;
  try {
    text = await readFile(path, 'utf8');
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code === 'ENOENT') return undefined;
    throw e;
  }
  const first = text.replace(/^\uFEFF/, '').split(/\r?\n/)[0].trim();
  return first === '' ? undefined : first;
}

/** One image file, decoded upright, with its caption if `<stem>.txt` sits beside it. */
export async function loadImageFile(path: string): Promise<LoadedImage> {
  const name = basename(path);
  let bytes: Uint8Array;
  try {
    bytes = await readFile(path);
  } catch (e) {
    throw new ImageError(name, `${name}: cannot read ${path} (${(e as Error).message})`);
  }
  const image = await decodeImageNode(bytes, name);
  const caption = extname(path).toLowerCase() === '.txt' ? undefined : await readCaption(join(path, '..', `${stem(path)}.txt`));
  return caption === undefined ? { name, path, image } : { name, path, image, caption };
}

export interface ImageDirResult {
  /** Every image that decoded, in file-name order. */
  images: LoadedImage[];
  /** One per file that is not a usable image, each naming its file; the others still load. */
  errors: ImageError[];
}

/**
 * Every file of a folder (not recursive), sorted by name (plain code-unit order, the same on every machine,
 * so a seeded training run sees the same order everywhere). A .txt with the stem of another file there is
 * that file's caption, not an image; hidden files (.DS_Store, ._photo.jpg from macOS) are skipped; any other
 * file that is not a JPEG, PNG or WebP becomes an ImageError naming it.
 */
export async function loadImageDir(dir: string): Promise<ImageDirResult> {
  const entries = await readdir(dir, { withFileTypes: true });
  const files = entries.filter((e) => e.isFile() && !e.name.startsWith('.')).map((e) => e.name);
  files.sort((a, b) => (a < b ? -1 : a > b ? 1 : 0));
  const isTxt = (f: string) => extname(f).toLowerCase() === '.txt';
  const imageStems = new Set(files.filter((f) => !isTxt(f)).map(stem));
  const images: LoadedImage[] = [];
  const errors: ImageError[] = [];
  for (const file of files) {
    if (isTxt(file) && imageStems.has(stem(file))) continue; // a caption
    try {
      images.push(await loadImageFile(join(dir, file)));
    } catch (e) {
      errors.push(e instanceof ImageError ? e : new ImageError(file, `${file}: ${(e as Error).message}`));
    }
  }
  return { images, errors };
}
