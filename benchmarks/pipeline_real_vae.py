"""Two-GPU streaming with the real-size HunyuanVideo VAE (``python -m benchmarks.pipeline_parallel``, its default).

The 1B causal student of ``benchmarks/streaming.py`` (``mmdit_1b_synthetic.py``: random weights, chunks of 3 latent
frames, 4 steps + refill, text cache, CUDA graphs; T5 / CLIP at their real widths) with diffusers'
``AutoencoderKLHunyuanVideo()`` at its default config (246M parameters, random weights, bf16), exact-once chunk
decode (``decode_rule="running"``), the KV cache's rolling window of ``--window-frames`` latent frames (default: the
training clip's minus a chunk, as ``benchmarks/streaming.py``), ``--groups`` videos in flight, per ``--sizes`` entry:

* ``1gpu``: ``StreamingGenerator(cuda_graphs=True)`` (graphed passes, graphed decode overlapped on a side stream),
  the videos one after another: the one-GPU ``--streaming`` run;
* ``2gpu-aggressive``: ``CausalStreamingStages`` with graphed stages, the CLI's ``--pp-split auto``
  (``pipeline_parallel.cli.auto_split``: probe, timed passes, the run's own chunk decode timed, then the split and
  each video's decode GPU chosen on the simulated plan), one decoder per video (``ChunkDecoders``); one variant
  per ``--decode-streams`` entry (``side``: each GPU decodes on its decode stream, ``compute``: on its compute
  stream), each planned for itself and timed one after the other, each a ``two_gpu`` entry of the row; and per
  ``--host-copies`` entry (``Lanes(host_copies=...)``: ``shared``, the chunks' copies to the host on the peer-copy
  streams, or ``own``, on a stream of their own per GPU), a variant of each of those.

Reported per size: peak GPU memory per device, frames/s end to end (median of ``--repeats`` after a warm-up run), the speed-up, bit-identity
(max |diff| of every chunk's latents and uint8 frames against the one-GPU run), the busy fraction per GPU (CUDA events
per task, one profiled run), the decode placement and the plan's simulated busy fractions, and the chunk latency
(time between consecutive chunks handed out: first, median and worst of the later ones; the pipeline's from the
profiled run's decode ends). Frames count the pixel frames of all videos. Per variant also the plan's time and busy
fractions as simulated (``--contention``) vs measured (the profiled run's span and busy fractions), and the
contention that makes the simulated time the measured span (``fitted_contention``, on a grid of 0.05; None for the
compute-stream decode, which the factor does not touch).
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from benchmarks.streaming import REAL_VAE, clip_window, random_sampler, training_clip
from opensora.config import load_config
from opensora.inference.pipeline_parallel.cli import auto_split
from opensora.inference.pipeline_parallel.decoders import ChunkDecoders
from opensora.inference.pipeline_parallel.runtime import Lanes, run_plan
from opensora.inference.pipeline_parallel.schedule import DEFAULT_CONTENTION, schedule
from opensora.inference.pipeline_parallel.stages import all_blocks, place_model
from opensora.inference.pipeline_parallel.streaming_stages import CausalStreamingStages
from opensora.inference.streaming.chunk_graphs import ChunkGraphs
from opensora.inference.streaming.generator import StreamingGenerator

CONFIG = "configs/diffusion/train/mmdit_1b_synthetic.py"
STEP_LIST = [1.0, 0.75, 0.5, 0.25]


def _sync(devices):
    for d in devices:
        if torch.device(d).type == "cuda":
            torch.cuda.synchronize(d)


def _latency(seconds) -> dict:
    later = seconds[1:] or seconds
    return dict(first_s=seconds[0], median_s=statistics.median(later), worst_s=max(later), per_chunk_s=seconds)


def _max_diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def fitted_contention(plan, costs, span_ms: float):
    """The contention (0 to 1.5, steps of 0.05) whose simulated ``aggressive`` time of ``plan`` is nearest
    ``span_ms``; None where the decode shares no GPU stream pair (``compute``)."""
    if plan.decode_stream != "side" or not span_ms:
        return None
    grid = [round(0.05 * i, 2) for i in range(31)]
    return min(grid, key=lambda c: abs(schedule(plan, "aggressive", costs, contention=c).makespan - span_ms))


def one_size(
    sampler,
    pp_model,
    devices,
    size,
    frames,
    n_groups,
    repeats,
    say,
    decode_streams=("side",),
    contention=None,
    host_copies=("own",),
    window_frames=None,
) -> dict:
    height, width = size
    gen = StreamingGenerator(sampler, step_list=STEP_LIST, cuda_graphs=True, window_frames=window_frames)
    prompts = [[f"a red circle moving left, video {g}"] for g in range(n_groups)]
    seeds = [[100 + g] for g in range(n_groups)]

    def one_gpu():
        outs = []
        for p, s in zip(prompts, seeds):
            outs.append(list(gen.stream(p, s, frames, height, width)))
        return outs

    times_1, refs = [], None
    for d in devices:
        torch.cuda.reset_peak_memory_stats(d)
    for i in range(repeats + 1):
        _sync(devices)
        t0 = time.perf_counter()
        outs = one_gpu()
        _sync(devices)
        if i:
            times_1.append(time.perf_counter() - t0)
        refs = refs or outs
    pixel_frames = sum(c.frames.shape[1] for chunks in refs for c in chunks)
    one = dict(
        seconds=statistics.median(times_1),
        runs_s=times_1,
        latency=_latency([c.seconds for c in outs[0]]),
        decode_graph_failures=list(gen.exact_decode.failures) if gen.exact_decode is not None else [],
        peak_gib=torch.cuda.max_memory_allocated(devices[0]) / 2**30,
    )
    one["frames_per_s"] = pixel_frames / one["seconds"]
    say(
        f"  1gpu: {one['frames_per_s']:.1f} frames/s ({one['seconds']:.3f} s), peak {one['peak_gib']:.2f} GiB, "
        f"chunk latency {one['latency']}"
    )

    latent = sampler.latent_size(frames, height, width)
    latent_size = (sampler.vae.latent_channels, *latent)
    times = gen.schedule(latent)

    def encode_groups():  # the prompts' text features, as --pp-devices encodes them (a stream encodes its own)
        return [dict(seeds=s, branches=[sampler.encode_text(p)[0]]) for p, s in zip(prompts, seeds)]

    decoders = ChunkDecoders.like(gen)
    contention = DEFAULT_CONTENTION if contention is None else contention
    variants = [
        two_gpu_variant(
            pp_model, devices, gen, decoders, encode_groups, latent_size, times, refs, repeats, ds, contention, hc
        )
        for ds in decode_streams
        for hc in host_copies
    ]
    for v in variants:
        v["frames_per_s"] = pixel_frames / v["seconds"]
        v["speedup"] = one["seconds"] / v["seconds"]
    row = dict(
        size=f"{height}x{width}",
        frames=frames,
        window_frames=gen.window_frames,
        videos=n_groups,
        latent=list(latent_size),
        num_chunks=variants[0]["num_chunks"],
        pixel_frames=pixel_frames,
        vae="HunyuanVideo VAE, diffusers default config (random weights, bf16), exact-once running decode",
        one_gpu=one,
        two_gpu=variants,
        speedup={variant_name(v): v["speedup"] for v in variants},
        max_diff=max(v["max_diff"] for v in variants),
        bit_identical=all(v["max_diff"] == 0.0 for v in variants),
        runs_checked=sum(v["runs_checked"] for v in variants),
    )
    for v in variants:
        say(
            f"  2gpu-aggressive, decode on the {v['decode_stream']} stream, host copies {v['host_copies']}: "
            f"{v['frames_per_s']:.1f} frames/s "
            f"({v['seconds']:.3f} s) = {v['speedup']:.2f}x, split {v['split']} (probe {v['probe_split']}), decode of "
            f"video g on GPU {v['decode_lanes']} ({v['decode_ms_per_chunk']:.1f} ms per chunk), busy GPU0/GPU1 "
            f"{v['busy']} (simulated {[round(b, 2) for b in v['simulated_busy']]}), span {v['measured_span_ms']:.0f} ms "
            f"(simulated {v['simulated_ms']:.0f} ms at contention {contention}, fitted {v['fitted_contention']}), "
            f"max |diff| {v['max_diff']:g}, peak GiB {[round(p, 2) for p in v['peak_gib']]}, "
            f"chunk latency {v['latency_video0']}"
        )
    return row  # the graphs and decoders of this size go with the frame


def variant_name(v) -> str:
    """A two-GPU variant's key in the row's ``speedup``: its decode stream (and ``/own`` for its own host copies)."""
    return v["decode_stream"] + ("" if v["host_copies"] == "shared" else f"/{v['host_copies']}")


def two_gpu_variant(
    pp_model,
    devices,
    gen,
    decoders,
    encode_groups,
    latent_size,
    times,
    refs,
    repeats,
    decode_stream,
    contention,
    host_copies="shared",
) -> dict:
    """``2gpu-aggressive`` with each GPU's decode on ``decode_stream`` and its copies to the host on ``host_copies``
    (``Lanes``): planned (``auto_split``), ``repeats`` timed runs after a warm-up, one profiled run, every run's
    chunks compared with the one-GPU ``refs``."""
    kw = dict(
        refill=True,
        rollout=gen.rollout,
        context_time=gen.context_time,
        window_frames=gen.window_frames,
        sink_frames=gen.sink_frames,
        make_decoder=decoders,
        decode_stream=decode_stream,
    )
    place_model(pp_model, len(all_blocks(pp_model)) - 2, [devices[0]] * 2)  # the CLI probes on GPU0
    t_plan = time.perf_counter()
    split, report = auto_split(
        pp_model,
        devices,
        "aggressive",
        encode_groups(),
        latent_size,
        times,
        dict(kw, cuda_graphs=True),
        gen,
        decoders,
        contention=contention,
    )
    plan_s = time.perf_counter() - t_plan
    decode_lanes, costs = tuple(report["decode_lanes"]), report["calibration"]["costs"]
    runners = (ChunkGraphs(pp_model), ChunkGraphs(pp_model))

    def two_gpu(profile=False):
        lanes = Lanes(devices, profile=profile, host_copies=host_copies)
        stages = CausalStreamingStages(  # text encoded inside the timed run, as the one-GPU stream encodes it
            pp_model,
            lanes,
            split,
            encode_groups(),
            latent_size,
            times,
            cuda_graphs=runners,
            decode_lanes=decode_lanes,
            **kw,
        )
        result, sim = run_plan(stages, "aggressive", lanes, costs=costs, contention=contention)
        return result, sim, stages.plan

    times_2, results = [], []
    for d in devices:
        torch.cuda.reset_peak_memory_stats(d)
    for i in range(repeats + 1):
        _sync(devices)
        t0 = time.perf_counter()
        result, _, _ = two_gpu()
        _sync(devices)
        if i:
            times_2.append(time.perf_counter() - t0)
        results.append(result)
    peak_gib = [torch.cuda.max_memory_allocated(d) / 2**30 for d in devices]
    profiled, sim, plan = two_gpu(profile=True)
    results.append(profiled)
    diff = 0.0
    for result in results:
        for g, chunks in enumerate(refs):
            for c in chunks:
                diff = max(
                    diff,
                    _max_diff(result.latents[(g, c.index)], c.latents.cpu()),
                    _max_diff(result.frames[(g, c.index)], c.frames),
                )
    ends = sorted(r["end_ms"] for r in profiled.timeline if r["kind"] == "decode" and r["group"] == 0)
    start = min(r["start_ms"] for r in profiled.timeline)
    seconds = [(b - a) / 1e3 for a, b in zip([start, *ends[:-1]], ends)]
    lanes_summary = profiled.summary.get("lanes", {})
    span = profiled.summary.get("span_ms")
    return dict(
        decode_stream=decode_stream,
        host_copies=host_copies,
        seconds=statistics.median(times_2),
        runs_s=times_2,
        num_chunks=plan.num_chunks,
        split=split,
        probe_split=report["probe_split"],
        decode_lanes=list(decode_lanes),
        decode_ms_per_chunk=report["decode"]["mean_ms"] if report["decode"] else None,
        decode_ms_per_chunk_list=report["decode"]["per_chunk_ms"] if report["decode"] else None,
        contention=contention,
        simulated_busy=list(sim.busy_fraction),
        simulated_ms=sim.makespan,
        busy=[lanes_summary.get(f"gpu{i}", {}).get("busy_fraction") for i in (0, 1)],
        measured_span_ms=span,
        fitted_contention=fitted_contention(plan, costs, span),
        costs=costs,
        ms_per_kind=profiled.summary.get("ms_per_kind"),
        latency_video0=_latency(seconds),
        stage_graphs=[r.summary for r in runners],
        decoders=decoders.summary(),
        plan_s=plan_s,
        passes=report["calibration"]["measured"],
        max_diff=diff,
        runs_checked=len(results),
        peak_gib=peak_gib,
    )


def rolling_window(args, cfg, sampler):
    """The KV cache's rolling window in latent frames: ``--window-frames`` ("train": the training clip's latent
    frames minus a chunk, as ``benchmarks/streaming.py``; "none": every frame kept, so memory and each chunk's
    attention grow with the video)."""
    value = str(getattr(args, "window_frames", "train"))
    if value == "none":
        return None
    if value == "train":
        return clip_window(sampler, *training_clip(cfg))
    return int(value)


def run_real_vae(args, say) -> dict:
    """The rows of the module docstring; ``args``: devices, sizes, frames, groups, repeats, budget_s, config."""
    started = time.time()
    devices = [torch.device(d) for d in args.devices.split(",")]
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 CUDA devices")
    cfg = load_config(args.config or CONFIG)
    sampler = random_sampler(cfg, 3, devices[0], torch.bfloat16, vae_cfg=REAL_VAE)
    pp_model = copy.deepcopy(sampler.model)
    say(f"real-size HunyuanVideo VAE, 1B causal student, {args.groups} video(s) in flight, devices {devices}")
    rows, skipped = [], []
    for size in args.sizes:
        if time.time() - started > args.budget_s:
            skipped.append(f"{size[0]}x{size[1]}")
            continue
        say(f"{size[0]}x{size[1]} x {args.frames} frames:")
        rows.append(
            one_size(
                sampler,
                pp_model,
                devices,
                size,
                args.frames,
                args.groups,
                args.repeats,
                say,
                getattr(args, "decode_streams", ("side",)),
                getattr(args, "contention", None),
                getattr(args, "host_copies", ("own",)),
                rolling_window(args, cfg, sampler),
            )
        )
        torch.cuda.empty_cache()
    return dict(
        rows=rows,
        skipped=skipped,
        config=args.config or CONFIG,
        step_list=STEP_LIST,
        wall_s=time.time() - started,
        device=torch.cuda.get_device_name(devices[0]),
    )
