// `npm run cli -- run ...`, the contract outside tools test against: each component on the tiny model
// (diffusers folder, and single file with a --config of the values weights cannot tell), tensors in and
// out by name, compared with the PyTorch goldens; f16 runs too; bad input exits 1 with a message.
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { readSafetensors, writeSafetensors, type NamedTensor } from '../../src/io/safetensors.ts';
import { compare } from '../../src/selftest/check.ts';
import { writeTinyModel } from '../fixtures/models/make-tiny.ts';
import { assertChecks, FIXTURES } from '../helpers.ts';
import { cliArgs } from '../cli.ts';

const dir = mkdtempSync(join(tmpdir(), 'dbs-cli-'));
const tiny = writeTinyModel(dir);
const configPath = join(dir, 'overrides.json');
writeFileSync(configPath, JSON.stringify(tiny.overrides));
const fixture = (n: string) => readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'modules', `${n}.safetensors`)))).tensors;

function cli(...args: string[]): { code: number; err: string } {
  try {
    execFileSync(process.execPath, cliArgs(...args), { stdio: ['ignore', 'pipe', 'pipe'], encoding: 'utf8' });
    return { code: 0, err: '' };
  } catch (e) {
    const x = e as { status: number; stderr: string };
    return { code: x.status, err: x.stderr };
  }
}

function writeIn(name: string, tensors: [string, NamedTensor, 'F16' | 'F32'][]): string {
  const p = join(dir, `${name}.in.safetensors`);
  writeFileSync(p, writeSafetensors(new Map(tensors.map(([n, t, d]) => [n, { ...t, dtype: d }]))));
  return p;
}

function readOut(p: string) {
  return readSafetensors(new Uint8Array(readFileSync(p))).tensors;
}

describe('cli run', () => {
  const u = fixture('unet_sd1');
  const v = fixture('vae');
  const c = fixture('clip_sd1');
  const unetIn = writeIn('unet', [
    ['sample', u.get('sample')!, 'F16'],
    ['timestep', u.get('timestep')!, 'F32'],
    ['encoder_hidden_states', u.get('encoder_hidden_states')!, 'F16'],
  ]);
  const f32 = { atol: 5e-4, rtol: 2e-4 };

  for (const [label, model, extra] of [
    ['diffusers folder', tiny.folder, []],
    ['single file + --config', tiny.singleFile, ['--config', configPath]],
  ] as const)
    it(`unet on the ${label} matches PyTorch`, () => {
      const out = join(dir, `unet-${extra.length}.out.safetensors`);
      const r = cli('run', 'unet', '--model', model, '--in', unetIn, '--out', out, ...extra);
      assert.equal(r.code, 0, r.err);
      assertChecks([compare('out', readOut(out).get('out')!.data, u.get('out')!.data, f32)]);
    });

  it('text-encoder, vae-encode and vae-decode (f32), and unet in f16', () => {
    const te = join(dir, 'te.out.safetensors');
    assert.equal(cli('run', 'text-encoder', '--model', tiny.folder, '--in', writeIn('te', [['input_ids', c.get('input_ids')!, 'F32']]), '--out', te).code, 0);
    const enc = join(dir, 'enc.out.safetensors');
    assert.equal(cli('run', 'vae-encode', '--model', tiny.folder, '--in', writeIn('enc', [['image', v.get('image')!, 'F16']]), '--out', enc).code, 0);
    const dec = join(dir, 'dec.out.safetensors');
    assert.equal(cli('run', 'vae-decode', '--model', tiny.folder, '--in', writeIn('dec', [['latents', v.get('latents')!, 'F32']]), '--out', dec).code, 0);
    const moments = v.get('moments')!.data; // [2, 8, 8, 8]: mean channels 0-3, logvar 4-7 per sample
    const plane = 4 * 64;
    const mean = new Float32Array(2 * plane);
    const logvar = new Float32Array(2 * plane);
    for (let b = 0; b < 2; b++) {
      mean.set(moments.subarray(b * 2 * plane, b * 2 * plane + plane), b * plane);
      logvar.set(moments.subarray(b * 2 * plane + plane, (b + 1) * 2 * plane), b * plane);
    }
    const e = readOut(enc);
    const f16out = join(dir, 'unet16.out.safetensors');
    assert.equal(cli('run', 'unet', '--model', tiny.folder, '--in', unetIn, '--out', f16out, '--dtype', 'f16').code, 0);
    assertChecks([
      compare('last_hidden_state', readOut(te).get('last_hidden_state')!.data, c.get('last_hidden_state')!.data, { atol: 1e-4, rtol: 1e-4 }),
      compare('mean', e.get('mean')!.data, mean, { atol: 2e-4, rtol: 1e-4 }),
      compare('logvar', e.get('logvar')!.data, logvar, { atol: 2e-4, rtol: 1e-4 }),
      compare('image', readOut(dec).get('image')!.data, v.get('decoded')!.data, { atol: 2e-4, rtol: 1e-4 }),
      compare('unet f16', readOut(f16out).get('out')!.data, u.get('out')!.data, { atol: 5e-2, rtol: 2e-2 }),
    ]);
    assert.deepEqual(e.get('mean')!.shape, [2, 4, 8, 8]);
  });

  it('grad unet: loss and every parameter gradient under diffusers names match PyTorch autograd', () => {
    const grads = readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, 'modules', 'unet_sd1_grads.safetensors')))).tensors;
    const gin = writeIn('grad', [
      ['sample', u.get('sample')!, 'F16'],
      ['timestep', u.get('timestep')!, 'F32'],
      ['encoder_hidden_states', u.get('encoder_hidden_states')!, 'F16'],
      ['target', grads.get('target')!, 'F16'],
    ]);
    const out = join(dir, 'grads.out.safetensors');
    const r = cli('grad', 'unet', '--model', tiny.singleFile, '--config', configPath, '--in', gin, '--out', out);
    assert.equal(r.code, 0, r.err);
    const got = readOut(out);
    const names = [...grads.keys()].filter((k) => k.startsWith('grad.'));
    assert.equal(got.size, names.length + 1, 'loss + one gradient per parameter');
    const checks = [compare('loss', got.get('loss')!.data, grads.get('loss')!.data, { atol: 1e-6, rtol: 1e-4 })];
    for (const n of names) {
      const want = grads.get(n)!.data;
      const scale = want.reduce((m, v) => Math.max(m, Math.abs(v)), 0);
      checks.push(compare(n, got.get(n.slice(5))!.data, want, { atol: 1e-4 * scale + 1e-12, rtol: 1e-4 }));
    }
    assertChecks(checks);
  });

  it('bad input: a missing input tensor, an unknown target, a pickle model', () => {
    const noCtx = writeIn('bad', [['sample', u.get('sample')!, 'F32']]);
    const r = cli('run', 'unet', '--model', tiny.folder, '--in', noCtx, '--out', join(dir, 'x.safetensors'));
    assert.equal(r.code, 1);
    assert.match(r.err, /has no tensor 'timestep'/);
    assert.match(cli('run', 'decoder', '--model', tiny.folder, '--in', noCtx, '--out', 'x').err, /usage: run <unet\|text-encoder\|vae-encode\|vae-decode>/);
    const ckpt = join(dir, 'm.ckpt');
    writeFileSync(ckpt, Buffer.from([0x80, 0x02, ...new Array(40).fill(0)]));
    assert.match(cli('run', 'unet', '--model', ckpt, '--in', unetIn, '--out', 'x').err, /PyTorch pickle checkpoint/);
  });
});
