// Node host: a file read at offsets through a file handle.
import { statSync } from 'node:fs';
import { open, type FileHandle } from 'node:fs/promises';
import { basename } from 'node:path';
import { SourceRangeError, type ByteSource } from './source.ts';

/**
 * Refuses an input that is not a regular file (after links): opening a FIFO blocks until something writes to
 * it, for ever and deaf to signals, and a device streams without end. A missing file is left to the caller.
 */
export function needRegularFile(path: string): void {
  let st;
  try {
    st = statSync(path);
  } catch {
    return;
  }
  if (st.isFile()) return;
  const kind = st.isDirectory()
    ? 'a folder'
    : st.isFIFO()
      ? 'a FIFO (named pipe)'
      : st.isCharacterDevice() || st.isBlockDevice()
        ? 'a device'
        : st.isSocket()
          ? 'a socket'
          : 'not a regular file';
  throw new Error(`${path} is ${kind}: models, configs and inputs are read from regular files only; give the file itself`);
}

export class NodeFileSource implements ByteSource {
  private constructor(
    private readonly fh: FileHandle,
    readonly size: number,
    readonly name: string,
  ) {}

  static async open(path: string): Promise<NodeFileSource> {
    needRegularFile(path);
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
