"""Scaled dot-product attention with the kernel chosen on purpose.

PyTorch's SDPA picks a kernel by itself, and on Hopper the fastest one (cuDNN, about 2x flash at our shapes)
is not always the one it picks; it has also crashed in other projects' layouts. So every call names the
backends it may use. ``"auto"`` resolves once per device: cuDNN first on sm90+ without a mask, flash next,
then mem-efficient, then math; with a mask flash is left out (it takes none). On CPU ``"auto"`` lets PyTorch
choose. The GPU test in tests/test_mmdit.py checks every backend against math for the layouts we use.
"""

from contextlib import nullcontext
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
ATTENTION_BACKENDS = ("auto",) + tuple(BACKENDS)


def check_backend(backend: str) -> str:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend '{backend}'; choose one of {ATTENTION_BACKENDS}")
    return backend


_CAPABILITY = {}  # device index -> compute capability major; a dict hit is free inside torch.compile regions


def device_major(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)[0]
    return _CAPABILITY[index]


def auto_backends(device: torch.device, has_mask: bool) -> Optional[list]:
    """Backends, best first, that ``"auto"`` allows on ``device``; ``None`` means PyTorch's own choice."""
    if device.type != "cuda":
        return None
    major = device_major(device)
    order = []
    if major >= 9:
        order.append(SDPBackend.CUDNN_ATTENTION)
    if not has_mask:
        order.append(SDPBackend.FLASH_ATTENTION)
    order += [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return order


def backend_context(backend: str, device: torch.device, has_mask: bool):
    check_backend(backend)
    if backend == "auto":
        order = auto_backends(device, has_mask)
        if order is None:
            return nullcontext()
        # set_priority makes the list order binding, not just the allowed set.
        return sdpa_kernel(order, set_priority=True)
    return sdpa_kernel([BACKENDS[backend]])


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    Consumers such as ``cat((attn_out, mlp_out), -1)`` (single-stream blocks) hand SDPA's backward a strided
    grad_out. Measured on H100/torch 2.11: when cuDNN attention runs in two such layouts (double blocks dense,
    single blocks strided) in one graph, its backward returns NaN grads or hits an illegal memory access (the
    same crash seen in diffusers' Flux); a dense grad_out in every layer fixes it. tests/test_mmdit.py covers it.
    """

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention over ``q, k, v`` of shape [B, heads, N, head_dim]; returns [B, N, heads * head_dim].

    ``mask`` is boolean (True = may attend), broadcastable to [B, heads, Nq, Nk], or ``None`` for full
    attention (what lets flash/cuDNN run).
    """
    if q.dim() != 4:
        raise ValueError(f"attention expects q/k/v as [B, heads, N, head_dim], got q of shape {tuple(q.shape)}")
    return _dense_sdpa(q, k, v, mask, backend)


@torch.compiler.disable
def _dense_sdpa(q, k, v, mask, backend):
    """SDPA on dense [B, heads, N, head_dim] inputs with a dense grad_out, always run eagerly.

    Inside compiled blocks Inductor chooses the strides of intermediates itself and may hand SDPA (and its
    backward) other layouts than eager does; measured on H100/torch 2.11 the 1B MMDiT then trained to NaN with
    cuDNN attention while eager was fine. Keeping the attention call out of the graph pins the layouts we
    test (tests/test_mmdit.py, tests/test_mmdit_gpu.py); everything around it still fuses.
    """
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    with backend_context(backend, q.device, mask is not None):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    batch, heads, tokens, head_dim = out.shape
    out = out.transpose(1, 2).reshape(batch, tokens, heads * head_dim)
    return _DenseGrad.apply(out) if out.requires_grad else out
