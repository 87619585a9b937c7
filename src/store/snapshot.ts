// Snapshots (checkpoint sets) on any ChunkStore: a training checkpoint is several files (LoRA / UNet weights,
// optimizer chunks, the run's state) that must be replaced together. The commit protocol, with keys
//   <prefix>/s000007/<name>   the files of snapshot 7
//   <prefix>/HEAD             JSON {seq, files: [{name, bytes, checksum}], meta}, the commit record
// 1. remove leftovers of an uncommitted snapshot (files under s<n> that HEAD does not name);
// 2. write every file of the new snapshot under s<seq+1>/;
// 3. write HEAD (one atomic chunk write: the commit point);
// 4. delete the previous snapshot's files.
// A crash or a full disk anywhere before 3 leaves the old HEAD naming the old, untouched files; after 3 the
// new snapshot is complete. Leftovers are removed by the next commit or by openSnapshot. The store's own
// per-chunk CRC catches damaged bytes; the checksum in HEAD also ties each file to this commit, so a stray
// file from another (uncommitted) attempt under the same name can never be read as part of it.
//
// HEAD also binds its record to what was written (`bind`): a SHA-256 digest over the sequence number, the
// file list (names, sizes, checksums) and the meta, and a copy of the meta's numeric counters (a training
// checkpoint's step, applied updates, Rng state). A record edited afterwards (a step counter changed, the
// chunk's CRC recomputed so the store accepts it) no longer matches: openSnapshot refuses it, naming the
// counter that disagrees, or the digest when the copy was edited too. A record without a binding is refused
// as well: otherwise deleting the binding along with an edit would pass any check made from the record alone
// (records from before bindings existed are refused the same way: their run starts again).
//
// Everything matching <prefix>/s<digits>/... belongs to the snapshot set; keep other data out of that pattern.
// One writer per prefix: openSnapshot also cleans up, so do not open while another commit is in flight.
import { crc32, ChunkStoreError, hex32, validateKey, type ChunkStore } from './chunkstore.ts';

export interface SnapshotFile {
  name: string;
  bytes: number;
  /** "crc32:<8 hex digits>" over the file's bytes. */
  checksum: string;
}

export interface Snapshot<M = unknown> {
  seq: number;
  meta: M;
  /** File names in commit order. */
  names: string[];
  files: SnapshotFile[];
  /** The file's bytes, verified against HEAD's size and checksum; ChunkStoreError when missing or damaged. */
  read(name: string): Promise<Uint8Array>;
}

interface Head {
  seq: number;
  files: SnapshotFile[];
  meta: unknown;
  /** The record's binding; a record without one is refused (checkBinding). */
  bind?: Binding;
}

/** What ties a HEAD record to what was written: the meta's numeric counters as written, and a digest of it all. */
interface Binding {
  counters: Record<string, number>;
  /** "sha256:<hex>" over seq, the file list and the meta's JSON. */
  digest: string;
}

/** A snapshot whose record does not match what was written (edited afterwards): never trusted. */
export class SnapshotBindingError extends ChunkStoreError {
  constructor(
    key: string,
    /** What disagrees, in words ("its record says step 1, but it was written at step 2"). */
    readonly detail: string,
    prefix: string,
  ) {
    super(`snapshot record "${key}": ${detail}: it was edited after it was written and cannot be trusted (dropSnapshots("${prefix}") discards the set)`, key);
  }
}

async function digestOf(seq: number, files: SnapshotFile[], metaJson: string): Promise<string> {
  const text = new TextEncoder().encode(`dbs-snapshot\n${seq}\n${JSON.stringify(files)}\n${metaJson}`);
  const hash = new Uint8Array(await crypto.subtle.digest('SHA-256', text));
  return `sha256:${[...hash].map((b) => b.toString(16).padStart(2, '0')).join('')}`;
}

async function bindingOf(seq: number, files: SnapshotFile[], metaJson: string): Promise<Binding> {
  const meta = JSON.parse(metaJson) as Record<string, unknown>;
  const counters = Object.fromEntries(Object.entries(meta).filter(([, v]) => typeof v === 'number')) as Record<string, number>;
  return { counters, digest: await digestOf(seq, files, metaJson) };
}

/**
 * Refuses a record that is not the one written: no binding at all, a counter that differs from its bound copy,
 * or a digest that does not match.
 */
