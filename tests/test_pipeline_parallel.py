"""Two-stage pipeline overlap (opensora/inference/pipeline_parallel/schedule.py): the schedule's dependencies and KV write
order (pure), and bit-identical outputs against the single-device samplers with both stages on the CPU."""

import contextlib
import itertools

import numpy as np
import pytest
import torch

from opensora.inference.pipeline_parallel.runtime import Lanes, run_plan, summarize_timeline
from opensora.inference.pipeline_parallel.schedule import (
    OVERLAP_MODES,
    Plan,
    Task,
    build_graph,
    check_order,
    natural_order,
    schedule,
    simulate,
)
from opensora.inference.pipeline_parallel.split import choose_split, parse_split
from opensora.inference.pipeline_parallel.stages import BidirectionalStages, place_model, sample_microbatched
from opensora.inference.sampler import VideoSampler
from opensora.models.mmdit.configs import mmdit_config
from opensora.registry import MODELS, build_module

PLANS = [
    Plan(num_groups=g, num_branches=b, num_chunks=3, num_steps=s, refill=r)
    for g, b, s, r in itertools.product((1, 2), (1, 2), (1, 3), (False, True))
]


# ---- the schedule (pure) ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", OVERLAP_MODES)
@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_every_schedule_is_a_valid_issue_order_with_window_major_kv_writes(plan, mode):
    from collections import Counter

    from opensora.inference.pipeline_parallel.split import tasks_per_kind

    sim = schedule(plan, mode)  # check_order inside: deps first, KV writes chunk by chunk per (stage, group, branch)
    assert len(sim.order) == len(build_graph(plan, mode))
    assert Counter(t.kind for t in sim.order) == tasks_per_kind(plan)
    # per stream (two compute streams, GPU0's prep stream), the order a FIFO stream executes is the simulated one
    for stream in (0, 1, 2):
        starts = [sim.start[t] for t in sim.order if t.stream == stream]
        assert starts == sorted(starts)


COST_SETS = [
    None,  # DEFAULT_COSTS
    dict(prep=0.2, stage0=3.7, stage1=4.07, update=0.036, decode=0.39),  # ms per task, 2 H200s, 1B, split 10
    dict(prep=2.0, stage0=0.8, stage1=1.3, update=0.05, decode=0.9),  # a prep dearer than a stage
    dict(prep=0.3, stage0=1.4, stage1=0.6, update=0.0, decode=0.0),
]


@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_aggressive_issues_basic_stage_order_with_each_prep_hoisted(plan, prefetch):
    """``aggressive`` = ``basic``'s issue order of every non-prep task, each chunk's prep moved to the earliest point
    its dependencies allow (after chunk c-prefetch's first stage0), preps kept in basic's sequence (the prep stream
    runs them in issue order); so its timeline is never longer than basic's, for any costs."""
    from opensora.inference.pipeline_parallel.schedule import in_order_timeline

    for costs in COST_SETS:
        basic, aggressive = schedule(plan, "basic", costs, prefetch), schedule(plan, "aggressive", costs, prefetch)
        assert [t for t in aggressive.order if t.kind != "prep"] == [t for t in basic.order if t.kind != "prep"]
        assert [t for t in aggressive.order if t.kind == "prep"] == [t for t in basic.order if t.kind == "prep"]
        assert in_order_timeline(plan, basic.order, "basic", costs).makespan == pytest.approx(basic.makespan)
        deps = build_graph(plan, "aggressive", prefetch)
        previous = None
        for i, t in enumerate(aggressive.order):
            if t.kind == "prep":
                if deps[t] or previous is not None:  # right after the last task it waits for
                    assert aggressive.order[i - 1] in deps[t] or aggressive.order[i - 1] == previous
                previous = t
        assert aggressive.makespan <= basic.makespan + 1e-9
        for t in basic.order:  # no task starts later than in basic
            assert aggressive.start[t] <= basic.start[t] + 1e-9, t


def test_aggressive_gains_when_a_prep_would_delay_the_next_chunk():
    """Hoisting pays where a chunk's first stage0 would wait for its prep (a dear prep, GPU0 otherwise idle)."""
    plan = Plan(num_chunks=6, num_steps=3, refill=False)  # basic: prep of c+1 after c's last stage0, then waits
    costs = dict(prep=1.5, stage0=1.0, stage1=1.0, update=0.0, decode=0.2)
    assert schedule(plan, "aggressive", costs).makespan < 0.9 * schedule(plan, "basic", costs).makespan


def _timeline_with_prep_waits_on_gpu1(plan, order, mode, costs):
    """``in_order_timeline`` for the executor before 2026-11-23c: the prep ran on GPU0's compute stream and pulled
    the chunk's RoPE tables onto GPU1 there, so GPU1's stream waited for the prep (everything GPU0 was given before
    it, then the prep) before any GPU1 task issued after it could start."""
    from opensora.inference.pipeline_parallel.schedule import DEFAULT_COSTS

    costs = {**DEFAULT_COSTS, **costs}
    deps = build_graph(plan, mode)
    finish, free_at, busy = {}, [0.0, 0.0], [0.0, 0.0]
    for t in order:
        start = max([free_at[t.device]] + [finish[d] for d in deps[t]])
        finish[t] = free_at[t.device] = start + costs[t.kind]
        busy[t.device] += costs[t.kind]
        if t.kind == "prep":
            free_at[1] = max(free_at[1], finish[t])  # GPU1's stream: wait_event on the RoPE copy
    span = max(finish.values())
    return span, busy[1] / span


