"""Block-causal MMDiT: attention masks over frame chunks and the streaming KV cache.

``MMDiT(causal_chunk_frames=K)`` with ``K > 0`` splits the latent frames into chunks of ``K`` frames. In every
block's joint attention

* video tokens of chunk ``c`` attend to the (valid) text tokens and to the video tokens of chunks ``<= c``;
* text tokens attend to the text tokens only, so the text stream never depends on the video and a chunk
  generated alone (with the cache holding the earlier chunks) sees exactly the text keys/values the full
  forward computes.

RoPE time ids are absolute latent-frame indices (``start_frame`` of a streamed chunk onward). RoPE makes a video
query's score with a video key depend on their frame distance only, but text tokens sit at RoPE id (0, 0, 0): to
a video query the text keys are an anchor at frame 0, so its text scores depend on its absolute frame index and
leave the training range once a stream passes the training length, whatever the window keeps. Sink frames (kept
forever) are the other such distance (tests/test_rope_positions.py pins both). ``KVCache(rope_anchor="window")``
moves both to the window's start once it rolls (tests/test_rope_anchor.py).

Streaming (``MMDiT.forward_chunk``) runs one chunk with a ``kv_hook`` per block (layers.py) that prepends the
cached keys/values (after RoPE) of the earlier chunks' video tokens and, with ``store_kv=True``, hands the
chunk's own video keys/values to the cache after the forward. Cached tensors are detached: gradients flow
through the chunk's own tokens only (what Self-Forcing trains).
"""

from contextlib import contextmanager
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .patches import unpatchify
from .rope import shift_time_all

ROPE_ANCHORS = ("absolute", "window")  # KVCache(rope_anchor=...): where the text and the sink frames sit in time


def joint_attention_mask(text_mask: Optional[torch.Tensor], num_text: int, video_allowed: torch.Tensor) -> torch.Tensor:
    """Boolean mask [B or 1, 1, L + Nq, L + Nk] for the joint sequence (text first, then video).

    ``video_allowed`` [Nq, Nk]: which video keys each video query may see. Text queries see text keys only;
    every query sees the valid text keys (``text_mask`` [B, L], None = all valid).
    """
    nq, nk = video_allowed.shape
    device = video_allowed.device
    text_rows = torch.cat(
        (
            torch.ones(num_text, num_text, dtype=torch.bool, device=device),
            torch.zeros(num_text, nk, dtype=torch.bool, device=device),
        ),
        dim=1,
    )
    video_rows = torch.cat((torch.ones(nq, num_text, dtype=torch.bool, device=device), video_allowed), dim=1)
    mask = torch.cat((text_rows, video_rows), dim=0)[None, None]
    if text_mask is not None:
        valid = text_mask.to(device=device, dtype=torch.bool)
        keys = torch.cat((valid, valid.new_ones(valid.shape[0], nk)), dim=1)
        mask = mask & keys[:, None, None, :]
    return mask


def text_keys_all_valid(text_mask: Optional[torch.Tensor], has_padding: Optional[bool]) -> bool:
    """Whether every text key is valid, so a pass whose queries are all video tokens (a text-cache hit) may attend
    without a mask: no ``text_mask``, or the caller says it has no padded token (``has_padding=False``). ``None``
    (unknown) keeps the mask: inspecting it would be a host read per pass on a GPU."""
    return text_mask is None or has_padding is False


