"""The chunk decode on a decode stream of its GPU (``Plan.decode_stream="side"``): the simulator's decode lanes and
its contention model against closed forms, the runtime's waits for a side-stream decode (both lanes on the CPU, where
streams are no-ops: what each task queues, and on which stream, is recorded), and the option's checks."""

import contextlib
import itertools

import pytest
import torch
from test_pipeline_parallel import RecordingLanes, text_inputs, tiny_model

from opensora.inference.pipeline_parallel.runtime import _Value, run_plan
from opensora.inference.pipeline_parallel.schedule import (
    DECODE_STREAMS,
    DEFAULT_COSTS,
    Plan,
    Task,
    build_graph,
    in_order_timeline,
    schedule,
    simulate,
)
from opensora.inference.pipeline_parallel.stages import place_model

# prep and update free, stage0 1, stage1 2, decode 3: small enough to follow by hand
HAND_COSTS = dict(prep=0.0, stage0=1.0, stage1=2.0, update=0.0, decode=3.0)


@pytest.mark.parametrize("contention", [0.0, 0.5, 1.0])
def test_a_side_stream_decode_overlaps_the_next_chunks_pass_as_the_contention_model_says(contention):
    """Two chunks, one step, the cache written by the denoising pass. GPU0: stage0 c0 [0, 1], stage0 c1 [1, 2].
    GPU1: stage1 c0 [1, 3]; at 3 both decode c0 (3) and stage1 c1 (2) start, on two streams of GPU1, each at
    1 / (1 + c) of its speed: stage1 c1 ends at 3 + 2 (1 + c), and decode c0, alone from then on, at 3 + 3 + 2c;
    decode c1 follows it: makespan 9 + 2c. On the compute stream the decode of c0 (older work first) runs before
    stage1 c1: 3 + 3 + 2 + 3 = 11, which full contention (c = 1) reaches too: then overlap gains nothing."""
    c = contention
    side = Plan(num_chunks=2, num_steps=1, refill=False, decode_stream="side")
    compute = Plan(num_chunks=2, num_steps=1, refill=False, decode_stream="compute")
    sim = simulate(side, "basic", HAND_COSTS, contention=c)
    d0, d1, s1 = side.decode_task(0, 0), side.decode_task(0, 1), Task("stage1", 0, 1, 0, 0)
    assert d0.stream == DECODE_STREAMS[1] and s1.stream == 1
    assert sim.start[d0] == sim.start[s1] == 3.0
    assert sim.finish[s1] == pytest.approx(3 + 2 * (1 + c))
    assert sim.finish[d0] == pytest.approx(6 + 2 * c)
    assert sim.start[d1] == pytest.approx(6 + 2 * c) and sim.makespan == pytest.approx(9 + 2 * c)
    # busy: GPU0 its two stage0s; GPU1 from stage1 c0 to the end (two streams' intervals merged, as measured)
    assert sim.busy == pytest.approx((2.0, 8 + 2 * c))
    assert in_order_timeline(side, sim.order, "basic", HAND_COSTS, contention=c).makespan == pytest.approx(9 + 2 * c)
    for contention_of_compute in (0.0, c):  # one stream per GPU: nothing to share, whatever the factor
        assert simulate(compute, "basic", HAND_COSTS, contention=contention_of_compute).makespan == 11.0


def _independent_lanes(plan, order, mode, costs):
    """Each stream a FIFO of ``order``'s tasks that starts a task when it is free and the task's dependencies have
    finished (the max-plus timeline of independent streams)."""
    costs = {**DEFAULT_COSTS, **(costs or {})}
    deps = build_graph(plan, mode)
    start, finish, free_at = {}, {}, {}
    for t in order:
        start[t] = max([free_at.get(t.stream, 0.0)] + [finish[d] for d in deps[t]])
        finish[t] = free_at[t.stream] = start[t] + costs[t.kind]
    return start, finish


