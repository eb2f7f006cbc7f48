#!/usr/bin/env python
"""Jano region cache and OffloadManager on one GPU, side by side in one run. Three parts:

(a) quality on the trained MovingShapes teacher (benchmarks/gpu_moving_shapes.sh trains it): full compute, Jano
    settings, Jano with --jano-offload and the TeaCache-style baseline sample the 72 held captions with the same seeds;
    PSNR of every video against the full-compute one, the evaluator's colour / shape / direction accuracy, model
    FLOPs ratio (counted per call) and wall-clock ratio (median of timed generations after a warm-up);
(b) the 1B MMDiT shape (random weights; 2304 video + 512 text tokens, CFG batch of 2 rows): CUDA-event time of one
    forward at each step level, with fixed regions (active / medium / static fractions);
    With a GPU the same levels again as CUDA graphs (``--jano-graphs``: RegionGraphs on a StaticDeviceStore), and
    each level's speed-up from the graphs;
(c) offload: a fixed level schedule (one refresh, then cached steps) with the caches on the GPU, in the packed
    dual-stream PackedOffloadManager (--jano-offload; a few slot sizes), static-only offload, the earlier per-entry
    slot-ring OffloadManager, and a naive synchronous .cpu()/.to(); GPU memory held by the caches, and a
    torch.profiler trace summarised as the fraction of copy time that overlaps compute kernels; with it (or alone,
    --parts host, which needs no GPU) the host cost of each manager: its Python time and CUDA calls per step over the
    same schedule, driven on a counting backend without a model. With a GPU also both stores with graphs
    (``device_graphs``, ``offload_graphs``), and paired alternated runs of (device, offload), (device_graphs,
    offload_graphs) and (device, device_graphs): the offload goal is checked on the graphed pair.

  python -m benchmarks.jano --config configs/diffusion/train/moving_shapes_gpu.py --ckpt CKPT_DIR --out OUT.json
  python -m benchmarks.jano --smoke          # CPU: tiny random model, parts (a)-(c) without timings that matter

Results: JSON to --out; a summary table and the goal checks (>= 2x fewer FLOPs and >= 1.8x wall-clock at PSNR >= 25
dB and accuracy within 2 points; offload <= 3% slower than on-GPU caches) are printed at the end.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.offload_stores import NaiveOffload, OffloadManager, SplitStore
from opensora.inference.cache import jano
from opensora.inference.cache.jano import ACTIVE, FULL, MEDIUM, REFRESH, JanoCache, JanoConfig
from opensora.inference.cache.region_graphs import RegionGraphs
from opensora.inference.cache.stores import DeviceStore, PackedOffloadManager, StaticDeviceStore, make_store

CUDA = torch.cuda.is_available()
MANAGERS = (OffloadManager, PackedOffloadManager)
LEVEL_NAMES = {FULL: "L0 full", REFRESH: "L3 full+refresh", MEDIUM: "L2 active+medium", ACTIVE: "L1 active"}


def sync():
    if CUDA:
        torch.cuda.synchronize()


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR (dB) of uint8 videos; identical videos count as 100 dB."""
    mse = (a.float() - b.float()).pow(2).mean().item()
    return 100.0 if mse == 0 else 10 * math.log10(255.0**2 / mse)


def timed(fn, repeats: int, warmup: int = 1):
    """Median seconds of ``fn()`` (CUDA events on the GPU, perf_counter otherwise) and the last result."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        sync()
        if CUDA:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times), times, out


# --------------------------------------------------------------------------------------------------------------
# (a) quality on the MovingShapes teacher
# --------------------------------------------------------------------------------------------------------------
def quality_methods(num_steps: int) -> dict:
    """Name -> accelerator factory. Jano's 6-of-50 warm-up scaled to the step count."""
    warmup = max(2, round(num_steps * 6 / 50))
    base = dict(warmup_steps=warmup, cooldown_steps=1)
    settings = {
        "jano_r5_m2": dict(refresh_interval=5, medium_interval=2),
        "jano_r8_m3_d0": dict(refresh_interval=8, medium_interval=3, dilation=0),
        "jano_r12_m4_d0": dict(refresh_interval=12, medium_interval=4, dilation=0),
        "jano_r8_m3_d0_t.3": dict(
            refresh_interval=8, medium_interval=3, dilation=0, static_threshold=0.3, medium_threshold=0.7
        ),
        "jano_r8_m3_d0_per_row": dict(refresh_interval=8, medium_interval=3, dilation=0, share_branches=False),
        "jano_r8_m3_d0_q.9": dict(refresh_interval=8, medium_interval=3, dilation=0, batch_quantile=0.9),
        "jano_r8_m3_d0_offload": dict(refresh_interval=8, medium_interval=3, dilation=0, store="offload"),
    }
    methods = {"full": lambda: jano.FullCompute()}
    for name, extra in settings.items():
        methods[name] = lambda extra=extra: JanoCache(JanoConfig(**base, **extra))
    for threshold in (0.05, 0.1, 0.25):
        methods[f"teacache_{threshold}"] = lambda threshold=threshold: jano.StepCache(threshold, warmup, 1)
    return methods


def build_sampler(cfg, ckpt):
    from opensora.inference.sampler import VideoSampler, resolve_device, resolve_sampling_dtype, role_model_config
    from opensora.registry import MODELS, build_module

    if ckpt is not None:
        return VideoSampler.from_config(cfg, ckpt, role=cfg.get("role", "model"), progress=False)
    # smoke: random weights (zero-initialised layers too, so caching changes something)
    device = resolve_device("auto")
    dtype = resolve_sampling_dtype("auto", device)
    model = build_module(role_model_config(cfg), MODELS)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model = model.to(device, dtype).eval().requires_grad_(False)
    vae = build_module(cfg["vae"], MODELS).to(device, dtype).eval().requires_grad_(False)
    text = build_module(cfg["text_encoder"], MODELS).to(device).eval()
    shift = (cfg.get("method") or {}).get("shift") or {}
    return VideoSampler(model, vae, text, shift=shift, device=device, progress=False)


