"""The demo model's three components in PyTorch, functional over a dict of weights named as diffusers names them
(the names and shapes come from the engine's src/models/shapes.ts through the data export), for any of the demo
model's configs (lab/demo-model/pretrain.ts PRETRAIN_SIZES). The math is that of the golden generators in
tests/fixtures/modules/gen_unet.py, gen_vae.py and gen_clip.py, generalised from their fixed tiny configs and
written in the weights' own dtype so it trains in float32 on a CPU or a GPU. Those generators cannot be imported
(each writes its fixture files when loaded, and their configs are module constants), so forward_ref.py runs their
own forward functions, float64, on the trained model and compares these against them.
"""
import math

import torch
import torch.nn.functional as F


def timestep_embedding(t, dim):
    """diffusers' Timesteps(dim, flip_sin_to_cos=True, downscale_freq_shift=0): [cos | sin] of t * 10000^(-i/half)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    e = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(e), torch.sin(e)], -1)


def _lin(W, x, n):
    y = x @ W[n + ".weight"].T
    return y + W[n + ".bias"] if n + ".bias" in W else y


def _conv(W, x, n, stride=1, padding=None):
    k = W[n + ".weight"].shape[-1]
    return F.conv2d(x, W[n + ".weight"], W[n + ".bias"], stride=stride, padding=k // 2 if padding is None else padding)


def unet_forward(cfg, W, sample, t, ctx):
    """UNet2DConditionModel: SD 1.x blocks (resnet with time embedding, spatial transformer with self- and
    cross-attention and a GEGLU MLP), attention_head_dim read as the number of heads, as SD 1.x configs mean it."""
    CH, L, G = cfg["block_out_channels"], cfg["layers_per_block"], cfg["norm_num_groups"]
    heads, linear_proj = cfg["attention_head_dim"], cfg.get("use_linear_projection", False)
    down_attn = [b.startswith("CrossAttn") for b in cfg["down_block_types"]]
    up_attn = [b.startswith("CrossAttn") for b in cfg["up_block_types"]]
    lin = lambda x, n: _lin(W, x, n)  # noqa: E731
    conv = lambda x, n, stride=1: _conv(W, x, n, stride)  # noqa: E731
    emb = lin(F.silu(lin(timestep_embedding(t, CH[0]), "time_embedding.linear_1")), "time_embedding.linear_2")

    def resnet(x, p):
        h = conv(F.silu(F.group_norm(x, G, W[p + ".norm1.weight"], W[p + ".norm1.bias"], 1e-5)), p + ".conv1")
        h = h + lin(F.silu(emb), p + ".time_emb_proj")[:, :, None, None]
        h = conv(F.silu(F.group_norm(h, G, W[p + ".norm2.weight"], W[p + ".norm2.bias"], 1e-5)), p + ".conv2")
        return (conv(x, p + ".conv_shortcut") if p + ".conv_shortcut.weight" in W else x) + h

    def attn(x, c, p):
        b, n, d = x.shape
        q = lin(x, p + ".to_q").view(b, n, heads, -1).transpose(1, 2)
        k = lin(c, p + ".to_k").view(b, c.shape[1], heads, -1).transpose(1, 2)
        v = lin(c, p + ".to_v").view(b, c.shape[1], heads, -1).transpose(1, 2)
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v
        return lin(a.transpose(1, 2).reshape(b, n, d), p + ".to_out.0")

    def transformer(x, p):
        b, c, hh, ww = x.shape
        h = F.group_norm(x, G, W[p + ".norm.weight"], W[p + ".norm.bias"], 1e-6)
        if linear_proj:
            h = lin(h.reshape(b, c, hh * ww).transpose(1, 2), p + ".proj_in")
        else:
            h = conv(h, p + ".proj_in").reshape(b, c, hh * ww).transpose(1, 2)
        tb = p + ".transformer_blocks.0"
        ln = lambda y, n: F.layer_norm(y, (c,), W[n + ".weight"], W[n + ".bias"], 1e-5)  # noqa: E731
        n1 = ln(h, tb + ".norm1")
        h = h + attn(n1, n1, tb + ".attn1")
        h = h + attn(ln(h, tb + ".norm2"), ctx, tb + ".attn2")
        hid, gate = lin(ln(h, tb + ".norm3"), tb + ".ff.net.0.proj").chunk(2, -1)
        h = h + lin(hid * F.gelu(gate), tb + ".ff.net.2")
        if linear_proj:
            h = lin(h, p + ".proj_out").transpose(1, 2).reshape(b, c, hh, ww)
        else:
            h = conv(h.transpose(1, 2).reshape(b, c, hh, ww), p + ".proj_out")
        return h + x

    x = conv(sample, "conv_in")
    skips = [x]
    for i in range(len(CH)):
        for j in range(L):
            x = resnet(x, f"down_blocks.{i}.resnets.{j}")
            if down_attn[i]:
                x = transformer(x, f"down_blocks.{i}.attentions.{j}")
            skips.append(x)
        if i < len(CH) - 1:
            x = conv(x, f"down_blocks.{i}.downsamplers.0.conv", 2)
            skips.append(x)
    x = resnet(transformer(resnet(x, "mid_block.resnets.0"), "mid_block.attentions.0"), "mid_block.resnets.1")
    for i in range(len(CH)):
        for j in range(L + 1):
            x = resnet(torch.cat([x, skips.pop()], 1), f"up_blocks.{i}.resnets.{j}")
            if up_attn[i]:
                x = transformer(x, f"up_blocks.{i}.attentions.{j}")
        if i < len(CH) - 1:
            x = conv(F.interpolate(x, scale_factor=2.0, mode="nearest"), f"up_blocks.{i}.upsamplers.0.conv")
    h = F.silu(F.group_norm(x, G, W["conv_norm_out.weight"], W["conv_norm_out.bias"], 1e-5))
    return conv(h, "conv_out")


def _vae_parts(cfg, W):
    CH, L, G, EPS = cfg["block_out_channels"], cfg["layers_per_block"], cfg["norm_num_groups"], 1e-6

    def conv(x, p, stride=1):
        k = W[p + ".weight"].shape[-1]
        return F.conv2d(x, W[p + ".weight"], W[p + ".bias"], stride=stride, padding=1 if (k == 3 and stride == 1) else 0)

    def norm_silu(x, p):
        return F.silu(F.group_norm(x, G, W[p + ".weight"], W[p + ".bias"], EPS))

    def resnet(x, p):
        h = conv(norm_silu(conv(norm_silu(x, p + ".norm1"), p + ".conv1"), p + ".norm2"), p + ".conv2")
        return (conv(x, p + ".conv_shortcut") if p + ".conv_shortcut.weight" in W else x) + h

    def attention(x, p):
        n, c, hh, ww = x.shape
        t = F.group_norm(x, G, W[p + ".group_norm.weight"], W[p + ".group_norm.bias"], EPS).reshape(n, c, hh * ww).transpose(1, 2)
        lin = lambda a, m: a @ W[p + "." + m + ".weight"].T + W[p + "." + m + ".bias"]  # noqa: E731
        q, k, v = lin(t, "to_q"), lin(t, "to_k"), lin(t, "to_v")
        o = lin(torch.softmax(q @ k.transpose(1, 2) / math.sqrt(c), -1) @ v, "to_out.0")
        return x + o.transpose(1, 2).reshape(n, c, hh, ww)

    def mid(x, p):
        return resnet(attention(resnet(x, p + ".mid_block.resnets.0"), p + ".mid_block.attentions.0"), p + ".mid_block.resnets.1")

    def encode(img):
        """The posterior's moments [mean | logvar] (quant_conv applied), as AutoencoderKL.encode computes them."""
        x = conv(img, "encoder.conv_in")
        for i in range(len(CH)):
            for j in range(L):
                x = resnet(x, f"encoder.down_blocks.{i}.resnets.{j}")
            if i < len(CH) - 1:
                x = conv(F.pad(x, (0, 1, 0, 1)), f"encoder.down_blocks.{i}.downsamplers.0.conv", 2)
        x = conv(norm_silu(mid(x, "encoder"), "encoder.conv_norm_out"), "encoder.conv_out")
        return conv(x, "quant_conv")

    def decode(z):
        x = mid(conv(conv(z, "post_quant_conv"), "decoder.conv_in"), "decoder")
        for i in range(len(CH)):
            for j in range(L + 1):
                x = resnet(x, f"decoder.up_blocks.{i}.resnets.{j}")
            if i < len(CH) - 1:
                x = conv(F.interpolate(x, scale_factor=2.0, mode="nearest"), f"decoder.up_blocks.{i}.upsamplers.0.conv")
        return conv(norm_silu(x, "decoder.conv_norm_out"), "decoder.conv_out")

    return encode, decode


