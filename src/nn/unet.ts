// UNet2DConditionModel for SD 1.x / 2.x and SDXL on the engine, forward, with diffusers tensor names:
// timestep embedding -> MLP; conv_in; down blocks (ResNets with the time embedding, cross-attention
// transformers where the config has them, stride-2 conv downsamplers); mid (ResNet, transformer, ResNet);
// up blocks (each layer concatenates a skip, ResNet, transformer; nearest-2x + conv upsamplers);
// GroupNorm + SiLU + conv_out. Transformer2DModel: GroupNorm, proj_in (1x1 conv, or linear for SD2's
// use_linear_projection), BasicTransformerBlock (LN + self-attention, LN + cross-attention to the text,
// LN + GEGLU feed-forward, each residual), proj_out, residual.
// SDXL adds several BasicTransformerBlocks per transformer (transformerLayers) and the text_time embedding.
import type { Gpu } from '../gpu/device.ts';
import { ShapeError } from '../gpu/errors.ts';
import { Tensor } from '../gpu/tensor.ts';
import { timestepEmbedding } from '../ops/elementwise.ts';
import { isInt8 } from '../ops/int8.ts';
import { conv, normSilu, resnetForward, weight, type Weights } from './blocks.ts';
import { loraLinear, loraLinearGroup } from './lora.ts';
import { Ops, type Tape } from './ops.ts';

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
  /**
   * Transformer blocks in each attention of down block i (SDXL base: [1, 2, 10]); the up blocks take them
   * reversed and the mid block the last, as diffusers does. Absent: one everywhere (SD 1.x/2.x).
   */
  transformerLayers?: number[];
  /**
   * SDXL's addition_embed_type 'text_time': the 6 time ids (original size, crop top-left, target size) each
   * get a sinusoidal embedding of `timeEmbedDim` (addition_time_embed_dim, 256), concatenated after the pooled
   * text embedding into `projectionInputDim` (projection_class_embeddings_input_dim, 2816 = 1280 + 6 * 256),
   * then add_embedding (linear, SiLU, linear) is added to the time embedding. Absent for SD 1.x/2.x.
   */
  textTime?: { timeEmbedDim: number; projectionInputDim: number };
}

/** Number of SDXL time ids per sample: original (h, w), crop top-left (top, left), target (h, w). */
export const TIME_IDS = 6;

/** SDXL's extra UNet inputs (addition_embed_type 'text_time'). */
export interface UnetAddedCond {
  /** Pooled, projected output of text encoder 2 [B, projectionInputDim - 6 * timeEmbedDim]. */
  textEmbeds: Tensor;
  /** f32 [B, 6]: original height, width, crop top, left, target height, width. */
  timeIds: Tensor;
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
    ...textTimeFromJson(j, channels.length),
  };
}

/** The SDXL fields of a unet config.json (transformer_layers_per_block, addition_embed_type 'text_time'). */
function textTimeFromJson(j: Record<string, unknown>, blocks: number): Pick<UnetConfig, 'transformerLayers' | 'textTime'> {
  const out: Pick<UnetConfig, 'transformerLayers' | 'textTime'> = {};
  const t = j.transformer_layers_per_block;
  if (Array.isArray(t)) out.transformerLayers = t as number[];
  else if (typeof t === 'number' && t !== 1) out.transformerLayers = Array.from({ length: blocks }, () => t);
  if (j.addition_embed_type === 'text_time')
    out.textTime = { timeEmbedDim: j.addition_time_embed_dim as number, projectionInputDim: j.projection_class_embeddings_input_dim as number };
  return out;
}

/** Transformer blocks per attention: down block i, up block i (diffusers order), mid. */
export function transformerDepth(cfg: UnetConfig, where: 'down' | 'up' | 'mid', i = 0): number {
  const t = cfg.transformerLayers;
  if (!t) return 1;
  if (where === 'mid') return t[t.length - 1];
  return where === 'down' ? t[i] : t[t.length - 1 - i];
}

const RES_EPS = 1e-5;
const TRANSFORMER_NORM_EPS = 1e-6;
const LN_EPS = 1e-5;

