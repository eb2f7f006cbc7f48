"""OffloadManager bookkeeping on the CPU (a recording fake of the CUDA calls), and on the GPU against the device cache."""

import weakref
from collections import deque
from contextlib import contextmanager

import pytest
import torch

from benchmarks.offload_stores import NaiveOffload, OffloadManager, SplitStore
from opensora.inference.cache.stores import (
    CacheStore,
    DeviceStore,
    PackedOffloadManager,
    StagedStore,
    StaticDeviceStore,
)


class FakeStream:
    def __init__(self, name):
        self.name = name


class FakeEvent:
    def __init__(self, number):
        self.number, self.stream, self.complete = number, None, False


class FakeBackend:
    """Runs copies at once and records every stream/event call, so tests can check the ordering rules."""

    def __init__(self):
        self.compute = FakeStream("compute")
        self.active = self.compute
        self.log, self.events, self.pinned_allocations = [], [], 0

    def new_stream(self):
        self.streams = getattr(self, "streams", 0) + 1
        return FakeStream("data" if self.streams == 1 else "store")

    def current_stream(self):
        return self.active

    @contextmanager
    def use_stream(self, stream):
        previous, self.active = self.active, stream
        try:
            yield
        finally:
            self.active = previous

    def new_event(self):
        self.events.append(FakeEvent(len(self.events)))
        return self.events[-1]

    def record(self, event, stream):
        event.stream, event.complete = stream, False  # re-recording an event makes it pending again
        self.log.append(("record", event.number, stream.name))

    def wait(self, stream, event):
        assert event.stream is not None, "waiting on an event that was never recorded"
        self.log.append(("wait", stream.name, event.number))

    def done(self, event):
        return event.complete

    def pinned_empty(self, shape, dtype):
        self.pinned_allocations += 1
        return torch.empty(shape, dtype=dtype)

    def device_empty(self, numel, dtype):
        return torch.empty(numel, dtype=dtype)

    def copy(self, dst, src):
        dst.copy_(src)
        self.log.append(("copy", self.active.name))

    def synchronize(self, stream):
        for event in self.events:
            if event.stream is stream:
                event.complete = True


def manager(ring_size=2):
    backend = FakeBackend()
    return OffloadManager(ring_size=ring_size, backend=backend), backend


def test_store_waits_for_compute_copies_on_data_stream_and_keeps_source_alive():
    om, fake = manager()
    source = torch.randn(3, 4)
    alive = weakref.ref(source)
    om.store_async(source, "s_kv_0")
    # compute-stream event recorded, store stream waits on it, copy on the store stream, done-event on the store stream
    assert fake.log == [("record", 0, "compute"), ("wait", "store", 0), ("copy", "store"), ("record", 1, "store")]
    del source
    assert alive() is not None and om.inflight() == 1  # copy not complete: the manager still holds the source
    fake.events[1].complete = True
    assert om.inflight() == 0 and alive() is None


def test_pinned_buffers_allocated_once():
    om, fake = manager()
    om.reserve("a", (2, 3), torch.float32)
    om.reserve("b", (4,), torch.float32)
    for _ in range(3):
        om.store_async(torch.randn(2, 3), "a")
        om.store_async(torch.randn(4), "b")
    assert fake.pinned_allocations == 2 and om.stats["pinned_allocations"] == 2
    om.reserve("a", (2, 3), torch.float32)  # same shape: reused
    assert fake.pinned_allocations == 2


