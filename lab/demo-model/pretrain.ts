// Pretraining a small SD-shaped latent diffusion model from scratch on the engine (issue 16): the demo model
// that draws. Two stages, each an AdamW run over all of its component's weights:
//   1. the VAE, as an autoencoder: encode a picture (or a random square crop of it, `vaeCrop`), decode the
//      posterior's mean, mean squared error against the input (deterministic: no KL term; see `finishVae` for
//      the variance channels and the scale);
//   2. the UNet and the text encoder together, on SD's noise-prediction loss
//        L = mean || eps - unet(sqrt(acp_t) z0 + sqrt(1 - acp_t) eps, t, te(caption)) ||^2
//      with z0 = the frozen VAE's latent of the picture times the scaling factor, cached the first time a
//      picture is drawn (the data is a seeded generator: picture i is drawn again identically, so a cached
//      latent and a recomputed one agree), and 10% of captions dropped to "" so classifier-free guidance
//      works. The token and position tables of the text encoder stay at their random start (the engine's
//      CLIP has no embedding-table gradient): fixed distinct vectors the trained layers learn to read.
// EMA copies of the UNet and text encoder (diffusers' EMAModel warm-up decay, folded over `emaEvery` steps)
// are what ships. Checkpoints are snapshots in a chunk store (optimizer state, EMA, the finished VAE, the
// Rng, the step): a killed or lost-device run resumes to the same state.
import type { Gpu } from '../../src/gpu/device.ts';
import type { Tensor } from '../../src/gpu/tensor.ts';
import { ADAMW_DEFAULTS } from '../../src/ops/adamw.ts';
import { add, concatChannels, scale, splitChannels } from '../../src/ops/elementwise.ts';
import { readSafetensors, writeSafetensors, type NamedTensor } from '../../src/io/safetensors.ts';
import type { ClipTokenizer } from '../../src/io/tokenizer.ts';
import type { Weights } from '../../src/nn/blocks.ts';
import { clipConfigFromJson, clipTextForward, type ClipTextConfig } from '../../src/nn/clip.ts';
import { Tape } from '../../src/nn/ops.ts';
import { unetConfigFromJson, unetForward, type UnetConfig } from '../../src/nn/unet.ts';
import { vaeConfigFromJson, vaeDecode, vaeEncode, type VaeConfig } from '../../src/nn/vae.ts';
import { DEMO_CONFIGS, diffusersModelFiles, initWeights } from './demo.ts';
import { clipParams, unetParams, vaeParams } from '../../src/models/shapes.ts';
import { alphasCumprod, scheduleFromJson, type ScheduleConfig } from '../../src/sample/schedulers.ts';
import type { ChunkStore } from '../../src/store/chunkstore.ts';
import { commitSnapshot, openSnapshot } from '../../src/store/snapshot.ts';
import { Rng } from '../../src/util/rng.ts';
import { addNoise, velocity, weightedMse, weightedMseBackward } from '../../src/ops/loss.ts';
import { ChunkedAdamW } from '../../src/train/optimizer.ts';
import { captionOf, checkDatasetOptions, dataSceneOptions, drawScene, sceneAt, toModelInput, type DataVersion, type ShapeName } from './synthetic.ts';

/** diffusers config.json of each component: SD 1.x's layout (four UNet levels, factor-8 VAE) at a laptop's size. */
export const PRETRAIN_CONFIGS = {
  unet: {
    block_out_channels: [32, 64, 64, 64],
    layers_per_block: 1,
    attention_head_dim: 4,
    cross_attention_dim: 64,
    norm_num_groups: 8,
    use_linear_projection: false,
    in_channels: 4,
    out_channels: 4,
    sample_size: 8,
    down_block_types: ['CrossAttnDownBlock2D', 'CrossAttnDownBlock2D', 'CrossAttnDownBlock2D', 'DownBlock2D'],
    up_block_types: ['UpBlock2D', 'CrossAttnUpBlock2D', 'CrossAttnUpBlock2D', 'CrossAttnUpBlock2D'],
  },
  vae: {
    block_out_channels: [16, 32, 64, 64],
    layers_per_block: 1,
    norm_num_groups: 8,
    latent_channels: 4,
    scaling_factor: 1,
    in_channels: 3,
    out_channels: 3,
    sample_size: 64,
  },
  text_encoder: {
    vocab_size: 49408,
    hidden_size: 64,
    num_hidden_layers: 2,
    num_attention_heads: 4,
    intermediate_size: 256,
    max_position_embeddings: 77,
    hidden_act: 'quick_gelu',
    layer_norm_eps: 1e-5,
  },
  // SD's own schedule (DDIM, scaled-linear betas 0.00085-0.012 over 1000 steps), as the demo model has it.
  scheduler: DEMO_CONFIGS.scheduler,
};
export type PretrainConfigs = typeof PRETRAIN_CONFIGS;

/**
 * Model sizes:
 * - `small`: SD's factor-8 VAE at 64 px, so 8x8x4 latents. Its VAE (the shipped demo model's) decodes every
 *   lone shape to the same smudge after 800 steps (lab/demo-model/scripts/vae-reconstruction.ts): each latent cell spans
 *   8x8 px, so a shape's outline must be coded inside a cell's 4 numbers, which this small a VAE learns slowly.
 * - `small-f4`: the same UNet and text encoder on 16x16x4 latents from a factor-4 VAE (three levels, SD's
 *   blocks), where a 16-32 px shape spans 4-8 cells and its outline is the latent's own layout.
 * - `tiny`: the same layout at toy size (a factor-2 VAE for 16 px pictures, a two-level UNet, a 1024-token
 *   tokenizer) for tests and quick checks.
 */
