// ray_train.py of a job bundle (bundle.ts): the bundle's DreamBooth job as a Ray Train TorchTrainer over N
// workers. The same for every bundle: it reads job.json (settings, model reference) and prompts.jsonl.
// The loop is diffusers' train_dreambooth(_lora).py step (VAE-encode, noise, timestep, UNet, MSE, prior
// term) with what those scripts lack and the engine has: per-photo captions, the LoRA alpha, offset noise
// of any strength, min-SNR-gamma on every sample and the masked loss; its learning-rate schedule (lr_factor)
// is train.sh's. Checkpoints go through ray.train.report(checkpoint=) and come back through
// ray.train.get_checkpoint() (worker restarts) and TorchTrainer.restore (a new run of the script on the same
// storage path). tests/pipeline/bundle.test.ts compiles it with python3.
export const RAY_TRAIN_PY = String.raw`#!/usr/bin/env python3
"""DreamBooth Studio job bundle: the job in job.json as a Ray Train TorchTrainer over N workers.

    pip install -r requirements.txt
    MODEL=<hub id or diffusers folder> python ray_train.py --num-workers 4 --storage-path /shared/ray-results

Each worker trains on its share of every batch (DistributedDataParallel through ray.train.torch.prepare_model)
and the ranks' gradients are averaged, so N workers see N times the batch per step. Every checkpointing_steps
the trained weights, the optimizer and the step are reported as a ray.train.Checkpoint; a failed worker
group restarts from the latest (FailureConfig), and running this script again with the same --storage-path
and --name restores the run (TorchTrainer.restore). The result is written to <output>/ like the diffusers
scripts: pytorch_lora_weights.safetensors (LoRA) or a diffusers folder (full).
"""
import argparse
import json
import math
import os
import random
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def read_job():
    with open(os.path.join(HERE, "job.json"), encoding="utf-8") as f:
        job = json.load(f)
    with open(os.path.join(HERE, "prompts.jsonl"), encoding="utf-8") as f:
        job["instances"] = [json.loads(line) for line in f if line.strip()]
    return job


def lr_factor(s, step):
    """The learning rate's factor for the update after step updates: transformers' get_scheduler formulas."""
    name, warmup, total = s.get("lrScheduler", "constant"), s.get("lrWarmup", 0), s["steps"]
    if name == "constant" and warmup > 0:
        name = "constant_with_warmup"
    if name == "constant":
        return 1.0
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    if name == "linear":
        return max(0.0, (total - step) / max(1, total - warmup))
    if name == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))
    if name == "cosine_with_restarts":
        return 0.0 if progress >= 1.0 else max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((s.get("lrCycles", 1) * progress) % 1.0))))
    if name == "polynomial":
        end = 1e-7
        if step > total:
            return end / s["lr"]
        return ((s["lr"] - end) * (1 - (step - warmup) / (total - warmup)) ** s.get("lrPower", 1.0) + end) / s["lr"]
    return 1.0  # constant_with_warmup


def class_items(job):
    """Class images (prompt = class prompt), generated with the base model first when class_images/ has too few."""
    folder = os.path.join(HERE, job.get("class_data_dir") or "class_images")
    if not job["settings"]["priorPreservation"]:
        return []
    os.makedirs(folder, exist_ok=True)
    names = sorted(n for n in os.listdir(folder) if n.lower().endswith((".png", ".jpg", ".jpeg", ".webp")))
    return [{"file": os.path.join(folder, n), "prompt": job["class_prompt"]} for n in names]


def generate_class_images(job, model, revision):
    """What the diffusers scripts do before training: fill class_images/ with the base model's own images."""
    import torch
    from diffusers import StableDiffusionPipeline

    s = job["settings"]
    folder = os.path.join(HERE, job.get("class_data_dir") or "class_images")
    have = len(class_items(job))
    need = job.get("num_class_images", s["classCount"]) - have
    if need <= 0:
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pipe = StableDiffusionPipeline.from_pretrained(model, revision=revision, torch_dtype=torch.float16 if device == "cuda" else torch.float32, safety_checker=None)
    pipe.to(device)
    for i in range(need):
        g = torch.Generator(device=device).manual_seed(s["seed"] + have + i)
        image = pipe(job["class_prompt"], num_inference_steps=s["classSteps"], height=s["resolution"], width=s["resolution"], generator=g).images[0]
        image.save(os.path.join(folder, "gen-%04d.png" % (have + i)))
    del pipe


def train_loop_per_worker(config):
    import numpy as np
    import torch
    import torch.nn.functional as F
    import ray.train
    import ray.train.torch
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from PIL import Image
    from transformers import CLIPTextModel, CLIPTokenizer

    job, model, revision = config["job"], config["model"], config["revision"]
    s = job["settings"]
    lora = s["mode"] == "lora"
    rank, world = ray.train.get_context().get_world_rank(), ray.train.get_context().get_world_size()
    device = ray.train.torch.get_device()
    torch.manual_seed(s["seed"] + rank)
    random.seed(s["seed"] + rank)
    dtype = torch.float16 if device.type == "cuda" else torch.float32

    tokenizer = CLIPTokenizer.from_pretrained(model, subfolder="tokenizer", revision=revision)
    text_encoder = CLIPTextModel.from_pretrained(model, subfolder="text_encoder", revision=revision)
    vae = AutoencoderKL.from_pretrained(model, subfolder="vae", revision=revision)
    unet = UNet2DConditionModel.from_pretrained(model, subfolder="unet", revision=revision)
    scheduler = DDPMScheduler.from_pretrained(model, subfolder="scheduler", revision=revision)
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    vae.to(device, dtype=dtype)
    train_te = lora and s["trainTextEncoder"]
    if lora:
        from peft import LoraConfig

        unet.requires_grad_(False)
        alpha = s["alpha"] or s["rank"]
        unet.add_adapter(LoraConfig(r=s["rank"], lora_alpha=alpha, init_lora_weights="gaussian", target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
        if train_te:
            text_encoder.add_adapter(LoraConfig(r=s["rank"], lora_alpha=alpha, init_lora_weights="gaussian", target_modules=["q_proj", "k_proj", "v_proj", "out_proj"]))
    text_encoder.to(device, dtype=torch.float32 if train_te else dtype)
    unet.to(device)  # trained weights stay fp32 (masters); the forward runs under autocast
    if device.type == "cuda":
        unet.enable_gradient_checkpointing()  # train.sh passes --gradient_checkpointing too

    groups = [{"params": [p for p in unet.parameters() if p.requires_grad]}]
    if train_te:  # the text encoder's adapters at their own rate (textEncoderLr; 0: the run's lr)
        groups.append({"params": [p for p in text_encoder.parameters() if p.requires_grad], "lr": s.get("textEncoderLr") or s["lr"]})
    optimizer = torch.optim.AdamW(groups, lr=s["lr"], betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)
    base_lrs = [g["lr"] for g in optimizer.param_groups]
    step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), map_location="cpu")
            unet.load_state_dict(state["unet"], strict=False)
            if train_te:
                text_encoder.load_state_dict(state["text_encoder"], strict=False)
            optimizer.load_state_dict(state["optimizer"])
            step = state["step"]
    unet = ray.train.torch.prepare_model(unet)
    trained_te = ray.train.torch.prepare_model(text_encoder) if train_te else text_encoder

    r = s["resolution"]

    def pixels(path):
        image = Image.open(path).convert("RGB")
        if image.size != (r, r):  # bundle images are already the trained square; class images may not be
            w, h = image.size
            side = min(w, h)
            image = image.crop(((w - side) // 2, (h - side) // 2, (w - side) // 2 + side, (h - side) // 2 + side)).resize((r, r), Image.BICUBIC)
        x = torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)
        return x

    def ids(prompt):
        return tokenizer(prompt, padding="max_length", truncation=True, max_length=tokenizer.model_max_length, return_tensors="pt").input_ids[0]

    instances = [{"file": os.path.join(HERE, it["file"]), "prompt": it["prompt"], "mask": it.get("mask")} for it in job["instances"]]

    def loss_mask(item, size):
        """The masked loss's weights at latent size (the mask's R channel, white = 1, average-pooled), or ones."""
        if not item.get("mask"):
            return torch.ones(1, *size)
        m = np.asarray(Image.open(os.path.join(HERE, item["mask"])).convert("RGB"), dtype=np.float32)[:, :, 0] / 255.0
        return F.adaptive_avg_pool2d(torch.from_numpy(m)[None, None], size)[0]
    classes = class_items(job)
    acp = scheduler.alphas_cumprod.to(device)
    prediction = scheduler.config.prediction_type

    def draw(items, k):
        """Item k of a shuffled pass through items, the same order on every worker (seeded per epoch)."""
        epoch, i = divmod(k, len(items))
        order = list(range(len(items)))
        random.Random(s["seed"] + epoch).shuffle(order)
        return items[order[i]]

    while step < s["steps"]:
        # One step: this worker's instance (and class) sample; DDP averages the workers' gradients.
        batch = [draw(instances, step * world + rank)]
        if classes:
            batch.append(draw(classes, step * world + rank))
        x = torch.stack([pixels(b["file"]) for b in batch]).to(device, dtype=dtype)
        with torch.no_grad():
            latents = vae.encode(x).latent_dist.sample() * vae.config.scaling_factor
        latents = latents.float()
        noise = torch.randn_like(latents)
        if s["offsetNoise"]:
            noise = noise + s["offsetNoise"] * torch.randn(latents.shape[0], latents.shape[1], 1, 1, device=device)
        t = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],), device=device).long()
        noisy = scheduler.add_noise(latents, noise, t)
        target = noise if prediction == "epsilon" else scheduler.get_velocity(latents, noise, t)
        input_ids = torch.stack([ids(b["prompt"]) for b in batch]).to(device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype == torch.float16):
            context = trained_te(input_ids)[0]
            pred = unet(noisy, t, context).sample
        # Masked loss as sd-scripts and the engine do it: the squared error times the mask, averaged over every element.
        masks = torch.stack([loss_mask(b, tuple(latents.shape[-2:])) for b in batch]).to(device)
        per_sample = (F.mse_loss(pred.float(), target.float(), reduction="none") * masks).mean(dim=(1, 2, 3))
        weights = torch.ones_like(per_sample)
        if s["minSnrGamma"]:
            snr = acp[t] / (1 - acp[t])
            weights = torch.clamp(snr, max=s["minSnrGamma"]) / (snr if prediction == "epsilon" else snr + 1)
        if classes:
            weights[1] = weights[1] * s["priorWeight"]
        loss = (per_sample * weights)[:1].mean() + ((per_sample * weights)[1:].mean() if classes else 0.0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for g, base in zip(optimizer.param_groups, base_lrs):  # the schedule is a pure function of the step
            g["lr"] = base * lr_factor(s, step)
        optimizer.step()
        step += 1
        metrics = {"step": step, "loss": float(loss.detach())}
        every = s["checkpointEvery"] or s["steps"]
        if step % every == 0 or step == s["steps"]:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    raw_unet = unet.module if hasattr(unet, "module") else unet
                    raw_te = trained_te.module if hasattr(trained_te, "module") else trained_te
                    trainable = lambda m: {k: v.detach().cpu() for k, v in m.state_dict().items() if (not lora) or "lora" in k}
                    torch.save({"unet": trainable(raw_unet), "text_encoder": trainable(raw_te) if train_te else {}, "optimizer": optimizer.state_dict(), "step": step}, os.path.join(d, "state.pt"))
                    if step == s["steps"]:
                        save_result(config, raw_unet, raw_te if train_te else None)
                    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
                else:
                    ray.train.report(metrics)
        else:
            ray.train.report(metrics)


def save_result(config, unet, text_encoder):
    """output/: pytorch_lora_weights.safetensors (LoRA) or a diffusers folder (full), as the diffusers scripts write."""
    job, model, revision = config["job"], config["model"], config["revision"]
    out = config["output"]
    os.makedirs(out, exist_ok=True)
    if job["settings"]["mode"] == "lora":
        from diffusers import StableDiffusionPipeline
        from diffusers.utils import convert_state_dict_to_diffusers
        from peft.utils import get_peft_model_state_dict

        StableDiffusionPipeline.save_lora_weights(
            out,
            unet_lora_layers=convert_state_dict_to_diffusers(get_peft_model_state_dict(unet)),
            text_encoder_lora_layers=convert_state_dict_to_diffusers(get_peft_model_state_dict(text_encoder)) if text_encoder is not None else None,
        )
    else:
        from diffusers import StableDiffusionPipeline

        pipe = StableDiffusionPipeline.from_pretrained(model, unet=unet, revision=revision, safety_checker=None)
        pipe.save_pretrained(out)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-workers", type=int, default=1, help="training workers (one GPU each with --use-gpu)")
    p.add_argument("--cpu", action="store_true", help="train on CPUs (tiny tests only)")
    p.add_argument("--storage-path", default=os.path.join(HERE, "ray_results"), help="where Ray keeps checkpoints (shared storage on a cluster)")
    p.add_argument("--name", default="dreambooth", help="run name under --storage-path; the same name restores the run")
    p.add_argument("--output", default=os.path.join(HERE, "output"), help="where the trained result is written")
    p.add_argument("--max-failures", type=int, default=3, help="worker-group restarts from the last checkpoint")
    args = p.parse_args()

    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    job = read_job()
    model = os.environ.get("MODEL") or job["model"].get("reference")
    if not model:
        raise SystemExit("set MODEL first: " + job["model"]["note"])
    revision = job["model"].get("revision") if model == job["model"].get("reference") else None
    if job["settings"]["priorPreservation"]:
        generate_class_images(job, model, revision)

    ray.init(ignore_reinit_error=True)
    config = {"job": job, "model": model, "revision": revision, "output": os.path.abspath(args.output)}
    path = os.path.join(args.storage_path, args.name)
    if TorchTrainer.can_restore(path):
        print("restoring the run in %s from its last checkpoint" % path)
        trainer = TorchTrainer.restore(path, train_loop_per_worker=train_loop_per_worker, train_loop_config=config)
    else:
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=not args.cpu),
            run_config=RunConfig(
                name=args.name,
                storage_path=os.path.abspath(args.storage_path),
                checkpoint_config=CheckpointConfig(num_to_keep=2),
                failure_config=FailureConfig(max_failures=args.max_failures),
            ),
        )
    result = trainer.fit()
    print("done: step %s, loss %s, checkpoint %s; result in %s" % (result.metrics.get("step"), result.metrics.get("loss"), result.checkpoint, args.output))


if __name__ == "__main__":
    main()
`;
