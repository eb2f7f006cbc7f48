"""One training step (forward, backward, AdamW) of our MMDiT next to diffusers' FluxTransformer2DModel.

Same shape for both: 8 double + 16 single blocks, 12 heads x 128, 64-wide input tokens (16 latent channels x
2x2 patches for ours, Flux's packed 64 channels for diffusers), 4096-dim text features, 8448 video + 512 text
tokens, batch 1, parameters and activations in bf16, fused AdamW. Every variant runs in its own subprocess (a
crashed kernel must not take the others down, and memory peaks stay separate); the driver collects one JSON
(``--out``) and prints a table.

Timing: CUDA events around each step after warm-up (compilation happens there), median of the timed steps.
MFU = model FLOPs (3x the forward matmuls, recompute not counted, the same number for both models) / time /
the bf16 ceiling (752 TFLOP/s measured on H200; pass --peak-tflops for another device).

  python -m benchmarks.train_step                       # all default variants on the GPU
  python -m benchmarks.train_step --variants ours-compile,diffusers --iters 20
  python -m benchmarks.train_step --tiny                # CPU smoke test of the script itself
  python -m benchmarks.train_step --runs "trainer@full;ours-eager@full;trainer@full;ours-eager@full"

Trainer mode (variant ``trainer``): the real ``Trainer`` built from ``--trainer-config``
(default configs/diffusion/train/mmdit_1b_bench_shape.py: this shape, batch 1, latents and text features from memory,
so loading costs nothing) with the variant's checkpointing. Per-step times are the trainer's own CUDA events (end of
the previous step to end of this one, so input stalls count); also reported: the host time spent waiting for each
batch (data stalls), the median, p10, p90 and p90/p10 of the timed steps, and a sync audit: ``--audit-steps`` steps
after warm-up run under ``torch.cuda.set_sync_debug_mode("warn")`` and every synchronising call is listed with its
call site (the innermost opensora / colossalai frames). ``--trainer-config`` with the 1B synthetic config measures
the same trainer on rendered clips (data stalls show up in ``data_wait_ms``).

Like for like: ``ours-eager-master`` is the bare step with the trainer's optimizer precision (fp32 master weights
and AdamW moments, torch foreach AdamW as the trainer's default), so trainer minus it is the trainer's own
overhead and it minus ``ours-eager`` is the precision's price. ``--profile-steps N`` adds, for the first run of
each variant, N profiled steps after the timed ones and a compact ``profile_summary`` (GPU ms by category, top
kernels, GPU idle gaps, host op counts; ``opensora.training.profiling.profile_step_summary``).
"""

import argparse
import datetime
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

from benchmarks.common import FULL, OUT, ROOT, TINY, count_host_syncs, model_config, randomize_, shape_tokens

