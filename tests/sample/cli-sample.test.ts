// `npm run cli -- sample` on the tiny model: a real PNG of the VAE's output size, the same bytes for
// the same seed, different ones for another seed, negative prompt or sampler.
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { describe, it } from 'node:test';
import { fileURLToPath } from 'node:url';
import { decode } from 'fast-png';
import { writeTinyModel } from '../fixtures/models/make-tiny.ts';

const root = join(dirname(fileURLToPath(import.meta.url)), '..', '..');
const dir = mkdtempSync(join(tmpdir(), 'dbs-sample-'));
const tiny = writeTinyModel(dir);

function sample(name: string, ...args: string[]): Uint8Array {
  const out = join(dir, `${name}.png`);
  execFileSync(
    process.execPath,
    [
      '--import',
      'tsx',
      join(root, 'src/cli/main.ts'),
      'sample',
      '--model',
      tiny.folder,
      '--out',
      out,
      '--width',
      '16',
      '--height',
      '16',
      '--steps',
      '4',
      ...args,
    ],
    { stdio: ['ignore', 'pipe', 'pipe'] },
  );
  return new Uint8Array(readFileSync(out));
}

describe('cli sample (tiny model)', () => {
  it('writes a deterministic PNG; seed, negative prompt and sampler change it', () => {
    const a = sample('a', '--prompt', 'a photo of a dog', '--seed', '1');
    const png = decode(a);
    assert.deepEqual([png.width, png.height, png.channels], [16, 16, 3]);
    assert.deepEqual(sample('a2', '--prompt', 'a photo of a dog', '--seed', '1'), a, 'same seed, same bytes');
    assert.notDeepEqual(sample('b', '--prompt', 'a photo of a dog', '--seed', '2'), a);
    assert.notDeepEqual(sample('c', '--prompt', 'a photo of a dog', '--seed', '1', '--negative', 'blurry'), a);
    assert.notDeepEqual(sample('d', '--prompt', 'a photo of a dog', '--seed', '1', '--sampler', 'ddim'), a);
  });
});