def test_prefetch_ring_events_and_release_order():
    om, fake = manager(ring_size=2)
    values = {k: torch.randn(2, 3) for k in ("k0", "k1", "k2")}
    for key, value in values.items():
        om.store_async(value, key)
    stored_k0 = om._stored_event["k0"]
    fake.log.clear()
    om.begin_fetch_step(["k0", "k1", "k2"])
    # two slots: k0 and k1 issued (one event each, on the data stream), k2 waits for a free slot
    assert [e for e in fake.log if e[0] == "copy"] == [("copy", "data")] * 2
    assert fake.log[0] == ("wait", "data", stored_k0.number)  # the prefetch follows the key's store
    assert om.stats["prefetches"] == 2
    ready_k0 = om._issued["k0"][1]
    assert ready_k0.stream.name == "data"
    fake.log.clear()
    out = om.fetch("k0")
    assert fake.log == [("wait", "compute", ready_k0.number)]  # the compute stream waits on k0's own event
    torch.testing.assert_close(out, values["k0"])
    fake.log.clear()
    om.release("k0")
    # release: event on the compute stream, then k2's copy into the freed slot waits for it on the data stream
    release_event = fake.log[0][1]
    assert fake.log[0] == ("record", release_event, "compute")
    assert fake.log[1] == ("wait", "data", release_event) and fake.log[3] == ("copy", "data")
    torch.testing.assert_close(om.fetch("k1"), values["k1"])
    torch.testing.assert_close(om.fetch("k2"), values["k2"])
    om.release("k1")
    om.release("k2")
    assert om.device_bytes() == 2 * 256  # the ring: 2 slots of the largest entry (24 bytes, 256-byte aligned)


def test_fetch_without_prefetch_is_a_synchronous_fallback():
    om, fake = manager()
    value = torch.randn(5)
    om.store_async(value, "x")
    torch.testing.assert_close(om.fetch("x"), value)
    assert om.stats["sync_fetches"] == 1
    om.release("x")
    with pytest.raises(KeyError, match="never stored"):
        om.fetch("missing")


def test_full_ring_of_unreleased_entries_is_a_clear_error():
    om, _ = manager(ring_size=1)
    om.store_async(torch.randn(2), "a")
    om.store_async(torch.randn(2), "b")
    om.fetch("a")
    with pytest.raises(RuntimeError, match="no free staging slot"):
        om.fetch("b")


def test_every_store_declares_what_it_is_instead_of_being_probed():
    """Region graphs and the Jano cache read a store's declared capabilities (``capturable``, ``staged``,
    ``wants_hints``, ``layout``) and, for a staged store, its streams and slots: every store, the product's and the
    benchmarks', answers the whole protocol, and exactly the offload managers are staged."""
    packed = PackedOffloadManager(backend=FakeBackend())
    stores = [DeviceStore(), StaticDeviceStore("cpu"), packed, NaiveOffload("cpu"), manager()[0]]
    stores.append(SplitStore(DeviceStore(), manager()[0], resident=lambda key: True))
    assert all(isinstance(store, CacheStore) for store in stores)
    assert [store.staged for store in stores] == [False, False, True, False, True, False]
    assert [isinstance(store, StagedStore) for store in stores] == [False, False, True, False, True, False]
    assert [store.capturable for store in stores] == [False, True, False, False, False, False]
    packed.reserve("a", (2, 3), torch.float32)
    assert packed.chunk_of(["a"]) == {"a": 0} and manager()[0].chunk_of(["a"]) is None


def test_stores_agree():
    value = torch.randn(2, 3)
    split = [SplitStore(DeviceStore(), manager()[0], resident=lambda key, r=r: r) for r in (True, False)]
    for store in (DeviceStore(), NaiveOffload("cpu"), manager()[0], *split):
        store.reserve("k", value.shape, value.dtype)
        store.store_async(value, "k")
        store.begin_fetch_step(["k"])
        torch.testing.assert_close(store.fetch("k"), value)
        store.release("k")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kind", ["packed", "slots"])
def test_offload_manager_round_trip_on_gpu_under_concurrent_compute(kind):
    torch.manual_seed(0)
    entry = 64 * 1024 * 4
    if kind == "packed":  # chunks of 3 entries in 2 slots, stores in batches of 2
        om = PackedOffloadManager("cuda", slot_bytes=3 * entry, slots=2, flush_bytes=2 * entry)
    else:
        om = OffloadManager("cuda", ring_size=3)
    values = {f"k{i}": torch.randn(64, 1024, device="cuda") for i in range(8)}
    for key, value in values.items():
        om.reserve(key, value.shape, value.dtype)
    for key, value in values.items():
        om.store_async(value * 1, key)  # a temporary: only the manager keeps it alive
    om.begin_fetch_step(list(values))
    weight = torch.randn(1024, 1024, device="cuda")
    for key, value in values.items():
        out = om.fetch(key) @ weight
        torch.testing.assert_close(out, value @ weight)
        om.release(key)
    om.synchronize()
    assert om.stats["sync_fetches"] == 0 and om.inflight() == 0
    if kind == "packed":  # adjacent entries of a chunk cross in one copy
        assert om.stats["h2d_copies"] < len(values)


