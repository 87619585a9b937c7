// The tiny SD1-style UNet (tests/fixtures/modules/unet_sd1) and the PyTorch reference runs'
// data (tests/fixtures/train) as trainers, shared by the training tests.
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import type { Gpu } from '../../src/gpu/device.ts';
import type { DType } from '../../src/gpu/tensor.ts';
import { readSafetensors } from '../../src/io/safetensors.ts';
import { unetConfigFromJson } from '../../src/nn/unet.ts';
import { SD_SCHEDULE } from '../../src/sample/schedulers.ts';
import type { ChunkStore } from '../../src/store/chunkstore.ts';
import { TRAIN_DEFAULTS } from '../../src/pipeline/settings.ts';
import { DreamBoothTrainer, type StepInputs, type TrainData, type TrainerModel, type TrainSettings } from '../../src/train/trainer.ts';
import { FIXTURES } from '../helpers.ts';

const load = (p: string) => readSafetensors(new Uint8Array(readFileSync(join(FIXTURES, p))));
export const base = load('modules/unet_sd1.safetensors');
const cfg = unetConfigFromJson(JSON.parse(base.metadata.config));

export function fixture(mode: 'lora' | 'full') {
  const f = load(`train/dreambooth_${mode}.safetensors`);
  const t = (k: string) => f.tensors.get(k)!.data;
  const m = f.metadata;
  const data: TrainData = {
    latentShape: [4, 8, 8],
    contextShape: [7, 32],
    instance: [0, 1].map((i) => ({ latent: t('inst_latents').slice(i * 256, (i + 1) * 256), context: t('inst_context') })),
    classes: [{ latent: t('class_latents'), context: t('class_context') }],
  };
  const settings: TrainSettings = {
    ...TRAIN_DEFAULTS[mode],
    steps: Number(m.steps),
    lr: Number(m.lr),
    rank: Number(m.rank),
    alpha: Number(m.alpha),
    priorLossWeight: Number(m.prior_loss_weight),
    minSnrGamma: m.min_snr_gamma === '' ? null : Number(m.min_snr_gamma),
    maxGradNorm: Number(m.max_grad_norm),
    weightDecay: Number(m.weight_decay),
    checkpointEvery: 0,
    chunkElems: 4096,
    // The PyTorch reference runs are fp32 AdamW; tests of the compact modes (tests/train/compact-modes.test.ts) override these.
    optimizer: 'adamw',
    master: 'fp32',
  };
  const inputs: StepInputs[] = Array.from({ length: settings.steps }, (_, s) => ({
    instance: s % 2,
    classIndex: 0,
    noise: t('noise').slice(s * 512, (s + 1) * 512),
    timesteps: [t('timesteps')[2 * s], t('timesteps')[2 * s + 1]],
  }));
  const init = new Map([...f.tensors].filter(([k]) => k.startsWith('init.')).map(([k, v]) => [k.slice(5), v.data]));
  const finals = new Map([...f.tensors].filter(([k]) => k.startsWith('final.')).map(([k, v]) => [k.slice(6), v.data]));
  return { data, settings, inputs, init, finals, losses: t('loss'), prediction: m.prediction as 'epsilon' | 'v_prediction' };
}

export async function makeTrainer(
  gpu: Gpu,
  dtype: DType,
  mode: 'lora' | 'full',
  store: ChunkStore,
  over: Partial<TrainSettings> = {},
  /** Caption processing: each instance photo's prompt and the text encoder's stand-in. */
  captions?: { prompts: string[]; encoder: NonNullable<TrainerModel['captions']> },
) {
  const fx = fixture(mode);
  if (captions) fx.data.instance.forEach((x, i) => (x.prompt = captions.prompts[i]));
  const weights = new Map();
  for (const [k, t] of base.tensors)
    if (!['sample', 'timestep', 'encoder_hidden_states', 'out'].includes(k)) weights.set(k, gpu.upload(t.data, t.shape, dtype, 'weights', k));
  const trainer = await DreamBoothTrainer.create(
    gpu,
    { config: cfg, weights, schedule: { ...SD_SCHEDULE, prediction: fx.prediction }, ...(captions ? { captions: captions.encoder } : {}) },
    fx.data,
    { ...fx.settings, ...over },
    store,
    'run',
    // fx.init holds plain LoRA's adapters; a LyCORIS network starts from its own init
    mode === 'lora' && (over.network ?? 'lora') === 'lora' ? fx.init : undefined,
  );
  const free = () => {
    trainer.destroy();
    for (const w of weights.values()) gpu.free(w);
  };
  return { trainer, fx, free };
}
