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
import { toF16Bits } from '../util/half.ts';
import type { ByteSink } from '../io/safetensors.ts';
import { ExportError } from './provider.ts';

/** Bytes per element of the safetensors dtypes (as in io/safetensors.ts). */
const DTYPE_BYTES: Record<string, number> = {
  BOOL: 1, U8: 1, I8: 1, F8_E5M2: 1, F8_E4M3: 1, I16: 2, U16: 2, F16: 2, BF16: 2, I32: 4, U32: 4, F32: 4, I64: 8, U64: 8, F64: 8,
};

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

/** The bytes of one tensor in its file dtype, checked against its spec. */
export async function encodeTensor(t: OutTensor): Promise<Uint8Array> {
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
  return bytes;
}

/** The file as chunks: the header, then one chunk per tensor, each read only when it is pulled. */
export async function* safetensorsChunks(tensors: readonly OutTensor[], metadata: Record<string, string> = {}): AsyncGenerator<Uint8Array> {
  yield headerBytes(tensors, metadata);
  for (const t of tensors) yield await encodeTensor(t);
}

/** Writes every chunk to the sink in order, then closes it. */
export async function pump(chunks: AsyncIterable<Uint8Array>, sink: ByteSink): Promise<void> {
  for await (const c of chunks) await sink.write(c);
  await sink.close();
}

/** A ReadableStream (e.g. zipDiffusers' output) into a ByteSink, chunk by chunk. */
export async function pipeToSink(stream: ReadableStream<Uint8Array>, sink: ByteSink): Promise<void> {
  const reader = stream.getReader();
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    await sink.write(value);
  }
  await sink.close();
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