PLANS = [
    Plan(num_groups=g, num_chunks=3, num_steps=s, refill=r, decode_lanes=lanes, decode_stream=ds)
    for g, s, r, ds in itertools.product((1, 2), (1, 3), (False, True), ("side", "compute"))
    for lanes in ([(), (0,) * g] + ([(0, 1)] if g == 2 else []))
]
COST_SETS = [
    None,
    dict(prep=0.2, stage0=3.7, stage1=4.07, update=0.036, decode=0.39),
    dict(prep=0.3, stage0=1.4, stage1=0.6, update=0.05, decode=9.0),  # the real VAE: a decode ~ a chunk's passes
]


@pytest.mark.parametrize("mode", ["basic", "aggressive"])
@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_contention_zero_is_independent_lanes(plan, mode):
    """With ``contention=0`` the simulated timeline of the issue order is that of independent FIFO streams (the
    two compute streams, the prep stream, the decode streams)."""
    for costs in COST_SETS:
        sim = schedule(plan, mode, costs, contention=0.0)
        start, finish = _independent_lanes(plan, sim.order, mode, costs)
        assert sim.start == pytest.approx(start) and sim.finish == pytest.approx(finish)
        if plan.decode_stream == "compute":  # one stream per GPU: the factor changes nothing
            assert schedule(plan, mode, costs, contention=0.7).finish == pytest.approx(finish)


def test_contention_only_slows_a_side_stream_plan_down():
    plan = Plan(num_groups=2, num_chunks=4, num_steps=2, refill=True, decode_lanes=(0, 1))
    costs = COST_SETS[2]
    spans = [schedule(plan, "basic", costs, contention=c).makespan for c in (0.0, 0.25, 0.5, 1.0)]
    assert spans == sorted(spans) and spans[0] < spans[-1]
    with pytest.raises(ValueError, match="contention must be >= 0"):
        simulate(plan, contention=-0.1)


def test_the_decode_stream_option_is_checked_in_one_line():
    with pytest.raises(ValueError, match=r"decode_stream must be one of \('side', 'compute'\), got 'gpu'") as error:
        Plan(decode_stream="gpu")
    assert "\n" not in str(error.value)
    assert str(Plan().decode_task(0, 1)) == "decode.g0.c1.gpu1.side" and Plan().decode_stream == "side"
    assert not Plan(decode_stream="compute").decode_task(0, 0).side


def test_nothing_but_the_next_decode_waits_for_a_decode():
    plan = Plan(num_groups=2, num_chunks=3, num_steps=2, refill=True, decode_lanes=(0, 1))
    for task, deps in build_graph(plan).items():
        if any(d.kind == "decode" for d in deps):
            assert task.kind == "decode" and [d for d in deps if d.kind == "decode"] == [
                plan.decode_task(task.group, task.chunk - 1)
            ]


class _StubLanes:
    """Two devices that differ (unlike CPU lanes): what a value's consumer queues, in order."""

    devices = ("gpu0", "gpu1")

    def __init__(self):
        self.log = []

    def wait(self, lane, ready):
        self.log.append(("wait", lane, ready))

    def hand_over(self, tree, lane):
        self.log.append(("hand_over", lane, tree))

    def pull(self, value, ready, lane):
        self.log.append(("pull", lane, ready))
        return f"{value}@{lane}"


def test_a_side_stream_consumer_waits_for_the_value_itself_and_takes_its_own_copy():
    """The x0 of a chunk is made on GPU1's compute stream. A decode on GPU1's decode stream waits for its event and
    marks it as read there; a decode on GPU0's decode stream pulls a copy of its own, even where the refill's stage0
    has already pulled one for GPU0's compute stream (that copy is ready only on the compute stream)."""
    lanes = _StubLanes()
    x0 = _Value("x0", 1, "x0-ready")
    assert x0.on_side_stream(lanes, 1) == "x0"
    assert lanes.log == [("wait", 1, "x0-ready"), ("hand_over", 1, "x0")]
    lanes.log.clear()
    assert x0.on(lanes, 0) == "x0@0"  # the refill's stage0, on GPU0's compute stream: cached
    assert x0.on_side_stream(lanes, 0) == "x0@0" and lanes.log == [("pull", 0, "x0-ready")] * 2
    assert x0.copies == {1: "x0", 0: "x0@0"}


