// Issue 46: one handler for SIGINT, SIGTERM and SIGHUP (src/cli/signals.ts). SIGTERM mid-step (what docker stop
// and job schedulers send) finishes the step, checkpoints, releases the lock and exits 143, and the resumed
// run ends with the uninterrupted run's LoRA bit for bit; Ctrl-C while loading exits 130 leaving no lock
// and no folder (the identical retry is not refused); a lock's holder is a process identity, not a pid.
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { closeSync, existsSync, mkdirSync, openSync, readFileSync, utimesSync, writeFileSync } from 'node:fs';
import { once } from 'node:events';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { identityOf, RunLockedError, takeRunLock } from '../../src/io/runlock.ts';
import { readSafetensors } from '../../src/io/safetensors.ts';
import { cliArgs } from '../cli.ts';
import { cli, makeWorkspace, root, trainArgs } from './harness.ts';

const ws = makeWorkspace();
const run = (out: string) => [...trainArgs(ws, out), '--steps', '4', '--checkpoint-every', '100', '--export', 'lora-kohya'];
const tensorsOf = (p: string) => readSafetensors(new Uint8Array(readFileSync(p))).tensors;

/** Runs the CLI and sends `signal` once `when` (called on every output chunk and every 50 ms) says so. */
function signalled(
  args: string[],
  signal: NodeJS.Signals,
  when: (out: string) => boolean,
): Promise<{ code: number | null; by: NodeJS.Signals | null; out: string; err: string }> {
  return new Promise((resolve) => {
    const p = spawn(process.execPath, cliArgs(...args), { cwd: root, stdio: ['ignore', 'pipe', 'pipe'] });
    let out = '';
    let err = '';
    let sent = false;
    const check = () => {
      if (!sent && when(out)) {
        sent = true;
        p.kill(signal);
      }
    };
    const poll = setInterval(check, 50);
    p.stdout.on('data', (d) => ((out += d), check()));
    p.stderr.on('data', (d) => (err += d));
    p.on('exit', (code, by) => {
      clearInterval(poll);
      resolve({ code, by, out, err });
    });
  });
}

