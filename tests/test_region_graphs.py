"""CUDA graphs of the Jano levels (region_graphs.py): the plumbing on a CPU with an eager "capture" (bitwise against
the eager region forward), which graph serves which level and shape, re-captures, fallback; on the GPU the real
graphs against the eager forward and offload + graphs against on-GPU caches + graphs."""

import pytest
import torch
from test_jano import denoise, inputs, random_plan, sampler_for, tiny_model
from test_offload import FakeBackend, SimBackend

from opensora.inference.cache.jano import JanoCache
from opensora.inference.cache.plan import ACTIVE, FULL, MEDIUM, REFRESH, JanoConfig, RegionPlan, entry_shapes
from opensora.inference.cache.region_forward import RegionForward
from opensora.inference.cache.region_graphs import RegionGraphs
from opensora.inference.cache.stores import DeviceStore, PackedOffloadManager, StaticDeviceStore, make_store

SCHEDULE = [REFRESH, ACTIVE, MEDIUM, ACTIVE, MEDIUM, REFRESH, ACTIVE, FULL]
CONFIG = dict(warmup_steps=3, cooldown_steps=1, refresh_interval=4, dilation=0)


class EagerReplayGraphs(RegionGraphs):
    """``RegionGraphs`` with the capture replaced by re-running the captured body (the plumbing runs on a CPU)."""

    @staticmethod
    def usable(x):
        return True

    def _record(self, segment, body):
        body()  # the "capture"
        segment.graph, segment.replay = "eager", body


class FailingGraphs(EagerReplayGraphs):
    def _record(self, segment, body):
        raise RuntimeError("capture refused")


def packed(backend, **kwargs):
    kwargs = dict(dict(slot_bytes=2048, slots=3, flush_bytes=4096, fixed_slots=True), **kwargs)
    return PackedOffloadManager(backend=backend, **kwargs)


@torch.no_grad()
def run_schedule(forward, store, plan, batch, schedule=SCHEDULE):
    """The schedule as JanoCache runs it: entries reserved first, each step's prefetches queued after the last."""
    model = forward.model
    for key, shape in entry_shapes(model, batch["x"].shape[0], plan, forward.num_layers).items():
        store.reserve(key, shape, model.img_in.weight.dtype)
    store.allocate()
    outs = []
    for i, level in enumerate(schedule):
        if level in (ACTIVE, MEDIUM):
            store.begin_fetch_step(plan.entry_keys(forward.num_layers, level))
        outs.append(forward(level, **batch, plan=plan, store=store, store_medium=i != 4))
        following = schedule[i + 1] if i + 1 < len(schedule) else None
        if following in (ACTIVE, MEDIUM):
            store.begin_fetch_step(plan.entry_keys(forward.num_layers, following))
    return outs


def reference_outputs(model, batch, plan, schedule=SCHEDULE):
    return run_schedule(RegionForward(model), DeviceStore(), plan, batch, schedule)


def test_static_device_store_is_the_device_store_bit_for_bit_in_the_sampler():
    model, batch = tiny_model(), inputs()
    sampler = sampler_for(model)
    sampler.accelerator = JanoCache(JanoConfig(**CONFIG), store=DeviceStore())
    reference = denoise(sampler, batch, steps=12)
    sampler.accelerator = JanoCache(JanoConfig(**CONFIG), store=StaticDeviceStore("cpu"))
    assert torch.equal(denoise(sampler, batch, steps=12), reference)
    assert isinstance(make_store("device", "cpu", graphs=True), DeviceStore)  # no graphs off the GPU


