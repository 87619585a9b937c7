// Tensor names between the single-file layout (CompVis/A1111/ComfyUI: model.diffusion_model.*,
// first_stage_model.*, cond_stage_model.*) and diffusers' per-component names. The rules are those of
// diffusers' convert_diffusers_to_original_stable_diffusion script, generalised to any block layout
// (tiny test models included):
//   UNet: down block i, layer j -> input_blocks.{1 + i(L+1) + j}.{0 resnet | 1 attention}; its
//   downsampler -> input_blocks.{(i+1)(L+1)}.0.op; up block i, layer j (L+1 layers) ->
//   output_blocks.{i(L+1) + j}.{0 | 1}; its upsampler -> output_blocks.{i(L+1) + L}.{1 or 2, after an
//   attention}; mid block -> middle_block.{0 resnet, 1 attention, 2 resnet}; resnet parts renamed
//   (in_layers.0 = norm1, in_layers.2 = conv1, emb_layers.1 = time_emb_proj, out_layers.0 = norm2,
//   out_layers.3 = conv2, skip_connection = conv_shortcut). Transformer internals keep their names.
//   VAE: encoder.down.{i}.block.{j} = encoder.down_blocks.{i}.resnets.{j}; decoder.up.{n-1-i} =
//   decoder.up_blocks.{i}; mid.block_{k+1} = mid_block.resnets.{k}; mid.attn_1 = mid_block.attentions.0
//   with q/k/v/proj_out = to_q/to_k/to_v/to_out.0 (1x1 convs [C,C,1,1] in the single file, linears
//   [C,C] in diffusers) and norm = group_norm; nin_shortcut = conv_shortcut.
//   Text encoder: SD1 cond_stage_model.transformer.text_model.* = text_model.*; SD2's OpenCLIP
//   cond_stage_model.model.* is renamed and its fused attn.in_proj_{weight,bias} split into q/k/v.

import { ModelError } from './detect.ts';

export interface UnetLayout {
  /** Number of down (and up) blocks. */
  blocks: number;
  layersPerBlock: number;
  /** Per down block: does it have cross-attention transformers? (SD: [true, true, true, false]) */
  downAttention: boolean[];
  /** Per up block, in diffusers order (SD: [false, true, true, true]). */
  upAttention: boolean[];
}

export const SD_UNET: UnetLayout = { blocks: 4, layersPerBlock: 2, downAttention: [true, true, true, false], upAttention: [false, true, true, true] };

const RESNET_PARTS: [string, string][] = [
  ['in_layers.0.', 'norm1.'],
  ['in_layers.2.', 'conv1.'],
  ['out_layers.0.', 'norm2.'],
  ['out_layers.3.', 'conv2.'],
  ['emb_layers.1.', 'time_emb_proj.'],
  ['skip_connection.', 'conv_shortcut.'],
];