export const PRETRAIN_SIZES: Record<'small' | 'small-f4' | 'tiny', PretrainConfigs> = {
  small: PRETRAIN_CONFIGS,
  'small-f4': {
    ...PRETRAIN_CONFIGS,
    unet: { ...PRETRAIN_CONFIGS.unet, sample_size: 16 },
    vae: { ...PRETRAIN_CONFIGS.vae, block_out_channels: [16, 32, 64] },
  },
  tiny: {
    ...PRETRAIN_CONFIGS,
    unet: {
      ...PRETRAIN_CONFIGS.unet,
      block_out_channels: [16, 32],
      attention_head_dim: 2,
      cross_attention_dim: 32,
      sample_size: 8,
      down_block_types: ['CrossAttnDownBlock2D', 'DownBlock2D'],
      up_block_types: ['UpBlock2D', 'CrossAttnUpBlock2D'],
    },
    vae: { ...PRETRAIN_CONFIGS.vae, block_out_channels: [8, 16], norm_num_groups: 4, sample_size: 16 },
    text_encoder: { ...PRETRAIN_CONFIGS.text_encoder, vocab_size: 1024, hidden_size: 32, num_attention_heads: 2, intermediate_size: 64 },
  },
};

export interface PretrainSettings {
  /** Picture side in px (a multiple of the VAE's factor). */
  resolution: number;
  /** The dataset: pictures 0..dataSize-1 of the generator with this seed, never drawing `exclude`. */
  dataSeed: number;
  dataSize: number;
  exclude: ShapeName[];
  /**
   * The dataset's version (synthetic.ts DATA_VERSIONS): `v1` without stars (the shipped model's), or `stars` with
   * stars and the DreamBooth subject's look held out. Options that would show the subject are refused.
   */
  data: DataVersion;
  /** The run's own Rng (batches, noise, timesteps, caption dropout). */
  seed: number;
  batch: number;
  vaeSteps: number;
  vaeLr: number;
  /**
   * Side in px of the random square crops stage 1 trains on; 0 trains on whole pictures. The VAE is
   * convolutional, so crops teach it the same maps at a fraction of the cost (SD's VAE was trained on 256 px
   * crops and is used at 512): a 32 px crop of a 64 px picture costs a quarter of the whole.
   */
  vaeCrop: number;
  steps: number;
  lr: number;
  /** diffusers EMAModel's decay cap; the decay warms up as min(emaDecay, (1 + n) / (10 + n)). */
  emaDecay: number;
  /** EMA updated every this many steps (the decay raised to this power). */
  emaEvery: number;
  /** Probability a caption is replaced by "" (classifier-free guidance's unconditional branch). */
  dropCaption: number;
  checkpointEvery: number;
  /**
   * Standard deviation of the text encoder's token table at the start. The table stays frozen (the engine's
   * embedding has no gradient), so its scale decides how much of each position's encoding is its token: at
   * CLIP's own 0.02 the tokens are a small part of the pre-LN residual stream (two unrelated captions encode
   * to cos 0.53 at init, 0.12 at 1), and in the first small-model run (0.02) training drew them together to cos
   * 0.9-0.99 by step 1250, when the UNet's loss was the same with the right caption, an empty one or another
   * picture's. At 1 the token stays the largest part of the residual stream the final LayerNorm reads.
   */
  tokenStd: number;
  /**
   * What the UNet learns to predict: the noise (SD 1.x) or v = sqrt(a) eps - sqrt(1 - a) x0 (SD 2.x). With
   * epsilon the loss weighs the clean picture's error by the SNR, about 0.03 at t = 800 and 0.005 at 999, where
   * the noisy latent shows almost nothing and only the caption tells what to draw: in the first two small-model
   * runs (epsilon) the UNet's output moved by 1.5-2% between unrelated captions after 800-1430 steps and the
   * caption did not lower the loss. v weighs that error by about 1 at every noise level.
   */
  prediction: 'epsilon' | 'v_prediction';
  /**
   * UNet steps the starting UNet and text encoder had already been trained (`lab:pretrain --init-from`, which
   * reads it from the model it starts from): 0 for a run from scratch. Recorded in the export, so a model
   * trained over several runs says how far it has come in all.
   */
  initSteps: number;
  /**
   * Share of pictures whose objects are solid, and apart from that of solid backgrounds (the rest striped, dotted
   * or checkered); null draws every pattern alike, as the first runs did (a quarter each, so 1 in 16 pictures a
   * plain shape on a plain background). Plain shapes show their outline with nothing else to learn; at 0.5 a
   * quarter of the pictures are plain on plain.
   */
  solidShare: number | null;
  /**
   * Share of the UNet stage's captions that leave the background unsaid ("a green triangle" for "a green triangle
   * on a white background"), drawn per step from the run's Rng among the captions not dropped; null never does,
   * as the first runs trained. A model that only ever read the background in its captions draws an empty field
   * for a prompt without one ("a green triangle", DreamBooth's "a sks star": measured on the factor-4 model at
   * UNet step 15200), so the short prompts people write are out of its grammar.
   */
  bareShare: number | null;
}

