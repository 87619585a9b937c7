// Shared e2e plumbing: serve the built dist/ on 127.0.0.1 and launch Debian's headless Chromium
// with WebGPU on SwiftShader (no shader-f16 there, so pages exercise the f32 path).
import { createReadStream, existsSync, mkdirSync, statSync } from 'node:fs';
import { createServer, type Server } from 'node:http';
import { extname, join, normalize, resolve } from 'node:path';
import { chromium, type Browser, type Page } from 'playwright-core';

export const ROOT = join(import.meta.dirname, '..');
/**
 * Where the e2e tests save their screenshots: test-results/screenshots/ (git-ignored) by default, so
 * `npm test` leaves the working tree as it was. `npm run screenshots` sets SCREENSHOTS_DIR=e2e/screenshots
 * to refresh the committed ones the README shows. A relative SCREENSHOTS_DIR is from the repository root.
 */
export const SCREENSHOTS = resolve(ROOT, process.env.SCREENSHOTS_DIR || join('test-results', 'screenshots'));

/** The path to save screenshot `file` at, in SCREENSHOTS (created when missing). */
export function screenshotPath(file: string): string {
  mkdirSync(SCREENSHOTS, { recursive: true });
  return join(SCREENSHOTS, file);
}

const TYPES: Record<string, string> = {
  '.html': 'text/html',
  '.js': 'text/javascript',
  '.mjs': 'text/javascript',
  '.css': 'text/css',
  '.wasm': 'application/wasm',
  '.json': 'application/json',
  '.png': 'image/png',
  '.svg': 'image/svg+xml',
};

/** Serves `dir` on a free loopback port. */
export async function serve(dir = join(ROOT, 'dist'), entry = 'index.html'): Promise<{ url: string; close: () => Promise<void> }> {
  if (!existsSync(join(dir, entry))) throw new Error(`${dir}/${entry} is missing: run 'npx vite build' first (npm test does)`);
  const server: Server = createServer((req, res) => {
    const path = normalize(decodeURIComponent(new URL(req.url ?? '/', 'http://x').pathname)).replace(/^(\.\.[/\\])+/, '');
    let file = join(dir, path);
    if (!file.startsWith(dir) || !existsSync(file) || statSync(file).isDirectory()) {
      // Page routes fall back to the entry page; a missing file (anything with an extension) is a 404.
      if (extname(path)) {
        res.writeHead(404).end();
        return;
      }
      file = join(dir, entry);
    }
    res.writeHead(200, { 'content-type': TYPES[extname(file)] ?? 'application/octet-stream' });
    createReadStream(file).pipe(res);
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  const addr = server.address();
  const port = typeof addr === 'object' && addr ? addr.port : 0;
  return { url: `http://127.0.0.1:${port}`, close: () => new Promise((r) => server.close(() => r())) };
}

export const CHROMIUM_FLAGS = [
  '--no-sandbox',
  '--disable-background-networking',
  '--disable-component-update',
  '--disable-sync',
  '--no-first-run',
  '--disable-quic',
];

// Measured with Debian's Chromium 156 headless on a machine with no GPU: --enable-unsafe-webgpu alone gives
// the SwiftShader adapter (google/swiftshader, no shader-f16, 1 GiB buffers); without it requestAdapter()
// returns null. --enable-unsafe-swiftshader keeps the software fallback allowed in Chromium versions that
// gate it, and --use-angle=swiftshader keeps the page's WebGL/compositing off any host GPU driver.
export const WEBGPU_FLAGS = ['--enable-unsafe-webgpu', '--enable-unsafe-swiftshader', '--use-angle=swiftshader'];

export async function launch(webgpu = true): Promise<Browser> {
  const exe = process.env.CHROMIUM_PATH ?? '/usr/bin/chromium';
  if (!existsSync(exe)) throw new Error(`${exe} not found: npm test installs Debian's chromium (scripts/ensure-deps.sh --browser)`);
  return chromium.launch({
    executablePath: exe,
    headless: true,
    // playwright-core gives each launch a fresh, temporary user-data-dir (removed at close).
    args: [...CHROMIUM_FLAGS, ...(webgpu ? WEBGPU_FLAGS : ['--disable-webgpu'])],
  });
}

/**
 * Serves dist/ with the tiny test model published as a hub repo at /hub/org/tiny-sd (diffusers layout,
 * the HF resolve URL scheme), for page tests that download a model. `close` removes it again.
 */
export async function serveWithTinyHub(): Promise<{ url: string; close: () => Promise<void>; folder: string }> {
  const { cpSync, mkdirSync, mkdtempSync, rmSync } = await import('node:fs');
  const { tmpdir } = await import('node:os');
  const { writeTinyModel } = await import('../tests/fixtures/models/make-tiny.ts');
  const tiny = writeTinyModel(mkdtempSync(join(tmpdir(), 'dbs-hub-e2e-')));
  const hub = join(ROOT, 'dist', 'hub');
  rmSync(hub, { recursive: true, force: true });
  const repo = join(hub, 'org', 'tiny-sd', 'resolve', 'main');
  mkdirSync(repo, { recursive: true });
  cpSync(tiny.folder, repo, { recursive: true });
  const server = await serve();
  return {
    url: server.url,
    folder: tiny.folder,
    close: async () => {
      await server.close();
      rmSync(hub, { recursive: true, force: true });
    },
  };
}

/** Opens the studio's demo model ("Use the demo model") and waits until it has loaded. */
export async function useDemoModel(page: Page): Promise<void> {
  await page.getByRole('button', { name: 'Use the demo model' }).click({ timeout: 60_000 });
  await page.getByTestId('model-status').filter({ hasText: 'Loaded demo-sd1-small' }).waitFor({ timeout: 60_000 });
}

/** Opens the studio's "Advanced settings" section unless it is open already (a click on an open one closes it). */
export async function openAdvanced(page: Page): Promise<void> {
  if (
    !(await page
      .locator('details')
      .first()
      .evaluate((d) => (d as HTMLDetailsElement).open))
  )
    await page.getByText('Advanced settings').click();
}

/** Drops PNG files on the studio's photo area, as a drag from the desktop would. */
export async function dropPngs(page: Page, files: { name: string; bytes: number[] }[]): Promise<void> {
  const dataTransfer = await page.evaluateHandle((fs) => {
    const d = new DataTransfer();
    for (const f of fs) d.items.add(new File([new Uint8Array(f.bytes)], f.name, { type: 'image/png' }));
    return d;
  }, files);
  await page.getByTestId('photo-drop').dispatchEvent('drop', { dataTransfer });
}

/** A downloaded safetensors file's tensor names and `__metadata__`, read from its JSON header. */
export function safetensorsHeader(bytes: Buffer): { names: string[]; metadata: Record<string, string> } {
  const n = Number(bytes.readBigUInt64LE(0));
  const json = JSON.parse(bytes.subarray(8, 8 + n).toString('utf8')) as Record<string, unknown>;
  const { __metadata__, ...tensors } = json;
  return { names: Object.keys(tensors), metadata: (__metadata__ ?? {}) as Record<string, string> };
}
