// The file-system store: the shared contract, plus what only a disk has: temp files left by a crash, a
// process killed in the middle of writes, on-disk layout, and ENOSPC.
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { existsSync, mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, describe, it } from 'node:test';
import { ChunkStoreError, StorageFullError } from '../../src/store/chunkstore.ts';
import { chunkFileName, FsChunkStore, isDiskFullError } from '../../src/store/fs-store.ts';
import { defineContractSuite } from './contract.ts';
import { fsHarness, testBytes } from './harnesses.ts';
import { Rng } from '../../src/util/rng.ts';

/**
 * The crash test kills its writer after a random delay drawn from this seed: random by default (each run
 * tries another moment), logged by the test, and FS_KILL_SEED=<seed> replays the same delay.
 */
function killSeed(): number {
  const env = process.env.FS_KILL_SEED;
  if (env === undefined || env === '') return Math.floor(Math.random() * 2 ** 32);
  if (!/^\d+$/.test(env) || Number(env) >= 2 ** 32) throw new Error(`FS_KILL_SEED=${env}: expected the integer seed a crash-test log printed (0 to 2^32 - 1)`);
  return Number(env);
}

defineContractSuite(fsHarness());

describe('FsChunkStore on disk', () => {
  const root = mkdtempSync(join(tmpdir(), 'dbs-fs-store-'));
  after(() => rmSync(root, { recursive: true, force: true }));
  let n = 0;
  const dir = () => join(root, `d${n++}`);

  it('keeps one flat file per chunk; a key and a key below it can coexist', async () => {
    const s = await FsChunkStore.open(dir());
    await s.write('run', testBytes(3, 1));
    await s.write('run/opt/0001', testBytes(5, 2));
    assert.deepEqual(readdirSync(s.dir).sort(), ['run.chunk', 'run~opt~0001.chunk']);
    assert.deepEqual(await s.keys(), ['run', 'run/opt/0001']);
    assert.equal(chunkFileName('a/b.chunk'), 'a~b.chunk.chunk');
    await s.write('a/b.chunk', testBytes(4, 3)); // a key ending in the suffix still maps back exactly
    assert.deepEqual(await s.keys('a/'), ['a/b.chunk']);
  });

  it('a crash between temp write and rename leaves the old version, and open removes the temp file', async () => {
    const d = dir();
    const s = await FsChunkStore.open(d);
    await s.write('run/w/0000', testBytes(4000, 1));
    // What a writer killed before its rename leaves: a complete or partial temp file next to the chunk.
    const tmp = join(d, `.${chunkFileName('run/w/0000')}.0123456789ab.tmp`);
    writeFileSync(tmp, testBytes(2000, 2));
    assert.deepEqual(await s.read('run/w/0000'), testBytes(4000, 1), 'readers never see the temp file');
    assert.deepEqual(await s.keys(), ['run/w/0000']);
    await s.close();
    const again = await FsChunkStore.open(d);
    assert.ok(!existsSync(tmp), 'temp leftover removed at open');
    assert.deepEqual(await again.read('run/w/0000'), testBytes(4000, 1));
    assert.equal(await again.bytesUsed(), 4000);
  });

  it('a process killed mid-writes leaves every chunk whole (old or new version), never torn', { timeout: 20_000 }, async (t) => {
    const seed = killSeed();
    // Up to 50 ms after a write starts: a 4 MiB write (CRC, temp file, fsync, rename) takes some ms to some
    // tens of ms, so the kill lands in any phase of it (temp half written, written but not renamed, renamed
    // but not reported) or of the next one or two.
    const delayMs = new Rng(seed).uniform() * 50;
    t.diagnostic(`kill seed ${seed}: SIGKILL ${delayMs.toFixed(3)} ms after the 5th write starts (replay: FS_KILL_SEED=${seed})`);
    const d = dir();
    const s = await FsChunkStore.open(d);
    const size = 4 << 20;
    await s.write('c/0', testBytes(size, 1000));
    await s.close();
    // The child rewrites the chunk with versions 1001, 1002, ... and reports each write's start and return.
    const child = spawn(process.execPath, ['--import', 'tsx', join(import.meta.dirname, 'fixtures', 'crash-writer.ts'), d, String(size)], {
      stdio: ['ignore', 'pipe', 'inherit'],
    });
    let reported = '';
    await new Promise<void>((resolve, reject) => {
      child.on('error', reject);
      child.on('close', (code, signal) => (signal === 'SIGKILL' ? resolve() : reject(new Error(`crash-writer exited with ${code}`))));
      let armed = false;
      child.stdout.on('data', (b: Buffer) => {
        reported += b.toString();
        // Kill it `delayMs` after its 5th write starts: inside that write or one of the next few.
        if (!armed && reported.includes('> 1005\n')) {
          armed = true;
          setTimeout(() => child.kill('SIGKILL'), delayMs);
        }
      });
    });
    const done = reported
      .split('\n')
      .filter((l) => /^\d+$/.test(l))
      .map(Number);
    const replay = `kill seed ${seed} (replay: FS_KILL_SEED=${seed}): SIGKILL ${delayMs.toFixed(3)} ms after write 1005 started; last write returned: ${done.at(-1)}`;
    t.diagnostic(`${done.length} writes returned before the kill`);
    const again = await FsChunkStore.open(d);
    assert.deepEqual(
      readdirSync(d).filter((f) => f.endsWith('.tmp')),
      [],
      `temp files removed; ${replay}`,
    );
    // read verifies the CRC: a torn chunk throws here.
    const back = await again.read('c/0').catch((e: Error) => assert.fail(`${e.message}; ${replay}`));
    assert.ok(back, replay);
    const last = done[done.length - 1];
    // The chunk holds the last reported version or the one after (written but killed before reporting).
    const match = [last, last + 1].find((v) => Buffer.compare(back, testBytes(size, v)) === 0);
    assert.ok(match !== undefined, `chunk is neither version ${last} nor ${last + 1}; ${replay}`);
    t.diagnostic(`after the kill the chunk holds version ${match}`);
  });

  it('reports a damaged header clearly', async () => {
    const s = await FsChunkStore.open(dir());
    writeFileSync(s.pathOf('bad/short'), new Uint8Array(5));
    await assert.rejects(s.read('bad/short'), /chunk "bad\/short" is truncated or damaged .*shorter than its 16-byte header/);
    writeFileSync(s.pathOf('bad/magic'), new Uint8Array(40));
    await assert.rejects(s.read('bad/magic'), (e: unknown) => e instanceof ChunkStoreError && e.key === 'bad/magic' && /bad magic/.test(e.message));
  });

  it('maps ENOSPC / EDQUOT to StorageFullError', () => {
    assert.ok(isDiskFullError(Object.assign(new Error('no space'), { code: 'ENOSPC' })));
    assert.ok(isDiskFullError(Object.assign(new Error('quota'), { code: 'EDQUOT' })));
    assert.ok(!isDiskFullError(Object.assign(new Error('x'), { code: 'EACCES' })));
  });

  it('other I/O failures are ChunkStoreErrors naming the key and file', async () => {
    const d = dir();
    const s = await FsChunkStore.open(d);
    await s.write('k', testBytes(10));
    rmSync(d, { recursive: true }); // the directory vanished underneath the store (unmounted, deleted)
    await assert.rejects(s.write('k', testBytes(20)), (e: unknown) => {
      assert.ok(e instanceof ChunkStoreError, String(e));
      assert.equal(e.key, 'k');
      assert.match(e.message, /could not write chunk "k" \(.*k\.chunk\): ENOENT/);
      return true;
    });
    assert.equal(await s.read('k'), null);
    await assert.rejects(s.keys(), (e: unknown) => e instanceof ChunkStoreError && /could not list the chunk store .*ENOENT/.test(e.message));
  });

  it('StorageFullError from the simulated quota says which key and how much', async () => {
    const s = await FsChunkStore.open(dir(), { quotaBytes: 100 });
    await assert.rejects(
      s.write('run/opt/0001', testBytes(101)),
      (e: unknown) => e instanceof StorageFullError && /101 bytes for chunk "run\/opt\/0001"/.test(e.message),
    );
    assert.deepEqual(readdirSync(s.dir), [], 'nothing was written, not even a temp file');
  });
});
