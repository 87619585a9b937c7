// Streamed safetensors: reading by slices from a Node file handle and from a Blob, the streaming
// writer (never more than one tensor in memory), and one specific message per kind of bad file.
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, truncateSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { roundToF16 } from '../../src/util/half.ts';
import { SafetensorsError, SafetensorsFile, SafetensorsWriter, writeSafetensors, type ByteSink } from '../../src/io/safetensors.ts';
import { nodeFileSink } from '../../src/io/sink-node.ts';
import { BlobSource, BytesSource } from '../../src/io/source.ts';
import { NodeFileSource } from '../../src/io/source-node.ts';
import { randomValues } from '../../src/selftest/check.ts';

const dir = mkdtempSync(join(tmpdir(), 'dbs-st-'));

/** A raw safetensors file from a header object (or its JSON text as is) and a data section length. */
function rawFile(header: unknown, dataBytes: number): Uint8Array {
  const json = new TextEncoder().encode(typeof header === 'string' ? header : JSON.stringify(header));
  const out = new Uint8Array(8 + json.length + dataBytes);
  new DataView(out.buffer).setBigUint64(0, BigInt(json.length), true);
  out.set(json, 8);
  return out;
}

async function openBytes(bytes: Uint8Array, name = 'model.safetensors') {
  return SafetensorsFile.open(new BytesSource(bytes, name));
}

describe('streamed safetensors', () => {
  it('writes tensor by tensor and reads back by slices from a file handle and a Blob', async () => {
    const a = randomValues(3 * 5, 1);
    const b = roundToF16(randomValues(4 * 7, 2));
    const path = join(dir, 'rt.safetensors');
    const w = new SafetensorsWriter(
      await nodeFileSink(path),
      [
        { name: 'a', dtype: 'F32', shape: [3, 5] },
        { name: 'b.weight', dtype: 'F16', shape: [4, 7] },
      ],
      { format: 'pt' },
    );
    await w.write('a', a);
    await w.write('b.weight', b);
    await w.finish();
    const src = await NodeFileSource.open(path);
    const f = await SafetensorsFile.open(src);
    assert.deepEqual(f.names, ['a', 'b.weight']);
    assert.deepEqual(f.metadata, { format: 'pt' });
    assert.deepEqual([...(await f.read('a')).data], [...a]);
    assert.deepEqual([...(await f.read('b.weight')).data], [...b]);
    const rows = await f.readRows('b.weight', 1, 2); // rows 1..2 of [4, 7] F16
    assert.equal(rows.length, 2 * 7 * 2);
    const slice = await f.readSlice('b.weight', 1, 2);
    assert.deepEqual(slice.shape, [2, 7]);
    assert.deepEqual([...slice.data], [...b.subarray(7, 21)]);
    await assert.rejects(f.readSlice('b.weight', 3, 2), /rows \[3, 5\) of 'b\.weight' \[4,7\] are out of range/);
    await src.close();
    const viaBlob = await SafetensorsFile.open(new BlobSource(new Blob([readFileSync(path)]), 'rt.safetensors'));
    assert.deepEqual([...(await viaBlob.read('b.weight')).data], [...b]);
  });

  it('the writer holds at most one tensor: a 24 MiB file written from 1 MiB tensors', async () => {
    let largest = 0;
    let total = 0;
    const chunks: Uint8Array[] = [];
    const sink: ByteSink = {
      async write(c) {
        largest = Math.max(largest, c.length);
        total += c.length;
        chunks.push(c.slice(0, 16));
      },
      async close() {},
    };
    const specs = Array.from({ length: 24 }, (_, i) => ({ name: `t${i}`, dtype: 'F32' as const, shape: [512, 512] }));
    const w = new SafetensorsWriter(sink, specs);
    for (const s of specs) await w.write(s.name, new Float32Array(512 * 512).fill(Number(s.name.slice(1))));
    await w.finish();
    assert.equal(largest, 1 << 20, 'no chunk larger than one tensor');
    assert.ok(total > 24 << 20);
    await assert.rejects(new SafetensorsWriter(sink, specs).write('t1', new Float32Array(4)), /expected tensor 't0', got 't1'/);
  });

  it('decodes BF16 (upper half of the f32 bits) and F64 to f32', async () => {
    const values = [1.5, -2.25, 3e-3, 65504];
    const f32 = new Float32Array(values);
    const bf16 = new Uint16Array(new Uint32Array(f32.buffer).map((u) => u >>> 16));
    const f64 = new Float64Array(values);
    const f = rawFile({ b: { dtype: 'BF16', shape: [4], data_offsets: [0, 8] }, d: { dtype: 'F64', shape: [2, 2], data_offsets: [8, 40] } }, 40);
    const dataStart = f.length - 40;
    f.set(new Uint8Array(bf16.buffer), dataStart);
    f.set(new Uint8Array(f64.buffer), dataStart + 8);
    const st = await openBytes(f);
    // bf16 keeps 8 mantissa bits: 1.5, -2.25 and 65504 -> 65280 truncate exactly as the bit shift says.
    assert.deepEqual([...(await st.read('b')).data], [...new Float32Array(new Uint32Array(bf16).map((u) => u << 16).buffer)]);
    assert.deepEqual([...(await st.read('b')).data].slice(0, 2), [1.5, -2.25]);
    assert.deepEqual([...(await st.read('d')).data], [...f32]);
  });

  it('matches the in-memory writer byte for byte', async () => {
    const x = randomValues(6, 3);
    const mem = writeSafetensors(new Map([['x', { shape: [2, 3], data: x }]]));
    const parts: Uint8Array[] = [];
    const w = new SafetensorsWriter({ write: async (c) => void parts.push(c.slice()), close: async () => {} }, [{ name: 'x', dtype: 'F32', shape: [2, 3] }]);
    await w.write('x', x);
    await w.finish();
    assert.deepEqual(Buffer.concat(parts), Buffer.from(mem));
  });
});

