"""One pass that refills the KV cache with a finished chunk and takes the first denoising step of the next chunk.

Streaming (opensora/inference/streaming.py) re-runs every finished chunk once at the context time to store its
keys/values, then starts the next chunk with a pass at the first step time. Both passes attend to the same cache,
and the second depends on the first only through the finished chunk's keys/values, which the first computes. So
they can be one forward of twice the rows:

* rows ``[0, R)``: the finished chunk ``p`` (at the context time, its own RoPE offset) -- the refill pass;
* rows ``[R, 2R)``: the next chunk ``n`` (at its first step time, its own RoPE offset) -- its first step.

Every block gives each row the keys/values ``[text of the row's time | cached video | video of p | video of n]``;
the mask hides ``n`` from the refill rows (they see what the refill pass sees) and shows the rows of ``n`` only the
cached frames that survive the rolling window once ``p`` is appended (they see what the next pass would see after
the refill). Row-wise operations (embeddings, modulation, norms, MLPs, RoPE) are per row, so the result is the two
separate passes' result up to the order of the attention's reductions over the masked-out keys (exactly zero
weight): tests/test_causal_refill.py checks it on CPU fp32. Afterwards ``p``'s video keys/values are appended to the
cache (window rolled), as the refill pass does.

Cost: the same FLOPs as the two passes (plus the ``n``-length keys the refill rows skip), in one launch sequence:
at the batch-1 streaming shapes a pass is latency-bound, so two rows cost little more than one.

With a ``TextKVCache`` holding both times (every chunk after the second) the text rows are not run: each row takes
its own time's cached text keys/values. Otherwise the text rows run and the missing entries are recorded.
"""

from typing import Optional

import torch

from .causal import KVCache, TextKVCache, joint_attention_mask


def _rows(a: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if a is None else torch.cat((a, a))


def refill_and_step(
    model,
    prev_x: torch.Tensor,
    next_x: torch.Tensor,
    *,
    prev_timestep: torch.Tensor,
    next_timestep: torch.Tensor,
    text_emb: torch.Tensor,
    text_mask: Optional[torch.Tensor] = None,
    pooled: Optional[torch.Tensor] = None,
    cond: Optional[torch.Tensor] = None,
    guidance: Optional[torch.Tensor] = None,
    cache: KVCache,
    prev_start: int,
    text_cache: Optional[TextKVCache] = None,
    prev_key=None,
    next_key=None,
) -> torch.Tensor:
    """Velocity of ``next_x`` [R, C, F, H, W] (the chunk right after ``prev_x``, same shape) at ``next_timestep``,
    attending to the cache after ``prev_x`` (at ``prev_timestep``) was stored; stores ``prev_x``'s keys/values in
    ``cache``. Equals ``forward_chunk(prev_x, store_kv=True)`` then ``forward_chunk(next_x, store_kv=False)`` (see
    the module docstring); ``prev_key`` / ``next_key`` are the two passes' ``text_key`` for ``text_cache``."""
    if prev_x.shape != next_x.shape:
        raise ValueError(
            f"the merged pass needs chunks of one shape, got {tuple(prev_x.shape)} and {tuple(next_x.shape)}"
        )
    pt, ph, pw = model.patch_size
    frames = prev_x.shape[2]
    model.check_chunk(cache, prev_start, text_cache, prev_key)
    if text_cache is not None and next_key is None:
        raise ValueError("refill_and_step(text_cache=...) needs next_key too")
    rows = prev_x.shape[0]
    num_text = text_emb.shape[1]
    kv_prev = kv_next = None
    if text_cache is not None:
        text_cache.validate(model, (text_emb, text_mask, pooled, guidance), model.img_in.weight.dtype, prev_x.device)
        kv_prev, kv_next = text_cache.get(prev_key), text_cache.get(next_key)
    cached_text = kv_prev is not None and kv_next is not None

    img, txt, vec, grid = model.embed(
        torch.cat((prev_x, next_x)),
        torch.cat((prev_timestep, next_timestep)),
        _rows(text_emb),
        _rows(pooled),
        _rows(cond),
        _rows(guidance),
        with_text=not cached_text,
    )
    tokens = img.shape[1]
    device = img.device
    tables = [
        model.rope(grid, num_text, device, time_offset=start // pt) for start in (prev_start, prev_start + frames)
    ]
    rope = tuple(
        torch.cat([table[None].expand(rows, -1, -1) for table in pair])[:, None]  # [2R, 1, L + N, D/2]
        for pair in zip(*tables)
    )

    # which held frames the next chunk still sees once the finished chunk is appended (the rolling window)
    survivors = set(cache.frame_ids_after_append(prev_start, frames))
    past_tokens = cache.keys[0].shape[2] if cache.keys[0] is not None else 0
    per_group = tokens // grid[0]
    held = torch.tensor(
        [fid in survivors for fid in cache.frame_ids[::pt]], dtype=torch.bool, device=device
    ).repeat_interleave(per_group)
    own = torch.tensor(
        [fid in survivors for fid in range(prev_start, prev_start + frames, pt)], dtype=torch.bool, device=device
    ).repeat_interleave(per_group)
    ones = torch.ones(tokens, tokens, dtype=torch.bool, device=device)
    refill_rows = torch.cat((torch.ones(tokens, past_tokens, dtype=torch.bool, device=device), ones, ~ones), dim=1)
    step_rows = torch.cat((held.expand(tokens, -1), own.expand(tokens, -1), ones), dim=1)
    mask = torch.cat(
        [
            joint_attention_mask(text_mask, num_text, video).expand(rows, -1, -1, -1)
            for video in (refill_rows, step_rows)
        ]
    )  # [2R, 1, L + N, L + past + 2N]

    pending, entry_prev, entry_next = {}, {}, {}
    if cached_text:
        rope = tuple(table[:, :, num_text:] for table in rope)
        mask = mask[:, :, num_text:]

    def make(index: int):
        past_k, past_v = cache.block(index)
        if cached_text:
            text_k = torch.cat((kv_prev[index][0], kv_next[index][0])).to(img.dtype)
            text_v = torch.cat((kv_prev[index][1], kv_next[index][1])).to(img.dtype)

        def hook(k, v, _key_mask):
            if cached_text:
                tk, tv, video_k, video_v = text_k, text_v, k, v
            else:
                tk, tv, video_k, video_v = (
                    k[:, :, :num_text],
                    v[:, :, :num_text],
                    k[:, :, num_text:],
                    v[:, :, num_text:],
                )
                entry_prev[index] = (tk[:rows].detach().clone(), tv[:rows].detach().clone())
                entry_next[index] = (tk[rows:].detach().clone(), tv[rows:].detach().clone())
            pending[index] = (video_k[:rows], video_v[:rows])
            out = []
            for text, video, past in ((tk, video_k, past_k), (tv, video_v, past_v)):
                parts = [text] if past is None else [text, _rows(past.to(video.dtype))]
                parts += [_rows(video[:rows]), _rows(video[rows:])]
                out.append(torch.cat(parts, dim=2))
            return out[0], out[1], mask

        return hook

    hooks = [make(i) for i in range(cache.num_blocks)]
    out = model.run_blocks(img, txt, vec, rope, mask, hooks)
    from .model import unpatchify

    velocity = unpatchify(out[rows:], grid, model.patch_size)
    if text_cache is not None and not cached_text:
        for key, entry in ((prev_key, entry_prev), (next_key, entry_next)):
            if key not in text_cache.entries:
                text_cache.entries[key] = [entry[i] for i in range(cache.num_blocks)]
    cache.append(pending, prev_start, frames, frames_per_group=pt)
    return velocity
