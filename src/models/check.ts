// What the loader checks before it reads a single weight, shared with `inspect` so that both say the
// same thing about a model:
//   - a single file at widths other than SD's names the config values its shapes cannot tell;
//   - each config field the engine reads has the right type, naming the field and where its value came
//     from (unet/config.json, the --config override, or the single file's inferred config);
//   - settings the engine does not implement are refused by name (diffusers would build another model
//     from them, and the engine would silently compute SD's);
//   - sizes fit together: heads divide widths and their head dims fit the attention kernel, norm groups
//     divide every normalised width, the UNet's text width is the text encoder's; before this check a
//     bad config failed deep in a kernel ("uniform u32 out of range: 0.5");
//   - every tensor the configs call for is present with its shape, and nothing else is there.
// Messages here carry no model name: the loader prefixes it, inspect lists them as they are.
import { clipConfigFromJson, type ClipTextConfig } from '../nn/clip.ts';
import { unetConfigFromJson, type UnetConfig } from '../nn/unet.ts';
import { vaeConfigFromJson, type VaeConfig } from '../nn/vae.ts';
import { MAX_HEAD_DIM } from '../ops/attention.ts';
import { ModelError, type Component } from './detect.ts';
import { clipParams, unetParams, vaeParams, type ParamShapes } from './shapes.ts';
import { COMPONENTS, type Json, type ModelSource } from './source.ts';

export interface ModelConfigs {
  unet: UnetConfig;
  vae: VaeConfig;
  textEncoder: ClipTextConfig;
}

/** Tokens per prompt in SD (bos, 75, eos): the text encoder needs as many positions. */
const PROMPT_TOKENS = 77;

// ---- config fields ------------------------------------------------------------------------------------

interface Field {
  key: string;
  /** What a valid value is, for the message. */
  expect: string;
  ok(v: unknown): boolean;
  /** No default: diffusers/transformers have none either, or SD's cannot be assumed. */
  required?: boolean;
}

const positiveInt = (v: unknown) => Number.isInteger(v) && (v as number) > 0;
const positiveInts = (v: unknown) => Array.isArray(v) && v.length > 0 && v.every(positiveInt);
const positive = (v: unknown) => typeof v === 'number' && Number.isFinite(v) && v > 0;
const oneOf =
  (...names: string[]) =>
  (v: unknown) =>
    Array.isArray(v) && v.length > 0 && v.every((t) => names.includes(t as string));
const INT = 'a positive integer';

const UNET_FIELDS: Field[] = [
  { key: 'block_out_channels', expect: 'a list of positive integers, one width per block', ok: positiveInts, required: true },
  { key: 'layers_per_block', expect: `${INT} (one count for every block)`, ok: positiveInt },
  {
    key: 'attention_head_dim',
    expect: `${INT} or a list of them, one per block (diffusers' name for SD's head counts)`,
    ok: (v) => positiveInt(v) || positiveInts(v),
  },
  { key: 'cross_attention_dim', expect: `${INT} (the text encoder's width)`, ok: positiveInt },
  { key: 'norm_num_groups', expect: INT, ok: positiveInt },
  // diffusers tests it for truth, so null reads as false there and here.
  { key: 'use_linear_projection', expect: 'true or false', ok: (v) => v === null || typeof v === 'boolean' },
  { key: 'in_channels', expect: INT, ok: positiveInt },
  { key: 'out_channels', expect: INT, ok: positiveInt },
  { key: 'down_block_types', expect: "a list of 'CrossAttnDownBlock2D' or 'DownBlock2D', one per block", ok: oneOf('CrossAttnDownBlock2D', 'DownBlock2D') },
  { key: 'up_block_types', expect: "a list of 'CrossAttnUpBlock2D' or 'UpBlock2D', one per block", ok: oneOf('CrossAttnUpBlock2D', 'UpBlock2D') },
];

