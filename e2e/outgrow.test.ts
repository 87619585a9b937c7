// Issue 17 in the studio (headless Chromium, SwiftShader, demo model): "Download job bundle" saves a zip with
// the photos cropped at the training resolution, train.sh / ray_train.py / README / job.json (the demo model
// named as one to replace); "Bring results back" takes a LoRA in diffusers' training-script layout
// (unet.<module>.lora.down/up + .alpha) made for the demo model, draws an image with it ("Try it") and
// exports it as a kohya file; the loaded (diffusers-layout) model alone exports as a single file; a LoRA for
// SDXL is refused naming its key.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { decode, encode } from 'fast-png';
import { crc32 } from '../tests/fixtures/images/craft.ts';
import type { Page } from 'playwright-core';
import { writeSafetensors, readSafetensors, type NamedTensor } from '../src/io/safetensors.ts';
import { dropPngs, launch, ROOT, screenshotPath, serve } from './browser.ts';

/** Entries of a zip whose entries are stored (client-zip): read through the central directory. */
function unzip(bytes: Buffer): Map<string, Buffer> {
  const eocd = bytes.lastIndexOf(Buffer.from([0x50, 0x4b, 0x05, 0x06]));
  const count = bytes.readUInt16LE(eocd + 10);
  let p = bytes.readUInt32LE(eocd + 16);
  const out = new Map<string, Buffer>();
  for (let i = 0; i < count; i++) {
    assert.equal(bytes.readUInt32LE(p), 0x02014b50, 'central directory entry');
    const [method, size, nameLen, extraLen, commentLen, local] = [
      bytes.readUInt16LE(p + 10),
      bytes.readUInt32LE(p + 20),
      bytes.readUInt16LE(p + 28),
      bytes.readUInt16LE(p + 30),
      bytes.readUInt16LE(p + 32),
      bytes.readUInt32LE(p + 42),
    ];
    assert.equal(method, 0, 'stored');
    const name = bytes.subarray(p + 46, p + 46 + nameLen).toString('utf8');
    const start = local + 30 + bytes.readUInt16LE(local + 26) + bytes.readUInt16LE(local + 28);
    out.set(name, bytes.subarray(start, start + size));
    p += 46 + nameLen + extraLen + commentLen;
  }
  return out;
}

function photo(w: number, h: number, k: number): number[] {
  const data = new Uint8Array(w * h * 3);
  for (let i = 0; i < w * h; i++) data.set([(i * 7 + 60 * k) % 256, (i * 3) % 256, 100], 3 * i);
  return [...encode({ width: w, height: h, data, channels: 3, depth: 8 })];
}

/**
 * A LoRA for the demo model's UNet in the layout diffusers' train_dreambooth_lora.py writes (old spelling +
 * alphas): its keys and shapes from the UNet the page loads, the shipped public/demo-model/ (fp16 on disk).
 */
function demoLora(): Buffer {
  const unet = readSafetensors(readFileSync(join(ROOT, 'public', 'demo-model', 'unet', 'diffusion_pytorch_model.safetensors'))).tensors;
  const out = new Map<string, NamedTensor>();
  let seed = 1;
  const rand = () => ((seed = (seed * 16807) % 2147483647) / 2147483647 - 0.5) * 0.6;
  for (const [n, t] of unet) {
    const m = /^(.*\.attn[12]\.(?:to_q|to_k|to_v|to_out\.0))\.weight$/.exec(n);
    if (!m) continue;
    const [o, i] = t.shape;
    out.set(`unet.${m[1]}.lora.down.weight`, { shape: [4, i], data: Float32Array.from({ length: 4 * i }, rand) });
    out.set(`unet.${m[1]}.lora.up.weight`, { shape: [o, 4], data: Float32Array.from({ length: o * 4 }, rand) });
    out.set(`unet.${m[1]}.alpha`, { shape: [], data: Float32Array.of(4) });
  }
  return Buffer.from(writeSafetensors(out));
}

/**
 * Every record of every IndexedDB database of the page, keyed database/store/key; Blobs and binary values as
 * their size and SHA-256, so two dumps are equal exactly when the stored bytes are.
 */
