// Loss masks given as files with the photos, as kohya and the CLI's --masks take them: a mask has its photo's
// name. Dropped or picked together with the photos, a file is a mask when it sits in a folder named mask or
// masks (photos/dog.png + masks/dog.png: kohya's same-name rule) or carries a mask suffix beside its photo
// (dog_mask.png, dog-mask.png, dog.mask.png); its photo is the one with that name stem (any image type), among
// those given with it or already on the page. Pure: the page decodes and attaches them (actions.ts addPhotos).

/** A given file: its path in the drop (folder/name) or just its name. */
export interface GivenFile {
  path: string;
}

export interface MaskSplit {
  /** Indices of the files that are photos. */
  photos: number[];
  /** Each mask file's index and the stem of its photo. */
  masks: { index: number; stem: string }[];
  /** Mask files whose photo is neither given nor on the page: named in a message, not added as photos. */
  orphans: number[];
}

const MASK_FOLDER = /(^|\/)masks?\/[^/]+$/i;
const MASK_SUFFIX = /^(.*?)(?:[_.-]mask)$/i;

/** A file name without its folder and its last extension. */
export function stemOf(path: string): string {
  const name = path.slice(path.lastIndexOf('/') + 1);
  const dot = name.lastIndexOf('.');
  return dot > 0 ? name.slice(0, dot) : name;
}

/** Sorts the given files into photos and masks (with their photo's stem); `onPage`: names of photos already there. */
export function splitMasks(files: readonly GivenFile[], onPage: readonly string[]): MaskSplit {
  const candidates = files.map((f) => {
    const stem = stemOf(f.path);
    if (MASK_FOLDER.test(f.path)) return { stem, mask: true };
    const m = MASK_SUFFIX.exec(stem);
    return m && m[1] ? { stem: m[1], mask: true } : { stem, mask: false };
  });
  const photoStems = new Set([...onPage.map(stemOf), ...candidates.filter((c) => !c.mask).map((c) => c.stem)]);
  const out: MaskSplit = { photos: [], masks: [], orphans: [] };
  candidates.forEach((c, index) => {
    if (!c.mask) out.photos.push(index);
    else if (photoStems.has(c.stem)) out.masks.push({ index, stem: c.stem });
    else out.orphans.push(index);
  });
  return out;
}
