// The loss-mask editor in the studio (issue 15, masked loss; headless Chromium): a photo's mask is painted with
// the brush over its crop (Clear, then a stroke of subject), saved as a PNG of the photo's shape with white
// only where the stroke went, kept with the photo across a reload, handed to the run with the photo, and
// removed again. Fill / Clear / Invert act on the whole mask and are keyboard-operable buttons. The editor is a
// modal dialog (the photos stay in place) and the brush's outline follows the pointer.
import assert from 'node:assert/strict';
import { after, before, describe, it } from 'node:test';
import { encode } from 'fast-png';
import type { Page } from 'playwright-core';
import { launch, screenshotPath, serve } from './browser.ts';

/** A 48x40 PNG photo (landscape: its crop is the centred 40x40 square). */
function photo(): number[] {
  const w = 48;
  const h = 40;
  const data = new Uint8Array(w * h * 3);
  for (let i = 0; i < w * h; i++) data.set([(i * 7) % 256, (i * 3) % 256, 100], 3 * i);
  return [...encode({ width: w, height: h, data, channels: 3, depth: 8 })];
}

/** The saved mask of the only photo, read from the project's IndexedDB: its size and white / black pixel counts by half. */
async function savedMask(page: Page): Promise<{ width: number; height: number; whiteLeft: number; whiteRight: number } | null> {
  return page.evaluate(async () => {
    const db = await new Promise<IDBDatabase>((res, rej) => {
      const r = indexedDB.open('dreambooth-studio-project');
      r.onsuccess = () => res(r.result);
      r.onerror = () => rej(r.error);
    });
    const store = db.transaction('project').objectStore('project');
    const keys = await new Promise<IDBValidKey[]>((res) => {
      const r = store.getAllKeys();
      r.onsuccess = () => res(r.result);
    });
    const key = keys.find((k) => typeof k === 'string' && k.startsWith('mask:'));
    if (!key) return null;
    const blob = await new Promise<Blob>((res) => {
      const r = db.transaction('project').objectStore('project').get(key);
      r.onsuccess = () => res(r.result as Blob);
    });
    const bmp = await createImageBitmap(blob);
    const c = new OffscreenCanvas(bmp.width, bmp.height);
    const ctx = c.getContext('2d')!;
    ctx.drawImage(bmp, 0, 0);
    const px = ctx.getImageData(0, 0, bmp.width, bmp.height).data;
    let whiteLeft = 0;
    let whiteRight = 0;
    for (let y = 0; y < bmp.height; y++)
      for (let x = 0; x < bmp.width; x++)
        if (px[(y * bmp.width + x) * 4] > 200) {
          if (x < bmp.width / 2) whiteLeft++;
          else whiteRight++;
        }
    return { width: bmp.width, height: bmp.height, whiteLeft, whiteRight };
  });
}

describe('studio: loss masks (Chromium)', () => {
  let server: Awaited<ReturnType<typeof serve>>;
  before(async () => (server = await serve()));
  after(async () => server?.close());

  it('paints, saves, keeps across a reload, and removes a photo mask', { timeout: 300_000 }, async () => {
    const browser = await launch(true);
    try {
      const page = await (await browser.newContext({ viewport: { width: 1280, height: 800 } })).newPage();
      const pageErrors: string[] = [];
      page.on('pageerror', (e) => pageErrors.push(e.message));
      await page.goto(server.url);
      await page.getByRole('button', { name: 'Use the demo model' }).waitFor({ timeout: 60_000 });
      const dt = await page.evaluateHandle((bytes) => {
        const d = new DataTransfer();
        d.items.add(new File([new Uint8Array(bytes)], 'dog-1.png', { type: 'image/png' }));
        return d;
      }, photo());
      await page.getByTestId('photo-drop').dispatchEvent('drop', { dataTransfer: dt });
      await page.getByText('dog-1.png').first().waitFor({ timeout: 60_000 });

      // The card's box in page coordinates (the click may scroll the page).
      const cardBox = () =>
        page
          .locator('li.photo')
          .first()
          .evaluate((el) => {
            const r = el.getBoundingClientRect();
            return { x: r.left + window.scrollX, y: r.top + window.scrollY, width: r.width, height: r.height };
          });
      const cardBefore = await cardBox();
      await page.getByRole('button', { name: 'Paint mask on dog-1.png' }).click();
      const clear = page.getByRole('button', { name: 'Clear', exact: true });
      await clear.waitFor();
      await page.waitForFunction(() => !document.querySelector<HTMLButtonElement>('.mask-editor button')?.disabled, null, { timeout: 30_000 });
      // The editor is a modal dialog over the page: the photo's card (and so the photos after it) stays as it was.
      assert.ok(await page.evaluate(() => document.querySelector('dialog.mask-editor')?.matches(':modal')), 'the editor is a modal dialog');
      assert.deepEqual(await cardBox(), cardBefore, "the photo's card keeps its place and size");
      // Keyboard: Clear is reachable and pressed with Enter (nothing is subject), then a brush stroke paints the
      // left part of the crop as subject.
      await clear.focus();
      await page.keyboard.press('Enter');
      const box = (await page.getByTestId('mask-canvas').boundingBox())!;
      // The brush's outline follows the pointer: hovering (no button) draws a ring of the brush's radius (24 of
      // the view's 320 px) around it, gone when the pointer leaves; the mask itself is unchanged by a hover.
      const ring = () => page.getByTestId('mask-canvas').evaluate((c) => [...(c as HTMLCanvasElement).getContext('2d')!.getImageData(178, 150, 12, 20).data]);
      await page.mouse.move(box.x + box.width / 2, box.y + box.height / 2);
      const hovered = await ring();
      await page.mouse.move(box.x + box.width + 40, box.y + box.height / 2);
      const left = await ring();
      const ringDiff = hovered.reduce((a, v, i) => a + Math.abs(v - left[i]), 0);
      assert.ok(ringDiff > 2000, `the brush outline is drawn at its radius (channel difference ${ringDiff})`);
      await page.mouse.move(box.x + box.width * 0.15, box.y + box.height * 0.2);
      await page.mouse.down();
      for (let i = 1; i <= 10; i++) await page.mouse.move(box.x + box.width * 0.15, box.y + box.height * (0.2 + 0.06 * i));
      await page.mouse.up();
      await page.screenshot({ path: screenshotPath('studio-mask.png') });
      await page.getByRole('button', { name: 'Save mask' }).click();
      await page.getByTestId('mask-status').waitFor();

      // Saved with the project: the photo's shape, white only along the stroke on the left.
      let mask = null;
      for (let i = 0; i < 50 && !mask; i++) {
        mask = await savedMask(page);
        if (!mask) await page.waitForTimeout(200);
      }
      assert.ok(mask, 'the mask is in the project store');
      assert.equal(mask.width, 48);
      assert.equal(mask.height, 40);
      assert.ok(mask.whiteLeft > 40, `the stroke is white (${mask.whiteLeft} px)`);
      assert.equal(mask.whiteRight, 0, 'nothing right of the stroke is subject');

      // A reload keeps it; Edit mask then Remove mask drops it.
      await page.reload();
      await page.getByTestId('mask-status').waitFor({ timeout: 60_000 });
      await page.getByRole('button', { name: 'Edit mask of dog-1.png' }).click();
      await page.getByRole('button', { name: 'Remove mask' }).click();
      assert.equal(await page.getByTestId('mask-status').count(), 0);
      assert.ok(await page.getByRole('button', { name: 'Paint mask on dog-1.png' }).isVisible());
      assert.deepEqual(pageErrors, []);
    } finally {
      await browser.close();
    }
  });
});
