// The page at `npm start`, built, in headless Chromium: the adapter panel renders and the kernel
// self-test (every case, f32 on SwiftShader) passes; without WebGPU the page says so clearly.
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import type { Browser } from 'playwright-core';
import { launch, screenshotPath, serve } from './browser.ts';

interface PageResult {
  family: string;
  name: string;
  dtype: string;
  pass: boolean;
  error?: string;
  ms: number;
  checks: { label: string; pass: boolean; maxAbs: number }[];
}

describe('page in headless Chromium', () => {
  let server: Awaited<ReturnType<typeof serve>>;
  before(async () => {
    server = await serve();
  });
  after(async () => server?.close());

  it('shows the adapter and passes the kernel self-test (f32 on SwiftShader)', { timeout: 40 * 60_000 }, async (t) => {
    const browser: Browser = await launch(true);
    try {
      const page = await browser.newPage({ viewport: { width: 1280, height: 800 } });
      page.on('console', (m) => m.type() === 'error' && t.diagnostic(`console: ${m.text()}`));
      await page.goto(`${server.url}/?autorun=1`);
      await page.getByTestId('adapter').waitFor({ timeout: 60_000 });
      await page.screenshot({ path: screenshotPath('adapter.png') });
      await page.waitForFunction(() => window.__selftest?.done === true, null, { timeout: 39 * 60_000, polling: 1000 });
      const results = (await page.evaluate(() => window.__selftest!.results)) as PageResult[];
      await page.screenshot({ path: screenshotPath('selftest.png'), fullPage: true });
      const byFamily = new Map<string, number>();
      for (const r of results) byFamily.set(r.family, (byFamily.get(r.family) ?? 0) + r.ms);
      t.diagnostic(`per-family ms: ${[...byFamily].map(([f, ms]) => `${f}=${ms.toFixed(0)}`).join(' ')}`);
      assert.ok(results.length > 0, 'the self-test ran no case');
      assert.ok(
        results.every((r) => r.dtype === 'f32'),
        'SwiftShader has no shader-f16: only f32 cases may run',
      );
      const failed = results.filter((r) => !r.pass);
      assert.equal(
        failed.length,
        0,
        failed.map((r) => `${r.family}/${r.name} [${r.dtype}]: ${r.error ?? JSON.stringify(r.checks.filter((c) => !c.pass))}`).join('\n'),
      );
      const status = await page.getByTestId('selftest-status').textContent();
      assert.match(status ?? '', /All \d+ kernel checks passed/);
      assert.ok(await page.getByTestId('no-f16').isVisible(), 'the no-shader-f16 notice is shown');
    } finally {
      await browser.close();
    }
  });

  it('without WebGPU the page explains what is missing', { timeout: 120_000 }, async () => {
    const browser = await launch(false);
    try {
      const page = await browser.newPage({ viewport: { width: 1280, height: 800 } });
      await page.goto(server.url);
      const alert = page.getByRole('alert');
      await alert.waitFor({ timeout: 60_000 });
      assert.match((await alert.textContent()) ?? '', /WebGPU is not available.*Chrome/s);
      await page.screenshot({ path: screenshotPath('no-webgpu.png') });
    } finally {
      await browser.close();
    }
  });
});