def part_quality(args) -> dict:
    from benchmarks.common import held_caption_setup
    from opensora.config import load_config
    from opensora.eval.moving_shapes import score_rows

    cfg = load_config(args.config)
    sampler = build_sampler(cfg, args.ckpt)
    (num_frames, height, width), prompts, seeds = held_caption_setup(cfg, args.num_prompts, args.seed)

    def generate():
        return sampler.generate(
            prompts,
            seeds,
            num_frames=num_frames,
            height=height,
            width=width,
            num_steps=args.num_steps,
            guidance_scale=args.guidance_scale,
            batch_size=len(prompts),
        )

    rows, reference, jano_videos = {}, None, None
    for name, factory in quality_methods(args.num_steps).items():
        if "offload" in name and not CUDA:
            continue
        accelerator = factory()
        sampler.accelerator = accelerator
        videos = generate()  # scored (and the warm-up of the timing)
        stats = accelerator.stats.as_dict()
        accelerator.reset_stats()
        seconds, all_seconds, _ = timed(generate, args.repeats, warmup=0)
        report = score_rows([(f"s{i:04d}", text, videos[i], None) for i, text in enumerate(prompts)])
        if reference is None:
            reference = videos
        per_video = [psnr(videos[i], reference[i]) for i in range(len(prompts))]
        row = dict(
            seconds=seconds,
            seconds_all=all_seconds,
            flops=stats["flops"],
            full_flops=stats["full_flops"],
            flops_per_sample=stats["flops"] / len(prompts),
            flops_ratio=stats["flops_ratio"],
            levels=stats["levels"],
            psnr_mean=statistics.mean(per_video),
            psnr_min=min(per_video),
            color_acc=report.color_acc,
            shape_acc=report.shape_acc,
            direction_acc=report.direction_acc,
            all_acc=report.all_acc,
            n=report.n,
        )
        if isinstance(accelerator, JanoCache) and accelerator.region_counts is not None:
            counts = accelerator.region_counts
            total = sum(counts[k][0] for k in counts)
            row["region_fractions"] = {k: statistics.mean(counts[k]) / total for k in counts}
            row["computed_fraction_l1_l2"] = [accelerator.plan.k_active / total, accelerator.plan.k_medium / total]
            if isinstance(accelerator.store, MANAGERS):
                row["offload_stats"] = dict(accelerator.store.stats)
        if name == "jano_r8_m3_d0":
            jano_videos = videos
        if name == "jano_r8_m3_d0_offload" and jano_videos is not None:
            row["equal_to_on_gpu_jano"] = bool(torch.equal(videos, jano_videos))
        rows[name] = row
        print(
            f"[quality] {name}: {seconds:.3f} s, FLOPs x{row['flops_ratio']:.2f}, PSNR {row['psnr_mean']:.2f} dB, "
            f"acc {row['color_acc']:.3f}/{row['shape_acc']:.3f}/{row['direction_acc']:.3f}",
            flush=True,
        )
    sampler.accelerator = None
    full = rows["full"]
    for row in rows.values():
        row["speedup"] = full["seconds"] / row["seconds"]
    return dict(
        config=str(args.config),
        ckpt=None if args.ckpt is None else str(args.ckpt),
        num_steps=args.num_steps,
        guidance_scale=args.guidance_scale,
        batch=len(prompts),
        size=[num_frames, height, width],
        methods=rows,
    )


# --------------------------------------------------------------------------------------------------------------
# (b) and (c): the 1B shape with fixed regions
# --------------------------------------------------------------------------------------------------------------
def build_big(args):
    from opensora.models.mmdit import MMDiT, mmdit_config

    preset = "tiny" if args.smoke else "1b"
    overrides = dict(in_channels=16, text_dim=4096 if not args.smoke else 32, pooled_dim=768 if not args.smoke else 16)
    if args.smoke:
        overrides.update(hidden_size=64, num_heads=2, axes_dims=(8, 12, 12))
    cfg = mmdit_config(preset, **overrides)
    cfg.pop("type")
    device = torch.device("cuda" if CUDA else "cpu")
    dtype = torch.bfloat16 if CUDA else torch.float32
    with torch.device(device):
        model = MMDiT(**cfg)
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=device) * 0.02)
    model = model.to(dtype).eval().requires_grad_(False)
    frames, side, text_len = (9, 32, 512) if not args.smoke else (2, 8, 8)
    rows = 2  # one sample, CFG
    x = torch.randn(rows, 16, frames, side, side, generator=gen, device=device).to(dtype)
    inputs = dict(
        x=x,
        timestep=torch.full((rows,), 0.5, device=device, dtype=dtype),
        text_emb=torch.randn(rows, text_len, overrides["text_dim"], generator=gen, device=device).to(dtype),
        text_mask=None,
        pooled=torch.randn(rows, overrides["pooled_dim"], generator=gen, device=device).to(dtype),
    )
    n = frames * (side // 2) ** 2
    classes = torch.ones(rows, n, dtype=torch.int8)
    for r in range(rows):  # random regions per row: active / medium fractions
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(r))
        classes[r, perm[: int(args.active * n)]] = 3
        classes[r, perm[int(args.active * n) : int((args.active + args.medium) * n)]] = 2
    return model, inputs, jano.RegionPlan.from_classes(classes.to(device))


def run_level(forward, store, plan, inputs, level, following=None, store_medium=True, upcoming=tuple):
    """One forward at ``level``; like JanoCache, queue the ``following`` step's prefetches right after it (and hint
    the keys of the steps after that, ``upcoming()``, to a store that uses hints)."""
    if level in (ACTIVE, MEDIUM):
        store.begin_fetch_step(plan.entry_keys(forward.num_layers, level))
    out = forward(level, **inputs, plan=plan, store=store, store_medium=store_medium)
    if following in (ACTIVE, MEDIUM):
        store.begin_fetch_step(plan.entry_keys(forward.num_layers, following))
        if getattr(store, "wants_hints", False):
            store.hint_upcoming(list(upcoming()))
    return out


def reserve(forward, store, plan, model, inputs):
    rows, heads = inputs["x"].shape[0], model.num_heads
    head_dim, dtype = model.hidden_size // heads, model.img_in.weight.dtype
    for part, count in (("m", plan.k_medium - plan.k_active), ("s", plan.num_tokens - plan.k_medium)):
        for layer in range(forward.num_layers):
            store.reserve(f"{part}_kv_{layer}", (2, rows, heads, count, head_dim), dtype)
        store.reserve(f"{part}_x", (rows, count, model.final_layer.linear.out_features), dtype)
    store.allocate()


