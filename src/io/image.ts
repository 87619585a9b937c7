// Instance / class images for DreamBooth, host-neutral part (no DOM, no node:*): recognising the file,
// reading its size and EXIF orientation from the header alone, the eight EXIF transforms, checks on a set
// of images, and turning a decoded RGBA image into the [3, R, R] tensor in [-1, 1] the VAE encoder takes.
// Decoding itself is per host: image-node.ts (jpeg-js, fast-png, @jsquash/webp) and image-browser.ts
// (createImageBitmap).

export type ImageKind = 'jpeg' | 'png' | 'webp';
/** EXIF orientation: 1 = as stored; 2..8 = the flips and quarter turns that display the image upright. */
export type Orientation = 1 | 2 | 3 | 4 | 5 | 6 | 7 | 8;

/** Decoded pixels, row-major, 4 bytes per pixel (R, G, B, A; straight, not premultiplied alpha). */
export interface RgbaImage {
  width: number;
  height: number;
  data: Uint8ClampedArray | Uint8Array;
}

export interface ImageSize {
  width: number;
  height: number;
}

/** A square crop in the pixels of the oriented image; may be fractional (e.g. after `scaleCrop`). */
export interface CropBox {
  x: number;
  y: number;
  size: number;
}

/** Every problem with an image file; the message always names the file. */
export class ImageError extends Error {
  override readonly name = 'ImageError';
  constructor(
    readonly file: string,
    message: string,
  ) {
    super(message);
  }
}

/** Node refuses to decode more pixels than this (RGBA alone is 200 MB at 50 MP; the browser downscales instead). */
export const MAX_DECODE_PIXELS = 50_000_000;
/** The most images in one set: DreamBooth wants 3-5 of a subject; far more is almost always a mistake. */
export const MAX_IMAGES = 50;
/**
 * Sides below this come out blurry at SD's resolutions (512 and up: upscaled 2x or more): a warning, not an
 * error. For a smaller training resolution the bar is half of it instead (see checkImageSet).
 */
const MIN_RECOMMENDED_SIDE = 256;

/** How a format is written in messages. */
export const KIND_NAME: Readonly<Record<ImageKind, string>> = { jpeg: 'JPEG', png: 'PNG', webp: 'WebP' };

// ---------------------------------------------------------------------------------------------------------
// Byte helpers. Every read is bounds-checked by the caller (`need`), so a short file is "truncated", never
// an undefined read that turns into NaN sizes.

const u16be = (b: Uint8Array, p: number) => (b[p] << 8) | b[p + 1];
const u16le = (b: Uint8Array, p: number) => b[p] | (b[p + 1] << 8);
const u24le = (b: Uint8Array, p: number) => b[p] | (b[p + 1] << 8) | (b[p + 2] << 16);
const u32be = (b: Uint8Array, p: number) => ((b[p] << 24) | (b[p + 1] << 16) | (b[p + 2] << 8) | b[p + 3]) >>> 0;
const u32le = (b: Uint8Array, p: number) => (b[p] | (b[p + 1] << 8) | (b[p + 2] << 16) | (b[p + 3] << 24)) >>> 0;
const fourcc = (b: Uint8Array, p: number) => String.fromCharCode(b[p], b[p + 1], b[p + 2], b[p + 3]);

function startsWith(bytes: Uint8Array, magic: readonly number[], at = 0): boolean {
  if (bytes.length < at + magic.length) return false;
  return magic.every((m, i) => bytes[at + i] === m);
}

function hex(bytes: Uint8Array): string {
  return Array.from(bytes, (b) => b.toString(16).padStart(2, '0')).join(' ');
}

function truncated(name: string, kind: ImageKind, where: string): ImageError {
  return new ImageError(name, `${name} is truncated: the ${KIND_NAME[kind]} ends ${where} (the file was probably cut short while copying or downloading)`);
}

function corrupt(name: string, kind: ImageKind, what: string): ImageError {
  return new ImageError(name, `${name} is not a valid ${KIND_NAME[kind]}: ${what}`);
}

// ---------------------------------------------------------------------------------------------------------
// Recognising the format.

const JPEG_MAGIC = [0xff, 0xd8, 0xff];
const PNG_MAGIC = [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a];
const RIFF_MAGIC = [0x52, 0x49, 0x46, 0x46]; // "RIFF", then a 4-byte size, then "WEBP"
const WEBP_MAGIC = [0x57, 0x45, 0x42, 0x50];

/** Formats people drop by mistake, named in the error so they know what to convert. */
function otherFormat(b: Uint8Array): string | undefined {
  if (startsWith(b, [0x47, 0x49, 0x46, 0x38])) return 'GIF';
  if (startsWith(b, [0x42, 0x4d])) return 'BMP';
  if (startsWith(b, [0x49, 0x49, 0x2a, 0x00]) || startsWith(b, [0x4d, 0x4d, 0x00, 0x2a])) return 'TIFF (or a camera RAW file)';
  if (startsWith(b, [0x25, 0x50, 0x44, 0x46])) return 'PDF';
  if (b.length >= 12 && fourcc(b, 4) === 'ftyp') {
    const brand = fourcc(b, 8);
    if (brand.startsWith('avi')) return 'AVIF';
    if (/^(hei|hev|mif1|msf1)/.test(brand)) return 'HEIC/HEIF (the iPhone default)';
    return 'an ISO media file (MP4/MOV/HEIC)';
  }
  if (startsWith(b, RIFF_MAGIC) && b.length >= 12) return `a RIFF ${fourcc(b, 8).trim()} file, not WebP`;
  return undefined;
}

