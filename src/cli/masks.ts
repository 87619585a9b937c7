// Loss masks from --masks (train and train --bundle): which mask belongs to which photo, and masks that
// would train nothing. kohya's convention names a photo's mask after the photo, in its own folder. The
// pairing rule: a mask with the photo's full file name is its mask; otherwise the mask with the photo's
// stem (any image type), but only where that stem is the photo's alone: photos a.png and a.jpg cannot tell
// which of masks a.png and a.webp is whose, so such a pair must use the photos' full names and is
// otherwise refused by name, never matched silently.
import { realpathSync } from 'node:fs';
import { basename, extname, join } from 'node:path';
import type { RgbaImage } from '../io/image.ts';
import { UsageError } from './args.ts';

const stemOf = (name: string) => basename(name, extname(name));

/** Refuses --masks that is the --images folder itself (each photo would be its own mask). */
export function refuseMasksAsImages(masks: string, images: string): void {
  let same: boolean;
  try {
    same = realpathSync(masks) === realpathSync(images);
  } catch {
    return; // a missing folder is named by the folder checks
  }
  if (same)
    throw new UsageError(
      `--masks ${masks} is the --images folder: each photo would be its own mask. Put the masks (white where the subject is) in a folder of their own, named like the photos`,
    );
}

/**
 * Each photo's mask file name, by the rule above; refuses, naming them, the photos with no mask and the
 * photos whose mask is ambiguous.
 */
export function pairMasks(photos: string[], masks: string[], dir: string): Map<string, string> {
  const maskNames = new Set(masks);
  const masksByStem = new Map<string, string[]>();
  for (const m of masks) masksByStem.set(stemOf(m), [...(masksByStem.get(stemOf(m)) ?? []), m]);
  const photosByStem = new Map<string, number>();
  for (const p of photos) photosByStem.set(stemOf(p), (photosByStem.get(stemOf(p)) ?? 0) + 1);
  const pairs = new Map<string, string>();
  const missing: string[] = [];
  const ambiguous: string[] = [];
  for (const p of photos) {
    if (maskNames.has(p)) {
      pairs.set(p, p);
      continue;
    }
    const byStem = masksByStem.get(stemOf(p)) ?? [];
    if (byStem.length === 0) missing.push(p);
    else if (byStem.length > 1 || photosByStem.get(stemOf(p))! > 1) ambiguous.push(p);
    else pairs.set(p, byStem[0]);
  }
  if (ambiguous.length) {
    const stems = [...new Set(ambiguous.map(stemOf))];
    const show = stems.map((s) => {
      const ps = photos.filter((p) => stemOf(p) === s).join(' and ');
      const ms = (masksByStem.get(s) ?? []).join(' and ');
      return `photos ${ps} with masks ${ms}`;
    });
    throw new UsageError(
      `--masks ${dir}: cannot tell which mask is whose for ${show.join('; ')}: name each mask exactly like its photo (${ambiguous.join(', ')} ${ambiguous.length === 1 ? 'has no mask of its' : 'have no mask of their'} full name)`,
    );
  }
  if (missing.length)
    throw new UsageError(
      `--masks ${dir} has no mask for ${missing.join(', ')}: add an image with the same name (any image type) for each photo, ` +
        `white where the subject is (a white image trains the photo whole)`,
    );
  return pairs;
}

/** Whether a mask marks nothing to train: every pixel black or transparent (weight R x alpha = 0). */
export function isBlackMask(mask: RgbaImage): boolean {
  const d = mask.data;
  for (let i = 0; i < d.length; i += 4) if (d[i] !== 0 && d[i + 3] !== 0) return false;
  return true;
}

/**
 * Masks that train nothing: all of them black is refused (the run would train nothing, at loss 0); a black
 * mask among others leaves its photo out of the loss, which is named as a warning.
 */
export function checkBlackMasks(pairs: { photo: string; mask: string; image: RgbaImage }[], dir: string, warn: (m: string) => void): void {
  const black = pairs.filter((p) => isBlackMask(p.image));
  if (pairs.length > 0 && black.length === pairs.length)
    throw new UsageError(
      `--masks ${dir}: every mask is black (${black.map((p) => p.mask).join(', ')}), so nothing would be trained: paint the subject white in each mask (white is trained, black ignored)`,
    );
  for (const p of black) warn(`--masks ${join(dir, p.mask)} is black everywhere: its photo ${p.photo} adds nothing to the training`);
}
