// Name maps checked against pairs taken from real SD 1.5 / 2.1 checkpoints and their diffusers
// conversions (the pairs diffusers' conversion scripts produce), in both directions.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import {
  clipToDiffusers,
  isVaeAttentionProjection,
  openClipToDiffusers,
  SD_UNET,
  unetFromDiffusers,
  unetToDiffusers,
  vaeFromDiffusers,
  vaeToDiffusers,
} from '../../src/models/keymap.ts';

const UNET_PAIRS: [string, string][] = [
  ['time_embed.0.weight', 'time_embedding.linear_1.weight'],
  ['time_embed.2.bias', 'time_embedding.linear_2.bias'],
  ['input_blocks.0.0.weight', 'conv_in.weight'],
  ['input_blocks.1.0.in_layers.0.weight', 'down_blocks.0.resnets.0.norm1.weight'],
  ['input_blocks.1.0.emb_layers.1.weight', 'down_blocks.0.resnets.0.time_emb_proj.weight'],
  ['input_blocks.1.1.proj_in.weight', 'down_blocks.0.attentions.0.proj_in.weight'],
  ['input_blocks.2.1.transformer_blocks.0.attn2.to_k.weight', 'down_blocks.0.attentions.1.transformer_blocks.0.attn2.to_k.weight'],
  ['input_blocks.3.0.op.weight', 'down_blocks.0.downsamplers.0.conv.weight'],
  ['input_blocks.4.0.skip_connection.weight', 'down_blocks.1.resnets.0.conv_shortcut.weight'],
  ['input_blocks.4.1.transformer_blocks.0.attn1.to_q.weight', 'down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight'],
  ['input_blocks.9.0.op.bias', 'down_blocks.2.downsamplers.0.conv.bias'],
  ['input_blocks.10.0.out_layers.3.weight', 'down_blocks.3.resnets.0.conv2.weight'],
  ['input_blocks.11.0.out_layers.0.bias', 'down_blocks.3.resnets.1.norm2.bias'],
  ['middle_block.0.in_layers.2.weight', 'mid_block.resnets.0.conv1.weight'],
  ['middle_block.1.transformer_blocks.0.ff.net.0.proj.weight', 'mid_block.attentions.0.transformer_blocks.0.ff.net.0.proj.weight'],
  ['middle_block.2.in_layers.0.weight', 'mid_block.resnets.1.norm1.weight'],
  ['output_blocks.0.0.skip_connection.bias', 'up_blocks.0.resnets.0.conv_shortcut.bias'],
  ['output_blocks.2.1.conv.weight', 'up_blocks.0.upsamplers.0.conv.weight'],
  ['output_blocks.3.1.norm.weight', 'up_blocks.1.attentions.0.norm.weight'],
  ['output_blocks.5.2.conv.bias', 'up_blocks.1.upsamplers.0.conv.bias'],
  ['output_blocks.8.2.conv.weight', 'up_blocks.2.upsamplers.0.conv.weight'],
  ['output_blocks.11.1.proj_out.weight', 'up_blocks.3.attentions.2.proj_out.weight'],
  ['output_blocks.11.0.emb_layers.1.bias', 'up_blocks.3.resnets.2.time_emb_proj.bias'],
  ['out.0.weight', 'conv_norm_out.weight'],
  ['out.2.bias', 'conv_out.bias'],
];

const VAE_PAIRS: [string, string][] = [
  ['encoder.conv_in.weight', 'encoder.conv_in.weight'],
  ['encoder.down.0.block.1.conv2.weight', 'encoder.down_blocks.0.resnets.1.conv2.weight'],
  ['encoder.down.1.block.0.nin_shortcut.weight', 'encoder.down_blocks.1.resnets.0.conv_shortcut.weight'],
  ['encoder.down.2.downsample.conv.weight', 'encoder.down_blocks.2.downsamplers.0.conv.weight'],
  ['encoder.mid.block_1.norm1.weight', 'encoder.mid_block.resnets.0.norm1.weight'],
  ['encoder.mid.attn_1.q.weight', 'encoder.mid_block.attentions.0.to_q.weight'],
  ['encoder.mid.attn_1.proj_out.bias', 'encoder.mid_block.attentions.0.to_out.0.bias'],
  ['encoder.mid.attn_1.norm.weight', 'encoder.mid_block.attentions.0.group_norm.weight'],
  ['encoder.norm_out.bias', 'encoder.conv_norm_out.bias'],
  ['decoder.mid.block_2.conv1.weight', 'decoder.mid_block.resnets.1.conv1.weight'],
  ['decoder.up.0.block.2.conv2.weight', 'decoder.up_blocks.3.resnets.2.conv2.weight'],
  ['decoder.up.3.upsample.conv.weight', 'decoder.up_blocks.0.upsamplers.0.conv.weight'],
  ['decoder.up.1.block.0.nin_shortcut.bias', 'decoder.up_blocks.2.resnets.0.conv_shortcut.bias'],
  ['quant_conv.weight', 'quant_conv.weight'],
  ['post_quant_conv.bias', 'post_quant_conv.bias'],
];

