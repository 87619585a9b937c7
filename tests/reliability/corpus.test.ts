// The bad-input corpus (cases.ts) through the real command line: every row must get its message, exit code
// and time limit, leak no internal wording and change nothing it names. The summary line gives the counts
// the issue asks for: tried, and how each went before (clear / wrong / unclear / hung) — now all clear.
import assert from 'node:assert/strict';
import { after, describe, it } from 'node:test';
import { userMessage } from '../../src/cli/errors.ts';
import { CASES as BASE_CASES } from './cases.ts';
import { RESUME_CASES } from './cases-resume.ts';
import { WRITE_CASES } from './cases-writes.ts';
import { makeWorkspace, runCase, type Before } from './harness.ts';

const CASES = [...BASE_CASES, ...WRITE_CASES, ...RESUME_CASES];
const ws = makeWorkspace();
const passed = new Set<string>();

void describe('bad input and faults on the command line (tests/reliability/cases.ts)', { concurrency: 1 }, () => {
  for (const c of CASES)
    void it(`${c.name} (before: ${c.before})`, () => {
      runCase(ws, c);
      passed.add(c.name);
    });
});

void describe('errors from the operating system reach the user in words (src/cli/errors.ts)', () => {
  // As Node raises them (code, syscall, path); a read-only disk cannot be mounted by an unprivileged test.
  const osError = (code: string, syscall: string, path: string) =>
    Object.assign(new Error(`${code}: ${code.toLowerCase()} failure, ${syscall} '${path}'`), { code, syscall, path, errno: -1 });
  void it('a read-only disk (EROFS) names the output file and what to do', () => {
    assert.equal(
      userMessage(osError('EROFS', 'open', '/mnt/ro/out.png.partial')),
      'cannot write /mnt/ro/out.png: the disk is read-only: choose a place on a writable disk (EROFS)',
    );
  });
  void it("a full disk, no permission; the project's own messages and unknown codes pass unchanged", () => {
    assert.match(userMessage(osError('ENOSPC', 'write', '/data/run/store/x.chunk')), /^cannot write \/data\/run\/store\/x\.chunk: the disk is full/);
    assert.match(userMessage(osError('EACCES', 'scandir', '/root/photos')), /^cannot read \/root\/photos: no permission/);
    assert.equal(userMessage(new Error('--steps must be from 1 to 1000000, got 0')), '--steps must be from 1 to 1000000, got 0');
    assert.equal(userMessage(osError('EWHATEVER', 'open', '/x')), "EWHATEVER: ewhatever failure, open '/x'");
  });
});

after(() => {
  const before: Record<Before, number> = { clear: 0, wrong: 0, unclear: 0, hung: 0 };
  for (const c of CASES) before[c.before]++;
  const failed = CASES.length - passed.size;
  console.log(
    `reliability corpus: ${CASES.length} tried; before: ${before.clear} clear, ${before.wrong} wrong, ${before.unclear} unclear, ${before.hung} hung; ` +
      `now: ${passed.size} clear, ${failed} not`,
  );
});
