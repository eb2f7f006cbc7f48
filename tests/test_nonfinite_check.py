"""The deferred non-finite check (``nonfinite_check="auto"`` with fused AdamW): a step whose loss is not finite is
skipped on the device (fused AdamW's ``found_inf``) and the host reads the verdict one step later. It must train
exactly as the synchronous check does (``"sync"``: read before each optimizer step): the same records, weights,
EMA and optimizer state, bit for bit, with skips in the middle, in a row, at a checkpoint boundary and at the end;
the same abort after too many in a row; the same resume, also after a kill -9 between a skipped step and the read
of its verdict; and on two ranks a NaN on one rank only skips the step on both.

CPU runs take the deferred path only with ``optimizer=dict(fused=True)`` (the default on CPU is the foreach
update), which these tests set.
"""

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_train import (
    DEMO_CONFIG,
    ROOT,
    assert_same_records,
    build_trainer,
    by_step,
    launcher_env,
    nan_when,
    read_metrics,
    safetensors_weights,
    write_config,
)

from dist_utils import run_distributed

FUSED = dict(fused=True)
KEYS = ("loss", "grad_norm", "lr", "nonfinite_total", "skipped_samples")


def rendered_config(root: Path, **extra) -> Path:
    """The demo config on 16 MovingShapes clips of 4 frames at 32x32 rendered in memory (no files, no PyAV: the
    file also runs on GPU machines without it), 2 clips per rank and step."""
    return write_config(
        root / "rendered.py",
        DEMO_CONFIG,
        dataset=dict(_delete_=True, type="MovingShapesDataset", num=16, seed=0, height=32, width=32, num_frames=4),
        bucket_config={"_delete_": True, "32x32": {4: (1.0, 2)}},
        num_workers=0,
        warmup_steps=3,  # the lr changes every step early on: a scheduler stepped for a skipped step shows
        keep_last=5,
        **extra,
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("nonfinite")
    return dict(root=root, config=rendered_config(root, optimizer=FUSED))


def watch_reads(trainer, seen):
    """Record, for every verdict read, how many micro-steps had run by then."""
    reads = []
    real_read = trainer._read_verdict

    def read(verdict):
        reads.append(seen["calls"])
        return real_read(verdict)

    trainer._read_verdict = read
    return reads


def trained_state(trainer) -> dict:
    role = trainer.roles["model"]
    inner = role.optimizer.optim
    return dict(
        weights={k: v.detach().clone() for k, v in role.unwrap().state_dict().items()},
        ema={k: v.clone() for k, v in role.ema.shadow.items()},
        adam_steps=sorted({float(state["step"]) for state in inner.state.values()}),
        lr=role.lr_scheduler.get_last_lr()[0],
    )


def assert_same_state(got: dict, want: dict) -> None:
    assert got["adam_steps"] == want["adam_steps"] and got["lr"] == want["lr"]
    for part in ("weights", "ema"):
        different = [name for name in want[part] if not torch.equal(got[part][name], want[part][name])]
        assert not different, f"{part} differ: {different[:4]}"


def run(data, name, check, bad, *flags):
    """Train ``data["config"]`` into ``data["root"] / name`` with ``nonfinite_check=check`` and NaN losses where
    ``bad``; returns (trainer, records, the micro-step count at each verdict read)."""
    outputs = data["root"] / name
    trainer = build_trainer(data["config"], outputs, "--tensorboard", "false", *flags)
    trainer.cfg.nonfinite_check = check
    trainer.defer_check = trainer._choose_nonfinite_check()
    seen = nan_when(trainer.method, bad)
    reads = watch_reads(trainer, seen)
    trainer.train()
    return trainer, read_metrics(outputs), reads


# NaN on micro-steps 2, 5 and 6: a skip between two counted steps, and two in a row where the 4th step (a checkpoint)
# is due; then steps 5-8 run clean and the run ends.
BAD_CALLS = {2, 5, 6}


def both_checks(data) -> dict:
    """8 steps with a checkpoint every 4 and NaN on ``BAD_CALLS``, once per check."""
    bad = lambda call, batch: call in BAD_CALLS  # noqa: E731
    runs = {}
    for check in ("sync", "auto"):
        trainer, records, reads = run(data, check, check, bad, "--max-steps", "8", "--ckpt-every", "4")
        runs[check] = dict(trainer=trainer, records=records, reads=reads, state=trained_state(trainer))
    return runs


@pytest.fixture(scope="module")
def both(data):
    return both_checks(data)


def test_auto_defers_the_read_with_fused_adamw(both):
    assert not both["sync"]["trainer"].defer_check and both["auto"]["trainer"].defer_check
    # sync: each step's verdict is read before its optimizer step, right after its own micro-step
    assert both["sync"]["reads"] == list(range(1, 12))
    # auto: read after the next micro-step, except where a checkpoint (steps 4 and 8, the end) settles at once
    # (micro-steps 5 and 6 would be the 4th step: settled at once, as is the 11th, the 8th step)
    assert both["auto"]["reads"] == [2, 3, 4, 5, 5, 6, 7, 9, 10, 11, 11]


def test_deferred_check_trains_bit_for_bit_as_the_synchronous_one(both):
    assert_same_training(both)


@pytest.mark.gpu
def test_gpu_deferred_check_trains_bit_for_bit_as_the_synchronous_one(tmp_path):
    """The GPU path: bf16 weights, LowLevelZero's one-rank step over fp32 masters, CUDA fused AdamW (the default
    there), the EMA overlapped on a side stream and started at the optimizer's event, host copies read a step late.
    Frames rendered on the fly (no PyAV)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    config = rendered_config(tmp_path, precision="bf16")
    runs = both_checks(dict(root=tmp_path, config=config))
    assert all(shadow.is_cuda for shadow in runs["auto"]["trainer"].roles["model"].ema.shadow.values())
    assert runs["auto"]["reads"] == [2, 3, 4, 5, 5, 6, 7, 9, 10, 11, 11]
    assert_same_training(runs)


def assert_same_training(both: dict) -> None:
    sync, auto = both["sync"], both["auto"]
    assert [r["step"] for r in auto["records"]] == list(range(1, 9))
    assert [r["nonfinite_total"] for r in auto["records"]] == [0, 1, 1, 3, 3, 3, 3, 3]
    assert_same_records(by_step(auto["records"]), by_step(sync["records"]), range(1, 9), keys=KEYS)
    assert_same_state(auto["state"], sync["state"])
    assert auto["state"]["adam_steps"] == [8.0], "found_inf must undo the skipped steps' step counts"
    for check in ("sync", "auto"):
        trainer = both[check]["trainer"]
        assert trainer.step == 8 and trainer.nonfinite_total == 3
    step4 = [safetensors_weights(both[c]["trainer"].outputs / "checkpoints" / "step-0000004") for c in ("sync", "auto")]
    assert all(torch.equal(step4[0][name], step4[1][name]) for name in step4[0])


def test_deferred_check_stops_after_too_many_in_a_row(data):
    from opensora.training.trainer import NonFiniteLossError

    trainer = build_trainer(data["config"], data["root"] / "abort", "--tensorboard", "false", "--max-steps", "2")
    trainer.cfg.max_consecutive_nonfinite = 3
    trainer.max_consecutive_nonfinite = 3
    assert trainer.defer_check
    nan_when(trainer.method, lambda call, batch: False)
    trainer.train()
    before = trained_state(trainer)
    trainer.max_steps = 10
    seen = nan_when(trainer.method, lambda call, batch: True)
    with pytest.raises(NonFiniteLossError, match="3 non-finite losses in a row at step 2"):
        trainer.train()
    assert trainer.step == 2 and trainer.nonfinite_total == 3
    assert seen["calls"] == 4  # the third skip is read after the next micro-step, before its optimizer step
    assert_same_state(trained_state(trainer), before)  # three skipped steps: no weight, EMA, Adam or lr change


def first_indices(data, count: int) -> list:
    """The first sample index of each of the first ``count`` batches a fresh run draws."""
    trainer = build_trainer(data["config"], data["root"] / "peek", "--tensorboard", "false")
    batches = trainer._batches()
    return [int(next(batches)["index"][0]) for _ in range(count)]


def bad_batches(data) -> set:
    """Sample indices whose batches get a NaN loss: the 3rd and 6th batch of a run (and wherever they come again)."""
    indices = first_indices(data, 6)
    return {indices[2], indices[5]}


_KILLED_RUN = """
import os, signal, sys
sys.path[:0] = [{tests!r}, {root!r}]
from test_train import build_trainer, nan_when
trainer = build_trainer({config!r}, {outputs!r}, "--tensorboard", "false", "--max-steps", "8", "--ckpt-every", "2")
assert trainer.defer_check
bad = {bad!r}
nan_when(trainer.method, lambda call, batch: int(batch["index"][0]) in bad)
real_read = trainer._read_verdict

def read(verdict):  # kill -9 when a skipped step past the first checkpoint is about to be read
    nonfinite = verdict.values()[0][0].item() if hasattr(verdict, "values") else verdict[0]
    if nonfinite and trainer.step >= 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_read(verdict)

trainer._read_verdict = read
trainer.train()
"""


def test_resume_after_kill_between_a_skip_and_its_verdict_is_exact(data):
    bad = bad_batches(data)
    rule = lambda call, batch: int(batch["index"][0]) in bad  # noqa: E731
    reference, records, _ = run(data, "uninterrupted", "auto", rule, "--max-steps", "8", "--ckpt-every", "2")
    assert reference.nonfinite_total >= 2

    outputs = data["root"] / "killed"
    script = _KILLED_RUN.format(
        tests=str(ROOT / "tests"), root=str(ROOT), config=str(data["config"]), outputs=str(outputs), bad=bad
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=launcher_env(), capture_output=True, text=True
    )
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    saved = sorted(p.name for p in (outputs / "checkpoints").glob("step-*"))
    assert saved and "step-0000008" not in saved, saved

    resumed = build_trainer(data["config"], outputs, "--tensorboard", "false", "--max-steps", "8", "--ckpt-every", "2")
    resumed.resume(auto=True)
    nan_when(resumed.method, rule)
    resumed.train()
    got = read_metrics(outputs)
    assert [r["step"] for r in got] == list(range(1, 9))
    assert_same_records(by_step(got), by_step(records), range(1, 9), keys=KEYS)
    assert_same_state(trained_state(resumed), trained_state(reference))


def _two_rank_body(rank, world_size, config, root):
    """Both checks in one world: a NaN on rank 1 only (its 3rd micro-step) must skip the step on both ranks."""
    from test_train import build_trainer as build

    results = {}
    for check in ("sync", "auto"):
        trainer = build(config, Path(root) / f"two_{check}", "--tensorboard", "false", "--max-steps", "4")
        trainer.cfg.nonfinite_check = check
        trainer.defer_check = trainer._choose_nonfinite_check()
        nan_when(trainer.method, lambda call, batch: rank == 1 and call == 3)
        trainer.train()
        weights = trainer.roles["model"].unwrap().state_dict()
        results[check] = dict(
            defer=trainer.defer_check,
            step=trainer.step,
            skipped=trainer.nonfinite_total,
            weights={k: v.detach().cpu() for k, v in weights.items()},  # each rank's GPU: compared on the host
            records=read_metrics(Path(root) / f"two_{check}") if rank == 0 else None,
        )
    return results


def test_two_ranks_skip_together_and_match_the_synchronous_check(data):
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("two ranks on one GPU")
    results = run_distributed(_two_rank_body, world_size=2, args=(str(data["config"]), str(data["root"])))
    for rank in (0, 1):
        sync, auto = results[rank]["sync"], results[rank]["auto"]
        assert not sync["defer"] and auto["defer"]
        assert sync["step"] == auto["step"] == 4 and sync["skipped"] == auto["skipped"] == 1
        assert all(torch.equal(sync["weights"][k], auto["weights"][k]) for k in sync["weights"])
    assert all(
        torch.equal(results[0]["auto"]["weights"][k], results[1]["auto"]["weights"][k])
        for k in results[0]["auto"]["weights"]
    )
    sync, auto = results[0]["sync"]["records"], results[0]["auto"]["records"]
    assert [r["nonfinite_total"] for r in auto] == [0, 0, 1, 1]
    assert_same_records(by_step(auto), by_step(sync), range(1, 5), keys=KEYS)


def test_device_check_is_refused_where_it_cannot_skip(data, tmp_path):
    from opensora.config import ConfigValueError

    foreach = write_config(tmp_path / "foreach.py", data["config"], optimizer=dict(fused=False))
    assert not build_trainer(foreach, tmp_path / "auto", "--tensorboard", "false").defer_check  # auto falls back
    device = write_config(tmp_path / "device.py", foreach, nonfinite_check="device")
    with pytest.raises(ConfigValueError, match="nonfinite_check='device': the optimizers of roles .'model'. cannot"):
        build_trainer(device, tmp_path / "device", "--tensorboard", "false")
    typo = write_config(tmp_path / "typo.py", data["config"], nonfinite_check="later")
    with pytest.raises(ConfigValueError, match="nonfinite_check='later': expected one of auto, sync, device"):
        build_trainer(typo, tmp_path / "typo", "--tensorboard", "false")


def test_deferred_check_discards_a_whole_accumulation_window(data, tmp_path):
    """grad_accum=2 with a NaN on the second micro-step of the second window: that window is skipped as a whole,
    exactly as with the synchronous check."""
    config = write_config(tmp_path / "accum.py", data["config"], grad_accum=2)
    runs = {}
    for check in ("sync", "auto"):
        trainer, records, _ = run(
            dict(root=tmp_path, config=config), check, check, lambda call, b: call == 4, "--max-steps", "4"
        )
        runs[check] = dict(trainer=trainer, records=records, state=trained_state(trainer))
    assert runs["auto"]["trainer"].defer_check and runs["auto"]["trainer"].step == 4
    assert [r["nonfinite_total"] for r in runs["auto"]["records"]] == [0, 1, 1, 1]
    assert_same_records(by_step(runs["auto"]["records"]), by_step(runs["sync"]["records"]), range(1, 5), keys=KEYS)
    assert_same_state(runs["auto"]["state"], runs["sync"]["state"])


def test_deferred_check_settles_before_validation(data, tmp_path):
    """Validation every 2 steps with a NaN where step 2 would come: the skipped attempt is settled at once, step 2
    validates after the retry, and training matches the synchronous check bit for bit."""
    pytest.importorskip("av")  # the samples are written as mp4
    validation = dict(every=2, prompts=["a red circle moving left", "a blue square moving up"], num_steps=2)
    config = write_config(tmp_path / "val.py", data["config"], max_steps=4, validation=validation)
    runs = {}
    for check in ("sync", "auto"):
        trainer, records, reads = run(dict(root=tmp_path, config=config), check, check, lambda call, b: call == 2)
        runs[check] = dict(trainer=trainer, records=records, reads=reads, state=trained_state(trainer))
    auto = runs["auto"]
    assert auto["trainer"].defer_check
    assert auto["reads"] == [2, 2, 3, 5, 5]  # calls 2, 3 (step 2: validation) and 5 (the end) settle at once
    validated = [r["step"] for r in auto["records"] if "val/seconds" in r]
    assert validated == [r["step"] for r in runs["sync"]["records"] if "val/seconds" in r] == [2, 4]
    train = {check: [r for r in runs[check]["records"] if "loss" in r] for check in runs}
    assert [r["step"] for r in train["auto"]] == [1, 2, 3, 4]
    assert_same_records(by_step(train["auto"]), by_step(train["sync"]), range(1, 5), keys=KEYS)
    assert_same_state(auto["state"], runs["sync"]["state"])


class _SignalAt:
    """Stands in for the launcher's ``Preemption``: a SIGTERM 'arrives' while micro-step ``call`` runs."""

    def __init__(self, seen: dict, call: int):
        self.seen, self.call = seen, call

    @property
    def signal_number(self) -> int:
        return int(signal.SIGTERM) if self.seen["calls"] >= self.call else 0


def test_preemption_under_the_deferred_check_saves_a_settled_step_and_resumes_exactly(data):
    """The stop flag rides in the verdict that is read a step late: the signal arrives during the 3rd micro-step (a
    NaN one, still unsettled), the run stops after settling every queued step, saves at that settled step (the skip
    counted, the scheduler not stepped for it) and ``--resume auto`` continues bit for bit."""
    bad = bad_batches(data)  # NaN on the 3rd and 6th batch
    rule = lambda call, batch: int(batch["index"][0]) in bad  # noqa: E731
    flags = ("--max-steps", "8", "--ckpt-every", "100")
    reference, records, _ = run(data, "uninterrupted_preempt", "auto", rule, *flags)

    outputs = data["root"] / "preempted"
    trainer = build_trainer(data["config"], outputs, "--tensorboard", "false", *flags)
    assert trainer.defer_check
    trainer.preemption = _SignalAt(nan_when(trainer.method, rule), 3)
    trainer.train()
    assert trainer.preempted and trainer.stop_signal == signal.SIGTERM
    step = trainer.step
    assert 1 <= step < 8 and trainer.nonfinite_total == 1
    assert trainer.last_checkpoint == outputs / "checkpoints" / f"step-{step:07d}"
    assert sorted(p.name for p in (outputs / "checkpoints").iterdir()) == [f"step-{step:07d}"]
    got = read_metrics(outputs)
    assert [r["step"] for r in got] == list(range(1, step + 1))
    assert_same_records(by_step(got), by_step(records), range(1, step + 1), keys=KEYS)

    resumed = build_trainer(data["config"], outputs, "--tensorboard", "false", *flags)
    resumed.resume(auto=True)
    nan_when(resumed.method, rule)
    resumed.train()
    got = read_metrics(outputs)
    assert [r["step"] for r in got] == list(range(1, 9))
    assert_same_records(by_step(got), by_step(records), range(1, 9), keys=KEYS)
    assert_same_state(trained_state(resumed), trained_state(reference))
