"""Group norm for batch-1 video decoders, split in two passes that each use the whole GPU:

1. ``group_moments``: per (sample, group) mean and variance. Each row (C/G x T x H x W elements, millions at 480x832)
   is cut into blocks of ``MOMENT_BLOCK`` elements, one GPU program per block computes the block's mean and centred
   sum of squares, and the partials are merged with Chan's parallel rule (fp32, no E[x^2] - mean^2 cancellation).
   PyTorch's kernel reduces a row in one thread block, so 32 groups at batch 1 leave all but 32 SMs idle.
2. ``normalize_into``: ``y = x * scale[c] + shift[c]`` with the per-channel affine folded from the statistics, the
   SiLU that follows every decoder norm fused in, written straight into any strided destination (the interior of a
   causal conv's padded input buffer: the padding copy of ``F.pad`` disappears).

The statistics and the normalisation are separate so a caller can merge statistics across chunks (running rule of
``streaming_decode``) before normalising. Triton on CUDA; the same math in PyTorch elsewhere (the CPU path of tests).
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

try:  # the GPU image has Triton; CPU-only installs may not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

MOMENT_BLOCK = 8192  # elements per statistics program: ~2.4k programs per 32-group row at 480x832 x 12 frames
NORM_TILE = 4096  # elements per normalisation program (rows x padded width)
MAX_WIDTH = 8192  # a row wider than this normalises in PyTorch (one program holds a whole row)


def triton_ready(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


if triton is not None:

    @triton.jit
    def _block_moments_kernel(x_ptr, mean_ptr, m2_ptr, row_len, num_blocks, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        block = tl.program_id(1)
        offsets = block * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < row_len
        x = tl.load(x_ptr + row.to(tl.int64) * row_len + offsets, mask=inside, other=0.0).to(tl.float32)
        count = tl.minimum(row_len - block * BLOCK, BLOCK).to(tl.float32)
        mean = tl.sum(x, axis=0) / count
        centred = tl.where(inside, x - mean, 0.0)
        slot = row * num_blocks + block
        tl.store(mean_ptr + slot, mean)
        tl.store(m2_ptr + slot, tl.sum(centred * centred, axis=0))

    @triton.jit
    def _normalize_kernel(
        x_ptr,
        out_ptr,
        scale_ptr,
        shift_ptr,
        num_rows,
        channels,
        frames,
        height,
        width,
        out_sb,
        out_sc,
        out_st,
        out_sh,
        SILU: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_W)
        row_ok = rows < num_rows
        mask = row_ok[:, None] & (cols < width)[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * width + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h = rows64 % height
        t = (rows64 // height) % frames
        bc = rows64 // (height * frames)
        scale = tl.load(scale_ptr + bc, mask=row_ok, other=0.0)
        shift = tl.load(shift_ptr + bc, mask=row_ok, other=0.0)
        y = x * scale[:, None] + shift[:, None]
        if SILU:
            y = y * tl.sigmoid(y)
        base = (bc // channels) * out_sb + (bc % channels) * out_sc + t * out_st + h * out_sh
        tl.store(out_ptr + base[:, None] + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def merge_moments(counts: torch.Tensor, means: torch.Tensor, m2s: torch.Tensor, dim: int = -1):
    """Chan's rule: (count, mean, centred sum of squares) of the union of parts given along ``dim``."""
    total = counts.sum(dim)
    mean = (counts * means).sum(dim) / total
    m2 = m2s.sum(dim) + (counts * (means - mean.unsqueeze(dim)).square()).sum(dim)
    return total, mean, m2


