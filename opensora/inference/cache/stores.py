"""Cache stores for inference caches (Jano region cache): on the device, a naive synchronous CPU offload, and two
dual-stream prefetching managers (spec: seeds/jano_offload_manager.md): ``PackedOffloadManager`` (what
``--jano-offload`` runs: one pinned block, chunked prefetch, batched stores; built for the least host time per step,
see its docstring) and ``OffloadManager`` below (one pinned buffer and one copy + events per entry, a staging-slot
cache keyed by entry version; measured 2026-11-23 to cost far more host time than the region forward can spare).

All of them answer the same verbs, keyed by strings, so a cache policy never knows where its tensors live:

* ``reserve(key, shape, dtype)``: announce an entry before sampling (the offload manager allocates its pinned CPU
  buffer here, once; a later ``reserve`` with the same shape and dtype reuses it).
* ``store_async(tensor, key)``: keep ``tensor`` (a fresh tensor the caller will not modify) as entry ``key``.
* ``begin_fetch_step(keys)``: the entries the next forward will read, in the order it reads them.
* ``fetch(key)``: the entry on the device; ``release(key)``: the caller is done reading the fetched tensor.
* ``allocate()`` after the reserves, ``flush()`` at the end of a step that stored (no-ops where not needed).

``OffloadManager`` keeps every entry in one pinned CPU buffer. ``store_async`` copies device -> pinned on a side
stream (after waiting for the compute stream that produced the tensor; by default a store stream apart from the
prefetch data stream, so both copy engines work, with per-key events ordering a key's store and prefetches) and
holds a reference to the source until an event recorded *on that copy's stream* after the copy has completed, so the caching allocator cannot hand the source's
memory to a new tensor while the DMA still reads it (diffusers' group offload once recorded the wrong stream here).
``begin_fetch_step`` issues the host -> device copies of a step on the data stream, each into a slot of a small GPU
staging ring, with one event per key; ``fetch`` makes the compute stream wait on that key's event (or, when the key
was never prefetched, copies it synchronously). A slot is refilled only after the compute stream has passed the
``release`` of the entry it held, so the ring can be far smaller than the cache: GPU memory held by the cache is
the ring (``ring_size`` slots of the largest entry), the copies run ``ring_size`` entries ahead of the compute.

Staging slots are also a cache keyed by entry *version* (``reuse_slots``): every ``store_async`` bumps the key's
version, a slot remembers the (key, version) it was last filled with, and a prefetch of a key whose current version
still sits in a free slot takes that slot without a copy. A refill picks, among the free slots, first one that holds
nothing or a stale version, then the one whose entry is read furthest ahead (queued prefetches, then the keys
``hint_upcoming`` names, then never), the least recently released among equals. Static entries change only at
refreshes, so with a ring that holds a step's entries they cross the bus once per refresh; a ring smaller than a
step's reads refills every freed slot at once and so gets no hits (the slots stream).

The CUDA calls live behind ``CudaBackend``; tests drive the same bookkeeping with a recording CPU backend.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch


class DeviceStore:
    """Entries stay where they were produced (the on-GPU cache every offload is measured against)."""

    wants_hints = False  # whether hint_upcoming does anything (callers skip building the keys otherwise)

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


class NaiveOffload(DeviceStore):
    """Synchronous ``.cpu()`` on store and ``.to(device)`` on fetch: the baseline the prefetching manager must beat."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = torch.device(device)

    def store_async(self, tensor: torch.Tensor, key: str) -> None:
        self._entries[key] = tensor.cpu()

    def fetch(self, key: str) -> torch.Tensor:
        return self._entries[key].to(self.device)


class _StreamSwitch:
    """``torch.cuda.stream(stream)`` for a stream of the current device, with less host work (it is entered for every
    batch of copies)."""

    __slots__ = ("stream", "previous")

    def __init__(self, stream):
        self.stream = stream

    def __enter__(self):
        self.previous = torch.cuda.current_stream(self.stream.device)
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc):
        torch.cuda.set_stream(self.previous)


