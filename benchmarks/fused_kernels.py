"""The fused Triton chains (models/mmdit/fused.py) against their eager code, one chain at a time, at the 1B shape.

Per chain: forward + backward time (CUDA events, median of ``--iters`` after warm-up), eager vs fused, the bytes
each moves by our pass count, and the GB/s that implies, so the saving in benchmarks/train_step.py can be
checked against an estimate. The 1B step (8 double + 16 single blocks, 8448 video + 512 text tokens, hidden 1536)
runs the modulation chain over 32 x 8960 rows and the QK-norm + RoPE chain over 24 x (q, k) x 8960 rows, so
the per-step saving is 32 x (modulation saving) + 24 x (q/k pair saving) at 8960 rows.

Pass counts (X = one bf16 [8960, 1536] activation, 27.5 MB; fp32 intermediates count 2X):
  modulation   eager fwd 4X (layer_norm read+write, addcmul read+write); bwd ~10X (grad * (1 + scale), the
               product and sum for d_scale, the sum for d_shift, layer_norm backward read x, grad, write dx)
               fused fwd 2X; bwd 3X (+ 1/4X of fp32 partials)
  q/k (each)   eager fwd ~12X (rms_norm on the strided view, contiguous copy, fp32 upcast, complex multiply,
               downcast); bwd ~13X (the same in reverse, plus the rms_norm backward)
               fused fwd 2X; bwd 3X

  python -m benchmarks.fused_kernels --out DIR
"""

import argparse
import json
import statistics
from pathlib import Path

import torch

from opensora.models.mmdit import fused  # noqa: E402
from opensora.models.mmdit.layers import QKNorm, modulate  # noqa: E402
from opensora.models.mmdit.rope import apply_rope, rope_cos_sin, video_position_ids  # noqa: E402

TOKENS, HIDDEN, HEADS, MLP = 8960, 1536, 12, 6144
PASSES = {  # (eager fwd, eager bwd, fused fwd, fused bwd) in units of one bf16 [TOKENS, HIDDEN] tensor
    "modulate": (4, 10, 2, 3.25),
    "qk_norm_rope (q and k)": (24, 26, 4, 6),
}
CALLS_PER_STEP = {"modulate": 32, "qk_norm_rope (q and k)": 24}


def time_ms(fn, warmup, iters):
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
    return statistics.median(times)


def modulate_case(device):
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, TOKENS, HIDDEN, device=device, generator=gen).bfloat16().requires_grad_(True)
    mods = torch.randn(1, 1, 6 * HIDDEN, device=device, generator=gen).bfloat16().requires_grad_(True)
    gy = torch.randn(1, TOKENS, HIDDEN, device=device, generator=gen).bfloat16()

    def run(fused_on):
        def step():
            shift, scale = mods.chunk(6, dim=-1)[:2]
            y = modulate(x, shift, scale, fused=fused_on)
            torch.autograd.backward(y, gy)

        return step

    return run


def qk_case(device):
    gen = torch.Generator(device=device).manual_seed(0)
    lin = torch.randn(1, TOKENS, 3 * HIDDEN + MLP, device=device, generator=gen).bfloat16()
    # the single block's split of linear1's output: a leaf with that view's strides
    qkv = lin[..., : 3 * HIDDEN].detach().requires_grad_(True)
    norm = QKNorm(HIDDEN // HEADS).to(device, torch.bfloat16)
    ids = torch.cat([torch.zeros(512, 3, dtype=torch.long), video_position_ids(11, 24, 32)]).to(device)
    cos, sin = rope_cos_sin(ids, (16, 56, 56), 10000.0)
    gq = torch.randn(1, HEADS, TOKENS, HIDDEN // HEADS, device=device, generator=gen).bfloat16()

    def run(fused_on):
        def step():
            q, k, _ = qkv.view(1, TOKENS, 3, HEADS, -1).permute(2, 0, 3, 1, 4).unbind(0)
            if fused_on:
                q, k = fused.qk_norm_rope(q, k, norm.query_scale, norm.key_scale, cos, sin)
            else:  # what the eager single block does
                q, k = norm(q, k)
                q, k = apply_rope(q.contiguous(), cos, sin), apply_rope(k.contiguous(), cos, sin)
            torch.autograd.backward((q, k), (gq, gq))

        return step

    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for fused_kernels.json")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    x_bytes = TOKENS * HIDDEN * 2
    report = dict(
        torch=torch.__version__, device=torch.cuda.get_device_name(), triton=fused.triton.__version__, chains=[]
    )
    total_saved = 0.0
    for name, case in (("modulate", modulate_case), ("qk_norm_rope (q and k)", qk_case)):
        run = case(device)
        eager_ms = time_ms(run(False), args.warmup, args.iters)
        fused_ms = time_ms(run(True), args.warmup, args.iters)
        ef, eb, ff, fb = PASSES[name]
        calls = CALLS_PER_STEP[name]
        saved = (eager_ms - fused_ms) * calls
        total_saved += saved
        row = dict(
            chain=name,
            eager_fwd_bwd_ms=eager_ms,
            fused_fwd_bwd_ms=fused_ms,
            eager_est_gb=(ef + eb) * x_bytes / 1e9,
            fused_est_gb=(ff + fb) * x_bytes / 1e9,
            eager_est_gbps=(ef + eb) * x_bytes / 1e6 / eager_ms,
            fused_est_gbps=(ff + fb) * x_bytes / 1e6 / fused_ms,
            calls_per_step=calls,
            saved_ms_per_step=saved,
        )
        report["chains"].append(row)
        print(
            f"{name:24s} eager {eager_ms:7.3f} ms ({row['eager_est_gbps']:6.0f} GB/s est.)  fused {fused_ms:7.3f} ms "
            f"({row['fused_est_gbps']:6.0f} GB/s est.)  x{calls} calls = {saved:6.2f} ms/step saved",
            flush=True,
        )
    report["saved_ms_per_step"] = total_saved
    print(f"expected saving per 1B step: {total_saved:.2f} ms")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fused_kernels.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'fused_kernels.json'}")


if __name__ == "__main__":
    main()