# name -> how to build it; ckpt: "none" | "full" | "D,S" (first D double and S single blocks checkpointed)
VARIANTS = {
    "diffusers": dict(model="diffusers", backend="default"),
    "diffusers-flash": dict(model="diffusers", backend="flash"),
    "ours-eager": dict(model="ours", backend="auto", compile=False),
    "ours-eager-flash": dict(model="ours", backend="flash", compile=False),
    "ours-compile": dict(model="ours", backend="auto", compile=True),
    "ours-compile-flash": dict(model="ours", backend="flash", compile=True),
    # SDPA traced into the compiled blocks instead of the opaque op (whose backward recomputes the forward)
    "ours-compile-traced": dict(model="ours", backend="auto", compile=True, attention="traced"),
    "ours-compile-efficient": dict(model="ours", backend="efficient", compile=True),
    "ours-compile-masked": dict(model="ours", backend="auto", compile=True, padded_text=True),
    # candidate fixes for the compiled path's non-finite vec-path grads (see compile_parity.py)
    "ours-compile-nosplit": dict(model="ours", backend="auto", compile={"split_reductions": False}),
    "ours-compile-nopersistent": dict(model="ours", backend="auto", compile={"triton.persistent_reductions": False}),
    # the real Trainer (ZeRO-2 bf16, EMA, scheduler, loss check, metrics, loader) on in-memory latents at this shape
    "trainer": dict(model="trainer", backend="auto"),
    # the trainer's earlier defaults, to price them: torch's foreach AdamW on the fp32 masters instead of
    # the fused one (the fused kernel orders the update's arithmetic differently: not bit-identical), and without the
    # one-rank ZeRO shortcuts (bit-identical either way)
    "trainer-foreach": dict(model="trainer", backend="auto", optimizer=dict(fused=False)),
    "trainer-colossal": dict(
        model="trainer", backend="auto", optimizer=dict(fused=False), plugin=dict(single_rank_shortcut=False)
    ),
    # the trainer without its rank-0 EMA (what the EMA's 18 B per parameter cost)
    "trainer-noema": dict(model="trainer", backend="auto", ema=False),
    # one rank: the gradients through ColossalAI's bucket store (the one-rank shortcut as before it left them in .grad)
    "trainer-bucketed": dict(model="trainer", backend="auto", plugin=dict(grads_in_place=False)),
    # the trainer with compiled blocks (model.compile_blocks=True: the step of ours-compile-traced); the first
    # warm-up step compiles
    "trainer-compile": dict(model="trainer", backend="auto", compile=True),
    # the EMA update after the optimizer on the compute stream instead of overlapped on a side stream
    "trainer-ema-serial": dict(model="trainer", backend="auto", ema="serial"),
    # the non-finite check read by the host before each optimizer step (the default reads it a step late, fused
    # AdamW skipping a non-finite step on the device)
    "trainer-sync": dict(model="trainer", backend="auto", nonfinite_check="sync"),
    # the bare step with the trainer's optimizer precision: bf16 model, fp32 master weights and AdamW moments,
    # gradients cast to fp32, torch AdamW on the masters (foreach, the trainer's default; or fused), masters
    # copied back to bf16. trainer minus this = the trainer's own overhead; this minus ours-eager = the precision.
    "ours-eager-master": dict(model="ours", backend="auto", compile=False, master="foreach"),
    "ours-eager-master-fused": dict(model="ours", backend="auto", compile=False, master="fused"),
    # the same with compiled blocks (traced SDPA): like for like with trainer-compile
    "ours-compile-master-fused": dict(model="ours", backend="auto", compile=True, attention="traced", master="fused"),
}
DEFAULT_RUNS = [
    ("diffusers-flash", "none"),
    ("diffusers-flash", "full"),
    ("ours-compile", "none"),
    ("ours-compile", "full"),
    ("ours-eager", "none"),
    ("ours-eager", "full"),
    ("ours-compile", "0,16"),
    ("ours-compile-masked", "none"),
    ("ours-compile-flash", "none"),
    ("diffusers", "none"),
]

LATENT_CHANNELS = 16


def build_ours(shape, spec, ckpt, device, dtype):
    import torch

    from opensora.models.mmdit import MMDiT

    cfg = model_config(shape, attn_backend=spec["backend"])
    cfg.pop("type")
    with torch.device(device):  # build on the GPU: initialising 1.3B parameters on the CPU takes ~25 s
        model = MMDiT(**cfg)
    randomize_(model)
    model.to(device=device, dtype=dtype).train()
    model.set_grad_ckpt(*ckpt_counts(ckpt, shape))
    if spec.get("compile"):
        options = spec["compile"] if isinstance(spec["compile"], dict) else None
        model.set_compile_blocks(True, inductor_options=options, attention=spec.get("attention", "op"))
    t, h, w = shape["grid"]
    gen = torch.Generator(device="cpu").manual_seed(1)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)
    n_txt = shape["text_tokens"]
    inputs = dict(
        x=rnd(1, LATENT_CHANNELS, t, 2 * h, 2 * w),
        timestep=torch.rand(1, generator=gen).to(device),
        text_emb=rnd(1, n_txt, shape["text_dim"]),
        pooled=rnd(1, shape["pooled_dim"]),
    )
    if spec.get("padded_text"):
        mask = torch.ones(1, n_txt, dtype=torch.bool)
        mask[:, n_txt // 4 :] = False  # a short prompt padded to the max length, as T5 pads
        inputs.update(text_mask=mask.to(device), text_mask_has_padding=True)
    target = rnd(*inputs["x"].shape)
    return model, (lambda: model(**inputs)), target


def build_diffusers(shape, spec, ckpt, device, dtype):
    import torch

    from opensora.models.mmdit.rope import video_position_ids

    if ckpt not in ("none", "full"):
        raise ValueError("diffusers checkpoints all blocks or none: use ckpt none|full")
    with torch.device(device):
        model = flux_model(shape)
    randomize_(model)
    model.to(device=device, dtype=dtype).train()
    if ckpt == "full":
        model.enable_gradient_checkpointing()
    n_img, n_txt = shape_tokens(shape)
    gen = torch.Generator(device="cpu").manual_seed(1)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)
    inputs = dict(
        hidden_states=rnd(1, n_img, 4 * LATENT_CHANNELS),
        encoder_hidden_states=rnd(1, n_txt, shape["text_dim"]),
        pooled_projections=rnd(1, shape["pooled_dim"]),
        timestep=torch.rand(1, generator=gen).to(device, dtype),
        img_ids=video_position_ids(*shape["grid"]).to(device, dtype),
        txt_ids=torch.zeros(n_txt, 3).to(device, dtype),
        return_dict=False,
    )
    target = rnd(*inputs["hidden_states"].shape)
    return model, (lambda: model(**inputs)[0]), target


