// The UNet's conditioning for one training or validation pass, SD 1/2 and SDXL alike:
//   - SD 1/2: encoder_hidden_states = the cached text-encoder output, or (text-encoder LoRA) the text encoder
//     run on the prompt's ids on the tape;
//   - SDXL (a UNet with the text_time addition embedding): encoder_hidden_states = both encoders' penultimate
//     states concatenated (768 + 1280 = 2048 for SDXL base), text_embeds = encoder 2's pooled, projected EOS
//     row (cached, or both encoders run on the tape when they train), and time_ids = each sample's
//     [original h, w, crop top, left, target h, w] (kohya's sdxl_train_network: the photo's size before
//     resizing, the crop's top-left in the resized photo, the bucket's size), plain numbers with no gradient.
import type { Gpu } from '../gpu/device.ts';
import type { DType, Tensor } from '../gpu/tensor.ts';
import type { Weights } from '../nn/blocks.ts';
import { clipTextForward, type ClipTextConfig } from '../nn/clip.ts';
import type { Tape } from '../nn/ops.ts';
import { sdxlTextEncode } from '../nn/sdxl.ts';
import { TIME_IDS, type UnetAddedCond, type UnetConfig } from '../nn/unet.ts';
import type { TrainableGroup } from './trainable.ts';

/** What a pass needs of a cached sample (a subset of trainer.ts TrainSample). */
export interface ConditionedSample {
  context: Float32Array;
  ids?: Int32Array;
  /** SDXL: the prompt's tokenizer-2 ids [L] (the second encoder runs on them when it trains). */
  ids2?: Int32Array;
  /** SDXL: encoder 2's pooled, projected output [projectionDim] for the prompt. */
  pooled?: Float32Array;
  /** SDXL: [original h, w, crop top, left, target h, w] in pixels. */
  timeIds?: Float32Array;
}

/** The models a pass's conditioning comes from (a subset of trainer.ts TrainerModel). */
export interface ConditioningModel {
  config: UnetConfig;
  weights: Weights;
  textEncoder?: { config: ClipTextConfig; weights: Weights };
  textEncoder2?: { config: ClipTextConfig; weights: Weights };
}

export interface PassConditioning {
  context: Tensor;
  added: UnetAddedCond | null;
  /** Tensors the caller frees after the pass (what the tape does not own). */
  owned: Tensor[];
  /** Inputs that need no gradient (cached embeddings, time ids): Tape.noGrad them. */
  constants: Tensor[];
}

/** SDXL's time ids of one image (kohya's order: original size, crop top-left, target size; all [h, w]). */
export function photoTimeIds(
  original: { width: number; height: number },
  crop: { top: number; left: number },
  target: { width: number; height: number },
): Float32Array {
  return Float32Array.of(original.height, original.width, crop.top, crop.left, target.height, target.width);
}

/**
 * The time ids of a photo prepared for training (io/image.ts prepareImage): `decoded` is the photo as decoded
 * (perhaps reduced), `original` its file's upright size; the square `crop` (in decoded pixels) or the bucket's
 * `region` is scaled to the target size, so the crop's top-left in that resized photo is the region's times the
 * scale (kohya's crop_top_left after its resize; a mirrored copy's left edge is mirrored too). Rounded to pixels.
 */
export function preparedTimeIds(
  decoded: { width: number; height: number },
  original: { width: number; height: number } | undefined,
  region: { x: number; y: number; width: number; height: number },
  target: { width: number; height: number },
  flip: boolean,
): Float32Array {
  const scale = target.width / region.width;
  const left = flip ? decoded.width - region.x - region.width : region.x;
  const o = original ?? decoded;
  return photoTimeIds(o, { top: Math.round(region.y * scale), left: Math.round(left * scale) }, target);
}

/** The weights map a trainable group's adapters go into. */
export function groupWeights(model: ConditioningModel, group: TrainableGroup['model']): Weights {
  const m = group === 'unet' ? model : group === 'text_encoder' ? model.textEncoder : model.textEncoder2;
  if (!m) throw new Error(`${group} LoRA needs the ${group} (it stays on the GPU)`);
  return m.weights;
}