function attention(F: Ops, x: Tensor, context: Tensor, w: Weights, p: string, heads: number, loraScale: number): Tensor {
  const [b, n, c] = x.shape;
  const m = context.shape[1];
  const dh = c / heads;
  // Projections [b, tokens, c] are viewed as [b, tokens, heads, dh]; the owning tensors are released. Self-attention's
  // q, k, v (cross-attention's k, v) are one GEMM where their frozen weights lie end to end (loraLinearGroup).
  const self = x === context;
  const group = loraLinearGroup(
    F,
    context,
    w,
    (self ? ['to_q', 'to_k', 'to_v'] : ['to_k', 'to_v']).map((l) => `${p}.${l}`),
    loraScale,
  );
  const q = self && group ? group.ys[0] : loraLinear(F, x, w, `${p}.to_q`, loraScale);
  const k = group ? group.ys[self ? 1 : 0] : loraLinear(F, context, w, `${p}.to_k`, loraScale);
  const v = group ? group.ys[self ? 2 : 1] : loraLinear(F, context, w, `${p}.to_v`, loraScale);
  const a = F.attention(F.reshape(q, [b, n, heads, dh]), F.reshape(k, [b, m, heads, dh]), F.reshape(v, [b, m, heads, dh]), { layout: 'bnhd' });
  const o = loraLinear(F, F.reshape(a, [b, n, c]), w, `${p}.to_out.0`, loraScale, true);
  F.release(q, k, v, a, group?.owner);
  return o;
}

function residual(F: Ops, x: Tensor, delta: Tensor): Tensor {
  const y = F.add(x, delta);
  F.release(x, delta);
  return y;
}

function ln(F: Ops, x: Tensor, w: Weights, p: string): Tensor {
  return F.layerNorm(x, weight(w, `${p}.weight`), weight(w, `${p}.bias`), LN_EPS);
}

/** BasicTransformerBlock on tokens h [b, n, c]: LN + self-attention, LN + cross-attention, LN + GEGLU, each residual. */
function basicTransformerBlock(F: Ops, h: Tensor, context: Tensor, w: Weights, tb: string, heads: number, loraScale: number): Tensor {
  let n = ln(F, h, w, `${tb}.norm1`);
  h = residual(F, h, attention(F, n, n, w, `${tb}.attn1`, heads, loraScale));
  F.release(n);
  n = ln(F, h, w, `${tb}.norm2`);
  h = residual(F, h, attention(F, n, context, w, `${tb}.attn2`, heads, loraScale));
  F.release(n);
  n = ln(F, h, w, `${tb}.norm3`);
  const proj = F.linear(n, weight(w, `${tb}.ff.net.0.proj.weight`), weight(w, `${tb}.ff.net.0.proj.bias`));
  const gg = F.geglu(proj);
  const ff = F.linear(gg, weight(w, `${tb}.ff.net.2.weight`), weight(w, `${tb}.ff.net.2.bias`));
  F.release(n, proj, gg);
  return residual(F, h, ff);
}

/**
 * Whether a transformer's proj_in or proj_out can run as Ops.project: weight and bias frozen (a trained one's dW
 * would sum over samples in another order), not int8, no adapter factors under its name (LyCORIS).
 */
function projectable(F: Ops, w: Weights, layer: string): boolean {
  const wt = weight(w, `${layer}.weight`);
  const b = w.get(`${layer}.bias`);
  if (!F.frozen(wt) || (b && !F.frozen(b)) || isInt8(wt)) return false;
  for (const name of w.keys()) if (name.startsWith(`${layer}.`) && name !== `${layer}.weight` && name !== `${layer}.bias`) return false;
  return true;
}

