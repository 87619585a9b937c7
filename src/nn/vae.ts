// AutoencoderKL (SD's VAE) on the engine, forward: encode an image to the latent distribution's
// mean and log-variance, decode latents to an image. Layout from the diffusers config
// (block_out_channels, layers_per_block, norm_num_groups, latent_channels); weights by diffusers names.
//   encoder: conv_in, per block `layers` ResNets (+ stride-2 conv after a (0,1,0,1) zero pad, except the
//   last), mid (ResNet, attention, ResNet), GroupNorm + SiLU, conv_out -> 2 * latent channels, quant_conv.
//   decoder: post_quant_conv, conv_in, mid, per block (channels reversed) `layers + 1` ResNets (+ nearest
//   2x upsample and conv, except the last), GroupNorm + SiLU, conv_out -> 3 channels.
// Latents here are unscaled (multiply by the config's scaling_factor, 0.18215 for SD, before the UNet).
// With a tape both directions record their backward (every VAE parameter gets its gradient).
import type { Gpu } from '../gpu/device.ts';
import { ShapeError } from '../gpu/errors.ts';
import type { Tensor } from '../gpu/tensor.ts';
import { conv, normSilu, resnetForward, vaeAttentionForward, type Weights } from './blocks.ts';
import { Ops, type Tape } from './ops.ts';

export interface VaeConfig {
  blockOutChannels: number[];
  layersPerBlock: number;
  groups: number;
  latentChannels: number;
  scalingFactor: number;
}

export function vaeConfigFromJson(j: Record<string, unknown>): VaeConfig {
  if (!Array.isArray(j.block_out_channels)) throw new ShapeError('vaeConfig', 'vae config.json has no block_out_channels');
  return {
    blockOutChannels: j.block_out_channels as number[],
    layersPerBlock: (j.layers_per_block as number) ?? 2,
    groups: (j.norm_num_groups as number) ?? 32,
    latentChannels: (j.latent_channels as number) ?? 4,
    scalingFactor: (j.scaling_factor as number) ?? 0.18215,
  };
}

const EPS = 1e-6;

function mid(F: Ops, x: Tensor, weights: Weights, p: string, cfg: VaeConfig): Tensor {
  const a = resnetForward(F, x, weights, `${p}.mid_block.resnets.0`, cfg.groups, EPS);
  const b = vaeAttentionForward(F, a, weights, `${p}.mid_block.attentions.0`, cfg.groups, EPS);
  F.release(a);
  const c = resnetForward(F, b, weights, `${p}.mid_block.resnets.1`, cfg.groups, EPS);
  F.release(b);
  return c;
}

/** image [N, 3, H, W] in [-1, 1] -> moments [N, 2 * latent, H/f, W/f]: mean then log-variance channels. */
export function vaeEncode(gpu: Gpu, cfg: VaeConfig, weights: Weights, image: Tensor, tape: Tape | null = null): Tensor {
  if (image.shape.length !== 4 || image.shape[1] !== 3) throw new ShapeError('vaeEncode', `image must be [N,3,H,W], got [${image.shape}]`);
  const f = 2 ** (cfg.blockOutChannels.length - 1);
  if (image.shape[2] % f || image.shape[3] % f) throw new ShapeError('vaeEncode', `image size ${image.shape[2]}x${image.shape[3]} must be a multiple of ${f}`);
  const F = new Ops(gpu, tape);
  let x = conv(F, image, weights, 'encoder.conv_in');
  for (let i = 0; i < cfg.blockOutChannels.length; i++) {
    for (let j = 0; j < cfg.layersPerBlock; j++) {
      const y = resnetForward(F, x, weights, `encoder.down_blocks.${i}.resnets.${j}`, cfg.groups, EPS);
      F.release(x);
      x = y;
    }
    if (i < cfg.blockOutChannels.length - 1) {
      const padded = F.pad(x, { top: 0, bottom: 1, left: 0, right: 1 });
      F.release(x);
      x = conv(F, padded, weights, `encoder.down_blocks.${i}.downsamplers.0.conv`, 2);
      F.release(padded);
    }
  }
  const m = mid(F, x, weights, 'encoder', cfg);
  F.release(x);
  const a = normSilu(F, m, weights, 'encoder.conv_norm_out', cfg.groups, EPS);
  F.release(m);
  const h = conv(F, a, weights, 'encoder.conv_out');
  F.release(a);
  const moments = conv(F, h, weights, 'quant_conv');
  F.release(h);
  return moments;
}

/** latents [N, latent, h, w] (unscaled) -> image [N, 3, h*f, w*f], roughly in [-1, 1]. */
export function vaeDecode(gpu: Gpu, cfg: VaeConfig, weights: Weights, latents: Tensor, tape: Tape | null = null): Tensor {
  if (latents.shape.length !== 4 || latents.shape[1] !== cfg.latentChannels)
    throw new ShapeError('vaeDecode', `latents must be [N,${cfg.latentChannels},h,w], got [${latents.shape}]`);
  const F = new Ops(gpu, tape);
  const z = conv(F, latents, weights, 'post_quant_conv');
  let x = conv(F, z, weights, 'decoder.conv_in');
  F.release(z);
  const m = mid(F, x, weights, 'decoder', cfg);
  F.release(x);
  x = m;
  const blocks = cfg.blockOutChannels.length;
  for (let i = 0; i < blocks; i++) {
    for (let j = 0; j < cfg.layersPerBlock + 1; j++) {
      const y = resnetForward(F, x, weights, `decoder.up_blocks.${i}.resnets.${j}`, cfg.groups, EPS);
      F.release(x);
      x = y;
    }
    if (i < blocks - 1) {
      const up = F.upsample(x);
      F.release(x);
      x = conv(F, up, weights, `decoder.up_blocks.${i}.upsamplers.0.conv`);
      F.release(up);
    }
  }
  const a = normSilu(F, x, weights, 'decoder.conv_norm_out', cfg.groups, EPS);
  F.release(x);
  const img = conv(F, a, weights, 'decoder.conv_out');
  F.release(a);
  return img;
}
