// The settings schema's entries for the LoRA network type (nn/lycoris.ts): plain LoRA or the LyCORIS types LoCon,
// LoHa and LoKr, the ResNet convs' rank and alpha, LoKr's factor and DoRA. settings.ts appends NETWORK_SETTINGS to
// SETTINGS and checks networkProblem in validateSettings; this file imports only types from it.
// In the sd-scripts bundle a LyCORIS run becomes LyCORIS' kohya module (its README's "for kohya script" usage):
//   --network_module=lycoris.kohya --network_args algo=<type> conv_dim=<n> conv_alpha=<a> [factor=<f>] [dora_wd=True]
// given by the network row (lycorisArgs); the other rows say they are in those args.
import { NETWORK_TYPES, type NetworkType } from '../nn/lycoris.ts';
import type { Namer, RunSettings, SettingKey, SettingSpec } from './settings.ts';

/** The network's fields of RunSettings. */
export interface NetworkSettings {
  /** lora: adapters on the attention projections; locon, loha, lokr: LyCORIS types, on the ResNet 3x3 convs too. */
  network: NetworkType;
  /** The convs' rank and alpha (0: the rank; 0: the conv rank, scale 1). */
  convRank: number;
  convAlpha: number;
  /** LoKr's factorization factor (-1: the split closest to a square). */
  lokrFactor: number;
  /** DoRA: weight-decomposed training of a LyCORIS network (LyCORIS dora_wd, nn/dora.ts). */
  dora: boolean;
}

const entry = <K extends SettingKey>(e: SettingSpec<K>): SettingSpec => e as unknown as SettingSpec;
const lycoris = (s: RunSettings) => s.mode === 'lora' && s.network !== 'lora';
const lycorisOnly = { test: lycoris, why: "sets the ResNet convs' adapters of a LyCORIS network: add --network locon, loha or lokr, or leave this out" };
const noBundle = () => ({ option: null, note: "not carried: the diffusers scripts train plain LoRA only (sd-scripts: LyCORIS' lycoris.kohya module)" });
/** A LyCORIS setting in sd-scripts: one of the --network_args the network row gives (lycorisArgs). */
const inArgs = (name: string) => (s: RunSettings) =>
  lycoris(s) ? { option: null, note: `in --network_args (${name})` } : { option: null, note: 'not used: LyCORIS networks only' };

/**
 * sd-scripts' options for a LyCORIS run (LyCORIS' lycoris.kohya network module and the network_args its
 * create_network reads: algo, conv_dim, conv_alpha, factor, dora_wd), or null for plain LoRA (networks.lora).
 * conv_dim and conv_alpha as the trainer resolves them (0: the rank; 0: the conv rank).
 */
export function lycorisArgs(s: RunSettings): string | null {
  if (!lycoris(s)) return null;
  const convDim = s.convRank || s.rank;
  const args = [`algo=${s.network}`, `conv_dim=${convDim}`, `conv_alpha=${s.convAlpha || convDim}`];
  if (s.network === 'lokr') args.push(`factor=${s.lokrFactor}`);
  if (s.dora) args.push('dora_wd=True');
  return `--network_module=lycoris.kohya --network_args ${args.join(' ')}`;
}

