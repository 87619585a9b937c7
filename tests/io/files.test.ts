// The Node file sink every CLI export writes through: bytes go to `<name>.partial` and are renamed to the
// final name only when complete; a full disk, a read-only folder or a permission problem is a message
// naming the folder, the file and what to do; a failed export leaves neither the final file nor the temp
// file, and an older file at the final name is untouched. The failing disk is real node:fs behind a small
// fault-injecting FileOps (the sink's own seam), since a tiny full tmpfs cannot be mounted here.
import assert from 'node:assert/strict';
import { chmodSync, existsSync, mkdtempSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { pipeToSink, pump, safetensorsChunks, safetensorsSize, type OutTensor } from '../../src/export/stream.ts';
import { nodeFileOps, nodeFileSink, partialPath, type FileOps } from '../../src/io/sink-node.ts';

const dir = () => mkdtempSync(join(tmpdir(), 'dbs-files-'));
const errno = (code: string, syscall: string) => Object.assign(new Error(`${code}: simulated, ${syscall}`), { code, syscall });

/** Real node:fs, except that writes past `capacity` bytes (over all files) fail like a full disk. */
function smallDisk(capacity: number, code = 'ENOSPC'): FileOps {
  let used = 0;
  return {
    ...nodeFileOps,
    async open(path, flags) {
      const fh = await nodeFileOps.open(path, flags);
      return {
        async write(buf, off, len) {
          const room = capacity - used;
          if (room <= 0) throw errno(code, 'write');
          const n = Math.min(room, len);
          used += n;
          return fh.write(buf, off, n); // a short write, as a real disk gives just before it is full
        },
        sync: () => fh.sync(),
        close: () => fh.close(),
      };
    },
  };
}

const MIB = 2 ** 20;
const tensors: OutTensor[] = [0, 1, 2].map((i) => ({ name: `t${i}`, dtype: 'F32', shape: [MIB / 4], data: async () => new Float32Array(MIB / 4).fill(i) }));

describe('nodeFileSink: temp file, then rename', () => {
  it('writes <name>.partial while the export runs; the final name appears only once it is complete', async () => {
    const d = dir();
    const path = join(d, 'model.safetensors');
    const sink = await nodeFileSink(path);
    await sink.write(new TextEncoder().encode('hello '));
    assert.deepEqual(readdirSync(d), ['model.safetensors.partial']);
    assert.equal(partialPath(path), join(d, 'model.safetensors.partial'));
    await sink.write(new TextEncoder().encode('world'));
    await sink.close();
    assert.deepEqual(readdirSync(d), ['model.safetensors']);
    assert.equal(readFileSync(path, 'utf8'), 'hello world');
    await assert.rejects(sink.write(new Uint8Array(1)), /write after the file was closed/);
  });

  it('replaces an older file only at the end; abort() removes the temp file and keeps the older one', async () => {
    const d = dir();
    const path = join(d, 'lora.safetensors');
    writeFileSync(path, 'old');
    const sink = await nodeFileSink(path);
    await sink.write(new Uint8Array(10));
    assert.equal(readFileSync(path, 'utf8'), 'old', 'untouched while the new one is written');
    await sink.abort();
    await sink.abort(); // twice is harmless
    assert.deepEqual(readdirSync(d), ['lora.safetensors']);
    assert.equal(readFileSync(path, 'utf8'), 'old');
    await assert.rejects(sink.close(), /close after the file was abandoned/);
    const again = await nodeFileSink(path);
    await again.write(new TextEncoder().encode('new'));
    await again.close();
    assert.equal(readFileSync(path, 'utf8'), 'new');
  });
});

describe('nodeFileSink: a full disk', () => {
  it('a safetensors export that does not fit: the message says the folder, the file and the size needed; nothing is left', async () => {
    const d = dir();
    const path = join(d, 'model.safetensors');
    writeFileSync(path, 'previous model');
    const size = safetensorsSize(tensors);
    await assert.rejects(pump(safetensorsChunks(tensors), await nodeFileSink(path, smallDisk(1.5 * MIB))), (e: Error) => {
      assert.equal(
        e.message,
        `${d}: the disk is full (ENOSPC) while writing model.safetensors: it needs ${Math.ceil(size / MIB)} MiB, free at least that much there or choose another --out folder (the incomplete file was removed)`,
      );
      assert.equal((e.cause as NodeJS.ErrnoException).code, 'ENOSPC');
      return true;
    });
    assert.deepEqual(readdirSync(d), ['model.safetensors'], 'no temp file');
    assert.equal(readFileSync(path, 'utf8'), 'previous model');
  });

  it('a stream of unknown length (the diffusers zip) says how far it got; a quota is reported as such', async () => {
    const d = dir();
    const chunks = new ReadableStream<Uint8Array>({
      pull: (c) => c.enqueue(new Uint8Array(MIB)), // endless: only the disk stops it
    });
    await assert.rejects(pipeToSink(chunks, await nodeFileSink(join(d, 'model-diffusers.zip'), smallDisk(3 * MIB))), {
      message: `${d}: the disk is full (ENOSPC) while writing model-diffusers.zip: it filled up after 3 MiB, free more than that there or choose another --out folder (the incomplete file was removed)`,
    });
    assert.deepEqual(readdirSync(d), []);
    const quota = await nodeFileSink(join(d, 'x.safetensors'), smallDisk(0, 'EDQUOT'));
    await assert.rejects(quota.write(new Uint8Array(8)), /the disk quota is used up \(EDQUOT\) while writing x\.safetensors/);
    assert.deepEqual(readdirSync(d), []);
  });

  it('a failure at fsync (delayed allocation, network disks) is reported the same and cleaned up', async () => {
    const d = dir();
    const ops: FileOps = {
      ...nodeFileOps,
      async open(path, flags) {
        const fh = await nodeFileOps.open(path, flags);
        return { write: (b, o, l) => fh.write(b, o, l), sync: async () => Promise.reject(errno('ENOSPC', 'fsync')), close: () => fh.close() };
      },
    };
    const sink = await nodeFileSink(join(d, 'a.bin'), ops);
    await sink.write(new Uint8Array(100));
    await assert.rejects(sink.close(), /: the disk is full \(ENOSPC\) while writing a\.bin/);
    assert.deepEqual(readdirSync(d), []);
  });
});

describe('nodeFileSink: folders that cannot be written', () => {
  it('read-only file system (EROFS) and a missing folder: refused at open, naming the folder', async () => {
    const d = dir();
    const readOnly: FileOps = { ...nodeFileOps, open: async () => Promise.reject(errno('EROFS', 'open')) };
    await assert.rejects(nodeFileSink(join(d, 'model.safetensors'), readOnly), {
      message: `${d}: read-only folder (EROFS), cannot write model.safetensors: choose another --out folder on a writable disk`,
    });
    await assert.rejects(nodeFileSink(join(d, 'missing', 'model.safetensors')), {
      message: `${join(d, 'missing')}: no such folder, cannot write model.safetensors: create it first or choose another --out folder`,
    });
  });

  it('a folder without write permission (EACCES): chmod where that binds, else the same error injected', async () => {
    const d = dir();
    // root ignores permission bits, so there the kernel's EACCES is injected instead of provoked.
    const asRoot = process.getuid?.() === 0;
    if (!asRoot) chmodSync(d, 0o555);
    const ops: FileOps = asRoot ? { ...nodeFileOps, open: async () => Promise.reject(errno('EACCES', 'open')) } : nodeFileOps;
    try {
      await assert.rejects(nodeFileSink(join(d, 'lora.safetensors'), ops), {
        message: `${d}: no permission to write lora.safetensors there (EACCES): choose another --out folder, or make this one writable (chmod u+w)`,
      });
    } finally {
      chmodSync(d, 0o755);
    }
    assert.equal(existsSync(join(d, 'lora.safetensors.partial')), false);
  });

  it('a failed rename keeps the older file and removes the temp file', async () => {
    const d = dir();
    const path = join(d, 'model.safetensors');
    writeFileSync(path, 'old');
    const ops: FileOps = { ...nodeFileOps, rename: async () => Promise.reject(errno('EACCES', 'rename')) };
    const sink = await nodeFileSink(path, ops);
    await sink.write(new Uint8Array(4));
    await assert.rejects(sink.close(), /no permission to write model\.safetensors there/);
    assert.deepEqual(readdirSync(d), ['model.safetensors']);
    assert.equal(readFileSync(path, 'utf8'), 'old');
  });
});
