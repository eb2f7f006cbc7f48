"""Attention with fp32 scores as two GEMMs, for the HunyuanVideo decoder's single 512-wide head (wider than the fused
flash / cuDNN SDPA kernels take; PyTorch falls back to its memory-efficient kernel, 22.7 ms of a 221 ms chunk decode
at 480x832 on an H200).

``softmax(q k^T / sqrt(d)) v``: the scores are the fp32-accumulated products of the bf16 inputs (on CUDA one bf16
GEMM with an fp32 output, ``torch.bmm(..., out_dtype=torch.float32)``; elsewhere the fp32 product, where bf16 values
are exact), the softmax runs over fp32 rows with the scale folded in and writes the probabilities in v's dtype (one
Triton pass pair per row on CUDA), and the second GEMM is bf16 as in the fused kernels.
"""

from __future__ import annotations

import functools

import torch

try:  # the GPU image has Triton; CPU-only installs may not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

SOFTMAX_BLOCK = 2048

if triton is not None:

    @triton.jit
    def _scaled_softmax_kernel(scores_ptr, out_ptr, cols, scale, BLOCK: tl.constexpr):
        """One row per program: an online max / sum pass, then exp(s * scale - max) / sum written in out's dtype."""
        base = tl.program_id(0).to(tl.int64) * cols
        row_max = tl.zeros([], dtype=tl.float32) - float("inf")
        row_sum = tl.zeros([], dtype=tl.float32)
        for start in range(0, cols, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            s = tl.load(scores_ptr + base + offsets, mask=offsets < cols, other=-float("inf")) * scale
            new_max = tl.maximum(row_max, tl.max(s, axis=0))
            row_sum = row_sum * tl.exp(row_max - new_max) + tl.sum(tl.exp(s - new_max), axis=0)
            row_max = new_max
        for start in range(0, cols, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            inside = offsets < cols
            s = tl.load(scores_ptr + base + offsets, mask=inside, other=0.0) * scale
            p = tl.exp(s - row_max) / row_sum
            tl.store(out_ptr + base + offsets, p.to(out_ptr.dtype.element_ty), mask=inside)


@functools.lru_cache(maxsize=None)
def fp32_output_gemm(device: torch.device) -> bool:
    """Whether ``torch.bmm(bf16, bf16, out_dtype=torch.float32)`` runs on ``device`` (CUDA builds of recent PyTorch).
    Probe outside any graph capture (``FrameCausalAttentionCache`` does at construction)."""
    if device.type != "cuda":
        return False
    a = torch.ones(1, 2, 8, dtype=torch.bfloat16, device=device)
    try:
        return bool(torch.bmm(a, a.transpose(1, 2), out_dtype=torch.float32).dtype == torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def scaled_softmax(scores: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``softmax(scores * scale, dim=-1)`` of fp32 ``scores`` in ``dtype`` (fp32 math, one rounding)."""
    if triton is None or not scores.is_cuda:
        return torch.softmax(scores * scale, dim=-1).to(dtype)
    scores = scores.contiguous()
    out = torch.empty(scores.shape, dtype=dtype, device=scores.device)
    cols = scores.shape[-1]
    _scaled_softmax_kernel[(scores.numel() // cols,)](scores, out, cols, scale, BLOCK=SOFTMAX_BLOCK)
    return out


def fp32_score_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d)) v`` for q [..., Lq, d], k / v [..., Lk, d] (module docstring)."""
    lead, lq, lk, d = q.shape[:-2], q.shape[-2], k.shape[-2], q.shape[-1]
    q3, k3, v3 = q.reshape(-1, lq, d), k.reshape(-1, lk, d), v.reshape(-1, lk, v.shape[-1])
    low_precision = q.dtype in (torch.bfloat16, torch.float16)
    if low_precision and fp32_output_gemm(q.device):
        scores = torch.bmm(q3, k3.transpose(1, 2), out_dtype=torch.float32)
    else:  # bf16 values are exact in TF32: the TF32 product of their fp32 copies accumulates in fp32
        allowed = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = low_precision
        try:
            scores = torch.bmm(q3.float(), k3.float().transpose(1, 2))
        finally:
            torch.backends.cuda.matmul.allow_tf32 = allowed
    probs = scaled_softmax(scores, d**-0.5, v.dtype)
    return torch.bmm(probs, v3).view(*lead, lq, v.shape[-1])
