"""Where does ``compile_blocks=True`` go non-finite? One 1B block, compiled vs eager, tensor by tensor.

Issue 16: the compiled 1B MMDiT gives non-finite gradients on GPU at batch 1 in bf16 (not on CPU). This script
builds one double- and one single-stream block at the 1B shapes (hidden 1536, 12 x 128 heads, 8448 video + 512
text tokens, batch 1, bf16, weights ~N(0, 0.02) like benchmarks/train_step.py), runs forward + backward eagerly
and compiled on the same weights, inputs and output gradients, and reports for each variant the first tensor
that is non-finite or far from eager, in the order outputs -> input grads -> parameter grads. Variants isolate
one op or one compiler setting each:

  default     block.compile(options=compile_block_options()) as MMDiT.set_compile_blocks does (mix-order
              reductions off, the fix found with this script)
  mix-order   the same with Inductor's mix-order reductions on (torch 2.10-2.11's default: wrong modulation grads)
  fullgraph   torch.compile(fullgraph=True): fails loudly on a graph break instead of splitting the block
  autotune    mode="max-autotune-no-cudagraphs"
  no-qknorm   QK RMSNorm removed (in eager and compiled alike)
  no-rope     identity rotation (cos 1, sin 0)
  flash       attention backend "flash" instead of "auto" (cuDNN on sm90)
  batch2      batch 2 instead of 1 (the fault was seen at batch 1 only)
  no-split-reductions / no-persistent-reductions   Inductor options for the token sums

What the earlier runs point at (benchmarks/README.md, Known problems): the non-finite grads were the time/pooled
embedders' and some blocks' modulation weights, i.e. the gradient reaching ``vec``; every other weight was finite.
Those grads are sums over all tokens of [B, 1, C] broadcasts (shift, scale, gate), so the variants that change
batch size and Inductor's reduction codegen come first.

Each variant runs twice: output gradients ~N(0, 1) and at the scale the step's MSE loss gives
(2 (out - target) / numel, ~1e-7): bf16 underflow or an eps in a compiled backward shows only at the second.
``--model`` adds the whole 1B model, one step compiled vs eager, with non-finite / worst grads per block.

  python benchmarks/compile_parity.py --out DIR [--variants default,no-rope] [--model]

Writes DIR/compile_parity.json (and prints one line per variant); each variant is guarded, so one crash does not
hide the others.
"""

import argparse
import copy
import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from opensora.models.mmdit.layers import (  # noqa: E402
    DoubleStreamBlock,
    Modulation,
    SingleStreamBlock,
    gated_residual,
    modulate,
)
from opensora.models.mmdit.model import compile_block_options  # noqa: E402
from opensora.models.mmdit.rope import rope_cos_sin, video_position_ids  # noqa: E402

HIDDEN, HEADS, GRID, N_TXT = 1536, 12, (11, 24, 32), 512
VARIANTS = (
    "default", "mix-order", "batch2", "no-split-reductions", "no-persistent-reductions", "fullgraph", "autotune", "no-qknorm",
    "no-rope", "flash",
)  # fmt: skip
INDUCTOR_OPTIONS = {  # Inductor settings that change how the sums over tokens (the [B, 1, C] grads) are generated
    # what torch 2.10-2.11 did by default: the mix-order reduction that leaves the modulation grads unwritten
    "mix-order": {"triton.mix_order_reduction": True},
    "no-split-reductions": {"split_reductions": False},
    "no-persistent-reductions": {"triton.persistent_reductions": False},
}
GRAD_SCALES = {"unit": 1.0, "mse": None}  # None: the scale of d(mse)/d(out), 2 / numel


def rel_err(a, b):
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


class ModulationOnly(torch.nn.Module):
    """A block without its linears and attention: adaLN modulation and the gated residual only, so a compile
    takes seconds and the only sums over tokens left in the backward are the shift / scale / gate grads."""

    def __init__(self):
        super().__init__()
        self.mod = Modulation(HIDDEN, 1)

    def forward(self, x, vec, rope, mask):
        shift, scale, gate = self.mod(vec)
        return gated_residual(x, gate, modulate(x, shift, scale))


def make_block(kind, variant, device):
    torch.manual_seed(0)
    if kind == "micro":
        block = ModulationOnly()
    else:
        cls = DoubleStreamBlock if kind == "double" else SingleStreamBlock
        block = cls(HIDDEN, HEADS, 4.0, attn_backend="flash" if variant == "flash" else "auto")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    if variant == "no-qknorm":
        for m in block.modules():
            if hasattr(m, "norm") and not isinstance(m, torch.nn.LayerNorm):
                m.norm = None
    return block.to(device, torch.bfloat16).train()


def make_inputs(kind, variant, device):
    gen = torch.Generator().manual_seed(1)
    n_img = GRID[0] * GRID[1] * GRID[2]
    ids = torch.cat([torch.zeros(N_TXT, 3, dtype=torch.long), video_position_ids(*GRID)])
    cos, sin = rope_cos_sin(ids, (16, 56, 56), 10000.0)
    if variant == "no-rope":
        cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
    rope = (cos.to(device), sin.to(device))
    b = 2 if variant == "batch2" else 1
    shapes = [(b, n_img, HIDDEN), (b, N_TXT, HIDDEN)] if kind == "double" else [(b, n_img + N_TXT, HIDDEN)]
    streams = [torch.randn(s, generator=gen).to(device, torch.bfloat16) for s in shapes]
    vec = torch.randn(b, HIDDEN, generator=gen).to(device, torch.bfloat16)
    return streams, vec, rope


