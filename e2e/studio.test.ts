// The studio, end to end in headless Chromium (WebGPU on SwiftShader: no shader-f16, so the f32 path), with
// the project's own demo model: load it, drop three photos and a bad file, train a few steps (loss chart,
// samples), reload mid-run and resume from the checkpoint, export a kohya LoRA and a full checkpoint and
// read the downloaded files' safetensors headers. Also: pause/resume/cancel, a lost GPU device, a storage
// quota too small for the run, phone width, keyboard use and labels. Screenshots of each stage go to
// SCREENSHOTS (browser.ts: test-results/screenshots/, or e2e/screenshots/ for the README with `npm run screenshots`).
import assert from 'node:assert/strict';
import { cpSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { encode } from 'fast-png';
import { chromium, type Page } from 'playwright-core';
import { build } from 'vite';
import { writeTinySdxl } from '../tests/fixtures/models/make-tiny-sdxl.ts';
import { CHROMIUM_FLAGS, launch, openAdvanced, ROOT, safetensorsHeader, screenshotPath, serve, serveWithTinyHub, WEBGPU_FLAGS } from './browser.ts';

/** A w x h PNG: a soft disc on a gradient, a different colour per `k` (a "subject" the eye can follow). */
function photo(w: number, h: number, k: number): number[] {
  const data = new Uint8Array(w * h * 3);
  for (let y = 0; y < h; y++)
    for (let x = 0; x < w; x++) {
      const p = 3 * (y * w + x);
      const d = Math.hypot(x - w / 2, y - h / 2) / (Math.min(w, h) / 3);
      const inside = d < 1 ? 1 : 0;
      data[p] = inside ? 220 : (x * 200) / w;
      data[p + 1] = inside ? 60 + 60 * k : (y * 200) / h;
      data[p + 2] = inside ? 40 : 120;
    }
  return [...encode({ width: w, height: h, data, channels: 3, depth: 8 })];
}

/** Drops files on a drop zone the way a drag from the desktop does (a DataTransfer with Files). */
async function dropFiles(page: Page, testId: string, files: { name: string; type: string; bytes: number[] }[]): Promise<void> {
  const dt = await page.evaluateHandle((fs) => {
    const d = new DataTransfer();
    for (const f of fs) d.items.add(new File([new Uint8Array(f.bytes)], f.name, { type: f.type }));
    return d;
  }, files);
  await page.getByTestId(testId).dispatchEvent('drop', { dataTransfer: dt });
}

async function shot(page: Page, name: string): Promise<void> {
  await page.screenshot({ path: screenshotPath(`${name}.png`), fullPage: true });
}

/**
 * The storage quota of the storage-full test: room for one checkpoint of the demo model's full fine-tune but
 * not two. The demo UNet (public/demo-model/unet, the only part a full fine-tune trains) has 2,174,852
 * weights; with fp32 masters and fp32 AdamW moments a checkpoint keeps 12 bytes per weight, 26.1 MB (24.9
 * MiB). 40 MiB (41.9 MB) holds that plus the rest of the origin's storage (project, photos: well under 1 MB)
 * with ~15 MB to spare, and refuses a second checkpoint (52.2 MB) by ~10 MB; the test checks both against the
 * checkpoint's real size.
 */
const QUOTA = 40 * 2 ** 20;

/** The worker's IndexedDB database of runs (src/studio/worker.ts RUN_DB; not imported: that module starts a worker). */
const RUN_DB = 'dreambooth-studio-runs';

type StoreReader = typeof import('../src/store/idb-store.ts') & typeof import('../src/store/snapshot.ts');

/**
 * The project's IndexedDB chunk store and snapshot reader as one ES module (Vite library mode, as
 * e2e/store.test.ts builds it), placed in dist/ so the studio page's origin can import it and read back what
 * its worker stored. `remove` deletes it again.
 */
async function bundleStoreReader(): Promise<{ url: string; remove: () => void }> {
  const src = mkdtempSync(join(tmpdir(), 'dbs-e2e-reader-'));
  const out = join(ROOT, 'dist', 'e2e-store-reader');
  writeFileSync(join(src, 'entry.ts'), ['idb-store', 'snapshot'].map((m) => `export * from '${join(ROOT, 'src', 'store', `${m}.ts`)}';`).join('\n'));
  await build({
    configFile: false,
    root: src,
    logLevel: 'warn',
    build: { outDir: out, emptyOutDir: true, minify: false, lib: { entry: join(src, 'entry.ts'), formats: ['es'], fileName: () => 'store.js' } },
  });
  rmSync(src, { recursive: true, force: true });
  return { url: '/e2e-store-reader/store.js', remove: () => rmSync(out, { recursive: true, force: true }) };
}

/** Photos larger than the demo model's 64 px (so none is upscaled), two of them not square. */
const PHOTOS = [
  { name: 'subject-1.png', type: 'image/png', bytes: photo(96, 80, 0) },
  { name: 'subject-2.png', type: 'image/png', bytes: photo(80, 112, 1) },
  { name: 'subject-3.png', type: 'image/png', bytes: photo(80, 80, 2) },
];

async function openStudio(page: Page, url: string): Promise<void> {
  await page.goto(url);
  await page.getByRole('button', { name: 'Use the demo model' }).waitFor({ timeout: 60_000 });
}

async function loadDemo(page: Page): Promise<void> {
  await page.getByRole('button', { name: 'Use the demo model' }).click();
  await page.getByTestId('model-status').filter({ hasText: 'Loaded demo-sd1-small' }).waitFor({ timeout: 60_000 });
}

/**
 * Small, fast settings for software WebGPU. `validateEvery: 0` turns the validation loss off in the tests that do
 * not check it: at the studio's default every run start (step 0, each resume) and its last step runs one, a forward
 * pass per photo and validation timestep.
 */
async function tinySettings(page: Page, o: { steps: number; sampleEvery: number; checkpointEvery: number; validateEvery?: number }): Promise<void> {
  await openAdvanced(page);
  await page.getByLabel('Steps', { exact: true }).fill(String(o.steps));
  await page.getByLabel('Sample every N steps (0: never)').fill(String(o.sampleEvery));
  await page.getByLabel('Sampling steps').fill('2');
  await page.getByLabel('Checkpoint every N steps').fill(String(o.checkpointEvery));
  if (o.validateEvery !== undefined) await page.getByLabel('Validation loss every N steps (0: never)').fill(String(o.validateEvery));
}

const progressText = (page: Page) => page.getByTestId('train-progress-text').textContent();

/** At 390 px (a phone) nothing is wider than the screen: no sideways scrolling. */
async function assertFitsPhone(page: Page, when: string): Promise<void> {
  await page.setViewportSize({ width: 390, height: 844 });
  const overflow = await page.evaluate(() => {
    const w = document.documentElement.clientWidth;
    const wide = [...document.querySelectorAll('body *')].filter((el) => el.getBoundingClientRect().right > w + 1).map((el) => `${el.tagName}.${el.className}`);
    return { by: document.documentElement.scrollWidth - w, wide: wide.slice(0, 5) };
  });
  assert.ok(overflow.by <= 1, `no horizontal scrolling at phone width ${when} (overflow ${overflow.by}px: ${overflow.wide.join(', ')})`);
}

/**
 * Text fields and selects (outside the photo cards' free-text captions) whose value or longest option is wider
 * than the room inside the field: measured with the field's own font on a canvas.
 */
async function cutOffFields(page: Page): Promise<string[]> {
  return page.evaluate(() => {
    const ctx = document.createElement('canvas').getContext('2d')!;
    const out: string[] = [];
    for (const el of document.querySelectorAll<HTMLInputElement | HTMLSelectElement>('form input[type="text"], form input:not([type]), form select')) {
      if (!el.offsetParent || el.closest('li.photo')) continue;
      const cs = getComputedStyle(el);
      ctx.font = `${cs.fontWeight} ${cs.fontSize} ${cs.fontFamily}`;
      const texts = el instanceof HTMLSelectElement ? [...el.options].map((o) => o.text) : [el.value];
      const need = Math.max(...texts.map((t) => ctx.measureText(t).width));
      // A select's arrow takes about 20 px of its box.
      const room = el.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight) - (el instanceof HTMLSelectElement ? 20 : 0);
      if (need > room) out.push(`${el.name || el.tagName}: needs ${need.toFixed(0)} px, has ${room.toFixed(0)} px`);
    }
    return out;
  });
}

