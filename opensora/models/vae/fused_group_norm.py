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
        block = tl.program_id(0)  # blocks on grid axis 0 (axis 1 allows 65535)
        row = tl.program_id(1)
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

    @triton.jit
    def _block_moments_cl_kernel(
        x_ptr, mean_ptr, m2_ptr, voxels, num_blocks, C: tl.constexpr, G: tl.constexpr, BLOCK_V: tl.constexpr
    ):
        """Channels-last x [N, voxels, C]: per block of voxels, every group's mean and centred sum of squares. The
        blocks run on grid axis 0 (axis 1 allows 65535: a 480x832 chunk has ~75k blocks)."""
        block = tl.program_id(0)
        n = tl.program_id(1).to(tl.int64)
        v = block * BLOCK_V + tl.arange(0, BLOCK_V)
        inside = v < voxels
        rows = (n * voxels + v).to(tl.int64)
        x = tl.load(x_ptr + rows[:, None] * C + tl.arange(0, C)[None, :], mask=inside[:, None], other=0.0)
        xg = tl.reshape(x.to(tl.float32), (BLOCK_V, G, C // G))
        count = (tl.minimum(voxels - block * BLOCK_V, BLOCK_V) * (C // G)).to(tl.float32)
        mean = tl.sum(tl.sum(xg, axis=2), axis=0) / count
        keep = tl.reshape(tl.broadcast_to(inside[:, None], (BLOCK_V, C)), (BLOCK_V, G, C // G))
        centred = tl.where(keep, xg - mean[None, :, None], 0.0)
        slot = (n * num_blocks + block) * G + tl.arange(0, G)
        tl.store(mean_ptr + slot, mean)
        tl.store(m2_ptr + slot, tl.sum(tl.sum(centred * centred, axis=2), axis=0))

    @triton.jit
    def _normalize_cl_kernel(
        x_ptr, out_ptr, scale_ptr, shift_ptr, voxels, channels, height, width,
        out_sb, out_st, out_sh, out_sw,
        SILU: tl.constexpr, BORDER: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        """Channels-last x [N, voxels, C] -> ``out`` (any view whose channel stride is 1); with ``BORDER`` the
        edge voxels are also written one step outside ``out`` in height and width (corners included): the
        replicated border of a padded conv input, without a pass of its own."""
        n = tl.program_id(1).to(tl.int64)
        v = (tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
        c = tl.arange(0, BLOCK_C)
        mask = (v < voxels)[:, None] & (c < channels)[None, :]
        x = tl.load(x_ptr + (n * voxels + v)[:, None] * channels + c[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + n * channels + c, mask=c < channels, other=0.0)
        shift = tl.load(shift_ptr + n * channels + c, mask=c < channels, other=0.0)
        y = x * scale[None, :] + shift[None, :]
        if SILU:
            y = y * tl.sigmoid(y)
        w = v % width
        h = (v // width) % height
        t = v // (width * height)
        base = n * out_sb + t * out_st + h * out_sh + w * out_sw
        y = y.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + base[:, None] + c[None, :], y, mask=mask)
        if BORDER:
            top, bottom, left, right = h == 0, h == height - 1, w == 0, w == width - 1
            for dh in tl.static_range(3):
                for dw in tl.static_range(3):
                    if dh * 3 + dw != 4:  # every neighbour but the voxel itself
                        edge = v < voxels
                        if dh == 0:
                            edge = edge & top
                        if dh == 2:
                            edge = edge & bottom
                        if dw == 0:
                            edge = edge & left
                        if dw == 2:
                            edge = edge & right
                        shifted = base + (dh - 1) * out_sh + (dw - 1) * out_sw
                        tl.store(out_ptr + shifted[:, None] + c[None, :], y, mask=mask & edge[:, None])

    @triton.jit
    def output_tile(out_voxels, channels, out_h, out_w, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr):
        """This program's tile of a channels-last output [N, T, H, W, C] (grid: voxel blocks, samples): the sample,
        the channel range, the in-bounds mask and each voxel's (t, h, w)."""
        n = tl.program_id(1).to(tl.int64)
        v = (tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
        c = tl.arange(0, BLOCK_C)
        mask = (v < out_voxels)[:, None] & (c < channels)[None, :]
        return n, c, mask, v // (out_w * out_h), (v // out_w) % out_h, v % out_w

    @triton.jit
    def _upsample_cl_kernel(
        x_ptr, out_ptr, out_voxels, channels, in_t, in_h, in_w, out_h, out_w,
        out_sb, out_st, out_sh, out_sw,
        FT: tl.constexpr, FH: tl.constexpr, FW: tl.constexpr, FIRST: tl.constexpr,
        BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        """Nearest upsampling of channels-last x [N, T, H, W, C] into ``out`` (channel stride 1); ``FIRST``: output
        frame 0 comes from input frame 0 alone (the causal first-frame rule), later ones ``FT`` to an input frame."""
        n, c, mask, to, ho, wo = output_tile(out_voxels, channels, out_h, out_w, BLOCK_V, BLOCK_C)
        if FIRST:
            ti = tl.where(to == 0, 0, 1 + (to - 1) // FT)
        else:
            ti = to // FT
        src = (((n * in_t + ti) * in_h + ho // FH) * in_w + wo // FW) * channels
        x = tl.load(x_ptr + src[:, None] + c[None, :], mask=mask, other=0.0)
        base = n * out_sb + to * out_st + ho * out_sh + wo * out_sw
        tl.store(out_ptr + base[:, None] + c[None, :], x, mask=mask)


if triton is not None:

    @triton.jit
    def _add_bias_cl_kernel(x_ptr, bias_ptr, rows, channels, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """In place: channels-last x [rows, C] += bias[C] (fp32 sum, one rounding, as PyTorch's add)."""
        r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        c = tl.arange(0, BLOCK_C)
        mask = (r < rows)[:, None] & (c < channels)[None, :]
        offsets = r[:, None] * channels + c[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(bias_ptr + c, mask=c < channels, other=0.0).to(tl.float32)
        tl.store(x_ptr + offsets, (x + b[None, :]).to(x_ptr.dtype.element_ty), mask=mask)


def add_channel_bias_(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``x += bias`` per channel of x [N, C, ...], in place. PyTorch's broadcast add over a channels-last conv output
    runs a generic strided kernel at about half the memory bandwidth (1.7 ms per 128-channel 12-frame 480x832
    output on an H200); a channels-last tile kernel streams it."""
    if not (triton_ready(x) and x.dim() == 5 and channels_last(x)):
        return x.add_(bias.view(1, -1, *([1] * (x.dim() - 2))))
    c = x.shape[1]
    block_c = triton.next_power_of_2(c)
    block_r = max(1, NORM_TILE // block_c)
    rows = x.numel() // c
    _add_bias_cl_kernel[(triton.cdiv(rows, block_r),)](x, bias, rows, c, BLOCK_R=block_r, BLOCK_C=block_c)
    return x


def channels_last(x: torch.Tensor) -> bool:
    """Whether x [N, C, T, H, W] is laid out channels-last (``torch.channels_last_3d``) and dense."""
    return x.dim() == 5 and x.stride(1) == 1 and x.is_contiguous(memory_format=torch.channels_last_3d)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def merge_moments(counts: torch.Tensor, means: torch.Tensor, m2s: torch.Tensor, dim: int = -1):
    """Chan's rule: (count, mean, centred sum of squares) of the union of parts given along ``dim``."""
    total = counts.sum(dim)
    mean = (counts * means).sum(dim) / total
    m2 = m2s.sum(dim) + (counts * (means - mean.unsqueeze(dim)).square()).sum(dim)
    return total, mean, m2


def group_moments(x: torch.Tensor, num_groups: int) -> Tuple[int, torch.Tensor, torch.Tensor]:
    """(elements per row, mean [N, G], biased variance [N, G]) of x [N, C, ...] per (sample, group), in fp32."""
    n, c = x.shape[:2]
    if triton_ready(x) and channels_last(x) and c > 1 and _pow2(c) and _pow2(num_groups):
        return _group_moments_cl(x, num_groups)
    rows = x.reshape(n * num_groups, -1)
    row_len = rows.shape[1]
    if not triton_ready(x):
        var, mean = torch.var_mean(rows.float(), dim=1, correction=0)
        return row_len, mean.view(n, num_groups), var.view(n, num_groups)
    rows = rows.contiguous()
    num_blocks = triton.cdiv(row_len, MOMENT_BLOCK)
    means = torch.empty(rows.shape[0], num_blocks, device=x.device, dtype=torch.float32)
    m2s = torch.empty_like(means)
    _block_moments_kernel[(num_blocks, rows.shape[0])](rows, means, m2s, row_len, num_blocks, BLOCK=MOMENT_BLOCK)
    starts = torch.arange(num_blocks, device=x.device, dtype=torch.float32) * MOMENT_BLOCK
    counts = (row_len - starts).clamp(max=MOMENT_BLOCK)
    _, mean, m2 = merge_moments(counts, means, m2s)
    return row_len, mean.view(n, num_groups), (m2 / row_len).view(n, num_groups)


def _group_moments_cl(x: torch.Tensor, num_groups: int):
    n, c = x.shape[:2]
    voxels = x.numel() // (n * c)
    block_v = max(1, MOMENT_BLOCK // c)
    num_blocks = triton.cdiv(voxels, block_v)
    means = torch.empty(n, num_blocks, num_groups, device=x.device, dtype=torch.float32)
    m2s = torch.empty_like(means)
    _block_moments_cl_kernel[(num_blocks, n)](x, means, m2s, voxels, num_blocks, C=c, G=num_groups, BLOCK_V=block_v)
    starts = torch.arange(num_blocks, device=x.device, dtype=torch.float32) * block_v
    counts = ((voxels - starts).clamp(max=block_v) * (c // num_groups)).view(1, -1, 1)
    row_len = voxels * (c // num_groups)
    _, mean, m2 = merge_moments(counts, means, m2s, dim=1)
    return row_len, mean, m2 / row_len


def upsample_into(x: torch.Tensor, out: torch.Tensor, factors: Tuple[int, int, int], first: bool) -> None:
    """Nearest upsampling of x [N, C, T, H, W] by ``factors`` (t, h, w) into ``out``; with ``first`` the first frame
    is upsampled in space only (diffusers' causal upsampler on a clip's first frame)."""
    ft, fh, fw = factors
    n, c, t, h, w = x.shape
    if triton_ready(x) and channels_last(x) and out.stride(1) == 1:
        out_voxels = out.shape[2] * out.shape[3] * out.shape[4]
        block_c = triton.next_power_of_2(c)
        block_v = max(1, NORM_TILE // block_c)
        grid = (triton.cdiv(out_voxels, block_v), n)
        sb, _, st, sh, sw = out.stride()
        _upsample_cl_kernel[grid](
            x, out, out_voxels, c, t, h, w, out.shape[3], out.shape[4], sb, st, sh, sw,
            FT=ft, FH=fh, FW=fw, FIRST=first, BLOCK_V=block_v, BLOCK_C=block_c,
        )  # fmt: skip
        return
    single = 1 if first else 0
    if single:
        out[:, :, :1].unflatten(3, (h, fh)).unflatten(5, (w, fw)).copy_(
            x[:, :, :1, :, None, :, None].expand(n, c, 1, h, fh, w, fw)
        )
    rest = t - single
    if rest:
        view = out[:, :, single:].unflatten(2, (rest, ft)).unflatten(4, (h, fh)).unflatten(6, (w, fw))
        view.copy_(x[:, :, single:, None, :, None, :, None].expand(n, c, rest, ft, h, fh, w, fw))


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


def normalize_into(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, out: torch.Tensor, silu: bool, border: int = 0
) -> bool:
    """``out[...] = act(x * scale + shift)`` for x [N, C, T, H, W] and ``out`` of x's shape (any view, e.g. the
    interior of a padded buffer: unit last stride for a contiguous x, unit channel stride for a channels-last x);
    scale/shift [N, C] fp32. One rounding to ``out``'s dtype.

    ``border=1`` asks for the replicated one-voxel border around ``out`` in height and width too (``out`` must be
    the interior of a buffer with that room); returns whether it was written (the channels-last Triton path does;
    elsewhere the caller fills it)."""
    if x.dim() != 5 or out.shape != x.shape:
        raise ValueError(f"normalize_into expects x [N, C, T, H, W] and out of its shape, got {x.shape}, {out.shape}")
    if triton_ready(x) and channels_last(x) and out.stride(1) == 1:
        n, c, t, h, w = x.shape
        block_c = triton.next_power_of_2(c)
        block_v = max(1, NORM_TILE // block_c)
        grid = (triton.cdiv(t * h * w, block_v), n)
        sb, _, st, sh, sw = out.stride()
        _normalize_cl_kernel[grid](
            x, out, scale, shift, t * h * w, c, h, w, sb, st, sh, sw,
            SILU=silu, BORDER=border == 1, BLOCK_V=block_v, BLOCK_C=block_c,
        )  # fmt: skip
        return border == 1
    if not triton_ready(x) or out.stride(-1) != 1 or x.shape[-1] > MAX_WIDTH:
        y = torch.addcmul(shift[:, :, None, None, None], x.float(), scale[:, :, None, None, None])
        out.copy_(F.silu(y) if silu else y)
        return False
    n, c, t, h, w = x.shape
    x = x.contiguous()  # NCTHW rows for the kernel below
    block_w = triton.next_power_of_2(w)
    rows_per_program = max(1, NORM_TILE // block_w)
    num_rows = n * c * t * h
    grid = (triton.cdiv(num_rows, rows_per_program),)
    _normalize_kernel[grid](
        x, out, scale, shift, num_rows, c, t, h, w, *out.stride()[:4],
        SILU=silu, ROWS=rows_per_program, BLOCK_W=block_w, num_warps=4,
    )  # fmt: skip
    return False


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
