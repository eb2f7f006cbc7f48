"""Padded prompts through FlexAttention: one fused kernel that skips the padded text keys block by block.

Why: a boolean key mask slows SDPA's kernels (the dense path; zero_key_attention.py is the default). FlexAttention
turns the mask into a block-sparse kernel instead: key blocks that are all padding are skipped, blocks that are all
valid run without a mask, and only a block holding a prompt's end evaluates ``mask_mod``.

Key ``j`` of row ``b`` of a joint [text T, video N] sequence may be attended iff it is a video token (``j >= T``)
or a valid text token (``j < lengths[b]``). Every query attends, so padded text queries attend over the valid keys
exactly as under the dense key mask (``MMDiT.key_mask``). ``mask_mod`` closes over a [B] device tensor of lengths:
Dynamo takes a closure's tensors as graph inputs, so every batch of one trimmed length reuses one compiled block
graph (tests/test_text_padding_flex.py counts the compiles).

Speed needs torch.compile: inside compiled blocks (``MMDiT(compile_blocks=True)``) flex_attention is traced into the
block's graph; eager on CUDA it runs through one ``torch.compile(flex_attention)`` made on first use. Elsewhere it is
torch's unfused reference (materialises the scores: slow, exact). torch has no flex_attention backward on CPU (it
raises); the CPU tests lift that check to run the reference forward and backward. Sequence parallelism and causal
models keep the dense mask (``MMDiT.padding_mask``, ``MMDiT.forward``).
"""

from typing import Sequence

import torch

from .row_lengths import DeviceRowLengths

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # torch < 2.5
    create_block_mask = flex_attention = None

BLOCK_SIZE = 128
_COMPILED = {}  # the torch.compile'd flex_attention for eager CUDA calls, made on first use


def padded_text_mask_mod(lengths: torch.Tensor, num_text: int):
    """``mask_mod`` of a [text ``num_text``, video] sequence whose row ``b`` has ``lengths[b]`` valid text tokens."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= num_text) | (kv_idx < lengths[b])

    return mask_mod


def _flex(q, k, v, block_mask):
    fn = flex_attention
    if q.is_cuda and not torch.compiler.is_compiling():  # unfused eager flex is slow and memory-hungry on GPU
        fn = _COMPILED.get("fn") or _COMPILED.setdefault("fn", torch.compile(flex_attention))
    return fn(q, k, v, block_mask=block_mask)


class FlexRows(DeviceRowLengths):
    """The key mask of a joint [text, video] batch whose row ``b`` has ``lengths[b]`` valid text tokens first, as a
    FlexAttention ``BlockMask`` built once per forward and shared by every block. ``attend`` takes and returns what
    ``attention.attention`` does (its ``backend`` is for SDPA and is ignored here)."""

    def __init__(self, lengths: Sequence[int], num_text: int, num_video: int, device, block_size: int = BLOCK_SIZE):
        if flex_attention is None:
            raise ValueError("padded_text_attention='flex' needs torch >= 2.5 (torch.nn.attention.flex_attention)")
        super().__init__(lengths, num_text, num_video, device, dtype=torch.int32)
        tokens = self.num_text + self.num_video
        mask_mod = padded_text_mask_mod(self.lengths, self.num_text)
        self.block_mask = create_block_mask(
            mask_mod, len(self.lengths), None, tokens, tokens, device=device, BLOCK_SIZE=block_size
        )

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "auto") -> torch.Tensor:
        """[B, heads, T + N, head_dim] q/k/v -> [B, T + N, heads * head_dim]."""
        self.check(q, k)
        batch, heads, tokens, head_dim = q.shape
        if torch.is_autocast_enabled(q.device.type):  # what SDPA's autocast rule does; flex has none
            dtype = torch.get_autocast_dtype(q.device.type)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        out = _flex(q, k, v.contiguous(), self.block_mask)
        return out.transpose(1, 2).reshape(batch, tokens, heads * head_dim)
