#!/usr/bin/env python
"""Streaming generation: speed and memory at the 1B shape, quality of a causal student on MovingShapes,
and the fixed costs of the full-video sampler. Writes JSON under --out and prints a table.

  # (a) 1B shape, random weights, one GPU: per-chunk latency, time to first chunk, frames/s (VAE decode included),
  #     peak memory at 1x and 4x the training length (goal: flat within 5%), next to the 30-step CFG teacher
  python -m benchmarks.streaming speed --out OUT/streaming_1b
  # (b) a causal student checkpoint vs its bidirectional teacher on the 72 held MovingShapes captions
  python -m benchmarks.streaming quality --student-config C --student-ckpt S --teacher-config T --teacher-ckpt P \
      --out OUT/streaming_quality
  # (c) where VideoSampler.generate spends its time outside the model passes (runs on a CPU too)
  python -m benchmarks.streaming costs --config configs/diffusion/train/moving_shapes_gpu.py --out DIR

Timing: wall clock around whole generations (CUDA synchronised), after one warm-up generation; the streaming
chunk times come from the generator (each chunk ends when its decoded uint8 frames are on the host).
"""

import argparse
import gc
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from benchmarks.common import count_host_syncs  # noqa: E402
from opensora.config import load_config  # noqa: E402
from opensora.inference import sampler as pipeline  # noqa: E402
from opensora.inference.io import uint8_frames_on_device  # noqa: E402
from opensora.inference.sampler import VideoSampler, resolve_device, role_model_config  # noqa: E402
from opensora.inference.streaming.generator import ChunkDecoder, GraphedDecode, StreamingGenerator  # noqa: E402
from opensora.models.mmdit.flops import mmdit_chunk_flops, mmdit_forward_flops  # noqa: E402
from opensora.models.vae.exact_chunk_decode import exact_chunk_decode  # noqa: E402
from opensora.registry import MODELS, build_module  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


# The autoencoder Open-Sora 2.0 ships: diffusers' HunyuanVideo VAE at its default config (246M parameters), random
# weights. ``--vae config`` takes the config's autoencoder instead (a stand-in: its rows are named so).
REAL_VAE = dict(type="HunyuanVideoVAE", config={}, seed=0, dtype="bf16")


def random_sampler(cfg, causal_chunk_frames: int, device, dtype, seed: int = 0, vae_cfg=None) -> VideoSampler:
    """A sampler around the config's network with random weights (all parameters perturbed, so no output is 0);
    ``vae_cfg`` replaces the config's autoencoder."""
    torch.manual_seed(seed)
    model_cfg = dict(role_model_config(cfg), causal_chunk_frames=causal_chunk_frames)
    # no block compilation: the training configs turn it on, but the streamed passes (KV hooks) are not verified
    # with it and recompile per cache state
    model_cfg.update(grad_ckpt_double=0, grad_ckpt_single=0, compile_blocks=False)
    model = build_module(model_cfg, MODELS).to(device, dtype).eval().requires_grad_(False)
    with torch.no_grad():  # on the device: perturbing 1B parameters on the CPU takes a while
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    vae = build_module(vae_cfg or cfg["vae"], MODELS).to(device, dtype).eval().requires_grad_(False)
    text = build_module(cfg["text_encoder"], MODELS).to(device).eval()
    shift = (cfg.get("method") or {}).get("shift") or {}
    return VideoSampler(model, vae, text, shift=shift, device=device, progress=False)


def training_clip(cfg):
    """(frames, height, width) of the config's (first) training bucket or dataset."""
    dataset = cfg.get("dataset") or {}
    if "num_frames" in dataset and "height" in dataset:
        return int(dataset["num_frames"]), int(dataset["height"]), int(dataset["width"])
    size = next(iter(cfg.bucket_config))
    height, width = (int(v) for v in size.split("x"))
    return int(next(iter(cfg.bucket_config[size]))), height, width


def clip_window(sampler, frames: int, height: int, width: int) -> int:
    """The rolling KV window streaming benchmarks use by default: the training clip's latent frames minus one chunk,
    so the chunk being made attends to as many frames as the last chunk of a training clip."""
    return sampler.latent_size(frames, height, width)[0] - sampler.model.causal_chunk_frames


def stream_once(generator, prompts, seeds, size):
    """One streamed generation: (uint8 video [B, T, H, W, 3], chunk records)."""
    frames, chunks = [], []
    sync()
    for chunk in generator.stream(prompts, seeds, *size):
        frames.append(chunk.frames)
        chunks.append(
            dict(
                seconds=chunk.seconds,
                frames=int(chunk.frames.shape[1]),
                cached_frames=chunk.cached_frames,
                cache_bytes=chunk.cache_bytes,
                text_cache_bytes=chunk.text_cache_bytes,
            )
        )
    return torch.cat(frames, dim=1), chunks


def chunk_summary(chunks, batch: int = 1) -> dict:
    """Frame rates count the frames of all ``batch`` videos (each chunk holds that many frames per video)."""
    total = sum(c["seconds"] for c in chunks)
    later = [c["seconds"] for c in chunks[1:]] or [chunks[0]["seconds"]]
    frames = sum(c["frames"] for c in chunks)
    sustained = batch * sum(c["frames"] for c in chunks[1:]) / sum(later) if len(chunks) > 1 else None
    return dict(
        chunks=len(chunks),
        first_chunk_s=chunks[0]["seconds"],
        chunk_s_median=statistics.median(later),
        total_s=total,
        frames_per_video=frames,
        frames_per_s=batch * frames / total,
        sustained_frames_per_s=sustained,
        max_cached_frames=max(c["cached_frames"] for c in chunks),
        max_cache_mib=max(c["cache_bytes"] for c in chunks) / 2**20,
    )


