#!/usr/bin/env python
"""Streamed chunk decode of the HunyuanVideo VAE: how far each chunk rule is from the whole-clip decode, and how fast
one chunk decodes. Writes JSON under --out and prints tables.

  # (a) rules: PSNR / max |diff| of the uint8 frames of each chunk rule against the whole-clip decode, over MovingShapes
  #     clips and natural-image-like random textures encoded and decoded by the same VAE
  python -m benchmarks.streaming_decode rules --out DIR                      # real-size VAE (random weights), GPU
  python -m benchmarks.streaming_decode rules --tiny --size 64 64 --out DIR  # tiny random VAE, fp32, CPU
  # (b) speed: one chunk of 3 latent frames at 480x832 (bf16), interleaved with the eager diffusers decode
  python -m benchmarks.streaming_decode speed --out DIR

Rules: ``running`` / ``chunk`` (exact-once decode, GroupNorm statistics over the frames seen so far / over the chunk),
``fixed`` (exact-once with the whole clip's own statistics: what is left is arithmetic), ``overlap`` (the previous
rule: each chunk re-decoded with 2 earlier latent frames through ``vae.decode``) and ``diffusers`` (diffusers' own
decode of the whole latent clip, which tiles long clips in time). The reference is the decoder run once over the
whole latent clip (``vae.decoder(vae.post_quant_conv(z))``, no tiling).
"""

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import cuda_times_ms
from opensora.datasets.moving_shapes import render_from_attributes  # noqa: E402
from opensora.inference.io import uint8_frames_on_device  # noqa: E402
from opensora.inference.streaming.generator import ChunkDecoder, GraphedDecode  # noqa: E402
from opensora.models.vae import HunyuanVideoVAE  # noqa: E402
from opensora.models.vae.exact_chunk_decode import ExactChunkDecode  # noqa: E402
from opensora.models.vae.streaming_decode import StreamingDecoder, whole_clip_stats  # noqa: E402

TINY = dict(block_out_channels=(16, 16, 16, 16), layers_per_block=1, norm_num_groups=4, latent_channels=16)


def build_vae(tiny: bool, device, parallel_group_norm: bool = True) -> HunyuanVideoVAE:
    config = TINY if tiny else {}  # {}: the diffusers default config (246M parameters)
    dtype = "fp32" if tiny else "bf16"
    return HunyuanVideoVAE(config=config, seed=0, dtype=dtype, device=device, parallel_group_norm=parallel_group_norm)


def texture_clip(rng: np.random.Generator, frames: int, height: int, width: int) -> np.ndarray:
    """Natural-image-like content: 1/f colour noise (the spectrum of natural images), panned (it is periodic)."""
    size = 2 * max(height, width)
    fy, fx = np.fft.fftfreq(size)[:, None], np.fft.fftfreq(size)[None, :]
    amplitude = 1.0 / np.maximum(np.hypot(fy, fx), 1.0 / size)
    image = np.stack(
        [np.fft.ifft2(amplitude * np.exp(2j * np.pi * rng.random((size, size)))).real for _ in range(3)], -1
    )
    image = (image - image.mean()) / (3 * image.std()) * 127.5 + 127.5
    vy, vx = rng.uniform(-1.5, 1.5, size=2)
    out = np.empty((frames, height, width, 3), np.uint8)
    for t in range(frames):
        rows, cols = (int(vy * t) + np.arange(height)) % size, (int(vx * t) + np.arange(width)) % size
        out[t] = np.clip(image[rows[:, None], cols[None, :]], 0, 255).astype(np.uint8)
    return out


