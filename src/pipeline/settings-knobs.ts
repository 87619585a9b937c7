// The settings schema's entries for the trainer's knobs that LoRA trainers bring from kohya's sd-scripts and
// diffusers: the noise and loss options (train/noise.ts, train/loss-options.ts) and the EMA of the trained
// weights (train/ema.ts). settings.ts appends KNOB_SETTINGS to SETTINGS and checks knobProblem in
// validateSettings; this file imports only types from it (settings.ts imports this one).
import { EMA_DEFAULTS } from '../train/ema.ts';
import { HUBER_C_DEFAULT, HUBER_SCHEDULES, LOSS_KINDS, type HuberSchedule, type LossKind } from '../train/loss-options.ts';
import { MULTIRES_DISCOUNT_DEFAULT } from '../train/noise.ts';
import { sdWhen } from './sdscripts-row.ts';
import type { Namer, RunSettings, SettingKey, SettingSpec } from './settings.ts';

const pyBool = (b: boolean) => (b ? 'True' : 'False');

/**
 * sd-scripts' --optimizer_type and --optimizer_args for a run's optimizer (library/train_util.py get_optimizer:
 * Prodigy from prodigyopt, transformers' Adafactor; each argument is read by ast.literal_eval), or null for
 * AdamW (train-sd-scripts.sh's default --optimizer_type=AdamW).
 */
export function optimizerArgs(s: RunSettings): string | null {
  if (s.optimizer === 'prodigy')
    return `--optimizer_type=Prodigy --optimizer_args d_coef=${s.prodigyDCoef} d0=${s.prodigyD0} safeguard_warmup=${pyBool(s.prodigySafeguardWarmup)} use_bias_correction=${pyBool(s.prodigyBiasCorrection)}`;
  if (s.optimizer === 'adafactor')
    return `--optimizer_type=Adafactor --optimizer_args relative_step=${pyBool(s.adafactorRelativeStep === 'on')} scale_parameter=${pyBool(s.adafactorScaleParameter === 'on')} warmup_init=${pyBool(s.adafactorWarmupInit)}`;
  return null;
}

/** The knobs' fields of RunSettings. */
export interface KnobSettings {
  /** Rescale the noise schedule to zero terminal SNR (for v-prediction models). */
  zeroTerminalSnr: boolean;
  /** Debiased estimation's loss weight per sample. */
  debiasedEstimation: boolean;
  /** Multi-resolution noise levels (0: off) and their discount. */
  multiresNoiseIterations: number;
  multiresNoiseDiscount: number;
  /** Input-perturbation noise strength (0: off). */
  ipNoiseGamma: number;
  /** Timesteps drawn from min..max-1. */
  minTimestep: number;
  maxTimestep: number;
  /** The loss, and for huber / smooth_l1 sd-scripts' huber_c and its schedule. */
  loss: LossKind;
  huberC: number;
  huberSchedule: HuberSchedule;
  /** EMA of the trained weights: used for samples and try-it; exported instead of the raw weights with exportEma. */
  ema: boolean;
  emaDecay: number;
  emaMinDecay: number;
  emaUpdateAfter: number;
  emaWarmup: boolean;
  emaPower: number;
  emaInvGamma: number;
  exportEma: boolean;
  /** Prodigy's d_coef, d0, safeguard_warmup and use_bias_correction. */
  prodigyDCoef: number;
  prodigyD0: number;
  prodigySafeguardWarmup: boolean;
  prodigyBiasCorrection: boolean;
  /** Adafactor's relative_step, scale_parameter and warmup_init. */
  adafactorRelativeStep: 'on' | 'off';
  adafactorScaleParameter: 'on' | 'off';
  adafactorWarmupInit: boolean;
  /** Per step: the empty caption with this probability; the tags after the first keepTokens shuffled (train/captions.ts). */
  captionDropout: number;
  shuffleTags: boolean;
  keepTokens: number;
}

/** Adafactor with its relative step: the learning rate and its schedule are not read. */
export const adafactorRelative = (s: RunSettings): boolean => s.optimizer === 'adafactor' && s.adafactorRelativeStep === 'on';

