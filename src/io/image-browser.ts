// Browser host for image loading: the browser's own decoders through createImageBitmap, pixels read back
// from an OffscreenCanvas. Uses only APIs that exist in a Worker as well as on the main thread (no <img>, no
// document), so decoding can move off the UI thread.
//
// EXIF orientation: createImageBitmap with imageOrientation 'from-image' (the default in current browsers)
// already returns the image upright, for JPEG, WebP and PNG eXIf alike. Do NOT call applyOrientation on the
// result: that would turn the photo a second time. (The Node path decodes with libraries that ignore EXIF,
// which is why image-node.ts applies it itself.)
import {
  assertComplete,
  decodeScale,
  exifOrientation,
  ImageError,
  imageSize,
  KIND_NAME,
  orientedSize,
  sniffImage,
  type ImageSize,
  type RgbaImage,
} from './image.ts';

export interface BrowserImage extends RgbaImage {
  /**
   * The upright size of the file itself. Differs from width/height when the decode was downscaled; crops
   * chosen on the full-size photo map onto the pixels with scaleCrop(crop, original, decoded).
   */
  original: ImageSize;
}

function bitmapOptions(target: ImageSize | null): ImageBitmapOptions {
  return {
    imageOrientation: 'from-image',
    // Straight alpha in, and the canvas below converts ICC-tagged photos (e.g. Display P3) to sRGB.
    premultiplyAlpha: 'none',
    colorSpaceConversion: 'default',
    ...(target ? { resizeWidth: target.width, resizeHeight: target.height, resizeQuality: 'high' as const } : {}),
  };
}

/**
 * Decodes a dropped file to upright RGBA8. Photos much larger than `resolution` needs are downscaled during
 * decode (decodeScale), so a 48 MP photo costs ~6 MB of pixels instead of ~200 MB. The header is read first:
 * unknown formats, text files and truncated files fail with the same messages as in Node.
 */
export async function decodeImageBrowser(blob: Blob, name: string, resolution: number): Promise<BrowserImage> {
  const bytes = new Uint8Array(await blob.arrayBuffer());
  const kind = sniffImage(bytes, name);
  const stored = imageSize(bytes, kind, name);
  assertComplete(bytes, kind, name);
  const original = orientedSize(stored, exifOrientation(bytes, kind));
  const target = decodeScale(original.width, original.height, resolution);

  let bitmap: ImageBitmap;
  try {
    bitmap = await createImageBitmap(blob, bitmapOptions(target));
    // resizeWidth/Height are meant for the oriented image. Should a browser apply them before orienting, the
    // result comes back with the sides swapped: decode at full size rather than train on a stretched photo.
    if (target && (bitmap.width !== target.width || bitmap.height !== target.height)) {
      bitmap.close();
      bitmap = await createImageBitmap(blob, bitmapOptions(null));
    }
  } catch (e) {
    throw new ImageError(name, `${name}: the browser could not decode this ${KIND_NAME[kind]} (${e instanceof Error ? e.message : String(e)})`);
  }

  try {
    const { width, height } = bitmap;
    const canvas = new OffscreenCanvas(width, height);
    const ctx = canvas.getContext('2d', { willReadFrequently: true });
    if (!ctx) throw new ImageError(name, `${name}: no 2D canvas context available to read the pixels`);
    ctx.drawImage(bitmap, 0, 0);
    // The canvas stores premultiplied alpha, so fully transparent pixels read back as 0, 0, 0, 0; prepareImage
    // composites alpha over a background, which makes that loss invisible (and matches the Node path).
    const { data } = ctx.getImageData(0, 0, width, height);
    return { width, height, data, original };
  } finally {
    bitmap.close();
  }
}
