"""Where to cut the MMDiT between the two GPUs and which GPU decodes each video: per-kind task costs from per-block
times (``stage_costs``), the split (and decode placement, ``choose_split_and_decode``) the simulator finds fastest,
and the same calibrated against timed whole stage passes (``calibrated_split``); the times come from stage_times.py
and, for the decode, decoders.py."""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .schedule import DEFAULT_CONTENTION, Plan, schedule


def stage_costs(
    block_ms: Sequence[float],
    split: int,
    embed_ms: float,
    final_ms: float,
    update_ms: float,
    decode_ms: float,
    prep_ms: float,
) -> dict:
    """Per-kind costs for a split where GPU0 holds blocks[0..split] (inclusive)."""
    return dict(
        prep=prep_ms,
        stage0=embed_ms + sum(block_ms[: split + 1]),
        stage1=sum(block_ms[split + 1 :]) + final_ms,
        update=update_ms,
        decode=decode_ms,
    )


def decode_placements(num_groups: int) -> List[Tuple[int, ...]]:
    """Where the groups' decoders may live (``Plan.decode_lanes``), the default first: every group on the last GPU,
    every group on GPU0, and with several groups alternating (each GPU decodes every other video). One video's
    chunks never move between GPUs: its decoder carries state from chunk to chunk."""
    g = int(num_groups)
    out = [(1,) * g, (0,) * g]
    if g > 1:
        out += [tuple(i % 2 for i in range(g)), tuple(1 - i % 2 for i in range(g))]
    return out


def choose_split(
    plan: Plan,
    mode: str,
    block_ms: Sequence[float],
    embed_ms: float,
    final_ms: float,
    update_ms: float = 0.0,
    decode_ms: float = 0.0,
    prep_ms: float = 0.0,
    contention: float = DEFAULT_CONTENTION,
) -> Tuple[int, List[dict]]:
    """The split (index of GPU0's last block) with the smallest simulated time for ``plan`` (its decode placement
    as it is) under ``mode``, from measured per-block times; ties go to the most balanced split. Returns (split, one
    row per candidate)."""
    split, _, rows = choose_split_and_decode(
        plan, mode, block_ms, embed_ms, final_ms, update_ms, decode_ms, prep_ms, [plan.decode_lanes], contention
    )
    return split, rows


def choose_split_and_decode(
    plan: Plan,
    mode: str,
    block_ms: Sequence[float],
    embed_ms: float,
    final_ms: float,
    update_ms: float = 0.0,
    decode_ms: float = 0.0,
    prep_ms: float = 0.0,
    placements: Optional[Sequence[Sequence[int]]] = None,
    contention: float = DEFAULT_CONTENTION,
) -> Tuple[int, Tuple[int, ...], List[dict]]:
    """The split and the decode placement (``Plan.decode_lanes``, from ``placements``; None: every one of
    ``decode_placements``) with the smallest simulated time. The decode is a task of the GPU that runs it, so a
    dear decode (the real VAE: ~220 ms a chunk at 480x832, about a chunk's DiT passes) moves blocks to the other
    GPU; on a decode stream (``plan.decode_stream == "side"``) it slows that GPU's passes by ``contention`` while
    they overlap (``schedule.simulate``). Ties go to the earlier placement (the default first), then the most
    balanced split. Returns (split, decode_lanes, one row per (placement, split) candidate)."""
    n = len(block_ms)
    if n < 2:
        raise ValueError("pipeline parallelism needs at least 2 blocks")
    if placements is None:
        placements = decode_placements(plan.num_groups) if plan.decode else [()]
    rows = []
    for rank, lanes in enumerate(placements):
        candidate = replace(plan, decode_lanes=tuple(lanes))
        on0 = sum(1 for g in range(plan.num_groups) if candidate.decode_lane(g) == 0) / plan.num_groups
        decode = decode_ms if plan.decode else 0.0
        for split in range(n - 1):
            costs = stage_costs(block_ms, split, embed_ms, final_ms, update_ms, decode_ms, prep_ms)
            sim = schedule(candidate, mode if mode != "off" else "basic", costs, contention=contention)
            forwards = plan.total_forwards / plan.num_chunks  # per chunk, on average (the last one has no refill)
            gpu0 = forwards * costs["stage0"] + costs["prep"] + on0 * decode
            gpu1 = forwards * costs["stage1"] + plan.num_steps * costs["update"] + (1 - on0) * decode
            rows.append(
                dict(
                    split=split,
                    decode_lanes=list(candidate.decode_lanes),
                    stage0_ms=costs["stage0"],
                    stage1_ms=costs["stage1"],
                    gpu0_ms_per_chunk=gpu0,
                    gpu1_ms_per_chunk=gpu1,
                    simulated_ms=sim.makespan,
                    simulated_busy=list(sim.busy_fraction),
                    contention=contention,
                    _rank=rank,
                )
            )
    best = min(
        rows,
        key=lambda r: (
            round(r["simulated_ms"], 6),
            r["_rank"],
            abs(r["gpu0_ms_per_chunk"] - r["gpu1_ms_per_chunk"]),
        ),
    )
    for r in rows:
        r.pop("_rank")
    return best["split"], tuple(best["decode_lanes"]), rows


def tasks_per_kind(plan: Plan) -> Dict[str, int]:
    """How many tasks of each kind a run of ``plan`` issues."""
    items = plan.num_groups * plan.num_chunks
    return dict(
        prep=items,
        stage0=plan.num_groups * plan.num_branches * plan.total_forwards,
        stage1=plan.num_groups * plan.num_branches * plan.total_forwards,
        update=items * plan.num_steps,
        decode=items if plan.decode else 0,
    )