def timed(fn, repeats: int):
    fn()  # warm-up
    times, out = [], None
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def top_kernels(fn, count: int = 8) -> list:
    """The ``count`` CUDA kernels with the most GPU time in one call of ``fn`` (torch.profiler): name, ms, calls."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us:
            rows.append(dict(kernel=event.key[:90], ms=device_us / 1e3, calls=event.count))
    return sorted(rows, key=lambda r: -r["ms"])[:count]


def print_table(title, rows):
    print(f"\n{title}")
    keys = list(rows[0])
    print(" | ".join(f"{k:>14}" for k in keys))
    for row in rows:
        print(" | ".join(f"{v:>14.4g}" if isinstance(v, float) else f"{str(v):>14}" for v in row.values()))


def write_json(out_dir, name, payload):
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str))
    print(f"wrote {path}")


# --------------------------------------------------------------------------------------------------------------
# (a) speed and memory at the 1B shape
# --------------------------------------------------------------------------------------------------------------
def stream_flops(
    model, chunk_tokens, text_tokens, chunks, chunk_frames, window, steps, merged, text_cache, rows=1, text_padded=True
):
    """Forward FLOPs of one streamed video: per chunk ``steps`` passes + the refill (none after the last chunk; with
    ``merged`` folded into the next chunk's first pass, whose refill rows also compute the masked next-chunk keys
    unless the pass is mask-free: text cached and not ``text_padded``, see ``causal_refill.split_keys``).
    The first chunk's passes run the text rows (they fill the text cache); later ones too without ``text_cache``."""
    per_frame = chunk_tokens // chunk_frames
    total, held = 0, 0  # held: cached frames when the chunk starts
    for c in range(chunks):
        past = held * per_frame
        run_text = c == 0 or not text_cache
        one = mmdit_chunk_flops(model, chunk_tokens, text_tokens, past, rows, run_text)
        total += steps * one
        if c + 1 < chunks:  # the refill (no chunk reads the last one's)
            extra = chunk_tokens if merged and (text_padded or run_text) else 0
            total += mmdit_chunk_flops(model, chunk_tokens, text_tokens, past, rows, run_text, extra_key_tokens=extra)
        held = min(held + chunk_frames, window) if window is not None else held + chunk_frames
    return total


def every_text_token_valid(sampler) -> None:
    """Make ``sampler``'s text masks all true (``--text-mask full``): a stand-in for prompts that fill the text
    length, same shapes and FLOPs as the padded ones. Without padded text tokens the text-cached passes attend
    without a mask (``causal_refill.split_keys``); the tokenizer pads every prompt to its length otherwise."""
    encode = sampler.encode_text

    def full(prompts):
        return tuple(dict(d, text_mask=torch.ones_like(d["text_mask"])) for d in encode(prompts))

    sampler.encode_text = full


SPEED_VARIANTS = {  # name: (text cache, CUDA graphs (passes + decode), merged refill, decode overlapped)
    "window": (True, False, False, False),
    "window-merged": (True, False, True, False),
    "window-recompute-text": (False, False, False, False),
    "window-graphs": (True, True, False, False),
    "window-graphs-merged": (True, True, True, False),
    "window-graphs-overlap": (True, True, False, True),  # the default of StreamingGenerator(cuda_graphs=True)
    "window-graphs-merged-overlap": (True, True, True, True),
}


def cuda_mib(fn=None) -> float:
    return (fn or torch.cuda.memory_allocated)() / 2**20 if torch.cuda.is_available() else 0.0


def modes(choice: str, both=(False, True)) -> tuple:
    """The values a ``both | on | off`` flag asks for (``both`` in the given order)."""
    return dict(both=both, on=(True,), off=(False,))[choice]


def paired_rounds(args, sampler, teacher, teacher_video, teachers, window, prompts, seeds, size) -> dict:
    """``--paired N``: N rounds, each timing the default streaming path (the CLI's: text cache, and on a GPU graphs +
    decode overlap) once and every teacher mode once, back to back, so the ratios compare runs a few seconds apart
    (the teacher's time moves from host to host and within a call); per mode the median ratio and its range."""
    on_gpu = torch.cuda.is_available() and sampler.device.type == "cuda"
    student = StreamingGenerator(
        sampler,
        step_list=args.step_list,
        window_frames=window,
        sink_frames=args.sink_frames,
        cuda_graphs=on_gpu,
        decode_rule=args.decode_rule,
    )
    stream_once(student, prompts, seeds, size)  # warm-up: captures its graphs
    rounds = []
    for _ in range(args.paired):
        one = {}
        for name in teachers:
            teacher.set_cuda_graphs(name == "graphs" and on_gpu)
            one[f"teacher_{name}_s"], _ = timed(teacher_video, repeats=1)
        sync()
        start = time.perf_counter()
        stream_once(student, prompts, seeds, size)
        sync()
        one["student_s"] = time.perf_counter() - start
        rounds.append(one)
    summary = dict(rounds=rounds, student_s_median=statistics.median(r["student_s"] for r in rounds))
    for name in teachers:
        ratios = sorted(r[f"teacher_{name}_s"] / r["student_s"] for r in rounds)
        summary[f"ratio_vs_{name}"] = dict(median=statistics.median(ratios), min=ratios[0], max=ratios[-1])
        summary[f"teacher_{name}_s_median"] = statistics.median(r[f"teacher_{name}_s"] for r in rounds)
    print(f"paired rounds ({args.paired}): student {summary['student_s_median']:.4f} s", end="")
    for name in teachers:
        r = summary[f"ratio_vs_{name}"]
        print(
            f"; teacher {name} {summary[f'teacher_{name}_s_median']:.4f} s, ratio {r['median']:.3g}x "
            f"({r['min']:.3g}-{r['max']:.3g})",
            end="",
        )
    print()
    return summary


