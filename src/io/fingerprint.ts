// Fingerprints of a run's inputs (Node host), recorded when the run starts and checked when it is resumed, so
// a resumed run never steps on other weights or trains on latents cached from other photos. A base model is
// fingerprinted by what tells one model from another cheaply: every safetensors header (names, shapes,
// dtypes, offsets) and a sample of its bytes (SAMPLES blocks spread evenly over the tensor data: another
// model of the same architecture differs in almost every weight, so it differs in the sample), and its small
// files (configs, tokenizer) whole. Photos, masks and captions are small and hashed whole. Only regular files
// are read (a FIFO or device is never opened: it could block for ever); links are followed to files.
import { closeSync, openSync, readdirSync, readSync, statSync } from 'node:fs';
import { createHash } from 'node:crypto';
import { join } from 'node:path';

export interface FileFingerprint {
  size: number;
  /** sha256 (hex) of the file, or of its header and sampled blocks for a large file. */
  digest: string;
}

/** Fingerprints by path relative to the fingerprinted folder (the file's own name for a single file). */
export type Fingerprints = Record<string, FileFingerprint>;

/** Files up to this size are hashed whole. */
const WHOLE_MAX_BYTES = 1 << 20;
/** Sampled blocks of a large file, and their size. */
const SAMPLES = 32;
const SAMPLE_BYTES = 4096;
/** A safetensors header longer than this is not read as one (the loader names such a file). */
const HEADER_MAX_BYTES = 100 << 20;

function readAt(fd: number, position: number, length: number): Buffer {
  const buf = Buffer.alloc(length);
  let done = 0;
  while (done < length) {
    const n = readSync(fd, buf, done, length - done, position + done);
    if (n === 0) break;
    done += n;
  }
  return buf.subarray(0, done);
}

/** One regular file's fingerprint: whole when small; else its safetensors header (if any) and SAMPLES blocks. */
export function fileFingerprint(path: string): FileFingerprint {
  const size = statSync(path).size;
  const h = createHash('sha256');
  const fd = openSync(path, 'r');
  try {
    if (size <= WHOLE_MAX_BYTES) h.update(readAt(fd, 0, size));
    else {
      const n = Number(readAt(fd, 0, 8).readBigUInt64LE(0));
      const header = n > 0 && 8 + n <= size && n <= HEADER_MAX_BYTES ? 8 + n : 0;
      h.update(readAt(fd, 0, header));
      const span = Math.max(0, size - header - SAMPLE_BYTES);
      for (let i = 0; i < SAMPLES; i++) h.update(readAt(fd, header + Math.floor((span * i) / (SAMPLES - 1)), SAMPLE_BYTES));
    }
  } finally {
    closeSync(fd);
  }
  return { size, digest: h.digest('hex') };
}

/** Whether `path` is (or links to) a regular file; a loop, a dangling link or a FIFO is not. */
function isRegularFile(path: string): boolean {
  try {
    return statSync(path).isFile();
  } catch {
    return false;
  }
}

/**
 * A folder's fingerprints: every regular, non-hidden file in it, and in its sub-folders down to `depth`
 * (a diffusers model keeps its weights one level down). A file is fingerprinted by fileFingerprint.
 */
export function folderFingerprints(dir: string, depth = 0): Fingerprints {
  const out: Fingerprints = {};
  const walk = (rel: string, left: number) => {
    for (const e of readdirSync(join(dir, rel), { withFileTypes: true }).sort((a, b) => (a.name < b.name ? -1 : 1))) {
      if (e.name.startsWith('.')) continue;
      const r = rel ? `${rel}/${e.name}` : e.name;
      if (isRegularFile(join(dir, r))) out[r] = fileFingerprint(join(dir, r));
      else if (left > 0 && e.isDirectory()) walk(r, left - 1);
    }
  };
  walk('', depth);
  return out;
}

/** A model's fingerprints: a diffusers folder's files (one level of sub-folders), or the single file. */
export function modelFingerprints(path: string): Fingerprints {
  if (statSync(path).isDirectory()) return folderFingerprints(path, 1);
  return isRegularFile(path) ? { [path.split('/').pop()!]: fileFingerprint(path) } : {};
}

/** What differs between a recorded set of fingerprints and today's, in words ('' when nothing does). */
export function fingerprintChanges(was: Fingerprints, now: Fingerprints, opts: { added: boolean }): string {
  const changed: string[] = [];
  const removed: string[] = [];
  for (const [name, fp] of Object.entries(was)) {
    const n = now[name];
    if (!n) removed.push(name);
    else if (n.size !== fp.size || n.digest !== fp.digest) changed.push(name);
  }
  const added = opts.added ? Object.keys(now).filter((name) => !(name in was)) : [];
  const list = (what: string, names: string[]) =>
    names.length ? [`${names.slice(0, 5).join(', ')}${names.length > 5 ? ` and ${names.length - 5} more` : ''} ${what}`] : [];
  return [...list('changed', changed), ...list('removed', removed), ...list('added', added)].join('; ');
}

/** Checks the shape of a recorded set (a run record is never trusted); null when it is not one. */
export function asFingerprints(x: unknown): Fingerprints | null {
  if (typeof x !== 'object' || x === null || Array.isArray(x)) return null;
  for (const v of Object.values(x as Record<string, unknown>)) {
    const f = v as Partial<FileFingerprint> | null;
    if (typeof f !== 'object' || f === null || typeof f.size !== 'number' || typeof f.digest !== 'string') return null;
  }
  return x as Fingerprints;
}
