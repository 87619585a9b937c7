"""PyTorch peer of bench/step.ts at SD 1.5's real widths: seconds per DreamBooth step, in plain torch.

The model is SD 1.5's UNet2DConditionModel (src/models/shapes.ts SD15.unet: block_out_channels
[320, 640, 1280, 1280], 2 layers per block, 8 heads, cross-attention dim 768, 32 groups, 1x1-conv
proj_in / proj_out, down attention [T, T, T, F], up attention [F, T, T, T]; 859,520,964 parameters) written
as torch modules with diffusers' parameter names (diffusers itself is not needed), with random weights as
bench/step.ts gives ours: fan-in scaled normals for matrices and kernels, norm scales 1, biases 0.

One step = DreamBoothTrainer.trainStep (src/train/trainer.ts) with TRAIN_DEFAULTS:
  batch = [instance i, class] (prior preservation), i = step mod 2; latents [2, 4, px/8, px/8], context [2, 77, 768]
  eps ~ N(0, I), t ~ U{0..999} per sample; x_t = sqrt(a_t) x0 + sqrt(1 - a_t) eps; target = eps
  loss = mse(pred_inst, eps_inst) + prior_weight * mse(pred_class, eps_class)
  backward, clip_grad_norm_(1.0), AdamW (betas 0.9 / 0.999, eps 1e-8, weight decay 1e-2; lr 1e-4 LoRA, 5e-6 full)
LoRA (src/nn/lora.ts): rank 8 / alpha 8 adapters (PEFT init: A kaiming-uniform, B = 0) on to_q, to_k, to_v,
to_out.0 of attn1 and attn2 of every transformer block, y = x W^T + b + (alpha / r) (x A^T) B^T, base frozen.
Full: every UNet weight trained.
--checkpointing: torch.utils.checkpoint around each ResNet (with its time_emb_proj) and each Transformer2D
(norm, proj_in, the block, proj_out), the granularity of src/nn/unet.ts's `segment`; non-reentrant where the
torch version has use_reentrant.

Precision: --dtype f32 (default; TF32 off) computes everything in float32, attention as
softmax(Q K^T / sqrt(d)) V per head. --amp fp16 (CUDA only) is a PyTorch user's default mixed precision:
f32 weights, torch.autocast fp16, GradScaler, and F.scaled_dot_product_attention where torch has it (>= 2.0).

Run: /usr/bin/python3 bench/peers/torch_step.py --mode lora|full [--px 64] [--steps 5] [--warmup 1]
       [--threads N] [--checkpointing] [--device cpu|cuda] [--dtype f32 | --amp fp16] [--check] [--expect-params N]
Prints one JSON object (last line)."""
import argparse
import inspect
import json
import math
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

# SD 1.5's UNet config (src/models/shapes.ts SD15.unet).
CHANNELS = [320, 640, 1280, 1280]
LAYERS = 2
HEADS = 8
CROSS_DIM = 768
GROUPS = 32
DOWN_ATTN = [True, True, True, False]
UP_ATTN = [False, True, True, True]
TEMB = 4 * CHANNELS[0]
CONTEXT_TOKENS = 77
RES_EPS, TRANSFORMER_NORM_EPS, LN_EPS = 1e-5, 1e-6, 1e-5

# src/train/trainer.ts TRAIN_DEFAULTS (with src/ops/adamw.ts ADAMW_DEFAULTS' betas and eps).
DEFAULTS = {
    "lora": dict(lr=1e-4, rank=8, alpha=8, prior_weight=1.0, max_grad_norm=1.0, weight_decay=1e-2),
    "full": dict(lr=5e-6, prior_weight=1.0, max_grad_norm=1.0, weight_decay=1e-2),
}
BETAS, ADAM_EPS = (0.9, 0.999), 1e-8

HAS_SDPA = hasattr(F, "scaled_dot_product_attention")
HAS_NON_REENTRANT = "use_reentrant" in inspect.signature(torch.utils.checkpoint.checkpoint).parameters