def part_levels(model, inputs, plan, args) -> dict:
    forward, store = jano.RegionForward(model), DeviceStore()
    out = {}
    with torch.no_grad():
        run_level(forward, store, plan, inputs, REFRESH)
        for level in (FULL, REFRESH, MEDIUM, ACTIVE):
            seconds, all_seconds, _ = timed(
                lambda: run_level(forward, store, plan, inputs, level), args.level_repeats, warmup=2
            )
            out[LEVEL_NAMES[level]] = dict(
                ms=seconds * 1000, ms_all=[s * 1000 for s in all_seconds], computed_tokens=plan.computed(level)
            )
        seconds, _, _ = timed(lambda: model(**inputs), args.level_repeats, warmup=2)
        out["model.forward"] = dict(ms=seconds * 1000, computed_tokens=plan.num_tokens)
        graphed, graph_summary = None, None
        if CUDA:
            try:  # new code on the GPU: a failure here must not cost the rest of the run
                graphed, graph_summary = part_levels_graphed(forward, model, inputs, plan, args)
            except Exception as error:  # noqa: BLE001
                graph_summary = dict(error=f"{type(error).__name__}: {error}")
                print(f"[levels] graphed levels failed: {graph_summary['error']}", flush=True)
    full_ms = out[LEVEL_NAMES[FULL]]["ms"]
    for row in out.values():
        row["speedup_vs_full"] = full_ms / row["ms"]
    for name, row in (graphed or {}).items():
        row["speedup_vs_full"] = full_ms / row["ms"]
        row["speedup_vs_eager"] = out[name]["ms"] / row["ms"]
    return dict(
        tokens=plan.num_tokens,
        active=args.active,
        medium=args.medium,
        k_active=plan.k_active,
        k_medium=plan.k_medium,
        levels=out,
        levels_graphed=graphed,
        graphs=graph_summary,
    )


def part_levels_graphed(forward, model, inputs, plan, args) -> dict:
    """Each level as a CUDA graph (RegionGraphs on caches at fixed GPU addresses), timed like the eager levels."""
    graphs, store = RegionGraphs(forward), StaticDeviceStore(inputs["x"].device)
    reserve(forward, store, plan, model, inputs)
    out = {}
    run_level(graphs, store, plan, inputs, REFRESH)
    for level in (FULL, REFRESH, MEDIUM, ACTIVE):
        seconds, all_seconds, _ = timed(
            lambda: run_level(graphs, store, plan, inputs, level), args.level_repeats, warmup=2
        )
        out[LEVEL_NAMES[level]] = dict(ms=seconds * 1000, ms_all=[s * 1000 for s in all_seconds])
    return out, graphs.summary


def copy_overlap(trace_path: str) -> dict:
    """Fraction of memcpy time (device<->host) that overlaps kernels on other streams, from a chrome trace."""
    events = json.loads(Path(trace_path).read_text()).get("traceEvents", [])
    kernels, copies = [], []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        interval = (float(e["ts"]), float(e["ts"]) + float(e["dur"]), (e.get("args") or {}).get("stream"))
        if cat == "kernel":
            kernels.append(interval)
        elif cat == "gpu_memcpy" and ("HtoD" in name or "DtoH" in name):
            copies.append((interval, "HtoD" if "HtoD" in name else "DtoH"))
    kernels.sort()
    merged = []  # union of kernel intervals
    for start, end, _ in kernels:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    starts = [start for start, _ in merged]
    out = {}
    for kind in ("HtoD", "DtoH"):
        total = overlapped = 0.0
        for (start, end, _), k in copies:
            if k != kind:
                continue
            total += end - start
            for ks, ke in merged[max(0, bisect.bisect_right(starts, start) - 1) :]:
                if ks >= end:
                    break
                if ke > start:
                    overlapped += min(end, ke) - max(start, ks)
        out[kind] = dict(copy_us=total, overlapped_fraction=overlapped / total if total else None)
    total = sum(v["copy_us"] for v in out.values())
    out["all_overlapped_fraction"] = (
        sum(v["copy_us"] * (v["overlapped_fraction"] or 0) for v in out.values()) / total if total else None
    )
    out["copies"], out["kernels"] = len(copies), len(kernels)
    return out


