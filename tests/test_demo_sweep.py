"""benchmarks/demo_sweep.py's step plan: equal steps for demo_fast's model, the same time for a dearer one, and every
variant's training, sampling and scoring inside the deadline."""

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import demo_sweep  # noqa: E402


def plan_for(tmp_path, step_s: dict, seconds_left: float, target=2400):
    for index, seconds in step_s.items():
        record = dict(index=index, stages=dict(probe=dict(outcome="ok", median_step_s=seconds, startup_s=15.0)))
        (tmp_path / f"v{index}_{demo_sweep.VARIANTS[index].name}.json").write_text(json.dumps(record))
    args = SimpleNamespace(
        results=tmp_path, steps=target, smoke=False, deadline_at=time.time() + seconds_left, spare_cores_of={0: "0,1"}
    )
    return demo_sweep.plan_steps(sorted(step_s), args)


def test_variants_keep_demo_fast_defaults():
    assert demo_sweep.TRAIN_CONFIG.endswith("demo_fast.py") and len(demo_sweep.VARIANTS) == 7
    assert [(v.size, v.num_frames, v.batch_size) for v in demo_sweep.VARIANTS] == [(24, 4, 16)] * 7
    assert demo_sweep.VARIANTS[0].overrides == [] and demo_sweep.VARIANTS[0].train_only == []


def test_fast_machine_trains_the_demo_steps_and_scales_the_wider_model(tmp_path):
    step_s = {0: 0.15, 1: 0.16, 2: 0.14, 3: 0.15, 4: 0.25, 5: 0.15, 6: 0.155}
    plan = plan_for(tmp_path, step_s, seconds_left=520)
    assert plan["base_steps"] == 2400
    assert {i: n for i, n in plan["steps"].items() if i != 4} == {i: 2400 for i in step_s if i != 4}
    assert plan["steps"][4] == round(2400 * 0.15 / 0.25)


def test_slow_machine_shrinks_every_variant_alike_to_fit(tmp_path):
    step_s = {i: 0.24 for i in range(7)} | {4: 0.36}
    seconds_left = 520
    plan = plan_for(tmp_path, step_s, seconds_left)
    assert 1000 < plan["base_steps"] < 2400
    for index, steps in plan["steps"].items():
        sampling = sum(demo_sweep.sampling_seconds(x, step_s[index]) for x in demo_sweep.VARIANTS[index].samplings)
        assert 15.0 + steps * step_s[index] + sampling < seconds_left


def test_step_time_leaves_the_warm_up_out():
    rows = [dict(step=i + 1, loss=1.0, step_time=2.0 if i < 10 else 0.2) for i in range(50)]
    assert demo_sweep.median_step_seconds(rows) == 0.2
    assert demo_sweep.median_step_seconds(rows[:3]) == 2.0  # a smoke probe: every step counts