class LoraLinear(nn.Linear):
    """nn.Linear plus an optional PEFT adapter: y = x W^T + b + scale (x A^T) B^T (A [r, in], B [out, r])."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lora_A = self.lora_B = None  # instance attributes: add_adapter's modules then replace them
        self.lora_scale = 1.0

    def add_adapter(self, rank, alpha):
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=self.weight.device)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=self.weight.device)
        # PEFT's init (src/nn/lora.ts initLora): A ~ U(-1/sqrt(in), 1/sqrt(in)), B = 0.
        bound = 1 / math.sqrt(self.in_features)
        nn.init.uniform_(self.lora_A.weight, -bound, bound)
        nn.init.zeros_(self.lora_B.weight)
        self.lora_scale = alpha / rank

    def forward(self, x):
        y = super().forward(x)
        if self.lora_A is not None:
            y = y + self.lora_scale * self.lora_B(self.lora_A(x))
        return y


class Attention(nn.Module):
    """diffusers Attention (no q/k/v bias; to_out.0 with bias), `heads` heads over the channels."""

    def __init__(self, c, kv_dim, heads, use_sdpa):
        super().__init__()
        self.heads, self.use_sdpa = heads, use_sdpa
        self.to_q = LoraLinear(c, c, bias=False)
        self.to_k = LoraLinear(kv_dim, c, bias=False)
        self.to_v = LoraLinear(kv_dim, c, bias=False)
        self.to_out = nn.ModuleList([LoraLinear(c, c)])

    def forward(self, x, context):
        b, n, c = x.shape
        m = context.shape[1]
        split = lambda t, tokens: t.view(b, tokens, self.heads, c // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.to_q(x), n), split(self.to_k(context), m), split(self.to_v(context), m)
        if self.use_sdpa:
            a = F.scaled_dot_product_attention(q, k, v)
        else:
            # softmax(Q K^T / sqrt(d)) V per head [b, heads, n, d] (f32 in the f32 path).
            a = torch.softmax(q @ k.transpose(-1, -2) * (1 / math.sqrt(c // self.heads)), dim=-1) @ v
        return self.to_out[0](a.transpose(1, 2).reshape(b, n, c))


class FeedForward(nn.Module):
    """GEGLU feed-forward: net.0.proj [8c, c] -> hidden * gelu(gate) -> net.2 [c, 4c]."""

    def __init__(self, c):
        super().__init__()
        self.net = nn.ModuleDict({"0": nn.Module(), "2": nn.Linear(4 * c, c)})
        self.net["0"].proj = nn.Linear(c, 8 * c)

    def forward(self, x):
        hidden, gate = self.net["0"].proj(x).chunk(2, dim=-1)
        return self.net["2"](hidden * F.gelu(gate))


class BasicTransformerBlock(nn.Module):
    def __init__(self, c, heads, use_sdpa):
        super().__init__()
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(c, eps=LN_EPS) for _ in range(3))
        self.attn1 = Attention(c, c, heads, use_sdpa)
        self.attn2 = Attention(c, CROSS_DIM, heads, use_sdpa)
        self.ff = FeedForward(c)

    def forward(self, h, context):
        n = self.norm1(h)
        h = h + self.attn1(n, n)
        h = h + self.attn2(self.norm2(h), context)
        return h + self.ff(self.norm3(h))


class Transformer2D(nn.Module):
    """GroupNorm, 1x1-conv proj_in, one BasicTransformerBlock over the h*w tokens, 1x1-conv proj_out, residual."""

    def __init__(self, c, heads, use_sdpa):
        super().__init__()
        self.norm = nn.GroupNorm(GROUPS, c, eps=TRANSFORMER_NORM_EPS)
        self.proj_in = nn.Conv2d(c, c, 1)
        self.transformer_blocks = nn.ModuleList([BasicTransformerBlock(c, heads, use_sdpa)])
        self.proj_out = nn.Conv2d(c, c, 1)

    def forward(self, x, context):
        b, c, hh, ww = x.shape
        h = self.proj_in(self.norm(x)).view(b, c, hh * ww).transpose(1, 2)
        h = self.transformer_blocks[0](h, context)
        return self.proj_out(h.transpose(1, 2).reshape(b, c, hh, ww)) + x


class ResnetBlock2D(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.norm1 = nn.GroupNorm(GROUPS, cin, eps=RES_EPS)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.time_emb_proj = nn.Linear(TEMB, cout)
        self.norm2 = nn.GroupNorm(GROUPS, cout, eps=RES_EPS)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x, emb_act):
        h = self.conv1(F.silu(self.norm1(x))) + self.time_emb_proj(emb_act)[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return (self.conv_shortcut(x) if self.conv_shortcut is not None else x) + h


class Sampler(nn.Module):
    def __init__(self, c, stride):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, stride=stride, padding=1)


class Block(nn.Module):
    def __init__(self, resnets, attentions, sampler):
        super().__init__()
        self.resnets = nn.ModuleList(resnets)
        if attentions:
            self.attentions = nn.ModuleList(attentions)
        if sampler is not None:
            setattr(self, "downsamplers" if sampler.conv.stride[0] == 2 else "upsamplers", nn.ModuleList([sampler]))


class TimestepEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear_1 = nn.Linear(CHANNELS[0], TEMB)
        self.linear_2 = nn.Linear(TEMB, TEMB)


class UNet(nn.Module):
    """SD 1.5's UNet2DConditionModel with diffusers' parameter names (the forward of src/nn/unet.ts)."""

    def __init__(self, use_sdpa):
        super().__init__()
        self.time_embedding = TimestepEmbedding()
        self.conv_in = nn.Conv2d(4, CHANNELS[0], 3, padding=1)
        skips, cin = [CHANNELS[0]], CHANNELS[0]
        down = []
        for i, c in enumerate(CHANNELS):
            resnets, attns = [], []
            for _ in range(LAYERS):
                resnets.append(ResnetBlock2D(cin, c))
                cin = c
                if DOWN_ATTN[i]:
                    attns.append(Transformer2D(c, HEADS, use_sdpa))
                skips.append(c)
            last = i == len(CHANNELS) - 1
            down.append(Block(resnets, attns, None if last else Sampler(c, 2)))
            if not last:
                skips.append(c)
        self.down_blocks = nn.ModuleList(down)
        top = CHANNELS[-1]
        self.mid_block = Block([ResnetBlock2D(top, top), ResnetBlock2D(top, top)], [Transformer2D(top, HEADS, use_sdpa)], None)
        up = []
        for i, c in enumerate(reversed(CHANNELS)):
            resnets, attns = [], []
            for _ in range(LAYERS + 1):
                resnets.append(ResnetBlock2D(cin + skips.pop(), c))
                cin = c
                if UP_ATTN[i]:
                    attns.append(Transformer2D(c, HEADS, use_sdpa))
            up.append(Block(resnets, attns, None if i == len(CHANNELS) - 1 else Sampler(c, 1)))
        self.up_blocks = nn.ModuleList(up)
        self.conv_norm_out = nn.GroupNorm(GROUPS, CHANNELS[0], eps=RES_EPS)
        self.conv_out = nn.Conv2d(CHANNELS[0], 4, 3, padding=1)
        self.checkpointing = False

    def segment(self, module, *inputs):
        """Activation checkpointing at src/nn/unet.ts's granularity: one ResNet or one Transformer2D."""
        if not (self.checkpointing and torch.is_grad_enabled()):
            return module(*inputs)
        if HAS_NON_REENTRANT:
            return torch.utils.checkpoint.checkpoint(module, *inputs, use_reentrant=False)
        return torch.utils.checkpoint.checkpoint(module, *inputs)  # the caller made the sample require grad

    def forward(self, sample, timesteps, context):
        # Sinusoidal time embedding (flip_sin_to_cos, shift 0: [cos | sin]) -> linear -> SiLU -> linear.
        half = CHANNELS[0] // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, device=sample.device, dtype=torch.float32) / half)
        arg = timesteps.float()[:, None] * freqs[None]
        t_emb = torch.cat([torch.cos(arg), torch.sin(arg)], dim=-1)
        te = self.time_embedding
        emb_act = F.silu(te.linear_2(F.silu(te.linear_1(t_emb))))  # ResNets take SiLU of the embedding
        x = self.conv_in(sample)
        skips = [x]
        for i, block in enumerate(self.down_blocks):
            for j in range(LAYERS):
                x = self.segment(block.resnets[j], x, emb_act)
                if DOWN_ATTN[i]:
                    x = self.segment(block.attentions[j], x, context)
                skips.append(x)
            if i < len(CHANNELS) - 1:
                x = block.downsamplers[0].conv(x)
                skips.append(x)
        mid = self.mid_block
        x = self.segment(mid.resnets[0], x, emb_act)
        x = self.segment(mid.attentions[0], x, context)
        x = self.segment(mid.resnets[1], x, emb_act)
        for i, block in enumerate(self.up_blocks):
            for j in range(LAYERS + 1):
                x = self.segment(block.resnets[j], torch.cat([x, skips.pop()], dim=1), emb_act)
                if UP_ATTN[i]:
                    x = self.segment(block.attentions[j], x, context)
            if i < len(CHANNELS) - 1:
                x = block.upsamplers[0].conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))
        return self.conv_out(F.silu(self.conv_norm_out(x)))


