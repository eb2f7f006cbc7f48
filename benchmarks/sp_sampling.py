"""Sequence-parallel sampling vs one GPU at the 1B long-video shape.

The 1B MMDiT of ``configs/diffusion/train/mmdit_1b_long_synthetic.py`` (random weights, bf16) denoises one
512x512 x 129-frame video: 33 x 32 x 32 = 33,792 video tokens + 512 text tokens, Euler with text CFG (2 passes per
step, batched), through ``VideoSampler.denoise`` -- the loop ``scripts/diffusion/inference.py`` runs. Text
encoding and decoding (the config's stand-in encoders) are outside the timed region.

  python -m benchmarks.sp_sampling --out OUT/sp_sampling_1gpu.json                      # 1 GPU
  torchrun --nproc_per_node 2 -m benchmarks.sp_sampling --out OUT/sp_sampling_2gpu.json   # 2 GPUs
  python -m benchmarks.sp_sampling --tiny                                                 # CPU smoke
  torchrun --nproc_per_node 2 -m benchmarks.sp_sampling --tiny

Under torchrun the world is one sequence-parallel group (``--sequence-parallel-size`` = world size). Each run
reports the median of ``--repeats`` timed denoising loops after one warm-up loop, and saves the final latents
(``--latents PATH``, rank 0) so the two runs' outputs can be compared: ``--compare A.pt B.pt`` prints the max and
relative differences (every exchange variant of a 2-GPU run against the 1-GPU latents). Speed-up = 1-GPU seconds /
2-GPU seconds from the two JSON files (``--speedup ONE.json TWO.json`` prints it per variant).

``--exchange old,direct,staged,direct-late,direct-row`` times several sampling exchanges
(opensora/parallel/sampling_exchange.py; ``-late``: every exchange issued after the last RoPE, ``-row``: each batch
row's as soon as it is ready, plain: each tensor's) in one process pair, interleaved repeat by repeat, so drift of
the machine hits all alike; each variant's latents must be bitwise those of the first.
"""

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from opensora.config import load_config  # noqa: E402
from opensora.inference.sampler import VideoSampler, role_model_config, seeded_noise  # noqa: E402
from opensora.parallel.process_group import init_process_group_from_env  # noqa: E402
from opensora.parallel.sampling_exchange import EXCHANGES  # noqa: E402
from opensora.parallel.sequence_parallel import build_sequence_groups  # noqa: E402
from opensora.registry import MODELS, build_module  # noqa: E402

CONFIG = ROOT / "configs/diffusion/train/mmdit_1b_long_synthetic.py"


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


KERNEL_KINDS = [  # first match wins; names of the kernels PyTorch / NCCL / cuBLAS / FlashAttention launch
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "cudnn")),
    ("matmul", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")),
    ("copy", ("copy", "cat", "memcpy", "memset")),
]