def run_once(block, streams, vec, rope, grad_scale, seed=7):
    xs = [t.detach().clone().requires_grad_(True) for t in streams]
    outs = block(*xs, vec, rope, None)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator(device=outs[0].device).manual_seed(seed)
    grads = []
    for o in outs:
        scale = 2.0 / o.numel() if grad_scale is None else grad_scale
        grads.append((torch.randn(o.shape, device=o.device, generator=gen) * scale).to(o.dtype))
    torch.autograd.backward(outs, grads)
    tensors = {f"out{i}": o.detach() for i, o in enumerate(outs)}
    tensors.update({f"d_input{i}": x.grad for i, x in enumerate(xs)})
    tensors.update({f"d_{n}": p.grad for n, p in block.named_parameters()})
    block.zero_grad(set_to_none=True)
    return tensors


def compare(eager, compiled, tol=5e-2):
    """Per-tensor finiteness and relative error; the first tensor (in output -> grad order) that is bad."""
    rows, first_bad = {}, None
    for name, ref in eager.items():
        got = compiled[name]
        finite = bool(torch.isfinite(got).all())
        err = rel_err(got, ref)
        rows[name] = dict(finite=finite, eager_finite=bool(torch.isfinite(ref).all()), rel_err=err)
        if first_bad is None and (not finite or err > tol):
            first_bad = name
    return rows, first_bad


def run_variant(kind, variant, device):
    torch._dynamo.reset()
    block = make_block(kind, variant, device)
    streams, vec, rope = make_inputs(kind, variant, device)
    compiled = copy.deepcopy(block)
    options = dict(fullgraph=variant == "fullgraph")
    if variant == "autotune":
        options["mode"] = "max-autotune-no-cudagraphs"
    # MMDiT.set_compile_blocks' options (mix-order reductions off), then the variant's own
    options["options"] = compile_block_options(INDUCTOR_OPTIONS.get(variant))
    compiled.compile(**options)
    result = dict(kind=kind, variant=variant)
    for label, scale in GRAD_SCALES.items():
        ref = run_once(block, streams, vec, rope, scale)
        t0 = time.perf_counter()
        got = run_once(compiled, streams, vec, rope, scale)
        if device.type == "cuda":
            torch.cuda.synchronize()
        rows, first_bad = compare(ref, got)
        worst = sorted(rows.items(), key=lambda kv: -kv[1]["rel_err"])[:5]
        result[label] = dict(
            first_bad=first_bad,
            nonfinite=[n for n, r in rows.items() if not r["finite"]],
            eager_nonfinite=[n for n, r in rows.items() if not r["eager_finite"]],
            worst=[(n, r["rel_err"]) for n, r in worst],
            first_call_s=round(time.perf_counter() - t0, 1),
            tensors=rows,
        )
    return result


def run_model(device):
    """The whole 1B model as train_step.py builds it: one step eager, one compiled, grads compared per block."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import train_step

    torch._dynamo.reset()
    spec = dict(model="ours", backend="auto", compile=False)
    model, forward, target = train_step.build_ours(train_step.FULL, spec, "none", device, torch.bfloat16)
    results = {}
    for name in ("eager", "compiled"):
        model.set_compile_blocks(name == "compiled")
        loss = torch.nn.functional.mse_loss(forward().float(), target.float())
        loss.backward()
        results[name] = (loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    (loss_e, grads_e), (loss_c, grads_c) = results["eager"], results["compiled"]
    per_block = {}
    for n, g in grads_c.items():
        block = ".".join(n.split(".")[:2]) if "blocks" in n else n.split(".")[0]
        entry = per_block.setdefault(block, dict(nonfinite=[], worst_rel_err=0.0))
        if not torch.isfinite(g).all():
            entry["nonfinite"].append(n)
        entry["worst_rel_err"] = max(entry["worst_rel_err"], rel_err(g, grads_e[n]))
    return dict(loss_eager=loss_e, loss_compiled=loss_c, per_block=per_block)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for compile_parity.json")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--blocks", default="micro,single,double", help="micro: modulation + gated residual only")
    parser.add_argument("--model", action="store_true", help="also the whole 1B model, one step")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(torch=torch.__version__, device=torch.cuda.get_device_name(), runs=[])
    for kind in args.blocks.split(","):
        for variant in args.variants.split(","):
            try:
                r = run_variant(kind, variant, device)
                line = " | ".join(
                    f"{g}: first_bad={r[g]['first_bad']} nonfinite={len(r[g]['nonfinite'])} "
                    f"worst={r[g]['worst'][0][0]}:{r[g]['worst'][0][1]:.3g}"
                    for g in GRAD_SCALES
                )
            except Exception as exc:  # one variant's crash must not hide the others
                r = dict(kind=kind, variant=variant, error=f"{type(exc).__name__}: {exc}", tb=traceback.format_exc())
                line = "ERROR " + r["error"][:200]
            print(f"{kind:6s} {variant:10s} {line}", flush=True)
            report["runs"].append(r)
            (out / "compile_parity.json").write_text(json.dumps(report, indent=1))
    if args.model:
        try:
            report["model"] = run_model(device)
            bad = {b: e for b, e in report["model"]["per_block"].items() if e["nonfinite"]}
            print(f"model: loss eager {report['model']['loss_eager']:.5f} compiled "
                  f"{report['model']['loss_compiled']:.5f}; blocks with non-finite grads: {sorted(bad)}")  # fmt: skip
        except Exception as exc:
            report["model"] = dict(error=f"{type(exc).__name__}: {exc}", tb=traceback.format_exc())
            print("model ERROR", report["model"]["error"][:300])
        (out / "compile_parity.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'compile_parity.json'}")


if __name__ == "__main__":
    main()