function dumpIndexedDb(page: Page): Promise<Record<string, unknown>> {
  return page.evaluate(async () => {
    const done = <T>(q: IDBRequest<T>) =>
      new Promise<T>((res, rej) => {
        q.onsuccess = () => res(q.result);
        q.onerror = () => rej(q.error);
      });
    const digest = async (b: ArrayBuffer) =>
      Array.from(new Uint8Array(await crypto.subtle.digest('SHA-256', b)), (x) => x.toString(16).padStart(2, '0')).join('');
    const bytesOf = async (v: unknown): Promise<unknown> => {
      if (v instanceof Blob) return `blob ${v.size} ${await digest(await v.arrayBuffer())}`;
      if (v instanceof ArrayBuffer) return `bytes ${v.byteLength} ${await digest(v)}`;
      if (ArrayBuffer.isView(v)) return `bytes ${v.byteLength} ${await digest(v.buffer.slice(v.byteOffset, v.byteOffset + v.byteLength) as ArrayBuffer)}`;
      if (Array.isArray(v)) return Promise.all(v.map(bytesOf));
      if (v && typeof v === 'object') return Object.fromEntries(await Promise.all(Object.entries(v).map(async ([k, x]) => [k, await bytesOf(x)])));
      return v;
    };
    const out: Record<string, unknown> = {};
    for (const { name } of await indexedDB.databases()) {
      const db = await done(indexedDB.open(name!));
      for (const store of Array.from(db.objectStoreNames)) {
        const st = db.transaction(store).objectStore(store);
        const [keys, values] = await Promise.all([done(st.getAllKeys()), done(st.getAll())]);
        for (let i = 0; i < keys.length; i++) out[`${name}/${store}/${JSON.stringify(keys[i])}`] = await bytesOf(values[i]);
      }
      db.close();
    }
    return out;
  });
}

/** The dump once nothing has changed for `quietMs` (the page saves its project 0.5 s after a change). */
async function settledDump(page: Page, quietMs = 1500): Promise<Record<string, unknown>> {
  let last = await dumpIndexedDb(page);
  for (;;) {
    await page.waitForTimeout(quietMs);
    const now = await dumpIndexedDb(page);
    if (JSON.stringify(now) === JSON.stringify(last)) return now;
    last = now;
  }
}

async function download(page: Page, click: () => Promise<void>): Promise<{ name: string; bytes: Buffer }> {
  const [d] = await Promise.all([page.waitForEvent('download', { timeout: 300_000 }), click()]);
  const path = await d.path();
  return { name: d.suggestedFilename(), bytes: readFileSync(path!) };
}

