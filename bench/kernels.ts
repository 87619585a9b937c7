// npm run bench:kernels — builds bench/kernels.html, opens it in headless Chromium (WebGPU on this
// machine's adapter: SwiftShader here), runs ours, onnxruntime-web (WebGPU EP) and tfjs-webgpu on the
// SD1.5 shapes in the same page, prints the table and the target ratios, and writes
// bench/results/kernels.json (kernels-quick.json with --quick). Flags: --quick, --reps N,
// --budget SECONDS (per case and implementation), --naive-max-mib MIB, --only id,id, --out FILE.
import { execFileSync } from 'node:child_process';
import { cpSync, mkdirSync, readdirSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { launch, serve } from '../e2e/browser.ts';
import { pickLimits, summarise, table, type Measurement } from './core.ts';

const here = dirname(fileURLToPath(import.meta.url));
const root = join(here, '..');
const args = process.argv.slice(2);
const arg = (name: string) => (args.includes(name) ? args[args.indexOf(name) + 1] : undefined);
const quick = args.includes('--quick');
const reps = Number(arg('--reps')) || 3;
const budgetMs = (Number(arg('--budget')) || 300) * 1000;
// Naive attention at 8x4096x4096 holds 512 MiB of f32 scores and would take ~20 min a run on
// SwiftShader: by default it is not timed past 256 MiB of scores (its peak is still planned).
const naiveMaxScoreBytes = (Number(arg('--naive-max-mib')) || 256) * 2 ** 20;
const only = arg('--only')?.split(',');

execFileSync('npx', ['vite', 'build', '-c', join(here, 'vite.config.ts'), '--logLevel', 'warn'], { cwd: root, stdio: 'inherit' });
const ortDist = join(root, 'node_modules', 'onnxruntime-web', 'dist');
mkdirSync(join(here, 'dist', 'ort'), { recursive: true });
for (const f of readdirSync(ortDist)) if (/^ort-wasm.*\.(wasm|mjs)$/.test(f)) cpSync(join(ortDist, f), join(here, 'dist', 'ort', f));

const server = await serve(join(here, 'dist'), 'bench/kernels.html');
const browser = await launch(true);
try {
  const page = await browser.newPage();
  page.on('console', (m) => console.log(`[page] ${m.text()}`));
  await page.goto(`${server.url}/bench/kernels.html`);
  await page.waitForFunction(() => (window as unknown as { __bench?: unknown }).__bench !== undefined, null, { timeout: 60_000 });
  const res = (await page.evaluate((o) => (window as unknown as { __bench: { run: (x: unknown) => Promise<unknown> } }).__bench.run(o), {
    size: quick ? 'quick' : 'full',
    reps,
    budgetMs,
    naiveMaxScoreBytes,
    only,
  })) as {
    adapter: { vendor: string; architecture: string; description: string; features: string[]; limits: Record<string, number> };
    computeDType: string;
    results: Measurement[];
    errors: string[];
  };
  const adapter = `${res.adapter.vendor} ${res.adapter.architecture} ${res.adapter.description}`.trim();
  console.log(`\nadapter: ${adapter} (Chromium ${browser.version()}); ours in ${res.computeDType}, peers in f32\n`);
  console.log(table(res.results));
  const summary = summarise(res.results);
  console.log('');
  for (const [k, v] of Object.entries(summary)) console.log(`${k}: ${typeof v === 'number' ? v.toFixed(2) : v}`);
  for (const e of res.errors) console.log(`error: ${e}`);
  const out = arg('--out') ?? join(here, 'results', quick ? 'kernels-quick.json' : 'kernels.json');
  mkdirSync(dirname(out), { recursive: true });
  writeFileSync(
    out,
    JSON.stringify(
      {
        date: new Date().toISOString(),
        host: `chromium ${browser.version()}`,
        adapter,
        features: res.adapter.features,
        limits: pickLimits(res.adapter.limits),
        computeDType: res.computeDType,
        shapes: quick ? 'quick' : 'full',
        reps,
        results: res.results,
        summary,
        errors: res.errors,
      },
      null,
      2,
    ),
  );
  console.log(`wrote ${out}`);
} finally {
  await browser.close();
  await server.close();
}
