// safetensors: 8-byte little-endian header length, a JSON header {name: {dtype, shape,
// data_offsets: [begin, end]}, __metadata__?}, then the raw little-endian data.
// This in-memory reader/writer serves small files (golden fixtures, test models); it validates
// the header as strictly as the streamed reader that loads real checkpoints.

import { firstNonUtf8, jsonDepth, jsonSyntaxProblem, preview } from '../util/describe.ts';
import { f16BitsToF32, toF16Bits } from '../util/half.ts';
import type { ByteSource } from './source.ts';

/**
 * Every dtype the safetensors format defines with a whole number of bytes. Real SD checkpoints hold a
 * few integer tensors beside the float weights (CLIP's I64 position_ids, EMA's num_updates): the header
 * accepts them with their sizes checked; only reading one as a float tensor is refused.
 */
export const DTYPE_BYTES: Record<string, number> = {
  BOOL: 1,
  U8: 1,
  I8: 1,
  F8_E5M2: 1,
  F8_E4M3: 1,
  I16: 2,
  U16: 2,
  F16: 2,
  BF16: 2,
  I32: 4,
  U32: 4,
  F32: 4,
  I64: 8,
  U64: 8,
  F64: 8,
};
const FLOAT_DTYPES = new Set(['F32', 'F16', 'BF16', 'F64']);

export interface StEntry {
  /** A safetensors dtype name (see DTYPE_BYTES); F32/F16/BF16/F64 decode to f32. */
  dtype: string;
  shape: number[];
  begin: number;
  end: number;
}

export interface StHeader {
  entries: Map<string, StEntry>;
  metadata: Record<string, string>;
  dataStart: number;
}

export class SafetensorsError extends Error {
  override name = 'SafetensorsError';
}

/** Largest header we accept; real headers are well under 10 MB. */
const MAX_HEADER = 100 << 20;
/** Deepest nesting of a header's JSON we parse (a real one has 3 levels; some slack for unknown fields). */
const MAX_HEADER_DEPTH = 16;

/**
 * The first key of a JSON object's text that appears twice at its top level, or null. JSON.parse keeps
 * the last of duplicate keys without a word, so this scans the raw text; `text` must already have parsed
 * as an object (the scanner relies on it being valid JSON).
 */
function repeatedTopLevelKey(text: string): string | null {
  const seen = new Set<string>();
  let depth = -1; // -1 outside the object, 0 inside the top-level object
  let keyNext = false; // at depth 0, the next string is a key (after '{' or ',')
  for (let i = 0; i < text.length; i++) {
    const c = text[i];
    if (c === '"') {
      let end = i + 1;
      while (text[end] !== '"') end += text[end] === '\\' ? 2 : 1;
      if (depth === 0 && keyNext) {
        const key = JSON.parse(text.slice(i, end + 1)) as string;
        if (seen.has(key)) return key;
        seen.add(key);
        keyNext = false;
      }
      i = end;
    } else if (c === '{' || c === '[') {
      depth++;
      if (depth === 0) keyNext = true;
    } else if (c === '}' || c === ']') {
      if (--depth < 0) break;
    } else if (c === ',' && depth === 0) keyNext = true;
  }
  return null;
}

/**
 * The header's bytes as text. The format requires UTF-8; a byte that is not (in a tensor name, say) would
 * otherwise decode to U+FFFD and the tensor be "missing" under its real name later, so it is refused here,
 * naming where it sits.
 */
function headerText(raw: Uint8Array): string {
  try {
    return new TextDecoder('utf-8', { fatal: true }).decode(raw);
  } catch {
    const at = firstNonUtf8(raw);
    const before = new TextDecoder().decode(raw.subarray(Math.max(0, at - 40), at));
    throw new SafetensorsError(
      `the header is not UTF-8 text: byte ${8 + at} of the file (after ${JSON.stringify(before)}) is not UTF-8, which no safetensors writer produces (a damaged tensor name or metadata value); the file is corrupt: use another copy`,
    );
  }
}

