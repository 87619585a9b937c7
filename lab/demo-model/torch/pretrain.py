"""The demo model's pretraining in PyTorch (issue 49): the engine's two stages (lab/demo-model/pretrain.ts) on the
data folder torch/export-data.ts wrote, on a CPU or a CUDA GPU, writing the diffusers folder `lab:pretrain` writes.

  1. the VAE as an autoencoder: decode(mean(encode(x))) against x, mean squared error, AdamW (vaeLr, weight
     decay 0.01, gradient norm clipped to 1), on whole pictures or random vaeCrop px crops; at its end the latent
     scale is 1 / std of the mean latents of the first 256 pictures and the log-variance rows of quant_conv are set
     to a constant -10 (the stage never trains them), as the engine's finishVae does;
  2. the UNet and the text encoder together on L = mean || target - unet(sqrt(a_t) z0 + sqrt(1 - a_t) eps, t,
     te(ids)) ||^2 (target v = sqrt(a_t) eps - sqrt(1 - a_t) z0, or eps), SD's scaled-linear schedule, captions
     dropped to "" with probability dropCaption and, among the rest, left without their background with
     probability bareShare; the text encoder's token and position tables stay frozen (token table N(0, tokenStd^2)),
     as the engine's CLIP has no embedding gradient. EMA of both (diffusers' warm-up decay min(emaDecay,
     (1 + n) / (10 + n)), applied every emaEvery steps raised to that power) is what ships.
Weights start from the engine's initialisation rule (LeCun normal, norms 1, biases 0, embeddings N(0, 0.02^2)),
drawn by torch from the run's seed: the same rule, not the same numbers (the engine's Rng is its own). Batches,
noise and timesteps are drawn on the CPU from the run's seed, so a CPU and a GPU run draw the same ones.

  python3 lab/demo-model/torch/pretrain.py --data <export> --out <run> [--steps N] [--vae-steps N] [--batch N] ...
  python3 lab/demo-model/torch/pretrain.py --resume <run> [--steps N] [--vae-steps N]     (other settings: the run's)
  python3 lab/demo-model/torch/pretrain.py --resume <run> --export                        (part-way model)

The run folder: settings.json, checkpoint.pt (every checkpointEvery steps and at each stage's end), loss.jsonl
(one line per step: stage, step, loss, seconds) and model/ (the diffusers folder, fp16) when the UNet stage ends.
"""
import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "tests", "fixtures"))
from sd_modules import clip_forward, unet_forward, vae_decode, vae_encode  # noqa: E402
from st import f16, save  # noqa: E402  (the fixtures' safetensors writer: F16 for f16-exact values)

DATA_FORMAT = "dbs-demo-pretrain-data/1"
# Settings by the engine's names (PretrainSettings), their defaults (PRETRAIN_DEFAULTS) and flags.
DEFAULTS = dict(seed=1, batch=16, vaeSteps=1500, vaeLr=1e-3, vaeCrop=0, steps=6000, lr=5e-4, emaDecay=0.999, emaEvery=10,
                dropCaption=0.1, checkpointEvery=250, tokenStd=1.0, prediction="v_prediction", bareShare=None)
FLAGS = {"seed": int, "batch": int, "vae-steps": int, "vae-lr": float, "vae-crop": int, "steps": int, "lr": float, "ema-decay": float,
         "ema-every": int, "drop-caption": float, "checkpoint-every": int, "token-std": float, "prediction": str, "bare-share": float}


def camel(flag):
    a, *rest = flag.split("-")
    return a + "".join(r.capitalize() for r in rest)


class Refused(Exception):
    pass


