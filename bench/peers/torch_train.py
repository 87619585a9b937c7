"""PyTorch CPU peer of bench/train.ts: seconds per DreamBooth step on the tiny SD1-style UNet, float32.

The UNet is tests/fixtures/modules/gen_unet.py's hand-written torch model (diffusers tensor names), taken
the way tests/fixtures/train/gen_train.py takes it (its functions and constants through `ast`, without
running its fixture writing). gen_unet.py computes in float64 for golden values; here its float64 casts are
rewritten to float32 (an AST pass over the same source), so the step runs in float32 like ours.

One step = the engine's trainer step: batch [instance, class] (prior preservation), noise and timesteps
drawn, x_t = sqrt(a_t) x0 + sqrt(1 - a_t) eps, epsilon or v target, per-sample weighted MSE (min-SNR-gamma
and prior weight where set), backward, clip_grad_norm_(max_grad_norm), AdamW. LoRA: rank/alpha adapters
(PEFT init) on every attention projection, base frozen; full: every UNet weight trained.

Run: /usr/bin/python3 bench/peers/torch_train.py --mode lora|full [--steps 10] [--warmup 2] ...
Prints one JSON object."""
import argparse
import ast
import json
import math
import os
import statistics
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
GEN_UNET = os.path.join(ROOT, "tests", "fixtures", "modules", "gen_unet.py")


class Float32(ast.NodeTransformer):
    """x.double() -> x.float(); torch.float64 -> torch.float32."""

    def visit_Attribute(self, node):
        self.generic_visit(node)
        if node.attr == "double":
            node.attr = "float"
        elif node.attr == "float64":
            node.attr = "float32"
        return node


def load_unet():
    sys.path.insert(0, os.path.join(ROOT, "tests", "fixtures"))  # gen_unet imports st.py from there
    tree = ast.parse(open(GEN_UNET).read())
    tree.body = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.Assign))]
    tree = ast.fix_missing_locations(Float32().visit(tree))
    ns = {"__file__": GEN_UNET}
    exec(compile(tree, "gen_unet.py", "exec"), ns)
    return ns


def alphas_cumprod(T=1000):
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, T, dtype=torch.float64) ** 2
    return torch.cumprod(1 - betas, 0).float()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["lora", "full"], required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--prediction", choices=["epsilon", "v_prediction"], default="epsilon")
    ap.add_argument("--min-snr", type=float, default=None)
    ap.add_argument("--prior-weight", type=float, default=1.0)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--weight-decay", type=float, default=1e-2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    unet = load_unet()
    gen = torch.Generator().manual_seed(0)
    w = unet["make_weights"](False, 5)  # == tests/fixtures/modules/unet_sd1.safetensors
    W = {k: v.float() for k, v in w.items()}
    scale = 1.0
    if a.mode == "lora":
        scale = a.alpha / a.rank
        params = {}
        for name in list(w):
            if any(name.endswith(p + ".weight") for p in (".to_q", ".to_k", ".to_v", ".to_out.0")):
                layer = name[: -len(".weight")]
                o, i = w[name].shape
                params[layer + ".lora_A.weight"] = ((torch.rand(a.rank, i, generator=gen) * 2 - 1) / math.sqrt(i)).requires_grad_()
                params[layer + ".lora_B.weight"] = torch.zeros(o, a.rank).requires_grad_()
        W.update(params)
    else:
        params = {k: v.clone().requires_grad_() for k, v in W.items()}
        W = params
    opt = torch.optim.AdamW(list(params.values()), lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=a.weight_decay)
    acp = alphas_cumprod()
    inst = torch.randn(2, 4, 8, 8, generator=gen)
    cls = torch.randn(1, 4, 8, 8, generator=gen)
    ctx = torch.randn(2, 7, 32, generator=gen)

    def step(s):
        x0 = torch.cat([inst[s % 2: s % 2 + 1], cls])
        eps = torch.randn(2, 4, 8, 8, generator=gen)
        t = torch.randint(0, 1000, (2,), generator=gen)
        at = acp[t].view(2, 1, 1, 1)
        xt = at.sqrt() * x0 + (1 - at).sqrt() * eps
        target = eps if a.prediction == "epsilon" else at.sqrt() * eps - (1 - at).sqrt() * x0
        pred = unet["forward"](w, False, xt, t.float(), ctx, W, lora_scale=scale)
        per = ((pred - target) ** 2).mean(dim=(1, 2, 3))
        wts = torch.ones(2)
        if a.min_snr is not None:
            snr = acp[t] / (1 - acp[t])
            wts = torch.minimum(snr, torch.full_like(snr, a.min_snr)) / (snr if a.prediction == "epsilon" else snr + 1)
        loss = wts[0] * per[0] + a.prior_weight * wts[1] * per[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if a.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(list(params.values()), a.max_grad_norm)
        opt.step()
        return loss.item()

    for s in range(a.warmup):
        step(s)
    times = []
    for s in range(a.steps):
        t0 = time.perf_counter()
        loss = step(a.warmup + s)
        times.append(time.perf_counter() - t0)
    print(json.dumps({
        "impl": "pytorch-cpu", "torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": "float32",
        "mode": a.mode, "trainable": sum(p.numel() for p in params.values()), "steps": a.steps, "warmup": a.warmup,
        "medianS": statistics.median(times), "all": times, "lastLoss": loss,
    }))


if __name__ == "__main__":
    main()