function transformer(F: Ops, x: Tensor, context: Tensor, w: Weights, p: string, heads: number, cfg: UnetConfig, loraScale: number, depth = 1): Tensor {
  const [b, c, hh, ww] = x.shape;
  const g = F.groupNorm(x, weight(w, `${p}.norm.weight`), weight(w, `${p}.norm.bias`), cfg.groups, TRANSFORMER_NORM_EPS);
  // A frozen projection reads or writes its operand transposed (Ops.project): no layout pass either way.
  const [pin, pout] = [`${p}.proj_in`, `${p}.proj_out`];
  let h: Tensor;
  if (projectable(F, w, pin)) h = F.project(g, weight(w, `${pin}.weight`), w.get(`${pin}.bias`) ?? null, 'tokens');
  else if (cfg.linearProjection) {
    const t = F.transpose(F.reshape(g, [b, c, hh * ww]));
    h = F.linear(t, weight(w, `${p}.proj_in.weight`), weight(w, `${p}.proj_in.bias`));
    F.release(t);
  } else {
    const pc = conv(F, g, w, `${p}.proj_in`);
    h = F.transpose(F.reshape(pc, [b, c, hh * ww]));
    F.release(pc);
  }
  F.release(g);
  for (let d = 0; d < depth; d++) h = basicTransformerBlock(F, h, context, w, `${p}.transformer_blocks.${d}`, heads, loraScale);
  // Back to channel-first [b, c, h, w] (the transposed buffer is released, not its reshape view).
  let out: Tensor;
  if (projectable(F, w, pout)) out = F.project(h, weight(w, `${pout}.weight`), w.get(`${pout}.bias`) ?? null, 'channels');
  else if (cfg.linearProjection) {
    const po = F.linear(h, weight(w, `${p}.proj_out.weight`), weight(w, `${p}.proj_out.bias`));
    out = F.transpose(po);
    F.release(po);
  } else {
    const ht = F.transpose(h);
    out = conv(F, F.reshape(ht, [b, c, hh, ww]), w, `${p}.proj_out`);
    F.release(ht);
  }
  F.release(h);
  const y = F.add(F.reshape(out, [b, c, hh, ww]), x);
  F.release(out);
  return y;
}

/**
 * SDXL's add_embedding(concat(text_embeds, sinusoid(time_ids))) [B, temb]: each of the 6 time ids gets
 * diffusers' Timesteps(addition_time_embed_dim, flip_sin_to_cos, shift 0) embedding (cos half first), the
 * 6 rows of a sample laid end to end after its pooled text embedding; then linear_1, SiLU, linear_2.
 * The time ids are plain numbers (no gradient); the gradient reaches text_embeds (text-encoder training).
 */
function textTimeEmbedding(F: Ops, cfg: UnetConfig, w: Weights, B: number, added: UnetAddedCond | null): Tensor {
  const tt = cfg.textTime!;
  if (!added) throw new ShapeError('unet', 'this UNet (SDXL, addition_embed_type text_time) needs text_embeds and time_ids');
  const { textEmbeds, timeIds } = added;
  const pooled = tt.projectionInputDim - TIME_IDS * tt.timeEmbedDim;
  if (timeIds.numel !== B * TIME_IDS || timeIds.shape[timeIds.shape.length - 1] !== TIME_IDS)
    throw new ShapeError('unet', `time_ids must be [${B},${TIME_IDS}] (original h, w, crop top, left, target h, w), got [${timeIds.shape}]`);
  if (textEmbeds.shape.length !== 2 || textEmbeds.shape[0] !== B || textEmbeds.shape[1] !== pooled)
    throw new ShapeError(
      'unet',
      `text_embeds must be [${B},${pooled}] (projection_class_embeddings_input_dim - 6 x addition_time_embed_dim), got [${textEmbeds.shape}]`,
    );
  const ids = F.keep(timestepEmbedding(F.gpu, timeIds.reshape([B * TIME_IDS]), tt.timeEmbedDim, textEmbeds.dtype));
  const cat = F.concat(textEmbeds, ids.reshape([B, TIME_IDS * tt.timeEmbedDim]));
  F.release(ids);
  const l1 = F.linear(cat, weight(w, 'add_embedding.linear_1.weight'), weight(w, 'add_embedding.linear_1.bias'));
  const s1 = F.act('silu', l1);
  const out = F.linear(s1, weight(w, 'add_embedding.linear_2.weight'), weight(w, 'add_embedding.linear_2.bias'));
  F.release(cat, l1, s1);
  return out;
}

/**
 * Every ResNet's time_emb_proj(silu(temb)) by one GEMM, when the layers' weights lie end to end in one allocation
 * and so do their biases (models/load.ts allocateWeights) and none of them, nor the embedding, needs a gradient:
 * [B, temb] x [sum C_i, temb]^T -> [B, sum C_i], each ResNet reading its C_i columns in place (addChannel's column).
 * Each output element is the same dot product over temb with the same bias as the layer's own GEMM would compute:
 * only the number of output columns per dispatch changes. Else null: each ResNet projects on its own (a trained
 * projection, full fine-tuning; an int8 or LyCORIS-adapted one; weights not loaded grouped).
 */