def check_settings(s, factor, resolution):
    """Refuses a setting the run cannot honour, naming it, before any work (the engine's checkPretrainSettings)."""
    def whole(k, lo, hi):
        v = s[k]
        if not isinstance(v, int) or v < lo or v > hi:
            raise Refused(f"{k} {v}: use a whole number from {lo} to {hi}")
    whole("seed", 0, 0xFFFFFFFF)
    whole("batch", 1, 256)
    whole("vaeSteps", 0, 10**7)
    whole("steps", 0, 10**7)
    whole("emaEvery", 1, 1000)
    whole("checkpointEvery", 0, 10**7)
    whole("vaeCrop", 0, resolution)
    if s["vaeCrop"] % factor:
        raise Refused(f"vaeCrop {s['vaeCrop']}: use 0 (whole pictures) or a multiple of the VAE's factor {factor} up to {resolution}")
    for k in ("vaeLr", "lr"):
        if not 0 < s[k] < 1:
            raise Refused(f"{k} {s[k]}: use a learning rate between 0 and 1 (e.g. 1e-3)")
    if not 0 <= s["emaDecay"] < 1:
        raise Refused(f"emaDecay {s['emaDecay']}: use a decay from 0 to below 1 (e.g. 0.999)")
    if not 0 <= s["dropCaption"] < 1:
        raise Refused(f"dropCaption {s['dropCaption']}: use a probability from 0 to below 1 (e.g. 0.1)")
    if s["bareShare"] is not None and not 0 <= s["bareShare"] <= 1:
        raise Refused(f"bareShare {s['bareShare']}: use a probability from 0 to 1 (e.g. 0.3)")
    if s["prediction"] not in ("epsilon", "v_prediction"):
        raise Refused(f"prediction {s['prediction']}: use epsilon or v_prediction")
    if not 0 < s["tokenStd"] <= 10:
        raise Refused(f"tokenStd {s['tokenStd']}: use a standard deviation above 0 and at most 10 (e.g. 1)")


def read_data(folder):
    """The export's manifest and arrays, each file checked against the SHA-256 the export recorded."""
    path = os.path.join(folder, "data.json")
    if not os.path.exists(path):
        raise Refused(f"--data {folder}: no data.json there; write the folder with lab/demo-model/torch/export-data.ts")
    m = json.load(open(path))
    if m.get("format") != DATA_FORMAT:
        raise Refused(f"--data {folder}: data.json's format is {m.get('format')!r}, not {DATA_FORMAT}: export it again")
    subject = {"shape": "star", "colour": "yellow", "pattern": "dotted", "second": "purple"}  # synthetic.ts SUBJECT_LOOK
    if (m.get("data") == "v1" and "star" not in m.get("exclude", [])) or (m.get("data") == "stars" and subject not in m.get("holdOut", [])):
        raise Refused(f"--data {folder}: its data.json ({m.get('data')}, exclude {m.get('exclude')}, holdOut {m.get('holdOut')}) would show "
                      "the DreamBooth subject's look in pretraining: export the data again with export-data.ts, which holds it out")
    raw = {}
    for name, digest in m["sha256"].items():
        b = open(os.path.join(folder, name), "rb").read()
        if hashlib.sha256(b).hexdigest() != digest:
            raise Refused(f"--data {folder}: {name} does not match data.json's SHA-256 (changed or cut short): export it again")
        raw[name] = b
    import gzip
    n, r = m["dataSize"], m["resolution"]
    pics = np.frombuffer(gzip.decompress(raw["pictures.u8.gz"]), dtype=np.uint8).reshape(n, r, r, 3)
    ids = np.frombuffer(raw["ids.i32"], dtype="<i4").reshape(n, 77)
    bare = np.frombuffer(raw["bare_ids.i32"], dtype="<i4").reshape(n, 77)
    return m, pics, ids, bare


def data_digest(m):
    return hashlib.sha256(json.dumps(m["sha256"], sort_keys=True).encode()).hexdigest()


def init_weights(params, gen, token_std):
    """The engine's rule (lab/demo-model/demo.ts initTensor): LeCun normal N(0, 1/fan_in) for matrices and kernels,
    norm scales 1, biases 0, embeddings N(0, 0.02^2), the token table N(0, tokenStd^2)."""
    out = {}
    for name, shape in params:
        if len(shape) == 1:
            out[name] = torch.ones(shape) if name.endswith(".weight") else torch.zeros(shape)
            continue
        std = 0.02 if "embedding" in name else 1 / math.sqrt(math.prod(shape[1:]))
        if name.endswith("token_embedding.weight"):
            std = token_std
        out[name] = torch.randn(shape, generator=gen) * std
    return out


