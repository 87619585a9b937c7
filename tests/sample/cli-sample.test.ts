// `npm run cli -- sample` on the tiny model: a real PNG of the VAE's output size, the same bytes for
// the same seed, different ones for another seed, negative prompt or sampler. `cli grid`: each cell is
// exactly the image `sample` draws for its row's prompt and its column's seed, upscaled.
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { decode } from 'fast-png';
import { writeTinyModel } from '../fixtures/models/make-tiny.ts';
import { cliArgs } from '../cli.ts';

const dir = mkdtempSync(join(tmpdir(), 'dbs-sample-'));
const tiny = writeTinyModel(dir);

function sample(name: string, ...args: string[]): Uint8Array {
  return cli('sample', name, ...args);
}

function cli(command: 'sample' | 'grid', name: string, ...args: string[]): Uint8Array {
  const out = join(dir, `${name}.png`);
  execFileSync(process.execPath, cliArgs(command, '--model', tiny.folder, '--out', out, '--width', '16', '--height', '16', '--steps', '4', ...args), {
    stdio: ['ignore', 'pipe', 'pipe'],
  });
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

  it('grid: one row per prompt, one column per seed, each cell the sampled image upscaled', () => {
    const prompts = ['a photo of a dog', 'a red cat'];
    const seeds = [3, 5];
    const scale = 2;
    const grid = decode(cli('grid', 'grid', '--prompts', prompts.join('|'), '--seeds', seeds.join(','), '--scale', String(scale)));
    const GAP = 2;
    const cell = 16 * scale + GAP;
    assert.deepEqual([grid.width, grid.height, grid.channels], [cell * 2 - GAP, cell * 2 - GAP, 3]);
    for (const [row, prompt] of prompts.entries())
      for (const [col, seed] of seeds.entries()) {
        const one = decode(sample(`cell-${row}-${col}`, '--prompt', prompt, '--seed', String(seed))).data;
        for (let y = 0; y < 16 * scale; y++)
          for (let x = 0; x < 16 * scale; x++)
            for (let c = 0; c < 3; c++) {
              const want = one[(Math.floor(y / scale) * 16 + Math.floor(x / scale)) * 3 + c];
              const got = grid.data[((row * cell + y) * grid.width + col * cell + x) * 3 + c];
              if (got !== want) assert.fail(`cell (${row}, ${col}) pixel (${x}, ${y}) channel ${c}: ${got}, sample drew ${want}`);
            }
      }
    // The gap between cells is white.
    assert.equal(grid.data[(0 * grid.width + 16 * scale) * 3], 255);
  });
});