/**
 * Records every change of the progress line together with the sample's own progress line (null when none
 * shows), from now until the page goes away; `progressRecords` reads them back.
 */
async function watchProgress(page: Page): Promise<void> {
  // No named functions inside: the test runner's transform would wrap them in a helper the page lacks.
  await page.evaluate(() => {
    const w = window as unknown as { __progress: { progress: string; sample: string | null; status: string }[] };
    w.__progress = [];
    new MutationObserver(() => {
      const r = {
        progress: document.querySelector('[data-testid="train-progress-text"]')?.textContent ?? '',
        sample: document.querySelector('[data-testid="sample-progress"]')?.textContent ?? null,
        status: document.querySelector('[data-testid="train-status"]')?.textContent ?? '',
      };
      const last = w.__progress.at(-1);
      if (!last || last.progress !== r.progress || last.sample !== r.sample || last.status !== r.status) w.__progress.push(r);
    }).observe(document.body, { subtree: true, childList: true, characterData: true });
  });
}

const progressRecords = (page: Page) =>
  page.evaluate(() => (window as unknown as { __progress: { progress: string; sample: string | null; status: string }[] }).__progress);

/**
 * Clicks the page's left margin (nothing there reacts) every half second until stopped, timing each click from
 * the mouse-down to the page's answer: Playwright's click returns once the page has handled the events, which
 * needs its main thread. Each latency comes with what the run said at the time, to name the slow moment.
 */
function startClicker(page: Page): { stop: () => Promise<{ ms: number; status: string }[]> } {
  let running = true;
  const clicks: { ms: number; status: string }[] = [];
  const loop = (async () => {
    while (running) {
      const t0 = performance.now();
      try {
        await page.mouse.click(4, 400);
      } catch {
        // The page went away (a reload): stop.
        break;
      }
      const ms = performance.now() - t0;
      const status = await page.evaluate(() => document.querySelector('[data-testid="train-status"]')?.textContent ?? '').catch(() => '');
      clicks.push({ ms, status });
      await new Promise((r) => setTimeout(r, 500));
    }
  })();
  return {
    stop: async () => {
      running = false;
      await loop;
      return clicks;
    },
  };
}

/** The page answered every click within 2 s (issue 48): the slowest, with the run's status then, in the test's log. */
function assertAnswered(clicks: { ms: number; status: string }[], when: string, log: (m: string) => void): void {
  const worst = clicks.reduce((a, b) => (b.ms > a.ms ? b : a), { ms: 0, status: '' });
  const ms = clicks.map((c) => c.ms).sort((a, b) => a - b);
  log(`clicks ${when}: ${clicks.length}, median ${ms[ms.length >> 1]?.toFixed(0)} ms, max ${worst.ms.toFixed(0)} ms (at "${worst.status}")`);
  assert.ok(clicks.length >= 5, `clicked ${clicks.length} times ${when}`);
  assert.ok(worst.ms < 2000, `the page answered a click in ${worst.ms.toFixed(0)} ms ${when}, at "${worst.status}" (limit 2 s)`);
}

