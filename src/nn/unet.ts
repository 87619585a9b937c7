// UNet2DConditionModel for SD 1.x / 2.x on the engine, forward, with diffusers tensor names:
// timestep embedding -> MLP; conv_in; down blocks (ResNets with the time embedding, cross-attention
// transformers where the config has them, stride-2 conv downsamplers); mid (ResNet, transformer, ResNet);
// up blocks (each layer concatenates a skip, ResNet, transformer; nearest-2x + conv upsamplers);
// GroupNorm + SiLU + conv_out. Transformer2DModel: GroupNorm, proj_in (1x1 conv, or linear for SD2's
// use_linear_projection), BasicTransformerBlock (LN + self-attention, LN + cross-attention to the text,
// LN + GEGLU feed-forward, each residual), proj_out, residual.
import type { Gpu } from '../gpu/device.ts';
import { ShapeError } from '../gpu/errors.ts';
import type { Tensor } from '../gpu/tensor.ts';
import { flashAttention } from '../ops/attention.ts';
import { activation, add, concatChannels, geglu, timestepEmbedding, transpose2d, upsample2x } from '../ops/elementwise.ts';
import { linear } from '../ops/matmul.ts';
import { groupNorm, layerNorm } from '../ops/norm.ts';
import { conv, normSilu, resnetForward, weight, type Weights } from './blocks.ts';

export interface UnetConfig {
  blockOutChannels: number[];
  layersPerBlock: number;
  /** Attention heads per block (diffusers' attention_head_dim holds head counts for SD1/2). */
  heads: number[];
  crossAttentionDim: number;
  groups: number;
  linearProjection: boolean;
  downAttention: boolean[];
  upAttention: boolean[];
  inChannels: number;
  outChannels: number;
}

export function unetConfigFromJson(j: Record<string, unknown>): UnetConfig {
  const channels = j.block_out_channels as number[];
  if (!Array.isArray(channels)) throw new ShapeError('unetConfig', 'unet config.json has no block_out_channels');
  const headDim = j.attention_head_dim ?? 8;
  const heads = Array.isArray(headDim) ? (headDim as number[]) : channels.map(() => headDim as number);
  const down = (j.down_block_types as string[] | undefined) ?? channels.map((_, i) => (i < channels.length - 1 ? 'CrossAttnDownBlock2D' : 'DownBlock2D'));
  const up = (j.up_block_types as string[] | undefined) ?? channels.map((_, i) => (i === 0 ? 'UpBlock2D' : 'CrossAttnUpBlock2D'));
  return {
    blockOutChannels: channels,
    layersPerBlock: (j.layers_per_block as number) ?? 2,
    heads,
    crossAttentionDim: (j.cross_attention_dim as number) ?? 768,
    groups: (j.norm_num_groups as number) ?? 32,
    linearProjection: !!j.use_linear_projection,
    downAttention: down.map((t) => t.startsWith('CrossAttn')),
    upAttention: up.map((t) => t.startsWith('CrossAttn')),
    inChannels: (j.in_channels as number) ?? 4,
    outChannels: (j.out_channels as number) ?? 4,
  };
}

const RES_EPS = 1e-5;
const TRANSFORMER_NORM_EPS = 1e-6;
const LN_EPS = 1e-5;

function attention(gpu: Gpu, x: Tensor, context: Tensor, w: Weights, p: string, heads: number): Tensor {
  const [b, n, c] = x.shape;
  const m = context.shape[1];
  const dh = c / heads;
  const q = linear(gpu, x, weight(w, `${p}.to_q.weight`)).reshape([b, n, heads, dh]);
  const k = linear(gpu, context, weight(w, `${p}.to_k.weight`)).reshape([b, m, heads, dh]);
  const v = linear(gpu, context, weight(w, `${p}.to_v.weight`)).reshape([b, m, heads, dh]);
  const a = flashAttention(gpu, q, k, v, { layout: 'bnhd' });
  const o = linear(gpu, a.out.reshape([b, n, c]), weight(w, `${p}.to_out.0.weight`), weight(w, `${p}.to_out.0.bias`));
  gpu.free(q, k, v, a.out, a.lse);
  return o;
}