def test_a_store_after_a_prefetch_of_the_same_key_waits_for_that_read():
    om, fake = manager()
    om.store_async(torch.randn(3), "k")
    om.begin_fetch_step(["k"])
    ready = om._issued["k"][1]
    om.fetch("k")
    om.release("k")
    fake.log.clear()
    om.store_async(torch.randn(3), "k")  # e.g. a level-2 step refreshing a medium entry read by the step before
    assert ("wait", "store", ready.number) in fake.log
    assert fake.log.index(("wait", "store", ready.number)) < fake.log.index(("copy", "store"))


def test_ring_size_none_gives_every_entry_a_slot_and_issues_all_copies_at_once():
    backend = FakeBackend()
    om = OffloadManager(ring_size=None, backend=backend)
    values = {f"k{i}": torch.randn(4) for i in range(5)}
    for key, value in values.items():
        om.store_async(value, key)
    om.begin_fetch_step(list(values))
    assert om.stats["prefetches"] == 5 and not om._pending
    for key, value in values.items():
        torch.testing.assert_close(om.fetch(key), value)
    om.store_async(torch.randn(4), "k5")  # a new entry while slots are held: the ring cannot grow now
    for key in values:
        om.release(key)
    om.begin_fetch_step(["k5"])
    assert om.device_bytes() == 6 * 256


def test_clear_frees_every_slot_and_forgets_values_but_keeps_pinned_buffers():
    om, fake = manager(ring_size=2)
    for key in ("a", "b", "c"):
        om.store_async(torch.randn(2), key)
    om.begin_fetch_step(["a", "b", "c"])
    om.fetch("a")  # held; b issued; c pending
    om.clear()
    assert len(om._free_slots) == 2 and not om._issued and not om._held and not om._pending
    assert om.inflight() == 0 and fake.pinned_allocations == 3
    with pytest.raises(KeyError, match="never stored"):
        om.begin_fetch_step(["a"])


def test_begin_fetch_step_twice_queues_each_key_once():
    om, _ = manager(ring_size=1)
    for key in ("a", "b"):
        om.store_async(torch.randn(2), key)
    om.begin_fetch_step(["a", "b"])  # a issued, b pending
    om.begin_fetch_step(["a", "b"])  # e.g. the step itself after the previous step queued its prefetches
    assert list(om._pending) == ["b"] and om.stats["prefetches"] == 1
    for key in ("a", "b"):
        om.fetch(key)
        om.release(key)
    assert om.stats["prefetches"] == 2 and om.stats["sync_fetches"] == 0


def _read(om, keys):
    om.begin_fetch_step(keys)
    out = {}
    for key in keys:
        out[key] = om.fetch(key).clone()
        om.release(key)
    return out


def test_a_slot_still_holding_the_current_version_is_reused_without_a_copy():
    om, fake = manager(ring_size=2)
    a = torch.randn(3)
    om.store_async(a, "a")
    _read(om, ["a"])
    assert om.stats["prefetches"] == 1 and om.stats["h2d_bytes"] == 12
    fake.log.clear()
    torch.testing.assert_close(_read(om, ["a"])["a"], a)  # unchanged since the last fetch: no copy
    assert [e for e in fake.log if e[0] == "copy"] == [] and om.stats["slot_hits"] == 1
    assert om.stats["prefetches"] == 1 and om.stats["h2d_bytes"] == 12
    newer = torch.randn(3)
    om.store_async(newer, "a")  # a new version: the slot is stale, the next fetch copies
    torch.testing.assert_close(_read(om, ["a"])["a"], newer)
    assert om.stats["prefetches"] == 2 and om.stats["slot_hits"] == 1
    off, _ = manager(ring_size=2)
    off.reuse_slots = False
    off.store_async(a, "a")
    _read(off, ["a"])
    _read(off, ["a"])
    assert off.stats["prefetches"] == 2 and off.stats["slot_hits"] == 0


