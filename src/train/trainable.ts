// The trainable set of a run: which parameters the optimizer updates, in which order, with which shapes and
// learning rates. The trainer (trainer.ts, DreamBoothTrainer.create) builds its tensors from it and the planner
// (plan.ts) sizes the optimizer's chunks from it, so the two agree by construction:
//   - full fine-tuning: every UNet weight, in the UNet's parameter order;
//   - LoRA: the UNet's adapters (A [rank, in], B [out, rank] per targeted linear layer, peft's names), then,
//     with textEncoderLora, the text encoder's adapters at the text encoder's rate (textEncoderLrOf), and for
//     SDXL the second text encoder's after them, named under `text_encoder_2.` (both encoders use the same
//     transformers names, and the optimizer needs one name per parameter). A rate that differs from the run's is
//     carried on each parameter, so the optimizer gives those chunks of their own.
import type { ClipTextConfig } from '../nn/clip.ts';
import { initLora, loraShapes, loraTargets, type UniformRng } from '../nn/lora.ts';
import { convTargets, initNetwork, networkShapes, type NetworkSpec, type NetworkType } from '../nn/lycoris.ts';
import type { UnetConfig } from '../nn/unet.ts';
import { clipParams, unetParams } from '../models/shapes.ts';
import type { ParamSpec } from './optimizer-chunks.ts';

/** The settings that decide the trainable set (a subset of TrainSettings). */
export interface TrainableSettings {
  mode: 'lora' | 'full';
  rank: number;
  textEncoderLora?: boolean;
  lr: number;
  textEncoderLr?: number;
  /** The network type (absent: lora) and the LyCORIS types' conv rank / alpha and LoKr factor (nn/lycoris.ts). */
  network?: NetworkType;
  convRank?: number;
  convAlpha?: number;
  lokrFactor?: number;
  /** DoRA on a LyCORIS network (nn/dora.ts). */
  dora?: boolean;
}

/** The run's network (alpha as the trainer's: alpha / rank is the linear layers' scale). */
export function networkSpecOf(s: TrainableSettings & { alpha: number }): NetworkSpec {
  const convRank = s.convRank || s.rank;
  return {
    type: s.network ?? 'lora',
    rank: s.rank,
    alpha: s.alpha,
    convRank,
    convAlpha: s.convAlpha || convRank,
    factor: s.lokrFactor ?? -1,
    dora: (s.network ?? 'lora') !== 'lora' && !!s.dora,
  };
}

/** A group's starting adapters (PEFT's init for lora, LyCORIS' for the others), by the group's own names. */
export function initGroup(g: TrainableGroup, s: TrainableSettings & { alpha: number }, rng: UniformRng): Map<string, Float32Array> {
  const spec = networkSpecOf(s);
  return spec.type === 'lora' ? initLora(g.layers, g.base, s.rank, rng) : initNetwork(g.layers, g.base, spec, rng);
}

/** One model's part of the trainable set. */
export interface TrainableGroup {
  model: 'unet' | 'text_encoder' | 'text_encoder_2';
  /** Prepended to the model's own parameter names in `params` ('' but for SDXL's second text encoder). */
  prefix: string;
  /** LoRA: the adapted layers (initLora's and loraShapes' input); full: empty. */
  layers: string[];
  /** The model's parameter shapes (from its config) the layers were found in. */
  base: ReadonlyMap<string, readonly number[]>;
  /** The group's parameters in the optimizer's order; `lr` where the group's rate differs from the run's. */
  params: ParamSpec[];
}

/** The optimizer-name prefix of SDXL's second text encoder's adapters. */
export const TEXT_ENCODER_2_PREFIX = 'text_encoder_2.';

/** The text-encoder adapters' learning rate: their own, or the run's (absent or 0). */
export function textEncoderLrOf(s: Pick<TrainableSettings, 'lr' | 'textEncoderLr'>): number {
  return s.textEncoderLr ? s.textEncoderLr : s.lr;
}

/**
 * The trainable set for a UNet config (and the text encoder's, needed only with text-encoder LoRA), in the
 * order the optimizer packs its chunks: the UNet group first, then the text encoder's.
 */
export function trainableSpec(
  unet: UnetConfig,
  textEncoder: ClipTextConfig | undefined,
  settings: TrainableSettings,
  /** SDXL's second text encoder (CLIPTextModelWithProjection): its adapters train with the first's. */
  textEncoder2?: ClipTextConfig,
): TrainableGroup[] {
  const unetShapes = unetParams(unet);
  if (settings.mode !== 'lora')
    return [{ model: 'unet', prefix: '', layers: [], base: unetShapes, params: [...unetShapes].map(([name, shape]) => ({ name, shape: [...shape] })) }];
  const spec = networkSpecOf({ ...settings, alpha: settings.rank });
  const adapters = (model: TrainableGroup['model'], shapes: ReadonlyMap<string, readonly number[]>, lr?: number, skip = ''): TrainableGroup => {
    const prefix = model === 'text_encoder_2' ? TEXT_ENCODER_2_PREFIX : '';
    const layers = loraTargets(model === 'unet' ? 'unet' : 'text_encoder', shapes.keys()).filter((l) => !skip || !l.startsWith(skip));
    // LyCORIS types adapt the UNet's ResNet 3x3 convs too (LoCon's conv_dim), after the attention projections
    if (spec.type !== 'lora' && model === 'unet') layers.push(...convTargets(shapes.keys()));
    const factors = spec.type === 'lora' ? loraShapes(layers, shapes, settings.rank) : networkShapes(layers, shapes, spec);
    const params = [...factors].map(([name, shape]) => ({
      name: prefix + name,
      shape: [...shape],
      ...(lr !== undefined ? { lr } : {}),
    }));
    return { model, prefix, layers, base: shapes, params };
  };
  const groups = [adapters('unet', unetShapes)];
  if (settings.textEncoderLora) {
    if (!textEncoder) throw new Error("text-encoder LoRA needs the text encoder's config");
    const lr = textEncoderLrOf(settings);
    // SDXL reads encoder 1's penultimate hidden state: its last layer never reaches the loss, so it gets no
    // adapters (they would get no gradient). Encoder 2's last layer feeds the pooled embedding and keeps them.
    const last = textEncoder2 ? `text_model.encoder.layers.${textEncoder.layers - 1}.` : '';
    groups.push(adapters('text_encoder', clipParams(textEncoder), lr !== settings.lr ? lr : undefined, last));
    if (textEncoder2) groups.push(adapters('text_encoder_2', clipParams(textEncoder2), lr !== settings.lr ? lr : undefined));
  }
  return groups;
}