def part_bandwidth(args) -> dict:
    """Raw copy rates on this machine: pinned and pageable host -> device, pinned device -> host, both directions at
    once (two streams), entry-sized pinned copies, and a pinned H2D copy on a side stream next to matmuls on the
    compute stream (how much of it hides). GB/s are 1e9 bytes per second."""
    if not CUDA:
        return {}
    nbytes = 256 * 2**20
    device = torch.device("cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    dev, dev_src = (
        torch.empty(nbytes, dtype=torch.uint8, device=device),
        torch.ones(nbytes, dtype=torch.uint8, device=device),
    )
    side, other = torch.cuda.Stream(), torch.cuda.Stream()

    def rate(fn, repeats=5):
        seconds, _, _ = timed(fn, repeats, warmup=1)
        return seconds

    def on(stream, fn):
        def run():
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream().wait_stream(stream)

        return run

    out = {}
    out["h2d_pinned_GBps"] = nbytes / rate(on(side, lambda: dev.copy_(pinned, non_blocking=True))) / 1e9
    out["d2h_pinned_GBps"] = nbytes / rate(on(other, lambda: pinned_out.copy_(dev_src, non_blocking=True))) / 1e9
    out["h2d_pageable_GBps"] = nbytes / rate(lambda: dev.copy_(pageable)) / 1e9
    chunk = 14 * 2**20  # about one static K/V entry of the 1B shape

    def chunks():
        for start in range(0, nbytes - chunk + 1, chunk):
            dev[start : start + chunk].copy_(pinned[start : start + chunk], non_blocking=True)

    out["h2d_pinned_14MiB_copies_GBps"] = (nbytes // chunk) * chunk / rate(on(side, chunks)) / 1e9

    def both():
        side.wait_stream(torch.cuda.current_stream())
        other.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dev.copy_(pinned, non_blocking=True)
        with torch.cuda.stream(other):
            pinned_out.copy_(dev_src, non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.current_stream().wait_stream(other)

    out["h2d_plus_d2h_concurrent_GBps"] = 2 * nbytes / rate(both) / 1e9
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)

    def matmuls():
        for _ in range(40):
            a @ a

    copy_s = rate(on(side, lambda: dev.copy_(pinned, non_blocking=True)))
    mm_s = rate(matmuls)

    def together():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dev.copy_(pinned, non_blocking=True)
        matmuls()
        torch.cuda.current_stream().wait_stream(side)

    both_s = rate(together)
    out["copy_next_to_matmuls"] = dict(
        copy_ms=copy_s * 1e3,
        matmul_ms=mm_s * 1e3,
        together_ms=both_s * 1e3,
        hidden_fraction=max(0.0, min(1.0, (copy_s + mm_s - both_s) / min(copy_s, mm_s))),
    )
    # Launch-bound work (many tiny kernels, as the region forward's level-1 step at this shape) next to a copy:
    # does a saturated host -> device link delay kernel launches (the GPU fetches its commands over the same link)?
    small = torch.zeros(1024, device=device)

    def tiny_kernels():
        for _ in range(3000):
            small.add_(1.0)

    alone_s = rate(tiny_kernels)
    results = dict(kernels=3000, alone_ms=alone_s * 1e3)
    for name, fn in (
        ("with_h2d", lambda: dev.copy_(pinned, non_blocking=True)),
        ("with_d2h", lambda: pinned_out.copy_(dev_src, non_blocking=True)),
    ):

        def next_to_copy(fn=fn):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(4):  # ~20 ms of copying: longer than the kernels alone
                    fn()
            tiny_kernels()
            done = torch.cuda.Event(enable_timing=True)
            done.record()
            torch.cuda.current_stream().wait_stream(side)
            return done

        start = torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(4):
            sync()
            start.record()
            done = next_to_copy()
            sync()
            times.append(start.elapsed_time(done))
        results[f"{name}_ms"] = statistics.median(times[1:])
    out["tiny_kernels_next_to_copy"] = results
    return out


def _trace_events(trace_path: str) -> list:
    return json.loads(Path(trace_path).read_text()).get("traceEvents", [])


def compute_gaps(trace_path: str, min_gap_us: float = 5.0) -> dict:
    """Where the compute stream (the stream with the most kernels) sat idle, from a chrome trace: each gap between
    two of its kernels counts as *host* time up to the moment the next kernel's launch call returned on the CPU (the
    GPU had nothing queued) and as *wait* time after it (queued but held back: an event wait on a copy, or a copy
    engine); the wait time overlapped by host -> device copies is reported apart. Memcpy/memset on the compute
    stream are counted too (a device-to-device copy there shares the copy engines with the offload copies)."""
    events = _trace_events(trace_path)
    launches, kernels, copies, compute_memcpy = {}, [], [], {}
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        args, cat = e.get("args") or {}, e.get("cat", "")
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if cat == "cuda_runtime" or cat == "cuda_driver":
            if "correlation" in args:
                launches[args["correlation"]] = end
        elif cat == "kernel":
            kernels.append((start, end, args.get("stream"), args.get("correlation")))
        elif cat in ("gpu_memcpy", "gpu_memset"):
            copies.append((start, end, args.get("stream"), e.get("name", "")))
    if not kernels:
        return {}
    streams = {}
    for k in kernels:
        streams[k[2]] = streams.get(k[2], 0) + 1
    compute = max(streams, key=streams.get)
    mine = sorted(k for k in kernels if k[2] == compute)
    h2d = sorted((s, e) for s, e, stream, name in copies if "HtoD" in name)
    h2d_ends = sorted(e for _, e in h2d)
    host = wait = wait_under_h2d = wait_released_by_copy = 0.0
    for (_, prev_end, _, _), (start, _, _, corr) in zip(mine[:-1], mine[1:]):
        gap = start - prev_end
        if gap < min_gap_us:
            continue
        launched = launches.get(corr, prev_end)
        host_part = min(gap, max(0.0, launched - prev_end))
        host += host_part
        wait_start = prev_end + host_part
        wait += start - wait_start
        for cs, ce in h2d:  # few hundred copies: a plain scan is fine
            if cs < start and ce > wait_start:
                wait_under_h2d += min(ce, start) - max(cs, wait_start)
        # a wait that ends right after a copy ends is the compute stream waiting on that copy's event; one that does
        # not was held back by something else (e.g. launches delayed by a busy host -> device link)
        i = bisect.bisect_right(h2d_ends, start)
        if i and start - h2d_ends[i - 1] <= 15.0 and h2d_ends[i - 1] > wait_start:
            wait_released_by_copy += start - wait_start
    for s, e, stream, name in copies:
        if stream == compute:
            kind = name.split(" ")[1] if " " in name else name
            entry = compute_memcpy.setdefault(kind, [0, 0.0])
            entry[0] += 1
            entry[1] += e - s
    span = mine[-1][1] - mine[0][0]
    busy = sum(e - s for s, e, _, _ in mine)
    return dict(
        compute_span_us=span,
        compute_kernel_us=busy,
        gap_host_us=host,
        gap_wait_us=wait,
        gap_wait_under_h2d_us=wait_under_h2d,
        gap_wait_ended_by_h2d_us=wait_released_by_copy,
        compute_stream_copies={k: dict(count=v[0], us=v[1]) for k, v in compute_memcpy.items()},
        streams=len(streams),
    )


def entry_bytes(model, inputs, plan) -> dict:
    """Bytes of every cache entry (the layout ``reserve`` announces)."""
    rows, heads = inputs["x"].shape[0], model.num_heads
    head_dim, size = model.hidden_size // heads, model.img_in.weight.element_size()
    layers = len(model.double_blocks) + len(model.single_blocks)
    out = {}
    for part, count in (("m", plan.k_medium - plan.k_active), ("s", plan.num_tokens - plan.k_medium)):
        for layer in range(layers):
            out[f"{part}_kv_{layer}"] = 2 * rows * heads * count * head_dim * size
        out[f"{part}_x"] = rows * count * model.final_layer.linear.out_features * size
    return out


def level_traffic(schedule, plan, layers, sizes) -> list:
    """Per step of ``schedule``: (H2D bytes the step reads from the cache, D2H bytes it stores) when every read
    crosses the bus and medium entries are stored only when a later level-1 step reads them."""
    out = []
    for i, level in enumerate(schedule):
        h2d = sum(sizes[k] for k in plan.entry_keys(layers, level)) if level in (ACTIVE, MEDIUM) else 0
        if level == REFRESH:
            d2h = sum(sizes.values())
        elif level == MEDIUM and jano.medium_read_later(lambda j: schedule[j], i, len(schedule)):
            d2h = sum(v for k, v in sizes.items() if k.startswith("m_"))
        else:
            d2h = 0
        out.append((h2d, d2h))
    return out


def floors(schedule, traffic, device_ms_per_level, bandwidth) -> dict:
    """Per level: compute (caches on the GPU), H2D and D2H bytes, copy ms at the measured pinned rates, and the floor
    max(compute, H2D ms, D2H ms) a perfectly overlapped offload could reach; totals over the schedule."""
    h2d_rate = bandwidth.get("h2d_pinned_GBps") or float("nan")
    d2h_rate = bandwidth.get("d2h_pinned_GBps") or float("nan")
    per_level, total_floor, total_compute = {}, 0.0, 0.0
    for level, (h2d, d2h) in zip(schedule, traffic):
        name = LEVEL_NAMES[level]
        compute = device_ms_per_level.get(name, float("nan"))
        h2d_ms, d2h_ms = h2d / h2d_rate / 1e6, d2h / d2h_rate / 1e6
        floor = max(compute, h2d_ms, d2h_ms)
        total_floor += floor
        total_compute += compute
        per_level.setdefault(
            name,
            dict(
                compute_ms=compute,
                h2d_MB=h2d / 1e6,
                d2h_MB=d2h / 1e6,
                h2d_ms=h2d_ms,
                d2h_ms=d2h_ms,
                floor_ms=floor,
                bound="copy" if floor > compute else "compute",
            ),
        )
    return dict(
        per_level=per_level,
        floor_ms_per_step=total_floor / len(schedule),
        compute_ms_per_step=total_compute / len(schedule),
        floor_slowdown_vs_device=total_floor / total_compute - 1,
    )


OFFLOAD_SCHEDULE = [REFRESH, ACTIVE, MEDIUM, ACTIVE, MEDIUM, REFRESH, ACTIVE, MEDIUM, ACTIVE, MEDIUM]


class CountingBackend:
    """The backend verbs of the offload managers at no cost (meta tensors, copies not run), counting each CUDA
    call they stand for: the host-side cost of a manager is its Python time here plus these calls."""

    def __init__(self):
        self.calls = {}

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def new_stream(self):
        return object()

    def current_stream(self):
        return None

    def use_stream(self, stream):
        self._count("set_stream")
        return contextlib.nullcontext()

    def new_event(self):
        self._count("new_event")
        return object()

    def record(self, event, stream):
        self._count("record")

    def wait(self, stream, event):
        self._count("wait")

    def done(self, event):
        self._count("query")
        return True

    def pinned_empty(self, shape, dtype):
        return torch.empty(tuple(shape), dtype=dtype, device="meta")

    def device_empty(self, numel, dtype):
        return torch.empty(numel, dtype=dtype, device="meta")

    def copy(self, dst, src):
        self._count("copy")

    def synchronize(self, stream):
        pass


def host_managers():
    """Name -> manager factory (given a backend) for the host-cost simulation."""
    return {
        "offload (packed)": lambda b: PackedOffloadManager(backend=b),
        "offload_packed_32MiBx4": lambda b: PackedOffloadManager(slot_bytes=32 * 2**20, slots=4, backend=b),
        "offload_slots": lambda b: OffloadManager(backend=b),
        "offload_v1": lambda b: OffloadManager(backend=b, reuse_slots=False),
    }


def part_host(model, inputs, plan, args, repeats: int = 20) -> dict:
    """Host cost of each manager at the benchmark's entry counts: the store / prefetch / fetch / release calls that
    RegionForward and JanoCache make over OFFLOAD_SCHEDULE, driven without a model, on a counting backend. Reports
    Python microseconds per step and CUDA calls per step (each costs the host a few microseconds on a real GPU)."""
    schedule = OFFLOAD_SCHEDULE
    layers = len(model.double_blocks) + len(model.single_blocks)
    rows, heads = inputs["x"].shape[0], model.num_heads
    head_dim, dtype = model.hidden_size // heads, model.img_in.weight.dtype
    features = model.final_layer.linear.out_features
    k1, k2, n = plan.k_active, plan.k_medium, plan.num_tokens
    shapes = {}
    for part, count in (("m", k2 - k1), ("s", n - k2)):
        for layer in range(layers):
            shapes[f"{part}_kv_{layer}"] = (2, rows, heads, count, head_dim)
        shapes[f"{part}_x"] = (rows, count, features)
    sources = {key: torch.empty(shape, dtype=dtype, device="meta") for key, shape in shapes.items()}
    names = [f"kv_{layer}" for layer in range(layers)] + ["x"]

    def trajectory(store):
        store.clear()
        for key, shape in shapes.items():
            store.reserve(key, shape, dtype)
        for i, level in enumerate(schedule):
            following = schedule[i + 1] if i + 1 < len(schedule) else None
            medium = jano.medium_read_later(lambda j: schedule[j], i, len(schedule))
            if level in (ACTIVE, MEDIUM):
                store.begin_fetch_step(plan.entry_keys(layers, level))
            for name in names:
                if level == REFRESH:
                    store.store_async(sources[f"m_{name}"], f"m_{name}")
                    store.store_async(sources[f"s_{name}"], f"s_{name}")
                    continue
                if level == MEDIUM and medium:
                    store.store_async(sources[f"m_{name}"], f"m_{name}")
                keys = plan.reads(level, name)
                for key in keys:
                    store.fetch(key)
                for key in keys:
                    store.release(key)
            store.flush()
            if following in (ACTIVE, MEDIUM):
                store.begin_fetch_step(plan.entry_keys(layers, following))
                store.hint_upcoming([])

    out = {}
    for name, make in host_managers().items():
        backend = CountingBackend()
        store = make(backend)
        trajectory(store)  # warm-up: layout, plans, views
        backend.calls.clear()
        t0 = time.perf_counter()
        for _ in range(repeats):
            trajectory(store)
        seconds = time.perf_counter() - t0
        steps = repeats * len(schedule)
        calls = {k: v / steps for k, v in sorted(backend.calls.items())}
        out[name] = dict(python_us_per_step=seconds / steps * 1e6, cuda_calls_per_step=calls)
    return dict(schedule=schedule, entries=len(shapes), managers=out)


def offload_variants(device) -> dict:
    """Name -> (store factory, whether unread medium entries are stored anyway). ``offload`` is what --jano-offload
    runs (PackedOffloadManager: 3 slots of 64 MiB); ``offload_slots`` the per-entry slot-ring OffloadManager it
    replaced; ``offload_v1`` that manager as first measured (no slot reuse, every medium entry stored)."""
    variants = {
        "device": (lambda: make_store("device", device), False),
        "naive": (lambda: NaiveOffload(device), False),
    }
    if CUDA:
        variants.update(
            {
                "offload": (lambda: make_store("offload", device), False),
                "offload_packed_32MiBx4": (lambda: PackedOffloadManager(device, 32 * 2**20, 4), False),
                "offload_packed_128MiBx2": (lambda: PackedOffloadManager(device, 128 * 2**20, 2), False),
                "offload_static": (
                    lambda: SplitStore(
                        DeviceStore(), make_store("offload", device), lambda key: not key.startswith("s_")
                    ),
                    False,
                ),
                "offload_slots": (lambda: OffloadManager(device), False),
                "offload_v1": (lambda: OffloadManager(device, reuse_slots=False), True),
                # --jano-graphs: the stores at fixed addresses that RegionGraphs replays against
                "device_graphs": (lambda: make_store("device", device, graphs=True), False),
                "offload_graphs": (lambda: make_store("offload", device, graphs=True), False),
                # deeper staging rings: more copies in flight ahead of the replay (level 1 is ~80% copy time)
                "offload_graphs_64MiBx4": (
                    lambda: PackedOffloadManager(device, 64 * 2**20, 4, fixed_slots=True),
                    False,
                ),
                "offload_graphs_64MiBx3": (  # what offload_graphs was first (--jano-offload's eager ring)
                    lambda: PackedOffloadManager(device, 64 * 2**20, 3, fixed_slots=True),
                    False,
                ),
            }
        )
    return variants


GRAPHED = {"device_graphs", "offload_graphs", "offload_graphs_64MiBx4", "offload_graphs_64MiBx3"}  # RegionGraphs
# Alternated pairs (baseline, candidate); the offload goal is checked on the graphed pair when it ran.
PAIRS = (
    ("device", "offload"),
    ("device_graphs", "offload_graphs"),
    ("device_graphs", "offload_graphs_64MiBx4"),
    ("device_graphs", "offload_graphs_64MiBx3"),
    ("device", "device_graphs"),
)


def part_offload(model, inputs, plan, args, bandwidth=None) -> dict:
    schedule = OFFLOAD_SCHEDULE
    device = inputs["x"].device
    profiled = {"offload", "offload_v1", "offload_graphs"}
    results, outputs = {}, {}
    eager_forward = jano.RegionForward(model)
    layers = eager_forward.num_layers

    def upcoming(i):  # what JanoCache hints: the cached steps after the following one, up to a refresh
        keys = []
        for level in schedule[i + 2 : i + 4]:
            if level == REFRESH:
                break
            if level in (ACTIVE, MEDIUM):
                keys += plan.entry_keys(layers, level)
        return keys

    trajectories = {}  # kind -> its trajectory, for the paired runs below
    failed = {}  # variant -> why it failed (only the graphed ones may; the others raise)

    def run_variant(kind, make, store_all_medium):
        allocated_before = torch.cuda.memory_allocated() if CUDA else 0  # earlier variants stay alive (pairs)
        store = make()
        forward = RegionGraphs(eager_forward) if kind in GRAPHED else eager_forward
        reserve(forward, store, plan, model, inputs)

        marks, host = [], []  # CUDA events between the steps of the last trajectory; host seconds to queue it

        def trajectory(store=store, store_all_medium=store_all_medium, forward=forward):
            marks.clear()
            outs = []
            t0 = time.perf_counter()
            for i, level in enumerate(schedule):
                if CUDA:
                    marks.append(torch.cuda.Event(enable_timing=True))
                    marks[-1].record()
                following = schedule[i + 1] if i + 1 < len(schedule) else None
                medium = store_all_medium or jano.medium_read_later(lambda j: schedule[j], i, len(schedule))
                outs.append(run_level(forward, store, plan, inputs, level, following, medium, lambda: upcoming(i)))
            if CUDA:
                marks.append(torch.cuda.Event(enable_timing=True))
                marks[-1].record()
            host.append(time.perf_counter() - t0)
            return outs

        if any(kind in pair for pair in PAIRS):
            trajectories[kind] = trajectory
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        stats_before = dict(getattr(store, "stats", {}) or {})
        seconds, all_seconds, outs = timed(trajectory, args.offload_repeats, warmup=1)
        outputs[kind] = outs[-1]
        results[kind] = dict(
            ms_per_step=seconds * 1000 / len(schedule),
            ms_all=[s * 1000 for s in all_seconds],
            host_ms_per_step=statistics.median(host[1:] or host) * 1000 / len(schedule),
            cache_device_bytes=store.device_bytes(),
            peak_allocated_bytes=torch.cuda.max_memory_allocated() if CUDA else None,
            peak_over_start_bytes=torch.cuda.max_memory_allocated() - allocated_before if CUDA else None,
            medium_stored_always=store_all_medium,
        )
        if CUDA:
            torch.cuda.synchronize()
            per_level = {}
            for level, start, end in zip(schedule, marks[:-1], marks[1:]):
                per_level.setdefault(LEVEL_NAMES[level], []).append(start.elapsed_time(end))
            results[kind]["ms_per_level"] = {k: statistics.median(v) for k, v in per_level.items()}
        if kind in GRAPHED:
            results[kind]["graphs"] = forward.summary
            results[kind]["graph_buffer_bytes"] = forward.device_bytes()
        manager = store if isinstance(store, MANAGERS) else getattr(store, "offload", None)
        if isinstance(manager, MANAGERS):
            runs = 1 + args.offload_repeats
            results[kind]["host_bytes"] = manager.host_bytes()
            results[kind]["stats"] = dict(manager.stats)
            results[kind]["ring_size"] = manager.ring_size
            for name in ("h2d_bytes", "d2h_bytes", "slot_hits", "h2d_copies", "d2h_copies"):
                if name not in manager.stats:
                    continue
                done = manager.stats[name] - stats_before.get(name, 0)
                results[kind][f"{name}_per_step"] = done / runs / len(schedule)
        if kind in profiled and CUDA:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                trajectory()
                sync()
            with tempfile.TemporaryDirectory() as tmp:
                path = str(Path(tmp) / "trace.json")
                prof.export_chrome_trace(path)
                results[kind]["profile"] = copy_overlap(path)
                results[kind]["profile"]["compute_gaps"] = compute_gaps(path)
                if args.trace:
                    trace = Path(args.trace)
                    trace.mkdir(parents=True, exist_ok=True)
                    import gzip

                    with gzip.open(trace / f"trace_{kind}.json.gz", "wt") as f:
                        f.write(Path(path).read_text())
        del store

    with torch.no_grad():
        for kind, (make, store_all_medium) in offload_variants(device).items():
            try:
                run_variant(kind, make, store_all_medium)
            except Exception as error:  # noqa: BLE001  (a new variant failing must not cost the measured ones)
                if kind not in GRAPHED:
                    raise
                failed[kind] = f"{type(error).__name__}: {error}"
                print(f"[offload] variant {kind} failed: {failed[kind]}", flush=True)
                for table in (trajectories, results, outputs):
                    table.pop(kind, None)
        paired = {}
        for baseline, candidate in PAIRS if CUDA else ():
            if baseline not in trajectories or candidate not in trajectories:
                continue
            # The host of the lent machines drifts by ~10% over seconds: alternate the two trajectories and take the
            # median of the per-pair ratios, which the drift mostly cancels out of.
            base_ms, cand_ms = [], []
            for _ in range(args.paired_repeats):
                for kind, times in ((baseline, base_ms), (candidate, cand_ms)):
                    seconds, _, _ = timed(trajectories[kind], 1, warmup=0)
                    times.append(seconds * 1000 / len(schedule))
            paired[f"{candidate}_vs_{baseline}"] = dict(
                pairs=args.paired_repeats,
                baseline=baseline,
                candidate=candidate,
                baseline_ms_per_step=statistics.median(base_ms),
                candidate_ms_per_step=statistics.median(cand_ms),
                slowdown=statistics.median(c / b for c, b in zip(cand_ms, base_ms)) - 1,
                baseline_ms_all=base_ms,
                candidate_ms_all=cand_ms,
            )
        trajectories.clear()
    base = results["device"]["ms_per_step"]
    for kind, row in results.items():
        row["slowdown_vs_device"] = row["ms_per_step"] / base - 1
        row["output_equal_to_device"] = bool(torch.equal(outputs[kind], outputs["device"]))
        row["max_abs_diff_to_device"] = (outputs[kind].float() - outputs["device"].float()).abs().max().item()
    for kind in sorted(GRAPHED - {"device_graphs"}):
        if "device_graphs" in outputs and kind in outputs:
            equal = bool(torch.equal(outputs[kind], outputs["device_graphs"]))
            results[kind]["output_equal_to_device_graphs"] = equal
    sizes = entry_bytes(model, inputs, plan)
    out = dict(
        schedule=schedule, stores=results, cache_bytes=sum(sizes.values()), paired=paired, failed_variants=failed
    )
    if bandwidth and "ms_per_level" in results["device"]:
        out["floor"] = floors(
            schedule, level_traffic(schedule, plan, layers, sizes), results["device"]["ms_per_level"], bandwidth
        )
        for row in results.values():
            row["vs_floor"] = row["ms_per_step"] / out["floor"]["floor_ms_per_step"] - 1
            if "ms_per_level" in row:
                row["per_level_vs_floor"] = {
                    name: ms / out["floor"]["per_level"][name]["floor_ms"] - 1
                    for name, ms in row["ms_per_level"].items()
                }
    return out


# --------------------------------------------------------------------------------------------------------------
def summary(result: dict) -> list:
    lines, checks = [], []
    quality = result.get("quality")
    if quality:
        lines.append(f"(a) quality: MovingShapes teacher, {quality['batch']} captions, {quality['num_steps']} steps")
        lines.append(
            f"{'method':24s} {'FLOPs x':>8s} {'wall x':>7s} {'PSNR':>7s} {'min':>6s} "
            f"{'colour':>7s} {'shape':>6s} {'dir':>6s}  L1/L2 computed"
        )
        full = quality["methods"]["full"]
        for name, row in quality["methods"].items():
            computed = row.get("computed_fraction_l1_l2")
            extra = "" if computed is None else f"  {computed[0]:.2f}/{computed[1]:.2f}"
            if "equal_to_on_gpu_jano" in row:
                extra += f"  equal to on-GPU caches: {row['equal_to_on_gpu_jano']}"
            lines.append(
                f"{name:24s} {row['flops_ratio']:8.2f} {row['speedup']:7.2f} {row['psnr_mean']:7.2f} "
                f"{row['psnr_min']:6.2f} {row['color_acc']:7.3f} {row['shape_acc']:6.3f} "
                f"{row['direction_acc']:6.3f}{extra}"
            )
            if name.startswith("jano") and "offload" not in name:
                drop = max(full[k] - row[k] for k in ("color_acc", "shape_acc", "direction_acc"))
                ok = row["flops_ratio"] >= 2 and row["speedup"] >= 1.8 and row["psnr_mean"] >= 25 and drop <= 0.02
                checks.append(
                    f"{name}: FLOPs >= 2x, wall >= 1.8x, PSNR >= 25, acc drop <= 2 pt: {'PASS' if ok else 'FAIL'}"
                )
    levels = result.get("levels")
    if levels:
        lines.append(
            f"(b) 1B shape, {levels['tokens']} video tokens, active {levels['active']:.0%} / medium "
            f"{levels['medium']:.0%} (computed L1 {levels['k_active']}, L2 {levels['k_medium']})"
        )
        for name, row in levels["levels"].items():
            lines.append(f"  {name:20s} {row['ms']:8.2f} ms/step  x{row['speedup_vs_full']:.2f}")
        for name, row in (levels.get("levels_graphed") or {}).items():
            lines.append(
                f"  graphs {name:13s} {row['ms']:8.2f} ms/step  x{row['speedup_vs_full']:.2f} vs eager L0, "
                f"x{row['speedup_vs_eager']:.2f} vs the eager level"
            )
        if levels.get("graphs"):
            lines.append(f"  graphs: {levels['graphs']}")
    bandwidth = result.get("bandwidth")
    if bandwidth:
        hide = bandwidth["copy_next_to_matmuls"]
        lines.append(
            f"copy rates (GB/s): H2D pinned {bandwidth['h2d_pinned_GBps']:.1f} (14 MiB copies "
            f"{bandwidth['h2d_pinned_14MiB_copies_GBps']:.1f}), D2H pinned {bandwidth['d2h_pinned_GBps']:.1f}, both "
            f"at once {bandwidth['h2d_plus_d2h_concurrent_GBps']:.1f}, H2D pageable {bandwidth['h2d_pageable_GBps']:.1f}; "
            f"H2D next to matmuls hidden {hide['hidden_fraction']:.0%}"
        )
        tiny = bandwidth["tiny_kernels_next_to_copy"]
        lines.append(
            f"{tiny['kernels']} tiny kernels: alone {tiny['alone_ms']:.2f} ms, next to H2D {tiny['with_h2d_ms']:.2f} ms, "
            f"next to D2H {tiny['with_d2h_ms']:.2f} ms"
        )
    host = result.get("host")
    if host:
        lines.append(
            f"host cost of the cache calls over schedule {''.join(str(v) for v in host['schedule'])} "
            f"({host['entries']} entries; counting backend, no GPU work)"
        )
        for name, row in host["managers"].items():
            calls = row["cuda_calls_per_step"]
            lines.append(
                f"  {name:24s} Python {row['python_us_per_step']:7.0f} us/step, CUDA calls/step "
                f"{sum(calls.values()):5.0f} (" + ", ".join(f"{k} {v:.0f}" for k, v in calls.items()) + ")"
            )
    offload = result.get("offload")
    if offload:
        lines.append("(c) offload: fixed schedule " + "".join(str(level) for level in offload["schedule"]))
        floor = offload.get("floor")
        if floor:
            lines.append(
                f"  floor max(compute, H2D, D2H) per level: {floor['floor_ms_per_step']:.2f} ms/step "
                f"({floor['floor_slowdown_vs_device']:+.1%} vs on-GPU compute)"
            )
            for name, row in floor["per_level"].items():
                lines.append(
                    f"    {name:18s} compute {row['compute_ms']:6.2f} ms, H2D {row['h2d_MB']:6.0f} MB "
                    f"{row['h2d_ms']:5.2f} ms, D2H {row['d2h_MB']:6.0f} MB {row['d2h_ms']:5.2f} ms -> "
                    f"{row['floor_ms']:6.2f} ({row['bound']}-bound)"
                )
        for kind, row in offload["stores"].items():
            profile = row.get("profile") or {}
            overlap = profile.get("all_overlapped_fraction")
            lines.append(
                f"  {kind:22s} {row['ms_per_step']:7.2f} ms/step  {row['slowdown_vs_device']:+7.1%}  "
                f"host {row['host_ms_per_step']:6.2f} ms/step  cache on GPU {row['cache_device_bytes'] / 2**20:7.1f} MiB"
                f"  equal {row['output_equal_to_device']}"
                + (f"  vs floor {row['vs_floor']:+.1%}" if "vs_floor" in row else "")
                + (f"  copy overlapped {overlap:.0%}" if overlap is not None else "")
            )
            if row.get("ms_per_level"):
                lines.append("    per level (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in row["ms_per_level"].items()))
            if "h2d_bytes_per_step" in row:
                lines.append(
                    f"    bytes/step H2D {row['h2d_bytes_per_step'] / 1e6:.0f} MB, D2H "
                    f"{row['d2h_bytes_per_step'] / 1e6:.0f} MB, slot hits/step {row['slot_hits_per_step']:.1f}"
                    + (
                        f", copies/step H2D {row['h2d_copies_per_step']:.0f} D2H {row['d2h_copies_per_step']:.0f}"
                        if "h2d_copies_per_step" in row
                        else ""
                    )
                )
            gaps = profile.get("compute_gaps")
            if gaps:
                lines.append(
                    f"    compute stream idle: host {gaps['gap_host_us'] / 1e3:.2f} ms, waiting "
                    f"{gaps['gap_wait_us'] / 1e3:.2f} ms ({gaps['gap_wait_under_h2d_us'] / 1e3:.2f} under H2D, "
                    f"{gaps['gap_wait_ended_by_h2d_us'] / 1e3:.2f} ended by an H2D copy's end) of "
                    f"{gaps['compute_span_us'] / 1e3:.1f} ms; copies on the compute stream "
                    f"{gaps['compute_stream_copies']}"
                )
        for kind, why in (offload.get("failed_variants") or {}).items():
            lines.append(f"  {kind} FAILED: {why}")
        paired = offload.get("paired") or {}
        for row in paired.values():
            lines.append(
                f"  paired ({row['baseline']} and {row['candidate']} alternated, {row['pairs']} pairs): "
                f"{row['baseline']} {row['baseline_ms_per_step']:.2f} ms/step, {row['candidate']} "
                f"{row['candidate_ms_per_step']:.2f} ms/step, median ratio {row['slowdown']:+.1%}"
            )
        for kind in sorted(GRAPHED - {"device_graphs"}):
            graphed = offload["stores"].get(kind)
            if graphed and "output_equal_to_device_graphs" in graphed:
                lines.append(f"  {kind} output equal to device_graphs: {graphed['output_equal_to_device_graphs']}")
        for kind in sorted(GRAPHED):
            if kind in offload["stores"]:
                row = offload["stores"][kind]
                lines.append(
                    f"  {kind}: graphs {row['graphs']}, buffers {row['graph_buffer_bytes'] / 2**20:.1f} MiB, peak "
                    f"allocated over its start {(row['peak_over_start_bytes'] or 0) / 2**20:.0f} MiB (caches, rings, "
                    f"graph pool, activations), max |diff| to eager device "
                    f"{row['max_abs_diff_to_device']:.3g}"
                )
        for kind, baseline, name in (
            ("offload", "device", "offload <= 3% slower than on-GPU caches"),
            ("offload_graphs", "device_graphs", "offload + graphs <= 3% slower than on-GPU caches + graphs"),
            ("offload_graphs_64MiBx4", "device_graphs", "same, 4 x 64 MiB ring"),
            ("offload_graphs_64MiBx3", "device_graphs", "same, 3 x 64 MiB ring"),
        ):
            if kind not in offload["stores"] or baseline not in offload["stores"]:
                continue
            pair = paired.get(f"{kind}_vs_{baseline}")
            if pair:
                slow = pair["slowdown"]
            else:
                slow = offload["stores"][kind]["ms_per_step"] / offload["stores"][baseline]["ms_per_step"] - 1
            checks.append(f"{name}{' (paired)' if pair else ''}: {'PASS' if slow <= 0.03 else 'FAIL'} ({slow:+.1%})")
    return lines + ["goals:"] + ["  " + c for c in checks]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/diffusion/train/moving_shapes_gpu.py")
    parser.add_argument(
        "--ckpt",
        default=None,
        help="teacher checkpoint; without it part (a) is skipped (or random weights with --smoke)",
    )
    parser.add_argument("--num-steps", type=int, default=30)
    parser.add_argument("--guidance-scale", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3, help="timed generations per method in (a)")
    parser.add_argument("--level-repeats", type=int, default=10)
    parser.add_argument("--offload-repeats", type=int, default=5)
    parser.add_argument("--paired-repeats", type=int, default=10, help="(c): alternated trajectories per pair")
    parser.add_argument("--active", type=float, default=0.2, help="(b)/(c): fraction of active tokens")
    parser.add_argument("--medium", type=float, default=0.3, help="(b)/(c): fraction of medium tokens")
    parser.add_argument("--parts", default="quality,levels,offload")
    parser.add_argument(
        "--trace", default=None, help="also write the offload profiles' chrome traces (gzip) to this dir"
    )
    parser.add_argument("--smoke", action="store_true", help="CPU smoke run: tiny shapes, demo config, random weights")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.config = "configs/diffusion/train/demo.py"
        args.num_steps, args.num_prompts, args.repeats = 6, args.num_prompts or 4, 1
        args.level_repeats, args.offload_repeats, args.paired_repeats = 1, 1, 1
    parts = set(args.parts.split(","))
    result = dict(device=torch.cuda.get_device_name() if CUDA else "cpu", torch=torch.__version__)
    started = time.perf_counter()
    if "quality" in parts and (args.ckpt is not None or args.smoke):
        result["quality"] = part_quality(args)
    if "offload" in parts or "bandwidth" in parts:
        result["bandwidth"] = part_bandwidth(args)
    if parts & {"levels", "offload", "host"}:
        model, inputs, plan = build_big(args)
        if "levels" in parts:
            result["levels"] = part_levels(model, inputs, plan, args)
        if "offload" in parts or "host" in parts:
            result["host"] = part_host(model, inputs, plan, args)
        if "offload" in parts:
            result["offload"] = part_offload(model, inputs, plan, args, result.get("bandwidth"))
    result["seconds"] = time.perf_counter() - started
    lines = summary(result)
    result["summary"] = lines
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