/** Prefix pairs (single file, diffusers) for a UNet layout, most specific first. */
function unetPrefixes(l: UnetLayout): { pairs: [string, string][]; resnets: Set<string> } {
  const pairs: [string, string][] = [
    ['time_embed.0.', 'time_embedding.linear_1.'],
    ['time_embed.2.', 'time_embedding.linear_2.'],
    ['input_blocks.0.0.', 'conv_in.'],
    ['out.0.', 'conv_norm_out.'],
    ['out.2.', 'conv_out.'],
  ];
  const resnets = new Set<string>();
  const L = l.layersPerBlock;
  for (let i = 0; i < l.blocks; i++) {
    for (let j = 0; j < L; j++) {
      const idx = 1 + i * (L + 1) + j;
      pairs.push([`input_blocks.${idx}.0.`, `down_blocks.${i}.resnets.${j}.`]);
      resnets.add(`input_blocks.${idx}.0.`);
      if (l.downAttention[i]) pairs.push([`input_blocks.${idx}.1.`, `down_blocks.${i}.attentions.${j}.`]);
    }
    if (i < l.blocks - 1) pairs.push([`input_blocks.${(i + 1) * (L + 1)}.0.op.`, `down_blocks.${i}.downsamplers.0.conv.`]);
    for (let j = 0; j < L + 1; j++) {
      const idx = i * (L + 1) + j;
      pairs.push([`output_blocks.${idx}.0.`, `up_blocks.${i}.resnets.${j}.`]);
      resnets.add(`output_blocks.${idx}.0.`);
      if (l.upAttention[i]) pairs.push([`output_blocks.${idx}.1.`, `up_blocks.${i}.attentions.${j}.`]);
    }
    if (i < l.blocks - 1) pairs.push([`output_blocks.${i * (L + 1) + L}.${l.upAttention[i] ? 2 : 1}.`, `up_blocks.${i}.upsamplers.0.`]);
  }
  pairs.push(['middle_block.1.', 'mid_block.attentions.0.']);
  for (let j = 0; j < 2; j++) {
    pairs.push([`middle_block.${2 * j}.`, `mid_block.resnets.${j}.`]);
    resnets.add(`middle_block.${2 * j}.`);
  }
  // Longest prefixes first so input_blocks.1.0. never matches input_blocks.10. and the like.
  pairs.sort((a, b) => b[0].length - a[0].length);
  return { pairs, resnets };
}

/** A UNet tensor name (without model.diffusion_model.) in diffusers naming. */
export function unetToDiffusers(name: string, l: UnetLayout = SD_UNET): string {
  const { pairs, resnets } = unetPrefixes(l);
  for (const [orig, diff] of pairs) {
    if (!name.startsWith(orig)) continue;
    let rest = name.slice(orig.length);
    if (resnets.has(orig)) for (const [a, b] of RESNET_PARTS) if (rest.startsWith(a)) rest = b + rest.slice(a.length);
    return diff + rest;
  }
  throw new ModelError(`UNet tensor '${name}' matches no known block of this layout`);
}

/** A diffusers UNet tensor name in single-file naming (without model.diffusion_model.). */
export function unetFromDiffusers(name: string, l: UnetLayout = SD_UNET): string {
  const { pairs, resnets } = unetPrefixes(l);
  const byDiff = [...pairs].sort((a, b) => b[1].length - a[1].length);
  for (const [orig, diff] of byDiff) {
    if (!name.startsWith(diff)) continue;
    let rest = name.slice(diff.length);
    if (resnets.has(orig)) for (const [a, b] of RESNET_PARTS) if (rest.startsWith(b)) rest = a + rest.slice(b.length);
    return orig + rest;
  }
  throw new ModelError(`diffusers UNet tensor '${name}' matches no known block of this layout`);
}

// ---- VAE ----------------------------------------------------------------------------------------

const VAE_ATTN: [string, string][] = [
  ['norm.', 'group_norm.'],
  ['q.', 'to_q.'],
  ['k.', 'to_k.'],
  ['v.', 'to_v.'],
  ['proj_out.', 'to_out.0.'],
];

/** A VAE tensor name (without first_stage_model.) in diffusers naming; `blocks` = number of resolutions. */
export function vaeToDiffusers(name: string, blocks = 4): string {
  let m: RegExpExecArray | null;
  let out = name;
  if ((m = /^encoder\.down\.(\d+)\.block\.(\d+)\.(.*)$/.exec(name))) out = `encoder.down_blocks.${m[1]}.resnets.${m[2]}.${m[3]}`;
  else if ((m = /^encoder\.down\.(\d+)\.downsample\.(.*)$/.exec(name))) out = `encoder.down_blocks.${m[1]}.downsamplers.0.${m[2]}`;
  else if ((m = /^decoder\.up\.(\d+)\.block\.(\d+)\.(.*)$/.exec(name))) out = `decoder.up_blocks.${blocks - 1 - Number(m[1])}.resnets.${m[2]}.${m[3]}`;
  else if ((m = /^decoder\.up\.(\d+)\.upsample\.(.*)$/.exec(name))) out = `decoder.up_blocks.${blocks - 1 - Number(m[1])}.upsamplers.0.${m[2]}`;
  else if ((m = /^(encoder|decoder)\.mid\.block_(\d+)\.(.*)$/.exec(name))) out = `${m[1]}.mid_block.resnets.${Number(m[2]) - 1}.${m[3]}`;
  else if ((m = /^(encoder|decoder)\.mid\.attn_1\.(.*)$/.exec(name))) {
    let rest = m[2];
    for (const [a, b] of VAE_ATTN) if (rest.startsWith(a)) rest = b + rest.slice(a.length);
    out = `${m[1]}.mid_block.attentions.0.${rest}`;
  } else if ((m = /^(encoder|decoder)\.norm_out\.(.*)$/.exec(name))) out = `${m[1]}.conv_norm_out.${m[2]}`;
  return out.replace('.nin_shortcut.', '.conv_shortcut.');
}