function timeProjections(F: Ops, w: Weights, embAct: Tensor): { all: Tensor; columns: Map<string, number> } | null {
  const layers: { p: string; w: Tensor; b: Tensor }[] = [];
  for (const [name, t] of w) {
    if (!name.endsWith('.time_emb_proj.weight')) continue;
    const p = name.slice(0, -'.time_emb_proj.weight'.length);
    const b = w.get(`${p}.time_emb_proj.bias`);
    if (!b) return null;
    layers.push({ p, w: t, b });
  }
  if (layers.length < 2) return null;
  if (!F.frozen(embAct) || layers.some((l) => !F.frozen(l.w) || !F.frozen(l.b) || l.w.shape.length !== 2 || isInt8(l.w))) return null;
  // A LyCORIS or LoRA adapter on a projection (any tensor under its name beyond weight and bias) keeps it separate
  const own = new Set(layers.flatMap((l) => [`${l.p}.time_emb_proj.weight`, `${l.p}.time_emb_proj.bias`]));
  for (const name of w.keys()) if (name.includes('.time_emb_proj.') && !own.has(name)) return null;
  const byWeight = [...layers].sort((a, b) => a.w.byteOffset - b.w.byteOffset);
  const inner = byWeight[0].w.shape[1];
  let column = 0;
  const columns = new Map<string, number>();
  for (const [i, l] of byWeight.entries()) {
    const prev = byWeight[i - 1];
    const follows = (t: Tensor, u: Tensor) => t.alloc === u.alloc && u.byteOffset + u.byteSize === t.byteOffset;
    if (l.w.dtype !== embAct.dtype || l.b.dtype !== embAct.dtype || l.w.shape[1] !== inner || l.b.numel !== l.w.shape[0]) return null;
    if (prev && (!follows(l.w, prev.w) || !follows(l.b, prev.b))) return null;
    columns.set(l.p, column);
    column += l.w.shape[0];
  }
  const [first] = byWeight;
  const wAll = new Tensor(first.w.alloc, [column, inner], first.w.dtype, first.w.byteOffset, false);
  const bAll = new Tensor(first.b.alloc, [column], first.b.dtype, first.b.byteOffset, false);
  return { all: F.linear(embAct, wAll, bAll), columns };
}

/**
 * noise (or v) prediction [B, out, h, w] for sample [B, in, h, w], timesteps [B] (f32), context [B, L, D].
 * With a tape, every op records its backward (Tape.backward then yields parameter gradients). LoRA
 * adapters in `w` on the attention projections (to_q, to_k, to_v, to_out.0) are applied with `loraScale`.
 */