def measured_task_ms(plan: Plan, ms_per_kind: Mapping[str, float]) -> Dict[str, float]:
    """Mean GPU time per task of each kind from a profiled run (``RunResult.summary["ms_per_kind"]``; take it from
    ``off``, whose tasks do not overlap)."""
    counts = tasks_per_kind(plan)
    return {kind: ms_per_kind.get(kind, 0.0) / n for kind, n in counts.items() if n}


def calibrate_block_ms(
    block_ms: Sequence[float],
    num_double: int,
    split: int,
    embed_ms: float,
    final_ms: float,
    stage0_ms: float,
    stage1_ms: float,
) -> List[float]:
    """Per-block times (one graph per block, ``measure_stage_times``) rescaled so that the two stages at ``split``
    cost what whole passes were measured to cost (``stage0_ms`` / ``stage1_ms`` per pass, e.g. from
    ``measured_task_ms``): one factor for the double blocks (the first ``num_double``), one for the single blocks,
    solved from the two stages (embedding and final layer kept). Per-block graphs do not add up to a stage's pass:
    on 2 H200s (1B, split 10) they said 4.49 / 4.31 ms and the passes took 3.72 / 4.07 ms, the double blocks
    ~21% over and the single ones ~6%, so ``auto`` put one block too many on GPU1. Falls back to one factor for
    all blocks where the two equations do not determine two positive factors."""
    blocks = [float(b) for b in block_ms]
    on0 = [i <= split for i in range(len(blocks))]
    d0 = sum(b for i, b in enumerate(blocks) if i < num_double and on0[i])
    s0 = sum(b for i, b in enumerate(blocks) if i >= num_double and on0[i])
    d1 = sum(b for i, b in enumerate(blocks) if i < num_double and not on0[i])
    s1 = sum(b for i, b in enumerate(blocks) if i >= num_double and not on0[i])
    r0, r1 = stage0_ms - embed_ms, stage1_ms - final_ms
    det = d0 * s1 - s0 * d1
    double = single = None
    if abs(det) > 1e-12 * max(1.0, (d0 + s0) * (d1 + s1)):
        double, single = (r0 * s1 - s0 * r1) / det, (d0 * r1 - r0 * d1) / det
    if double is None or double <= 0 or single <= 0:
        total = sum(blocks)
        double = single = (r0 + r1) / total if total else 1.0
    return [b * (double if i < num_double else single) for i, b in enumerate(blocks)]


def calibrated_split(
    plan: Plan,
    mode: str,
    stage_times: Mapping,
    num_double: int,
    measured: Mapping[str, float],
    place_decode: bool = False,
    contention: float = DEFAULT_CONTENTION,
) -> Tuple[int, List[dict], dict]:
    """``--pp-split auto`` from whole-pass measurements: the per-block probe times ``stage_times``
    (``measure_stage_times``: ``embed_ms``, ``block_ms``, ``final_ms``, ``decode_ms``) rescaled with
    ``calibrate_block_ms`` so that the stages at ``measured["split"]`` cost ``measured["stage0"]`` /
    ``measured["stage1"]`` ms per pass, then ``choose_split`` on those. ``measured`` comes from a profiled ``off``
    run (``measured_task_ms``: also ``prep`` / ``update`` / ``decode`` per task, used as their costs) or from a few
    timed passes (``stages.measure_stage_passes``: the decode then costs the probe's ``decode_ms``, prep
    and update 0, as ``choose_split`` has them by default). ``num_double``: the model's double blocks (the first
    ones). Returns (split, ``choose_split``'s candidates on the calibrated times, details: ``probe_split`` (the
    choice from the uncalibrated probe), ``block_ms`` (calibrated), ``costs`` (per-kind costs at the chosen split,
    the run's issue order), ``measured``, ``decode_lanes``). ``place_decode``: choose the decode placement too
    (``choose_split_and_decode``; ``details["decode_lanes"]``), else keep ``plan``'s. ``contention``: see
    ``schedule.simulate``."""
    embed_ms, final_ms = float(stage_times["embed_ms"]), float(stage_times["final_ms"])
    probe = [float(b) for b in stage_times["block_ms"]]
    blocks = calibrate_block_ms(
        probe, num_double, int(measured["split"]), embed_ms, final_ms, measured["stage0"], measured["stage1"]
    )
    extra = dict(
        update_ms=float(measured.get("update", 0.0)),
        decode_ms=float(measured.get("decode", stage_times.get("decode_ms", 0.0))),
        prep_ms=float(measured.get("prep", 0.0)),
    )
    placements = None if place_decode else [plan.decode_lanes]
    split, decode_lanes, rows = choose_split_and_decode(
        plan, mode, blocks, embed_ms, final_ms, **extra, placements=placements, contention=contention
    )
    probe_decode = float(stage_times.get("decode_ms", 0.0))
    probe_split, _ = choose_split(plan, mode, probe, embed_ms, final_ms, decode_ms=probe_decode, contention=contention)
    costs = stage_costs(blocks, split, embed_ms, final_ms, extra["update_ms"], extra["decode_ms"], extra["prep_ms"])
    details = dict(
        probe_split=probe_split,
        block_ms=blocks,
        costs=costs,
        measured=dict(measured),
        decode_lanes=decode_lanes,
        contention=contention,
    )
    return split, rows, details


def parse_split(value, num_blocks: int) -> Optional[int]:
    """``--pp-split``: ``auto`` (None) or the index of GPU0's last block, 0 <= N < num_blocks - 1."""
    if value is None or str(value) == "auto":
        return None
    split = int(value)
    if not 0 <= split < num_blocks - 1:
        raise ValueError(
            f"--pp-split {split} must lie in [0, {num_blocks - 2}] (index of GPU0's last block; "
            f"the model has {num_blocks} blocks)"
        )
    return split
