"""Largest per-GPU token count of the 1B MMDiT training step with no / selective / full activation checkpointing.

The 1B preset (``benchmarks.common.FULL``, the training-step shape: 8 double + 16 single blocks, 12 x 128 heads,
512 text tokens, batch 1) at 384x512 (24 x 32 = 768 video tokens per latent frame); the search runs over the latent
frame count T (tokens = 768 T + 512). Memory is the trainer's on one GPU: bf16 working weights and gradients plus an
fp32 master copy with fp32 AdamW moments (what ZeRO keeps on a single rank), so "fits" means "fits in the trainer",
not in the lighter bare benchmark step. For each mode: doubling from ``--start-frames`` until a step runs out of
memory (or ``--max-frames``), then bisection; at the largest T that fits, two timed steps (CUDA events) and the peak
memory. The allocator runs with ``expandable_segments`` (less fragmentation; set it in real runs too).

  python -m benchmarks.max_tokens --out OUT/max_tokens.json
  python -m benchmarks.max_tokens --modes none,4:8,full --max-frames 160 --budget-s 420
  python -m benchmarks.max_tokens --tiny      # CPU smoke test (no OOM there: stops at --max-frames)

Modes: ``none``, ``full`` or ``D:S`` = the first D double and S single blocks checkpointed (``grad_ckpt_double`` /
``grad_ckpt_single`` in a model config); ``selective`` = ``4:8`` (half of each kind).
"""

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import FULL, OUT, TINY, model_config, randomize_

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

TOKENS_H, TOKENS_W = 24, 32  # video tokens per latent frame: 384x512 pixels, 8x VAE, 2x2 patches


def parse_mode(mode, depth_double, depth_single):
    if mode == "none":
        return 0, 0
    if mode == "full":
        return depth_double, depth_single
    if mode == "selective":
        return depth_double // 2, depth_single // 2
    d, s = (int(v) for v in mode.split(":"))
    return d, s


class MasterAdamW:
    """fp32 master weights + fused AdamW for bf16 working weights: the memory ZeRO has on one rank."""

    def __init__(self, params, lr=1e-5):
        import torch

        self.params = list(params)
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        fused = self.params[0].is_cuda
        self.opt = torch.optim.AdamW(self.master, lr=lr, betas=(0.9, 0.999), eps=1e-15, fused=fused)

    def step(self):
        import torch

        for m, p in zip(self.master, self.params):
            m.grad = p.grad.float() if p.grad is not None else None
        self.opt.step()
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.master)
        for m, p in zip(self.master, self.params):
            m.grad = None
            p.grad = None


def build(shape, device, dtype):
    import torch

    from opensora.models.mmdit import MMDiT

    cfg = model_config(shape)
    cfg.pop("type")
    with torch.device(device):
        model = MMDiT(**cfg)
    randomize_(model)
    model.to(device=device, dtype=dtype).train()
    return model, MasterAdamW(model.parameters())


def step_fn(model, opt, shape, frames, device, dtype):
    import torch

    gen = torch.Generator(device="cpu").manual_seed(frames)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)
    h, w = shape["tokens_hw"]
    x = rnd(1, 16, frames, 2 * h, 2 * w)
    kwargs = dict(
        timestep=torch.rand(1, generator=gen).to(device),
        text_emb=rnd(1, shape["text_tokens"], shape["text_dim"]),
        pooled=rnd(1, shape["pooled_dim"]),
    )
    target = rnd(*x.shape)

    def step():
        out = model(x, **kwargs)
        loss = torch.nn.functional.mse_loss(out.float(), target.float())
        loss.backward()
        opt.step()
        return loss

    return step


