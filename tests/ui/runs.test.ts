// The runs kept in the browser (issue 15, "Runs"): the list's summaries, per-run storage, which runs lost their
// storage, and the project database across New run / Open / Delete (fake-indexeddb): each run keeps its own
// photos, masks and samples; a deleted run's Blobs go unless another run uses them; a project saved before
// runs existed becomes the first run, masks included.
import 'fake-indexeddb/auto';
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import {
  chunkBytesByRun,
  cleanRunName,
  defaultRunName,
  nextRunNumber,
  lostMessage,
  lostParts,
  photoUsers,
  projectBlobKeys,
  runIdsOfChunks,
  runStorage,
  summarize,
  thumbSource,
  type SavedProject,
} from '../../src/ui/studio/runs.ts';
import { PAGE_DEFAULTS } from '../../src/ui/studio/presets.ts';
import { EMPTY_RUN } from '../../src/ui/studio/state.ts';

function project(id: string, runId: string | null, o: Partial<SavedProject['run']> = {}, photos = ['p1', 'p2']): SavedProject {
  const { samples: _s, tries: _t, ...run } = EMPTY_RUN;
  return {
    version: 2,
    workspace: { id, created: 1000, updated: 2000 },
    prompt: `a photo of ${id}`,
    preset: 'lora',
    settings: { ...PAGE_DEFAULTS, mode: 'lora', steps: 10 },
    model: { kind: 'demo' },
    photos: photos.map((p, i) => ({
      id: p,
      name: `${p}.png`,
      width: 8,
      height: 8,
      crop: { x: 0, y: 0, size: 8 },
      caption: '',
      ...(i === 0 ? { hasMask: true } : {}),
    })),
    classPhotos: [],
    run: { ...run, runId, samples: [], tries: [], ...o },
  };
}

