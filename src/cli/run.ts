// `cli run <unet|text-encoder|vae-encode|vae-decode> --model <file|folder> --in <in.safetensors>
//  --out <out.safetensors> [--config <config.json>] [--dtype f32|f16]`: one component forward on the
// engine, tensors in and out by the contract's names; outputs f32, inputs any float dtype.
import { existsSync, readFileSync, statSync } from 'node:fs';
import type { Gpu } from '../gpu/device.ts';
import type { DType } from '../gpu/tensor.ts';
import { readSafetensors, SafetensorsFile, writeSafetensors, type NamedTensor } from '../io/safetensors.ts';
import { checkOutFile, writeOutput } from '../io/outpath.ts';
import { NodeFileSource } from '../io/source-node.ts';
import { nodeFolder } from '../models/folder-node.ts';
import { loadDiffusers, loadSingleFile, type LoadedModel, type LoadOptions } from '../models/load.ts';
import { clipTextForward } from '../nn/clip.ts';
import { unetForward } from '../nn/unet.ts';
import { vaeDecode, vaeEncode } from '../nn/vae.ts';
import { Tape } from '../nn/ops.ts';
import { mseLoss, mseLossBackward } from '../ops/reduce.ts';
import { parseFlags, readJsonFile, stringFlag, UsageError, type Flags } from './args.ts';
import { gradSdxlCommand, isSdxlPath, runSdxlCommand } from './run-sdxl.ts';

const COMPONENT = { unet: 'unet', 'text-encoder': 'text_encoder', 'vae-encode': 'vae', 'vae-decode': 'vae' } as const;
export type RunTarget = keyof typeof COMPONENT;

/** --config: per-component overrides ({unet: {...}, vae: {...}, ...}) or one component's config.json. */
export function configOverrides(path: string | undefined, target: RunTarget): LoadOptions['overrides'] {
  if (!path) return undefined;
  const j = readJsonFile(path, '--config');
  const keys = ['unet', 'vae', 'text_encoder', 'text_encoder_2', 'scheduler'];
  if (Object.keys(j).some((k) => keys.includes(k))) return j as LoadOptions['overrides'];
  return { [COMPONENT[target]]: j };
}

export async function loadModel(gpu: Gpu, path: string, o: LoadOptions): Promise<LoadedModel> {
  if (!existsSync(path)) throw new Error(`${path}: no such file or folder`);
  if (statSync(path).isDirectory()) return loadDiffusers(gpu, nodeFolder(path), o);
  const file = await SafetensorsFile.open(await NodeFileSource.open(path));
  try {
    return await loadSingleFile(gpu, file, o);
  } finally {
    await file.source.close?.();
  }
}

/** Refuses a tensor holding NaN or Inf, naming it: `run` never reads or writes non-finite values silently. */
function refuseNonFinite(data: Float32Array, what: string, then: string): void {
  let bad = 0;
  for (const v of data) if (!Number.isFinite(v)) bad++;
  if (bad) throw new Error(`${what} holds ${bad} non-finite value${bad === 1 ? '' : 's'} (NaN/Inf) of ${data.length}: ${then}`);
}

function need(inputs: Map<string, NamedTensor>, name: string, rank: number, file: string): NamedTensor {
  const t = inputs.get(name);
  if (!t) throw new Error(`${file} has no tensor '${name}' (has: ${[...inputs.keys()].join(', ') || 'none'})`);
  if (t.shape.length !== rank) throw new Error(`${file}: '${name}' must have rank ${rank}, got [${t.shape}]`);
  return t;
}

