// The VAE encoder's latent mean for one image (and below, the decoder's image), tiled when the whole image's
// activations would not fit one storage binding. A 1024 px encode holds [128, 1024, 1024] f32 activations (512 MiB) where SwiftShader and many laptop
// GPUs bind at most 128 MiB, and a convolution needs one sample of its input and output in one binding. Such an
// image is encoded in overlapping square tiles, as diffusers' AutoencoderKL.tiled_encode does: tiles of side T at a
// stride of 3T/4, each tile's latent blended linearly into its upper and left neighbours over the overlap (T/4 in
// pixels, T/4f in latents), then cropped to the stride. Each tile sees its own GroupNorm statistics and its own
// mid-block attention, so a tiled latent is close to the untiled one, not equal (tests/modules/vae.test.ts
// measures it); an image that fits is encoded whole, as before.
import type { Gpu } from '../gpu/device.ts';
import type { DType } from '../gpu/tensor.ts';
import { BYTES } from '../gpu/tensor.ts';
import type { Weights } from './blocks.ts';
import { vaeDecode, vaeEncode, type VaeConfig } from './vae.ts';

/** Headroom kept below the binding limit (a binding's offset alignment and the kernels' window rounding). */
const SLACK = 4096;

/**
 * The largest per-sample tensor the encoder makes for an h x w image (bytes): each block's activations (with the
 * one-pixel pad before a down-sampling conv) and the mid-block attention's score matrix (tokens², f32).
 */
export function encodeActivationBytes(cfg: VaeConfig, h: number, w: number, dtype: DType): number {
  let most = 0;
  cfg.blockOutChannels.forEach((c, i) => {
    const s = 2 ** i;
    most = Math.max(most, c * (h / s + 1) * (w / s + 1) * BYTES[dtype]);
  });
  const f = 2 ** (cfg.blockOutChannels.length - 1);
  const tokens = (h / f) * (w / f);
  return Math.max(most, tokens * tokens * 4);
}

/**
 * The tile side for an h x w encode under a binding of `maxBinding` bytes: null when the whole image fits, else the
 * largest multiple of 4f (so the overlap and the stride are whole latent pixels) whose activations fit.
 */
export function encodeTileSide(cfg: VaeConfig, h: number, w: number, dtype: DType, maxBinding: number): number | null {
  const limit = maxBinding - SLACK;
  if (encodeActivationBytes(cfg, h, w, dtype) <= limit) return null;
  const step = 4 * 2 ** (cfg.blockOutChannels.length - 1);
  let t = Math.floor(Math.max(h, w) / step) * step;
  while (t > step && encodeActivationBytes(cfg, t, t, dtype) > limit) t -= step;
  if (encodeActivationBytes(cfg, t, t, dtype) > limit)
    throw new Error(`vaeEncodeMean: even a ${t} px tile's activations exceed the ${maxBinding}-byte storage binding`);
  return t;
}

/** One image's tile [c, th, tw] (CHW, rows y0.., columns x0..) of `image` [c, h, w]. */
function crop(image: Float32Array, c: number, h: number, w: number, y0: number, x0: number, th: number, tw: number): Float32Array {
  const out = new Float32Array(c * th * tw);
  for (let k = 0; k < c; k++)
    for (let y = 0; y < th; y++) out.set(image.subarray(k * h * w + (y0 + y) * w + x0, k * h * w + (y0 + y) * w + x0 + tw), (k * th + y) * tw);
  return out;
}

/** The encoder's mean channels [latent, h/f, w/f] for one tile (or the whole image), `image` uploaded in `dtype`. */
async function encodeMean(gpu: Gpu, cfg: VaeConfig, weights: Weights, image: Float32Array, h: number, w: number, dtype: DType): Promise<Float32Array> {
  const x = gpu.upload(image, [1, 3, h, w], dtype, 'activations', 'image');
  const moments = vaeEncode(gpu, cfg, weights, x);
  const all = await gpu.read(moments);
  gpu.free(x, moments);
  return all.slice(0, all.length / 2); // mean channels first, log-variance after
}

interface Tile {
  data: Float32Array;
  h: number;
  w: number;
}

/**
 * The VAE posterior's mean [latent, h/f, w/f] of `image` [3, h, w] (unscaled), encoded whole or, past one binding,
 * in tiles (see the file's head). `tile` forces a tile side (a multiple of 4f; tests), otherwise chosen by the binding.
 */