def flux_model(shape):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * LATENT_CHANNELS,
        num_layers=shape["depth_double"],
        num_single_layers=shape["depth_single"],
        attention_head_dim=shape["hidden"] // shape["heads"],
        num_attention_heads=shape["heads"],
        joint_attention_dim=shape["text_dim"],
        pooled_projection_dim=shape["pooled_dim"],
        guidance_embeds=False,
        axes_dims_rope=shape["axes"],
    )


def ckpt_counts(ckpt, shape):
    if ckpt == "none":
        return 0, 0
    if ckpt == "full":
        return shape["depth_double"], shape["depth_single"]
    d, s = (int(v) for v in ckpt.split(","))
    return d, s


def model_flops(shape):
    """Model FLOPs of one step: 3x forward matmuls (no recompute), from our closed-form counter."""
    from opensora.models.mmdit import mmdit_train_flops

    return mmdit_train_flops(model_config(shape), *shape_tokens(shape))


def run_variant(name, ckpt, args):
    """Build, warm up and time one variant in this process; returns its result dict."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    spec = VARIANTS[name]
    if spec["model"] == "trainer":
        return run_trainer(name, ckpt, args)
    shape = TINY if args.tiny else FULL
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    torch.manual_seed(0)
    build = build_ours if spec["model"] == "ours" else build_diffusers
    t0 = time.perf_counter()
    model, forward, target = build(shape, spec, ckpt, device, dtype)
    params = sum(p.numel() for p in model.parameters())
    if spec.get("master"):
        optimizer_step = MasterWeightAdamW(model, fused=spec["master"] == "fused" and device.type == "cuda")
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
        optimizer_step = opt.step
    context = (
        sdpa_kernel([SDPBackend.FLASH_ATTENTION])
        if spec["backend"] == "flash" and spec["model"] == "diffusers"
        else None
    )

    first = [True]

    def step():
        out = forward()
        loss = torch.nn.functional.mse_loss(out.float(), target.float())
        loss.backward()
        if first[0]:  # where does a non-finite value first show up? (one-off host syncs, before timing)
            first[0] = False
            bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
            if not torch.isfinite(loss) or bad:
                raise RuntimeError(
                    f"{name}/{ckpt}: first step loss {loss.item()}, non-finite grads in "
                    f"{len(bad)} tensors, e.g. {bad[:4]}"
                )
        optimizer_step()
        model.zero_grad(set_to_none=True)
        return loss

    def guarded_step():
        if context is None:
            return step()
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return step()

    cuda = device.type == "cuda"
    compile_error = None
    if spec.get("compile") and ckpt == "none":
        options = spec["compile"] if isinstance(spec["compile"], dict) else None
        toggle = lambda on: model.set_compile_blocks(  # noqa: E731
            on, inductor_options=options, attention=spec.get("attention", "op")
        )
        compile_error = toggled_vs_eager_error(forward, toggle, "compiled blocks")
    warm_times = []
    for _ in range(args.warmup):
        w0 = time.perf_counter()
        loss = guarded_step()
        if cuda:
            torch.cuda.synchronize()
        warm_times.append(time.perf_counter() - w0)
    if not torch.isfinite(loss):
        raise RuntimeError(f"{name}/{ckpt}: non-finite loss {loss.item()}")
    syncs = count_host_syncs(guarded_step) if cuda else []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            guarded_step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            s0 = time.perf_counter()
            guarded_step()
            times.append(time.perf_counter() - s0)
    flops = model_flops(shape)
    median = statistics.median(times)
    result = dict(
        variant=name,
        ckpt=ckpt,
        params=params,
        **spread(times),
        step_ms=median * 1e3,
        min_ms=min(times) * 1e3,
        max_ms=max(times) * 1e3,
        times_ms=[round(t * 1e3, 3) for t in times],
        warmup_s=[round(t, 2) for t in warm_times],
        build_s=round(time.perf_counter() - t0, 1),
        model_tflops=flops / median / 1e12,
        mfu=flops / median / 1e12 / args.peak_tflops,
        model_flops=flops,
        peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        host_syncs=syncs,
        loss=float(loss),
        compiled_vs_eager_rel_err=compile_error,
    )
    if args.profile and cuda:
        result["profile"] = profile_breakdown(guarded_step)
    if args.profile_steps and cuda:
        result["profile_summary"] = profile_summary(guarded_step, args.profile_steps)
    return result


class MasterWeightAdamW:
    """AdamW as the trainer's ZeRO optimizer does it on one GPU, without ZeRO's bookkeeping: fp32 master copies
    of the bf16 weights own the AdamW state; each step casts the bf16 gradients to fp32 (one multi-tensor copy),
    steps torch AdamW on the masters and copies the masters back into the bf16 weights (one multi-tensor copy).
    Gradient clipping is left out (the bare step never clips; the trainer's clip is a norm + one multiply)."""

    def __init__(self, model, fused: bool):
        import torch

        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float() for p in self.params]
        for master in self.masters:
            master.grad = torch.zeros_like(master)
        self.optimizer = torch.optim.AdamW(self.masters, lr=1e-5, foreach=not fused, fused=fused or None)

    def __call__(self):
        import torch

        torch._foreach_copy_([m.grad for m in self.masters], [p.grad for p in self.params])
        self.optimizer.step()
        torch._foreach_copy_([p.data for p in self.params], self.masters)