@torch.no_grad()
def init_weights(unet, gen):
    """bench/step.ts's sd15Model values: fan-in scaled normals (std 1/sqrt(numel/out)), norm scales 1, biases 0."""
    for name, p in unet.named_parameters():
        if p.dim() > 1:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.numel() / p.shape[0]))
        elif "norm" in name.split(".")[-2] and name.endswith(".weight"):
            p.fill_(1.0)
        else:
            p.zero_()


def blas_in_use():
    """The BLAS library this process mapped (Debian's torch calls whatever libblas.so.3 the system's alternative
    names: the reference BLAS runs matmuls some 20x slower than OpenBLAS), or what torch was built with."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}  # the mapped files
        libs = sorted(p for p in paths if any(k in os.path.basename(p) for k in ("blas", "libmkl")))
        if libs:
            return ", ".join(libs)
    except OSError:
        pass
    cfg = torch.__config__.show()
    return next((part.split("=", 1)[1] for part in cfg.replace(",", " ").split() if part.startswith("BLAS_INFO=")), "unknown")


def matmul_gflops(device, sync):
    """f32 1024x1024x1024 matmul rate on `device`, best of 3 (GFLOP/s): what the linear layers can reach here."""
    a, b = torch.randn(1024, 1024, device=device), torch.randn(1024, 1024, device=device)
    best = math.inf
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * 1024**3 / best / 1e9


def alphas_cumprod(T=1000):
    """SD's scaled_linear schedule (src/sample/schedulers.ts SD_SCHEDULE): betas linspace(sqrt .00085, sqrt .012)^2."""
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, T, dtype=torch.float64) ** 2
    return torch.cumprod(1 - betas, 0).float()


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["lora", "full"], required=True)
    ap.add_argument("--px", type=int, default=64, help="image size in pixels (latents px/8, a multiple of 64)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    precision = ap.add_mutually_exclusive_group()
    precision.add_argument("--dtype", choices=["f32"], default="f32")
    precision.add_argument("--amp", choices=["fp16"], default=None)
    ap.add_argument("--check", action="store_true", help="assert finite losses and that the trained weights moved")
    ap.add_argument("--expect-params", type=int, default=None, help="fail unless the UNet has this many parameters")
    a = ap.parse_args()
    if a.px % 64:
        ap.error(f"--px {a.px}: the latent side px/8 must be a multiple of 8 (three 2x downsamplers)")
    if a.amp and a.device != "cuda":
        ap.error("--amp fp16 needs --device cuda (CPU autocast has no fp16)")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False")
    return a


def main():
    a = parse_args()
    s = DEFAULTS[a.mode]
    torch.set_num_threads(a.threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device(a.device)
    gen = torch.Generator().manual_seed(0)

    unet = UNet(use_sdpa=bool(a.amp) and HAS_SDPA)
    init_weights(unet, gen)
    params = sum(p.numel() for p in unet.parameters())
    if a.expect_params is not None and params != a.expect_params:
        sys.exit(f"the torch UNet has {params} parameters, ours {a.expect_params}: the structures differ")
    unet.to(dev)
    unet.checkpointing = a.checkpointing
    if a.mode == "lora":
        unet.requires_grad_(False)
        for name, m in unet.named_modules():
            if isinstance(m, LoraLinear) and ".transformer_blocks." in name:
                m.add_adapter(s["rank"], s["alpha"])
        trained = [p for n, p in unet.named_parameters() if ".lora_" in n]
    else:
        trained = list(unet.parameters())
    opt = torch.optim.AdamW(trained, lr=s["lr"], betas=BETAS, eps=ADAM_EPS, weight_decay=s["weight_decay"])
    scaler = torch.cuda.amp.GradScaler() if a.amp else None

    # bench/step.ts's sampleData: two instance samples and one class sample, each with its own context.
    lat = a.px // 8
    inst = torch.randn(2, 4, lat, lat, generator=gen).to(dev)
    cls = torch.randn(1, 4, lat, lat, generator=gen).to(dev)
    ctx_inst = torch.randn(2, CONTEXT_TOKENS, CROSS_DIM, generator=gen).to(dev)
    ctx_cls = torch.randn(1, CONTEXT_TOKENS, CROSS_DIM, generator=gen).to(dev)
    acp = alphas_cumprod().to(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def step(i):
        x0 = torch.cat([inst[i % 2 : i % 2 + 1], cls])
        context = torch.cat([ctx_inst[i % 2 : i % 2 + 1], ctx_cls])
        eps = torch.randn(2, 4, lat, lat, generator=gen).to(dev)
        t = torch.randint(0, 1000, (2,), generator=gen).to(dev)
        at = acp[t].view(2, 1, 1, 1)
        xt = at.sqrt() * x0 + (1 - at).sqrt() * eps
        if a.checkpointing and not HAS_NON_REENTRANT:
            xt.requires_grad_()  # reentrant checkpoints pass gradients only to inputs that require them
        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=bool(a.amp)):
            pred = unet(xt, t, context)
        per = ((pred.float() - eps) ** 2).mean(dim=(1, 2, 3))
        loss = per[0] + s["prior_weight"] * per[1]
        opt.zero_grad(set_to_none=True)
        if scaler:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(trained, s["max_grad_norm"])
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, s["max_grad_norm"])
            opt.step()
        return loss.item()

    # --check: the first trained tensor of the last kind (LoRA: a lora_B, zero at start) must move.
    probe = trained[-1]
    probe_before = probe.detach().clone() if a.check else None
    losses = []
    for i in range(a.warmup):
        losses.append(step(i))
    if dev.type == "cuda":
        sync()
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for i in range(a.steps):
        sync()
        t0 = time.perf_counter()
        losses.append(step(a.warmup + i))
        sync()
        times.append(time.perf_counter() - t0)
    if a.check:
        assert all(math.isfinite(x) for x in losses), f"non-finite loss: {losses}"
        moved = (probe.detach() - probe_before).abs().max().item()
        assert moved > 0, "the trained weights did not change"
        print(f"check: {len(losses)} finite losses {[round(x, 4) for x in losses]}; last trained tensor moved by up to {moved:.3g}", file=sys.stderr)
    out = {
        "impl": f"pytorch-{a.device}",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": "float32",
        "amp": a.amp,
        "attention": "sdpa" if unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.use_sdpa else "softmax(QK^T/sqrt(d))V",
        "mode": a.mode,
        "px": a.px,
        "checkpointing": a.checkpointing,
        "checkpointReentrant": a.checkpointing and not HAS_NON_REENTRANT,
        "trainable": sum(p.numel() for p in trained),
        "params": params,
        "steps": a.steps,
        "warmup": a.warmup,
        "blas": blas_in_use() if dev.type == "cpu" else "cuBLAS",
        "matmulGflops": round(matmul_gflops(dev, sync), 1),
        "medianS": statistics.median(times),
        "all": times,
        "lastLoss": losses[-1],
    }
    if dev.type == "cuda":
        out["peak_bytes"] = torch.cuda.max_memory_allocated(dev)
    else:
        out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    print(json.dumps(out))


if __name__ == "__main__":
    main()
