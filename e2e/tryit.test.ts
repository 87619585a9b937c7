// "Try it" in the studio (headless Chromium, SwiftShader: the f32 path; the demo model): before any step the
// panel says there is no finished step and its button is disabled; after a 2-step LoRA run (no samples, so
// the worker re-reads the VAE decoder and text encoder for it), the form submitted from the keyboard draws
// the base and the fine-tuned image side by side, the fine-tuned PNG downloads with A1111's "parameters"
// text (the LoRA in the prompt), the result survives a reload, and nothing is wider than a phone.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { after, before, describe, it } from 'node:test';
import { decode, encode } from 'fast-png';
import type { Page } from 'playwright-core';
import { launch, openAdvanced, screenshotPath, serve } from './browser.ts';

function photo(w: number, h: number, k: number): number[] {
  const data = new Uint8Array(w * h * 3);
  for (let y = 0; y < h; y++)
    for (let x = 0; x < w; x++) {
      const inside = Math.hypot(x - w / 2, y - h / 2) < Math.min(w, h) / 3;
      data.set(inside ? [220, 60 + 60 * k, 40] : [(x * 200) / w, (y * 200) / h, 120], 3 * (y * w + x));
    }
  return [...encode({ width: w, height: h, data, channels: 3, depth: 8 })];
}

async function download(page: Page, click: () => Promise<void>): Promise<{ name: string; bytes: Buffer }> {
  const [d] = await Promise.all([page.waitForEvent('download', { timeout: 120_000 }), click()]);
  return { name: d.suggestedFilename(), bytes: readFileSync((await d.path())!) };
}

/** At 390 px nothing is wider than the screen. */
async function assertFitsPhone(page: Page): Promise<void> {
  await page.setViewportSize({ width: 390, height: 844 });
  const overflow = await page.evaluate(() => {
    const w = document.documentElement.clientWidth;
    const wide = [...document.querySelectorAll('body *')].filter((el) => el.getBoundingClientRect().right > w + 1).map((el) => `${el.tagName}.${el.className}`);
    return { by: document.documentElement.scrollWidth - w, wide: wide.slice(0, 5) };
  });
  assert.ok(overflow.by <= 1, `no horizontal scrolling at 390 px (overflow ${overflow.by}px: ${overflow.wide.join(', ')})`);
}

