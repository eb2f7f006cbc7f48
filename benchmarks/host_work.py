#!/usr/bin/env python
"""Host time of the trainer's per-parameter work around the optimizer step, at the 1B preset's parameter structure
(8 double + 16 single blocks: 336 trainable tensors) with the preset's smallest widths, so that the per-tensor host
work shows and the arithmetic costs little:

* ``ema``: one rank-0 EMA update (bf16 weights, fp32 shadow);
* ``zero_cast``: the ZeRO step's cast of the bf16 gradient shards into fp32 (``zero_single_rank._cast_all``);
* ``zero_write_back``: the one-rank step's write of the fp32 masters into the bf16 parameters.

  python -m benchmarks.host_work                                        # this checkout, CPU
  git show REV:opensora/training/ema.py > /tmp/ema_rev.py
  git show REV:opensora/training/zero_single_rank.py > /tmp/zero_rev.py
  python -m benchmarks.host_work --against-ema /tmp/ema_rev.py --against-zero /tmp/zero_rev.py   # interleaved

Each round times ``--iters`` calls (median) of every version in turn; the rounds interleave them. On a GPU the kernels
are queued, so this host time is what a host-bound trainer step pays; on CPU the multi-tensor kernels run inline as
one small op per tensor, and are part of every number here. ``--against-zero`` files older than the write-back cache
(before 2026-11-27) are timed with the write-back as it was then: an alias and a reshape per parameter each step.
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


def module_from(path: str, name: str):
    """Another version of a module of ``opensora.training`` (imported as a module of that package)."""
    spec = importlib.util.spec_from_file_location(f"opensora.training.{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_back(zero, owner, stepped):
    """The one-rank step's write-back with ``zero``'s lists (or, before it had them, the per-step lists)."""
    if hasattr(zero, "_write_back_lists"):
        torch._foreach_copy_(*zero._write_back_lists(owner, stepped))
    else:
        working = [w.data for w, _ in stepped]
        torch._foreach_copy_(working, [m.reshape(w.shape) for w, (_, m) in zip(working, stepped)])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--against-ema", default=None, help="another ema.py to time beside this checkout's")
    parser.add_argument("--against-zero", default=None, help="another zero_single_rank.py to time beside this one")
    args = parser.parse_args(argv)
    import types

    from opensora.models.mmdit import MMDiT
    from opensora.training import ema as this_ema
    from opensora.training import zero_single_rank as this_zero

    cfg = model_config(dict(TINY, depth_double=8, depth_single=16, hidden=16, heads=1, axes=(4, 6, 6)))
    cfg.pop("type", None)
    model = MMDiT(**cfg).to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [torch.randn(p.numel()).bfloat16() for p in params]  # ZeRO's shards: flat
    stepped = [(p, p.detach().float().flatten().clone()) for p in params]

    emas = {"this checkout": this_ema}
    zeros = {"this checkout": this_zero}
    if args.against_ema:
        emas[args.against_ema] = module_from(args.against_ema, "ema_against")
    if args.against_zero:
        zeros[args.against_zero] = module_from(args.against_zero, "zero_single_rank_against")
    cases = {}
    for name, module in emas.items():
        ema = module.EMA(model, decay=0.999, enabled=True)
        cases[("ema", name)] = lambda ema=ema: ema.update(model, step=1)
    for name, module in zeros.items():
        cases[("zero_cast", name)] = lambda module=module: module._cast_all(grads, torch.float32)
        owner = types.SimpleNamespace()  # stands for the optimizer that keeps the write-back lists
        cases[("zero_write_back", name)] = lambda module=module, owner=owner: write_back(module, owner, stepped)
    rounds = {key: [] for key in cases}
    for _ in range(args.rounds):
        for key, fn in cases.items():
            for _ in range(20):
                fn()
            rounds[key].append(median_ms(fn, args.iters))
    result = dict(tensors=len(params), parts={})
    for (part, name), values in rounds.items():
        result["parts"].setdefault(part, {})[name] = dict(median_ms=statistics.median(values), rounds_ms=values)
        spread = " ".join(f"{v:.2f}" for v in values)
        print(f"{part:16s} {name}: {statistics.median(values):.2f} ms ({len(params)} tensors; rounds {spread})")
    return result


if __name__ == "__main__":
    main()
