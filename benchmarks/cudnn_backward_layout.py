"""Why the zero-key path's cuDNN backward gave wrong gradients in one process and right ones in another: probes of
PyTorch's cuDNN attention backward op as ``opensora/models/mmdit/zero_key_attention.py`` calls it.

1. ``rows``: per token count, an unmasked bf16 attention; the gradients of SDPA's own cuDNN autograd against the
   backward op fed the forward's own ``(out, lse)`` (``own``), ``lse`` rebuilt contiguous (``contiguous``, what the
   zero-key path passes) or in the forward's strides (``like-forward``); and ``shifted-lse``: a shifted ``lse``
   against the fp32 formula, i.e. is a handed-in log-sum-exp used as given. (H200, torch 2.11: all right.)
2. ``tiny_model``: the tiny MMDiT's zero-key q / k / v (``model_backend_parity``'s padded case) through the zero-key
   op on cuDNN and on flash in a fresh process, against fp32 masked math. (H200: both right, while the same model's
   weight gradient was 0.63 off in ``model_backend_parity``, after unpadded cuDNN passes at the same shape.)
3. ``cache``: the suspect that explains both: PyTorch caches the backward graph by the q / k / v layout alone and
   keeps the grad_out strides of the call that built it. At a fresh shape, SDPA's own backward with grad_out as
   ``_merge_heads`` hands it (a view of a dense [B, N, heads, D]) builds the graph; then the backward op with a
   contiguous [B, heads, N, D] grad_out (the zero-key path before ``cudnn_grad_layout``) and with
   ``cudnn_grad_layout``'s, each against the fp32 formula. (Expected: the first wrong, the second right. Measured
   on an H200, torch 2.11: the reverse, 0.0023 then 1.41 - the op's call did not hit SDPA autograd's graph but built
   its own with the contiguous grad_out, and the second call, at the same q / k / v, was read with those strides.
   That is the collision itself: the output-gradient strides are not in the key, and whichever layout comes second
   is wrong. The zero-key path is safe by always handing over one layout, the one SDPA autograd gets in the model;
   tests/test_text_padding_gpu.py checks both orders in one process.)

    python -m benchmarks.cudnn_backward_layout --out F.json      # GPU, sm90+
"""

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import OUT

aten = torch.ops.aten


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def errors(got, want) -> dict:
    return {axis: rel(g, w) for axis, g, w in zip("qkv", got, want)}


def random_bf16(*shapes, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16) for shape in shapes]


def cudnn_backward(grad, q, k, v, out, lse):
    """PyTorch's cuDNN attention backward op, unmasked, no dropout (zero scalars for the unused random state)."""
    unused = torch.zeros((), dtype=torch.int64, device="cuda")
    tokens = q.shape[2]
    return aten._scaled_dot_product_cudnn_attention_backward(
        grad, q, k, v, out, lse, unused, unused, None, None, None, tokens, tokens, 0.0, False
    )


def math_backward(grad, q, k, v, out, lse=None):
    """(dq, dk, dv) in fp32 from the backward formula, with probabilities exp(scores - lse): the given log-sum-exp
    (is a handed-in one used as given?) or, where None, the scores' own (the true gradient)."""
    qf, kf, vf, gf, of = (t.float() for t in (q, k, v, grad, out))
    scale = q.shape[-1] ** -0.5
    scores = qf @ kf.transpose(-1, -2) * scale
    probs = torch.exp(scores - (scores.logsumexp(-1, keepdim=True) if lse is None else lse.float()))
    ds = probs * (gf @ vf.transpose(-1, -2) - (gf * of).sum(-1, keepdim=True))
    return ds @ kf * scale, ds.transpose(-1, -2) @ qf * scale, probs.transpose(-1, -2) @ gf