export function unetForward(
  gpu: Gpu,
  cfg: UnetConfig,
  w: Weights,
  sample: Tensor,
  timesteps: Tensor,
  context: Tensor,
  tape: Tape | null = null,
  /** alpha / rank of the LoRA adapters present in `w` (see loraLinear). */
  loraScale = 1,
  /**
   * Activation checkpointing (with a tape): each ResNet and each transformer keeps only its inputs and
   * re-runs its forward inside the backward, so the activations held at once are those of one block
   * plus the block boundaries (skips), at the price of about one more forward.
   */
  checkpointing = false,
  /** SDXL's text embeddings and time ids, required exactly when the config has `textTime`. */
  added: UnetAddedCond | null = null,
): Tensor {
  const F = new Ops(gpu, tape);
  const B = sample.shape[0];
  if (sample.shape.length !== 4 || sample.shape[1] !== cfg.inChannels)
    throw new ShapeError('unet', `sample must be [B,${cfg.inChannels},h,w], got [${sample.shape}]`);
  if (context.shape.length !== 3 || context.shape[0] !== B || context.shape[2] !== cfg.crossAttentionDim)
    throw new ShapeError('unet', `encoder_hidden_states must be [${B},L,${cfg.crossAttentionDim}], got [${context.shape}]`);
  if (timesteps.numel !== B) throw new ShapeError('unet', `timesteps must be [${B}], got [${timesteps.shape}]`);
  const f = 2 ** (cfg.blockOutChannels.length - 1);
  if (sample.shape[2] % f || sample.shape[3] % f) throw new ShapeError('unet', `latent size ${sample.shape[2]}x${sample.shape[3]} must be a multiple of ${f}`);
  // Time embedding: sinusoidal (flip_sin_to_cos, shift 0) -> linear -> SiLU -> linear; ResNets take SiLU of it.
  // Timesteps are not differentiable: the embedding (and the whole time MLP, frozen in LoRA) needs no gradient.
  const tEmb = F.constant(timestepEmbedding(gpu, timesteps, cfg.blockOutChannels[0], sample.dtype));
  const l1 = F.linear(tEmb, weight(w, 'time_embedding.linear_1.weight'), weight(w, 'time_embedding.linear_1.bias'));
  const s1 = F.act('silu', l1);
  let emb = F.linear(s1, weight(w, 'time_embedding.linear_2.weight'), weight(w, 'time_embedding.linear_2.bias'));
  F.release(tEmb, l1, s1);
  if (cfg.textTime) {
    const a = textTimeEmbedding(F, cfg, w, B, added);
    const sum = F.add(emb, a);
    F.release(emb, a);
    emb = sum;
  } else if (added) throw new ShapeError('unet', 'text_embeds and time_ids were given but this UNet has no text_time addition embedding (not SDXL)');
  const embAct = F.act('silu', emb);
  F.release(emb);
  const segment = (fn: (G: Ops) => Tensor): Tensor => (checkpointing ? F.checkpoint(fn) : fn(F));
  const merged = timeProjections(F, w, embAct);
  const resnet = (x: Tensor, p: string) =>
    segment((G) => {
      const column = merged?.columns.get(p);
      if (merged && column !== undefined) return resnetForward(G, x, w, p, cfg.groups, RES_EPS, { t: merged.all, column });
      const tp = G.linear(embAct, weight(w, `${p}.time_emb_proj.weight`), weight(w, `${p}.time_emb_proj.bias`));
      const y = resnetForward(G, x, w, p, cfg.groups, RES_EPS, tp);
      G.release(tp);
      return y;
    });
  const attn = (x: Tensor, p: string, heads: number, depth: number) => segment((G) => transformer(G, x, context, w, p, heads, cfg, loraScale, depth));
  let x = conv(F, sample, w, 'conv_in');
  const skips: Tensor[] = [x];
  const blocks = cfg.blockOutChannels.length;
  for (let i = 0; i < blocks; i++) {
    for (let j = 0; j < cfg.layersPerBlock; j++) {
      x = resnet(x, `down_blocks.${i}.resnets.${j}`);
      if (cfg.downAttention[i]) {
        const y = attn(x, `down_blocks.${i}.attentions.${j}`, cfg.heads[i], transformerDepth(cfg, 'down', i));
        F.release(x);
        x = y;
      }
      skips.push(x);
    }
    if (i < blocks - 1) {
      x = conv(F, x, w, `down_blocks.${i}.downsamplers.0.conv`, 2, 1);
      skips.push(x);
    }
  }
  let m = resnet(x, 'mid_block.resnets.0');
  const mt = attn(m, 'mid_block.attentions.0', cfg.heads[blocks - 1], transformerDepth(cfg, 'mid'));
  F.release(m);
  m = resnet(mt, 'mid_block.resnets.1');
  F.release(mt);
  x = m;
  for (let i = 0; i < blocks; i++) {
    const headIdx = blocks - 1 - i;
    for (let j = 0; j < cfg.layersPerBlock + 1; j++) {
      const skip = skips.pop()!;
      const cat = F.concat(x, skip);
      F.release(x, skip);
      x = resnet(cat, `up_blocks.${i}.resnets.${j}`);
      F.release(cat);
      if (cfg.upAttention[i]) {
        const y = attn(x, `up_blocks.${i}.attentions.${j}`, cfg.heads[headIdx], transformerDepth(cfg, 'up', i));
        F.release(x);
        x = y;
      }
    }
    if (i < blocks - 1) {
      const up = F.upsample(x);
      F.release(x);
      x = conv(F, up, w, `up_blocks.${i}.upsamplers.0.conv`);
      F.release(up);
    }
  }
  const a = normSilu(F, x, w, 'conv_norm_out', cfg.groups, RES_EPS);
  F.release(x, embAct, merged?.all);
  const out = conv(F, a, w, 'conv_out');
  F.release(a);
  return out;
}