const cat = <T extends Float32Array | Int32Array>(parts: T[], make: (n: number) => T): T => {
  const out = make(parts.reduce((k, p) => k + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
};

/**
 * The context (and SDXL's text_embeds and time_ids) for `samples` as one batch. With `trainText` the text
 * encoder(s) run on the samples' ids on `tape` (null: no tape, e.g. validation; the caller then owns their output).
 */
export function passConditioning(
  gpu: Gpu,
  model: ConditioningModel,
  samples: ConditionedSample[],
  contextShape: [number, number],
  dtype: DType,
  o: { trainText: boolean; tape: Tape | null; loraScale: number },
): PassConditioning {
  const n = samples.length;
  const [L, D] = contextShape;
  const owned: Tensor[] = [];
  const constants: Tensor[] = [];
  const ids = (f: (s: ConditionedSample) => Int32Array | undefined) =>
    Float32Array.from(
      cat(
        samples.map((s) => f(s)!),
        (k) => new Int32Array(k),
      ),
    );
  let context: Tensor;
  let pooled: Tensor | null = null;
  const sdxl = !!model.config.textTime;
  if (o.trainText && sdxl) {
    const r = sdxlTextEncode(
      gpu,
      model.textEncoder!,
      model.textEncoder2!,
      ids((s) => s.ids),
      ids((s) => s.ids2),
      n,
      o.tape,
      o.loraScale,
    );
    context = r.context;
    pooled = r.pooled;
    if (!o.tape) owned.push(context, pooled);
  } else if (o.trainText) {
    const te = model.textEncoder!;
    context = clipTextForward(
      gpu,
      te.config,
      te.weights,
      ids((s) => s.ids),
      n,
      o.tape,
      o.loraScale,
    );
    if (!o.tape) owned.push(context);
  } else {
    context = gpu.upload(
      cat(
        samples.map((s) => s.context),
        (k) => new Float32Array(k),
      ),
      [n, L, D],
      dtype,
      'activations',
      'context',
    );
    owned.push(context);
    constants.push(context);
    if (sdxl) {
      const parts = samples.map((s) => s.pooled!);
      pooled = gpu.upload(
        cat(parts, (k) => new Float32Array(k)),
        [n, parts[0].length],
        dtype,
        'activations',
        'text-embeds',
      );
      owned.push(pooled);
      constants.push(pooled);
    }
  }
  if (!sdxl) return { context, added: null, owned, constants };
  const timeIds = gpu.upload(
    cat(
      samples.map((s) => s.timeIds!),
      (k) => new Float32Array(k),
    ),
    [n, TIME_IDS],
    'f32',
    'activations',
    'time-ids',
  );
  owned.push(timeIds);
  constants.push(timeIds);
  return { context, added: { textEmbeds: pooled!, timeIds }, owned, constants };
}

/**
 * The training data and models checked for what the conditioning needs, naming the sample and what to do:
 * an SDXL UNet needs each sample's pooled embedding (of the UNet's width) and 6 time ids; text-encoder LoRA
 * needs the encoder(s) and the prompts' ids.
 */
export function checkConditioning(
  model: ConditioningModel,
  sets: { what: 'instance' | 'class'; samples: ConditionedSample[] }[],
  textEncoderLora: boolean,
): void {
  const tt = model.config.textTime;
  if (textEncoderLora) {
    if (!model.textEncoder) throw new Error('text-encoder LoRA needs the text encoder (it stays on the GPU)');
    if (tt && !model.textEncoder2) throw new Error('text-encoder LoRA on SDXL needs the second text encoder too (it stays on the GPU)');
  }
  for (const { what, samples } of sets)
    for (const [i, s] of samples.entries()) {
      if (textEncoderLora && (!s.ids || (tt && !s.ids2)))
        throw new Error(`text-encoder LoRA needs the prompts' token ids in the training data (${what} image ${i} has none)`);
      if (!tt) {
        if (s.pooled || s.timeIds) throw new Error(`${what} image ${i} has SDXL conditioning (pooled text embedding, time ids) but the UNet is not SDXL's`);
        continue;
      }
      const pooled = tt.projectionInputDim - TIME_IDS * tt.timeEmbedDim;
      if (!textEncoderLora && s.pooled?.length !== pooled)
        throw new Error(
          `${what} image ${i}'s pooled text embedding has ${s.pooled?.length ?? 'no'} values; the SDXL UNet takes ${pooled}: encode the prompts again`,
        );
      if (s.timeIds?.length !== TIME_IDS || !s.timeIds.every((v) => Number.isFinite(v) && v >= 0))
        throw new Error(
          `${what} image ${i}'s time ids are ${s.timeIds ? `[${[...s.timeIds].join(', ')}]` : 'missing'}: SDXL needs 6 (original h, w, crop top, left, target h, w), each >= 0`,
        );
    }
}
