// Host-neutral pieces of src/store/chunkstore.ts: the CRC-32, key rules, byte formatting, error messages.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { crc32 as zlibCrc32 } from 'node:zlib';
import { formatBytes as formatSize } from '../../src/util/bytes.ts';
// The chunk store's messages give sizes with the exact count ("1.5 KiB (1536 bytes)").
const formatBytes = (n: number) => formatSize(n, { exact: true });
import { ChunkStoreError, crc32, isQuotaError, StorageFullError, validateKey, verifyChunk } from '../../src/store/chunkstore.ts';
import { testBytes } from './harnesses.ts';

describe('crc32', () => {
  it('matches the standard check value and zlib on every alignment and length', () => {
    assert.equal(crc32(new TextEncoder().encode('123456789')), 0xcbf43926);
    assert.equal(crc32(new Uint8Array(0)), 0);
    const data = testBytes(5000, 11);
    for (let start = 0; start < 9; start++) {
      for (const len of [0, 1, 3, 7, 8, 9, 15, 16, 17, 100, 4000]) {
        const view = data.subarray(start, start + len);
        assert.equal(crc32(view), zlibCrc32(view), `offset ${start} length ${len}`);
      }
    }
  });

  it('continues over data split in parts', () => {
    const data = testBytes(10_000, 5);
    assert.equal(crc32(data.subarray(4001), crc32(data.subarray(0, 4001))), crc32(data));
  });

  it('verifyChunk names the key and both checksums', () => {
    const data = testBytes(100);
    verifyChunk('k', data, { length: 100, crc32: crc32(data) });
    assert.throws(
      () => verifyChunk('run/opt/0001', data, { length: 100, crc32: 0x1234 }),
      (e: unknown) => {
        assert.ok(e instanceof ChunkStoreError);
        assert.equal(e.key, 'run/opt/0001');
        assert.match(e.message, /chunk "run\/opt\/0001" is corrupt: CRC-32 [0-9a-f]{8} does not match the stored 00001234 \(100 bytes\)/);
        return true;
      },
    );
    assert.throws(() => verifyChunk('k', data, { length: 101, crc32: 0 }), /truncated or damaged: 100 bytes read, 101 were written/);
  });
});

describe('keys', () => {
  it('accepts the key shapes the offload tier uses', () => {
    for (const k of ['run-abc/opt/0007', 'HEAD', 'run_1/s000003/unet.lora.safetensors', 'a', 'a.b-c_d/E9', 'x'.repeat(200)]) validateKey(k);
  });
});

describe('errors', () => {
  it('StorageFullError explains the quota, the key and what to do', () => {
    const e = new StorageFullError('run/w/0001', 64 * 1024 * 1024, { quota: 1024 ** 3, used: 1000 * 1024 ** 2 });
    assert.equal(e.name, 'StorageFullError');
    assert.equal(
      e.message,
      'Storage is full: could not write 64.0 MiB (67108864 bytes) for chunk "run/w/0001" (1000.0 MiB (1048576000 bytes) of the 1.0 GiB (1073741824 bytes) quota in use). ' +
        'The previous version of this chunk is intact. Free space (delete old runs or other site data / files), then resume.',
    );
    assert.match(new StorageFullError('k', 10, { reason: 'ENOSPC: disk full' }).message, /10 bytes for chunk "k" \(ENOSPC: disk full\)/);
  });

  it('formats byte counts', () => {
    assert.equal(formatBytes(0), '0 bytes');
    assert.equal(formatBytes(1023), '1023 bytes');
    assert.equal(formatBytes(1536), '1.5 KiB (1536 bytes)');
    assert.equal(formatBytes(3 * 1024 ** 4), '3.0 TiB (3298534883328 bytes)');
  });

  it('recognises browser quota errors by name or legacy code', () => {
    assert.ok(isQuotaError(new DOMException('x', 'QuotaExceededError')));
    assert.ok(isQuotaError({ name: 'Whatever', code: 22 }));
    assert.ok(!isQuotaError(new DOMException('x', 'AbortError')));
    assert.ok(!isQuotaError(null));
  });
});