@pytest.mark.parametrize("refill", [True, False])
def test_a_prep_that_makes_gpu1_wait_is_what_cost_aggressive_its_speed(refill):
    """The 2026-11-23b H200 run (2 items, 4 steps, split 10): ``aggressive`` issued ``basic``'s stage order with the
    preps hoisted and still ran 5-8% slower (paired medians; profiled span 261 -> 274 ms, GPU1 busy 0.96 -> 0.91).
    With the measured per-task costs, a GPU1 wait at each prep's issue position reproduces that: a prep hoisted to
    just after chunk t's first stage0 holds back the GPU1 tasks issued after it (chunk t-1's refill stage1, the
    other item's update) until GPU0 has finished that stage0. Without the wait (the prep now runs on GPU0's prep
    stream and touches nothing of GPU1) the two modes' timelines are equal."""
    costs = COST_SETS[1]
    # that run decoded on GPU1's compute stream (as the helper times every task on its GPU's one stream)
    plan = Plan(num_groups=2, num_chunks=6, num_steps=4, refill=refill, decode_stream="compute")
    basic, aggressive = schedule(plan, "basic", costs), schedule(plan, "aggressive", costs)
    old_basic, busy1_basic = _timeline_with_prep_waits_on_gpu1(plan, basic.order, "basic", costs)
    old_aggressive, busy1_aggressive = _timeline_with_prep_waits_on_gpu1(plan, aggressive.order, "aggressive", costs)
    assert old_aggressive > 1.04 * old_basic and busy1_aggressive < busy1_basic - 0.03
    assert old_basic == pytest.approx(basic.makespan, rel=0.01)  # in basic the wait cost almost nothing
    assert aggressive.makespan <= basic.makespan + 1e-9


def test_check_order_rejects_a_cache_write_out_of_window_order():
    plan = Plan(num_chunks=2, num_steps=1, refill=True)
    order = natural_order(plan)
    # move chunk 1's first stage0 before chunk 0's refill stage0 (which writes blocks[:split]'s cache)
    early = Task("stage0", 0, 1, 0, 0)
    refill = Task("stage0", 0, 0, 1, 0)
    bad = [t for t in order if t != early]
    bad.insert(bad.index(refill), early)
    with pytest.raises(AssertionError, match="before its dependencies"):
        check_order(plan, bad, "basic")


def test_dependencies_of_refill_and_next_chunk():
    plan = Plan(num_chunks=2, num_steps=2, refill=True)
    deps = build_graph(plan)
    # the refill (step 2) waits for the chunk's final x0; the next chunk's stage0 waits for the refill's stage0 only
    assert deps[Task("stage0", 0, 0, 2, 0)] == [Task("update", 0, 0, 1)]
    assert Task("stage0", 0, 0, 2, 0) in deps[Task("stage0", 0, 1, 0, 0)]
    assert Task("stage1", 0, 0, 2, 0) in deps[Task("stage1", 0, 1, 0, 0)]
    assert Task("stage1", 0, 0, 2, 0) not in deps[Task("stage0", 0, 1, 0, 0)]


def test_simulated_speedups_follow_the_dependencies():
    costs = dict(decode=0.0, update=0.0, prep=0.0)

    def speedup(plan, mode="basic"):
        return simulate(plan, "off", costs).makespan / simulate(plan, mode, costs).makespan

    # one video, 1 step + refill: only the refill's stage1 overlaps the next chunk's stage0: -> 4/3
    assert speedup(Plan(num_chunks=40, num_steps=1, refill=True)) == pytest.approx(4 / 3, rel=0.02)
    # the cache written by the denoising pass (FlashVSR's one-step case): stages overlap fully -> ~2x
    assert speedup(Plan(num_chunks=40, num_steps=1, refill=False)) == pytest.approx(2.0, rel=0.03)
    # several steps per chunk on one video: little overlap; two independent groups in flight: ~2x again
    assert speedup(Plan(num_chunks=10, num_steps=4, refill=True)) < 1.15
    assert speedup(Plan(num_groups=2, num_chunks=10, num_steps=4, refill=True)) > 1.9
    # off is the serial sum; the last chunk has no refill (nothing reads its cache): 3 + 3 + 2 forwards
    plan = Plan(num_chunks=3, num_steps=2, refill=True)
    assert simulate(plan, "off", costs).makespan == pytest.approx((3 + 3 + 2) * 2.0)
    assert [plan.forwards(c) for c in range(3)] == [3, 3, 2] and not plan.writes_kv(2) and plan.writes_kv(1)


def test_choose_split_balances_the_simulated_pipeline():
    plan = Plan(num_groups=2, num_chunks=4, num_steps=1)
    # GPU1 also decodes: the split moves towards GPU1's end to give GPU0 more blocks
    split, rows = choose_split(plan, "basic", [1.0] * 10, embed_ms=0.0, final_ms=0.0, decode_ms=2.0)
    assert len(rows) == 9 and split > 4
    assert min(r["simulated_ms"] for r in rows) == next(r for r in rows if r["split"] == split)["simulated_ms"]
    assert parse_split("auto", 10) is None and parse_split("3", 10) == 3
    with pytest.raises(ValueError):
        parse_split(9, 10)


def test_auto_split_moves_towards_gpu1_when_blocks_cost_their_graphed_times():
    """The 1B shape's 8 double + 16 single blocks: eager, a double block costs ~1.75x a single one (launch time, the
    H200 stage times of 2026-11-23), graphed ~1.3x (estimated from that run's graphed stage totals): ``auto`` from
    the eager times leaves GPU1 the longer stage of a graphed pipeline; from graphed times it balances."""
    plan = Plan(num_groups=2, num_chunks=6, num_steps=4, refill=True)
    eager = [1.2] * 8 + [0.68] * 16
    graphed = [0.41] * 8 + [0.32] * 16
    split_eager, _ = choose_split(plan, "basic", eager, embed_ms=1.24, final_ms=0.21, decode_ms=0.77)
    split_graphed, rows = choose_split(plan, "basic", graphed, embed_ms=0.15, final_ms=0.05, decode_ms=0.8)
    assert split_eager == 7 and split_graphed == 10
    at = {r["split"]: r["simulated_ms"] for r in rows}
    assert at[10] < 0.9 * at[7]  # the eager-chosen split costs the graphed pipeline > 10%


