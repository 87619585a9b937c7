// The ChunkStore contract, as one node:test suite that every implementation runs (memory.test.ts,
// fs.test.ts, idb.test.ts): the same calls must give the same results and the same errors everywhere.
import assert from 'node:assert/strict';
import { after, describe, it } from 'node:test';
import { ChunkStoreError, MAX_KEY_LENGTH, StorageFullError } from '../../src/store/chunkstore.ts';
import { testBytes, type StoreHarness } from './harnesses.ts';

const MiB = 1 << 20;

export const BAD_KEYS: [string, RegExp][] = [
  ['', /empty/],
  ['/abs', /empty segment/],
  ['trailing/', /empty segment/],
  ['a//b', /empty segment/],
  ['a/../b', /'\.\.' segments are not allowed/],
  ['..', /'\.\.' segments/],
  ['a/./b', /'\.' segments/],
  ['.hidden', /starts with '\.'/],
  ['run/.tmp', /starts with '\.'/],
  ['with space', /character " " is not allowed/],
  ['back\\slash', /character "\\\\" is not allowed/],
  ['c:drive', /character ":" is not allowed/],
  ['tilde~x', /character "~" is not allowed/],
  ['nul\u0000x', /is not allowed/],
  ['é', /character "é" is not allowed/],
  ['x'.repeat(MAX_KEY_LENGTH + 1), /too long/],
];