/** True when the first KiB is valid UTF-8 with no control characters other than whitespace. */
function looksLikeText(b: Uint8Array): boolean {
  const head = b.subarray(0, 1024);
  try {
    // stream: true so a multi-byte character cut at the 1 KiB boundary is not an error.
    const text = new TextDecoder('utf-8', { fatal: true }).decode(head, { stream: true });
    // eslint-disable-next-line no-control-regex -- control characters are what this test looks for
    return !/[\u0000-\u0008\u000b\u000e-\u001f\u007f]/.test(text);
  } catch {
    return false;
  }
}

/** The format from the magic bytes (never the file extension: phones save HEIC as .jpg, sites WebP as .png). */
export function sniffImage(bytes: Uint8Array, name: string): ImageKind {
  if (bytes.length === 0) throw new ImageError(name, `${name} is empty (0 bytes)`);
  if (startsWith(bytes, JPEG_MAGIC)) return 'jpeg';
  if (startsWith(bytes, PNG_MAGIC)) return 'png';
  if (startsWith(bytes, RIFF_MAGIC) && startsWith(bytes, WEBP_MAGIC, 8)) return 'webp';
  // A file shorter than the signature it starts with was cut off, not of another kind.
  const prefixOf = (magic: readonly number[]) => bytes.length >= 2 && bytes.length < magic.length && bytes.every((b, i) => b === magic[i]);
  const riffCut = bytes.length < 12 && (prefixOf(RIFF_MAGIC) || startsWith(bytes, RIFF_MAGIC));
  const cut: ImageKind | undefined = prefixOf(JPEG_MAGIC) ? 'jpeg' : prefixOf(PNG_MAGIC) ? 'png' : riffCut ? 'webp' : undefined;
  if (cut) throw new ImageError(name, `${name} is truncated (${bytes.length} bytes): it starts like a ${KIND_NAME[cut]} but ends inside its signature`);
  if (looksLikeText(bytes)) throw new ImageError(name, `${name} is a text file, not an image`);
  const other = otherFormat(bytes);
  const hint = other ? `; it looks like ${other}: convert it to JPEG or PNG first` : '';
  throw new ImageError(name, `${name}: not a JPEG, PNG or WebP image (starts with ${hex(bytes.subarray(0, 12))}${hint})`);
}

// ---------------------------------------------------------------------------------------------------------
// Size from the header.

/** SOFn markers carry the frame size; C4 (DHT), C8 (reserved) and CC (DAC) share the range but are not frames. */
const isSof = (m: number) => m >= 0xc0 && m <= 0xcf && m !== 0xc4 && m !== 0xc8 && m !== 0xcc;
/** Markers without a length field: SOI, TEM and the restart markers. */
const isStandalone = (m: number) => m === 0xd8 || m === 0x01 || (m >= 0xd0 && m <= 0xd7);

interface JpegSegment {
  marker: number;
  /** Offset of the payload (after the two length bytes). */
  start: number;
  /** Offset just past the payload. */
  end: number;
}

/**
 * Walks the JPEG's marker segments from SOI up to and including the first SOS, calling `visit` for each;
 * stops early when `visit` returns true. Throws ImageError when the file ends or is malformed first.
 */
function walkJpeg(b: Uint8Array, name: string, visit: (s: JpegSegment) => boolean): void {
  let p = 2;
  for (;;) {
    if (p >= b.length) throw truncated(name, 'jpeg', 'before its frame header');
    if (b[p] !== 0xff) throw corrupt(name, 'jpeg', `expected a marker at byte ${p}, found ${hex(b.subarray(p, p + 2))}`);
    while (b[p] === 0xff && p < b.length) p++; // any number of 0xFF fill bytes may precede a marker
    if (p >= b.length) throw truncated(name, 'jpeg', 'before its frame header');
    const marker = b[p++];
    if (isStandalone(marker)) continue;
    if (marker === 0xd9) throw corrupt(name, 'jpeg', 'it ends (EOI) before any image data');
    if (p + 2 > b.length) throw truncated(name, 'jpeg', 'inside a marker segment');
    const len = u16be(b, p);
    if (len < 2) throw corrupt(name, 'jpeg', `segment length ${len} at byte ${p}`);
    const seg = { marker, start: p + 2, end: p + len };
    if (seg.end > b.length) throw truncated(name, 'jpeg', 'inside a marker segment');
    if (visit(seg) || marker === 0xda) return;
    p = seg.end;
  }
}

function jpegSize(b: Uint8Array, name: string): ImageSize {
  let size: ImageSize | undefined;
  walkJpeg(b, name, (s) => {
    if (!isSof(s.marker)) return false;
    if (s.end - s.start < 5) throw corrupt(name, 'jpeg', 'frame header too short');
    // SOF payload: precision (1), height (2), width (2), components...
    size = { height: u16be(b, s.start + 1), width: u16be(b, s.start + 3) };
    return true;
  });
  if (!size) throw corrupt(name, 'jpeg', 'image data (SOS) starts before any frame header (SOF)');
  if (size.height === 0) throw new ImageError(name, `${name}: JPEGs whose height is given after the image data (DNL marker) are not supported`);
  return size;
}

