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