export async function vaeEncodeMean(
  gpu: Gpu,
  cfg: VaeConfig,
  weights: Weights,
  image: Float32Array,
  size: { width: number; height: number },
  dtype: DType,
  tile: number | null = encodeTileSide(cfg, size.height, size.width, dtype, gpu.maxBinding),
): Promise<Float32Array> {
  const { height: H, width: W } = size;
  if (tile === null || (tile >= H && tile >= W)) return encodeMean(gpu, cfg, weights, image, H, W, dtype);
  const f = 2 ** (cfg.blockOutChannels.length - 1);
  if (tile % (4 * f)) throw new Error(`vaeEncodeMean: tile side ${tile} must be a multiple of ${4 * f}`);
  const zc = cfg.latentChannels;
  const stride = (tile * 3) / 4;
  const lt = tile / f;
  const blend = lt / 4; // latent pixels blended with the neighbour above and to the left
  const keep = lt - blend; // latent pixels each tile contributes (its stride)
  const [lh, lw] = [H / f, W / f];
  const out = new Float32Array(zc * lh * lw);
  let above: Tile[] = [];
  for (let y0 = 0; y0 < H; y0 += stride) {
    const row: Tile[] = [];
    for (let x0 = 0; x0 < W; x0 += stride) {
      const [th, tw] = [Math.min(tile, H - y0), Math.min(tile, W - x0)];
      const t: Tile = { data: await encodeMean(gpu, cfg, weights, crop(image, 3, H, W, y0, x0, th, tw), th, tw, dtype), h: th / f, w: tw / f };
      const up = above[row.length];
      const left = row.at(-1);
      // diffusers' blend_v then blend_h, in place: the first e rows (columns) ramp from the neighbour's last e to this
      // tile's own, e = min(blend, both sides' extents).
      const ev = up ? Math.min(blend, up.h, t.h) : 0;
      const eh = left ? Math.min(blend, left.w, t.w) : 0;
      for (let k = 0; k < zc; k++)
        for (let y = 0; y < t.h; y++)
          for (let x = 0; x < t.w; x++) {
            const i = (k * t.h + y) * t.w + x;
            if (up && y < ev) t.data[i] = up.data[(k * up.h + up.h - ev + y) * up.w + x] * (1 - y / ev) + t.data[i] * (y / ev);
            if (left && x < eh) t.data[i] = left.data[(k * left.h + y) * left.w + left.w - eh + x] * (1 - x / eh) + t.data[i] * (x / eh);
          }
      row.push(t);
      // Keep the tile's first `keep` rows and columns (all of an edge tile's), at its place in the latent.
      const [oy, ox] = [y0 / f, x0 / f];
      for (let k = 0; k < zc; k++)
        for (let y = 0; y < Math.min(keep, t.h, lh - oy); y++)
          for (let x = 0; x < Math.min(keep, t.w, lw - ox); x++) out[(k * lh + oy + y) * lw + ox + x] = t.data[(k * t.h + y) * t.w + x];
    }
    above = row;
  }
  return out;
}

// The decode, tiled the same way when the whole image's activations would not fit one binding (SDXL at 1024 px: the
// last up block's first ResNet reads [256, 1024, 1024] f32, 1 GiB), as diffusers' AutoencoderKL.tiled_decode does:
// latent tiles of side t at a stride of 3t/4, each decoded, blended linearly into its upper and left neighbours over
// T/4 image pixels (T = t·f), cropped to the stride. A latent that fits is decoded whole, exactly as before.

/**
 * The largest per-sample tensor the decoder makes for h x w latents (bytes): at up block i (scale 2^i) the first
 * ResNet reads the previous block's channels (upsampled) and writes this block's; the mid-block attention's score
 * matrix (tokens², f32) at latent scale.
 */
export function decodeActivationBytes(cfg: VaeConfig, h: number, w: number, dtype: DType): number {
  const ch = [...cfg.blockOutChannels].reverse();
  let most = (h * w) ** 2 * 4;
  ch.forEach((c, i) => {
    most = Math.max(most, Math.max(c, ch[Math.max(i - 1, 0)]) * h * w * 4 ** i * BYTES[dtype]);
  });
  return most;
}

/**
 * The latent tile side for decoding h x w latents under a binding of `maxBinding` bytes: null when the whole latent
 * fits, else the largest multiple of 4 (so the stride 3t/4 is whole) whose decode fits.
 */