function pngSize(b: Uint8Array, name: string): ImageSize {
  // Signature (8), then the IHDR chunk: length (4), "IHDR", width (4), height (4), ...
  if (b.length < 24) throw truncated(name, 'png', 'before its IHDR header');
  if (fourcc(b, 12) !== 'IHDR') throw corrupt(name, 'png', 'the first chunk is not IHDR');
  return { width: u32be(b, 16), height: u32be(b, 20) };
}

function webpSize(b: Uint8Array, name: string): ImageSize {
  if (b.length < 30) throw truncated(name, 'webp', 'before its image header');
  const chunk = fourcc(b, 12);
  if (chunk === 'VP8X') {
    // Extended: flags (1), reserved (3), canvas width - 1 (24 bits LE), canvas height - 1 (24 bits LE).
    return { width: u24le(b, 24) + 1, height: u24le(b, 27) + 1 };
  }
  if (chunk === 'VP8 ') {
    // Lossy key frame: 3-byte frame tag, start code 9d 01 2a, then 14-bit width and height (top 2 bits: upscale hint).
    if (!startsWith(b, [0x9d, 0x01, 0x2a], 23)) throw corrupt(name, 'webp', 'VP8 key frame start code missing');
    return { width: u16le(b, 26) & 0x3fff, height: u16le(b, 28) & 0x3fff };
  }
  if (chunk === 'VP8L') {
    // Lossless: signature 0x2f, then 14 bits width - 1 and 14 bits height - 1, little-endian bit order.
    if (b[20] !== 0x2f) throw corrupt(name, 'webp', 'VP8L signature missing');
    const bits = u32le(b, 21);
    return { width: (bits & 0x3fff) + 1, height: ((bits >>> 14) & 0x3fff) + 1 };
  }
  throw corrupt(name, 'webp', `unknown first chunk "${chunk}"`);
}

/** Stored width and height (before EXIF orientation) from the header alone, without decoding. */
export function imageSize(bytes: Uint8Array, kind: ImageKind, name = 'image'): ImageSize {
  const size = kind === 'jpeg' ? jpegSize(bytes, name) : kind === 'png' ? pngSize(bytes, name) : webpSize(bytes, name);
  if (size.width === 0 || size.height === 0) throw corrupt(name, kind, `it declares a ${size.width}x${size.height} image`);
  return size;
}

/** The size as displayed: orientations 5-8 swap width and height (they include a quarter turn). */
export function orientedSize(size: ImageSize, orientation: Orientation): ImageSize {
  return orientation >= 5 ? { width: size.height, height: size.width } : { width: size.width, height: size.height };
}

/** Throws before any decoding when the image has more pixels than this host will decode. */
export function assertDecodable(size: ImageSize, name: string, maxPixels = MAX_DECODE_PIXELS): void {
  const pixels = size.width * size.height;
  if (pixels <= maxPixels) return;
  const mp = (n: number) => (n / 1e6).toFixed(1);
  throw new ImageError(
    name,
    `${name} is ${size.width}x${size.height} (${mp(pixels)} MP), too large to decode here (limit ${mp(maxPixels)} MP); ` +
      'downscale it first: 2048 px on the long side is plenty for training at 512 or 768',
  );
}

/**
 * Throws when the file stops before its end, which the decoders tolerate differently (jpeg-js and browsers
 * paint the missing rows grey): a half-grey photo would silently poison training.
 */
export function assertComplete(bytes: Uint8Array, kind: ImageKind, name: string): void {
  if (kind === 'jpeg') {
    let scan = 0;
    let frame: JpegSegment | undefined;
    walkJpeg(bytes, name, (s) => {
      if (s.marker === 0xda) scan = s.end;
      else if (isSof(s.marker)) frame ??= s;
      return false;
    });
    // Entropy-coded data cannot contain FF D9 (a data 0xFF is stuffed as FF 00, markers inside are RSTn), so an
    // EOI anywhere after the first scan is the real end. Search backwards: it is normally the last two bytes,
    // though some cameras append data after it.
    let end = -1;
    for (let p = bytes.length - 2; p >= scan && end < 0; p--) if (bytes[p] === 0xff && bytes[p + 1] === 0xd9) end = p;
    if (end < 0) throw truncated(name, 'jpeg', 'before its end-of-image marker');
    if (frame) tooSmall(name, 'jpeg', end - scan, jpegMinDataBytes(bytes, frame));
  } else if (kind === 'png') {
    let idat = 0;
    for (let p = 8; ;) {
      if (p + 8 > bytes.length) throw truncated(name, 'png', 'before its IEND chunk');
      const len = u32be(bytes, p);
      const type = fourcc(bytes, p + 4);
      if (p + 12 + len > bytes.length) throw truncated(name, 'png', `inside its ${type} chunk`);
      if (type === 'IDAT') idat += len;
      if (type === 'IEND') return tooSmall(name, 'png', idat, pngMinDataBytes(bytes));
      p += 12 + len;
    }
  } else {
    // RIFF size counts everything after the first 8 bytes; extra bytes after it are harmless.
    if (bytes.length < 8 + u32le(bytes, 4)) throw truncated(name, 'webp', `after ${bytes.length} of ${8 + u32le(bytes, 4)} bytes`);
  }
}

