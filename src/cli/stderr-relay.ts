// Dawn prints its adapter-limit notices from native code straight to file descriptor 2 (gpu/native-stderr.ts).
// In process they are filtered where fd 2 can be reopened as the same stream (a terminal, a pipe, a file opened
// for appending); a file opened plainly (`2> log`) cannot: a reopened one would get its own offset. There the
// command runs as a child whose stderr is a pipe, and this process relays it to the file line by line without
// Dawn's notices and native source lines, writing through the original descriptor (one offset, so `> log 2>&1`
// interleaves as before). Stop signals are passed on to the child; signals.ts takes a repeat of the same signal
// within a second as one (a signal sent to the process group reaches both processes, then arrives again relayed).
import { spawn } from 'node:child_process';
import { constants, fstatSync, readFileSync, writeSync } from 'node:fs';
import { constants as os } from 'node:os';
import { withoutLines } from '../gpu/native-stderr.ts';
import { DAWN_LIMIT_NOTICE } from '../gpu/node.ts';

/** What the relay drops: Dawn's limit notices and the C++ source locations it prints under a warning. */
const NOISE = new RegExp(`${DAWN_LIMIT_NOTICE.source}|^\\s+at .*\\.(cpp|cc|mm|h):\\d+\\)?$`);
const RELAYED = 'DBS_STDERR_RELAYED';

/** Whether stderr is a file opened without O_APPEND (Linux; not already relayed). */
export function needsStderrRelay(): boolean {
  if (process.platform !== 'linux' || process.env[RELAYED] === '1') return false;
  try {
    if (!fstatSync(2).isFile()) return false;
    const flags = /^flags:\s*([0-7]+)$/m.exec(readFileSync('/proc/self/fdinfo/2', 'utf8'))?.[1];
    return flags !== undefined && (parseInt(flags, 8) & constants.O_APPEND) === 0;
  } catch {
    return false;
  }
}

/** Runs this command again as a child with its stderr relayed (see above); resolves with the child's exit code. */
export function runWithStderrRelay(): Promise<number> {
  return new Promise((resolve) => {
    const child = spawn(process.execPath, [...process.execArgv, ...process.argv.slice(1)], {
      stdio: ['inherit', 'inherit', 'pipe'],
      env: { ...process.env, [RELAYED]: '1' },
    });
    for (const signal of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const) process.on(signal, () => child.kill(signal));
    const write = (text: string) => {
      const kept = Buffer.from(withoutLines(text, NOISE));
      for (let done = 0; done < kept.length;) done += writeSync(2, kept, done);
    };
    let rest = '';
    child.stderr.setEncoding('utf8');
    child.stderr.on('data', (d: string) => {
      rest += d;
      const end = rest.lastIndexOf('\n') + 1;
      if (end > 0) {
        write(rest.slice(0, end));
        rest = rest.slice(end);
      }
    });
    child.on('close', (code, signal) => {
      if (rest) write(rest);
      resolve(code ?? 128 + (signal ? os.signals[signal] : 0));
    });
  });
}
