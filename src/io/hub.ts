// Model-hub downloads in the diffusers layout: `${endpoint}/${repo}/resolve/${revision}/${path}` (the
// HF_ENDPOINT convention), streamed with progress, resumed with HTTP Range after an interruption, and
// kept in a cache so a second load downloads nothing. A file becomes visible in the cache only once
// complete (the partial bytes live under a separate key until then).
import type { ByteSource } from './source.ts';

export interface DownloadCache {
  /** Bytes of `key` downloaded so far but not yet complete (0 if none). */
  partialSize(key: string): Promise<number>;
  appendPartial(key: string, chunk: Uint8Array): Promise<void>;
  dropPartial(key: string): Promise<void>;
  /** Makes the partial bytes the complete entry, atomically. */
  commit(key: string): Promise<void>;
  /** The complete entry, or null. */
  open(key: string): Promise<ByteSource | null>;
}

export interface HubOptions {
  /** Default https://huggingface.co; HF_ENDPOINT in Node. */
  endpoint?: string;
  revision?: string;
  token?: string;
  cache: DownloadCache;
  fetch?: typeof fetch;
  onProgress?: (p: { path: string; loaded: number; total: number | null }) => void;
  signal?: AbortSignal;
}

export class HubError extends Error {
  override name = 'HubError';
  constructor(
    message: string,
    readonly status?: number,
  ) {
    super(message);
  }
}

function url(repo: string, path: string, o: HubOptions): string {
  const endpoint = (o.endpoint ?? 'https://huggingface.co').replace(/\/+$/, '');
  return `${endpoint}/${repo}/resolve/${encodeURIComponent(o.revision ?? 'main')}/${path.split('/').map(encodeURIComponent).join('/')}`;
}

/** Downloads one file of a repo into the cache (resuming a partial one) and returns it. */
export async function downloadFile(repo: string, path: string, o: HubOptions): Promise<ByteSource> {
  const key = `${repo}@${o.revision ?? 'main'}/${path}`;
  const cached = await o.cache.open(key);
  if (cached) return cached;
  const doFetch = o.fetch ?? fetch;
  let have = await o.cache.partialSize(key);
  const headers: Record<string, string> = {};
  if (o.token) headers.authorization = `Bearer ${o.token}`;
  if (have > 0) headers.range = `bytes=${have}-`;
  const res = await doFetch(url(repo, path, o), { headers, signal: o.signal });
  if (res.status === 404) throw new HubError(`${repo}: ${path} not found on the hub (revision ${o.revision ?? 'main'})`, 404);
  if (res.status === 401 || res.status === 403)
    throw new HubError(`${repo}: access to ${path} was refused (${res.status}): the repo may be gated or need a token`, res.status);
  if (res.status === 416 && have > 0) {
    // Our partial copy is as long as the file (or longer): start again.
    await o.cache.dropPartial(key);
    return downloadFile(repo, path, o);
  }
  if (res.status !== 200 && res.status !== 206) throw new HubError(`${repo}: downloading ${path} failed with HTTP ${res.status}`, res.status);
  // A server may ignore the range (200), or answer a range we did not ask for: then take the whole file.
  const range = res.headers.get('content-range');
  const rangeStart = range ? Number(/^bytes (\d+)-/.exec(range)?.[1]) : NaN;
  if (have > 0 && (res.status === 200 || rangeStart !== have)) {
    await o.cache.dropPartial(key);
    if (res.status === 206) {
      await res.body?.cancel();
      return downloadFile(repo, path, o);
    }
    have = 0;
  }
  // With a content encoding (gzip'd JSON from some servers) fetch hands us decoded bytes while
  // Content-Length counts encoded ones: the total is unknown then, and partial bytes cannot be resumed.
  const encoded = !!res.headers.get('content-encoding') && res.headers.get('content-encoding') !== 'identity';
  let total: number | null = null;
  if (res.status === 206 && range) total = Number(range.split('/')[1]) || null;
  else if (res.headers.get('content-length') && !encoded) total = have + Number(res.headers.get('content-length'));
  if (!res.body) throw new HubError(`${repo}: ${path}: empty response`);
  const reader = res.body.getReader();
  let loaded = have;
  o.onProgress?.({ path, loaded, total });
  try {
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      await o.cache.appendPartial(key, value);
      loaded += value.length;
      o.onProgress?.({ path, loaded, total });
    }
  } catch (e) {
    if (encoded) await o.cache.dropPartial(key);
    if (o.signal?.aborted) throw e;
    throw new HubError(
      `${repo}: ${path}: the download broke off at ${loaded}${total ? ` of ${total}` : ''} bytes (${(e as Error).message}); ${encoded ? 'it starts again' : 'it resumes from there'} next time`,
    );
  }
  if (total !== null && loaded !== total)
    throw new HubError(`${repo}: ${path}: download ended at ${loaded} of ${total} bytes; it resumes from there next time`);
  await o.cache.commit(key);
  const done = await o.cache.open(key);
  if (!done) throw new HubError(`${repo}: ${path}: the cache lost the file after writing it`);
  return done;
}

