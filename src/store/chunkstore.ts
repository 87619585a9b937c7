// The offload tier's chunk store: weights, optimizer states (fp32 master + AdamW moments) and checkpoints
// live here as named chunks and stream to the GPU. This file is host-neutral: the interface, the errors,
// key rules, the integrity check every implementation applies, and an in-memory store for dry runs and
// tests. IndexedDB (idb-store.ts, the browser) and the file system (fs-store.ts, Node) implement the same
// contract, checked by one shared test suite (tests/store/contract.ts).
import { formatBytes as formatSize } from '../util/bytes.ts';

export interface ChunkStore {
  readonly kind: 'indexeddb' | 'fs' | 'memory';
  readonly name: string;
  /** Atomic replace: readers see either the old bytes or all of the new ones, never a part (also across a crash). */
  write(key: string, data: Uint8Array): Promise<void>;
  /**
   * Null when absent. The bytes are verified (length + CRC-32) first; a damaged chunk throws ChunkStoreError.
   * The array is the caller's: it owns its whole ArrayBuffer (byteOffset 0), so typed views over it are safe.
   */
  read(key: string): Promise<Uint8Array | null>;
  /** Removing an absent key is not an error. */
  delete(key: string): Promise<void>;
  /** Keys starting with prefix, sorted. */
  keys(prefix?: string): Promise<string[]>;
  /** Bytes this store holds (sum of chunk sizes), for the "storage bytes" gauge. */
  bytesUsed(): Promise<number>;
  close(): Promise<void>;
}

// ---------------------------------------------------------------------------------------------- errors

/**
 * The user's storage (browser quota or disk) is full. The write that hit it changed nothing: the previous
 * version of `key` (if any) is intact. The message says what to do, since it reaches the user as is.
 */
export class StorageFullError extends Error {
  override readonly name = 'StorageFullError';
  constructor(
    readonly key: string,
    /** Size of the chunk that could not be written. */
    readonly bytes: number,
    /** What was known about the limit, for the message: quota and usage in bytes, or the host's wording. */
    readonly detail: { quota?: number; used?: number; reason?: string } = {},
    options?: { cause?: unknown },
  ) {
    super(storageFullMessage(key, bytes, detail), options);
  }
}

function storageFullMessage(key: string, bytes: number, d: { quota?: number; used?: number; reason?: string }): string {
  const parts: string[] = [];
  if (d.reason) parts.push(d.reason);
  if (d.quota !== undefined) parts.push(`${exactBytes(d.used ?? 0)} of the ${exactBytes(d.quota)} quota in use`);
  return (
    `Storage is full: could not write ${exactBytes(bytes)} for chunk "${key}"${parts.length ? ` (${parts.join('; ')})` : ''}. ` +
    `The previous version of this chunk is intact. Free space (delete old runs or other site data / files), then resume.`
  );
}

/** Any other chunk store failure: a bad key, a corrupt or unreadable chunk, an I/O error, a closed store. */
export class ChunkStoreError extends Error {
  override readonly name = 'ChunkStoreError';
  constructor(
    message: string,
    /** The chunk concerned, when there is one. */
    readonly key?: string,
    options?: { cause?: unknown },
  ) {
    super(message, options);
  }
}

/** "64.0 MiB (67108864 bytes)": the exact count for logs, the rounded one for people. */
const exactBytes = (n: number): string => formatSize(n, { exact: true });

// ---------------------------------------------------------------------------------------------- keys

/** Longest key accepted: the file system store turns a key into one file name (NAME_MAX is 255 bytes). */
export const MAX_KEY_LENGTH = 200;
const SEGMENT = /^[A-Za-z0-9_-][A-Za-z0-9._-]*$/;
const KEY_RULE = `keys are '/'-separated segments of A-Z a-z 0-9 . _ - (not starting with '.'), at most ${MAX_KEY_LENGTH} characters`;

/**
 * Throws ChunkStoreError unless `key` is valid in every store. The rules are the file system's, applied
 * everywhere so that a key that works in a dry run (memory) also works on disk and in IndexedDB:
 * no empty key or segment ('a//b' and 'a/b' would be one file), no '.' / '..' segments (path escape or
 * aliasing), no segment starting with '.' (reserved for temp files), only characters that are safe on
 * every common file system. Keys differing only in letter case are distinct here but would share a file on
 * case-insensitive file systems (macOS, Windows): callers should not rely on case alone.
 */
