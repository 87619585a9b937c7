// CLIP text encoder (the text half of CLIP ViT-L for SD1, OpenCLIP ViT-H for SD2) on the engine,
// forward: token + position embeddings, `layers` pre-LayerNorm transformer blocks with causal
// self-attention and a quick-GELU (SD1) or GELU (SD2) MLP, then the final LayerNorm. Weights are
// looked up by diffusers' CLIPTextModel names. SD2 uses the penultimate block of OpenCLIP's 24: its
// diffusers config has 23 layers, and a single-file loader drops the 24th.
// Optional LoRA adapters (src/nn/lora.ts) on the self-attention projections q_proj, k_proj, v_proj and
// out_proj, for DreamBooth with a trained text encoder.
import type { Gpu } from '../gpu/device.ts';
import { ShapeError } from '../gpu/errors.ts';
import type { Tensor } from '../gpu/tensor.ts';
import { embedding } from '../ops/embedding.ts';
import { loraLinear } from './lora.ts';
import { Ops, type Tape } from './ops.ts';

export interface ClipTextConfig {
  vocabSize: number;
  hiddenSize: number;
  layers: number;
  heads: number;
  intermediateSize: number;
  maxPositions: number;
  act: 'quick_gelu' | 'gelu';
  eps: number;
  /**
   * Width of text_projection (CLIPTextModelWithProjection: SDXL's text_encoder_2, 1280); absent for a
   * plain CLIPTextModel, whose config.json may still list a projection_dim it has no weight for.
   */
  projectionDim?: number;
}

/** From a diffusers/transformers text_encoder/config.json. */
export function clipConfigFromJson(j: Record<string, unknown>): ClipTextConfig {
  const num = (k: string) => {
    const v = j[k];
    if (typeof v !== 'number') throw new ShapeError('clipConfig', `config.json has no numeric ${k}`);
    return v;
  };
  const act = j.hidden_act === 'gelu' ? 'gelu' : 'quick_gelu';
  return {
    vocabSize: num('vocab_size'),
    hiddenSize: num('hidden_size'),
    layers: num('num_hidden_layers'),
    heads: num('num_attention_heads'),
    intermediateSize: num('intermediate_size'),
    maxPositions: num('max_position_embeddings'),
    act,
    eps: typeof j.layer_norm_eps === 'number' ? j.layer_norm_eps : 1e-5,
    ...(Array.isArray(j.architectures) && j.architectures.includes('CLIPTextModelWithProjection') ? { projectionDim: num('projection_dim') } : {}),
  };
}

export type Weights = Map<string, Tensor>;

function w(weights: Weights, name: string): Tensor {
  const t = weights.get(name);
  if (!t) throw new ShapeError('clipTextEncoder', `missing tensor ${name}`);
  return t;
}

/** One pre-LN encoder block l on x [B, L, hidden] (x itself is left for the caller to release). */
function clipLayer(F: Ops, cfg: ClipTextConfig, weights: Weights, x: Tensor, l: number, batch: number, L: number, loraScale: number): Tensor {
  const b = `text_model.encoder.layers.${l}.`;
  const headDim = cfg.hiddenSize / cfg.heads;
  const ln1 = F.layerNorm(x, w(weights, `${b}layer_norm1.weight`), w(weights, `${b}layer_norm1.bias`), cfg.eps);
  // q/k/v/out projections (with bias), each x W^T + b + loraScale (x A^T) B^T where adapters are present.
  // q, k, v [B, L, hidden] are viewed as [B, L, heads, headDim]; the owning tensors are the ones released.
  const [q, k, v] = ['q_proj', 'k_proj', 'v_proj'].map((n) => loraLinear(F, ln1, weights, `${b}self_attn.${n}`, loraScale, true));
  const heads = (t: Tensor) => F.reshape(t, [batch, L, cfg.heads, headDim]);
  const att = F.attention(heads(q), heads(k), heads(v), { layout: 'bnhd', causal: true });
  const o = loraLinear(F, F.reshape(att, [batch, L, cfg.hiddenSize]), weights, `${b}self_attn.out_proj`, loraScale, true);
  const x1 = F.add(x, o);
  F.release(ln1, q, k, v, att, o);
  const ln2 = F.layerNorm(x1, w(weights, `${b}layer_norm2.weight`), w(weights, `${b}layer_norm2.bias`), cfg.eps);
  const h = F.linear(ln2, w(weights, `${b}mlp.fc1.weight`), w(weights, `${b}mlp.fc1.bias`));
  const a = F.act(cfg.act === 'gelu' ? 'gelu' : 'quickGelu', h);
  const f = F.linear(a, w(weights, `${b}mlp.fc2.weight`), w(weights, `${b}mlp.fc2.bias`));
  const y = F.add(x1, f);
  F.release(ln2, h, a, f, x1);
  return y;
}

