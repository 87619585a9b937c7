// Runs test files with node:test, a few at a time, and prints each file's TAP whole when it ends.
//
//   node scripts/run-tests.mjs [--jobs N] [--failures FILE] [--node-option ARG]... [--] <file> ...
//
// --node-option passes ARG to every file's node (one per option: `--node-option --test-name-pattern --node-option norm`).
//
// Files start in the order given (put the longest first). Browser files (under e2e/) run one at a time while Node
// files are waiting: each has a whole Chromium with SwiftShader, and some measure how fast the page answers. While
// one runs, the other slots take Node files; a free slot always takes the next browser file first, since the browser
// files together are the longest chain. Once no Node file is waiting, a free slot takes the next browser file even
// while another runs, so the chain's tail is not one file alone on a machine with a core idle. A file uses about one
// core (small dispatches on lavapipe, or one page's pipelines compiled one after another in SwiftShader's GPU
// process), so two files at a time keep two cores busy: a browser file beside another meets the same load as beside
// a Node file.
// At the end: every file's time, the slowest first, then the failures (scripts/failed-tests-reporter.mjs), so the
// last lines of a log name what failed. Exit status 1 if any file failed.
import { spawn } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

function parse(argv) {
  const o = { jobs: 2, failures: null, nodeOptions: [], files: [] };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === '--jobs') o.jobs = Number(argv[++i]);
    else if (a === '--failures') o.failures = argv[++i];
    else if (a === '--node-option') o.nodeOptions.push(argv[++i]);
    else if (a === '--') (o.files.push(...argv.slice(i + 1)), (i = argv.length));
    else o.files.push(a);
  }
  if (!Number.isInteger(o.jobs) || o.jobs < 1) throw new Error(`--jobs must be a whole number of at least 1, not ${o.jobs}`);
  return o;
}

const isBrowser = (f) => /(^|\/)e2e\//.test(f);

function runFile(file, dir, index, nodeOptions) {
  const failures = join(dir, `failures-${index}.txt`);
  const args = ['--import', 'tsx', '--test', '--test-reporter=tap', '--test-reporter-destination=stdout'];
  args.push('--test-reporter=./scripts/failed-tests-reporter.mjs', `--test-reporter-destination=${failures}`, ...nodeOptions, file);
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
  const { jobs, failures, nodeOptions, files } = parse(process.argv.slice(2));
  const dir = mkdtempSync(join(tmpdir(), 'dbs-tests-'));
  const queue = files.map((file, index) => ({ file, index }));
  const results = [];
  let browsersRunning = 0;

  // The next file for a free slot: a browser file when none runs, else a Node file, else (no Node file waiting) a
  // browser file beside the running one.
  const next = () => {
    const b = queue.findIndex((q) => isBrowser(q.file));
    const n = queue.findIndex((q) => !isBrowser(q.file));
    const k = b >= 0 && (browsersRunning === 0 || n < 0) ? b : n;
    return k < 0 ? undefined : queue.splice(k, 1)[0];
  };
  const worker = async () => {
    for (;;) {
      const item = next();
      if (!item) return;
      const browser = isBrowser(item.file);
      if (browser) browsersRunning++;
      const r = await runFile(item.file, dir, item.index, nodeOptions);
      if (browser) browsersRunning--;
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
