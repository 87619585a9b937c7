// The IndexedDB chunk store and snapshots in real headless Chromium: round trips (64 MiB included, Blob and
// ArrayBuffer storage timed side by side), damage detection, persistence across a reload, and a real
// QuotaExceededError (the origin's quota lowered over the DevTools protocol) surfacing as StorageFullError
// with the old version intact.
//
// The store modules are bundled on the fly with Vite's library mode into a temp folder served next to a blank
// page (no dependency on the app build), and the browser uses an on-disk profile rather than an incognito
// context, so IndexedDB writes real files and the quota override applies.
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { chromium, type BrowserContext, type Page } from 'playwright-core';
import { build } from 'vite';
import { CHROMIUM_FLAGS, ROOT, serve } from './browser.ts';

/** The bundle's exports, as the page sees them (typed loosely: the page code is serialised, not imported). */
type StoreModule = typeof import('../src/store/idb-store.ts') & typeof import('../src/store/chunkstore.ts') & typeof import('../src/store/snapshot.ts');
declare global {
  interface Window {
    __store?: StoreModule;
  }
}

async function bundleStore(dir: string): Promise<void> {
  const entry = join(dir, 'entry.ts');
  writeFileSync(entry, ['idb-store', 'chunkstore', 'snapshot'].map((m) => `export * from '${join(ROOT, 'src', 'store', `${m}.ts`)}';`).join('\n'));
  await build({
    configFile: false,
    root: dir,
    logLevel: 'warn',
    build: { outDir: join(dir, 'www'), emptyOutDir: true, minify: false, lib: { entry, formats: ['es'], fileName: () => 'store.js' } },
  });
  // tsx compiles this file with esbuild's keepNames, which wraps named functions inside page.evaluate
  // callbacks in a `__name(fn, "name")` helper that exists only in Node: the page gets a no-op one.
  writeFileSync(
    join(dir, 'www', 'index.html'),
    '<!doctype html><title>chunk store</title><script>window.__name = (f) => f;</script>' +
      '<script type="module">window.__store = await import("/store.js");</script>',
  );
}

async function openPage(ctx: BrowserContext, url: string): Promise<Page> {
  const page = ctx.pages()[0] ?? (await ctx.newPage());
  await page.goto(url);
  await page.waitForFunction(() => window.__store !== undefined);
  return page;
}

