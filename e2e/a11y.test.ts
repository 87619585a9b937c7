// The studio from the keyboard and for a screen reader (issue 48, Must show 4), in headless Chromium with
// SwiftShader WebGPU: axe-core finds no serious or critical violation on each screen (first visit, a model
// and photos with the Advanced settings open, a run starting, the ?tools page); the skip links reach each
// step in a few presses; after Train the focus is on the run's status, a live region that says the run started.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { after, before, describe, it } from 'node:test';
import { encode } from 'fast-png';
import type { Page } from 'playwright-core';
import { dropPngs, launch, serve, useDemoModel } from './browser.ts';

const AXE = readFileSync(createRequire(import.meta.url).resolve('axe-core/axe.min.js'), 'utf8');

/** axe-core's serious and critical violations on the page as it is now: rule, impact, the first elements. */
async function axeProblems(page: Page): Promise<string[]> {
  if (!(await page.evaluate(() => 'axe' in globalThis))) await page.addScriptTag({ content: AXE });
  const found = await page.evaluate(async () => {
    const axe = (
      globalThis as unknown as { axe: { run: (o: object) => Promise<{ violations: { id: string; impact: string; nodes: { target: string[] }[] }[] }> } }
    ).axe;
    const r = await axe.run({ resultTypes: ['violations'] });
    return r.violations.map((v) => ({ id: v.id, impact: v.impact, targets: v.nodes.slice(0, 3).map((n) => n.target.join(' ')) }));
  });
  return found.filter((v) => v.impact === 'serious' || v.impact === 'critical').map((v) => `${v.impact} ${v.id}: ${v.targets.join(', ')}`);
}

function png(w: number, h: number, k: number): number[] {
  const data = new Uint8Array(w * h * 3);
  for (let i = 0; i < w * h; i++) data.set([(i * 7 + k * 50) % 256, (i * 3) % 256, 128], i * 3);
  return [...encode({ width: w, height: h, data, channels: 3, depth: 8 })];
}

/** Tab presses from the page's top until the focused element's text is `target` (at most `max`). */
async function tabsTo(page: Page, target: string, max: number): Promise<number> {
  for (let i = 1; i <= max; i++) {
    await page.keyboard.press('Tab');
    if ((await page.evaluate(() => document.activeElement?.textContent?.trim())) === target) return i;
  }
  return Infinity;
}

let server: { url: string; close: () => Promise<void> };
before(async () => {
  server = await serve();
});
after(() => server.close());

describe('studio accessibility (Chromium, SwiftShader)', () => {
  it('no serious or critical axe violation on each screen; skip links; focus and announcement after Train', { timeout: 300_000 }, async () => {
    const browser = await launch(true);
    try {
      const page = await (await browser.newContext({ viewport: { width: 1280, height: 900 } })).newPage();
      await page.goto(server.url);
      await page.getByRole('button', { name: 'Use the demo model' }).waitFor({ timeout: 60_000 });
      assert.deepEqual(await axeProblems(page), [], 'first visit');

      await useDemoModel(page);
      await dropPngs(page, [
        { name: 'a.png', bytes: png(48, 40, 0) },
        { name: 'b.png', bytes: png(40, 40, 1) },
      ]);
      await page.getByText('b.png').first().waitFor({ timeout: 60_000 });
      await page.getByText('Advanced settings').click();
      assert.deepEqual(await axeProblems(page), [], 'model, photos, Advanced settings open');
      // The mask editor, a modal dialog: no violation in it, and Escape closes it without saving.
      await page.getByRole('button', { name: 'Paint mask on a.png' }).click();
      await page.getByRole('dialog', { name: 'Loss mask of a.png' }).waitFor();
      assert.deepEqual(await axeProblems(page), [], 'the mask editor');
      await page.keyboard.press('Escape');
      await page.getByRole('dialog').waitFor({ state: 'detached' });
      assert.equal(await page.getByTestId('mask-status').count(), 0, 'Escape saved nothing');

      // Skip links: the Train step is a few presses from the top (it was 33 Tabs to Steps, 48 to Train).
      // From the top of a fresh load; the reload also shows the demo model coming back by itself (the last run used it).
      await page.waitForTimeout(1000); // the autosave (at most every 500 ms)
      await page.reload();
      await page.getByTestId('model-status').filter({ hasText: 'Loaded demo-sd1-small' }).waitFor({ timeout: 60_000 });
      await page.getByText('b.png').first().waitFor({ timeout: 60_000 });
      const toLink = await tabsTo(page, 'Train', 12);
      assert.ok(toLink <= 8, `the "Train" skip link after ${toLink} Tabs`);
      await page.keyboard.press('Enter');
      assert.equal(await page.evaluate(() => document.activeElement?.id), 'train-title', 'the jump lands on the step heading');
      await page.keyboard.press('Tab');
      assert.match((await page.evaluate(() => document.activeElement?.textContent)) ?? '', /^Train/, 'and the next Tab is its first button');

      // Train from the keyboard: the focus goes to the status line (a live region), which says the run started.
      await page.getByText('Advanced settings').click();
      await page.getByLabel('Steps', { exact: true }).fill('400');
      await page.getByRole('button', { name: 'Train', exact: true }).focus();
      await page.keyboard.press('Enter');
      const focused = await page.evaluate(() => ({
        id: document.activeElement?.getAttribute('data-testid'),
        live: document.activeElement?.getAttribute('aria-live'),
      }));
      assert.deepEqual(focused, { id: 'train-status', live: 'polite' }, 'the focus is on the run status, not the body');
      await page
        .getByTestId('train-status')
        .filter({ hasText: /Preparing|Training/ })
        .waitFor({ timeout: 60_000 });
      assert.deepEqual(await axeProblems(page), [], 'a run starting');
      page.on('dialog', (d) => void d.accept());
      await page.getByRole('button', { name: 'Cancel', exact: true }).click();
      await page
        .getByTestId('train-status')
        .filter({ hasText: /Cancelled/ })
        .waitFor({ timeout: 240_000 });

      await page.goto(`${server.url}?tools`);
      await page.getByRole('heading').first().waitFor({ timeout: 60_000 });
      assert.deepEqual(await axeProblems(page), [], 'the ?tools page');
    } finally {
      await browser.close();
    }
  });
});