def probe(tokens: int, batch: int = 2, heads: int = 2, head_dim: int = 128) -> dict:
    q, k, v, grad = random_bf16(*[(batch, heads, tokens, head_dim)] * 4, seed=tokens)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref_out = torch.nn.functional.scaled_dot_product_attention(*leaves)
    reference = torch.autograd.grad(ref_out, leaves, grad)
    out, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)[:2]
    contiguous = lse.reshape(batch, heads, tokens).contiguous().unsqueeze(-1)
    like_forward = torch.empty_strided(lse.shape, lse.stride(), dtype=lse.dtype, device="cuda")
    like_forward.copy_(contiguous)
    row = dict(tokens=tokens, lse_shape=list(lse.shape), lse_stride=list(lse.stride()), out_error=rel(out, ref_out))
    for name, given in (("own", lse), ("contiguous", contiguous), ("like-forward", like_forward)):
        row[name] = errors(cudnn_backward(grad, q, k, v, out, given), reference)
    # a shifted log-sum-exp (as the zero-key correction hands over): is it used? fp32 math of the same formula
    shifted = (contiguous.float() + 0.25).to(lse.dtype)
    row["shifted-lse"] = errors(cudnn_backward(grad, q, k, v, out, shifted), math_backward(grad, q, k, v, out, shifted))
    return row


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(OUT / "cudnn_backward_layout.json"))
    parser.add_argument("--tokens", default="212,276,2400,2432,8512,8544")
    args = parser.parse_args(argv)
    rows = [probe(int(n)) for n in args.tokens.split(",")]
    for row in rows:
        cells = "  ".join(
            f"{name} dq {row[name]['q']:.3g} dk {row[name]['k']:.3g}"
            for name in ("own", "contiguous", "like-forward", "shifted-lse")
        )
        print(f"tokens {row['tokens']:5d} lse {row['lse_shape']} stride {row['lse_stride']}  {cells}", flush=True)
    capture = tiny_model_capture()
    collision = cache_collision()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            dict(
                device=torch.cuda.get_device_name(),
                torch=torch.__version__,
                rows=rows,
                tiny_model=capture,
                cache=collision,
            ),
            indent=1,
        )
        + "\n"
    )
    return rows


def tiny_model_capture() -> list:
    """The tiny MMDiT's first zero-key attention call (model_backend_parity's padded case): its q / k / v through the
    zero-key op on cuDNN and on flash against the fp32 masked math, with each row's padded key count."""
    from benchmarks.model_backend_parity import batch, tiny_model
    from opensora.models.mmdit import zero_key_attention as zka
    from opensora.models.mmdit.attention import attention

    captured = []
    original = zka.ZeroKeyRows.attend_heads

    def capture(self, q, k, v, kernel):
        captured.append((self, q.detach(), k.detach(), v.detach()))
        return original(self, q, k, v, kernel)

    zka.ZeroKeyRows.attend_heads = capture
    try:
        model, data = tiny_model("zero-keys", 0, "cuda"), batch(3, True, "cuda")
        model.set_attn_backend("cudnn")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(**data)
    finally:
        zka.ZeroKeyRows.attend_heads = original
    rows_out = []
    for index in (0, len(captured) - 1):
        rows, q, k, v = captured[index]
        grad = torch.randn(q.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
        leaves32 = [t.float().requires_grad_() for t in (q, k, v)]
        ref = attention(*leaves32, rows.key_mask, "math")
        ref_grads = torch.autograd.grad(ref, leaves32, grad.transpose(1, 2).flatten(-2))  # attention(): [B, N, H*D]
        ref = ref.unflatten(-1, q.shape[1::2]).transpose(1, 2)
        row = dict(call=index, shape=list(q.shape), num_padded=rows.num_padded.tolist())
        for kernel in ("cudnn", "flash"):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = rows.attend_heads(*leaves, kernel)
            grads = torch.autograd.grad(out, leaves, grad.to(out.dtype))
            row[kernel] = dict(out=rel(out, ref), **errors(grads, ref_grads))
        print(json.dumps(row), flush=True)
        rows_out.append(row)
    return rows_out


def cache_collision(tokens: int = 300, batch: int = 2, heads: int = 2, head_dim: int = 128) -> dict:
    """Probe 3 (module docstring): relative errors of the backward op's dq / dk / dv against fp32 math when SDPA's
    own backward built the cached graph first, with a contiguous grad_out and with ``cudnn_grad_layout``'s."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from opensora.models.mmdit.zero_key_attention import cudnn_grad_layout

    shape = (batch, heads, tokens, head_dim)
    q, k, v, merged_grad = random_bf16(shape, shape, shape, (batch, tokens, heads * head_dim), seed=3)
    as_merge_heads_gives = merged_grad.view(batch, tokens, heads, head_dim).transpose(1, 2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):  # builds and caches the backward graph at this layout
        torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(*leaves), leaves, as_merge_heads_gives)
    out, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)[:2]
    want = math_backward(as_merge_heads_gives, q, k, v, out)  # one gradient, two layouts of it below
    result = {}
    for name, grad in (
        ("contiguous", as_merge_heads_gives.contiguous()),
        ("cudnn_grad_layout", cudnn_grad_layout(as_merge_heads_gives.contiguous())),
    ):
        result[name] = errors(cudnn_backward(grad, q, k, v, out, lse), want)
    print(f"cache probe, tokens {tokens}: {json.dumps(result)}", flush=True)
    return result


if __name__ == "__main__":
    main()
