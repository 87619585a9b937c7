// Streamed safetensors output for the exporters, pull-based so the same bytes can go to a ByteSink (a file
// on disk, the browser's FileSystemWritableFileStream) or be an entry of a streamed zip (client-zip pulls
// an async iterable). The header is built from the tensor specs alone, so the file size is known before
// any tensor is read; then each tensor is read, encoded and yielded as ONE chunk, and dropped: memory
// never holds more than the tensor being written (the largest SD tensor, OpenCLIP's token embedding,
// is 200 MB as f32), and no buffer near Chrome's ArrayBuffer limits is ever built.
//
// Header JSON is written ASCII-only (non-ASCII metadata such as a prompt with "é" is \u-escaped, valid
// JSON that every parser reads back to the same string), so its byte length equals its character length
// and the space padding really aligns the data section to 8 bytes (io/safetensors.ts's writer pads by
// characters, which misaligns the data after a non-ASCII metadata value).
//
// No tensor with a NaN or infinite value is ever written: each tensor is checked AFTER encoding to its
// file dtype (an f32 1e30 is finite but becomes inf in F16), and the export stops with an error naming
// it. pump/pipeToSink then abort the sink when it can (sink-node.ts removes its temp file), so a failed
// export leaves no file that a UI would happily load and render as black images.
import { toF16Bits } from '../util/half.ts';
import { DTYPE_BYTES, type ByteSink } from '../io/safetensors.ts';
import { ExportError } from './provider.ts';

/** One tensor of an output file: its header entry now, its values when `data` is called. */
export interface OutTensor {
  name: string;
  /** 'F16' or 'F32' for f32 values; any safetensors dtype when `data` gives the raw bytes. */
  dtype: string;
  shape: readonly number[];
  /** f32 values (encoded to `dtype`) or the raw little-endian bytes. */
  data(): Promise<Float32Array | Uint8Array>;
}

export function numel(shape: readonly number[]): number {
  return shape.reduce((a, b) => a * b, 1);
}

function byteLength(t: Pick<OutTensor, 'name' | 'dtype' | 'shape'>): number {
  const b = DTYPE_BYTES[t.dtype];
  if (b === undefined) throw new ExportError(`tensor '${t.name}': unknown safetensors dtype ${t.dtype}`);
  return numel(t.shape) * b;
}