async function waitForStep(page: Page, step: number, timeout = 300_000): Promise<void> {
  await page.waitForFunction(
    (n) => {
      const m = /Step (\d+) \//.exec(document.querySelector('[data-testid="train-progress-text"]')?.textContent ?? '');
      return m !== null && Number(m[1]) >= n;
    },
    step,
    { timeout },
  );
}

async function waitForStatus(page: Page, re: RegExp, timeout = 300_000): Promise<void> {
  await page.waitForFunction((src) => new RegExp(src).test(document.querySelector('[data-testid="train-status"]')?.textContent ?? ''), re.source, { timeout });
}

describe('the studio page (Chromium, SwiftShader, f32, demo model)', () => {
  let server: Awaited<ReturnType<typeof serve>>;
  before(async () => (server = await serve()));
  after(async () => server?.close());

  it('demo model, 3 photos and a bad file, train, reload mid-run, resume, export LoRA and full checkpoint', { timeout: 900_000 }, async (t) => {
    const browser = await launch(true);
    try {
      const context = await browser.newContext({ viewport: { width: 1280, height: 800 }, acceptDownloads: true });
      const page = await context.newPage();
      const pageErrors: string[] = [];
      page.on('pageerror', (e) => pageErrors.push(e.message));
      // Nothing the page asks for is missing (the favicon was a 404 on every load).
      const failed: string[] = [];
      page.on('response', (r) => r.status() >= 400 && failed.push(`${r.status()} ${r.url()}`));
      await openStudio(page, server.url);
      assert.ok(await page.getByTestId('no-f16').isVisible(), 'SwiftShader has no shader-f16: the f32 notice shows');
      // The footer says which GEMM kernels run and why: a CPU adapter keeps its defaults, untimed.
      assert.match(
        (await page.getByTestId('gpu-summary').textContent()) ?? '',
        /· f32 · GEMM kernels: 8x8 blocks, fill 8, split-K off, 16-deep steps, no prefetch, staged matmuls \(defaults for a CPU adapter/,
      );
      const icon = await page.evaluate(async () => {
        const href = document.querySelector<HTMLLinkElement>('link[rel="icon"]')?.href ?? '';
        const r = await fetch(href);
        return { href, status: r.status, svg: /<svg[\s>]/.test(await r.text()) };
      });
      assert.deepEqual(icon, { href: `${server.url}/favicon.svg`, status: 200, svg: true }, 'the favicon is in the build');
      // No chart (and no legend) before the first step: a line says where the loss will appear.
      assert.ok(await page.getByTestId('loss-chart').isHidden(), 'no empty chart before step 1');
      assert.equal(await page.getByTestId('loss-legend').count(), 0);
      await shot(page, 'studio-1-start');

      // Keyboard: Tab to the demo button and press Enter.
      let focused = '';
      for (let i = 0; i < 30 && focused !== 'Use the demo model'; i++) {
        await page.keyboard.press('Tab');
        focused = await page.evaluate(() => document.activeElement?.textContent ?? '');
      }
      assert.equal(focused, 'Use the demo model', 'the demo button is reachable with Tab');
      await page.keyboard.press('Enter');
      await page.getByTestId('model-status').filter({ hasText: 'Loaded demo-sd1-small' }).waitFor({ timeout: 60_000 });

      await dropFiles(page, 'photo-drop', [...PHOTOS, { name: 'notes.txt', type: 'text/plain', bytes: [...Buffer.from('shopping list: milk, eggs')] }]);
      await page.getByTestId('photo-errors').waitFor();
      assert.match((await page.getByTestId('photo-errors').textContent()) ?? '', /notes\.txt/);
      assert.equal(await page.locator('[data-testid="photos"] li').count(), 3, 'three photos, the text file refused');
      // The crop of the tall photo moves to its top.
      await page.getByLabel('Crop position for subject-2.png').fill('0');
      await page.getByLabel('Caption for subject-3.png').fill('a photo of sks disc on a table');

      // Every control has an accessible name.
      const unlabelled = await page.evaluate(() =>
        [...document.querySelectorAll('input, select, button, textarea')]
          .filter((el) => {
            const e = el as HTMLInputElement;
            return !(e.labels && e.labels.length) && !e.getAttribute('aria-label') && !(el.tagName === 'BUTTON' && el.textContent?.trim());
          })
          .map((el) => el.outerHTML.slice(0, 80)),
      );
      assert.deepEqual(unlabelled, []);
      await tinySettings(page, { steps: 6, sampleEvery: 3, checkpointEvery: 2 });
      // At 1280 px the hub model and the export format (every option) fit their fields.
      assert.deepEqual(await cutOffFields(page), [], 'no field cut off at 1280 px');
      await shot(page, 'studio-2-photos');

      // Phone width: the same page in one column, nothing wider than the screen.
      await assertFitsPhone(page, 'with photos and settings');
      await page.screenshot({ path: screenshotPath('studio-phone.png'), fullPage: false });
      await page.setViewportSize({ width: 1280, height: 800 });

      await watchProgress(page);
      await page.getByRole('button', { name: 'Train', exact: true }).click();
      // Every moment of the run, from Train (class-free preparation, validation, the first sample, warm-up,
      // steps, samples, checkpoints) to the reload, and after Resume until done: the page answers a click.
      let clicker = startClicker(page);
      await page.waitForFunction(
        () => /checkpoint at step [2-9]/.test(document.querySelector('[data-testid="train-progress-text"]')?.textContent ?? ''),
        null,
        { timeout: 600_000 },
      );
      await page.getByTestId('samples').waitFor();
      assert.match((await page.getByTestId('loss-text').textContent()) ?? '', /Loss at step \d+: \d/);
      // The legend says numbers (the latest step's) without the pointer over the chart.
      assert.match((await page.getByTestId('loss-legend').textContent()) ?? '', /step \d+.*loss \d+\.\d{4}.*average of 10 \d+\.\d{4}/);
      // The validation loss (every 100 steps by default: here the one before step 1) is in the legend too.
      assert.match((await page.getByTestId('validation-legend').textContent()) ?? '', /validation at step 0: photos \d+\.\d{4}/);
      // While it trains, the model and the photos stay as they are.
      for (const control of [
        page.getByRole('button', { name: 'Use the demo model' }),
        page.getByRole('button', { name: 'Download from the hub' }),
        page.getByLabel('Choose a checkpoint file'),
        page.getByLabel('Add photos'),
        page.getByRole('button', { name: 'Remove subject-1.png' }),
        page.getByLabel('Replace photo 1'),
        page.getByLabel('Crop position for subject-2.png'),
        page.getByLabel('Caption for subject-3.png'),
      ])
        assert.ok(await control.isDisabled(), `${control} is disabled while training`);
      // Photo warnings: sizes judged at the demo model's 64 px (96x80 is not small there; at SD's 512 px all
      // three would be "blurry"); the page trains non-square photos in aspect-ratio buckets, so none is "not
      // square": the cards say which bucket each trains at. Bucket sides are multiples of the model's factor,
      // VAE x UNet down-sampling = 8 x 8 = 64 for the demo model (4 blocks each), and a bucket holds at most
      // 64x64 px: at 64 px the square is the only bucket, so every photo trains at 64x64, labelled a square crop
      // (a factor or resolution taken from anything but the loaded model would show other sides).
      // (With no warning at all the page shows no list.)
      const warningList = page.getByRole('list', { name: 'Warnings' });
      const warnings = (await warningList.count()) ? ((await warningList.textContent()) ?? '') : '';
      assert.doesNotMatch(warnings, /not square|blurry|upscaled/);
      // The two photos that are not square say why they train square, and from which size they would not.
      assert.deepEqual(await page.getByTestId('bucket').allTextContents(), [
        'Trains at 64×64, a square crop: at 64 px, with bucket sides in steps of 64 px, no other shape is nearer its 6:5; from 384 px it trains at its own aspect ratio.',
        'Trains at 64×64, a square crop: at 64 px, with bucket sides in steps of 64 px, no other shape is nearer its 5:7; from 256 px it trains at its own aspect ratio.',
        'Trains at 64×64 (square)',
      ]);
      // The page stays responsive while the worker trains: a click on the advanced panel answers at once.
      const t0 = Date.now();
      await page.evaluate(() => new Promise((r) => requestAnimationFrame(() => r(null))));
      assert.ok(Date.now() - t0 < 2000, 'the page renders frames during training');
      await shot(page, 'studio-3-training');
      const stepBefore = Number(/Step (\d+)/.exec((await progressText(page)) ?? '')![1]);
      // Honest time: the sample before step 1 showed its denoising steps; step 1 was shown as warm-up (the
      // pipelines compile) and s/step appeared only from warm steps, with the warm-up beside it.
      const early = await progressRecords(page);
      assert.ok(
        early.some((r) => /Sample at step 0: denoising step [0-2] of 2/.test(r.sample ?? '')),
        early.map((r) => r.sample).join(' | '),
      );
      assert.ok(
        early.some((r) => /^Step 1 \/ 6 · warm-up: the first step took \d+\.\d s \(compiling GPU pipelines\) · ETA about \d+:\d\d/.test(r.progress)),
        early.map((r) => r.progress).join(' | '),
      );
      assert.ok(!early.some((r) => /^Step 1 \/.*s\/step/.test(r.progress)), 'no s/step from the warm-up step alone');
      // The model was loaded before Train: the run does not download it again; the validation before step 1
      // said which of how many it was, with its estimate.
      assert.ok(!early.some((r) => /Downloading/.test(r.status)), early.map((r) => r.status).join(' | '));
      assert.ok(
        early.some((r) => /Validation 1 of \d+: the loss at step 0 \(\d+ forward passes\)/.test(r.status)),
        early.map((r) => r.status).join(' | '),
      );
      assert.ok(
        early.some((r) => /^Step [2-6] \/ 6 · warm-up \d+\.\d s · \d+\.\d\d s\/step · ETA/.test(r.progress)),
        early.map((r) => r.progress).join(' | '),
      );

      assertAnswered(await clicker.stop(), 'while training', (m) => t.diagnostic(m));

      // Reload mid-run: the run is remembered, resumes from the checkpoint after the model is loaded again.
      await page.reload();
      await page.getByTestId('interrupted').waitFor({ timeout: 60_000 });
      assert.match((await page.getByTestId('interrupted').textContent()) ?? '', /checkpoint at step \d/);
      assert.equal(await page.getByText(/The page was closed during training/).count(), 1, 'the interrupted message is said once');
      assert.match((await page.getByTestId('train-status').textContent()) ?? '', /^Interrupted\.\s*$/);
      assert.equal(await page.locator('[data-testid="photos"] li').count(), 3, 'photos survive the reload');
      assert.equal(await page.getByLabel('Caption for subject-3.png').inputValue(), 'a photo of sks disc on a table');
      await shot(page, 'studio-4-reloaded');
      await loadDemo(page);
      await watchProgress(page);
      await page.getByRole('button', { name: 'Resume' }).click();
      clicker = startClicker(page);
      await waitForStatus(page, /Done/, 600_000);
      assertAnswered(await clicker.stop(), 'while the resumed run trained', (m) => t.diagnostic(m));
      // The final sample (step 6) showed its progress, and the ETA did not read 0:00 when it started: it
      // counts the sample and the final checkpoint.
      const late = await progressRecords(page);
      const finalSample = late.find((r) => /Sample at step 6: denoising step 0 of 2/.test(r.sample ?? ''));
      assert.ok(finalSample, late.map((r) => `${r.progress} [${r.sample}]`).join(' | '));
      assert.match(finalSample.progress, /^Step 6 \/ 6 .*ETA (about )?(0:0[1-9]|0:[1-5]\d|[1-9]\d*:\d\d)/);
      const after = (await progressText(page)) ?? '';
      assert.match(after, /Step 6 \/ 6/);
      assert.ok(stepBefore >= 2);
      assert.match((await page.getByTestId('loss-text').textContent()) ?? '', /Loss at step 6/);
      assert.ok((await page.locator('[data-testid="samples"] li').count()) >= 2, 'samples from before and after the reload');

      // Export a kohya LoRA and a full checkpoint as downloads (Blob path); read the downloads' headers.
      const dialog = page.getByLabel('Choose where to save (streams large files straight to disk)');
      // Chromium has showSaveFilePicker, so the page offers the dialog (on by default): turn it off here.
      assert.equal(await dialog.count(), 1, 'the save-dialog option is offered');
      await dialog.uncheck();
      const exportAs = async (label: RegExp) => {
        await page
          .getByLabel('Format')
          .selectOption({ label: (await page.getByLabel('Format').locator('option').allTextContents()).find((t) => label.test(t))! });
        const [download] = await Promise.all([
          page.waitForEvent('download', { timeout: 300_000 }),
          page.getByRole('button', { name: 'Export and download' }).click(),
        ]);
        const path = await download.path();
        return { name: download.suggestedFilename(), bytes: readFileSync(path) };
      };
      const lora = await exportAs(/LoRA, kohya/);
      assert.match(lora.name, /^demo-sd1-small-dreambooth-lora-step6-lora\.safetensors$/);
      const lh = safetensorsHeader(lora.bytes);
      assert.ok(lh.names.length > 0 && lh.names.every((n) => n.startsWith('lora_unet_')), lh.names.slice(0, 3).join(', '));
      assert.equal(lh.metadata.ss_network_dim, '8');
      const full = await exportAs(/Full checkpoint/);
      const fh = safetensorsHeader(full.bytes);
      for (const p of ['model.diffusion_model.', 'first_stage_model.', 'cond_stage_model.'])
        assert.ok(
          fh.names.some((n) => n.startsWith(p)),
          `full checkpoint has ${p}*`,
        );
      await page.getByTestId('exports').filter({ hasText: 'KiB' }).waitFor();
      assert.equal(await page.locator('[data-testid="exports"] li').count(), 2);
      // The export says what it did on its own line; the run's status stays the run's.
      assert.match((await page.getByTestId('export-status').textContent()) ?? '', /^Exported demo-sd1-small-dreambooth-lora-step6\.safetensors \(/);
      // "Done. Trained 6 steps." (it read "Done. Done: 6 steps"), and no ETA left on the finished run's progress line.
      assert.match((await page.getByTestId('train-status').textContent()) ?? '', /^Done\. Trained 6 steps\./);
      assert.doesNotMatch((await progressText(page)) ?? '', /ETA/);
      // Through the save dialog: the worker streams into the chosen file. The OS dialog is replaced by one that
      // answers with a file in the origin-private file system; everything after it is the real path.
      {
        await page.evaluate(() => {
          (window as unknown as { showSaveFilePicker: unknown }).showSaveFilePicker = async (o: { suggestedName: string }) =>
            (await navigator.storage.getDirectory()).getFileHandle(o.suggestedName, { create: true });
        });
        await dialog.check();
        await page
          .getByLabel('Format')
          .selectOption({ label: (await page.getByLabel('Format').locator('option').allTextContents()).find((t) => /diffusers folder/.test(t))! });
        await page.getByRole('button', { name: 'Export and download' }).click();
        await page.getByTestId('exports').filter({ hasText: 'saved where you chose' }).waitFor({ timeout: 300_000 });
        const saved = await page.evaluate(async () => {
          const f = await (await (await navigator.storage.getDirectory()).getFileHandle('demo-sd1-small-dreambooth-lora-step6-diffusers.zip')).getFile();
          return { size: f.size, head: [...new Uint8Array(await f.slice(0, 2).arrayBuffer())] };
        });
        assert.deepEqual(saved.head, [0x50, 0x4b], 'a zip (PK)');
        assert.ok(saved.size > 100_000, `zip size ${saved.size}`);
        assert.match((await page.getByTestId('exports').textContent()) ?? '', /diffusers\.zip \(saved where you chose\) — \d/);
      }
      await shot(page, 'studio-5-export');
      // A finished run (chart, legend, samples, exports with long file names) also fits a phone.
      await assertFitsPhone(page, 'after training and exports');
      await page.setViewportSize({ width: 1280, height: 800 });
      assert.match((await page.getByTestId('train-status').textContent()) ?? '', /^Done\./, "still the run's status after the save-dialog export");

      // "Choose where to save" is remembered across a reload (turned off here, off after it).
      await dialog.uncheck();
      await page.waitForTimeout(1000); // the project autosaves at most every 500 ms
      await page.reload();
      await page.getByRole('button', { name: 'Use the demo model' }).waitFor({ timeout: 60_000 });
      assert.equal(await page.getByLabel('Choose where to save (streams large files straight to disk)').isChecked(), false);
      assert.deepEqual(pageErrors, []);
      assert.deepEqual(failed, [], 'no request failed');
    } finally {
      await browser.close();
    }
  });

  it('pause, resume, cancel; a lost GPU device offers resume and the run finishes', { timeout: 900_000 }, async () => {
    const browser = await launch(true);
    try {
      const page = await browser.newPage({ viewport: { width: 1280, height: 800 } });
      // "Train again" and "Cancel" ask before deleting a run's checkpoints: answer yes, and check they asked.
      const asked: string[] = [];
      page.on('dialog', (d) => {
        asked.push(d.message());
        void d.accept();
      });
      await openStudio(page, server.url);
      await loadDemo(page);
      await dropFiles(page, 'photo-drop', PHOTOS);
      await page.locator('[data-testid="photos"] li').nth(2).waitFor();
      await tinySettings(page, { steps: 5, sampleEvery: 0, checkpointEvery: 1, validateEvery: 0 });
      await page.getByRole('button', { name: 'Train', exact: true }).click();
      await waitForStep(page, 1);
      await page.getByRole('button', { name: 'Pause' }).click();
      await waitForStatus(page, /Paused at step \d/);
      const paused = Number(/Step (\d+)/.exec((await progressText(page)) ?? '')![1]);
      await page.waitForTimeout(1500);
      assert.equal(Number(/Step (\d+)/.exec((await progressText(page)) ?? '')![1]), paused, 'no steps while paused');
      await page.getByRole('button', { name: 'Resume' }).click();
      await waitForStep(page, paused + 1);

      // The device goes away mid-run (destroyed from inside the worker, as a driver reset would).
      await page.evaluate(() => (window as unknown as { __studio: { loseDevice: () => Promise<void> } }).__studio.loseDevice());
      await page.getByTestId('device-lost').waitFor({ timeout: 120_000 });
      await shot(page, 'studio-device-lost');
      await page.getByRole('button', { name: 'Resume' }).click();
      await waitForStatus(page, /Done/, 600_000);
      assert.match((await progressText(page)) ?? '', /Step 5 \/ 5/);

      // Cancel a new run: its checkpoints go, the page is ready for another.
      await page.getByRole('button', { name: 'Train again from the start' }).click();
      await waitForStatus(page, /^Training\./);
      await waitForStep(page, 1);
      await page.getByRole('button', { name: 'Cancel' }).click();
      await waitForStatus(page, /Cancelled/);
      assert.match((await progressText(page)) ?? '', /Step 0/);
      assert.equal(asked.length, 2, asked.join(' | '));
      assert.match(asked[0], /Train this run again from the start\? Its 5 steps and checkpoints will be deleted/);
      assert.match(asked[1], /Cancel the run\?/);
    } finally {
      await browser.close();
    }
  });

  it('a storage quota too small for a full fine-tune stops it with the storage screen; the checkpoint stays intact', { timeout: 300_000 }, async (t) => {
    const t0 = Date.now();
    const phase = (what: string) => t.diagnostic(`${((Date.now() - t0) / 1000).toFixed(1)} s: ${what}`);
    // An on-disk profile, not an incognito context: IndexedDB then writes real files whose sizes the quota
    // counts exactly (in memory, Chromium's accounting of the same writes varies from run to run).
    const profile = mkdtempSync(join(tmpdir(), 'dbs-e2e-quota-'));
    const context = await chromium.launchPersistentContext(profile, {
      executablePath: process.env.CHROMIUM_PATH ?? '/usr/bin/chromium',
      headless: true,
      args: [...CHROMIUM_FLAGS, ...WEBGPU_FLAGS],
      viewport: { width: 1280, height: 800 },
    });
    const reader = await bundleStoreReader();
    try {
      const page = context.pages()[0] ?? (await context.newPage());
      const cdp = await context.newCDPSession(page);
      // QUOTA for the whole origin: room for one checkpoint of the demo model's full fine-tune (fp32 masters
      // and two moments, 12 bytes per UNet weight: ~26 MB, checked below) but not for the next, which is
      // written before the previous one is deleted. (Set before the page stores anything: Chromium's
      // IndexedDB caches an origin's quota once used.)
      await cdp.send('Storage.overrideQuotaForOrigin', { origin: server.url, quotaSize: QUOTA });
      await openStudio(page, server.url);
      assert.ok(await page.getByTestId('not-persistent').isVisible(), 'the storage-persistence screen shows (headless Chromium does not persist by default)');
      await loadDemo(page);
      await dropFiles(page, 'photo-drop', PHOTOS);
      await page.locator('[data-testid="photos"] li').nth(2).waitFor();
      await page.getByLabel('Full DreamBooth').check();
      await tinySettings(page, { steps: 4, sampleEvery: 0, checkpointEvery: 1, validateEvery: 0 });
      await page.getByRole('checkbox', { name: 'Prior preservation (class images)' }).uncheck();
      // fp32 AdamW state (12 bytes per weight), which the quota below is sized for (the full default, 8-bit
      // moments and a compact master, keeps a sixth of it).
      await page.locator('select[name="optimizer"]').selectOption('adamw');
      await page.locator('select[name="master"]').selectOption('fp32');
      phase('training');
      await page.getByRole('button', { name: 'Train', exact: true }).click();
      await page.locator('[data-testid="quota"], [data-testid="train-error"]').first().waitFor({ timeout: 300_000 });
      phase(`stopped: ${await page.getByTestId('train-status').textContent()} | ${await progressText(page)}`);
      assert.ok(
        await page.getByTestId('quota').isVisible(),
        `the quota screen, not: ${await page.getByTestId('train-status').textContent()} ${await page
          .getByTestId('train-error')
          .textContent()
          .catch(() => '')}`,
      );
      // navigator.storage.estimate() does not see CDP's quota override, so the pre-check passes and the browser
      // itself refuses the second checkpoint's write: the real storage-full path.
      const quotaText = (await page.getByTestId('quota').textContent()) ?? '';
      assert.match(quotaText, /Storage is full: could not write .* Training stopped at step \d+; the last checkpoint is intact/);
      const stoppedAt = Number(/Training stopped at step (\d+)/.exec(quotaText)![1]);
      assert.ok(stoppedAt >= 2, `stopped at step ${stoppedAt}: the first checkpoint (step 1) must have fitted`);
      assert.match((await page.getByTestId('plan').textContent()) ?? '', /about .* of storage/);
      await shot(page, 'studio-quota');

      // "Intact", read back: the run's checkpoint in the worker's IndexedDB, opened with the project's own
      // snapshot reader (every file checked against HEAD's size and CRC and the store record's CRC), is the
      // one of the step before the refused one, and every chunk the run still stores reads back with a valid CRC.
      const back = await page.evaluate(
        async ({ db, url }) => {
          const m = (await import(url)) as StoreReader;
          const runId = (window as unknown as { __studio: { state: () => { run: { runId: string | null } } } }).__studio.state().run.runId;
          if (!runId) return { error: 'the page has no run id' };
          const store = await m.IdbChunkStore.open(db);
          try {
            const snap = await m.openSnapshot<{ step: number }>(store, `${runId}/ckpt`);
            if (!snap) return { error: `no checkpoint under ${runId}/ckpt: ${(await store.keys(`${runId}/`)).join(', ')}` };
            let bytes = 0;
            for (const name of snap.names) bytes += (await snap.read(name)).length;
            const keys = await store.keys(`${runId}/`);
            for (const k of keys) if ((await store.read(k)) === null) return { error: `${k} listed but not readable` };
            return { step: snap.meta.step, files: snap.names.length, bytes, keys: keys.length };
          } catch (e) {
            return { error: String(e) };
          } finally {
            await store.close();
          }
        },
        { db: RUN_DB, url: reader.url },
      );
      phase(`read back: ${JSON.stringify(back)}`);
      assert.ok(!('error' in back), `reading the checkpoint back: ${back.error}`);
      assert.equal(back.step, stoppedAt - 1, 'the checkpoint holds the last step before the refused checkpoint');
      assert.ok(
        back.files > 0 && back.bytes < QUOTA && 2 * back.bytes > QUOTA,
        `checkpoint files ${back.files}, ${back.bytes} bytes: one fits the quota, two do not`,
      );
    } finally {
      await context.close();
      reader.remove();
      rmSync(profile, { recursive: true, force: true });
    }
  });
});

describe('the studio page: models from the hub and bad files (Chromium)', () => {
  let server: Awaited<ReturnType<typeof serveWithTinyHub>>;
  before(async () => (server = await serveWithTinyHub()));
  after(async () => server?.close());

  it(
    'downloads a diffusers model from a hub with progress; refuses a bad model file and a bad photo replacement by name; removes a photo',
    { timeout: 300_000 },
    async () => {
      const browser = await launch(true);
      try {
        const page = await browser.newPage({ viewport: { width: 1280, height: 800 } });
        await openStudio(page, server.url);
        // A file that is not a checkpoint: the message names it and says why.
        await page
          .getByLabel('Choose a checkpoint file')
          .setInputFiles({ name: 'holiday.safetensors', mimeType: 'application/octet-stream', buffer: Buffer.from('this is not a safetensors file at all') });
        await page.getByTestId('model-status').filter({ hasText: 'holiday.safetensors' }).waitFor({ timeout: 60_000 });
        assert.match((await page.getByTestId('model-status').textContent()) ?? '', /header length .* out of bounds|not a safetensors/);
        await page
          .getByLabel('Choose a checkpoint file')
          .setInputFiles({ name: 'model.ckpt', mimeType: 'application/octet-stream', buffer: Buffer.from('PK pickle') });
        await page.getByTestId('model-status').filter({ hasText: 'only .safetensors' }).waitFor({ timeout: 60_000 });

        // From the hub (a local server in the HF resolve layout), progress shown while it downloads.
        let sawProgress = false;
        page.on('console', () => undefined);
        const watch = page
          .waitForFunction(() => !!document.querySelector('#dl-progress'), null, { timeout: 60_000 })
          .then(
            () => (sawProgress = true),
            () => undefined,
          );
        await page.getByLabel('Model hub').fill(`${server.url}/hub`);
        await page.getByLabel('Hub model (diffusers layout)').fill('org/tiny-sd');
        await page.getByRole('button', { name: 'Download from the hub' }).click();
        await page.getByTestId('model-status').filter({ hasText: 'Loaded org/tiny-sd' }).waitFor({ timeout: 120_000 });
        await watch;
        assert.ok(sawProgress, 'a download progress bar was shown');
        assert.match((await page.getByTestId('model-status').textContent()) ?? '', /Stable Diffusion 1\.x \(diffusers, epsilon\)/);

        // Photos: add three, remove one, replace one with a non-image (refused, the old photo stays), then with a photo.
        await page.getByLabel('Add photos').setInputFiles(PHOTOS.map((p) => ({ name: p.name, mimeType: p.type, buffer: Buffer.from(p.bytes) })));
        await page.locator('[data-testid="photos"] li').nth(2).waitFor();
        await page.getByRole('button', { name: 'Remove subject-2.png' }).click();
        assert.equal(await page.locator('[data-testid="photos"] li').count(), 2);
        await page
          .getByLabel('Replace photo 1')
          .setInputFiles({ name: 'broken.jpg', mimeType: 'image/jpeg', buffer: Buffer.from([0xff, 0xd8, 0xff, 0xe0, 0, 16]) });
        await page.getByTestId('photo-errors').filter({ hasText: 'broken.jpg' }).waitFor();
        assert.ok(await page.getByRole('img', { name: 'Crop of subject-1.png' }).isVisible(), 'the refused replacement leaves the photo in place');
        await page.getByLabel('Replace photo 1').setInputFiles({ name: 'subject-4.png', mimeType: 'image/png', buffer: Buffer.from(photo(64, 48, 3)) });
        await page.getByRole('img', { name: 'Crop of subject-4.png' }).waitFor();
        assert.equal(await page.locator('[data-testid="photos"] li').count(), 2);
      } finally {
        await browser.close();
      }
    },
  );

  it(
    "an SDXL single file: refused alone (its sizes are not SDXL's), loaded with its config as SDXL, tokenizers from the hub; 2 LoRA steps; Try it",
    { timeout: 900_000 },
    async () => {
      const dir = mkdtempSync(join(tmpdir(), 'dbs-sdxl-e2e-'));
      // The tiny SDXL fixture as an SGM single file, and SDXL base's tokenizer/ and tokenizer_2/ on the hub (the tiny ones).
      const tiny = writeTinySdxl(dir);
      const repo = join(ROOT, 'dist', 'hub', 'stabilityai', 'stable-diffusion-xl-base-1.0', 'resolve', 'main');
      for (const sub of ['tokenizer', 'tokenizer_2']) cpSync(join(tiny.folder, sub), join(repo, sub), { recursive: true });
      const checkpoint = { name: 'tiny-sdxl.safetensors', mimeType: 'application/octet-stream', buffer: readFileSync(tiny.singleFile) };
      const config = { name: 'tiny-sdxl.json', mimeType: 'application/json', buffer: Buffer.from(JSON.stringify(tiny.overrides)) };
      const browser = await launch(true);
      try {
        const page = await browser.newPage({ viewport: { width: 1280, height: 800 } });
        const pageErrors: string[] = [];
        page.on('pageerror', (e) => pageErrors.push(e.message));
        await openStudio(page, server.url);
        await page.getByLabel('Model hub').fill(`${server.url}/hub`);
        const status = page.getByTestId('model-status');
        // Alone: its widths are not SDXL's, so head counts and norm groups cannot be inferred: refused when chosen, named.
        await page.getByLabel('Choose a checkpoint file').setInputFiles(checkpoint);
        await status.filter({ hasText: 'cannot be inferred' }).waitFor({ timeout: 120_000 });
        assert.match((await status.textContent()) ?? '', /tiny-sdxl\.safetensors: a single file holds no configs.*unet attention_head_dim/);
        // With its config (the CLI's --config JSON): SDXL, and the LoRA preset at SDXL's 1024 px.
        await page.getByLabel('Choose a checkpoint file').setInputFiles([checkpoint, config]);
        await status.filter({ hasText: 'Loaded tiny-sdxl.safetensors' }).waitFor({ timeout: 120_000 });
        assert.match((await status.textContent()) ?? '', /Stable Diffusion XL \(single-file, epsilon\), 0\.59 M parameters/);
        await openAdvanced(page);
        assert.equal(await page.getByLabel('Resolution (px)').inputValue(), '1024');

        // 2 LoRA steps at 32 px (the tiny model's factor is 4), then Try it (the worker reads its tokenizers from the hub).
        await page.getByLabel('Add photos').setInputFiles(PHOTOS.slice(0, 2).map((p) => ({ name: p.name, mimeType: p.type, buffer: Buffer.from(p.bytes) })));
        await page.locator('[data-testid="photos"] li').nth(1).waitFor();
        await page.getByLabel('Resolution (px)').fill('32');
        await page.getByLabel('Steps', { exact: true }).fill('2');
        await page.getByLabel('Sample every N steps (0: never)').fill('0');
        await page.getByLabel('Checkpoint every N steps').fill('0');
        await page.getByLabel('Validation loss every N steps (0: never)').fill('0');
        await page.getByLabel('Learning rate').fill('0.01');
        await page.getByRole('button', { name: 'Train', exact: true }).click();
        await page.waitForFunction(() => /Done|Error|refused/i.test(document.querySelector('[data-testid="train-status"]')?.textContent ?? ''), null, {
          timeout: 600_000,
        });
        assert.match((await page.getByTestId('train-status').textContent()) ?? '', /Done/);
        const panel = page.getByTestId('tryit');
        await panel.getByLabel('Try-it prompt').fill('a photo of sks dog');
        await panel.getByLabel('Try-it denoising steps').fill('2');
        await panel.getByLabel('Try-it seed').fill('7');
        await panel.getByRole('button', { name: 'Generate' }).click();
        const result = panel.getByTestId('tryit-result');
        await result.first().waitFor({ timeout: 300_000 });
        const figures = await result
          .locator('figure')
          .evaluateAll((fs) =>
            fs.map((f) => ({ caption: f.querySelector('figcaption')?.textContent, width: (f.querySelector('img') as HTMLImageElement).naturalWidth })),
          );
        assert.deepEqual(
          figures.map((f) => [f.caption, f.width]),
          [
            ['base', 32],
            ['fine-tuned', 32],
          ],
        );
        assert.deepEqual(pageErrors, []);
      } finally {
        await browser.close();
        rmSync(dir, { recursive: true, force: true });
      }
    },
  );
});
