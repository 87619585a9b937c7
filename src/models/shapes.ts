// Parameter names and shapes of each component for a config, in diffusers naming: used to plan memory,
// to allocate models without files (benchmarks at SD1.5 sizes), and later by training to lay out
// parameters and optimizer state.
import type { ClipTextConfig } from '../nn/clip.ts';
import { transformerDepth, type UnetConfig } from '../nn/unet.ts';
import type { VaeConfig } from '../nn/vae.ts';

export type ParamShapes = Map<string, number[]>;

function conv(m: ParamShapes, name: string, cout: number, cin: number, k: number): void {
  m.set(`${name}.weight`, [cout, cin, k, k]);
  m.set(`${name}.bias`, [cout]);
}
function lin(m: ParamShapes, name: string, out: number, inp: number, bias = true): void {
  m.set(`${name}.weight`, [out, inp]);
  if (bias) m.set(`${name}.bias`, [out]);
}
function norm(m: ParamShapes, name: string, c: number): void {
  m.set(`${name}.weight`, [c]);
  m.set(`${name}.bias`, [c]);
}
function resnet(m: ParamShapes, p: string, cin: number, cout: number, temb: number | null): void {
  norm(m, `${p}.norm1`, cin);
  conv(m, `${p}.conv1`, cout, cin, 3);
  if (temb) lin(m, `${p}.time_emb_proj`, cout, temb);
  norm(m, `${p}.norm2`, cout);
  conv(m, `${p}.conv2`, cout, cout, 3);
  if (cin !== cout) conv(m, `${p}.conv_shortcut`, cout, cin, 1);
}

export function unetParams(c: UnetConfig): ParamShapes {
  const m: ParamShapes = new Map();
  const ch = c.blockOutChannels;
  const temb = 4 * ch[0];
  const block = (tb: string, cc: number) => {
    for (const n of ['norm1', 'norm2', 'norm3']) norm(m, `${tb}.${n}`, cc);
    for (const [a, kv] of [
      ['attn1', cc],
      ['attn2', c.crossAttentionDim],
    ] as const) {
      lin(m, `${tb}.${a}.to_q`, cc, cc, false);
      lin(m, `${tb}.${a}.to_k`, cc, kv, false);
      lin(m, `${tb}.${a}.to_v`, cc, kv, false);
      lin(m, `${tb}.${a}.to_out.0`, cc, cc);
    }
    lin(m, `${tb}.ff.net.0.proj`, 8 * cc, cc);
    lin(m, `${tb}.ff.net.2`, cc, 4 * cc);
  };
  const transformer = (p: string, cc: number, depth: number) => {
    norm(m, `${p}.norm`, cc);
    if (c.linearProjection) lin(m, `${p}.proj_in`, cc, cc);
    else conv(m, `${p}.proj_in`, cc, cc, 1);
    for (let d = 0; d < depth; d++) block(`${p}.transformer_blocks.${d}`, cc);
    if (c.linearProjection) lin(m, `${p}.proj_out`, cc, cc);
    else conv(m, `${p}.proj_out`, cc, cc, 1);
  };
  lin(m, 'time_embedding.linear_1', temb, ch[0]);
  lin(m, 'time_embedding.linear_2', temb, temb);
  if (c.textTime) {
    lin(m, 'add_embedding.linear_1', temb, c.textTime.projectionInputDim);
    lin(m, 'add_embedding.linear_2', temb, temb);
  }
  conv(m, 'conv_in', ch[0], c.inChannels, 3);
  const skips = [ch[0]];
  let cin = ch[0];
  ch.forEach((cc, i) => {
    for (let j = 0; j < c.layersPerBlock; j++) {
      resnet(m, `down_blocks.${i}.resnets.${j}`, cin, cc, temb);
      cin = cc;
      if (c.downAttention[i]) transformer(`down_blocks.${i}.attentions.${j}`, cc, transformerDepth(c, 'down', i));
      skips.push(cc);
    }
    if (i < ch.length - 1) {
      conv(m, `down_blocks.${i}.downsamplers.0.conv`, cc, cc, 3);
      skips.push(cc);
    }
  });
  const last = ch[ch.length - 1];
  resnet(m, 'mid_block.resnets.0', last, last, temb);
  transformer('mid_block.attentions.0', last, transformerDepth(c, 'mid'));
  resnet(m, 'mid_block.resnets.1', last, last, temb);
  [...ch].reverse().forEach((cc, i) => {
    for (let j = 0; j < c.layersPerBlock + 1; j++) {
      resnet(m, `up_blocks.${i}.resnets.${j}`, cin + skips.pop()!, cc, temb);
      cin = cc;
      if (c.upAttention[i]) transformer(`up_blocks.${i}.attentions.${j}`, cc, transformerDepth(c, 'up', i));
    }
    if (i < ch.length - 1) conv(m, `up_blocks.${i}.upsamplers.0.conv`, cc, cc, 3);
  });
  norm(m, 'conv_norm_out', ch[0]);
  conv(m, 'conv_out', c.outChannels, ch[0], 3);
  return m;
}