async function tryDownload(repo: string, path: string, o: HubOptions): Promise<ByteSource | null> {
  try {
    return await downloadFile(repo, path, o);
  } catch (e) {
    if (e instanceof HubError && e.status === 404) return null;
    throw e;
  }
}

async function json(src: ByteSource): Promise<Record<string, unknown>> {
  return JSON.parse(new TextDecoder().decode(await src.read(0, src.size)));
}

export interface DownloadedModel {
  repo: string;
  /** Relative path -> cached file. */
  files: Map<string, ByteSource>;
}

/**
 * Fetches a diffusers-layout SD repo: model_index.json, each component's config, tokenizer files and
 * weights (the fp16 safetensors variant where the repo has it, else the full one).
 */
export async function downloadDiffusersModel(repo: string, o: HubOptions): Promise<DownloadedModel> {
  // A finished download leaves a manifest of the files it chose: a later load opens them from the
  // cache without a single request.
  const manifestKey = `${repo}@${o.revision ?? 'main'}/.dbs-manifest.json`;
  const manifest = await o.cache.open(manifestKey);
  if (manifest) {
    const paths = (await json(manifest)).files as string[];
    const files = new Map<string, ByteSource>();
    for (const p of paths) {
      const f = await o.cache.open(`${repo}@${o.revision ?? 'main'}/${p}`);
      if (!f) break;
      files.set(p, f);
    }
    if (files.size === paths.length) return { repo, files };
  }
  const files = new Map<string, ByteSource>();
  const index = await downloadFile(repo, 'model_index.json', o);
  files.set('model_index.json', index);
  const parts = await json(index);
  const want: [string, string[]][] = [
    ['scheduler/scheduler_config.json', []],
    ['unet/config.json', []],
    ['vae/config.json', []],
    ['text_encoder/config.json', []],
    ['unet/diffusion_pytorch_model.fp16.safetensors', ['unet/diffusion_pytorch_model.safetensors']],
    ['vae/diffusion_pytorch_model.fp16.safetensors', ['vae/diffusion_pytorch_model.safetensors']],
    ['text_encoder/model.fp16.safetensors', ['text_encoder/model.safetensors']],
  ];
  for (const c of ['unet', 'vae', 'text_encoder', 'scheduler'])
    if (!(c in parts)) throw new HubError(`${repo}: model_index.json lists no ${c}: not a Stable Diffusion pipeline`);
  // SDXL: a second text encoder (CLIPTextModelWithProjection) and its tokenizer.
  const second = 'text_encoder_2' in parts;
  if (second) want.push(['text_encoder_2/config.json', []], ['text_encoder_2/model.fp16.safetensors', ['text_encoder_2/model.safetensors']]);
  for (const [first, fallbacks] of want) {
    let got: ByteSource | null = null;
    let name = first;
    for (const p of [first, ...fallbacks]) {
      got = await tryDownload(repo, p, o);
      name = p;
      if (got) break;
    }
    if (!got) throw new HubError(`${repo}: ${[first, ...fallbacks].join(' or ')} not found`, 404);
    files.set(name, got);
  }
  // Tokenizer (and SDXL's tokenizer_2): tokenizer.json when present, else CLIPTokenizer's vocab + merges; configs optional.
  for (const t of second ? ['tokenizer', 'tokenizer_2'] : ['tokenizer']) {
    const tj = await tryDownload(repo, `${t}/tokenizer.json`, o);
    if (tj) files.set(`${t}/tokenizer.json`, tj);
    else
      for (const p of [`${t}/vocab.json`, `${t}/merges.txt`]) {
        const f = await tryDownload(repo, p, o);
        if (!f) throw new HubError(`${repo}: ${p} not found (and no ${t}/tokenizer.json)`, 404);
        files.set(p, f);
      }
    for (const p of [`${t}/tokenizer_config.json`, `${t}/special_tokens_map.json`]) {
      const f = await tryDownload(repo, p, o);
      if (f) files.set(p, f);
    }
  }
  await o.cache.dropPartial(manifestKey);
  await o.cache.appendPartial(manifestKey, new TextEncoder().encode(JSON.stringify({ files: [...files.keys()] })));
  await o.cache.commit(manifestKey);
  return { repo, files };
}
