// The PyTorch path's data export (lab/demo-model/torch/export-data.ts), without torch: the files hold exactly the
// pictures, captions and token ids the engine's pretraining draws for the same seed and indices, the same options
// write the same bytes, and bad or leaking options are refused by name before anything is written.
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { existsSync, mkdtempSync, readdirSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { gunzipSync } from 'node:zlib';
import { ClipTokenizer } from '../../../src/io/tokenizer.ts';
import { unetParams } from '../../../src/models/shapes.ts';
import { unetConfigFromJson } from '../../../src/nn/unet.ts';
import { PRETRAIN_SIZES } from '../pretrain.ts';
import { captionOf, dataSceneOptions, drawScene, sceneAt } from '../synthetic.ts';
import { DATA_FORMAT, exportData, exportOptionsFromArgs, type DataManifest, type ExportOptions } from '../torch/export-data.ts';

const OPTS: ExportOptions = { size: 'tiny', data: 'stars', dataSeed: 11, dataSize: 24, resolution: 16, solidShare: 0.5 };
const tmp = () => join(mkdtempSync(join(tmpdir(), 'dbs-torch-data-')), 'out');
const read = (dir: string, f: string) => new Uint8Array(readFileSync(join(dir, f)));
const FILES = ['data.json', 'pictures.u8.gz', 'ids.i32', 'bare_ids.i32', 'captions.txt', 'tokenizer/vocab.json', 'tokenizer/merges.txt'];

describe('the PyTorch data export', () => {
  const dir = tmp();
  const m = exportData(dir, OPTS);

  it('holds the engine pictures, captions and token ids of each index', () => {
    const R = OPTS.resolution;
    const pictures = new Uint8Array(gunzipSync(read(dir, 'pictures.u8.gz')));
    assert.equal(pictures.length, OPTS.dataSize * R * R * 3);
    const ids = new Int32Array(read(dir, 'ids.i32').slice().buffer);
    const bare = new Int32Array(read(dir, 'bare_ids.i32').slice().buffer);
    const captions = readFileSync(join(dir, 'captions.txt'), 'utf8').trimEnd().split('\n');
    const tokenizer = ClipTokenizer.fromFiles({
      vocab: JSON.parse(readFileSync(join(dir, 'tokenizer', 'vocab.json'), 'utf8')) as Record<string, number>,
      merges: readFileSync(join(dir, 'tokenizer', 'merges.txt'), 'utf8'),
    });
    const scene = dataSceneOptions('stars', { solidShare: 0.5 });
    for (let i = 0; i < OPTS.dataSize; i++) {
      const s = sceneAt(OPTS.dataSeed, i, scene);
      assert.deepEqual(pictures.subarray(i * R * R * 3, (i + 1) * R * R * 3), drawScene(s, R), `picture ${i}`);
      assert.equal(captions[i], captionOf(s));
      assert.deepEqual(ids.subarray(i * 77, (i + 1) * 77), tokenizer.encodePadded(captionOf(s)), `ids of picture ${i}`);
      assert.deepEqual(bare.subarray(i * 77, (i + 1) * 77), tokenizer.encodePadded(captionOf(s, { background: false })));
    }
    assert.deepEqual(m.emptyIds, [...tokenizer.encodePadded('')]);
  });

  it('records what was drawn, the engine configs and weight shapes, and each file hash', () => {
    const saved = JSON.parse(readFileSync(join(dir, 'data.json'), 'utf8')) as DataManifest;
    assert.equal(saved.format, DATA_FORMAT);
    assert.deepEqual([saved.data, saved.dataSeed, saved.dataSize, saved.resolution, saved.exclude], ['stars', 11, 24, 16, []]);
    assert.deepEqual(saved.holdOut, [{ shape: 'star', colour: 'yellow', pattern: 'dotted', second: 'purple' }]);
    assert.deepEqual(saved.configs, JSON.parse(JSON.stringify(PRETRAIN_SIZES.tiny)));
    assert.deepEqual(saved.params.unet, [...unetParams(unetConfigFromJson(PRETRAIN_SIZES.tiny.unet))]);
    for (const [f, digest] of Object.entries(saved.sha256)) assert.equal(createHash('sha256').update(read(dir, f)).digest('hex'), digest, f);
  });

  it('writes the same bytes for the same options, and other pictures for another data seed', () => {
    const again = tmp();
    exportData(again, OPTS);
    for (const f of FILES) assert.deepEqual(read(again, f), read(dir, f), f);
    const other = tmp();
    exportData(other, { ...OPTS, dataSeed: 12 });
    assert.notDeepEqual(read(other, 'pictures.u8.gz'), read(dir, 'pictures.u8.gz'));
  });

  it('refuses by name, before writing, options that leak the subject or cannot be drawn', () => {
    const cases: [Partial<ExportOptions>, RegExp][] = [
      [{ data: 'v1', exclude: [] }, /--data exclude \[\]: the v1 data holds the subject out/],
      [{ resolution: 15 }, /dataset size 15: use a multiple of 2/],
      [{ dataSize: 0 }, /dataset count 0/],
      [{ solidShare: 2 }, /solidShare 2/],
    ];
    for (const [bad, message] of cases) {
      const out = tmp();
      assert.throws(() => exportData(out, { ...OPTS, ...bad }), message);
      assert.equal(existsSync(out), false, `${message} wrote ${out}`);
    }
    assert.throws(() => exportData(dir, OPTS), /--out .*not empty/);
    assert.equal(readdirSync(dir).length, FILES.length - 1, 'a refused export into a full folder leaves it as it was');
    assert.throws(() => exportOptionsFromArgs(['--out', 'x', '--data', 'v3']), /--data v3: use one of v1, stars/);
    assert.throws(() => exportOptionsFromArgs(['--out', 'x', '--data-size', 'many']), /--data-size many: not a number/);
    assert.throws(() => exportOptionsFromArgs(['--out', 'x', '--exclude', 'moon']), /--exclude moon: not a shape/);
  });
});