def test_calibrated_block_times_move_the_split_to_what_the_passes_measured():
    """The 2026-11-23b H200 run: per-block graphed probes 0.43 ms (double) / 0.33 ms (single), whole passes at
    split 10 measured 3.72 ms (stage0) / 4.07 ms (stage1) in the profiled ``off`` run. Calibrated, the stage sums
    at split 10 equal the passes, and ``auto`` moves one single block to GPU0 (simulated ~3% faster)."""
    from opensora.inference.pipeline_parallel.split import (
        calibrate_block_ms,
        measured_task_ms,
        stage_costs,
        tasks_per_kind,
    )

    probe = [0.43] * 8 + [0.33] * 16
    plan = Plan(num_groups=2, num_chunks=6, num_steps=4, refill=True)
    counts = tasks_per_kind(plan)
    assert counts == dict(prep=12, stage0=58, stage1=58, update=48, decode=12)  # no refill of the last chunks
    ms = dict(prep=2.45, stage0=223.2, stage1=244.1, update=0.84, decode=4.7)  # that run's ms_per_kind (off)
    ms.update(stage0=223.2 * 58 / 60, stage1=244.1 * 58 / 60)  # it ran 60 passes per stage (refilled the last)
    per_task = measured_task_ms(plan, ms)
    assert per_task["stage0"] == pytest.approx(3.72) and per_task["stage1"] == pytest.approx(4.068, abs=1e-3)
    blocks = calibrate_block_ms(probe, 8, 10, 0.06, 0.03, per_task["stage0"], per_task["stage1"])
    at10 = stage_costs(blocks, 10, 0.06, 0.03, 0.0, 0.0, 0.0)
    assert at10["stage0"] == pytest.approx(per_task["stage0"]) and at10["stage1"] == pytest.approx(per_task["stage1"])
    assert blocks[0] == pytest.approx(0.341, abs=1e-3) and blocks[-1] == pytest.approx(0.311, abs=1e-3)
    extra = dict(update_ms=per_task["update"], decode_ms=per_task["decode"], prep_ms=per_task["prep"])
    assert choose_split(plan, "basic", probe, 0.06, 0.03, **extra)[0] == 10
    split, rows = choose_split(plan, "basic", blocks, 0.06, 0.03, **extra)
    at = {r["split"]: r["simulated_ms"] for r in rows}
    assert split == 11 and at[11] < 0.98 * at[10]
    # one kind only (or a degenerate system): one factor for every block
    flat = calibrate_block_ms([1.0] * 4, 0, 1, 0.0, 0.0, 1.0, 1.0)
    assert flat == [0.5] * 4


def test_calibrated_split_moves_the_split_to_what_whole_passes_measured():
    """``calibrated_split`` (the benchmark's and the CLI's ``--pp-split auto``), by hand: 4 double + 8 single blocks
    that the probe times at 1 ms each, so at split 5 (4 double + 2 single blocks on GPU0) the stages look balanced
    (6 / 6 ms) and the probe picks 5. The whole passes there took 6 ms (stage0) and 9 ms (stage1): the single
    blocks cost s = 9 / 6 = 1.5 ms, the double ones d = (6 - 2 s) / 4 = 0.75 ms. Then split 6 balances the stages
    (4 d + 3 s = 7.5 = 5 s) and is chosen: one block moves to GPU0."""
    from opensora.inference.pipeline_parallel.split import calibrated_split

    plan = Plan(num_groups=2, num_chunks=4, num_steps=1)
    probe = dict(embed_ms=0.0, block_ms=[1.0] * 12, final_ms=0.0, decode_ms=0.0)
    assert choose_split(plan, "aggressive", probe["block_ms"], 0.0, 0.0)[0] == 5
    split, rows, details = calibrated_split(plan, "aggressive", probe, 4, dict(split=5, stage0=6.0, stage1=9.0))
    assert details["block_ms"] == pytest.approx([0.75] * 4 + [1.5] * 8)
    assert details["probe_split"] == 5 and split == 6
    assert details["costs"]["stage0"] == pytest.approx(7.5) and details["costs"]["stage1"] == pytest.approx(7.5)
    assert rows[5]["stage0_ms"] == pytest.approx(6.0) and rows[5]["stage1_ms"] == pytest.approx(9.0)
    assert min(r["simulated_ms"] for r in rows) == rows[6]["simulated_ms"] < rows[5]["simulated_ms"]
    # measured extras (a profiled run's prep / update / decode per task) are the costs; else the probe's decode
    assert details["costs"]["decode"] == 0.0 and details["costs"]["update"] == 0.0
    measured = dict(split=5, stage0=6.0, stage1=9.0, prep=0.3, update=0.1, decode=2.0)
    costs = calibrated_split(plan, "aggressive", dict(probe, decode_ms=5.0), 4, measured)[2]["costs"]
    assert (costs["prep"], costs["update"], costs["decode"]) == (0.3, 0.1, 2.0)
    # the 1B shape on 2 H200s (2026-11-23c): graphed probes 0.43 / 0.33 ms per double / single block (decode 0.65
    # ms), passes at split 10 of 3.68 / 4.04 ms: with the CLI's costs (no prep / update) the choice is 11, as the
    # benchmark's from its profiled run
    h200 = dict(embed_ms=0.06, block_ms=[0.43] * 8 + [0.33] * 16, final_ms=0.03, decode_ms=0.65)
    plan = Plan(num_groups=2, num_chunks=6, num_steps=4, refill=True)
    split, _, details = calibrated_split(plan, "aggressive", h200, 8, dict(split=10, stage0=3.68, stage1=4.04))
    assert (details["probe_split"], split) == (10, 11)


