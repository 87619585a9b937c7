// The one guard every command that writes goes through (Node host). Its rules:
// - never write over an input: an output path that is, or lies inside, a path the command reads (its model,
//   photos, LoRA, tokenizer, config) is refused before any work, compared by real location (links resolved)
//   and by file identity (device + inode, so a hard link is caught too);
// - never write through a link or into something that is not a regular file: a symlink, device node, FIFO or
//   socket at an output's name (or at its `.partial`) is refused, never followed or replaced;
// - a file is written to `<name>.partial`, created exclusively (O_CREAT | O_EXCL, which never follows a link),
//   fsync'ed, then renamed over the name, so the name holds either the old file or the whole new one;
// - an output folder records the entries the project wrote in it (MANIFEST); --overwrite removes exactly those,
//   and an entry the command would write over that the manifest does not list (the user's own tokenizer/,
//   README.md, ...) is refused rather than replaced.
import {
  closeSync,
  constants,
  fsyncSync,
  lstatSync,
  mkdirSync,
  openSync,
  readdirSync,
  readFileSync,
  realpathSync,
  renameSync,
  rmSync,
  statSync,
  writeSync,
  type Stats,
} from 'node:fs';
import { basename, dirname, join, resolve, sep } from 'node:path';

/** A refusal of an output path (a bad-input message: the CLI prints it as is). */
export class OutputPathError extends Error {}

/** A path the command reads, and the flag that named it. */
export interface ReadPath {
  flag: string;
  path: string | undefined;
}

/** The file an output folder's manifest lives in (top-level entry names the project wrote there). */
export const MANIFEST = '.dbs-written.json';

/** Where a file's bytes go until it is complete. */
export const partialPath = (path: string) => `${path}.partial`;

function lstatOrNull(path: string): Stats | null {
  try {
    return lstatSync(path);
  } catch {
    return null;
  }
}

/** What a non-regular directory entry is, in words. */
function kindOf(st: Stats): string {
  if (st.isSymbolicLink()) return 'a symbolic link';
  if (st.isDirectory()) return 'a folder';
  if (st.isFIFO()) return 'a FIFO (named pipe)';
  if (st.isCharacterDevice() || st.isBlockDevice()) return 'a device';
  if (st.isSocket()) return 'a socket';
  return 'not a regular file';
}

/** Refuses anything at `path` but a regular file (a link is not followed: lstat). */
export function refuseNonRegular(path: string, flag: string): void {
  const st = lstatOrNull(path);
  if (st && !st.isFile())
    throw new OutputPathError(
      `${flag} ${path} is ${kindOf(st)}: outputs are written only as regular files, never through a link or into a device; remove it or choose another path`,
    );
}

/** The real location `path` would have: its folder's real path and its own name (the name is not followed). */
function realTarget(path: string): string {
  const abs = resolve(path);
  try {
    return join(realpathSync(dirname(abs)), basename(abs));
  } catch {
    return abs;
  }
}

/** Refuses an output that is one of the inputs, or lies inside an input folder. */
function refuseInputs(flag: string, out: string, inputs: ReadPath[]): void {
  const target = realTarget(out);
  const outSt = lstatOrNull(out);
  for (const { flag: f, path } of inputs) {
    if (path === undefined) continue;
    let real: string;
    let st: Stats;
    try {
      real = realpathSync(path);
      st = statSync(path);
    } catch {
      continue; // a missing input is the input's own error, checked by the command
    }
    const sameFile = outSt !== null && outSt.isFile() && st.isFile() && outSt.dev === st.dev && outSt.ino === st.ino;
    if (target === real || sameFile)
      throw new OutputPathError(`${flag} ${out} is ${f} ${path}: writing it would destroy an input of this command; choose another ${flag}`);
    if (st.isDirectory() && target.startsWith(real.endsWith(sep) ? real : real + sep))
      throw new OutputPathError(`${flag} ${out} lies inside ${f} ${path}: the command never writes into its own inputs; choose another ${flag}`);
  }
}

/**
 * An output file, checked before any work: its folder exists, nothing but a regular file stands at its name
 * (or at its `.partial`), and it is none of `inputs`.
 */