export const NETWORK_SETTINGS: readonly SettingSpec[] = [
  entry({
    key: 'network',
    kind: 'enum',
    flag: 'network',
    label: 'Network type',
    values: NETWORK_TYPES,
    valueLabels: { lora: 'LoRA', locon: 'LoCon (LoRA + convs)', loha: 'LoHa (Hadamard)', lokr: 'LoKr (Kronecker)' },
    default: 'lora',
    onlyMode: 'lora',
    help: 'lora: the attention projections; locon, loha, lokr: the LyCORIS types (A1111 and ComfyUI load them), on the ResNet 3x3 convs too',
    train: (v, s) => (s.mode === 'lora' && v !== 'lora' ? { network: v } : {}),
    bundle: (s) => (s.network === 'lora' ? { option: null, note: 'LoRA' } : noBundle()),
    sdScripts: (s) => {
      const option = lycorisArgs(s);
      return option ? { option } : { option: null, note: 'the same: --network_module=networks.lora' };
    },
  }),
  entry({
    key: 'convRank',
    kind: 'int',
    flag: 'conv-rank',
    label: 'Conv rank (0: the rank)',
    min: 0,
    max: 1024,
    default: 0,
    onlyMode: 'lora',
    help: "rank of the ResNet 3x3 convs' adapters (LyCORIS conv_dim); 0: the LoRA rank",
    showWhen: lycoris,
    activeWhen: lycorisOnly,
    train: (v, s) => (lycoris(s) ? { convRank: v || s.rank } : {}),
    bundle: noBundle,
    sdScripts: inArgs('conv_dim'),
  }),
  entry({
    key: 'convAlpha',
    kind: 'number',
    flag: 'conv-alpha',
    label: 'Conv alpha (0: the conv rank)',
    min: 0,
    max: 100_000,
    default: 0,
    onlyMode: 'lora',
    help: "alpha of the convs' adapters (scale conv alpha / conv rank, LyCORIS conv_alpha); 0: the conv rank, scale 1",
    showWhen: lycoris,
    activeWhen: lycorisOnly,
    train: (v, s) => (lycoris(s) ? { convAlpha: v || s.convRank || s.rank } : {}),
    bundle: noBundle,
    sdScripts: inArgs('conv_alpha'),
  }),
  entry({
    key: 'lokrFactor',
    kind: 'int',
    flag: 'lokr-factor',
    label: 'LoKr factor (-1: square)',
    min: -1,
    max: 1024,
    default: -1,
    onlyMode: 'lora',
    help: 'LoKr: split each width as factor x rest (LyCORIS factor); -1: the split closest to a square',
    showWhen: (s) => s.mode === 'lora' && s.network === 'lokr',
    activeWhen: { test: (s) => s.mode === 'lora' && s.network === 'lokr', why: 'is for --network lokr only: add it, or leave this out' },
    train: (v, s) => (s.mode === 'lora' && s.network === 'lokr' ? { lokrFactor: v } : {}),
    bundle: noBundle,
    sdScripts: (s) =>
      s.mode === 'lora' && s.network === 'lokr'
        ? { option: null, note: 'in --network_args (factor)' }
        : { option: null, note: 'not used: --network lokr only' },
  }),
  entry({
    key: 'dora',
    kind: 'bool',
    flag: 'dora',
    label: 'DoRA (weight-decomposed)',
    default: false,
    onlyMode: 'lora',
    help: "train each adapted layer's weight as a direction W + s·ΔW and a per-input-channel magnitude (LyCORIS dora_wd; A1111 and ComfyUI load its dora_scale)",
    showWhen: lycoris,
    activeWhen: { test: lycoris, why: "is LyCORIS' weight decomposition (dora_wd): add --network locon, loha or lokr, or leave this out" },
    train: (v, s) => (lycoris(s) && v ? { dora: true } : {}),
    bundle: noBundle,
    sdScripts: (s) => (lycoris(s) && s.dora ? { option: null, note: 'in --network_args (dora_wd=True)' } : { option: null, note: 'off' }),
  }),
];

/** A network setting that would do nothing as set, named (the studio's values, which are not flags). */
export function networkProblem(s: RunSettings, name: Namer): { message: string; key: SettingKey } | null {
  if (s.lokrFactor === 0) return { message: `${name('lokrFactor')} must be -1 or a positive whole number, got 0`, key: 'lokrFactor' };
  // A LyCORIS layer runs with W + s·ΔW, written into the frozen weight's own tensor: that tensor must stay f16.
  if (s.mode === 'lora' && s.network !== 'lora' && s.baseWeights === 'int8')
    return {
      message: `${name('baseWeights')} int8 cannot hold the weights ${name('network')} ${s.network} adds its delta to: use ${name('baseWeights')} f16 or auto, or ${name('network')} lora`,
      key: 'baseWeights',
    };
  if (s.mode !== 'lora' || s.network !== 'lora') return null;
  if (s.dora)
    return { message: `${name('dora')} is LyCORIS' weight decomposition: choose ${name('network')} locon, loha or lokr, or turn it off`, key: 'dora' };
  for (const key of ['convRank', 'convAlpha'] as const)
    if (s[key] !== 0)
      return { message: `${name(key)} ${s[key]} sets LyCORIS conv adapters: choose ${name('network')} locon, loha or lokr, or set it to 0`, key };
  return null;
}
