"""The FLOPs a PyTorch DreamBooth step computes (the census's flops_useful, bench/census.ts): the SD 1.5 UNet and
step of bench/peers/torch_step.py (same modules, LoRA targets, loss), run on the `meta` device (shapes only: no
weights, no memory, no arithmetic), with every aten matmul and convolution, forward and backward, counted as 2
FLOPs per multiply-add. Autograd's requires_grad pruning decides which backward GEMMs exist: no input gradient
that reaches no trainable tensor, no weight gradient of a frozen weight. Attention is counted as torch_step.py's
f32 path computes it (Q K^T and P V as batched matmuls, and their gradients).

Run: /usr/bin/python3 bench/peers/torch_flops.py --cases lora-128-2,full-512-1 (mode-px-batch)
Prints one JSON object: {case: {"flops": total, "forward": ..., "backward": ..., "by_op": {...}}, ...}."""
import argparse
import json
import os
import sys

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_step as ts  # noqa: E402

aten = torch.ops.aten


def prod(xs):
    out = 1
    for x in xs:
        out *= int(x)
    return out


def conv_flops(out_shape, w_shape):
    # 2 * N * Co * Ho * Wo * (Ci / groups) * KH * KW
    return 2 * prod(out_shape) * prod(w_shape[1:])


class FlopCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.by_op = {}
        self.total = 0

    def add(self, name, n):
        self.by_op[name] = self.by_op.get(name, 0) + n
        self.total += n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet is aten.convolution_backward:
            # torch 1.13 has no meta kernel for it: its outputs have the input's, weight's and bias's shapes
            grad_out, inp, weight, mask = args[0], args[1], args[2], args[10]
            n = conv_flops(grad_out.shape, weight.shape)
            if mask[0]:
                self.add("conv_dx", n)
            if mask[1]:
                self.add("conv_dw", n)
            like = lambda t, on: torch.empty(t.shape, dtype=t.dtype, device="meta") if on else None  # noqa: E731
            bias = torch.empty(weight.shape[0], dtype=weight.dtype, device="meta") if mask[2] else None
            return like(inp, mask[0]), like(weight, mask[1]), bias
        out = func(*args, **kwargs)
        if packet is aten.mm:
            a, b = args[0], args[1]
            self.add("mm", 2 * a.shape[0] * a.shape[1] * b.shape[1])
        elif packet is aten.addmm:
            a, b = args[1], args[2]
            self.add("addmm", 2 * a.shape[0] * a.shape[1] * b.shape[1])
        elif packet in (aten.bmm, aten.baddbmm):
            a, b = (args[0], args[1]) if packet is aten.bmm else (args[1], args[2])
            self.add("bmm", 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2])
        elif packet is aten.convolution:
            self.add("conv", conv_flops(out.shape, args[1].shape))
        return out


def meta_modules():
    """Every parameterised layer torch_step.py builds is made on the meta device (shapes only)."""
    for cls in (nn.Linear, nn.Conv2d, nn.GroupNorm, nn.LayerNorm):
        orig = cls.__init__

        def init(self, *a, _orig=orig, **k):
            k.setdefault("device", "meta")
            _orig(self, *a, **k)

        cls.__init__ = init


def count(mode, px, batch):
    s = ts.DEFAULTS[mode]
    unet = ts.UNet(use_sdpa=False)
    if mode == "lora":
        unet.requires_grad_(False)
        for name, m in unet.named_modules():
            if isinstance(m, ts.LoraLinear) and ".transformer_blocks." in name:
                m.add_adapter(s["rank"], s["alpha"])
    lat = px // 8
    xt = torch.zeros(batch, 4, lat, lat, device="meta")
    eps = torch.zeros(batch, 4, lat, lat, device="meta")
    t = torch.zeros(batch, dtype=torch.long, device="meta")
    context = torch.zeros(batch, ts.CONTEXT_TOKENS, ts.CROSS_DIM, device="meta")
    counter = FlopCounter()
    with counter:
        pred = unet(xt, t, context)
        forward = counter.total
        loss = ((pred.float() - eps) ** 2).mean()
        loss.backward()
    return {"flops": counter.total, "forward": forward, "backward": counter.total - forward, "by_op": counter.by_op}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="lora-128-2")
    a = ap.parse_args()
    meta_modules()
    out = {}
    for case in a.cases.split(","):
        mode, px, batch = case.split("-")
        out[case] = count(mode, int(px), int(batch))
    out["torch"] = torch.__version__
    print(json.dumps(out))


if __name__ == "__main__":
    main()