/** A diffusers VAE tensor name in single-file naming (without first_stage_model.); inverse of vaeToDiffusers. */
export function vaeFromDiffusers(name: string, blocks = 4): string {
  let m: RegExpExecArray | null;
  let out = name.replace('.conv_shortcut.', '.nin_shortcut.');
  if ((m = /^encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.*)$/.exec(out))) out = `encoder.down.${m[1]}.block.${m[2]}.${m[3]}`;
  else if ((m = /^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.(.*)$/.exec(out))) out = `encoder.down.${m[1]}.downsample.${m[2]}`;
  else if ((m = /^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)$/.exec(out))) out = `decoder.up.${blocks - 1 - Number(m[1])}.block.${m[2]}.${m[3]}`;
  else if ((m = /^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.*)$/.exec(out))) out = `decoder.up.${blocks - 1 - Number(m[1])}.upsample.${m[2]}`;
  else if ((m = /^(encoder|decoder)\.mid_block\.resnets\.(\d+)\.(.*)$/.exec(out))) out = `${m[1]}.mid.block_${Number(m[2]) + 1}.${m[3]}`;
  else if ((m = /^(encoder|decoder)\.mid_block\.attentions\.0\.(.*)$/.exec(out))) {
    let rest = m[2];
    for (const [a, b] of VAE_ATTN) if (rest.startsWith(b)) rest = a + rest.slice(b.length);
    out = `${m[1]}.mid.attn_1.${rest}`;
  } else if ((m = /^(encoder|decoder)\.conv_norm_out\.(.*)$/.exec(out))) out = `${m[1]}.norm_out.${m[2]}`;
  return out;
}

/** True for the VAE attention projections stored as 1x1 convs in the single file (linears in diffusers). */
export function isVaeAttentionProjection(diffusersName: string): boolean {
  return /mid_block\.attentions\.0\.(to_q|to_k|to_v|to_out\.0)\.weight$/.test(diffusersName);
}

// ---- text encoder -----------------------------------------------------------------------------------

/** SD1 (CLIP ViT-L) text-encoder name (without cond_stage_model.transformer.) in diffusers naming. */
export function clipToDiffusers(name: string): string {
  return name.startsWith('text_model.') ? name : `text_model.${name}`;
}

// SD2's OpenCLIP text-encoder names (without cond_stage_model.model.) against diffusers' CLIPTextModel: the
// one table both directions read (loading maps OpenCLIP -> diffusers, the single-file export back).
const OPENCLIP_TOP: readonly (readonly [openClip: string, diffusers: string])[] = [
  ['token_embedding.weight', 'text_model.embeddings.token_embedding.weight'],
  ['positional_embedding', 'text_model.embeddings.position_embedding.weight'],
  ['ln_final.weight', 'text_model.final_layer_norm.weight'],
  ['ln_final.bias', 'text_model.final_layer_norm.bias'],
];
/** Inside block N (transformer.resblocks.N. / text_model.encoder.layers.N.), each with .weight and .bias. */
const OPENCLIP_BLOCK: readonly (readonly [openClip: string, diffusers: string])[] = [
  ['attn.out_proj', 'self_attn.out_proj'],
  ['ln_1', 'layer_norm1'],
  ['ln_2', 'layer_norm2'],
  ['mlp.c_fc', 'mlp.fc1'],
  ['mlp.c_proj', 'mlp.fc2'],
];
/** A block's fused attn.in_proj_weight / _bias: these three, stacked along dim 0 in this order. */
const OPENCLIP_QKV = ['q_proj', 'k_proj', 'v_proj'] as const;

