// The demo model the studio ships (public/demo-model/): the page's loader (fetchShippedDemo, the same code
// the worker runs, here over a fetch that reads the repository's public/ folder) checks every file against
// the manifest and hands the engine a folder it loads; a file the server lost, cut short or altered is refused
// by name; the model stays under the 20 MB the page may download and holds fp16 weights only.
import assert from 'node:assert/strict';
import { existsSync, readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { describe, it } from 'node:test';
import { fileURLToPath } from 'node:url';
import { readSafetensors } from '../../src/io/safetensors.ts';
import { BytesSource, type ByteSource } from '../../src/io/source.ts';
import { loadDiffusers } from '../../src/models/load.ts';
import { fetchShippedDemo, SHIPPED_DEMO_DIR, ShippedDemoError } from '../../src/models/shipped-demo.ts';
import { folderFromSources } from '../../src/models/source.ts';
import { testGpu } from '../helpers.ts';

const PUBLIC = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'public');

/** A server for public/: 404 for what is not there; `alter` rewrites one file's bytes on the way. */
function publicFetch(alter?: { path: string; bytes: (b: Uint8Array) => Uint8Array }): typeof fetch {
  return (async (url: string | URL) => {
    const path = String(url).replace(/^\//, '');
    const file = join(PUBLIC, path);
    if (!existsSync(file)) return new Response('not found', { status: 404 });
    let bytes = new Uint8Array(readFileSync(file));
    if (alter && path === `${SHIPPED_DEMO_DIR}/${alter.path}`) bytes = alter.bytes(bytes).slice();
    return new Response(bytes);
  }) as typeof fetch;
}

describe('the shipped demo model (public/demo-model)', () => {
  it('loads through the page loader: every file checked, under 20 MB, fp16, at its manifest resolution', async () => {
    let last = 0;
    const { manifest, files } = await fetchShippedDemo('/', { fetch: publicFetch(), onProgress: (loaded) => (last = loaded) });
    const total = [...files.values()].reduce((a, b) => a + b.length, 0);
    assert.equal(last, total, 'progress reaches the total');
    assert.ok(total <= 20e6, `${total} bytes: the page downloads at most 20 MB`);
    for (const p of ['unet/diffusion_pytorch_model.safetensors', 'vae/diffusion_pytorch_model.safetensors', 'text_encoder/model.safetensors']) {
      const bytes = files.get(p)!;
      assert.ok(readSafetensors(bytes).tensors.size > 0, p);
      // Every tensor's dtype in the header (the reader widens f16 to f32, so the header is where it shows).
      const headerLength = Number(new DataView(bytes.buffer, bytes.byteOffset).getBigUint64(0, true));
      const header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + headerLength))) as Record<string, { dtype: string }>;
      for (const [name, e] of Object.entries(header)) if (name !== '__metadata__') assert.equal(e.dtype, 'F16', `${p} ${name}`);
    }
    assert.ok(files.has('tokenizer/vocab.json') && files.has('tokenizer/merges.txt'), 'the tokenizer ships with it');
    const vae = JSON.parse(new TextDecoder().decode(files.get('vae/config.json')!)) as { sample_size: number; scaling_factor: number };
    assert.equal(vae.sample_size, manifest.resolution);
    const gpu = await testGpu();
    const model = await loadDiffusers(
      gpu,
      folderFromSources(manifest.name, new Map<string, ByteSource>([...files].map(([p, b]) => [p, new BytesSource(b, p)]))),
      {
        dtype: 'f32',
      },
    );
    assert.equal(model.vae.config.scalingFactor, vae.scaling_factor);
    assert.notEqual(vae.scaling_factor, 1, 'the latent scale was measured in pretraining');
  });

  it('refuses a file that is missing, cut short or altered, naming it', async () => {
    const unet = 'unet/diffusion_pytorch_model.safetensors';
    const cases: [Parameters<typeof publicFetch>[0], RegExp][] = [
      [
        { path: unet, bytes: (b) => b.subarray(0, b.length - 1) },
        /demo model's unet\/diffusion_pytorch_model\.safetensors is \d+ bytes, not the \d+ its manifest says/,
      ],
      [
        {
          path: unet,
          bytes: (b) => {
            const c = b.slice();
            c[c.length >> 1] ^= 1;
            return c;
          },
        },
        /demo model's unet\/diffusion_pytorch_model\.safetensors does not match its manifest's SHA-256/,
      ],
      [{ path: 'manifest.json', bytes: () => new TextEncoder().encode('<!doctype html>') }, /demo model's manifest\.json is not JSON/],
      [{ path: 'manifest.json', bytes: () => new TextEncoder().encode('{"name":"x","resolution":64,"files":[]}') }, /manifest\.json: no "files"/],
    ];
    for (const [alter, message] of cases)
      await assert.rejects(fetchShippedDemo('/', { fetch: publicFetch(alter) }), (e: Error) => e instanceof ShippedDemoError && message.test(e.message));
    await assert.rejects(
      fetchShippedDemo('/nowhere/', { fetch: publicFetch() }),
      /demo model's manifest\.json is missing from this page's server \(HTTP 404\)/,
    );
  });
});
