// npm run bench:kernels — builds bench/kernels.html, opens it in headless Chromium (WebGPU on this machine's
// adapter: SwiftShader here) and runs ours, onnxruntime-web (WebGPU EP) and tfjs-webgpu on the SD 1.5 shapes
// of bench/shapes.json in the same page, all timed alike (R back-to-back runs per measurement, median of
// --reps >= 10 measurements). Chromium runs with Dawn's timestamp quantization off and NVIDIA f16 on (the
// flags the README gives users); the results say whether timestamps came out quantized anyway.
// Prints medians and speed ratios, writes bench/results/kernels-<adapter>.json (kernels-swiftshader.json here).
// Flags: --quick (scaled shapes), --reps N (default 10), --naive-reps N (quick: 0, not timed), --target-ms MS (length of
// one measurement, default 50), --budget SECONDS (per variant of ours), --naive-max-mib MIB, --only id,id,
// --out FILE.
import { execFileSync } from 'node:child_process';
import { cpSync, mkdirSync, readdirSync, writeFileSync } from 'node:fs';
import { cpus, loadavg } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';
import { CHROMIUM_FLAGS, serve, WEBGPU_FLAGS } from '../e2e/browser.ts';
import { adapterSlug, compare, comparisonTable, flashTiledVsRows, flashVsNaive, pickLimits, table, timestampsQuantized, type Measurement } from './core.ts';
import { gitCommit } from './git.ts';

const started = performance.now();
const loadAtStart = loadavg();
const here = dirname(fileURLToPath(import.meta.url));
const root = join(here, '..');
const args = process.argv.slice(2);
const arg = (name: string) => (args.includes(name) ? args[args.indexOf(name) + 1] : undefined);
const quick = args.includes('--quick');
const reps = Number(arg('--reps')) || 10;
// Naive attention is issue 2's baseline, not a peer: --quick does not time it unless --naive-reps N asks.
const naiveReps = arg('--naive-reps') !== undefined ? Number(arg('--naive-reps')) : quick ? 0 : reps;
const targetMs = Number(arg('--target-ms')) || 50;
const budgetMs = (Number(arg('--budget')) || 600) * 1000;
// Naive attention at 8x4096x4096 holds 512 MiB of f32 scores and would take ~20 min a run on
// SwiftShader: by default it is not timed past 256 MiB of scores (its peak is still planned).
const naiveMaxScoreBytes = (Number(arg('--naive-max-mib')) || 256) * 2 ** 20;
const only = arg('--only')?.split(',');
const commit = gitCommit();

/**
 * Dawn switches for the benchmark's Chromium (the ones the README gives users; WEBGPU_FLAGS has
 * --enable-unsafe-webgpu, which offers experimental features such as subgroup matrices): timestamps at full
 * resolution, shader-f16 on NVIDIA's Vulkan driver.
 */
const DAWN_SWITCHES = ['--enable-dawn-features=vulkan_enable_f16_on_nvidia', '--disable-dawn-features=timestamp_quantization'];

execFileSync('npx', ['vite', 'build', '-c', join(here, 'vite.config.ts'), '--logLevel', 'warn'], { cwd: root, stdio: 'inherit' });
const ortDist = join(root, 'node_modules', 'onnxruntime-web', 'dist');
mkdirSync(join(here, 'dist', 'ort'), { recursive: true });
for (const f of readdirSync(ortDist)) if (/^ort-wasm.*\.(wasm|mjs)$/.test(f)) cpSync(join(ortDist, f), join(here, 'dist', 'ort', f));

