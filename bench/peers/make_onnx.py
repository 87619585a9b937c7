"""Graph-only ONNX models (every tensor a graph input, no weights) for the onnxruntime-web peer in
bench/kernels.html, one per benchmark shape. Run: /usr/bin/python3 bench/peers/make_onnx.py
Writes bench/models/<name>.onnx (a few hundred bytes each)."""
import json
import math
import os

import torch

OUT = os.path.join(os.path.dirname(__file__), "..", "models")
SHAPES = json.load(open(os.path.join(os.path.dirname(__file__), "..", "shapes.json")))


class MatMul(torch.nn.Module):
    def forward(self, a, b):
        return a @ b


class Conv(torch.nn.Module):
    def __init__(self, r):
        super().__init__()
        self.padding = (r - 1) // 2

    def forward(self, x, w, b):
        return torch.nn.functional.conv2d(x, w, b, stride=1, padding=self.padding)


class Attention(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.scale = 1 / math.sqrt(d)

    def forward(self, q, k, v):
        return torch.softmax((q @ k.transpose(-1, -2)) * self.scale, dim=-1) @ v


def export(name, module, inputs, names):
    path = os.path.join(OUT, f"{name}.onnx")
    torch.onnx.export(module, tuple(torch.zeros(s) for s in inputs), path, input_names=names, output_names=["y"], opset_version=17)
    print(path, os.path.getsize(path), "bytes")


os.makedirs(OUT, exist_ok=True)
for old in os.listdir(OUT):
    if old.endswith(".onnx"):
        os.remove(os.path.join(OUT, old))
for size in ("full", "quick"):
    for c in SHAPES[size]:
        tag = f"{size}-{c['id']}"
        if c["op"] == "matmul":
            export(tag, MatMul(), [[c["M"], c["K"]], [c["K"], c["N"]]], ["a", "b"])
        elif c["op"] == "conv":
            r = c.get("R", 3)
            export(tag, Conv(r), [[1, c["C"], c["H"], c["W"]], [c["C"], c["C"], r, r], [c["C"]]], ["x", "w", "b"])
        else:
            export(tag, Attention(c["D"]), [[c["H"], c["N"], c["D"]], [c["H"], c["M"], c["D"]], [c["H"], c["M"], c["D"]]], ["q", "k", "v"])
