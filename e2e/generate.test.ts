// Text to image from the page in headless Chromium (WebGPU on SwiftShader, f32): the tiny model is
// fetched from a hub served next to the page, loaded onto the GPU, sampled (saying the step of how many and the
// time left), and shown as an image; the kernel self-test on the same page shows its check of how many, the
// time left, and stops when asked.
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import type { Page } from 'playwright-core';
import { launch, screenshotPath, serveWithTinyHub } from './browser.ts';

/** Every text the element with `testId` shows from now on; the returned function reads them. */
async function recordTexts(page: Page, testId: string): Promise<() => Promise<string[]>> {
  await page.evaluate((id) => {
    const el = document.querySelector(`[data-testid="${id}"]`)!;
    const seen: string[] = [];
    (window as unknown as { __texts: string[] }).__texts = seen;
    new MutationObserver(() => seen.push(el.textContent ?? '')).observe(el, { childList: true, subtree: true, characterData: true });
  }, testId);
  return () => page.evaluate(() => (window as unknown as { __texts: string[] }).__texts);
}

describe('generate an image from the page (Chromium)', () => {
  let server: Awaited<ReturnType<typeof serveWithTinyHub>>;
  before(async () => (server = await serveWithTinyHub()));
  after(async () => server?.close());

  it('tiny model, 4 DPM-Solver++ steps, 16x16: an image appears', { timeout: 600_000 }, async () => {
    const browser = await launch(true);
    try {
      const page = await browser.newPage({ viewport: { width: 1280, height: 800 } });
      await page.goto(`${server.url}/?tools`);
      await page.getByRole('heading', { name: 'Generate an image' }).waitFor({ timeout: 60_000 });
      await page.getByLabel('Model hub').fill(`${server.url}/hub`);
      await page.getByLabel('Model (diffusers layout)').fill('org/tiny-sd');
      await page.getByLabel('Prompt', { exact: true }).fill('a photo of a dog');
      await page.getByLabel('Steps').fill('4');
      await page.getByLabel('Size (px)').fill('16');
      const seen = await recordTexts(page, 'gen-status');
      await page.getByRole('button', { name: 'Generate' }).click();
      const img = page.getByTestId('gen-image');
      await img.waitFor({ timeout: 540_000 });
      const size = await img.evaluate((el) => [(el as HTMLImageElement).naturalWidth, (el as HTMLImageElement).naturalHeight]);
      assert.deepEqual(size, [16, 16]);
      assert.match((await page.getByTestId('gen-status').textContent()) ?? '', /Done in .* \(16x16\)/);
      // The denoising loop said which step it was on, of how many, and the time left once a step was measured.
      const lines = await seen();
      assert.ok(
        lines.some((l) => /^Denoising step [2-4] of 4 · (about )?\d+:\d\d left$/.test(l)),
        `text to image shows i of n and the time left: ${JSON.stringify(lines)}`,
      );
      await page.getByRole('heading', { name: 'Generate an image' }).scrollIntoViewIfNeeded();
      await page.screenshot({ path: screenshotPath('generate.png') });
    } finally {
      await browser.close();
    }
  });

  it('a diffusers folder chosen from disk, DDIM: an image appears', { timeout: 600_000 }, async () => {
    const browser = await launch(true);
    try {
      const page = await browser.newPage({ viewport: { width: 1280, height: 800 } });
      await page.goto(`${server.url}/?tools`);
      await page.getByRole('heading', { name: 'Generate an image' }).waitFor({ timeout: 60_000 });
      await page.getByLabel('Or a diffusers folder on this computer').setInputFiles(server.folder);
      await page.getByLabel('Steps').fill('3');
      await page.getByLabel('Size (px)').fill('16');
      await page.getByLabel('Sampler').selectOption('ddim');
      await page.getByRole('button', { name: 'Generate' }).click();
      await page.getByTestId('gen-image').waitFor({ timeout: 540_000 });
      assert.match((await page.getByTestId('gen-status').textContent()) ?? '', /Done in .* \(16x16\)/);

      // The kernel self-test on the same page: the check under way of how many and the time left, and Stop
      // ends it after the check under way, saying where.
      const status = page.getByTestId('selftest-status');
      await page.getByRole('button', { name: 'Run kernel self-test' }).click();
      await page.waitForFunction(
        () =>
          /^Kernel check ([3-9]|\d\d+) of \d+ · (about )?\d+:\d\d(:\d\d)? left/.test(
            document.querySelector('[data-testid="selftest-status"]')?.textContent ?? '',
          ),
        null,
        { timeout: 300_000, polling: 100 },
      );
      await page.getByRole('button', { name: 'Stop' }).click();
      await page.waitForFunction(() => window.__selftest?.done === true, null, { timeout: 300_000, polling: 200 });
      const stopped = /^Stopped after (\d+) of (\d+) kernel checks/.exec((await status.textContent()) ?? '');
      assert.ok(stopped && Number(stopped[1]) < Number(stopped[2]), `stopped early: ${await status.textContent()}`);
      assert.ok(await page.getByRole('button', { name: 'Run kernel self-test' }).isEnabled(), 'the self-test can run again');
    } finally {
      await browser.close();
    }
  });
});