export function parseHeader(prefix: Uint8Array, fileSize: number): StHeader {
  if (fileSize < 8) throw new SafetensorsError(`not a safetensors file: ${fileSize} bytes is shorter than the 8-byte header length`);
  const len = Number(new DataView(prefix.buffer, prefix.byteOffset, 8).getBigUint64(0, true));
  if (len < 2 || len > MAX_HEADER) throw new SafetensorsError(`header length ${len} is out of bounds (2..${MAX_HEADER})`);
  if (8 + len > fileSize) throw new SafetensorsError(`header length ${len} runs past the end of the ${fileSize}-byte file (truncated?)`);
  if (prefix.length < 8 + len) throw new SafetensorsError(`need ${8 + len} bytes of prefix to parse the header, got ${prefix.length}`);
  const text = headerText(prefix.subarray(8, 8 + len));
  // {name: {dtype, shape: [...]}} is three levels; writers add nothing deeper (metadata values are strings).
  const depth = jsonDepth(text, MAX_HEADER_DEPTH);
  if (depth > MAX_HEADER_DEPTH)
    throw new SafetensorsError(
      `the header nests more than ${MAX_HEADER_DEPTH} levels deep, where a safetensors header has 3 (tensors, their fields, shapes): the file is corrupt`,
    );
  let json: unknown;
  try {
    json = JSON.parse(text);
  } catch (e) {
    throw new SafetensorsError(`the header's JSON is damaged: ${jsonSyntaxProblem(e, text)}; the file is truncated or corrupt: use another copy`);
  }
  if (typeof json !== 'object' || json === null || Array.isArray(json))
    throw new SafetensorsError(`the header is not a JSON object (it is ${preview(json, 40)}): not a safetensors file`);
  const twice = repeatedTopLevelKey(text);
  if (twice !== null)
    throw new SafetensorsError(
      `the header names tensor '${twice}' twice (a JSON parser keeps only the last entry, so one of them would be silently dropped): the file is corrupt; use another file`,
    );
  const dataStart = 8 + len;
  const dataSize = fileSize - dataStart;
  const entries = new Map<string, StEntry>();
  let metadata: Record<string, string> = {};
  for (const [name, raw] of Object.entries(json as Record<string, unknown>)) {
    if (name === '__metadata__') {
      if (typeof raw !== 'object' || raw === null || Array.isArray(raw) || Object.values(raw).some((v) => typeof v !== 'string'))
        throw new SafetensorsError(`__metadata__ must map names to strings, got ${preview(raw)}`);
      metadata = raw as Record<string, string>;
      continue;
    }
    const r = raw as { dtype?: unknown; shape?: unknown; data_offsets?: unknown };
    if (typeof r !== 'object' || r === null || Array.isArray(r))
      throw new SafetensorsError(`tensor '${name}': its entry is ${preview(r, 40)}, not an object {dtype, shape, data_offsets}`);
    if (typeof r.dtype !== 'string' || !(r.dtype in DTYPE_BYTES))
      throw new SafetensorsError(`tensor '${name}': unknown dtype ${preview(r.dtype, 40)} (safetensors defines ${Object.keys(DTYPE_BYTES).join(', ')})`);
    if (!Array.isArray(r.shape) || r.shape.some((d) => !Number.isInteger(d) || d < 0))
      throw new SafetensorsError(`tensor '${name}': shape ${preview(r.shape)} is not a list of non-negative integers`);
    const off = r.data_offsets;
    if (!Array.isArray(off) || off.length !== 2 || !off.every((x) => Number.isInteger(x) && x >= 0) || off[1] < off[0])
      throw new SafetensorsError(`tensor '${name}': data_offsets ${preview(off)} is not [begin, end]`);
    const bytes = (r.shape as number[]).reduce((a, b) => a * b, 1) * DTYPE_BYTES[r.dtype];
    if (off[1] - off[0] !== bytes)
      throw new SafetensorsError(`tensor '${name}': shape [${r.shape}] x ${r.dtype} is ${bytes} bytes but its range holds ${off[1] - off[0]}`);
    if (off[1] > dataSize) throw new SafetensorsError(`tensor '${name}': range [${off[0]}, ${off[1]}) lies outside the ${dataSize}-byte data section`);
    entries.set(name, { dtype: r.dtype, shape: r.shape as number[], begin: off[0], end: off[1] });
  }
  // No two non-empty ranges may share a byte: in begin order, each must start at or after the furthest
  // end seen so far (comparing neighbours alone misses a long range that spans several later ones).
  const sorted = [...entries.entries()].filter(([, e]) => e.end > e.begin).sort((a, b) => a[1].begin - b[1].begin);
  let reach = { name: '', end: 0 };
  for (const [name, e] of sorted) {
    if (e.begin < reach.end)
      throw new SafetensorsError(`tensors '${reach.name}' and '${name}' overlap (bytes [${e.begin}, ${Math.min(e.end, reach.end)}) of the data section)`);
    if (e.end > reach.end) reach = { name, end: e.end };
  }
  return { entries, metadata, dataStart };
}