export const PRETRAIN_DEFAULTS: PretrainSettings = {
  resolution: 64,
  dataSeed: 1,
  dataSize: 20000,
  exclude: ['star'],
  data: 'v1',
  seed: 1,
  batch: 16,
  vaeSteps: 1500,
  vaeLr: 1e-3,
  vaeCrop: 0,
  steps: 6000,
  lr: 5e-4,
  emaDecay: 0.999,
  emaEvery: 10,
  dropCaption: 0.1,
  checkpointEvery: 250,
  tokenStd: 1,
  prediction: 'v_prediction',
  initSteps: 0,
  solidShare: 0.5,
  bareShare: null,
};

/**
 * Settings added after runs had begun, with the value a run that predates each had: a resumed run's missing
 * setting takes this (so it trains on as it began), not the default for new runs.
 */
export const PRETRAIN_SETTINGS_BEFORE_ADDED: Partial<PretrainSettings> = {
  tokenStd: 0.02,
  prediction: 'epsilon',
  initSteps: 0,
  solidShare: null,
  bareShare: null,
  data: 'v1',
};

/** A saved run's settings with every setting it predates filled in as it ran. */
export function savedPretrainSettings(saved: Partial<PretrainSettings>): PretrainSettings {
  return { ...PRETRAIN_DEFAULTS, ...PRETRAIN_SETTINGS_BEFORE_ADDED, ...saved };
}

/** Refuses settings the run cannot honour, before any work, naming the setting. */
export function checkPretrainSettings(s: PretrainSettings, cfg: PretrainConfigs = PRETRAIN_CONFIGS): void {
  const factor = 2 ** (cfg.vae.block_out_channels.length - 1);
  checkDatasetOptions(
    { seed: s.dataSeed, size: s.resolution, factor, count: s.dataSize, exclude: s.exclude, solidShare: s.solidShare ?? undefined },
    'dataset',
  );
  dataSceneOptions(s.data, { exclude: s.exclude, solidShare: s.solidShare ?? undefined }, 'dataset');
  const whole = (k: keyof PretrainSettings, lo: number, hi: number) => {
    const v = s[k] as number;
    if (!Number.isInteger(v) || v < lo || v > hi) throw new Error(`${k} ${v}: use a whole number from ${lo} to ${hi}`);
  };
  whole('seed', 0, 0xffffffff);
  whole('batch', 1, 256);
  whole('vaeSteps', 0, 1e7);
  whole('steps', 0, 1e7);
  whole('emaEvery', 1, 1000);
  whole('vaeCrop', 0, s.resolution);
  if (s.vaeCrop % factor !== 0)
    throw new Error(`vaeCrop ${s.vaeCrop}: use 0 (whole pictures) or a multiple of the VAE's factor ${factor} up to the resolution ${s.resolution}`);
  whole('checkpointEvery', 0, 1e7);
  whole('initSteps', 0, 1e9);
  for (const k of ['vaeLr', 'lr'] as const) if (!(s[k] > 0 && s[k] < 1)) throw new Error(`${k} ${s[k]}: use a learning rate between 0 and 1 (e.g. 1e-3)`);
  if (!(s.emaDecay >= 0 && s.emaDecay < 1)) throw new Error(`emaDecay ${s.emaDecay}: use a decay from 0 to below 1 (e.g. 0.999)`);
  if (!(s.dropCaption >= 0 && s.dropCaption < 1)) throw new Error(`dropCaption ${s.dropCaption}: use a probability from 0 to below 1 (e.g. 0.1)`);
  if (s.bareShare !== null && !(s.bareShare >= 0 && s.bareShare <= 1))
    throw new Error(`bareShare ${s.bareShare}: use a probability from 0 to 1 (e.g. 0.3: that share of the captions leave the background unsaid)`);
  if (s.prediction !== 'epsilon' && s.prediction !== 'v_prediction') throw new Error(`prediction ${String(s.prediction)}: use epsilon or v_prediction`);
  if (!(s.tokenStd > 0 && s.tokenStd <= 10)) throw new Error(`tokenStd ${s.tokenStd}: use a standard deviation above 0 and at most 10 (e.g. 1)`);
}

/** A trained VAE to start from instead of stage 1 (`lab:pretrain --vae-from`): its weights and latent scale. */
export interface PretrainedVae {
  weights: Map<string, Float32Array>;
  scalingFactor: number;
}

/**
 * A UNet and text encoder to go on training instead of starting from the initialisation (`lab:pretrain
 * --init-from`, e.g. a part-way export): a new run (fresh optimizer state, EMA from these weights) that
 * continues another's training. Their weights by name, as the VAE's.
 */
export interface PretrainedDenoiser {
  unet: Map<string, Float32Array>;
  text_encoder: Map<string, Float32Array>;
}

export type PretrainStage = 'vae' | 'unet' | 'done';

export interface PretrainStepReport {
  stage: Exclude<PretrainStage, 'done'>;
  /** Step within the stage (1-based). */
  step: number;
  loss: number;
  applied: boolean;
  seconds: number;
}

