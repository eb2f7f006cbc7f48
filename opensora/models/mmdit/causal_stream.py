"""Streaming a block-causal MMDiT chunk by chunk: ``CausalStreaming``, the part of ``MMDiT`` that runs one chunk
against a ``KVCache`` (and a ``TextKVCache``) of the chunks before it.

A mixin rather than a wrapper: ``MMDiT.forward(kv_cache=...)`` runs ``forward_chunk`` through the module's own
``forward``, so a training wrapper's hooks (Self-Forcing rolls the student out through them) see streamed passes
too. Every method here drives the model's own pieces (``embed``, ``run_block_range``, ``final_tokens``) with the
cache hooks of causal.py on the blocks' ``kv_hook`` seam; the two-GPU pipeline runs ``chunk_stage`` on the two
halves of the blocks, so a stage computes exactly what one device does.
"""

from typing import Optional

import torch

from .causal import (
    KVCache,
    TextKVCache,
    cached_text_kv_hooks,
    joint_attention_mask,
    streaming_kv_hooks,
    text_filling_hooks,
    text_keys_all_valid,
)
from .patches import unpatchify


class CausalStreaming:
    """``forward_chunk`` and its pieces, mixed into ``MMDiT`` (see the module docstring). Needs the host model's
    ``causal_chunk_frames``, ``patch_size``, ``sp``, ``img_in``, blocks, ``rope``, ``embed``, ``run_block_range`` and
    ``final_tokens``."""

    def new_text_cache(self) -> TextKVCache:
        """An empty ``TextKVCache`` (causal.py) for ``forward_chunk(text_cache=...)``."""
        return TextKVCache(len(self.double_blocks) + len(self.single_blocks), (tuple(self.axes_dims), self.theta))

    def new_kv_cache(
        self, window_frames: Optional[int] = None, sink_frames: int = 0, rope_anchor: str = "absolute"
    ) -> KVCache:
        """An empty ``KVCache`` for this model's blocks (see causal.py for the window, sink frames and anchor)."""
        blocks = len(self.double_blocks) + len(self.single_blocks)
        return KVCache(blocks, window_frames, sink_frames, rope_anchor, tuple(self.axes_dims), self.theta)

    def forward_chunk(
        self,
        x: torch.Tensor,
        *,
        timestep: torch.Tensor,
        text_emb: torch.Tensor,
        text_mask: Optional[torch.Tensor] = None,
        pooled: Optional[torch.Tensor] = None,
        cond: Optional[torch.Tensor] = None,
        guidance: Optional[torch.Tensor] = None,
        cache: KVCache,
        start_frame: int,
        store_kv: bool,
        text_cache: Optional[TextKVCache] = None,
        text_key=None,
        text_mask_has_padding: Optional[bool] = None,
    ) -> torch.Tensor:
        """Velocity for one chunk ``x`` [B, C, Tc, H, W] at absolute latent frame ``start_frame``, attending to the
        frames held by ``cache`` and to itself; the other inputs as for ``forward`` (all by keyword). ``store_kv=True`` appends the chunk's keys/values to the cache (and
        rolls its window) after the forward; ``False`` leaves the cache as it was. Gradients flow through the
        chunk's own tokens (the cache is detached).

        ``text_cache`` (a ``TextKVCache``) with ``text_key`` (a host value standing for this pass's timestep, e.g. the
        step time as a float): the first pass with a key runs as usual and records every block's text keys/values;
        later passes with that key (and the same text tensors, dtype, device and weights: ``TextKVCache.validate``)
        run the video tokens only against the recorded text keys/values. Same result, fewer tokens per pass; no
        gradient reaches the text stream through a cached pass (the text rows are not run). Such a pass attends
        without a mask when no text token is padding (no ``text_mask``, or ``text_mask_has_padding=False``): every
        key is then visible to every query, and SDPA may take the flash / cuDNN kernels."""
        self.check_chunk(cache, start_frame, text_cache, text_key)
        text_kv = None
        if text_cache is not None:
            text_cache.validate(self, (text_emb, text_mask, pooled, guidance), self.img_in.weight.dtype, x.device)
            text_kv = text_cache.get(text_key, cache.text_time)
        past = cache.keys[0].shape[2] if cache.keys[0] is not None else 0
        with_mask = text_kv is None or not text_keys_all_valid(text_mask, text_mask_has_padding)
        rope, mask = self.chunk_rope_mask(
            x, text_mask, text_emb.shape[1], past, start_frame, with_mask, text_time=cache.text_time
        )
        pending = {} if store_kv else None
        entry = {} if text_cache is not None and text_kv is None else None
        out = self.chunk_body(x, timestep, text_emb, pooled, cond, guidance, rope, mask, cache, text_kv, pending, entry)
        if entry is not None:
            text_cache.put(text_key, [entry[i] for i in range(text_cache.num_blocks)], cache.text_time)
        if store_kv:
            cache.append(pending, start_frame, x.shape[2], frames_per_group=self.patch_size[0])
        return out

    def check_chunk(self, cache: KVCache, start_frame: int, text_cache=None, text_key=None) -> None:
        """``forward_chunk``'s argument checks."""
        if not self.causal_chunk_frames:
            raise ValueError("forward_chunk needs a causal MMDiT (causal_chunk_frames > 0)")
        if self.sp is not None:
            raise ValueError("forward_chunk does not support sequence parallelism")
        pt = self.patch_size[0]
        if start_frame < 0 or start_frame % pt:
            raise ValueError(f"start_frame={start_frame} must be a non-negative multiple of the temporal patch {pt}")
        if cache.num_frames and start_frame < cache.end_frame:
            raise ValueError(f"chunk at frame {start_frame} overlaps the cache (frames up to {cache.end_frame - 1})")
        if text_cache is not None and text_key is None:
            raise ValueError("forward_chunk(text_cache=...) needs text_key, a host value identifying the timestep")

    def chunk_rope_mask(
        self, x, text_mask, num_text: int, past_tokens: int, start_frame: int, with_mask=True, text_time: int = 0
    ):
        """RoPE tables of [text, chunk video] (video time ids from ``start_frame``, text at ``text_time``: the
        cache's ``text_time``) and the joint mask
        [B or 1, 1, L + N, L + past + N] of a streamed chunk: video queries see the valid text, the cached video
        and the chunk; text queries see the text only. ``with_mask=False``: no mask (None), for a text-cached pass
        whose text keys are all valid."""
        pt, ph, pw = self.patch_size
        grid = (x.shape[2] // pt, x.shape[3] // ph, x.shape[4] // pw)
        rope = self.rope(grid, num_text, x.device, time_offset=start_frame // pt, text_time=text_time)
        if not with_mask:
            return rope, None
        return rope, self.chunk_mask(text_mask, num_text, grid[0] * grid[1] * grid[2], past_tokens, x.device)

    @staticmethod
    def chunk_mask(text_mask, num_text: int, tokens: int, past_tokens: int, device) -> torch.Tensor:
        """The joint mask of ``chunk_rope_mask`` for a chunk of ``tokens`` video tokens after ``past_tokens``."""
        video = torch.ones(tokens, past_tokens + tokens, dtype=torch.bool, device=device)
        return joint_attention_mask(text_mask, num_text, video)

    def chunk_body(self, x, timestep, text_emb, pooled, cond, guidance, rope, mask, past, text_kv, pending, entry):
        """The model part of ``forward_chunk`` (no host reads, fixed shapes for fixed inputs: what a CUDA graph can
        capture). ``past``: anything with ``num_blocks`` and ``block(i) -> (keys, values)`` of the cached video
        (a ``KVCache``); ``text_kv``: the text keys/values per block of a text-cache hit (None: run the text rows);
        ``pending`` / ``entry`` (dicts or None) receive each block's chunk video / text keys/values.

        It is ``chunk_stage`` over every block: the two-GPU pipeline (``inference.pipeline_parallel.streaming_stages``) runs ``chunk_stage`` on
        the two halves of the blocks, so it cannot compute anything else."""
        inputs = dict(x=x, timestep=timestep, text_emb=text_emb, pooled=pooled, cond=cond, guidance=guidance, mask=mask)
        inputs.update(cos=rope[0], sin=rope[1])
        num_blocks = len(self.double_blocks) + len(self.single_blocks)
        return self.chunk_stage(inputs, 0, num_blocks, text_emb.shape[1], past, text_kv, pending, entry)

    def chunk_stage(self, inputs: dict, lo: int, hi: int, num_text: int, past, text_kv, pending, entry, grid=None):
        """Blocks ``lo..hi-1`` of a streamed pass (``chunk_body``'s other arguments; ``past``, ``text_kv``,
        ``pending`` and ``entry`` indexed from ``lo``). ``inputs`` (tensors only, what a CUDA graph keeps static):
        ``cos``, ``sin`` (RoPE tables of [text, video]), ``mask`` (``chunk_rope_mask``'s) and either the pass's
        inputs ``x``, ``timestep``, ``text_emb``, ``pooled``, ``cond``, ``guidance`` (``lo == 0``: ``chunk_start``
        first) or an earlier stage's output (``img`` + ``txt``, or ``tokens``, and ``vec``). Returns the velocity
        when the range ends with the last block (``grid``: the chunk's patch grid, found from ``x`` when it is an
        input), else that output: ``img`` / ``txt`` or ``tokens`` (text rows first, none in a text-cache hit) and
        ``vec``."""
        if "x" in inputs:
            state, vec, grid = self.chunk_start(
                inputs["x"],
                inputs["timestep"],
                inputs["text_emb"],
                inputs["pooled"],
                inputs.get("cond"),
                inputs.get("guidance"),
                text_kv is not None,
            )
        elif "tokens" in inputs:
            state, vec = dict(tokens=inputs["tokens"], num_text=0 if text_kv is not None else num_text), inputs["vec"]
        else:
            state, vec = dict(img=inputs["img"], txt=inputs.get("txt")), inputs["vec"]
        rope = (inputs["cos"], inputs["sin"])
        state = self.chunk_blocks(state, vec, rope, inputs["mask"], num_text, lo, hi, past, text_kv, pending, entry)
        if hi == len(self.double_blocks) + len(self.single_blocks):
            return self.chunk_finish(state, vec, grid)
        state.pop("num_text", None)
        return dict(state, vec=vec)

    def chunk_start(self, x, timestep, text_emb, pooled, cond, guidance, cached_text: bool):
        """A streamed pass's embeddings -> (state for ``chunk_blocks``, conditioning vector, patch grid); a pass
        whose text keys/values come from the text cache (``cached_text``) skips the text embedding."""
        img, txt, vec, grid = self.embed(x, timestep, text_emb, pooled, cond, guidance, with_text=not cached_text)
        return dict(img=img, txt=txt), vec, grid

    def chunk_blocks(self, state, vec, rope, mask, num_text: int, lo: int, hi: int, past, text_kv, pending, entry):
        """Blocks ``lo..hi-1`` of a streamed pass (``chunk_body``'s arguments; ``past``, ``text_kv``, ``pending``
        and ``entry`` are indexed from ``lo``: block ``lo`` is their entry 0). ``rope`` / ``mask``: the full
        [text, video] tables and mask of ``chunk_rope_mask``; a text-cache hit (``text_kv``) runs the video rows."""
        if text_kv is not None:  # video rows only: [L:] of the RoPE tables and of the mask's query rows
            rope = tuple(table[num_text:] for table in rope)
            mask = None if mask is None else mask[:, :, num_text:]
            hooks = cached_text_kv_hooks(past, text_kv, mask, pending)
        else:
            hooks = streaming_kv_hooks(past, num_text, mask, pending)
            if entry is not None:
                hooks = text_filling_hooks(hooks, entry, num_text)
        return self.run_block_range(state, lo, hi, vec, rope, mask, hooks)

    def chunk_finish(self, state, vec, grid) -> torch.Tensor:
        """Final layer + unpatchify after the last block of a streamed pass."""
        return unpatchify(self.final_tokens(state, vec), grid, self.patch_size)