export interface NamedTensor {
  shape: number[];
  data: Float32Array;
}

/** Decodes a float entry's bytes (F32, F16, BF16 or F64) to f32; `name` is for the message. */
export function decode(entry: StEntry, bytes: Uint8Array, name = 'tensor'): Float32Array {
  if (!FLOAT_DTYPES.has(entry.dtype)) throw new SafetensorsError(`tensor '${name}' is ${entry.dtype}, not a float tensor (weights must be F32, F16 or BF16)`);
  const n = entry.shape.reduce((a, b) => a * b, 1);
  const copy = bytes.slice(0, entry.end - entry.begin); // aligned copy
  if (entry.dtype === 'F32') return new Float32Array(copy.buffer, 0, n);
  if (entry.dtype === 'F64') return Float32Array.from(new Float64Array(copy.buffer, 0, n));
  const u16 = new Uint16Array(copy.buffer, 0, n);
  const out = new Float32Array(n);
  if (entry.dtype === 'F16') for (let i = 0; i < n; i++) out[i] = f16BitsToF32(u16[i]);
  else {
    const u32 = new Uint32Array(out.buffer);
    for (let i = 0; i < n; i++) u32[i] = u16[i] << 16;
  }
  return out;
}

export function readSafetensors(file: Uint8Array): { tensors: Map<string, NamedTensor>; metadata: Record<string, string> } {
  const h = parseHeader(file, file.length);
  const tensors = new Map<string, NamedTensor>();
  for (const [name, e] of h.entries) tensors.set(name, { shape: e.shape, data: decode(e, file.subarray(h.dataStart + e.begin, h.dataStart + e.end), name) });
  return { tensors, metadata: h.metadata };
}

export function writeSafetensors(
  tensors: Map<string, { shape: number[]; data: ArrayLike<number>; dtype?: 'F32' | 'F16' }>,
  metadata: Record<string, string> = {},
): Uint8Array {
  const header: Record<string, unknown> = {};
  if (Object.keys(metadata).length) header.__metadata__ = metadata;
  const blobs: Uint8Array[] = [];
  let offset = 0;
  for (const [name, t] of tensors) {
    const dtype = t.dtype ?? 'F32';
    const bytes = dtype === 'F16' ? new Uint8Array(toF16Bits(t.data).buffer) : new Uint8Array(Float32Array.from(t.data).buffer);
    header[name] = { dtype, shape: t.shape, data_offsets: [offset, offset + bytes.length] };
    blobs.push(bytes);
    offset += bytes.length;
  }
  let json = JSON.stringify(header);
  while ((8 + json.length) % 8) json += ' ';
  const jsonBytes = new TextEncoder().encode(json);
  const out = new Uint8Array(8 + jsonBytes.length + offset);
  new DataView(out.buffer).setBigUint64(0, BigInt(jsonBytes.length), true);
  out.set(jsonBytes, 8);
  let p = 8 + jsonBytes.length;
  for (const b of blobs) {
    out.set(b, p);
    p += b.length;
  }
  return out;
}

