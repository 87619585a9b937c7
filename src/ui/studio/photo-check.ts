// A photo (or a mask) is checked in full at the moment it is given: its kind and size from the header, that
// the file does not stop before its end (a PNG cut after its header has a valid size, and browsers paint
// the missing rows grey), and that the browser decodes every pixel of it. A file that fails any of these is
// refused then, named, and nothing of it is stored; the run and the mask editor never meet it.
import { assertComplete, exifOrientation, ImageError, imageSize, KIND_NAME, orientedSize, sniffImage, type ImageKind, type ImageSize } from '../../io/image.ts';

/** Decodes the whole image or throws (the browser's createImageBitmap on the page; a real decoder in Node tests). */
export type PhotoDecoder = (blob: Blob, kind: ImageKind, name: string) => Promise<void>;

/**
 * The browser's decoder. createImageBitmap decodes the whole file (Chrome does it off the page's thread) and
 * rejects what it cannot read; the bitmap is closed at once, only the verdict is kept.
 */
export const browserDecoder: PhotoDecoder = async (blob, kind, name) => {
  let bmp: ImageBitmap;
  try {
    bmp = await createImageBitmap(blob);
  } catch (e) {
    throw new ImageError(
      name,
      `${name}: the browser could not decode this ${KIND_NAME[kind]} (${e instanceof Error ? e.message : String(e)}); save it again or pick another photo`,
    );
  }
  bmp.close();
};

/** Reads a photo in full: kind, upright size (EXIF orientation), completeness and a decode, or a message naming what is wrong. */
export async function checkPhoto(
  file: Blob & { name: string },
  decode: PhotoDecoder = browserDecoder,
): Promise<(ImageSize & { bytes: Uint8Array }) | { error: string }> {
  try {
    const bytes = new Uint8Array(await file.arrayBuffer());
    const kind = sniffImage(bytes, file.name);
    const size = imageSize(bytes, kind, file.name);
    assertComplete(bytes, kind, file.name);
    await decode(file, kind, file.name);
    return { ...orientedSize(size, exifOrientation(bytes, kind)), bytes };
  } catch (e) {
    return { error: (e as Error).message };
  }
}

/**
 * A mask file for `photo`: checked in full, of the photo's shape (within 1% in aspect ratio), and kept as the mask
 * editor keeps its own (white, opaque where the file is white: kohya reads the R channel) where the page can redraw it.
 */
export async function checkMask(
  f: File,
  photo: { name: string; width: number; height: number },
  decoder: PhotoDecoder = browserDecoder,
): Promise<{ blob: Blob } | { error: string }> {
  const m = await checkPhoto(f, decoder);
  if ('error' in m) return m;
  if (Math.abs(m.width / m.height - photo.width / photo.height) > 0.01 * (photo.width / photo.height))
    return { error: `${f.name}: a mask must have its photo's shape; it is ${m.width}x${m.height}, ${photo.name} is ${photo.width}x${photo.height}` };
  const blob = new Blob([m.bytes as Uint8Array<ArrayBuffer>], { type: f.type || 'image/png' });
  return { blob: (await maskAsAlpha(blob)) ?? blob };
}

/** The mask with its R channel as alpha over white (the editor's form), or null where the page cannot redraw it (tests). */
async function maskAsAlpha(blob: Blob): Promise<Blob | null> {
  if (typeof OffscreenCanvas === 'undefined' || typeof createImageBitmap === 'undefined') return null;
  const bmp = await createImageBitmap(blob);
  const c = new OffscreenCanvas(bmp.width, bmp.height);
  const ctx = c.getContext('2d')!;
  ctx.drawImage(bmp, 0, 0);
  bmp.close();
  const img = ctx.getImageData(0, 0, c.width, c.height);
  const px = img.data;
  for (let i = 0; i < px.length; i += 4) {
    // A transparent pixel reads as black (the run composites over black).
    px[i + 3] = Math.round((px[i] * px[i + 3]) / 255);
    px[i] = px[i + 1] = px[i + 2] = 255;
  }
  ctx.putImageData(img, 0, 0);
  return c.convertToBlob({ type: 'image/png' });
}

/** A caption file's first line (kohya reads only that), or why it is refused: not UTF-8 text, or empty. */
export async function captionOf(f: File, photo: string): Promise<{ caption: string } | { error: string }> {
  const bytes = new Uint8Array(await f.arrayBuffer());
  let text: string;
  try {
    if (bytes.includes(0)) throw new Error('binary');
    text = new TextDecoder('utf-8', { fatal: true }).decode(bytes);
  } catch {
    return { error: `${f.name} is not UTF-8 text: not used as the caption of ${photo} (save it as UTF-8, or type the caption under the photo)` };
  }
  const caption = text.split(/\r?\n/)[0].trim();
  if (!caption) return { error: `${f.name} is empty: ${photo} keeps the prompt (write its caption on the first line, or type it under the photo)` };
  return { caption };
}