def group_moments(x: torch.Tensor, num_groups: int) -> Tuple[int, torch.Tensor, torch.Tensor]:
    """(elements per row, mean [N, G], biased variance [N, G]) of x [N, C, ...] per (sample, group), in fp32."""
    n, c = x.shape[:2]
    rows = x.reshape(n * num_groups, -1)
    row_len = rows.shape[1]
    if not triton_ready(x):
        var, mean = torch.var_mean(rows.float(), dim=1, correction=0)
        return row_len, mean.view(n, num_groups), var.view(n, num_groups)
    rows = rows.contiguous()
    num_blocks = triton.cdiv(row_len, MOMENT_BLOCK)
    means = torch.empty(rows.shape[0], num_blocks, device=x.device, dtype=torch.float32)
    m2s = torch.empty_like(means)
    _block_moments_kernel[(rows.shape[0], num_blocks)](rows, means, m2s, row_len, num_blocks, BLOCK=MOMENT_BLOCK)
    starts = torch.arange(num_blocks, device=x.device, dtype=torch.float32) * MOMENT_BLOCK
    counts = (row_len - starts).clamp(max=MOMENT_BLOCK)
    _, mean, m2 = merge_moments(counts, means, m2s)
    return row_len, mean.view(n, num_groups), (m2 / row_len).view(n, num_groups)


def norm_affine(mean, var, num_channels: int, weight, bias, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-(sample, channel) fp32 (scale, shift) with ``norm(x) * weight + bias == x * scale + shift``."""
    n, groups = mean.shape
    rstd = torch.rsqrt(var.float() + eps)
    per_group = num_channels // groups
    scale = rstd.view(n, groups, 1).expand(n, groups, per_group)
    if weight is not None:
        scale = scale * weight.float().view(1, groups, per_group)
    shift = -mean.float().view(n, groups, 1) * scale
    if bias is not None:
        shift = shift + bias.float().view(1, groups, per_group)
    return scale.reshape(n, num_channels).contiguous(), shift.reshape(n, num_channels).contiguous()


def normalize_into(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, out: torch.Tensor, silu: bool) -> None:
    """``out[...] = act(x * scale + shift)`` for x [N, C, T, H, W] (contiguous) and ``out`` of x's shape with a unit
    last stride (any view, e.g. the interior of a padded buffer); scale/shift [N, C] fp32. One rounding to
    ``out``'s dtype."""
    if x.dim() != 5 or out.shape != x.shape:
        raise ValueError(f"normalize_into expects x [N, C, T, H, W] and out of its shape, got {x.shape}, {out.shape}")
    if not triton_ready(x) or out.stride(-1) != 1 or x.shape[-1] > MAX_WIDTH:
        y = torch.addcmul(shift[:, :, None, None, None], x.float(), scale[:, :, None, None, None])
        out.copy_(F.silu(y) if silu else y)
        return
    n, c, t, h, w = x.shape
    x = x.contiguous()
    block_w = triton.next_power_of_2(w)
    rows_per_program = max(1, NORM_TILE // block_w)
    num_rows = n * c * t * h
    grid = (triton.cdiv(num_rows, rows_per_program),)
    _normalize_kernel[grid](
        x, out, scale, shift, num_rows, c, t, h, w, *out.stride()[:4],
        SILU=silu, ROWS=rows_per_program, BLOCK_W=block_w, num_warps=4,
    )  # fmt: skip


def fused_group_norm(
    x: torch.Tensor,
    num_groups: int,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    silu: bool = False,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``act(F.group_norm(x, num_groups, weight, bias, eps))`` (act: SiLU or identity), written into ``out`` (default:
    a fresh tensor like x). Statistics in fp32; one rounding of the output."""
    _, mean, var = group_moments(x, num_groups)
    scale, shift = norm_affine(mean, var, x.shape[1], weight, bias, eps)
    if out is not None:
        normalize_into(x, scale, shift, out, silu)
        return out
    shape = x.shape
    if x.dim() != 5:  # [N, C, *spatial] -> [N, C, 1, rows, last dim] for the 5-D kernel
        x = x.reshape(shape[0], shape[1], 1, -1, shape[-1] if x.dim() > 2 else 1)
    result = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    normalize_into(x.contiguous(), scale, shift, result, silu)
    return result.view(shape)
