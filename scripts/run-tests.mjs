// Runs test files with node:test, a few at a time, and prints each file's TAP whole when it ends.
//
//   node scripts/run-tests.mjs [--jobs N] [--failures FILE] [--] <file> ...
//
// Files start in the order given (put the longest first). Browser files (under e2e/) run one at a time: each has a
// whole Chromium with SwiftShader to itself and some measure how fast the page answers. While one runs, the other
// slots take Node files; a free slot always takes the next browser file first, since the browser files together
// are the longest chain. A file that uses about one core (most do: small dispatches on lavapipe, or one page's
// pipelines compiled one after another in SwiftShader) leaves the other core to the next file.
// At the end: every file's time, the slowest first, then the failures (scripts/failed-tests-reporter.mjs), so the
// last lines of a log name what failed. Exit status 1 if any file failed.
import { spawn } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

function parse(argv) {
  const o = { jobs: 2, failures: null, files: [] };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === '--jobs') o.jobs = Number(argv[++i]);
    else if (a === '--failures') o.failures = argv[++i];
    else if (a === '--') (o.files.push(...argv.slice(i + 1)), (i = argv.length));
    else o.files.push(a);
  }
  if (!Number.isInteger(o.jobs) || o.jobs < 1) throw new Error(`--jobs must be a whole number of at least 1, not ${o.jobs}`);
  return o;
}

const isBrowser = (f) => /(^|\/)e2e\//.test(f);

function runFile(file, dir, index) {
  const failures = join(dir, `failures-${index}.txt`);
  const args = ['--import', 'tsx', '--test', '--test-reporter=tap', '--test-reporter-destination=stdout'];
  args.push('--test-reporter=./scripts/failed-tests-reporter.mjs', `--test-reporter-destination=${failures}`, file);
  const t0 = Date.now();
  return new Promise((resolve) => {
    const child = spawn(process.execPath, args, { stdio: ['ignore', 'pipe', 'pipe'] });
    const chunks = [];
    child.stdout.on('data', (c) => chunks.push(c));
    child.stderr.on('data', (c) => chunks.push(c));
    child.on('close', (code, signal) => {
      let failed = '';
      try {
        failed = readFileSync(failures, 'utf8');
      } catch {
        // No failures file: the process died before its reporters ran; the exit status says so below.
      }
      resolve({ file, code: code ?? 1, signal, seconds: (Date.now() - t0) / 1000, output: Buffer.concat(chunks).toString(), failed });
    });
  });
}

async function main() {
  const { jobs, failures, files } = parse(process.argv.slice(2));
  const dir = mkdtempSync(join(tmpdir(), 'dbs-tests-'));
  const queue = files.map((file, index) => ({ file, index }));
  const results = [];
  let browserBusy = false;

  const next = () => {
    const b = browserBusy ? -1 : queue.findIndex((q) => isBrowser(q.file));
    const k = b >= 0 ? b : queue.findIndex((q) => !isBrowser(q.file));
    return k < 0 ? undefined : queue.splice(k, 1)[0];
  };
  const waiting = [];
  const wake = () => waiting.splice(0).forEach((resolve) => resolve());
  const worker = async () => {
    for (;;) {
      const item = next();
      if (!item) {
        // Only browser files are left and one is running: wait for it, then look again.
        if (queue.length === 0) return;
        await new Promise((resolve) => waiting.push(resolve));
        continue;
      }
      const browser = isBrowser(item.file);
      if (browser) browserBusy = true;
      const r = await runFile(item.file, dir, item.index);
      if (browser) browserBusy = false;
      wake();
      results.push(r);
      const how = r.signal ? `killed by ${r.signal}` : `exit ${r.code}`;
      process.stdout.write(`# file ${r.file}: ${r.seconds.toFixed(1)} s, ${how}\n${r.output}\n`);
    }
  };
  await Promise.all(Array.from({ length: Math.min(jobs, files.length) }, worker));

  const bad = results.filter((r) => r.code !== 0);
  console.log('# time per file, slowest first:');
  for (const r of [...results].sort((a, b) => b.seconds - a.seconds)) console.log(`#   ${r.seconds.toFixed(1).padStart(7)} s  ${r.file}`);
  const text = bad.map((r) => r.failed || `not ok: ${r.file} ended with ${r.signal ?? `exit ${r.code}`} before reporting\n`).join('\n');
  if (failures) writeFileSync(failures, text);
  rmSync(dir, { recursive: true, force: true });
  console.log(`# ${results.length} files, ${bad.length} failed`);
  process.exitCode = bad.length ? 1 : 0;
}

await main();