@pytest.mark.parametrize("padded,with_cond", [(True, True), (False, False)])
def test_graphed_levels_on_static_device_caches_equal_the_eager_forward_bitwise(padded, with_cond):
    model, batch = tiny_model(), inputs(padded=padded, with_cond=with_cond)
    plan, _ = random_plan()
    reference = reference_outputs(model, batch, plan)
    graphs = EagerReplayGraphs(RegionForward(model))
    store = StaticDeviceStore("cpu")
    outs = run_schedule(graphs, store, plan, batch)
    for out, ref in zip(outs, reference):
        assert torch.equal(out, ref)
    summary = graphs.summary
    # one graph (one segment) per level key: L3, L1, L2 storing, L2 not storing, L0
    assert summary["levels"] == 5 and summary["segments"] == 5 and summary["captures"] == 5
    assert summary["replays"] == len(SCHEDULE) and summary["eager"] == 0 and summary["failures"] == []


def test_new_regions_with_the_same_counts_reload_the_order_and_new_counts_capture_again():
    model, batch = tiny_model(), inputs()
    plan, classes = random_plan()
    graphs = EagerReplayGraphs(RegionForward(model))
    store = StaticDeviceStore("cpu")
    run_schedule(graphs, store, plan, batch)
    captures = graphs.captures
    shuffled = RegionPlan.from_classes(classes[:, torch.randperm(classes.shape[1])])  # same counts, other tokens
    assert (shuffled.k_active, shuffled.k_medium) == (plan.k_active, plan.k_medium)
    assert not torch.equal(shuffled.order, plan.order)
    outs = run_schedule(graphs, store, shuffled, batch)
    assert graphs.captures == captures  # the order is a static input
    for out, ref in zip(outs, reference_outputs(model, batch, shuffled)):
        assert torch.equal(out, ref)
    other, _ = random_plan(seed=5)
    assert (other.k_active, other.k_medium) != (plan.k_active, plan.k_medium)
    outs = run_schedule(graphs, store, other, batch, [REFRESH, ACTIVE])
    assert graphs.captures == captures + 2  # new counts: new shapes
    for out, ref in zip(outs, reference_outputs(model, batch, other, [REFRESH, ACTIVE])):
        assert torch.equal(out, ref)
    new_x = dict(batch, x=batch["x"][:1], timestep=batch["timestep"][:1], text_emb=batch["text_emb"][:1])
    new_x.update(text_mask=batch["text_mask"][:1], pooled=batch["pooled"][:1], cond=batch["cond"][:1])
    with torch.no_grad():
        graphs(FULL, **new_x)
    assert graphs.captures == captures + 3  # a new batch shape


def test_a_new_store_layout_is_a_new_graph():
    model, batch = tiny_model(), inputs()
    plan, _ = random_plan()
    graphs, store = EagerReplayGraphs(RegionForward(model)), StaticDeviceStore("cpu")
    run_schedule(graphs, store, plan, batch, [REFRESH, ACTIVE])
    store.reserve("s_kv_0", (1, 2, 3), torch.float32)  # a buffer made anew: graphs that read the old one are stale
    captures = graphs.captures
    run_schedule(graphs, store, plan, batch, [REFRESH, ACTIVE])
    assert graphs.captures == captures + 2


def test_a_failed_capture_runs_the_eager_forward_and_stays_eager():
    model, batch = tiny_model(), inputs()
    plan, _ = random_plan()
    reference = reference_outputs(model, batch, plan)
    graphs = FailingGraphs(RegionForward(model))
    with pytest.warns(UserWarning, match="capture failed"):
        outs = run_schedule(graphs, StaticDeviceStore("cpu"), plan, batch)
    for out, ref in zip(outs, reference):
        assert torch.equal(out, ref)
    summary = graphs.summary
    assert len(summary["failures"]) == 5 and summary["eager"] == len(SCHEDULE) - 5 and summary["captures"] == 0


def test_off_the_gpu_and_with_plain_device_caches_every_call_is_eager():
    model, batch = tiny_model(), inputs()
    plan, _ = random_plan()
    graphs = RegionGraphs(RegionForward(model))  # the real class: CUDA only
    outs = run_schedule(graphs, StaticDeviceStore("cpu"), plan, batch)
    for out, ref in zip(outs, reference_outputs(model, batch, plan)):
        assert torch.equal(out, ref)
    fake = EagerReplayGraphs(RegionForward(model))
    run_schedule(fake, DeviceStore(), plan, batch)  # entries are fresh tensors: no fixed addresses to graph
    assert graphs.summary["eager"] == len(SCHEDULE) and fake.summary["eager"] == len(SCHEDULE) - 1  # but level 0


