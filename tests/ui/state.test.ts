// The studio page's pure helpers: the storage pre-check behind the "quota too small" screen, the crop
// slider's mapping, and the formats the page prints.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { cropAt } from '../../src/ui/studio/actions.ts';
import { fmtBytes, fmtDuration, storageShortfall } from '../../src/ui/studio/state.ts';
import { storageNeed } from '../../src/studio/session.ts';

describe('studio page helpers', () => {
  it('storage pre-check: a full SD 1.5 fine-tune does not fit 10 GiB free; LoRA does; unknown quota passes', () => {
    const fullNeed = storageNeed(859_520_964, 4 * 2 ** 20); // SD 1.5 UNet parameters
    assert.ok(fullNeed > 20e9);
    const msg = storageShortfall(fullNeed, 12 * 2 ** 30, 2 * 2 ** 30, 0);
    assert.match(msg ?? '', /needs about 19\.\d+ GiB .* only 10\.00 GiB more/);
    assert.equal(storageShortfall(storageNeed(3_188_736, 4 * 2 ** 20), 12 * 2 ** 30, 2 * 2 ** 30, 0), null);
    // What the run already stores counts as reusable.
    assert.equal(storageShortfall(100, 1000, 1000, 100), null);
    assert.notEqual(storageShortfall(101, 1000, 1000, 100), null);
    assert.equal(storageShortfall(fullNeed, null, null, 0), null);
  });

  it('crop slider: 0 is the left/top square, 1 the right/bottom one, never outside the photo', () => {
    assert.deepEqual(cropAt({ width: 400, height: 300 }, 0), { x: 0, y: 0, size: 300 });
    assert.deepEqual(cropAt({ width: 400, height: 300 }, 1), { x: 100, y: 0, size: 300 });
    assert.deepEqual(cropAt({ width: 300, height: 500 }, 0.5), { x: 0, y: 100, size: 300 });
    assert.deepEqual(cropAt({ width: 300, height: 500 }, 7), { x: 0, y: 200, size: 300 });
    assert.deepEqual(cropAt({ width: 256, height: 256 }, 0.3), { x: 0, y: 0, size: 256 });
  });

  it('formats bytes and durations', () => {
    assert.equal(fmtBytes(512), '512 B');
    assert.equal(fmtBytes(1536), '1.5 KiB');
    assert.equal(fmtBytes(3 * 2 ** 30), '3.00 GiB');
    assert.equal(fmtDuration(65), '1:05');
    assert.equal(fmtDuration(3725), '1:02:05');
  });
});