describe('studio: Try it (Chromium, SwiftShader, demo model)', () => {
  let server: Awaited<ReturnType<typeof serve>>;
  // E2E_DIST: a build elsewhere than dist/ (several builds may share the tree).
  before(async () => (server = await serve(process.env.E2E_DIST || undefined)));
  after(async () => server?.close());

  it('says no step yet; after a 2-step LoRA run draws base and fine-tuned side by side; PNG with parameters', { timeout: 900_000 }, async () => {
    const browser = await launch(true);
    try {
      const context = await browser.newContext({ viewport: { width: 1280, height: 800 }, acceptDownloads: true });
      const page = await context.newPage();
      const pageErrors: string[] = [];
      page.on('pageerror', (e) => pageErrors.push(e.message));
      await page.goto(server.url);
      await page.getByRole('button', { name: 'Use the demo model' }).click({ timeout: 60_000 });
      await page.getByTestId('model-status').filter({ hasText: 'Loaded demo-sd1-small' }).waitFor({ timeout: 60_000 });
      const dt = await page.evaluateHandle(
        (fs) => {
          const d = new DataTransfer();
          for (const f of fs) d.items.add(new File([new Uint8Array(f.bytes)], f.name, { type: 'image/png' }));
          return d;
        },
        [
          { name: 'subject-1.png', bytes: photo(40, 40, 0) },
          { name: 'subject-2.png', bytes: photo(40, 40, 1) },
        ],
      );
      await page.getByTestId('photo-drop').dispatchEvent('drop', { dataTransfer: dt });
      await page.getByText('subject-2.png').first().waitFor({ timeout: 60_000 });

      // No finished step: the panel says so and Generate is disabled.
      const panel = page.getByTestId('tryit');
      const generate = panel.getByRole('button', { name: 'Generate' });
      assert.match((await panel.getByTestId('tryit-blocked').textContent()) ?? '', /No finished training step yet/);
      assert.equal(await generate.isDisabled(), true);
      // Every control of the panel is labelled.
      const unlabelled = await panel.evaluate((sec) =>
        [...sec.querySelectorAll('input, button')]
          .filter((el) => !((el as HTMLInputElement).labels?.length || (el.tagName === 'BUTTON' && el.textContent?.trim())))
          .map((el) => el.outerHTML.slice(0, 80)),
      );
      assert.deepEqual(unlabelled, []);

      // A 2-step LoRA run, no samples, no checkpoints but the final one.
      await openAdvanced(page);
      await page.getByLabel('Steps', { exact: true }).fill('2');
      await page.getByLabel('Sample every N steps (0: never)').fill('0');
      await page.getByLabel('Checkpoint every N steps').fill('0');
      // No validation loss (nothing here reads it; at the default it runs before step 1 and after step 2).
      await page.getByLabel('Validation loss every N steps (0: never)').fill('0');
      await page.getByLabel('Learning rate').fill('0.01');
      await page.getByRole('button', { name: 'Train', exact: true }).click();
      // While it prepares and trains, Generate stays disabled and says why.
      await panel
        .getByTestId('tryit-blocked')
        .filter({ hasText: /busy training|No finished/ })
        .waitFor({ timeout: 60_000 });
      assert.equal(await generate.isDisabled(), true);
      await page.waitForFunction(() => /Done/.test(document.querySelector('[data-testid="train-status"]')?.textContent ?? ''), null, { timeout: 600_000 });
      await panel.getByTestId('tryit-blocked').waitFor({ state: 'detached', timeout: 10_000 });

      // The form from the keyboard: type into the fields, Enter submits.
      await panel.getByLabel('Try-it prompt').fill('a photo of sks dog');
      await panel.getByLabel('Try-it negative prompt').fill('blurry');
      await panel.getByLabel('Try-it denoising steps').fill('2');
      await panel.getByLabel('Try-it seed').fill('7');
      await panel.getByLabel('Try-it LoRA strength').fill('0.8');
      await panel.getByLabel('Try-it prompt').focus();
      await page.keyboard.press('Enter');
      const result = panel.getByTestId('tryit-result');
      await result.first().waitFor({ timeout: 300_000 });
      assert.equal(await result.count(), 1);
      // Base and fine-tuned side by side, both drawn (decoded images of the run's 64 px: the demo model's own resolution).
      const figures = await result.locator('figure').evaluateAll((fs) =>
        fs.map((f) => {
          const img = f.querySelector('img')!;
          return { caption: f.querySelector('figcaption')?.textContent, width: img.naturalWidth, top: Math.round(img.getBoundingClientRect().top) };
        }),
      );
      assert.deepEqual(
        figures.map((f) => [f.caption, f.width]),
        [
          ['base', 64],
          ['fine-tuned', 64],
        ],
      );
      assert.equal(figures[0].top, figures[1].top, 'side by side');
      await panel.screenshot({ path: screenshotPath('tryit.png') });

      const tuned = await download(page, () => result.getByRole('link', { name: 'Download fine-tuned PNG' }).click());
      assert.match(tuned.name, /^tryit-step2-seed7-fine-tuned-.*\.png$/);
      const png = decode(tuned.bytes, { checkCrc: true });
      assert.equal(png.width, 64);
      // A1111's text, with the LoRA's hash as A1111 writes it (the first 12 hex digits of its sshs_model_hash;
      // tests/pipeline/tryit.test.ts checks it equals the exported file's).
      assert.match(
        png.text.parameters,
        new RegExp(
          '^a photo of sks dog <lora:demo-sd1-small-dreambooth-lora-step2-lora:0\\.8>\nNegative prompt: blurry\n' +
            'Steps: 2, Sampler: DPM\\+\\+ 2M, CFG scale: 7\\.5, Seed: 7, Size: 64x64, Model: demo-sd1-small, ' +
            'Lora hashes: "demo-sd1-small-dreambooth-lora-step2-lora: [0-9a-f]{12}"$',
        ),
      );
      const base = await download(page, () => result.getByRole('link', { name: 'Download base PNG' }).click());
      assert.equal(
        decode(base.bytes).text.parameters,
        'a photo of sks dog\nNegative prompt: blurry\nSteps: 2, Sampler: DPM++ 2M, CFG scale: 7.5, Seed: 7, Size: 64x64, Model: demo-sd1-small',
      );

      // Each result's Remove says which result it removes.
      assert.equal(await result.getByRole('button', { name: /^Remove the result of step 2, seed 7/ }).count(), 1);
      await assertFitsPhone(page);
      await page.getByTestId('tryit').screenshot({ path: screenshotPath('tryit-phone.png') });

      // Kept with the run: after a reload the result is listed again, its images readable.
      await page.setViewportSize({ width: 1280, height: 800 });
      await page.waitForTimeout(1500); // the autosave (at most every 500 ms)
      await page.reload();
      await page.getByTestId('tryit-result').first().waitFor({ timeout: 60_000 });
      const widths = await page
        .getByTestId('tryit-result')
        .locator('img')
        .evaluateAll((imgs) => Promise.all(imgs.map((i) => (i as HTMLImageElement).decode().then(() => (i as HTMLImageElement).naturalWidth))));
      assert.deepEqual(widths, [64, 64]);
      assert.deepEqual(pageErrors, []);
    } finally {
      await browser.close();
    }
  });
});