export function validateKey(key: string): void {
  if (typeof key !== 'string' || key.length === 0) throw new ChunkStoreError(`bad chunk key ${JSON.stringify(key)}: empty (${KEY_RULE})`, String(key));
  if (key.length > MAX_KEY_LENGTH) throw new ChunkStoreError(`bad chunk key "${key.slice(0, 40)}...": ${key.length} characters is too long (${KEY_RULE})`, key);
  const segments = key.split('/');
  for (const s of segments) {
    if (s === '') throw new ChunkStoreError(`bad chunk key ${JSON.stringify(key)}: empty segment (leading, trailing or doubled '/') (${KEY_RULE})`, key);
    if (s === '..' || s === '.') throw new ChunkStoreError(`bad chunk key ${JSON.stringify(key)}: '${s}' segments are not allowed (${KEY_RULE})`, key);
    if (!SEGMENT.test(s)) {
      const bad = [...s].find((c) => !/[A-Za-z0-9._-]/.test(c));
      const why = bad !== undefined ? `character ${JSON.stringify(bad)} is not allowed` : `segment "${s}" starts with '.'`;
      throw new ChunkStoreError(`bad chunk key ${JSON.stringify(key)}: ${why} (${KEY_RULE})`, key);
    }
  }
}

/** A keys() prefix may end in '/' or part-way through a segment, so it only needs the character rule. */
export function validatePrefix(prefix: string): void {
  if (!/^[A-Za-z0-9._/-]*$/.test(prefix)) throw new ChunkStoreError(`bad key prefix ${JSON.stringify(prefix)}: ${KEY_RULE}`, prefix);
}

// ---------------------------------------------------------------------------------------------- integrity

// CRC-32 (IEEE 802.3, the zlib / PNG one), slicing-by-8: eight 256-entry tables let the loop consume 8 bytes
// per step. About 1.5 GB/s in V8, so verifying a 64 MiB chunk costs ~40 ms, well under its disk time.
const CRC_TABLES = (() => {
  const t = new Uint32Array(8 * 256);
  for (let n = 0; n < 256; n++) {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    t[n] = c >>> 0;
  }
  for (let n = 0; n < 256; n++) {
    let c = t[n];
    for (let k = 1; k < 8; k++) {
      c = t[c & 0xff] ^ (c >>> 8);
      t[k * 256 + n] = c;
    }
  }
  return t;
})();
const LITTLE_ENDIAN = new Uint8Array(new Uint32Array([1]).buffer)[0] === 1;

/** CRC-32 of `data`; pass a previous result as `crc` to continue over data split in parts. */
export function crc32(data: Uint8Array, crc = 0): number {
  const T = CRC_TABLES;
  let c = ~crc | 0;
  let i = 0;
  const n = data.length;
  // Byte-wise until the read position is 4-byte aligned, then whole words through a Uint32Array view
  // (faster than assembling words from bytes); the word trick assumes little-endian, as every WebGPU host is.
  if (LITTLE_ENDIAN) {
    while (i < n && ((data.byteOffset + i) & 3) !== 0) c = T[(c ^ data[i++]) & 0xff] ^ (c >>> 8);
    const pairs = i < n ? (n - i) >>> 3 : 0; // short input may end before it reaches alignment
    const w = pairs > 0 ? new Uint32Array(data.buffer, data.byteOffset + i, pairs * 2) : new Uint32Array(0);
    for (let j = 0; j < w.length; j += 2) {
      const a = w[j] ^ c;
      const b = w[j + 1];
      c =
        T[1792 + (a & 0xff)] ^
        T[1536 + ((a >>> 8) & 0xff)] ^
        T[1280 + ((a >>> 16) & 0xff)] ^
        T[1024 + (a >>> 24)] ^
        T[768 + (b & 0xff)] ^
        T[512 + ((b >>> 8) & 0xff)] ^
        T[256 + ((b >>> 16) & 0xff)] ^
        T[b >>> 24];
    }
    i += pairs * 8;
  }
  for (; i < n; i++) c = T[(c ^ data[i]) & 0xff] ^ (c >>> 8);
  return ~c >>> 0;
}

/** What every store keeps beside a chunk's bytes and checks on read. */
export interface ChunkCheck {
  length: number;
  crc32: number;
}

export function chunkCheck(data: Uint8Array): ChunkCheck {
  return { length: data.length, crc32: crc32(data) };
}