// ---- streamed reading and writing (multi-GB checkpoints) ------------------------------------------

/** A PyTorch pickle checkpoint (.ckpt/.pt/.bin): a zip archive or a raw pickle stream. */
function sniffPickle(head: Uint8Array): boolean {
  const zip = head[0] === 0x50 && head[1] === 0x4b && head[2] === 0x03 && head[3] === 0x04;
  const pickle = head[0] === 0x80 && head[1] >= 2 && head[1] <= 5;
  return zip || pickle;
}

/** A safetensors file read lazily from a ByteSource: the header at open, tensors on demand. */
export class SafetensorsFile {
  private constructor(
    readonly source: ByteSource,
    readonly header: StHeader,
  ) {}

  static async open(source: ByteSource): Promise<SafetensorsFile> {
    if (source.size < 8) throw new SafetensorsError(`${source.name}: not a safetensors file (${source.size} bytes, shorter than the 8-byte header length)`);
    const head = await source.read(0, Math.min(source.size, 16));
    if (sniffPickle(head))
      throw new SafetensorsError(
        `${source.name}: this is a PyTorch pickle checkpoint (.ckpt/.pt/.bin). Pickles can run code when loaded, so they are never opened here: convert it to .safetensors first (for example with the diffusers or safetensors "convert" scripts).`,
      );
    const len = Number(new DataView(head.buffer, head.byteOffset, 8).getBigUint64(0, true));
    if (len < 2 || len > MAX_HEADER)
      throw new SafetensorsError(`${source.name}: not a safetensors file (header length ${len} is out of bounds 2..${MAX_HEADER})`);
    if (8 + len > source.size)
      throw new SafetensorsError(`${source.name}: truncated: the header says ${len} bytes but only ${source.size - 8} follow (an incomplete download?)`);
    const prefix = await source.read(0, 8 + len);
    if (prefix[8] !== 0x7b /* { */) throw new SafetensorsError(`${source.name}: not a safetensors file (the header is not a JSON object)`);
    let header: StHeader;
    try {
      header = parseHeader(prefix, source.size);
    } catch (e) {
      const msg = (e as Error).message;
      throw new SafetensorsError(/outside the .*data section/.test(msg) ? `${source.name}: truncated or corrupt: ${msg}` : `${source.name}: ${msg}`);
    }
    return new SafetensorsFile(source, header);
  }

  get names(): string[] {
    return [...this.header.entries.keys()];
  }

  get metadata(): Record<string, string> {
    return this.header.metadata;
  }

  entry(name: string): StEntry {
    const e = this.header.entries.get(name);
    if (!e) throw new SafetensorsError(`${this.source.name}: no tensor '${name}'`);
    return e;
  }

  /** The tensor's raw little-endian bytes. */
  async readRaw(name: string): Promise<Uint8Array> {
    const e = this.entry(name);
    return this.source.read(this.header.dataStart + e.begin, e.end - e.begin);
  }

  /** Rows [start, start + count) along dim 0, raw bytes (slices of huge tensors). */
  async readRows(name: string, start: number, count: number): Promise<Uint8Array> {
    const e = this.entry(name);
    const rows = e.shape[0] ?? 1;
    if (start < 0 || count < 0 || start + count > rows)
      throw new SafetensorsError(`${this.source.name}: rows [${start}, ${start + count}) of '${name}' ${JSON.stringify(e.shape)} are out of range`);
    const rowBytes = (e.end - e.begin) / Math.max(1, rows);
    return this.source.read(this.header.dataStart + e.begin + start * rowBytes, count * rowBytes);
  }