describe('runs list (pure)', () => {
  it('a run refers to its photos, its own masks, samples, Try it images and thumbnail', () => {
    const p = project('w1', 'run-a', {
      samples: [{ step: 0 }, { step: 5 }],
      tries: [{ id: 't1', step: 5, prompt: 'x', negativePrompt: '', steps: 4, guidance: 7, seed: 1, strength: 1 }],
    });
    p.workspace!.thumbFrom = 'sample:run-a:5';
    assert.deepEqual(projectBlobKeys(p).sort(), [
      'mask:w1:p1',
      'photo:p1',
      'photo:p2',
      'sample:run-a:0',
      'sample:run-a:5',
      'thumb:w1',
      'try:run-a:t1:base',
      'try:run-a:t1:tuned',
    ]);
    assert.equal(thumbSource(p), 'sample:run-a:5', 'the last sample');
    assert.equal(thumbSource({ ...p, run: { ...p.run, samples: [] } }), 'photo:p1', 'else the first photo');
    assert.equal(thumbSource({ ...p, photos: [], run: { ...p.run, samples: [] } }), null);
  });

  it('summary: the prompt the run started with, mode and steps of its settings', () => {
    const p = project('w1', 'run-a', { step: 3, steps: 12, status: 'paused' });
    p.run.startedWith = { prompt: 'sks dog', settings: { ...p.settings, mode: 'full', steps: 12 }, photoIds: ['p1'], classIds: [] };
    const s = summarize(p);
    assert.deepEqual([s.id, s.prompt, s.mode, s.step, s.steps, s.status, s.updated], ['w1', 'sks dog', 'full', 3, 12, 'paused', 2000]);
    assert.equal(summarize(project('w2', null)).steps, 10, 'not started: the steps of its settings');
  });

  it('names: three runs of one prompt get different default names (mode, number, date); a given name wins; empty brings the default back', () => {
    const runs = [1, 2, 3].map((n) => {
      const p = project(`w${n}`, `run-${n}`);
      p.prompt = 'a photo of sks dog';
      p.workspace = { id: `w${n}`, created: Date.UTC(2026, 10, 29, 4, 10 + n), updated: 2000, number: n };
      return p;
    });
    const names = runs.map((p) => summarize(p).name);
    assert.equal(new Set(names).size, 3, `distinct names: ${names.join(' | ')}`);
    assert.equal(new Set(runs.map((p) => summarize(p).prompt)).size, 1, 'same prompt');
    assert.match(names[1], /^LoRA run 2 · 2026-11-29 \d\d:12$/, 'mode, number and date (local time)');
    assert.match(defaultRunName('full', 7, 0), /^Full run 7$/);
    runs[0].workspace!.name = 'Rex, first try';
    assert.equal(summarize(runs[0]).name, 'Rex, first try');
    assert.equal(cleanRunName('  two\n  words '), 'two words');
    assert.equal(cleanRunName('x'.repeat(200)).length, 80);
    assert.equal(nextRunNumber(runs.map((p) => p.workspace)), 4, 'one more than the highest');
    assert.equal(nextRunNumber([{ id: 'old', created: 1, updated: 1 }]), 2, 'a run made before numbers counts as one');
    assert.equal(nextRunNumber([]), 1);
  });

  it('storage: chunk bytes of the run id plus its Blobs; a shared photo counted in each run and said to be shared', () => {
    const a = project('w1', 'run-a', { step: 2 });
    const b = project('w2', 'run-b', { step: 1 }, ['p2', 'p3']);
    const chunks = chunkBytesByRun([
      ['run-a/latents', 100],
      ['run-a/ckpt/1', 50],
      ['run-b/latents', 7],
      ['stray', 1000],
    ]);
    assert.deepEqual(
      [...chunks],
      [
        ['run-a', 150],
        ['run-b', 7],
      ],
    );
    const sizes = new Map([
      ['photo:p1', 10],
      ['photo:p2', 20],
      ['photo:p3', 30],
      ['mask:w1:p1', 1],
      ['mask:w2:p2', 2],
    ]);
    const users = photoUsers([a, b]);
    assert.equal(users.get('photo:p2'), 2);
    assert.deepEqual(runStorage(a, sizes, chunks, users), { bytes: 150 + 10 + 20 + 1, shared: 20 });
    assert.deepEqual(runStorage(b, sizes, chunks, users), { bytes: 7 + 20 + 30 + 2, shared: 20 });
  });

  it('lost: a run with steps but no chunks, or with photos gone, names what is gone; a run not started is not lost', () => {
    const blobs = new Set(['photo:p1', 'photo:p2']);
    const a = project('w1', 'run-a', { step: 4, lastCheckpoint: 3 });
    assert.deepEqual(lostParts(a, blobs, runIdsOfChunks(['run-a/latents'])), []);
    const gone = lostParts(a, new Set(['photo:p1']), runIdsOfChunks(['run-b/latents']));
    assert.deepEqual(gone, ['its training state (checkpoints at step 3)', 'the photo p2.png']);
    assert.match(lostMessage('sks dog', gone), /^Storage for run "sks dog" was cleared by the browser: its training state .* and the photo p2\.png\./);
    assert.deepEqual(lostParts(project('w2', 'run-c'), blobs, new Set()), [], 'prepared, no step: nothing in the chunk store yet');
  });
});

