// Node host for image loading (CLI, tests): decode JPEG with jpeg-js, PNG with fast-png and WebP with
// @jsquash/webp (libwebp compiled to wasm), then apply the EXIF orientation, which none of them does. Plus
// loading a file or a whole folder of training images with kohya-style captions (photo.jpg + photo.txt).
import type { Dirent } from 'node:fs';
import { lstat, readdir, readFile, readlink, stat } from 'node:fs/promises';
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
import { CLIP_MAX_LENGTH } from './tokenizer.ts';

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
    // A decoder's own refusals are plain Errors that say what it found ("SOI not found", "invalid huffman
    // sequence"); a TypeError or RangeError is the decoder itself failing on data it did not expect, whose
    // wording ("Cannot read properties of undefined") says nothing about the file.
    const own = e instanceof Error && e.constructor === Error;
    const why = own ? e.message : 'its image data is damaged';
    throw new ImageError(name, `${name}: could not decode the ${KIND_NAME[kind]} (${why}): save it again or use another file`);
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

/** Where loaders report problems that do not stop loading (a bad caption file, say). */
export interface LoadOptions {
  /** Default: printed to stderr as "warning: ...", as the CLI prints its other warnings. */
  onWarning?: (message: string) => void;
  /**
   * A caption file that is not UTF-8 text or is empty is a CaptionError (naming the photo, the file and what to
   * do) instead of a warning: the photo's caption was meant, so training it with the prompt would be wrong.
   */
  refuseBadCaptions?: boolean;
}

/** A caption file beside a photo that cannot be its caption (not UTF-8 text, or empty): stops the load. */
export class CaptionError extends Error {
  override name = 'CaptionError';
}

const stderrWarning = (message: string) => console.error(`warning: ${message}`);

/** A caption longer than this is still used, with a warning: kohya captions are one short line. */
const CAPTION_WARN_BYTES = 4096;
/** A ".txt" larger than this is not a caption (a log or a book that happens to share the name): ignored. */
export const CAPTION_MAX_BYTES = 2 ** 20;
/** Prompt tokens the text encoder reads: 77 minus the start and end tokens. */
const CAPTION_TOKENS = CLIP_MAX_LENGTH - 2;
/**
 * CLIP's pre-tokenizer split (tokenizer.ts): every piece becomes at least one BPE token, so the count of
 * pieces is a lower bound on the caption's token count, exact enough to know it will be cut off.
 */
const CLIP_PIECES = /'s|'t|'re|'ve|'m|'ll|'d|\p{L}+|\p{N}|[^\s\p{L}\p{N}]+/gu;

/** A caption file's text, or why it is not text: UTF-8 (BOM optional), or UTF-16 with its BOM (Windows Notepad). */
function captionText(bytes: Uint8Array): string | undefined {
  const utf16 = bytes[0] === 0xff && bytes[1] === 0xfe ? 'utf-16le' : bytes[0] === 0xfe && bytes[1] === 0xff ? 'utf-16be' : undefined;
  try {
    if (utf16) return new TextDecoder(utf16, { fatal: true }).decode(bytes); // drops the BOM
    if (bytes.includes(0)) return undefined; // text has no NUL bytes; binary files nearly always do
    return new TextDecoder('utf-8', { fatal: true }).decode(bytes); // drops a UTF-8 BOM
  } catch {
    return undefined;
  }
}

/** Says so when `path` is a symlink whose target is missing (readFile just reports ENOENT). */
async function brokenLink(path: string): Promise<string | undefined> {
  try {
    if (!(await lstat(path)).isSymbolicLink()) return undefined;
    return `${basename(path)} is a broken link (${await readlink(path)} does not exist)`;
  } catch {
    return undefined;
  }
}

/**
 * The caption file's first line, trimmed (kohya reads only the first line); undefined when absent, empty or
 * unusable. Empty, unusable (binary, not UTF-8, a broken link, over CAPTION_MAX_BYTES) and suspicious (over
 * CAPTION_WARN_BYTES, or longer than the text encoder reads) files are reported through `warn`, naming them.
 */
async function readCaption(path: string, image: string, warn: (message: string) => void, refuse = false): Promise<string | undefined> {
  const file = basename(path);
  const where = join(path, '..');
  let bytes: Uint8Array;
  try {
    const st = await stat(path);
    if (!st.isFile()) {
      warn(`${file} is not a file (a folder or device), so not a caption: ignored, ${image} is trained with the prompt`);
      return undefined;
    }
    const size = st.size;
    if (size > CAPTION_MAX_BYTES) {
      warn(`${file} is ${(size / 2 ** 20).toFixed(1)} MiB, far too large for a caption: ignored, ${image} is trained with the prompt`);
      return undefined;
    }
    bytes = await readFile(path);
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code !== 'ENOENT') throw e;
    const broken = await brokenLink(path);
    if (broken) warn(`${broken}: ignored, ${image} is trained with the prompt`);
    return undefined;
  }
  const text = captionText(bytes);
  if (text === undefined && refuse)
    throw new CaptionError(
      `${file} in ${where} is not UTF-8 text (binary data or another encoding), so it cannot be the caption of ${image}: save it as UTF-8 text, or remove it to train ${image} with the prompt`,
    );
  if (text === undefined) {
    warn(`${file} is not a text file (binary data or not UTF-8): ignored as the caption of ${image}, which is trained with the prompt`);
    return undefined;
  }
  const first = text.split(/\r?\n/)[0].trim();
  if (first === '' && refuse)
    throw new CaptionError(
      `${file} in ${where} is empty (kohya reads its first line), so ${image} would have no caption: write its caption on the first line, or remove the file to train ${image} with the prompt`,
    );
  if (first === '') {
    warn(`${file} is empty (kohya reads its first line): ${image} is trained with the prompt; write its caption there, or remove the file`);
    return undefined;
  }
  const tokens = first.toLowerCase().match(CLIP_PIECES)?.length ?? 0;
  if (tokens > CAPTION_TOKENS)
    warn(
      `${file}: the caption is at least ${tokens} tokens long but the text encoder reads only ${CAPTION_TOKENS}; the rest is ignored (shorten it to what matters most, first)`,
    );
  else if (bytes.length > CAPTION_WARN_BYTES)
    warn(`${file} is ${(bytes.length / 1024).toFixed(1)} KiB, large for a caption: only its first line is used (kohya convention)`);
  return first;
}

