"""FlashAttention 4 (the ``flash-attn-4`` package: CuTe DSL kernels, ``flash_attn.cute``) against the SDPA kernels our
blocks run, at the 1B real configuration's attention: batch 4, 12 heads of 128, 2304 video tokens + the text bound.

Rows, each forward + backward of one attention call (what a block costs, before the 24 blocks and the recompute):
* ``sdpa-cudnn``: cuDNN SDPA, no mask, [B, heads, N, D] (the unpadded / zero-key kernel of ``attention.py``);
* ``sdpa-flash``: PyTorch's flash SDPA (FlashAttention 2), the same;
* ``fa4``: ``flash_attn_func``, [B, N, heads, D], no mask;
* ``fa4-varlen``: ``flash_attn_varlen_func`` over the packed valid tokens of rows whose text lengths differ (20-120
  of the bound): the padding never reaches the kernel, so it does less work than the dense rows;
* ``sdpa-cudnn-masked``: cuDNN with the boolean key mask of those rows (what the zero-key path replaced).

Numerics: at a smaller shape each kernel's output and q / k / v gradients against fp64 math attention (max abs error
over max abs value), and ``fa4-varlen`` row by row against each row's valid tokens alone. FA4 rows are skipped
with the reason when the package is missing or fails (``reason`` in the row).

    python -m benchmarks.flash_attention4 --out F.json            # on a GPU, with flash-attn-4 importable
    python -m benchmarks.flash_attention4 --tiny --out F.json     # CPU smoke: math SDPA only

The wheels: ``bash benchmarks/fa4_wheels.sh`` (here) splits them into two carry folders, and ``bash
benchmarks/fa4_wheels.sh install DIR`` (on the GPU machine) puts them together again (its header says how).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.common import OUT, cuda_times_ms

HEADS, HEAD_DIM, VIDEO, TEXT_BOUND, BATCH = 12, 128, 2304, 128, 4
TEXT_VALID = (20, 120)


def text_lengths(batch: int, low: int, high: int, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (batch,), generator=gen).tolist()


def key_mask(lengths: list, bound: int, video: int, device) -> torch.Tensor:
    """[B, N] True where a key may be attended: each row's valid text (first) and all its video tokens."""
    positions = torch.arange(bound + video, device=device)
    valid = torch.tensor(lengths, device=device)[:, None]
    return (positions[None] < valid) | (positions[None] >= bound)


def attention_flops(batch: int, heads: int, lengths_q: list, lengths_k: list, head_dim: int) -> float:
    """Forward + backward matmul FLOPs: 4 N_q N_k D per head forward, 2.5x that backward."""
    per_row = [4.0 * nq * nk * head_dim for nq, nk in zip(lengths_q, lengths_k)]
    return 3.5 * heads * sum(per_row) * (batch // len(per_row))


def fa4_module():
    """``flash_attn.cute`` or the reason it is unusable here."""
    try:
        import flash_attn.cute as fa4

        return fa4, None
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason to skip, reported as such
        return None, f"{type(exc).__name__}: {exc}"


# ---- the calls (each returns the output in [B, N, heads, D] or [total, heads, D]) --------------------------------
def sdpa(q, k, v, backend, mask=None):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kinds = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
    attn_mask = None if mask is None else mask[:, None, None, :]
    with sdpa_kernel([kinds[backend]]):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask)
    return out.transpose(1, 2)


def fa4_dense(fa4, q, k, v):
    out = fa4.flash_attn_func(q, k, v)
    return out[0] if isinstance(out, tuple) else out


def pack(x, mask):
    """[B, N, H, D] -> ([total, H, D] of the tokens where ``mask``, cu_seqlens int32, max length)."""
    counts = mask.sum(1)
    cu = torch.zeros(len(counts) + 1, dtype=torch.int32, device=x.device)
    cu[1:] = counts.cumsum(0)
    return x[mask], cu, int(counts.max())


def fa4_varlen(fa4, q, k, v, cu, max_len):
    out = fa4.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len
    )
    return out[0] if isinstance(out, tuple) else out