const asciiJson = (v: unknown) => JSON.stringify(v).replace(/[\u007f-\uffff]/g, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`);

/** The 8-byte length and the JSON header (offsets in `tensors` order), padded so data starts 8-aligned. */
export function headerBytes(tensors: readonly Pick<OutTensor, 'name' | 'dtype' | 'shape'>[], metadata: Record<string, string> = {}): Uint8Array {
  const header: Record<string, unknown> = {};
  if (Object.keys(metadata).length) header.__metadata__ = metadata;
  let offset = 0;
  for (const t of tensors) {
    if (t.name === '__metadata__' || Object.hasOwn(header, t.name)) throw new ExportError(`tensor name '${t.name}' is reserved or given twice`);
    const n = byteLength(t);
    header[t.name] = { dtype: t.dtype, shape: [...t.shape], data_offsets: [offset, offset + n] };
    offset += n;
  }
  let json = asciiJson(header);
  json += ' '.repeat((8 - ((8 + json.length) % 8)) % 8);
  const out = new Uint8Array(8 + json.length);
  new DataView(out.buffer).setBigUint64(0, BigInt(json.length), true);
  for (let i = 0; i < json.length; i++) out[8 + i] = json.charCodeAt(i);
  return out;
}

/** Total size of the file `safetensorsChunks` will produce. */
export function safetensorsSize(tensors: readonly Pick<OutTensor, 'name' | 'dtype' | 'shape'>[], metadata: Record<string, string> = {}): number {
  return headerBytes(tensors, metadata).length + tensors.reduce((s, t) => s + byteLength(t), 0);
}

// ---- non-finite values ------------------------------------------------------------------------------

/** Per float dtype: bytes per value, the exponent bits (all set = NaN or infinity) and the mantissa bits. */
const FLOAT_BITS: Record<string, { bytes: 1 | 2 | 4; exp: number; mant: number }> = {
  F32: { bytes: 4, exp: 0x7f800000, mant: 0x007fffff },
  F16: { bytes: 2, exp: 0x7c00, mant: 0x03ff },
  BF16: { bytes: 2, exp: 0x7f80, mant: 0x007f },
  F8_E5M2: { bytes: 1, exp: 0x7c, mant: 0x03 },
};

/** The largest finite F16 value, and the smallest f32 magnitude that rounds to F16 infinity (65504 + half a step). */
const F16_MAX = 65504;
const F16_OVERFLOW = 65520;

function valueWords(bytes: Uint8Array, size: 1 | 2 | 4): Uint8Array | Uint16Array | Uint32Array {
  // Typed views need an aligned offset; raw bytes from a reader may sit anywhere in their buffer.
  const b = bytes.byteOffset % size === 0 ? bytes : bytes.slice();
  if (size === 1) return b;
  return size === 2 ? new Uint16Array(b.buffer, b.byteOffset, b.length / 2) : new Uint32Array(b.buffer, b.byteOffset, b.length / 4);
}

/** How many values of the encoded tensor are NaN and how many are ±infinity (little-endian bytes). */
export function countNonFinite(bytes: Uint8Array, dtype: string): { nan: number; inf: number } {
  let nan = 0;
  let inf = 0;
  if (dtype === 'F64') {
    const b = bytes.byteOffset % 8 === 0 ? bytes : bytes.slice();
    for (const v of new Float64Array(b.buffer, b.byteOffset, b.length / 8)) {
      if (Number.isNaN(v)) nan++;
      else if (!Number.isFinite(v)) inf++;
    }
    return { nan, inf };
  }
  if (dtype === 'F8_E4M3') {
    // E4M3 (fn) has no infinity: only S.1111.111 is NaN.
    for (const v of bytes) if ((v & 0x7f) === 0x7f) nan++;
    return { nan, inf };
  }
  const f = FLOAT_BITS[dtype];
  if (!f) return { nan, inf }; // integers and BOOL are always finite
  const words = valueWords(bytes, f.bytes);
  for (let i = 0; i < words.length; i++) {
    const v = words[i];
    if ((v & f.exp) !== f.exp) continue;
    if ((v & f.mant) === 0) inf++;
    else nan++;
  }
  return { nan, inf };
}

/** Refuses a tensor whose encoded values hold a NaN or an infinity, naming it and the counts. */
function assertFinite(t: OutTensor, bytes: Uint8Array, source: Float32Array | Uint8Array): void {
  const { nan, inf } = countNonFinite(bytes, t.dtype);
  if (nan + inf === 0) return;
  let overflow = 0;
  if (source instanceof Float32Array && t.dtype === 'F16') for (const v of source) if (Number.isFinite(v) && Math.abs(v) >= F16_OVERFLOW) overflow++;
  const kinds = [nan && `${nan} NaN`, inf && `${inf} infinite`].filter(Boolean).join(', ');
  const why = overflow ? `; ${overflow} of them are finite f32 values too large for F16 (max ±${F16_MAX})` : '';
  throw new ExportError(
    `tensor '${t.name}' (${t.dtype} [${t.shape}]): ${nan + inf} of ${numel(t.shape)} values would be written as NaN or infinity (${kinds}${why}). ` +
      'The export was stopped so that no broken model file is written. Usually training diverged: train again with a lower learning rate or fewer steps',
  );
}

/** The bytes of one tensor in its file dtype, checked against its spec and for NaN / infinite values. */
async function encodeTensor(t: OutTensor): Promise<Uint8Array> {
  const data = await t.data();
  const n = numel(t.shape);
  let bytes: Uint8Array;
  if (data instanceof Uint8Array) bytes = data;
  else {
    if (data.length !== n) throw new ExportError(`tensor '${t.name}': ${data.length} values for shape [${t.shape}]`);
    if (t.dtype === 'F16') bytes = new Uint8Array(toF16Bits(data).buffer);
    else if (t.dtype === 'F32') bytes = new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
    else throw new ExportError(`tensor '${t.name}': f32 values can be written as F16 or F32, not ${t.dtype} (give raw bytes)`);
  }
  if (bytes.length !== byteLength(t)) throw new ExportError(`tensor '${t.name}': ${bytes.length} bytes for ${t.dtype} [${t.shape}]`);
  assertFinite(t, bytes, data);
  return bytes;
}

/** Chunks whose total length is known before the first one is pulled. */
export type SizedChunks = AsyncGenerator<Uint8Array> & { readonly totalBytes: number };

async function* chunksOf(tensors: readonly OutTensor[], metadata: Record<string, string>): AsyncGenerator<Uint8Array> {
  yield headerBytes(tensors, metadata);
  for (const t of tensors) yield await encodeTensor(t);
}

/** The file as chunks: the header, then one chunk per tensor, each read only when it is pulled. */
export function safetensorsChunks(tensors: readonly OutTensor[], metadata: Record<string, string> = {}): SizedChunks {
  // A getter, so a bad spec still fails on the first pull (as a rejection), not when the generator is made.
  return Object.defineProperty(chunksOf(tensors, metadata), 'totalBytes', { get: () => safetensorsSize(tensors, metadata) }) as SizedChunks;
}

/** What a ByteSink may offer beyond write/close (sink-node.ts's file sink has both); used when present. */
export interface SinkExtras {
  /** Told the total size before the first write, when known: a disk-full message can then say how much room is needed. */
  expectBytes?(total: number): void;
  /** Throws away what was written (a temp file) after a failed export. */
  abort?(reason: unknown): Promise<void>;
}

async function abortSink(sink: ByteSink & SinkExtras, reason: unknown): Promise<void> {
  // The export's own error is the one to report: a failure to clean up must not replace it.
  await sink.abort?.(reason).catch(() => undefined);
}

/** Writes every chunk to the sink in order, then closes it; on any failure the sink is aborted and the error rethrown. */
export async function pump(chunks: AsyncIterable<Uint8Array>, sink: ByteSink & SinkExtras): Promise<void> {
  try {
    const total = (chunks as Partial<SizedChunks>).totalBytes;
    if (total !== undefined) sink.expectBytes?.(total);
    for await (const c of chunks) await sink.write(c);
    await sink.close();
  } catch (e) {
    await abortSink(sink, e);
    throw e;
  }
}

/** A ReadableStream (e.g. zipDiffusers' output) into a ByteSink, chunk by chunk; aborted like pump on failure. */
export async function pipeToSink(stream: ReadableStream<Uint8Array>, sink: ByteSink & SinkExtras): Promise<void> {
  const reader = stream.getReader();
  try {
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      await sink.write(value);
    }
    await sink.close();
  } catch (e) {
    await reader.cancel(e).catch(() => undefined);
    await abortSink(sink, e);
    throw e;
  }
}

// ---- metadata values as kohya's Python writes them (str() of Python values) ---------------------------

/** Python's str(float): '8.0', '0.0001', '1e-05', '5e-06'. */
export function pyFloat(x: number): string {
  if (!Number.isFinite(x)) return Number.isNaN(x) ? 'nan' : x > 0 ? 'inf' : '-inf';
  const a = Math.abs(x);
  if (a !== 0 && (a < 1e-4 || a >= 1e16)) {
    const [m, e] = x.toExponential().split('e');
    const exp = Number(e);
    return `${m}e${exp < 0 ? '-' : '+'}${String(Math.abs(exp)).padStart(2, '0')}`;
  }
  return Number.isInteger(x) ? `${x}.0` : String(x);
}

/** Python's str(bool). */
export const pyBool = (b: boolean) => (b ? 'True' : 'False');

/** A value for pyJson: ints (JS integers), strings, booleans, None (null), lists, and dicts in key order (Map). */
export type PyJson = number | string | boolean | null | readonly PyJson[] | ReadonlyMap<string, PyJson>;

/**
 * Python's json.dumps(v) with its defaults: ', ' and ': ' separators, non-ASCII as \uXXXX (ensure_ascii),
 * dict keys in insertion order (a Map, since a JS object would move integer-like keys such as a "1girl" tag's
 * sibling "1" to the front).
 */
export function pyJson(v: PyJson): string {
  if (v === null) return 'null';
  if (typeof v === 'boolean') return v ? 'true' : 'false';
  if (typeof v === 'number') {
    if (!Number.isInteger(v)) throw new ExportError(`pyJson: ${v} is not an integer (floats are not written here)`);
    return String(v);
  }
  if (typeof v === 'string') return JSON.stringify(v).replace(/[\u007f-\uffff]/g, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`);
  if (Array.isArray(v)) return `[${(v as readonly PyJson[]).map(pyJson).join(', ')}]`;
  return `{${[...(v as ReadonlyMap<string, PyJson>)].map(([k, x]) => `${pyJson(k)}: ${pyJson(x)}`).join(', ')}}`;
}