async function checkBinding(prefix: string, head: Head): Promise<void> {
  const key = headKey(prefix);
  if (head.bind === undefined)
    throw new SnapshotBindingError(key, 'it has no binding to what was written (it was removed, or the record predates bindings)', prefix);
  const b = head.bind as Partial<Binding> | null;
  if (typeof b !== 'object' || b === null || typeof b.digest !== 'string' || typeof b.counters !== 'object' || b.counters === null)
    throw new SnapshotBindingError(key, 'its binding is malformed', prefix);
  const meta = head.meta as Record<string, unknown>;
  for (const [k, v] of Object.entries(b.counters))
    if (meta[k] !== v) throw new SnapshotBindingError(key, `its record says ${k} ${JSON.stringify(meta[k])}, but it was written at ${k} ${v}`, prefix);
  const files = head.files.map((f) => ({ name: f.name, bytes: f.bytes, checksum: f.checksum }));
  if ((await digestOf(head.seq, files, JSON.stringify(head.meta))) !== b.digest)
    throw new SnapshotBindingError(key, `its record or file list does not match the digest it was written with (${b.digest.slice(0, 19)}...)`, prefix);
}

export const headKey = (prefix: string): string => `${prefix}/HEAD`;
const seqDir = (prefix: string, seq: number): string => `${prefix}/s${String(seq).padStart(6, '0')}`;
const checksumOf = (data: Uint8Array): string => `crc32:${hex32(crc32(data))}`;

/**
 * Writes `files` as a new snapshot under `prefix` and makes it current; returns its sequence number.
 * `files` may be an async iterable, so large checkpoints can be produced one file at a time (e.g. read back
 * from the GPU chunk by chunk). On any failure (StorageFullError included) the partial files are removed
 * (best effort), the previous snapshot stays current and readable, and the error is rethrown.
 */
export async function commitSnapshot(
  store: ChunkStore,
  prefix: string,
  files: Map<string, Uint8Array> | AsyncIterable<[string, Uint8Array]>,
  meta: object,
): Promise<number> {
  validateKey(headKey(prefix));
  const metaJson = serializeMeta(prefix, meta); // before any write: a bad meta must not cost a half commit
  const head = await readHead(store, prefix);
  await removeSnapshotsExcept(store, prefix, head?.seq);
  const seq = (head?.seq ?? 0) + 1;
  const dir = seqDir(prefix, seq);
  const entries: SnapshotFile[] = [];
  const names = new Set<string>();
  try {
    for await (const [name, data] of files) {
      const key = `${dir}/${name}`;
      validateKey(key);
      if (names.has(name)) throw new ChunkStoreError(`snapshot ${prefix}: file "${name}" given twice`, key);
      names.add(name);
      const entry = { name, bytes: data.length, checksum: checksumOf(data) }; // of the bytes as handed in
      await store.write(key, data);
      entries.push(entry);
    }
    const bind = await bindingOf(seq, entries, metaJson);
    const record = `{"seq":${seq},"files":${JSON.stringify(entries)},"meta":${metaJson},"bind":${JSON.stringify(bind)}}`;
    await store.write(headKey(prefix), new TextEncoder().encode(record));
  } catch (err) {
    await discardUncommitted(store, prefix, seq);
    throw err;
  }
  // Committed. Old files are garbage now; a failure here must not report the commit as failed, and whatever
  // this leaves behind is removed by the next commit or open.
  await removeSnapshotsExcept(store, prefix, seq).catch(() => {});
  return seq;
}

/**
 * The current snapshot under `prefix`, or null when none was committed. Also removes files of uncommitted
 * or superseded snapshots. Files are read (and verified) on demand.
 */
export async function openSnapshot<M = unknown>(store: ChunkStore, prefix: string): Promise<Snapshot<M> | null> {
  validateKey(headKey(prefix));
  const head = await readHead(store, prefix);
  if (head) await checkBinding(prefix, head); // before anything is removed: a refused record changes nothing
  await removeSnapshotsExcept(store, prefix, head?.seq);
  if (!head) return null;
  const dir = seqDir(prefix, head.seq);
  return {
    seq: head.seq,
    meta: head.meta as M,
    names: head.files.map((f) => f.name),
    files: head.files.map((f) => ({ ...f })),
    async read(name: string): Promise<Uint8Array> {
      const entry = head.files.find((f) => f.name === name);
      const key = `${dir}/${name}`;
      if (!entry) {
        throw new ChunkStoreError(`snapshot ${prefix} #${head.seq} has no file "${name}" (it has: ${head.files.map((f) => f.name).join(', ') || 'none'})`, key);
      }
      const data = await store.read(key);
      if (data === null) throw new ChunkStoreError(`snapshot ${prefix} #${head.seq}: file "${name}" (chunk "${key}") is missing from the store`, key);
      if (data.length !== entry.bytes) {
        throw new ChunkStoreError(
          `snapshot ${prefix} #${head.seq}: file "${name}" (chunk "${key}") has ${data.length} bytes, the snapshot recorded ${entry.bytes}`,
          key,
        );
      }
      const sum = checksumOf(data);
      if (sum !== entry.checksum) {
        throw new ChunkStoreError(
          `snapshot ${prefix} #${head.seq}: file "${name}" (chunk "${key}") fails its checksum: ${sum}, the snapshot recorded ${entry.checksum}`,
          key,
        );
      }
      return data;
    },
  };
}