export function defineContractSuite(h: StoreHarness): void {
  describe(`ChunkStore contract: ${h.label}`, () => {
    after(() => h.cleanup());

    it('reads back what was written; absent keys read as null', async () => {
      const s = await h.fresh();
      for (const n of [0, 1, 7, 4096, 100_003]) await s.write(`k/${n}`, testBytes(n, n));
      for (const n of [0, 1, 7, 4096, 100_003]) assert.deepEqual(await s.read(`k/${n}`), testBytes(n, n), `size ${n}`);
      assert.equal(await s.read('k/missing'), null);
      assert.equal(await s.read('nothing-here'), null);
      await s.close();
    });

    it('writes only the view it is given, and reads return arrays that own their buffer', async () => {
      const s = await h.fresh();
      const big = testBytes(1000, 3);
      const view = big.subarray(13, 513); // an odd offset into a larger buffer
      await s.write('view', view);
      const back = await s.read('view');
      assert.ok(back);
      assert.deepEqual(back, view);
      assert.equal(back.byteOffset, 0);
      assert.equal(back.buffer.byteLength, back.byteLength, 'the returned array owns its whole ArrayBuffer');
      // Neither the caller's buffer nor the returned one is shared with the store.
      big.fill(0);
      back.fill(0);
      assert.deepEqual(await s.read('view'), testBytes(1000, 3).subarray(13, 513));
      await s.close();
    });

    it('overwrite replaces the bytes and the byte count', async () => {
      const s = await h.fresh();
      await s.write('a', testBytes(1000, 1));
      await s.write('b', testBytes(10, 2));
      assert.equal(await s.bytesUsed(), 1010);
      await s.write('a', testBytes(300, 5));
      assert.deepEqual(await s.read('a'), testBytes(300, 5));
      assert.equal(await s.bytesUsed(), 310);
      await s.close();
    });

    it('deletes (absent keys too) and lists keys by prefix, sorted', async () => {
      const s = await h.fresh();
      const keys = ['run-b/opt/0002', 'run-a/opt/0010', 'run-a/opt/0002', 'run-a/w/0000', 'run-a.x', 'HEAD'];
      for (const [i, k] of keys.entries()) await s.write(k, testBytes(i + 1, i));
      assert.deepEqual(await s.keys(), [...keys].sort());
      assert.deepEqual(await s.keys('run-a/'), ['run-a/opt/0002', 'run-a/opt/0010', 'run-a/w/0000']);
      assert.deepEqual(await s.keys('run-a/opt/'), ['run-a/opt/0002', 'run-a/opt/0010']);
      assert.deepEqual(await s.keys('run-a'), ['run-a.x', 'run-a/opt/0002', 'run-a/opt/0010', 'run-a/w/0000']);
      assert.deepEqual(await s.keys('zzz'), []);
      await s.delete('run-a/opt/0002');
      await s.delete('run-a/opt/0002'); // already gone: not an error
      await s.delete('never-existed');
      assert.equal(await s.read('run-a/opt/0002'), null);
      assert.deepEqual(await s.keys('run-a/opt/'), ['run-a/opt/0010']);
      assert.equal(await s.bytesUsed(), 1 + 2 + 4 + 5 + 6);
      await s.close();
    });

    it('round-trips a 64 MiB chunk', { timeout: 20_000 }, async () => {
      const s = await h.fresh();
      const data = testBytes(64 * MiB, 64);
      const t0 = performance.now();
      await s.write('big/0000', data);
      const t1 = performance.now();
      const back = await s.read('big/0000');
      const t2 = performance.now();
      assert.ok(back);
      assert.equal(back.length, data.length);
      assert.ok(Buffer.compare(back, data) === 0, '64 MiB differ');
      assert.equal(await s.bytesUsed(), 64 * MiB);
      console.log(`# ${h.label}: 64 MiB write ${(t1 - t0).toFixed(0)} ms, read+verify ${(t2 - t1).toFixed(0)} ms`);
      await s.delete('big/0000');
      assert.equal(await s.bytesUsed(), 0);
      await s.close();
    });

    for (const how of ['flip', 'truncate'] as const) {
      it(`detects a damaged chunk (${how}) and names the key`, async () => {
        const s = await h.fresh();
        await s.write('run/opt/0007', testBytes(5000, 7));
        await s.write('run/opt/0008', testBytes(5000, 8));
        await h.damage(s, 'run/opt/0007', how);
        await assert.rejects(s.read('run/opt/0007'), (e: unknown) => {
          assert.ok(e instanceof ChunkStoreError, String(e));
          assert.equal(e.key, 'run/opt/0007');
          assert.match(e.message, /chunk "run\/opt\/0007" is (corrupt|truncated or damaged)/);
          return true;
        });
        assert.deepEqual(await s.read('run/opt/0008'), testBytes(5000, 8), 'other chunks are unaffected');
        await s.write('run/opt/0007', testBytes(10, 9)); // a rewrite repairs it
        assert.deepEqual(await s.read('run/opt/0007'), testBytes(10, 9));
        await s.close();
      });
    }

    it('refuses a write past the quota with StorageFullError, keeping the old version', async () => {
      const s = await h.fresh({ quotaBytes: 10_000 });
      await s.write('run/w', testBytes(6000, 1));
      await s.write('run/w', testBytes(9000, 2)); // replacing counts only the growth
      await s.write('run/x', testBytes(1000, 3)); // exactly full
      await assert.rejects(s.write('run/w', testBytes(9001, 4)), (e: unknown) => {
        assert.ok(e instanceof StorageFullError, String(e));
        assert.equal(e.key, 'run/w');
        assert.equal(e.bytes, 9001);
        assert.match(e.message, /Storage is full: could not write 8\.8 KiB \(9001 bytes\) for chunk "run\/w"/);
        assert.match(e.message, /previous version of this chunk is intact/);
        assert.match(e.message, /[Ff]ree space.*then resume/);
        return true;
      });
      await assert.rejects(s.write('run/y', testBytes(1, 5)), StorageFullError);
      assert.deepEqual(await s.read('run/w'), testBytes(9000, 2), 'old version intact');
      assert.equal(await s.read('run/y'), null);
      assert.equal(await s.bytesUsed(), 10_000);
      await s.delete('run/x'); // freeing space lets the write through
      await s.write('run/y', testBytes(1000, 5));
      assert.deepEqual(await s.read('run/y'), testBytes(1000, 5));
      await s.close();
    });

    it('counts concurrent writes against the quota together', async () => {
      const s = await h.fresh({ quotaBytes: 3000 });
      const results = await Promise.allSettled([1, 2, 3, 4, 5].map((i) => s.write(`c/${i}`, testBytes(1000, i))));
      assert.equal(results.filter((r) => r.status === 'fulfilled').length, 3);
      for (const r of results) if (r.status === 'rejected') assert.ok(r.reason instanceof StorageFullError);
      assert.equal(await s.bytesUsed(), 3000);
      await s.close();
    });

    it('handles concurrent writes: distinct keys all land, one key ends as one whole version', async () => {
      const s = await h.fresh();
      await Promise.all(Array.from({ length: 16 }, (_, i) => s.write(`p/${String(i).padStart(2, '0')}`, testBytes(10_000 + i, i))));
      for (let i = 0; i < 16; i++) assert.deepEqual(await s.read(`p/${String(i).padStart(2, '0')}`), testBytes(10_000 + i, i));
      await Promise.all([1, 2, 3, 4].map((v) => s.write('same', testBytes(20_000, v))));
      const got = await s.read('same');
      assert.ok(
        [1, 2, 3, 4].some((v) => Buffer.compare(got!, testBytes(20_000, v)) === 0),
        'one complete version',
      );
      assert.equal(await s.bytesUsed(), 16 * 10_000 + 120 + 20_000);
      await s.close();
    });

    it('rejects bad keys with a clear ChunkStoreError, on every method', async () => {
      const s = await h.fresh();
      for (const [key, why] of BAD_KEYS) {
        for (const call of [() => s.write(key, new Uint8Array(1)), () => s.read(key), () => s.delete(key)]) {
          await assert.rejects(call(), (e: unknown) => {
            assert.ok(e instanceof ChunkStoreError, `${JSON.stringify(key)}: ${String(e)}`);
            assert.match(e.message, /^bad chunk key/);
            assert.match(e.message, why);
            assert.match(e.message, /keys are '\/'-separated segments/);
            return true;
          });
        }
      }
      await assert.rejects(s.keys('a b'), /bad key prefix "a b"/);
      assert.deepEqual(await s.keys(), [], 'nothing was written');
      await s.close();
    });

    it('fails clearly once closed', async () => {
      const s = await h.fresh();
      await s.write('a', testBytes(3));
      await s.close();
      await assert.rejects(s.read('a'), (e: unknown) => e instanceof ChunkStoreError && /is closed/.test(e.message));
      await assert.rejects(s.write('a', testBytes(3)), /is closed/);
    });

    if (h.reopen) {
      const reopen = h.reopen.bind(h);
      it('persists across close and reopen (keys, bytes, byte count)', async () => {
        let s = await h.fresh();
        await s.write('run/a', testBytes(1234, 1));
        await s.write('run/b/c', testBytes(0, 2));
        s = await reopen(s);
        assert.deepEqual(await s.keys(), ['run/a', 'run/b/c']);
        assert.deepEqual(await s.read('run/a'), testBytes(1234, 1));
        assert.deepEqual(await s.read('run/b/c'), new Uint8Array(0));
        assert.equal(await s.bytesUsed(), 1234);
        await s.close();
      });

      it('enforces the quota on usage found at reopen', async () => {
        let s = await h.fresh();
        await s.write('run/a', testBytes(800, 1));
        s = await reopen(s, { quotaBytes: 1000 });
        await assert.rejects(s.write('run/b', testBytes(201, 2)), StorageFullError);
        await s.write('run/b', testBytes(200, 2));
        await s.close();
      });
    }
  });
}