class CudaBackend:
    """The CUDA calls of ``OffloadManager`` (streams, events, pinned and device buffers, copies)."""

    def __init__(self, device):
        self.device = torch.device(device)

    def new_stream(self):
        return torch.cuda.Stream(self.device)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream):
        return _StreamSwitch(stream)

    def new_event(self):
        return torch.cuda.Event()

    def record(self, event, stream) -> None:
        event.record(stream)

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def done(self, event) -> bool:
        return event.query()

    def pinned_empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)

    def device_empty(self, numel: int, dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def synchronize(self, stream) -> None:
        stream.synchronize()


class OffloadManager:
    """Cache entries in pinned CPU memory, prefetched to a GPU staging ring on a separate data stream.

    Args:
        device: the compute device. backend: ``CudaBackend(device)`` by default (tests pass a fake).
        ring_size: staging slots (each as large as the largest entry); entries of one layer are read together, so
            keep it at least the number of entries one layer reads (the Jano cache reads 2), more to prefetch ahead.
            ``None``: one slot per entry (the spec's literal design: every copy of a step in flight at once, but
            the staging then holds as much GPU memory as the cache it offloads).
        separate_store_stream: stores on a stream of their own (see the module docstring); False = one data stream.
        reuse_slots: a prefetch of an entry whose current version still sits in a free staging slot reuses that
            slot without a copy (see the module docstring).
    """

    def __init__(
        self,
        device="cuda",
        ring_size: Optional[int] = 8,
        backend=None,
        separate_store_stream: bool = True,
        reuse_slots: bool = True,
    ):
        if ring_size is not None and ring_size < 1:
            raise ValueError(f"ring_size must be >= 1 or None, got {ring_size}")
        self.backend = backend if backend is not None else CudaBackend(device)
        self.data_stream = self.backend.new_stream()
        # Stores (device -> host) on their own stream use the other copy engine, so a step that refreshes some
        # entries while prefetching others moves both at once; per-key events keep each key's copies in order.
        self.store_stream = self.backend.new_stream() if separate_store_stream else self.data_stream
        self._stored_event: Dict[str, object] = {}  # key -> its last store's done event (store_stream)
        self._read_event: Dict[str, object] = {}  # key -> its last prefetch's done event (data_stream)
        self.ring_size = ring_size
        self._pinned: Dict[str, torch.Tensor] = {}
        self._stored: set = set()  # keys whose pinned buffer holds a stored value
        self._inflight: deque = deque()  # (copy-done event on the store stream, source) pairs, in store order
        self._ring: Optional[torch.Tensor] = None  # flat byte buffer: ring_size slots of _slot_bytes
        self._slot_bytes = 0
        self._ring_slot_bytes = 0
        self._resize = False  # the ring must be re-made (an entry grew, or a new one needs a slot) before use
        self._free_slots: deque = deque()
        self._slot_released: Dict[int, object] = {}  # slot -> event recorded on the compute stream at release
        self._pending: deque = deque()  # prefetch keys not yet issued (waiting for a free slot)
        self._issued: Dict[str, Tuple[int, object]] = {}  # key -> (slot, H2D-done event)
        self._held: Dict[str, int] = {}  # fetched, not yet released: key -> slot
        self.reuse_slots = reuse_slots
        self._version: Dict[str, int] = {}  # key -> bumped by every store (and a re-allocated pinned buffer)
        self._slot_holds: Dict[int, Tuple[str, int, object]] = {}  # slot -> (key, version, H2D-done event)
        self._upcoming: Dict[str, int] = {}  # key -> position among the keys later steps read (hint_upcoming)
        self._views: Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]] = {}  # (slot, key) -> (pinned, view)
        self._queued_at: Dict[str, int] = {}  # pending key -> queue sequence number (FIFO: smaller = read sooner)
        self._sequence = 0
        self.stats = dict(
            pinned_allocations=0, stores=0, prefetches=0, sync_fetches=0, slot_hits=0, h2d_bytes=0, d2h_bytes=0
        )

    @property
    def wants_hints(self) -> bool:
        return self.reuse_slots

    # ---- storage --------------------------------------------------------------------------------------------
    def reserve(self, key: str, shape: Sequence[int], dtype: torch.dtype) -> None:
        """Allocate the pinned buffer of ``key`` (once: kept while shape and dtype stay the same)."""
        buffer = self._pinned.get(key)
        if buffer is not None and tuple(buffer.shape) == tuple(shape) and buffer.dtype == dtype:
            return
        if buffer is None and self.ring_size is None:
            self._resize = True  # one slot per entry: a new entry needs a larger ring
        self._pinned[key] = self.backend.pinned_empty(shape, dtype)
        self._stored.discard(key)
        self._version[key] = self._version.get(key, 0) + 1  # no slot holds this buffer's value
        self.stats["pinned_allocations"] += 1
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        nbytes = -(-nbytes // 256) * 256  # slots aligned for any dtype view
        if nbytes > self._slot_bytes:
            self._resize = True  # re-made at the next prefetch with the larger slot size
            self._slot_bytes = nbytes

    def store_async(self, tensor: torch.Tensor, key: str) -> None:
        """Copy ``tensor`` to the pinned buffer of ``key`` on the data stream; returns at once."""
        self.reserve(key, tensor.shape, tensor.dtype)
        backend = self.backend
        produced = backend.new_event()
        backend.record(produced, backend.current_stream())  # the tensor is written by the compute stream
        backend.wait(self.store_stream, produced)
        last_read = self._read_event.pop(key, None)
        if last_read is not None and self.store_stream is not self.data_stream:
            backend.wait(self.store_stream, last_read)  # the previous prefetch of this key has read the buffer
        with backend.use_stream(self.store_stream):
            backend.copy(self._pinned[key], tensor)
        copied = backend.new_event()
        backend.record(copied, self.store_stream)  # on the stream that reads the source: the right one to wait for
        self._inflight.append((copied, tensor))  # the source stays alive until the DMA has read it
        self._stored_event[key] = copied
        self._stored.add(key)
        self._version[key] = self._version.get(key, 0) + 1
        self.stats["stores"] += 1
        self.stats["d2h_bytes"] += self._nbytes(key)
        self._prune()

    def _nbytes(self, key: str) -> int:
        pinned = self._pinned[key]
        return pinned.numel() * pinned.element_size()

    def _prune(self) -> None:
        # stores complete in the order they were queued on one stream: drop completed ones from the front
        while self._inflight and self.backend.done(self._inflight[0][0]):
            self._inflight.popleft()

    def inflight(self) -> int:
        """Stores whose source tensor is still referenced (copy not known to be complete)."""
        self._prune()
        return len(self._inflight)

    # ---- prefetch -------------------------------------------------------------------------------------------
    def _ensure_ring(self) -> None:
        if self._resize and self._ring is not None:
            if self._issued or self._held:
                raise RuntimeError(
                    "entries grew while prefetched ones are outstanding: release them (or reserve "
                    "every entry before sampling) so the staging ring can be re-made"
                )
            self._ring = None
            self._free_slots.clear()
            self._slot_released.clear()
            self._slot_holds.clear()
            self._views.clear()
        self._resize = False
        if self._ring is None and self._slot_bytes:
            slots = self.ring_size or len(self._pinned)
            self._ring = self.backend.device_empty(slots * self._slot_bytes, torch.uint8)
            self._ring_slot_bytes = self._slot_bytes
            self._free_slots = deque(range(slots))

    def _slot_view(self, slot: int, key: str) -> torch.Tensor:
        pinned = self._pinned[key]
        cached = self._views.get((slot, key))
        if cached is not None and cached[0] is pinned:
            return cached[1]  # views are made once: fewer host-side tensor ops per copy
        nbytes = pinned.numel() * pinned.element_size()
        if nbytes > self._ring_slot_bytes:
            raise RuntimeError(f"entry '{key}' ({nbytes} bytes) outgrew the staging slots ({self._ring_slot_bytes})")
        start = slot * self._ring_slot_bytes
        view = self._ring[start : start + nbytes].view(pinned.dtype).view(pinned.shape)
        self._views[(slot, key)] = (pinned, view)
        return view

    def _holds_current(self, slot: int) -> Optional[str]:
        """The key whose current version ``slot`` holds, or None."""
        held = self._slot_holds.get(slot)
        if held is None or self._version.get(held[0]) != held[1] or held[0] not in self._stored:
            return None
        return held[0]

    def _take_slot(self, key: str) -> Tuple[int, bool]:
        """A free slot for ``key`` and whether it already holds ``key``'s current version (no copy needed)."""
        free = self._free_slots
        if self.reuse_slots:
            for slot in free:
                if self._holds_current(slot) == key:
                    free.remove(slot)
                    return slot, True
            # A victim: empty or stale first, then the entry read furthest in the known future (queued prefetches,
            # then the ``hint_upcoming`` keys; never = furthest); among equals the least recently released.
            later, never = 1 << 40, 1 << 62
            best, best_rank = None, None
            for slot in free:  # free is in release order: the first of equal rank is the least recently released
                holder = self._holds_current(slot)
                if holder is None:
                    rank = (0, 0)
                elif holder in self._queued_at:
                    rank = (1, -self._queued_at[holder])
                else:
                    rank = (1, -(later + self._upcoming[holder]) if holder in self._upcoming else -never)
                if best_rank is None or rank < best_rank:
                    best, best_rank = slot, rank
            free.remove(best)
            return best, False
        return free.popleft(), False

    def _issue(self, key: str) -> None:
        backend = self.backend
        slot, hit = self._take_slot(key)
        if hit:
            # The slot still holds this version: nothing crosses the bus. The compute stream released the slot after
            # reading it and reads it again in order; waiting on the old copy's event keeps fetch() uniform.
            self._slot_released.pop(slot, None)
            ready = self._slot_holds[slot][2]
            self._issued[key] = (slot, ready)
            self.stats["slot_hits"] += 1
            return
        released = self._slot_released.pop(slot, None)
        if released is not None:
            backend.wait(self.data_stream, released)  # the compute stream is done with the slot's last entry
        stored = self._stored_event.pop(key, None)
        if stored is not None and self.store_stream is not self.data_stream:
            backend.wait(self.data_stream, stored)  # the key's last store has landed in its pinned buffer
        with backend.use_stream(self.data_stream):
            backend.copy(self._slot_view(slot, key), self._pinned[key])
        ready = backend.new_event()
        backend.record(ready, self.data_stream)
        self._issued[key] = (slot, ready)
        self._read_event[key] = ready
        self._slot_holds[slot] = (key, self._version[key], ready)
        self.stats["prefetches"] += 1
        self.stats["h2d_bytes"] += self._nbytes(key)

    def _issue_pending(self) -> None:
        while self._pending and self._free_slots and not self._resize:  # a pending resize waits for the next step
            key = self._pending.popleft()
            self._queued_at.pop(key, None)
            self._issue(key)

    def begin_fetch_step(self, keys: Iterable[str]) -> None:
        """Queue host -> device copies of ``keys`` (in the order the step reads them) on the data stream."""
        queued = set(self._pending)
        keys = [k for k in keys if k not in self._issued and k not in self._held and k not in queued]
        missing = [k for k in keys if k not in self._stored]
        if missing:
            raise KeyError(f"prefetch of entries never stored: {missing[:4]}")
        self._ensure_ring()
        for key in keys:
            self._queued_at[key] = self._sequence
            self._sequence += 1
        self._pending.extend(keys)
        self._issue_pending()

    def hint_upcoming(self, keys: Iterable[str]) -> None:
        """Keys the steps after the queued ones will read, in order: only used to choose which staging slot to
        refill (keep the entries read soonest), so a ring that can hold them keeps unchanged entries off the bus."""
        self._upcoming = {}
        for position, key in enumerate(keys):
            self._upcoming.setdefault(key, position)

    def fetch(self, key: str) -> torch.Tensor:
        """The entry on the device (a staging slot: read it, then ``release`` it; do not write it)."""
        if key in self._held:
            return self._slot_view(self._held[key], key)
        if key not in self._stored:
            raise KeyError(f"cache entry '{key}' was never stored")
        if key not in self._issued:
            # Not prefetched (or still queued behind a full ring): issue it now, out of order, and wait below.
            if key in self._pending:
                self._pending.remove(key)
                self._queued_at.pop(key, None)
            self._ensure_ring()
            if not self._free_slots:
                raise RuntimeError(
                    f"no free staging slot for '{key}': held (fetched, not released) {sorted(self._held)[:4]}, "
                    f"prefetched ahead {list(self._issued)[:4]}; release entries after reading them, fetch in the "
                    f"order given to begin_fetch_step, or raise ring_size"
                )
            self._issue(key)
            self.stats["sync_fetches"] += 1
        slot, ready = self._issued.pop(key)
        self.backend.wait(self.backend.current_stream(), ready)
        self._held[key] = slot
        return self._slot_view(slot, key)

    def release(self, key: str) -> None:
        """The compute stream has queued its last read of ``key``'s slot: let the next prefetch reuse it."""
        slot = self._held.pop(key)
        released = self.backend.new_event()
        self.backend.record(released, self.backend.current_stream())
        self._slot_released[slot] = released
        self._free_slots.append(slot)
        self._issue_pending()

    # ---- housekeeping ---------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Stores are issued at once here: nothing to flush."""

    def allocate(self) -> None:
        """Pinned buffers are allocated by ``reserve`` here."""

    def synchronize(self) -> None:
        self.backend.synchronize(self.store_stream)
        self.backend.synchronize(self.data_stream)
        self._stored_event.clear()
        self._read_event.clear()
        self._prune()

    def clear(self) -> None:
        """Forget outstanding prefetches and stored values (pinned buffers and the ring are kept for reuse)."""
        self._pending.clear()
        self._queued_at.clear()
        self._upcoming = {}
        for key in list(self._held):
            self.release(key)
        self.synchronize()
        for slot, _ in self._issued.values():
            self._free_slots.append(slot)
        self._issued.clear()
        self._stored.clear()

    def device_bytes(self) -> int:
        return 0 if self._ring is None else self._ring.numel()

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._pinned.values())


