// Node host: the chunk store as files in one directory (CLI, tests, benchmarks).
//
// Layout: one file per chunk, `<dir>/<key with '/' as '~'>.chunk`. A flat directory, because a hierarchical
// one cannot hold both `a` and `a/b` (a file and a directory of the same name); '~' is not allowed in keys,
// so the mapping is one-to-one. Each file is a 16-byte header (magic "DBC1", CRC-32, payload length as u64,
// little-endian) followed by the payload; read() checks all three.
//
// Atomic replace: the new version is written to a temp file in the same directory (`.<name>.<random>.tmp`;
// keys cannot start with '.', so temp names never collide with chunks), fsync'd, then renamed over the
// chunk, then the directory is fsync'd so the rename itself survives a power cut. rename(2) replaces the
// target atomically, so a reader (or the next process after a crash) sees the old file or the complete new
// one. Temp files left by a crash are removed by open().
//
// The store assumes it is the only writer of its directory (one training run per store): the byte count
// behind bytesUsed() and the simulated quota is taken at open and kept up to date by this object.
import { randomBytes } from 'node:crypto';
import { mkdir, open, readdir, rename, rm, stat, type FileHandle } from 'node:fs/promises';
import { join, resolve } from 'node:path';
import { checkQuota, ChunkStoreError, StorageFullError, validateKey, validatePrefix, verifyChunk, crc32, sortedKeys, type ChunkStore } from './chunkstore.ts';

const MAGIC = 0x31434244; // "DBC1" read as a little-endian u32
export const FS_HEADER_BYTES = 16;
const SUFFIX = '.chunk';
const TEMP = /^\..*\.tmp$/;

export interface FsChunkStoreOptions {
  /** Simulates a small disk: a write that would take the payload total past this fails with StorageFullError. */
  quotaBytes?: number;
}

/** Error codes meaning the disk (or the user's disk quota) is full. */
export function isDiskFullError(err: unknown): boolean {
  const code = (err as { code?: unknown } | null)?.code;
  return code === 'ENOSPC' || code === 'EDQUOT';
}

/** The file a key lives in (exported for tests that damage chunks on disk). */
export function chunkFileName(key: string): string {
  return key.replaceAll('/', '~') + SUFFIX;
}

function keyOfFile(name: string): string | null {
  if (name.startsWith('.') || !name.endsWith(SUFFIX)) return null;
  return name.slice(0, -SUFFIX.length).replaceAll('~', '/');
}

export class FsChunkStore implements ChunkStore {
  readonly kind = 'fs' as const;
  /** Payload bytes per key, read at open and maintained by write/delete. */
  private readonly sizes: Map<string, number>;
  private used = 0;
  /** Bytes of writes in flight, counted against the quota so concurrent writes cannot overshoot it together. */
  private reserved = 0;
  private closed = false;

  private constructor(
    readonly dir: string,
    sizes: Map<string, number>,
    private readonly opts: FsChunkStoreOptions,
  ) {
    this.sizes = sizes;
    for (const n of sizes.values()) this.used += n;
  }

  get name(): string {
    return this.dir;
  }

  /** Opens (creating if needed) the store in `dir`, removing temp files left by an interrupted write. */
  static async open(dir: string, opts: FsChunkStoreOptions = {}): Promise<FsChunkStore> {
    const root = resolve(dir);
    try {
      await mkdir(root, { recursive: true });
      const sizes = new Map<string, number>();
      for (const name of await readdir(root)) {
        if (TEMP.test(name)) {
          // An uncommitted write: the chunk it was replacing is still in place, so the temp is just garbage.
          await rm(join(root, name), { force: true });
          continue;
        }
        const key = keyOfFile(name);
        if (key === null) continue;
        const st = await stat(join(root, name));
        if (st.isFile()) sizes.set(key, Math.max(0, st.size - FS_HEADER_BYTES));
      }
      return new FsChunkStore(root, sizes, opts);
    } catch (err) {
      throw new ChunkStoreError(`could not open the chunk store in ${root}: ${(err as Error).message}`, undefined, { cause: err });
    }
  }

  async write(key: string, data: Uint8Array): Promise<void> {
    this.ensureOpen();
    validateKey(key);
    const file = this.pathOf(key);
    checkQuota(key, data.length, this.opts.quotaBytes, this.used + this.reserved, this.sizes.get(key) ?? 0);
    this.reserved += data.length;
    const tmp = join(this.dir, `.${chunkFileName(key)}.${randomBytes(6).toString('hex')}.tmp`);
    try {
      await writeFileDurably(tmp, header(data), data);
      await rename(tmp, file);
    } catch (err) {
      await rm(tmp, { force: true }).catch(() => {}); // best effort: open() removes it otherwise
      throw this.ioError(err, key, data.length, 'write');
    } finally {
      this.reserved -= data.length;
    }
    this.used += data.length - (this.sizes.get(key) ?? 0);
    this.sizes.set(key, data.length);
    await this.syncDir(key);
  }

  async read(key: string): Promise<Uint8Array | null> {
    this.ensureOpen();
    validateKey(key);
    const file = this.pathOf(key);
    let fh: FileHandle;
    try {
      fh = await open(file, 'r');
    } catch (err) {
      if ((err as { code?: unknown }).code === 'ENOENT') return null;
      throw this.ioError(err, key, 0, 'read');
    }
    try {
      return await readChunkFile(fh, key, file);
    } catch (err) {
      throw err instanceof ChunkStoreError ? err : this.ioError(err, key, 0, 'read');
    } finally {
      await fh.close();
    }
  }