interface PretrainMeta {
  stage: PretrainStage;
  step: number;
  rng: number;
  versions: Record<number, number>;
  applied: number;
  emaUpdates: number;
  losses: { vae: number[]; unet: number[] };
  /** The VAE's latent scale, fixed when its stage ends (1 before). */
  scalingFactor: number;
  settings: PretrainSettings;
}

type Component = 'unet' | 'vae' | 'text_encoder';

/** The trainable weights of a component (the text encoder's embedding tables stay frozen). */
const trainableNames = (c: Component, names: Iterable<string>) => [...names].filter((n) => c !== 'text_encoder' || !n.includes('embedding'));

/** The C x C square at (ox, oy) of a [3, R, R] picture, as [3, C, C]. */
export function cropPicture(image: Float32Array, R: number, C: number, ox: number, oy: number): Float32Array {
  if (ox < 0 || oy < 0 || ox + C > R || oy + C > R) throw new Error(`crop ${C} px at (${ox}, ${oy}) does not fit a ${R} px picture`);
  const out = new Float32Array(3 * C * C);
  for (let ch = 0; ch < 3; ch++)
    for (let y = 0; y < C; y++) out.set(image.subarray(ch * R * R + (oy + y) * R + ox, ch * R * R + (oy + y) * R + ox + C), ch * C * C + y * C);
  return out;
}

/** Pretrains the demo model; see the file comment. */
export class Pretrainer {
  readonly unetConfig: UnetConfig;
  readonly vaeConfig: VaeConfig;
  readonly teConfig: ClipTextConfig;
  readonly weights: Record<Component, Weights>;
  stage: PretrainStage = 'vae';
  /** Steps done in the current stage. */
  step = 0;
  readonly losses = { vae: [] as number[], unet: [] as number[] };
  scalingFactor = 1;
  private optimizer: ChunkedAdamW | null = null;
  private readonly rng: Rng;
  private readonly acp: Float64Array;
  private readonly latentCache = new Map<number, Float32Array>();
  private readonly idsCache = new Map<string, Int32Array>();
  /**
   * EMA of the UNet and text-encoder weights (stage 2), by component/name: f32 tensors on the GPU beside the
   * weights, so an update is 2 dispatches per tensor and no read-back (read back only for checkpoints and export).
   */
  private ema = new Map<string, Tensor>();
  private emaUpdates = 0;

  private constructor(
    private readonly gpu: Gpu,
    readonly configs: PretrainConfigs,
    private readonly tokenizer: ClipTokenizer,
    readonly settings: PretrainSettings,
    private readonly store: ChunkStore,
    private readonly runId: string,
  ) {
    this.unetConfig = unetConfigFromJson(configs.unet);
    this.vaeConfig = vaeConfigFromJson(configs.vae);
    this.teConfig = clipConfigFromJson(configs.text_encoder);
    this.rng = new Rng(settings.seed);
    this.acp = alphasCumprod(this.schedule);
    // Every weight starts from the demo model's initialisation (LeCun normal, norms 1, biases 0), seeded.
    const init = new Rng(settings.seed ^ 0x1517);
    const upload = (shapes: Map<string, number[]>) => {
      const w: Weights = new Map();
      for (const [name, t] of initWeights(shapes, init)) {
        // The frozen token table at tokenStd instead of the init's 0.02 (see PretrainSettings.tokenStd).
        const data = name.endsWith('token_embedding.weight') ? (t.data as Float32Array).map((v) => v * (settings.tokenStd / 0.02)) : t.data;
        w.set(name, gpu.upload(data, t.shape, 'f32', 'weights', name));
      }
      return w;
    };
    this.weights = { vae: upload(vaeParams(this.vaeConfig)), unet: upload(unetParams(this.unetConfig)), text_encoder: upload(clipParams(this.teConfig)) };
  }

  get schedule(): ScheduleConfig {
    return scheduleFromJson(this.configs.scheduler);
  }

  static async create(
    gpu: Gpu,
    tokenizer: ClipTokenizer,
    settings: PretrainSettings,
    store: ChunkStore,
    runId: string,
    configs: PretrainConfigs = PRETRAIN_CONFIGS,
    /** Start from this trained VAE (settings.vaeSteps must be 0): SD trains its UNet on a fixed, pretrained VAE. */
    vae?: PretrainedVae,
    /** Go on training this UNet and text encoder (with `vae`, the VAE they were trained on). */
    denoiser?: PretrainedDenoiser,
  ): Promise<Pretrainer> {
    checkPretrainSettings(settings, configs);
    if (vae && settings.vaeSteps !== 0) throw new Error(`vaeSteps ${settings.vaeSteps}: a run that starts from a trained VAE has no VAE stage (use 0)`);
    if (denoiser && !vae) throw new Error('a UNet to go on training needs the VAE it was trained on: pass both');
    const p = new Pretrainer(gpu, configs, tokenizer, settings, store, runId);
    if (vae) {
      p.writeWeights('vae', vae.weights, 'VAE');
      p.scalingFactor = vae.scalingFactor;
    }
    if (denoiser) {
      p.writeWeights('unet', denoiser.unet, 'UNet');
      p.writeWeights('text_encoder', denoiser.text_encoder, 'text encoder');
    }
    await p.startStage(settings.vaeSteps > 0 ? 'vae' : 'unet');
    return p;
  }

