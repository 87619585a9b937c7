// SDXL's text conditioning on the engine: both CLIP text encoders (clip.ts) on their own token ids, the
// penultimate hidden states of each (hidden_states[-2], no final LayerNorm) concatenated along the
// channel axis into the UNet's encoder_hidden_states (768 + 1280 = 2048 for SDXL base), and encoder 2's
// pooled, projected EOS row as the UNet's text_embeds. The concatenation runs channel-first
// (transpose, concat, transpose back) so it is the same differentiable concat the UNet's skips use.
import type { Gpu } from '../gpu/device.ts';
import { ShapeError } from '../gpu/errors.ts';
import type { Tensor } from '../gpu/tensor.ts';
import type { Weights } from './blocks.ts';
import { clipTextEncode, type ClipTextConfig } from './clip.ts';
import { Ops, type Tape } from './ops.ts';

export interface SdxlText {
  /** [B, L, hidden1 + hidden2]: the UNet's encoder_hidden_states. */
  context: Tensor;
  /** [B, projectionDim]: the UNet's text_embeds. */
  pooled: Tensor;
}

export function sdxlTextEncode(
  gpu: Gpu,
  te1: { config: ClipTextConfig; weights: Weights },
  te2: { config: ClipTextConfig; weights: Weights },
  ids1: ArrayLike<number>,
  ids2: ArrayLike<number>,
  batch: number,
  tape: Tape | null = null,
  loraScale = 1,
): SdxlText {
  if (ids1.length !== ids2.length)
    throw new ShapeError('sdxlTextEncode', `both tokenizers must give the same number of ids (${ids1.length} vs ${ids2.length})`);
  if (te2.config.projectionDim === undefined)
    throw new ShapeError('sdxlTextEncode', 'text_encoder_2 has no text_projection (it must be a CLIPTextModelWithProjection)');
  const F = new Ops(gpu, tape);
  const h1 = clipTextEncode(gpu, te1.config, te1.weights, ids1, batch, tape, loraScale, { hidden: 'penultimate' }).hidden;
  const r2 = clipTextEncode(gpu, te2.config, te2.weights, ids2, batch, tape, loraScale, { hidden: 'penultimate', pooled: true });
  const [t1, t2] = [F.transpose(h1), F.transpose(r2.hidden)];
  F.release(h1, r2.hidden);
  const cat = F.concat(t1, t2);
  F.release(t1, t2);
  const context = F.transpose(cat);
  F.release(cat);
  return { context, pooled: r2.pooled! };
}
