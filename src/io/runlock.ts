// One process per run folder (Node host): `lock` in the folder, created exclusively, holds the identity of
// the process that trains there: pid, the process's start time (field 22 of /proc/<pid>/stat, clock ticks
// since boot) and the host name. A pid alone is not an identity: after a crash or a reboot the number is
// reused by an unrelated process (pid 1 is always alive), so a lock is held only while a process with the
// same pid AND the same start time runs on this host; otherwise it was left by a process that is gone and
// is taken over. A lock from another host cannot be checked from here and is refused, naming the host.
import { closeSync, openSync, readFileSync, rmSync, writeSync } from 'node:fs';
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

/** Whether the process the lock names is the one running now (same host, pid and start time). */
function holds(lock: Partial<ProcessIdentity> & { pid: number }): boolean {
  if (lock.pid <= 0 || lock.pid === process.pid || !alive(lock.pid)) return false;
  if (lock.start === undefined || lock.start === null) return true; // nothing to compare: a live pid is taken as the holder
  const now = processStart(lock.pid);
  return now === null || now === lock.start;
}

/**
 * Takes `<dir>/lock` for this process; refuses while another live process holds it. `doing` says what the
 * holder does there ("training in it"). Returns the release, which removes the lock only while it is ours.
 */
export function takeRunLock(dir: string, doing: string): () => void {
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
      if (lock.host !== undefined && lock.host !== me.host)
        throw new RunLockedError(
          `${dir} is locked by process ${lock.pid} on host ${lock.host} (${path}); this host cannot tell whether it still runs: ` +
            `if no process on ${lock.host} is ${doing}, remove ${path}`,
        );
      if (holds(lock))
        throw new RunLockedError(
          `${dir} is in use: process ${lock.pid} is ${doing} (${path}). Wait for it to finish or stop it; two processes must never train one run`,
        );
      rmSync(path, { force: true }); // left by a process that is gone (or by a reused pid): take it over
    }
  }
  throw new RunLockedError(`${dir}: could not take the lock ${path}`);
}