def test_refill_evicts_stale_then_the_entry_read_furthest_ahead():
    om, _ = manager(ring_size=2)
    values = {k: torch.randn(2) for k in "abc"}
    for key, value in values.items():
        om.store_async(value, key)
    _read(om, ["a", "b"])  # slots hold a and b
    om.hint_upcoming(["a"])  # a is read again soon, b not at all
    _read(om, ["c"])  # c must evict b, not a (a was released first, plain LRU would evict it)
    assert om.stats["prefetches"] == 3
    out = _read(om, ["a"])
    assert om.stats["slot_hits"] == 1 and om.stats["prefetches"] == 3
    torch.testing.assert_close(out["a"], values["a"])
    om.store_async(torch.randn(2), "a")  # a's slot is now stale: the next refill takes it before c's
    _read(om, ["b"])
    held = {om._slot_holds[s][0] for s in om._slot_holds if om._holds_current(s)}
    assert held == {"b", "c"}


def test_clear_invalidates_the_slots_of_forgotten_values():
    om, _ = manager(ring_size=2)
    om.store_async(torch.randn(2), "a")
    _read(om, ["a"])
    om.clear()
    value = torch.randn(2)
    om.store_async(value, "a")
    torch.testing.assert_close(_read(om, ["a"])["a"], value)
    assert om.stats["slot_hits"] == 0 and om.stats["prefetches"] == 2


def test_stores_count_bytes_both_ways():
    om, _ = manager(ring_size=2)
    om.store_async(torch.randn(4, 2), "a")
    om.store_async(torch.randn(3), "b")
    _read(om, ["a", "b"])
    assert om.stats["d2h_bytes"] == 44 and om.stats["h2d_bytes"] == 44


# ---- PackedOffloadManager ---------------------------------------------------------------------------------------
def packed(**kwargs):
    backend = FakeBackend()
    return PackedOffloadManager(backend=backend, **kwargs), backend


def jano_like_entries(layers=4, m_tokens=3, s_tokens=5):
    """Entries laid out as JanoCache reserves them: every medium entry, then every static one."""
    shapes = {}
    for part, tokens in (("m", m_tokens), ("s", s_tokens)):
        for layer in range(layers):
            shapes[f"{part}_kv_{layer}"] = (2, 2, 2, tokens, 4)
        shapes[f"{part}_x"] = (2, tokens, 8)
    return shapes


def l1_keys(layers):
    return [k for layer in range(layers) for k in (f"m_kv_{layer}", f"s_kv_{layer}")] + ["m_x", "s_x"]


def test_packed_round_trip_merges_adjacent_entries_into_one_copy_per_run():
    shapes = jano_like_entries()
    entry = 2 * 2 * 2 * 5 * 4 * 4  # bytes of an s_kv entry (float32)
    om, fake = packed(slot_bytes=4 * entry, slots=2, flush_bytes=1 << 30)
    for key, shape in shapes.items():
        om.reserve(key, shape, torch.float32)
    values = {key: torch.randn(shape) for key, shape in shapes.items()}
    for key, value in values.items():
        om.store_async(value.clone(), key)
    assert fake.pinned_allocations == 0 and om.stats["flushes"] == 0  # batched: nothing issued yet
    keys = l1_keys(4)
    om.begin_fetch_step(keys)
    assert fake.pinned_allocations == 1 and om.stats["flushes"] == 1 and om.stats["d2h_copies"] == len(values)
    chunks = om._plan(tuple(keys))
    # every chunk's medium entries are adjacent in the block, and so are its static ones: two copies per chunk
    for chunk in chunks:
        kinds = {key[0] for key in chunk.keys}
        assert len(chunk.runs) == len(kinds)
    for key in keys:
        torch.testing.assert_close(om.fetch(key), values[key])
        om.release(key)
    assert om.stats["sync_fetches"] == 0
    assert om.stats["h2d_copies"] == sum(len(chunk.runs) for chunk in chunks) < len(keys)
    assert om.stats["chunks"] == len(chunks) > 2  # the ring (2 slots) was refilled as chunks were released