describe('bad safetensors files each get their own message', () => {
  const good = writeSafetensors(
    new Map([
      ['w', { shape: [4, 4], data: randomValues(16, 4) }],
      ['b', { shape: [4], data: randomValues(4, 5) }],
    ]),
  );

  it('a truncated file', async () => {
    const path = join(dir, 'cut.safetensors');
    writeFileSync(path, good);
    truncateSync(path, good.length - 10);
    await assert.rejects(
      SafetensorsFile.open(await NodeFileSource.open(path)),
      (e: Error) =>
        e instanceof SafetensorsError &&
        /cut\.safetensors: truncated or corrupt: tensor 'b': range \[64, 80\) lies outside the 70-byte data section/.test(e.message),
    );
  });

  it('a header length past the end of the file', async () => {
    const bytes = good.slice(0, 40);
    await assert.rejects(openBytes(bytes), /truncated: the header says \d+ bytes but only 32 follow/);
  });

  it('overlapping ranges', async () => {
    const f = rawFile({ a: { dtype: 'F32', shape: [2], data_offsets: [0, 8] }, b: { dtype: 'F32', shape: [2], data_offsets: [4, 12] } }, 12);
    await assert.rejects(openBytes(f), /tensors 'a' and 'b' overlap/);
  });

  it('a range outside the file', async () => {
    const f = rawFile({ a: { dtype: 'F32', shape: [4], data_offsets: [0, 16] } }, 8);
    await assert.rejects(openBytes(f), /range \[0, 16\) lies outside the 8-byte data section/);
  });

  it('a range spanning several later ones overlaps even when its neighbour is empty', async () => {
    const f = rawFile(
      {
        big: { dtype: 'F32', shape: [25], data_offsets: [0, 100] },
        empty: { dtype: 'F32', shape: [0], data_offsets: [10, 10] },
        inside: { dtype: 'F32', shape: [4], data_offsets: [50, 66] },
      },
      100,
    );
    await assert.rejects(openBytes(f), /tensors 'big' and 'inside' overlap \(bytes \[50, 66\)/);
  });

  it('an unknown dtype', async () => {
    const f = rawFile({ a: { dtype: 'Q4_K', shape: [1], data_offsets: [0, 8] } }, 8);
    await assert.rejects(openBytes(f), /tensor 'a': unknown dtype "Q4_K" \(safetensors defines BOOL, U8/);
  });

  it('integer tensors (CLIP position_ids, EMA num_updates) open, but are refused as float weights', async () => {
    const f = rawFile(
      {
        'text_model.embeddings.position_ids': { dtype: 'I64', shape: [1, 3], data_offsets: [0, 24] },
        'model_ema.num_updates': { dtype: 'I32', shape: [], data_offsets: [24, 28] },
      },
      28,
    );
    const st = await openBytes(f);
    assert.deepEqual(st.names, ['text_model.embeddings.position_ids', 'model_ema.num_updates']);
    assert.equal(st.entry('model_ema.num_updates').dtype, 'I32');
    await assert.rejects(st.read('text_model.embeddings.position_ids'), /tensor 'text_model\.embeddings\.position_ids' is I64, not a float tensor/);
    const bad = rawFile({ a: { dtype: 'I64', shape: [2], data_offsets: [0, 8] } }, 8);
    await assert.rejects(openBytes(bad), /shape \[2\] x I64 is 16 bytes but its range holds 8/);
  });

  it('a tensor named twice in the header (JSON.parse would keep the last silently)', async () => {
    const entry = (begin: number) => `{"dtype":"F32","shape":[1],"data_offsets":[${begin},${begin + 4}]}`;
    // The duplicate sits after a nested value holding the same name as a string and an escaped quote,
    // so only a top-level key counts.
    const twice = `{"__metadata__":{"note":"a \\"quoted\\" a","a":"x"},"a":${entry(0)},"b":${entry(4)},"a":${entry(8)}}`;
    await assert.rejects(
      openBytes(rawFile(twice, 12), 'dup.safetensors'),
      (e: Error) => e instanceof SafetensorsError && /dup\.safetensors: the header names tensor 'a' twice .*corrupt/.test(e.message),
    );
    const escaped = `{"a\\u0062":${entry(0)},"ab":${entry(4)}}`; // the same key spelled two ways
    await assert.rejects(openBytes(rawFile(escaped, 8)), /names tensor 'ab' twice/);
    const distinct = `{"__metadata__":{"a":"1"},"a":${entry(0)},"b":${entry(4)}}`; // same name at another depth only
    assert.deepEqual((await openBytes(rawFile(distinct, 8))).names, ['a', 'b']);
  });

  it('metadata that is not a map of strings', async () => {
    const f = rawFile({ __metadata__: { format: 1 }, a: { dtype: 'F32', shape: [1], data_offsets: [0, 4] } }, 4);
    await assert.rejects(openBytes(f), /__metadata__ must map names to strings/);
  });

  it('shape x dtype size not matching the byte range', async () => {
    const f = rawFile({ a: { dtype: 'F16', shape: [3], data_offsets: [0, 8] } }, 8);
    await assert.rejects(openBytes(f), /shape \[3\] x F16 is 6 bytes but its range holds 8/);
  });

  it('a pickle checkpoint (zip or raw pickle) is refused, never unpickled', async () => {
    const zip = new Uint8Array(64);
    zip.set([0x50, 0x4b, 0x03, 0x04]);
    await assert.rejects(openBytes(zip, 'model.ckpt'), /model\.ckpt: this is a PyTorch pickle checkpoint.*convert it to \.safetensors/);
    const pickle = new Uint8Array(64);
    pickle.set([0x80, 0x02, 0x7d]);
    await assert.rejects(openBytes(pickle, 'model.pt'), /PyTorch pickle checkpoint/);
  });

  it('a file that is no safetensors at all, and one too short to be one', async () => {
    await assert.rejects(openBytes(new TextEncoder().encode('hello, this is a text file and not a model'), 'notes.txt'), /notes\.txt: not a safetensors file/);
    await assert.rejects(openBytes(new Uint8Array(5), 'tiny.bin'), /tiny\.bin: not a safetensors file \(5 bytes/);
  });

  it('reads outside a source are refused with the file name', async () => {
    await assert.rejects(new BytesSource(new Uint8Array(10), 'x.bin').read(8, 4), /x\.bin: bytes \[8, 12\) lie outside the 10-byte file/);
  });
});