describe('runs in the project database (fake-indexeddb)', () => {
  it('New run keeps the old one; Open restores each run; Delete frees only what no other run uses', async () => {
    const { useStudioStore, saveProject, restoreProject, switchWorkspace, forgetWorkspace, savedWorkspaces, storedBlobSizes, renameWorkspace } =
      await import('../../src/ui/studio/state.ts');
    const { createStore, keys } = await import('idb-keyval');
    const store = createStore('dreambooth-studio-project', 'project');
    const blob = (s: string) => new Blob([s], { type: 'image/png' });
    const st = useStudioStore.getState();
    st.set({
      restored: true,
      prompt: 'sks dog',
      photos: [
        { id: 'p1', name: 'a.png', blob: blob('AAAA'), width: 8, height: 8, crop: { x: 0, y: 0, size: 8 }, caption: '', mask: blob('M1') },
        { id: 'p2', name: 'b.png', blob: blob('BB'), width: 8, height: 8, crop: { x: 0, y: 0, size: 8 }, caption: '' },
      ],
    });
    st.setRun({ ...EMPTY_RUN, runId: 'run-a', status: 'done', step: 2, steps: 2, lastCheckpoint: 2, samples: [{ step: 2, blob: blob('SA') }] });
    await saveProject();
    const first = useStudioStore.getState().workspace.id;

    // New run: same photos and masks, an empty run; the first is kept in the list.
    assert.equal(await switchWorkspace(null), true);
    const second = useStudioStore.getState().workspace.id;
    assert.notEqual(second, first);
    assert.equal(useStudioStore.getState().workspace.number, 2, 'the new run is run 2');
    assert.equal(useStudioStore.getState().run.runId, null);
    useStudioStore.getState().set((s) => ({ prompt: 'sks cat', photos: s.photos.filter((p) => p.id === 'p2') }));
    useStudioStore.getState().setRun({ runId: 'run-b', status: 'paused', step: 1, steps: 3, samples: [{ step: 1, blob: blob('SB') }] });
    await saveProject();
    assert.deepEqual(
      savedWorkspaces().map((p) => p.prompt),
      ['sks cat', 'sks dog'],
    );
    assert.deepEqual(
      (await keys(store)).map(String).sort(),
      ['photo:p1', 'photo:p2', 'project', `mask:${first}:p1`, 'sample:run-a:2', 'sample:run-b:1', `ws:${first}`].sort(),
      "the first run's photo p1, mask and sample stay although the open run dropped p1",
    );

    // Reload, then open the first run: its photos (mask included), chart and sample come back.
    useStudioStore.getState().set({ photos: [], prompt: '', restored: false });
    await restoreProject();
    assert.equal(useStudioStore.getState().workspace.id, second);
    // Names: the kept run renamed in the list, the open one on the page; both survive a reload.
    await renameWorkspace(first, '  Rex,  first try ');
    await renameWorkspace(second, 'Cat');
    useStudioStore.getState().set({ restored: false });
    await restoreProject();
    assert.deepEqual(
      savedWorkspaces().map((p) => summarize(p).name),
      ['Cat', 'Rex, first try'],
    );
    await renameWorkspace(second, ' ');
    assert.match(summarize(savedWorkspaces()[0]).name, /^LoRA run 2 · /, 'an empty name brings the default back');
    assert.equal(await switchWorkspace(first), true);
    const opened = useStudioStore.getState();
    assert.equal(opened.prompt, 'sks dog');
    assert.deepEqual(
      opened.photos.map((p) => p.id),
      ['p1', 'p2'],
    );
    assert.equal(await opened.photos[0].mask?.text(), 'M1');
    assert.equal(opened.run.runId, 'run-a');
    assert.equal(await opened.run.samples[0].blob.text(), 'SA');

    // Delete the second run (now in the list): its sample goes; p2 stays (the open run uses it).
    await forgetWorkspace(second);
    const left = (await keys(store)).map(String).sort();
    assert.deepEqual(left, ['photo:p1', 'photo:p2', 'project', `mask:${first}:p1`, 'sample:run-a:2'].sort());
    assert.equal((await storedBlobSizes()).get('photo:p1'), 4);
  });

  it('a project saved before runs existed becomes the first run, its mask moved under the run', async () => {
    const { useStudioStore, saveProject, restoreProject, savedWorkspaces } = await import('../../src/ui/studio/state.ts');
    const { legacyWorkspaceId } = await import('../../src/ui/studio/runs.ts');
    const { clear, createStore, keys, set } = await import('idb-keyval');
    const store = createStore('dreambooth-studio-project', 'project');
    await clear(store);
    const old = project('ignored', 'run-old', { status: 'training', step: 5, steps: 9, lastCheckpoint: 4, samples: [{ step: 4 }] }, ['q1']);
    delete old.workspace;
    await set('project', old, store);
    await set('photo:q1', new Blob(['Q']), store);
    await set('mask:q1', new Blob(['MQ']), store);
    await set('sample:run-old:4', new Blob(['S4']), store);
    useStudioStore.getState().set({ restored: false });
    await restoreProject();
    const r = useStudioStore.getState();
    assert.equal(r.workspace.id, legacyWorkspaceId(old));
    assert.equal(r.run.runId, 'run-old');
    assert.equal(r.run.status, 'interrupted');
    assert.equal(await r.photos[0].mask?.text(), 'MQ');
    await saveProject();
    assert.deepEqual((await keys(store)).map(String).sort(), ['mask:w-run-old:q1', 'photo:q1', 'project', 'sample:run-old:4']);
    assert.deepEqual(
      savedWorkspaces().map((p) => p.workspace?.id),
      ['w-run-old'],
    );
  });
});
