// What the command line prints for an error that reached it. The project's own errors are already in words;
// an error from the operating system (Node's ErrnoException: code, syscall, path) is put in words here,
// naming the file and what to do, instead of "EROFS: read-only file system, open '...'".
const WHY: Record<string, string> = {
  EROFS: 'the disk is read-only: choose a place on a writable disk',
  ENOSPC: 'the disk is full: free some space or choose another disk',
  EDQUOT: 'your disk quota is used up: free some space or choose another disk',
  EACCES: 'no permission: choose a place you may write to, or change its permissions',
  EPERM: 'the operation is not permitted there: choose another place',
  EISDIR: 'it is a folder, where a file was expected',
  ENOTDIR: 'a file stands where a folder of its path should be',
  ENAMETOOLONG: 'the path is too long: choose a shorter one',
  EMFILE: 'too many files are open: raise the limit (ulimit -n) and try again',
  EIO: 'the disk reported an input/output error: check the disk',
  ELOOP: 'a link on the path loops back on itself: fix or remove it',
};

/** What the OS call was doing, in words. */
function doing(syscall: string | undefined): string {
  if (!syscall) return 'use';
  if (/^(open|write|rename|mkdir|unlink|rmdir|rm|copyfile|symlink|link|ftruncate|fsync|utime|chmod)/.test(syscall)) return 'write';
  if (/^(read|scandir|stat|lstat|access)/.test(syscall)) return 'read';
  return 'use';
}

/** The message for `e`: an OS error in words naming its path, anything else its own message. */
export function userMessage(e: unknown): string {
  const x = e as NodeJS.ErrnoException | null;
  const message = x instanceof Error ? x.message : String(e);
  if (!x || typeof x.code !== 'string' || !(x.code in WHY) || !message.startsWith(`${x.code}:`)) return message;
  // A file is written through `<name>.partial` (io/outpath.ts): the user named `<name>`.
  const path = x.path?.replace(/\.partial$/, '') ?? 'a file';
  return `cannot ${doing(x.syscall)} ${path}: ${WHY[x.code]} (${x.code})`;
}