const reverse = (table: readonly (readonly [string, string])[]) => new Map(table.map(([o, d]) => [d, o]));
const OPENCLIP_TOP_TO_DIFFUSERS = new Map(OPENCLIP_TOP);
const OPENCLIP_BLOCK_TO_DIFFUSERS = new Map(OPENCLIP_BLOCK);
const OPENCLIP_TOP_FROM_DIFFUSERS = reverse(OPENCLIP_TOP);
const OPENCLIP_BLOCK_FROM_DIFFUSERS = reverse(OPENCLIP_BLOCK);

export interface OpenClipTarget {
  /** Diffusers name, or for fused q/k/v the three names in q, k, v order. */
  names: string[];
  /** The source tensor is split into names.length equal parts along dim 0. */
  split: boolean;
}

/** SD2 OpenCLIP name (without cond_stage_model.model.) -> diffusers CLIPTextModel names; null = unused. */
export function openClipToDiffusers(name: string): OpenClipTarget | null {
  const one = (n: string): OpenClipTarget => ({ names: [n], split: false });
  const top = OPENCLIP_TOP_TO_DIFFUSERS.get(name);
  if (top) return one(top);
  let m: RegExpExecArray | null;
  if ((m = /^transformer\.resblocks\.(\d+)\.(.*)$/.exec(name))) {
    const p = `text_model.encoder.layers.${m[1]}.`;
    let r: RegExpExecArray | null;
    if ((r = /^attn\.in_proj_(weight|bias)$/.exec(m[2]))) return { names: OPENCLIP_QKV.map((x) => `${p}self_attn.${x}.${r![1]}`), split: true };
    const target = (r = /^(.*)\.(weight|bias)$/.exec(m[2])) && OPENCLIP_BLOCK_TO_DIFFUSERS.get(r[1]);
    if (r && target) return one(`${p}${target}.${r[2]}`);
  }
  if (name === 'text_projection' || name === 'logit_scale') return null; // not part of CLIPTextModel
  throw new ModelError(`OpenCLIP tensor '${name}' is not part of SD2's text encoder`);
}

/**
 * Where a diffusers CLIPTextModel tensor goes in SD2's OpenCLIP naming (the inverse of openClipToDiffusers,
 * from the same table); `part` is q, k or v's place (0, 1, 2) in the fused in_proj tensor.
 */
export function openClipFromDiffusers(name: string): { key: string; part?: 0 | 1 | 2 } {
  const top = OPENCLIP_TOP_FROM_DIFFUSERS.get(name);
  if (top) return { key: top };
  let m: RegExpExecArray | null;
  if ((m = /^text_model\.encoder\.layers\.(\d+)\.(.*)$/.exec(name))) {
    const p = `transformer.resblocks.${m[1]}.`;
    const r = /^(.*)\.(weight|bias)$/.exec(m[2]);
    const qkv = r ? OPENCLIP_QKV.findIndex((x) => r[1] === `self_attn.${x}`) : -1;
    if (r && qkv >= 0) return { key: `${p}attn.in_proj_${r[2]}`, part: qkv as 0 | 1 | 2 };
    const target = r && OPENCLIP_BLOCK_FROM_DIFFUSERS.get(r[1]);
    if (r && target) return { key: `${p}${target}.${r[2]}` };
  }
  throw new ModelError(`text-encoder tensor '${name}' has no place in SD2's OpenCLIP layout`);
}
