"""Cache stores the product's are measured against (benchmarks/jano.py), kept out of ``opensora``:

* ``NaiveOffload``: synchronous ``.cpu()`` on store and ``.to(device)`` on fetch, the baseline a prefetching offload
  must beat;
* ``OffloadManager``: one pinned buffer, one copy and events per entry, a staging-slot ring keyed by entry version
  (measured to cost far more host time per step than the region forward can spare; ``PackedOffloadManager`` in
  ``opensora.inference.cache.packed_offload`` replaced it);
* ``SplitStore``: static entries offloaded, medium ones on the device.

``OffloadManager`` in detail:

 ``store_async`` copies device -> pinned on a side
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
from typing import Dict, Iterable, Optional, Sequence, Tuple

import torch

from opensora.inference.cache.cuda_backend import CudaBackend
from opensora.inference.cache.stores import DeviceStore


class NaiveOffload(DeviceStore):
    """Synchronous ``.cpu()`` on store and ``.to(device)`` on fetch: the baseline the prefetching manager must beat."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = torch.device(device)

    def store_async(self, tensor: torch.Tensor, key: str) -> None:
        self._entries[key] = tensor.cpu()

    def fetch(self, key: str) -> torch.Tensor:
        return self._entries[key].to(self.device)


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

    capturable = False
    staged = True
    layout = None
    slot_bytes, slots = 64 * 2**20, 3  # what region graphs cut a level by (its slots are one entry each)

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

    def chunk_of(self, keys: Sequence[str]) -> None:
        """Entries are prefetched one by one, not in chunks."""
        return None


class SplitStore:
    """Route entries by key: those ``resident(key)`` says yes to stay in ``device`` (a DeviceStore), the rest go to
    ``offload`` (e.g. an OffloadManager). Static entries change only at refreshes while medium ones change every
    level-2 step, so offloading only the static ones trades some memory for copies that hide behind smaller steps."""

    capturable = False
    staged = False  # its verbs route to two stores: region graphs run it eagerly
    layout = None

    def __init__(self, device_store, offload_store, resident):
        self.device, self.offload, self.resident = device_store, offload_store, resident

    @property
    def wants_hints(self) -> bool:
        return self.offload.wants_hints

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