const VAE_FIELDS: Field[] = [
  { key: 'block_out_channels', expect: 'a list of positive integers, one width per block', ok: positiveInts, required: true },
  { key: 'layers_per_block', expect: INT, ok: positiveInt },
  { key: 'norm_num_groups', expect: INT, ok: positiveInt },
  { key: 'latent_channels', expect: INT, ok: positiveInt },
  { key: 'scaling_factor', expect: 'a positive number', ok: positive },
  { key: 'down_block_types', expect: "a list of 'DownEncoderBlock2D', one per block", ok: oneOf('DownEncoderBlock2D') },
  { key: 'up_block_types', expect: "a list of 'UpDecoderBlock2D', one per block", ok: oneOf('UpDecoderBlock2D') },
];

const CLIP_FIELDS: Field[] = [
  ...['vocab_size', 'hidden_size', 'num_hidden_layers', 'num_attention_heads', 'intermediate_size', 'max_position_embeddings'].map((key) => ({
    key,
    expect: INT,
    ok: positiveInt,
    required: true,
  })),
  // transformers' CLIPTextConfig defaults to quick_gelu; anything else would be computed as quick_gelu.
  { key: 'hidden_act', expect: "'quick_gelu' (SD1's CLIP) or 'gelu' (SD2's OpenCLIP)", ok: (v) => v === 'quick_gelu' || v === 'gelu' },
  { key: 'layer_norm_eps', expect: 'a positive number', ok: positive },
];

/**
 * Settings whose every other value builds a model the engine does not compute; absent means diffusers'
 * default, which is the value listed first.
 */
const allFalse = (v: unknown) => v === false || (Array.isArray(v) && v.every((x) => x === false));
const allOnes = (v: unknown) => v === 1 || (Array.isArray(v) && v.every((x) => x === 1));
const FIXED: Record<Component, [key: string, supported: unknown[] | ((v: unknown) => boolean), what: string][]> = {
  unet: [
    ['act_fn', ['silu'], '"silu"'],
    ['flip_sin_to_cos', [true], 'true'],
    ['freq_shift', [0], '0'],
    ['time_embedding_type', ['positional'], '"positional"'],
    ['resnet_time_scale_shift', ['default'], '"default"'],
    ['norm_eps', [1e-5], '1e-5'],
    ['center_input_sample', [false], 'false'],
    ['downsample_padding', [1], '1'],
    ['mid_block_scale_factor', [1], '1'],
    ['mid_block_type', ['UNetMidBlock2DCrossAttn'], '"UNetMidBlock2DCrossAttn"'],
    ['conv_in_kernel', [3], '3'],
    ['conv_out_kernel', [3], '3'],
    ['transformer_layers_per_block', allOnes, '1 (one transformer block per attention)'],
    ['only_cross_attention', allFalse, 'false'],
    ['dual_cross_attention', [false], 'false'],
    ['attention_type', ['default'], '"default"'],
    ['resnet_skip_time_act', [false], 'false'],
    ['resnet_out_scale_factor', [1], '1'],
    // diffusers itself refuses num_attention_heads for this class: head counts go in attention_head_dim.
    ['num_attention_heads', [null], 'null (SD head counts go in attention_head_dim)'],
    ...[
      'class_embed_type',
      'num_class_embeds',
      'addition_embed_type',
      'encoder_hid_dim',
      'time_cond_proj_dim',
      'time_embedding_dim',
      'time_embedding_act_fn',
      'timestep_post_act',
      'cross_attention_norm',
    ].map((k): [string, unknown[], string] => [k, [null], 'null']),
  ],
  vae: [
    ['act_fn', ['silu'], '"silu"'],
    ['in_channels', [3], '3'],
    ['out_channels', [3], '3'],
    ['shift_factor', [null, 0], 'null'],
    ['latents_mean', [null], 'null'],
    ['latents_std', [null], 'null'],
    ['use_quant_conv', [true], 'true'],
    ['use_post_quant_conv', [true], 'true'],
    ['mid_block_add_attention', [true], 'true'],
  ],
  text_encoder: [],
};

