// Text to image from the page in headless Chromium (WebGPU on SwiftShader, f32): the tiny model is
// fetched from a hub served next to the page, loaded onto the GPU, sampled, and shown as an image.
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { launch, screenshotPath, serveWithTinyHub } from './browser.ts';

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
      await page.getByRole('button', { name: 'Generate' }).click();
      const img = page.getByTestId('gen-image');
      await img.waitFor({ timeout: 540_000 });
      const size = await img.evaluate((el) => [(el as HTMLImageElement).naturalWidth, (el as HTMLImageElement).naturalHeight]);
      assert.deepEqual(size, [16, 16]);
      assert.match((await page.getByTestId('gen-status').textContent()) ?? '', /Done in .* \(16x16\)/);
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
    } finally {
      await browser.close();
    }
  });
});
