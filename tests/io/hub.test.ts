// Hub downloads against a local HTTP server on 127.0.0.1 that serves a tiny diffusers repo with Range
// support: progress, fp16-variant preference with fallback, resume after an interrupted transfer, and a
// second load that sends no request at all.
import assert from 'node:assert/strict';
import { mkdtempSync } from 'node:fs';
import { createServer, type Server } from 'node:http';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { gzipSync } from 'node:zlib';
import { after, before, describe, it } from 'node:test';
import { nodeDownloadCache } from '../../src/io/cache-node.ts';
import { downloadDiffusersModel, downloadFile, HubError } from '../../src/io/hub.ts';
import { writeSafetensors } from '../../src/io/safetensors.ts';

const big = writeSafetensors(new Map([['w', { shape: [256, 256], data: Float32Array.from({ length: 65536 }, (_, i) => i % 97) }]]));
const repoFiles: Record<string, Uint8Array> = {
  'model_index.json': new TextEncoder().encode(
    JSON.stringify({
      _class_name: 'StableDiffusionPipeline',
      unet: ['diffusers', 'UNet2DConditionModel'],
      vae: [],
      text_encoder: [],
      tokenizer: [],
      scheduler: [],
    }),
  ),
  'scheduler/scheduler_config.json': new TextEncoder().encode('{"prediction_type":"epsilon"}'),
  'unet/config.json': new TextEncoder().encode('{"cross_attention_dim":768}'),
  'vae/config.json': new TextEncoder().encode('{}'),
  'text_encoder/config.json': new TextEncoder().encode('{}'),
  'unet/diffusion_pytorch_model.fp16.safetensors': big,
  'vae/diffusion_pytorch_model.safetensors': big.slice(), // no fp16 variant: fallback
  'text_encoder/model.fp16.safetensors': big.slice(),
  'tokenizer/vocab.json': new TextEncoder().encode('{"a":0}'),
  'tokenizer/merges.txt': new TextEncoder().encode('#version: 0.2\n'),
};

repoFiles['config.gz.json'] = new TextEncoder().encode(JSON.stringify({ note: 'served gzip-encoded', pad: 'x'.repeat(4000) }));

let requests: string[] = [];
/** How the server answers a Range request for a path: honour it (default), ignore it (200), or start elsewhere. */
const rangeMode = new Map<string, 'ignore' | 'wrong-start'>();
/** Cut the next response for this path after this many bytes (a dropped connection). */
const cutAfter = new Map<string, number>();

function startServer(): Promise<{ server: Server; endpoint: string }> {
  const server = createServer((req, res) => {
    const m = /^\/org\/tiny-sd\/resolve\/main\/(.+)$/.exec(req.url ?? '');
    const path = m ? decodeURIComponent(m[1]) : '';
    requests.push(`${path}${req.headers.range ? ` ${req.headers.range}` : ''}`);
    const body = repoFiles[path];
    if (!body) {
      res.writeHead(404).end();
      return;
    }
    if (path === 'config.gz.json') {
      const gz = gzipSync(body);
      res.writeHead(200, { 'content-encoding': 'gzip', 'content-length': gz.length, 'content-type': 'application/json' }).end(gz);
      return;
    }
    let start = 0;
    let r = /^bytes=(\d+)-$/.exec(req.headers.range ?? '');
    if (r && rangeMode.get(path) === 'ignore') r = null;
    if (r) start = rangeMode.get(path) === 'wrong-start' ? 0 : Number(r[1]);
    const slice = body.subarray(start);
    const headers: Record<string, string | number> = { 'content-length': slice.length, 'accept-ranges': 'bytes' };
    if (r) headers['content-range'] = `bytes ${start}-${body.length - 1}/${body.length}`;
    res.writeHead(r ? 206 : 200, headers);
    const cut = cutAfter.get(path);
    if (cut !== undefined) {
      cutAfter.delete(path);
      res.write(slice.subarray(0, cut), () => res.destroy());
      return;
    }
    res.end(slice);
  });
  return new Promise((resolve) =>
    server.listen(0, '127.0.0.1', () => resolve({ server, endpoint: `http://127.0.0.1:${(server.address() as { port: number }).port}` })),
  );
}