/** One image file, decoded upright, with its caption if `<stem>.txt` sits beside it. */
export async function loadImageFile(path: string, opts: LoadOptions = {}): Promise<LoadedImage> {
  const name = basename(path);
  let bytes: Uint8Array;
  try {
    bytes = await readFile(path);
  } catch (e) {
    throw new ImageError(name, `${name}: cannot read ${path} (${(e as Error).message})`);
  }
  const image = await decodeImageNode(bytes, name);
  const caption =
    extname(path).toLowerCase() === '.txt'
      ? undefined
      : await readCaption(join(path, '..', `${stem(path)}.txt`), name, opts.onWarning ?? stderrWarning, opts.refuseBadCaptions);
  return caption === undefined ? { name, path, image } : { name, path, image, caption };
}

export interface ImageDirResult {
  /** Every image that decoded, in file-name order. */
  images: LoadedImage[];
  /** One per file that is not a usable image, each naming its file; the others still load. */
  errors: ImageError[];
}

/** A folder entry resolved through symlinks: a file to load, something to skip, or a link that is broken. */
async function resolveEntry(dir: string, entry: Dirent): Promise<'file' | 'skip' | ImageError> {
  if (entry.isFile()) return 'file';
  if (!entry.isSymbolicLink()) return 'skip'; // folders, sockets, devices
  const path = join(dir, entry.name);
  try {
    return (await stat(path)).isFile() ? 'file' : 'skip';
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).code;
    if (code === 'ELOOP') return new ImageError(entry.name, `${entry.name} is a link that loops back on itself: fix or remove it`);
    const broken = await brokenLink(path);
    return new ImageError(entry.name, broken ? `${broken}: fix or remove it` : `${entry.name}: cannot follow the link (${(e as Error).message})`);
  }
}

/**
 * Every file of a folder (not recursive), sorted by name (plain code-unit order, the same on every machine,
 * so a seeded training run sees the same order everywhere). Symlinks are followed (to files; a link to a
 * folder is skipped like a folder), and a broken one becomes an ImageError naming it. A .txt with the stem
 * of another file there is that file's caption, not an image (caption problems are reported through
 * `onWarning`); hidden files (.DS_Store, ._photo.jpg from macOS) are skipped; any other file that is not a
 * JPEG, PNG or WebP becomes an ImageError naming it.
 */
export async function loadImageDir(dir: string, opts: LoadOptions = {}): Promise<ImageDirResult> {
  const entries = (await readdir(dir, { withFileTypes: true })).filter((e) => !e.name.startsWith('.'));
  const files: string[] = [];
  const broken: ImageError[] = [];
  for (const e of entries) {
    const kind = await resolveEntry(dir, e);
    if (kind === 'file') files.push(e.name);
    else if (kind instanceof ImageError) broken.push(kind);
  }
  const byName = (a: string, b: string) => (a < b ? -1 : a > b ? 1 : 0);
  files.sort(byName);
  const isTxt = (f: string) => extname(f).toLowerCase() === '.txt';
  const imageStems = new Set([...files, ...broken.map((b) => b.file)].filter((f) => !isTxt(f)).map(stem));
  const images: LoadedImage[] = [];
  const errors: ImageError[] = [];
  for (const file of files) {
    if (isTxt(file) && imageStems.has(stem(file))) continue; // a caption
    try {
      images.push(await loadImageFile(join(dir, file), opts));
    } catch (e) {
      if (e instanceof CaptionError) throw e;
      errors.push(e instanceof ImageError ? e : new ImageError(file, `${file}: ${(e as Error).message}`));
    }
  }
  // A broken caption link is reported when its image loads (readCaption); every other broken link here.
  const brokenFiles = broken.filter((b) => !(isTxt(b.file) && imageStems.has(stem(b.file))));
  errors.push(...brokenFiles);
  errors.sort((a, b) => byName(a.file, b.file));
  return { images, errors };
}

/**
 * Refuses (CaptionError) the first caption file of `dir` that is not UTF-8 text or is empty, without decoding
 * any photo: the command line's check before any work. A caption is a `.txt` with the stem of a .jpg, .jpeg, .png
 * or .webp file (the loader refuses the rest of them as it decodes each photo).
 */
export async function checkCaptionFiles(dir: string): Promise<void> {
  const names = (await readdir(dir)).filter((n) => !n.startsWith('.')).sort();
  const isTxt = (f: string) => extname(f).toLowerCase() === '.txt';
  const txt = new Set(names.filter(isTxt));
  for (const image of names.filter((n) => /\.(jpe?g|png|webp)$/i.test(n))) {
    const caption = `${stem(image)}.txt`;
    if (txt.has(caption)) await readCaption(join(dir, caption), image, () => {}, true);
  }
}
