"""Group norm whose statistics are computed by reductions that spread each long row over many GPU blocks.

PyTorch's CUDA group norm reduces each (sample, group) row in one thread block, so a VAE decode at batch 1 with
4-32 groups runs its statistics on 4-32 SMs while each row holds millions of elements (C/G x T x H x W): about
half the decode's GPU time. ``torch.sum`` / ``torch.linalg.vector_norm`` split a long row across the whole GPU;
where Triton runs (the GPU image), ``fused_group_norm``'s block-split kernels do so for any number of groups.
"""

from typing import Optional

import torch
from torch import nn

from .fused_group_norm import fused_group_norm, triton_ready

# The parallel path pays off when PyTorch's kernel leaves nearly every SM idle and each row is long. Measured on an
# H100 (132 SMs; benchmarks/group_norm.py, bf16): 4 rows of 1.1M elements 3.3x faster, but 32 rows of 328k 0.62x and
# 64 rows of 295k 0.69x (its several small kernels then cost more than the idle SMs): so at most one row per 8 SMs
# (16 rows on an H100 / H200; untested between 4 and 32). Elsewhere (and off the GPU) nn.GroupNorm runs unchanged.
SMS_PER_ROW = 8
MIN_ROW_ELEMENTS = 65536


def parallel_group_norm(
    x: torch.Tensor,
    num_groups: int,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.group_norm(x, num_groups, weight, bias, eps)`` for x [N, C, ...], statistics in fp32.

    var = E[x^2] - mean^2 (clamped at 0): one read of x per statistic and no centred copy, at the price of
    cancellation when |mean| >> std (fp32 leaves ~1e-4 to 1e-3 relative error in var at mean/std = 50).
    """
    n, c = x.shape[:2]
    xg = x.reshape(n * num_groups, -1)
    count = xg.shape[1]
    # dtype=float32 accumulates in fp32 reading x in its own dtype: on CUDA no fp32 copy of x is made.
    mean = torch.sum(xg, dim=-1, dtype=torch.float32) / count
    sq_mean = torch.linalg.vector_norm(xg, 2, dim=-1, dtype=torch.float32).square() / count
    rstd = torch.rsqrt((sq_mean - mean.square()).clamp_min(0) + eps)
    # per-(n, c) affine: y = x * scale + shift, with scale = rstd * weight and shift = bias - mean * scale (fp32)
    per_channel = (n, num_groups, c // num_groups)
    scale = rstd.view(n, num_groups, 1).expand(per_channel)
    if weight is not None:
        scale = scale * weight.float().view(1, num_groups, -1)
    shift = -mean.view(n, num_groups, 1) * scale
    if bias is not None:
        shift = shift + bias.float().view(1, num_groups, -1)
    bcast = (n, c) + (1,) * (x.dim() - 2)
    # fp32 scale/shift with an output in x's dtype: the CUDA kernel computes in fp32 and rounds once on the store, as
    # F.group_norm does. bf16 scale/shift would round shift (~ -mean * rstd, large when |mean| >> std) to 8 bits;
    # an fp32 result cast afterwards would cost an extra fp32 write and read of the whole output.
    shift, scale = shift.reshape(bcast), scale.reshape(bcast)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return torch.addcmul(shift, x, scale).to(x.dtype)  # out= does not support autograd
    return torch.addcmul(shift, x, scale, out=torch.empty_like(x, memory_format=torch.contiguous_format))


class ParallelGroupNorm(nn.GroupNorm):
    """``nn.GroupNorm`` (same parameters and state_dict) that takes ``parallel_group_norm`` where PyTorch's kernel
    would be badly parallel: CUDA input, at most one (sample, group) row per ``SMS_PER_ROW`` SMs, long rows."""

    def uses_parallel(self, x: torch.Tensor) -> bool:
        if not x.is_cuda or x.dim() < 2 or not x.is_contiguous():
            return False
        rows = x.shape[0] * self.num_groups
        if x.numel() // max(rows, 1) < MIN_ROW_ELEMENTS:
            return False
        if self.uses_fused(x):  # block-split rows: any number of groups
            return True
        return rows * SMS_PER_ROW <= torch.cuda.get_device_properties(x.device).multi_processor_count

    @staticmethod
    def uses_fused(x: torch.Tensor) -> bool:
        """The Triton kernels of ``fused_group_norm`` (inference only: they have no backward)."""
        return triton_ready(x) and not (torch.is_grad_enabled() and x.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_parallel(x):
            if self.uses_fused(x):
                return fused_group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
            return parallel_group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        return super().forward(x)


def use_parallel_group_norm(module: nn.Module) -> int:
    """Turns every plain ``nn.GroupNorm`` in ``module`` into a ``ParallelGroupNorm`` in place (a class swap: the
    parameters, buffers and hooks stay as they are); returns how many it swapped."""
    swapped = 0
    for child in module.modules():
        if type(child) is nn.GroupNorm:
            child.__class__ = ParallelGroupNorm
            swapped += 1
    return swapped
