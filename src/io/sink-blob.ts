// A ByteSink that builds a Blob, for downloads in the browser (and tests in Node). Parts are folded into a
// Blob every `foldBytes`, so the page's JS heap holds at most that much: the browser keeps Blob data in its
// blob store, which spills large blobs to disk, so a multi-GiB export never sits in JS memory at once.
import type { ByteSink } from './safetensors.ts';

export interface BlobSink extends ByteSink {
  /** Bytes written so far. */
  readonly size: number;
  /** The finished Blob (after close). */
  blob(): Blob;
}

export function blobSink(type = 'application/octet-stream', foldBytes = 64 * 2 ** 20): BlobSink {
  let folded = new Blob([], { type });
  let parts: Uint8Array[] = [];
  let pending = 0;
  let size = 0;
  let closed = false;
  const fold = () => {
    folded = new Blob([folded, ...(parts as BlobPart[])], { type });
    parts = [];
    pending = 0;
  };
  return {
    get size() {
      return size;
    },
    async write(chunk) {
      if (closed) throw new Error('blob sink: write after close');
      // Copy: writers may reuse their buffers after write() resolves.
      parts.push(chunk.slice());
      pending += chunk.length;
      size += chunk.length;
      if (pending >= foldBytes) fold();
    },
    async close() {
      fold();
      closed = true;
    },
    blob() {
      if (!closed) throw new Error('blob sink: blob() before close()');
      return folded;
    },
  };
}
