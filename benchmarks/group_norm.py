"""PyTorch's group norm vs ``parallel_group_norm`` (opensora/models/vae/group_norm.py) at VAE-decoder shapes, bf16.

Per shape: median time of ``F.group_norm`` and ``parallel_group_norm`` (CUDA events, after warm-up), and each
one's max error against ``F.group_norm`` on the fp32 copy. Then one streaming chunk decode of the tiny HunyuanVideo
VAE (5 latent frames: 3 new + 2 of context, 256px), graphed as the streaming sampler runs it, with and without the
swap to ``ParallelGroupNorm``. Table on stdout, JSON in ``--out``/group_norm.json.

  python -m benchmarks.group_norm --out DIR
  python -m benchmarks.group_norm --tiny --out DIR   # CPU smoke test (tiny shapes, eager decode)
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import cuda_time_ms
from opensora.models.vae import HunyuanVideoVAE
from opensora.models.vae.group_norm import parallel_group_norm

SHAPES = [  # (shape, groups)
    ((1, 128, 5, 128, 128), 32),
    ((1, 8, 17, 256, 256), 4),
    ((1, 512, 3, 32, 32), 32),
    ((2, 256, 9, 64, 64), 32),
]
TINY_SHAPES = [((1, 16, 3, 8, 8), 4), ((2, 32, 2, 8, 8), 32)]
TINY_VAE = dict(block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4, latent_channels=16)


def time_ms(fn, warmup, iters, device):
    if device.type == "cuda":
        return cuda_time_ms(fn, warmup, iters)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bench_shape(shape, groups, device, warmup, iters):
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape, device=device, generator=gen).bfloat16()
    w = torch.randn(shape[1], device=device, generator=gen).bfloat16()
    b = torch.randn(shape[1], device=device, generator=gen).bfloat16()
    ref = F.group_norm(x.float(), groups, w.float(), b.float(), 1e-6)
    plain, ours = (lambda: F.group_norm(x, groups, w, b, 1e-6)), (lambda: parallel_group_norm(x, groups, w, b, 1e-6))
    row = dict(shape=list(shape), groups=groups)
    row["torch_ms"] = time_ms(plain, warmup, iters, device)
    row["parallel_ms"] = time_ms(ours, warmup, iters, device)
    row["speedup"] = row["torch_ms"] / row["parallel_ms"]
    row["torch_err"] = (plain().float() - ref).abs().max().item()
    row["parallel_err"] = (ours().float() - ref).abs().max().item()
    return row


def bench_decode(device, tiny, warmup, iters):
    """One chunk decode of the tiny VAE (graphed on the GPU, as ``StreamingGenerator(cuda_graphs=True)`` runs it)."""
    from opensora.inference.streaming.generator import GraphedDecode

    latent = torch.randn((1, 16, 5) + ((4, 4) if tiny else (32, 32)), generator=torch.Generator().manual_seed(1))
    latent = latent.to(device, torch.bfloat16)
    row = dict(latent_shape=list(latent.shape), graphed=device.type == "cuda")
    for name, parallel in (("torch_ms", False), ("parallel_ms", True)):
        vae = HunyuanVideoVAE(config=TINY_VAE, dtype="bf16", device=device, parallel_group_norm=parallel)
        decode = GraphedDecode(vae, torch.bfloat16, None).on_device if row["graphed"] else vae.decode
        row[name] = time_ms(lambda: decode(latent), warmup, iters, device)
    row["speedup"] = row["torch_ms"] / row["parallel_ms"]
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for group_norm.json")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.tiny:
        parser.error("needs a CUDA GPU (or --tiny for the CPU smoke test)")
    result = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", torch=torch.__version__
    )
    with torch.no_grad():
        shapes = TINY_SHAPES if args.tiny else SHAPES
        result["shapes"] = [bench_shape(s, g, device, args.warmup, args.iters) for s, g in shapes]
        result["decode"] = bench_decode(device, args.tiny, args.warmup, args.iters)
    print(
        f"{'shape':<26} {'G':>3} {'torch ms':>9} {'parallel ms':>12} {'speedup':>8} {'torch err':>10} {'ours err':>9}"
    )
    for r in result["shapes"]:
        print(
            f"{str(r['shape']):<26} {r['groups']:>3} {r['torch_ms']:>9.3f} {r['parallel_ms']:>12.3f} "
            f"{r['speedup']:>7.2f}x {r['torch_err']:>10.4f} {r['parallel_err']:>9.4f}"
        )
    d = result["decode"]
    kind = "graphed" if d["graphed"] else "eager"
    print(
        f"tiny VAE chunk decode {d['latent_shape']} ({kind}): {d['torch_ms']:.3f} ms -> {d['parallel_ms']:.3f} ms "
        f"({d['speedup']:.2f}x)"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "group_norm.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