def test_fixed_slots_put_chunk_i_of_a_step_in_slot_i_mod_slots():
    backend = FakeBackend()
    om = PackedOffloadManager(slot_bytes=256, slots=3, fixed_slots=True, backend=backend)
    values = {f"k{i}": torch.full((64,), float(i)) for i in range(7)}  # one 256-byte chunk each
    for key, value in values.items():
        om.store_async(value, key)
    ring = om._ring_slot_bytes if om._ring is not None else None
    for step in range(3):
        keys = list(values)[step:]  # other key tuples: other plans, still chunk i -> slot i % 3
        om.begin_fetch_step(keys)
        for i, key in enumerate(keys):
            tensor = om.fetch(key)
            ring = om._ring_slot_bytes
            assert (tensor.data_ptr() - om._ring.data_ptr()) // ring == i % 3
            assert torch.equal(tensor, values[key])
            om.release(key)
    assert om.stats["sync_fetches"] == 0


@pytest.mark.parametrize("seed", range(3))
def test_offload_with_graphs_equals_the_on_device_caches_with_side_streams_that_run_late(seed):
    """The segmented path: the manager's fetch / release / stores between segments, the output ring and its waits;
    side streams that run late make a missing wait show up as a wrong value."""
    model, batch = tiny_model(), inputs()
    sampler = sampler_for(model)
    sampler.accelerator = JanoCache(JanoConfig(**CONFIG), store=DeviceStore())
    reference = denoise(sampler, batch, steps=12)
    store = packed(SimBackend(seed))
    cache = JanoCache(JanoConfig(**CONFIG, graphs=True), store=store, graphs=EagerReplayGraphs)
    sampler.accelerator = cache
    assert torch.equal(denoise(sampler, batch, steps=12), reference)
    assert torch.equal(denoise(sampler, batch, steps=12), reference)  # the graphs kept from the first trajectory
    summary = cache._forward.summary
    assert summary["segments"] > summary["levels"]  # the offload levels are cut into segments
    assert summary["recaptures"] == 0 and summary["eager_segments"] == 0 and summary["eager"] == 0
    assert store.stats["sync_fetches"] == 0


@pytest.mark.parametrize("seed", range(3))
def test_segmented_schedule_with_medium_stores_equals_the_eager_forward_with_late_side_streams(seed):
    model, batch = tiny_model(), inputs()
    plan, _ = random_plan()
    assert plan.k_active < plan.k_medium < plan.num_tokens  # level 2 stores medium entries, level 1 reads both
    reference = reference_outputs(model, batch, plan)
    graphs, store = EagerReplayGraphs(RegionForward(model)), packed(SimBackend(seed), slot_bytes=1024)
    for _ in range(2):
        store.clear()
        outs = run_schedule(graphs, store, plan, batch)
        for out, ref in zip(outs, reference):
            assert torch.equal(out, ref)
    assert graphs.summary["recaptures"] == 0 and graphs.summary["eager_segments"] == 0
    assert graphs.summary["captures"] == graphs.summary["segments"]


def test_fetches_at_other_addresses_capture_again_then_run_eagerly():
    """Without fixed slots the chunks rotate over the ring: the address check re-captures, then gives up; the result
    stays exact."""
    model, batch = tiny_model(), inputs()
    plan, _ = random_plan()
    reference = reference_outputs(model, batch, plan)
    graphs = EagerReplayGraphs(RegionForward(model))
    outs = run_schedule(graphs, packed(FakeBackend(), slots=2, fixed_slots=False), plan, batch)
    for out, ref in zip(outs, reference):
        assert torch.equal(out, ref)
    assert graphs.summary["recaptures"] > 0


