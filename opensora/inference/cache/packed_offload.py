"""``PackedOffloadManager``: the dual-stream prefetching offload store of ``--jano-offload`` (cache entries in one
pinned host block, prefetched chunk by chunk into a small device staging ring; see the class docstring). It answers
the ``CacheStore`` verbs (stores.py) and is a ``StagedStore``."""

from __future__ import annotations

import math
from collections import deque
from typing import Dict, Iterable, List, Optional, Sequence

import torch

from .cuda_backend import CudaBackend


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

    capturable = False
    staged = True
    wants_hints = False
    layout = None

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
