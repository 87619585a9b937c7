// One process per run folder (Node host): `lock` in the folder, created exclusively, holds the identity of
// the process that trains there: pid, the process's start time (field 22 of /proc/<pid>/stat, clock ticks
// since boot) and the host name. A pid alone is not an identity: after a crash or a reboot the number is
// reused by an unrelated process (pid 1 is always alive), so a lock is held only while a process with the
// same pid AND the same start time runs on this host; otherwise it was left by a process that is gone and
// is taken over, saying why. A lock written before identities were recorded (a bare pid) is judged by the
// identity that is left: the process must be a Node runtime (pid 1, init, is not) that started before the lock
// was written. A lock from another host cannot be checked from here and is refused, naming the host.
import { closeSync, openSync, readFileSync, rmSync, statSync, writeSync } from 'node:fs';
import { hostname } from 'node:os';
import { join } from 'node:path';

export interface ProcessIdentity {
  pid: number;
  /** Start time in clock ticks since boot (/proc/<pid>/stat), or null where /proc is not available. */
  start: number | null;
  host: string;
}

/** A lock held by a live process (the refusal's message names it). */
export class RunLockedError extends Error {}

/** The start time of process `pid` from /proc, or null (no such process, or no /proc). */
export function processStart(pid: number): number | null {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    // The command name (field 2) is in parentheses and may hold spaces or ')': count fields after the last ')'.
    const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    const start = Number(fields[19]); // field 22 overall; fields[0] is field 3
    return Number.isFinite(start) ? start : null;
  } catch {
    return null;
  }
}

export function identityOf(pid: number): ProcessIdentity {
  return { pid, start: processStart(pid), host: hostname() };
}

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (e) {
    return (e as NodeJS.ErrnoException).code === 'EPERM';
  }
}

/** When the lock was written (its modification time, ms since the epoch); now when it cannot be read. */
function lockTime(path: string): number {
  try {
    return statSync(path).mtimeMs;
  } catch {
    return Date.now();
  }
}

/** What a lock file says: the identity, or a bare pid (locks written before identities were recorded). */
function readLock(path: string): Partial<ProcessIdentity> & { pid: number } {
  const text = readFileSync(path, 'utf8').trim();
  if (/^\d+$/.test(text)) return { pid: Number(text) };
  try {
    const j = JSON.parse(text) as Partial<ProcessIdentity>;
    if (Number.isInteger(j.pid) && (j.pid as number) > 0) return j as ProcessIdentity;
  } catch {
    // unreadable: no process can be shown to hold it
  }
  return { pid: 0 };
}

/** The command line of process `pid` (argv, from /proc), or null where it cannot be read. */
function commandLine(pid: number): string[] | null {
  try {
    const raw = readFileSync(`/proc/${pid}/cmdline`, 'utf8');
    return raw ? raw.split('\0').filter(Boolean) : null;
  } catch {
    return null;
  }
}

/** When process `pid` started, in ms since the epoch (/proc/stat's boot time + its start in clock ticks), or null. */
function processStartMs(pid: number): number | null {
  const ticks = processStart(pid);
  if (ticks === null) return null;
  try {
    const btime = Number(/^btime (\d+)$/m.exec(readFileSync('/proc/stat', 'utf8'))?.[1]);
    // USER_HZ, the unit of /proc's times, is 100 on every Linux ABI Node runs on.
    return Number.isFinite(btime) && btime > 0 ? btime * 1000 + ticks * 10 : null;
  } catch {
    return null;
  }
}

/** The runtimes this project's commands run in (the first word of a holder's command line). */
const RUNTIME = /(^|\/)(node|nodejs|bun|deno|tsx)(\d[\d.]*)?(\.exe)?$/;

/** Slack between a process's start and its lock's time (clock ticks round down; the lock is written after start). */
const START_SLACK_MS = 2000;

/**
 * Why the live process that a lock names is not its holder, or null when it may be. A lock with a start
 * time holds only while the process of that pid has that start time. An old lock (a bare pid) is judged by
 * what identity is left: a process that is not a Node runtime (pid 1 is init; a reused pid is usually
 * something else) did not write it, nor did one that started after the lock was written.
 */
function notTheHolder(lock: Partial<ProcessIdentity> & { pid: number }, lockTimeMs: number): string | null {
  if (lock.start !== undefined && lock.start !== null) {
    const now = processStart(lock.pid);
    return now === null || now === lock.start ? null : `process ${lock.pid} now is another process (started later than the lock's)`;
  }
  const argv = commandLine(lock.pid);
  if (argv && !RUNTIME.test(argv[0]))
    return `process ${lock.pid} is ${JSON.stringify(argv.join(' ').slice(0, 80))}, not a run of this program${lock.pid === 1 ? " (pid 1 is the system's first process)" : ''}`;
  const started = processStartMs(lock.pid);
  if (started !== null && started > lockTimeMs + START_SLACK_MS) return `process ${lock.pid} started after the lock was written`;
  return null;
}

/**
 * Takes `<dir>/lock` for this process; refuses while another live process holds it. `doing` says what the
 * holder does there ("training in it"). Returns the release, which removes the lock only while it is ours.
 */
export function takeRunLock(dir: string, doing: string, warn: (message: string) => void = (m) => console.error(`warning: ${m}`)): () => void {
  const path = join(dir, 'lock');
  const me = identityOf(process.pid);
  for (let attempt = 0; attempt < 3; attempt++) {
    try {
      const fd = openSync(path, 'wx');
      writeSync(fd, JSON.stringify(me));
      closeSync(fd);
      let released = false;
      return () => {
        if (released) return;
        released = true;
        try {
          if (readLock(path).pid === process.pid) rmSync(path, { force: true });
        } catch {
          // already gone
        }
      };
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code !== 'EEXIST') throw e;
      const lock = readLock(path);
      const written = lockTime(path);
      if (lock.host !== undefined && lock.host !== me.host)
        throw new RunLockedError(
          `${dir} is locked by process ${lock.pid} on host ${lock.host} (${path}); this host cannot tell whether it still runs: ` +
            `if no process on ${lock.host} is ${doing}, remove ${path}`,
        );
      const live = lock.pid > 0 && lock.pid !== process.pid && alive(lock.pid);
      const other = live ? notTheHolder(lock, written) : null;
      if (live && other === null)
        throw new RunLockedError(
          `${dir} is in use: process ${lock.pid} is ${doing} (${path}). Wait for it to finish or stop it; two processes must never train one run`,
        );
      // Left by a process that is gone (or naming a pid now reused): taken over, and said so.
      const why =
        lock.pid <= 0 ? 'it names no process' : lock.pid === process.pid ? 'it names this process' : (other ?? `process ${lock.pid} is no longer running`);
      warn(`${path}: a stale lock (${why}); the run it guarded is not in use, taking it over`);
      rmSync(path, { force: true });
    }
  }
  throw new RunLockedError(`${dir}: could not take the lock ${path}`);
}
