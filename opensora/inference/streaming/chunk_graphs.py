"""CUDA graphs for streamed chunk passes (``MMDiT.forward_chunk``), GPU only, off by default.

A batch-1 streamed pass is ~1.3k tokens through every block: on a GPU its time goes to launching the few thousand
kernels, not to running them. Once its shapes are fixed the pass can be captured once and replayed: what fixes the
shapes is (rows, chunk frames, text tokens, cached video tokens, text-cache hit or not), so a video needs a handful
of graphs (the cached frames grow until the rolling window is full, then stay), and they are kept across videos.

Replay = copy the pass's inputs into the graph's static buffers, replay, copy the outputs out:

* static per shape (shared by the graphs of every step time): x, timestep, cond, text embedding / mask / pooled
  vector, RoPE tables (they depend on the chunk's absolute start frame) and the joint mask. Inputs that are the same
  tensor objects as at the last copy (text, the RoPE tables and mask, which are made once per chunk) are not copied
  again;
* static per cache shape (``GraphMemory.past``, shared by every pass shape that reads a cache of that size, also by
  ``MergedGraphs``): the cached video keys/values of every block, copied when the cache holds new tensors;
* static per text-cache key (step time), shared by that time's graphs: the text keys/values of a text-cache hit,
  copied once per video (when the text cache hands over new tensors); they hold as much memory as the text cache;
* outputs: the velocity, the chunk's video keys/values (storing passes only: ``store_kv`` is part of a graph's key)
  and, on a text-cache miss, the text keys/values, copied inside the graph into buffers shared by all graphs
  (``GraphMemory.output``) and cloned out after the replay; one memory pool for all graphs. So a graph holds no
  memory of its own beyond its pool's share, and peak memory does not grow when a longer video meets new shapes
  (the refill at a full window, a shorter last chunk).

The captured body is ``MMDiT.chunk_body``, the same code as the eager pass, so the result is the eager result up to
the kernels cuBLAS/cuDNN choose inside a capture (tests/test_chunk_graphs_gpu.py bounds the difference). The first
pass of every shape runs the body twice on a side stream (warm-up) and captures it: slower than eager once. If a
capture fails, that shape runs eagerly from then on (``failures`` records why). Off the GPU, with gradients
enabled, or without a text cache every call is plain ``forward_chunk``.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from opensora.models.mmdit.causal import text_keys_all_valid
from opensora.models.mmdit.graph_memory import GraphMemory, on_capture_device

from ..graphs import PassGraphFamily, StaticInputs, clone, clone_tree, describe_inputs


class _Graph:
    def __init__(self):
        self.replay = None  # set by ChunkGraphs._record
        self.text_kv: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None  # static, on a text-cache hit
        self.out = None  # the outputs below live in the shared buffers of ``GraphMemory``
        self.pending: Optional[Dict[int, tuple]] = None  # the chunk's video keys/values (a storing pass only)
        self.entry: Optional[Dict[int, tuple]] = None  # the text keys/values (a text-cache miss only)


class ChunkGraphs(PassGraphFamily):
    """Replays ``model.forward_chunk`` passes as CUDA graphs (see the module docstring); call it like
    ``forward_chunk`` (keywords ``timestep, text_emb, text_mask, pooled, cond, cache, start_frame, store_kv,
    text_cache, text_key``)."""

    def __init__(self, model, memory: Optional[GraphMemory] = None):
        super().__init__(memory)
        self.model = model
        self._prelude: Optional[tuple] = None  # (key, text mask, RoPE tables, mask) of the last chunk
        self.text_statics: Dict[tuple, list] = {}  # (text key, shape, dtype, device) -> [buffers, last source]

    def _text_buffers(self, text_key, text_kv):
        """Static text keys/values for ``text_key``, shared by the graphs of every cached-frame count (one copy per
        distinct time, not per graph), refreshed when the text cache hands over other tensors (a new video)."""
        k0 = text_kv[0][0]
        key = (text_key, tuple(k0.shape), k0.dtype, k0.device)
        holder = self.text_statics.get(key)
        if holder is None:  # the source is held weakly: the last video's text cache is not kept alive
            holder = self.text_statics[key] = [[(clone(k), clone(v)) for k, v in text_kv], weakref.ref(k0)]
        elif holder[1]() is not k0:  # entries are made once per key and video: block 0's keys stand for them all
            for (dk, dv), (sk, sv) in zip(holder[0], text_kv):
                dk.copy_(sk)
                dv.copy_(sv)
            holder[1] = weakref.ref(k0)
        return holder[0]

    def _rope_mask(
        self, x, text_mask, num_text: int, past: int, start_frame: int, with_mask: bool = True, text_time: int = 0
    ):
        """``chunk_rope_mask``, kept for the passes of one chunk (same start frame, cached frames and text mask: its
        steps, then its refill): the same tensor objects then need no copy into the static buffers either. Only the
        last chunk's are kept: every chunk has a start frame of its own, so a cache of several entries would hold
        one mask per chunk, and peak memory would grow with the video until the cache is full."""
        key = (
            tuple(x.shape[2:]),
            x.device,
            num_text,
            past,
            start_frame,
            id(text_mask),
            None if text_mask is None else text_mask._version,
            with_mask,
            text_time,
        )
        if self._prelude is None or self._prelude[0] != key or self._prelude[1] is not text_mask:
            self._prelude = None  # the previous chunk's tables go before this chunk's are made
            tables = self.model.chunk_rope_mask(x, text_mask, num_text, past, start_frame, with_mask, text_time)
            self._prelude = (key, text_mask, *tables)
        return self._prelude[2], self._prelude[3]

    def __call__(
        self,
        x,
        *,
        timestep,
        text_emb,
        text_mask=None,
        pooled=None,
        cond=None,
        cache,
        start_frame: int,
        store_kv: bool,
        text_cache=None,
        text_key=None,
        text_mask_has_padding=None,
    ) -> torch.Tensor:
        model = self.model
        eager = dict(
            timestep=timestep,
            text_emb=text_emb,
            text_mask=text_mask,
            pooled=pooled,
            cond=cond,
            cache=cache,
            start_frame=start_frame,
            store_kv=store_kv,
            text_cache=text_cache,
            text_key=text_key,
            text_mask_has_padding=text_mask_has_padding,
        )
        if not self.usable(x) or torch.is_grad_enabled() or text_cache is None:
            self.eager += 1
            return model.forward_chunk(x, **eager)
        model.check_chunk(cache, start_frame, text_cache, text_key)
        text_cache.validate(model, (text_emb, text_mask, pooled, None), model.img_in.weight.dtype, x.device)
        past = cache.keys[0].shape[2] if cache.keys[0] is not None else 0
        # a text-cached pass with every text key valid attends without a mask (forward_chunk)
        with_mask = text_key not in text_cache.entries or not text_keys_all_valid(text_mask, text_mask_has_padding)
        # the text's time id enters through the RoPE tables, an input: a moved anchor needs no new graph
        rope, mask = self._rope_mask(x, text_mask, text_emb.shape[1], past, start_frame, with_mask, cache.text_time)
        inputs = dict(
            x=x,
            timestep=timestep,
            text_emb=text_emb,
            text_mask=text_mask,
            pooled=pooled,
            cond=cond,
            cos=rope[0],
            sin=rope[1],
            mask=mask,
        )
        num_blocks = len(model.double_blocks) + len(model.single_blocks)
        return self.stage(
            inputs,
            0,
            num_blocks,
            num_text=text_emb.shape[1],
            cache=cache,
            text_cache=text_cache,
            text_key=text_key,
            store_kv=store_kv,
            start_frame=start_frame,
            eager=lambda: model.forward_chunk(x, **eager),
        )

    def stage(
        self,
        inputs: Dict[str, Optional[torch.Tensor]],
        lo: int,
        hi: int,
        *,
        num_text: int,
        cache,
        text_cache,
        text_key,
        store_kv: bool,
        start_frame: int,
        eager,
        grid: Optional[tuple] = None,
        fresh: Tuple[str, ...] = ("x", "timestep"),
        slot=None,
    ):
        """``MMDiT.chunk_stage(inputs, lo, hi, ...)`` replayed as a CUDA graph: the whole pass (``__call__``) or one
        pipeline stage's block range (``pipeline_parallel.stages``), with ``cache`` / ``text_cache`` over blocks lo..hi-1.
        ``inputs`` as ``chunk_stage`` takes them; ``fresh``: the inputs copied on every call (the others only when
        they are other tensors than at the last copy); ``slot``: keeps separate static buffers per work item (e.g.
        per prompt group of the two-GPU pipeline) so items taking turns do not recopy each other's caches; ``eager``: the
        same pass run eagerly (a shape whose capture failed). Appends to the caches as ``forward_chunk`` does and
        returns ``chunk_stage``'s result (cloned out of the graph's memory)."""
        model = self.model
        past = cache.keys[0].shape[2] if cache.keys[0] is not None else 0
        frames = None
        if "x" in inputs:
            frames = inputs["x"].shape[2]
        shape = (lo, hi, slot, past, grid, describe_inputs(inputs))
        hit = text_key in text_cache.entries
        key = (shape, text_key if hit else None, hit, bool(store_kv))
        if shape in self.failed:
            self.eager += 1
            return eager()
        text_kv = text_cache.get(text_key, cache.text_time)  # re-rotated copies are new tensors: copied in once
        statics = self.statics.get(shape)
        if statics is None:
            statics = self.statics[shape] = StaticInputs(inputs)
        for name, source in inputs.items():
            if source is not None:
                statics.load(name, source, always=name in fresh)
        static_past = self.memory.past(cache, slot)
        text_static = None if text_kv is None else self._text_buffers((slot, text_key), text_kv)
        graph = self.graphs.get(key)
        if graph is None:
            device = next(t.device for t in statics.inputs.values() if t is not None)
            try:
                with on_capture_device(device):  # the stage's device, whatever the caller's current device is
                    graph = self._capture(statics, static_past, text_static, lo, hi, num_text, grid, store_kv)
            except Exception as error:  # noqa: BLE001  (a capture that fails leaves the eager path)
                self.failed.add(shape)
                self.failures.append(f"{type(error).__name__}: {error}")
                warnings.warn(f"CUDA graph capture failed for a streamed chunk shape, running it eagerly: {error}")
                if torch.cuda.is_available() and device.type == "cuda":
                    torch.cuda.synchronize(device)
                self.eager += 1
                return eager()
            self.graphs[key] = graph
            self.captures += 1
        graph.replay()
        self.replays += 1
        out = clone_tree(graph.out)
        if graph.entry is not None:
            entry = [tuple(clone(t) for t in graph.entry[i]) for i in range(cache.num_blocks)]
            text_cache.put(text_key, entry, cache.text_time)
        if store_kv:
            new = {i: tuple(clone(t) for t in graph.pending[i]) for i in range(cache.num_blocks)}
            if frames is None:
                frames = grid[0] * model.patch_size[0]
            cache.append(new, start_frame, frames, frames_per_group=model.patch_size[0])
        return out

    def _capture(self, statics: StaticInputs, past, text_static, lo, hi, num_text: int, grid, store: bool) -> _Graph:
        """A graph of ``chunk_stage`` on ``statics`` and the static cached video ``past`` (and, on a text-cache hit,
        the static text keys/values); the chunk's keys/values are an output of storing passes only. Outputs are
        copied into ``memory``'s shared buffers inside the graph (a graph keeps none of its pool alive)."""
        model, graph, s, memory = self.model, _Graph(), statics.inputs, self.memory
        graph.text_kv = text_static

        def body():
            pending = {} if store else None
            entry = {} if text_static is None else None
            out = model.chunk_stage(s, lo, hi, num_text, past, graph.text_kv, pending, entry, grid)
            graph.out = memory.output_tree("out", out)
            graph.pending = memory.output_kv("pending", pending)
            graph.entry = memory.output_kv("entry", entry)

        self._record(graph, body)
        return graph

    def _record(self, graph: _Graph, body) -> None:
        """Warm ``body`` up, capture it into a CUDA graph in ``memory``'s pool, and make ``graph.replay`` replay it.
        (tests/test_streaming.py swaps this for an eager replay to check the buffer plumbing on a CPU.)"""
        cuda_graph = self.memory.capture(body)
        graph.replay = cuda_graph.replay
        graph.cuda_graph = cuda_graph