describe('single-file <-> diffusers names', () => {
  it('UNet, both directions (SD 1.x/2.x layout)', () => {
    for (const [orig, diff] of UNET_PAIRS) {
      assert.equal(unetToDiffusers(orig), diff, orig);
      assert.equal(unetFromDiffusers(diff), orig, diff);
    }
  });

  it('UNet of a tiny two-block layout (1 layer per block)', () => {
    const tiny = { blocks: 2, layersPerBlock: 1, downAttention: [true, false], upAttention: [false, true] };
    const pairs: [string, string][] = [
      ['input_blocks.1.1.proj_in.weight', 'down_blocks.0.attentions.0.proj_in.weight'],
      ['input_blocks.2.0.op.weight', 'down_blocks.0.downsamplers.0.conv.weight'],
      ['input_blocks.3.0.in_layers.0.weight', 'down_blocks.1.resnets.0.norm1.weight'],
      ['output_blocks.1.0.in_layers.2.weight', 'up_blocks.0.resnets.1.conv1.weight'],
      ['output_blocks.1.1.conv.weight', 'up_blocks.0.upsamplers.0.conv.weight'],
      ['output_blocks.3.1.proj_out.bias', 'up_blocks.1.attentions.1.proj_out.bias'],
    ];
    for (const [orig, diff] of pairs) {
      assert.equal(unetToDiffusers(orig, tiny), diff, orig);
      assert.equal(unetFromDiffusers(diff, tiny), orig, diff);
    }
    assert.throws(() => unetToDiffusers('input_blocks.9.0.weight', tiny), /matches no known block/);
  });

  it('VAE, including the 1x1-conv attention projections', () => {
    for (const [orig, diff] of VAE_PAIRS) {
      assert.equal(vaeToDiffusers(orig), diff, orig);
      assert.equal(vaeFromDiffusers(diff), orig, diff);
    }
    assert.ok(isVaeAttentionProjection('decoder.mid_block.attentions.0.to_out.0.weight'));
    assert.ok(!isVaeAttentionProjection('decoder.mid_block.attentions.0.to_out.0.bias'));
    assert.equal(SD_UNET.blocks, 4);
  });

  it('text encoders: SD1 CLIP prefix, SD2 OpenCLIP renames and fused q/k/v split', () => {
    assert.equal(clipToDiffusers('text_model.encoder.layers.0.mlp.fc1.weight'), 'text_model.encoder.layers.0.mlp.fc1.weight');
    assert.equal(clipToDiffusers('embeddings.position_ids'), 'text_model.embeddings.position_ids');
    assert.deepEqual(openClipToDiffusers('transformer.resblocks.3.attn.in_proj_weight'), {
      names: [
        'text_model.encoder.layers.3.self_attn.q_proj.weight',
        'text_model.encoder.layers.3.self_attn.k_proj.weight',
        'text_model.encoder.layers.3.self_attn.v_proj.weight',
      ],
      split: true,
    });
    assert.deepEqual(openClipToDiffusers('transformer.resblocks.0.mlp.c_proj.bias')?.names, ['text_model.encoder.layers.0.mlp.fc2.bias']);
    assert.deepEqual(openClipToDiffusers('positional_embedding')?.names, ['text_model.embeddings.position_embedding.weight']);
    assert.deepEqual(openClipToDiffusers('ln_final.weight')?.names, ['text_model.final_layer_norm.weight']);
    assert.equal(openClipToDiffusers('text_projection'), null);
    assert.throws(() => openClipToDiffusers('visual.conv1.weight'), /not part of SD2's text encoder/);
  });
});