const entry = <K extends SettingKey>(e: SettingSpec<K>): SettingSpec => e as unknown as SettingSpec;
/** A Prodigy or Adafactor setting: one of the --optimizer_args the optimizer row gives (optimizerArgs). */
const inArgs = (name: string) => ({ option: null, note: `in --optimizer_args (${name})` });
const none = (note: string) => () => ({ option: null, note });
const robust = (s: RunSettings) => s.loss !== 'l2';
const robustOnly = { test: robust, why: 'is for --loss huber or smooth_l1 only: add one, or leave this out' };
const emaOnly = { test: (s: RunSettings) => s.ema, why: 'sets the EMA of the trained weights: add --ema, or leave this out' };
const prodigyOnly = { test: (s: RunSettings) => s.optimizer === 'prodigy', why: 'is for --optimizer prodigy only: add it, or leave this out' };
const adafactorOnly = { test: (s: RunSettings) => s.optimizer === 'adafactor', why: 'is for --optimizer adafactor only: add it, or leave this out' };
const emaWarmupOnly = { test: (s: RunSettings) => s.ema && s.emaWarmup, why: "is the EMA warm-up's: add --ema --ema-warmup, or leave this out" };

export const KNOB_SETTINGS: readonly SettingSpec[] = [
  entry({
    key: 'zeroTerminalSnr',
    kind: 'bool',
    flag: 'zero-terminal-snr',
    label: 'Zero terminal SNR (v-prediction models)',
    default: false,
    help: 'rescale the noise schedule so its last timestep is pure noise (Lin et al.; sd-scripts --zero_terminal_snr); needs a v-prediction model',
    train: (v) => (v ? { zeroTerminalSnr: true } : {}),
    bundle: none('the diffusers scripts have no zero-terminal-SNR option'),
    sdScripts: (s) => sdWhen(s.zeroTerminalSnr, '--zero_terminal_snr'),
  }),
  entry({
    key: 'debiasedEstimation',
    kind: 'bool',
    flag: 'debiased-estimation',
    label: 'Debiased estimation loss',
    default: false,
    help: "weigh each sample's loss by 1/sqrt(SNR) (v-prediction: 1/(SNR+1)), SNR at most 1000 (sd-scripts --debiased_estimation_loss)",
    train: (v) => (v ? { debiasedEstimation: true } : {}),
    sdScripts: (s) => sdWhen(s.debiasedEstimation, '--debiased_estimation_loss'),
  }),
  entry({
    key: 'multiresNoiseIterations',
    kind: 'int',
    flag: 'multires-noise-iterations',
    label: 'Multires noise levels (0: off)',
    min: 0,
    max: 20,
    default: 0,
    help: 'multi-resolution (pyramid) noise with N levels, e.g. 6 (sd-scripts --multires_noise_iterations); not with --offset-noise',
    activeWhen: { test: (s) => s.offsetNoise === 0, why: 'and --offset-noise both reshape the noise (sd-scripts uses one or the other): leave one out' },
    train: (v) => (v > 0 ? { multiresNoiseIterations: v } : {}),
    sdScripts: (s) => sdWhen(s.multiresNoiseIterations > 0, `--multires_noise_iterations=${s.multiresNoiseIterations}`),
  }),
  entry({
    key: 'multiresNoiseDiscount',
    kind: 'number',
    flag: 'multires-noise-discount',
    label: 'Multires noise discount',
    min: 0,
    max: 1,
    default: MULTIRES_DISCOUNT_DEFAULT,
    help: "each level's weight is discount^level (sd-scripts --multires_noise_discount)",
    showWhen: (s) => s.multiresNoiseIterations > 0,
    activeWhen: { test: (s) => s.multiresNoiseIterations > 0, why: 'is for multires noise: add --multires-noise-iterations N, or leave this out' },
    train: (v, s) => (s.multiresNoiseIterations > 0 ? { multiresNoiseDiscount: v } : {}),
    sdScripts: (s) =>
      s.multiresNoiseIterations > 0
        ? { option: `--multires_noise_discount=${s.multiresNoiseDiscount}` }
        : { option: null, note: 'not used: multires noise only' },
  }),
  entry({
    key: 'ipNoiseGamma',
    kind: 'number',
    flag: 'ip-noise-gamma',
    label: 'Input perturbation noise (0: off)',
    min: 0,
    max: 1,
    default: 0,
    help: 'input-perturbation noise: x_t is noised with eps + gamma N(0, I), the target stays eps, e.g. 0.1 (sd-scripts --ip_noise_gamma)',
    train: (v) => (v > 0 ? { ipNoiseGamma: v } : {}),
    sdScripts: (s) => sdWhen(s.ipNoiseGamma > 0, `--ip_noise_gamma=${s.ipNoiseGamma}`),
  }),
  entry({
    key: 'minTimestep',
    kind: 'int',
    flag: 'min-timestep',
    label: 'Lowest timestep',
    min: 0,
    max: 999,
    default: 0,
    help: 'timesteps are drawn from min..max-1 (sd-scripts --min_timestep)',
    train: (v) => (v > 0 ? { minTimestep: v } : {}),
    sdScripts: (s) => sdWhen(s.minTimestep > 0, `--min_timestep=${s.minTimestep}`),
  }),
  entry({
    key: 'maxTimestep',
    kind: 'int',
    flag: 'max-timestep',
    label: 'Timesteps below',
    min: 1,
    max: 1000,
    default: 1000,
    help: "timesteps are drawn below this (sd-scripts --max_timestep; the schedule's length, 1000, by default)",
    train: (v) => (v < 1000 ? { maxTimestep: v } : {}),
    sdScripts: (s) => sdWhen(s.maxTimestep < 1000, `--max_timestep=${s.maxTimestep}`),
  }),
  entry({
    key: 'loss',
    kind: 'enum',
    flag: 'loss',
    label: 'Loss',
    values: LOSS_KINDS,
    valueLabels: { l2: 'L2 (MSE)', huber: 'Huber', smooth_l1: 'smooth L1' },
    default: 'l2',
    help: "l2 (MSE), huber (2c(sqrt(d^2+c^2)-c)) or smooth_l1 (2(sqrt(d^2+c^2)-c)), c from --huber-delta and --huber-schedule (sd-scripts' --loss_type)",
    train: (v) => (v !== 'l2' ? { loss: v } : {}),
    sdScripts: (s) => (s.loss === 'l2' ? { option: null, note: "the same: sd-scripts' default --loss_type=l2" } : { option: `--loss_type=${s.loss}` }),
  }),
  entry({
    key: 'huberC',
    kind: 'number',
    flag: 'huber-delta',
    label: 'Huber delta (c)',
    min: 1e-4,
    max: 1,
    default: HUBER_C_DEFAULT,
    help: "the Huber loss's c (sd-scripts --huber_c)",
    showWhen: robust,
    activeWhen: robustOnly,
    train: (v, s) => (robust(s) ? { huberC: v } : {}),
    sdScripts: (s) => (robust(s) ? { option: `--huber_c=${s.huberC}` } : { option: null, note: 'not used: --loss huber or smooth_l1 only' }),
  }),
  entry({
    key: 'huberSchedule',
    kind: 'enum',
    flag: 'huber-schedule',
    label: 'Huber delta over timesteps',
    values: HUBER_SCHEDULES,
    default: 'snr',
    help: 'c per timestep: snr ((1-c)/(1+sigma_t)^2 + c), exponential (c^(t/T)) or constant (sd-scripts --huber_schedule)',
    showWhen: robust,
    activeWhen: robustOnly,
    train: (v, s) => (robust(s) ? { huberSchedule: v } : {}),
    sdScripts: (s) => (robust(s) ? { option: `--huber_schedule=${s.huberSchedule}` } : { option: null, note: 'not used: --loss huber or smooth_l1 only' }),
  }),
  entry({
    key: 'ema',
    kind: 'bool',
    flag: 'ema',
    label: 'EMA of the trained weights',
    default: false,
    help: "keep an exponential moving average of the trained weights (diffusers' EMAModel; a full fine-tune keeps it in the chunk store): samples and try-it use it; --export-ema exports it",
    bundle: (s) => ({ option: null, note: s.ema ? "the bundle's DreamBooth scripts keep no EMA (diffusers' --use_ema is train_text_to_image.py's)" : 'off' }),
  }),
  entry({
    key: 'emaDecay',
    kind: 'number',
    flag: 'ema-decay',
    label: 'EMA decay',
    min: 0,
    max: 0.999999,
    default: EMA_DEFAULTS.decay,
    help: 'the largest decay; without --ema-warmup the decay is min(this, (1+n)/(10+n)) at the n-th update',
    showWhen: (s) => s.ema,
    activeWhen: emaOnly,
  }),
  entry({
    key: 'emaMinDecay',
    kind: 'number',
    flag: 'ema-min-decay',
    label: 'EMA smallest decay',
    min: 0,
    max: 0.999999,
    default: EMA_DEFAULTS.minDecay,
    help: 'the decay is at least this (after --ema-update-after)',
    showWhen: (s) => s.ema,
    activeWhen: emaOnly,
  }),
  entry({
    key: 'emaUpdateAfter',
    kind: 'int',
    flag: 'ema-update-after',
    label: 'EMA starts averaging after',
    unit: 'steps',
    min: 0,
    max: 1_000_000,
    default: EMA_DEFAULTS.updateAfterStep,
    help: 'the EMA copies the weights (decay 0) for this many steps first',
    showWhen: (s) => s.ema,
    activeWhen: emaOnly,
  }),
  entry({
    key: 'emaWarmup',
    kind: 'bool',
    flag: 'ema-warmup',
    label: 'EMA warm-up (1 - (1 + n/inv_gamma)^-power)',
    default: EMA_DEFAULTS.warmup,
    help: "diffusers' use_ema_warmup: decay 1 - (1 + n / inv_gamma)^-power (--ema-inv-gamma, --ema-power) instead of (1+n)/(10+n)",
    showWhen: (s) => s.ema,
    activeWhen: emaOnly,
  }),
  entry({
    key: 'emaPower',
    kind: 'number',
    flag: 'ema-power',
    label: 'EMA warm-up power',
    min: 0.01,
    max: 10,
    default: EMA_DEFAULTS.power,
    help: "the warm-up's power (diffusers: 2/3)",
    showWhen: (s) => s.ema && s.emaWarmup,
    activeWhen: emaWarmupOnly,
  }),
  entry({
    key: 'emaInvGamma',
    kind: 'number',
    flag: 'ema-inv-gamma',
    label: 'EMA warm-up inv_gamma',
    min: 0.01,
    max: 1_000_000,
    default: EMA_DEFAULTS.invGamma,
    help: "the warm-up's inv_gamma (diffusers: 1)",
    showWhen: (s) => s.ema && s.emaWarmup,
    activeWhen: emaWarmupOnly,
    // Every EMA field reaches the trainer in one object (this last entry writes it).
    train: (_v, s) =>
      s.ema
        ? {
            ema: {
              decay: s.emaDecay,
              minDecay: s.emaMinDecay,
              updateAfterStep: s.emaUpdateAfter,
              warmup: s.emaWarmup,
              power: s.emaPower,
              invGamma: s.emaInvGamma,
            },
          }
        : {},
  }),
  entry({
    key: 'exportEma',
    kind: 'bool',
    flag: 'export-ema',
    label: 'Export the EMA weights',
    default: false,
    help: "export the EMA of the weights instead of the last step's",
    showWhen: (s) => s.ema,
    activeWhen: emaOnly,
  }),
  entry({
    key: 'prodigyDCoef',
    kind: 'number',
    flag: 'prodigy-d-coef',
    label: 'Prodigy d_coef',
    min: 0.01,
    max: 100,
    default: 1,
    onlyMode: 'lora',
    help: "scales Prodigy's estimated step size d (prodigyopt's d_coef)",
    showWhen: prodigyOnly.test,
    activeWhen: prodigyOnly,
    train: (v, s) =>
      s.optimizer === 'prodigy'
        ? { prodigy: { dCoef: v, d0: s.prodigyD0, safeguardWarmup: s.prodigySafeguardWarmup, useBiasCorrection: s.prodigyBiasCorrection } }
        : {},
    sdScripts: (s) => (prodigyOnly.test(s) ? inArgs('d_coef') : { option: null, note: 'not used: --optimizer prodigy only' }),
  }),
  entry({
    key: 'prodigyD0',
    kind: 'number',
    flag: 'prodigy-d0',
    label: 'Prodigy d0',
    min: 1e-12,
    max: 1,
    default: 1e-6,
    onlyMode: 'lora',
    help: "Prodigy's starting estimate of d (prodigyopt's d0)",
    showWhen: prodigyOnly.test,
    activeWhen: prodigyOnly,
    sdScripts: (s) => (prodigyOnly.test(s) ? inArgs('d0') : { option: null, note: 'not used: --optimizer prodigy only' }),
  }),
  entry({
    key: 'prodigySafeguardWarmup',
    kind: 'bool',
    flag: 'prodigy-safeguard-warmup',
    label: 'Prodigy safeguard warm-up',
    default: false,
    onlyMode: 'lora',
    help: "Prodigy's safeguard_warmup (for runs with a learning-rate warm-up)",
    showWhen: prodigyOnly.test,
    activeWhen: prodigyOnly,
    sdScripts: (s) => (prodigyOnly.test(s) ? inArgs('safeguard_warmup') : { option: null, note: 'not used: --optimizer prodigy only' }),
  }),
  entry({
    key: 'prodigyBiasCorrection',
    kind: 'bool',
    flag: 'prodigy-bias-correction',
    label: 'Prodigy bias correction',
    default: false,
    onlyMode: 'lora',
    help: "Prodigy's use_bias_correction (Adam's bias correction of the step)",
    showWhen: prodigyOnly.test,
    activeWhen: prodigyOnly,
    sdScripts: (s) => (prodigyOnly.test(s) ? inArgs('use_bias_correction') : { option: null, note: 'not used: --optimizer prodigy only' }),
  }),
  entry({
    key: 'adafactorRelativeStep',
    kind: 'enum',
    flag: 'adafactor-relative-step',
    label: 'Adafactor relative step',
    values: ['on', 'off'],
    default: 'on',
    onlyMode: 'lora',
    help: "on: Adafactor's own step size min(1e-2, 1/sqrt(t)) (--lr and its schedule unused); off: --lr",
    showWhen: adafactorOnly.test,
    activeWhen: adafactorOnly,
    train: (v, s) =>
      s.optimizer === 'adafactor'
        ? { adafactor: { relativeStep: v === 'on', scaleParameter: s.adafactorScaleParameter === 'on', warmupInit: s.adafactorWarmupInit } }
        : {},
    sdScripts: (s) => (adafactorOnly.test(s) ? inArgs('relative_step') : { option: null, note: 'not used: --optimizer adafactor only' }),
  }),
  entry({
    key: 'adafactorScaleParameter',
    kind: 'enum',
    flag: 'adafactor-scale-parameter',
    label: 'Adafactor scale parameter',
    values: ['on', 'off'],
    default: 'on',
    onlyMode: 'lora',
    help: "on: Adafactor's step is relative to each parameter's RMS (scale_parameter)",
    showWhen: adafactorOnly.test,
    activeWhen: adafactorOnly,
    sdScripts: (s) => (adafactorOnly.test(s) ? inArgs('scale_parameter') : { option: null, note: 'not used: --optimizer adafactor only' }),
  }),
  entry({
    key: 'adafactorWarmupInit',
    kind: 'bool',
    flag: 'adafactor-warmup-init',
    label: 'Adafactor warm-up init',
    default: false,
    onlyMode: 'lora',
    help: "Adafactor's warmup_init: the relative step grows as 1e-6 t",
    showWhen: adafactorRelative,
    activeWhen: { test: adafactorRelative, why: 'is for --optimizer adafactor with its relative step: add those, or leave this out' },
    sdScripts: (s) => (adafactorOnly.test(s) ? inArgs('warmup_init') : { option: null, note: 'not used: --optimizer adafactor only' }),
  }),
  entry({
    key: 'captionDropout',
    kind: 'number',
    flag: 'caption-dropout',
    label: 'Caption dropout',
    min: 0,
    max: 0.99,
    default: 0,
    help: "the share of steps a photo trains with the empty caption, e.g. 0.05 (sd-scripts' caption_dropout_rate)",
    train: (v, s) => (v > 0 && !s.shuffleTags ? { captions: { dropout: v, shuffle: false, keepTokens: 0 } } : {}),
    sdScripts: (s) =>
      s.captionDropout > 0
        ? { option: null, note: `sd-scripts.toml: caption_dropout_rate = ${s.captionDropout} (the photos' subset)` }
        : { option: null, note: 'off' },
  }),
  entry({
    key: 'shuffleTags',
    kind: 'bool',
    flag: 'shuffle-tags',
    label: 'Shuffle caption tags',
    default: false,
    help: "shuffle each caption's comma-separated tags every step, the first --keep-tokens kept in place (sd-scripts' shuffle_caption)",
    train: (v, s) => (v ? { captions: { dropout: s.captionDropout, shuffle: true, keepTokens: s.keepTokens } } : {}),
    sdScripts: (s) => (s.shuffleTags ? { option: null, note: "sd-scripts.toml: shuffle_caption = true (the photos' subset)" } : { option: null, note: 'off' }),
  }),
  entry({
    key: 'keepTokens',
    kind: 'int',
    flag: 'keep-tokens',
    label: 'Tags kept in front',
    min: 0,
    max: 75,
    default: 0,
    help: "with --shuffle-tags: this many leading tags stay in place (sd-scripts' keep_tokens), e.g. 1 for the trigger word",
    showWhen: (s) => s.shuffleTags,
    activeWhen: { test: (s) => s.shuffleTags, why: 'keeps tags in place while they are shuffled: add --shuffle-tags, or leave this out' },
    sdScripts: (s) =>
      s.shuffleTags
        ? { option: null, note: `sd-scripts.toml: keep_tokens = ${s.keepTokens} (the photos' subset)` }
        : { option: null, note: 'not used: --shuffle-tags only' },
  }),
];