def test_packed_events_order_stores_prefetches_and_slot_reuse():
    om, fake = packed(slot_bytes=64, slots=1, flush_bytes=1 << 30)
    a, b = torch.randn(16), torch.randn(16)  # 64 bytes each: one entry per chunk
    om.store_async(a.clone(), "a")
    om.store_async(b.clone(), "b")
    om.begin_fetch_step(["a", "b"])
    flush_done = om._inflight[-1][1]
    log = fake.log
    # the flush waited for the compute stream, and the prefetch for the flush, before copying
    assert log[:2] == [("record", 0, "compute"), ("wait", "store", 0)]
    assert ("wait", "data", flush_done.number) in log
    assert log.index(("wait", "data", flush_done.number)) < log.index(("copy", "data"))
    assert len(om._pending) == 1  # one slot: "b" waits for "a" to be released
    fetched = om.fetch("a")
    ready = om._held["a"][0].event
    assert log[-1] == ("wait", "compute", ready.number)
    torch.testing.assert_close(fetched, a)
    fake.log.clear()
    om.release("a")
    released = fake.log[0]
    assert released[0] == "record" and released[2] == "compute"
    assert fake.log[1] == ("wait", "data", released[1])  # the refill of the slot waits for the release
    torch.testing.assert_close(om.fetch("b"), b)
    om.release("b")


def test_packed_store_waits_for_the_newest_prefetch_and_keeps_its_sources_alive():
    import weakref

    om, fake = packed(slot_bytes=1 << 20, slots=2, flush_bytes=1 << 30)
    om.store_async(torch.randn(8), "k")
    om.begin_fetch_step(["k"])
    ready = om._queued["k"].event
    om.fetch("k")
    om.release("k")
    om.synchronize()
    fake.log.clear()
    source = torch.randn(8)
    alive = weakref.ref(source)
    om.store_async(source, "k")
    del source
    assert alive() is not None and om.inflight() == 1
    om.flush()
    assert ("wait", "store", ready.number) in fake.log
    assert fake.log.index(("wait", "store", ready.number)) < fake.log.index(("copy", "store"))
    assert alive() is not None  # the copy is not known to be complete
    om.synchronize()
    assert alive() is None and om.inflight() == 0


def test_packed_queueing_a_step_twice_is_a_no_op_and_fallback_fetches_are_exact():
    om, fake = packed(slot_bytes=64, slots=1)
    values = {k: torch.randn(16) for k in "abc"}
    for key, value in values.items():
        om.store_async(value, key)
    om.begin_fetch_step(["a", "b", "c"])
    issued = om.stats["chunks"]
    om.begin_fetch_step(["a", "b", "c"])
    assert om.stats["chunks"] == issued and len(om._pending) == 2
    # out of order: "c" is queued behind a full ring, so it is copied now; its chunk is dropped once released
    torch.testing.assert_close(om.fetch("c"), values["c"])
    om.release("c")
    assert om.stats["sync_fetches"] == 1 and len(om._pending) == 1
    for key in "ab":
        torch.testing.assert_close(om.fetch(key), values[key])
        om.release(key)
    assert not om._pending and not om._queued and om.stats["chunks"] == 2
    # never queued at all: a synchronous fetch too
    torch.testing.assert_close(om.fetch("b"), values["b"])
    om.release("b")
    with pytest.raises(KeyError):
        om.begin_fetch_step(["never"])


def test_packed_block_allocated_once_across_trajectories():
    shapes = jano_like_entries()
    om, fake = packed(slot_bytes=1 << 20)
    for trajectory in range(3):
        om.clear()
        for key, shape in shapes.items():
            om.reserve(key, shape, torch.float32)
        om.allocate()  # what JanoCache does after its reserves: no pinned allocation once sampling stores
        assert fake.pinned_allocations == 1
        for key, shape in shapes.items():
            om.store_async(torch.randn(shape), key)
        om.begin_fetch_step(l1_keys(4))
        for key in l1_keys(4):
            om.fetch(key)
            om.release(key)
    assert fake.pinned_allocations == 1 and om.stats["pinned_allocations"] == 1
    # a smaller layout reuses the block; entries stored without a reserve are laid out at the end
    om.clear()
    om.store_async(torch.randn(3), "late")
    om.flush()
    assert fake.pinned_allocations == 1


