// The exporters' streamed safetensors writer: the size is known before any tensor is read, the header is
// ASCII (non-ASCII metadata escaped) so the data really starts 8-byte aligned, 0-d scalars and raw
// non-float tensors are written as given, and each tensor is checked against its spec.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { ExportError } from '../../src/export/provider.ts';
import { headerBytes, pump, pyFloat, safetensorsChunks, safetensorsSize, type OutTensor } from '../../src/export/stream.ts';
import { SafetensorsFile } from '../../src/io/safetensors.ts';
import { BytesSource } from '../../src/io/source.ts';
import { memorySink } from './fixtures.ts';

const tensors: OutTensor[] = [
  { name: 'scalar', dtype: 'F32', shape: [], data: async () => Float32Array.of(8) },
  { name: 'half', dtype: 'F16', shape: [2, 3], data: async () => Float32Array.of(1, 2, 3, 4, 5, 0.1) },
  { name: 'ids', dtype: 'I64', shape: [1, 3], data: async () => new Uint8Array(BigInt64Array.of(0n, 1n, 2n).buffer) },
];

describe('streamed safetensors', () => {
  it('writes what the reader reads back, size known up front, data 8-aligned after non-ASCII metadata', async () => {
    const metadata = { prompt: 'un chien, café ☕ 🐶', n: '3' };
    const header = headerBytes(tensors, metadata);
    assert.ok(
      header.every((b, i) => i < 8 || b < 0x80),
      'the header is ASCII',
    );
    assert.equal(header.length % 8, 0);
    const sink = memorySink();
    await pump(safetensorsChunks(tensors, metadata), sink);
    const bytes = sink.bytes();
    assert.equal(bytes.length, safetensorsSize(tensors, metadata));
    assert.deepEqual(sink.chunks, [header.length, 4, 12, 24]);
    const f = await SafetensorsFile.open(new BytesSource(bytes));
    assert.deepEqual(f.metadata, metadata);
    assert.deepEqual([f.entry('scalar').dtype, f.entry('scalar').shape], ['F32', []]);
    assert.deepEqual((await f.read('scalar')).data, Float32Array.of(8));
    assert.deepEqual((await f.read('half')).data, Float32Array.of(1, 2, 3, 4, 5, 0.0999755859375));
    assert.deepEqual(new BigInt64Array((await f.readRaw('ids')).slice().buffer), BigInt64Array.of(0n, 1n, 2n));
  });

  it('checks each tensor against its spec', async () => {
    const run = (t: OutTensor) => pump(safetensorsChunks([t]), memorySink());
    await assert.rejects(
      run({ name: 'x', dtype: 'F16', shape: [3], data: async () => new Float32Array(2) }),
      (e: Error) => e instanceof ExportError && /2 values for shape \[3\]/.test(e.message),
    );
    await assert.rejects(run({ name: 'x', dtype: 'I64', shape: [2], data: async () => new Uint8Array(8) }), /8 bytes for I64 \[2\]/);
    await assert.rejects(run({ name: 'x', dtype: 'BF16', shape: [2], data: async () => new Float32Array(2) }), /F16 or F32, not BF16/);
    assert.throws(() => headerBytes([tensors[0], tensors[0]]), /given twice/);
    assert.throws(() => headerBytes([{ name: 'x', dtype: 'Q4', shape: [1] }]), /unknown safetensors dtype Q4/);
  });

  it("formats numbers as Python's str()", () => {
    assert.deepEqual([8, 0.0001, 1e-5, 5e-6, 2.5e-4, 1.5, 0, 1e16].map(pyFloat), ['8.0', '0.0001', '1e-05', '5e-06', '0.00025', '1.5', '0.0', '1e+16']);
  });
});
