// The run's cached latents and masks (pipeline/run.ts) follow the masks: a run prepared again (a resume) after
// a mask was painted, changed or removed encodes its photos again with the new mask, and one prepared with
// the same masks reads the cache. The demo model on the Node GPU, 32 px.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { encode } from 'fast-png';
import { nodeGpu } from '../../src/gpu/node.ts';
import { decodeImageNode } from '../../src/io/image-node.ts';
import { BytesSource } from '../../src/io/source.ts';
import { demoModelFiles, DEMO_RESOLUTION } from '../../lab/demo-model/demo.ts';
import { folderFromSources, tokenizerFilesFrom } from '../../src/models/source.ts';
import { MemoryChunkStore } from '../../src/store/chunkstore.ts';
import { maskFingerprint, TrainingRun, type OpenedModel, type RunEvent, type RunInput } from '../../src/pipeline/run.ts';
import { defaultSettings } from '../../src/pipeline/settings.ts';
import { loadTrainData } from '../../src/train/preprocess.ts';
import { testGpu } from '../helpers.ts';

async function demoModel(): Promise<OpenedModel> {
  const files = new Map([...demoModelFiles(1)].map(([p, b]) => [p, new BytesSource(b, p)]));
  const reader = folderFromSources('demo', files);
  const tokenizer = await tokenizerFilesFrom(reader);
  assert.ok(tokenizer);
  return { kind: 'diffusers', name: 'demo', reader, tokenizer };
}

/** A w x h PNG: a gradient photo, or (mask) white where `white(x, y)`. */
function png(w: number, h: number, white?: (x: number, y: number) => boolean): Blob {
  const data = new Uint8Array(w * h * 3);
  for (let y = 0; y < h; y++)
    for (let x = 0; x < w; x++) data.set(white ? (white(x, y) ? [255, 255, 255] : [0, 0, 0]) : [(x * 255) / w, (y * 255) / h, 90], 3 * (y * w + x));
  return new Blob([new Uint8Array(encode({ width: w, height: h, data, channels: 3, depth: 8 }))], { type: 'image/png' });
}

function input(mask: Blob | null): RunInput {
  return {
    runId: 'r1',
    prompt: 'a photo of sks toy',
    images: [
      { id: 'a', name: 'a.png', blob: png(32, 32), ...(mask ? { mask: { name: 'the mask of a.png', blob: mask } } : {}) },
      { id: 'b', name: 'b.png', blob: png(32, 32) },
    ],
    classImages: [],
    settings: { ...defaultSettings('lora'), resolution: DEMO_RESOLUTION, steps: 2, sampleEvery: 0, checkpointEvery: 0, budgetBytes: 2 ** 30 },
  };
}

describe('cached latents and masks', () => {
  it('the fingerprint names each photo and its mask bytes', async () => {
    const left = png(32, 32, (x) => x < 16);
    assert.equal(await maskFingerprint(input(null).images), 'a:-,b:-');
    const f = await maskFingerprint(input(left).images);
    assert.match(f, /^a:[0-9a-f]+,b:-$/);
    assert.notEqual(f, await maskFingerprint(input(png(32, 32, (x) => x >= 16)).images), 'another mask, another fingerprint');
    assert.equal(f, await maskFingerprint(input(png(32, 32, (x) => x < 16)).images), 'the same mask, the same fingerprint');
  });

  it('a mask painted, then changed, then removed after the photos were encoded is used when the run is prepared again', { timeout: 300_000 }, async () => {
    const gpu = await testGpu();
    const store = new MemoryChunkStore();
    const model = await demoModel();
    const prepare = async (mask: Blob | null) => {
      const events: RunEvent[] = [];
      const host = {
        gpu,
        dryRunGpu: () => nodeGpu({ dryRun: true, disableF16: !gpu.hasF16 }),
        store,
        decode: async (blob: Blob, name: string) => decodeImageNode(new Uint8Array(await blob.arrayBuffer()), name),
        emit: (e: RunEvent) => events.push(e),
        encodePng: (rgb: Uint8Array, width: number, height: number) => encode({ width, height, data: rgb, channels: 3, depth: 8 }),
      };
      const run = await TrainingRun.prepare(host, model, input(mask));
      await run.destroy();
      const encoded = events.some((e) => e.type === 'phase' && e.phase === 'encoding');
      const again = events.some((e) => e.type === 'phase' && /A mask changed/.test(e.message));
      const data = await loadTrainData(store, 'r1');
      assert.ok(data);
      return { encoded, again, mask: data.instance[0].mask ?? null };
    };
    const first = await prepare(null);
    assert.deepEqual([first.encoded, first.again, first.mask], [true, false, null], 'encoded without a mask');
    const same = await prepare(null);
    assert.deepEqual([same.encoded, same.mask], [false, null], 'the same (no) masks: the cache is read');

    const leftMask = await prepare(png(32, 32, (x) => x < 16));
    assert.equal(leftMask.again, true, 'a mask painted since: encoded again');
    assert.ok(leftMask.mask);
    const leftSum = leftMask.mask.reduce((a, b) => a + b, 0);
    assert.ok(leftSum > 0 && leftSum < leftMask.mask.length, 'half the latent is weighted');
    assert.equal((await prepare(png(32, 32, (x) => x < 16))).encoded, false, 'the same mask again: the cache is read');

    const rightMask = await prepare(png(32, 32, (x) => x >= 16));
    assert.equal(rightMask.again, true, 'a changed mask: encoded again');
    assert.notDeepEqual([...rightMask.mask!], [...leftMask.mask], 'the new mask is the one cached');

    const removed = await prepare(null);
    assert.deepEqual([removed.again, removed.mask], [true, null], 'a removed mask: encoded again, no mask');
  });
});