/**
 * A file whose compressed data is smaller than any encoder could make its declared pixels is damaged (a size
 * field corrupted, or a crafted "bomb"): refused before a decoder allocates and works through the declared
 * size. (WebP has no such bound: a lossless WebP of one colour codes its pixels in zero bits.)
 */
function tooSmall(name: string, kind: ImageKind, have: number, need: number): void {
  if (have < need)
    throw corrupt(
      name,
      kind,
      `${have} bytes of image data cannot hold the pixels its header declares (at least ${need} bytes): the header is damaged or the file cut short`,
    );
}

/**
 * Huffman-coded JPEG (SOF0-3, 5-7) codes each 8x8 block of every component with at least one bit (the DC
 * coefficient's code; Huffman codes are 1 to 16 bits), in sequential and progressive files alike. Component c
 * with sampling factors (Hc, Vc) covers ceil(w * Hc / Hmax) x ceil(h * Vc / Vmax) pixels. Arithmetic-coded
 * frames (SOF9 and up) can go below a bit per block and are not bounded.
 */
function jpegMinDataBytes(b: Uint8Array, sof: JpegSegment): number {
  if (sof.marker >= 0xc8 || sof.end - sof.start < 6) return 0;
  const height = u16be(b, sof.start + 1);
  const width = u16be(b, sof.start + 3);
  const n = b[sof.start + 5];
  if (sof.end - sof.start < 6 + 3 * n) return 0;
  const factors = Array.from({ length: n }, (_, i) => ({ h: b[sof.start + 7 + 3 * i] >> 4, v: b[sof.start + 7 + 3 * i] & 15 }));
  const hMax = Math.max(1, ...factors.map((f) => f.h));
  const vMax = Math.max(1, ...factors.map((f) => f.v));
  let blocks = 0;
  for (const f of factors) blocks += Math.ceil(Math.ceil((width * f.h) / hMax) / 8) * Math.ceil(Math.ceil((height * f.v) / vMax) / 8);
  return Math.floor(blocks / 8);
}

/**
 * Deflate codes at most 258 bytes (a longest match) in 2 bits (1-bit length and distance codes), so the IDAT
 * data of a PNG is at least 1/1032 of its filtered rows: height x (1 filter byte + the row's packed samples).
 * Interlaced images have more rows, so this bounds them too.
 */
function pngMinDataBytes(b: Uint8Array): number {
  if (b.length < 26) return 0;
  const channels = ({ 0: 1, 2: 3, 3: 1, 4: 2, 6: 4 } as Record<number, number>)[b[25]];
  if (channels === undefined) return 0;
  const raw = u32be(b, 20) * (1 + Math.ceil((u32be(b, 16) * channels * b[24]) / 8));
  return Math.floor(raw / 1032);
}

// ---------------------------------------------------------------------------------------------------------
// EXIF orientation. Hand-parsed because only one tag matters and an EXIF library would be most of the bundle.

/**
 * Orientation from a TIFF block (the body of every EXIF container): byte order "II" (little-endian) or "MM"
 * (big-endian), 42, offset of IFD0; IFD0 = entry count, then 12-byte entries (tag, type, count, value).
 * Orientation is tag 0x0112, type SHORT, whose value sits in the first two bytes of the value field.
 */
function tiffOrientation(t: Uint8Array): Orientation {
  if (t.length < 8) return 1;
  const le = t[0] === 0x49 && t[1] === 0x49;
  if (!le && !(t[0] === 0x4d && t[1] === 0x4d)) return 1;
  const dv = new DataView(t.buffer, t.byteOffset, t.byteLength);
  if (dv.getUint16(2, le) !== 42) return 1;
  const ifd = dv.getUint32(4, le);
  if (ifd + 2 > t.length) return 1;
  const count = dv.getUint16(ifd, le);
  for (let i = 0; i < count; i++) {
    const e = ifd + 2 + 12 * i;
    if (e + 12 > t.length) return 1;
    if (dv.getUint16(e, le) !== 0x0112) continue;
    const type = dv.getUint16(e + 2, le);
    // SHORT per the spec; a few writers use LONG, which is unambiguous, so accept it too.
    const value = type === 3 ? dv.getUint16(e + 8, le) : type === 4 ? dv.getUint32(e + 8, le) : 0;
    return value >= 1 && value <= 8 ? (value as Orientation) : 1;
  }
  return 1;
}

const EXIF_HEADER = [0x45, 0x78, 0x69, 0x66, 0x00, 0x00]; // "Exif\0\0"

function jpegExif(b: Uint8Array): Uint8Array | undefined {
  let exif: Uint8Array | undefined;
  walkJpeg(b, 'image', (s) => {
    // APP1 also holds XMP ("http://ns.adobe.com/xap/1.0/"): only the one that starts "Exif\0\0" is EXIF.
    if (s.marker === 0xe1 && startsWith(b.subarray(s.start, s.end), EXIF_HEADER)) exif = b.subarray(s.start + 6, s.end);
    return exif !== undefined;
  });
  return exif;
}

function pngExif(b: Uint8Array): Uint8Array | undefined {
  // eXIf (PNG 1.5 extension). Chrome only honours it before the first IDAT, so stop there to agree with it.
  for (let p = 8; p + 8 <= b.length;) {
    const len = u32be(b, p);
    const type = fourcc(b, p + 4);
    if (type === 'IDAT' || type === 'IEND') return undefined;
    if (type === 'eXIf') return b.subarray(p + 8, Math.min(b.length, p + 8 + len));
    p += 12 + len;
  }
  return undefined;
}

