"""Validation samples during training (issue 17, item 2) on CPU: the tiny demo config (4-frame 32x32 MovingShapes clips)
with ``validation = dict(every=2, ...)``: files, metrics, tensorboard, no effect on the losses, exact resume, and a
two-rank gloo run where rank 0 samples alone (the other rank waits at the next collective and nothing hangs)."""

import csv
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_train import DEMO_CONFIG, ROOT, assert_same_records, build_trainer, launch, read_metrics  # noqa: E402

VAL_KEYS = ("val/color_acc", "val/shape_acc", "val/direction_acc", "val/all_acc", "val/seconds", "val/num_samples")


def write_config(path: Path, base: Path, **values) -> Path:
    lines = [f"_base_ = [{str(base)!r}]"] + [f"{key} = {value!r}" for key, value in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def split_records(outputs: Path):
    """(training records by step, validation records by step) of a run's metrics.jsonl."""
    train, val = {}, {}
    for record in read_metrics(outputs):
        (val if "val/seconds" in record else train)[record["step"]] = record
    return train, val


def tiny_demo_config(root: Path, num_prompts: int, **values):
    """(the demo config on 8 written 4-frame 32x32 clips with ``values`` on top, ``num_prompts`` of their captions)."""
    from opensora.datasets.moving_shapes import write_dataset

    data = write_dataset(root / "data", num=8, seed=0, height=32, width=32, num_frames=4, progress=False)
    prompts = [row["text"] for row in csv.DictReader(open(data))][:num_prompts]
    config = write_config(
        root / "plain.py",
        DEMO_CONFIG,
        dataset=dict(data_path=str(data)),
        bucket_config={"_delete_": True, "32x32": {4: (1.0, 2)}},
        num_workers=0,
        **values,
    )
    return config, prompts


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three one-rank runs to step 4 with a checkpoint at step 2: validation every 2 steps, none, and the first
    resumed from its step-2 checkpoint (validation on)."""
    root = tmp_path_factory.mktemp("validation")
    plain, prompts = tiny_demo_config(root, 3, warmup_steps=5)
    validated = write_config(
        root / "val.py", plain, validation=dict(every=2, prompts=prompts, num_steps=3, score="moving_shapes")
    )
    flags = ("--max-steps", "4", "--ckpt-every", "2")
    outputs = dict(val=root / "val", plain=root / "plain", resumed=root / "resumed")
    build_trainer(validated, outputs["val"], *flags).train()
    build_trainer(plain, outputs["plain"], *flags).train()
    resumed = build_trainer(validated, outputs["resumed"], *flags)
    resumed.resume(load=str(outputs["val"] / "checkpoints" / "step-0000002"))
    resumed.train()
    return dict(root=root, prompts=prompts, validated=validated, **outputs)


def test_samples_csv_and_metrics_are_written_every_n_steps(runs):
    outputs = runs["val"]
    assert sorted(p.name for p in (outputs / "samples").iterdir()) == ["step-0000002", "step-0000004"]
    for step_dir in (outputs / "samples").iterdir():
        rows = list(csv.DictReader(open(step_dir / "samples.csv")))
        assert [row["text"] for row in rows] == runs["prompts"]
        for row in rows:  # paths relative to the csv, as the inference CLI writes them
            assert (step_dir / row["path"]).suffix == ".mp4" and (step_dir / row["path"]).stat().st_size > 0
        summary = json.loads((step_dir / "validation.json").read_text())
        assert summary["role"] == "model" and summary["ema"] and summary["num_frames"] == 4
    train, val = split_records(outputs)
    assert sorted(train) == [1, 2, 3, 4] and sorted(val) == [2, 4]
    for record in val.values():
        assert set(VAL_KEYS) <= set(record)
        assert all(0.0 <= record[f"val/{a}_acc"] <= 1.0 for a in ("color", "shape", "direction"))
        assert record["val/num_samples"] == 3 and record["val/seconds"] > 0
    assert not (runs["plain"] / "samples").exists()


def test_tensorboard_has_validation_scalars_and_the_frame_grid(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((runs["val"] / "tensorboard").glob("events.out.tfevents.*"))
    accumulator = EventAccumulator(str(events[0]))
    accumulator.Reload()
    tags = accumulator.Tags()
    assert {"val/color_acc", "val/shape_acc", "val/direction_acc", "val/seconds"} <= set(tags["scalars"])
    assert "train/loss" in tags["scalars"]
    assert [e.step for e in accumulator.Scalars("val/color_acc")] == [2, 4]
    grids = accumulator.Images("val/samples")
    assert [g.step for g in grids] == [2, 4]
    assert (grids[0].height, grids[0].width) == (3 * 32, 4 * 32)  # a row per prompt, every one of the 4 frames


def test_validation_leaves_the_losses_bit_identical(runs):
    train_val, _ = split_records(runs["val"])
    train_plain, _ = split_records(runs["plain"])
    assert_same_records(train_val, train_plain, steps=[1, 2, 3, 4])


def test_resume_with_validation_is_exact(runs):
    train_val, val_val = split_records(runs["val"])
    train_resumed, val_resumed = split_records(runs["resumed"])
    assert_same_records(train_resumed, train_val, steps=[3, 4])
    # the EMA is restored too: the step-4 samples are the same videos (bit-identical files) and scores
    assert sorted(val_resumed) == [4]
    for key in VAL_KEYS[:4]:
        assert val_resumed[4][key] == val_val[4][key]
    for name in [row["path"] for row in csv.DictReader(open(runs["val"] / "samples/step-0000004/samples.csv"))]:
        got = (runs["resumed"] / "samples/step-0000004" / name).read_bytes()
        assert got == (runs["val"] / "samples/step-0000004" / name).read_bytes()


def test_unknown_validation_key_names_the_nearest():
    from opensora.config import ConfigKeyError, load_config
    from opensora.training.validation import validation_settings

    cfg = load_config(DEMO_CONFIG, overrides=None)
    cfg.validation = dict(evrey=2, prompts=["a red circle moving left"])
    with pytest.raises(ConfigKeyError, match="validation.every"):
        validation_settings(cfg)


def test_settings_default_to_the_first_bucket_and_a_distilled_students_sampling_keys():
    from opensora.config import load_config
    from opensora.training.validation import validation_settings

    cfg = load_config(DEMO_CONFIG)
    cfg.validation = dict(every=5, prompts=["a red circle moving left"])
    s = validation_settings(cfg)
    assert (s["role"], s["resolution"], s["num_frames"], s["step_list"], s["seeds"]) == (
        "model",
        "32x32",
        16,
        None,
        [0],
    )
    cfg.validation = dict(every=0, prompts=["x"])
    assert validation_settings(cfg) is None
    distill = load_config(ROOT / "configs" / "distill" / "dmd2_demo.py")
    distill.validation = dict(every=5, prompts=["a red circle moving left", "a blue square moving up"], seed=7)
    s = validation_settings(distill)
    assert s["role"] == "student" and s["step_list"] == [1.0, 0.75, 0.5, 0.25]
    assert s["guidance_scale"] == 1.0 and s["seeds"] == [7, 8]


def test_two_rank_gloo_run_with_validation_finishes(runs):
    """Rank 0 samples alone; rank 1 meets it at the next step's all-reduce (no barrier, no hang)."""
    outputs = runs["root"] / "two_ranks"
    launch("torchrun", runs["validated"], outputs, "--max-steps", "4")
    train, val = split_records(outputs)
    assert sorted(train) == [1, 2, 3, 4] and sorted(val) == [2, 4]
    assert sorted(p.name for p in (outputs / "samples").iterdir()) == ["step-0000002", "step-0000004"]


def test_two_rank_run_ending_between_validations_validates_its_last_step_from_the_sharded_ema(runs):
    """``at_end`` on 2 ZeRO ranks, where the EMA is sharded: both ranks gather it for the last step's validation
    after the final save (one rank alone would hang the other), and the run ends."""
    from opensora.config import load_config

    plugin = load_config(runs["validated"]).plugin  # LowLevelZero on 2 ranks: sharded_ema_fits shards the EMA
    assert plugin.type == "LowLevelZeroPlugin" and not plugin.get("cpu_offload")
    outputs = runs["root"] / "two_ranks_at_end"
    launch("torchrun", runs["validated"], outputs, "--max-steps", "5")
    train, val = split_records(outputs)
    assert sorted(train) == [1, 2, 3, 4, 5] and sorted(val) == [2, 4, 5]
    assert sorted(p.name for p in (outputs / "samples").iterdir()) == ["step-0000002", "step-0000004", "step-0000005"]
    assert 0.0 <= val[5]["val/color_acc"] <= 1.0 and (outputs / "checkpoints" / "step-0000005").is_dir()
    assert json.loads((outputs / "samples" / "step-0000005" / "validation.json").read_text())["ema"]


def test_distillation_run_validates_the_student_on_its_step_list(tmp_path):
    """DMD2 (student, critic, frozen teacher): the student's EMA is sampled on method.step_list without CFG."""
    from test_dmd2 import _write_run_config

    base = _write_run_config(tmp_path)
    config = write_config(
        tmp_path / "dmd2_val.py", base, validation=dict(every=2, prompts=["a red circle moving left"])
    )
    outputs = tmp_path / "run"
    build_trainer(config, outputs, "--max-steps", "2").train()
    train, val = split_records(outputs)
    assert sorted(train) == [1, 2] and sorted(val) == [2]
    summary = json.loads((outputs / "samples/step-0000002/validation.json").read_text())
    assert summary["role"] == "student" and summary["ema"]
    assert summary["step_list"] == [1.0, 0.6, 0.3] and summary["guidance_scale"] == 1.0
    assert summary["resolution"] == "18x18" and summary["num_frames"] == 4
    assert (outputs / "samples/step-0000002/0000_a_red_circle_moving_left.mp4").stat().st_size > 0


def _bare_validator(cfg, network, ema=None, metrics=None, outputs="unused"):
    from types import SimpleNamespace

    from opensora.training.validation import Validator, validation_settings

    role = SimpleNamespace(unwrap=lambda: network, wait_for_params=lambda: None, ema=ema)
    components = SimpleNamespace(vae=None, text_encoder=None)
    return Validator(validation_settings(cfg), cfg, {"model": role}, components, metrics, outputs, is_main=True)


def test_a_network_wrapped_after_building_is_deep_copied_and_the_live_one_untouched():
    """e.g. LoRA adapters: the config's plain network cannot hold its state dict, so the copy is a deep copy."""
    import torch

    from opensora.config import load_config
    from opensora.registry import MODELS, build_module

    cfg = load_config(DEMO_CONFIG)
    cfg.validation = dict(every=1, prompts=["a red circle moving left"])

    class Wrapped(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base, self.extra = base, torch.nn.Linear(2, 2)

    live = Wrapped(build_module(cfg.model, MODELS)).train()
    before = {k: v.clone() for k, v in live.state_dict().items()}
    network = _bare_validator(cfg, live)._refreshed_network()
    assert isinstance(network, Wrapped) and network is not live and not network.training
    assert not any(p.requires_grad for p in network.parameters())
    assert all(p.requires_grad for p in live.parameters()) and live.training
    with torch.no_grad():
        next(network.parameters()).add_(1.0)
    assert all(torch.equal(v, before[k]) for k, v in live.state_dict().items())


def test_a_failing_validation_is_logged_and_training_state_is_untouched(tmp_path, caplog):
    import torch

    from opensora.config import load_config
    from opensora.registry import MODELS, build_module

    cfg = load_config(DEMO_CONFIG)
    cfg.validation = dict(every=1, prompts=["a red circle moving left"])
    validator = _bare_validator(cfg, build_module(cfg.model, MODELS), outputs=tmp_path)  # no VAE: sampling fails
    state = torch.get_rng_state()
    assert validator.run(3) is None
    assert torch.equal(torch.get_rng_state(), state)
    assert "validation at step 3 failed" in caplog.text


def test_a_prompt_file_replaces_the_prompt_list(tmp_path):
    from opensora.config import load_config
    from opensora.training.validation import validation_settings

    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("a red circle moving left\n\na blue square moving up\n")
    cfg = load_config(DEMO_CONFIG, overrides=["--validation.every", "3", "--validation.prompt_file", str(prompt_file)])
    s = validation_settings(cfg)
    assert s["prompts"] == ["a red circle moving left", "a blue square moving up"] and s["seeds"] == [0, 1]
    assert s["num_steps"] == 10 and s["score"] == "moving_shapes"


def test_a_config_of_several_networks_names_the_role_it_samples():
    """The trainer side knows no role names: a config with several networks (and no top-level role) must say which one
    validation samples; with ``validation.role`` it samples that one."""
    from opensora.config import ConfigValueError, load_config
    from opensora.training.validation import validation_settings

    distill = load_config(ROOT / "configs" / "distill" / "dmd2_demo.py")
    distill.role = None
    distill.validation = dict(every=5, prompts=["a red circle moving left"])
    with pytest.raises(ConfigValueError, match=r"validation needs the role to sample: this config trains \['critic'"):
        validation_settings(distill)
    distill.validation = dict(every=5, prompts=["a red circle moving left"], role="critic")
    assert validation_settings(distill)["role"] == "critic"