function residual(gpu: Gpu, x: Tensor, delta: Tensor): Tensor {
  const y = add(gpu, x, delta);
  gpu.free(x, delta);
  return y;
}

function ln(gpu: Gpu, x: Tensor, w: Weights, p: string): Tensor {
  const r = layerNorm(gpu, x, weight(w, `${p}.weight`), weight(w, `${p}.bias`), LN_EPS);
  gpu.free(r.mean, r.rstd);
  return r.y;
}

function transformer(gpu: Gpu, x: Tensor, context: Tensor, w: Weights, p: string, heads: number, cfg: UnetConfig): Tensor {
  const [b, c, hh, ww] = x.shape;
  const g = groupNorm(gpu, x, weight(w, `${p}.norm.weight`), weight(w, `${p}.norm.bias`), cfg.groups, TRANSFORMER_NORM_EPS);
  gpu.free(g.mean, g.rstd);
  let h: Tensor;
  if (cfg.linearProjection) {
    const t = transpose2d(gpu, g.y.reshape([b, c, hh * ww]));
    h = linear(gpu, t, weight(w, `${p}.proj_in.weight`), weight(w, `${p}.proj_in.bias`));
    gpu.free(t);
  } else {
    const pc = conv(gpu, g.y, w, `${p}.proj_in`);
    h = transpose2d(gpu, pc.reshape([b, c, hh * ww]));
    gpu.free(pc);
  }
  gpu.free(g.y);
  const tb = `${p}.transformer_blocks.0`;
  let n = ln(gpu, h, w, `${tb}.norm1`);
  h = residual(gpu, h, attention(gpu, n, n, w, `${tb}.attn1`, heads));
  gpu.free(n);
  n = ln(gpu, h, w, `${tb}.norm2`);
  h = residual(gpu, h, attention(gpu, n, context, w, `${tb}.attn2`, heads));
  gpu.free(n);
  n = ln(gpu, h, w, `${tb}.norm3`);
  const proj = linear(gpu, n, weight(w, `${tb}.ff.net.0.proj.weight`), weight(w, `${tb}.ff.net.0.proj.bias`));
  const gg = geglu(gpu, proj);
  const ff = linear(gpu, gg, weight(w, `${tb}.ff.net.2.weight`), weight(w, `${tb}.ff.net.2.bias`));
  gpu.free(n, proj, gg);
  h = residual(gpu, h, ff);
  let out: Tensor;
  if (cfg.linearProjection) {
    const po = linear(gpu, h, weight(w, `${p}.proj_out.weight`), weight(w, `${p}.proj_out.bias`));
    out = transpose2d(gpu, po).reshape([b, c, hh, ww]);
    gpu.free(po);
  } else {
    const t = transpose2d(gpu, h).reshape([b, c, hh, ww]);
    out = conv(gpu, t, w, `${p}.proj_out`);
    gpu.free(t);
  }
  gpu.free(h);
  const y = add(gpu, out, x);
  gpu.free(out);
  return y;
}