  /** Overwrites every weight of a component with given values, refusing (naming the tensor) any that is missing or another size. */
  private writeWeights(c: Component, values: Map<string, Float32Array>, what: string): void {
    for (const [name, t] of this.weights[c]) {
      const v = values.get(name);
      if (!v || v.length !== t.numel)
        throw new Error(`the ${what} to start from has ${v ? `${v.length} values` : 'no tensor'} for ${name}, not ${t.numel}: it is not this size's ${what}`);
      this.gpu.write(t, v);
    }
  }

  /** The components a stage trains and the learning rate. */
  private stageParams(stage: Exclude<PretrainStage, 'done'>): { comps: Component[]; lr: number } {
    return stage === 'vae' ? { comps: ['vae'], lr: this.settings.vaeLr } : { comps: ['unet', 'text_encoder'], lr: this.settings.lr };
  }

  /** A stage's trainable weights, keyed "component/name" (the optimizer's parameter names). */
  private trainable(stage: Exclude<PretrainStage, 'done'>): Map<string, Tensor> {
    const out = new Map<string, Tensor>();
    for (const c of this.stageParams(stage).comps) for (const n of trainableNames(c, this.weights[c].keys())) out.set(`${c}/${n}`, this.weights[c].get(n)!);
    return out;
  }

  private async startStage(stage: PretrainStage): Promise<void> {
    this.optimizer?.destroy();
    this.optimizer = null;
    this.stage = stage;
    this.step = 0;
    if (stage === 'done') return;
    const trainable = this.trainable(stage);
    const params = [...trainable].map(([name, t]) => ({ name, shape: [...t.shape] }));
    const elems = params.reduce((a, p) => a + p.shape.reduce((x, y) => x * y, 1), 0);
    // Everything resident (one chunk per 16 Mi elements, all kept on the GPU): a small model streams nothing.
    const chunkElems = Math.max(1 << 24, ...params.map((p) => p.shape.reduce((x, y) => x * y, 1)));
    this.optimizer = await ChunkedAdamW.create(this.gpu, params, trainable, (n) => this.gpu.read(trainable.get(n)!), {
      cfg: { ...ADAMW_DEFAULTS, lr: this.stageParams(stage).lr, weightDecay: 0.01 },
      chunkElems,
      residentChunks: Math.ceil(elems / chunkElems) + 1,
      store: this.store,
      prefix: `${this.runId}/${stage}-opt`,
      maxGradNorm: 1,
    });
    if (stage === 'unet') this.replaceEma([...trainable].map(([name, t]) => [name, scale(this.gpu, t, 1, this.emaTensor(t))]));
  }

  /** Picture `index` of the dataset: its model input [3, R, R] and caption. */
  picture(index: number): { image: Float32Array; caption: string } {
    const scene = this.sceneOf(index);
    const R = this.settings.resolution;
    return { image: toModelInput(drawScene(scene, R), R), caption: captionOf(scene) };
  }

  /**
   * The caption of picture `index`, without drawing it: the UNet stage needs only captions once the latents are
   * cached, and drawing a 64 px picture costs about 5-9 ms of host time (2-core EPYC), 0.15-0.3 s per batch of 32.
   */
  captionOf(index: number): string {
    return captionOf(this.sceneOf(index));
  }

  /**
   * The caption the UNet stage trains picture `index` with at this step: "" with probability dropCaption (the
   * unconditional branch of classifier-free guidance), else without its background with probability bareShare,
   * else the whole caption. Draws from the run's Rng (a bareShare of null draws nothing more, so runs saved before
   * the setting draw as they did).
   */
  trainingCaption(index: number): string {
    if (this.rng.uniform() < this.settings.dropCaption) return '';
    const bare = this.settings.bareShare !== null && this.rng.uniform() < this.settings.bareShare;
    return captionOf(this.sceneOf(index), { background: !bare });
  }

  private sceneOf(index: number) {
    const s = this.settings;
    return sceneAt(s.dataSeed, index, dataSceneOptions(s.data, { exclude: s.exclude, solidShare: s.solidShare ?? undefined }));
  }

  private drawBatch(): number[] {
    return Array.from({ length: this.settings.batch }, () => this.rng.int(this.settings.dataSize));
  }

  /** One step of the current stage; null once both stages are done. */
  async trainStep(): Promise<PretrainStepReport | null> {
    if (this.stage === 'done') return null;
    const t0 = performance.now();
    const stage = this.stage;
    const tape = new Tape(this.gpu, new Set(this.trainable(stage).values()));
    const loss = stage === 'vae' ? await this.vaeLoss(tape) : await this.diffusionLoss(tape);
    const grads = new Map<string, Tensor>();
    for (const [name, t] of this.trainable(stage)) {
      const g = tape.take(t);
      if (g) grads.set(name, g);
    }
    tape.dropGrads();
    const r = Number.isFinite(loss) ? await this.optimizer!.step(grads, 1) : { applied: false };
    for (const g of grads.values()) this.gpu.free(g);
    this.step++;
    this.losses[stage].push(loss);
    if (stage === 'unet' && this.step % this.settings.emaEvery === 0) this.updateEma();
    const total = stage === 'vae' ? this.settings.vaeSteps : this.settings.steps;
    if (this.step >= total) {
      if (stage === 'vae') await this.finishVae();
      await this.startStage(stage === 'vae' ? (this.settings.steps > 0 ? 'unet' : 'done') : 'done');
      await this.checkpoint();
    } else if (this.settings.checkpointEvery > 0 && this.step % this.settings.checkpointEvery === 0) await this.checkpoint();
    await this.gpu.sync();
    return { stage, step: stage === this.stage ? this.step : total, loss, applied: r.applied, seconds: (performance.now() - t0) / 1000 };
  }