function webpExif(b: Uint8Array): Uint8Array | undefined {
  // Only the extended layout (VP8X) can carry EXIF, and its flags must announce it (bit 3): libwebp-based
  // decoders such as Chrome's look at the chunk only then.
  if (b.length < 30 || fourcc(b, 12) !== 'VP8X' || (b[20] & 0x08) === 0) return undefined;
  for (let p = 12; p + 8 <= b.length;) {
    const len = u32le(b, p + 4);
    if (fourcc(b, p) === 'EXIF') {
      const body = b.subarray(p + 8, Math.min(b.length, p + 8 + len));
      // The spec says raw TIFF, but some tools keep JPEG's "Exif\0\0" prefix.
      return startsWith(body, EXIF_HEADER) ? body.subarray(6) : body;
    }
    p += 8 + len + (len & 1); // chunks are padded to an even size
  }
  return undefined;
}

/** EXIF orientation 1..8; 1 when absent, and also when the EXIF is malformed (never throws). */
export function exifOrientation(bytes: Uint8Array, kind: ImageKind): Orientation {
  try {
    const tiff = kind === 'jpeg' ? jpegExif(bytes) : kind === 'png' ? pngExif(bytes) : webpExif(bytes);
    return tiff ? tiffOrientation(tiff) : 1;
  } catch {
    return 1;
  }
}

/** Format, stored size and orientation from the header; `width`/`height` are as displayed. */
export interface ImageInfo extends ImageSize {
  name: string;
  kind: ImageKind;
  orientation: Orientation;
  storedWidth: number;
  storedHeight: number;
}

export function probeImage(bytes: Uint8Array, name: string): ImageInfo {
  const kind = sniffImage(bytes, name);
  const stored = imageSize(bytes, kind, name);
  const orientation = exifOrientation(bytes, kind);
  return { name, kind, orientation, storedWidth: stored.width, storedHeight: stored.height, ...orientedSize(stored, orientation) };
}

// ---------------------------------------------------------------------------------------------------------
// The eight EXIF transforms.

/**
 * Where displayed pixel (x, y) comes from in the stored W x H image. The EXIF spec defines orientation by
 * where the stored row 0 / column 0 end up: 1 top/left, 2 top/right, 3 bottom/right, 4 bottom/left,
 * 5 left/top (transpose), 6 right/top (turn 90° clockwise), 7 right/bottom (transverse), 8 left/bottom
 * (turn 90° anticlockwise). Inverting each gives these source coordinates.
 */
function sourceOf(o: Orientation, x: number, y: number, w: number, h: number): [number, number] {
  switch (o) {
    case 1:
      return [x, y];
    case 2:
      return [w - 1 - x, y];
    case 3:
      return [w - 1 - x, h - 1 - y];
    case 4:
      return [x, h - 1 - y];
    case 5:
      return [y, x];
    case 6:
      return [y, h - 1 - x];
    case 7:
      return [w - 1 - y, h - 1 - x];
    case 8:
      return [w - 1 - y, x];
  }
}

/** The image as it should be displayed. Orientation 1 returns the input itself (no copy). */
export function applyOrientation(img: RgbaImage, o: Orientation): RgbaImage {
  if (o === 1) return img;
  const { width: w, height: h } = img;
  const out = orientedSize(img, o);
  // Move whole pixels as 32-bit words; copy to an aligned buffer first if the input view is not 4-aligned.
  const srcBytes = img.data.byteOffset % 4 === 0 ? img.data : new Uint8Array(img.data);
  const src = new Uint32Array(srcBytes.buffer, srcBytes.byteOffset, w * h);
  const data = new Uint8Array(w * h * 4);
  const dst = new Uint32Array(data.buffer);
  for (let y = 0; y < out.height; y++)
    for (let x = 0; x < out.width; x++) {
      const [sx, sy] = sourceOf(o, x, y, w, h);
      dst[y * out.width + x] = src[sy * w + sx];
    }
  return { width: out.width, height: out.height, data };
}

// ---------------------------------------------------------------------------------------------------------
// Crops.

/** The largest centred square; an odd leftover pixel goes after the crop (like torchvision's CenterCrop). */
export function centerCrop(size: ImageSize): CropBox {
  const side = Math.min(size.width, size.height);
  return { x: Math.floor((size.width - side) / 2), y: Math.floor((size.height - side) / 2), size: side };
}

/** `crop` resolved against an image of `size`, or an ImageError saying how it misses. */
export function resolveCrop(size: ImageSize, crop: CropBox | 'center' | undefined, name = 'image'): CropBox {
  if (crop === undefined || crop === 'center') return centerCrop(size);
  const { x, y, size: s } = crop;
  const describe = `crop {x: ${x}, y: ${y}, size: ${s}}`;
  if (![x, y, s].every(Number.isFinite)) throw new ImageError(name, `${name}: ${describe} has a non-finite value`);
  if (s < 1) throw new ImageError(name, `${name}: ${describe} is smaller than one pixel`);
  if (x < 0 || y < 0) throw new ImageError(name, `${name}: ${describe} starts outside the ${size.width}x${size.height} image (negative offset)`);
  // A little slack (1e-6 of the side): crops scaled between sizes (`scaleCrop`) land on the edge up to rounding.
  const eps = 1e-6 * Math.max(size.width, size.height);
  if (x + s > size.width + eps)
    throw new ImageError(name, `${name}: ${describe} does not fit in the ${size.width}x${size.height} image (x + size = ${x + s} > width ${size.width})`);
  if (y + s > size.height + eps)
    throw new ImageError(name, `${name}: ${describe} does not fit in the ${size.width}x${size.height} image (y + size = ${y + s} > height ${size.height})`);
  return { x, y, size: Math.min(s, size.width - x, size.height - y) };
}

