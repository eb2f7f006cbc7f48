"""Triton kernels for the MMDiT's elementwise chains, each an autograd.Function with its own backward.

``MMDiT(fused_kernels=True)`` routes two chains of every block through here:

- ``modulate(x, shift, scale)``: LayerNorm (no affine, eps 1e-6) then ``(1 + scale) * x + shift``. Eager it is a
  layer_norm kernel plus an addcmul forward (4 passes over the activation) and, backward, an addcmul backward
  (mul, mul + sum over tokens, sum over tokens) plus the layer_norm backward (~8 passes). Fused: 2 passes forward,
  3 backward (read x and the gradient, write dx), with the shift/scale gradients reduced in the same pass.
- ``qk_norm_rope(q, k, ...)``: per-head RMSNorm with a learned scale, then RoPE on adjacent channel pairs, reading
  q/k straight from the strided view of the QKV projection and writing contiguous [B, heads, N, head_dim] for
  attention. Eager this is rms_norm, the fp32 upcast, a contiguous copy, the complex multiply, the downcast and
  the q/k ``contiguous()`` (about 7 passes per tensor forward, as many backward); fused: 2 forward, 3 backward.

The eager functions in layers.py / rope.py are the reference and the fallback: the kernels run only on CUDA
tensors when Triton imports (or on CPU under Triton's interpreter, ``TRITON_INTERPRET=1``, which the CPU tests
use). All math is fp32 in registers; inputs and outputs keep their dtype. Numerics differ from eager only by
where bf16 rounding happens (eager rounds the normalised q/k to bf16 before RoPE; the kernel does not).
"""

import os

import torch
import torch.nn.functional as F

try:  # Triton is optional: CPU installs and CI run the eager path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

LN_EPS = 1e-6


