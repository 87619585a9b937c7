// safetensors: 8-byte little-endian header length, a JSON header {name: {dtype, shape,
// data_offsets: [begin, end]}, __metadata__?}, then the raw little-endian data.
// This in-memory reader/writer serves small files (golden fixtures, test models); it validates
// the header as strictly as the streamed reader that loads real checkpoints.

import { f16BitsToF32, toF16Bits } from '../gpu/half.ts';

export type StDType = 'F32' | 'F16' | 'BF16';
const DTYPE_BYTES: Record<StDType, number> = { F32: 4, F16: 2, BF16: 2 };

export interface StEntry {
  dtype: StDType;
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

export function parseHeader(prefix: Uint8Array, fileSize: number): StHeader {
  if (fileSize < 8) throw new SafetensorsError(`not a safetensors file: ${fileSize} bytes is shorter than the 8-byte header length`);
  const len = Number(new DataView(prefix.buffer, prefix.byteOffset, 8).getBigUint64(0, true));
  if (len < 2 || len > MAX_HEADER) throw new SafetensorsError(`header length ${len} is out of bounds (2..${MAX_HEADER})`);
  if (8 + len > fileSize) throw new SafetensorsError(`header length ${len} runs past the end of the ${fileSize}-byte file (truncated?)`);
  if (prefix.length < 8 + len) throw new SafetensorsError(`need ${8 + len} bytes of prefix to parse the header, got ${prefix.length}`);
  let json: unknown;
  try {
    json = JSON.parse(new TextDecoder().decode(prefix.subarray(8, 8 + len)));
  } catch (e) {
    throw new SafetensorsError(`header is not valid JSON: ${(e as Error).message}`);
  }
  if (typeof json !== 'object' || json === null || Array.isArray(json)) throw new SafetensorsError('header JSON is not an object');
  const dataStart = 8 + len;
  const dataSize = fileSize - dataStart;
  const entries = new Map<string, StEntry>();
  let metadata: Record<string, string> = {};
  for (const [name, raw] of Object.entries(json as Record<string, unknown>)) {
    if (name === '__metadata__') {
      metadata = raw as Record<string, string>;
      continue;
    }
    const r = raw as { dtype?: unknown; shape?: unknown; data_offsets?: unknown };
    if (typeof r !== 'object' || r === null) throw new SafetensorsError(`tensor '${name}': entry is not an object`);
    if (r.dtype !== 'F32' && r.dtype !== 'F16' && r.dtype !== 'BF16')
      throw new SafetensorsError(`tensor '${name}': unsupported dtype ${JSON.stringify(r.dtype)} (F32, F16 and BF16 are supported)`);
    if (!Array.isArray(r.shape) || r.shape.some((d) => !Number.isInteger(d) || d < 0))
      throw new SafetensorsError(`tensor '${name}': shape ${JSON.stringify(r.shape)} is not a list of non-negative integers`);
    const off = r.data_offsets;
    if (!Array.isArray(off) || off.length !== 2 || !off.every((x) => Number.isInteger(x) && x >= 0) || off[1] < off[0])
      throw new SafetensorsError(`tensor '${name}': data_offsets ${JSON.stringify(off)} is not [begin, end]`);
    const bytes = (r.shape as number[]).reduce((a, b) => a * b, 1) * DTYPE_BYTES[r.dtype];
    if (off[1] - off[0] !== bytes)
      throw new SafetensorsError(`tensor '${name}': shape [${r.shape}] x ${r.dtype} is ${bytes} bytes but its range holds ${off[1] - off[0]}`);
    if (off[1] > dataSize) throw new SafetensorsError(`tensor '${name}': range [${off[0]}, ${off[1]}) lies outside the ${dataSize}-byte data section`);
    entries.set(name, { dtype: r.dtype, shape: r.shape as number[], begin: off[0], end: off[1] });
  }
  const sorted = [...entries.entries()].sort((a, b) => a[1].begin - b[1].begin);
  for (let i = 1; i < sorted.length; i++)
    if (sorted[i][1].begin < sorted[i - 1][1].end && sorted[i][1].end > sorted[i][1].begin)
      throw new SafetensorsError(`tensors '${sorted[i - 1][0]}' and '${sorted[i][0]}' overlap`);
  return { entries, metadata, dataStart };
}

export interface NamedTensor {
  shape: number[];
  data: Float32Array;
}

/** Decodes an entry's bytes to f32. */
export function decode(entry: StEntry, bytes: Uint8Array): Float32Array {
  const n = entry.shape.reduce((a, b) => a * b, 1);
  const copy = bytes.slice(0, entry.end - entry.begin); // aligned copy
  if (entry.dtype === 'F32') return new Float32Array(copy.buffer, 0, n);
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
  for (const [name, e] of h.entries)
    tensors.set(name, { shape: e.shape, data: decode(e, file.subarray(h.dataStart + e.begin, h.dataStart + e.end)) });
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
