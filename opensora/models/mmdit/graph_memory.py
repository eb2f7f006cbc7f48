"""Memory shared by the CUDA graphs of the streaming sampler (``chunk_graphs.ChunkGraphs``, ``causal_refill.MergedGraphs``).

A video needs one graph per pass shape, step time and text-cache state, and the set grows with the length: the refill
at a full rolling window, or a shorter last chunk, appear only in videos longer than the training clip. What a graph
keeps alive must therefore not depend on how many graphs exist, or peak memory grows with the length. Here:

* one memory pool for every graph that shares a ``GraphMemory`` (the activations of a pass are freed at the end of its
  capture and reused by the next capture: the pool holds about one pass's working memory, not one per graph);
* outputs are copied, inside the graph, into static buffers shared by every graph whose output has that name, shape
  and dtype (the caller clones them out after each replay, before the next one): a graph keeps no tensor of its own
  pool alive, so in particular no view that pins a whole per-block key/value tensor;
* static inputs that every replay reloads anyway (the merged pass's text keys/values) are shared the same way;
* the static copy of the cached video (the KV cache of the rolling window) is one set of buffers per cache shape,
  shared by every pass shape that reads a cache of that size, loaded when the cache holds other tensors than at the
  last load.

Streams and pools belong to one device: a ``GraphMemory`` keeps a pool per device, and the side and capture streams
are one per device (``capture`` runs on the device it is given, by default the current one; ``on_capture_device``
makes the device of a capture's tensors the current one). Graphs sharing a pool must be replayed one at a time in
stream order; graphs replayed beside them on another stream (the chunk decode of ``streaming.StreamingGenerator``)
get a ``GraphMemory`` of their own, on another capture lane (their own cuBLAS workspace: ``graph_capture_stream``).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Dict, List, Optional

import torch

_SIDE_STREAMS: Dict[int, "torch.cuda.Stream"] = {}
_CAPTURE_STREAMS: Dict[tuple, "torch.cuda.Stream"] = {}


def device_index(device=None) -> int:
    """The CUDA device index of ``device`` (a ``torch.device``, a string, an int), the current device for None or an
    index-less ``cuda``."""
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def on_capture_device(device):
    """``torch.cuda.device(device)`` for a CUDA device, a no-op context otherwise: wrap a capture in the device of its
    tensors, so the side and capture streams (keyed by the current device) are that device's even when the caller's
    current device is another one (a pipeline stage on cuda:1, a generator on cuda:1 run from cuda:0)."""
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def capture_side_stream(device=None) -> "torch.cuda.Stream":
    """The side stream every CUDA-graph warm-up of the streaming sampler runs on (one per device, for the process).
    cuBLAS keeps a workspace (32 MiB on Hopper) for every stream it ever ran on, until the process ends, so a fresh
    stream per capture leaves ~33 MiB of allocated memory behind each time (up to the 32 streams of PyTorch's pool).
    A stream belongs to one device: the stream of ``device`` (default: the current one) is made on that device."""
    index = device_index(device)
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def graph_capture_stream(lane: str, device=None) -> "torch.cuda.Stream":
    """The stream graphs of ``lane`` are captured on (one per device and lane, for the process). cuBLAS takes its
    workspace per (handle, stream) and a captured matmul keeps the capture stream's workspace: graphs captured on one
    stream must never run at the same time, so graphs replayed concurrently (the chunk passes and the chunk decode)
    are captured on different lanes. Never leave the stream to ``torch.cuda.graph``: its default capture stream is
    one for the process, made on whichever device was current at its first use, so a capture on another device
    would begin on a stream of the wrong device (its kernels run outside the capture: an empty or invalidated graph)."""
    key = (device_index(device), lane)
    if key not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[key] = torch.cuda.Stream(device=key[0])
    return _CAPTURE_STREAMS[key]


class StaticPast:
    """``KVCache``'s ``num_blocks`` / ``block(i)`` over static buffers (entries None when nothing is cached)."""

    def __init__(self, keys: List[Optional[torch.Tensor]], values: List[Optional[torch.Tensor]]):
        self.keys, self.values, self.num_blocks = keys, values, len(keys)
        self.source = None  # weak reference to the cache's block-0 keys last copied in

    def block(self, index: int):
        return self.keys[index], self.values[index]

    def load(self, cache) -> None:
        """Copy ``cache``'s tensors in, unless these very tensors were the last copied (a cache replaces its tensors
        whenever it changes: append and trim make new ones)."""
        if cache.keys[0] is None or (self.source is not None and self.source() is cache.keys[0]):
            return
        for i in range(self.num_blocks):
            self.keys[i].copy_(cache.keys[i])
            self.values[i].copy_(cache.values[i])
        self.source = weakref.ref(cache.keys[0])


class GraphMemory:
    """The pool, shared output buffers and shared cached-video buffers of a family of CUDA graphs (module docstring)."""

    def __init__(self, lane: str = "passes"):
        self.lane = lane  # graphs of different lanes may run concurrently (``graph_capture_stream``)
        self.pools: Dict[int, tuple] = {}  # device index -> pool handle, set by the first capture on that device
        self.outputs: Dict[tuple, torch.Tensor] = {}
        self.pasts: Dict[tuple, StaticPast] = {}

    def output(self, name: str, value: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``value`` copied into the shared buffer for (``name``, its shape, dtype, device); returns the buffer. Called
        inside a captured body: the copy is part of the graph. The buffer is made on the first (warm-up) call,
        outside any capture. Also a static input shared by graphs that load it before every replay."""
        if value is None:
            return None
        key = (name, tuple(value.shape), value.dtype, value.device)
        buffer = self.outputs.get(key)
        if buffer is None:
            buffer = self.outputs[key] = torch.empty_like(value, memory_format=torch.contiguous_format)
        buffer.copy_(value)
        return buffer

    def output_tree(self, name: str, value):
        """``output`` over a tensor, None, or a dict of those (a pipeline stage's output)."""
        if isinstance(value, dict):
            return {k: self.output(f"{name}.{k}", v) for k, v in value.items()}
        return self.output(name, value)

    def output_kv(self, name: str, kv: Optional[Dict[int, tuple]]) -> Optional[Dict[int, tuple]]:
        """``output`` over per-block (keys, values) pairs."""
        if kv is None:
            return None
        return {i: tuple(self.output(f"{name}.{i}.{j}", t) for j, t in enumerate(pair)) for i, pair in kv.items()}

    def past(self, cache, slot=None) -> StaticPast:
        """The static cached-video buffers for ``cache``'s current shape (per ``slot``), loaded with its tensors."""
        if cache.keys[0] is None:
            return StaticPast([None] * cache.num_blocks, [None] * cache.num_blocks)
        k0 = cache.keys[0]
        key = (slot, cache.num_blocks, tuple(k0.shape), tuple(cache.values[0].shape), k0.dtype, k0.device)
        past = self.pasts.get(key)
        if past is None:
            past = self.pasts[key] = StaticPast(
                [torch.empty_like(k) for k in cache.keys], [torch.empty_like(v) for v in cache.values]
            )
        past.load(cache)
        return past

    def capture(self, body, device=None) -> "torch.cuda.CUDAGraph":
        """Warm ``body`` up twice on the capture side stream, then capture it into this memory's pool, all on
        ``device`` (default: the current device; its side stream, capture stream and pool: a stream and a pool belong
        to one device). A capture that fails gives its pool up: ``CUDAGraph.capture_end`` raises at
        ``cudaStreamEndCapture`` before it tells the allocator the capture ended, so the pool stays "recording" and
        every later capture into it would fail with "beginAllocateToPool: already recording to mempool_id" (the
        graphs captured into it before keep it alive; later captures on that device start a fresh pool)."""
        index = device_index(device)
        with torch.cuda.device(index):
            side = capture_side_stream(index)  # one per device: a fresh stream per capture leaves a cuBLAS workspace
            side.wait_stream(torch.cuda.current_stream(index))
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up outside the capture (cuBLAS handles/workspaces, lazy initialisation)
                    body()
            torch.cuda.current_stream(index).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self.pools.get(index), stream=graph_capture_stream(self.lane, index)):
                    body()
            except BaseException:
                self.pools.pop(index, None)
                raise
            self.pools[index] = graph.pool()
        return graph

    @property
    def nbytes(self) -> int:
        """Bytes of the shared output and cached-video buffers (the pool is not counted)."""
        tensors = list(self.outputs.values())
        for past in self.pasts.values():
            tensors += [t for t in (*past.keys, *past.values) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)