export function checkOutFile(flag: string, out: string, inputs: ReadPath[]): void {
  const dir = dirname(resolve(out));
  const d = statOrNull(dir);
  if (!d) throw new OutputPathError(`${flag} ${out}: the folder ${dir} does not exist`);
  if (!d.isDirectory()) throw new OutputPathError(`${flag} ${out}: ${dir} is not a folder`);
  const st = lstatOrNull(out);
  if (st?.isDirectory()) throw new OutputPathError(`${flag} ${out} is a folder: give the file to write`);
  refuseNonRegular(out, flag);
  refuseNonRegular(partialPath(out), flag);
  refuseInputs(flag, out, inputs);
}

/**
 * An output folder, checked before it is created: not a file, link or device (a link to a folder is the
 * user's choice of place and is allowed), and neither an input nor inside one.
 */
export function checkOutFolder(flag: string, out: string, inputs: ReadPath[], what = 'a folder'): void {
  const st = lstatOrNull(out);
  if (st && !st.isDirectory()) {
    const target = st.isSymbolicLink() ? statOrNull(out) : null;
    if (!target?.isDirectory()) throw new OutputPathError(`${flag} ${out} is ${st.isFile() ? 'a file' : kindOf(st)}: give ${what} (it is created if missing)`);
  }
  refuseInputs(flag, out, inputs);
}

function statOrNull(path: string): Stats | null {
  try {
    return statSync(path);
  } catch {
    return null;
  }
}

/**
 * Opens `<path>.partial` for writing, exclusively: a regular file there (left by an interrupted write of
 * ours) is removed first; a link or device there is refused. Returns the descriptor.
 */
export function openPartial(path: string, flag = '--out', mode = 0o644): number {
  const temp = partialPath(path);
  refuseNonRegular(temp, flag);
  rmSync(temp, { force: true });
  // O_EXCL with O_CREAT fails on any existing entry, a dangling link included: nothing is ever followed.
  return openSync(temp, constants.O_WRONLY | constants.O_CREAT | constants.O_EXCL | (constants.O_NOFOLLOW ?? 0), mode);
}

/** Writes a whole file through `<path>.partial` (exclusive create, fsync, rename); never through a link. */
export function writeOutput(path: string, data: Uint8Array | string, opts: { flag?: string; mode?: number } = {}): void {
  const flag = opts.flag ?? '--out';
  refuseNonRegular(path, flag);
  const bytes = typeof data === 'string' ? new TextEncoder().encode(data) : data;
  const fd = openPartial(path, flag, opts.mode ?? 0o644);
  try {
    let done = 0;
    while (done < bytes.length) done += writeSync(fd, bytes, done, bytes.length - done);
    fsyncSync(fd);
  } catch (e) {
    closeSync(fd);
    rmSync(partialPath(path), { force: true });
    throw e;
  }
  closeSync(fd);
  renameSync(partialPath(path), path);
}

/** A manifest entry must be a plain name inside the folder (an edited manifest cannot reach outside it). */
const plainName = (n: unknown): n is string => typeof n === 'string' && n !== '' && n !== '.' && n !== '..' && !/[/\\]/.test(n);

/** The top-level entries the project wrote into `dir` (empty when it has no manifest). */
export function writtenEntries(dir: string): string[] {
  const path = join(dir, MANIFEST);
  const st = lstatOrNull(path);
  if (!st) return [];
  if (!st.isFile()) throw new OutputPathError(`${path} is ${kindOf(st)}, not the manifest this project writes: remove it`);
  let j: unknown;
  try {
    j = JSON.parse(readFileSync(path, 'utf8'));
  } catch {
    throw new OutputPathError(`${path}: invalid JSON (the list of what this project wrote here); remove the folder's outputs by hand`);
  }
  const written = (j as { written?: unknown } | null)?.written;
  if (!Array.isArray(written) || !written.every(plainName))
    throw new OutputPathError(`${path}: "written" must be a list of names in the folder; remove the folder's outputs by hand`);
  return written;
}

/** Adds `names` to the folder's manifest (before they are written, so a crash never leaves an unlisted output). */
export function recordWritten(dir: string, names: string[], flag = '--out'): void {
  const have = writtenEntries(dir);
  const all = [...new Set([...have, ...names])];
  if (all.length === have.length) return;
  writeOutput(join(dir, MANIFEST), JSON.stringify({ written: all }, null, 2) + '\n', { flag });
}

