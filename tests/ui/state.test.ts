// The studio page's pure helpers: the storage pre-check behind the "quota too small" screen, the crop
// slider's mapping, and the formats the page prints.
import 'fake-indexeddb/auto';
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { cropAt, photoInput } from '../../src/ui/studio/actions.ts';
import { chartColumns, legendValues, STEP_TICKS, validationAt } from '../../src/ui/studio/chart-values.ts';
import { fmtBytes, fmtDuration, progressLine, runBusy, samplesHint, statusMessage, stepCount, storageShortfall } from '../../src/ui/studio/state.ts';
import { PAGE_DEFAULTS } from '../../src/ui/studio/presets.ts';
import { bucketNote } from '../../src/ui/studio/bucket-note.ts';
import { storageNeed } from '../../src/pipeline/run.ts';

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

  it('a crop goes to the run only once chosen (the run warns "not square" for the others)', () => {
    const blob = new Blob(['x']);
    const p = { id: 'p1', name: 'a.png', blob, width: 48, height: 40, crop: { x: 4, y: 0, size: 40 }, caption: '' };
    assert.equal('crop' in photoInput(p), false, "a centred crop nobody moved is the run's own centre crop");
    assert.deepEqual(photoInput({ ...p, crop: { x: 0, y: 0, size: 40 }, cropChosen: true }).crop, { x: 0, y: 0, size: 40 });
  });

  it('the model and photos are locked while the run prepares or trains; the status line says a message once', () => {
    for (const s of ['preparing', 'training', 'pausing'] as const) assert.equal(runBusy(s), true, s);
    for (const s of ['idle', 'paused', 'done', 'cancelled', 'error', 'interrupted', 'device-lost', 'quota'] as const) assert.equal(runBusy(s), false, s);
    // The interrupted note and the lost-device alert show the message; the status line then only names the state.
    assert.equal(statusMessage({ status: 'interrupted', message: 'The page was closed during training.' }), '');
    assert.equal(statusMessage({ status: 'device-lost', message: 'The GPU device was lost.' }), '');
    assert.equal(statusMessage({ status: 'paused', message: 'Paused at step 3 (checkpoint saved).' }), 'Paused at step 3 (checkpoint saved).');
  });

  it("the chart legend shows numbers: the latest step's, or the hovered step's; nothing before step 1", () => {
    assert.equal(legendValues([], null), null);
    const losses = [0.5, 0.3, 0.4].map((loss, i) => ({ step: i + 1, loss }));
    const latest = legendValues(losses, null)!;
    assert.deepEqual(
      { ...latest, average: Math.round(latest.average * 1e9) / 1e9 },
      { step: 3, loss: 0.4, average: 0.4, latest: true },
      'mean of 0.5, 0.3, 0.4 (to 1e-9: float sums)',
    );
    const hovered = legendValues(losses, 1)!;
    assert.equal(hovered.step, 2);
    assert.equal(hovered.latest, false);
    assert.ok(Math.abs(hovered.average - 0.4) < 1e-12, 'the average of the steps up to the hovered one (0.5, 0.3)');
    assert.equal(legendValues(losses, 7)!.step, 3, 'an index past the data shows the latest');
  });

  it('the progress line: warm-up apart from s/step, the ETA (about, while it rests on a first estimate)', () => {
    const run = { step: 0, steps: 6, secondsPerStep: null, warmupSeconds: null, etaSeconds: null, etaProvisional: false, lastCheckpoint: 0 };
    assert.equal(progressLine(run), 'Step 0 / 6', 'nothing timed: no pace, no ETA');
    assert.equal(
      progressLine({ ...run, step: 1, warmupSeconds: 13.4, etaSeconds: 95, etaProvisional: true }),
      'Step 1 / 6 · warm-up: the first step took 13.4 s (compiling GPU pipelines) · ETA about 1:35',
    );
    assert.equal(
      progressLine({ ...run, step: 4, warmupSeconds: 13.4, secondsPerStep: 0.5, etaSeconds: 12, lastCheckpoint: 4 }),
      'Step 4 / 6 · warm-up 13.4 s · 0.50 s/step · ETA 0:12 · checkpoint at step 4',
    );
  });

  it('no ETA on the progress line of a run that is not running; "1 step", not "1 steps"', () => {
    const run = { step: 3, steps: 3, secondsPerStep: 1, warmupSeconds: 5, etaSeconds: 2, etaProvisional: false, lastCheckpoint: 3 };
    assert.match(progressLine({ ...run, status: 'training' }), /ETA 0:02/);
    for (const status of ['done', 'paused', 'error', 'interrupted'] as const) assert.doesNotMatch(progressLine({ ...run, status }), /ETA/, status);
    assert.equal(stepCount(1), '1 step');
    assert.equal(stepCount(3), '3 steps');
  });

  it("Samples panel: the run's own interval, and the changed setting for the next run; before a run the setting", () => {
    const started = { status: 'done' as const, startedWith: { prompt: 'p', settings: { ...PAGE_DEFAULTS, sampleEvery: 5 }, photoIds: [], classIds: [] } };
    assert.equal(
      samplesHint({ status: 'idle', startedWith: null }, { sampleEvery: 2 }),
      'A sample appears before the first step and every 2 steps, always with the same seed.',
    );
    const h = samplesHint(started, { sampleEvery: 2 });
    assert.match(h, /^This run draws a sample before the first step and every 5 steps/);
    assert.match(h, /next run.*every 2 steps/);
    assert.doesNotMatch(samplesHint(started, { sampleEvery: 5 }), /next run/);
    assert.match(samplesHint({ status: 'idle', startedWith: null }, { sampleEvery: 0 }), /off/);
  });

  it("the demo model's settings come only when switching to it: loading it again after a reload keeps the changed interval", async () => {
    const { modelDefaults } = await import('../../src/ui/studio/actions.ts');
    const summary = { nativeResolution: 64 };
    assert.equal(modelDefaults({ kind: 'demo' }, null, summary, { steps: 400 }).sampleEvery, 5, 'first time: the demo defaults');
    assert.equal(modelDefaults({ kind: 'demo' }, { kind: 'hub', endpoint: 'e', repo: 'r' }, summary, { steps: 400 }).resolution, 64);
    assert.deepEqual(modelDefaults({ kind: 'demo' }, { kind: 'demo' }, summary, { steps: 400 }), {}, 'the same model again: nothing changed');
    assert.deepEqual(modelDefaults({ kind: 'hub', endpoint: 'e', repo: 'r' }, null, summary, { steps: 400 }), {});
    // SDXL trains at 1024 px: switching to an SDXL file sets it; the same file given again (a reload) keeps the user's.
    const xl = { family: 'sdxl' };
    const file = { kind: 'file', name: 'xl.safetensors', size: 7 } as const;
    assert.deepEqual(modelDefaults(file, { kind: 'demo' }, xl, { steps: 400 }), { resolution: 1024 });
    assert.deepEqual(modelDefaults(file, { ...file }, xl, { steps: 400 }), {}, 'the same SDXL file again: nothing changed');
  });

  it('a photo that is not square but trains square with buckets says why, and from which resolution it would not', () => {
    // The demo model: 64 px, factor 64 (VAE 8 x UNet 8): only the 64x64 bucket exists.
    assert.equal(
      bucketNote({ width: 400, height: 300 }, 64, 64),
      'Trains at 64×64, a square crop: at 64 px, with bucket sides in steps of 64 px, no other shape is nearer its 4:3; from 256 px it trains at its own aspect ratio.',
    );
    assert.match(bucketNote({ width: 1600, height: 900 }, 64, 64), /its 16:9; from 192 px/);
    assert.equal(bucketNote({ width: 1600, height: 900 }, 512, 64), 'Trains at 640×384 (its own aspect ratio)');
    assert.equal(bucketNote({ width: 300, height: 300 }, 64, 64), 'Trains at 64×64 (square)');
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

  it('"Choose where to save" is remembered across a reload (on when the saved project predates it)', async () => {
    const { useStudioStore, saveProject, restoreProject } = await import('../../src/ui/studio/state.ts');
    const { createStore, get, set } = await import('idb-keyval');
    const st = useStudioStore.getState();
    st.set({ restored: true, saveWithDialog: false });
    await saveProject();
    st.set({ saveWithDialog: true, restored: false });
    await restoreProject();
    assert.equal(useStudioStore.getState().saveWithDialog, false, 'turned off before the reload, off after it');
    const store = createStore('dreambooth-studio-project', 'project');
    const { saveWithDialog: _, ...older } = (await get('project', store)) as Record<string, unknown>;
    await set('project', older, store);
    await restoreProject();
    assert.equal(useStudioStore.getState().saveWithDialog, true);
  });

  it('a finished run after a reload: "Done" with its steps, no ETA, no download message; a late download event changes nothing', async () => {
    const { useStudioStore, saveProject, restoreProject, EMPTY_RUN, progressLine, statusMessage } = await import('../../src/ui/studio/state.ts');
    const { onEvent } = await import('../../src/ui/studio/actions.ts');
    const st = useStudioStore.getState();
    st.set({ restored: true });
    // As the issue saw it: an export after the run finished had downloaded the demo model; the ETA was left over.
    st.setRun({
      ...EMPTY_RUN,
      runId: 'run-d',
      status: 'done',
      step: 3,
      steps: 3,
      lastCheckpoint: 3,
      etaSeconds: 2,
      secondsPerStep: 1.5,
      message: 'Downloading demo model: 13.8 MiB of 13.8 MiB',
    });
    await saveProject();
    st.set({ restored: false });
    st.setRun(EMPTY_RUN);
    await restoreProject();
    const r = useStudioStore.getState().run;
    assert.equal(r.status, 'done');
    assert.equal(statusMessage(r), 'Trained 3 steps. Try it or export the result below.');
    assert.equal(r.etaSeconds, null);
    assert.doesNotMatch(progressLine(r), /ETA/, progressLine(r));
    onEvent({ type: 'download', path: 'demo model', loaded: 1, total: 2 });
    assert.equal(
      useStudioStore.getState().run.message,
      'Trained 3 steps. Try it or export the result below.',
      'no download on the status line of a stopped run',
    );
    useStudioStore.getState().setRun({ status: 'preparing' });
    onEvent({ type: 'download', path: 'demo model', loaded: 1, total: 2 });
    assert.match(useStudioStore.getState().run.message, /^Downloading demo model/, 'while the run prepares it does say so');
  });

  it('a long phase shows i of n and a time left that counts down; a phase without items, a validation or a stop clears it', async () => {
    const { useStudioStore, EMPTY_RUN, STOPPED, phaseEtaText } = await import('../../src/ui/studio/state.ts');
    const { onEvent } = await import('../../src/ui/studio/actions.ts');
    const st = useStudioStore.getState();
    st.setRun({ ...EMPTY_RUN, runId: 'run-p', status: 'preparing' });
    const before = Date.now();
    onEvent({
      type: 'phase',
      phase: 'class-images',
      message: 'Generating class images of "a dog": image 2 of 4 · about 0:40 left',
      done: 1,
      total: 4,
      etaSeconds: 40,
      provisional: true,
    });
    const p = useStudioStore.getState().run.phase!;
    assert.deepEqual([p.done, p.total, p.etaSeconds, p.provisional], [1, 4, 40, true]);
    assert.ok(p.at! >= before);
    assert.equal(phaseEtaText(p, p.at!), 'about 0:40 left');
    assert.equal(phaseEtaText(p, p.at! + 15_000), 'about 0:25 left', 'counts down between reports');
    assert.equal(phaseEtaText(p, p.at! + 50_000), 'taking longer than estimated');
    assert.equal(phaseEtaText({ ...p, etaSeconds: null }, p.at!), 'estimating the time left');
    onEvent({ type: 'phase', phase: 'planning', message: 'Planning GPU memory' });
    assert.equal(useStudioStore.getState().run.phase, null, 'a phase without items');
    onEvent({ type: 'phase', phase: 'validating', message: 'Validation 1 of 2', done: 0, total: 1, etaSeconds: 3, provisional: true });
    onEvent({ type: 'validation', report: { step: 0, instance: 0.1, class: null }, seconds: 3 });
    assert.equal(useStudioStore.getState().run.phase, null, 'the validation is done');
    onEvent({ type: 'phase', phase: 'encoding', message: 'Encoding: image 1 of 2', done: 0, total: 2, etaSeconds: null });
    st.setRun({ ...STOPPED, status: 'paused' });
    assert.equal(useStudioStore.getState().run.phase, null, 'a stopped run has no phase under way');
  });

  it('the chart aligns training and validation losses by step (validation from step 0, gaps as null)', () => {
    const losses = [1, 2, 3, 4].map((step) => ({ step, loss: 1 / step }));
    const validation = [
      { step: 0, instance: 0.5, class: 0.25 },
      { step: 2, instance: 0.4, class: 0.3 },
      { step: 4, instance: 0.3, class: null },
    ];
    const c = chartColumns(losses, validation);
    assert.deepEqual(c.steps, [0, 1, 2, 3, 4]);
    assert.deepEqual(c.loss, [null, 1, 0.5, 1 / 3, 0.25]);
    assert.deepEqual(c.instance, [0.5, null, 0.4, null, 0.3]);
    assert.deepEqual(c.classes, [0.25, null, 0.3, null, null]);
    assert.equal(c.average[0], null);
    assert.equal(c.average[2], 0.75, 'the moving average of the training loss at step 2');
    assert.deepEqual(validationAt(validation, 3), validation[1]);
    assert.equal(validationAt(validation.slice(1), 1), null);
    assert.ok(STEP_TICKS.length > 0 && STEP_TICKS.every((t) => Number.isInteger(t) && t >= 1), 'the x axis ticks at whole steps only');
  });
});
