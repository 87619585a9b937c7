// `cli run` / `cli grad unet` on the tiny SDXL model (tests/fixtures/models/make-tiny-sdxl.ts): the UNet takes
// sample, timestep, encoder_hidden_states, text_embeds and time_ids from the single file (with a --config
// that includes text_encoder_2), the text encoders give prompt_embeds and pooled from the folder, grad unet
// gives every parameter's gradient; all against the PyTorch goldens (tolerances as tests/modules/sdxl.test.ts,
// f32). time_ids of the wrong length exit 1 naming the --in file; `cli sample` draws with both tokenizers;
// `cli inspect` reports either layout as SDXL and names a missing tensor among its problems; `cli train` runs a
// 2-step LoRA whose kohya export reads back with SDXL keys and metadata.
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, describe, it } from 'node:test';
import { encode as encodePng } from 'fast-png';
import { inspectSdxlPath } from '../../src/cli/run-sdxl.ts';
import { readSafetensors, writeSafetensors, type NamedTensor } from '../../src/io/safetensors.ts';
import { compare, type Check } from '../../src/selftest/check.ts';
import { writeTinySdxl } from '../fixtures/models/make-tiny-sdxl.ts';
import { assertChecks, FIXTURES } from '../helpers.ts';
import { cliArgs } from '../cli.ts';

const dir = mkdtempSync(join(tmpdir(), 'dbs-cli-sdxl-'));
after(() => rmSync(dir, { recursive: true, force: true }));
const tiny = writeTinySdxl(dir);
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
const writeIn = (name: string, t: Map<string, NamedTensor>) => {
  const p = join(dir, `${name}.in.safetensors`);
  writeFileSync(p, writeSafetensors(t));
  return p;
};
const readOut = (p: string) => readSafetensors(new Uint8Array(readFileSync(p))).tensors;

