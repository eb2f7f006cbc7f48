"""Where cache entries live: the ``CacheStore`` protocol every store answers, the on-device stores, and
``make_store`` (``JanoConfig.store``: ``device`` or ``offload``, the dual-stream ``PackedOffloadManager`` of
packed_offload.py). Other stores measured against these (a naive synchronous offload, a per-entry slot ring) live in
``benchmarks/offload_stores.py``.

A cache policy (``cache.jano``) never knows where its tensors live; it only speaks the protocol's verbs, keyed by
strings. What a store can do beyond them is declared, not probed: ``capturable`` (a CUDA graph of a whole level may
contain its verbs) and ``staged`` (it stages host entries through device slots on streams of its own: the region
graphs then cut a level at its slots and call its verbs in between, see ``StagedStore``).
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Protocol, Sequence, runtime_checkable

import torch

from .config import STORE_KINDS
from .packed_offload import PackedOffloadManager


@runtime_checkable
class CacheStore(Protocol):
    """The verbs of a cache store.

    * ``reserve(key, shape, dtype)``: announce an entry before sampling; ``allocate()`` after the reserves.
    * ``store_async(tensor, key)``: keep ``tensor`` (a fresh tensor the caller will not modify) as entry ``key``;
      ``flush()`` at the end of a step that stored (stores that batch their copies issue them then).
    * ``begin_fetch_step(keys)``: the entries the next forward reads, in reading order; ``hint_upcoming(keys)``: those
      of the steps after it (only where ``wants_hints``).
    * ``fetch(key)``: the entry on the device; ``release(key)``: the caller is done reading it.
    * ``clear()``: a new trajectory; ``device_bytes()``: device memory held.

    Declared capabilities: ``capturable`` (its verbs are device copies and look-ups, so a CUDA graph captures them),
    ``staged`` (a ``StagedStore``), ``wants_hints``, and ``layout``: an object replaced whenever the store makes its
    buffers anew (graphs that read the old ones are stale), or None.
    """

    capturable: bool
    staged: bool
    wants_hints: bool
    layout: Optional[object]

    def reserve(self, key: str, shape: Sequence[int], dtype: torch.dtype) -> None: ...
    def allocate(self) -> None: ...
    def store_async(self, tensor: torch.Tensor, key: str) -> None: ...
    def flush(self) -> None: ...
    def begin_fetch_step(self, keys: Iterable[str]) -> None: ...
    def hint_upcoming(self, keys: Iterable[str]) -> None: ...
    def fetch(self, key: str) -> torch.Tensor: ...
    def release(self, key: str) -> None: ...
    def clear(self) -> None: ...
    def device_bytes(self) -> int: ...


@runtime_checkable
class StagedStore(CacheStore, Protocol):
    """A store that copies entries between host memory and device staging slots on its own streams.

    ``backend`` (``CudaBackend`` or a test fake) and ``store_stream``: where its device -> host copies run (a graphed
    segment's outputs may be overwritten once an event recorded there has passed); ``slot_bytes`` / ``slots``: the
    staging ring; ``chunk_of(keys)``: key -> the prefetch chunk it arrives in when ``keys`` are queued at once (None
    when it does not group entries)."""

    backend: object
    store_stream: object
    slot_bytes: int
    slots: int

    def chunk_of(self, keys: Sequence[str]) -> Optional[Dict[str, int]]: ...


class DeviceStore:
    """Entries stay where they were produced (the on-GPU cache every offload is measured against)."""

    capturable = False
    staged = False
    wants_hints = False  # whether hint_upcoming does anything (callers skip building the keys otherwise)
    layout = None

    def __init__(self):
        self._entries: Dict[str, torch.Tensor] = {}

    def reserve(self, key: str, shape: Sequence[int], dtype: torch.dtype) -> None:
        pass

    def store_async(self, tensor: torch.Tensor, key: str) -> None:
        self._entries[key] = tensor

    def begin_fetch_step(self, keys: Iterable[str]) -> None:
        pass

    def hint_upcoming(self, keys: Iterable[str]) -> None:
        pass

    def fetch(self, key: str) -> torch.Tensor:
        return self._entries[key]

    def release(self, key: str) -> None:
        pass

    def flush(self) -> None:
        """Issue any batched stores now (stores that batch them: ``PackedOffloadManager``)."""

    def allocate(self) -> None:
        """After the reserves: allocate what they announced (stores that defer it: ``PackedOffloadManager``)."""

    def clear(self) -> None:
        self._entries.clear()

    def device_bytes(self) -> int:
        """Bytes of device memory held for the cache."""
        return sum(t.numel() * t.element_size() for t in self._entries.values() if t.device.type != "cpu")


class StaticDeviceStore(DeviceStore):
    """Entries on the device at fixed addresses: one buffer per entry, made at ``reserve``, that every store copies
    into. What a CUDA graph of a level needs (``capturable``: its verbs are device copies and look-ups, so a graph
    captures them); the copy makes it bit-identical to ``DeviceStore``."""

    capturable = True

    def __init__(self, device):
        super().__init__()
        self.device = torch.device(device)
        self.layout = object()  # replaced whenever a buffer is made anew: graphs that read the old ones are stale

    def reserve(self, key: str, shape: Sequence[int], dtype: torch.dtype) -> None:
        buffer = self._entries.get(key)
        if buffer is None or tuple(buffer.shape) != tuple(shape) or buffer.dtype != dtype:
            self._entries[key] = torch.empty(tuple(shape), dtype=dtype, device=self.device)
            self.layout = object()

    def store_async(self, tensor: torch.Tensor, key: str) -> None:
        self.reserve(key, tensor.shape, tensor.dtype)
        self._entries[key].copy_(tensor)

    def clear(self) -> None:
        """Buffers are kept (a refresh writes every entry before a step reads it)."""


def make_store(kind: str, device, graphs: bool = False) -> CacheStore:
    """``"device"`` (caches on the GPU) or ``"offload"`` (``PackedOffloadManager``: what --jano-offload runs).
    ``graphs``: the stores CUDA graphs of the levels read
    at fixed addresses (``StaticDeviceStore``; a ``PackedOffloadManager`` with ``fixed_slots``)."""
    device = torch.device(device)
    if kind == "device" or device.type == "cpu":
        return StaticDeviceStore(device) if graphs and device.type != "cpu" else DeviceStore()
    if kind == "offload" and graphs:
        # graphed levels read a step's entries in segments of one slot each: 8 slots of 32 MiB keep more copies in
        # flight ahead of the replay than 3 of 64 MiB (H100, 1B: +1.9% vs +3.5% over on-GPU caches + graphs)
        return PackedOffloadManager(device, 32 * 2**20, 8, fixed_slots=True)
    if kind == "offload":
        return PackedOffloadManager(device)
    raise ValueError(f"unknown cache store '{kind}'; choose one of {STORE_KINDS}")