  /** Rows [start, start + count) along dim 0 decoded to f32 (e.g. one of q/k/v in a fused projection). */
  async readSlice(name: string, start: number, count: number): Promise<NamedTensor> {
    const e = this.entry(name);
    const shape = [count, ...e.shape.slice(1)];
    const bytes = await this.readRows(name, start, count);
    return { shape, data: decode({ dtype: e.dtype, shape, begin: 0, end: bytes.length }, bytes, name) };
  }

  /** The tensor decoded to f32. */
  async read(name: string): Promise<NamedTensor> {
    const e = this.entry(name);
    return { shape: e.shape, data: decode(e, await this.readRaw(name), name) };
  }
}

/** Where a streamed writer puts its bytes. */
export interface ByteSink {
  write(chunk: Uint8Array): Promise<void>;
  close(): Promise<void>;
}

export interface TensorSpec {
  name: string;
  /** F32 or F16 for f32 values; any safetensors dtype (I64, BF16, ...) when written as raw bytes. */
  dtype: string;
  shape: number[];
}

/**
 * Writes a safetensors file tensor by tensor: the header (from the specs, in order) first, then each
 * tensor's bytes as it is given. Never holds more than the tensor being written.
 */
export class SafetensorsWriter {
  private next = 0;
  private started = false;

  constructor(
    private readonly sink: ByteSink,
    private readonly specs: TensorSpec[],
    private readonly metadata: Record<string, string> = {},
  ) {
    for (const sp of specs) if (!(sp.dtype in DTYPE_BYTES)) throw new SafetensorsError(`tensor '${sp.name}': unknown dtype ${JSON.stringify(sp.dtype)}`);
  }

  private headerBytes(): Uint8Array {
    const header: Record<string, unknown> = {};
    if (Object.keys(this.metadata).length) header.__metadata__ = this.metadata;
    let offset = 0;
    for (const s of this.specs) {
      const bytes = s.shape.reduce((a, b) => a * b, 1) * DTYPE_BYTES[s.dtype];
      header[s.name] = { dtype: s.dtype, shape: s.shape, data_offsets: [offset, offset + bytes] };
      offset += bytes;
    }
    let json = JSON.stringify(header);
    while ((8 + json.length) % 8) json += ' ';
    const jsonBytes = new TextEncoder().encode(json);
    const out = new Uint8Array(8 + jsonBytes.length);
    new DataView(out.buffer).setBigUint64(0, BigInt(jsonBytes.length), true);
    out.set(jsonBytes, 8);
    return out;
  }

  /** Writes the next tensor (in spec order): f32 values (converted to F16 where the spec says) or raw bytes. */
  async write(name: string, data: Float32Array | Uint8Array): Promise<void> {
    const spec = this.specs[this.next];
    if (!spec || spec.name !== name) throw new SafetensorsError(`writer expected tensor '${spec?.name ?? '(none: all written)'}', got '${name}'`);
    if (!this.started) {
      await this.sink.write(this.headerBytes());
      this.started = true;
    }
    const n = spec.shape.reduce((a, b) => a * b, 1);
    let bytes: Uint8Array;
    if (data instanceof Uint8Array) bytes = data;
    else {
      if (spec.dtype !== 'F32' && spec.dtype !== 'F16')
        throw new SafetensorsError(`tensor '${name}': f32 values can be written as F32 or F16, not ${spec.dtype} (pass raw bytes)`);
      if (data.length !== n) throw new SafetensorsError(`tensor '${name}': ${data.length} values for shape [${spec.shape}]`);
      bytes = spec.dtype === 'F16' ? new Uint8Array(toF16Bits(data).buffer) : new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
    }
    if (bytes.length !== n * DTYPE_BYTES[spec.dtype]) throw new SafetensorsError(`tensor '${name}': ${bytes.length} bytes for ${spec.dtype} [${spec.shape}]`);
    await this.sink.write(bytes);
    this.next++;
  }

  async finish(): Promise<void> {
    if (this.next !== this.specs.length) throw new SafetensorsError(`writer finished after ${this.next} of ${this.specs.length} tensors`);
    if (!this.started) await this.sink.write(this.headerBytes());
    await this.sink.close();
  }
}
