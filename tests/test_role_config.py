"""The one role dialect: plain training's top-level keys expand to the role ``model``; ignored keys are errors."""

import subprocess
import sys
from pathlib import Path

import pytest

from opensora.config import load_config, load_config_from_cli
from opensora.role_config import ROLE_DEFAULTS, role_configs

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs/diffusion/train/demo.py"
DMD2_DEMO = ROOT / "configs/distill/dmd2_demo.py"
NETWORK = dict(type="MMDiT", in_channels=4)


def test_shorthand_expands_to_one_role_with_defaults():
    roles = role_configs(dict(model=NETWORK, lr=1e-3, warmup_steps=5, grad_clip=1.0, ema_decay=0.9, precision="fp32"))
    assert list(roles) == ["model"]
    role = roles["model"]
    assert role["model"] == NETWORK and role["trainable"] and role["precision"] == "fp32"
    assert role["optimizer"] == {**ROLE_DEFAULTS["optimizer"], "lr": 1e-3}
    assert (role["warmup_steps"], role["grad_clip"]) == (5, 1.0)
    assert role["ema"] == dict(decay=0.9, start_step=0, warmup=True)


def test_roles_take_the_same_defaults_as_the_shorthand():
    roles = role_configs(dict(models=dict(student=dict(model=NETWORK), teacher=dict(model=NETWORK, trainable=False))))
    assert roles["student"] == role_configs(dict(model=NETWORK))["model"]
    assert roles["teacher"]["trainable"] is False


@pytest.mark.parametrize("key", ["lr", "warmup_steps", "grad_clip", "ema_decay", "model"])
def test_shorthand_key_next_to_roles_is_an_error(key):
    cfg = dict(models=dict(student=dict(model=NETWORK)), **{key: NETWORK if key == "model" else 1.0})
    with pytest.raises(KeyError, match=f"'{key}'"):
        role_configs(cfg)


def test_lr_given_twice_is_an_error():
    with pytest.raises(KeyError, match="optimizer.lr"):
        role_configs(dict(model=NETWORK, lr=1e-3, optimizer=dict(lr=1e-4)))


def test_unknown_role_key_names_the_nearest():
    with pytest.raises(KeyError, match="'models.student.grad_clipp'.*'grad_clip'"):
        role_configs(dict(models=dict(student=dict(model=NETWORK, grad_clipp=1.0))))


def test_lr_override_on_the_command_line_reaches_the_role():
    cfg, _ = load_config_from_cli([str(DEMO), "--lr", "1e-4"])
    assert role_configs(cfg)["model"]["optimizer"]["lr"] == 1e-4


def test_distillation_config_sets_every_role_itself():
    roles = role_configs(load_config(DMD2_DEMO))
    assert sorted(roles) == ["critic", "student", "teacher"]
    assert roles["student"]["optimizer"]["lr"] == 5e-5 and roles["critic"]["optimizer"]["lr"] == 1e-4
    with pytest.raises(KeyError, match="'lr'"):  # the teacher config's lr would be silently ignored
        role_configs(load_config(DMD2_DEMO, ["--lr", "1e-3"]))


def test_train_script_reports_an_ignored_key_in_one_line():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts/diffusion/train.py"), str(DMD2_DEMO), "--lr", "1e-3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "'lr'" in result.stderr and "Traceback" not in result.stderr


def test_build_optimizer_keeps_parameter_groups_given_as_generators():
    import torch

    from opensora.training.role_builder import build_optimizer

    layer = torch.nn.Linear(3, 2)
    optimizer = build_optimizer([dict(params=layer.parameters(), lr=1e-3)], dict(type="AdamW"))
    assert len(optimizer.param_groups[0]["params"]) == 2
