"""One pass that refills the KV cache with a finished chunk and takes the first denoising step of the next chunk.

Streaming (opensora/inference/streaming/generator.py) re-runs every finished chunk once at the context time to store its
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

Mask-free form (``split_keys``, ``split_attention_hook``): when the text cache holds both times and no text token is
padding, the mask is only there to give the two halves different key sets, so each block instead makes two SDPA
calls without a mask (``attention.RowGroups``): the refill rows over ``[text | cached video | p]`` (exactly the
separate refill pass's keys) and the step rows over ``[text | surviving cached video | surviving frames of p | n]``
(the survivors as host-int slices, fixed per cache state, so a CUDA graph captures them; no frame dropped: whole
tensors). No mask is built or read, the refill rows no longer score ``n``'s keys nor the step rows the dropped
frames, and on a GPU both calls may take the flash / cuDNN kernels (with a mask SDPA converts it to an additive
bias and runs cuDNN with a bias, or the memory-efficient kernel). Padded text, and the pass that runs the text rows,
keep the masked form.

Cost: the same FLOPs as the two passes (the masked form adds the ``n``-length keys of the refill rows), in one
launch sequence: at the batch-1 streaming shapes a pass is latency-bound, so two rows cost little more than one.

With a ``TextKVCache`` holding both times (every chunk after the second) the text rows are not run: each row takes
its own time's cached text keys/values. Otherwise the text rows run and the missing entries are recorded.

``MergedGraphs`` replays the merged pass as a CUDA graph per shape (inputs copied into static buffers,
outputs cloned out), like ``opensora.inference.streaming.chunk_graphs`` does for the single-chunk passes.
"""

import warnings
from typing import Dict, List, Optional, Tuple

import torch

from .attention import RowGroups
from .causal import KVCache, TextKVCache, joint_attention_mask, text_keys_all_valid
from .graph_memory import GraphMemory, StaticPast, on_capture_device
from .patches import unpatchify


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
    graphs: Optional["MergedGraphs"] = None,
    text_mask_has_padding: Optional[bool] = None,
) -> torch.Tensor:
    """Velocity of ``next_x`` [R, C, F, H, W] (the chunk right after ``prev_x``, same shape) at ``next_timestep``,
    attending to the cache after ``prev_x`` (at ``prev_timestep``) was stored; stores ``prev_x``'s keys/values in
    ``cache``. Equals ``forward_chunk(prev_x, store_kv=True)`` then ``forward_chunk(next_x, store_kv=False)`` (see
    the module docstring); ``prev_key`` / ``next_key`` are the two passes' ``text_key`` for ``text_cache``.
    ``graphs``: replay the pass as a CUDA graph when both text entries are cached (GPU, no grad).
    ``text_mask_has_padding=False`` (or no ``text_mask``): no text token is padding, so a text-cached pass runs
    mask-free (``split_keys``); None (unknown) keeps the mask (``causal.text_keys_all_valid``)."""
    if prev_x.shape != next_x.shape:
        raise ValueError(
            f"the merged pass needs chunks of one shape, got {tuple(prev_x.shape)} and {tuple(next_x.shape)}"
        )
    model.check_chunk(cache, prev_start, text_cache, prev_key)
    if text_cache is not None and next_key is None:
        raise ValueError("refill_and_step(text_cache=...) needs next_key too")
    kv_prev = kv_next = None
    if text_cache is not None:
        text_cache.validate(model, (text_emb, text_mask, pooled, guidance), model.img_in.weight.dtype, prev_x.device)
        kv_prev, kv_next = text_cache.get(prev_key), text_cache.get(next_key)
    text_kv = None
    if kv_prev is not None and kv_next is not None:
        text_kv = [(torch.cat((a[0], b[0])), torch.cat((a[1], b[1]))) for a, b in zip(kv_prev, kv_next)]
    num_text = text_emb.shape[1]
    split = None
    if text_kv is not None and text_keys_all_valid(text_mask, text_mask_has_padding):
        split = split_keys(model, prev_x, cache, prev_start)
        rope, mask = merged_rope(model, prev_x, num_text, prev_start, cached_text=True), None
    else:
        rope, mask = merged_rope_mask(model, prev_x, text_mask, num_text, cache, prev_start, text_kv is not None)
    inputs = dict(
        x=torch.cat((prev_x, next_x)),
        timestep=torch.cat((prev_timestep, next_timestep)),
        text_emb=None if text_kv is not None else _rows(text_emb),  # a text-cached pass does not read it
        pooled=_rows(pooled),
        cond=_rows(cond),
        guidance=_rows(guidance),
        cos=rope[0],
        sin=rope[1],
        mask=mask,
    )
    if graphs is not None and graphs.usable(prev_x):
        velocity, pending, entries = graphs(inputs, num_text, cache, text_kv, split)
    else:
        velocity, pending, entries = merged_body(model, inputs, num_text, cache, text_kv, split)
    if text_cache is not None and entries is not None:
        for key, entry in zip((prev_key, next_key), entries):
            if key not in text_cache.entries:
                text_cache.entries[key] = [entry[i] for i in range(cache.num_blocks)]
    cache.append(pending, prev_start, prev_x.shape[2], frames_per_group=model.patch_size[0])
    return velocity


