// Random-access byte sources for model files of several GB: a browser File/Blob or a Node file
// handle. Readers take slices on demand; nothing ever holds the whole file in one ArrayBuffer
// (Chrome caps one ArrayBuffer near 2 GB; SD checkpoints are 2-7 GB).

export interface ByteSource {
  /** A name for messages (the file name). */
  readonly name: string;
  readonly size: number;
  /** Bytes [offset, offset + length); throws if the range leaves the source. */
  read(offset: number, length: number): Promise<Uint8Array>;
  close?(): Promise<void>;
}

export class SourceRangeError extends Error {
  override name = 'SourceRangeError';
}

function checkRange(src: { name: string; size: number }, offset: number, length: number): void {
  if (!Number.isInteger(offset) || !Number.isInteger(length) || offset < 0 || length < 0 || offset + length > src.size)
    throw new SourceRangeError(`${src.name}: bytes [${offset}, ${offset + length}) lie outside the ${src.size}-byte file`);
}

/** A File or Blob (browser; also Node's Blob). */
export class BlobSource implements ByteSource {
  readonly size: number;
  constructor(
    private readonly blob: Blob,
    readonly name = (blob as File).name ?? 'blob',
  ) {
    this.size = blob.size;
  }
  async read(offset: number, length: number): Promise<Uint8Array> {
    checkRange(this, offset, length);
    return new Uint8Array(await this.blob.slice(offset, offset + length).arrayBuffer());
  }
}

/** An in-memory byte array (tests, small downloaded files). */
export class BytesSource implements ByteSource {
  readonly size: number;
  constructor(
    private readonly bytes: Uint8Array,
    readonly name = 'bytes',
  ) {
    this.size = bytes.length;
  }
  async read(offset: number, length: number): Promise<Uint8Array> {
    checkRange(this, offset, length);
    return this.bytes.subarray(offset, offset + length);
  }
}
