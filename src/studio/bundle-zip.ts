// The studio's job-bundle download: the files of pipeline/bundle.ts (the same builder, and so the same quoting
// of every typed value in train.sh, as `cli bundle`) zipped under one folder. What the command line's output
// guard is to a folder on disk, this is to the zip: every entry unpacks inside that folder (relative,
// '/'-separated, no '.' or '..' segment, no backslash or control character, no name twice), so no prompt,
// photo or model name can make an unzip write elsewhere; train.sh keeps its executable bit.
import { downloadZip } from 'client-zip';
import { encode as encodePng } from 'fast-png';
import { jobBundle, type BundleFile, type BundleInput } from '../pipeline/bundle.ts';

/** The folder the zip unpacks into (and the zip's own name). */
export const BUNDLE_FOLDER = 'dreambooth-job';

/** A bundle entry that would not unpack inside its folder: a bug in the builder, never shipped as a zip. */
export class BundleEntryError extends Error {
  override name = 'BundleEntryError';
}

/** Throws unless every path is a plain relative path inside the bundle's folder, each given once. */
export function checkEntryPaths(paths: readonly string[]): void {
  const seen = new Set<string>();
  for (const p of paths) {
    const segments = p.split('/');
    // eslint-disable-next-line no-control-regex -- control characters are what this looks for
    const bad = p === '' || /[\\\u0000-\u001f\u007f]/.test(p) || /^[A-Za-z]:/.test(p) || segments.some((s) => s === '' || s === '.' || s === '..');
    if (bad) throw new BundleEntryError(`job bundle entry ${JSON.stringify(p)} would unpack outside ${BUNDLE_FOLDER}/`);
    if (seen.has(p)) throw new BundleEntryError(`job bundle entry ${JSON.stringify(p)} is written twice`);
    seen.add(p);
  }
}

/** The zip's entries for a bundle's files, checked. */
export function zipEntries(files: readonly BundleFile[]): { name: string; input: string | Uint8Array; lastModified: Date; mode?: number }[] {
  checkEntryPaths(files.map((f) => f.path));
  return files.map((f) => ({ name: `${BUNDLE_FOLDER}/${f.path}`, input: f.data, lastModified: new Date(0), ...(f.executable ? { mode: 0o755 } : {}) }));
}

/** The run (photos already decoded by the host) as the downloaded zip. */
export async function bundleZip(input: BundleInput): Promise<{ blob: Blob; name: string; size: number }> {
  const files = jobBundle(input, (rgb, width, height) => encodePng({ width, height, data: rgb, channels: 3, depth: 8 }));
  const blob = await downloadZip(zipEntries(files)).blob();
  return { blob, name: `${BUNDLE_FOLDER}.zip`, size: blob.size };
}