def kernel_time_by_kind(loop, cuda: bool) -> dict:
    """GPU (on CPU: operator self-time) milliseconds of one denoising loop by kernel kind (sum of kernel durations; overlapping NCCL and compute
    kernels both count), plus the loop's wall milliseconds and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        wall, _ = loop()
    totals, kernels = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}, []
    for event in prof.key_averages():
        ms = (event.device_time_total if cuda else event.self_cpu_time_total) / 1e3
        if ms <= 0:
            continue
        name = event.key.lower()
        kind = next((k for k, words in KERNEL_KINDS if any(w in name for w in words)), "other")
        totals[kind] += ms
        kernels.append((ms, event.key[:90]))
    return dict(
        wall_ms=wall * 1e3,
        by_kind=totals,
        top=[dict(ms=round(ms, 2), name=n) for ms, n in sorted(kernels, reverse=True)[:15]],
    )


def exchange_variant(sp, name: str):
    """The SequenceGroup of a ``--exchange`` name: old | direct | staged, optionally ``-late`` or ``-row`` (when the
    exchanges start; plain: per tensor)."""
    mode, _, issue = name.partition("-")
    if mode not in EXCHANGES or issue not in ("", "late", "row"):
        raise SystemExit(f"--exchange {name}: choose from {EXCHANGES}, optionally with -late or -row")
    return dataclasses.replace(sp, sampling_exchange=mode, exchange_issue=issue or "tensor")


def compare_latents(a, b) -> dict:
    """Max and relative differences of every latents tensor in ``b`` (a dict per exchange, or one tensor) against
    ``a``'s first."""
    a = next(iter(a.values())) if isinstance(a, dict) else a
    b = b if isinstance(b, dict) else {"latents": b}
    out = {}
    for name, x in b.items():
        diff = (x.float() - a.float()).abs()
        out[name] = dict(max_abs=diff.max().item(), rel_l2=(diff.norm() / a.float().norm()).item())
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--frames", type=int, default=129)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4, help="Euler steps per timed loop (2 passes each, batched)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--guidance-scale", type=float, default=7.5)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: the demo config at 4x32x32")
    parser.add_argument("--out", default=None, help="JSON results (rank 0)")
    parser.add_argument("--latents", default=None, help="save the final latents here (rank 0)")
    parser.add_argument(
        "--overlap-rows", action="store_true", help="overlap the exchanges with attention row by row (SequenceGroup)"
    )
    parser.add_argument(
        "--exchange",
        default="staged",
        help="comma-separated sampling exchanges to time interleaved: old, direct, staged, optionally -late / -row",
    )
    parser.add_argument("--profile", action="store_true", help="profile one more loop: GPU time by kernel kind")
    parser.add_argument("--compare", nargs=2, default=None, help="two saved latents files: print their difference")
    parser.add_argument("--speedup", nargs=2, default=None, help="1-GPU and 2-GPU JSON results: speed-up per variant")
    args = parser.parse_args()
    if args.compare:
        print(json.dumps(compare_latents(*(torch.load(p) for p in args.compare)), indent=1))
        return
    if args.speedup:
        one, many = (json.loads(Path(p).read_text())["median_s"] for p in args.speedup)
        one = next(iter(one.values())) if isinstance(one, dict) else one
        print(json.dumps({name: dict(s=s, speedup=round(one / s, 4)) for name, s in many.items()}, indent=1))
        return

    if args.tiny:
        args.config, args.frames, args.size, args.steps = str(ROOT / "configs/diffusion/train/demo.py"), 4, 32, 2
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    world, rank, sp = 1, 0, None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        rank, world, device = init_process_group_from_env(device)
        sp = build_sequence_groups(world, overlap_rows=args.overlap_rows)
    variants = {name: exchange_variant(sp, name) for name in args.exchange.split(",")} if sp else {"1gpu": None}
    cfg = load_config(args.config)
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)  # the same random weights on every rank and in every run
    model = build_module(role_model_config(cfg), MODELS)
    gen = torch.Generator().manual_seed(1)
    with (
        torch.no_grad()
    ):  # zero-initialised layers (output, modulation gates) too: else v = 0 and outputs match trivially
        for param in model.parameters():
            if not param.any():
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    model = model.to(device, dtype).eval().requires_grad_(False)
    vae = build_module(cfg["vae"], MODELS).to(device, dtype).eval()
    text_encoder = build_module(cfg["text_encoder"], MODELS).to(device).eval()
    sampler = VideoSampler(model, vae, text_encoder, shift=(cfg.get("method") or {}).get("shift"), progress=False)
    latent_size = sampler.latent_size(args.frames, args.size, args.size)
    tokens = 1
    for n, p in zip(latent_size, sampler.patch_size):
        tokens *= n // p
    text, null_text = sampler.encode_text(["a long video"])
    condition = sampler.prepare_condition(1, latent_size)
    noise = seeded_noise([0], (vae.latent_channels, *latent_size), device=device)

    def loop(variant=None):
        if variant is not None:
            sampler.set_sequence_parallel(variants[variant])
        sync(device)
        start = time.perf_counter()
        out = sampler.denoise(
            noise, text, null_text, condition, num_steps=args.steps, guidance_scale=args.guidance_scale
        )
        sync(device)
        return time.perf_counter() - start, out

    for name in variants:
        loop(name)  # warm-up (kernels, allocator, NCCL communicators)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds, latents = {name: [] for name in variants}, {}
    for _ in range(args.repeats):
        for name in variants:  # interleaved
            elapsed, latents[name] = loop(name)
            seconds[name].append(elapsed)
    first = next(iter(variants))
    result = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        config=os.path.relpath(args.config, ROOT),
        world_size=world,
        sequence_parallel_size=1 if sp is None else sp.size,
        overlap_rows=sp is not None and sp.overlap_rows,
        exchanges=list(variants),
        device=torch.cuda.get_device_name(device) if cuda else "cpu",
        dtype=str(dtype).replace("torch.", ""),
        latent_size=list(latent_size),
        video_tokens=tokens,
        text_tokens=int(text["text_emb"].shape[1]),
        steps=args.steps,
        passes_per_step=2 if args.guidance_scale != 1 else 1,
        seconds=seconds,
        median_s={name: statistics.median(s) for name, s in seconds.items()},
        s_per_step={name: statistics.median(s) / args.steps for name, s in seconds.items()},
        bitwise_as_first={name: bool(torch.equal(x, latents[first])) for name, x in latents.items()},
        peak_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
    )
    if args.profile:
        result["profile_ms"] = {name: kernel_time_by_kind(lambda: loop(name), cuda) for name in variants}
    if rank == 0:
        print(json.dumps(result, indent=1))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        if args.latents:
            torch.save({name: x.cpu() for name, x in latents.items()}, args.latents)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
