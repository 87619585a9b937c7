// Instance/class image loading: format sniffing with specific messages, header-only sizes and EXIF
// orientation (JPEG both byte orders, PNG eXIf, WebP EXIF; malformed EXIF is orientation 1), the eight EXIF
// transforms against the spec's definition, Node decoding of every format and PNG variant to RGBA8, the
// [3, R, R] tensor (crops, flip, exact box downscale, bilinear upscale, alpha), checks on a set of images,
// huge images refused from the header alone, and loading a folder with kohya captions and bad files.
// Fixtures: tests/fixtures/images (made by make-images.ts there; pattern and byte builders in craft.ts).
import assert from 'node:assert/strict';
import { copyFileSync, mkdirSync, mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { encode as encodePng } from 'fast-png';
import { decodeImageNode, loadImageDir, loadImageFile } from '../../src/io/image-node.ts';
import {
  applyOrientation,
  checkImageSet,
  decodeScale,
  exifOrientation,
  ImageError,
  imageSize,
  MAX_DECODE_PIXELS,
  orientedSize,
  prepareImage,
  probeImage,
  resolveCrop,
  scaleCrop,
  sniffImage,
  type CropBox,
  type ImageKind,
  type Orientation,
  type RgbaImage,
} from '../../src/io/image.ts';
import {
  ascii,
  concat,
  exifApp1,
  FIXTURE_HEIGHT as H,
  FIXTURE_WIDTH as W,
  jpegSegment,
  QUADRANTS,
  quadrant16,
  quadrantAlpha,
  quadrantColour,
  tiffWithOrientation,
  withPngChunk,
  withSegments,
  type Rgb,
} from '../fixtures/images/craft.ts';

const FIXTURES = join(import.meta.dirname, '../fixtures/images');
const fixture = (name: string) => new Uint8Array(readFileSync(join(FIXTURES, name)));

/** Lossy formats (JPEG at quality 95 with 4:4:4 sampling, WebP at q95) stay within this many levels of the
 * pattern away from the quadrant borders, where ringing lives; lossless formats must match exactly. */
const LOSSY_TOLERANCE = 8;
const LOSSY_MARGIN = 3;

function pixel(img: RgbaImage, x: number, y: number): number[] {
  const i = (y * img.width + x) * 4;
  return Array.from(img.data.subarray(i, i + 4));
}

/** Checks every pixel of one displayed quadrant (qx, qy in {0, 1}), `margin` pixels in from its borders. */
function assertQuadrant(img: RgbaImage, qx: number, qy: number, want: Rgb, tol: number, margin: number, alpha = 255): void {
  const hw = img.width / 2;
  const hh = img.height / 2;
  for (let y = qy * hh + margin; y < (qy + 1) * hh - margin; y++)
    for (let x = qx * hw + margin; x < (qx + 1) * hw - margin; x++) {
      const got = pixel(img, x, y);
      for (let c = 0; c < 3; c++) assert.ok(Math.abs(got[c] - want[c]) <= tol, `pixel (${x}, ${y}) channel ${c}: got ${got[c]}, want ${want[c]} ± ${tol}`);
      assert.equal(got[3], alpha, `alpha at (${x}, ${y})`);
    }
}

/** Displayed quadrants [TL, TR, BL, BR] for an orientation, from the EXIF spec's row-0/column-0 table. */
const DISPLAYED: Partial<Record<Orientation, Rgb[]>> = {
  1: [QUADRANTS.topLeft, QUADRANTS.topRight, QUADRANTS.bottomLeft, QUADRANTS.bottomRight],
  3: [QUADRANTS.bottomRight, QUADRANTS.bottomLeft, QUADRANTS.topRight, QUADRANTS.topLeft],
  // 6: stored row 0 becomes the right column, stored column 0 the top row.
  6: [QUADRANTS.bottomLeft, QUADRANTS.topLeft, QUADRANTS.bottomRight, QUADRANTS.topRight],
  // 8: stored row 0 becomes the left column, stored column 0 the bottom row.
  8: [QUADRANTS.topRight, QUADRANTS.bottomRight, QUADRANTS.topLeft, QUADRANTS.bottomLeft],
};

function assertPattern(img: RgbaImage, o: Orientation, tol: number, margin: number): void {
  assert.deepEqual([img.width, img.height], o >= 5 ? [H, W] : [W, H]);
  const quads = DISPLAYED[o]!;
  quads.forEach((want, i) => assertQuadrant(img, i % 2, i >> 1, want, tol, margin));
}

async function rejects(p: Promise<unknown> | (() => unknown), pattern: RegExp): Promise<ImageError> {
  let caught: unknown;
  try {
    await (typeof p === 'function' ? p() : p);
  } catch (e) {
    caught = e;
  }
  assert.ok(caught instanceof ImageError, `expected an ImageError, got ${String(caught)}`);
  assert.match(caught.message, pattern);
  return caught;
}

/** A PNG header claiming w x h: signature and IHDR only (the CRC is never checked: nothing is decoded). */
function pngHeader(w: number, h: number): Uint8Array {
  const b = new Uint8Array(33);
  b.set([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]);
  const dv = new DataView(b.buffer);
  dv.setUint32(8, 13);
  b.set(ascii('IHDR'), 12);
  dv.setUint32(16, w);
  dv.setUint32(20, h);
  b.set([8, 6, 0, 0, 0], 24);
  return b;
}

/** A JPEG header claiming w x h: SOI, then a baseline SOF0 for three components, then nothing. */
function jpegHeader(w: number, h: number): Uint8Array {
  return new Uint8Array([0xff, 0xd8, 0xff, 0xc0, 0, 17, 8, h >> 8, h & 0xff, w >> 8, w & 0xff, 3, 1, 0x11, 0, 2, 0x11, 1, 3, 0x11, 1]);
}

/** What follows a PNG header in a complete file: an IDAT whose zlib stream is garbage, then IEND. */
function pngBody(): Uint8Array {
  const chunk = (type: string, data: Uint8Array) => {
    const b = new Uint8Array(12 + data.length);
    new DataView(b.buffer).setUint32(0, data.length);
    b.set(ascii(type), 4);
    b.set(data, 8);
    return b; // CRCs left 0: fast-png fails on the data first
  };
  return concat(chunk('IDAT', new Uint8Array(64).fill(0x55)), chunk('IEND', new Uint8Array(0)));
}

/** What follows a baseline SOF0 in a complete JPEG: a scan header naming tables never defined, data, EOI. */
function jpegBody(): Uint8Array {
  return concat(jpegSegment(0xda, new Uint8Array([3, 1, 0, 2, 0x11, 3, 0x11, 0, 63, 0])), new Uint8Array(64).fill(0x55), new Uint8Array([0xff, 0xd9]));
}

describe('sniffImage', () => {
  it('recognises each format by its magic bytes, whatever the extension', () => {
    assert.equal(sniffImage(fixture('quadrants.jpg'), 'a.png'), 'jpeg');
    assert.equal(sniffImage(fixture('quadrants.png'), 'a.jpg'), 'png');
    assert.equal(sniffImage(fixture('quadrants.webp'), 'a.jpg'), 'webp');
    assert.equal(sniffImage(fixture('quadrants-lossy.webp'), 'a'), 'webp');
  });

  it('names the file and says what is wrong', async () => {
    await rejects(() => sniffImage(new Uint8Array(0), 'empty.jpg'), /^empty\.jpg is empty \(0 bytes\)$/);
    await rejects(() => sniffImage(fixture('notes.jpg'), 'notes.jpg'), /^notes\.jpg is a text file, not an image$/);
    await rejects(() => sniffImage(new TextEncoder().encode('a photo of sks dog'), 'notes.txt'), /^notes\.txt is a text file, not an image$/);
    await rejects(() => sniffImage(new Uint8Array([0xff, 0xd8]), 'cut.jpg'), /^cut\.jpg is truncated \(2 bytes\): it starts like a JPEG/);
    await rejects(() => sniffImage(new Uint8Array([0x89, 0x50, 0x4e, 0x47]), 'cut.png'), /cut\.png is truncated \(4 bytes\): it starts like a PNG/);
    const heic = concat(new Uint8Array([0, 0, 0, 0x18]), ascii('ftypheic'), new Uint8Array(16));
    await rejects(
      () => sniffImage(heic, 'photo.heic'),
      /^photo\.heic: not a JPEG, PNG or WebP image \(starts with 00 00 00 18 66 74 79 70 68 65 69 63; it looks like HEIC\/HEIF.*convert it to JPEG or PNG first\)$/,
    );
    await rejects(
      () => sniffImage(concat(ascii('GIF89a'), new Uint8Array([1, 0, 1, 0, 0x80, 0xff])), 'anim.gif'),
      /anim\.gif: not a JPEG, PNG or WebP image \(starts with 47 49 46 38 39 61.*GIF/,
    );
    await rejects(
      () => sniffImage(new Uint8Array([0, 1, 2, 3, 0xfe, 0xfd]), 'blob.bin'),
      /^blob\.bin: not a JPEG, PNG or WebP image \(starts with 00 01 02 03 fe fd\)$/,
    );
  });
});

describe('imageSize (header only)', () => {
  const cases: [string, ImageKind][] = [
    ['quadrants.jpg', 'jpeg'], // SOF0 after APP0 and DQT
    ['quadrants-o8.jpg', 'jpeg'], // after two APP1 segments
    ['quadrants.png', 'png'],
    ['quadrants.webp', 'webp'], // VP8L
    ['quadrants-lossy.webp', 'webp'], // VP8
    ['quadrants-o6.webp', 'webp'], // VP8X
  ];
  for (const [file, kind] of cases) it(`${file}: 48x32 stored`, () => assert.deepEqual(imageSize(fixture(file), kind, file), { width: W, height: H }));

  it('reports truncated headers', async () => {
    await rejects(() => imageSize(fixture('quadrants.jpg').subarray(0, 100), 'jpeg', 'a.jpg'), /^a\.jpg is truncated: the JPEG ends/);
    await rejects(() => imageSize(fixture('quadrants.png').subarray(0, 20), 'png', 'a.png'), /^a\.png is truncated: the PNG ends before its IHDR/);
    await rejects(() => imageSize(fixture('quadrants.webp').subarray(0, 25), 'webp', 'a.webp'), /^a\.webp is truncated: the WebP ends/);
  });

  it('reads sizes up to 65535 without decoding (the huge-image check relies on it)', () => {
    assert.deepEqual(imageSize(pngHeader(20000, 20000), 'png'), { width: 20000, height: 20000 });
    assert.deepEqual(imageSize(jpegHeader(20000, 12000), 'jpeg'), { width: 20000, height: 12000 });
  });

  it('probeImage gives the displayed size for rotated photos', () => {
    const info = probeImage(fixture('quadrants-o6.jpg'), 'o6.jpg');
    assert.deepEqual(info, { name: 'o6.jpg', kind: 'jpeg', orientation: 6, storedWidth: 48, storedHeight: 32, width: 32, height: 48 });
    assert.deepEqual(orientedSize({ width: 4, height: 3 }, 3), { width: 4, height: 3 });
    assert.deepEqual(orientedSize({ width: 4, height: 3 }, 7), { width: 3, height: 4 });
  });
});

describe('exifOrientation', () => {
  const cases: [string, ImageKind, Orientation][] = [
    ['quadrants.jpg', 'jpeg', 1],
    ['quadrants-o6.jpg', 'jpeg', 6], // little-endian, APP1 first, Make entry before Orientation
    ['quadrants-o3.jpg', 'jpeg', 3], // big-endian, after JFIF APP0
    ['quadrants-o8.jpg', 'jpeg', 8], // big-endian, behind an XMP APP1
    ['quadrants.png', 'png', 1],
    ['quadrants-o6.png', 'png', 6], // eXIf chunk before IDAT
    ['quadrants.webp', 'webp', 1],
    ['quadrants-o6.webp', 'webp', 6], // VP8X + EXIF chunk (webpmux)
  ];
  for (const [file, kind, o] of cases) it(`${file}: ${o}`, () => assert.equal(exifOrientation(fixture(file), kind), o));

  it('is 1, never a throw, for malformed EXIF', () => {
    const jpeg = fixture('quadrants.jpg');
    const withTiff = (tiff: Uint8Array) => withSegments(jpeg, false, exifApp1(tiff));
    const good = tiffWithOrientation(6, 'II', false);
    assert.equal(exifOrientation(withTiff(good), 'jpeg'), 6, 'the unmodified block reads 6');
    const badIfd = good.slice();
    new DataView(badIfd.buffer).setUint32(4, 9999, true); // IFD0 offset past the block
    const badMagic = good.slice();
    badMagic[2] = 43;
    const badValue = good.slice();
    new DataView(badValue.buffer).setUint16(18, 9, true); // orientation 9 does not exist
    const badOrder = good.slice();
    badOrder.set(ascii('XX'));
    for (const [what, tiff] of Object.entries({
      badIfd,
      badMagic,
      badValue,
      badOrder,
      cutEntry: good.subarray(0, 16),
      short: good.subarray(0, 5),
      empty: new Uint8Array(0),
    }))
      assert.equal(exifOrientation(withTiff(tiff), 'jpeg'), 1, what);
    // An APP1 whose length runs past the end of the file, and plain garbage.
    assert.equal(exifOrientation(concat(jpeg.subarray(0, 2), new Uint8Array([0xff, 0xe1, 0x40, 0x00]), ascii('Exif\0\0II')), 'jpeg'), 1);
    assert.equal(exifOrientation(new Uint8Array([0xff, 0xd8, 0xff, 0x17, 0x01]), 'jpeg'), 1);
    assert.equal(exifOrientation(new Uint8Array(3), 'png'), 1);
    // eXIf after the image data is ignored, as Chrome ignores it (so both hosts show the same thing).
    const late = withPngChunk(fixture('quadrants.png'), 'IEND', 'eXIf', tiffWithOrientation(6, 'MM', false));
    assert.equal(exifOrientation(late, 'png'), 1);
    assert.equal(exifOrientation(new Uint8Array(3), 'webp'), 1);
  });
});

describe('applyOrientation', () => {
  // The EXIF spec defines each value by where the stored row 0 and column 0 are displayed.
  const spec: Record<Orientation, [row0: Side, col0: Side]> = {
    1: ['top', 'left'],
    2: ['top', 'right'],
    3: ['bottom', 'right'],
    4: ['bottom', 'left'],
    5: ['left', 'top'],
    6: ['right', 'top'],
    7: ['right', 'bottom'],
    8: ['left', 'bottom'],
  };
  type Side = 'top' | 'bottom' | 'left' | 'right';
  // A 3x2 image whose pixels carry their stored index in the red channel (and 10 + index in alpha).
  const w = 3;
  const h = 2;
  const img: RgbaImage = {
    width: w,
    height: h,
    data: Uint8Array.from({ length: w * h * 4 }, (_, i) => (i % 4 === 0 ? i / 4 : i % 4 === 3 ? 10 + (i >> 2) : 0)),
  };
  const side = (d: RgbaImage, s: Side) => {
    const ids: number[] = [];
    const n = s === 'top' || s === 'bottom' ? d.width : d.height;
    for (let k = 0; k < n; k++) {
      const [x, y] = s === 'top' ? [k, 0] : s === 'bottom' ? [k, d.height - 1] : s === 'left' ? [0, k] : [d.width - 1, k];
      ids.push(pixel(d, x, y)[0]);
    }
    return ids;
  };
  for (const o of [1, 2, 3, 4, 5, 6, 7, 8] as Orientation[])
    it(`orientation ${o}: stored row 0 on the ${spec[o][0]}, column 0 on the ${spec[o][1]}`, () => {
      const d = applyOrientation(img, o);
      assert.deepEqual([d.width, d.height], o >= 5 ? [h, w] : [w, h]);
      // Row 0 = ids 0,1,2 running away from column 0; column 0 = ids 0,3 running away from row 0.
      const rowSide = side(d, spec[o][0]);
      const colSide = side(d, spec[o][1]);
      assert.deepEqual([...rowSide].sort(), [0, 1, 2]);
      assert.deepEqual([...colSide].sort(), [0, 3]);
      // Whole pixels move (alpha travels with red).
      for (let i = 0; i < w * h; i++) assert.equal(d.data[i * 4 + 3], 10 + d.data[i * 4]);
    });
  it('orientation 1 returns the same image without copying', () => assert.equal(applyOrientation(img, 1), img));
  it('works on a view that is not 4-byte aligned', () => {
    const backing = new Uint8Array(img.data.length + 1);
    backing.set(img.data, 1);
    const d = applyOrientation({ width: w, height: h, data: backing.subarray(1) }, 6);
    assert.deepEqual(Array.from(d.data), Array.from(applyOrientation(img, 6).data));
  });
});

describe('decodeImageNode', () => {
  it('JPEG: the pattern within the lossy tolerance', async () => {
    assertPattern(await decodeImageNode(fixture('quadrants.jpg'), 'q.jpg'), 1, LOSSY_TOLERANCE, LOSSY_MARGIN);
  });

  for (const o of [6, 3, 8] as Orientation[])
    it(`JPEG with EXIF orientation ${o}: upright, quadrants where EXIF says`, async () => {
      assertPattern(await decodeImageNode(fixture(`quadrants-o${o}.jpg`), `o${o}.jpg`), o, LOSSY_TOLERANCE, LOSSY_MARGIN);
    });

  it('orientation 6: the stored top-left quadrant ends up top-right', async () => {
    const img = await decodeImageNode(fixture('quadrants-o6.jpg'), 'o6.jpg');
    assert.deepEqual([img.width, img.height], [32, 48]);
    const topRight = pixel(img, 28, 4);
    QUADRANTS.topLeft.forEach((v, c) => assert.ok(Math.abs(topRight[c] - v) <= LOSSY_TOLERANCE));
  });

  it('PNG RGB, RGBA, palette with tRNS and eXIf orientation: exact', async () => {
    assertPattern(await decodeImageNode(fixture('quadrants.png'), 'q.png'), 1, 0, 0);
    assertPattern(await decodeImageNode(fixture('quadrants-o6.png'), 'o6.png'), 6, 0, 0);
    const rgba = await decodeImageNode(fixture('rgba.png'), 'rgba.png');
    for (let y = 0; y < H; y++) for (let x = 0; x < W; x++) assert.deepEqual(pixel(rgba, x, y), [...quadrantColour(x, y), quadrantAlpha(x, y)]);
    const pal = await decodeImageNode(fixture('palette.png'), 'palette.png');
    assertQuadrant(pal, 0, 0, QUADRANTS.topLeft, 0, 0);
    assertQuadrant(pal, 1, 0, QUADRANTS.topRight, 0, 0, 128);
    assertQuadrant(pal, 0, 1, QUADRANTS.bottomLeft, 0, 0);
    assertQuadrant(pal, 1, 1, QUADRANTS.bottomRight, 0, 0);
  });

  it('16-bit PNG: rounded to 8 bits (v / 257), not truncated', async () => {
    const img = await decodeImageNode(fixture('rgb16.png'), 'rgb16.png');
    for (let y = 0; y < H; y++)
      for (let x = 0; x < W; x++) {
        const want = [0, 1, 2].map((c) => Math.round(quadrant16(x, y, c) / 257));
        assert.deepEqual(pixel(img, x, y), [...want, 255]);
      }
    // The fixture's offsets make rounding and truncation differ: +200 rounds up.
    assert.equal(pixel(img, 1, 0)[0], QUADRANTS.topLeft[0] + 1);
  });

  it('PNG grey 1/4/8/16-bit, grey+alpha, RGBA16 and RGB with a tRNS colour key all become RGBA8', async () => {
    const png = (data: Uint8Array | Uint16Array, width: number, height: number, channels: number, depth: 1 | 2 | 4 | 8 | 16) =>
      encodePng({ width, height, data, channels, depth });
    // 1-bit, 10 wide: rows padded to 2 bytes. Bits 1011001110 / 0100110001.
    const bits = [1, 0, 1, 1, 0, 0, 1, 1, 1, 0];
    const pack = (row: number[]) => [row.slice(0, 8).reduce((a, b, i) => a | (b << (7 - i)), 0), row.slice(8).reduce((a, b, i) => a | (b << (7 - i)), 0)];
    const grey1 = await decodeImageNode(png(Uint8Array.from([...pack(bits), ...pack(bits.map((b) => 1 - b))]), 10, 2, 1, 1), 'g1.png');
    for (let x = 0; x < 10; x++) {
      assert.deepEqual(pixel(grey1, x, 0), bits[x] ? [255, 255, 255, 255] : [0, 0, 0, 255]);
      assert.deepEqual(pixel(grey1, x, 1), bits[x] ? [0, 0, 0, 255] : [255, 255, 255, 255]);
    }
    // 4-bit, 3 wide (one and a half bytes per row): v -> v * 17.
    const grey4 = await decodeImageNode(png(Uint8Array.from([0x0f, 0x80, 0x35, 0xa0]), 3, 2, 1, 4), 'g4.png');
    assert.deepEqual(
      [0, 1, 2].map((x) => pixel(grey4, x, 0)[0]),
      [0, 255, 136],
    );
    assert.deepEqual(
      [0, 1, 2].map((x) => pixel(grey4, x, 1)[1]),
      [51, 85, 170],
    );
    const greyAlpha = await decodeImageNode(png(Uint8Array.from([10, 0, 200, 255]), 2, 1, 2, 8), 'ga.png');
    assert.deepEqual(
      [pixel(greyAlpha, 0, 0), pixel(greyAlpha, 1, 0)],
      [
        [10, 10, 10, 0],
        [200, 200, 200, 255],
      ],
    );
    const grey16 = await decodeImageNode(png(Uint16Array.from([0, 65535, 257 * 7 + 128, 257 * 7 + 129]), 4, 1, 1, 16), 'g16.png');
    assert.deepEqual(
      [0, 1, 2, 3].map((x) => pixel(grey16, x, 0)[0]),
      [0, 255, 7, 8],
    );
    const rgba16 = await decodeImageNode(png(Uint16Array.from([65535, 0, 257 * 100, 32896]), 1, 1, 4, 16), 'rgba16.png');
    assert.deepEqual(pixel(rgba16, 0, 0), [255, 0, 100, 128]);
    // RGB with tRNS naming (1, 2, 3) as the transparent colour (three 16-bit samples). At least 3 pixels:
    // fast-png compares the tRNS sample count with the pixel count.
    const rgb = png(Uint8Array.from([1, 2, 3, 1, 2, 4, 3, 2, 1, 1, 2, 3]), 4, 1, 3, 8);
    const keyed = await decodeImageNode(withPngChunk(rgb, 'IDAT', 'tRNS', new Uint8Array([0, 1, 0, 2, 0, 3])), 'key.png');
    assert.deepEqual(
      [0, 1, 2, 3].map((x) => pixel(keyed, x, 0)),
      [
        [1, 2, 3, 0],
        [1, 2, 4, 255],
        [3, 2, 1, 255],
        [1, 2, 3, 0],
      ],
    );
    // Grey with a tRNS key (one sample).
    const greyKey = await decodeImageNode(withPngChunk(png(Uint8Array.from([9, 10, 9]), 3, 1, 1, 8), 'IDAT', 'tRNS', new Uint8Array([0, 9])), 'gkey.png');
    assert.deepEqual(
      [0, 1, 2].map((x) => pixel(greyKey, x, 0)[3]),
      [0, 255, 0],
    );
  });

  it('WebP lossless (exact), lossy (tolerance) and with EXIF orientation 6', async () => {
    assertPattern(await decodeImageNode(fixture('quadrants.webp'), 'q.webp'), 1, 0, 0);
    assertPattern(await decodeImageNode(fixture('quadrants-lossy.webp'), 'lossy.webp'), 1, LOSSY_TOLERANCE, LOSSY_MARGIN);
    assertPattern(await decodeImageNode(fixture('quadrants-o6.webp'), 'o6.webp'), 6, 0, 0);
  });

  it('refuses a truncated JPEG instead of painting the missing rows grey', async () => {
    await rejects(decodeImageNode(fixture('truncated.jpg'), 'truncated.jpg'), /^truncated\.jpg is truncated: the JPEG ends before its end-of-image marker/);
    // An end marker inside metadata before the scan (an EXIF thumbnail ends with FF D9) does not count.
    const thumb = jpegSegment(0xe1, concat(ascii('Exif\0\0'), new Uint8Array([0xff, 0xd8, 0xff, 0xd9])));
    await rejects(decodeImageNode(withSegments(fixture('truncated.jpg'), false, thumb), 'thumb.jpg'), /^thumb\.jpg is truncated/);
    await rejects(decodeImageNode(fixture('quadrants.png').subarray(0, 80), 'cut.png'), /^cut\.png is truncated: the PNG ends/);
    const webp = fixture('quadrants.webp');
    await rejects(decodeImageNode(webp.subarray(0, webp.length - 10), 'cut.webp'), /^cut\.webp is truncated: the WebP ends after 70 of 80 bytes/);
  });

  it('wraps decoder failures in an ImageError naming the file', async () => {
    const png = fixture('quadrants.png').slice();
    const idat = Buffer.from(png).indexOf('IDAT');
    png.fill(0x55, idat + 6, idat + 30); // corrupt the zlib stream, keep the chunk structure
    await rejects(decodeImageNode(png, 'bad.png'), /^bad\.png: could not decode the PNG \(/);
    const webp = fixture('quadrants.webp').slice();
    webp.fill(0xff, 25, webp.length); // VP8L bitstream garbage
    await rejects(decodeImageNode(webp, 'bad.webp'), /^bad\.webp: could not decode the WebP \(/);
  });

  it('refuses a huge image from its header alone, before the completeness check and the decoder', async () => {
    const refusal = (name: string) =>
      new RegExp(`^${name.replace('.', '\\.')} is 20000x20000 \\(400\\.0 MP\\), too large to decode here \\(limit 50\\.0 MP\\); downscale it first`);
    // The header and nothing else (no pixel data, no end marker): the size check refuses it, where the
    // completeness check would have said "truncated" and a decoder "could not decode".
    for (const [name, bytes] of [
      ['huge.png', pngHeader(20000, 20000)],
      ['huge.jpg', jpegHeader(20000, 20000)],
    ] as const)
      await rejects(decodeImageNode(bytes, name), refusal(name));
    // A complete file (body and end marker) whose body the decoder chokes on: behind a small header the
    // decoder is reached and fails on it; behind the huge header the refusal comes first, so the decoder was
    // never called (decodeImageNode reports every decoder failure as "could not decode"). No clock involved.
    const body = { png: pngBody(), jpeg: jpegBody() };
    await rejects(decodeImageNode(concat(pngHeader(16, 16), body.png), 'small.png'), /^small\.png: could not decode the PNG \(/);
    await rejects(decodeImageNode(concat(jpegHeader(16, 16), body.jpeg), 'small.jpg'), /^small\.jpg: could not decode the JPEG \(/);
    await rejects(decodeImageNode(concat(pngHeader(20000, 20000), body.png), 'huge.png'), refusal('huge.png'));
    await rejects(decodeImageNode(concat(jpegHeader(20000, 20000), body.jpeg), 'huge.jpg'), refusal('huge.jpg'));
    // Just under the limit is not refused by the size check (it fails later, as the header is all there is).
    const side = Math.floor(Math.sqrt(MAX_DECODE_PIXELS));
    await rejects(decodeImageNode(pngHeader(side, side), 'ok-size.png'), /^ok-size\.png is truncated/);
  });
});

describe('prepareImage', () => {
  /** An image whose channels are functions of (x, y). */
  function synth(w: number, h: number, f: (x: number, y: number) => [number, number, number, number?]): RgbaImage {
    const data = new Uint8Array(w * h * 4);
    for (let y = 0; y < h; y++)
      for (let x = 0; x < w; x++) {
        const [r, g, b, a = 255] = f(x, y);
        data.set([r, g, b, a], (y * w + x) * 4);
      }
    return { width: w, height: h, data };
  }
  const at = (t: Float32Array, r: number, c: number, x: number, y: number) => t[c * r * r + y * r + x];
  const unit = (v: number) => v / 127.5 - 1;
  const close = (a: number, b: number, what: string, tol = 1e-6) => assert.ok(Math.abs(a - b) <= tol, `${what}: ${a} vs ${b}`);

  // 6x4, red = 40x, green = 50y, blue = 7: every pixel identifiable.
  const grid = synth(6, 4, (x, y) => [40 * x, 50 * y, 7]);

  it('layout [3, R, R], channel-first, x / 127.5 - 1; centre crop of a wide image', () => {
    const t = prepareImage(grid, { resolution: 4 });
    assert.equal(t.length, 3 * 4 * 4);
    // The centred 4x4 square starts at x = 1; same size, so the box filter is the identity.
    for (let y = 0; y < 4; y++)
      for (let x = 0; x < 4; x++) {
        close(at(t, 4, 0, x, y), unit(40 * (x + 1)), `R(${x},${y})`);
        close(at(t, 4, 1, x, y), unit(50 * y), `G(${x},${y})`);
        close(at(t, 4, 2, x, y), unit(7), `B(${x},${y})`);
      }
    assert.deepEqual(resolveCrop({ width: 7, height: 4 }, 'center'), { x: 1, y: 0, size: 4 }, 'odd leftover goes after the crop');
  });

  it('user crop and horizontal flip', () => {
    const t = prepareImage(grid, { resolution: 3, crop: { x: 3, y: 1, size: 3 } });
    const f = prepareImage(grid, { resolution: 3, crop: { x: 3, y: 1, size: 3 }, flip: true });
    for (let y = 0; y < 3; y++)
      for (let x = 0; x < 3; x++) {
        close(at(t, 3, 0, x, y), unit(40 * (3 + x)), 'R');
        close(at(t, 3, 1, x, y), unit(50 * (1 + y)), 'G');
        close(at(f, 3, 0, x, y), unit(40 * (3 + 2 - x)), 'flipped R');
        close(at(f, 3, 1, x, y), unit(50 * (1 + y)), 'flipped G');
      }
  });

  it('box downscale 8x8 -> 2x2 equals the 4x4 block means exactly', () => {
    const img = synth(8, 8, (x, y) => [(x * 37 + y * 91) % 256, (x * x * 13 + y * 5) % 256, (255 - x * y * 3) % 256]);
    const t = prepareImage(img, { resolution: 2 });
    for (let by = 0; by < 2; by++)
      for (let bx = 0; bx < 2; bx++)
        for (let c = 0; c < 3; c++) {
          let sum = 0;
          for (let y = 0; y < 4; y++) for (let x = 0; x < 4; x++) sum += img.data[((by * 4 + y) * 8 + bx * 4 + x) * 4 + c];
          close(at(t, 2, c, bx, by), unit(sum / 16), `block (${bx},${by}) channel ${c}`);
        }
  });

  it('non-integer box downscale and fractional crops weigh each source pixel by its covered area', () => {
    // Reference by construction: nearest-upsample by K so the crop and every output footprint land on whole
    // pixels, then take plain block means. Exact area averaging must agree.
    const img = synth(13, 9, (x, y) => [(x * 53 + y * 29) % 256, (x * 11 + y * y * 7) % 256, (x * y * 17) % 256]);
    function areaReference(crop: CropBox, r: number, k: number): Float32Array {
      const s = Math.round(crop.size * k);
      const block = s / r;
      assert.ok(Number.isInteger(block));
      const out = new Float32Array(3 * r * r);
      for (let oy = 0; oy < r; oy++)
        for (let ox = 0; ox < r; ox++)
          for (let c = 0; c < 3; c++) {
            let sum = 0;
            for (let v = 0; v < block; v++)
              for (let u = 0; u < block; u++) {
                const sx = Math.floor((Math.round(crop.x * k) + ox * block + u) / k);
                const sy = Math.floor((Math.round(crop.y * k) + oy * block + v) / k);
                sum += img.data[(sy * img.width + sx) * 4 + c];
              }
            out[c * r * r + oy * r + ox] = unit(sum / (block * block));
          }
      return out;
    }
    for (const [crop, r, k] of [
      [{ x: 2, y: 1, size: 7 }, 3, 3],
      [{ x: 1.5, y: 0.25, size: 8.5 }, 4, 8],
      [{ x: 0, y: 0, size: 9 }, 2, 2],
    ] as const) {
      const got = prepareImage(img, { resolution: r, crop });
      const want = areaReference(crop, r, k);
      got.forEach((v, i) => close(v, want[i], `crop ${JSON.stringify(crop)} -> ${r}, element ${i}`, 1e-5));
    }
  });

  it('bilinear upscale (align_corners=false) matches a hand-computed value', () => {
    // 2x2 -> 4x4: output index i samples source c = (i + 0.5) / 2 - 0.5 = -0.25, 0.25, 0.75, 1.25, clamped
    // to [0, 1]. Output (1, 1) = 0.75 * (0.75 a + 0.25 b) + 0.25 * (0.75 c + 0.25 d) with red a=0, b=100,
    // c=200, d=255 (row-major): 18.75 + 53.4375 = 72.1875.
    const img = synth(2, 2, (x, y) => [[0, 100, 200, 255][y * 2 + x], 0, 0]);
    const t = prepareImage(img, { resolution: 4 });
    close(at(t, 4, 0, 1, 1), unit(72.1875), 'out(1,1)');
    close(at(t, 4, 0, 2, 1), unit(0.75 * (0.25 * 0 + 0.75 * 100) + 0.25 * (0.25 * 200 + 0.75 * 255)), 'out(2,1)');
    // Clamped corners reproduce the source pixels.
    close(at(t, 4, 0, 0, 0), unit(0), 'out(0,0)');
    close(at(t, 4, 0, 3, 3), unit(255), 'out(3,3)');
  });

  it('output stays in [-1, 1] for any content, down and up', () => {
    const noise = synth(37, 29, (x, y) => {
      const h = Math.imul(x * 7919 + y * 104729, 2654435761) >>> 0;
      return [h & 255, (h >>> 8) & 255, (h >>> 16) & 255, (h >>> 24) | 1];
    });
    for (const r of [5, 16, 29, 64]) {
      const t = prepareImage(noise, { resolution: r });
      assert.equal(t.length, 3 * r * r);
      let min = Infinity;
      let max = -Infinity;
      for (const v of t) {
        min = Math.min(min, v);
        max = Math.max(max, v);
      }
      assert.ok(min >= -1 && max <= 1, `R=${r}: range [${min}, ${max}]`);
    }
    const white = prepareImage(
      synth(3, 3, () => [255, 255, 255]),
      { resolution: 7 },
    );
    const black = prepareImage(
      synth(9, 9, () => [0, 0, 0]),
      { resolution: 4 },
    );
    assert.ok(white.every((v) => v === 1) && black.every((v) => v === -1));
  });

  it('composites transparency over white (or the given background)', () => {
    const img = synth(2, 1, (x) => (x === 0 ? [0, 0, 0, 0] : [255, 0, 0, 128]));
    const t = prepareImage(img, { resolution: 1, crop: { x: 0, y: 0, size: 1 } });
    assert.deepEqual(Array.from(t), [1, 1, 1], 'fully transparent black is white');
    const half = prepareImage(img, { resolution: 1, crop: { x: 1, y: 0, size: 1 } });
    close(half[0], 1, 'red stays 255');
    close(half[1], unit(255 * (1 - 128 / 255)), 'green is the white showing through');
    const onGrey = prepareImage(img, { resolution: 1, crop: { x: 0, y: 0, size: 1 }, background: [127.5, 127.5, 127.5] });
    assert.deepEqual(Array.from(onGrey), [0, 0, 0]);
  });

  it('the decoded fixture, end to end: quadrants land in the right places after orientation', async () => {
    const img = await decodeImageNode(fixture('quadrants-o6.png'), 'o6.png'); // 32x48 upright
    const t = prepareImage(img, { resolution: 2, crop: { x: 0, y: 0, size: 32 } });
    // The top 32x32 square of the upright 32x48 image holds its two top quadrants (DISPLAYED[6]), 16x16 each
    // of the 2x2 output.
    const [tl, tr] = DISPLAYED[6]!;
    for (let c = 0; c < 3; c++) {
      close(at(t, 2, c, 0, 0), unit(tl[c]), 'top-left');
      close(at(t, 2, c, 1, 0), unit(tr[c]), 'top-right');
    }
  });

  it('refuses crops outside the image with a clear message', async () => {
    await rejects(
      () => prepareImage(grid, { resolution: 2, crop: { x: 4, y: 0, size: 3 }, name: 'dog.jpg' }),
      /^dog\.jpg: crop \{x: 4, y: 0, size: 3\} does not fit in the 6x4 image \(x \+ size = 7 > width 6\)$/,
    );
    await rejects(() => prepareImage(grid, { resolution: 2, crop: { x: 0, y: 2, size: 3 } }), /does not fit in the 6x4 image \(y \+ size = 5 > height 4\)/);
    await rejects(() => prepareImage(grid, { resolution: 2, crop: { x: -1, y: 0, size: 2 } }), /starts outside the 6x4 image/);
    await rejects(() => prepareImage(grid, { resolution: 2, crop: { x: 0, y: 0, size: 0.5 } }), /smaller than one pixel/);
    await rejects(() => prepareImage(grid, { resolution: 2, crop: { x: NaN, y: 0, size: 2 } }), /non-finite/);
    await rejects(() => prepareImage(grid, { resolution: 0 }), /resolution must be a positive integer/);
  });
});

describe('checkImageSet', () => {
  const sq = (name: string, side = 512) => ({ name, width: side, height: side });

  it('zero images is an error, one a warning, more than 50 an error', () => {
    assert.deepEqual(checkImageSet([]).errors, ['add at least one image (3 to 5 photos of the subject work best)']);
    const one = checkImageSet([sq('a.jpg')]);
    assert.deepEqual(one.errors, []);
    assert.match(one.warnings.join('\n'), /only one image: training will work/);
    const ok = checkImageSet([sq('a.jpg'), sq('b.jpg'), sq('c.jpg')]);
    assert.deepEqual(ok, { errors: [], warnings: [] });
    const many = checkImageSet(Array.from({ length: 51 }, (_, i) => sq(`${i}.jpg`)));
    assert.deepEqual(many.errors, ['51 images is too many (at most 50); DreamBooth needs only 3 to 5 good photos of the subject']);
    assert.deepEqual(checkImageSet(Array.from({ length: 50 }, (_, i) => sq(`${i}.jpg`))).errors, []);
  });

  it('small and non-square images are warnings naming the file', () => {
    const r = checkImageSet([{ name: 'tiny.jpg', width: 200, height: 150 }, { name: 'wide.jpg', width: 800, height: 600 }, sq('ok.png', 600)], {
      resolution: 768,
    });
    assert.deepEqual(r.errors, []);
    assert.deepEqual(r.warnings, [
      'tiny.jpg is only 200x150; sides under 256 px come out blurry after upscaling, use a larger photo if you have one',
      'tiny.jpg is not square (200x150): it will be centre-cropped to 150x150 unless you set a crop',
      'wide.jpg is 800x600, smaller than 768 px: it will be upscaled and slightly soft',
      'wide.jpg is not square (800x600): it will be centre-cropped to 600x600 unless you set a crop',
      'ok.png is 600x600, smaller than 768 px: it will be upscaled and slightly soft',
    ]);
    const cropped = checkImageSet([{ name: 'wide.jpg', width: 800, height: 600, crop: { x: 0, y: 0, size: 600 } }, sq('b.jpg')]);
    assert.deepEqual(cropped.warnings, []);
  });
});

describe('browser decode size and crops across sizes', () => {
  it('decodeScale: short side to 2 x resolution, exact (not power-of-two) sizes, null when not much larger', () => {
    assert.deepEqual(decodeScale(4000, 3000, 512), { width: 1365, height: 1024 });
    assert.deepEqual(decodeScale(3000, 4000, 512), { width: 1024, height: 1365 });
    assert.deepEqual(decodeScale(8000, 6000, 768), { width: 2048, height: 1536 });
    assert.deepEqual(decodeScale(4000, 3000, 512, 1), { width: 683, height: 512 });
    assert.equal(decodeScale(1500, 1000, 512), null);
    assert.equal(decodeScale(1024, 5000, 512), null);
  });

  it('scaleCrop maps a crop chosen on the full photo onto the downscaled decode, and it fits', () => {
    const from = { width: 4000, height: 3000 };
    const to = decodeScale(from.width, from.height, 512)!;
    const c = scaleCrop({ x: 1000, y: 500, size: 2000 }, from, to);
    close3(c, { x: 1000 * (1024 / 3000), y: 500 * (1024 / 3000), size: 2000 * (1024 / 3000) });
    const edge = scaleCrop({ x: 2000, y: 1000, size: 2000 }, from, to); // flush with the right and bottom edges
    assert.doesNotThrow(() => resolveCrop(to, edge));
    assert.ok(edge.x + edge.size <= to.width && edge.y + edge.size <= to.height);
  });
  function close3(a: CropBox, b: CropBox) {
    for (const k of ['x', 'y', 'size'] as const) assert.ok(Math.abs(a[k] - b[k]) < 1e-9, `${k}: ${a[k]} vs ${b[k]}`);
  }
});

describe('loadImageFile / loadImageDir', () => {
  const dir = mkdtempSync(join(tmpdir(), 'dbs-images-'));
  copyFileSync(join(FIXTURES, 'quadrants-o6.jpg'), join(dir, 'a.jpg'));
  copyFileSync(join(FIXTURES, 'quadrants.png'), join(dir, 'b.png'));
  writeFileSync(join(dir, 'b.txt'), 'a photo of sks dog\nsecond line is ignored\n');
  copyFileSync(join(FIXTURES, 'quadrants.webp'), join(dir, 'c.webp'));
  writeFileSync(join(dir, 'c.txt'), '\uFEFF  sks dog on a beach  \r\n');
  copyFileSync(join(FIXTURES, 'notes.jpg'), join(dir, 'notes.jpg'));
  writeFileSync(join(dir, 'readme.txt'), 'no image called readme here');
  copyFileSync(join(FIXTURES, 'truncated.jpg'), join(dir, 'truncated.jpg'));
  writeFileSync(join(dir, '.DS_Store'), new Uint8Array([0, 0, 0, 1, 0x42, 0x75, 0x64, 0x31]));
  mkdirSync(join(dir, 'sub'));

  it('loads every image in name order with captions; bad files become errors naming them', async () => {
    const { images, errors } = await loadImageDir(dir);
    assert.deepEqual(
      images.map((i) => i.name),
      ['a.jpg', 'b.png', 'c.webp'],
    );
    assert.deepEqual(
      images.map((i) => i.caption),
      [undefined, 'a photo of sks dog', 'sks dog on a beach'],
    );
    assert.deepEqual([images[0].image.width, images[0].image.height], [32, 48], 'a.jpg is upright');
    assert.equal(images[1].path, join(dir, 'b.png'));
    assert.ok(errors.every((e) => e instanceof ImageError));
    assert.deepEqual(
      errors.map((e) => e.file),
      ['notes.jpg', 'readme.txt', 'truncated.jpg'],
    );
    assert.deepEqual(
      errors.map((e) => e.message.split(/[:(]/)[0]),
      ['notes.jpg is a text file, not an image', 'readme.txt is a text file, not an image', 'truncated.jpg is truncated'],
    );
  });

  it('loadImageFile: one image with its caption; a missing file says so', async () => {
    const b = await loadImageFile(join(dir, 'b.png'));
    assert.equal(b.caption, 'a photo of sks dog');
    assertPattern(b.image, 1, 0, 0);
    await rejects(loadImageFile(join(dir, 'missing.jpg')), /^missing\.jpg: cannot read .*missing\.jpg/);
  });
});