def spread(times):
    """median, p10, p90 (nearest rank) and p90 / p10 of a list of seconds."""
    ordered = sorted(times)
    q = lambda f: ordered[min(len(ordered) - 1, int(f * len(ordered)))]
    return dict(
        step_s=statistics.median(ordered), p10_s=q(0.1), p90_s=q(0.9), p90_over_p10=q(0.9) / q(0.1) if q(0.1) else None
    )


class SyncAudit:
    """Collects CUDA sync-debug warnings with the call site that caused each (innermost project frames)."""

    def __init__(self):
        import collections

        self.sites = collections.Counter()
        self.active = False
        self._saved = None

    def _show(self, message, category, filename, lineno, file=None, line=None):
        import traceback

        text = str(message)
        if text.startswith("Synchronization debug mode is a prototype"):  # torch's notice on enabling: not a sync
            return None
        if "synchroniz" not in text.lower():
            return self._saved(message, category, filename, lineno, file, line)
        frames = [
            f
            for f in traceback.extract_stack()[:-1]
            if ("opensora" in f.filename or "colossalai" in f.filename or "/torch/" in f.filename)
            and "warnings" not in f.filename
        ]
        ours = [f for f in frames if "opensora" in f.filename or "colossalai" in f.filename] or frames
        where = " <- ".join(f"{short_path(f.filename)}:{f.lineno} {f.name}" for f in reversed(ours[-3:]))
        self.sites[f"{text.splitlines()[0][:90]} @ {where}"] += 1

    def enable(self):
        import torch

        self._saved = warnings.showwarning
        warnings.showwarning = self._show
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        self.active = True

    def disable(self):
        import torch

        if self.active:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = self._saved
            self.active = False


def short_path(path):
    for anchor in ("opensora/", "colossalai/", "torch/"):
        if anchor in path:
            return anchor + path.rsplit(anchor, 1)[1]
    return Path(path).name


