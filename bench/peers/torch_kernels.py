"""PyTorch peer for bench/kernels-node.ts: the same shapes on CUDA (when present), f16 and f32
(TF32 off), median ms over reps after warm-up, timed with CUDA events. Prints one JSON line.
Usage: python3 bench/peers/torch_kernels.py <full|quick> <reps>"""
import json
import math
import os
import sys

import torch

size, reps = sys.argv[1], int(sys.argv[2])
shapes = json.load(open(os.path.join(os.path.dirname(__file__), "..", "shapes.json")))[size]
if not torch.cuda.is_available():
    print(json.dumps({"error": "no CUDA device"}))
    sys.exit(0)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = torch.device("cuda")


def timed(fn):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


out = []
for dtype in (torch.float16, torch.float32):
    name = "f16" if dtype == torch.float16 else "f32"
    for c in shapes:
        r = lambda *s: torch.randn(*s, device=dev, dtype=dtype) * 0.5  # noqa: E731
        if c["op"] == "matmul":
            a, b = r(c["M"], c["K"]), r(c["K"], c["N"])
            out.append({"id": c["id"], "impl": f"torch {name}", "ms": timed(lambda: a @ b)})
        elif c["op"] == "conv":
            x, w, bias = r(1, c["C"], c["H"], c["W"]), r(c["C"], c["C"], 3, 3), r(c["C"])
            out.append({"id": c["id"], "impl": f"torch {name}", "ms": timed(lambda: torch.nn.functional.conv2d(x, w, bias, padding=1))})
        else:
            q, k, v = r(1, c["H"], c["N"], c["D"]), r(1, c["H"], c["M"], c["D"]), r(1, c["H"], c["M"], c["D"])
            sdpa = torch.nn.functional.scaled_dot_product_attention
            out.append({"id": c["id"], "impl": f"torch sdpa {name}", "ms": timed(lambda: sdpa(q, k, v))})

            def naive():
                return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(c["D"]), -1) @ v
            out.append({"id": c["id"], "impl": f"torch naive {name}", "ms": timed(naive)})
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            do = r(1, c["H"], c["N"], c["D"])

            def fb():
                y = sdpa(qg, kg, vg)
                y.backward(do)
            out.append({"id": c["id"], "impl": f"torch sdpa fwd+bwd {name}", "ms": timed(fb)})
print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "results": out}))
