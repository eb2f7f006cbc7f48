"""Where a tiny MMDiT's attention backends part from math, on the GPU: the case grid behind
``tests/test_mmdit.py::test_model_backends_match_math_on_gpu`` (which failed for "auto" and "cudnn" on an H200 on
2026-11-28 while flash and efficient passed, with no traceback kept).

For each attention backend, padded-text path, checkpointing and text padding, the bf16 output and ``img_in``'s
weight gradient are compared with the fp32 math computation (max abs error over the reference's max abs value; the
bf16 math backend's own error is the yardstick), with NaN / inf flags. Two video lengths: 192 tokens (212 with
the text, the test's) and 256 (276).

    python -m benchmarks.model_backend_parity --out F.json     # GPU
    python -m benchmarks.model_backend_parity --tiny           # CPU smoke: the CPU kernels, one case of each
"""

import argparse
import itertools
import json
from pathlib import Path

import torch

from benchmarks.common import OUT, randomize_

TEXT_DIM, POOLED_DIM = 24, 16


def tiny_model(padded_text_attention: str, grad_ckpt: int, device):
    from opensora.models.mmdit import MMDiT, mmdit_config

    kwargs = mmdit_config("tiny", hidden_size=256, num_heads=2, axes_dims=(32, 48, 48))
    kwargs.pop("type")
    kwargs.update(text_dim=TEXT_DIM, pooled_dim=POOLED_DIM, grad_ckpt_double=grad_ckpt)
    model = MMDiT(**kwargs, padded_text_attention=padded_text_attention)
    randomize_(model, std=0.3)  # on the CPU, seed 0: the same weights as the test's perturb()
    return model.to(device).train()


def batch(frames: int, padded: bool, device):
    gen = torch.Generator().manual_seed(0)
    data = dict(
        x=torch.randn(2, 12, frames, 16, 16, generator=gen),
        timestep=torch.rand(2, generator=gen),
        text_emb=torch.randn(2, 20, TEXT_DIM, generator=gen),
        text_mask=torch.ones(2, 20, dtype=torch.bool),
        pooled=torch.randn(2, POOLED_DIM, generator=gen),
        cond=torch.randn(2, 13, frames, 16, 16, generator=gen),
    )
    if padded:
        data["text_mask"][1, 11:] = False
    return {k: v.to(device) for k, v in data.items()}


def run_case(model, data, backend, dtype):
    model.set_attn_backend(backend)
    model.zero_grad()
    with torch.autocast(data["x"].device.type, dtype=dtype, enabled=dtype != torch.float32):
        out = model(**data)
    out.float().square().mean().backward()
    return out.detach().float(), model.img_in.weight.grad.detach().float().clone()


def relative(got, want) -> float:
    return float((got - want).abs().max() / want.abs().max())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(OUT / "model_backend_parity.json"))
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    backends = ["auto"] if device.type == "cpu" else ["auto", "cudnn", "flash", "efficient", "math"]
    paths = ["zero-keys"] if args.tiny else ["zero-keys", "dense", "rows"]
    grid = list(itertools.product([3] if args.tiny else [3, 4], paths, [0] if args.tiny else [0, 1], [False, True]))
    rows = []
    for frames, path, ckpt, padded in grid:
        model, data = tiny_model(path, ckpt, device), batch(frames, padded, device)
        reference = run_case(model, data, "math", torch.float32)
        for backend in backends:
            if backend == "flash" and padded and path == "dense":
                continue  # flash takes no mask
            try:
                got = run_case(model, data, backend, torch.bfloat16)
            except Exception as error:  # noqa: BLE001 - a kernel that refuses the case is a finding
                rows.append(
                    dict(frames=frames, path=path, ckpt=ckpt, padded=padded, backend=backend, error=str(error)[:300])
                )
                continue
            row = dict(frames=frames, tokens=20 + frames * 64, path=path, ckpt=ckpt, padded=padded, backend=backend)
            for name, have, want in zip(("out", "grad"), got, reference):
                row[name] = relative(have, want)
                row[f"{name}_finite"] = bool(torch.isfinite(have).all())
            rows.append(row)
            print(
                f"tokens {row['tokens']} {path:9s} ckpt {ckpt} padded {int(padded)} {backend:9s} "
                f"out {row['out']:.3g} grad {row['grad']:.3g}"
                + ("" if row["out_finite"] and row["grad_finite"] else "  NON-FINITE"),
                flush=True,
            )
    result = dict(
        device=str(torch.cuda.get_device_name() if device.type == "cuda" else "cpu"), torch=torch.__version__, rows=rows
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
