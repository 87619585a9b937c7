// What the photo's thumbnail says of the shape it trains at, and why a photo that is not square still trains
// as a square with "own aspect (buckets)": bucket sides are multiples of the model's factor (64 px for SD, 8 for
// the demo model) at about the square's pixel count, so at a small resolution no other shape comes near it.
import { bucketFor, type ImageSize } from '../../io/image.ts';

/** The smallest resolution (a multiple of `factor`, up to 4096) at which `photo` gets a bucket that is not square; null if none. */
export function firstNonSquareResolution(photo: ImageSize, factor: number, from: number): number | null {
  for (let r = Math.ceil(from / factor) * factor; r <= 4096; r += factor) {
    const b = bucketFor(photo, r, factor);
    if (b.width !== b.height) return r;
  }
  return null;
}

/** The thumbnail's line: the bucket, and for a photo that is not square but trains square, why. */
export function bucketNote(photo: ImageSize, resolution: number, factor: number): string {
  const b = bucketFor(photo, resolution, factor);
  const at = `Trains at ${b.width}×${b.height}`;
  if (b.width !== b.height) return `${at} (its own aspect ratio)`;
  if (photo.width === photo.height) return `${at} (square)`;
  const from = firstNonSquareResolution(photo, factor, resolution + factor);
  const g = gcd(photo.width, photo.height);
  const shape = `${photo.width / g}:${photo.height / g}`;
  const why = `at ${resolution} px, with bucket sides in steps of ${factor} px, no other shape is nearer its ${shape}`;
  return `${at}, a square crop: ${why}${from ? `; from ${from} px it trains at its own aspect ratio` : ''}.`;
}

function gcd(a: number, b: number): number {
  return b ? gcd(b, a % b) : a;
}