/** Removes every snapshot under `prefix`: HEAD first, so an interrupted drop never leaves HEAD naming missing files. */
export async function dropSnapshots(store: ChunkStore, prefix: string): Promise<void> {
  validateKey(headKey(prefix));
  await store.delete(headKey(prefix));
  await removeSnapshotsExcept(store, prefix, undefined);
}

// ---------------------------------------------------------------------------------------------- internals

function serializeMeta(prefix: string, meta: object): string {
  let json: string | undefined;
  try {
    json = JSON.stringify(meta);
  } catch (err) {
    throw new ChunkStoreError(`snapshot ${prefix}: meta is not JSON-serialisable (${(err as Error).message})`, headKey(prefix), { cause: err });
  }
  if (json === undefined || meta === null || typeof meta !== 'object') {
    throw new ChunkStoreError(`snapshot ${prefix}: meta must be a JSON object`, headKey(prefix));
  }
  return json;
}

async function readHead(store: ChunkStore, prefix: string): Promise<Head | null> {
  const key = headKey(prefix);
  const bytes = await store.read(key);
  if (bytes === null) return null;
  let head: unknown;
  try {
    head = JSON.parse(new TextDecoder('utf-8', { fatal: true }).decode(bytes));
  } catch (err) {
    throw new ChunkStoreError(`snapshot record "${key}" is not valid JSON (${(err as Error).message}); dropSnapshots("${prefix}") discards the set`, key, {
      cause: err,
    });
  }
  const problem = headProblem(head);
  if (problem) throw new ChunkStoreError(`snapshot record "${key}" is malformed: ${problem}; dropSnapshots("${prefix}") discards the set`, key);
  return head as Head;
}

function headProblem(h: unknown): string | null {
  if (typeof h !== 'object' || h === null) return 'not an object';
  const { seq, files, meta } = h as Record<string, unknown>;
  if (!Number.isSafeInteger(seq) || (seq as number) < 1) return `seq ${JSON.stringify(seq)} is not a positive integer`;
  if (!Array.isArray(files)) return 'files is not an array';
  for (const f of files as unknown[]) {
    const { name, bytes, checksum } = (f ?? {}) as Record<string, unknown>;
    if (typeof name !== 'string' || !Number.isSafeInteger(bytes) || (bytes as number) < 0 || typeof checksum !== 'string') {
      return `bad file entry ${JSON.stringify(f)}`;
    }
  }
  if (typeof meta !== 'object' || meta === null) return 'meta is not an object';
  return null;
}

/** Deletes every snapshot file under `prefix` except those of snapshot `keep`. */
async function removeSnapshotsExcept(store: ChunkStore, prefix: string, keep: number | undefined): Promise<void> {
  const pattern = /^s(\d+)\//;
  for (const key of await store.keys(`${prefix}/s`)) {
    const m = pattern.exec(key.slice(prefix.length + 1));
    if (m && Number(m[1]) !== keep) await store.delete(key);
  }
}

/**
 * After a failed commit of snapshot `seq`: delete its files, unless HEAD names it after all (a HEAD write can
 * land and still report an error, e.g. when syncing the directory fails after the rename). Best effort: what
 * is left here is removed by the next commit or open.
 */
async function discardUncommitted(store: ChunkStore, prefix: string, seq: number): Promise<void> {
  try {
    const head = await readHead(store, prefix).catch(() => null);
    if (head?.seq === seq) return;
    const dir = `${seqDir(prefix, seq)}/`;
    for (const key of await store.keys(dir)) await store.delete(key).catch(() => {});
  } catch {
    // The original error matters more than this cleanup's.
  }
}