function show(v: unknown): string {
  const s = JSON.stringify(v) ?? String(v);
  return s.length > 60 ? `${s.slice(0, 57)}...` : s;
}

/** Type and value problems of one component's config.json fields, each naming the field and its origin. */
function fieldProblems(json: Json, fields: Field[], fixed: (typeof FIXED)[Component], origin: (field: string) => string): string[] {
  const out: string[] = [];
  for (const f of fields) {
    const v = json[f.key];
    if (v === undefined) {
      if (f.required) out.push(`${origin(f.key)}: ${f.key} is missing: expected ${f.expect}`);
    } else if (!f.ok(v)) out.push(`${origin(f.key)}: ${f.key} is ${v === null ? 'null' : show(v)}: expected ${f.expect}`);
  }
  for (const [key, supported, what] of fixed) {
    const v = json[key];
    if (v === undefined) continue;
    const ok = typeof supported === 'function' ? supported(v) : supported.includes(v);
    if (!ok) out.push(`${origin(key)}: ${key} is ${show(v)}: the engine implements SD 1.x/2.x's ${what} only`);
  }
  return out;
}

// ---- sizes that must fit together ---------------------------------------------------------------------

/** The GroupNorm widths of a component (resnet norms, attention norms, the output norm), by parameter name. */
function groupNormWidths(params: ParamShapes): [string, number][] {
  const re = /(resnets\.\d+\.norm[12]|attentions\.\d+\.norm|attentions\.\d+\.group_norm|conv_norm_out)\.weight$/;
  return [...params].filter(([n]) => re.test(n)).map(([n, s]) => [n.slice(0, -'.weight'.length), s[0]]);
}

function groupsProblem(c: Component, groups: number, params: ParamShapes, from: string): string | null {
  const bad = groupNormWidths(params).find(([, w]) => w % groups !== 0);
  return bad
    ? `${c}: norm_num_groups ${groups} does not divide the ${bad[1]} channels of ${bad[0]} (${from}): fix the config or pass --config with the model's ${c} config`
    : null;
}

function headsProblem(c: Component, what: string, width: number, heads: number, field: string, from: string): string | null {
  if (width % heads !== 0)
    return `${c}: ${what} ${width} is not divisible by ${field} ${heads} (${from}): fix the config or pass --config with the model's ${c} config`;
  if (width / heads > MAX_HEAD_DIM)
    return `${c}: ${what} ${width} over ${field} ${heads} makes ${width / heads}-wide heads; the engine's attention takes at most ${MAX_HEAD_DIM} (${from})`;
  return null;
}

function unetSizeProblems(c: UnetConfig, from: (...fields: string[]) => string): string[] {
  const blocks = c.blockOutChannels.length;
  const out: string[] = [];
  for (const [field, n] of [
    ['attention_head_dim', c.heads.length],
    ['down_block_types', c.downAttention.length],
    ['up_block_types', c.upAttention.length],
  ] as const)
    if (n !== blocks) out.push(`unet: ${field} has ${n} entries but block_out_channels has ${blocks} (${from(field, 'block_out_channels')})`);
  if (out.length) return out;
  // Block i's transformers (down i, up blocks-1-i, the mid block for the last) use heads[i].
  for (let i = 0; i < blocks; i++) {
    if (!c.downAttention[i] && !c.upAttention[blocks - 1 - i] && i !== blocks - 1) continue;
    const p = headsProblem(
      'unet',
      `block_out_channels[${i}]`,
      c.blockOutChannels[i],
      c.heads[i],
      `attention_head_dim[${i}]`,
      from('block_out_channels', 'attention_head_dim'),
    );
    if (p) out.push(p);
  }
  const g = groupsProblem('unet', c.groups, unetParams(c), from('norm_num_groups', 'block_out_channels'));
  if (g) out.push(g);
  return out;
}