describe('cli on an SDXL model', () => {
  const u = fixture('unet_sdxl');
  const names = ['sample', 'timestep', 'encoder_hidden_states', 'text_embeds', 'time_ids'];
  const unetIn = new Map(names.map((n) => [n, u.get(n)!] as const));

  it('run unet (single file, --config with text_encoder_2) and grad unet (folder) match PyTorch', () => {
    const inPath = writeIn('unet', unetIn);
    const out = join(dir, 'unet.out.safetensors');
    const r = cli('run', 'unet', '--model', tiny.singleFile, '--config', configPath, '--in', inPath, '--out', out);
    assert.equal(r.code, 0, r.err);
    const gradIn = writeIn('grad', new Map([...unetIn, ['target', u.get('target')!]]));
    const gradOut = join(dir, 'grad.out.safetensors');
    const g = cli('grad', 'unet', '--model', tiny.folder, '--in', gradIn, '--out', gradOut);
    assert.equal(g.code, 0, g.err);
    const grads = readOut(gradOut);
    const checks: Check[] = [
      compare('out', readOut(out).get('out')!.data, u.get('out')!.data, { atol: 5e-4, rtol: 2e-4 }),
      compare('loss', grads.get('loss')!.data, u.get('loss')!.data, { atol: 1e-6, rtol: 1e-4 }),
    ];
    for (const [n, t] of u) {
      if (!n.startsWith('grad.')) continue;
      const scale = t.data.reduce((m, v) => Math.max(m, Math.abs(v)), 0);
      checks.push(compare(n, grads.get(n.slice(5))!.data, t.data, { atol: 1e-4 * scale + 1e-12, rtol: 1e-4 }));
    }
    assert.equal(checks.length, 2 + tiny.weights.unet.size);
    assertChecks(checks);
  });

  it('run text-encoder gives prompt_embeds and pooled', () => {
    const c = fixture('clip_sdxl');
    const inPath = writeIn(
      'te',
      new Map([
        ['input_ids', c.get('input_ids')!],
        ['input_ids_2', c.get('input_ids_2')!],
      ]),
    );
    const out = join(dir, 'te.out.safetensors');
    const r = cli('run', 'text-encoder', '--model', tiny.folder, '--in', inPath, '--out', out);
    assert.equal(r.code, 0, r.err);
    const o = readOut(out);
    assertChecks([
      compare('prompt_embeds', o.get('prompt_embeds')!.data, c.get('prompt_embeds')!.data, { atol: 1e-4, rtol: 1e-4 }),
      compare('pooled', o.get('pooled')!.data, c.get('pooled')!.data, { atol: 1e-4, rtol: 1e-4 }),
    ]);
  });

  it('inspect reports both layouts as SDXL (widths, depths, parameters) and a missing tensor as a problem', async () => {
    // The command line once (its SDXL dispatch), the same function in this process for the rest.
    type Report = Record<string, unknown> & { parameters: Record<string, number>; problems: string[] };
    const cliInspect = (path: string) =>
      JSON.parse(
        execFileSync(process.execPath, cliArgs('inspect', path, '--config', configPath), {
          stdio: ['ignore', 'pipe', 'pipe'],
          encoding: 'utf8',
        }),
      ) as Report;
    const inspect = async (path: string) =>
      path === tiny.singleFile ? cliInspect(path) : ((await inspectSdxlPath(path, path === tiny.folder ? undefined : tiny.overrides)) as unknown as Report);
    const count = (m: Map<string, NamedTensor>) => [...m.values()].reduce((a, t) => a + t.data.length, 0);
    for (const [layout, path] of [
      ['single-file', tiny.singleFile],
      ['diffusers', tiny.folder],
    ]) {
      const r = await inspect(path);
      assert.equal(r.architecture, 'sdxl');
      assert.equal(r.layout, layout);
      assert.equal(r.contextDim, 80);
      assert.deepEqual(r.textEncoders, { width1: 32, width2: 48, projection: 40 });
      assert.deepEqual(r.transformerLayersPerBlock, [1, 2]);
      assert.equal(r.vaeScalingFactor, 0.13025);
      for (const c of ['unet', 'vae', 'text_encoder', 'text_encoder_2'] as const)
        assert.equal(r.parameters[c], count(tiny.weights[c]), `${layout} ${c} parameters`);
      assert.deepEqual(r.problems, [], `${layout}: no problems`);
    }
    const damaged = readSafetensors(new Uint8Array(readFileSync(tiny.singleFile))).tensors;
    damaged.delete('model.diffusion_model.out.2.weight');
    const path = join(dir, 'damaged-sdxl.safetensors');
    writeFileSync(path, writeSafetensors(damaged));
    const r = await inspect(path);
    assert.equal(r.architecture, 'sdxl');
    // Without its config the single file's sizes are a problem, named (tests/models/sdxl-load.test.ts has the message).
    assert.match(
      (await inspectSdxlPath(tiny.singleFile, undefined)).problems.join(' | '),
      /cannot be inferred from the tensor shapes: unet attention_head_dim/,
    );
    assert.ok(
      r.problems.some((p) => /unet/.test(p) && /conv_out\.weight/.test(p)),
      `problems name the missing UNet tensor: ${r.problems.join(' | ')}`,
    );
  });

  it('time ids of the wrong length are refused naming the file', () => {
    const bad = new Map(unetIn);
    bad.set('time_ids', { shape: [2, 5], data: new Float32Array(10) });
    const inPath = writeIn('bad', bad);
    const r = cli('run', 'unet', '--model', tiny.folder, '--in', inPath, '--out', join(dir, 'bad.out.safetensors'));
    assert.equal(r.code, 1);
    assert.match(r.err, /bad\.in\.safetensors: 'time_ids' must be \[2,6\].*got \[2,5\]/);
  });

  it('sample draws a PNG of the asked size with both tokenizers', () => {
    const png = join(dir, 'sdxl.png');
    const r = cli('sample', '--model', tiny.folder, '--prompt', 'a red cube', '--out', png, '--steps', '2', '--width', '16', '--height', '24', '--seed', '3');
    assert.equal(r.code, 0, r.err);
    const b = readFileSync(png);
    assert.deepEqual([b.readUInt32BE(16), b.readUInt32BE(20)], [16, 24], 'IHDR width and height');
  });

  it('train: a LoRA run of 2 steps at 16 px; the kohya export reads back with SDXL keys and metadata', () => {
    const photos = join(dir, 'photos');
    mkdirSync(photos);
    const rgb = new Uint8Array(16 * 16 * 3).map((_, i) => (i * 37) % 251);
    writeFileSync(join(photos, 'a.png'), encodePng({ width: 16, height: 16, data: rgb, channels: 3, depth: 8 }));
    const out = join(dir, 'trained');
    const args = ['train', '--model', tiny.folder, '--images', photos, '--prompt', 'a photo of sks toy', '--mode', 'lora', '--rank', '4'];
    const r = cli(...args, '--steps', '2', '--resolution', '16', '--lr', '1e-3', '--seed', '1', '--sample-every', '0', '--out', out);
    assert.equal(r.code, 0, r.err);
    const kohya = readSafetensors(new Uint8Array(readFileSync(join(out, 'lora-kohya.safetensors'))));
    assert.equal(kohya.metadata.ss_base_model_version, 'sdxl_base_v1-0');
    assert.equal(kohya.metadata['modelspec.architecture'], 'stable-diffusion-xl-v1-base/lora');
    assert.equal(kohya.metadata.ss_network_dim, '4');
    const keys = [...kohya.tensors.keys()];
    assert.ok(keys.length > 0 && keys.every((k) => k.startsWith('lora_unet_')), keys.slice(0, 3).join(', '));
    // two steps moved the up projections away from their zero init
    assert.ok([...kohya.tensors].some(([k, t]) => k.endsWith('.lora_up.weight') && t.data.some((v) => v !== 0)));
  });
});