/**
 * A crop chosen on an image of size `from` moved to the same image at size `to` (e.g. the UI shows the full
 * photo, the browser decoded it downscaled). One scale for both axes (from the short sides) keeps it square.
 */
export function scaleCrop(crop: CropBox, from: ImageSize, to: ImageSize): CropBox {
  const s = Math.min(to.width, to.height) / Math.min(from.width, from.height);
  const size = Math.min(crop.size * s, to.width, to.height);
  return { x: Math.min(crop.x * s, to.width - size), y: Math.min(crop.y * s, to.height - size), size };
}

// ---------------------------------------------------------------------------------------------------------
// Resampling: a square region of the image to R x R, separably (rows, then columns).

/** For one output pixel: the first source index and the weights of consecutive source pixels. */
interface Taps {
  first: number;
  weights: Float64Array;
}

/**
 * Downscaling (region `size` >= `out`): an exact box filter. Output pixel i covers the source interval
 * [start + i*f, start + (i+1)*f) with f = size/out; each source pixel j (the interval [j, j+1)) weighs its
 * overlap with it, divided by f. Every source pixel contributes exactly its area, so nothing aliases however
 * large the factor (4000 -> 512 averages ~61 pixels per output, where bilinear would sample 4 and alias).
 * This is OpenCV's INTER_AREA; for integer factors, plain block means. (PIL's BOX agrees only for integer
 * factors: it takes or leaves each source pixel whole, by whether its centre falls in the interval.)
 */
function boxTaps(start: number, size: number, out: number, limit: number): Taps[] {
  const f = size / out;
  return Array.from({ length: out }, (_, i) => {
    const a = start + (i * size) / out;
    const b = start + ((i + 1) * size) / out;
    const first = Math.floor(a);
    const last = Math.min(limit - 1, Math.ceil(b) - 1);
    const weights = new Float64Array(Math.max(1, last - first + 1));
    for (let j = first; j <= last; j++) weights[j - first] = Math.max(0, Math.min(b, j + 1) - Math.max(a, j)) / f;
    return { first, weights };
  });
}

/**
 * Upscaling (region `size` < `out`): bilinear with align_corners=false, PyTorch's and PIL's convention. Pixel
 * centres sit at half-integers, so output pixel i's centre, i + 0.5, maps to start + (i + 0.5)*f in source
 * edge coordinates, i.e. c = start + (i + 0.5)*f - 0.5 in source index coordinates; clamped to the region's
 * first and last pixel (PyTorch clamps to the input, which here is the crop), then linear between floor(c)
 * and floor(c) + 1.
 */
function bilinearTaps(start: number, size: number, out: number, limit: number): Taps[] {
  const f = size / out;
  const lo = start;
  const hi = Math.min(limit - 1, start + size - 1);
  return Array.from({ length: out }, (_, i) => {
    const c = Math.min(hi, Math.max(lo, start + (i + 0.5) * f - 0.5));
    const first = Math.floor(c);
    const t = c - first;
    if (t === 0 || first + 1 > limit - 1) return { first, weights: Float64Array.of(1) };
    return { first, weights: Float64Array.of(1 - t, t) };
  });
}

const taps = (start: number, size: number, out: number, limit: number) =>
  size >= out ? boxTaps(start, size, out, limit) : bilinearTaps(start, size, out, limit);

/** A rectangular region of the oriented image, in its pixels (may be fractional). */
export interface Region {
  x: number;
  y: number;
  width: number;
  height: number;
}

export interface PrepareOptions {
  /** Output side R (SD1: 512; SD2: 512 or 768) of a square output. */
  resolution: number;
  /** Square region in the oriented image's pixels; default: the centred largest square. */
  crop?: CropBox | 'center';
  /**
   * Instead of the square: a rectangular output (an aspect-ratio bucket, `bucketFor`) from a region of the same
   * aspect ratio (`bucketRegion`). Both or neither.
   */
  bucket?: { size: ImageSize; region: Region };
  /** Mirror left-right (augmentation). */
  flip?: boolean;
  /** What transparent pixels are composited over, 0-255 per channel; default white. */
  background?: readonly [number, number, number];
  /** For error messages. */
  name?: string;
}

