"""A causal upsampler of HunyuanVideo's decoder (nearest upsampling, then a 3x3x3 causal conv with replicated borders)
computed at the low resolution, one sub-pixel phase at a time.

Along an axis upsampled 2x, the three taps of an output voxel at phase ``p`` (its position inside the 2-block) read
upsampled positions ``2i + p + o`` (offsets ``o``: -1, 0, 1 in space; -2, -1, 0 causally in time), which are only two
distinct low-resolution positions ``i + floor((p + o) / 2)``. So each phase is a 2-tap conv of the low-resolution
input whose taps are sums of the original taps (summed in fp32, rounded once to the weights' dtype). Per output voxel:
2x2x2 = 8 taps instead of 27 for a (2, 2, 2) upsampler (3.4x fewer FLOPs), 3x2x2 = 12 for (1, 2, 2) (2.25x). All
phases run as one conv whose output channels are (phase, channel), and one strided copy interleaves them into the
upsampled layout.

The borders stay exact: the replicated border of the upsampled input is the upsampling of the low-resolution input's
replicated border. In time, the last two upsampled frames of a chunk are one low-resolution frame repeated, so the
causal front of a later chunk is the previous chunk's last low-resolution frame (``CausalConvCache`` keeps it), and a
clip's first frame (upsampled in space only) is the phase-1 output of frame 0 with its front replicated, i.e. the
interleaved output without its first frame. Equal to the direct upsample + conv in exact arithmetic; in floating point
up to the order of the sums and the one rounding of the merged taps (fp32: ~1e-6; the GPU test bounds bf16 by the
eager diffusers decoder's own error).
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from .conv_cache import CausalConvCache
from .fused_group_norm import NORM_TILE, add_channel_bias_, channels_last, triton, triton_ready

if triton is not None:
    import triton.language as tl

    from .fused_group_norm import output_tile

    @triton.jit
    def _interleave_cl_kernel(
        y_ptr, out_ptr, bias_ptr, out_voxels, channels, out_h, out_w, skip,
        y_sb, y_st, y_sh, y_sw, out_sb, out_st, out_sh, out_sw,
        FT: tl.constexpr, FH: tl.constexpr, FW: tl.constexpr,
        STEP_T: tl.constexpr, STEP_H: tl.constexpr, STEP_W: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        """out[n, c, to, ho, wo] = y[n, phase(to + skip, ho, wo) Cout + c, i_t + p_t STEP_T, i_h + p_h STEP_H,
        i_w + p_w STEP_W] (+ bias[c]) (i = index // factor, p = index % factor), channel stride 1 on both sides."""
        n, c, mask, to, ho, wo = output_tile(out_voxels, channels, out_h, out_w, BLOCK_V, BLOCK_C)
        tf = to + skip
        pt, ph, pw = tf % FT, ho % FH, wo % FW
        phase = (pt * FH + ph) * FW + pw
        src = (
            n * y_sb + (tf // FT + pt * STEP_T) * y_st + (ho // FH + ph * STEP_H) * y_sh
            + (wo // FW + pw * STEP_W) * y_sw + phase * channels
        )  # fmt: skip
        x = tl.load(y_ptr + src[:, None] + c[None, :], mask=mask, other=0.0)
        if HAS_BIAS:
            b = tl.load(bias_ptr + c, mask=c < channels, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) + b[None, :]).to(out_ptr.dtype.element_ty)
        dst = n * out_sb + to * out_st + ho * out_sh + wo * out_sw
        tl.store(out_ptr + dst[:, None] + c[None, :], x, mask=mask)


KERNEL = 3


def version(tensor: torch.Tensor) -> int:
    """The tensor's in-place version counter; -1 for an inference-mode tensor, which keeps none (a VAE built under
    ``torch.inference_mode``: an in-place change of its weights is then not noticed)."""
    try:
        return tensor._version
    except RuntimeError:
        return -1


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def axis_phases(factor: int, causal: bool) -> Tuple[torch.Tensor, int, List[int]]:
    """For one axis of a size-3 kernel after nearest upsampling by ``factor`` (1 or 2): the tap merge matrices
    [phases, new taps, 3], the low-resolution front padding and each phase's start in the conv output."""
    if factor not in (1, 2):
        raise ValueError(f"phase upsampling supports factors 1 and 2, got {factor}")
    offsets = [k - (KERNEL - 1) for k in range(KERNEL)] if causal else [k - KERNEL // 2 for k in range(KERNEL)]
    if factor == 1:
        return torch.eye(KERNEL).unsqueeze(0), -offsets[0], [0]
    reads = [[(p + o) // 2 for o in offsets] for p in range(2)]  # low-res position (relative to i) of each tap
    taps = 2
    front = -min(min(r) for r in reads)
    merge = torch.zeros(2, taps, KERNEL)
    for p, rel in enumerate(reads):
        for k, r in enumerate(rel):
            merge[p, r - min(rel), k] = 1.0
    if any(max(r) - min(r) + 1 != taps for r in reads):
        raise ValueError("phases of unequal width")  # never for kernel 3, factor 2
    return merge, front, [min(r) + front for r in reads]


class PhaseUpsampleConv:
    """``conv(nearest_upsample(x))`` of a diffusers ``HunyuanVideoUpsampleCausal3D`` chunk by chunk (module
    docstring), with the causal front of later chunks taken from the previous chunk (``cache``)."""

    def __init__(self, upsampler):
        module = upsampler.conv
        factors = tuple(int(f) for f in upsampler.upsample_factor)
        if module.pad_mode != "replicate" or tuple(module.conv.kernel_size) != (KERNEL,) * 3:
            raise ValueError(f"phase upsampling needs a replicated 3x3x3 causal conv, got {module}")
        CausalConvCache.of(module)  # the same padding checks as the direct path
        self.factors = factors
        axes = [axis_phases(factors[0], causal=True)] + [axis_phases(f, causal=False) for f in factors[1:]]
        self.phases = tuple(merge.shape[0] for merge, _, _ in axes)
        self.starts = [starts for _, _, starts in axes]
        # each axis' phase-1 start minus its phase-0 start (two phases per axis: the start is affine in the phase)
        self.steps = [(s[1] - s[0]) if len(s) > 1 else 0 for s in self.starts]
        self.module, self.merges = module, [merge for merge, _, _ in axes]
        self.out_channels = module.conv.weight.shape[0]
        self.conv = CausalConvCache(None, None, axes[0][1], axes[1][1], axes[2][1])
        self.merged_version = None
        self.merge_weights()

    def merge_weights(self) -> None:
        """The phases' taps from the conv's current weights, written in place into the tensor a captured CUDA graph
        reads (``refresh`` redoes it whenever the weights change, e.g. a ``load_state_dict`` after this was built)."""
        weight, bias = self.module.conv.weight, self.module.conv.bias
        mt, mh, mw = (m.to(weight.device) for m in self.merges)
        merged = torch.einsum("ajt,bkh,clw,oithw->abcoijkl", mt, mh, mw, weight.detach().float())
        merged = merged.reshape(-1, *merged.shape[4:]).to(weight.dtype)
        current = self.conv.weight
        if current is not None and current.shape == merged.shape and current.device == merged.device:
            current.copy_(merged)
        else:
            self.conv.weight = merged
        self.bias = None if bias is None else bias.detach()  # added while interleaving (one pass fewer)
        self.merged_version = self.weights_version()

    def refresh(self) -> None:
        """Re-merge the taps if the conv's weights changed since (a host-side check; not during a graph capture)."""
        if self.weights_version() != self.merged_version and not capturing():
            self.merge_weights()

    def weights_version(self) -> tuple:
        conv = self.module.conv
        return (version(conv.weight), conv.weight.data_ptr(), None if conv.bias is None else version(conv.bias))

    @property
    def cache(self):
        return self.conv.cache

    def __call__(self, x: torch.Tensor, first: bool, fmt=None) -> torch.Tensor:
        """The upsampled, convolved chunk [B, Cout, frames, H fh, W fw] (frames = 1 + ft (t - 1) for a clip's first
        chunk, ft t after), in ``fmt`` (default contiguous)."""
        fmt = fmt or torch.contiguous_format
        self.refresh()
        y = self.conv(x.contiguous(memory_format=fmt), first, fmt)  # [B, phases x Cout, t, h + 1, w + 1]
        b, _, t, h, w = x.shape
        ft, fh, fw = self.factors
        skip = 1 if first and ft > 1 else 0  # a clip's first frame: the interleaved output without its first frame
        if triton_ready(y) and channels_last(y) and fmt == torch.channels_last_3d:
            shape = (b, self.out_channels, t * ft - skip, h * fh, w * fw)
            out = torch.empty(shape, dtype=y.dtype, device=y.device, memory_format=fmt)
            self._interleave_triton(y, out, skip)
            return out
        shape = (b, self.out_channels, t * ft, h * fh, w * fw)
        out = torch.empty(shape, dtype=y.dtype, device=y.device, memory_format=fmt)
        self._interleave(y, out, (t, h, w))
        out = out[:, :, skip:]
        return out if self.bias is None else add_channel_bias_(out, self.bias)

    def _interleave_triton(self, y: torch.Tensor, out: torch.Tensor, skip: int) -> None:
        n, c, t, h, w = out.shape
        block_c = triton.next_power_of_2(c)
        block_v = max(1, NORM_TILE // block_c)
        steps = self.steps
        base = [s[0] for s in self.starts]
        y_view = y[:, :, base[0] :, base[1] :, base[2] :]  # each axis' phase 0 start
        grid = (triton.cdiv(t * h * w, block_v), n)
        ft, fh, fw = self.factors
        bias = self.bias if self.bias is not None else out  # any pointer when there is no bias
        _interleave_cl_kernel[grid](
            y_view, out, bias, t * h * w, c, h, w, skip, y.stride(0), *y.stride()[2:],
            out.stride(0), *out.stride()[2:], FT=ft, FH=fh, FW=fw, STEP_T=steps[0], STEP_H=steps[1],
            STEP_W=steps[2], HAS_BIAS=self.bias is not None, BLOCK_V=block_v, BLOCK_C=block_c,
        )  # fmt: skip

    def _interleave(self, y: torch.Tensor, out: torch.Tensor, size: Tuple[int, int, int]) -> None:
        """``out[b, c, i ft + p, ...] = y[b, (phase index) Cout + c, i + start(p), ...]`` over all three axes, as one
        strided copy (two phases per axis: a phase index's start is affine in it)."""
        cout = self.out_channels
        sb, sc, *spatial = y.stride()
        phase_block = [self.phases[1] * self.phases[2] * cout, self.phases[2] * cout, cout]
        sizes, strides, offset = [out.shape[0], cout], [sb, sc], y.storage_offset()
        for axis in range(3):
            starts, stride = self.starts[axis], spatial[axis]
            sizes += [size[axis], len(starts)]
            strides += [stride, phase_block[axis] * sc + self.steps[axis] * stride]
            offset += starts[0] * stride
        source = y.as_strided(sizes, strides, offset)
        ob, oc, ot, oh, ow = out.stride()
        ft, fh, fw = self.factors
        target = out.as_strided(
            sizes, [ob, oc, ot * ft, ot, oh * fh, oh, ow * fw, ow], out.storage_offset()
        )  # [B, C, t, ft, h, fh, w, fw]
        target.copy_(source)