function clipSizeProblems(c: ClipTextConfig, from: (...fields: string[]) => string): string[] {
  const out: string[] = [];
  const h = headsProblem('text_encoder', 'hidden_size', c.hiddenSize, c.heads, 'num_attention_heads', from('hidden_size', 'num_attention_heads'));
  if (h) out.push(h);
  if (c.maxPositions < PROMPT_TOKENS)
    out.push(
      `text_encoder: max_position_embeddings ${c.maxPositions} is fewer than the ${PROMPT_TOKENS} tokens of an SD prompt (${from('max_position_embeddings')})`,
    );
  return out;
}

// ---- tensors ------------------------------------------------------------------------------------------

export interface TensorMismatch {
  missing: string[];
  misshaped: { name: string; got: readonly number[]; want: readonly number[] }[];
  /** Present but not called for by the config. */
  unused: string[];
}

/** The component's tensors against the parameters its config calls for, in the config's order. */
export function compareTensors(expected: ParamShapes, actual: Map<string, readonly number[]>): TensorMismatch {
  const m: TensorMismatch = { missing: [], misshaped: [], unused: [] };
  for (const [name, want] of expected) {
    const got = actual.get(name);
    if (!got) m.missing.push(name);
    else if (got.length !== want.length || got.some((d, i) => d !== want[i])) m.misshaped.push({ name, got, want });
  }
  m.unused = [...actual.keys()].filter((n) => !expected.has(n));
  return m;
}

function misshapedText(label: string, t: TensorMismatch['misshaped'][number]): string {
  return `${label} tensor ${t.name} is [${t.got}] but its config needs [${t.want}]`;
}

/** The loader's one-line summary of a mismatch (the first misshaped tensor, else the missing, else the unused ones), or null. */
export function mismatchSummary(label: string, m: TensorMismatch): string | null {
  if (m.misshaped.length) return misshapedText(label, m.misshaped[0]);
  if (m.missing.length) return `${label} is missing ${m.missing.length} tensor(s), e.g. ${m.missing.slice(0, 3).join(', ')}`;
  if (m.unused.length) return `${label} has ${m.unused.length} tensor(s) its config does not use, e.g. ${m.unused.slice(0, 3).join(', ')}`;
  return null;
}

/** Most lines per kind and component that inspect lists; a UNet-only file would otherwise list every VAE tensor. */
export const LISTED_PER_KIND = 20;

/** Every missing, misshaped and unused tensor, one line each (at most LISTED_PER_KIND of a kind, then a count). */
function mismatchLines(label: string, m: TensorMismatch): string[] {
  const out: string[] = [];
  const list = <T>(items: T[], line: (t: T) => string, kind: string) => {
    out.push(...items.slice(0, LISTED_PER_KIND).map(line));
    if (items.length > LISTED_PER_KIND) out.push(`...and ${items.length - LISTED_PER_KIND} more ${label} tensors ${kind} (${items.length} in all)`);
  };
  list(m.misshaped, (t) => misshapedText(label, t), 'misshaped');
  list(m.missing, (n) => `${label} tensor ${n} is missing`, 'missing');
  list(m.unused, (n) => `${label} tensor ${n} is not used by its config`, 'unused');
  return out;
}

// ---- the whole model ----------------------------------------------------------------------------------

/** The text encoder is 'text encoder' in tensor messages, as it always was. */
const TENSOR_LABEL: Record<Component, string> = { unet: 'unet', vae: 'vae', text_encoder: 'text encoder' };

export interface ModelCheck {
  /** Configs of the components whose config is sound (all three when `problems` is empty). */
  configs: Partial<ModelConfigs>;
  /** Config problems, in the order the loader meets them. */
  problems: string[];
  /** Per component with a sound config: its tensors against it. */
  tensors: Partial<Record<Component, TensorMismatch>>;
}