describe('studio: bigger machines (Chromium, SwiftShader, demo model)', () => {
  let server: Awaited<ReturnType<typeof serve>>;
  before(async () => (server = await serve()));
  after(async () => server?.close());

  it('a refused photo, class image, LoRA or model file leaves every IndexedDB byte as it was', { timeout: 120_000 }, async () => {
    const browser = await launch(true);
    try {
      const page = await browser.newPage();
      const pageErrors: string[] = [];
      page.on('pageerror', (e) => pageErrors.push(e.message));
      // tsx (esbuild keepNames) wraps the dump's named helpers in a Node-only __name(): the page gets a no-op one.
      await page.addInitScript('window.__name = (f) => f;');
      await page.goto(server.url);
      await page.getByRole('button', { name: 'Use the demo model' }).waitFor({ timeout: 60_000 });
      await dropPngs(page, [{ name: 'good.png', bytes: photo(40, 40, 0) }]);
      await page.getByText('good.png').first().waitFor({ timeout: 30_000 });
      const before = await settledDump(page);
      assert.ok(
        Object.values(before).some((v) => typeof v === 'string' && v.startsWith('blob ')),
        'the good photo is stored (the dump reads Blobs)',
      );

      // Photos: text named .png, a PNG cut short, a PNG declaring 7000x7000 over 200 bytes of data.
      const good = photo(40, 40, 0);
      const bomb = Buffer.from(good);
      bomb.writeUInt32BE(7000, 16);
      bomb.writeUInt32BE(7000, 20);
      bomb.writeUInt32BE(crc32(bomb.subarray(12, 29)), 29);
      const bad = [
        { name: 'notes.png', bytes: [...Buffer.from('not a photo\n')] },
        { name: 'cut.png', bytes: good.slice(0, 60) },
        { name: 'bomb.png', bytes: [...bomb] },
      ];
      await dropPngs(page, bad);
      for (const b of bad) await page.getByTestId('photo-errors').filter({ hasText: b.name }).waitFor({ timeout: 30_000 });
      await page
        .locator('input[type="file"][multiple]')
        .last()
        .setInputFiles({ name: 'class.png', mimeType: 'image/png', buffer: Buffer.from('<html>') });
      await page.getByTestId('photo-errors').filter({ hasText: 'class.png' }).waitFor({ timeout: 30_000 });
      // A LoRA that is not safetensors, and a model file whose header is cut short.
      await page
        .locator('input[name="imported-lora"]')
        .setInputFiles({ name: 'lora.safetensors', mimeType: 'application/octet-stream', buffer: Buffer.from('PK\x03\x04 a zip') });
      await page.getByRole('alert').filter({ hasText: 'lora.safetensors' }).waitFor({ timeout: 30_000 });
      const model = Buffer.concat([Buffer.from([40, 0, 0, 0, 0, 0, 0, 0]), Buffer.from('{"a":{"dtype":"F32","shape":[1],"data_o')]);
      await page.getByLabel('Choose a checkpoint file').setInputFiles({ name: 'model.safetensors', mimeType: 'application/octet-stream', buffer: model });
      await page.getByTestId('model-status').filter({ hasText: 'model.safetensors' }).waitFor({ timeout: 30_000 });

      assert.deepEqual(await settledDump(page), before);
      // The control: an accepted photo does change what is stored (the comparison can fail).
      await dropPngs(page, [{ name: 'second.png', bytes: photo(40, 40, 1) }]);
      await page.getByText('second.png').first().waitFor({ timeout: 30_000 });
      assert.notDeepEqual(await settledDump(page), before);
      assert.deepEqual(pageErrors, []);
    } finally {
      await browser.close();
    }
  });

  it('downloads a job bundle; tries and exports a LoRA trained elsewhere; refuses an SDXL LoRA by key', { timeout: 900_000 }, async () => {
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
          { name: 'dog-1.png', bytes: photo(48, 40, 0) },
          { name: 'dog-2.png', bytes: photo(40, 40, 1) },
        ],
      );
      await page.getByTestId('photo-drop').dispatchEvent('drop', { dataTransfer: dt });
      await page.getByText('dog-2.png').first().waitFor({ timeout: 60_000 });

      // The panel's controls are labelled, nothing is cut off at 1280 px, and nothing is wider than a phone.
      const panel = page.locator('section[aria-labelledby="outgrow-title"]');
      const unlabelled = await panel.evaluate((sec) =>
        [...sec.querySelectorAll('input, select, button')]
          .filter((el) => !((el as HTMLInputElement).labels?.length || el.getAttribute('aria-label') || (el.tagName === 'BUTTON' && el.textContent?.trim())))
          .map((el) => el.outerHTML.slice(0, 80)),
      );
      assert.deepEqual(unlabelled, []);
      const cut = await panel.evaluate((sec) => {
        const ctx = document.createElement('canvas').getContext('2d')!;
        return [...sec.querySelectorAll<HTMLInputElement | HTMLSelectElement>('input[type="text"], select')]
          .filter((el) => {
            const cs = getComputedStyle(el);
            ctx.font = `${cs.fontWeight} ${cs.fontSize} ${cs.fontFamily}`;
            const texts = el instanceof HTMLSelectElement ? [...el.options].map((o) => o.text) : [el.value];
            const room = el.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight) - (el instanceof HTMLSelectElement ? 20 : 0);
            return Math.max(...texts.map((t) => ctx.measureText(t).width)) > room;
          })
          .map((el) => el.getAttribute('name'));
      });
      assert.deepEqual(cut, [], 'no field of the panel cut off at 1280 px');
      await page.setViewportSize({ width: 390, height: 844 });
      const overflow = await page.evaluate(() => document.documentElement.scrollWidth - document.documentElement.clientWidth);
      assert.ok(overflow <= 1, `no horizontal scrolling at phone width (${overflow} px)`);
      await page.setViewportSize({ width: 1280, height: 800 });

      // The job bundle.
      const zip = await download(page, () => page.getByRole('button', { name: 'Download job bundle (.zip)' }).click());
      assert.equal(zip.name, 'dreambooth-job.zip');
      const files = unzip(zip.bytes);
      const names = [...files.keys()].sort();
      for (const n of [
        'README.md',
        'job.json',
        'prompts.jsonl',
        'ray_train.py',
        'requirements.txt',
        'train.sh',
        'instance_images/001-dog-1.png',
        'instance_images/002-dog-2.png',
      ])
        assert.ok(names.includes(`dreambooth-job/${n}`), `${n} in ${names.join(', ')}`);
      const job = JSON.parse(files.get('dreambooth-job/job.json')!.toString('utf8'));
      assert.equal(job.model.kind, 'demo');
      const img = decode(files.get('dreambooth-job/instance_images/001-dog-1.png')!);
      assert.deepEqual([img.width, img.height], [job.settings.resolution, job.settings.resolution], 'cropped to the training square');
      assert.match(files.get('dreambooth-job/train.sh')!.toString('utf8'), /accelerate launch "\$DIFFUSERS_EXAMPLES\/train_dreambooth_lora\.py"/);
      assert.match(
        files.get('dreambooth-job/README.md')!.toString('utf8'),
        /\*\*Provide it:\*\* the studio's demo model ships with the studio \(public\/demo-model\//,
      );

      // A LoRA from diffusers' script layout: Try it, then export as kohya.
      await page
        .locator('input[name="imported-lora"]')
        .setInputFiles({ name: 'pytorch_lora_weights.safetensors', mimeType: 'application/octet-stream', buffer: demoLora() });
      await page.getByLabel('Try-it steps').fill('2');
      await page.getByRole('button', { name: 'Try it' }).click();
      await page.getByTestId('imported-sample').waitFor({ timeout: 600_000 });
      const size = await page.getByTestId('imported-sample').evaluate(async (el) => {
        const im = el as HTMLImageElement;
        await im.decode();
        return [im.naturalWidth, im.naturalHeight];
      });
      assert.ok(size[0] > 0 && size[0] === size[1], `a square image (${size})`);
      await page.getByLabel('Export as').selectOption('lora-kohya');
      const kohya = await download(page, () => page.getByRole('button', { name: 'Export the imported result' }).click());
      const n = Number(kohya.bytes.readBigUInt64LE(0));
      const keys = Object.keys(JSON.parse(kohya.bytes.subarray(8, 8 + n).toString('utf8'))).filter((k) => k !== '__metadata__');
      assert.ok(keys.length > 0 && keys.every((k) => k.startsWith('lora_unet_')), keys.slice(0, 3).join(', '));
      await page.screenshot({ path: screenshotPath('studio-outgrow.png'), fullPage: true });

      // No LoRA: the loaded model itself (a diffusers folder: what train_dreambooth.py writes) as one file.
      await page.locator('input[name="imported-lora"]').setInputFiles([]);
      await page.getByLabel('Export as').selectOption('full-single-file');
      const full = await download(page, () => page.getByRole('button', { name: 'Export the imported result' }).click());
      const fn = Number(full.bytes.readBigUInt64LE(0));
      const fullKeys = Object.keys(JSON.parse(full.bytes.subarray(8, 8 + fn).toString('utf8')));
      assert.ok(
        fullKeys.some((k) => k.startsWith('model.diffusion_model.')) && fullKeys.some((k) => k.startsWith('first_stage_model.')),
        'a single-file checkpoint',
      );

      // An SDXL LoRA is refused by key, the moment it is chosen.
      const sdxl = Buffer.from(
        writeSafetensors(new Map([['lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight', { shape: [4, 8], data: new Float32Array(32) }]])),
      );
      await page.locator('input[name="imported-lora"]').setInputFiles({ name: 'sdxl.safetensors', mimeType: 'application/octet-stream', buffer: sdxl });
      await page
        .getByRole('alert')
        .filter({ hasText: "'lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight' is a key of a LoRA for SDXL" })
        .waitFor({ timeout: 60_000 });
      assert.deepEqual(pageErrors, []);
    } finally {
      await browser.close();
    }
  });
});