export interface ClipOutputOptions {
  /**
   * 'final' (SD 1.x/2.x): the last block's output through the final LayerNorm. 'penultimate' (SDXL, both
   * encoders): hidden_states[-2], the input of the last block, with no final LayerNorm.
   */
  hidden?: 'final' | 'penultimate';
  /**
   * Also the pooled, projected output (SDXL's text_encoder_2, CLIPTextModelWithProjection): the final
   * LayerNorm of the last block at each sequence's EOS token times text_projection (no bias). The EOS is
   * found as transformers does for these configs: the first position of the sequence's largest id (CLIP's
   * <|endoftext|> is the vocabulary's last id).
   */
  pooled?: boolean;
}

/** Position of each sequence's EOS token: the first index of its largest id. */
function eosPositions(ids: ArrayLike<number>, batch: number): number[] {
  const L = ids.length / batch;
  return Array.from({ length: batch }, (_, b) => {
    let best = 0;
    for (let i = 1; i < L; i++) if (ids[b * L + i] > ids[b * L + best]) best = i;
    return best;
  });
}

/**
 * hidden [B, L, hidden] (see ClipOutputOptions) and, when asked, pooled [B, projectionDim] for token ids
 * [B * L]. With a tape every op records its backward, as clipTextForward. The pooled row is taken by a
 * batched matmul with a one-hot selection [B, 1, L], so its gradient flows back to that position only.
 */
export function clipTextEncode(
  gpu: Gpu,
  cfg: ClipTextConfig,
  weights: Weights,
  ids: ArrayLike<number>,
  batch: number,
  tape: Tape | null = null,
  loraScale = 1,
  opts: ClipOutputOptions = {},
): { hidden: Tensor; pooled: Tensor | null } {
  const F = new Ops(gpu, tape);
  const p = 'text_model.';
  const penultimate = opts.hidden === 'penultimate';
  if (penultimate && cfg.layers < 2) throw new ShapeError('clipTextEncoder', `penultimate hidden states need at least 2 layers, the config has ${cfg.layers}`);
  // The embedding is a raw op (no gradient: the tables stay frozen); under a tape it is kept until the
  // backward has read it, then freed.
  let x = F.keep(embedding(gpu, ids, batch, w(weights, `${p}embeddings.token_embedding.weight`), w(weights, `${p}embeddings.position_embedding.weight`)));
  const L = ids.length / batch;
  let hidden: Tensor | null = null;
  for (let l = 0; l < cfg.layers; l++) {
    if (penultimate && l === cfg.layers - 1) {
      hidden = x;
      if (!opts.pooled) return { hidden, pooled: null };
    }
    const y = clipLayer(F, cfg, weights, x, l, batch, L, loraScale);
    if (x !== hidden) F.release(x);
    x = y;
  }
  const out = F.layerNorm(x, w(weights, `${p}final_layer_norm.weight`), w(weights, `${p}final_layer_norm.bias`), cfg.eps);
  F.release(x);
  if (!opts.pooled) return { hidden: out, pooled: null };
  const proj = w(weights, 'text_projection.weight');
  const sel = new Float32Array(batch * L);
  eosPositions(ids, batch).forEach((pos, b) => (sel[b * L + pos] = 1));
  const oneHot = F.keep(gpu.upload(sel, [batch, 1, L], out.dtype, 'activations', 'clip.eos'));
  const row = F.matmul(oneHot, out);
  const pooled = F.linear(F.reshape(row, [batch, cfg.hiddenSize]), proj);
  F.release(row, oneHot);
  if (hidden) F.release(out);
  return { hidden: hidden ?? out, pooled };
}

/**
 * last_hidden_state [B, L, hidden] for token ids [B * L] (L <= maxPositions, usually 77). With a tape,
 * every op records its backward (gradients for all weights but the embedding tables, which only
 * textual inversion would train; for LoRA training pass a Tape whose trainable set is the adapters, and
 * the frozen base weights' dW/db are never formed).
 * LoRA adapters in `weights` (`text_model.encoder.layers.N.self_attn.{q,k,v,out}_proj.lora_{A,B}.weight`,
 * PEFT layout) are added with `loraScale`; without adapters the result is exactly the plain encoder's.
 */
export function clipTextForward(
  gpu: Gpu,
  cfg: ClipTextConfig,
  weights: Weights,
  ids: ArrayLike<number>,
  batch: number,
  tape: Tape | null = null,
  /** alpha / rank of the LoRA adapters present in `weights` (see loraLinear). */
  loraScale = 1,
): Tensor {
  return clipTextEncode(gpu, cfg, weights, ids, batch, tape, loraScale).hidden;
}