def test_stage_passes_are_timed_after_the_cached_frames():
    """``measure_stage_passes`` (the CLI's ``--pp-split auto``): the stages' own passes at a split over two CPU
    lanes, after caches filled with ``past_frames``; the model is left as it was placed."""
    from opensora.inference.pipeline_parallel import stage_times as ps

    model = tiny_model(causal_chunk_frames=2)
    place_model(model, 1, ["cpu", "cpu"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    group = dict(seeds=[7], branches=[text_inputs(1, 5, 0, masked=True), text_inputs(1, 5, 1, masked=False)])
    for past, cfg_rows in ((4, True), (0, False)):
        passes = ps.measure_stage_passes(
            model,
            ["cpu", "cpu"],
            1,
            group,
            (12, 99, 8, 8),
            [1.0, 0.5, 0.0],
            past,
            repeats=3,
            cfg_rows=cfg_rows,
            guidance_scale=3.0,
            context_time=0.1,
            cuda_graphs=True,  # CPU: eager passes
        )
        assert passes["split"] == 1 and passes["cached_frames"] == passes["past_frames"] == past
        assert len(passes["stage0_samples"]) == len(passes["stage1_samples"]) == 3 and not passes["graphed"]
        assert passes["stage0"] > 0 and passes["stage1"] > 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_summarize_timeline_busy_fraction():
    rows = [
        dict(lane=0, start_ms=0, end_ms=2, chunk=0, kind="stage0", host_ms=0),
        dict(lane=1, start_ms=1, end_ms=4, chunk=0, kind="stage1", host_ms=0),
        dict(lane=0, start_ms=1, end_ms=3, chunk=0, kind="prep", host_ms=0),
    ]
    summary = summarize_timeline(rows)
    assert summary["span_ms"] == 4
    assert summary["lanes"]["gpu0"]["busy_ms"] == 3 and summary["lanes"]["gpu1"]["busy_fraction"] == 0.75


def test_typical_past_frames_is_the_mean_cached_window_in_whole_chunks():
    from opensora.inference.pipeline_parallel.stage_times import typical_past_frames

    assert typical_past_frames(18, 3) == 6  # chunks see 0, 3, ..., 15 frames: mean 7.5 -> 2 chunks
    assert typical_past_frames(18, 3, window_frames=6) == 6  # 0, 3, 6, 6, 6, 6: mean 4.5 -> 2 chunks (round half even)
    assert typical_past_frames(99, 3, window_frames=6) == 6  # long videos: the window
    assert typical_past_frames(3, 3) == 0  # one chunk sees nothing


def test_stage_times_after_cached_frames_attend_to_them():
    """``past_frames``: the probe chunk runs after a cache of that many frames (its keys/values in every block's
    attention, its mask one column per cached token), so a split can be chosen for the steady state."""
    from opensora.inference.pipeline_parallel import stage_times as ps

    model = streaming_sampler().model
    chunk = model.causal_chunk_frames
    x = torch.randn(1, model.in_channels, chunk, 8, 8)
    text = text_inputs(1, 6, 0, masked=True)
    with torch.no_grad():
        x_, t, emb, pooled, mask_in = ps._stage_inputs(model, x, text)
        past = ps._probe_past(model, x_, t, emb, pooled, mask_in, 2 * chunk)
        assert past.num_frames == 2 * chunk and ps._probe_offset(model, past) == 2 * chunk // model.patch_size[0]
        mask, hooks = ps._probe_mask_hooks(model, mask_in, 6, 16, "cpu", past)
    assert mask.shape[-1] == 6 + past.keys[0].shape[2] + 16
    times = ps.measure_stage_times(model, x, text, repeats=1, past_frames=2 * chunk)
    assert len(times["block_ms"]) == len(ps.all_blocks(model)) and times["graphed"] is False
    assert ps._probe_past(model, x_, t, emb, pooled, mask_in, 0) is None


def test_graphed_stage_times_time_each_unit_on_its_own_eager_input(monkeypatch):
    """``measure_stage_times(cuda_graphs=True)`` captures the embedding, every block and the final layer on its own
    input (``_graph_replay_ms``, swapped here for an eager run): the chained block inputs give the eager pass's
    output; on a CPU, ``cuda_graphs=True`` falls back to the eager times."""
    from opensora.inference.pipeline_parallel import stage_times as ps

    model = streaming_sampler().model
    x = torch.randn(1, model.in_channels, model.causal_chunk_frames, 8, 8)
    text = text_inputs(1, 6, 0, masked=True)
    eager = ps.measure_stage_times(model, x, text, cuda_graphs=True, repeats=1)  # CPU: no graphs
    assert eager["graphed"] is False and len(eager["block_ms"]) == len(ps.all_blocks(model))
    outputs = []

    def replay_ms(body, device, repeats):
        outputs.append(body())
        return float(len(outputs))  # unit k "takes" k ms

    monkeypatch.setattr(ps, "_graph_replay_ms", replay_ms)
    times = ps._graphed_stage_times(model, x, text, lambda v: v * 2, 1)  # what cuda_graphs=True runs on a GPU
    n = len(ps.all_blocks(model))
    assert times["graphed"] and times["embed_ms"] == 1.0 and times["block_ms"] == [float(i + 2) for i in range(n)]
    assert times["final_ms"] == float(n + 2) and times["decode_ms"] >= 0.0
    with torch.no_grad():  # the whole pass at once
        x_, t, emb, pooled, mask_in = ps._stage_inputs(model, x, text)
        img, txt, vec, grid = model.embed(x_, t, emb, pooled)
        mask, hooks = ps._probe_mask_hooks(model, mask_in, txt.shape[1], img.shape[1], x.device)
        rope = model.rope(grid, txt.shape[1], "cpu")
        state = model.run_block_range(dict(img=img, txt=txt), 0, n, vec, rope, mask)
        assert torch.equal(outputs[-1], ps.final_velocity(model, state, vec, grid))


# ---- bit-identical on two CPU "devices" --------------------------------------------------------------------------
def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    model = build_module(mmdit_config("tiny", cond_channels=None, **overrides), MODELS).eval()
    for p in model.parameters():  # adaLN-zero and the zero final layer would make every output 0
        torch.nn.init.normal_(p, std=0.05)
    return model


def text_inputs(batch, length, seed, masked):
    g = torch.Generator().manual_seed(seed)
    mask = None
    if masked:
        mask = torch.ones(batch, length, dtype=torch.bool)
        mask[:, length - 2 :] = False
    return dict(
        text_emb=torch.randn(batch, length, 64, generator=g), text_mask=mask, pooled=torch.randn(batch, 64, generator=g)
    )


@pytest.mark.parametrize("mode", OVERLAP_MODES)
@pytest.mark.parametrize("split", [0, 1, 2])
def test_bidirectional_cfg_pipeline_is_bit_identical_on_cpu(mode, split, one_thread):
    model = tiny_model()
    groups = [
        dict(
            seeds=[10 + g, 20 + g],
            branches=[text_inputs(2, 6, g, masked=True), text_inputs(2, 6, 100 + g, masked=False)],
        )
        for g in range(2)
    ]
    shape, times, scale = (12, 2, 8, 8), [1.0, 0.7, 0.3, 0.0], 4.0
    decode = lambda x: (x * 10).round().to(torch.int16)  # noqa: E731 - a stand-in decoder
    refs = [sample_microbatched(model, g, shape, times, scale, "cpu", decode) for g in groups]
    place_model(model, split, ["cpu", "cpu"])
    lanes = Lanes(["cpu", "cpu"], profile=True)
    stages = BidirectionalStages(model, lanes, split, groups, shape, times, scale, decode=decode)
    result, sim = run_plan(stages, mode, lanes)
    for g, (x0, frames) in enumerate(refs):
        assert torch.equal(result.latents[(g, 0)], x0)
        assert torch.equal(result.frames[(g, 0)], frames)
    assert len(result.timeline) == len(sim.order) and result.summary["lanes"]["gpu1"]["busy_ms"] > 0


STREAM_CASES = [
    # (groups of prompts, step list, guidance, rollout, window_frames, context_time)
    ([["a red circle moving left"]], [1.0], 1.0, "renoise", None, 0.0),
    ([["a red circle moving left", "a blue square moving up"]], [1.0, 0.6, 0.3], 3.0, "renoise", None, 0.0),
    ([["a red circle moving left"], ["a green star moving down"]], [1.0, 0.5], 3.0, "euler", 4, 0.1),
]


def streaming_sampler(dtype=torch.float32):
    """test_streaming.py's tiny causal sampler with 2 + 2 blocks (so a split can fall inside each kind), its network
    in ``dtype`` (bf16: the GPU's precision, where a pass over other token counts rounds differently)."""
    from test_streaming import tiny_sampler  # tests/ is on sys.path under pytest's default import mode

    cpu = tiny_sampler(depth_double=2, depth_single=2, attn_backend="auto")
    return VideoSampler(cpu.model.to(dtype), cpu.vae, cpu.text_encoder, progress=False)


def generator_reference(sampler, case, num_frames, size, graphs=None, **options):
    """The one-device ``StreamingGenerator`` run of ``case`` per prompt group, and the pipeline's inputs for it:
    (generator, chunks per group, groups, latent size). ``graphs``: a class whose ``make(model)`` gives the
    generator's ``cuda_graphs`` runner; ``options``: more generator options (sink frames, RoPE anchor)."""
    from opensora.inference.streaming.generator import StreamingGenerator

    prompt_groups, steps, guidance, rollout, window, context_time = case
    gen = StreamingGenerator(
        sampler,
        step_list=steps,
        rollout=rollout,
        guidance_scale=guidance,
        window_frames=window,
        context_time=context_time,
        **options,
    )
    if graphs is not None:
        gen.cuda_graphs = graphs.make(sampler.model)
    refs, groups, seed = [], [], 0
    for prompts in prompt_groups:
        seeds = list(range(seed, seed + len(prompts)))
        seed += len(prompts)
        refs.append(list(gen.stream(prompts, seeds, num_frames, size, size)))
        text, null = sampler.encode_text(prompts)
        groups.append(dict(seeds=seeds, branches=[text, null] if guidance != 1.0 else [text]))
    return gen, refs, groups, (sampler.vae.latent_channels, *sampler.latent_size(num_frames, size, size))


def generator_stages(sampler, case, gen, groups, latent_size, split, lanes, **kw):
    """``CausalStreamingStages`` with ``case``'s generator options, decoding with the sampler's autoencoder."""
    from opensora.inference.pipeline_parallel.streaming_stages import CausalStreamingStages
    from opensora.inference.streaming.generator import ChunkDecoder

    _, _, guidance, rollout, window, context_time = case
    return CausalStreamingStages(
        sampler.model,
        lanes,
        split,
        groups,
        latent_size,
        gen.schedule(latent_size[1:]),
        rollout=rollout,
        guidance_scale=guidance,
        context_time=context_time,
        window_frames=window,
        make_decoder=lambda device, group: ChunkDecoder(sampler.decode, sampler.vae),
        **kw,
    )


def assert_chunks_equal(result, refs):
    for g, chunks in enumerate(refs):
        for chunk in chunks:
            assert torch.equal(result.latents[(g, chunk.index)], chunk.latents), (g, chunk.index)
            assert torch.equal(result.frames[(g, chunk.index)], chunk.frames), (g, chunk.index)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", OVERLAP_MODES)
@pytest.mark.parametrize("case", STREAM_CASES, ids=lambda c: f"g{len(c[0])}s{len(c[1])}w{c[2]}{c[3]}")
def test_streaming_pipeline_is_bit_identical_to_the_streaming_generator_on_cpu(case, mode, dtype, one_thread):
    sampler = streaming_sampler(dtype)
    num_frames, size = 7, 16  # 7 latent frames: chunks of 2, 2, 2 and a last one of 1
    gen, refs, groups, latent_size = generator_reference(sampler, case, num_frames, size)
    split = 1  # last double block on lane 0, single blocks on lane 1: the (img, txt) -> tokens hand-over
    place_model(sampler.model, split, ["cpu", "cpu"])
    lanes = Lanes(["cpu", "cpu"])
    stages = generator_stages(sampler, case, gen, groups, latent_size, split, lanes)
    result, _ = run_plan(stages, mode, lanes, threads=True)  # one issuing thread per lane, as on two GPUs
    assert stages.plan.num_chunks == 4
    assert_chunks_equal(result, refs)


@pytest.mark.parametrize("mode", OVERLAP_MODES)
@pytest.mark.parametrize("sinks", [0, 2])
def test_window_anchor_pipeline_is_bit_identical_to_the_streaming_generator_on_cpu(sinks, mode, one_thread):
    """``rope_anchor="window"`` (the sampling CLI's default): each chunk's RoPE tables, made by the prep ahead of the
    cache writes, carry the anchor the lanes' caches reach by then, and both lanes move their sinks and text keys to
    it, so the pipeline's chunks equal the one-device generator's bit for bit over a window that rolls 4 times."""
    sampler = streaming_sampler()
    case = STREAM_CASES[2]  # two groups, CFG, a 4-frame window
    options = dict(sink_frames=sinks, rope_anchor="window")
    gen, refs, groups, latent_size = generator_reference(sampler, case, 11, 16, **options)
    split = 1
    place_model(sampler.model, split, ["cpu", "cpu"])
    lanes = Lanes(["cpu", "cpu"])
    stages = generator_stages(sampler, case, gen, groups, latent_size, split, lanes, **options)
    anchors = [stages.caches[0][0][0].anchor_before(2 * c) for c in range(stages.plan.num_chunks)]
    assert anchors == [0, 0, 0, 2, 4, 6]  # the window rolls from the chunk at frame 6 on
    result, _ = run_plan(stages, mode, lanes, threads=True)
    assert_chunks_equal(result, refs)
    _, absolute, _, _ = generator_reference(sampler, case, 11, 16, sink_frames=sinks)  # the anchor matters
    assert torch.equal(absolute[0][0].latents, refs[0][0].latents)
    assert not torch.equal(absolute[0][-1].latents, refs[0][-1].latents)


@pytest.mark.parametrize("mode", OVERLAP_MODES)
@pytest.mark.parametrize(
    "case, options",
    [(c, {}) for c in STREAM_CASES[1:]] + [(STREAM_CASES[2], dict(sink_frames=2, rope_anchor="window"))],
    ids=lambda c: f"g{len(c[0])}s{len(c[1])}w{c[2]}{c[3]}" if isinstance(c, tuple) else "-".join(map(str, c.values())),
)
def test_graphed_stages_match_the_graphed_streaming_generator_bitwise_on_cpu(case, options, mode, one_thread):
    """Each stage's pass through ``ChunkGraphs.stage`` (capture swapped for an eager re-run of the captured body, as
    in test_streaming.py): the static-buffer plumbing of both lanes, issued from one host thread, gives the
    generator's chunks bit for bit in bf16 (the generator through the same runner), over two runs of the stages
    that reuse the graphs; with the window RoPE anchor too (moved text keys and sinks through the static inputs)."""
    from test_streaming import EagerReplayGraphs

    sampler = streaming_sampler(torch.bfloat16)
    num_frames, size = (11 if options else 7), 16
    gen, refs, groups, latent_size = generator_reference(sampler, case, num_frames, size, **options)
    _, graphed_refs, _, _ = generator_reference(sampler, case, num_frames, size, graphs=EagerReplayGraphs, **options)
    for mine, theirs in zip(refs, graphed_refs):
        for a, b in zip(mine, theirs):
            assert torch.equal(a.latents, b.latents)
    split = 2  # a single block on lane 0: the joint tokens cross (split 1, in the test above, crosses img / txt)
    place_model(sampler.model, split, ["cpu", "cpu"])
    lanes = Lanes(["cpu", "cpu"])
    runners = (EagerReplayGraphs.make(sampler.model), EagerReplayGraphs.make(sampler.model))
    for _ in range(2):
        stages = generator_stages(sampler, case, gen, groups, latent_size, split, lanes, cuda_graphs=runners, **options)
        result, _ = run_plan(stages, mode, lanes, threads=False)
        assert_chunks_equal(result, refs)
    for runner in runners:
        summary = runner.summary
        assert summary["eager"] == 0 and summary["failures"] == [] and summary["replays"] > summary["graphs"] > 0


def record_masks(model, monkeypatch) -> list:
    """Spy on ``model.chunk_stage`` (the one-device pass and each pipeline stage run it): per call, whether it reused
    cached text keys and whether it got an attention mask."""
    calls, original = [], model.chunk_stage

    def chunk_stage(inputs, lo, hi, num_text, past, text_kv, *args, **kwargs):
        calls.append((text_kv is not None, inputs.get("mask") is not None))
        return original(inputs, lo, hi, num_text, past, text_kv, *args, **kwargs)

    monkeypatch.setattr(model, "chunk_stage", chunk_stage)
    return calls


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
@pytest.mark.parametrize("case", STREAM_CASES[1:2], ids=lambda c: f"g{len(c[0])}s{len(c[1])}w{c[2]}{c[3]}")
def test_unpadded_text_pipeline_attends_mask_free_like_the_generator(case, graphed, monkeypatch, one_thread):
    """Every text token valid: the generator's text-cached passes attend without a mask (another attention kernel on
    a GPU, so other last bits); the pipeline's stages must decide alike (they once built an all-true mask for
    every pass: 2 H200s then gave max |diff| 1 against the generator). bf16, both lanes, chunks bit for bit."""
    from test_streaming import EagerReplayGraphs, unpadded

    sampler = unpadded(streaming_sampler(torch.bfloat16))
    num_frames, size = 7, 16
    generator_calls = record_masks(sampler.model, monkeypatch)
    gen, refs, groups, latent_size = generator_reference(
        sampler, case, num_frames, size, graphs=EagerReplayGraphs if graphed else None
    )
    assert not any(has_mask for hit, has_mask in generator_calls if hit), "the generator's cached passes: no mask"
    assert all(has_mask for hit, has_mask in generator_calls if not hit)
    split = 1
    place_model(sampler.model, split, ["cpu", "cpu"])
    lanes = Lanes(["cpu", "cpu"])
    runners = (EagerReplayGraphs.make(sampler.model), EagerReplayGraphs.make(sampler.model)) if graphed else False
    pipeline_calls = record_masks(sampler.model, monkeypatch)
    stages = generator_stages(sampler, case, gen, groups, latent_size, split, lanes, cuda_graphs=runners)
    assert stages.text_padded == [False]
    result, _ = run_plan(stages, "basic", lanes, threads=not graphed)
    assert_chunks_equal(result, refs)
    assert sum(hit for hit, _ in pipeline_calls) > 0
    assert [has_mask for hit, has_mask in pipeline_calls] == [not hit for hit, _ in pipeline_calls]


@pytest.mark.parametrize("mode", OVERLAP_MODES)
@pytest.mark.parametrize("refill,cfg_rows", [(False, True), (True, False), (False, False)])
def test_streaming_pipeline_variants_match_the_single_device_loop(refill, cfg_rows, mode, one_thread):
    """No refill (the last denoising step writes the cache) and CFG passes as separate micro-batches: variants the
    streaming generator does not have, checked against ``stream_reference`` (same code path as the generator's
    math, which the test above pins)."""
    from streaming_reference import stream_reference

    from opensora.inference.pipeline_parallel.streaming_stages import CausalStreamingStages

    model = tiny_model(causal_chunk_frames=2)
    groups = [
        dict(seeds=[7 + g], branches=[text_inputs(1, 5, 3 * g + b, masked=b == 0) for b in range(2)]) for g in range(2)
    ]
    latent_size, times = (12, 6, 8, 8), [1.0, 0.6, 0.3, 0.0]
    decode = lambda device, group: lambda x: (x * 10).round().to(torch.int16)  # noqa: E731
    kw = dict(refill=refill, guidance_scale=3.0, make_decoder=decode, cfg_rows=cfg_rows)
    refs = [stream_reference(model, g, latent_size, times, **kw) for g in groups]
    place_model(model, 2, ["cpu", "cpu"])
    lanes = Lanes(["cpu", "cpu"])
    stages = CausalStreamingStages(model, lanes, 2, groups, latent_size, times, **kw)
    result, _ = run_plan(stages, mode, lanes, threads=True)
    for g, (latents, frames) in enumerate(refs):
        for c in range(3):
            assert torch.equal(result.latents[(g, c)], latents[c]), (g, c)
            assert torch.equal(result.frames[(g, c)], frames[c]), (g, c)
    assert not torch.equal(refs[0][0][1], refs[0][0][0])  # the cache matters


class RecordingLanes(Lanes):
    """CPU lanes that log what each task queues where: pulls (on GPUs a copy that the destination lane's compute
    stream then waits for), same-lane waits, uploads from the host, and whether the task ran on the prep stream."""

    def __init__(self, devices):
        super().__init__(devices)
        self.current, self.on_prep_stream, self.log = None, False, []

    def record(self, op, lane):
        self.log.append((None if self.current is None else self.current.kind, op, lane, self.on_prep_stream))

    @contextlib.contextmanager
    def task(self, task):
        self.current = task
        with super().task(task):
            yield
        self.current = None

    @contextlib.contextmanager
    def prep_stream(self, lane):
        self.on_prep_stream = True
        yield
        self.on_prep_stream = False

    def pull(self, value, ready, lane):
        self.record("pull", lane)
        return super().pull(value, ready, lane)

    def wait(self, lane, ready):
        self.record("wait", lane)
        super().wait(lane, ready)


@pytest.mark.parametrize("mode", ["basic", "aggressive"])
def test_a_prep_queues_nothing_on_gpu1_and_runs_on_the_prep_stream(mode, monkeypatch, one_thread):
    """The mechanism behind ``aggressive`` losing to ``basic`` on 2 H200s: a CUDA stream is a FIFO, so anything a
    prep queues on GPU1 (its RoPE tables' pull, which GPU1's compute stream waited for; the re-noise draws' copies)
    sits in GPU1's queue at the prep's issue position, and a hoisted prep is issued in the middle of the previous
    chunk's GPU1 work. Now: every prep runs on lane 0's prep stream and neither pulls to lane 1 nor uploads for
    it; lane 1 pulls the RoPE tables in its first stage1 of each chunk start and uploads each step's re-noise draw
    in its update; lane 0's first stage0 of a chunk waits for the prep's event. Outputs unchanged."""
    from streaming_reference import stream_reference

    from opensora.inference.pipeline_parallel import streaming_stages as ps

    lanes = RecordingLanes(["cpu", "cpu"])
    uploads = []
    real_upload = ps.to_device_async

    def upload(x, device):
        lanes.record("upload", None)
        uploads.append(lanes.current.kind)
        return real_upload(x, device)

    model = tiny_model(causal_chunk_frames=2)
    groups = [dict(seeds=[7 + g], branches=[text_inputs(1, 5, g, masked=True)]) for g in range(2)]
    latent_size, times = (12, 6, 8, 8), [1.0, 0.6, 0.3, 0.0]
    decode = lambda device, group: lambda x: (x * 10).round().to(torch.int16)  # noqa: E731
    kw = dict(refill=True, rollout="renoise", context_time=0.1, make_decoder=decode)
    refs = [stream_reference(model, g, latent_size, times, **kw) for g in groups]
    place_model(model, 2, ["cpu", "cpu"])
    monkeypatch.setattr(ps, "to_device_async", upload)
    stages = ps.CausalStreamingStages(model, lanes, 2, groups, latent_size, times, **kw)
    result, _ = run_plan(stages, mode, lanes, threads=False)
    for g, (latents, frames) in enumerate(refs):
        for c in range(3):
            assert torch.equal(result.latents[(g, c)], latents[c]) and torch.equal(result.frames[(g, c)], frames[c])
    preps = [entry for entry in lanes.log if entry[0] == "prep"]
    assert not [e for e in preps if e[1] in ("pull", "wait") and e[2] == 1]  # nothing for lane 1's stream to wait on
    assert [e for e in lanes.log if e[0] == "stage1" and e[1] == "pull"]  # RoPE tables pulled by stage1
    # uploads: per prep the initial latent and the context noise (context_time > 0); per update its re-noise draw
    n_chunks = stages.plan.num_groups * stages.plan.num_chunks
    assert uploads.count("prep") == 2 * n_chunks and uploads.count("update") == 2 * n_chunks  # times 0.6, 0.3
    assert preps and all(on_prep for _, _, _, on_prep in preps)  # the prep's work ran on the prep stream
    # each chunk's first stage0 waits for its prep's event on lane 0 (inputs are pulled before the task starts)
    waits = [e for e in lanes.log if e[1] == "wait"]
    assert len(waits) >= n_chunks and all(e[2] in (0, 1) for e in waits)


def test_to_host_outputs_share_pinned_slabs(monkeypatch):
    """``Lanes.to_host``'s pinned outputs are aligned views of a few slabs (one page-locked allocation per 16 MiB,
    not one per chunk output), of any dtype, each its own memory."""
    import opensora.inference.pipeline_parallel.runtime as pp

    allocations, real_empty = [], torch.empty

    def empty(*args, pin_memory=False, **kw):  # no CUDA here: count the page-locked allocations instead
        allocations.append(pin_memory)
        return real_empty(*args, **kw)

    monkeypatch.setattr(pp, "HOST_SLAB_BYTES", 4096)
    monkeypatch.setattr(torch, "empty", empty)
    lanes = Lanes(["cpu", "cpu"])
    outs = [lanes._pinned(shape, dtype) for shape, dtype in [((2, 3, 5), torch.float32), ((7,), torch.bfloat16)] * 5]
    monkeypatch.setattr(torch, "empty", real_empty)
    assert [o.shape for o in outs[:2]] == [(2, 3, 5), (7,)] and outs[1].dtype == torch.bfloat16
    assert all(o.storage_offset() * o.element_size() % 512 == 0 for o in outs)
    assert allocations.count(True) == 2  # 10 outputs of 512 bytes each in slabs of 4096
    for i, o in enumerate(outs):
        o.fill_(i)
    assert [int(o.flatten()[0]) for o in outs] == list(range(10))


# ---- the CLI (both lanes on the CPU) -----------------------------------------------------------------------------
def test_cli_streaming_pipeline_on_cpu_lanes_writes_samples_and_profile(tmp_path, one_thread):
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from opensora.config import load_config
    from opensora.inference import cli
    from opensora.inference.io import read_video

    root = Path(__file__).resolve().parents[1]
    config = tmp_path / "causal_demo.py"
    config.write_text(f'_base_ = ["{root}/configs/diffusion/inference/demo.py"]\nmodel = dict(causal_chunk_frames=2)\n')
    cfg = load_config(config)
    model = build_module(cfg.model, MODELS)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    ckpt = tmp_path / "causal.safetensors"
    save_file(model.state_dict(), str(ckpt))

    def sample(mode, split, save_dir):
        pipeline = ["--pp-devices", "cpu,cpu", "--pp-overlap", mode, "--pp-split", split, "--profile"]
        return cli.main(
            [
                str(config),
                "--ckpt",
                str(ckpt),
                "--prompt",
                "a red circle|a blue square",
                "--num-frames",
                "6",  # 3 chunks of 2 latent frames: auto times its passes after 2 cached frames
                "--resolution",
                "32x32",
                "--step-list",
                "1.0,0.5",
                "--guidance-scale",
                "3.0",
                "--batch-size",
                "1",
                "--streaming",
                *(pipeline if mode else ["--device", "cpu"]),
                "--save-dir",
                str(tmp_path / save_dir),
                "--no-progress",
            ]
        )

    written = sample("aggressive", "auto", "aggr")
    assert len(written) == 2 and read_video(written[0]).shape == (6, 32, 32, 3)
    side = json.loads(written[0].with_suffix(".json").read_text())
    assert side["pp_overlap"] == "aggressive" and "candidates" in side["pp_split"]
    # auto: the probe split, whole passes timed there, the split chosen again on the calibrated times
    report = side["pp_split"]
    passes = report["calibration"]["measured"]
    assert passes["split"] == report["probe_split"] == report["calibration"]["probe_split"]
    assert passes["stage0"] > 0 and passes["stage1"] > 0 and len(passes["stage0_samples"]) == 4
    assert passes["cached_frames"] == report["past_frames"] == 2 and passes["graphed"] is False  # CPU: eager
    assert report["split"] in [row["split"] for row in report["candidates"]]
    assert report["calibration"]["costs"]["stage0"] == pytest.approx(report["candidates"][report["split"]]["stage0_ms"])
    profile = json.loads((tmp_path / "aggr" / "pp_profile.json").read_text())
    assert profile["pp_split"]["calibration"]["measured"]["stage1"] == passes["stage1"]
    assert set(profile["summary"]["lanes"]) == {"gpu0", "gpu1"} and profile["timeline"]
    # another mode and another split: the same videos
    again = sample("off", "0", "off")  # an explicit split: no probe, no timed passes
    assert json.loads(again[0].with_suffix(".json").read_text())["pp_split"] == dict(requested="0", split=0)
    for a, b in zip(written, again):
        assert np.array_equal(read_video(a), read_video(b))
    # one device (--streaming alone): the same files, byte for byte (same frames through the same writer)
    alone = sample(None, None, "one")
    for a, b in zip(written, alone):
        assert a.read_bytes() == b.read_bytes()
