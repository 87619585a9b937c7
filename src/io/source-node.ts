// Node host: a file read at offsets through a file handle.
import { open, type FileHandle } from 'node:fs/promises';
import { basename } from 'node:path';
import { SourceRangeError, type ByteSource } from './source.ts';

export class NodeFileSource implements ByteSource {
  private constructor(
    private readonly fh: FileHandle,
    readonly size: number,
    readonly name: string,
  ) {}

  static async open(path: string): Promise<NodeFileSource> {
    const fh = await open(path, 'r');
    const { size } = await fh.stat();
    return new NodeFileSource(fh, size, basename(path));
  }

  async read(offset: number, length: number): Promise<Uint8Array> {
    if (offset < 0 || length < 0 || offset + length > this.size)
      throw new SourceRangeError(`${this.name}: bytes [${offset}, ${offset + length}) lie outside the ${this.size}-byte file`);
    const out = new Uint8Array(length);
    let done = 0;
    while (done < length) {
      const { bytesRead } = await this.fh.read(out, done, length - done, offset + done);
      if (bytesRead === 0) throw new SourceRangeError(`${this.name}: file ended at ${offset + done} while reading`);
      done += bytesRead;
    }
    return out;
  }

  async close(): Promise<void> {
    await this.fh.close();
  }
}
