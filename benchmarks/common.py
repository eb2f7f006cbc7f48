"""Helpers shared by the benchmark modules: the 1B benchmark shape and its model config, random weights, CUDA-event
timing, wall-clock timing between device syncs, the host-sync count and the MovingShapes held-caption set-up."""

import statistics
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where a run writes when not told (git-ignored): results/ holds only the raw files a report cites, copied there.
OUT = ROOT / "outputs" / "benchmarks"

# The 1B preset at the shape of the peer comparison with diffusers' Flux: 11 x 24 x 32 = 8448 video tokens (33 frames
# at 384x512 after the 8x VAE and 2x2 patches) + 512 text tokens, batch 1.
FULL = dict(
    grid=(11, 24, 32),
    text_tokens=512,
    depth_double=8,
    depth_single=16,
    hidden=1536,
    heads=12,
    text_dim=4096,
    pooled_dim=768,
    axes=(16, 56, 56),
)
# The same code path at CPU smoke-test size.
TINY = dict(
    grid=(2, 4, 4),
    text_tokens=8,
    depth_double=1,
    depth_single=2,
    hidden=64,
    heads=2,
    text_dim=32,
    pooled_dim=16,
    axes=(8, 12, 12),
)


def shape_tokens(shape):
    """(video tokens, text tokens) of a benchmark shape."""
    t, h, w = shape["grid"]
    return t * h * w, shape["text_tokens"]


def randomize_(model, std=0.02, seed=0):
    """Random weights everywhere (zero-initialised gates too): zeros would make kernels unrealistically fast."""
    import torch

    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * std)


def model_config(shape, **extra):
    """The 1B preset's config dict at a benchmark shape (``FULL`` / ``TINY`` keys), plus ``extra`` settings."""
    from opensora.models.mmdit import mmdit_config

    return mmdit_config(
        "1b",
        hidden_size=shape["hidden"],
        num_heads=shape["heads"],
        depth_double=shape["depth_double"],
        depth_single=shape["depth_single"],
        text_dim=shape["text_dim"],
        pooled_dim=shape["pooled_dim"],
        axes_dims=shape["axes"],
        **extra,
    )


def cuda_times_ms(fn, warmup, iters) -> list:
    """Milliseconds of each of ``iters`` calls of ``fn`` on the current CUDA device (CUDA events around each call),
    after ``warmup`` untimed calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def timed(fn):
    """(seconds, result) of one call of ``fn``, wall clock between two device syncs: a whole sampling run, with its
    host work, where CUDA events around one kernel stream would not hold all of it."""
    import time

    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started, out


def cuda_time_ms(fn, warmup, iters):
    """Median milliseconds of ``fn`` on the current CUDA device (``cuda_times_ms``)."""
    return statistics.median(cuda_times_ms(fn, warmup, iters))


def count_host_syncs(step):
    """Run one step under CUDA sync debug mode and list the synchronising calls it reports."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    messages = [str(w.message).splitlines()[0][:160] for w in caught]
    return [m for m in messages if "synchroniz" in m.lower() and "prototype" not in m]


def held_caption_setup(cfg, num_prompts=None, seed=1000, where=None, seeds_per_prompt=1):
    """(frames, height, width) of the config's one bucket, the first ``num_prompts`` held MovingShapes captions (those
    matching ``where``, each repeated ``seeds_per_prompt`` times), their seeds (``seed + i``, never a training seed)."""
    from opensora.datasets.moving_shapes import all_captions, parse_caption

    size = next(iter(cfg.bucket_config))  # "HxW"
    height, width = (int(v) for v in size.split("x"))
    num_frames = int(next(iter(cfg.bucket_config[size])))
    attributes = ("color", "shape", "direction")
    captions = [
        text
        for text in all_captions()
        if all(value in (where or {}).get(key, {value}) for key, value in zip(attributes, parse_caption(text)))
    ]
    prompts = [text for text in captions[:num_prompts] for _ in range(seeds_per_prompt)]
    return (num_frames, height, width), prompts, [seed + i for i in range(len(prompts))]