/**
 * Before a command writes `names` into `dir`: each must be absent or the project's own (in the manifest).
 * Anything else is the user's, and is refused rather than replaced.
 */
export function claimEntries(flag: string, dir: string, names: string[]): void {
  const ours = new Set(writtenEntries(dir));
  const theirs = names.filter((n) => !ours.has(n) && lstatOrNull(join(dir, n)) !== null);
  if (theirs.length)
    throw new OutputPathError(
      `${flag} ${dir} already holds ${theirs.join(', ')}, which this project did not write: choose a new or empty folder (nothing was changed)`,
    );
}

/** Where --overwrite keeps the outputs it replaces until the new run has been validated (set aside, not yet removed). */
export const ASIDE = '.dbs-replaced';

/** The outputs an --overwrite set aside: put back when the new command is refused, removed once it is under way. */
export interface SetAside {
  /** Removes what the new command wrote (its manifest's entries) and puts the set-aside entries and manifest back. */
  restore(): void;
  /** Removes them for good. */
  discard(): void;
}

/** Before any work: a `.dbs-replaced` left by a process killed during an --overwrite is the user's to settle. */
export function refuseLeftAside(flag: string, dir: string): void {
  const aside = join(dir, ASIDE);
  if (lstatOrNull(aside))
    throw new OutputPathError(
      `${flag} ${dir}: ${aside} holds the outputs an interrupted --overwrite set aside: move its entries back into ${dir} to keep that run, or remove it`,
    );
}

/**
 * --overwrite, for every command that writes a folder (train, the demo-model lab's pretrain, train --bundle),
 * in the order "validate fully, then remove, then create": the entries the manifest lists (and the manifest)
 * are renamed into `<dir>/.dbs-replaced/`, so the new command starts in a folder without them; only once it
 * has passed every check are they removed (discard). A refusal in between puts them back (restore), so a
 * refused overwrite never loses the old outputs; a process that exits with neither done (an uncaught refusal,
 * a stop signal's exit) restores them on its way out. A `.dbs-replaced` left by a killed process is refused,
 * naming it, rather than emptied.
 */
export function setAsideWritten(dir: string, flag = '--out'): SetAside {
  refuseLeftAside(flag, dir);
  const aside = join(dir, ASIDE);
  const names = writtenEntries(dir).filter((n) => lstatOrNull(join(dir, n)) !== null);
  mkdirSync(aside);
  for (const n of [...names, MANIFEST]) if (lstatOrNull(join(dir, n))) renameSync(join(dir, n), join(aside, n));
  let settled = false;
  const settle = () => {
    settled = true;
    process.off('exit', onExit);
  };
  const handle: SetAside = {
    restore() {
      if (settled) return;
      settle();
      removeWritten(dir);
      for (const n of readdirSync(aside)) {
        rmSync(join(dir, n), { recursive: true, force: true });
        renameSync(join(aside, n), join(dir, n));
      }
      rmSync(aside, { recursive: true, force: true });
    },
    discard() {
      if (settled) return;
      settle();
      rmSync(aside, { recursive: true, force: true });
    },
  };
  const onExit = () => {
    try {
      handle.restore();
    } catch {
      // What is left in .dbs-replaced is named by the next command on this folder (refuseLeftAside).
    }
  };
  process.on('exit', onExit);
  return handle;
}

/**
 * Writes a folder's outputs with `write` under the one --overwrite guard: with `overwrite`, the outputs there
 * are set aside first (setAsideWritten) and discarded only once `write` has finished; a failure part-way
 * removes what it wrote (the manifest's entries) and puts the old outputs back, so the folder is as it was.
 */
export function writeFolderOutputs(dir: string, flag: string, overwrite: boolean, write: () => void): void {
  const replaced = overwrite ? setAsideWritten(dir, flag) : null;
  try {
    write();
  } catch (e) {
    if (replaced) replaced.restore();
    else removeWritten(dir);
    throw e;
  }
  replaced?.discard();
}

/** --overwrite: removes exactly the entries the manifest lists (a link among them is removed, not followed), then the manifest. */
export function removeWritten(dir: string): string[] {
  const names = writtenEntries(dir);
  for (const n of names) rmSync(join(dir, n), { recursive: true, force: true });
  rmSync(join(dir, MANIFEST), { force: true });
  return names;
}