def vae_encode(cfg, W, img):
    return _vae_parts(cfg, W)[0](img)


def vae_decode(cfg, W, z):
    return _vae_parts(cfg, W)[1](z)


def clip_forward(cfg, W, ids):
    """CLIPTextModel's last_hidden_state: pre-LN blocks, causal self-attention, final LayerNorm."""
    B, L = ids.shape
    D, H = cfg["hidden_size"], cfg["num_attention_heads"]
    dh, eps = D // H, cfg["layer_norm_eps"]
    x = W["text_model.embeddings.token_embedding.weight"][ids] + W["text_model.embeddings.position_embedding.weight"][:L]
    mask = torch.triu(torch.ones(L, L, dtype=torch.bool, device=ids.device), 1)
    act = (lambda t: t * torch.sigmoid(1.702 * t)) if cfg["hidden_act"] == "quick_gelu" else F.gelu
    for layer in range(cfg["num_hidden_layers"]):
        p = f"text_model.encoder.layers.{layer}."
        lin = lambda t, n: t @ W[p + n + ".weight"].T + W[p + n + ".bias"]  # noqa: E731
        h = F.layer_norm(x, (D,), W[p + "layer_norm1.weight"], W[p + "layer_norm1.bias"], eps)
        q, k, v = (lin(h, f"self_attn.{n}_proj").view(B, L, H, dh).transpose(1, 2) for n in ("q", "k", "v"))
        a = torch.softmax(((q @ k.transpose(-1, -2)) / math.sqrt(dh)).masked_fill(mask, float("-inf")), -1) @ v
        x = x + lin(a.transpose(1, 2).reshape(B, L, D), "self_attn.out_proj")
        h = F.layer_norm(x, (D,), W[p + "layer_norm2.weight"], W[p + "layer_norm2.bias"], eps)
        x = x + lin(act(lin(h, "mlp.fc1")), "mlp.fc2")
    return F.layer_norm(x, (D,), W["text_model.final_layer_norm.weight"], W["text_model.final_layer_norm.bias"], eps)