def run_speed(args) -> dict:
    device = resolve_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    on_gpu = device.type == "cuda"
    cfg = load_config(args.config)
    frames, height, width = args.frames or training_clip(cfg)[0], *(args.size or training_clip(cfg)[1:])
    real_vae = args.vae == "real" or (args.vae == "auto" and on_gpu)
    sampler = random_sampler(cfg, args.chunk_frames, device, dtype, vae_cfg=REAL_VAE if real_vae else None)
    vae_tag = "" if real_vae else "-config-vae"  # rows with the config's (stand-in) autoencoder say so
    stand_in = vae_tag + ("" if args.decode_rule == "running" else f"-{args.decode_rule}-decode")
    if args.text_mask == "full":
        every_text_token_valid(sampler)
    model = sampler.model
    train_latent = sampler.latent_size(frames, height, width)[0]
    window = args.window_frames if args.window_frames is not None else clip_window(sampler, frames, height, width)
    prompts = ["a red circle moving left"] * args.batch
    seeds = list(range(args.batch))
    vae = sampler.vae
    text_cache_modes = modes(args.text_cache, both=(True, False))
    use_graphs = args.cuda_graphs == "on" or (args.cuda_graphs == "auto" and on_gpu)
    merge_modes = modes(args.merge_refill)
    overlap_modes = modes(args.overlap_decode)
    variants = [
        name
        for name, (cached, graphs, merged, overlap) in SPEED_VARIANTS.items()
        if cached in text_cache_modes
        and (not graphs or (use_graphs and cached))
        and merged in merge_modes
        and (overlap in overlap_modes if graphs else not overlap)
        and (not args.only or name in args.only)
    ]
    weights_mib = sum(p.numel() * p.element_size() for m in (model, vae) for p in m.parameters()) / 2**20
    result = dict(
        mode="speed",
        text_cache=args.text_cache,
        cuda_graphs=use_graphs,
        merge_refill=args.merge_refill,
        text_mask=args.text_mask,
        device=device_name(),
        config=args.config,
        vae="HunyuanVideo VAE, diffusers default config (random weights)" if real_vae else "the config's",
        decode_rule=args.decode_rule,
        batch=args.batch,
        chunk_frames=args.chunk_frames,
        steps=args.step_list,
        window_frames=window,
        sink_frames=args.sink_frames,
        training_clip=[frames, height, width],
        training_latent_frames=train_latent,
        weights_mib=weights_mib,
        lengths={},
        memory={},
    )
    # the decode share of a chunk under the overlap rule: one later chunk's latents with the overlap context decoded
    # alone (decode_s_per_chunk, decode_graphed_s_per_chunk); under the exact-once rules one later chunk of a clip in
    # progress (exact_decode_s_per_chunk: graphed on a GPU, as the graphed rows run it)
    latent_hw = sampler.latent_size(frames, height, width)[1:]
    exact = exact_chunk_decode(vae, args.decode_rule, graphs=on_gpu, postprocess=uint8_frames_on_device)
    if exact is not None:
        clip = torch.randn(args.batch, vae.latent_channels, 2 * args.chunk_frames, *latent_hw, device=device)
        later = clip[:, :, args.chunk_frames :]
        exact(clip[:, :, : args.chunk_frames], first=True)
        for _ in range(-(-exact.decoder.attention_window // args.chunk_frames) + 1):  # fill the attention window
            exact(later, first=False)
        result["exact_decode_s_per_chunk"], _ = timed(lambda: exact(later, first=False), repeats=3)
        del exact
    overlap = ChunkDecoder(sampler.decode, vae).overlap
    chunk_latents = torch.randn(args.batch, vae.latent_channels, args.chunk_frames + overlap, *latent_hw, device=device)
    result["decode_s_per_chunk"], _ = timed(lambda: sampler.decode(chunk_latents), repeats=3)
    if on_gpu:  # the graphed decode (what the graphed rows run) and where a decode's GPU time goes
        graphed = GraphedDecode(vae, pipeline._module_dtype(vae, dtype), sampler.decode)
        with torch.no_grad():
            result["decode_graphed_s_per_chunk"], _ = timed(lambda: graphed(chunk_latents), repeats=3)
        result["decode_top_kernels"] = top_kernels(lambda: sampler.decode(chunk_latents))  # eager: kernel names
        del graphed

    # the FLOP ceiling: teacher FLOPs / student FLOPs at 1x (what the speed-up would be at equal FLOP/s)
    pt, ph, pw = model.patch_size
    tokens_per_frame = (latent_hw[0] // ph) * (latent_hw[1] // pw) // pt
    text_tokens = sampler.encode_text(prompts[:1])[0]["text_emb"].shape[1]
    # what the student's passes see of the text: all of it, or (``--text-mask trim``) up to the last valid token
    student_text, student_padded = text_tokens, args.text_mask == "padded"
    if args.text_mask == "trim":
        valid = sampler.encode_text(prompts)[0]["text_mask"].bool().cpu()
        student_text = int(valid.any(0).nonzero().max()) + 1
        student_padded = not bool(valid[:, :student_text].all())
    teacher_flops = (
        args.teacher_steps
        * mmdit_forward_flops(model, tokens_per_frame * train_latent, text_tokens, 2 * args.batch)["total"]
    )
    n_chunks = -(-train_latent // args.chunk_frames)
    flops = {}
    for name in variants:
        cached, _, merged, _ = SPEED_VARIANTS[name]
        student = stream_flops(
            model,
            tokens_per_frame * args.chunk_frames,
            student_text,
            n_chunks,
            args.chunk_frames,
            window,
            len(args.step_list),
            merged,
            cached,
            rows=args.batch,
            text_padded=student_padded,
        )
        flops[name] = dict(student_tflop=student / 1e12, ceiling=teacher_flops / student if student else None)
    result["flops_1x"] = dict(
        teacher_tflop=teacher_flops / 1e12,
        teacher_passes=f"{args.teacher_steps} x batch 2 (CFG) over {tokens_per_frame * train_latent} video + "
        f"{text_tokens} text tokens",
        student_text_tokens=student_text,
        students=flops,
    )

    rows = []
    for name in variants:
        cached, graphs, merged, overlap = SPEED_VARIANTS[name]
        gen = StreamingGenerator(
            sampler,
            step_list=args.step_list,
            window_frames=window,
            sink_frames=args.sink_frames,
            text_cache=cached,
            cuda_graphs=graphs,
            merge_refill=merged,
            overlap_decode=overlap,
            trim_text=args.text_mask == "trim",
            decode_rule=args.decode_rule,
        )
        if on_gpu:
            torch.cuda.empty_cache()
        before_variant = cuda_mib()
        for multiple in args.lengths:
            latent = (train_latent - 1) * multiple + 1 if vae.causal_temporal else train_latent * multiple
            pixel_frames = vae.get_video_size((latent, 4, 4))[0]
            size = (pixel_frames, height, width)
            stream_once(gen, prompts, seeds, size)  # warm-up (captures the graphs on the first length)
            if on_gpu:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            resident = cuda_mib()
            passes = gen.passes
            _, chunks = stream_once(gen, prompts, seeds, size)
            summary = chunk_summary(chunks, args.batch)
            summary.update(
                name=name + stand_in,
                chunk_s_max=max(c["seconds"] for c in chunks[1:]) if len(chunks) > 1 else None,
                length_multiple=multiple,
                pixel_frames=pixel_frames,
                latent_frames=latent,
                cache=name,
                text_cache=cached,
                merge_refill=merged,
                model_passes=gen.passes - passes,
                text_cache_mib=chunks[-1]["text_cache_bytes"] / 2**20,
                overlap_decode=overlap,
                cuda_graphs=gen.cuda_graphs.summary if graphs else None,
                merged_graphs=gen.merged_graphs.summary if gen.merged_graphs is not None else None,
                # shared output + cached-video buffers of the graphs (their pool is not counted)
                graph_buffers_mib=gen.cuda_graphs.memory.nbytes / 2**20 if graphs else None,
                decode_graphs=None if gen.decode_graphs is None else len(gen.decode_graphs.graphs),
            )
            if on_gpu:  # what holds the memory (see the README): resident = weights + what the variant keeps
                peak = cuda_mib(torch.cuda.max_memory_allocated)
                summary.update(
                    peak_mib=peak,
                    resident_mib=resident,
                    working_mib=peak - resident,  # activations, KV/text caches of this video, decode
                    held_by_variant_mib=resident - before_variant,  # graph pools, static buffers, decode graphs
                    after_run_mib=cuda_mib(),
                    reserved_mib=cuda_mib(torch.cuda.memory_reserved),
                    # the caching allocator's peak, graph pools included (a replay's activations live in its pool,
                    # which max_memory_allocated does not see: the allocator counts them free after the capture)
                    peak_reserved_mib=cuda_mib(torch.cuda.max_memory_reserved),
                )
            result["lengths"][f"{multiple}x-{name}"] = dict(summary, chunk_seconds=[c["seconds"] for c in chunks])
            rows.append(
                {
                    k: summary.get(k)
                    for k in (
                        "length_multiple",
                        "name",
                        "cache",
                        "pixel_frames",
                        "model_passes",
                        "first_chunk_s",
                        "chunk_s_median",
                        "chunk_s_max",
                        "sustained_frames_per_s",
                        "frames_per_s",
                        "max_cached_frames",
                        "peak_mib",
                        "working_mib",
                    )
                }
            )
        del gen
        if on_gpu and len(args.lengths) > 1:
            gc.collect()
            torch.cuda.empty_cache()
            peaks = {m: result["lengths"][f"{m}x-{name}"]["peak_mib"] for m in args.lengths}
            growth = max(peaks.values()) / min(peaks.values()) - 1
            reserved = {m: result["lengths"][f"{m}x-{name}"]["peak_reserved_mib"] for m in args.lengths}
            result["memory"][name] = dict(
                peak_mib=peaks,
                growth=growth,
                peak_reserved_mib=reserved,
                reserved_growth=max(reserved.values()) / min(reserved.values()) - 1,
                flat_within_5pct=growth <= 0.05,
                # allocated memory the variant leaves behind once its generator is gone (e.g. cuBLAS workspaces)
                left_behind_mib=cuda_mib() - before_variant,
            )
    main_name = "window" if "window" in variants else variants[0]  # the headline rows
    if result["memory"]:
        result["peak_growth"] = max(m["growth"] for m in result["memory"].values())
        result["peak_flat_within_5pct"] = result["peak_growth"] <= 0.05
    if args.teacher_steps:
        teacher = random_sampler(cfg, 0, device, dtype, vae_cfg=REAL_VAE if real_vae else None)

        def teacher_video():
            return teacher.generate(
                prompts, seeds, frames, height, width, num_steps=args.teacher_steps, guidance_scale=7.5
            )

        teachers = {}  # "eager" / "graphs" -> seconds for the clip
        for graphed in modes(args.teacher_graphs):
            name = "graphs" if graphed else "eager"
            teacher.set_cuda_graphs(graphed and on_gpu)
            if on_gpu:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            teachers[name], _ = timed(teacher_video, repeats=args.teacher_repeats)
            result[f"teacher_{name}"] = dict(
                seconds=teachers[name],
                tflop_per_s=teacher_flops / 1e12 / teachers[name],
                peak_mib=cuda_mib(torch.cuda.max_memory_allocated) if on_gpu else None,
                graphs=None if teacher.pass_graphs is None else teacher.pass_graphs.summary,
            )
        # the headline baseline: the eager sampler unless only graphs were asked for
        baseline = "eager" if "eager" in teachers else "graphs"
        seconds = teachers[baseline]
        result["teacher"] = dict(
            steps=args.teacher_steps,
            cfg_passes="2, batched as rows of one pass",
            seconds=seconds,
            frames=frames,
            peak_mib=result[f"teacher_{baseline}"]["peak_mib"],
        )
        for name in variants:
            one_x = result["lengths"][f"{args.lengths[0]}x-{name}"]
            suffix = "" if name == main_name else "_" + name.removeprefix("window-").replace("-", "_")
            result[f"speedup_end_to_end_1x{suffix}"] = seconds / one_x["total_s"]
            result[f"first_chunk_over_teacher_clip{suffix}"] = one_x["first_chunk_s"] / seconds
            flops[name]["achieved_over_ceiling"] = (seconds / one_x["total_s"]) / flops[name]["ceiling"]
            if "graphs" in teachers:
                result[f"speedup_vs_graphed_teacher_1x{suffix}"] = teachers["graphs"] / one_x["total_s"]
        for name, teacher_s in teachers.items():
            rows.append(
                dict(
                    length_multiple=1,
                    name=f"teacher-{args.teacher_steps}x2-{name}{vae_tag}",
                    cache=f"teacher-{args.teacher_steps}x2-{name}",
                    pixel_frames=frames,
                    model_passes=args.teacher_steps,
                    first_chunk_s=teacher_s,
                    chunk_s_median=None,
                    chunk_s_max=None,
                    sustained_frames_per_s=None,
                    frames_per_s=frames * args.batch / teacher_s,
                    max_cached_frames=None,
                    peak_mib=result[f"teacher_{name}"]["peak_mib"],
                    working_mib=None,
                )
            )
        if args.paired:
            result["paired"] = paired_rounds(
                args, sampler, teacher, teacher_video, teachers, window, prompts, seeds, (frames, height, width)
            )
        del teacher
    print_table(
        f"streaming speed on {result['device']} (batch {args.batch}, chunk {args.chunk_frames} latent frames, "
        f"{len(args.step_list)} steps + 1 cache pass per chunk)",
        rows,
    )
    print(f"FLOP ceiling at 1x (teacher {result['flops_1x']['teacher_tflop']:.4g} TFLOP):")
    for name, f in flops.items():
        print(f"  {name}: {f['student_tflop']:.4g} TFLOP, ceiling {f['ceiling']:.4g}x", end="")
        print(f", achieved {f['achieved_over_ceiling']:.3g} of it" if "achieved_over_ceiling" in f else "")
    for name, m in result["memory"].items():
        print(f"peak memory {name}: " + ", ".join(f"{k}x {v:.0f} MiB" for k, v in m["peak_mib"].items()), end="")
        print(f" (growth {100 * m['growth']:+.1f}%; left behind after the run {m['left_behind_mib']:.0f} MiB)", end="")
        print("; reserved peak " + ", ".join(f"{k}x {v:.0f}" for k, v in m["peak_reserved_mib"].items()), end="")
        print(f" MiB ({100 * m['reserved_growth']:+.1f}%)")
    for key in sorted(result):
        headline = ("speedup_end_to_end", "speedup_vs_graphed", "first_chunk_over", "decode_s", "decode_graphed_s")
        headline += ("exact_decode_s",)
        if key.startswith((*headline, "peak_growth")):
            print(f"{key}: {result[key]:.4g}")
    for row in result.get("decode_top_kernels", []):
        print(f"  decode kernel {row['ms']:.3f} ms x{row['calls']}: {row['kernel']}")
    for name in variants:  # graphs and what they hold (the pool is in resident_mib, not in the buffers)
        one, last = (result["lengths"][f"{m}x-{name}"] for m in (args.lengths[0], args.lengths[-1]))
        if one.get("cuda_graphs") and "resident_mib" in one:
            print(
                f"{name}: graphs {one['cuda_graphs']['graphs']} -> {last['cuda_graphs']['graphs']}, decode graphs "
                f"{one['decode_graphs']} -> {last['decode_graphs']}, resident {one['resident_mib']:.0f} -> "
                f"{last['resident_mib']:.0f} MiB, shared graph buffers {last['graph_buffers_mib']:.0f} MiB"
            )
    write_json(args.out, "speed.json", result)
    return result


# --------------------------------------------------------------------------------------------------------------
# (b) quality of a causal student vs its teacher on MovingShapes
# --------------------------------------------------------------------------------------------------------------
def run_quality(args) -> dict:
    from opensora.datasets.moving_shapes import all_captions
    from opensora.eval.moving_shapes import score_rows
    from opensora.eval.moving_shapes_windows import chunk_edge_flicker, score_windows

    prompts = all_captions()[: args.num_prompts]
    seeds = [args.seed + i for i in range(len(prompts))]
    teacher_cfg, student_cfg = load_config(args.teacher_config), load_config(args.student_config)
    frames, height, width = training_clip(teacher_cfg)
    teacher = VideoSampler.from_config(teacher_cfg, args.teacher_ckpt, role=args.teacher_role, progress=False)
    student = VideoSampler.from_config(
        student_cfg, args.student_ckpt, role=args.student_role or student_cfg.get("role", "student"), progress=False
    )
    # the student config's sampling keys (those of scripts/diffusion/inference.py), unless given here
    step_list = args.step_list or student_cfg.get("step_list")
    chunk = student.model.causal_chunk_frames
    window = next(
        w
        for w in (args.window_frames, student_cfg.get("window_frames"), clip_window(student, frames, height, width))
        if w is not None
    )
    sinks = args.sink_frames if args.sink_frames is not None else int(student_cfg.get("sink_frames") or 0)
    rollout = args.rollout or student_cfg.get("rollout", "renoise")
    gen = StreamingGenerator(
        student,
        step_list=step_list,
        rollout=rollout,
        guidance_scale=float(student_cfg.get("guidance_scale", 1.0)),
        window_frames=window,
        sink_frames=sinks,
        context_time=float(
            args.context_time if args.context_time is not None else student_cfg.get("context_time") or 0.0
        ),
        merge_refill=args.merge_refill,
    )
    result = dict(
        mode="quality",
        device=device_name(),
        prompts=len(prompts),
        size=[frames, height, width],
        teacher=dict(ckpt=str(args.teacher_ckpt), steps=args.teacher_steps, guidance=args.teacher_guidance),
        student=dict(
            ckpt=str(args.student_ckpt),
            step_list=step_list,
            chunk_frames=chunk,
            window_frames=window,
            sink_frames=sinks,
            rollout=gen.rollout,
            context_time=gen.context_time,
        ),
    )

    def score(videos):
        report = score_rows([(f"s{i}", t, videos[i], None) for i, t in enumerate(prompts)], wrap=args.motion == "wrap")
        return dict(
            color_acc=report.color_acc,
            shape_acc=report.shape_acc,
            direction_acc=report.direction_acc,
            all_acc=report.all_acc,
        )

    teacher_s, teacher_videos = timed(
        lambda: teacher.generate(
            prompts,
            seeds,
            frames,
            height,
            width,
            num_steps=args.teacher_steps,
            guidance_scale=args.teacher_guidance,
            batch_size=len(prompts),
        ),
        repeats=args.repeats,
    )
    student_s, (student_videos, chunks) = timed(
        lambda: stream_once(gen, prompts, seeds, (frames, height, width)), repeats=args.repeats
    )
    result["teacher"].update(seconds=teacher_s, **score(teacher_videos.numpy()))
    result["student"].update(seconds=student_s, **score(student_videos.numpy()), **chunk_summary(chunks, len(prompts)))
    for key in ("color_acc", "shape_acc", "direction_acc"):
        t = result["teacher"][key]
        result[f"student_over_teacher_{key}"] = result["student"][key] / t if t else None
    result["speedup_end_to_end"] = teacher_s / student_s
    result["first_chunk_over_teacher_clip"] = result["student"]["first_chunk_s"] / teacher_s
    result["pass_ratio"] = (args.teacher_steps * 2) / ((len(step_list) + 1) * 1)

    # long clips: 4x the training length, where the teacher cannot go
    long_frames = frames * args.long_multiple
    long_videos, long_chunks = stream_once(gen, prompts, seeds, (long_frames, height, width))
    long_videos = long_videos.numpy()
    vae = student.vae
    chunk_pixels = chunk * vae.temporal_compression  # a causal VAE's first chunk is shorter by compression - 1
    first_pixels = vae.get_video_size((chunk, 4, 4))[0]
    # per window: colour, shape, direction by the clips' motion rule, frame statistics in their caption's range
    result["long"] = dict(
        frames=long_frames,
        **chunk_summary(long_chunks, len(prompts)),
        **score_windows(list(long_videos), prompts, frames, frames // 2, motion=args.motion),
        flicker=chunk_edge_flicker(long_videos, chunk_pixels, first_pixels),
        flicker_1x=chunk_edge_flicker(student_videos.numpy(), chunk_pixels, first_pixels),
        flicker_teacher_same_edges=chunk_edge_flicker(teacher_videos.numpy(), chunk_pixels, first_pixels),
    )
    windows = result["long"]["windows"]

    title = f"MovingShapes quality on {result['device']} ({len(prompts)} held captions, {frames}x{height}x{width})"
    print_table(
        title,
        [
            dict(
                sampler=f"teacher {args.teacher_steps}x2",
                seconds=teacher_s,
                first_chunk_s=None,
                **{k: result["teacher"][k] for k in ("color_acc", "shape_acc", "direction_acc")},
            ),
            dict(
                sampler=f"student {len(step_list)}+1/chunk",
                seconds=student_s,
                first_chunk_s=result["student"]["first_chunk_s"],
                **{k: result["student"][k] for k in ("color_acc", "shape_acc", "direction_acc")},
            ),
        ],
    )
    print_table(
        f"long clips ({long_frames} frames = {args.long_multiple}x), windows of {frames}",
        [
            {
                k: w[k]
                for k in (
                    "start_frame",
                    "color_acc",
                    "shape_acc",
                    "direction_acc",
                    "frame_mean",
                    "frame_std",
                    "background",
                    "stats_in_range",
                )
            }
            for w in windows
        ],
    )
    print(
        f"speedup end to end {result['speedup_end_to_end']:.3g}x (model passes {result['pass_ratio']:.3g}x fewer); "
        f"first chunk / teacher clip {result['first_chunk_over_teacher_clip']:.3g}; chunk-edge flicker "
        f"{result['long']['flicker']['edge_over_inside']:.3g}x the inside-chunk change (teacher at the same frames: "
        f"{result['long']['flicker_teacher_same_edges']['edge_over_inside']:.3g}x)"
    )
    write_json(args.out, "quality.json", result)
    return result


# --------------------------------------------------------------------------------------------------------------
# (c) fixed costs of VideoSampler.generate
# --------------------------------------------------------------------------------------------------------------
@contextmanager
def timed_phases(sampler, phases):
    """Time (synchronised) the phases of ``VideoSampler.generate`` by wrapping its helpers; counts model passes."""
    originals = dict(
        encode_text=sampler.encode_text,
        prepare_condition=sampler.prepare_condition,
        denoise=sampler.denoise,
        decode=sampler.decode,
        model=sampler.model,
    )
    noise_fn = pipeline.seeded_noise

    def wrap(name, fn):
        def inner(*a, **k):
            sync()
            start = time.perf_counter()
            out = fn(*a, **k)
            sync()
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - start
            return out

        return inner

    for name in ("encode_text", "prepare_condition", "denoise", "decode"):
        setattr(sampler, name, wrap(name, originals[name]))
    pipeline.seeded_noise = wrap("noise", noise_fn)
    passes = []
    model = originals["model"]

    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x, **k):
            passes.append(x.shape[0])
            return self.inner(x, **k)

    sampler.model = Counter()
    try:
        yield passes
    finally:
        for name in ("encode_text", "prepare_condition", "denoise", "decode"):
            setattr(sampler, name, originals[name])
        pipeline.seeded_noise = noise_fn
        sampler.model = model


def run_costs(args) -> dict:
    device = resolve_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = load_config(args.config)
    frames, height, width = training_clip(cfg)
    from opensora.datasets.moving_shapes import all_captions

    prompts = all_captions()[: args.num_prompts]
    seeds = [1000 + i for i in range(len(prompts))]
    sampler = (
        VideoSampler.from_config(cfg, args.ckpt, role=args.role, progress=False)
        if args.ckpt
        else random_sampler(cfg, 0, device, dtype)
    )
    result = dict(mode="costs", device=device_name(), prompts=len(prompts), size=[frames, height, width], runs={})
    rows = []
    for name, kwargs in (
        ("few-step", dict(num_steps=None, step_list=args.step_list, guidance_scale=1.0)),
        ("teacher", dict(num_steps=args.teacher_steps, guidance_scale=4.0)),
    ):

        def generate():
            return sampler.generate(prompts, seeds, frames, height, width, batch_size=len(prompts), **kwargs)

        total, _ = timed(generate, repeats=args.repeats)
        phases = {}
        with timed_phases(sampler, phases) as passes:
            start = time.perf_counter()
            generate()
            instrumented = time.perf_counter() - start
        syncs = sync_sites = None
        if device.type == "cuda":  # host syncs inside one generation, as PyTorch's sync debug mode reports them
            sync_sites = count_host_syncs(generate)
            syncs = len(sync_sites)
        per_pass = phases["denoise"] / len(passes)
        outside = instrumented - phases["denoise"]  # both from the same (synchronised) generation
        run = dict(
            total_s=total,
            instrumented_s=instrumented,
            phases_s=phases,
            model_passes=len(passes),
            pass_batch=passes[0],
            seconds_per_pass=per_pass,
            outside_passes_s=outside,
            outside_fraction=outside / instrumented,
            host_syncs=syncs,
            host_sync_sites=sync_sites,
        )
        result["runs"][name] = run
        rows.append(
            dict(
                run=name,
                total_s=total,
                passes=len(passes),
                per_pass_s=per_pass,
                text_s=phases.get("encode_text", 0.0),
                noise_s=phases.get("noise", 0.0),
                denoise_s=phases["denoise"],
                decode_s=phases.get("decode", 0.0),
                outside_s=outside,
                host_syncs=syncs,
            )
        )
    few, teacher = result["runs"]["few-step"], result["runs"]["teacher"]
    result["time_ratio"] = teacher["total_s"] / few["total_s"]
    result["pass_ratio"] = teacher["model_passes"] * teacher["pass_batch"] / (few["model_passes"] * few["pass_batch"])
    print_table(
        f"VideoSampler.generate costs on {result['device']} ({len(prompts)} prompts, {frames}x{height}x{width})", rows
    )
    print(
        f"teacher/few-step time ratio {result['time_ratio']:.3g} vs pass ratio (batch-weighted) "
        f"{result['pass_ratio']:.3g}"
    )
    write_json(args.out, "costs.json", result)
    return result


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    steps = lambda s: [float(v) for v in s.replace(",", " ").split()]  # noqa: E731

    speed = sub.add_parser("speed", help="1B-shape latency / throughput / memory with random weights")
    speed.add_argument("--config", default="configs/diffusion/train/mmdit_1b_synthetic.py")
    speed.add_argument("--chunk-frames", type=int, default=3, help="latent frames per chunk (Self-Forcing: 3)")
    speed.add_argument("--frames", type=int, default=None, help="training clip frames (default: the config's)")
    speed.add_argument("--size", type=int, nargs=2, default=None, metavar=("H", "W"))
    speed.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 4], help="multiples of the training length")
    speed.add_argument("--step-list", type=steps, default=[1.0, 0.75, 0.5, 0.25])
    speed.add_argument("--window-frames", type=int, default=None, help="default: training latent frames - chunk")
    speed.add_argument("--sink-frames", type=int, default=0)
    speed.add_argument("--batch", type=int, default=1)
    speed.add_argument(
        "--vae",
        choices=("auto", "real", "config"),
        default="auto",
        help="real: the HunyuanVideo VAE at diffusers' default config (random weights); config: the config's "
        "autoencoder (a stand-in, rows named '-config-vae'); auto: real on a GPU, the config's on a CPU",
    )
    speed.add_argument("--only", nargs="+", default=None, choices=list(SPEED_VARIANTS), help="run these variants only")
    speed.add_argument(
        "--decode-rule",
        choices=("running", "chunk", "overlap"),
        default="running",
        help="StreamingGenerator(decode_rule=...): exact-once chunk decode (running / chunk statistics) or overlap",
    )
    speed.add_argument("--teacher-steps", type=int, default=30, help="0: skip the bidirectional 30-step CFG timing")
    speed.add_argument("--teacher-repeats", type=int, default=2)
    speed.add_argument(
        "--teacher-graphs",
        choices=("both", "on", "off"),
        default="both",
        help="time the teacher eager, with each pass replayed as a CUDA graph (VideoSampler.set_cuda_graphs), or both",
    )
    speed.add_argument(
        "--paired", type=int, default=0, help="rounds of (each teacher mode, the default student) back to back"
    )
    toggles = dict(  # flag: (default, help); each takes both | on | off
        merge_refill=("both", "streaming with each refill merged into the next chunk's first pass ('-merged' rows)"),
        overlap_decode=("both", "graphed rows with the chunk decode overlapped with the next chunk's passes"),
        text_cache=("on", "the per-(block, t) text cache ('window' rows; off: 'window-recompute-text' rows)"),
    )
    for flag, (default, text) in toggles.items():
        option = "--" + flag.replace("_", "-")
        speed.add_argument(option, choices=("both", "on", "off"), default=default, help=f"{text}: on, off or both")
    speed.add_argument(
        "--text-mask",
        choices=("padded", "full", "trim"),
        default="padded",
        help="padded: the tokenizer's mask (prompts padded to the text length); full: every text token valid, "
        "which lets the text-cached passes run mask-free (same shapes, the teacher unmasked too); trim: the student "
        "cuts the padded tail of the text (StreamingGenerator(trim_text=True); the teacher keeps all 512 tokens)",
    )
    speed.add_argument(
        "--cuda-graphs",
        choices=("auto", "on", "off"),
        default="auto",
        help="also run the text cache with CUDA graphs ('window-graphs' rows); auto: on a CUDA device",
    )

    quality = sub.add_parser("quality", help="causal student vs teacher on the 72 held MovingShapes captions")
    quality.add_argument("--student-config", required=True)
    quality.add_argument("--student-ckpt", required=True)
    quality.add_argument("--student-role", default=None)
    quality.add_argument("--teacher-config", default="configs/diffusion/train/moving_shapes_gpu.py")
    quality.add_argument("--teacher-ckpt", required=True)
    quality.add_argument("--teacher-role", default="model")
    quality.add_argument("--teacher-steps", type=int, default=30)
    quality.add_argument("--teacher-guidance", type=float, default=4.0)
    quality.add_argument("--step-list", type=steps, default=None, help="default: the student config's step_list")
    quality.add_argument("--rollout", default=None)
    quality.add_argument("--window-frames", type=int, default=None)
    quality.add_argument("--sink-frames", type=int, default=None)
    quality.add_argument(
        "--context-time", type=float, default=None, help="refill time (default: the student config's, else 0)"
    )
    quality.add_argument("--merge-refill", action="store_true", help="fold each refill into the next chunk's pass")
    quality.add_argument("--long-multiple", type=int, default=4)
    quality.add_argument(
        "--motion", default="linear", help="the motion rule the teacher was trained on (linear, bounce, wrap)"
    )
    quality.add_argument("--num-prompts", type=int, default=None)
    quality.add_argument("--seed", type=int, default=1000)
    quality.add_argument("--repeats", type=int, default=3)

    costs = sub.add_parser("costs", help="VideoSampler.generate time outside the model passes")
    costs.add_argument("--config", default="configs/diffusion/train/moving_shapes_gpu.py")
    costs.add_argument("--ckpt", default=None, help="default: random weights")
    costs.add_argument("--role", default="model")
    costs.add_argument("--step-list", type=steps, default=[1.0, 0.75, 0.5, 0.25])
    costs.add_argument("--teacher-steps", type=int, default=30)
    costs.add_argument("--num-prompts", type=int, default=None)
    costs.add_argument("--repeats", type=int, default=3)

    for p in (speed, quality, costs):
        p.add_argument("--device", default="auto")
        p.add_argument("--out", default="outputs/benchmarks/streaming")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    return dict(speed=run_speed, quality=run_quality, costs=run_costs)[args.mode](args)


if __name__ == "__main__":
    main(sys.argv[1:])