def _grid(model, x: torch.Tensor) -> tuple:
    pt, ph, pw = model.patch_size
    return x.shape[2] // pt, x.shape[3] // ph, x.shape[4] // pw


def merged_rope(model, prev_x, num_text: int, prev_start: int, cached_text: bool):
    """RoPE tables [2R, 1, L + N, D/2] of the merged pass, each half at its chunk's offset ([2R, 1, N, D/2], the
    video rows only, when ``cached_text``)."""
    pt, rows, frames = model.patch_size[0], prev_x.shape[0], prev_x.shape[2]
    grid = _grid(model, prev_x)
    tables = [
        model.rope(grid, num_text, prev_x.device, time_offset=start // pt)
        for start in (prev_start, prev_start + frames)
    ]
    rope = tuple(torch.cat([table[None].expand(rows, -1, -1) for table in pair])[:, None] for pair in zip(*tables))
    return tuple(table[:, :, num_text:] for table in rope) if cached_text else rope


def _survivors(model, prev_x, cache: KVCache, prev_start: int) -> Tuple[List[bool], List[bool], int]:
    """Per time patch of the held video and of the finished chunk: whether the next chunk still sees it once the
    finished chunk is appended (the rolling window); and the video tokens per time patch."""
    pt, frames = model.patch_size[0], prev_x.shape[2]
    survivors = set(cache.frame_ids_after_append(prev_start, frames))
    held = [fid in survivors for fid in cache.frame_ids[::pt]]
    own = [fid in survivors for fid in range(prev_start, prev_start + frames, pt)]
    grid = _grid(model, prev_x)
    return held, own, grid[1] * grid[2]


def _runs(keep: List[bool], per_group: int) -> Tuple[Tuple[int, int], ...]:
    """Token ranges [start, stop) of the kept time patches, adjacent ones joined."""
    runs: List[List[int]] = []
    for i, kept in enumerate(keep):
        if kept and runs and runs[-1][1] == i * per_group:
            runs[-1][1] += per_group
        elif kept:
            runs.append([i * per_group, (i + 1) * per_group])
    return tuple((a, b) for a, b in runs)


def split_keys(model, prev_x, cache: KVCache, prev_start: int) -> Tuple[Tuple[Tuple[int, int], ...], ...]:
    """Which video keys the next chunk's rows of a mask-free merged pass see: (token ranges of the held video, token
    ranges of the finished chunk) that survive the rolling window once the finished chunk is appended (host ints,
    fixed per cache state: a CUDA graph captures the slices). No frame dropped: ``((0, past),), ((0, N),)``."""
    held, own, per_group = _survivors(model, prev_x, cache, prev_start)
    return _runs(held, per_group), _runs(own, per_group)


def merged_rope_mask(model, prev_x, text_mask, num_text: int, cache: KVCache, prev_start: int, cached_text: bool):
    """RoPE tables [2R, 1, L + N, D/2] (each half at its chunk's offset) and the mask [2R, 1, L + N, L + past + 2N]
    of the masked merged pass (query rows of the video only when ``cached_text``): see the module docstring."""
    rows, device = prev_x.shape[0], prev_x.device
    grid = _grid(model, prev_x)
    tokens = grid[0] * grid[1] * grid[2]
    rope = merged_rope(model, prev_x, num_text, prev_start, cached_text)
    held, own, per_group = _survivors(model, prev_x, cache, prev_start)
    past_tokens = cache.keys[0].shape[2] if cache.keys[0] is not None else 0
    held, own = (torch.tensor(m, dtype=torch.bool).to(device).repeat_interleave(per_group) for m in (held, own))
    ones = torch.ones(tokens, tokens, dtype=torch.bool, device=device)
    refill_rows = torch.cat((torch.ones(tokens, past_tokens, dtype=torch.bool, device=device), ones, ~ones), dim=1)
    step_rows = torch.cat((held.expand(tokens, -1), own.expand(tokens, -1), ones), dim=1)
    mask = torch.cat(
        [
            joint_attention_mask(text_mask, num_text, video).expand(rows, -1, -1, -1)
            for video in (refill_rows, step_rows)
        ]
    )
    return rope, mask[:, :, num_text:] if cached_text else mask


def merged_body(model, inputs: Dict[str, Optional[torch.Tensor]], num_text: int, past, text_kv, split=None):
    """The model part of the merged pass on the doubled ``inputs`` (``refill_and_step``): no host reads, fixed shapes
    (what a CUDA graph captures). ``past``: ``num_blocks`` / ``block(i)`` of the cached video; ``text_kv``: per block
    the text keys/values of the 2R rows (None: run the text rows). ``split`` (``split_keys``; text-cached passes
    only): attend without a mask, the two halves of the rows to key sets of their own (``split_attention_hook``);
    None: ``inputs["mask"]`` over the union of the keys. Returns (velocity of the next chunk, the finished chunk's
    video keys/values per block, the text entries (prev, next) recorded when the text rows ran, or None)."""
    x = inputs["x"]
    rows = x.shape[0] // 2
    mask = inputs["mask"]
    img, txt, vec, grid = model.embed(
        x,
        inputs["timestep"],
        inputs["text_emb"],
        inputs["pooled"],
        inputs["cond"],
        inputs["guidance"],
        with_text=text_kv is None,
    )
    pending, entry_prev, entry_next = {}, {}, {}

    def make(index: int):
        past_k, past_v = past.block(index)
        if split is not None:
            return split_attention_hook(index, text_kv[index], past_k, past_v, split, pending)

        def hook(k, v, _key_mask):
            if text_kv is not None:
                tk, tv = (t.to(k.dtype) for t in text_kv[index])
                video_k, video_v = k, v
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
            for text, video, held in ((tk, video_k, past_k), (tv, video_v, past_v)):
                parts = [text] if held is None else [text, _rows(held.to(video.dtype))]
                parts += [_rows(video[:rows]), _rows(video[rows:])]
                out.append(torch.cat(parts, dim=2))
            return out[0], out[1], mask

        return hook

    hooks = [make(i) for i in range(past.num_blocks)]
    out = model.run_blocks(img, txt, vec, (inputs["cos"], inputs["sin"]), mask, hooks)
    entries = None if text_kv is not None else (entry_prev, entry_next)
    return unpatchify(out[rows:], grid, model.patch_size), pending, entries


def split_attention_hook(index: int, text_kv, past_k, past_v, split, pending: dict):
    """``kv_hook`` of block ``index`` in a mask-free merged pass (text-cached: the rows are video tokens): the refill
    rows ``[0, R)`` get ``[text at the context time | cached video | finished chunk]`` (the separate refill pass's
    keys), the step rows ``[R, 2R)`` get ``[text at the step time | surviving cached video | surviving frames of the
    finished chunk | next chunk]`` (the next pass's keys after the append), as an ``attention.RowGroups``: two SDPA
    calls without a mask (flash / cuDNN on a GPU) instead of one masked call over ``[.. | finished | next]``."""
    held_runs, own_runs = split

    def hook(k, v, _key_mask):
        rows = k.shape[0] // 2
        pending[index] = (k[:rows], v[:rows])
        groups = []
        for t, held, text in ((k, past_k, text_kv[0]), (v, past_v, text_kv[1])):
            text, done = text.to(t.dtype), t[:rows]
            held = None if held is None else held.to(t.dtype)
            refill = [text[:rows]] + ([] if held is None else [held]) + [done]
            step = [text[rows:]] + [held[:, :, a:b] for a, b in held_runs] + [done[:, :, a:b] for a, b in own_runs]
            groups.append((torch.cat(refill, dim=2), torch.cat(step + [t[rows:]], dim=2)))
        (k_refill, k_step), (v_refill, v_step) = groups
        return RowGroups(((0, rows, k_refill, v_refill), (rows, 2 * rows, k_step, v_step)))

    return hook


class MergedGraphs:
    """CUDA graphs of the merged pass (``merged_body``), one per input shape and text-cache state (the first merged
    pass of a video runs the text rows: its context time is not cached yet), kept across videos: the inputs and the
    text keys/values are copied into static buffers before each replay, the cached video into the shared buffers of
    ``memory`` (``GraphMemory``: pass the ``ChunkGraphs``' one so both share the pool, the outputs and the cached
    video), and the outputs (velocity, the finished chunk's keys/values, new text entries), written into shared
    buffers inside the graph, are cloned out after it. A shape whose capture fails runs eagerly from then on
    (``failures``)."""

    def __init__(self, model, memory: Optional[GraphMemory] = None):
        self.model = model
        self.memory = memory if memory is not None else GraphMemory()
        self.graphs: Dict[tuple, object] = {}
        self.failures: List[str] = []
        self.captures = self.replays = 0

    @staticmethod
    def usable(x: torch.Tensor) -> bool:
        return x.is_cuda and torch.cuda.is_available() and not torch.is_grad_enabled()

    def __call__(self, inputs, num_text: int, cache: KVCache, text_kv, split=None):
        past_k = cache.keys[0]
        key = tuple((n, None if t is None else (tuple(t.shape), t.dtype)) for n, t in inputs.items())
        text_shape = None if text_kv is None else tuple(text_kv[0][0].shape)
        key += (None if past_k is None else tuple(past_k.shape), text_shape, num_text, inputs["x"].device, split)
        entry = self.graphs.get(key)
        past = self.memory.past(cache) if entry is not False else None
        if entry is None:
            try:
                with on_capture_device(inputs["x"].device):  # the pass's device, whatever the current device is
                    entry = self.graphs[key] = self._capture(inputs, num_text, past, text_kv, split)
                self.captures += 1
            except Exception as error:  # noqa: BLE001  (a capture that fails leaves the eager path)
                self.failures.append(f"{type(error).__name__}: {error}")
                warnings.warn(f"CUDA graph capture of the merged refill pass failed, running it eagerly: {error}")
                torch.cuda.synchronize(inputs["x"].device)
                entry = self.graphs[key] = False
        if entry is False:
            return merged_body(self.model, inputs, num_text, cache, text_kv, split)
        static, text, replay, holder = entry
        for name, t in inputs.items():
            if t is not None:
                static[name].copy_(t)
        for (dk, dv), (sk, sv) in zip(text or (), text_kv or ()):
            dk.copy_(sk)
            dv.copy_(sv)
        replay()
        self.replays += 1
        velocity, pending, entries = holder["out"]
        copy = lambda kv: {i: (k.clone(), v.clone()) for i, (k, v) in kv.items()}  # noqa: E731
        return velocity.clone(), copy(pending), None if entries is None else tuple(copy(e) for e in entries)

    def _capture(self, inputs, num_text: int, past: StaticPast, text_kv, split):
        clone = lambda t: None if t is None else t.detach().clone()  # noqa: E731
        static = {name: clone(t) for name, t in inputs.items()}
        holder, memory = {}, self.memory
        # reloaded before every replay: one set of buffers for all merged graphs (not 2 x the text cache per graph)
        text = None if text_kv is None else list(memory.output_kv("merged-text", dict(enumerate(text_kv))).values())

        def body():
            velocity, pending, entries = merged_body(self.model, static, num_text, past, text, split)
            if entries is not None:
                entries = tuple(memory.output_kv(f"merged-entry{j}", e) for j, e in enumerate(entries))
            holder["out"] = (memory.output("merged-out", velocity), memory.output_kv("pending", pending), entries)

        return static, text, self._record(body), holder

    def _record(self, body):
        """Warm ``body`` up and capture it in ``memory``'s pool; returns the replay function.
        (tests/test_causal_refill.py swaps this for an eager replay to check the plumbing on a CPU.)"""
        return self.memory.capture(body).replay

    @property
    def summary(self) -> dict:
        return dict(graphs=len(self.graphs), captures=self.captures, replays=self.replays, failures=self.failures)