def trainer_config(ckpt, args, outputs):
    """The trainer-mode config: ``--trainer-config`` with this run's steps, outputs and checkpointing."""
    from opensora.config import load_config

    cfg = load_config(args.trainer_config)
    steps = args.warmup + args.audit_steps + args.iters
    overrides = dict(outputs=str(outputs), max_steps=steps, ckpt_every=0, save_at_end=False, tensorboard=False)
    if args.profile_steps:  # profiled after the timed steps, so the profiler's overhead is not timed
        overrides.update(
            max_steps=steps + args.profile_steps, profile_steps=dict(start=steps, steps=args.profile_steps)
        )
    overrides["wandb"] = None
    if args.tiny:  # CPU: the tiny shape, fp32, no workers
        t, h, w = TINY["grid"]
        overrides.update(precision="fp32", num_workers=0)
        cfg.dataset.update(
            latent_frames=t,
            latent_height=2 * h,
            latent_width=2 * w,
            text_tokens=TINY["text_tokens"],
            text_dim=TINY["text_dim"],
            pooled_dim=TINY["pooled_dim"],
            num=64,
        )
        if cfg.dataset.get("text_valid_range"):  # prompts of differing lengths, inside the tiny text
            cfg.dataset.update(text_valid_range=(max(1, TINY["text_tokens"] // 4), TINY["text_tokens"]))
        cfg.bucket_config = {f"{16 * h}x{16 * w}": {1 + 4 * (t - 1): (1.0, 1)}}
        cfg.model = model_config(TINY)
    d, s = ckpt_counts(ckpt, dict(depth_double=len_blocks(cfg, "double"), depth_single=len_blocks(cfg, "single")))
    cfg.model.update(grad_ckpt_double=d, grad_ckpt_single=s)
    for key, value in overrides.items():
        cfg[key] = value
    return cfg


def len_blocks(cfg, kind):
    return int(cfg.model[f"depth_{kind}"])


def run_trainer(name, ckpt, args):
    """Build the real Trainer (one process) and time its steps; see the module docstring."""
    import tempfile

    import torch

    from opensora.training.trainer import Trainer

    t0 = time.perf_counter()
    outputs = Path(tempfile.mkdtemp(prefix="train_step_trainer_"))
    cfg = trainer_config(ckpt, args, outputs)
    cfg.optimizer = dict(cfg.get("optimizer") or {}, **VARIANTS[name].get("optimizer", {}))
    cfg.plugin = dict(cfg.get("plugin") or {}, **VARIANTS[name].get("plugin", {}))
    if VARIANTS[name].get("ema") is False:
        cfg.ema_decay = None
    if VARIANTS[name].get("compile"):
        cfg.model.update(compile_blocks=True)
    if VARIANTS[name].get("nonfinite_check"):
        cfg.nonfinite_check = VARIANTS[name]["nonfinite_check"]
    trainer = Trainer(cfg)
    if VARIANTS[name].get("ema") == "serial":
        for role in trainer.roles.values():
            if role.ema is not None:
                role.ema.overlap = False
    audit = SyncAudit()
    waits = []
    audit_from, audit_to = args.warmup, args.warmup + args.audit_steps
    inner_batches = trainer._batches

    def batches():  # host wait per batch; sync debug mode on for the audited steps (grad_accum 1: batch = step)
        source = inner_batches()
        for index in itertools.count():
            if index == audit_to:
                audit.disable()
            w0 = time.perf_counter()
            batch = next(source)
            waits.append(time.perf_counter() - w0)
            if index == audit_from and args.audit_steps and torch.cuda.is_available():
                audit.enable()
            yield batch

    trainer._batches = batches
    build_s = time.perf_counter() - t0
    wall0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        audit.disable()
    wall = time.perf_counter() - wall0
    records = [json.loads(line) for line in (outputs / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in records if "step_time" in r]
    timed = records[audit_to : audit_to + args.iters]
    times = [r["step_time"] for r in timed]
    stats = spread(times)
    median = stats["step_s"]
    params = sum(p.numel() for p in trainer.roles["model"].unwrap().parameters())
    # model FLOPs of one step from the trainer's own MFU record (its peak table gives 752 TFLOP/s for H100/H200)
    flops = timed[0]["mfu"] * timed[0]["step_time"] * args.peak_tflops * 1e12 if "mfu" in timed[0] else None
    timed_waits = waits[audit_to : audit_to + len(times)]
    result = dict(
        variant=name,
        ckpt=ckpt,
        config=os.path.relpath(args.trainer_config, ROOT),
        params=params,
        **stats,
        step_ms=median * 1e3,
        min_ms=min(times) * 1e3,
        max_ms=max(times) * 1e3,
        times_ms=[round(t * 1e3, 3) for t in times],
        warmup_s=[round(r["step_time"], 2) for r in records[: args.warmup]],
        build_s=round(build_s, 1),
        train_wall_s=round(wall, 1),
        data_wait_ms=[round(w * 1e3, 3) for w in timed_waits],
        data_wait_median_ms=statistics.median(timed_waits) * 1e3 if timed_waits else None,
        data_wait_max_ms=max(timed_waits) * 1e3 if timed_waits else None,
        samples_per_s=statistics.median(r["samples_per_s"] for r in timed),
        tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed),
        mfu=statistics.median(r["mfu"] for r in timed) if "mfu" in timed[0] else 0.0,
        model_tflops=(flops / median / 1e12) if flops else 0.0,
        model_flops=flops,
        peak_mem_gib=max(r.get("peak_memory_gib", 0) for r in timed) if torch.cuda.is_available() else None,
        host_syncs=[f"{n}x {site}" for site, n in audit.sites.most_common()],
        audited_steps=args.audit_steps,
        loss=timed[-1]["loss"],
    )
    profile_file = outputs / "profile" / "rank0.json"
    if args.profile_steps and profile_file.exists():
        result["profile_summary"] = json.loads(profile_file.read_text())
    shutil.rmtree(outputs, ignore_errors=True)  # the run's checkpoints and logs: the result holds what is kept
    return result


def toggled_vs_eager_error(forward, toggle, what):
    """||on - off|| / ||off|| of the forward output (same weights and inputs) for a model switch ``toggle(bool)``
    (``set_compile_blocks``); leaves the switch on."""
    import torch

    with torch.no_grad():
        toggle(False)
        ref = forward().float()
        toggle(True)
        got = forward().float()
    err = ((got - ref).norm() / ref.norm()).item()
    if not err < 2e-2:
        raise RuntimeError(f"{what} disagree with eager: relative error {err:.3g}")
    return err


def profile_breakdown(step, steps=3):
    """Profile ``steps`` steps; GPU kernel time per step by category (the trainer's ``StepProfiler``)."""
    import torch

    from opensora.training.profiling import StepProfiler

    profiler = StepProfiler(dict(start=0, steps=steps), None, rank=0, device=torch.device("cuda"))
    profiler.begin(0)
    for done in range(1, steps + 1):
        step()
        summary = profiler.end(done)
    return summary


def profile_summary(step, steps):
    """``steps`` steps under ``torch.profiler``, reduced to a small dict (``opensora.training.profiling``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from opensora.training.profiling import profile_step_summary

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
    return profile_step_summary(prof, steps, start.elapsed_time(end) / steps)


def environment(args):
    import torch

    env = dict(
        date=datetime.date.today().isoformat(),
        torch=torch.__version__,
        python=sys.version.split()[0],
        shape="tiny" if args.tiny else "full",
        peak_tflops=args.peak_tflops,
    )
    if torch.cuda.is_available() and not args.tiny:
        env.update(device=torch.cuda.get_device_name(), cudnn=torch.backends.cudnn.version())
    else:
        env.update(device="cpu")
    try:
        import diffusers

        env["diffusers"] = diffusers.__version__
    except ImportError:
        pass
    return env


def format_table(results):
    lines = [
        f"{'variant':22s} {'ckpt':6s} {'step ms':>8s} {'p90/p10':>7s} {'TFLOP/s':>8s} {'MFU':>6s} {'peak GiB':>9s} "
        f"{'syncs':>5s} {'data wait ms':>12s}"
    ]
    for r in results:
        if "error" in r:
            lines.append(f"{r['variant']:22s} {r['ckpt']:6s} FAILED: {r['error'][:90]}")
            continue
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        lines.append(
            f"{r['variant']:22s} {r['ckpt']:6s} {r['step_ms']:8.1f} {r.get('p90_over_p10') or 0:7.3f} "
            f"{r['model_tflops']:8.1f} {100 * r['mfu']:5.1f}% {mem:>9s} {len(r['host_syncs']):5d} "
            f"{format(r['data_wait_median_ms'], '.2f') if r.get('data_wait_median_ms') is not None else '-':>12}"
        )
    return "\n".join(lines)


def parse_runs(text):
    if not text:
        return DEFAULT_RUNS
    runs = []
    for item in text.split(";"):
        name, _, ckpt = item.partition("@")
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant '{name}'; choose from {sorted(VARIANTS)}")
        runs.append((name, ckpt or "none"))
    return runs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="", help="'variant@ckpt;...' (ckpt none|full|D,S); default: all")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--peak-tflops", type=float, default=752.0, help="bf16 ceiling for MFU (H200: 752)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU in fp32 (smoke test)")
    parser.add_argument(
        "--profile", default="", help="comma list of variant@ckpt whose GPU kernel time to split by category"
    )
    parser.add_argument("--out", default=None, help="JSON path (default outputs/benchmarks/train_step_<date>.json)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per variant subprocess")
    parser.add_argument(
        "--trainer-config",
        default=str(ROOT / "configs" / "diffusion" / "train" / "mmdit_1b_bench_shape.py"),
        help="config of the 'trainer' variant (its checkpointing is the variant's)",
    )
    parser.add_argument("--audit-steps", type=int, default=3, help="trainer steps run under sync debug mode")
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after timing, run N more steps under torch.profiler (first run of each variant@ckpt only) and keep a "
        "compact summary in the JSON: GPU ms by category, memcpy / memset, top 15 kernels, GPU idle gaps, host op "
        "counts",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:  # one variant in this process, result as JSON on the last stdout line
        name, _, ckpt = args.child.partition("@")
        args.profile = args.child in args.profile.split(",")
        print("RESULT " + json.dumps(run_variant(name, ckpt, args)), flush=True)
        return 0

    runs = parse_runs(args.runs)
    out = Path(args.out or OUT / f"train_step_{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    report = dict(environment=environment(args), runs=[])
    passthrough = [
        "--warmup",
        str(args.warmup),
        "--iters",
        str(args.iters),
        "--peak-tflops",
        str(args.peak_tflops),
        "--profile",
        args.profile,
        "--trainer-config",
        args.trainer_config,
        "--audit-steps",
        str(args.audit_steps),
    ] + (["--tiny"] if args.tiny else [])
    profiled = set()
    for name, ckpt in runs:
        cmd = [sys.executable, "-m", "benchmarks.train_step", "--child", f"{name}@{ckpt}", *passthrough]
        if args.profile_steps and (name, ckpt) not in profiled:
            profiled.add((name, ckpt))
            cmd += ["--profile-steps", str(args.profile_steps)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=args.timeout,
                cwd=ROOT,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
            lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
            if proc.returncode or not lines:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                result = dict(variant=name, ckpt=ckpt, error=f"rc={proc.returncode}: " + " | ".join(tail))
            else:
                result = json.loads(lines[-1][len("RESULT ") :])
        except subprocess.TimeoutExpired:
            result = dict(variant=name, ckpt=ckpt, error=f"timed out after {args.timeout:.0f} s")
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        report["runs"].append(result)
        out.write_text(json.dumps(report, indent=1))  # after every variant: partial results survive a kill
        summary = result.get("error") or f"{result['step_ms']:.1f} ms, {100 * result['mfu']:.1f}% MFU"
        print(f"[{result['wall_s']:6.1f}s] {name}@{ckpt}: {summary}", flush=True)
    from opensora.training.profiling import format_profile

    print(f"\n{report['environment']}\n" + format_table(report["runs"]))
    for r in report["runs"]:
        if r.get("variant", "").startswith("trainer") and r.get("host_syncs"):
            print(f"\ntrainer@{r['ckpt']}: synchronising calls in {r['audited_steps']} audited steps:")
            print("\n".join("  " + site for site in r["host_syncs"]))
    for r in report["runs"]:
        if "profile" in r:
            print(f"\n{r['variant']}@{r['ckpt']} " + format_profile(r["profile"]))
        if "profile_summary" in r:
            print(f"\n{r['variant']}@{r['ckpt']} " + format_profile(r["profile_summary"]))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