class StreamLanes(RecordingLanes):
    """``RecordingLanes`` that log, per task, what it queues (waits, pulls, hand-overs) and on which side stream,
    from the moment the runtime enters the task's stream scope (its inputs are pulled before its work)."""

    def __init__(self, devices):
        super().__init__(devices)
        self.side = None

    def record(self, op, lane):
        self.log.append((self.current, op, lane, self.side))

    @contextlib.contextmanager
    def side_stream(self, task):  # the runtime's scope of a task: its inputs, its work, its serial wait
        self.current = task
        with super().side_stream(task):
            yield
        self.current = None

    @contextlib.contextmanager
    def _on(self, name):
        self.side = name
        yield
        self.side = None

    def prep_stream(self, lane):
        return self._on("prep")

    def decode_stream(self, lane):
        return self._on("decode")

    def hand_over(self, tree, lane):
        self.record("hand_over", lane)
        super().hand_over(tree, lane)


def two_videos_of_three_chunks():
    """A tiny causal MMDiT (split after block 2 on two CPU lanes), two videos of 3 chunks with a stand-in decode,
    and their one-device chunks: (model, groups, latent_size, times, stage options, [(latents, frames)] per video)."""
    from streaming_reference import stream_reference

    model = tiny_model(causal_chunk_frames=2)
    groups = [dict(seeds=[3 + g], branches=[text_inputs(1, 5, g, masked=False)]) for g in range(2)]
    latent_size, times = (12, 6, 8, 8), [1.0, 0.5, 0.0]
    decode = lambda device, group: lambda x: (x * 10).round().to(torch.int16)  # noqa: E731
    kw = dict(refill=True, rollout="renoise", make_decoder=decode)
    refs = [stream_reference(model, g, latent_size, times, **kw) for g in groups]
    place_model(model, 2, ["cpu", "cpu"])
    return model, groups, latent_size, times, kw, refs


@pytest.mark.parametrize("mode", ["off", "basic", "aggressive"])
def test_a_side_stream_decode_queues_everything_on_its_decode_stream(mode, one_thread):
    """Each decode runs with its lane's decode stream current and queues its wait for x0 there (the compute
    streams queue nothing for it); a compute-stream decode does not. Same frames either way."""
    from opensora.inference.pipeline_parallel.streaming_stages import CausalStreamingStages

    model, groups, latent_size, times, kw, refs = two_videos_of_three_chunks()
    logs = {}
    for decode_stream in ("side", "compute"):
        lanes = StreamLanes(["cpu", "cpu"])
        stages = CausalStreamingStages(
            model, lanes, 2, groups, latent_size, times, decode_lanes=(0, 1), decode_stream=decode_stream, **kw
        )
        result, _ = run_plan(stages, mode, lanes, threads=False)
        for g, (latents, frames) in enumerate(refs):
            for c in range(3):
                assert torch.equal(result.latents[(g, c)], latents[c]) and torch.equal(result.frames[(g, c)], frames[c])
        logs[decode_stream] = lanes.log
    by_decode = [e for e in logs["side"] if e[0] is not None and e[0].kind == "decode"]
    decodes = {e[0] for e in by_decode}
    assert len(decodes) == 6 and all(t.side for t in decodes)
    assert all(side == "decode" for _, _, _, side in by_decode)  # nothing a decode queues lands on a compute stream
    for t in decodes:  # its x0 (made on lane 1's compute stream): waited for on the decode stream, then handed over
        ops = [(op, lane) for task, op, lane, _ in by_decode if task == t]
        assert ("wait", t.device) in ops and ("hand_over", t.device) in ops, (t, ops)
    compute = [e for e in logs["compute"] if e[0] is not None and e[0].kind == "decode"]
    assert compute and all(side is None for _, _, _, side in compute)