# ---- numerics ----------------------------------------------------------------------------------------------------
def relative_errors(call, q, k, v, reference) -> dict:
    """Max abs error over max abs reference value, for the output and each gradient (one random upstream grad)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = call(*leaves)
    grad = torch.randn_like(out)
    (out.float() * grad.float()).sum().backward()
    got = [out.detach().float()] + [t.grad.float() for t in leaves]
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref_out = reference(*ref_leaves)
    (ref_out * grad.double()).sum().backward()
    want = [ref_out.detach()] + [t.grad for t in ref_leaves]
    names = ("out", "dq", "dk", "dv")
    return {
        n: float((g.double() - w).abs().max() / w.abs().max().clamp_min(1e-30)) for n, g, w in zip(names, got, want)
    }


def math_reference(mask=None):
    def reference(q, k, v):
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)

    return reference


# ---- the run -----------------------------------------------------------------------------------------------------
def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batch, heads, head_dim, video, bound = (
        (2, 2, 16, 24, 8) if args.tiny else (args.batch, HEADS, HEAD_DIM, args.video, args.text_bound)
    )
    low, high = (2, 8) if args.tiny else TEXT_VALID
    lengths = text_lengths(batch, low, high, seed=args.seed)
    fa4, missing = fa4_module()
    gen = torch.Generator(device=device).manual_seed(args.seed)

    def inputs(n_batch, n_tokens):
        shape = (n_batch, n_tokens, heads, head_dim)
        return [torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(3)]

    q, k, v = inputs(batch, bound + video)
    mask = key_mask(lengths, bound, video, device)
    valid_tokens = [n + video for n in lengths]
    dense_flops = attention_flops(batch, heads, [bound + video] * batch, [bound + video] * batch, head_dim)
    varlen_flops = attention_flops(batch, heads, valid_tokens, valid_tokens, head_dim)
    dense_name, dense_kernel = ("sdpa-cudnn", "cudnn") if device.type == "cuda" else ("sdpa-math", "math")

    def dense_call(a, b, c):
        return sdpa(a, b, c, dense_kernel)

    calls = {dense_name: (dense_call, dense_flops)}
    if device.type == "cuda":
        calls["sdpa-flash"] = (lambda a, b, c: sdpa(a, b, c, "flash"), dense_flops)
        calls["sdpa-cudnn-masked"] = (lambda a, b, c: sdpa(a, b, c, "cudnn", mask), dense_flops)
    rows = []
    if fa4 is not None:
        calls["fa4"] = (lambda a, b, c: fa4_dense(fa4, a, b, c), dense_flops)
        calls["fa4-varlen"] = (None, varlen_flops)  # packed below
    else:
        rows += [dict(variant=name, skipped=True, reason=missing) for name in ("fa4", "fa4-varlen")]

    for name, (call, flops) in calls.items():
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        if name == "fa4-varlen":
            packed = [pack(t, mask) for t in (q, k, v)]
            cu, max_len = packed[0][1], packed[0][2]
            packed_leaves = [p[0].detach().clone().requires_grad_(True) for p in packed]

            def step(packed_leaves=packed_leaves, cu=cu, max_len=max_len):
                out = fa4_varlen(fa4, *packed_leaves, cu, max_len)
                out.backward(torch.ones_like(out))
        else:

            def step(call=call, leaves=leaves):
                out = call(*leaves)
                out.backward(torch.ones_like(out))

        row = dict(variant=name, tflop=flops / 1e12)
        try:
            if device.type == "cuda":
                started = time.monotonic()
                step()
                torch.cuda.synchronize()
                row["first_call_s"] = round(time.monotonic() - started, 2)  # FA4 compiles its kernels here
                times = cuda_times_ms(step, args.warmup, args.iters)
                row.update(ms=statistics.median(times), p10_ms=sorted(times)[len(times) // 10], times_ms=times)
                row["tflop_per_s"] = flops / (row["ms"] / 1e3) / 1e12
            else:
                step()
                row["ran"] = True
        except Exception as exc:  # noqa: BLE001 - a kernel that fails at our shape is a finding, not a crash
            row.update(skipped=True, reason=f"{type(exc).__name__}: {exc}"[:500])
        rows.append(row)

    # numerics at a smaller shape (the fp64 reference materialises the scores)
    small = dict(batch=2, tokens=min(bound + video, 384))
    sq, sk, sv = inputs(small["batch"], small["tokens"])
    s_bound = min(bound, 64)
    s_lengths = text_lengths(small["batch"], 1, s_bound, seed=args.seed + 1)
    s_mask = key_mask(s_lengths, s_bound, small["tokens"] - s_bound, device)
    errors = {}
    checks = {dense_name: (dense_call, None)}
    if device.type == "cuda":
        checks["sdpa-cudnn-masked"] = (lambda a, b, c: sdpa(a, b, c, "cudnn", s_mask), s_mask)
    if fa4 is not None:
        checks["fa4"] = (lambda a, b, c: fa4_dense(fa4, a, b, c), None)
    for name, (call, check_mask) in checks.items():
        try:
            errors[name] = relative_errors(call, sq, sk, sv, math_reference(check_mask))
        except Exception as exc:  # noqa: BLE001
            errors[name] = {"failed": f"{type(exc).__name__}: {exc}"[:500]}
    if fa4 is not None:
        try:  # varlen row by row: each row's valid tokens alone, dense
            packed = [pack(t, s_mask) for t in (sq, sk, sv)]
            out = fa4_varlen(fa4, packed[0][0], packed[1][0], packed[2][0], packed[0][1], packed[0][2]).float()
            worst = 0.0
            for row_index in range(small["batch"]):
                keep = s_mask[row_index]
                alone = [t[row_index : row_index + 1, keep].double() for t in (sq, sk, sv)]
                want = math_reference()(*alone)[0]
                lo, hi = int(packed[0][1][row_index]), int(packed[0][1][row_index + 1])
                worst = max(worst, float((out[lo:hi].double() - want).abs().max() / want.abs().max()))
            errors["fa4-varlen"] = {"out": worst}
        except Exception as exc:  # noqa: BLE001
            errors["fa4-varlen"] = {"failed": f"{type(exc).__name__}: {exc}"[:500]}

    environment = dict(
        torch=torch.__version__,
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        fa4=getattr(fa4, "__version__", None) if fa4 is not None else None,
        fa4_missing=missing,
    )
    shape = dict(batch=batch, heads=heads, head_dim=head_dim, video=video, text_bound=bound, text_lengths=lengths)
    return dict(environment=environment, shape=shape, rows=rows, errors=errors)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(OUT / "flash_attention4.json"))
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--video", type=int, default=VIDEO)
    parser.add_argument("--text-bound", type=int, default=TEXT_BOUND)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke shape, math SDPA only")
    args = parser.parse_args(argv)
    result = run(args)
    from pathlib import Path

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for row in result["rows"]:
        if row.get("skipped"):
            print(f"{row['variant']:<18} skipped: {row['reason']}")
        elif "ms" in row:
            print(
                f"{row['variant']:<18} {row['ms']:8.3f} ms  {row['tflop_per_s']:7.1f} TFLOP/s  first call {row['first_call_s']} s"
            )
        else:
            print(f"{row['variant']:<18} ran")
    for name, errs in result["errors"].items():
        print(
            f"{name:<18} errors vs fp64: "
            + ", ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}" for k, v in errs.items())
        )
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
