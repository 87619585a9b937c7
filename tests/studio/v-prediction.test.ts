// The studio's single-file export of a v-prediction model loads back as v-prediction, where the studio and the
// CLI open it (ModelSource through openSingleFile, and inspectSingleFile for the model summary and `cli inspect`):
// from the file's modelspec.prediction_type, else a `v_pred` marker tensor; a scheduler config still wins, and a
// file that says nothing keeps its family's default. The base here is the tiny SD1 model with a v_prediction
// scheduler, like the shipped demo model (SD1 layout, v-prediction), whose export was read back as epsilon.
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, describe, it } from 'node:test';
import { writeSingleFile } from '../../src/export/full.ts';
import { SafetensorsFile, SafetensorsWriter, type TensorSpec } from '../../src/io/safetensors.ts';
import { nodeFileSink } from '../../src/io/sink-node.ts';
import { NodeFileSource } from '../../src/io/source-node.ts';
import type { TensorProvider } from '../../src/io/tensor-provider.ts';
import { nodeFolder } from '../../src/models/folder-node.ts';
import { inspectSingleFile } from '../../src/models/inspect.ts';
import { openDiffusers, openSingleFile } from '../../src/models/source.ts';
import { writeTinyModel } from '../fixtures/models/make-tiny.ts';

const dir = mkdtempSync(join(tmpdir(), 'dbs-vpred-'));
after(() => rmSync(dir, { recursive: true, force: true }));
const NOTHING_TRAINED: TensorProvider = { names: () => [], shape: () => [], read: () => Promise.reject(new Error('nothing trained')) };

/** The tiny SD1 model with the given prediction type, exported as one file the way the studio's "single file" export writes it. */
async function exported(prediction: 'v_prediction' | 'epsilon') {
  const tiny = writeTinyModel(join(dir, prediction), 'sd1');
  const sched = join(tiny.folder, 'scheduler', 'scheduler_config.json');
  writeFileSync(sched, JSON.stringify({ ...JSON.parse(readFileSync(sched, 'utf8')), prediction_type: prediction }));
  const base = await openDiffusers(nodeFolder(tiny.folder));
  assert.equal(base.prediction, prediction, 'the base folder');
  const out = join(dir, `${prediction}.safetensors`);
  await writeSingleFile(await nodeFileSink(out), base, NOTHING_TRAINED, { title: 'tiny', date: new Date(0) });
  return { path: out, overrides: tiny.overrides };
}

/** Rewrites a single file without its metadata, with `extra` tensors added (streamed, tensor by tensor). */
async function rewritten(from: string, to: string, extra: TensorSpec[]): Promise<void> {
  const src = await SafetensorsFile.open(await NodeFileSource.open(from));
  const specs: TensorSpec[] = src.names.map((name) => ({ name, dtype: src.entry(name).dtype, shape: src.entry(name).shape }));
  const w = new SafetensorsWriter(await nodeFileSink(to), [...specs, ...extra], {});
  for (const s of specs) await w.write(s.name, await src.readRaw(s.name));
  for (const e of extra) await w.write(e.name, new Uint8Array(4 * e.shape.reduce((a, b) => a * b, 1)));
  await w.finish();
  await src.source.close?.();
}

async function prediction(path: string, overrides: object, scheduler?: { prediction_type: string }) {
  const file = await SafetensorsFile.open(await NodeFileSource.open(path));
  const src = await openSingleFile(file, { overrides: { ...overrides, ...(scheduler ? { scheduler } : {}) } });
  const inspected = await inspectSingleFile(await NodeFileSource.open(path), scheduler, overrides);
  await file.source.close?.();
  return { loaded: src.prediction, source: src.predictionSource, inspected: inspected.prediction };
}

describe('single-file prediction type', () => {
  it('a v-prediction model exported as one file loads back as v-prediction (loader and inspect), from modelspec.prediction_type', async () => {
    const v = await exported('v_prediction');
    const meta = (await SafetensorsFile.open(await NodeFileSource.open(v.path))).metadata;
    assert.equal(meta['modelspec.prediction_type'], 'v', 'the export says so');
    const p = await prediction(v.path, v.overrides);
    assert.deepEqual([p.loaded, p.inspected], ['v_prediction', 'v_prediction']);
    assert.match(p.source, /modelspec\.prediction_type "v"/);
    const eps = await exported('epsilon');
    const q = await prediction(eps.path, eps.overrides);
    assert.deepEqual([q.loaded, q.inspected], ['epsilon', 'epsilon'], 'an epsilon export stays epsilon');
  });

  it("without metadata: a v_pred marker tensor means v; nothing at all is the family's default; a scheduler config wins", async () => {
    const v = await exported('v_prediction');
    const marked = join(dir, 'marked.safetensors');
    await rewritten(v.path, marked, [{ name: 'v_pred', dtype: 'F32', shape: [1] }]);
    const m = await prediction(marked, v.overrides);
    assert.deepEqual([m.loaded, m.inspected], ['v_prediction', 'v_prediction']);
    const bare = join(dir, 'bare.safetensors');
    await rewritten(v.path, bare, []);
    const b = await prediction(bare, v.overrides);
    assert.deepEqual([b.loaded, b.inspected], ['epsilon', 'epsilon'], 'SD1 default');
    const c = await prediction(v.path, v.overrides, { prediction_type: 'epsilon' });
    assert.deepEqual([c.loaded, c.inspected], ['epsilon', 'epsilon'], 'the config given wins over the metadata');
  });
});