/**
 * The model's input for one (already oriented) image: Float32Array [3, R, R], channel-first, x / 127.5 - 1
 * so 0..255 maps to -1..1 (what diffusers' ToTensor + Normalize([0.5], [0.5]) gives).
 *
 * Steps: crop the square, resample to R x R (box filter down, bilinear up), optionally mirror. Notes:
 * - Crop first, then resize, at full resolution (diffusers resizes the short side then centre-crops; the same
 *   region, but resampling only the crop is cheaper and exact).
 * - Alpha is composited over `background` before filtering. Filtering composited colours equals compositing
 *   filtered premultiplied colours (both are linear), so edges do not pick up the hidden colour of transparent
 *   pixels; and Chrome's canvas, which stores premultiplied alpha, loses that hidden colour anyway, so this is
 *   also what makes both hosts agree. (PIL's convert('RGB') just drops alpha and keeps whatever was hidden.)
 * - Values are not rounded back to 8 bits after resampling (PIL would): one quantisation fewer.
 * - Filtering happens on sRGB values, like PIL and torchvision, not in linear light.
 */
export function prepareImage(img: RgbaImage, opts: PrepareOptions): Float32Array {
  const { resolution: r, flip = false, background = [255, 255, 255], name = 'image' } = opts;
  if (!Number.isInteger(r) || r < 1) throw new ImageError(name, `${name}: resolution must be a positive integer, got ${r}`);
  if (img.data.length !== img.width * img.height * 4)
    throw new ImageError(name, `${name}: pixel buffer has ${img.data.length} bytes, expected ${img.width}x${img.height}x4`);
  const { width: outW, height: outH } = opts.bucket?.size ?? { width: r, height: r };
  const region = opts.bucket ? checkRegion(img, opts.bucket.region, name) : squareRegion(resolveCrop(img, opts.crop, name));
  const xs = taps(region.x, region.width, outW, img.width);
  const ys = taps(region.y, region.height, outH, img.height);

  // Horizontal pass over only the source rows that the vertical taps read, into rows x outW x 3 floats.
  const row0 = ys[0].first;
  const row1 = Math.max(...ys.map((t) => t.first + t.weights.length - 1));
  const rows = row1 - row0 + 1;
  const tmp = new Float32Array(rows * outW * 3);
  const d = img.data;
  const [bgR, bgG, bgB] = background;
  for (let yy = 0; yy < rows; yy++) {
    const rowBase = (row0 + yy) * img.width;
    for (let x = 0; x < outW; x++) {
      const { first, weights } = xs[x];
      let sr = 0;
      let sg = 0;
      let sb = 0;
      for (let k = 0; k < weights.length; k++) {
        const p = (rowBase + first + k) * 4;
        const a = d[p + 3] / 255;
        const w = weights[k];
        // Composite over the background: c*a + bg*(1 - a).
        sr += w * (d[p] * a + bgR * (1 - a));
        sg += w * (d[p + 1] * a + bgG * (1 - a));
        sb += w * (d[p + 2] * a + bgB * (1 - a));
      }
      const t = (yy * outW + x) * 3;
      tmp[t] = sr;
      tmp[t + 1] = sg;
      tmp[t + 2] = sb;
    }
  }

  // Vertical pass, scale to [-1, 1], write channel-first, mirrored if asked.
  const out = new Float32Array(3 * outW * outH);
  const plane = outW * outH;
  for (let y = 0; y < outH; y++) {
    const { first, weights } = ys[y];
    for (let x = 0; x < outW; x++) {
      let sr = 0;
      let sg = 0;
      let sb = 0;
      for (let k = 0; k < weights.length; k++) {
        const t = ((first - row0 + k) * outW + x) * 3;
        const w = weights[k];
        sr += w * tmp[t];
        sg += w * tmp[t + 1];
        sb += w * tmp[t + 2];
      }
      const o = y * outW + (flip ? outW - 1 - x : x);
      // Weights sum to 1 only up to rounding: clamp so the range is exactly [-1, 1].
      out[o] = clampUnit(sr / 127.5 - 1);
      out[plane + o] = clampUnit(sg / 127.5 - 1);
      out[2 * plane + o] = clampUnit(sb / 127.5 - 1);
    }
  }
  return out;
}

const clampUnit = (v: number) => (v < -1 ? -1 : v > 1 ? 1 : v);

const squareRegion = (c: CropBox): Region => ({ x: c.x, y: c.y, width: c.size, height: c.size });

/** `r` inside an image of `size` (up to rounding slack, like resolveCrop), or an ImageError saying how it misses. */
function checkRegion(size: ImageSize, r: Region, name: string): Region {
  const eps = 1e-6 * Math.max(size.width, size.height);
  const ok = [r.x, r.y, r.width, r.height].every(Number.isFinite) && r.width >= 1 && r.height >= 1 && r.x >= 0 && r.y >= 0;
  if (!ok || r.x + r.width > size.width + eps || r.y + r.height > size.height + eps)
    throw new ImageError(name, `${name}: region ${r.width}x${r.height} at (${r.x}, ${r.y}) does not fit in the ${size.width}x${size.height} image`);
  return { x: r.x, y: r.y, width: Math.min(r.width, size.width - r.x), height: Math.min(r.height, size.height - r.y) };
}

// ---------------------------------------------------------------------------------------------------------
// Aspect-ratio buckets (kohya sd-scripts, OneTrainer): a non-square photo trains at its own shape, at about the
// square's pixel count, instead of losing its sides to a centre crop.

/** Widest bucket aspect ratio (either way): past 2:1 a photo is cropped to it. */
const MAX_BUCKET_ASPECT = 2;

