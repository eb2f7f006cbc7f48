"""Padded prompts on the unmasked fast kernels: the key mask carried by extra head channels, not by a mask tensor.

Why: a boolean key mask slows SDPA's kernels (on an H200 the masked cuDNN attention of the padded 1B step took 43 ms a
step against 28 ms unpadded). Zero keys (zero_key_attention.py, the default) reach the unpadded kernel time; this
path, which runs at head size 136, did not beat the dense mask.

How: q, k and v get ``EXTRA_CHANNELS`` more channels (zeros, so the head size stays a multiple of 8), except q's
first extra channel, which is 1, and k's, which is ``MASK_VALUE`` for a padded text key and 0 otherwise. SDPA runs
without a mask, with the original head size's scale ``1 / sqrt(d)``:

* a valid key's score is ``q . k / sqrt(d) + 1 * 0``: the unmasked score exactly;
* a padded key's score is that plus ``MASK_VALUE / sqrt(d)`` (-2896 at d = 128): its exp underflows to 0 in the
  kernels' fp32 softmax, as the masked kernel's -inf does, and its value row (whatever it holds) adds nothing;
* the output's extra channels are zeros (v's are), and are dropped.

So the output and every gradient equal the masked computation's up to the kernels' rounding (the CPU tests check fp32
against the dense mask; the GPU test bounds bf16 by the masked path's own error). Every query attends, padded text
queries too, over the valid keys: the dense key mask's semantics. The cost: 8 more channels per head (128 -> 136,
+6% attention FLOPs before the kernels' own tile rounding) and three concatenations per attention call. Measured on
an H200 (1B real configuration, compiled): 1.016x the dense mask's step, no gain; which SDPA kernel takes head 136
there was not recorded (benchmarks/reports/padded_text_h200_2026-11.md).
"""

from typing import Sequence

import torch
import torch.nn.functional as F

from .row_lengths import DeviceRowLengths

EXTRA_CHANNELS = 8
MASK_VALUE = -32768.0  # exact in bf16 / fp16; times 1 / sqrt(head size) it still underflows exp in fp32


class BiasChannelRows(DeviceRowLengths):
    """The key mask of a joint [text, video] batch whose row ``b`` has ``lengths[b]`` valid text tokens first, as
    the extra key channel above, built once per forward and shared by every block (``augment``)."""

    def __init__(self, lengths: Sequence[int], num_text: int, num_video: int, device):
        super().__init__(lengths, num_text, num_video, device)
        keys = torch.arange(self.num_text + self.num_video, device=device)
        padded = (keys[None] >= self.lengths[:, None]) & (keys[None] < self.num_text)  # [B, N]
        self.key_channel = torch.where(padded, MASK_VALUE, 0.0)  # [B, N] fp32, cast to k's dtype per call

    def augment(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """[B, heads, T + N, head_dim] q/k/v -> the same with the extra channels (module docstring); the caller runs
        SDPA without a mask at scale ``head_dim ** -0.5`` and keeps the output's first ``head_dim`` channels
        (``attention.attention`` does)."""
        self.check(q, k)
        batch, heads, tokens, _ = q.shape
        if torch.is_autocast_enabled(q.device.type):  # SDPA's autocast rule, applied before the concatenations
            dtype = torch.get_autocast_dtype(q.device.type)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        extra = q.new_zeros(EXTRA_CHANNELS)
        extra[0] = 1.0
        q = torch.cat((q, extra.expand(batch, heads, tokens, EXTRA_CHANNELS)), dim=-1)
        key_extra = F.pad(self.key_channel.to(k.dtype)[:, None, :, None], (0, EXTRA_CHANNELS - 1))
        k = torch.cat((k, key_extra.expand(batch, heads, tokens, EXTRA_CHANNELS)), dim=-1)
        return q, k, F.pad(v, (0, EXTRA_CHANNELS))