def make_store(kind: str, device, graphs: bool = False) -> object:
    """``"device"`` (caches on the GPU), ``"offload"`` (PackedOffloadManager: what --jano-offload runs),
    ``"offload_slots"`` (the per-entry slot-ring OffloadManager), ``"offload_static"`` (static entries offloaded,
    medium ones on the GPU), ``"naive"`` (sync .cpu()/.to()). ``graphs``: the stores CUDA graphs of the levels read
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
    if kind == "offload_slots":
        return OffloadManager(device)
    if kind == "naive":
        return NaiveOffload(device)
    if kind == "offload_static":
        return SplitStore(DeviceStore(), PackedOffloadManager(device), resident=lambda key: not key.startswith("s_"))
    raise ValueError(f"unknown cache store '{kind}'; choose device, offload, offload_slots, offload_static or naive")


class SplitStore:
    """Route entries by key: those ``resident(key)`` says yes to stay in ``device`` (a DeviceStore), the rest go to
    ``offload`` (e.g. an OffloadManager). Static entries change only at refreshes while medium ones change every
    level-2 step, so offloading only the static ones trades some memory for copies that hide behind smaller steps."""

    def __init__(self, device_store, offload_store, resident):
        self.device, self.offload, self.resident = device_store, offload_store, resident

    @property
    def wants_hints(self) -> bool:
        return getattr(self.offload, "wants_hints", False)

    def _route(self, key: str):
        return self.device if self.resident(key) else self.offload

    def reserve(self, key, shape, dtype) -> None:
        self._route(key).reserve(key, shape, dtype)

    def store_async(self, tensor, key) -> None:
        self._route(key).store_async(tensor, key)

    def begin_fetch_step(self, keys) -> None:
        self.offload.begin_fetch_step([k for k in keys if not self.resident(k)])

    def hint_upcoming(self, keys) -> None:
        self.offload.hint_upcoming([k for k in keys if not self.resident(k)])

    def fetch(self, key):
        return self._route(key).fetch(key)

    def release(self, key) -> None:
        self._route(key).release(key)

    def flush(self) -> None:
        self.offload.flush()

    def allocate(self) -> None:
        self.offload.allocate()

    def clear(self) -> None:
        self.device.clear()
        self.offload.clear()

    def device_bytes(self) -> int:
        return self.device.device_bytes() + self.offload.device_bytes()


class _Chunk:
    """Entries a step reads together: one staging slot, one host -> device event. ``runs`` are the byte ranges
    (block offset, length, slot offset) that cover them, adjacent entries merged into one copy."""

    __slots__ = ("keys", "runs", "offsets", "nbytes", "slot_views")

    def __init__(self, keys, specs):
        self.keys = tuple(keys)
        runs, offsets = [], {}
        for key in sorted(self.keys, key=lambda k: specs[k][2]):
            offset, nbytes = specs[key][2], specs[key][3]
            if runs and runs[-1][0] + runs[-1][1] + _ALIGN > offset >= runs[-1][0] + runs[-1][1]:
                start, _, at = runs[-1]
                runs[-1] = [start, offset + nbytes - start, at]  # the gap is alignment padding: copy it along
            else:
                at = runs[-1][2] + runs[-1][1] if runs else 0
                at = -(-at // _ALIGN) * _ALIGN
                runs.append([offset, nbytes, at])
            start, _, at = runs[-1]
            offsets[key] = at + offset - start
        self.runs = [tuple(run) for run in runs]
        self.offsets = offsets
        self.nbytes = max(at + length for _, length, at in self.runs)
        self.slot_views = {}  # slot -> ({key: typed view}, [(ring slice, block slice)])


class _Queued:
    """One queued read of a chunk: where it went (slot, event) and how many of its entries are not yet released."""

    __slots__ = ("chunk", "index", "remaining", "slot", "event", "waited", "views")

    def __init__(self, chunk, index: int = 0):
        self.chunk, self.index, self.remaining = chunk, index, len(chunk.keys)
        self.slot = self.event = self.views = None
        self.waited = False


_ALIGN = 256  # entries and runs start on 256-byte boundaries (any dtype view, DMA-friendly)


class PackedOffloadManager:
    """Cache entries in ONE pinned CPU block, prefetched chunk by chunk into a small GPU staging ring.

    The same verbs as ``OffloadManager`` (``reserve`` / ``store_async`` / ``begin_fetch_step`` / ``fetch`` /
    ``release``), built to spend as little host time per step as possible, because the region-cached forward is
    already launch-bound: every host microsecond the manager adds is a microsecond of step time.

    * Layout: entries are laid out in the block in ``reserve`` order (256-byte aligned); the block is allocated once,
      at the first use after the reserves, and kept with the layout across ``clear()`` (a new layout that fits
      reuses it).
    * Prefetch: ``begin_fetch_step(keys)`` cuts the keys (reading order) into chunks of up to ``slot_bytes``; the
      entries of a chunk that are adjacent in the block become one copy. A chunk costs one slot, its copies, one
      event on the data stream, one ``wait_event`` of the compute stream (at its first ``fetch``) and one event when
      its last entry is released (the data stream waits on it before refilling the slot). Plans are cached per key
      tuple, so a step's bookkeeping is a few dict look-ups.
    * Stores are batched: ``store_async`` only appends the tensor (kept alive) to a batch; a batch of
      ``flush_bytes`` (or any prefetch, ``flush()``, ``synchronize()``) issues all its device -> host copies at once
      on the store stream after one compute-stream event, and records one event that keeps the sources alive until
      it completes. A prefetch waits on the newest flush among its entries' last stores (flushes complete in order
      on one stream); a flush waits on the newest prefetch, so it never overwrites a block range still being read.

    GPU memory held: ``slots`` x ``slot_bytes`` (more when one entry is larger than a slot: the slot grows to it).

    Args:
        device: the compute device. slot_bytes: target size of a chunk (and of a staging slot). slots: staging slots
        (chunks in flight: 2 double-buffers, 3 lets the copies run two chunks ahead). flush_bytes: store batch size.
        backend: ``CudaBackend(device)`` by default (tests pass a fake). fixed_slots: chunk i of a step's plan always
        goes to slot i % slots (it waits for that slot rather than taking the first free one), so an entry of a step
        is always at the same device address: what CUDA graphs of the levels need (region_graphs.py).
    """

    def __init__(
        self,
        device="cuda",
        slot_bytes: int = 64 * 2**20,
        slots: int = 3,
        flush_bytes: int = 64 * 2**20,
        backend=None,
        fixed_slots: bool = False,
    ):
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"slots and slot_bytes must be >= 1, got {slots}, {slot_bytes}")
        self.backend = backend if backend is not None else CudaBackend(device)
        self.data_stream = self.backend.new_stream()
        self.store_stream = self.backend.new_stream()
        self.slot_bytes, self.slots, self.flush_bytes = int(slot_bytes), int(slots), int(flush_bytes)
        self.ring_size = slots  # the benchmark's name for it
        self.fixed_slots = bool(fixed_slots)
        # layout: key -> (shape, dtype, offset, nbytes, capacity)
        self._specs: Dict[str, tuple] = {}
        self._used = 0
        self._block: Optional[torch.Tensor] = None
        self._block_holds_values = False  # a flush wrote it since the last clear()
        self._fresh: set = set()  # keys reserved since the last clear(): a re-layout keeps only these
        self._pinned: Dict[str, torch.Tensor] = {}  # typed views of the block
        self._stored: set = set()
        self._plans: Dict[tuple, List[_Chunk]] = {}
        # stores
        self._batch: list = []
        self._batch_bytes = 0
        self._flushes = 0
        self._flush_events: Dict[int, object] = {}  # flush number -> its done event, while in flight
        self._inflight: deque = deque()  # (flush number, done event, sources)
        self._last_flush: Dict[str, int] = {}  # key -> flush number of its last store
        self._data_waited_flush = 0  # the data stream already waits for every flush up to this number
        self._last_read = None  # the newest prefetch event on the data stream
        # prefetch
        self._ring: Optional[torch.Tensor] = None
        self._ring_slot_bytes = 0
        self._free: deque = deque()
        self._slot_released: Dict[int, object] = {}
        self._pending: deque = deque()  # _Queued chunks not issued yet (waiting for a free slot)
        self._queued: Dict[str, _Queued] = {}  # key -> its queued read, until fetched
        self._held: Dict[str, tuple] = {}  # key -> (_Queued or None, tensor): fetched, not released
        # Events are re-recorded rather than made anew (each new one costs the host an object and an event creation):
        # one for "the compute stream produced this batch", one "ready" and one "released" per slot (a slot's next
        # record comes after every wait on its last one), and a pool for the flushes' done events (reused once the
        # flush is known complete).
        self._produced = None
        self._slot_ready: List[object] = []
        self._slot_release: List[object] = []
        self._event_pool: List[object] = []
        self._reads = 0  # prefetch chunks issued (the store stream has waited for the first _store_waited_reads)
        self._store_waited_reads = 0
        self.stats = dict(
            pinned_allocations=0,
            stores=0,
            prefetches=0,
            sync_fetches=0,
            slot_hits=0,
            h2d_bytes=0,
            d2h_bytes=0,
            h2d_copies=0,
            d2h_copies=0,
            flushes=0,
            chunks=0,
        )

    # ---- layout ---------------------------------------------------------------------------------------------
    def reserve(self, key: str, shape: Sequence[int], dtype: torch.dtype) -> None:
        """Lay out entry ``key`` (its pinned bytes come from the block, allocated at the next use)."""
        shape = tuple(shape)
        spec = self._specs.get(key)
        self._fresh.add(key)
        if spec is not None and spec[0] == shape and spec[1] == dtype:
            return
        if self._pending or self._queued or self._held:
            raise RuntimeError(f"entry '{key}' changed layout while prefetches are outstanding: reserve before them")
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if spec is not None and nbytes <= spec[4]:
            offset, capacity = spec[2], spec[4]  # fits where it was
        else:
            offset, capacity = self._used, max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
            self._used += capacity
        self._specs[key] = (shape, dtype, offset, nbytes, capacity)
        self._pinned.pop(key, None)
        self._stored.discard(key)
        self._plans.clear()

    def allocate(self) -> None:
        """Make the pinned block for the entries reserved so far now (callers do this after their reserves, before
        sampling reads or writes anything; otherwise the first store does it)."""
        self._ensure_block()

    def _ensure_block(self) -> None:
        if self._block is not None and self._block.numel() < self._used and not self._block_holds_values:
            self._compact()  # e.g. new shapes after clear(): lay out again from the start, maybe in the same block
        if self._block is not None and self._block.numel() >= self._used:
            if len(self._pinned) < len(self._specs):
                self._make_views()
            return
        old = self._block
        block = self.backend.pinned_empty((self._used,), torch.uint8)
        self.stats["pinned_allocations"] += 1
        if old is not None and self._block_holds_values:
            # rare: an entry was added after the block was made; keep the stored values
            self.backend.synchronize(self.store_stream)
            self.backend.synchronize(self.data_stream)
            block[: old.numel()].copy_(old)
        self._block = block
        self._pinned.clear()
        self._make_views()

    def _compact(self) -> None:
        offset = 0
        self._specs = {key: spec for key, spec in self._specs.items() if key in self._fresh or key in self._stored}
        for key, (shape, dtype, _, nbytes, _) in list(self._specs.items()):
            capacity = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
            self._specs[key] = (shape, dtype, offset, nbytes, capacity)
            offset += capacity
        self._used = offset
        self._pinned.clear()
        self._plans.clear()

    def _make_views(self) -> None:
        for key, (shape, dtype, offset, nbytes, _) in self._specs.items():
            if key not in self._pinned:
                self._pinned[key] = self._block[offset : offset + nbytes].view(dtype).view(shape)

    # ---- stores ---------------------------------------------------------------------------------------------
    def store_async(self, tensor: torch.Tensor, key: str) -> None:
        """Keep ``tensor`` (not modified afterwards by the caller) as entry ``key``; its copy is issued with the
        batch it joins (see the class docstring)."""
        spec = self._specs.get(key)
        if spec is None or spec[0] != tuple(tensor.shape) or spec[1] != tensor.dtype:
            self.reserve(key, tensor.shape, tensor.dtype)
            spec = self._specs[key]
        self._batch.append((tensor, key))
        self._batch_bytes += spec[3]
        self._stored.add(key)
        if self._batch_bytes >= self.flush_bytes:
            self.flush()

    def flush(self) -> None:
        """Issue the batched stores' device -> host copies now."""
        if not self._batch:
            return
        self._ensure_block()
        backend, store = self.backend, self.store_stream
        if self._produced is None:
            self._produced = backend.new_event()
        backend.record(self._produced, backend.current_stream())  # the sources are written by the compute stream
        backend.wait(store, self._produced)
        if self._reads > self._store_waited_reads:
            backend.wait(store, self._last_read)  # no block range is overwritten while a prefetch reads it
            self._store_waited_reads = self._reads
        pinned = self._pinned
        self._block_holds_values = True
        with backend.use_stream(store):
            for tensor, key in self._batch:
                backend.copy(pinned[key], tensor)
        done = self._event_pool.pop() if self._event_pool else backend.new_event()
        backend.record(done, store)  # recorded on the stream that reads the sources
        self._flushes += 1
        number = self._flushes
        last = self._last_flush
        for _, key in self._batch:
            last[key] = number
        self._flush_events[number] = done
        self._inflight.append((number, done, [tensor for tensor, _ in self._batch]))
        self.stats["stores"] += len(self._batch)
        self.stats["d2h_copies"] += len(self._batch)
        self.stats["d2h_bytes"] += self._batch_bytes
        self.stats["flushes"] += 1
        self._batch, self._batch_bytes = [], 0
        self._prune()

    def _prune(self) -> None:
        while self._inflight and self.backend.done(self._inflight[0][1]):
            number, done, _ = self._inflight.popleft()
            self._flush_events.pop(number, None)
            self._event_pool.append(done)

    def inflight(self) -> int:
        """Stores whose source tensor is still referenced (batched, or copy not known to be complete)."""
        self._prune()
        return len(self._batch) + sum(len(sources) for _, _, sources in self._inflight)

    # ---- prefetch -------------------------------------------------------------------------------------------
    def _plan(self, keys: tuple) -> List[_Chunk]:
        chunks = self._plans.get(keys)
        if chunks is None:
            chunks, current, size = [], [], 0
            for key in keys:
                nbytes = self._specs[key][4]
                if current and size + nbytes > self.slot_bytes:
                    chunks.append(_Chunk(current, self._specs))
                    current, size = [], 0
                current.append(key)
                size += nbytes
            if current:
                chunks.append(_Chunk(current, self._specs))
            self._plans[keys] = chunks
        return chunks

    def chunk_of(self, keys: Sequence[str]) -> Dict[str, int]:
        """Key -> the index of the chunk it is prefetched in when ``keys`` (a step's reading order) are queued at
        once (with ``fixed_slots``, chunk i goes to slot i % slots)."""
        return {key: index for index, chunk in enumerate(self._plan(tuple(keys))) for key in chunk.keys}

    def _ensure_ring(self, chunks) -> None:
        need = max(chunk.nbytes for chunk in chunks)
        if self._ring is not None and need <= self._ring_slot_bytes:
            return
        if self._ring is not None and (self._pending or self._queued or self._held):
            raise RuntimeError("an entry outgrew the staging slots while prefetches are outstanding")
        self._ring_slot_bytes = -(-max(self.slot_bytes, need) // _ALIGN) * _ALIGN  # every slot starts aligned
        self._ring = self.backend.device_empty(self.slots * self._ring_slot_bytes, torch.uint8)
        self._free = deque(range(self.slots))
        self._slot_released.clear()
        if not self._slot_ready:
            self._slot_ready = [self.backend.new_event() for _ in range(self.slots)]
            self._slot_release = [self.backend.new_event() for _ in range(self.slots)]
        for plan in self._plans.values():
            for chunk in plan:
                chunk.slot_views.clear()

    def begin_fetch_step(self, keys: Iterable[str]) -> None:
        """Queue the host -> device copies of ``keys`` (in the order the step reads them); keys already queued or
        held are skipped, so queueing a step twice is a no-op."""
        queued, held = self._queued, self._held
        keys = tuple(k for k in keys if k not in queued and k not in held)
        if not keys:
            return
        missing = [k for k in keys if k not in self._stored]
        if missing:
            raise KeyError(f"prefetch of entries never stored: {missing[:4]}")
        self.flush()
        self._ensure_block()
        chunks = self._plan(keys)
        self._ensure_ring(chunks)
        for index, chunk in enumerate(chunks):
            entry = _Queued(chunk, index)
            self._pending.append(entry)
            for key in chunk.keys:
                queued[key] = entry
        self._issue_pending()

    wants_hints = False

    def hint_upcoming(self, keys: Iterable[str]) -> None:
        """Accepted for the store interface; staging slots are not a cache here."""

    def _slot_views(self, chunk: _Chunk, slot: int):
        made = chunk.slot_views.get(slot)
        if made is None:
            base = slot * self._ring_slot_bytes
            ring, block = self._ring, self._block
            views = {}
            for key in chunk.keys:
                shape, dtype, _, nbytes, _ = self._specs[key]
                start = base + chunk.offsets[key]
                views[key] = ring[start : start + nbytes].view(dtype).view(shape)
            copies = [(ring[base + at : base + at + n], block[src : src + n]) for src, n, at in chunk.runs]
            made = chunk.slot_views[slot] = (views, copies)
        return made

    def _issue_pending(self) -> None:
        if not (self._pending and self._free):
            return
        if self._batch:
            self.flush()  # a queued read sees every store made before it is issued
        backend, data = self.backend, self.data_stream
        while self._pending and self._free:
            entry = self._pending[0]
            if self.fixed_slots:
                slot = entry.index % self.slots
                if slot not in self._free:
                    break  # in order: the chunk waits for its own slot
                self._free.remove(slot)
            else:
                slot = self._free.popleft()
            self._pending.popleft()
            chunk = entry.chunk
            released = self._slot_released.pop(slot, None)
            if released is not None:
                backend.wait(data, released)  # the compute stream is done with the slot's last chunk
            last = self._last_flush
            need = max(last.get(key, 0) for key in chunk.keys)
            if need > self._data_waited_flush:
                done = self._flush_events.get(need)
                if done is not None:
                    backend.wait(data, done)  # the chunk's stores (and all before them) have landed
                self._data_waited_flush = need
            views, copies = self._slot_views(chunk, slot)
            with backend.use_stream(data):
                for dst, src in copies:
                    backend.copy(dst, src)
            ready = self._slot_ready[slot]
            backend.record(ready, data)
            entry.slot, entry.event, entry.views = slot, ready, views
            self._last_read = ready
            self._reads += 1
            stats = self.stats
            stats["chunks"] += 1
            stats["prefetches"] += len(chunk.keys)
            stats["h2d_copies"] += len(copies)
            stats["h2d_bytes"] += sum(n for _, n, _ in chunk.runs)

    def fetch(self, key: str) -> torch.Tensor:
        """The entry on the device (a staging slot: read it, then ``release`` it; do not write it)."""
        held = self._held.get(key)
        if held is not None:
            return held[1]
        entry = self._queued.pop(key, None)
        if entry is not None and entry.slot is None:
            self._issue_pending()
        if entry is None or entry.slot is None:
            tensor = self._fetch_now(key)  # not prefetched, or queued behind a full ring: copy it now
            self._held[key] = (entry, tensor)
            return tensor
        if not entry.waited:
            self.backend.wait(self.backend.current_stream(), entry.event)
            entry.waited = True
        tensor = entry.views[key]
        self._held[key] = (entry, tensor)
        return tensor

    def _fetch_now(self, key: str) -> torch.Tensor:
        if key not in self._stored:
            raise KeyError(f"cache entry '{key}' was never stored")
        self.flush()
        self._ensure_block()
        backend = self.backend
        done = self._flush_events.get(self._last_flush.get(key, 0))
        if done is not None:
            backend.wait(backend.current_stream(), done)
        shape, dtype, _, nbytes, _ = self._specs[key]
        tensor = backend.device_empty(nbytes, torch.uint8).view(dtype).view(shape)
        backend.copy(tensor, self._pinned[key])  # on the compute stream: ordered before its reads
        self.stats["sync_fetches"] += 1
        self.stats["h2d_bytes"] += nbytes
        self.stats["h2d_copies"] += 1
        return tensor

    def release(self, key: str) -> None:
        """The compute stream has queued its last read of ``key``: its slot is refilled once all of the slot's
        entries are released."""
        entry, _ = self._held.pop(key)
        if entry is None:
            return
        entry.remaining -= 1
        if entry.remaining:
            return
        if entry.slot is None:  # every entry was fetched synchronously: the chunk need not be copied at all
            self._pending.remove(entry)
            return
        released = self._slot_release[entry.slot]
        self.backend.record(released, self.backend.current_stream())
        self._slot_released[entry.slot] = released
        self._free.append(entry.slot)
        self._issue_pending()

    # ---- housekeeping ---------------------------------------------------------------------------------------
    def synchronize(self) -> None:
        self.flush()
        self.backend.synchronize(self.store_stream)
        self.backend.synchronize(self.data_stream)
        self._flush_events.clear()
        self._event_pool.extend(done for _, done, _ in self._inflight)
        self._inflight.clear()

    def clear(self) -> None:
        """Forget outstanding prefetches and stored values. The layout, its plans and the block are kept: entries
        reserved again with the same shapes cost nothing, and new shapes are laid out again in the block (grown only
        when they do not fit)."""
        self._batch, self._batch_bytes = [], 0
        for key in list(self._held):
            self.release(key)
        self.synchronize()
        self._pending.clear()
        self._queued.clear()
        self._free = deque(range(self.slots)) if self._ring is not None else deque()
        self._stored.clear()  # (slot release events are kept: the compute stream may still read a slot)
        self._block_holds_values = False
        self._fresh = set()
        self._last_flush.clear()
        self._data_waited_flush = self._flushes
        self._last_read = None
        self._store_waited_reads = self._reads

    def device_bytes(self) -> int:
        return 0 if self._ring is None else self._ring.numel()

    def host_bytes(self) -> int:
        return 0 if self._block is None else self._block.numel()