void describe('stop signals and the run lock', { concurrency: 1 }, () => {
  void it("SIGTERM mid-step: the step finishes with a checkpoint, exit 143, no lock; the resumed run ends with the uninterrupted run's LoRA bit for bit", async () => {
    const whole = ws.path('whole');
    const a = cli(...run(whole));
    assert.equal(a.code, 0, a.err);
    const out = ws.path('stopped');
    // Step 2 is in flight when step 1's line is printed.
    const r = await signalled(run(out), 'SIGTERM', (o) => o.includes('step 1/4'));
    assert.equal(r.by, null, `killed by ${r.by} instead of handling it:\n${r.err}`);
    assert.equal(r.code, 143, r.err);
    assert.match(r.err, /SIGTERM: pausing[\s\S]*paused at step 2 with a checkpoint/);
    assert.ok(!existsSync(join(out, 'lock')), 'the lock is released');
    const b = cli('train', '--resume', out);
    assert.equal(b.code, 0, b.err);
    assert.match(b.err, /resumed at step 2/);
    assert.equal(b.out.split('\n').filter((l) => l.startsWith('step ')).length, 2, 'steps 3 and 4 run after the resume');
    const want = tensorsOf(join(whole, 'lora-kohya.safetensors'));
    const got = tensorsOf(join(out, 'lora-kohya.safetensors'));
    assert.deepEqual([...got.keys()], [...want.keys()]);
    for (const [k, t] of want) assert.deepEqual(got.get(k)!.data, t.data, `${k} differs after the SIGTERM and resume`);
  });

  void it('Ctrl-C while loading: exit 130, no lock and no folder left, so the identical retry is not refused', async () => {
    const out = ws.path('loading');
    // The lock exists from just before the model loads until the run ends: interrupt as soon as it appears.
    const r = await signalled(run(out), 'SIGINT', () => existsSync(join(out, 'lock')));
    assert.equal(r.by, null, `killed by ${r.by} instead of handling it:\n${r.err}`);
    assert.equal(r.code, 130, r.err);
    assert.match(r.err, /SIGINT: stopped before training began; nothing was trained/);
    assert.ok(!existsSync(out), `${out} was left behind`);
  });

  void it('a lock whose pid is alive but is another process (start time differs) is stale and taken over', () => {
    const out = ws.path('stale');
    mkdirSync(out);
    writeFileSync(join(out, 'run.json'), readFileSync(join(ws.trainedRun(), 'run.json')));
    // pid 1 is always alive; its start time is not this one.
    const me = identityOf(1);
    writeFileSync(join(out, 'lock'), JSON.stringify({ ...me, start: (me.start ?? 0) + 12345 }));
    const r = cli('train', '--resume', out);
    assert.doesNotMatch(r.err, /is in use/);
    assert.ok(!existsSync(join(out, 'lock')), 'the stale lock is gone after the run');
  });

  void it("stderr a plain file (2> log): Dawn's notices stay out of it (stderr-relay.ts), and SIGTERM while loading still exits 143 leaving nothing", async () => {
    const log = ws.path('stderr') + '.log';
    const out = ws.path('relayed');
    const fd = openSync(log, 'w');
    const p = spawn(process.execPath, cliArgs(...run(out)), { cwd: root, stdio: ['ignore', 'ignore', fd] });
    closeSync(fd);
    const poll = setInterval(() => existsSync(join(out, 'lock')) && p.kill('SIGTERM'), 50);
    const [code] = (await once(p, 'exit')) as [number | null];
    clearInterval(poll);
    const text = readFileSync(log, 'utf8');
    assert.equal(code, 143, text);
    assert.match(text, /SIGTERM: stopped before training began; nothing was trained/);
    assert.doesNotMatch(text, /artificially reduced|\.cpp:\d+/, 'no Dawn notice in the log');
    assert.ok(!existsSync(out), `${out} was left behind`);
  });

  void it('an old lock (a bare pid) is judged by what identity is left: a Node process that started before it holds it; pid 1, or a process started after it, does not', async () => {
    const dir = ws.path('bare-pid');
    mkdirSync(dir);
    const lock = join(dir, 'lock');
    const warnings: string[] = [];
    const take = () => takeRunLock(dir, 'training in it', (m) => warnings.push(m));
    // A live Node process, started before its lock was written: the holder.
    const holder = spawn(process.execPath, ['-e', 'setTimeout(() => {}, 60000)'], { stdio: 'ignore' });
    try {
      await new Promise((r) => setTimeout(r, 300));
      writeFileSync(lock, String(holder.pid));
      assert.throws(take, (e: Error) => e instanceof RunLockedError && new RegExp(`process ${holder.pid} is training in it`).test(e.message));
      // The same pid in a lock written a day before that process started: the pid was reused, the lock is stale.
      const dayAgo = new Date(Date.now() - 86_400_000);
      utimesSync(lock, dayAgo, dayAgo);
      take()();
      assert.match(warnings.at(-1)!, new RegExp(`a stale lock \\(process ${holder.pid} started after the lock was written\\)`));
    } finally {
      holder.kill();
    }
    // pid 1 (always alive) is the system's first process, never a run of this program.
    writeFileSync(lock, '1');
    take()();
    assert.match(warnings.at(-1)!, /a stale lock \(process 1 is "[^"]*", not a run of this program \(pid 1 is the system's first process\)\)/);
    assert.ok(!existsSync(lock), 'released');
  });

  void it('a lock held by a live process (pid and start time match) refuses a second train and a second pretrain', () => {
    const out = ws.path('held');
    mkdirSync(out);
    writeFileSync(join(out, 'run.json'), readFileSync(join(ws.trainedRun(), 'run.json')));
    writeFileSync(join(out, 'lock'), JSON.stringify(identityOf(process.pid)));
    const r = cli('train', '--resume', out);
    assert.equal(r.code, 1);
    assert.match(r.err, new RegExp(`is in use: process ${process.pid} is training in it`));
    const pt = ws.path('pretrain');
    mkdirSync(pt);
    writeFileSync(join(pt, 'pretrain.json'), JSON.stringify({ size: 'tiny', settings: { steps: 1, vaeSteps: 1, resolution: 16 } }));
    writeFileSync(join(pt, 'lock'), JSON.stringify(identityOf(process.pid)));
    const p = cli('lab:pretrain', '--resume', pt);
    assert.equal(p.code, 1, p.err);
    assert.match(p.err, new RegExp(`is in use: process ${process.pid} is pretraining in it`));
  });
});
