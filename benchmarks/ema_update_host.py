#!/usr/bin/env python
"""Host time of one EMA update at the 1B preset's parameter structure (8 double + 16 single blocks: 336 trainable
tensors) with the preset's smallest widths, so that the per-tensor host work shows and the arithmetic costs little.

  python -m benchmarks.ema_update_host                                   # bf16 weights, fp32 shadow, CPU
  git show REV:opensora/training/ema.py > /tmp/ema_rev.py
  python -m benchmarks.ema_update_host --against /tmp/ema_rev.py         # the same, interleaved with REV's EMA

Each round times ``--iters`` updates (median) of every EMA in turn; the rounds interleave them. On a GPU the kernels
are queued, so this host time is what a host-bound trainer step pays for its EMA; on CPU the multi-tensor kernels
run inline, one small op per tensor, and are part of every number here.
"""

import argparse
import importlib.util
import statistics
import time

import torch

from benchmarks.common import TINY, model_config


def median_ms(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def ema_class_from(path: str):
    """``EMA`` of another version of ``opensora/training/ema.py`` (imported as a module of that package)."""
    spec = importlib.util.spec_from_file_location("opensora.training.ema_against", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.EMA


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--against", default=None, help="another ema.py to time beside this checkout's")
    args = parser.parse_args(argv)
    from opensora.models.mmdit import MMDiT
    from opensora.training.ema import EMA

    cfg = model_config(dict(TINY, depth_double=8, depth_single=16, hidden=16, heads=1, axes=(4, 6, 6)))
    cfg.pop("type", None)
    model = MMDiT(**cfg).to(torch.bfloat16)
    classes = {"this checkout": EMA}
    if args.against:
        classes[args.against] = ema_class_from(args.against)
    emas = {name: cls(model, decay=0.999, enabled=True) for name, cls in classes.items()}
    rounds = {name: [] for name in emas}
    for _ in range(args.rounds):
        for name, ema in emas.items():
            for _ in range(20):
                ema.update(model, step=1)
            rounds[name].append(median_ms(lambda: ema.update(model, step=1), args.iters))
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    result = dict(tensors=tensors, rounds_ms=rounds, median_ms={k: statistics.median(v) for k, v in rounds.items()})
    for name, values in rounds.items():
        spread = " ".join(f"{v:.2f}" for v in values)
        print(f"{name}: {result['median_ms'][name]:.2f} ms per update ({tensors} tensors; rounds {spread})")
    return result


if __name__ == "__main__":
    main()
