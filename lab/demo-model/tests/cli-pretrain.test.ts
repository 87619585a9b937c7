// `npm run lab:pretrain -- --init-from <model>` on the tiny pretrained fixture: a new run goes on from the
// model with its size, settings, prediction type and tokenizer (flags override), counts the model's steps
// into the export's total, and a run killed before its first checkpoint resumes from the model again, to the
// same bytes.
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { describe, it } from 'node:test';
import { fileURLToPath } from 'node:url';
import { readSafetensors } from '../../../src/io/safetensors.ts';
import { cliArgs } from '../../../tests/cli.ts';

const root = join(dirname(fileURLToPath(import.meta.url)), '..', '..', '..');
const fixture = join(root, 'tests', 'fixtures', 'models', 'pretrained-tiny');
const dir = mkdtempSync(join(tmpdir(), 'dbs-pretrain-'));

function pretrain(...args: string[]): string {
  return execFileSync(process.execPath, cliArgs('lab:pretrain', ...args), {
    stdio: ['ignore', 'pipe', 'pipe'],
    encoding: 'utf8',
  });
}

const unetFile = (run: string) => join(run, 'model', 'unet', 'diffusion_pytorch_model.safetensors');

describe('lab:pretrain --init-from (tiny pretrained fixture)', () => {
  it("goes on with the model's size, settings and tokenizer; counts its steps; resumes from it before a checkpoint", () => {
    const run = join(dir, 'onward');
    pretrain('--out', run, '--init-from', fixture, '--steps', '4', '--batch', '4', '--checkpoint-every', '0');
    const saved = JSON.parse(readFileSync(join(run, 'pretrain.json'), 'utf8')) as { size: string; settings: Record<string, unknown> };
    // The fixture was trained at 16 px on 2000 pictures with epsilon and seed 1, before solidShare existed;
    // --batch is ours, and the seed is the next one (seed 1 would draw again the batches and noise it was trained on).
    assert.equal(saved.size, 'tiny', 'the size is read from the model');
    assert.deepEqual(
      [saved.settings.resolution, saved.settings.dataSize, saved.settings.prediction, saved.settings.solidShare, saved.settings.batch, saved.settings.seed],
      [16, 2000, 'epsilon', null, 4, 2],
    );
    assert.equal(saved.settings.initSteps, 300);
    for (const f of ['vocab.json', 'merges.txt'])
      assert.deepEqual(readFileSync(join(run, 'model', 'tokenizer', f)), readFileSync(join(fixture, 'tokenizer', f)), `tokenizer/${f}`);
    const first = readFileSync(unetFile(run));
    const meta = readSafetensors(new Uint8Array(first)).metadata;
    assert.deepEqual([meta.step, meta.total_steps], ['4', '304']);
    assert.notDeepEqual(first, readFileSync(join(fixture, 'unet', 'diffusion_pytorch_model.safetensors')), 'it trained');
    // Killed before any checkpoint: only pretrain.json and the tokenizer are left. The resume must start from the
    // fixture again (not the initialisation) and so reach the same weights, byte for byte.
    rmSync(join(run, 'store'), { recursive: true });
    rmSync(join(run, 'model'), { recursive: true });
    pretrain('--resume', run);
    assert.deepEqual(readFileSync(unetFile(run)), first, 'the resumed run went on from the model, as the first did');
  });
});
