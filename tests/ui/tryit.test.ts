// When the studio's Try it panel may generate (ui/studio/TryIt.tsx tryItBlocked): only on a paused or finished
// run with a finished step and the model loaded; otherwise the reason the page shows next to the disabled button.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { tryItBlocked } from '../../src/ui/studio/TryIt.tsx';

describe('Try it availability', () => {
  it('runs on a paused or finished run with a finished step and the model loaded', () => {
    assert.equal(tryItBlocked({ status: 'done', step: 2, runId: 'r' }, true), null);
    assert.equal(tryItBlocked({ status: 'paused', step: 1, runId: 'r' }, true), null);
  });

  it('says the engine is busy while the run prepares, trains or pauses', () => {
    for (const status of ['preparing', 'training', 'pausing'] as const)
      assert.match(tryItBlocked({ status, step: 3, runId: 'r' }, true) ?? '', /busy training: pause the run/, status);
  });

  it('says the engine is busy while an export runs', () => {
    assert.match(tryItBlocked({ status: 'done', step: 2, runId: 'r' }, true, true) ?? '', /busy exporting/);
  });

  it('says there is no finished step yet (no run, or step 0)', () => {
    assert.match(tryItBlocked({ status: 'idle', step: 0, runId: null }, true) ?? '', /No finished training step yet/);
    assert.match(tryItBlocked({ status: 'paused', step: 0, runId: 'r' }, true) ?? '', /No finished training step yet/);
  });

  it('asks to resume a run that stopped otherwise, and for the model after a reload', () => {
    for (const status of ['interrupted', 'device-lost', 'error', 'quota', 'cancelled'] as const)
      assert.match(tryItBlocked({ status, step: 3, runId: 'r' }, true) ?? '', /paused or finished run/, status);
    assert.match(tryItBlocked({ status: 'done', step: 3, runId: 'r' }, false) ?? '', /Load the model again/);
  });
});
