// The bad-input corpus's machinery: a workspace of real inputs (the tiny model in both layouts, photos, a
// trained run folder), the command line run as a user runs it, and the checks every refusal must pass:
// the exit code, the expected message, no internal wording (stack traces, JS error names, kernel uniforms),
// a time limit (a hang fails), and nothing changed on disk where the case says so.
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import { copyFileSync, existsSync, lstatSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, readlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { writeTinyModel, type TinyModel } from '../fixtures/models/make-tiny.ts';
import { cliArgs } from '../cli.ts';
import { FIXTURES } from '../helpers.ts';

export const root = join(dirname(fileURLToPath(import.meta.url)), '..', '..');

export interface Workspace {
  dir: string;
  tiny: TinyModel;
  /** --config file for the single file (head counts and groups). */
  config: string;
  tokenizer: string;
  /** Three good photos. */
  images: string;
  /** A finished 2-step LoRA run (for --resume cases); made on first use. */
  trainedRun(): string;
  /** A fresh path under the workspace. */
  path(name: string): string;
}

export function makeWorkspace(): Workspace {
  const dir = mkdtempSync(join(tmpdir(), 'dbs-reliability-'));
  const tiny = writeTinyModel(dir);
  const config = join(dir, 'overrides.json');
  writeFileSync(config, JSON.stringify(tiny.overrides));
  const images = join(dir, 'images');
  mkdirSync(images);
  for (const f of ['quadrants.png', 'quadrants-o6.jpg', 'rgba.png']) copyFileSync(join(FIXTURES, 'images', f), join(images, f));
  let trained: string | null = null;
  let n = 0;
  const ws: Workspace = {
    dir,
    tiny,
    config,
    images,
    tokenizer: join(tiny.folder, 'tokenizer'),
    path: (name) => join(dir, `${name}-${n++}`),
    trainedRun: () => {
      if (trained) return trained;
      const out = join(dir, 'trained');
      const r = cli(...trainArgs(ws, out), '--steps', '2', '--checkpoint-every', '1');
      assert.equal(r.code, 0, `the corpus's trained run failed:\n${r.err}`);
      trained = out;
      return out;
    },
  };
  return ws;
}

/** A small, valid LoRA run on the tiny model (cases change one thing of it). */
export function trainArgs(ws: Workspace, out: string): string[] {
  return [
    'train',
    '--model',
    ws.tiny.folder,
    '--images',
    ws.images,
    '--prompt',
    'a photo of sks dog',
    '--mode',
    'lora',
    '--rank',
    '4',
    '--resolution',
    '32',
    '--seed',
    '1',
    '--lr',
    '1e-3',
    '--out',
    out,
  ];
}

export interface CliResult {
  code: number;
  out: string;
  err: string;
  ms: number;
  timedOut: boolean;
}

/**
 * Hangs fail: a case gets this long (the slowest legitimate case trains 2 tiny steps); DBS_CASE_TIMEOUT_MS
 * raises it on a machine shared by many jobs.
 */
export const CASE_TIMEOUT_MS = Number(process.env.DBS_CASE_TIMEOUT_MS) || 180_000;

export function cli(...args: string[]): CliResult {
  return cliAt(root, args);
}

/** The command line run from the folder `cwd` (relative paths in `args` are the user's, from there). */
export function cliAt(cwd: string, args: string[], env?: Record<string, string>): CliResult {
  const t0 = performance.now();
  const r = spawnSync(process.execPath, cliArgs(...args), {
    stdio: ['ignore', 'pipe', 'pipe'],
    encoding: 'utf8',
    timeout: CASE_TIMEOUT_MS,
    cwd,
    ...(env ? { env: { ...process.env, ...env } } : {}),
  });
  return {
    code: r.status ?? -1,
    out: r.stdout ?? '',
    err: r.stderr ?? '',
    ms: performance.now() - t0,
    timedOut: r.error !== undefined && /ETIMEDOUT/.test(String(r.error)),
  };
}

/** How a case went before this corpus existed (the counts in the closing note). */
export type Before = 'clear' | 'wrong' | 'unclear' | 'hung';

export interface Case {
  /** What the user did. */
  name: string;
  before: Before;
  /** Arguments to the command line (after `npm run cli --`; first 'lab:pretrain': after `npm run lab:pretrain --`). */
  args: (ws: Workspace) => string[];
  /** Makes the bad input; returns the paths that must be unchanged by the command (default: none). */
  setup?: (
    ws: Workspace,
  ) => { args?: string[]; unchanged?: string[]; absent?: string[]; after?: () => void; cwd?: string; env?: Record<string, string> } | void;
  /** Exit code: 1 for a refusal, 0 for a warning on a run that goes on. */
  code: 0 | 1;
  /** What the message must say (stderr for refusals and warnings). */
  message: RegExp;
  /** Something stdout must not show (e.g. a step line or "done" after a refusal). */
  notOut?: RegExp;
  /** What stdout must show (a report such as inspect's). */
  out?: RegExp;
}

/** Wording that means an internal error leaked to the user. */
const INTERNAL =
  /\n\s+at [^\n]+:\d+:\d+|\b(TypeError|RangeError|ReferenceError|SyntaxError: Unexpected token)\b|is not a function|of undefined|Invalid typed array length|uniform u32|ERR_PARSE_ARGS|\[object Object\]/;

/** A digest of a file tree (names, sizes, contents) to prove a command changed nothing there. */
export function treeDigest(path: string): string {
  const h = createHash('sha256');
  const walk = (p: string) => {
    if (!existsSync(p)) {
      h.update(`missing ${p}\n`);
      return;
    }
    const st = lstatSync(p);
    if (st.isSymbolicLink()) h.update(`link ${p} ${readlinkSync(p)}\n`);
    else if (!st.isFile() && !st.isDirectory())
      h.update(`special ${p} ${st.mode} ${st.rdev}\n`); // a FIFO or device: never read (it would block)
    else if (st.isDirectory()) for (const e of readdirSync(p).sort()) walk(join(p, e));
    else h.update(`file ${p} ${st.size}\n`).update(readFileSync(p));
  };
  walk(path);
  return h.digest('hex');
}

/** Runs one case and checks it; returns the result for the summary. */
export function runCase(ws: Workspace, c: Case): CliResult {
  const prepared = c.setup?.(ws) ?? {};
  const args = prepared.args ?? c.args(ws);
  const before = (prepared.unchanged ?? []).map((p) => [p, treeDigest(p)] as const);
  const r = cliAt(prepared.cwd ?? root, args, prepared.env);
  const shown = `args: ${JSON.stringify(args)}\nexit ${r.code}\nstderr:\n${r.err}\nstdout:\n${r.out.slice(-2000)}`;
  assert.ok(!r.timedOut, `hung (over ${CASE_TIMEOUT_MS} ms)\n${shown}`);
  assert.equal(r.code, c.code, shown);
  assert.match(r.err, c.message, shown);
  assert.doesNotMatch(r.err, INTERNAL, `internal wording reached the user\n${shown}`);
  if (c.notOut) assert.doesNotMatch(r.out, c.notOut, shown);
  if (c.out) assert.match(r.out, c.out, shown);
  for (const [p, digest] of before) assert.equal(treeDigest(p), digest, `${p} changed\n${shown}`);
  for (const p of prepared.absent ?? []) assert.ok(!existsSync(p), `${p} was left behind\n${shown}`);
  prepared.after?.();
  return r;
}
