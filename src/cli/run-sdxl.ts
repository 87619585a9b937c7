// `cli run` and `cli grad unet` on an SDXL model (detected from the file's keys or the folder's configs):
//   run unet: sample, timestep, encoder_hidden_states, text_embeds, time_ids -> out;
//   run text-encoder: input_ids (tokenizer 1) and input_ids_2 (tokenizer 2) -> prompt_embeds (both encoders'
//     penultimate states concatenated) and pooled (encoder 2's projected EOS row);
//   run vae-encode / vae-decode: as for SD, in f32 (SDXL's VAE overflows in f16);
//   grad unet: the unet inputs and target -> loss and every UNet parameter's gradient;
//   sample: txt2img with both tokenizers (sample/txt2img-sdxl.ts).
// --config may hold text_encoder_2 overrides for a single file.
import { existsSync, readFileSync, statSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import type { Gpu } from '../gpu/device.ts';
import type { DType, Tensor } from '../gpu/tensor.ts';
import { readSafetensors, SafetensorsFile, writeSafetensors, type NamedTensor } from '../io/safetensors.ts';
import { NodeFileSource } from '../io/source-node.ts';
import { nodeFolder } from '../models/folder-node.ts';
import {
  isSdxlDiffusers,
  isSdxlSingleFile,
  loadSdxl,
  openSdxlDiffusers,
  openSdxlSingleFile,
  SDXL_COMPONENTS,
  type LoadedSdxl,
  type SdxlComponent,
} from '../models/sdxl.ts';
import type { Json } from '../models/source.ts';
import { inspectSdxl, type SdxlInspection } from '../models/sdxl-inspect.ts';
import { Tape } from '../nn/ops.ts';
import { sdxlTextEncode } from '../nn/sdxl.ts';
import { unetForward } from '../nn/unet.ts';
import { vaeDecode, vaeEncode } from '../nn/vae.ts';
import { mseLoss, mseLossBackward } from '../ops/reduce.ts';
import { ClipTokenizer } from '../io/tokenizer.ts';
import { tokenizerFilesFrom } from '../models/source.ts';
import { scheduleFromJson } from '../sample/schedulers.ts';
import { SampleOptionError, type Txt2ImgOptions } from '../sample/txt2img.ts';
import { txt2imgSdxl } from '../sample/txt2img-sdxl.ts';
import { UsageError } from './args.ts';

type Overrides = Partial<Record<SdxlComponent | 'scheduler', Json>>;

/** Is the model at `path` (a single file or a diffusers folder) an SDXL model? Reads headers and configs only. */
export async function isSdxlPath(path: string): Promise<boolean> {
  if (statSync(path).isDirectory()) {
    const dir = nodeFolder(path);
    const json = async (p: string) => ((await dir.exists(p)) ? await dir.readJson(p) : undefined);
    return isSdxlDiffusers(await json('model_index.json'), await json('unet/config.json'));
  }
  const file = await SafetensorsFile.open(await NodeFileSource.open(path));
  try {
    return isSdxlSingleFile(file.names);
  } finally {
    await file.source.close?.();
  }
}

export async function loadSdxlPath(gpu: Gpu, path: string, dtype: DType, overrides: Overrides | undefined): Promise<LoadedSdxl> {
  if (statSync(path).isDirectory()) {
    const src = await openSdxlDiffusers(nodeFolder(path), { overrides });
    try {
      return await loadSdxl(gpu, src, dtype);
    } finally {
      await src.close();
    }
  }
  const file = await SafetensorsFile.open(await NodeFileSource.open(path));
  try {
    return await loadSdxl(gpu, await openSdxlSingleFile(file, { overrides }), dtype);
  } finally {
    await file.source.close?.();
  }
}

/** `inspect` on an SDXL model: its architecture and the loader's refusals (models/sdxl-inspect.ts), headers only. */
export async function inspectSdxlPath(path: string, overrides: Overrides | undefined): Promise<SdxlInspection> {
  if (statSync(path).isDirectory()) {
    const src = await openSdxlDiffusers(nodeFolder(path), { overrides });
    try {
      return inspectSdxl(
        src,
        SDXL_COMPONENTS.map((c) => src.tensorOrigin(c, '')),
      );
    } finally {
      await src.close();
    }
  }
  const file = await SafetensorsFile.open(await NodeFileSource.open(path));
  try {
    return inspectSdxl(await openSdxlSingleFile(file, { overrides }), [path]);
  } finally {
    await file.source.close?.();
  }
}

function need(inputs: Map<string, NamedTensor>, name: string, rank: number, file: string): NamedTensor {
  const t = inputs.get(name);
  if (!t) throw new Error(`${file} has no tensor '${name}' (an SDXL model needs it; has: ${[...inputs.keys()].join(', ') || 'none'})`);
  if (t.shape.length !== rank) throw new Error(`${file}: '${name}' must have rank ${rank}, got [${t.shape}]`);
  return t;
}

/** The SDXL UNet's inputs from an --in file; time_ids of the wrong length are refused naming the file. */
function unetInputs(gpu: Gpu, inputs: Map<string, NamedTensor>, inPath: string, dtype: DType) {
  const up = (t: NamedTensor, d: DType = dtype) => gpu.upload(t.data, t.shape, d, 'activations');
  const sample = need(inputs, 'sample', 4, inPath);
  const timeIds = need(inputs, 'time_ids', 2, inPath);
  if (timeIds.shape[1] !== 6 || timeIds.shape[0] !== sample.shape[0])
    throw new Error(`${inPath}: 'time_ids' must be [${sample.shape[0]},6] (original h, w, crop top, left, target h, w), got [${timeIds.shape}]`);
  return {
    sample: up(sample),
    timestep: up(need(inputs, 'timestep', 1, inPath), 'f32'),
    context: up(need(inputs, 'encoder_hidden_states', 3, inPath)),
    added: { textEmbeds: up(need(inputs, 'text_embeds', 2, inPath)), timeIds: up(timeIds, 'f32') },
  };
}

export async function runSdxlComponent(gpu: Gpu, target: string, model: LoadedSdxl, inPath: string, dtype: DType): Promise<Map<string, NamedTensor>> {
  const inputs = readSafetensors(new Uint8Array(readFileSync(inPath))).tensors;
  const outputs = new Map<string, NamedTensor>();
  const read = async (name: string, t: Tensor) => outputs.set(name, { shape: [...t.shape], data: await gpu.read(t) });
  if (target === 'unet') {
    const x = unetInputs(gpu, inputs, inPath, dtype);
    await read('out', unetForward(gpu, model.unet.config, model.unet.weights, x.sample, x.timestep, x.context, null, 1, false, x.added));
  } else if (target === 'text-encoder') {
    const ids = need(inputs, 'input_ids', 2, inPath);
    const ids2 = need(inputs, 'input_ids_2', 2, inPath);
    const r = sdxlTextEncode(gpu, model.textEncoder, model.textEncoder2, Array.from(ids.data, Math.round), Array.from(ids2.data, Math.round), ids.shape[0]);
    await read('prompt_embeds', r.context);
    await read('pooled', r.pooled);
  } else if (target === 'vae-encode') {
    const image = need(inputs, 'image', 4, inPath);
    const moments = await gpu.read(vaeEncode(gpu, model.vae.config, model.vae.weights, gpu.upload(image.data, image.shape, 'f32', 'activations')));
    const [n, , h, w] = image.shape;
    const f = 2 ** (model.vae.config.blockOutChannels.length - 1);
    const z = model.vae.config.latentChannels;
    const plane = (h / f) * (w / f);
    const [mean, logvar] = [new Float32Array(n * z * plane), new Float32Array(n * z * plane)];
    for (let b = 0; b < n; b++) {
      mean.set(moments.subarray(b * 2 * z * plane, b * 2 * z * plane + z * plane), b * z * plane);
      logvar.set(moments.subarray(b * 2 * z * plane + z * plane, (b + 1) * 2 * z * plane), b * z * plane);
    }
    outputs.set('mean', { shape: [n, z, h / f, w / f], data: mean });
    outputs.set('logvar', { shape: [n, z, h / f, w / f], data: logvar });
  } else {
    const latents = need(inputs, 'latents', 4, inPath);
    await read('image', vaeDecode(gpu, model.vae.config, model.vae.weights, gpu.upload(latents.data, latents.shape, 'f32', 'activations')));
  }
  return outputs;
}

export async function runSdxlCommand(
  gpu: Gpu,
  target: string,
  modelPath: string,
  inPath: string,
  outPath: string,
  dtype: DType,
  overrides: Overrides | undefined,
) {
  const model = await loadSdxlPath(gpu, modelPath, dtype, overrides);
  writeFileSync(outPath, writeSafetensors(await runSdxlComponent(gpu, target, model, inPath, dtype)));
}

/** loss = mean((unet(...) - target)^2); writes loss and every UNet parameter's gradient (f32). */
export async function gradSdxlCommand(gpu: Gpu, modelPath: string, inPath: string, outPath: string, dtype: DType, overrides: Overrides | undefined) {
  const model = await loadSdxlPath(gpu, modelPath, dtype, overrides);
  const inputs = readSafetensors(new Uint8Array(readFileSync(inPath))).tensors;
  const x = unetInputs(gpu, inputs, inPath, dtype);
  const target = need(inputs, 'target', 4, inPath);
  const tTarget = gpu.upload(target.data, target.shape, dtype, 'activations');
  const tape = new Tape(gpu);
  const out = unetForward(gpu, model.unet.config, model.unet.weights, x.sample, x.timestep, x.context, tape, 1, false, x.added);
  const loss = await gpu.read(mseLoss(gpu, out, tTarget));
  tape.backward(out, mseLossBackward(gpu, out, tTarget));
  const result = new Map<string, NamedTensor>([['loss', { shape: [1], data: loss }]]);
  for (const [name, w] of model.unet.weights) {
    const g = tape.grads.get(w);
    if (!g) throw new Error(`no gradient reached ${name}`);
    result.set(name, { shape: [...w.shape], data: await gpu.read(g) });
  }
  writeFileSync(outPath, writeSafetensors(result));
}

/**
 * `cli sample` on an SDXL model: `tokenizers` is a folder holding tokenizer/ and tokenizer_2/ (the model's
 * own folder by default; a single file carries none). The schedule comes from the folder's scheduler config
 * (SDXL's is SD's scaled_linear DDPM schedule) with the model's prediction type.
 */
export async function sampleSdxl(
  gpu: Gpu,
  modelPath: string,
  tokenizers: string | undefined,
  overrides: Overrides | undefined,
  o: Omit<Txt2ImgOptions, 'schedule'>,
): Promise<{ rgb: Uint8Array; width: number; height: number }> {
  if (!tokenizers) throw new UsageError('an SDXL single file carries no tokenizers: pass --tokenizer <folder with tokenizer/ and tokenizer_2/>');
  const tok = async (sub: string) => {
    const files = await tokenizerFilesFrom(nodeFolder(tokenizers), `${sub}/`);
    if (!files)
      throw new UsageError(
        `--tokenizer ${tokenizers}: no ${sub}/ with tokenizer.json, or vocab.json and merges.txt (an SDXL model needs tokenizer/ and tokenizer_2/)`,
      );
    return ClipTokenizer.fromFiles(files);
  };
  const pair: [ClipTokenizer, ClipTokenizer] = [await tok('tokenizer'), await tok('tokenizer_2')];
  const model = await loadSdxlPath(gpu, modelPath, gpu.computeDType, overrides);
  const schedPath = join(modelPath, 'scheduler', 'scheduler_config.json');
  const sched = statSync(modelPath).isDirectory() && existsSync(schedPath) ? (JSON.parse(readFileSync(schedPath, 'utf8')) as Json) : {};
  const schedule = scheduleFromJson({ ...sched, ...overrides?.scheduler }, model.prediction);
  return txt2imgSdxl(gpu, model, pair, { ...o, schedule }).catch((e: unknown) => {
    throw e instanceof SampleOptionError ? new UsageError(`--${e.message}`) : e;
  });
}
