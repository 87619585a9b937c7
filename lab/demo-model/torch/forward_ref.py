"""Reference outputs of a written demo-model folder for torch/check.ts: the UNet, the VAE decoder and the text
encoder run in float64 by the golden generators' own forward functions (tests/fixtures/modules/gen_unet.py,
gen_vae.py, gen_clip.py: the PyTorch oracle the engine's modules are tested against), on the folder's fp16 weights
and seeded inputs. The generators write their fixtures when run, so their function definitions are taken out of
their source (imports and defs only, nothing at module level runs) and given the folder's config as the module
constants they read. The training modules (sd_modules.py, float32) are compared with them here too.

  python3 lab/demo-model/torch/forward_ref.py <model folder> <out.safetensors>
"""
import ast
import json
import os
import struct
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "..", "..", "tests", "fixtures")
sys.path.insert(0, HERE)
sys.path.insert(0, FIXTURES)
from sd_modules import clip_forward, unet_forward, vae_decode  # noqa: E402
from st import save  # noqa: E402


def golden_functions(name, **consts):
    """The imports and function definitions of tests/fixtures/modules/<name>.py, run with `consts` as globals."""
    path = os.path.join(FIXTURES, "modules", name + ".py")
    tree = ast.parse(open(path).read(), path)
    body = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef))]
    ns = dict(consts)
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), ns)
    return ns


def read_safetensors(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    header = json.loads(b[8:8 + n])
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        dt = {"F16": "<f2", "F32": "<f4"}[v["dtype"]]
        s, e = v["data_offsets"]
        out[k] = torch.from_numpy(np.frombuffer(b[8 + n + s:8 + n + e], dtype=dt).astype(np.float32).reshape(v["shape"]))
    return out


def main(model, out_path):
    cfg = {c: json.load(open(os.path.join(model, c, "config.json"))) for c in ("unet", "vae", "text_encoder")}
    w = {"unet": read_safetensors(os.path.join(model, "unet", "diffusion_pytorch_model.safetensors")),
         "vae": read_safetensors(os.path.join(model, "vae", "diffusion_pytorch_model.safetensors")),
         "text_encoder": read_safetensors(os.path.join(model, "text_encoder", "model.safetensors"))}
    u, v, te = cfg["unet"], cfg["vae"], cfg["text_encoder"]
    g = torch.Generator().manual_seed(49)
    side = u["sample_size"]
    sample = torch.randn(2, 4, side, side, generator=g)
    t = torch.tensor([10.0, 700.0])
    ctx = torch.randn(2, 77, u["cross_attention_dim"], generator=g)
    vf = 2 ** (len(v["block_out_channels"]) - 1)
    latents = torch.randn(1, v["latent_channels"], v["sample_size"] // vf, v["sample_size"] // vf, generator=g)
    ids = torch.randint(0, te["vocab_size"] - 2, (2, 77), generator=g)
    ids[:, 0] = te["vocab_size"] - 2  # <|startoftext|>, the last-but-one id of the demo tokenizers

    gu = golden_functions("gen_unet", CH=u["block_out_channels"], L=u["layers_per_block"], HEADS=u["attention_head_dim"],
                          CTX=u["cross_attention_dim"], G=u["norm_num_groups"],
                          DOWN_ATTN=[b.startswith("CrossAttn") for b in u["down_block_types"]],
                          UP_ATTN=[b.startswith("CrossAttn") for b in u["up_block_types"]])
    unet64 = gu["forward"](w["unet"], u.get("use_linear_projection", False), sample.double(), t, ctx.double())
    gv = golden_functions("gen_vae", CH=v["block_out_channels"], L=v["layers_per_block"], G=v["norm_num_groups"],
                          Z=v["latent_channels"], EPS=1e-6, W={k: x.double() for k, x in w["vae"].items()})
    decoded64 = gv["decode"](latents.double())
    gc = golden_functions("gen_clip")
    text64 = gc["forward"](te, w["text_encoder"], ids)

    # The float32 training modules against the float64 oracle: relative to each output's largest magnitude.
    with torch.no_grad():
        ours = {"unet": unet_forward(u, w["unet"], sample, t, ctx), "decoded": vae_decode(v, w["vae"], latents),
                "text": clip_forward(te, w["text_encoder"], ids)}
    for name, ref in (("unet", unet64), ("decoded", decoded64), ("text", text64)):
        err = (ours[name].double() - ref).abs().max().item() / ref.abs().max().item()
        print(f"sd_modules {name} (float32) vs golden forward (float64): max |diff| / max |ref| = {err:.2e}")
        if err > 1e-4:  # float32 through a few dozen layers: about 1e-6 relative; 1e-4 is a different computation
            raise SystemExit(f"sd_modules {name} differs from the golden generator's forward by {err:.2e} (over 1e-4)")
    save(out_path, {"sample": sample, "timestep": t, "encoder_hidden_states": ctx, "latents": latents, "input_ids": ids.float(),
                    "unet": unet64.float(), "decoded": decoded64.float(), "last_hidden_state": text64.float()})
    print(f"wrote {out_path}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: forward_ref.py <model folder> <out.safetensors>")
    main(sys.argv[1], sys.argv[2])
