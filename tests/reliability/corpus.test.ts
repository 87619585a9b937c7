// The bad-input corpus (cases.ts) through the real command line: every row must get its message, exit code
// and time limit, leak no internal wording and change nothing it names. The summary line gives the counts
// the issue asks for: tried, and how each went before (clear / wrong / unclear / hung) — now all clear.
import { after, describe, it } from 'node:test';
import { CASES as BASE_CASES } from './cases.ts';
import { WRITE_CASES } from './cases-writes.ts';
import { makeWorkspace, runCase, type Before } from './harness.ts';

const CASES = [...BASE_CASES, ...WRITE_CASES];
const ws = makeWorkspace();
const passed = new Set<string>();

void describe('bad input and faults on the command line (tests/reliability/cases.ts)', { concurrency: 1 }, () => {
  for (const c of CASES)
    void it(`${c.name} (before: ${c.before})`, () => {
      runCase(ws, c);
      passed.add(c.name);
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
