// Filtering what NATIVE code prints to stderr during one synchronous call (Node, Linux).
//
// Dawn prints some notices with fprintf(stderr) from C++ (dawn::WarningLog), e.g. when it discovers an
// adapter whose limits it clamps: "Warning: maxDynamicUniformBuffersPerPipelineLayout artificially reduced
// from 1000000 to 16 ..." on lavapipe and RADV. No flag, toggle or callback of the `webgpu` package reaches
// that logger, and process.stderr never sees the text (it goes straight to file descriptor 2), so it can
// only be filtered at the descriptor. Node has no dup2, but POSIX open() takes the LOWEST free descriptor:
// closing fd 2 and opening a temp file puts the temp file at fd 2; afterwards fd 2 is reopened from
// /proc/self/fd/<saved copy>. What the call printed is then read back, the known noise dropped, and the
// rest (real errors, e.g. a Vulkan loader failure) written to the real stderr.
//
// It is used only where that is safe, else the call just runs with stderr as it is:
// - Linux only (/proc/self/fd);
// - stderr is a terminal, a pipe, or a file opened for appending (`2>>log`): reopened, each is the same
//   stream; a file opened plainly (`2>log`) is left alone, since a reopened one would get its own offset
//   and could overwrite stdout's lines in `>log 2>&1` (the notices then stay in that log);
// - fds 0 and 1 are open (else the temp file would not land at 2);
// - no fs or DNS request and no worker thread is in flight: another thread opening a file between the
//   close and the open would be handed fd 2.
import { closeSync, constants, fstatSync, openSync, readFileSync, readSync, unlinkSync, writeSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

const STDERR = 2;
/** Active libuv resources that can open a descriptor on another thread. */
const OPENS_ON_ANOTHER_THREAD = /^(FSReq|GetAddrInfo|GetNameInfo|Worker)/;

interface Capture {
  /** Puts the real stderr back at fd 2 and returns what was printed meanwhile. */
  release(): string;
}

function isOpen(fd: number): boolean {
  try {
    fstatSync(fd);
    return true;
  } catch {
    return false;
  }
}

/** Whether fd 2 was opened with O_APPEND (the "flags:" line of /proc/self/fdinfo/2 is octal). */
function appends(): boolean {
  const flags = /^flags:\s*([0-7]+)$/m.exec(readFileSync(`/proc/self/fdinfo/${STDERR}`, 'utf8'))?.[1];
  return flags !== undefined && (parseInt(flags, 8) & constants.O_APPEND) !== 0;
}

function captureStderr(): Capture | null {
  if (process.platform !== 'linux') return null;
  if (process.getActiveResourcesInfo().some((r) => OPENS_ON_ANOTHER_THREAD.test(r))) return null;
  if (!isOpen(0) || !isOpen(1)) return null;
  let flags: number;
  let saved: number;
  try {
    const st = fstatSync(STDERR);
    const appending = st.isFile() && appends();
    if (!st.isCharacterDevice() && !st.isFIFO() && !appending) return null;
    // A pipe is opened non-blocking so that a pipe nobody reads any more fails (ENXIO) instead of hanging;
    // libuv makes stdio pipes non-blocking anyway. O_NOCTTY: a terminal must not become our controlling one.
    flags = constants.O_WRONLY | constants.O_NOCTTY | (st.isFIFO() ? constants.O_NONBLOCK : 0) | (appending ? constants.O_APPEND : 0);
    saved = openSync(`/proc/self/fd/${STDERR}`, flags);
  } catch {
    return null;
  }
  const path = join(tmpdir(), `dbs-stderr-${process.pid}-${Date.now()}-${Math.random().toString(36).slice(2)}`);
  closeSync(STDERR);
  let fd: number;
  try {
    fd = openSync(path, constants.O_RDWR | constants.O_CREAT | constants.O_EXCL, 0o600);
  } catch {
    fd = -1;
  }
  if (fd !== STDERR) {
    // The temp file could not be made (or, despite the checks above, fd 2 went to another thread's open):
    // put stderr back if fd 2 is still free, and run unfiltered.
    if (fd >= 0) {
      closeSync(fd);
      unlinkSync(path);
    }
    if (!isOpen(STDERR)) openSync(`/proc/self/fd/${saved}`, flags);
    closeSync(saved);
    return null;
  }
  unlinkSync(path); // the text stays readable through fd 2; nothing is left on disk, whatever happens next
  return {
    release() {
      let text: string;
      try {
        const size = fstatSync(STDERR).size;
        const bytes = Buffer.alloc(size);
        let got = 0;
        for (let n = 1; got < size && n > 0; got += n) n = readSync(STDERR, bytes, got, size - got, got);
        text = bytes.subarray(0, got).toString('utf8');
      } finally {
        closeSync(STDERR);
        openSync(`/proc/self/fd/${saved}`, flags); // lands at 2, the lowest free descriptor
        closeSync(saved);
      }
      return text;
    },
  };
}

/** The text without the lines that `drop` matches. */
export function withoutLines(text: string, drop: RegExp): string {
  return text
    .split(/(?<=\n)/)
    .filter((line) => !drop.test(line.replace(/\r?\n$/, '')))
    .join('');
}

/**
 * Runs `run` (a synchronous call into native code) with what it prints on fd 2 captured, then prints it to
 * stderr without the lines `drop` matches. Where capturing is not safe (see above) `run` runs as is.
 */
export function filterNativeStderr<T>(run: () => T, drop: RegExp): T {
  const capture = captureStderr();
  if (!capture) return run();
  try {
    return run();
  } finally {
    const kept = withoutLines(capture.release(), drop);
    if (kept) {
      try {
        writeSync(STDERR, kept);
      } catch {
        process.stderr.write(kept); // a full non-blocking pipe (EAGAIN): let the stream queue it
      }
    }
  }
}
