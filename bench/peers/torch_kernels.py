"""PyTorch peer for bench/kernels-node.ts: the shapes of bench/shapes.json, timed like ours: R back-to-back
runs per measurement (R fills --target-ms), median of <reps> measurements after a warm-up.
f32 with TF32 off; fp16 where the device has it (CUDA). On CUDA the time is CUDA events around the R runs;
on the CPU it is wall time (torch has no fast CPU fp16 path in 1.x: fp16 is reported as not run).
Attention: scaled_dot_product_attention (torch >= 2.0; flash / memory-efficient kernels on CUDA) and the
naive softmax(QKᵀ/√d)V, forward and forward+backward.
Prints one JSON line. Usage: python3 bench/peers/torch_kernels.py <full|quick> <reps> [--device cpu|cuda]
[--dtypes f32,f16] [--target-ms 5] [--only id,id]"""
import argparse
import json
import math
import os
import statistics
import time

import torch

ap = argparse.ArgumentParser()
ap.add_argument("size", choices=["full", "quick"])
ap.add_argument("reps", type=int)
ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
ap.add_argument("--dtypes", default="f32,f16")
ap.add_argument("--target-ms", type=float, default=5.0)
ap.add_argument("--only", default="")
args = ap.parse_args()

shapes = json.load(open(os.path.join(os.path.dirname(__file__), "..", "shapes.json")))[args.size]
if args.only:
    shapes = [c for c in shapes if c["id"] in args.only.split(",")]
cuda = args.device.startswith("cuda")
if cuda and not torch.cuda.is_available():
    print(json.dumps({"error": "no CUDA device"}))
    raise SystemExit(0)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = torch.device(args.device)
sdpa = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
not_run = {}


def cpu_blas_gflops():
    """f32 GEMM rate of this torch on the CPU (512^3, best of 5): Debian's python3-torch falls back to the reference
    BLAS (libblas3, a few GFLOP/s) when libopenblas is missing, which would flatter every ratio against it."""
    a = torch.randn(512, 512)
    a @ a
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t0)
    return 2 * 512**3 / best / 1e9


blas_gflops = None if cuda else cpu_blas_gflops()
if blas_gflops is not None and blas_gflops < 20:
    not_run["fast CPU BLAS"] = (
        f"torch's CPU GEMM runs at {blas_gflops:.1f} GFLOP/s: the reference BLAS? install libopenblas0-pthread, "
        "or every ratio against this peer flatters ours"
    )
if sdpa is None:
    not_run["torch sdpa"] = f"torch {torch.__version__} has no scaled_dot_product_attention (added in 2.0)"


def sync():
    if cuda:
        torch.cuda.synchronize()


def measure(fn, n):
    """Milliseconds of n back-to-back runs (CUDA events on a GPU, wall time on the CPU)."""
    sync()
    if cuda:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) * 1e3


def timed(fn):
    fn()  # warm-up
    one = measure(fn, 1)
    repeat = max(1, min(500, int(args.target_ms / max(one, 1e-3))))
    per_run = [one] if repeat == 1 else []
    while len(per_run) < args.reps:
        per_run.append(measure(fn, repeat) / repeat)
    return {"ms": statistics.median(per_run), "all": per_run, "repeat": repeat}


out = []
for name in args.dtypes.split(","):
    dtype = {"f32": torch.float32, "f16": torch.float16}[name]
    if name == "f16" and not cuda:
        not_run[f"torch {name}"] = "fp16 not run on the CPU (no fast CPU fp16 kernels in this torch)"
        continue

    def r(*s):
        return torch.randn(*s, device=dev, dtype=dtype) * 0.5

    def add(c, impl, pass_, fn):
        out.append({"id": c["id"], "impl": impl, "pass": pass_, "dtype": name, **timed(fn)})

    with torch.no_grad():
        for c in shapes:
            if c["op"] == "matmul":
                a, b = r(c["M"], c["K"]), r(c["K"], c["N"])
                add(c, "torch", "fwd", lambda: a @ b)
            elif c["op"] == "conv":
                k = c.get("R", 3)
                x, w, bias = r(1, c["C"], c["H"], c["W"]), r(c["C"], c["C"], k, k), r(c["C"])
                add(c, "torch", "fwd", lambda: torch.nn.functional.conv2d(x, w, bias, padding=(k - 1) // 2))
    for c in [c for c in shapes if c["op"] == "attention"]:
        q, k, v = r(1, c["H"], c["N"], c["D"]), r(1, c["H"], c["M"], c["D"]), r(1, c["H"], c["M"], c["D"])
        do = r(1, c["H"], c["N"], c["D"])
        scale = 1 / math.sqrt(c["D"])

        def naive(q, k, v):
            return torch.softmax((q @ k.transpose(-1, -2)) * scale, -1) @ v

        impls = [("torch naive", naive)] + ([("torch sdpa", sdpa)] if sdpa else [])
        for impl, f in impls:
            with torch.no_grad():
                add(c, impl, "fwd", lambda: f(q, k, v))
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

            def fb():
                y = f(qg, kg, vg)
                torch.autograd.grad(y, (qg, kg, vg), do)

            add(c, impl, "fwdbwd", fb)

device_name = torch.cuda.get_device_name(0) if cuda else f"CPU ({torch.get_num_threads()} threads)"
print(json.dumps({"device": device_name, "torch": torch.__version__, "time": "CUDA events" if cuda else "wall (CPU)", "cpuBlasGflops": blas_gflops, "notRun": not_run, "results": out}))