describe('hub download', () => {
  let srv: { server: Server; endpoint: string };
  before(async () => (srv = await startServer()));
  after(() => srv.server.close());

  it('downloads a diffusers repo with progress, preferring fp16 weights, and a second load sends nothing', async () => {
    const cache = nodeDownloadCache(mkdtempSync(join(tmpdir(), 'dbs-hub-')));
    requests = [];
    const progress: number[] = [];
    const m = await downloadDiffusersModel('org/tiny-sd', {
      endpoint: srv.endpoint,
      cache,
      onProgress: (p) => p.path.startsWith('unet/diffusion') && progress.push(p.loaded),
    });
    assert.ok(m.files.has('unet/diffusion_pytorch_model.fp16.safetensors'));
    assert.ok(m.files.has('vae/diffusion_pytorch_model.safetensors'), 'falls back to the full-precision file');
    assert.ok(m.files.has('tokenizer/vocab.json') && m.files.has('tokenizer/merges.txt'));
    assert.equal(progress.at(-1), big.length);
    const unet = m.files.get('unet/diffusion_pytorch_model.fp16.safetensors')!;
    assert.deepEqual(await unet.read(0, unet.size), big);
    assert.ok(requests.includes('vae/diffusion_pytorch_model.fp16.safetensors'), 'asked for the fp16 variant first');
    requests = [];
    const again = await downloadDiffusersModel('org/tiny-sd', { endpoint: srv.endpoint, cache });
    assert.equal(again.files.size, m.files.size);
    assert.deepEqual(requests, [], 'the second load is served from the cache alone');
  });

  it('resumes an interrupted download with a Range request', async () => {
    const cache = nodeDownloadCache(mkdtempSync(join(tmpdir(), 'dbs-hub-')));
    const path = 'unet/diffusion_pytorch_model.fp16.safetensors';
    cutAfter.set(path, 100_000);
    requests = [];
    await assert.rejects(downloadFile('org/tiny-sd', path, { endpoint: srv.endpoint, cache }));
    const partial = await cache.partialSize(`org/tiny-sd@main/${path}`);
    assert.ok(partial > 0 && partial <= 100_000 && partial < big.length, `kept ${partial} bytes`);
    assert.equal(await cache.open(`org/tiny-sd@main/${path}`), null, 'an incomplete file is never visible');
    const f = await downloadFile('org/tiny-sd', path, { endpoint: srv.endpoint, cache });
    assert.equal(requests.at(-1), `${path} bytes=${partial}-`);
    assert.deepEqual(await f.read(0, f.size), big);
  });

  it('a server that ignores the Range (200) or answers another range: the partial copy is dropped, the file is whole', async () => {
    const path = 'text_encoder/model.fp16.safetensors';
    for (const mode of ['ignore', 'wrong-start'] as const) {
      const cache = nodeDownloadCache(mkdtempSync(join(tmpdir(), 'dbs-hub-')));
      cutAfter.set(path, 70_000);
      await assert.rejects(
        downloadFile('org/tiny-sd', path, { endpoint: srv.endpoint, cache }),
        /broke off at \d+ of \d+ bytes .*it resumes from there next time/,
      );
      const partial = await cache.partialSize(`org/tiny-sd@main/${path}`);
      assert.ok(partial > 0, mode);
      rangeMode.set(path, mode);
      requests = [];
      const f = await downloadFile('org/tiny-sd', path, { endpoint: srv.endpoint, cache });
      rangeMode.delete(path);
      assert.equal(requests[0], `${path} bytes=${partial}-`, mode);
      assert.equal(requests.length, mode === 'ignore' ? 1 : 2, `${mode}: ${requests}`);
      assert.deepEqual(await f.read(0, f.size), big, mode);
    }
  });

  it('a gzip-encoded response: decoded bytes, no length check against the encoded Content-Length', async () => {
    const cache = nodeDownloadCache(mkdtempSync(join(tmpdir(), 'dbs-hub-')));
    const totals: (number | null)[] = [];
    const f = await downloadFile('org/tiny-sd', 'config.gz.json', { endpoint: srv.endpoint, cache, onProgress: (p) => totals.push(p.total) });
    assert.deepEqual(await f.read(0, f.size), repoFiles['config.gz.json']);
    assert.ok(
      totals.every((t) => t === null),
      'total unknown',
    );
  });

  it('a missing repo file is a clear 404', async () => {
    const cache = nodeDownloadCache(mkdtempSync(join(tmpdir(), 'dbs-hub-')));
    await assert.rejects(
      downloadFile('org/tiny-sd', 'nope.json', { endpoint: srv.endpoint, cache }),
      (e: Error) => e instanceof HubError && /org\/tiny-sd: nope\.json not found on the hub/.test(e.message),
    );
  });
});