function uninferredProblem(src: ModelSource): string | null {
  const u = src.uninferred ?? {};
  const cs = COMPONENTS.filter((c) => u[c]?.fields.length);
  if (!cs.length) return null;
  const parts = cs.map((c) => `${c} (${u[c]!.widths}) needs ${u[c]!.fields.join(', ')}`);
  const example = JSON.stringify(Object.fromEntries(cs.map((c) => [c, Object.fromEntries(u[c]!.fields.map((f) => [f, '...']))])));
  return `a single file holds no configs, and at widths other than SD's these values cannot be inferred from the tensor shapes: ${parts.join('; ')}: pass --config with the model's configs, e.g. ${example}`;
}

/**
 * Everything the loader checks before reading a weight, for every component. The loader stops at the
 * first problem (checkModel); inspect lists them all (modelProblems).
 */
export function analyseModel(src: ModelSource): ModelCheck {
  const origin = (c: Component) => (field: string) => src.configOrigin?.(c, field) ?? `the ${c} config`;
  const from =
    (c: Component) =>
    (...fields: string[]) =>
      [...new Set(fields.map(origin(c)))].join(' and ');
  const out: ModelCheck = { configs: {}, problems: [], tensors: {} };
  const uninferred = uninferredProblem(src);
  if (uninferred) out.problems.push(uninferred);
  const skip = (c: Component) => !!src.uninferred?.[c]?.fields.length;

  const parse = <T>(c: Component, fields: Field[], build: (j: Json) => T, sizes: (cfg: T) => string[]): T | undefined => {
    if (skip(c)) return undefined;
    const fp = fieldProblems(src.configs[c], fields, FIXED[c], origin(c));
    if (fp.length) {
      out.problems.push(...fp);
      return undefined;
    }
    const cfg = build(src.configs[c]);
    const sp = sizes(cfg);
    out.problems.push(...sp);
    return sp.length ? undefined : cfg;
  };
  const unet = parse('unet', UNET_FIELDS, unetConfigFromJson, (c) => unetSizeProblems(c, from('unet')));
  const vae = parse('vae', VAE_FIELDS, vaeConfigFromJson, (c) => {
    const g = groupsProblem('vae', c.groups, vaeParams(c), from('vae')('norm_num_groups', 'block_out_channels'));
    return g ? [g] : [];
  });
  const te = parse('text_encoder', CLIP_FIELDS, clipConfigFromJson, (c) => clipSizeProblems(c, from('text_encoder')));
  if (unet && te && unet.crossAttentionDim !== te.hiddenSize)
    out.problems.push(
      `the UNet expects ${unet.crossAttentionDim}-wide text embeddings (unet cross_attention_dim) but the text encoder is ${te.hiddenSize} wide (text_encoder hidden_size): mixed or corrupt model`,
    );
  if (unet) out.configs.unet = unet;
  if (vae) out.configs.vae = vae;
  if (te) out.configs.textEncoder = te;
  const expected: [Component, (() => ParamShapes) | null][] = [
    ['unet', unet ? () => unetParams(unet) : null],
    ['vae', vae ? () => vaeParams(vae) : null],
    ['text_encoder', te ? () => clipParams(te) : null],
  ];
  for (const [c, params] of expected) if (params) out.tensors[c] = compareTensors(params(), src.shapes(c));
  return out;
}

/**
 * The configs to build the modules from, after every check the loader makes (nothing is read or
 * uploaded yet); the first problem is a ModelError naming the model, the component, the field or tensor.
 */
export function checkModel(src: ModelSource): ModelConfigs {
  const a = analyseModel(src);
  if (a.problems.length) throw new ModelError(`${src.name}: ${a.problems[0]}`);
  for (const c of COMPONENTS) {
    const summary = mismatchSummary(TENSOR_LABEL[c], a.tensors[c]!);
    if (summary) throw new ModelError(`${src.name}: ${summary}`);
  }
  return a.configs as ModelConfigs;
}

/** Every problem checkModel would stop at, one line each: config problems, then each bad tensor. */
export function modelProblems(src: ModelSource): string[] {
  const a = analyseModel(src);
  return [...a.problems, ...COMPONENTS.flatMap((c) => (a.tensors[c] ? mismatchLines(TENSOR_LABEL[c], a.tensors[c]!) : []))];
}