/**
 * The knobs' checks across settings, or null: a problem's message (worded with the host's `name`) and the
 * setting it names (validateSettings throws it).
 */
export function knobProblem(s: RunSettings, name: Namer): { message: string; key: SettingKey } | null {
  if (s.minTimestep >= s.maxTimestep)
    return {
      message: `${name('minTimestep')} ${s.minTimestep} must be below ${name('maxTimestep')} ${s.maxTimestep} (timesteps are drawn from min to max-1)`,
      key: 'minTimestep',
    };
  if (s.multiresNoiseIterations > 0 && s.offsetNoise > 0)
    return {
      message: `${name('multiresNoiseIterations')} and ${name('offsetNoise')} both reshape the noise (sd-scripts uses one or the other): set one of them to 0`,
      key: 'multiresNoiseIterations',
    };
  if (s.ema && s.emaMinDecay > s.emaDecay)
    return { message: `${name('emaMinDecay')} ${s.emaMinDecay} is above ${name('emaDecay')} ${s.emaDecay}: use at most the decay`, key: 'emaMinDecay' };
  if ((s.optimizer === 'prodigy' || s.optimizer === 'adafactor') && s.mode !== 'lora')
    return {
      // Their updates run on the host over every fp32 master and its state held in memory (host-optimizer.ts): a
      // LoRA's few MB. A full fine-tune's optimizer is chunked GPU kernels streamed through the store, AdamW's only.
      message: `${name('optimizer')} ${s.optimizer} is for LoRA runs: its update runs on the host with every fp32 master and its state in memory (${s.optimizer === 'prodigy' ? '20 bytes per weight, 17 GB for SD 1.5' : '4 bytes per weight, 3.4 GB for SD 1.5'}), and full fine-tuning's chunked GPU optimizer is AdamW's only: use adamw or adamw8bit for ${name('mode')} ${s.mode}`,
      key: 'optimizer',
    };
  if ((s.optimizer === 'prodigy' || s.optimizer === 'adafactor') && s.master !== 'fp32')
    return { message: `${name('optimizer')} ${s.optimizer} keeps fp32 masters on the host: set ${name('master')} fp32`, key: 'master' };
  if ((s.optimizer === 'prodigy' || adafactorRelative(s)) && s.trainTextEncoder && s.textEncoderLr > 0)
    return { message: `${name('optimizer')} ${s.optimizer} has one step size for every parameter: leave ${name('textEncoderLr')} at 0`, key: 'textEncoderLr' };
  if (adafactorRelative(s) && (s.lrScheduler !== 'constant' || s.lrWarmup > 0))
    return {
      message: `${name('optimizer')} adafactor with its relative step does not read the learning rate, so ${name(s.lrWarmup > 0 ? 'lrWarmup' : 'lrScheduler')} would do nothing: set ${name('adafactorRelativeStep')} off, or leave the schedule out`,
      key: s.lrWarmup > 0 ? 'lrWarmup' : 'lrScheduler',
    };
  if (s.exportEma && !s.ema) return { message: `${name('exportEma')} exports the EMA: turn on ${name('ema')} too`, key: 'exportEma' };
  return null;
}
