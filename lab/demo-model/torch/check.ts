// Checks a model folder the PyTorch path wrote (torch/pretrain.py) against the engine:
//   1. the folder's files and configs are those the engine's `npm run lab:pretrain` writes for the same configs, latent
//      scale and prediction type (diffusersModelFiles: the same paths, the same parsed JSON);
//   2. the project's loader loads it (loadDiffusers: names, shapes, dtypes, the SD 1.x layout);
//   3. the engine's UNet, VAE decoder and text encoder on the loaded weights agree with the PyTorch forward of
//      the same written weights (torch/forward_ref.py: the golden generators' float64 code), within tolerances
//      relative to each output's scale (below).
//
//   bash scripts/gpu-env.sh npx tsx lab/demo-model/torch/check.ts <run>/model <forward-ref.safetensors> <data export>
import { readdirSync, readFileSync, statSync } from 'node:fs';
import { join, relative } from 'node:path';
import { isDeepStrictEqual } from 'node:util';
import { nodeGpu } from '../../../src/gpu/node.ts';
import { readSafetensors } from '../../../src/io/safetensors.ts';
import { loadDiffusers } from '../../../src/models/load.ts';
import { nodeFolder } from '../../../src/models/folder-node.ts';
import { clipTextForward } from '../../../src/nn/clip.ts';
import { unetForward } from '../../../src/nn/unet.ts';
import { vaeDecode } from '../../../src/nn/vae.ts';
import { compare, type Check } from '../../../src/selftest/check.ts';
import { diffusersModelFiles } from '../demo.ts';
import type { DataManifest } from './export-data.ts';

/**
 * Tolerance of an engine output against the float64 reference: |engine - torch| <= REL_ATOL * max |torch| +
 * RTOL |torch|. The engine computes in f32 on the same fp16 weights, so its error is f32 rounding through the
 * layers: measured at most 1.5e-6 on outputs of scale 1.6-3.5 (under 1e-6 of the scale; README "The PyTorch path"),
 * so 1e-4 leaves a margin of 100. A weight read under the wrong name, a transposed matrix or a missing norm moves
 * the outputs by the order of their scale, 10^4 times past it.
 */
const REL_ATOL = 1e-4;
const RTOL = 1e-4;

function listFiles(dir: string): string[] {
  return readdirSync(dir, { recursive: true, encoding: 'utf8' })
    .filter((f) => statSync(join(dir, f)).isFile())
    .map((f) => relative(dir, join(dir, f)))
    .sort();
}

/** The folder's layout and JSON files against what the engine writes for the same configs; a problem per mismatch. */
export function layoutProblems(model: string, data: DataManifest, dataDir: string): string[] {
  const json = (p: string) => JSON.parse(readFileSync(join(model, p), 'utf8')) as Record<string, unknown>;
  const vae = json('vae/config.json');
  const scheduler = json('scheduler/scheduler_config.json');
  const configs = {
    ...data.configs,
    vae: { ...data.configs.vae, scaling_factor: vae.scaling_factor },
    scheduler: { ...data.configs.scheduler, prediction_type: scheduler.prediction_type },
  };
  const tokenizer = {
    vocab: JSON.parse(readFileSync(join(dataDir, 'tokenizer', 'vocab.json'), 'utf8')) as Record<string, number>,
    merges: readFileSync(join(dataDir, 'tokenizer', 'merges.txt'), 'utf8'),
  };
  const empty = { unet: new Map(), vae: new Map(), text_encoder: new Map() };
  const expected = diffusersModelFiles(configs, empty, tokenizer, {}, 'F16');
  const problems: string[] = [];
  const have = listFiles(model);
  if (!isDeepStrictEqual(have, [...expected.keys()].sort()))
    problems.push(`files ${have.join(', ')}; the engine writes ${[...expected.keys()].sort().join(', ')}`);
  for (const [path, bytes] of expected) {
    if (!have.includes(path)) continue;
    if (path.endsWith('.json') && !isDeepStrictEqual(json(path), JSON.parse(new TextDecoder().decode(bytes))))
      problems.push(`${path} differs from the engine's (parsed JSON)`);
    if (path === 'tokenizer/merges.txt' && readFileSync(join(model, path), 'utf8') !== tokenizer.merges) problems.push(`${path} differs from the export's`);
  }
  if (!(Number(vae.scaling_factor) > 0)) problems.push(`vae/config.json scaling_factor ${String(vae.scaling_factor)} is not a positive number`);
  return problems;
}

/** The engine's forwards of the loaded folder against the reference; one check per component. */
export async function forwardChecks(model: string, refPath: string): Promise<Check[]> {
  const ref = readSafetensors(new Uint8Array(readFileSync(refPath))).tensors;
  const get = (n: string) => {
    const t = ref.get(n);
    if (!t) throw new Error(`${refPath}: no tensor ${n}; write it with lab/demo-model/torch/forward_ref.py`);
    return { data: Float32Array.from(t.data), shape: t.shape };
  };
  const gpu = await nodeGpu();
  const m = await loadDiffusers(gpu, nodeFolder(model), { dtype: 'f32' });
  const up = (t: { data: Float32Array; shape: number[] }) => gpu.upload(t.data, t.shape, 'f32');
  const ids = get('input_ids');
  const outs = {
    unet: unetForward(gpu, m.unet.config, m.unet.weights, up(get('sample')), up(get('timestep')), up(get('encoder_hidden_states'))),
    decoded: vaeDecode(gpu, m.vae.config, m.vae.weights, up(get('latents'))),
    last_hidden_state: clipTextForward(gpu, m.textEncoder.config, m.textEncoder.weights, Int32Array.from(ids.data), ids.shape[0]),
  };
  const checks: Check[] = [];
  for (const [name, t] of Object.entries(outs)) {
    const want = get(name).data;
    const scale = want.reduce((a, v) => Math.max(a, Math.abs(v)), 0);
    checks.push(compare(`${name}: engine vs PyTorch`, await gpu.read(t), want, { atol: REL_ATOL * scale, rtol: RTOL }));
  }
  return checks;
}

if (process.argv[1]?.endsWith('check.ts')) {
  const [model, refPath, dataDir] = process.argv.slice(2);
  if (!model || !refPath || !dataDir) {
    console.error('usage: check.ts <model folder> <forward-ref.safetensors> <data export folder>');
    process.exit(2);
  }
  const data = JSON.parse(readFileSync(join(dataDir, 'data.json'), 'utf8')) as DataManifest;
  const problems = layoutProblems(model, data, dataDir);
  for (const p of problems) console.log(`layout: ${p}`);
  if (!problems.length) console.log('layout: the files and configs the engine writes (same paths, same parsed JSON)');
  const checks = await forwardChecks(model, refPath);
  for (const c of checks)
    console.log(
      `${c.pass ? 'ok  ' : 'FAIL'} ${c.label}: max |diff| ${c.maxAbs.toExponential(2)}, max rel ${c.maxRel.toExponential(2)} (atol ${c.tol.atol.toExponential(2)}, rtol ${c.tol.rtol})`,
    );
  process.exit(problems.length || checks.some((c) => !c.pass) ? 1 : 0);
}
