// The hub download in Chromium with the IndexedDB cache: a tiny diffusers repo served next to the page
// downloads once; after a reload (same profile) the second load sends no request to the hub.
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { launch, serveWithTinyHub } from './browser.ts';

describe('hub download with the IndexedDB cache (Chromium)', () => {
  let server: Awaited<ReturnType<typeof serveWithTinyHub>>;
  before(async () => (server = await serveWithTinyHub()));
  after(async () => server?.close());

  it('downloads once, then serves a reload from IndexedDB without a request', { timeout: 180_000 }, async () => {
    const browser = await launch(false);
    try {
      const context = await browser.newContext();
      const page = await context.newPage();
      const hubRequests: string[] = [];
      page.on('request', (r) => r.url().includes('/hub/') && hubRequests.push(r.url()));
      const run = async () => {
        await page.goto(`${server.url}/e2e/harness.html`);
        await page.waitForFunction(() => 'hubDownload' in ((window as unknown as { __harness?: object }).__harness ?? {}));
        return page.evaluate(
          (endpoint) =>
            (
              window as unknown as { __harness: { hubDownload: (e: string, r: string) => Promise<{ files: string[]; unetTensors: string[] }> } }
            ).__harness.hubDownload(endpoint, 'org/tiny-sd'),
          `${server.url}/hub`,
        );
      };
      const first = await run();
      assert.ok(first.files.includes('unet/diffusion_pytorch_model.safetensors'));
      assert.ok(first.files.includes('tokenizer/vocab.json'));
      assert.ok(first.unetTensors.includes('conv_in.weight'));
      assert.ok(hubRequests.some((u) => u.endsWith('unet/diffusion_pytorch_model.safetensors')));
      hubRequests.length = 0;
      const second = await run(); // a reload: new page state, same IndexedDB
      assert.deepEqual(second, first);
      assert.deepEqual(hubRequests, [], 'the second visit downloads nothing');
    } finally {
      await browser.close();
    }
  });
});