  /** Stage 1's loss on the tape: MSE of decode(mean(encode(x))) against x. */
  private async vaeLoss(tape: Tape): Promise<number> {
    const gpu = this.gpu;
    const R = this.settings.resolution;
    const C = this.settings.vaeCrop || R;
    const batch = this.drawBatch();
    const images = new Float32Array(batch.length * 3 * C * C);
    batch.forEach((i, b) => {
      const whole = this.picture(i).image;
      // Whole pictures draw no offsets, so a run without crops keeps its Rng sequence.
      const [ox, oy] = C === R ? [0, 0] : [this.rng.int(R - C + 1), this.rng.int(R - C + 1)];
      images.set(C === R ? whole : cropPicture(whole, R, C, ox, oy), b * 3 * C * C);
    });
    const x = gpu.upload(images, [batch.length, 3, C, C], 'f32', 'activations', 'pictures');
    const moments = vaeEncode(gpu, this.vaeConfig, this.weights.vae, x, tape);
    const latentC = this.vaeConfig.latentChannels;
    // The mean channels, on the tape: their gradient is the moments' first C channels (the rest get none).
    const mean = splitChannels(gpu, moments, 0, latentC);
    tape.record(() => {
      const dMean = tape.take(mean);
      if (!dMean) return;
      const zeros = gpu.zeros([mean.shape[0], latentC, ...mean.shape.slice(2)], 'f32', 'activations', 'd-logvar');
      tape.acc(moments, concatChannels(gpu, dMean, zeros));
      gpu.free(dMean, zeros, mean);
    });
    const recon = vaeDecode(gpu, this.vaeConfig, this.weights.vae, mean, tape);
    const ones = batch.map(() => 1);
    const loss = await weightedMse(gpu, recon, x, ones);
    tape.backward(recon, weightedMseBackward(gpu, recon, x, ones));
    gpu.free(x);
    return loss;
  }

  /** The frozen VAE's scaled latent of picture `index` (computed once, then cached). */
  private async latentOf(index: number): Promise<Float32Array> {
    const hit = this.latentCache.get(index);
    if (hit) return hit;
    const R = this.settings.resolution;
    const x = this.gpu.upload(this.picture(index).image, [1, 3, R, R], 'f32', 'activations', 'picture');
    const moments = vaeEncode(this.gpu, this.vaeConfig, this.weights.vae, x);
    const all = await this.gpu.read(moments);
    this.gpu.free(x, moments);
    const latent = all.slice(0, all.length / 2).map((v) => v * this.scalingFactor);
    this.latentCache.set(index, latent);
    return latent;
  }

  private idsOf(caption: string): Int32Array {
    let ids = this.idsCache.get(caption);
    if (!ids) {
      ids = this.tokenizer.encodePadded(caption);
      const vocab = this.teConfig.vocabSize;
      if (ids.some((id) => id >= vocab))
        throw new Error(`the tokenizer gives ids past the text encoder's vocab_size ${vocab} for "${caption}": use the tokenizer the model was made for`);
      this.idsCache.set(caption, ids);
    }
    return ids;
  }

  /** Stage 2's loss on the tape: the noise-prediction MSE of the file comment. */
  private async diffusionLoss(tape: Tape): Promise<number> {
    const gpu = this.gpu;
    const batch = this.drawBatch();
    const latents = await Promise.all(batch.map((i) => this.latentOf(i)));
    const per = latents[0].length;
    const z0 = new Float32Array(batch.length * per);
    latents.forEach((l, b) => z0.set(l, b * per));
    const captions = batch.map((i) => this.trainingCaption(i));
    const ids = new Float32Array(batch.length * 77);
    captions.forEach((c, b) => ids.set(this.idsOf(c), b * 77));
    const T = this.schedule.numTrainTimesteps;
    const timesteps = batch.map(() => this.rng.int(T));
    const noise = this.rng.normals(z0.length);
    const f = 2 ** (this.vaeConfig.blockOutChannels.length - 1);
    const shape = [batch.length, this.vaeConfig.latentChannels, this.settings.resolution / f, this.settings.resolution / f];
    const x0 = gpu.upload(z0, shape, 'f32', 'activations', 'z0');
    const eps = gpu.upload(noise, shape, 'f32', 'activations', 'noise');
    const ctx = clipTextForward(gpu, this.teConfig, this.weights.text_encoder, ids, batch.length, tape);
    const tT = gpu.upload(timesteps, [batch.length], 'f32', 'activations', 'timesteps');
    const xt = addNoise(gpu, x0, eps, timesteps, this.acp);
    const pred = unetForward(gpu, this.unetConfig, this.weights.unet, xt, tT, ctx, tape);
    const target = this.settings.prediction === 'v_prediction' ? velocity(gpu, x0, eps, timesteps, this.acp) : eps;
    const ones = batch.map(() => 1);
    const loss = await weightedMse(gpu, pred, target, ones);
    tape.backward(pred, weightedMseBackward(gpu, pred, target, ones));
    gpu.free(x0, eps, tT, xt);
    if (target !== eps) gpu.free(target);
    return loss;
  }

