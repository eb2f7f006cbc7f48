"""The best checkpoint by a validation metric (``validation.best_metric``, ``opensora.best_checkpoint``): a real
one-rank CPU run of the tiny demo config whose validation scores are set per step, so the best step is known; pruning
spares it, ``RUN/best`` loads it, a resume forgets the steps it trains again; and the config checks."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_train import build_trainer  # noqa: E402
from test_validation import tiny_demo_config, write_config  # noqa: E402

from opensora.best_checkpoint import BEST_FILE, best_checkpoint_of, forget_after, note_value, read_best  # noqa: E402
from opensora.checkpoint_layout import newest_checkpoint_of  # noqa: E402


def test_note_value_keeps_the_last_of_equal_values_and_replaces_a_repeated_step(tmp_path):
    note_value(tmp_path, "val/all_acc", 2, 0.5)
    note_value(tmp_path, "val/all_acc", 4, 0.4)
    assert read_best(tmp_path)["best"] == dict(step=2, value=0.5, checkpoint="checkpoints/step-0000002")
    from opensora.checkpoint_layout import checkpoint_dir

    assert tmp_path / read_best(tmp_path)["best"]["checkpoint"] == checkpoint_dir(tmp_path, 2)  # the trainer's name
    note_value(tmp_path, "val/all_acc", 6, 0.5)  # a tie: the later, more trained step
    assert read_best(tmp_path)["best"]["step"] == 6
    note_value(tmp_path, "val/all_acc", 6, 0.1)  # step 6 validated again (a resumed run): its new value counts
    record = read_best(tmp_path)
    assert [e["step"] for e in record["history"]] == [2, 4, 6] and record["best"]["step"] == 2
    forget_after(tmp_path, 3)
    assert [e["step"] for e in read_best(tmp_path)["history"]] == [2]
    note_value(tmp_path, "val/color_acc", 8, 0.2)  # another metric starts a new history
    assert read_best(tmp_path)["history"] == [dict(step=8, value=0.2)]
    assert not list(tmp_path.glob(".*.tmp"))


def test_run_best_names_what_is_missing(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(FileNotFoundError, match="no best checkpoint.*best_metric"):
        newest_checkpoint_of(tmp_path / "best")
    note_value(tmp_path, "val/all_acc", 2, 0.5)
    with pytest.raises(FileNotFoundError, match="step-0000002.*does not exist"):
        best_checkpoint_of(tmp_path)
    assert newest_checkpoint_of(tmp_path / "elsewhere" / "best") == tmp_path / "elsewhere" / "best"  # not a run


@pytest.fixture(scope="module")
def best_run(tmp_path_factory):
    """A run to step 8, a checkpoint and a validation every 2 steps, keep_last=1, ``best_metric="val/all_acc"``
    with the validation's all_acc set to 0.2, 0.9, 0.4, 0.6 at steps 2, 4, 6, 8 (the scorer runs for real; only
    that one number is replaced): the best step is 4. Then resumed from step 4 with 0.95 and 0.3: the best is the
    new step 6."""
    from opensora.eval import moving_shapes_windows

    root = tmp_path_factory.mktemp("best")
    validation = dict(every=2, num_steps=2, score="moving_shapes", best_metric="val/all_acc")
    plain, prompts = tiny_demo_config(root, 2, keep_last=1)
    config = write_config(root / "val.py", plain, validation=dict(validation, prompts=prompts))
    real, values = moving_shapes_windows.score_rows, iter([0.2, 0.9, 0.4, 0.6, 0.95, 0.3])

    def scored(*args, **kwargs):
        return dataclasses.replace(real(*args, **kwargs), all_acc=next(values))

    patch = pytest.MonkeyPatch()
    patch.setattr(moving_shapes_windows, "score_rows", scored)  # what validation's score_clips calls
    try:
        outputs = root / "run"
        build_trainer(config, outputs, "--max-steps", "8", "--ckpt-every", "2").train()
        kept = sorted(p.name for p in (outputs / "checkpoints").glob("step-*"))
        record = read_best(outputs)
        best_before = newest_checkpoint_of(outputs / "best")
        # resumed from step 4: steps 6 and 8 are trained and validated again (0.95, 0.3), the old run's step-0000008
        # still on disk when the new step 6 is saved (pruning must not take the new step 6 for the older one)
        resumed = build_trainer(config, outputs, "--max-steps", "8", "--ckpt-every", "2")
        resumed.resume(load=str(outputs / "checkpoints" / "step-0000004"))
        after_resume = read_best(outputs)
        resumed.train()
    finally:
        patch.undo()
    kept_after = sorted(p.name for p in (outputs / "checkpoints").glob("step-*"))
    return dict(
        config=config,
        outputs=outputs,
        kept=kept,
        record=record,
        best_before=best_before,
        after_resume=after_resume,
        kept_after=kept_after,
    )


def test_the_best_validation_step_is_recorded_and_its_checkpoint_outlives_keep_last(best_run):
    record = best_run["record"]
    assert record["metric"] == "val/all_acc"
    assert [(e["step"], e["value"]) for e in record["history"]] == [(2, 0.2), (4, 0.9), (6, 0.4), (8, 0.6)]
    assert record["best"] == dict(step=4, value=0.9, checkpoint="checkpoints/step-0000004")
    assert best_run["kept"] == ["step-0000004", "step-0000008"]  # keep_last=1 plus the best


def test_run_slash_best_loads_the_best_checkpoints_weights(best_run):
    from opensora.convert.weights import load_role_weights

    outputs = best_run["outputs"]
    assert best_run["best_before"] == outputs / "checkpoints" / "step-0000004"
    best = load_role_weights(outputs / "best", role="model", ema=True)  # after the resume: step 6 (0.95)
    saved = load_role_weights(outputs / "checkpoints" / "step-0000006", role="model", ema=True)
    assert best.step == 6 and all(torch.equal(best.state_dict[k], v) for k, v in saved.state_dict.items())
    last = load_role_weights(outputs / "checkpoints" / "step-0000008", role="model", ema=True)
    assert not all(torch.equal(best.state_dict[k], v) for k, v in last.state_dict.items())  # not the newest


def test_a_resumed_run_forgets_the_steps_it_trains_again(best_run):
    from opensora.convert.weights import load_role_weights

    assert [e["step"] for e in best_run["after_resume"]["history"]] == [2, 4]
    outputs = best_run["outputs"]
    final = json.loads((outputs / BEST_FILE).read_text())
    assert [(e["step"], e["value"]) for e in final["history"]] == [(2, 0.2), (4, 0.9), (6, 0.95), (8, 0.3)]
    assert final["best"]["step"] == 6
    assert load_role_weights(outputs / "best", role="model").step == 6  # saved by the resumed run, not pruned
    # the old course's step 8 went first when the new step 6 was saved; then keep_last=1 plus the best
    assert best_run["kept_after"] == ["step-0000006", "step-0000008"]


def test_a_cut_short_or_unscored_validation_is_no_best_candidate(tmp_path):
    from types import SimpleNamespace

    from opensora.training.validation import Validator

    validator = SimpleNamespace(settings=dict(best_metric="val/all_acc", prompts=["a", "b", "c"]), outputs=tmp_path)
    Validator._note_best(validator, 2, {"val/all_acc": 0.5, "val/num_samples": 3})
    Validator._note_best(validator, 4, {"val/all_acc": 0.9, "val/num_samples": 2})  # max_seconds cut it short
    Validator._note_best(validator, 6, {"val/all_acc": 0.9, "val/num_samples": 3, "val/long_samples": 1})
    Validator._note_best(validator, 8, {"val/all_acc": float("nan"), "val/num_samples": 3})
    assert read_best(tmp_path)["history"] == [dict(step=2, value=0.5)]


def test_best_metric_must_be_a_logged_score_at_checkpointed_steps(best_run):
    from opensora.config import ConfigValueError, load_config
    from opensora.training.validation import validation_settings

    cfg = load_config(str(best_run["config"]))
    cfg.ckpt_every = 2
    assert validation_settings(cfg)["best_metric"] == "val/all_acc"
    cfg.validation.best_metric = "val/al_acc"
    with pytest.raises(ConfigValueError, match="did you mean 'val/all_acc'"):
        validation_settings(cfg)
    cfg.validation.best_metric = "val/stats_window_min"  # a window score without long clips
    with pytest.raises(ConfigValueError, match="not a score this validation logs"):
        validation_settings(cfg)
    cfg.validation.best_metric = "val/all_acc"
    cfg.ckpt_every = 3
    with pytest.raises(ConfigValueError, match="multiple of ckpt_every.*set ckpt_every=2"):
        validation_settings(cfg)
    cfg.ckpt_every, cfg.save_at_end = 2, False
    with pytest.raises(ConfigValueError, match="save_at_end=False"):
        validation_settings(cfg)


def test_a_run_ending_between_validations_validates_its_last_step_and_may_pick_it(tmp_path):
    """A run stopped at step 5 with a validation every 2 steps (as ``max_minutes`` stops one anywhere): ``at_end``
    validates step 5 after its checkpoint is saved, so best.json weighs the checkpoint the run ends on (here the best,
    0.8 against 0.2 and 0.5) and ``RUN/best`` loads it. With ``at_end=False`` steps 2 and 4 alone are validated. A
    LongRollout stage of 120 steps under ``every=150`` was never validated before this, so its best was unknown."""
    from opensora.convert.weights import load_role_weights
    from opensora.eval import moving_shapes_windows

    validation = dict(every=2, num_steps=2, score="moving_shapes", best_metric="val/all_acc")
    plain, prompts = tiny_demo_config(tmp_path, 2, keep_last=1)
    real, values = moving_shapes_windows.score_rows, iter([0.2, 0.5, 0.8, 0.2, 0.5])

    def scored(*args, **kwargs):
        return dataclasses.replace(real(*args, **kwargs), all_acc=next(values))

    runs = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moving_shapes_windows, "score_rows", scored)
        for name, at_end in (("at_end", True), ("off", False)):
            config = write_config(
                tmp_path / f"{name}.py", plain, validation=dict(validation, prompts=prompts, at_end=at_end)
            )
            runs[name] = tmp_path / name
            build_trainer(config, runs[name], "--max-steps", "5", "--ckpt-every", "2").train()
    record = read_best(runs["at_end"])
    assert [(e["step"], e["value"]) for e in record["history"]] == [(2, 0.2), (4, 0.5), (5, 0.8)]
    assert record["best"] == dict(step=5, value=0.8, checkpoint="checkpoints/step-0000005")
    assert load_role_weights(runs["at_end"] / "best", role="model").step == 5
    assert sorted(p.name for p in (runs["at_end"] / "samples").iterdir()) == [
        "step-0000002",
        "step-0000004",
        "step-0000005",
    ]
    assert [e["step"] for e in read_best(runs["off"])["history"]] == [2, 4]
    assert read_best(runs["off"])["best"]["step"] == 4
    assert sorted(p.name for p in (runs["off"] / "checkpoints").glob("step-*")) == ["step-0000004", "step-0000005"]