  async delete(key: string): Promise<void> {
    this.ensureOpen();
    validateKey(key);
    try {
      await rm(this.pathOf(key), { force: true });
    } catch (err) {
      throw this.ioError(err, key, 0, 'delete');
    }
    this.used -= this.sizes.get(key) ?? 0;
    this.sizes.delete(key);
  }

  async keys(prefix = ''): Promise<string[]> {
    this.ensureOpen();
    validatePrefix(prefix);
    // The directory listing is the truth for what exists; it is cheap next to any chunk I/O.
    let names: string[];
    try {
      names = await readdir(this.dir);
    } catch (err) {
      throw new ChunkStoreError(`could not list the chunk store ${this.dir}: ${(err as Error).message}`, undefined, { cause: err });
    }
    return sortedKeys(
      names.map(keyOfFile).filter((k): k is string => k !== null),
      prefix,
    );
  }

  async bytesUsed(): Promise<number> {
    this.ensureOpen();
    return this.used;
  }

  async close(): Promise<void> {
    this.closed = true;
  }

  /** Absolute path of a key's file (for tests and diagnostics). */
  pathOf(key: string): string {
    return join(this.dir, chunkFileName(key));
  }

  /** Makes the rename durable (POSIX); platforms that cannot open or fsync a directory (Windows) skip it. */
  private async syncDir(key: string): Promise<void> {
    let fh: FileHandle | undefined;
    try {
      fh = await open(this.dir, 'r');
      await fh.sync();
    } catch (err) {
      const code = (err as { code?: unknown }).code;
      if (code !== 'EISDIR' && code !== 'EPERM' && code !== 'EINVAL' && code !== 'ENOTSUP' && code !== 'EACCES') {
        throw this.ioError(err, key, 0, 'sync the directory after writing');
      }
    } finally {
      await fh?.close();
    }
  }

  private ioError(err: unknown, key: string, bytes: number, op: string): Error {
    if (err instanceof ChunkStoreError || err instanceof StorageFullError) return err;
    const code = (err as { code?: unknown }).code;
    if (isDiskFullError(err)) {
      return new StorageFullError(key, bytes, { reason: `${String(code)}: the disk holding ${this.dir} is full` }, { cause: err });
    }
    return new ChunkStoreError(`could not ${op} chunk "${key}" (${this.pathOf(key)}): ${(err as Error).message}`, key, { cause: err });
  }

  private ensureOpen(): void {
    if (this.closed) throw new ChunkStoreError(`file chunk store ${this.dir} is closed`);
  }
}

function header(data: Uint8Array): Uint8Array {
  const h = new Uint8Array(FS_HEADER_BYTES);
  const v = new DataView(h.buffer);
  v.setUint32(0, MAGIC, true);
  v.setUint32(4, crc32(data), true);
  v.setBigUint64(8, BigInt(data.length), true);
  return h;
}

/** Writes header + data to a new file (exclusive create) and fsyncs it before returning. */
async function writeFileDurably(path: string, head: Uint8Array, data: Uint8Array): Promise<void> {
  const fh = await open(path, 'wx');
  try {
    await writeAll(fh, head, 0);
    await writeAll(fh, data, head.length);
    await fh.sync();
  } finally {
    await fh.close();
  }
}

/** write(2) may write less than asked (and at most ~2 GiB per call on Linux): loop until all is written. */
async function writeAll(fh: FileHandle, data: Uint8Array, position: number): Promise<void> {
  let done = 0;
  while (done < data.length) {
    const { bytesWritten } = await fh.write(data, done, data.length - done, position + done);
    if (bytesWritten <= 0) throw new Error(`write returned ${bytesWritten}`);
    done += bytesWritten;
  }
}

async function readAll(fh: FileHandle, into: Uint8Array, position: number): Promise<number> {
  let done = 0;
  while (done < into.length) {
    const { bytesRead } = await fh.read(into, done, into.length - done, position + done);
    if (bytesRead === 0) break; // end of file: the caller reports the short read
    done += bytesRead;
  }
  return done;
}

/** Reads and verifies one chunk file; the payload gets its own ArrayBuffer (no header in front of it). */
async function readChunkFile(fh: FileHandle, key: string, file: string): Promise<Uint8Array> {
  const size = (await fh.stat()).size;
  const head = new Uint8Array(FS_HEADER_BYTES);
  if ((await readAll(fh, head, 0)) < FS_HEADER_BYTES) {
    throw new ChunkStoreError(`chunk "${key}" is truncated or damaged (${file}): ${size} bytes, shorter than its ${FS_HEADER_BYTES}-byte header`, key);
  }
  const v = new DataView(head.buffer);
  if (v.getUint32(0, true) !== MAGIC) throw new ChunkStoreError(`chunk "${key}" is damaged (${file}): not a chunk file (bad magic)`, key);
  const length = v.getBigUint64(8, true);
  if (BigInt(size) !== BigInt(FS_HEADER_BYTES) + length) {
    throw new ChunkStoreError(
      `chunk "${key}" is truncated or damaged (${file}): the file has ${size - FS_HEADER_BYTES} payload bytes, its header says ${length}`,
      key,
    );
  }
  const out = new Uint8Array(Number(length));
  const got = await readAll(fh, out, FS_HEADER_BYTES);
  verifyChunk(key, got === out.length ? out : out.subarray(0, got), { length: out.length, crc32: v.getUint32(4, true) }, file);
  return out;
}