def triton_usable(t: torch.Tensor) -> bool:
    """True when the kernels can run on ``t``: Triton imports and ``t`` is on CUDA (or Triton interprets on CPU)."""
    if triton is None:
        return False
    return t.is_cuda or (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


# ----------------------------------------------------------------------------------------------- eager references


def modulate_reference(x, shift, scale, eps=LN_EPS):
    return torch.addcmul(shift, F.layer_norm(x, x.shape[-1:], eps=eps), 1 + scale)


def qk_norm_rope_reference(q, k, q_scale, k_scale, cos, sin, eps=LN_EPS):
    """What the eager block does: RMSNorm (scale in the activation dtype), then the complex-multiply RoPE."""
    from .rope import apply_rope

    d = q.shape[-1:]
    q = F.rms_norm(q, d, q_scale.to(q.dtype), eps)
    k = F.rms_norm(k, d, k_scale.to(k.dtype), eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


# ------------------------------------------------------------------------------------------------------- kernels

if triton is not None:

    @triton.jit
    def _modulate_fwd(
        X, SHIFT, SCALE, Y, MEAN, RSTD,
        N, C, sx_b, sx_n, sm_b, sy_b, sy_n, eps,
        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        # One [BLOCK_R, C] tile of rows of sample b per program; x [B, N, C] with a unit channel stride.
        b = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_C)
        rmask = rows < N
        cmask = cols < C
        m = rmask[:, None] & cmask[None, :]
        shift = tl.load(SHIFT + b * sm_b + cols, mask=cmask, other=0.0).to(tl.float32)
        scale1 = 1.0 + tl.load(SCALE + b * sm_b + cols, mask=cmask, other=0.0).to(tl.float32)
        x = tl.load(X + b * sx_b + rows[:, None] * sx_n + cols[None, :], mask=m, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / C
        xc = tl.where(m, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / C + eps)
        y = xc * rstd[:, None] * scale1[None, :] + shift[None, :]
        tl.store(Y + b * sy_b + rows[:, None] * sy_n + cols[None, :], y.to(Y.dtype.element_ty), mask=m)
        tl.store(MEAN + b * N + rows, mean, mask=rmask)
        tl.store(RSTD + b * N + rows, rstd, mask=rmask)

    @triton.jit
    def _modulate_bwd(
        X, SCALE, GY, MEAN, RSTD, GX, GSHIFT_PART, GSCALE_PART,
        N, C, sx_b, sx_n, sm_b, sg_b, sg_n, sgx_b, sgx_n, n_parts,
        BLOCK_R: tl.constexpr, ITERS: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        # ITERS tiles of BLOCK_R rows per program; the shift/scale gradients of those rows are summed in
        # registers and written as one fp32 partial row each (the host sums the n_parts partials).
        b = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        cols = tl.arange(0, BLOCK_C)
        cmask = cols < C
        scale1 = 1.0 + tl.load(SCALE + b * sm_b + cols, mask=cmask, other=0.0).to(tl.float32)
        acc_shift = tl.zeros([BLOCK_C], dtype=tl.float32)
        acc_scale = tl.zeros([BLOCK_C], dtype=tl.float32)
        for i in range(ITERS):
            rows = (part * ITERS + i) * BLOCK_R + tl.arange(0, BLOCK_R)
            rmask = rows < N
            m = rmask[:, None] & cmask[None, :]
            x = tl.load(X + b * sx_b + rows[:, None] * sx_n + cols[None, :], mask=m, other=0.0).to(tl.float32)
            gy = tl.load(GY + b * sg_b + rows[:, None] * sg_n + cols[None, :], mask=m, other=0.0).to(tl.float32)
            mean = tl.load(MEAN + b * N + rows, mask=rmask, other=0.0)
            rstd = tl.load(RSTD + b * N + rows, mask=rmask, other=0.0)
            xhat = tl.where(m, (x - mean[:, None]) * rstd[:, None], 0.0)
            acc_shift += tl.sum(gy, axis=0)
            acc_scale += tl.sum(gy * xhat, axis=0)
            g = gy * scale1[None, :]
            c1 = tl.sum(g, axis=1) / C
            c2 = tl.sum(g * xhat, axis=1) / C
            gx = (g - c1[:, None] - xhat * c2[:, None]) * rstd[:, None]
            tl.store(GX + b * sgx_b + rows[:, None] * sgx_n + cols[None, :], gx.to(GX.dtype.element_ty), mask=m)
        out = (b * n_parts + part) * C + cols
        tl.store(GSHIFT_PART + out, acc_shift, mask=cmask)
        tl.store(GSCALE_PART + out, acc_scale, mask=cmask)

    @triton.jit
    def _load_pairs(PTR, b, h, rows, s_b, s_h, s_n, j, m):
        """Even and odd channels (fp32) of rows ``rows`` of head ``h`` of sample ``b`` in a strided [B, H, N, D]."""
        p = PTR + b * s_b + h * s_h + rows[:, None] * s_n + 2 * j[None, :]
        return tl.load(p, mask=m, other=0.0).to(tl.float32), tl.load(p + 1, mask=m, other=0.0).to(tl.float32)

    @triton.jit
    def _qk_norm_rope_fwd(
        X, W, COS, SIN, Y, RSTD,
        H, N, sx_b, sx_h, sx_n, eps,
        HALF: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # X: [B, H, N, 2*HALF] with any strides but a unit channel stride; Y: contiguous [B, H, N, 2*HALF].
        pid_bh = tl.program_id(0).to(tl.int64)  # 64-bit offsets: long videos x batch exceed 2**31
        b = pid_bh // H
        h = pid_bh % H
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        j = tl.arange(0, HALF)
        m = rmask[:, None]
        xe, xo = _load_pairs(X, b, h, rows, sx_b, sx_h, sx_n, j, m)
        rstd = 1.0 / tl.sqrt((tl.sum(xe * xe, axis=1) + tl.sum(xo * xo, axis=1)) / (2 * HALF) + eps)
        we = tl.load(W + 2 * j).to(tl.float32)
        wo = tl.load(W + 2 * j + 1).to(tl.float32)
        ye = xe * rstd[:, None] * we[None, :]
        yo = xo * rstd[:, None] * wo[None, :]
        cs = rows[:, None] * HALF + j[None, :]
        c = tl.load(COS + cs, mask=m, other=0.0)
        s = tl.load(SIN + cs, mask=m, other=0.0)
        yp = Y + pid_bh * N * 2 * HALF + rows[:, None] * 2 * HALF + 2 * j[None, :]
        tl.store(yp, (ye * c - yo * s).to(Y.dtype.element_ty), mask=m)
        tl.store(yp + 1, (ye * s + yo * c).to(Y.dtype.element_ty), mask=m)
        tl.store(RSTD + pid_bh * N + rows, rstd, mask=rmask)

    @triton.jit
    def _qk_norm_rope_bwd(
        X, W, COS, SIN, RSTD, GY, GX, GW_PART,
        H, N, sx_b, sx_h, sx_n, sg_b, sg_h, sg_n, n_parts,
        HALF: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # GX: contiguous [B, H, N, 2*HALF]; GW_PART: [B*H*n_parts, 2*HALF] fp32 partial sums of the scale grad.
        pid_bh = tl.program_id(0).to(tl.int64)  # 64-bit offsets: long videos x batch exceed 2**31
        part = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        rows = part * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        j = tl.arange(0, HALF)
        m = rmask[:, None]
        xe, xo = _load_pairs(X, b, h, rows, sx_b, sx_h, sx_n, j, m)
        ge, go = _load_pairs(GY, b, h, rows, sg_b, sg_h, sg_n, j, m)
        cs = rows[:, None] * HALF + j[None, :]
        c = tl.load(COS + cs, mask=m, other=0.0)
        s = tl.load(SIN + cs, mask=m, other=0.0)
        # The rotation's transpose takes the gradient back to the normalised values.
        gye = ge * c + go * s
        gyo = go * c - ge * s
        rstd = tl.load(RSTD + pid_bh * N + rows, mask=rmask, other=0.0)
        xhe = xe * rstd[:, None]
        xho = xo * rstd[:, None]
        we = tl.load(W + 2 * j).to(tl.float32)
        wo = tl.load(W + 2 * j + 1).to(tl.float32)
        out = (pid_bh * n_parts + part) * 2 * HALF + 2 * j
        tl.store(GW_PART + out, tl.sum(gye * xhe, axis=0))
        tl.store(GW_PART + out + 1, tl.sum(gyo * xho, axis=0))
        ghe = gye * we[None, :]
        gho = gyo * wo[None, :]
        dot = (tl.sum(ghe * xhe, axis=1) + tl.sum(gho * xho, axis=1)) / (2 * HALF)
        gxe = (ghe - xhe * dot[:, None]) * rstd[:, None]
        gxo = (gho - xho * dot[:, None]) * rstd[:, None]
        gxp = GX + pid_bh * N * 2 * HALF + rows[:, None] * 2 * HALF + 2 * j[None, :]
        tl.store(gxp, gxe.to(GX.dtype.element_ty), mask=m)
        tl.store(gxp + 1, gxo.to(GX.dtype.element_ty), mask=m)


# Modulation tiles: BLOCK_R rows x the whole channel dim (padded to a power of two) per tile, few rows so the
# fp32 tiles stay in registers; the backward runs ITERS tiles per program, so its fp32 shift/scale partials are
# [B, N / (BWD_BLOCK_R * ITERS), C] (1/8 of the activation's bytes each).
MODULATE_BLOCK_R = 4
MODULATE_BWD_BLOCK_R = 2
MODULATE_BWD_ITERS = 8
ROPE_BLOCK_N = 32


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its channels are adjacent in memory (what the kernels index), else a dense copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


class _Modulate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shift, scale, eps):
        b, n, c = x.shape
        x, shift, scale = _unit_last_stride(x), _unit_last_stride(shift), _unit_last_stride(scale)
        shift_shape, scale_shape = shift.shape, scale.shape  # [B, 1, C] or broadcast [1, 1, C]
        shift, scale = shift.expand(b, 1, c), scale.expand(b, 1, c)
        if shift.stride(0) != scale.stride(0):
            shift, scale = shift.contiguous(), scale.contiguous()
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        mean = torch.empty(b, n, device=x.device, dtype=torch.float32)
        rstd = torch.empty_like(mean)
        block_c = triton.next_power_of_2(c)
        grid = (b, triton.cdiv(n, MODULATE_BLOCK_R))
        _modulate_fwd[grid](
            x, shift, scale, y, mean, rstd, n, c, x.stride(0), x.stride(1), shift.stride(0), y.stride(0), y.stride(1),
            eps, BLOCK_R=MODULATE_BLOCK_R, BLOCK_C=block_c, num_warps=8,
        )  # fmt: skip
        ctx.save_for_backward(x, scale, mean, rstd)
        ctx.shift_dtype, ctx.shapes = shift.dtype, (shift_shape, scale_shape)
        return y

    @staticmethod
    def backward(ctx, gy):
        x, scale, mean, rstd = ctx.saved_tensors
        b, n, c = x.shape
        gy = _unit_last_stride(gy)
        n_parts = triton.cdiv(n, MODULATE_BWD_BLOCK_R * MODULATE_BWD_ITERS)
        gx = torch.empty_like(x, memory_format=torch.contiguous_format)
        gshift = torch.empty(b, n_parts, c, device=x.device, dtype=torch.float32)
        gscale = torch.empty_like(gshift)
        block_c = triton.next_power_of_2(c)
        _modulate_bwd[(b, n_parts)](
            x, scale, gy, mean, rstd, gx, gshift, gscale, n, c, x.stride(0), x.stride(1), scale.stride(0),
            gy.stride(0), gy.stride(1), gx.stride(0), gx.stride(1), n_parts,
            BLOCK_R=MODULATE_BWD_BLOCK_R, ITERS=MODULATE_BWD_ITERS, BLOCK_C=block_c, num_warps=8,
        )  # fmt: skip
        dt, (shift_shape, scale_shape) = ctx.shift_dtype, ctx.shapes
        gshift = gshift.sum(1, keepdim=True).sum_to_size(shift_shape).to(dt)
        return gx, gshift, gscale.sum(1, keepdim=True).sum_to_size(scale_shape).to(dt), None


class _QKNormRope(torch.autograd.Function):
    """One tensor (q or k) [B, H, N, D]: RMSNorm with ``weight`` [D], then RoPE by ``cos``/``sin`` [N, D/2]."""

    @staticmethod
    def forward(ctx, x, weight, cos, sin, eps):
        b, h, n, d = x.shape
        x = _unit_last_stride(x)
        if d % 2 or d & (d - 1):
            raise ValueError(f"the fused QK-norm + RoPE kernel needs a power-of-two head_dim, got {d}")
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        weight = weight.contiguous()
        y = torch.empty(b, h, n, d, device=x.device, dtype=x.dtype)
        rstd = torch.empty(b, h, n, device=x.device, dtype=torch.float32)
        grid = (b * h, triton.cdiv(n, ROPE_BLOCK_N))
        _qk_norm_rope_fwd[grid](
            x, weight, cos, sin, y, rstd, h, n, x.stride(0), x.stride(1), x.stride(2), eps,
            HALF=d // 2, BLOCK_N=ROPE_BLOCK_N, num_warps=4,
        )  # fmt: skip
        ctx.save_for_backward(x, weight, cos, sin, rstd)
        return y

    @staticmethod
    def backward(ctx, gy):
        x, weight, cos, sin, rstd = ctx.saved_tensors
        b, h, n, d = x.shape
        gy = _unit_last_stride(gy)
        n_parts = triton.cdiv(n, ROPE_BLOCK_N)
        gx = torch.empty(b, h, n, d, device=x.device, dtype=x.dtype)
        gw = torch.empty(b * h * n_parts, d, device=x.device, dtype=torch.float32)
        _qk_norm_rope_bwd[(b * h, n_parts)](
            x, weight, cos, sin, rstd, gy, gx, gw, h, n, x.stride(0), x.stride(1), x.stride(2),
            gy.stride(0), gy.stride(1), gy.stride(2), n_parts, HALF=d // 2, BLOCK_N=ROPE_BLOCK_N, num_warps=4,
        )  # fmt: skip
        return gx, gw.sum(0).to(weight.dtype), None, None, None


# ---------------------------------------------------------------------------------------------------- public API


def modulate(x, shift, scale, eps=LN_EPS):
    """``(1 + scale) * layer_norm(x) + shift`` for x [B, N, C], shift/scale [B, 1, C]; fused when Triton can run."""
    if not triton_usable(x):
        return modulate_reference(x, shift, scale, eps)
    return _Modulate.apply(x, shift, scale, eps)


def qk_norm_rope(q, k, q_scale, k_scale, cos, sin, eps=LN_EPS):
    """RMSNorm(q/k) * scale, then RoPE; q/k [B, H, N, D] (strided views allowed), cos/sin [N, D/2].

    Fused, the outputs are contiguous [B, H, N, D], ready for attention. The scales are cast to the activation
    dtype first, as the eager QKNorm does, so the rounding of the weight matches."""
    if not triton_usable(q):
        return qk_norm_rope_reference(q, k, q_scale, k_scale, cos, sin, eps)
    q_scale, k_scale = q_scale.to(q.dtype), k_scale.to(k.dtype)
    return _QKNormRope.apply(q, q_scale, cos, sin, eps), _QKNormRope.apply(k, k_scale, cos, sin, eps)