export async function runComponent(gpu: Gpu, target: RunTarget, model: LoadedModel, inPath: string, dtype: DType): Promise<Map<string, NamedTensor>> {
  const inputs = readSafetensors(new Uint8Array(readFileSync(inPath))).tensors;
  for (const [name, t] of inputs) refuseNonFinite(t.data, `${inPath}: input '${name}'`, 'give finite inputs');
  const up = (t: NamedTensor, d: DType = dtype) => gpu.upload(t.data, t.shape, d, 'activations');
  const outputs = new Map<string, NamedTensor>();
  const read = async (name: string, t: Awaited<ReturnType<typeof up>>) => {
    const data = await gpu.read(t);
    refuseNonFinite(data, `the ${target} output '${name}'`, 'nothing was written');
    outputs.set(name, { shape: [...t.shape], data });
  };
  if (target === 'unet') {
    const sample = need(inputs, 'sample', 4, inPath);
    const timestep = need(inputs, 'timestep', 1, inPath);
    const ctx = need(inputs, 'encoder_hidden_states', 3, inPath);
    await read('out', unetForward(gpu, model.unet.config, model.unet.weights, up(sample), up(timestep, 'f32'), up(ctx)));
  } else if (target === 'text-encoder') {
    const ids = need(inputs, 'input_ids', 2, inPath);
    await read('last_hidden_state', clipTextForward(gpu, model.textEncoder.config, model.textEncoder.weights, Array.from(ids.data, Math.round), ids.shape[0]));
  } else if (target === 'vae-encode') {
    const image = need(inputs, 'image', 4, inPath);
    const moments = await gpu.read(vaeEncode(gpu, model.vae.config, model.vae.weights, up(image)));
    const [n, , h, w] = image.shape;
    const f = 2 ** (model.vae.config.blockOutChannels.length - 1);
    const z = model.vae.config.latentChannels;
    const plane = (h / f) * (w / f);
    const mean = new Float32Array(n * z * plane);
    const logvar = new Float32Array(n * z * plane);
    for (let b = 0; b < n; b++) {
      mean.set(moments.subarray(b * 2 * z * plane, b * 2 * z * plane + z * plane), b * z * plane);
      logvar.set(moments.subarray(b * 2 * z * plane + z * plane, (b + 1) * 2 * z * plane), b * z * plane);
    }
    outputs.set('mean', { shape: [n, z, h / f, w / f], data: mean });
    outputs.set('logvar', { shape: [n, z, h / f, w / f], data: logvar });
  } else {
    const latents = need(inputs, 'latents', 4, inPath);
    await read('image', vaeDecode(gpu, model.vae.config, model.vae.weights, up(latents)));
  }
  return outputs;
}

/** run's and grad's flags: what parses them and what --help says. */
export const COMPONENT_FLAGS: Flags = {
  model: { type: 'string', arg: '<path>', help: 'the model: a diffusers folder or a single .safetensors file', default: 'required' },
  in: { type: 'string', arg: '<in.safetensors>', help: "the component's input tensors, by name", default: 'required' },
  out: { type: 'string', arg: '<out.safetensors>', help: 'the file to write the outputs (grad: the gradients) to', default: 'required' },
  config: { type: 'string', arg: '<json>', help: "config overrides of the model's components", default: 'none' },
  dtype: { type: 'string', arg: '<f32|f16>', help: 'the compute precision (f16 needs shader-f16)', default: 'f32' },
};
export const RUN_USAGE =
  'usage: run <unet|text-encoder|vae-encode|vae-decode> --model <path> --in <in.safetensors> --out <out.safetensors> [--config <json>] [--dtype f32|f16]';
export const GRAD_USAGE = 'usage: grad unet --model <path> --in <in.safetensors> --out <grads.safetensors> [--config <json>] [--dtype f32|f16]';

/** Strict flags of `run` and `grad`: the command's target and --flag values. */
function componentArgs(args: string[], usage: string): { target: string | undefined; arg: (k: string) => string | undefined } {
  const { values, positionals } = parseFlags(args, COMPONENT_FLAGS, usage, { positionals: 1 });
  for (const k of ['model', 'in'] as const) {
    const p = stringFlag(values, k);
    if (p !== undefined && !existsSync(p)) throw new UsageError(`--${k} ${p}: no such file or folder`);
  }
  return { target: positionals[0], arg: (k) => stringFlag(values, k.replace(/^--/, '')) };
}

/** What `run` and `grad` read: their output may be none of these. */
const readPaths = (model: string, input: string, config: string | undefined) => [
  { flag: '--model', path: model },
  { flag: '--in', path: input },
  { flag: '--config', path: config },
];

