// Node host: a file as a ByteSink (written sequentially, closed at the end).
import { open } from 'node:fs/promises';
import type { ByteSink } from './safetensors.ts';

export async function nodeFileSink(path: string): Promise<ByteSink> {
  const fh = await open(path, 'w');
  return {
    async write(chunk) {
      let done = 0;
      while (done < chunk.length) done += (await fh.write(chunk, done, chunk.length - done)).bytesWritten;
    },
    close: () => fh.close(),
  };
}