describe('IdbChunkStore in headless Chromium', () => {
  const dir = mkdtempSync(join(tmpdir(), 'dbs-e2e-store-'));
  let server: Awaited<ReturnType<typeof serve>>;
  let ctx: BrowserContext;
  let page: Page;
  /** A second origin for the quota test; closed after the browser (open keep-alive sockets would stall close()). */
  let other: Awaited<ReturnType<typeof serve>> | undefined;

  before(async () => {
    await bundleStore(dir);
    server = await serve(join(dir, 'www'));
    ctx = await chromium.launchPersistentContext(join(dir, 'profile'), {
      executablePath: process.env.CHROMIUM_PATH ?? '/usr/bin/chromium',
      headless: true,
      args: [...CHROMIUM_FLAGS, '--disable-webgpu'],
    });
    page = await openPage(ctx, server.url);
  });
  after(async () => {
    await ctx?.close();
    await server?.close();
    await other?.close();
    rmSync(dir, { recursive: true, force: true });
  });

  it('writes, reads, overwrites, deletes, lists; rejects bad keys; detects a damaged record', { timeout: 20_000 }, async () => {
    const r = await page.evaluate(async () => {
      const m = window.__store!;
      const bytes = (n: number, seed: number) => Uint8Array.from({ length: n }, (_, i) => (i * 31 + seed * 7) & 0xff);
      const same = (a: Uint8Array | null, b: Uint8Array) => a !== null && a.length === b.length && a.every((v, i) => v === b[i]);
      const s = await m.IdbChunkStore.open('basics');
      await s.write('run/opt/0002', bytes(1000, 1));
      await s.write('run/opt/0001', bytes(10, 2));
      await s.write('run/w/0000', bytes(5, 3));
      await s.write('run/opt/0002', bytes(300, 4));
      const keys = await s.keys('run/opt/');
      const used = await s.bytesUsed();
      const overwritten = same(await s.read('run/opt/0002'), bytes(300, 4));
      await s.delete('run/opt/0001');
      const afterDelete = [await s.read('run/opt/0001'), await s.keys()];
      const badKey = await s.write('a/../b', bytes(1, 1)).then(
        () => 'accepted',
        (e: Error) => `${e.name}: ${e.message}`,
      );
      // Damage the stored Blob underneath the store, keeping the record's length and CRC.
      const db = await new Promise<IDBDatabase>((res, rej) => {
        const q = indexedDB.open('basics');
        q.onsuccess = () => res(q.result);
        q.onerror = () => rej(q.error);
      });
      const rec = await new Promise<{ data: Blob; length: number; crc32: number }>((res) => {
        const q = db.transaction('chunks').objectStore('chunks').get('run/w/0000');
        q.onsuccess = () => res(q.result);
      });
      const bad = new Uint8Array(await rec.data.arrayBuffer());
      bad[2] ^= 1;
      await new Promise<void>((res) => {
        const tx = db.transaction('chunks', 'readwrite');
        tx.objectStore('chunks').put({ ...rec, data: new Blob([bad]) }, 'run/w/0000');
        tx.oncomplete = () => res();
      });
      db.close();
      const damaged = await s.read('run/w/0000').then(
        () => 'read garbage',
        (e: Error) => `${e.name}: ${e.message}`,
      );
      const storedAsBlob = rec.data instanceof Blob;
      await s.close();
      return { keys, used, overwritten, afterDelete, badKey, damaged, storedAsBlob };
    });
    assert.deepEqual(r.keys, ['run/opt/0001', 'run/opt/0002']);
    assert.equal(r.used, 315);
    assert.ok(r.overwritten);
    assert.deepEqual(r.afterDelete, [null, ['run/opt/0002', 'run/w/0000']]);
    assert.match(r.badKey, /^ChunkStoreError: bad chunk key "a\/..\/b": '..' segments are not allowed/);
    assert.match(r.damaged, /^ChunkStoreError: chunk "run\/w\/0000" is corrupt/);
    assert.ok(r.storedAsBlob);
  });

  it('round-trips 16 and 64 MiB chunks as Blob and as ArrayBuffer (timed)', { timeout: 25_000 }, async (t) => {
    const r = await page.evaluate(async () => {
      const m = window.__store!;
      const out: Record<string, { writeMs: number; readMs: number; ok: boolean }> = {};
      for (const storeAs of ['blob', 'arraybuffer'] as const) {
        const s = await m.IdbChunkStore.open(`big-${storeAs}`, { storeAs });
        for (const mib of [16, 64]) {
          // Incompressible bytes, like real weights and optimizer states: Chrome compresses large IndexedDB
          // values, so a mostly-zero buffer would time the compressor instead of the disk.
          const d = new Uint8Array(mib << 20);
          const words = new Uint32Array(d.buffer);
          for (let i = 0, x = mib; i < words.length; i++) words[i] = x = (Math.imul(x, 1664525) + 1013904223) >>> 0;
          const t0 = performance.now();
          await s.write('big/0000', d);
          const t1 = performance.now();
          const back = await s.read('big/0000');
          const t2 = performance.now();
          let ok = back !== null && back.length === d.length;
          for (let i = 0; ok && i < d.length; i += 97) ok = back![i] === d[i];
          out[`${storeAs} ${mib} MiB`] = { writeMs: Math.round(t1 - t0), readMs: Math.round(t2 - t1), ok };
        }
        await s.close();
      }
      return out;
    });
    for (const [k, v] of Object.entries(r)) {
      t.diagnostic(`${k}: write ${v.writeMs} ms, read+verify ${v.readMs} ms`);
      assert.ok(v.ok, `${k} round trip`);
    }
  });

  it('keeps chunks and snapshots across a reload', { timeout: 20_000 }, async () => {
    await page.evaluate(async () => {
      const m = window.__store!;
      const s = await m.IdbChunkStore.open('persist');
      await s.write('run/state', new TextEncoder().encode('step 41'));
      await m.commitSnapshot(s, 'run/ckpt', new Map([['lora.safetensors', new Uint8Array(4096).fill(7)]]), { step: 40 });
      await m.commitSnapshot(s, 'run/ckpt', new Map([['lora.safetensors', new Uint8Array(4096).fill(8)]]), { step: 41 });
      await s.close();
    });
    page = await openPage(ctx, server.url); // a reload: fresh page state, same profile
    const r = await page.evaluate(async () => {
      const m = window.__store!;
      const s = await m.IdbChunkStore.open('persist');
      const state = new TextDecoder().decode((await s.read('run/state'))!);
      const snap = await m.openSnapshot<{ step: number }>(s, 'run/ckpt');
      const lora = await snap!.read('lora.safetensors');
      const keys = await s.keys();
      await s.close();
      return { state, seq: snap!.seq, step: snap!.meta.step, allEight: lora.every((v) => v === 8), keys };
    });
    assert.deepEqual(r, { state: 'step 41', seq: 2, step: 41, allEight: true, keys: ['run/ckpt/HEAD', 'run/ckpt/s000002/lora.safetensors', 'run/state'] });
  });

  it('turns a real QuotaExceededError into StorageFullError and keeps the old version and snapshot', { timeout: 20_000 }, async () => {
    // A second origin (same files, another port) whose quota is lowered before it stores anything: Chrome's
    // IndexedDB caches an origin's quota once used, so the override must come first.
    other = await serve(join(dir, 'www'));
    const cdp = await ctx.newCDPSession(page);
    await cdp.send('Storage.overrideQuotaForOrigin', { origin: other.url, quotaSize: 24 * 1024 * 1024 });
    page = await openPage(ctx, other.url);
    try {
      const r = await page.evaluate(async () => {
        const m = window.__store!;
        const s = await m.IdbChunkStore.open('quota');
        const fill = (n: number, v: number) => new Uint8Array(n).fill(v);
        await s.write('run/opt/0001', fill(4 << 20, 1));
        const err = await s.write('run/opt/0001', fill(32 << 20, 2)).then(
          () => null,
          (e: Error & { key?: string; bytes?: number }) => ({
            name: e.name,
            message: e.message,
            key: e.key,
            bytes: e.bytes,
            cause: (e.cause as Error | undefined)?.name,
          }),
        );
        const old = await s.read('run/opt/0001');
        await m.commitSnapshot(s, 'run/ckpt', new Map([['a', fill(1 << 20, 3)]]), { step: 1 });
        const snapErr = await m
          .commitSnapshot(
            s,
            'run/ckpt',
            new Map([
              ['a', fill(1 << 20, 4)],
              ['b', fill(32 << 20, 5)],
            ]),
            { step: 2 },
          )
          .then(
            () => 'committed',
            (e: Error) => e.name,
          );
        const snap = await m.openSnapshot<{ step: number }>(s, 'run/ckpt');
        const a = await snap!.read('a');
        const keys = await s.keys('run/ckpt/');
        await s.close();
        return {
          err,
          oldOk: old !== null && old.length === 4 << 20 && old.every((v) => v === 1),
          snapErr,
          step: snap!.meta.step,
          aOk: a.every((v) => v === 3),
          keys,
        };
      });
      assert.ok(r.err, 'the 32 MiB write past a 24 MiB quota failed');
      assert.equal(r.err.name, 'StorageFullError');
      assert.equal(r.err.cause, 'QuotaExceededError');
      assert.equal(r.err.key, 'run/opt/0001');
      assert.equal(r.err.bytes, 32 << 20);
      // (navigator.storage.estimate() does not reflect the DevTools override, so the quota figure is the real one.)
      assert.match(
        r.err.message,
        /could not write 32\.0 MiB \(33554432 bytes\) for chunk "run\/opt\/0001" \(the browser refused more storage for this site(; the disk itself may be full)?; .* of the .* quota in use\)/,
      );
      assert.match(r.err.message, /Free space .*then resume/);
      assert.ok(r.oldOk, 'the previous version is intact');
      assert.equal(r.snapErr, 'StorageFullError');
      assert.equal(r.step, 1);
      assert.ok(r.aOk);
      assert.deepEqual(r.keys, ['run/ckpt/HEAD', 'run/ckpt/s000001/a']);
    } finally {
      await cdp.send('Storage.overrideQuotaForOrigin', { origin: other!.url }); // back to the real quota
      page = await openPage(ctx, server.url);
    }
  });

  it('storagePersistence reports the quota and usage', async () => {
    const p = await page.evaluate(() => window.__store!.storagePersistence());
    assert.equal(typeof p.persisted, 'boolean');
    assert.ok((p.quota ?? 0) > 0, JSON.stringify(p));
    assert.ok((p.usage ?? -1) >= 0, JSON.stringify(p));
  });
});
