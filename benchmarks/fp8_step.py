"""FP8 block linears (torchao float8, tensorwise and rowwise scaling) against bf16: training step time at two widths.

Shapes: the 1B preset (1536 wide, 8 + 16 blocks) and the 11B width (3072 wide, 24 heads; 3 + 6 of its 19 + 38
blocks, so that weights, grads and AdamW state fit one GPU next to the other variants: the per-block matmul shapes are
the 11B model's). Tokens as in the real 256px configuration: batch 4 x (2304 video + 128 text), no mask. Compiled
blocks and full checkpointing (the training configs' setting), bf16 weights, fused AdamW. The variants of one width
run in interleaved rounds in this process. Also reported: each FP8 variant's loss after one identical step relative
to bf16's and the relative error of its output (a sanity check, not the quality check of a training run).

  python -m benchmarks.fp8_step --out $OUT/fp8_step.json
"""

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import OUT, randomize_
from benchmarks.padded_text_step import REAL, our_config
from benchmarks.train_step import LATENT_CHANNELS, spread

WIDTHS = {
    "1b": dict(REAL),
    "11b-width": dict(REAL, hidden=3072, heads=24, depth_double=3, depth_single=6, axes=(16, 56, 56)),
}
RECIPES = (None, "tensorwise", "rowwise")


def build(shape, recipe, device):
    import torch

    from opensora.models.mmdit import MMDiT

    with torch.device(device):
        model = MMDiT(**our_config(shape), fp8_linears=recipe)
    randomize_(model)
    model.to(device=device, dtype=torch.bfloat16).train()
    model.set_grad_ckpt(shape["depth_double"], shape["depth_single"])
    model.set_compile_blocks(True)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)


def inputs(shape, device, text_cols=128, seed=0):
    import torch

    t, h, w = shape["grid"]
    batch = shape["batch"]
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=torch.bfloat16)  # noqa: E731
    data = dict(
        x=rnd(batch, LATENT_CHANNELS, t, 2 * h, 2 * w),
        timestep=torch.rand(batch, generator=gen).to(device),
        text_emb=rnd(batch, text_cols, shape["text_dim"]),
        pooled=rnd(batch, shape["pooled_dim"]),
    )
    return data, rnd(*data["x"].shape)


def run_width(name, shape, args):
    import torch

    from opensora.models.mmdit import mmdit_train_flops

    device = torch.device("cuda")
    data, target = inputs(shape, device)
    variants = {}
    for recipe in RECIPES:
        torch.manual_seed(0)
        variants[recipe or "bf16"] = build(shape, recipe, device)
    state = {k: v.clone() for k, v in variants["bf16"][0].state_dict().items()}
    checks = {}
    with torch.no_grad():
        reference = variants["bf16"][0](**data).float()
    for label, (model, _) in variants.items():  # identical weights (randomize_ is seeded): compare the outputs
        model.load_state_dict(state)
        with torch.no_grad():
            out = model(**data).float()
        checks[label] = dict(output_rel_err=((out - reference).norm() / reference.norm()).item())
    times = {label: [] for label in variants}
    warm = {}

    def step(model, optimizer):
        loss = torch.nn.functional.mse_loss(model(**data).float(), target.float())
        loss.backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)
        return loss

    for label, (model, optimizer) in variants.items():
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            loss = step(model, optimizer)
        torch.cuda.synchronize()
        warm[label] = round(time.perf_counter() - t0, 1)
        checks[label]["loss_after_warmup"] = loss.item()
        print(f"{name} {label}: warm-up {warm[label]} s", flush=True)
    for _ in range(args.rounds):
        for label, (model, optimizer) in variants.items():
            for _ in range(args.iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step(model, optimizer)
                end.record()
                end.synchronize()
                times[label].append(start.elapsed_time(end) / 1e3)
    video = shape["grid"][0] * shape["grid"][1] * shape["grid"][2]
    flops = mmdit_train_flops(our_config(shape), video, 128, shape["batch"])
    rows = []
    for label, ts in times.items():
        median = statistics.median(ts)
        rows.append(
            dict(
                width=name,
                variant=label,
                **spread(ts),
                step_ms=median * 1e3,
                warmup_s=warm[label],
                speedup_vs_bf16=statistics.median(times["bf16"]) / median,
                mfu_vs_ceiling=flops / median / 1e12 / args.ceiling_tflops,
                mfu_vs_vendor=flops / median / 1e12 / args.vendor_tflops,
                **checks[label],
            )  # fmt: skip
        )
    del variants
    torch.cuda.empty_cache()
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="1b,11b-width")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ceiling-tflops", type=float, default=752.0)
    parser.add_argument("--vendor-tflops", type=float, default=989.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import torch

    # every variant's blocks compile their own graphs in this one process (3 recipes x 2 widths x 2 block kinds):
    # under dynamo's default limit of 8 the later variants ran eager (2026-11-27, H100: the 11B-width rows)
    for limit, value in (("recompile_limit", 64), ("cache_size_limit", 64), ("accumulated_recompile_limit", 1024)):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, value)
    env = dict(date=datetime.date.today().isoformat(), torch=torch.__version__, device=torch.cuda.get_device_name())
    rows = []
    out = Path(args.out or OUT / f"fp8_step_{env['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.widths.split(","):
        try:
            rows += run_width(name, WIDTHS[name], args)
        except Exception as error:  # one width failing (memory, a kernel) keeps the other's rows
            rows.append(dict(width=name, error=f"{type(error).__name__}: {error}"[:400]))
        out.write_text(json.dumps(dict(environment=env, rows=rows), indent=1))
    print(json.dumps(env))
    for r in rows:
        if "error" in r:
            print(f"{r['width']:10s} FAILED {r['error']}")
            continue
        print(
            f"{r['width']:10s} {r['variant']:10s} {r['step_ms']:8.1f} ms  x{r['speedup_vs_bf16']:.3f}  "
            f"MFU {100 * r['mfu_vs_ceiling']:.1f}% of 752 / {100 * r['mfu_vs_vendor']:.1f}% of 989  "
            f"out err {r['output_rel_err']:.2e}  p90/p10 {r['p90_over_p10']:.3f}"
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