  /**
   * Ends stage 1. The latent scale is 1 / (std of the mean latents over 256 pictures), as SD's 0.18215 was
   * chosen, so the UNet sees unit-variance latents. The log-variance channels were never trained (the
   * stage fits the mean only): their quant_conv rows are set to a constant log-variance of -10 (std 0.007,
   * tiny beside unit-variance latents), so a loader that samples the posterior gets the mean, almost exactly.
   */
  private async finishVae(): Promise<void> {
    const n = Math.min(256, this.settings.dataSize);
    let sum = 0;
    let sq = 0;
    let count = 0;
    this.scalingFactor = 1;
    for (let i = 0; i < n; i++) {
      for (const v of await this.latentOf(i)) {
        sum += v;
        sq += v * v;
        count++;
      }
    }
    this.latentCache.clear();
    const std = Math.sqrt(Math.max(1e-12, sq / count - (sum / count) ** 2));
    this.scalingFactor = 1 / std;
    const C = this.vaeConfig.latentChannels;
    const w = this.weights.vae.get('quant_conv.weight')!;
    const b = this.weights.vae.get('quant_conv.bias')!;
    const wv = await this.gpu.read(w);
    const bv = await this.gpu.read(b);
    const perOut = wv.length / (2 * C);
    wv.fill(0, C * perOut);
    bv.fill(-10, C);
    this.gpu.write(w, wv);
    this.gpu.write(b, bv);
  }

  /** ema = d ema + (1 - d) w with d = decay^emaEvery, decay = min(emaDecay, (1 + n) / (10 + n)) for update n. */
  private updateEma(): void {
    const n = this.emaUpdates * this.settings.emaEvery;
    const decay = Math.min(this.settings.emaDecay, (1 + n) / (10 + n)) ** this.settings.emaEvery;
    for (const [name, w] of this.trainable('unet')) {
      const e = this.ema.get(name)!;
      const kept = scale(this.gpu, e, decay);
      add(this.gpu, kept, w, 1 - decay, e);
      this.gpu.free(kept);
    }
    this.emaUpdates++;
  }

  /** An EMA tensor shaped like weight `w`. */
  private emaTensor(w: Tensor): Tensor {
    return this.gpu.tensor(w.shape, 'f32', 'weights', 'ema');
  }

  /** Frees the EMA tensors and holds these instead. */
  private replaceEma(entries: [string, Tensor][]): void {
    for (const t of this.ema.values()) this.gpu.free(t);
    this.ema = new Map(entries);
  }

  private get ckptPrefix(): string {
    return `${this.runId}/pretrain`;
  }

  /** Commits a checkpoint: stage, step, Rng, optimizer state, EMA, the VAE (once trained) and the latent scale. */
  async checkpoint(): Promise<void> {
    const st = this.optimizer ? await this.optimizer.checkpointState() : { files: new Map<string, Uint8Array>(), versions: {}, applied: 0 };
    const files = new Map(st.files);
    const tensors = async (c: Component) => {
      const out = new Map<string, NamedTensor>();
      for (const [name, t] of this.weights[c]) out.set(name, { shape: [...t.shape], data: await this.gpu.read(t) });
      return writeSafetensors(out);
    };
    // The weights themselves (the optimizer's masters are the same values in f32; the frozen tables are not in it).
    for (const c of ['vae', 'unet', 'text_encoder'] as const) files.set(`weights-${c}.safetensors`, await tensors(c));
    if (this.ema.size) {
      const out = new Map<string, NamedTensor>();
      for (const [name, t] of this.ema) {
        const v = await this.gpu.read(t);
        out.set(name, { shape: [v.length], data: v });
      }
      files.set('ema.safetensors', writeSafetensors(out));
    }
    const meta: PretrainMeta = {
      stage: this.stage,
      step: this.step,
      rng: this.rng.state(),
      versions: st.versions,
      applied: st.applied,
      emaUpdates: this.emaUpdates,
      losses: this.losses,
      scalingFactor: this.scalingFactor,
      settings: this.settings,
    };
    await commitSnapshot(this.store, this.ckptPrefix, files, meta);
    await this.optimizer?.pin(st.versions);
  }

