"""Padded prompts at the cost of their valid tokens: trim the text of a batch, skip the rest of the padding.

T5 pads every prompt to its maximum length (512 tokens), while real prompts hold 20-120. Padded text tokens only
matter as attention keys, where the key mask hides them; as queries they compute outputs nobody reads (the video
output never depends on them: text RoPE ids are all zero, every other op is per token). So two exact savings:

* ``trim_text``: cut the text columns after the longest valid prompt of the batch, rounded up to
  ``TEXT_LENGTH_MULTIPLE`` so a training run sees few text lengths (few compiled graphs); a batch whose rows all
  have the same valid length (every batch of one) is cut to exactly that length, so no padding is left at all;
* the rows that still hold padding attend as ``MMDiT(padded_text_attention=...)`` says:
  ``zero_key_attention.ZeroKeyRows`` (the default: padded keys zeroed, the unmasked kernel, its output corrected),
  a dense key mask over the trimmed text, ``packed_attention.PackedRows`` (one variable-length flash call),
  ``flex_attention.FlexRows`` (FlexAttention skipping the padded key blocks), or
  ``padded_text_keys`` -> ``attention.KeyRanges`` (one mask-free SDPA call per row over its valid text and video
  tokens, padded queries output zeros; cuDNN builds an execution plan per new row length, ~0.1 s once per prompt
  length per run, which ``warm_attention_lengths`` pays up front). MMDiT's docstring has the measured step times.

All equal the masked computation on the video output and every gradient (tests/test_text_padding.py). ``MMDiT``
applies them in training mode (``model.train()``: the trained networks); eval-mode passes (sampling, frozen teachers)
keep the dense mask, which the sampler's pipeline stages, region caches and CUDA graphs reproduce bit for bit.
Reading the valid lengths is one small host read per forward when the mask lives on the GPU; inside a CUDA graph
capture nothing is read and the dense mask path runs unchanged.
"""

from typing import List, Optional, Sequence, Tuple

import torch

from .attention import KeyRanges, attention

TEXT_LENGTH_MULTIPLE = 32  # trimmed text lengths are multiples of this (at most 16 lengths for 512-token prompts)


def valid_prefix_lengths(text_mask: torch.Tensor) -> Optional[List[int]]:
    """Per row, the number of valid tokens when they form a prefix (what tokenizers that pad on the right give),
    else ``None``; one host read of ``2 B`` integers."""
    mask = text_mask.bool()
    lengths = mask.sum(-1)
    positions = torch.arange(mask.shape[-1], device=mask.device)
    prefix = (mask == (positions < lengths[:, None])).all(-1)
    lengths, prefix = torch.stack((lengths, prefix.long())).tolist()
    return lengths if all(prefix) else None


def trimmed_length(lengths: Sequence[int], max_length: int, multiple: int = TEXT_LENGTH_MULTIPLE) -> int:
    """The text length a batch keeps: its longest valid prompt rounded up to ``multiple``, at most ``max_length``
    and at least 1 (a batch of empty prompts keeps one, masked, column); exactly the valid length when every row
    has the same one (then no row has padding left and attention runs without a mask or per-row calls).

    The exact cut costs no more compiled graphs than rounding: Dynamo compiles the first text length statically
    and, at the second, recompiles once with the length symbolic (automatic dynamic shapes), which then serves
    every length >= 2; only a one-token text (a null prompt) costs one more double-block graph, as a size-1
    dimension is always specialised (tests/test_mmdit_compile.py). Each exact length is one attention shape, as each
    row's call of the per-row path was."""
    if lengths and min(lengths) == max(lengths) > 0:
        return min(lengths[0], max_length)
    return rounded_text_length(max(lengths, default=0), max_length, multiple)


def rounded_text_length(longest: int, max_length: int, multiple: int = TEXT_LENGTH_MULTIPLE) -> int:
    """``longest`` valid tokens rounded up to ``multiple``, at most ``max_length`` and at least 1."""
    return min(max_length, -(-max(int(longest), 1) // multiple) * multiple)


def trim_text(
    text_emb: torch.Tensor,
    text_mask: Optional[torch.Tensor],
    has_padding: Optional[bool] = None,
    multiple: int = TEXT_LENGTH_MULTIPLE,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[List[int]]]:
    """``(text_emb, text_mask, lengths)`` with the columns after the batch's longest valid prompt cut off
    (``trimmed_length``). ``lengths``: each row's valid prefix length, or ``None`` when nothing was read: no mask,
    ``has_padding=False`` (the caller says there is none), a CUDA graph being captured (no host reads there), or a
    mask whose valid tokens are not a prefix (then nothing is cut)."""
    if text_mask is None or has_padding is False:
        return text_emb, text_mask, None
    if text_mask.is_cuda and torch.cuda.is_current_stream_capturing():
        return text_emb, text_mask, None
    if text_mask.shape != text_emb.shape[:2]:
        raise ValueError(
            f"text_mask {tuple(text_mask.shape)} must be [B, L] of text_emb {tuple(text_emb.shape[:2])} (B, L)"
        )
    lengths = valid_prefix_lengths(text_mask)
    if lengths is None:
        return text_emb, text_mask, None
    keep = trimmed_length(lengths, text_emb.shape[1], multiple)
    return text_emb[:, :keep], text_mask[:, :keep], lengths


def trim_text_to_bound(
    text_emb: torch.Tensor, text_mask: torch.Tensor, bound: int, multiple: int = TEXT_LENGTH_MULTIPLE
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(text_emb, text_mask)`` cut to ``bound`` rounded up to ``multiple`` (at most their length), where ``bound`` is
    a host int the caller knows to be at least every row's valid length (e.g. read from the loader's host mask):
    nothing is read back from the device. The rows' padding is then handled from the device mask
    (``ZeroKeyRows.from_key_mask`` or the dense key mask). A bound below a row's valid length would cut valid tokens, so
    the cut columns are checked on the device without a host wait (``torch._assert_async``: a device-side error)."""
    if bound < 0:
        raise ValueError(f"text_length_bound must be >= 0, got {bound}")
    keep = rounded_text_length(bound, text_emb.shape[1], multiple)
    if keep < text_mask.shape[1]:
        torch._assert_async(~text_mask[:, keep:].bool().any(), "text_length_bound is below a row's valid length")
    return text_emb[:, :keep], text_mask[:, :keep]


def padded_text_keys(
    lengths: Sequence[int], num_text: int, num_video: int, queries_at_keys: bool = True
) -> Optional[KeyRanges]:
    """The key mask of a joint [text, video] sequence whose row ``b`` has ``lengths[b]`` valid text tokens first,
    as ``KeyRanges``; ``None`` when no row has padding (then SDPA runs without a mask). ``queries_at_keys=False``
    for a pass whose queries are not its keys (a region cache adds the keys of tokens it did not recompute)."""
    if all(length >= num_text for length in lengths):
        return None
    total = num_text + num_video
    ranges = [((0, min(length, num_text)), (num_text, total)) for length in lengths]
    return KeyRanges(ranges, queries_at_keys=queries_at_keys)


def warm_attention_lengths(num_heads: int, head_dim: int, num_video: int, lengths, device, dtype) -> None:
    """Run attention forward and backward once for each valid text length in ``lengths`` (a row of
    ``length + num_video`` tokens), so the kernels' per-shape set-up (cuDNN's execution plans, ~0.1 s each) happens
    here and not in the first training steps that meet each prompt length. Optional: a run pays the same once per
    new length as it goes."""
    for length in lengths:
        shape = (1, num_heads, int(length) + num_video, head_dim)
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        attention(q, k, v).sum().backward()