const server = await serve(join(here, 'dist'), 'bench/kernels.html');
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM_PATH ?? '/usr/bin/chromium',
  headless: true,
  args: [...CHROMIUM_FLAGS, ...WEBGPU_FLAGS, ...DAWN_SWITCHES],
});
try {
  const page = await browser.newPage();
  page.on('console', (m) => console.log(`[page] ${m.text()}`));
  await page.goto(`${server.url}/bench/kernels.html`);
  await page.waitForFunction(() => (window as unknown as { __bench?: unknown }).__bench !== undefined, null, { timeout: 60_000 });
  page.setDefaultTimeout(0);
  const logged = new Set<string>();
  const poll = setInterval(() => {
    void page
      .evaluate(() => document.getElementById('log')?.textContent ?? '')
      .then((text) => {
        for (const line of text.split('\n')) if (line && !logged.has(line) && logged.add(line)) console.log(`  ${line}`);
      })
      .catch(() => undefined);
  }, 2000);
  const res = (await page.evaluate((o) => (window as unknown as { __bench: { run: (x: unknown) => Promise<unknown> } }).__bench.run(o), {
    size: quick ? 'quick' : 'full',
    reps,
    naiveReps,
    targetMs,
    budgetMs,
    naiveMaxScoreBytes,
    only,
  })) as {
    adapter: { vendor: string; architecture: string; device: string; description: string; features: string[]; limits: Record<string, number> };
    computeDType: string;
    results: Measurement[];
    errors: string[];
    rawNs: number[];
  };
  clearInterval(poll);
  const adapter = `${res.adapter.vendor} ${res.adapter.architecture} ${res.adapter.device} ${res.adapter.description}`.replace(/\s+/g, ' ').trim();
  console.log(`\nadapter: ${adapter} (Chromium ${browser.version()}); ours in ${res.computeDType}, peers in f32; commit ${commit}\n`);
  console.log(table(res.results));
  // onnxruntime-web runs inference graphs: the attention backward has no peer there but tfjs (tf.grads).
  const cases = compare(res.results, false, { 'onnxruntime-web (webgpu) fwd+bwd': 'inference only: no backward' });
  console.log(`\n${comparisonTable(cases)}\n`);
  const flashNaive = flashVsNaive(res.results);
  for (const [k, v] of Object.entries(flashNaive)) console.log(`${k}: ${typeof v === 'number' ? v.toFixed(2) : v}`);
  const tiledVsRows = flashTiledVsRows(res.results);
  for (const [k, v] of Object.entries(tiledVsRows)) console.log(`${k}: ${v.toFixed(2)}`);
  for (const e of res.errors) console.log(`error: ${e}`);
  const quantized = timestampsQuantized(res.rawNs);
  const seconds = (performance.now() - started) / 1000;
  console.log(`timestamps quantized: ${quantized ?? 'no timestamps'} (${res.rawNs.length} measurements); ${seconds.toFixed(0)} s`);
  const out = arg('--out') ?? join(here, 'results', `kernels-${adapterSlug(res.adapter)}.json`);
  mkdirSync(dirname(out), { recursive: true });
  writeFileSync(
    out,
    JSON.stringify(
      {
        date: new Date().toISOString(),
        commit,
        machine: {
          cpus: cpus().length,
          loadAverage1mAtStart: loadAtStart[0],
          loadAverage1mAtEnd: loadavg()[0],
          note: 'load averages above the core count mean other work shared the CPU: timings are then noisy',
        },
        host: `chromium ${browser.version()}`,
        chromiumSwitches: DAWN_SWITCHES,
        adapter,
        features: res.adapter.features,
        limits: pickLimits(res.adapter.limits),
        dtype: res.computeDType,
        peersDtype: 'f32',
        shapes: quick ? 'quick' : 'full',
        reps,
        naiveReps,
        targetMsPerMeasurement: targetMs,
        timestamps: { quantized, measurements: res.rawNs.length, check: 'quantized = every raw timestamp duration a multiple of 65.536 us' },
        method:
          'everyone: R back-to-back runs per measurement (R fills targetMsPerMeasurement, at least 1), submit to queue completion, divided by R; median of reps measurements; compared on that wall time. Ours also: GPU timestamps around its R runs (gpuMs)',
        seconds: Math.round(seconds),
        cases,
        flashVsNaive: flashNaive,
        flashTiledVsRows: tiledVsRows,
        results: res.results,
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