/**
 * The bucket a photo of `size` trains at: width and height multiples of `step` (the model's factor: VAE x UNet
 * down-sampling, 64 for SD), with width x height <= resolution^2 and an aspect ratio at most MAX_BUCKET_ASPECT,
 * the one whose aspect ratio is nearest the photo's (log distance; the larger area on a tie). A square photo gets
 * the resolution x resolution square.
 */
export function bucketFor(size: ImageSize, resolution: number, step: number): ImageSize {
  const area = resolution * resolution;
  const target = Math.log(size.width / size.height);
  let best: ImageSize = { width: resolution, height: resolution };
  let bestScore = Math.abs(target);
  for (let w = step; w <= resolution * MAX_BUCKET_ASPECT; w += step) {
    const h = Math.floor(area / w / step) * step;
    if (h < step || w / h > MAX_BUCKET_ASPECT || h / w > MAX_BUCKET_ASPECT) continue;
    const score = Math.abs(Math.log(w / h) - target);
    if (score < bestScore - 1e-12 || (Math.abs(score - bestScore) <= 1e-12 && w * h > best.width * best.height)) {
      best = { width: w, height: h };
      bestScore = score;
    }
  }
  return best;
}

/**
 * The region of a photo of `size` that fills `bucket`: the largest one of the bucket's aspect ratio, placed along
 * the photo's slack by `t` (0: left/top, 0.5: centred, 1: right/bottom). A square crop a user chose gives its
 * position along the long side (cropPosition).
 */
export function bucketRegion(size: ImageSize, bucket: ImageSize, t = 0.5): Region {
  const aspect = bucket.width / bucket.height;
  const width = Math.min(size.width, size.height * aspect);
  const height = Math.min(size.height, size.width / aspect);
  const u = Math.min(1, Math.max(0, t));
  return { x: (size.width - width) * u, y: (size.height - height) * u, width, height };
}

/** Where a square crop sits along the photo's long side, 0..1 (0.5 when the photo is square). */
export function cropPosition(size: ImageSize, crop: CropBox): number {
  const slack = Math.max(size.width, size.height) - crop.size;
  if (slack <= 0) return 0.5;
  return (size.width >= size.height ? crop.x : crop.y) / slack;
}

// ---------------------------------------------------------------------------------------------------------
// Browser decode size.

/**
 * The size the browser should decode a (displayed) width x height image to, or null for full size. Much
 * larger photos are resized inside createImageBitmap (libjpeg-turbo can even skip DCT work), so a 48 MP phone
 * picture never exists at full size in the tab. The short side becomes resolution x headroom: the default
 * headroom 2 leaves room to crop down to half the short side and still downscale, never upscale. The target
 * is exact, not limited to power-of-two reductions; the long side keeps the aspect ratio (rounded).
 */
export function decodeScale(width: number, height: number, resolution: number, headroom = 2): ImageSize | null {
  const target = Math.ceil(resolution * headroom);
  const short = Math.min(width, height);
  if (short <= target) return null;
  const s = target / short;
  return width <= height
    ? { width: target, height: Math.max(target, Math.round(height * s)) }
    : { width: Math.max(target, Math.round(width * s)), height: target };
}

// ---------------------------------------------------------------------------------------------------------
// Checks on a set of images (before training): errors block, warnings inform.

export interface ImageSetItem extends ImageSize {
  name: string;
  /** A user crop (not 'center') silences the non-square note. */
  crop?: CropBox | 'center';
}

export interface ImageSetReport {
  errors: string[];
  warnings: string[];
}

/** `width`/`height` are the displayed (oriented) sizes, e.g. from `probeImage`. */
export function checkImageSet(
  items: readonly ImageSetItem[],
  /** `buckets`: non-square photos train at their own aspect ratio (no "not square" note). */
  opts: { resolution?: number; maxImages?: number; buckets?: boolean } = {},
): ImageSetReport {
  const { resolution, maxImages = MAX_IMAGES } = opts;
  const errors: string[] = [];
  const warnings: string[] = [];
  if (items.length === 0) errors.push('add at least one image (3 to 5 photos of the subject work best)');
  else if (items.length === 1) warnings.push('only one image: training will work, but 3 to 5 photos from different angles generalise much better');
  if (items.length > maxImages)
    errors.push(`${items.length} images is too many (at most ${maxImages}); DreamBooth needs only 3 to 5 good photos of the subject`);
  // Sizes are judged against the training resolution: only an image that must be upscaled is worth a
  // warning (a 48 px photo is plenty for a 32 px model), and a blurry one is upscaled more than 2x.
  const blurryBelow = resolution === undefined ? MIN_RECOMMENDED_SIDE : Math.min(MIN_RECOMMENDED_SIDE, Math.ceil(resolution / 2));
  for (const it of items) {
    const short = Math.min(it.width, it.height);
    if (short < blurryBelow)
      warnings.push(
        `${it.name} is only ${it.width}x${it.height}; sides under ${blurryBelow} px come out blurry after upscaling, use a larger photo if you have one`,
      );
    else if (resolution !== undefined && short < resolution)
      warnings.push(`${it.name} is ${it.width}x${it.height}, smaller than ${resolution} px: it will be upscaled and slightly soft`);
    if (it.width !== it.height && !opts.buckets && (it.crop === undefined || it.crop === 'center'))
      warnings.push(`${it.name} is not square (${it.width}x${it.height}): it will be centre-cropped to ${short}x${short} unless you set a crop`);
  }
  return { errors, warnings };
}