def block_causal_video_mask(time_patches: int, tokens_per_time_patch: int, chunk_patches: int, device) -> torch.Tensor:
    """[N, N] video-to-video mask of a full block-causal forward: a token's chunk is ``time_index // chunk_patches``
    (in time-patch units); query chunk ``c`` sees key chunks ``<= c``."""
    chunk = (torch.arange(time_patches, device=device) // chunk_patches).repeat_interleave(tokens_per_time_patch)
    return chunk[:, None] >= chunk[None, :]


class KVCache:
    """Per-block keys/values (after RoPE) of the video tokens of frames already generated.

    Args:
        num_blocks: blocks of the model (double + single); ``MMDiT.new_kv_cache`` fills it in.
        window_frames: the most latent frames the cache holds after a store (sink frames included); ``None`` keeps
            everything. A chunk then attends to at most ``window_frames`` earlier frames plus itself, so memory
            stays bounded however long the video gets.
        sink_frames: the first frames ever stored, kept for good when the window rolls (attention sinks,
            LongLive); they count towards ``window_frames``.

        rope_anchor: ``"absolute"`` (default): every frame keeps its absolute time id and the text sits at 0, so once
            the window rolls a query sees the text and the sinks at distances training never had. ``"window"``: the
            text and the sinks sit at the window's start (``anchor``: the oldest kept non-sink frame minus the sink
            frames), so every query-key time distance stays that of a video starting at the anchor. The sink keys
            are re-rotated from their stored originals (no drift) whenever the anchor moves; ``rope_axes`` /
            ``rope_theta`` (the model's RoPE) are then needed.

    Frames are counted in latent frames; with a temporal patch size ``pt > 1`` they come and go in groups of
    ``pt`` (``window_frames`` and ``sink_frames`` must then be multiples of ``pt``).
    """

    def __init__(
        self,
        num_blocks: int,
        window_frames: Optional[int] = None,
        sink_frames: int = 0,
        rope_anchor: str = "absolute",
        rope_axes: Optional[Tuple[int, ...]] = None,
        rope_theta: Optional[float] = None,
    ):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if sink_frames < 0 or (window_frames is not None and window_frames < max(sink_frames, 1)):
            raise ValueError(
                f"need 0 <= sink_frames <= window_frames and window_frames >= 1, "
                f"got window_frames={window_frames}, sink_frames={sink_frames}"
            )
        if rope_anchor not in ROPE_ANCHORS or (rope_anchor == "window" and (rope_axes is None or rope_theta is None)):
            raise ValueError(f"rope_anchor must be one of {ROPE_ANCHORS} (window needs rope_axes and rope_theta)")
        self.num_blocks = int(num_blocks)
        self.window_frames = None if window_frames is None else int(window_frames)
        self.sink_frames = int(sink_frames)
        self.rope_anchor, self.rope_axes, self.rope_theta = rope_anchor, rope_axes, rope_theta
        self.pinned_anchor: Optional[int] = None  # a re-cache's target anchor (``pin_anchor``); kept by clear()
        self.clear()

    # ---- state ----------------------------------------------------------------------------------------------
    def clear(self) -> None:
        """Forget every frame (a new video starts)."""
        self.keys: List[Optional[torch.Tensor]] = [None] * self.num_blocks  # [B, heads, frames * tpf, head_dim]
        self.values: List[Optional[torch.Tensor]] = [None] * self.num_blocks
        self.frame_ids: List[int] = []  # absolute latent-frame index of every held frame, in cache order
        self.tokens_per_frame_group: Optional[int] = None
        self.frames_per_group = 1
        self.sink_keys: Optional[List[torch.Tensor]] = None  # sink keys as stored (anchor 0), once the window rolled
        self.placed_anchor = 0  # the anchor the held sink keys are rotated to

    @property
    def num_frames(self) -> int:
        """Latent frames currently held."""
        return len(self.frame_ids)

    @property
    def end_frame(self) -> int:
        """Absolute index of the frame after the newest held one (0 when empty): where the next chunk starts."""
        return self.frame_ids[-1] + 1 if self.frame_ids else 0

    @property
    def anchor(self) -> int:
        """Latent frame where the text and the sink frames sit for the next chunk: 0 under ``"absolute"``; under
        ``"window"`` the oldest kept non-sink frame minus the sink frames (0 until the window first rolls), or the
        pinned anchor (``pin_anchor``) once every sink frame is held."""
        if self.pinned_anchor is not None and self.rope_anchor == "window" and self.num_frames >= self.sink_frames:
            return self.pinned_anchor
        return self.anchor_of(self.frame_ids)

    def anchor_before(self, start_frame: int) -> int:
        """The anchor a chunk at ``start_frame`` sees once every earlier frame was stored (a pure function of the
        window and sinks: the two-GPU pipeline's prep makes each chunk's RoPE tables ahead of the cache writes)."""
        ids = list(range(start_frame))
        return self.anchor_of(ids if self.window_frames is None else self._kept_ids(ids, self.window_frames))

    def anchor_of(self, frame_ids: Sequence[int]) -> int:
        """The anchor of a cache holding ``frame_ids`` (``anchor``'s rule, without a pin)."""
        sinks = min(self.sink_frames, len(frame_ids))
        if self.rope_anchor != "window" or len(frame_ids) <= sinks:
            return 0
        return max(frame_ids[sinks] - self.sink_frames, 0)

    @contextmanager
    def pin_anchor(self, frame_ids: Sequence[int]):
        """Rebuild the cache as holding ``frame_ids`` (a re-cache: ``inference.streaming.recache``) under their anchor.

        A re-cache stores the kept frames again piece by piece. Under ``"window"`` the anchor of the partly refilled
        cache is not the final one: with only the sinks held it is 0, so the first piece after them would see the
        text and the sinks a whole stream away, as under ``"absolute"``. Pinned, the sink frames are made as a video
        start (text and sinks at 0: while fewer than ``sink_frames`` are held nothing is pinned), then moved to the
        final anchor with the text, and every later piece sees them there: the cache ends as the block-causal forward
        of the kept frames with the video starting at the anchor."""
        self.pinned_anchor = self.anchor_of(list(frame_ids))
        try:
            yield
        finally:
            self.pinned_anchor = None

    @property
    def text_time(self) -> int:
        """The text's RoPE time id (in time patches) for the next chunk."""
        return self.anchor // self.frames_per_group

    @property
    def positions(self) -> List[int]:
        """The time (latent frame) at which each held frame's keys sit, in cache order: ``frame_ids`` with the sink
        frames moved to the anchor."""
        sinks = min(self.sink_frames, self.num_frames)
        return [self.anchor + i for i in range(sinks)] + self.frame_ids[sinks:]

    def place_sinks(self) -> None:
        """Rotate the held sink keys to the current anchor, from their originals (outside any graph: a graph reads
        the cache through copies made when the cache's tensors change)."""
        anchor = self.anchor
        if anchor == self.placed_anchor:
            return
        self.placed_anchor = anchor
        tokens = min(self.sink_frames, self.num_frames) // self.frames_per_group * (self.tokens_per_frame_group or 0)
        if not tokens:
            return
        if self.sink_keys is None:  # the window's first roll: the sinks are still where they were made, at 0
            self.sink_keys = [k[:, :, :tokens].clone() for k in self.keys]
        moved = shift_time_all(self.sink_keys, anchor // self.frames_per_group, *self.rope)
        for i, keys in enumerate(moved):
            # in place: the anchor moves only when trim / truncate just made these tensors, nothing else holds them
            self.keys[i][:, :, :tokens] = keys

    @property
    def rope(self) -> tuple:
        """(axes, theta) of the model's RoPE (``rope_anchor="window"``)."""
        return self.rope_axes, self.rope_theta

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached keys and values."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)

    def block(self, index: int) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        return self.keys[index], self.values[index]

    # ---- updates --------------------------------------------------------------------------------------------
    def append(
        self,
        new: Dict[int, Tuple[torch.Tensor, torch.Tensor]],
        start_frame: int,
        num_frames: int,
        frames_per_group: int = 1,
    ) -> None:
        """Add ``num_frames`` frames starting at absolute frame ``start_frame``; ``new[i]`` holds block ``i``'s
        (keys, values) [B, heads, tokens, head_dim] of those frames. Applies the rolling window."""
        if sorted(new) != list(range(self.num_blocks)):
            raise ValueError(f"append needs keys/values for all {self.num_blocks} blocks, got {len(new)}")
        if num_frames % frames_per_group:
            raise ValueError(f"{num_frames} frames are not whole groups of {frames_per_group} (temporal patch)")
        if self.frame_ids and start_frame < self.end_frame:
            raise ValueError(
                f"frames from {start_frame} overlap the cache, which holds frames up to "
                f"{self.end_frame - 1}; clear() it to start a new video"
            )
        tokens = new[0][0].shape[2]
        per_group = tokens // (num_frames // frames_per_group)
        if self.frame_ids and (per_group, frames_per_group) != (self.tokens_per_frame_group, self.frames_per_group):
            raise ValueError("chunks of different spatial sizes or temporal patch sizes cannot share a cache")
        self.tokens_per_frame_group, self.frames_per_group = per_group, frames_per_group
        if self.window_frames is not None:  # make room first, so the cache never holds more than the window
            self.trim(max(self.window_frames - num_frames, self.sink_frames))
        for i in range(self.num_blocks):
            k, v = (t.detach().contiguous() for t in new[i])  # a copy: the chunk's text keys are not kept
            past_k, past_v = self.keys[i], self.values[i]
            self.keys[i] = k if past_k is None else torch.cat((past_k, k), dim=2)
            self.values[i] = v if past_v is None else torch.cat((past_v, v), dim=2)
        self.frame_ids.extend(range(start_frame, start_frame + num_frames))
        if self.window_frames is not None:
            self.trim(self.window_frames)
        self.place_sinks()

    def frame_ids_after_append(self, start_frame: int, num_frames: int) -> List[int]:
        """The frame ids ``append(..., start_frame, num_frames)`` would leave in the cache (no tensor is touched):
        what the chunk after it sees (``causal_refill.refill_and_step``)."""
        ids = list(self.frame_ids)
        if self.window_frames is not None:
            ids = self._kept_ids(ids, max(self.window_frames - num_frames, self.sink_frames))
        ids += range(start_frame, start_frame + num_frames)
        return ids if self.window_frames is None else self._kept_ids(ids, self.window_frames)

    def _kept_ids(self, ids: List[int], keep_frames: int) -> List[int]:
        """``trim``'s choice on a list of frame ids: the sink frames plus the newest ``keep_frames - sinks``."""
        if len(ids) <= keep_frames:
            return ids
        sinks = min(self.sink_frames, len(ids))
        return ids[:sinks] + ids[sinks + len(ids) - keep_frames :]

    def trim(self, keep_frames: int) -> None:
        """Keep at most ``keep_frames`` frames: the sink frames plus the newest ``keep_frames - sink_frames``."""
        if keep_frames < self.sink_frames:
            raise ValueError(f"keep_frames={keep_frames} is fewer than the {self.sink_frames} sink frames")
        if self.num_frames <= keep_frames:
            return
        group = self.frames_per_group
        sinks = min(self.sink_frames, self.num_frames)
        newest = keep_frames - sinks
        if sinks % group or newest % group:
            raise ValueError(
                f"keep_frames={keep_frames} / sink_frames={self.sink_frames} must be multiples of the "
                f"temporal patch size {group}"
            )
        tpf = self.tokens_per_frame_group // group  # tokens per latent frame (exact: groups are whole)
        sink_tokens, drop_tokens = sinks * tpf, (self.num_frames - keep_frames) * tpf
        for i in range(self.num_blocks):
            for store in (self.keys, self.values):
                t = store[i]
                # a new tensor: a view would keep the dropped frames' memory alive
                store[i] = torch.cat((t[:, :, :sink_tokens], t[:, :, sink_tokens + drop_tokens :]), dim=2)
        self.frame_ids = self._kept_ids(self.frame_ids, keep_frames)

    def truncate(self, num_frames: int) -> None:
        """Keep the oldest ``num_frames`` held frames and forget the rest (a re-cache recomputes the frames after
        them: ``inference.streaming.recache``)."""
        if not 0 <= num_frames <= self.num_frames or num_frames % self.frames_per_group:
            raise ValueError(f"cannot truncate {self.num_frames} frames to {num_frames}")
        if num_frames == self.num_frames:
            return
        if num_frames == 0:
            self.clear()
            return
        tokens = num_frames // self.frames_per_group * self.tokens_per_frame_group
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                store[i] = t[:, :, :tokens].clone()  # a copy: a view would keep the dropped frames' memory alive
        self.frame_ids = self.frame_ids[:num_frames]
        self.place_sinks()


def streaming_kv_hooks(cache: KVCache, num_text: int, mask: torch.Tensor, pending: Optional[Dict[int, tuple]]):
    """One ``kv_hook`` per block for a streamed chunk: [text, cached video, chunk video] keys/values and ``mask``.

    The cached tensors are read once, here, so a hook re-run by activation checkpointing sees the same context.
    With ``pending`` (a dict) each hook records its block's chunk keys/values there for ``KVCache.append``.
    """

    def make(index: int):
        past_k, past_v = cache.block(index)

        def hook(k, v, _key_mask):
            if pending is not None:
                pending[index] = (k[:, :, num_text:], v[:, :, num_text:])
            if past_k is not None:
                if past_k.shape[0] != k.shape[0]:
                    raise ValueError(f"the cache holds a batch of {past_k.shape[0]}, the chunk has {k.shape[0]}")
                k = torch.cat((k[:, :, :num_text], past_k.to(k.dtype), k[:, :, num_text:]), dim=2)
                v = torch.cat((v[:, :, :num_text], past_v.to(v.dtype), v[:, :, num_text:]), dim=2)
            return k, v, mask

        return hook

    return [make(i) for i in range(cache.num_blocks)]


class TextKVCache:
    """Per-(block, pass key) keys/values (after RoPE) of the text tokens of a causal MMDiT, reused across chunks.

    In a block-causal model text queries attend to text keys only (``joint_attention_mask``), so every block's text
    hidden states and keys/values are a function of (text_emb, text_mask, pooled, guidance, timestep) and of the
    weights alone, never of the video. A streamed pass whose text inputs and timestep match an earlier pass can
    therefore take the text keys/values that pass computed and run the blocks on its video tokens only (no text
    rows, no text-side matmuls): the video rows see the same keys, values and mask rows, and every per-token op
    (norms, modulation, MLPs, RoPE) is row-wise, so the result is the same computation minus the text rows.

    ``key``: a host value (hashable) that the caller ties to the pass's timestep (and anything else in ``vec`` that
    is not a tensor checked here), e.g. the step time as a Python float: reading the timestep tensor would be a
    host sync per pass. One entry per distinct key holds ``num_blocks`` (keys, values) pairs
    [rows, heads, text tokens, head_dim]; CFG's null-text rows are rows of the same entry.

    Invalidation (no host sync): the entries are dropped when the text tensors passed in are not the very tensors
    (same objects, unmodified in place) the entries were made from, or when the compute dtype, the device, the model
    or its weights (in-place version counters) change. Weights updated between passes (training) thus refill; a
    parameter *object* swapped into the model (``load_state_dict(assign=True)``) is not seen: ``clear()`` then.
    """

    def __init__(self, num_blocks: int, rope: Optional[tuple] = None):
        self.num_blocks = int(num_blocks)
        self.entries: Dict[object, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
        # text time id an entry's keys were rotated at (absent: 0), and the last re-rotated copy per key
        self.text_times: Dict[object, int] = {}
        self._moved: Dict[object, tuple] = {}
        self.rope = rope  # (axes, theta) of the model's RoPE: moves entries to another text time id
        self._inputs: Tuple = ()
        self._signature: Tuple = ()
        self._model, self._params = None, []
        self.hits = self.misses = 0

    def clear(self) -> None:
        self.entries.clear()
        self.text_times.clear()
        self._moved.clear()
        self._inputs, self._signature = (), ()

    @property
    def nbytes(self) -> int:
        """Bytes held: text keys and values of every block for every cached key."""
        return sum(t.numel() * t.element_size() for entry in self.entries.values() for kv in entry for t in kv)

    def validate(self, model, text_inputs: Tuple[Optional[torch.Tensor], ...], dtype, device) -> None:
        """Drop every entry unless ``text_inputs`` (text_emb, text_mask, pooled, guidance) are the tensors the
        entries were made from and the dtype, device and weights are unchanged (metadata checks only)."""
        same_inputs = len(self._inputs) == len(text_inputs) and all(a is b for a, b in zip(self._inputs, text_inputs))
        versions = tuple(t._version if t is not None else None for t in text_inputs)
        if self._model is not model:  # walking the module tree costs ~0.5 ms a pass at 24 blocks: once per model
            self._model, self._params = model, list(model.parameters())
        weights = tuple(p._version for p in self._params)  # in-place updates (optimiser steps, loads) bump these
        signature = (versions, weights, dtype, str(device), torch.is_autocast_enabled(device.type))
        if not same_inputs or signature != self._signature:
            self.clear()
            self._inputs, self._signature = tuple(text_inputs), signature

    def get(self, key, text_time: int = 0) -> Optional[List[Tuple[torch.Tensor, torch.Tensor]]]:
        """The entry of ``key`` with its keys at RoPE time id ``text_time`` (re-rotated from the stored keys when
        they were made at another one; the copy is kept until the time changes, so a graph copies it once)."""
        entry = self.entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        delta = text_time - self.text_times.get(key, 0)
        if not delta:
            return entry
        moved = self._moved.get(key)
        if moved is None or moved[0] != text_time or moved[1] is not entry:
            if self.rope is None:
                raise ValueError("moving cached text keys to another time id needs the model's RoPE (rope=...)")
            keys = shift_time_all([k for k, _ in entry], delta, *self.rope)
            shifted = [(k, v) for k, (_, v) in zip(keys, entry)]
            moved = self._moved[key] = (text_time, entry, shifted)
        return moved[2]

    def put(self, key, entry: List[Tuple[torch.Tensor, torch.Tensor]], text_time: int = 0) -> None:
        """Store ``key``'s per-block text keys/values, made at RoPE time id ``text_time``."""
        self.entries[key] = entry
        self.text_times[key] = text_time
        self._moved.pop(key, None)


def text_filling_hooks(hooks: List, text_cache_entry: Dict[int, tuple], num_text: int) -> List:
    """Wrap ``streaming_kv_hooks``: each block also records its text keys/values (a copy, so the chunk's video
    keys are not kept alive) into ``text_cache_entry[index]``."""

    def wrap(index: int, inner):
        def hook(k, v, mask):
            text_cache_entry[index] = (k[:, :, :num_text].detach().clone(), v[:, :, :num_text].detach().clone())
            return inner(k, v, mask)

        return hook

    return [wrap(i, h) for i, h in enumerate(hooks)]


def cached_text_kv_hooks(
    cache: KVCache,
    text_kv: List[Tuple[torch.Tensor, torch.Tensor]],
    mask: torch.Tensor,
    pending: Optional[Dict[int, tuple]],
):
    """``kv_hook`` per block of a video-only pass (the text rows were not run): keys/values become [cached text,
    cached video, chunk video] -- the order ``streaming_kv_hooks`` builds -- and ``mask`` holds the video query
    rows only. With ``pending`` each hook records the chunk's video keys/values for ``KVCache.append``."""

    def make(index: int):
        past_k, past_v = cache.block(index)
        text_k, text_v = text_kv[index]

        def hook(k, v, _key_mask):
            if pending is not None:
                pending[index] = (k, v)
            if past_k is not None and past_k.shape[0] != k.shape[0]:
                raise ValueError(f"the cache holds a batch of {past_k.shape[0]}, the chunk has {k.shape[0]}")
            if text_k.shape[0] != k.shape[0]:
                raise ValueError(f"the text cache holds a batch of {text_k.shape[0]}, the chunk has {k.shape[0]}")
            ks = (text_k.to(k.dtype), k) if past_k is None else (text_k.to(k.dtype), past_k.to(k.dtype), k)
            vs = (text_v.to(v.dtype), v) if past_v is None else (text_v.to(v.dtype), past_v.to(v.dtype), v)
            return torch.cat(ks, dim=2), torch.cat(vs, dim=2), mask

        return hook

    return [make(i) for i in range(cache.num_blocks)]


def fold_chunks(tensor: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """[B, C, T, H, W] -> [B * n, C, T / n, H, W], chunk-major within each sample (row ``b * n + c``)."""
    b, c, t, h, w = tensor.shape
    return tensor.reshape(b, c, num_chunks, t // num_chunks, h, w).transpose(1, 2).reshape(b * num_chunks, c, -1, h, w)


def unfold_chunks(tensor: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """Inverse of ``fold_chunks``."""
    bn, c, tc, h, w = tensor.shape
    tensor = tensor.reshape(bn // num_chunks, num_chunks, c, tc, h, w).transpose(1, 2)
    return tensor.reshape(-1, c, num_chunks * tc, h, w)


def sibling_kv_hook(num_chunks: int, num_text: int, mask: torch.Tensor):
    """``kv_hook`` of the per-chunk-timestep forward: row ``b * n + c`` holds [text_c, video chunk c] of sample b;
    its keys/values become [text_c, video chunks 0..n-1 of sample b] and ``mask`` hides the chunks after c."""

    def hook(k, v, _key_mask):
        out = []
        for t in (k, v):
            bn, heads, _, dim = t.shape
            video = t[:, :, num_text:].reshape(bn // num_chunks, num_chunks, heads, -1, dim).transpose(1, 2)
            video = video.reshape(bn // num_chunks, 1, heads, -1, dim).expand(-1, num_chunks, -1, -1, -1)
            out.append(torch.cat((t[:, :, :num_text], video.reshape(bn, heads, -1, dim)), dim=2))
        return out[0], out[1], mask

    return hook


def per_chunk_timestep_forward(model, x, timestep, text_emb, text_mask, pooled, cond=None, guidance=None):
    """Full block-causal forward where chunk ``c`` of sample ``b`` is at time ``timestep[b, c]`` (diffusion forcing,
    causal ODE initialisation). The text stream is modulated by the timestep, so chunk ``c``'s video attends to the
    text computed at its own time -- what streaming that chunk computes. Implementation: every chunk becomes a row
    of the batch with its own text copy and conditioning vector; a ``kv_hook`` lets each row attend to the video
    keys/values of its sample's earlier chunks (``sibling_kv_hook``). Costs ``n`` copies of the text stream and of
    the video keys/values per block (n = chunks), which is fine at chunk counts of a few."""
    pt = model.patch_size[0]
    chunk = model.causal_chunk_frames
    b, _, t, h, w = x.shape
    n = t // chunk
    if t % chunk or timestep.shape != (b, n):
        raise ValueError(
            f"per-chunk timesteps for {t} frames in chunks of {chunk} must be [B, {t // chunk}] and the "
            f"frames a multiple of the chunk, got timestep {tuple(timestep.shape)}"
        )
    if model.sp is not None:
        raise ValueError("a causal MMDiT does not support sequence parallelism")
    rows = lambda a: None if a is None else a.repeat_interleave(n, dim=0)  # noqa: E731
    img, txt, vec, grid = model.embed(
        fold_chunks(x, n),
        timestep.reshape(-1),
        rows(text_emb),
        rows(pooled),
        None if cond is None else fold_chunks(cond, n),
        rows(guidance),
    )
    num_text, chunk_tokens = txt.shape[1], img.shape[1]
    cos, sin = zip(*(model.rope(grid, num_text, x.device, time_offset=c * (chunk // pt)) for c in range(n)))
    rope = tuple(torch.stack(table).repeat(b, 1, 1)[:, None] for table in (cos, sin))  # [B n, 1, L + Nc, D/2]
    key_chunk = torch.arange(n, device=x.device).repeat_interleave(chunk_tokens)
    video = (key_chunk[None, None, :] <= torch.arange(n, device=x.device)[:, None, None]).expand(n, chunk_tokens, -1)
    masks = torch.stack([joint_attention_mask(None, num_text, video[c])[0] for c in range(n)])  # [n, 1, Lq, Lk]
    mask = masks.repeat(b, 1, 1, 1)
    if text_mask is not None:
        valid = rows(text_mask).to(torch.bool)
        mask = mask & torch.cat((valid, valid.new_ones(b * n, n * chunk_tokens)), dim=1)[:, None, None, :]
    hooks = [sibling_kv_hook(n, num_text, mask)] * (len(model.double_blocks) + len(model.single_blocks))
    out = model.run_blocks(img, txt, vec, rope, mask, hooks)
    return unfold_chunks(unpatchify(out, grid, model.patch_size), n)
