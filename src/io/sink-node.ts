// Node host: a file as a ByteSink (written sequentially, closed at the end), safely:
// - the bytes go to `<name>.partial` in the same folder, which is fsync'ed and renamed over `<name>` only
//   when close() succeeds, so a crash, a full disk or a failed export (a NaN tensor) never leaves a
//   truncated file at the final name, and an older file there stays as it was until the new one is whole;
// - on any failure the temp file is removed (also by abort(), which the exporters' pump calls);
// - a full disk, a read-only folder or a permission problem becomes a message naming the folder, the file
//   and what to do, instead of a bare "ENOSPC: no space left on device, write".
// The file system calls go through a small interface (FileOps) so tests can inject a failing disk.
import { open, rename, rm } from 'node:fs/promises';
import { basename, dirname } from 'node:path';
import { partialPath, refuseNonRegular } from './outpath.ts';
import type { ByteSink } from './safetensors.ts';

/** The file handle calls the sink makes (a subset of node:fs/promises' FileHandle). */
export interface FileHandleOps {
  write(buffer: Uint8Array, offset: number, length: number): Promise<{ bytesWritten: number }>;
  sync(): Promise<void>;
  close(): Promise<void>;
}

/** The file system calls the sink makes: node:fs/promises by default, a failing fake in tests. */
export interface FileOps {
  open(path: string, flags: string): Promise<FileHandleOps>;
  rename(from: string, to: string): Promise<void>;
  remove(path: string): Promise<void>;
  /** Makes the rename durable (fsync of the folder); best effort, not every platform can open a folder. */
  syncDir(dir: string): Promise<void>;
}

export const nodeFileOps: FileOps = {
  open: (path, flags) => open(path, flags),
  rename: (from, to) => rename(from, to),
  remove: (path) => rm(path, { force: true }),
  async syncDir(dir) {
    try {
      const fh = await open(dir, 'r');
      try {
        await fh.sync();
      } finally {
        await fh.close();
      }
    } catch {
      // Windows cannot open a folder for fsync; the rename itself is still atomic there.
    }
  },
};

export interface NodeFileSink extends ByteSink {
  /** The file's total size, when known before writing: the disk-full message then says how much room is needed. */
  expectBytes(total: number): void;
  /** Stops writing and removes the temp file; the final name is left as it was. Safe to call twice. */
  abort(reason?: unknown): Promise<void>;
}

export { partialPath };

const mib = (bytes: number) => Math.max(1, Math.ceil(bytes / 2 ** 20));

/** A file system error as a message naming the folder and file and saying what to do; others unchanged. */
function describeWriteError(e: unknown, path: string, written: number, expected?: number): Error {
  const code = (e as NodeJS.ErrnoException | undefined)?.code;
  const dir = dirname(path);
  const file = basename(path);
  const why = `${dir}: `;
  if (code === 'ENOSPC' || code === 'EDQUOT') {
    const what = code === 'ENOSPC' ? 'the disk is full' : 'the disk quota is used up';
    // The incomplete file is removed, so the whole file must fit: say its size when it is known.
    const need =
      expected !== undefined && expected > 0
        ? `it needs ${mib(expected)} MiB, free at least that much there`
        : `it filled up after ${mib(written)} MiB, free more than that there`;
    return new Error(`${why}${what} (${code}) while writing ${file}: ${need} or choose another --out folder (the incomplete file was removed)`, { cause: e });
  }
  if (code === 'EROFS') return new Error(`${why}read-only folder (EROFS), cannot write ${file}: choose another --out folder on a writable disk`, { cause: e });
  if (code === 'EACCES' || code === 'EPERM')
    return new Error(`${why}no permission to write ${file} there (${code}): choose another --out folder, or make this one writable (chmod u+w)`, { cause: e });
  if (code === 'ENOENT') return new Error(`${why}no such folder, cannot write ${file}: create it first or choose another --out folder`, { cause: e });
  if (code === 'ENOTDIR') return new Error(`${why}not a folder, cannot write ${file}: choose another --out folder`, { cause: e });
  return e instanceof Error ? e : new Error(String(e));
}

/**
 * Opens `<path>.partial` for writing. close() fsyncs it and renames it to `path`; abort() or any failed
 * write/close removes it. Errors are turned into messages by describeWriteError.
 */
export async function nodeFileSink(path: string, fs: FileOps = nodeFileOps): Promise<NodeFileSink> {
  const temp = partialPath(path);
  // Nothing but a regular file is replaced, and the temp file is created exclusively ('wx': O_CREAT | O_EXCL,
  // which never follows a link planted at its name); a regular one left by an interrupted write goes first.
  refuseNonRegular(path, '--out');
  refuseNonRegular(temp, '--out');
  let fh: FileHandleOps;
  try {
    await fs.remove(temp);
    fh = await fs.open(temp, 'wx');
  } catch (e) {
    throw describeWriteError(e, path, 0);
  }
  let written = 0;
  let expected: number | undefined;
  let state: 'open' | 'closed' | 'failed' = 'open';

  /** Closes and removes the temp file (once); the final name is never touched. */
  const discard = async () => {
    if (state !== 'open') return;
    state = 'failed';
    await fh.close().catch(() => undefined);
    await fs.remove(temp).catch(() => undefined);
  };
  const fail = async (e: unknown): Promise<never> => {
    await discard();
    throw describeWriteError(e, path, written, expected);
  };

  return {
    expectBytes(total) {
      expected = total;
    },
    async write(chunk) {
      if (state !== 'open') throw new Error(`${path}: write after the file was ${state === 'closed' ? 'closed' : 'abandoned'}`);
      try {
        let done = 0;
        while (done < chunk.length) done += (await fh.write(chunk, done, chunk.length - done)).bytesWritten;
        written += done;
      } catch (e) {
        await fail(e);
      }
    },
    async close() {
      if (state !== 'open') throw new Error(`${path}: close after the file was ${state === 'closed' ? 'closed' : 'abandoned'}`);
      try {
        // fsync before the rename: otherwise a power cut can leave a renamed but empty or partial file.
        await fh.sync();
        await fh.close();
      } catch (e) {
        await fail(e);
      }
      state = 'closed';
      try {
        refuseNonRegular(path, '--out'); // a link or device put there while writing is not replaced either
        await fs.rename(temp, path);
      } catch (e) {
        await fs.remove(temp).catch(() => undefined);
        throw describeWriteError(e, path, written, expected);
      }
      await fs.syncDir(dirname(path));
    },
    abort: discard,
  };
}