  /** Continues from the last checkpoint (false when there is none); the settings must be the run's own. */
  async resume(): Promise<boolean> {
    const snap = await openSnapshot<PretrainMeta>(this.store, this.ckptPrefix);
    if (!snap) return false;
    const m = snap.meta;
    // Every setting but the step counts must be the run's own; more steps extend a run still in its stages.
    if (this.settings.steps < m.settings.steps || (m.stage === 'done' && this.settings.steps !== m.settings.steps))
      throw new Error(
        m.stage === 'done'
          ? `this pretraining run finished its ${m.settings.steps} steps: its optimizer state is gone, so go on in a new run that starts from its model (--init-from)`
          : `this pretraining run was started for ${m.settings.steps} steps: resume with at least that many, not ${this.settings.steps}`,
      );
    // The VAE stage may also grow while it runs; once it has ended the UNet's latents are made with it.
    if (this.settings.vaeSteps !== m.settings.vaeSteps && (m.stage !== 'vae' || this.settings.vaeSteps < m.settings.vaeSteps))
      throw new Error(
        m.stage === 'vae'
          ? `this pretraining run's VAE stage was started for ${m.settings.vaeSteps} steps: resume with at least that many, not ${this.settings.vaeSteps}`
          : `this pretraining run's VAE stage ended at ${m.settings.vaeSteps} steps (stage ${m.stage}), so it cannot have ${this.settings.vaeSteps}: train a longer VAE in a new run and start the UNet from it (--vae-from)`,
      );
    for (const k of Object.keys(this.settings) as (keyof PretrainSettings)[])
      // A setting added after the checkpoint was made counts as its default (which keeps the old behaviour).
      if (k !== 'steps' && k !== 'vaeSteps' && JSON.stringify(savedPretrainSettings(m.settings)[k]) !== JSON.stringify(this.settings[k]))
        throw new Error(
          `this pretraining run's checkpoint was made with ${k} = ${JSON.stringify(savedPretrainSettings(m.settings)[k])}, not ${JSON.stringify(this.settings[k])}: resume with the run's own settings`,
        );
    for (const c of ['vae', 'unet', 'text_encoder'] as const) {
      const saved = readSafetensors(await snap.read(`weights-${c}.safetensors`)).tensors;
      for (const [name, t] of this.weights[c]) this.gpu.write(t, saved.get(name)!.data);
    }
    await this.startStage(m.stage);
    const ema: [string, Tensor][] = [];
    if (m.stage === 'unet' || m.stage === 'done') {
      const saved = readSafetensors(await snap.read('ema.safetensors')).tensors;
      for (const [name, w] of this.trainable('unet')) ema.push([name, this.gpu.upload(saved.get(name)!.data, w.shape, 'f32', 'weights', 'ema')]);
    }
    this.replaceEma(ema);
    if (this.optimizer) await this.optimizer.restore((n) => snap.read(n), m.versions, m.applied);
    this.step = m.step;
    this.rng.restore(m.rng);
    this.emaUpdates = m.emaUpdates;
    this.scalingFactor = m.scalingFactor;
    this.losses.vae = [...m.losses.vae];
    this.losses.unet = [...m.losses.unet];
    this.latentCache.clear();
    await this.gpu.sync();
    return true;
  }

  /** The weights that ship, f32 by component: the trained VAE, and the EMA UNet and text encoder (frozen tables as they are). */
  async finalWeights(): Promise<Record<Component, Map<string, NamedTensor>>> {
    const out = { vae: new Map(), unet: new Map(), text_encoder: new Map() } as Record<Component, Map<string, NamedTensor>>;
    for (const c of ['vae', 'unet', 'text_encoder'] as const)
      for (const [name, t] of this.weights[c]) {
        const ema = this.ema.get(`${c}/${name}`);
        out[c].set(name, { shape: [...t.shape], data: await this.gpu.read(ema ?? t) });
      }
    return out;
  }

  destroy(): void {
    this.optimizer?.destroy();
    this.replaceEma([]);
    for (const w of Object.values(this.weights)) for (const t of w.values()) this.gpu.free(t);
  }
}

/**
 * The pretrained model as a diffusers folder (fp16 safetensors): the final weights, the VAE's measured latent
 * scale in its config, and the CLIP tokenizer it was trained with. Refuses (naming the tensor) a value that is
 * not finite or past f16's range, so no export ever carries one.
 */
export async function pretrainedModelFiles(
  p: Pretrainer,
  tokenizer: { vocab: Record<string, number>; merges: string },
  opts: { partWay?: boolean } = {},
): Promise<Map<string, Uint8Array>> {
  // Part-way (`pretrain --resume <dir> --export`) needs the UNet stage begun: before it the UNet is untrained.
  if (p.stage === 'vae' || (p.stage !== 'done' && !opts.partWay))
    throw new Error(`pretraining is not finished (stage ${p.stage}, step ${p.step}): resume it to the end first`);
  const weights = await p.finalWeights();
  for (const [c, m] of Object.entries(weights))
    for (const [name, t] of m)
      for (const v of t.data as Float32Array)
        if (!Number.isFinite(v) || Math.abs(v) > 65504) throw new Error(`${c}/${name} holds ${v}, which fp16 cannot store: the model was not written`);
  const configs = {
    ...p.configs,
    vae: { ...p.configs.vae, scaling_factor: p.scalingFactor },
    scheduler: { ...p.configs.scheduler, prediction_type: p.settings.prediction },
  };
  // A finished run's step counter restarts with its 'done' stage: the model is the UNet stage's last step.
  const step = p.stage === 'done' ? p.settings.steps : p.step;
  const meta = {
    format: 'pt',
    generator: 'DreamBooth Studio pretrain',
    settings: JSON.stringify(p.settings),
    stage: p.stage,
    step: String(step),
    // UNet steps in all, this run's and those of the model it went on from (--init-from).
    total_steps: String(p.settings.initSteps + step),
  };
  return diffusersModelFiles(configs, weights, tokenizer, meta, 'F16');
}
