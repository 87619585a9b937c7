// The studio page's pure helpers: the storage pre-check behind the "quota too small" screen, the crop
// slider's mapping, and the formats the page prints.
import 'fake-indexeddb/auto';
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

describe('studio project persistence (IndexedDB via fake-indexeddb)', () => {
  it('photos and samples are stored once under their own keys; a reload restores them; a training run becomes interrupted', async () => {
    const { useStudioStore, saveProject, restoreProject, EMPTY_RUN } = await import('../../src/ui/studio/state.ts');
    const { createStore, keys, get } = await import('idb-keyval');
    const st = useStudioStore.getState();
    const blob = (s: string) => new Blob([s], { type: 'image/png' });
    st.set({
      restored: true,
      prompt: 'a photo of sks cat',
      photos: [
        { id: 'p1', name: 'a.png', blob: blob('AAAA'), width: 40, height: 30, crop: { x: 5, y: 0, size: 30 }, caption: 'on a sofa' },
        { id: 'p2', name: 'b.png', blob: blob('BBBB'), width: 30, height: 30, crop: { x: 0, y: 0, size: 30 }, caption: '' },
      ],
    });
    st.setRun({
      ...EMPTY_RUN,
      runId: 'run-x',
      status: 'training',
      step: 7,
      steps: 10,
      lastCheckpoint: 5,
      losses: [{ step: 1, loss: 0.5 }],
      samples: [{ step: 0, blob: blob('S0') }],
    });
    await saveProject();
    const store = createStore('dreambooth-studio-project', 'project');
    assert.deepEqual((await keys(store)).sort(), ['photo:p1', 'photo:p2', 'project', 'sample:run-x:0']);
    const project = (await get('project', store)) as { photos: Record<string, unknown>[] };
    assert.ok(!('blob' in project.photos[0]), 'the project record holds no photo bytes');
    // Remove a photo: its Blob goes too.
    st.set((s) => ({ photos: s.photos.filter((p) => p.id !== 'p2') }));
    await saveProject();
    assert.deepEqual((await keys(store)).sort(), ['photo:p1', 'project', 'sample:run-x:0']);
    // "Reload": clear the page state, restore.
    st.set({ photos: [], prompt: '', restored: false });
    st.setRun(EMPTY_RUN);
    await restoreProject();
    const r = useStudioStore.getState();
    assert.equal(r.prompt, 'a photo of sks cat');
    assert.equal(r.photos.length, 1);
    assert.equal(await r.photos[0].blob.text(), 'AAAA');
    assert.deepEqual(r.photos[0].crop, { x: 5, y: 0, size: 30 });
    assert.equal(r.photos[0].caption, 'on a sofa');
    assert.equal(r.run.status, 'interrupted');
    assert.match(r.run.message, /checkpoint at step 5/);
    assert.equal(await r.run.samples[0].blob.text(), 'S0');
  });
});
