"""FlashAttention 4 (the ``flash-attn-4`` package, CuTe DSL kernels) as a kernel of the zero-key path.

The zero-key path (zero_key_attention.py) needs a kernel whose forward returns the log-sum-exp and whose backward
takes an output and a log-sum-exp given back to it: FA4's ``_flash_attn_fwd(return_lse=True)`` and
``_flash_attn_bwd`` do both (the same pair its own autograd function calls). FA4 works in [B, N, heads, D] and
returns the log-sum-exp as [B, heads, N] in natural log; these wrappers take and return the zero-key path's
[B, heads, N, D], as transposed views (FA4 accepts any layout whose last dimension is contiguous and aligned).

FA4 is optional: it is not in requirements.txt (its CUDA 13 wheels and the CuTe DSL's compiler are large, and only
Hopper / Blackwell GPUs run it). ``available()`` imports it once and keeps the reason when it cannot; the
attention backend "fa4" then falls back to SDPA's order with one warning. benchmarks/fa4_wheels.sh installs it on
a machine without network access.
"""

import warnings
from typing import Optional, Tuple

import torch

from .device_capability import device_major

_STATE = {}  # "module" -> flash_attn.cute.interface, or "reason" -> why it is unusable


def interface():
    """``flash_attn.cute.interface`` or ``None`` (then ``unavailable_reason()`` says why); imported once."""
    if "module" not in _STATE and "reason" not in _STATE:
        try:
            from flash_attn.cute import interface as module

            _STATE["module"] = module
        except Exception as error:  # noqa: BLE001 - any import failure (missing package, CUDA / DSL mismatch)
            _STATE["reason"] = f"{type(error).__name__}: {error}"
    return _STATE.get("module")


def unavailable_reason() -> Optional[str]:
    interface()
    return _STATE.get("reason")


def available() -> bool:
    return interface() is not None


def warn_fallback(fallback: str) -> None:
    """Once per process: the "fa4" backend was asked for and cannot run, so ``fallback`` runs instead."""
    if not _STATE.get("warned"):
        _STATE["warned"] = True
        warnings.warn(f"attention backend 'fa4' unavailable ({unavailable_reason()}); using {fallback}")


def supports(q: torch.Tensor) -> bool:
    """FA4 can take ``q`` [B, heads, N, head_dim]: CUDA, 16-bit, sm90 or newer, head size a multiple of 8 up to
    256 (its Hopper range), and the package imports."""
    return (
        q.device.type == "cuda"
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
        and device_major(q.device) >= 9
        and available()
    )


def _tokens_first(*tensors):
    """[B, heads, N, D] -> FA4's [B, N, heads, D], as views."""
    return [t.transpose(1, 2) for t in tensors]


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[B, heads, N, D] q / k / v -> (output [B, heads, N, D], log-sum-exp [B, heads, N] fp32), unmasked."""
    out, lse = interface()._flash_attn_fwd(*_tokens_first(q, k, v), return_lse=True)[:2]
    return out.transpose(1, 2), lse


def backward(grad, q, k, v, out, lse) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA4's backward from a given output and log-sum-exp [B, heads, N]; every tensor [B, heads, N, D]."""
    q, k, v, out, grad = _tokens_first(q, k, v, out, grad)
    return tuple(g.transpose(1, 2) for g in interface()._flash_attn_bwd(q, k, v, out, grad, lse)[:3])
