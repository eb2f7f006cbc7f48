"""Chunk-by-chunk causal 3D convolutions with a conv cache (the trailing input frames of the previous chunk).

diffusers' ``HunyuanVideoCausalConv3d`` pads its input by replication (``k - 1`` frames in front in time, ``k // 2``
on each side in space) and runs a padding-free ``nn.Conv3d``. Run on a whole clip, the frames in front of frame 0 are
copies of frame 0 and every later frame sees its ``k - 1`` real predecessors. Run chunk by chunk here: the first chunk
replicates its first frame as the whole clip does, every later chunk takes the last ``k - 1`` (spatially padded)
input frames of the previous chunk instead, so the convolution of a chunk equals the whole clip's convolution at
those frames exactly.

The padded input is a buffer the producer writes straight into (``PaddedInput.interior``: the fused norm + SiLU, or
the nearest upsampling of the temporal upsamplers), so no ``F.pad`` copy of the activations is made; only the border
(one voxel wide) and the cached frames are copied in.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from .fused_group_norm import add_channel_bias_


def conv3d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.conv3d(x, weight, bias)``; the bias added by ``add_channel_bias_`` (cuDNN adds it as a separate PyTorch
    add anyway, here a faster one for channels-last outputs: the same fp32 sum and rounding)."""
    out = F.conv3d(x, weight)
    return out if bias is None else add_channel_bias_(out, bias)


class PaddedInput:
    """The padded input of one chunk of a ``CausalConvCache``: ``buffer`` [B, C, front + T, H + 2ph, W + 2pw]."""

    def __init__(self, buffer: torch.Tensor, front: int, pad_h: int, pad_w: int):
        self.buffer, self.front, self.pad_h, self.pad_w = buffer, front, pad_h, pad_w
        self.border_filled = False  # set by a producer that wrote the spatial border with the interior

    @property
    def border(self) -> int:
        """The one spatial border width a producer can write along with the interior (0: none or unequal)."""
        return self.pad_h if self.pad_h == self.pad_w else 0

    @property
    def interior(self) -> torch.Tensor:
        """The view the chunk's own frames go into (write it completely before ``CausalConvCache.run``)."""
        h, w = self.buffer.shape[3] - 2 * self.pad_h, self.buffer.shape[4] - 2 * self.pad_w
        return self.buffer[:, :, self.front :, self.pad_h : self.pad_h + h, self.pad_w : self.pad_w + w]

    def fill_border(self) -> None:
        """Replicate the interior's edge pixels into the spatial border (as ``F.pad(mode="replicate")``)."""
        frames = self.buffer[:, :, self.front :]
        ph, pw = self.pad_h, self.pad_w
        width = frames.shape[4]
        if pw:
            rows = frames[:, :, :, ph : frames.shape[3] - ph]
            rows[..., :pw].copy_(rows[..., pw : pw + 1].expand_as(rows[..., :pw]))
            rows[..., width - pw :].copy_(rows[..., width - pw - 1 : width - pw].expand_as(rows[..., :pw]))
        if ph:
            height = frames.shape[3]
            frames[:, :, :, :ph].copy_(frames[:, :, :, ph : ph + 1].expand_as(frames[:, :, :, :ph]))
            tail = frames[:, :, :, height - ph :]
            tail.copy_(frames[:, :, :, height - ph - 1 : height - ph].expand_as(tail))


class CausalConvCache:
    """A causal conv (``weight`` [Cout, Cin, kt, kh, kw], ``bias``; stride 1, no inner padding) run over consecutive
    chunks of a clip, its input padded by ``front`` frames in time (replicated on the first chunk, cached after) and
    ``pad_h`` / ``pad_w`` replicated voxels in space. ``of(module)`` builds one from a diffusers
    ``HunyuanVideoCausalConv3d``.

    ``cache`` holds the last ``front`` padded input frames [B, C, front, H + 2ph, W + 2pw], updated in place (a
    static tensor a CUDA graph can read and write); ``first=True`` starts a new clip (the cache is not read).
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], front: int, pad_h: int, pad_w: int):
        self.weight, self.bias = weight, bias
        self.front, self.pad_h, self.pad_w = front, pad_h, pad_w
        self.cache: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, module) -> "CausalConvCache":
        pad_w0, pad_w1, pad_h0, pad_h1, front, back = module.time_causal_padding
        if module.pad_mode != "replicate" or back != 0 or pad_w0 != pad_w1 or pad_h0 != pad_h1:
            raise ValueError(f"unsupported causal conv padding {module.time_causal_padding} ({module.pad_mode})")
        if tuple(module.conv.stride) != (1, 1, 1) or tuple(module.conv.padding) != (0, 0, 0):
            raise ValueError("chunked causal convs support stride 1 and no inner padding (the decoder's convs)")
        return cls(module.conv.weight, module.conv.bias, front, pad_h0, pad_w0)

    @property
    def pads(self) -> bool:
        return bool(self.front or self.pad_h or self.pad_w)

    def new_input(self, like: torch.Tensor, frames: Optional[int] = None, size: Optional[tuple] = None, fmt=None):
        """An empty ``PaddedInput`` for ``frames`` new frames of spatial ``size`` (default: ``like``'s) with
        ``like``'s batch, channels, dtype and device, in memory format ``fmt`` (default: contiguous)."""
        b, c, t, h, w = like.shape
        h, w = size or (h, w)
        shape = (b, c, self.front + (frames or t), h + 2 * self.pad_h, w + 2 * self.pad_w)
        fmt = fmt or torch.contiguous_format
        buffer = torch.empty(shape, dtype=like.dtype, device=like.device, memory_format=fmt)
        return PaddedInput(buffer, self.front, self.pad_h, self.pad_w)

    def run(self, padded: PaddedInput, first: bool) -> torch.Tensor:
        """Complete the padding of ``padded`` (border, cached or replicated front frames), convolve, keep the cache."""
        if not padded.border_filled:
            padded.fill_border()
        buf, front = padded.buffer, self.front
        if front:
            if first:
                buf[:, :, :front].copy_(buf[:, :, front : front + 1].expand_as(buf[:, :, :front]))
            else:
                if self.cache is None:
                    raise RuntimeError("a later chunk before the first one: start the clip with first=True")
                buf[:, :, :front].copy_(self.cache)
            if self.cache is None or self.cache.shape != buf[:, :, -front:].shape:
                self.cache = torch.empty_like(buf[:, :, -front:])
        out = conv3d(buf, self.weight, self.bias)
        if front:
            self.cache.copy_(buf[:, :, -front:])
        return out

    def __call__(self, x: torch.Tensor, first: bool, fmt=None) -> torch.Tensor:
        """The conv of a chunk ``x`` whose padding is not folded into a producer (a copy into the buffer)."""
        if not self.pads:
            return conv3d(x, self.weight, self.bias)
        padded = self.new_input(x, fmt=fmt)
        padded.interior.copy_(x)
        return self.run(padded, first)