export async function runCommand(gpu: Gpu, args: string[]): Promise<void> {
  const { target: t, arg } = componentArgs(args, RUN_USAGE);
  const target = t as RunTarget;
  if (!t || !(target in COMPONENT)) throw new UsageError(`${t ? `unknown component "${t}": ` : ''}${RUN_USAGE}`);
  const modelPath = arg('--model');
  const inPath = arg('--in');
  const outPath = arg('--out');
  if (!modelPath || !inPath || !outPath) throw new Error('run needs --model, --in and --out');
  checkOutFile('--out', outPath, readPaths(modelPath, inPath, arg('--config')));
  const dtype = (arg('--dtype') ?? 'f32') as DType;
  if (dtype !== 'f32' && dtype !== 'f16') throw new Error(`--dtype must be f32 or f16, got ${dtype}`);
  if (dtype === 'f16' && !gpu.hasF16) throw new Error('--dtype f16 needs a GPU with shader-f16; this one has none (use f32)');
  if (await isSdxlPath(modelPath)) return runSdxlCommand(gpu, target, modelPath, inPath, outPath, dtype, configOverrides(arg('--config'), target));
  const model = await loadModel(gpu, modelPath, { dtype, overrides: configOverrides(arg('--config'), target) });
  const outputs = await runComponent(gpu, target, model, inPath, dtype);
  writeOutput(outPath, writeSafetensors(outputs));
}

/**
 * `grad unet --model <path> [--config <json>] --in <in.safetensors> --out <grads.safetensors> [--dtype]`:
 * loss = mean((unet(sample, timestep, encoder_hidden_states) - target)^2); writes `loss` and the gradient
 * of every UNet parameter under its diffusers name (f32).
 */
export async function gradCommand(gpu: Gpu, args: string[]): Promise<void> {
  const { target: component, arg } = componentArgs(args, GRAD_USAGE);
  if (component !== 'unet') throw new UsageError(GRAD_USAGE);
  const modelPath = arg('--model');
  const inPath = arg('--in');
  const outPath = arg('--out');
  if (!modelPath || !inPath || !outPath) throw new Error('grad needs --model, --in and --out');
  checkOutFile('--out', outPath, readPaths(modelPath, inPath, arg('--config')));
  const dtype = (arg('--dtype') ?? 'f32') as DType;
  if (dtype !== 'f32' && dtype !== 'f16') throw new Error(`--dtype must be f32 or f16, got ${dtype}`);
  if (await isSdxlPath(modelPath)) return gradSdxlCommand(gpu, modelPath, inPath, outPath, dtype, configOverrides(arg('--config'), 'unet'));
  const model = await loadModel(gpu, modelPath, { dtype, overrides: configOverrides(arg('--config'), 'unet') });
  const inputs = readSafetensors(new Uint8Array(readFileSync(inPath))).tensors;
  const up = (t: NamedTensor, d: DType = dtype) => gpu.upload(t.data, t.shape, d, 'activations');
  const sample = need(inputs, 'sample', 4, inPath);
  const timestep = need(inputs, 'timestep', 1, inPath);
  const ctx = need(inputs, 'encoder_hidden_states', 3, inPath);
  const target = need(inputs, 'target', 4, inPath);
  const tape = new Tape(gpu);
  const out = unetForward(gpu, model.unet.config, model.unet.weights, up(sample), up(timestep, 'f32'), up(ctx), tape);
  const tTarget = up(target);
  const loss = await gpu.read(mseLoss(gpu, out, tTarget));
  tape.backward(out, mseLossBackward(gpu, out, tTarget));
  const result = new Map<string, NamedTensor>([['loss', { shape: [1], data: loss }]]);
  for (const [name, w] of model.unet.weights) {
    const g = tape.grads.get(w);
    if (!g) throw new Error(`no gradient reached ${name}`);
    result.set(name, { shape: [...w.shape], data: await gpu.read(g) });
  }
  writeOutput(outPath, writeSafetensors(result));
}
