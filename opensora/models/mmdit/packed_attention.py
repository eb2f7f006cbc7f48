"""Padded prompts as packed variable-length attention: one flash call for the whole batch, whatever the lengths.

A row of a joint [text T, video N] batch with ``L`` valid text tokens attends over its ``L + N`` valid keys. The
per-row path (``attention.KeyRanges``) runs one SDPA call per row, and each row length is a new shape: new cuDNN
plans, and inside ``torch.compile`` host ints that Dynamo specialises on (measured on an H200: the 1B padded step
2.4x the unpadded one). Here the batch is reordered per row to [video, text] (attention does not care about token
order: the text's RoPE ids are all zero and the video's travel with their tokens), so each row's valid tokens are
one contiguous run followed by its padding, and the batch becomes ``2 B`` sequences of one packed tensor:
``[video + valid text]`` and ``[padded text]``, given to flash attention's variable-length kernel by cumulative
offsets. The packed size is ``B (T + N)`` for every batch of a trimmed length, the offsets are a device tensor, so
nothing about the lengths reaches a compiled graph's shapes. Padded text queries attend among themselves only and
output values nobody reads (as in ``KeyRanges``, where they output zeros).

Flash's variable-length kernel needs CUDA and bf16/fp16 (``torch.nn.attention.varlen``, torch >= 2.10);
elsewhere the same sequences run through one SDPA call each (``segment_attention``: the reference the CPU tests
check the packing with).
"""

from typing import Sequence

import torch
import torch.nn.functional as F

from .row_lengths import host_ints_to


def _flash_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


FLASH_VARLEN = _flash_varlen()  # resolved once: an import inside a compiled block would break its graph


def segment_attention(q, k, v, offsets: Sequence[int]) -> torch.Tensor:
    """Packed [total, heads, head_dim] q/k/v -> [total, heads, head_dim], each sequence ``offsets[i]:offsets[i+1]``
    attending over itself only: one SDPA call per non-empty sequence (the reference for the packed kernel)."""
    out = torch.empty_like(q)
    for start, stop in zip(offsets[:-1], offsets[1:]):
        if stop > start:
            piece = (t[start:stop].transpose(0, 1)[None] for t in (q, k, v))
            out[start:stop] = F.scaled_dot_product_attention(*piece)[0].transpose(0, 1)
    return out


class PackedRows:
    """The key mask of a joint [text, video] batch whose row ``b`` has ``lengths[b]`` valid text tokens first, as
    packed variable-length sequences (see the module doc). ``attend`` takes and returns what ``attention`` does."""

    def __init__(self, lengths: Sequence[int], num_text: int, num_video: int, device):
        self.lengths = [min(int(length), num_text) for length in lengths]
        self.num_text, self.num_video = int(num_text), int(num_video)
        row = self.num_text + self.num_video
        offsets = [0]
        for b, length in enumerate(self.lengths):
            offsets += [b * row + self.num_video + length, (b + 1) * row]
        self.offsets = offsets  # host copy (the reference path; the padding run of a full row is empty)
        self.cu_seqlens = host_ints_to(offsets, torch.int32, device)

    def __len__(self) -> int:
        return len(self.lengths)

    def dense(self, num_keys: int, device=None) -> torch.Tensor:
        """The equivalent boolean key mask [B, 1, 1, num_keys] (True = may attend) of the [text, video] order."""
        keys = torch.arange(num_keys, device=device)
        valid = torch.tensor(self.lengths, device=device)[:, None]
        mask = (keys[None] < valid) | (keys[None] >= self.num_text)
        return mask[:, None, None, :]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "auto") -> torch.Tensor:
        """[B, heads, T + N, head_dim] q/k/v -> [B, T + N, heads * head_dim]."""
        batch, heads, tokens, head_dim = q.shape
        if batch != len(self.lengths) or tokens != self.num_text + self.num_video:
            raise ValueError(
                f"PackedRows of {len(self.lengths)} rows x {self.num_text}+{self.num_video} tokens got q of shape "
                f"{tuple(q.shape)}"
            )
        split = self.num_text

        def pack(t):  # [B, H, T+N, D] -> [B (N+T), H, D], each row as [video, text]
            t = t.transpose(1, 2)
            return torch.cat((t[:, split:], t[:, :split]), 1).reshape(batch * tokens, heads, head_dim)

        q, k, v = pack(q), pack(k), pack(v)
        varlen = FLASH_VARLEN
        if varlen is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and backend != "math":
            out = varlen(q, k, v, self.cu_seqlens, self.cu_seqlens, tokens, tokens)
        else:
            out = segment_attention(q, k, v, self.offsets)
        out = out.reshape(batch, tokens, heads * head_dim)
        return torch.cat((out[:, self.num_video :], out[:, : self.num_video]), 1)  # back to [text, video]