def test_packed_matches_the_device_store_inside_the_jano_sampler():
    from test_jano import denoise, inputs, sampler_for, tiny_model

    from opensora.inference.cache.jano import JanoCache, JanoConfig

    model, batch = tiny_model(), inputs()
    config = JanoConfig(warmup_steps=3, cooldown_steps=1, refresh_interval=4, dilation=0)
    sampler = sampler_for(model)
    sampler.accelerator = JanoCache(config, store=DeviceStore())
    reference = denoise(sampler, batch, steps=12)
    om, _ = packed(slot_bytes=2048, slots=2, flush_bytes=4096)  # several chunks and flushes per step
    sampler.accelerator = JanoCache(config, store=om)
    assert torch.equal(denoise(sampler, batch, steps=12), reference)
    assert om.stats["chunks"] > 0 and om.stats["sync_fetches"] == 0 and om.stats["flushes"] > 1


def test_packed_odd_sizes_and_an_entry_larger_than_a_slot():
    om, _ = packed(slot_bytes=100, slots=2)
    values = {
        "a": torch.randn(3),
        "b": torch.randn(3, dtype=torch.float64),
        "big": torch.randn(50),
        "c": torch.randn(1),
    }
    for key, value in values.items():
        om.store_async(value, key)
    for _ in range(2):
        om.begin_fetch_step(list(values))
        for key, value in values.items():
            torch.testing.assert_close(om.fetch(key), value)
            om.release(key)
    assert om.device_bytes() == 2 * 256 and om.stats["sync_fetches"] == 0


class SimBackend(FakeBackend):
    """Side streams that really run late: copies on the data / store streams are queued and run at random later
    moments, in stream order, each stream held at its waits until the awaited event's work has run; the compute
    stream runs at once (it is the CPU model), and its waits run the awaited work first. A missing wait in a manager
    shows up as a stale or half-written value in the sampler's output."""

    def __init__(self, seed):
        super().__init__()
        import random

        self.random, self.lag = random.Random(seed), 0.2
        self.queues = {}  # stream -> deque of ("copy", dst, src) / ("wait", stream, position)
        self.ran = {}  # stream -> ops run

    def new_stream(self):
        stream = super().new_stream()
        self.queues[stream], self.ran[stream] = deque(), 0
        return stream

    def _queued(self, stream):
        return self.ran.get(stream, 0) + len(self.queues.get(stream, ()))

    def record(self, event, stream):
        super().record(event, stream)
        event.position = self._queued(stream)
        self._progress()

    def wait(self, stream, event):
        super().wait(stream, event)
        if stream is self.compute:
            self._run_until(event.stream, event.position)
        else:  # what the wait sees is the event's last record at this moment (as cudaStreamWaitEvent)
            self.queues[stream].append(("wait", event.stream, event.position))
        self._progress()

    def done(self, event):
        return event.stream is self.compute or self.ran[event.stream] >= event.position

    def copy(self, dst, src):
        self.log.append(("copy", self.active.name))
        if self.active is self.compute:
            dst.copy_(src)
        else:
            self.queues[self.active].append(("copy", dst, src))
        self._progress()

    def synchronize(self, stream):
        self._run_until(stream, self._queued(stream))

    def _run_until(self, stream, position):
        if stream is self.compute:
            return
        while self.ran[stream] < position:
            self._step(stream)

    def _step(self, stream):
        op = self.queues[stream][0]
        if op[0] == "wait":
            self._run_until(op[1], op[2])
        else:
            op[1].copy_(op[2])
        self.queues[stream].popleft()
        self.ran[stream] += 1

    def _progress(self):
        for stream, queue in self.queues.items():
            if queue and self.random.random() < self.lag:  # now and then one op of each side stream
                self._step(stream)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", ["packed", "slots"])
def test_managers_match_the_device_store_with_side_streams_that_run_late(kind, seed):
    from test_jano import denoise, inputs, sampler_for, tiny_model

    from opensora.inference.cache.jano import JanoCache, JanoConfig

    model, batch = tiny_model(), inputs()
    config = JanoConfig(warmup_steps=3, cooldown_steps=1, refresh_interval=4, dilation=0)
    sampler = sampler_for(model)
    sampler.accelerator = JanoCache(config, store=DeviceStore())
    reference = denoise(sampler, batch, steps=12)
    backend = SimBackend(seed)
    if kind == "packed":
        store = PackedOffloadManager(slot_bytes=2048, slots=2, flush_bytes=4096, backend=backend)
    else:
        store = OffloadManager(ring_size=2, backend=backend)
    sampler.accelerator = JanoCache(config, store=store)
    assert torch.equal(denoise(sampler, batch, steps=12), reference)
