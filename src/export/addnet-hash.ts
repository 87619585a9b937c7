// The LoRA hashes A1111 uses to name a LoRA in an image's "Lora hashes" and to find it again, as
// sd-webui-additional-networks (scripts/safetensors_hack.py) and A1111's modules/hashes.py compute them, and
// as kohya sd-scripts precalculates them into the metadata (sshs_model_hash, sshs_legacy_hash):
//   model hash  = SHA-256 (hex, 64) of the file's bytes after the header: from 8 + n (n = the header's
//                 little-endian u64 length prefix) to the end, i.e. the tensor data alone, so that editing
//                 the metadata does not change it. A1111 shows its first 12 hex digits (network.shorthash).
//   legacy hash = the first 8 hex digits of SHA-256 of the 0x10000 bytes at file offset 0x100000 (the old
//                 webui model_hash; fewer bytes when the file is shorter, none: the hash of nothing).
// Both are computed over the file exactly as it is written, the two hash values standing in the header as
// fixed-length placeholders first: the header's length, and so every byte at or after it, is the same
// once the real values replace them. (kohya hashes a copy holding only its ss_* metadata instead, whose
// legacy hash therefore need not match the file it ships in; the file's own is what a loader recomputes.)
// A header reaching into the legacy window would make that hash depend on itself: refused (no LoRA header
// comes near 1 MiB).
import { sha256 } from '@noble/hashes/sha2';
import { ExportError } from './provider.ts';
import { headerBytes, safetensorsChunks, safetensorsSize, type OutTensor, type SizedChunks } from './stream.ts';

export const LEGACY_OFFSET = 0x100000;
export const LEGACY_LENGTH = 0x10000;

export interface AddnetHashes {
  sshs_model_hash: string;
  sshs_legacy_hash: string;
}

const PLACEHOLDERS: AddnetHashes = { sshs_model_hash: '0'.repeat(64), sshs_legacy_hash: '0'.repeat(8) };

const hex = (bytes: Uint8Array) => Array.from(bytes, (b) => b.toString(16).padStart(2, '0')).join('');

/**
 * The metadata to write with `tensors`: `metadata` plus sshs_model_hash and sshs_legacy_hash of the file
 * `safetensorsChunks(tensors, result)` produces. Reads every tensor once (the writer reads them again).
 */
export async function withAddnetHashes(tensors: readonly OutTensor[], metadata: Record<string, string>): Promise<Record<string, string>> {
  const placed = { ...metadata, ...PLACEHOLDERS };
  const headerLength = headerBytes(tensors, placed).length;
  if (headerLength > LEGACY_OFFSET)
    throw new ExportError(`the LoRA's safetensors header is ${headerLength} bytes, past the legacy hash's window at ${LEGACY_OFFSET}: shorten its metadata`);
  const model = sha256.create();
  const legacy = sha256.create();
  let at = 0;
  for await (const chunk of safetensorsChunks(tensors, placed)) {
    const end = at + chunk.length;
    if (at >= headerLength) model.update(chunk);
    const from = Math.max(at, LEGACY_OFFSET);
    const to = Math.min(end, LEGACY_OFFSET + LEGACY_LENGTH);
    if (from < to) legacy.update(chunk.subarray(from - at, to - at));
    at = end;
  }
  return { ...metadata, sshs_model_hash: hex(model.digest()), sshs_legacy_hash: hex(legacy.digest()).slice(0, 8) };
}

async function* hashedChunks(tensors: readonly OutTensor[], metadata: Record<string, string>): AsyncGenerator<Uint8Array> {
  yield* safetensorsChunks(tensors, await withAddnetHashes(tensors, metadata));
}

/**
 * safetensorsChunks with the sshs_* hashes in the metadata: a failure while hashing (a non-finite value)
 * rejects the first pull, so pump aborts the sink as for any failed export. The size is known up front
 * (the hashes have fixed lengths).
 */
export function hashedSafetensorsChunks(tensors: readonly OutTensor[], metadata: Record<string, string>): SizedChunks {
  const size = () => safetensorsSize(tensors, { ...metadata, ...PLACEHOLDERS });
  return Object.defineProperty(hashedChunks(tensors, metadata), 'totalBytes', { get: size }) as SizedChunks;
}

/** sshs_model_hash of a file holding `tensors` (in this order), whatever its metadata: for "Lora hashes" before any export. */
export async function addnetModelHash(tensors: readonly OutTensor[]): Promise<string> {
  return (await withAddnetHashes(tensors, {})).sshs_model_hash;
}

/** A1111's short hash of a LoRA (extensions-builtin/Lora/network.py shorthash): the model hash's first 12 hex digits. */
export const shortHash = (modelHash: string) => modelHash.slice(0, 12);