def clips(frames: int, height: int, width: int, count: int, seed: int = 0):
    """(name, uint8 [T, H, W, 3]): half MovingShapes clips, half textures."""
    rng = np.random.default_rng(seed)
    shapes = [("red", "circle", "left"), ("blue", "square", "up"), ("green", "triangle", "right")]
    out = []
    for i in range(count):
        if i % 2 == 0:
            color, shape, direction = shapes[(i // 2) % len(shapes)]
            video = render_from_attributes(color, shape, direction, height, width, frames, seed=seed + i)
            out.append((f"shapes-{color}-{shape}", video))
        else:
            out.append((f"texture-{i}", texture_clip(rng, frames, height, width)))
    return out


def to_video(frames: np.ndarray, device, dtype) -> torch.Tensor:
    video = torch.from_numpy(frames).to(device).permute(3, 0, 1, 2)[None].to(dtype)
    return video / 127.5 - 1.0


def psnr_and_max(test: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = test.float() - ref.float()
    mse = diff.square().mean().item()
    psnr = float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)
    return dict(psnr_db=psnr, max_abs_diff=int(diff.abs().max().item()))


def rule_frames(vae, latents: torch.Tensor, rule: str, chunk: int, window: int) -> torch.Tensor:
    """uint8 frames [B, T, H, W, 3] of the clip decoded chunk by chunk under ``rule``."""
    raw = latents / vae.scaling_factor + vae.shift_factor
    parts = range(0, latents.shape[2], chunk)
    if rule == "overlap":
        decoder = ChunkDecoder(lambda z: uint8_frames_on_device(vae.decode(z)), vae, overlap=2)
        return torch.cat([decoder(latents[:, :, s : s + chunk]) for s in parts], dim=1)
    if rule == "diffusers":
        return uint8_frames_on_device(vae.decode(latents))
    if rule == "fixed":
        stats = whole_clip_stats(vae.vae, raw.to(vae.vae.dtype))
        decoder = StreamingDecoder(vae.vae, "fixed", attention_window=window, fixed_stats=stats)
        return uint8_frames_on_device(decoder.decode_clip(raw.to(vae.vae.dtype), chunk).clamp(-1, 1))
    exact = ExactChunkDecode(vae, stats=rule, attention_window=window, graphs=False, postprocess=uint8_frames_on_device)
    return torch.cat([exact(latents[:, :, s : s + chunk], first=s == 0) for s in parts], dim=1)


@torch.no_grad()
def run_rules(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    vae = build_vae(args.tiny, device)
    height, width = args.size
    rules = ["running", "chunk", "fixed", "overlap", "diffusers"]
    result = dict(mode="rules", device=device_name(device), tiny=args.tiny, size=args.size, chunk=args.chunk, rows=[])
    for multiple in args.lengths:
        frames = (args.frames - 1) * multiple + 1
        for name, video in clips(frames, height, width, args.clips if multiple == 1 else 2):
            latents = vae.encode(to_video(video, device, vae.vae.dtype))
            raw = (latents / vae.scaling_factor + vae.shift_factor).to(vae.vae.dtype)
            whole = vae.vae.decoder(vae.vae.post_quant_conv(raw)).clamp(-1, 1)
            reference = uint8_frames_on_device(whole)
            windows = [args.window] + ([latents.shape[2]] if latents.shape[2] > args.window + args.chunk else [])
            for rule in rules:
                for window in windows if rule in ("running", "chunk") else [args.window]:
                    frames_u8 = rule_frames(vae, latents, rule, args.chunk, window)
                    row = dict(clip=name, length=multiple, frames=frames, rule=rule, attention_window=window)
                    row.update(psnr_and_max(frames_u8, reference))
                    starts = [0, 1 + 4 * (args.chunk - 1)]  # pixel frame of each chunk start
                    while starts[-1] < frames:
                        starts.append(starts[-1] + 4 * args.chunk)
                    chunk_psnr = [
                        psnr_and_max(frames_u8[:, a:b], reference[:, a:b])["psnr_db"]
                        for a, b in zip(starts, starts[1:] + [frames])
                        if a < b
                    ]
                    row.update(worst_chunk_psnr_db=min(chunk_psnr), last_chunk_psnr_db=chunk_psnr[-1])
                    result["rows"].append(row)
                    print(
                        f"{name:<24} x{multiple} {rule:<9} w{window:<3} PSNR {row['psnr_db']:6.2f} dB  "
                        f"max|diff| {row['max_abs_diff']:3d}  worst chunk {row['worst_chunk_psnr_db']:6.2f} dB"
                    )
    summary = {}
    for row in result["rows"]:
        key = f"x{row['length']}-{row['rule']}-w{row['attention_window']}"
        summary.setdefault(key, []).append(row)
    result["summary"] = {
        key: dict(
            clips=len(rows),
            psnr_db_mean=statistics.fmean(min(r["psnr_db"], 99.0) for r in rows),
            psnr_db_min=min(r["psnr_db"] for r in rows),
            max_abs_diff=max(r["max_abs_diff"] for r in rows),
            worst_chunk_psnr_db=min(r["worst_chunk_psnr_db"] for r in rows),
        )
        for key, rows in summary.items()
    }
    print("\nsummary (PSNR capped at 99 dB in the mean)")
    for key, s in result["summary"].items():
        print(
            f"{key:<24} clips {s['clips']}  mean {s['psnr_db_mean']:6.2f} dB  min {s['psnr_db_min']:6.2f} dB  "
            f"max|diff| {s['max_abs_diff']:3d}  worst chunk {s['worst_chunk_psnr_db']:6.2f} dB"
        )
    return result


def device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def spread(times: list) -> dict:
    return dict(median_ms=statistics.median(times), min_ms=min(times), max_ms=max(times), repeats=len(times))


@torch.no_grad()
def run_speed(args) -> dict:
    from benchmarks.streaming import top_kernels

    device = torch.device("cuda")
    height, width = args.size
    h, w = height // 8, width // 8
    plain = build_vae(False, device, parallel_group_norm=False)  # the diffusers decoder as it ships
    vae = build_vae(False, device)  # the project's default: ParallelGroupNorm swap
    vae.vae.load_state_dict(plain.vae.state_dict())
    gen = torch.Generator(device).manual_seed(0)
    stream = torch.randn(1, 16, args.chunk * (args.chunks + 1), h, w, device=device, generator=gen)
    chunk = stream[:, :, : args.chunk]
    overlap = stream[:, :, : args.chunk + 2]
    result = dict(mode="speed", device=device_name(device), size=args.size, chunk_latent_frames=args.chunk)

    # correctness first: one clip of `chunk` latent frames decoded whole by the exact-once decoder and by diffusers
    reference = uint8_frames_on_device(plain.decode(chunk))
    eager = ExactChunkDecode(vae, graphs=False, postprocess=uint8_frames_on_device)
    graphed = ExactChunkDecode(vae, graphs=True, postprocess=uint8_frames_on_device)
    one = eager(chunk, first=True)
    result["first_chunk_vs_diffusers"] = psnr_and_max(one, reference)
    # graphed replay vs eager, over a stream that fills and rolls the attention window
    diffs = []
    for i in range(args.chunks):
        part = stream[:, :, i * args.chunk : (i + 1) * args.chunk]
        a, b = eager(part, first=i == 0), graphed(part, first=i == 0)
        diffs.append(int((a.int() - b.int()).abs().max().item()))
    result["graphed_vs_eager_max_abs_diff_per_chunk"] = diffs
    result["graph_failures"] = graphed.failures
    print("exact first chunk vs diffusers:", result["first_chunk_vs_diffusers"], "graphed vs eager:", diffs)

    # timing: a later chunk (attention window full) of each exact-once variant, interleaved with the baselines
    later = stream[:, :, -args.chunk :]
    plain_graph = GraphedDecode(plain, plain.vae.dtype, None)
    variants = {
        "diffusers-eager-3-latent": lambda: plain.decode(chunk),
        "diffusers-eager-parallel-gn-3-latent": lambda: vae.decode(chunk),
        "overlap-rule-graphed-5-latent": lambda: plain_graph.on_device(overlap),
        "exact-eager-later-chunk": lambda: eager(later, first=False),
        "exact-graphed-later-chunk": lambda: graphed(later, first=False),
        "exact-graphed-first-chunk": lambda: graphed(chunk, first=True),
    }
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            times[name] += cuda_times_ms(fn, 1, args.repeats)
            if name == "exact-graphed-first-chunk":  # back to a clip in progress for the later-chunk rows
                for i in range(1, args.chunks):
                    graphed(stream[:, :, i * args.chunk : (i + 1) * args.chunk], first=False)
    result["decode_ms"] = {name: spread(t) for name, t in times.items()}
    for name, s in result["decode_ms"].items():
        print(f"{name:<40} median {s['median_ms']:8.2f} ms  (min {s['min_ms']:.2f}, max {s['max_ms']:.2f})")
    variants = plain_graph = None  # frees the overlap rule's graph pool: the options below fit an 80 GB card
    torch.cuda.empty_cache()
    # options of the graphed exact decode, one at a time (each holds its own graph pool), each next to the default
    options = {
        "direct-upsample": dict(upsample="direct"),  # the default runs the upsamplers' convs by phase
        "sdpa-attention": dict(attention_kernel="sdpa"),  # the default on the GPU is fp32-scores
        "cudnn-benchmark": dict(cudnn_benchmark=True),
        "contiguous-layout": dict(channels_last=False),  # the default on the GPU is channels-last
        "attention-window-2": dict(attention_window=2),
    }
    result["options"] = {}
    for name, option in options.items():
        option = dict(option)
        torch.backends.cudnn.benchmark = option.pop("cudnn_benchmark", False)  # set while capturing: algorithms fixed
        other = ExactChunkDecode(vae, graphs=True, postprocess=uint8_frames_on_device, **option)
        diffs = []
        for i in range(args.chunks):
            part = stream[:, :, i * args.chunk : (i + 1) * args.chunk]
            diffs.append(int((graphed(part, first=i == 0).int() - other(part, first=i == 0).int()).abs().max().item()))
        pair = {"default": cuda_times_ms(lambda: graphed(later, first=False), 1, args.repeats * 2)}
        pair[name] = cuda_times_ms(lambda: other(later, first=False), 1, args.repeats * 2)
        result["options"][name] = dict(
            {k: spread(v) for k, v in pair.items()}, max_abs_diff_vs_default_per_chunk=diffs, failures=other.failures
        )
        other = None  # frees its graph pool before the next option
        torch.backends.cudnn.benchmark = False
        torch.cuda.empty_cache()
    for name, o in result["options"].items():
        print(
            f"option {name:<33} median {o[name]['median_ms']:8.2f} ms vs default {o['default']['median_ms']:8.2f} ms; "
            f"max|diff| vs default per chunk {o['max_abs_diff_vs_default_per_chunk']}"
        )
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    eager(later, first=False)
    result["exact_eager_chunk_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    result["graph_pool_reserved_mib"] = torch.cuda.memory_reserved() / 2**20
    result["exact_eager_top_kernels"] = top_kernels(lambda: eager(later, first=False), count=40)
    result["exact_eager_kernel_categories_ms"] = kernel_categories(result["exact_eager_top_kernels"])
    result["diffusers_eager_top_kernels"] = top_kernels(lambda: plain.decode(chunk), count=8)
    for row in result["exact_eager_top_kernels"][:16]:
        print(f"  {row['ms']:8.2f} ms  x{row['calls']:<4} {row['kernel']}")
    print("kernel categories (ms):", result["exact_eager_kernel_categories_ms"])
    result["exact_eager_top_ops"] = top_ops(lambda: eager(later, first=False), count=25)
    for row in result["exact_eager_top_ops"]:
        print(f"  {row['ms']:8.2f} ms  x{row['calls']:<4} {row['op']} {row['shapes']}")
    for name, options in (("phase", {}), ("direct", dict(upsample="direct"))):
        # sdpa: the FLOP counter does not take bmm's out_dtype; only the convolutions are counted
        decoder = ExactChunkDecode(vae, graphs=False, attention_kernel="sdpa", **options)
        flops = conv_flops(decoder, stream, args.chunk)
        result[f"conv_tflop_later_chunk_{name}_upsample"] = flops / 1e12
        print(f"conv TFLOP of a later chunk, {name} upsampling: {flops / 1e12:.1f}")
    return result


def top_ops(fn, count: int) -> list:
    """The ``count`` PyTorch ops (by input shapes) with the most GPU time in one call of ``fn``: which copy or
    conv a kernel total comes from."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages(group_by_input_shape=True):
        device_us = getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0)
        if device_us and event.key.startswith("aten::"):
            rows.append(dict(op=event.key, shapes=str(event.input_shapes)[:120], ms=device_us / 1e3, calls=event.count))
    return sorted(rows, key=lambda r: -r["ms"])[:count]


def kernel_categories(rows: list) -> dict:
    """GPU ms of a profile's kernels by kind (convolutions, attention, norms, copies, other)."""
    kinds = {
        "conv": ("xmma_fprop", "implicit_gemm", "conv", "cudnn"),
        "attention": ("fmha", "attention", "softmax", "nvjet", "gemm", "cutlass"),
        "norm": ("_normalize", "_block_moments", "group_norm"),
        "copy": ("copy", "elementwise", "_upsample", "cat"),
    }
    totals = dict.fromkeys([*kinds, "other"], 0.0)
    for row in rows:
        name = row["kernel"].lower()
        kind = next((k for k, words in kinds.items() if any(w in name for w in words)), "other")
        totals[kind] += row["ms"]
    return {k: round(v, 2) for k, v in totals.items()}


def conv_flops(decoder: ExactChunkDecode, stream: torch.Tensor, chunk: int) -> float:
    """FLOPs of the convolutions in one later-chunk decode (torch's FLOP counter: 2 x MACs)."""
    from torch.utils.flop_counter import FlopCounterMode

    for i in range(2):  # a clip in progress: the second chunk is a later chunk
        part = stream[:, :, i * chunk : (i + 1) * chunk]
        if i == 0:
            decoder(part, first=True)
            continue
        with FlopCounterMode(display=False) as counter:
            decoder(part, first=False)
    return float(sum(v for op, v in counter.get_flop_counts()["Global"].items() if "conv" in str(op)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    rules = sub.add_parser("rules", help="deviation of each chunk rule from the whole-clip decode")
    rules.add_argument("--tiny", action="store_true", help="tiny random VAE in fp32 on the CPU")
    rules.add_argument("--size", type=int, nargs=2, default=[256, 256], metavar=("H", "W"))
    rules.add_argument("--frames", type=int, default=33)
    rules.add_argument("--lengths", type=int, nargs="+", default=[1, 4], help="multiples of --frames (2 clips at >1)")
    rules.add_argument("--clips", type=int, default=4)
    rules.add_argument("--chunk", type=int, default=3, help="latent frames per chunk")
    rules.add_argument("--window", type=int, default=8, help="attention window (latent frames)")
    speed = sub.add_parser("speed", help="one chunk decode at 480x832, bf16, GPU")
    speed.add_argument("--size", type=int, nargs=2, default=[480, 832], metavar=("H", "W"))
    speed.add_argument("--chunk", type=int, default=3)
    speed.add_argument("--chunks", type=int, default=4, help="chunks of the stream decoded before timing")
    speed.add_argument("--rounds", type=int, default=3)
    speed.add_argument("--repeats", type=int, default=5)
    for p in (rules, speed):
        p.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = run_rules(args) if args.mode == "rules" else run_speed(args)
    path = Path(args.out) / f"streaming_decode_{args.mode}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