/** Throws ChunkStoreError naming the key when `data` does not match what was stored. */
export function verifyChunk(key: string, data: Uint8Array, expected: ChunkCheck, where = ''): void {
  const at = where ? ` (${where})` : '';
  if (data.length !== expected.length) {
    throw new ChunkStoreError(`chunk "${key}" is truncated or damaged${at}: ${data.length} bytes read, ${expected.length} were written`, key);
  }
  const got = crc32(data);
  if (got !== expected.crc32) {
    throw new ChunkStoreError(
      `chunk "${key}" is corrupt${at}: CRC-32 ${hex32(got)} does not match the stored ${hex32(expected.crc32)} (${data.length} bytes)`,
      key,
    );
  }
}

export function hex32(n: number): string {
  return n.toString(16).padStart(8, '0');
}

// ---------------------------------------------------------------------------------------------- quota

/**
 * Simulated small disk / quota, shared by the stores that take `quotaBytes`: refuses a write that would
 * take the store past the quota. Replacing a key counts only the growth, as the old version is released.
 */
export function checkQuota(key: string, bytes: number, quota: number | undefined, used: number, oldBytes: number): void {
  if (quota === undefined) return;
  if (used - oldBytes + bytes > quota) throw new StorageFullError(key, bytes, { quota, used });
}

/** True for a browser's quota error, wherever it surfaces (thrown by put, request.error, transaction.error). */
export function isQuotaError(err: unknown): boolean {
  const name = (err as { name?: unknown } | null)?.name;
  return name === 'QuotaExceededError' || (err as { code?: unknown } | null)?.code === 22; // 22: legacy DOMException code
}

/** Sorted copy; keys are ASCII, so the default UTF-16 order is byte order on every host. */
export function sortedKeys(keys: Iterable<string>, prefix = ''): string[] {
  return [...keys].filter((k) => k.startsWith(prefix)).sort();
}

// ---------------------------------------------------------------------------------------------- memory

interface MemoryChunk extends ChunkCheck {
  /** The store's own copy; replaced (never mutated) by write, so a reader holding the old one is unaffected. */
  bytes: Uint8Array;
}

/**
 * A real chunk store in memory, for dry runs and tests: the same key rules, integrity check, quota and
 * errors as the persistent stores. Writes copy in, reads copy out, so callers can reuse their buffers.
 */
export class MemoryChunkStore implements ChunkStore {
  readonly kind = 'memory' as const;
  private readonly chunks = new Map<string, MemoryChunk>();
  private used = 0;
  private closed = false;

  constructor(
    readonly name = 'memory',
    private readonly opts: { quotaBytes?: number } = {},
  ) {}

  async write(key: string, data: Uint8Array): Promise<void> {
    this.ensureOpen();
    validateKey(key);
    const old = this.chunks.get(key);
    checkQuota(key, data.length, this.opts.quotaBytes, this.used, old?.length ?? 0);
    const bytes = data.slice();
    // One Map.set is the atomic replace: nothing observable happens between the check and the swap.
    this.chunks.set(key, { bytes, ...chunkCheck(bytes) });
    this.used += bytes.length - (old?.length ?? 0);
  }

  async read(key: string): Promise<Uint8Array | null> {
    this.ensureOpen();
    validateKey(key);
    const c = this.chunks.get(key);
    if (!c) return null;
    verifyChunk(key, c.bytes, c, `memory store "${this.name}"`);
    return c.bytes.slice();
  }

  async delete(key: string): Promise<void> {
    this.ensureOpen();
    validateKey(key);
    const old = this.chunks.get(key);
    if (!old) return;
    this.chunks.delete(key);
    this.used -= old.length;
  }

  async keys(prefix = ''): Promise<string[]> {
    this.ensureOpen();
    validatePrefix(prefix);
    return sortedKeys(this.chunks.keys(), prefix);
  }

  async bytesUsed(): Promise<number> {
    this.ensureOpen();
    return this.used;
  }

  async close(): Promise<void> {
    this.closed = true;
  }

  /**
   * Test hook: replaces a chunk's stored bytes with `damage(bytes)` while keeping its recorded length and
   * CRC, the way a bad disk would, so tests can check that read() notices. Not for production use.
   */
  damageForTest(key: string, damage: (bytes: Uint8Array) => Uint8Array): void {
    const c = this.chunks.get(key);
    if (!c) throw new ChunkStoreError(`damageForTest: no chunk "${key}"`, key);
    c.bytes = damage(c.bytes.slice());
  }

  private ensureOpen(): void {
    if (this.closed) throw new ChunkStoreError(`memory chunk store "${this.name}" is closed`);
  }
}