export function vaeParams(c: VaeConfig): ParamShapes {
  const m: ParamShapes = new Map();
  const ch = c.blockOutChannels;
  const z = c.latentChannels;
  const attn = (p: string, cc: number) => {
    norm(m, `${p}.group_norm`, cc);
    for (const n of ['to_q', 'to_k', 'to_v', 'to_out.0']) lin(m, `${p}.${n}`, cc, cc);
  };
  const mid = (p: string) => {
    const last = ch[ch.length - 1];
    resnet(m, `${p}.mid_block.resnets.0`, last, last, null);
    attn(`${p}.mid_block.attentions.0`, last);
    resnet(m, `${p}.mid_block.resnets.1`, last, last, null);
  };
  conv(m, 'encoder.conv_in', ch[0], 3, 3);
  let cin = ch[0];
  ch.forEach((cc, i) => {
    for (let j = 0; j < c.layersPerBlock; j++) {
      resnet(m, `encoder.down_blocks.${i}.resnets.${j}`, cin, cc, null);
      cin = cc;
    }
    if (i < ch.length - 1) conv(m, `encoder.down_blocks.${i}.downsamplers.0.conv`, cc, cc, 3);
  });
  mid('encoder');
  norm(m, 'encoder.conv_norm_out', ch[ch.length - 1]);
  conv(m, 'encoder.conv_out', 2 * z, ch[ch.length - 1], 3);
  conv(m, 'quant_conv', 2 * z, 2 * z, 1);
  conv(m, 'post_quant_conv', z, z, 1);
  conv(m, 'decoder.conv_in', ch[ch.length - 1], z, 3);
  mid('decoder');
  cin = ch[ch.length - 1];
  [...ch].reverse().forEach((cc, i) => {
    for (let j = 0; j < c.layersPerBlock + 1; j++) {
      resnet(m, `decoder.up_blocks.${i}.resnets.${j}`, cin, cc, null);
      cin = cc;
    }
    if (i < ch.length - 1) conv(m, `decoder.up_blocks.${i}.upsamplers.0.conv`, cc, cc, 3);
  });
  norm(m, 'decoder.conv_norm_out', ch[0]);
  conv(m, 'decoder.conv_out', 3, ch[0], 3);
  return m;
}

export function clipParams(c: ClipTextConfig): ParamShapes {
  const m: ParamShapes = new Map();
  const d = c.hiddenSize;
  m.set('text_model.embeddings.token_embedding.weight', [c.vocabSize, d]);
  m.set('text_model.embeddings.position_embedding.weight', [c.maxPositions, d]);
  for (let l = 0; l < c.layers; l++) {
    const p = `text_model.encoder.layers.${l}`;
    for (const n of ['q_proj', 'k_proj', 'v_proj', 'out_proj']) lin(m, `${p}.self_attn.${n}`, d, d);
    norm(m, `${p}.layer_norm1`, d);
    norm(m, `${p}.layer_norm2`, d);
    lin(m, `${p}.mlp.fc1`, c.intermediateSize, d);
    lin(m, `${p}.mlp.fc2`, d, c.intermediateSize);
  }
  norm(m, 'text_model.final_layer_norm', d);
  return m;
}

export function paramCount(m: ParamShapes): number {
  let n = 0;
  for (const s of m.values()) n += s.reduce((a, b) => a * b, 1);
  return n;
}

/** SD 1.5's configs (diffusers' runwayml/stable-diffusion-v1-5). */
export const SD15 = {
  unet: {
    blockOutChannels: [320, 640, 1280, 1280],
    layersPerBlock: 2,
    heads: [8, 8, 8, 8],
    crossAttentionDim: 768,
    groups: 32,
    linearProjection: false,
    downAttention: [true, true, true, false],
    upAttention: [false, true, true, true],
    inChannels: 4,
    outChannels: 4,
  } satisfies UnetConfig,
  vae: { blockOutChannels: [128, 256, 512, 512], layersPerBlock: 2, groups: 32, latentChannels: 4, scalingFactor: 0.18215 } satisfies VaeConfig,
  textEncoder: {
    vocabSize: 49408,
    hiddenSize: 768,
    layers: 12,
    heads: 12,
    intermediateSize: 3072,
    maxPositions: 77,
    act: 'quick_gelu',
    eps: 1e-5,
  } satisfies ClipTextConfig,
};