/** noise (or v) prediction [B, out, h, w] for sample [B, in, h, w], timesteps [B] (f32), context [B, L, D]. */
export function unetForward(gpu: Gpu, cfg: UnetConfig, w: Weights, sample: Tensor, timesteps: Tensor, context: Tensor): Tensor {
  const B = sample.shape[0];
  if (sample.shape.length !== 4 || sample.shape[1] !== cfg.inChannels) throw new ShapeError('unet', `sample must be [B,${cfg.inChannels},h,w], got [${sample.shape}]`);
  if (context.shape.length !== 3 || context.shape[0] !== B || context.shape[2] !== cfg.crossAttentionDim)
    throw new ShapeError('unet', `encoder_hidden_states must be [${B},L,${cfg.crossAttentionDim}], got [${context.shape}]`);
  if (timesteps.numel !== B) throw new ShapeError('unet', `timesteps must be [${B}], got [${timesteps.shape}]`);
  const f = 2 ** (cfg.blockOutChannels.length - 1);
  if (sample.shape[2] % f || sample.shape[3] % f) throw new ShapeError('unet', `latent size ${sample.shape[2]}x${sample.shape[3]} must be a multiple of ${f}`);
  // Time embedding: sinusoidal (flip_sin_to_cos, shift 0) -> linear -> SiLU -> linear; ResNets take SiLU of it.
  const tEmb = timestepEmbedding(gpu, timesteps, cfg.blockOutChannels[0], sample.dtype);
  const l1 = linear(gpu, tEmb, weight(w, 'time_embedding.linear_1.weight'), weight(w, 'time_embedding.linear_1.bias'));
  const s1 = activation(gpu, 'silu', l1);
  const emb = linear(gpu, s1, weight(w, 'time_embedding.linear_2.weight'), weight(w, 'time_embedding.linear_2.bias'));
  const embAct = activation(gpu, 'silu', emb);
  gpu.free(tEmb, l1, s1, emb);
  const resnet = (x: Tensor, p: string) => {
    const tp = linear(gpu, embAct, weight(w, `${p}.time_emb_proj.weight`), weight(w, `${p}.time_emb_proj.bias`));
    const y = resnetForward(gpu, x, w, p, cfg.groups, RES_EPS, tp);
    gpu.free(tp);
    return y;
  };
  let x = conv(gpu, sample, w, 'conv_in');
  const skips: Tensor[] = [x];
  const blocks = cfg.blockOutChannels.length;
  for (let i = 0; i < blocks; i++) {
    for (let j = 0; j < cfg.layersPerBlock; j++) {
      x = resnet(x, `down_blocks.${i}.resnets.${j}`);
      if (cfg.downAttention[i]) {
        const y = transformer(gpu, x, context, w, `down_blocks.${i}.attentions.${j}`, cfg.heads[i], cfg);
        gpu.free(x);
        x = y;
      }
      skips.push(x);
    }
    if (i < blocks - 1) {
      x = conv(gpu, x, w, `down_blocks.${i}.downsamplers.0.conv`, 2, 1);
      skips.push(x);
    }
  }
  let m = resnet(x, 'mid_block.resnets.0');
  const mt = transformer(gpu, m, context, w, 'mid_block.attentions.0', cfg.heads[blocks - 1], cfg);
  gpu.free(m);
  m = resnet(mt, 'mid_block.resnets.1');
  gpu.free(mt);
  x = m;
  for (let i = 0; i < blocks; i++) {
    const headIdx = blocks - 1 - i;
    for (let j = 0; j < cfg.layersPerBlock + 1; j++) {
      const skip = skips.pop()!;
      const cat = concatChannels(gpu, x, skip);
      gpu.free(x, skip);
      x = resnet(cat, `up_blocks.${i}.resnets.${j}`);
      gpu.free(cat);
      if (cfg.upAttention[i]) {
        const y = transformer(gpu, x, context, w, `up_blocks.${i}.attentions.${j}`, cfg.heads[headIdx], cfg);
        gpu.free(x);
        x = y;
      }
    }
    if (i < blocks - 1) {
      const up = upsample2x(gpu, x);
      gpu.free(x);
      x = conv(gpu, up, w, `up_blocks.${i}.upsamplers.0.conv`);
      gpu.free(up);
    }
  }
  const a = normSilu(gpu, x, w, 'conv_norm_out', cfg.groups, RES_EPS);
  gpu.free(x, embAct);
  const out = conv(gpu, a, w, 'conv_out');
  gpu.free(a);
  return out;
}