def try_frames(model, opt, shape, frames, device, dtype, timed=0):
    """(fits, step seconds or None, peak GiB); frees everything the attempt allocated."""
    import torch

    cuda = device.type == "cuda"
    step = None
    try:
        step = step_fn(model, opt, shape, frames, device, dtype)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        step()
        times = []
        for _ in range(timed):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
        if cuda:
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        return True, (statistics.median(times) if times else None), peak
    except torch.OutOfMemoryError:
        return False, None, None
    finally:
        del step
        for p in model.parameters():
            p.grad = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def search(model, opt, shape, mode, args, device, dtype, deadline):
    """Largest latent frame count that fits in ``mode``; returns the row."""
    d, s = parse_mode(mode, shape["depth_double"], shape["depth_single"])
    model.set_grad_ckpt(d, s)
    probes = []

    def fits(frames):
        if time.perf_counter() > deadline:
            raise TimeoutError
        t0 = time.perf_counter()
        ok, _, peak = try_frames(model, opt, shape, frames, device, dtype)
        probes.append(dict(frames=frames, fits=ok, peak_gib=peak, probe_s=round(time.perf_counter() - t0, 1)))
        print(f"  {mode}: T={frames} ({tokens(shape, frames)} tokens) {'fits' if ok else 'OOM'}", flush=True)
        return ok

    lo, hi, timed_out = 0, None, False
    try:
        frames = args.start_frames
        while frames <= args.max_frames and fits(frames):  # doubling
            lo, frames = frames, frames * 2
        hi = min(frames, args.max_frames + 1)
        while hi - lo > 1:  # bisection: lo fits, hi does not (or is past the cap)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    except TimeoutError:
        timed_out = True
    row = dict(mode=mode, grad_ckpt_double=d, grad_ckpt_single=s, max_frames=lo, capped=lo >= args.max_frames)
    row.update(timed_out=timed_out, probes=probes)
    if lo:
        ok, seconds, peak = try_frames(model, opt, shape, lo, device, dtype, timed=args.timed)
        flops = train_flops(shape, lo)
        row.update(
            tokens=tokens(shape, lo),
            video_tokens=lo * shape["tokens_hw"][0] * shape["tokens_hw"][1],
            step_s=seconds,
            peak_gib=peak,
            model_tflops=flops / seconds / 1e12 if seconds else None,
            mfu=flops / seconds / 1e12 / args.peak_tflops if seconds else None,
            timed_ok=ok,
        )
    return row


def tokens(shape, frames):
    return frames * shape["tokens_hw"][0] * shape["tokens_hw"][1] + shape["text_tokens"]


def train_flops(shape, frames):
    from opensora.models.mmdit import mmdit_train_flops

    cfg = model_config(shape)
    video = frames * shape["tokens_hw"][0] * shape["tokens_hw"][1]
    return mmdit_train_flops(cfg, video, shape["text_tokens"])


def main(argv=None):
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="none,selective,full", help="comma list: none, selective, full, D:S")
    parser.add_argument("--start-frames", type=int, default=8)
    parser.add_argument("--max-frames", type=int, default=160, help="cap on the latent frame count searched")
    parser.add_argument("--timed", type=int, default=2, help="timed steps at the largest size")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=400,
        help="search seconds, split equally between the modes (timed steps extra)",
    )
    parser.add_argument("--peak-tflops", type=float, default=752.0)
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke test)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    tiny = args.tiny or not torch.cuda.is_available()
    shape = dict(TINY if tiny else FULL)
    shape["tokens_hw"] = (2, 2) if tiny else (TOKENS_H, TOKENS_W)
    if tiny:
        args.max_frames = min(args.max_frames, 4)
        args.start_frames = min(args.start_frames, 1)
    device = torch.device("cpu" if tiny else "cuda")
    dtype = torch.float32 if tiny else torch.bfloat16
    started = time.perf_counter()
    model, opt = build(shape, device, dtype)
    try_frames(model, opt, shape, 1, device, dtype)  # materialise the optimizer state before measuring
    modes = [m.strip() for m in args.modes.split(",")]
    env = dict(date=datetime.date.today().isoformat(), torch=torch.__version__, tiny=tiny)
    env["device"] = torch.cuda.get_device_name() if not tiny else "cpu"
    if not tiny:
        env["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    out = Path(args.out or OUT / f"max_tokens_{env['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for mode in modes:  # each mode's search gets its own equal share (the timed steps at its largest size come on
        # top: sharing what was left starved the last mode when a large mode's timed steps overran)
        deadline = time.perf_counter() + args.budget_s / len(modes)
        rows.append(search(model, opt, shape, mode, args, device, dtype, deadline))
        r = rows[-1]
        print(
            f"{mode}: max T={r['max_frames']} -> {r.get('tokens')} tokens, step {r.get('step_s')} s, "
            f"peak {r.get('peak_gib')} GiB{' (capped)' if r['capped'] else ''}{' (budget spent)' if r['timed_out'] else ''}",
            flush=True,
        )
        # written after every mode: a run stopped from outside keeps the modes it finished
        report = dict(environment=env, shape=dict(shape), rows=rows, wall_s=time.perf_counter() - started)
        out.write_text(json.dumps(report, indent=1))
    print(f"\n{'mode':10s} {'ckpt D:S':>8s} {'max T':>6s} {'tokens':>8s} {'step s':>8s} {'MFU':>6s} {'peak GiB':>9s}")
    for r in rows:
        mfu = f"{100 * r['mfu']:5.1f}%" if r.get("mfu") else "-"
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") else "-"
        step = f"{r['step_s']:.3f}" if r.get("step_s") else "-"
        print(
            f"{r['mode']:10s} {r['grad_ckpt_double']:>3d}:{r['grad_ckpt_single']:<4d} {r['max_frames']:6d} "
            f"{r.get('tokens') or 0:8d} {step:>8s} {mfu:>6s} {peak:>9s}"
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
