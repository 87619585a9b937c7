// Loss masks (issue 15's masked loss): a grey-level image per photo, white where the subject is (trained),
// black where it is not (ignored), grey in between (127 weighs ~0.5). kohya sd-scripts' convention: the mask
// image has the photo's name in its own folder and its R channel is the weight. The mask goes through the same
// crop, resize and mirror as its photo, so every mask pixel stays over the photo pixel it was painted on.
import { ImageError, prepareImage, resolveCrop, scaleCrop, type CropBox, type ImageSize, type Region, type RgbaImage } from './image.ts';

/** Relative aspect-ratio difference up to which a mask of another size is resized onto its photo. */
const ASPECT_SLACK = 0.01;

export interface MaskOptions {
  /** The training resolution R (the output is R x R). */
  resolution: number;
  /** The photo's crop in the upright photo's pixels ('center' or absent: the centred square). */
  crop?: CropBox | 'center';
  /** Instead of the square: the photo's aspect-ratio bucket and its region in the photo's pixels (as prepareImage). */
  bucket?: { size: ImageSize; region: Region };
  flip?: boolean;
  /** The photo's and the mask's names, for messages. */
  photoName: string;
  maskName: string;
}

/**
 * The loss mask of a photo of upright size `photo`: Float32Array [R, R] (or the bucket's [H, W]) in [0, 1] from the mask image's R
 * channel (transparent pixels count as black: not trained). A mask of another size with the same aspect ratio
 * (within 1%) is resized onto the photo (the crop scaled to it); any other size is refused, naming both sizes.
 */
export function prepareMask(mask: RgbaImage, photo: ImageSize, opts: MaskOptions): Float32Array {
  const { photoName, maskName, resolution } = opts;
  const sameSize = mask.width === photo.width && mask.height === photo.height;
  if (!sameSize) {
    const a = mask.width / mask.height;
    const b = photo.width / photo.height;
    if (Math.abs(a - b) > ASPECT_SLACK * b)
      throw new ImageError(
        maskName,
        `${maskName}: the mask is ${mask.width}x${mask.height} but its photo ${photoName} is ${photo.width}x${photo.height} (another shape): ` +
          `paint the mask on the photo itself, or save it at the photo's size`,
      );
  }
  const common = { resolution, flip: opts.flip ?? false, background: [0, 0, 0] as const, name: maskName };
  let rgb: Float32Array;
  if (opts.bucket) {
    // The region in the mask's pixels: the photo's region scaled per axis (same shape up to 1%).
    const sx = mask.width / photo.width;
    const sy = mask.height / photo.height;
    const r = opts.bucket.region;
    const region = sameSize ? r : { x: r.x * sx, y: r.y * sy, width: Math.min(r.width * sx, mask.width), height: Math.min(r.height * sy, mask.height) };
    rgb = prepareImage(mask, { ...common, bucket: { size: opts.bucket.size, region } });
  } else {
    const photoCrop = resolveCrop(photo, opts.crop, photoName);
    rgb = prepareImage(mask, { ...common, crop: sameSize ? photoCrop : scaleCrop(photoCrop, photo, mask) });
  }
  // prepareImage maps 0..255 to [-1, 1]; the weight is the R plane mapped back to [0, 1].
  const out = new Float32Array(rgb.length / 3);
  for (let i = 0; i < out.length; i++) out[i] = Math.min(1, Math.max(0, (rgb[i] + 1) / 2));
  return out;
}

/** A mask from weights in [0, 1] (e.g. painted in the studio): R = G = B = 255 x weight, opaque. */
export function maskImage(weights: ArrayLike<number>, width: number, height: number): RgbaImage {
  if (weights.length !== width * height) throw new Error(`a ${width}x${height} mask needs ${width * height} weights, got ${weights.length}`);
  const data = new Uint8ClampedArray(width * height * 4);
  for (let i = 0; i < weights.length; i++) {
    const v = Math.round(255 * Math.min(1, Math.max(0, weights[i])));
    data.set([v, v, v, 255], i * 4);
  }
  return { width, height, data };
}