def test_segments_read_and_store_at_most_the_budget_and_cover_every_entry():
    model = tiny_model()
    plan, _ = random_plan()
    graphs = RegionGraphs(RegionForward(model))
    for level, store_medium in ((REFRESH, True), (ACTIVE, True), (MEDIUM, True), (MEDIUM, False)):
        segments = graphs.segments(level, plan, 2, 3000, store_medium)
        assert [s.lo for s in segments[1:]] == [s.hi for s in segments[:-1]] and segments[-1].hi == 4
        reads = [k for s in segments for k in s.reads]
        assert reads == list(plan.entry_keys(4, level)) if level in (ACTIVE, MEDIUM) else reads == []
        stores = [k for s in segments for k in s.stores]
        expected = {REFRESH: 10, MEDIUM: 5 if store_medium else 0, ACTIVE: 0}[level]
        assert len(stores) == expected and len(segments) > 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_graphs_of_the_levels_match_the_eager_levels():
    model = tiny_model().cuda().to(torch.bfloat16)
    # the region forward gets the model's dtype as the sampler would hand it (only the sampler casts)
    batch = {
        k: None if v is None else v.cuda().to(torch.bfloat16 if v.is_floating_point() else v.dtype)
        for k, v in inputs().items()
    }
    plan, _ = random_plan()
    plan = RegionPlan(plan.order.cuda(), plan.k_active, plan.k_medium)
    eager = reference_outputs(model, batch, plan)
    graphs, store = RegionGraphs(RegionForward(model)), StaticDeviceStore("cuda")
    for _ in range(2):  # captures, then replays of the same graphs
        outs = run_schedule(graphs, store, plan, batch)
        summary = graphs.summary
        diffs = [float((o.float() - r.float()).abs().max()) for o, r in zip(outs, eager)]
        print("summary", summary, "max |diff| per step", diffs)  # the first failure on an H100 printed neither
        assert summary["failures"] == [], summary["failures"]
        for level, out, ref in zip(SCHEDULE, outs, eager):  # bf16; a capture may pick other kernels than eager
            torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2, msg=lambda m: f"L{level}: {m}")
    assert summary["eager"] == 0 and summary["replays"] == 2 * len(SCHEDULE), summary
    assert summary["captures"] == 5, summary  # L3, L1, L2 storing, L2 not storing, L0
    print("graphed levels bitwise equal to eager:", all(torch.equal(o, r) for o, r in zip(outs, eager)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_offload_with_cuda_graphs_equals_on_gpu_caches_with_cuda_graphs_in_the_sampler():
    model = tiny_model().cuda().to(torch.bfloat16)
    batch = {k: v.cuda() if v is not None else None for k, v in inputs().items()}
    sampler = sampler_for(model)
    on_gpu = JanoCache(JanoConfig(**CONFIG, graphs=True), store=StaticDeviceStore("cuda"))
    sampler.accelerator = on_gpu
    graphed = denoise(sampler, batch, steps=12)
    # several chunks and segments per step
    offload = JanoCache(
        JanoConfig(**CONFIG, graphs=True),
        store=PackedOffloadManager("cuda", slot_bytes=8 * 1024, slots=3, flush_bytes=16 * 1024, fixed_slots=True),
    )
    sampler.accelerator = offload
    for _ in range(2):  # the second trajectory replays the graphs of the first
        assert torch.equal(denoise(sampler, batch, steps=12), graphed)
    torch.cuda.synchronize()
    for cache in (on_gpu, offload):
        summary = cache._forward.summary
        assert summary["failures"] == [] and summary["eager"] == 0 and summary["eager_segments"] == 0
        assert summary["recaptures"] == 0
    assert offload._forward.summary["segments"] > offload._forward.summary["levels"]
    assert offload.store.stats["sync_fetches"] == 0 and offload.store.inflight() == 0