export function decodeTileSide(cfg: VaeConfig, h: number, w: number, dtype: DType, maxBinding: number): number | null {
  const limit = maxBinding - SLACK;
  if (decodeActivationBytes(cfg, h, w, dtype) <= limit) return null;
  let t = Math.floor(Math.max(h, w) / 4) * 4;
  while (t > 4 && decodeActivationBytes(cfg, t, t, dtype) > limit) t -= 4;
  if (decodeActivationBytes(cfg, t, t, dtype) > limit)
    throw new Error(`vaeDecodeImage: even a ${t}-latent-pixel tile's activations exceed the ${maxBinding}-byte storage binding`);
  return t;
}

/** The decoded image [3, h·f, w·f] of one latent tile (or the whole latent) [latent, h, w], uploaded in `dtype`. */
async function decodeWhole(gpu: Gpu, cfg: VaeConfig, weights: Weights, latents: Float32Array, h: number, w: number, dtype: DType): Promise<Float32Array> {
  const z = gpu.upload(latents, [1, cfg.latentChannels, h, w], dtype);
  const img = vaeDecode(gpu, cfg, weights, z);
  const out = await gpu.read(img);
  gpu.free(z, img);
  return out;
}

/**
 * The image [3, h·f, w·f] (roughly in [-1, 1]) decoded from unscaled latents [latent, h, w], whole or, past one
 * binding, in tiles (above). `tile` forces a latent tile side (a multiple of 4; tests), otherwise chosen by the
 * binding.
 */
export async function vaeDecodeImage(
  gpu: Gpu,
  cfg: VaeConfig,
  weights: Weights,
  latents: Float32Array,
  size: { width: number; height: number },
  dtype: DType,
  tile: number | null = decodeTileSide(cfg, size.height, size.width, dtype, gpu.maxBinding),
): Promise<Float32Array> {
  const { height: lh, width: lw } = size;
  if (tile === null || (tile >= lh && tile >= lw)) return decodeWhole(gpu, cfg, weights, latents, lh, lw, dtype);
  if (tile % 4) throw new Error(`vaeDecodeImage: latent tile side ${tile} must be a multiple of 4`);
  const f = 2 ** (cfg.blockOutChannels.length - 1);
  const stride = (tile * 3) / 4;
  const ext = (tile * f) / 4; // image pixels blended with the neighbour above and to the left
  const keep = stride * f; // image pixels each tile contributes
  const [H, W] = [lh * f, lw * f];
  const out = new Float32Array(3 * H * W);
  let above: Tile[] = [];
  for (let y0 = 0; y0 < lh; y0 += stride) {
    const row: Tile[] = [];
    for (let x0 = 0; x0 < lw; x0 += stride) {
      const [th, tw] = [Math.min(tile, lh - y0), Math.min(tile, lw - x0)];
      const data = await decodeWhole(gpu, cfg, weights, crop(latents, cfg.latentChannels, lh, lw, y0, x0, th, tw), th, tw, dtype);
      const t: Tile = { data, h: th * f, w: tw * f };
      const up = above[row.length];
      const left = row.at(-1);
      // diffusers' blend_v then blend_h, in place (as in the encode).
      const ev = up ? Math.min(ext, up.h, t.h) : 0;
      const eh = left ? Math.min(ext, left.w, t.w) : 0;
      for (let k = 0; k < 3; k++)
        for (let y = 0; y < t.h; y++)
          for (let x = 0; x < t.w; x++) {
            const i = (k * t.h + y) * t.w + x;
            if (up && y < ev) t.data[i] = up.data[(k * up.h + up.h - ev + y) * up.w + x] * (1 - y / ev) + t.data[i] * (y / ev);
            if (left && x < eh) t.data[i] = left.data[(k * left.h + y) * left.w + left.w - eh + x] * (1 - x / eh) + t.data[i] * (x / eh);
          }
      row.push(t);
      const [oy, ox] = [y0 * f, x0 * f];
      for (let k = 0; k < 3; k++)
        for (let y = 0; y < Math.min(keep, t.h, H - oy); y++)
          for (let x = 0; x < Math.min(keep, t.w, W - ox); x++) out[(k * H + oy + y) * W + ox + x] = t.data[(k * t.h + y) * t.w + x];
    }
    above = row;
  }
  return out;
}