def alphas_cumprod(sch):
    betas = torch.linspace(sch["beta_start"] ** 0.5, sch["beta_end"] ** 0.5, sch["num_train_timesteps"], dtype=torch.float64) ** 2
    return torch.cumprod(1 - betas, 0)


class Run:
    def __init__(self, run_dir, settings, data_dir, device):
        self.dir, self.s, self.device = run_dir, settings, torch.device(device)
        self.m, pics, ids, bare = read_data(data_dir)
        self.cfg = self.m["configs"]
        self.pics = torch.from_numpy(pics.copy()).to(self.device).permute(0, 3, 1, 2).float() / 127.5 - 1
        self.ids, self.bare = torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(bare.astype(np.int64))
        self.empty = torch.tensor(self.m["emptyIds"], dtype=torch.int64)
        self.gen = torch.Generator().manual_seed(settings["seed"])
        init = torch.Generator().manual_seed(settings["seed"] ^ 0x1517)
        self.W = {c: {k: v.to(self.device) for k, v in init_weights(self.m["params"][c], init, settings["tokenStd"]).items()}
                  for c in ("vae", "unet", "text_encoder")}
        self.acp = alphas_cumprod(self.cfg["scheduler"]).float()
        self.stage, self.step, self.scaling, self.ema, self.ema_updates, self.latents = "vae", 0, 1.0, {}, 0, None
        self.start_stage("vae" if settings["vaeSteps"] > 0 else "unet")

    def trainable(self, stage):
        comps = ["vae"] if stage == "vae" else ["unet", "text_encoder"]
        return {f"{c}/{n}": t for c in comps for n, t in self.W[c].items() if not (c == "text_encoder" and "embedding" in n)}

    def start_stage(self, stage):
        self.stage, self.step, self.opt = stage, 0, None
        if stage == "done":
            return
        if stage == "unet":
            self.make_latents()
        params = list(self.trainable(stage).values())
        for p in params:
            p.requires_grad_(True)
        lr = self.s["vaeLr"] if stage == "vae" else self.s["lr"]
        self.opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
        if stage == "unet":
            self.ema = {k: v.detach().clone() for k, v in self.trainable("unet").items()}

    def batch(self):
        return torch.randint(self.m["dataSize"], (self.s["batch"],), generator=self.gen)

    @torch.no_grad()
    def make_latents(self):
        """Every picture's scaled mean latent under the frozen VAE (the engine caches them as it meets them)."""
        C, out = self.cfg["vae"]["latent_channels"], []
        for i in range(0, self.m["dataSize"], 256):
            out.append(vae_encode(self.cfg["vae"], self.W["vae"], self.pics[i:i + 256])[:, :C] * self.scaling)
        self.latents = torch.cat(out)

    @torch.no_grad()
    def finish_vae(self):
        C = self.cfg["vae"]["latent_channels"]
        mean = vae_encode(self.cfg["vae"], self.W["vae"], self.pics[: min(256, self.m["dataSize"])])[:, :C].double()
        self.scaling = float(1 / max(mean.std(unbiased=False).item(), 1e-6))
        self.W["vae"]["quant_conv.weight"][C:] = 0
        self.W["vae"]["quant_conv.bias"][C:] = -10

    def vae_loss(self):
        idx, R, Cr = self.batch(), self.m["resolution"], self.s["vaeCrop"] or self.m["resolution"]
        x = self.pics[idx.to(self.device)]
        if Cr != R:
            offs = torch.randint(R - Cr + 1, (len(idx), 2), generator=self.gen).tolist()
            x = torch.stack([x[b, :, oy:oy + Cr, ox:ox + Cr] for b, (ox, oy) in enumerate(offs)])
        C = self.cfg["vae"]["latent_channels"]
        recon = vae_decode(self.cfg["vae"], self.W["vae"], vae_encode(self.cfg["vae"], self.W["vae"], x)[:, :C])
        return ((recon - x) ** 2).mean()

    def diffusion_loss(self):
        idx = self.batch()
        B = len(idx)
        u = torch.rand(B, generator=self.gen)
        bare_u = torch.rand(B, generator=self.gen)
        ids = self.ids[idx].clone()
        if self.s["bareShare"] is not None:
            ids[bare_u < self.s["bareShare"]] = self.bare[idx][bare_u < self.s["bareShare"]]
        ids[u < self.s["dropCaption"]] = self.empty
        t = torch.randint(self.cfg["scheduler"]["num_train_timesteps"], (B,), generator=self.gen)
        z0 = self.latents[idx.to(self.device)]
        eps = torch.randn(z0.shape, generator=self.gen).to(self.device)
        a = self.acp[t].to(self.device)[:, None, None, None]
        xt = a.sqrt() * z0 + (1 - a).sqrt() * eps
        ctx = clip_forward(self.cfg["text_encoder"], self.W["text_encoder"], ids.to(self.device))
        pred = unet_forward(self.cfg["unet"], self.W["unet"], xt, t.to(self.device).float(), ctx)
        target = a.sqrt() * eps - (1 - a).sqrt() * z0 if self.s["prediction"] == "v_prediction" else eps
        return ((pred - target) ** 2).mean()

    @torch.no_grad()
    def update_ema(self):
        n = self.ema_updates * self.s["emaEvery"]
        decay = min(self.s["emaDecay"], (1 + n) / (10 + n)) ** self.s["emaEvery"]
        for k, w in self.trainable("unet").items():
            self.ema[k].mul_(decay).add_(w.detach(), alpha=1 - decay)
        self.ema_updates += 1

    def train_step(self):
        t0, stage = time.time(), self.stage
        loss = self.vae_loss() if stage == "vae" else self.diffusion_loss()
        value = loss.item()
        if math.isfinite(value):  # a non-finite loss skips the update, as the engine's optimizer does
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(self.trainable(stage).values()), 1.0)
            self.opt.step()
        self.step += 1
        if stage == "unet" and self.step % self.s["emaEvery"] == 0:
            self.update_ema()
        rec = {"stage": stage, "step": self.step, "loss": value, "seconds": round(time.time() - t0, 4)}
        with open(os.path.join(self.dir, "loss.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
        total = self.s["vaeSteps"] if stage == "vae" else self.s["steps"]
        if self.step >= total:
            if stage == "vae":
                self.finish_vae()
            self.start_stage("unet" if stage == "vae" and self.s["steps"] > 0 else "done")
            self.checkpoint()
            if self.stage == "done":
                self.export()
        elif self.s["checkpointEvery"] and self.step % self.s["checkpointEvery"] == 0:
            self.checkpoint()
        return rec

    def checkpoint(self):
        cpu = lambda d: {k: v.detach().cpu() for k, v in d.items()}  # noqa: E731
        state = dict(stage=self.stage, step=self.step, scaling=self.scaling, ema_updates=self.ema_updates, gen=self.gen.get_state(),
                     weights={c: cpu(w) for c, w in self.W.items()}, ema=cpu(self.ema),
                     opt=self.opt.state_dict() if self.opt else None, settings=self.s)
        tmp = os.path.join(self.dir, "checkpoint.pt.tmp")
        torch.save(state, tmp)
        os.replace(tmp, os.path.join(self.dir, "checkpoint.pt"))  # a killed run keeps the last whole checkpoint

    def restore(self):
        # The run's own file (optimizer state, generator state, settings): newer torch loads only tensors by default.
        st = torch.load(os.path.join(self.dir, "checkpoint.pt"), map_location="cpu", weights_only=False)
        for c in self.W:
            for k in self.W[c]:
                self.W[c][k] = st["weights"][c][k].to(self.device)
        self.scaling = st["scaling"]
        self.start_stage(st["stage"])
        self.stage, self.step, self.ema_updates = st["stage"], st["step"], st["ema_updates"]
        self.ema = {k: v.to(self.device) for k, v in st["ema"].items()}
        if self.opt is not None and st["opt"] is not None:
            self.opt.load_state_dict(st["opt"])
        self.gen.set_state(st["gen"])
        # Steps logged after the checkpoint were lost with the killed run: the log keeps what the weights hold.
        log = os.path.join(self.dir, "loss.jsonl")
        if os.path.exists(log):
            order = {"vae": 0, "unet": 1, "done": 2}
            keep = [ln for ln in open(log) if (order[json.loads(ln)["stage"]], json.loads(ln)["step"]) <= (order[self.stage], self.step)]
            open(log, "w").writelines(keep)

    def export(self, part_way=False):
        """The diffusers folder `lab:pretrain` writes (pretrainedModelFiles): fp16 weights, the EMA UNet and text
        encoder, the VAE's measured scale and the prediction type in the configs, the run's tokenizer."""
        if self.stage == "vae" or (self.stage != "done" and not part_way):
            raise Refused(f"pretraining is not finished (stage {self.stage}, step {self.step}): resume it to the end first")
        step = self.s["steps"] if self.stage == "done" else self.step
        out = {}
        for c in ("vae", "unet", "text_encoder"):
            out[c] = {}
            for k, w in self.W[c].items():
                v = self.ema.get(f"{c}/{k}", w).detach().float().cpu()
                if not torch.isfinite(v).all() or v.abs().max() > 65504:
                    raise Refused(f"{c}/{k} holds a value fp16 cannot store: the model was not written")
                out[c][k] = f16(v)
        cfg = self.cfg
        configs = {"unet": cfg["unet"], "vae": {**cfg["vae"], "scaling_factor": self.scaling}, "text_encoder": cfg["text_encoder"],
                   "scheduler": {**cfg["scheduler"], "prediction_type": self.s["prediction"]}}
        meta = {"format": "pt", "generator": "DreamBooth Studio pretrain", "trainer": "pytorch " + torch.__version__,
                "settings": json.dumps({**self.s, **{k: self.m[k] for k in ("data", "dataSeed", "dataSize", "resolution", "exclude", "solidShare")}}),
                "stage": self.stage, "step": str(step), "total_steps": str(step)}
        model = os.path.join(self.dir, "model")
        shutil.rmtree(model, ignore_errors=True)
        for d in ("unet", "vae", "text_encoder", "scheduler", "tokenizer"):
            os.makedirs(os.path.join(model, d))
        write = lambda p, o: open(os.path.join(model, p), "w").write(json.dumps(o, indent=2))  # noqa: E731
        write("model_index.json", {"_class_name": "StableDiffusionPipeline", "_diffusers_version": "0.30.0",
                                   "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
                                   "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
                                   "scheduler": ["diffusers", "DDIMScheduler"]})
        write("unet/config.json", {"_class_name": "UNet2DConditionModel", **configs["unet"]})
        write("vae/config.json", {"_class_name": "AutoencoderKL", **configs["vae"]})
        write("text_encoder/config.json", {"architectures": ["CLIPTextModel"], "model_type": "clip_text_model", **configs["text_encoder"]})
        write("scheduler/scheduler_config.json", configs["scheduler"])
        write("tokenizer/tokenizer_config.json", {"model_max_length": 77, "pad_token": "<|endoftext|>", "bos_token": "<|startoftext|>",
                                                  "eos_token": "<|endoftext|>"})
        for f in ("vocab.json", "merges.txt"):
            shutil.copy(os.path.join(self.data_dir, "tokenizer", f), os.path.join(model, "tokenizer", f))
        save(os.path.join(model, "unet", "diffusion_pytorch_model.safetensors"), out["unet"], meta)
        save(os.path.join(model, "vae", "diffusion_pytorch_model.safetensors"), out["vae"], meta)
        save(os.path.join(model, "text_encoder", "model.safetensors"), out["text_encoder"], meta)
        print(f"wrote {model} (stage {self.stage}, UNet step {step}, latent scale {self.scaling:.4f})", flush=True)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data")
    ap.add_argument("--out")
    ap.add_argument("--resume")
    ap.add_argument("--export", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--max-steps", type=int, default=0, help="stop (after a checkpoint) once this many steps ran in this call")
    ap.add_argument("--max-seconds", type=float, default=0, help="stop (after a checkpoint) once this call has trained this long")
    for flag, typ in FLAGS.items():
        ap.add_argument("--" + flag, type=typ)
    return ap.parse_args(argv)


def open_run(a):
    """A new run (--data, --out) or a resumed one (--resume); every refusal comes before any file is written."""
    given = {camel(f): getattr(a, f.replace("-", "_")) for f in FLAGS if getattr(a, f.replace("-", "_")) is not None}
    if a.resume:
        path = os.path.join(a.resume, "settings.json")
        if not os.path.exists(path):
            raise Refused(f"--resume {a.resume}: no settings.json there; give the folder of a run of this script")
        saved = json.load(open(path))
        s, data_dir = dict(saved["settings"]), a.data or saved["data"]
        for k, v in given.items():
            if k in ("steps", "vaeSteps"):
                continue
            if v != s[k]:
                raise Refused(f"--{k}: this run's checkpoint was made with {k} = {json.dumps(s[k])}, not {json.dumps(v)}: resume with the run's own settings")
        st_stage = torch.load(os.path.join(a.resume, "checkpoint.pt"), map_location="cpu", weights_only=False)["stage"] if os.path.exists(os.path.join(a.resume, "checkpoint.pt")) else "vae"
        if "steps" in given and (given["steps"] < s["steps"] or st_stage == "done" and given["steps"] != s["steps"]):
            raise Refused(f"--steps {given['steps']}: this run was started for {s['steps']} UNet steps (stage {st_stage}): resume with at least that many, or go on in a new run")
        if "vaeSteps" in given and given["vaeSteps"] != s["vaeSteps"] and (st_stage != "vae" or given["vaeSteps"] < s["vaeSteps"]):
            raise Refused(f"--vae-steps {given['vaeSteps']}: this run's VAE stage was set to {s['vaeSteps']} steps and is at stage {st_stage}: resume with at least that many while it runs")
        s.update(given)
        m = read_data(data_dir)[0]
        if data_digest(m) != saved["dataDigest"]:
            raise Refused(f"--data {data_dir}: not the data this run was started on (its files' SHA-256 differ): give the run's own export")
        return a.resume, s, data_dir, True
    if not a.data or not a.out:
        raise Refused("give --data <export> and --out <new run folder>, or --resume <run folder>")
    s = {**DEFAULTS, **given}
    m = read_data(a.data)[0]
    factor = 2 ** (len(m["configs"]["vae"]["block_out_channels"]) - 1)
    check_settings(s, factor, m["resolution"])
    if os.path.exists(a.out) and os.listdir(a.out):
        raise Refused(f"--out {a.out}: the folder is not empty; give a new folder, or --resume it")
    os.makedirs(a.out, exist_ok=True)
    json.dump({"settings": s, "data": os.path.abspath(a.data), "dataDigest": data_digest(m)}, open(os.path.join(a.out, "settings.json"), "w"), indent=2)
    return a.out, s, a.data, False


def main(argv):
    a = parse(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    run_dir, s, data_dir, resumed = open_run(a)
    if resumed:
        saved = json.load(open(os.path.join(run_dir, "settings.json")))
        saved["settings"] = s
        json.dump(saved, open(os.path.join(run_dir, "settings.json"), "w"), indent=2)
    run = Run(run_dir, s, data_dir, a.device)
    run.data_dir = data_dir
    if resumed and os.path.exists(os.path.join(run_dir, "checkpoint.pt")):
        run.restore()
        run.s = s
        print(f"resumed at stage {run.stage}, step {run.step}", flush=True)
    if a.export:
        run.export(part_way=True)
        return
    done, t0 = 0, time.time()
    while run.stage != "done":
        rec = run.train_step()
        done += 1
        if rec["step"] % 10 == 0 or rec["step"] == 1:
            print(f"{rec['stage']} step {rec['step']}: loss {rec['loss']:.5f} ({rec['seconds']:.3f} s)", flush=True)
        out_of_time = a.max_seconds and time.time() - t0 >= a.max_seconds
        if (a.max_steps and done >= a.max_steps or out_of_time) and run.stage != "done":
            run.checkpoint()
            print(f"stopped after {done} steps at stage {run.stage}, step {run.step} (checkpointed)", flush=True)
            return


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except Refused as e:
        print(str(e), file=sys.stderr)
        sys.exit(2)
