"""The lr schedule: constant_with_warmup by default; an optional linear / cosine decay over the run's last part,
checked step by step against its closed form through torch's LambdaLR (what the trainer builds)."""

import math
from pathlib import Path

import pytest
import torch

from opensora.config import ConfigKeyError, ConfigValueError, load_config_from_cli
from opensora.lr_schedule import lr_lambda, warmup_lambda
from opensora.role_config import role_configs

NETWORK = dict(type="MMDiT", in_channels=4)
LR, WARMUP, TOTAL = 2e-3, 10, 100
DEMO_FAST = Path(__file__).resolve().parents[1] / "configs/diffusion/train/demo_fast.py"


def applied_lrs(factor, steps: int) -> list:
    """The lr each optimizer step uses, as the trainer steps optimizer then scheduler."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def closed_form(step: int, kind: str, fraction: float, floor: float) -> float:
    warmup = min(1.0, (step + 1) / WARMUP)
    decay_steps = round(fraction * TOTAL)
    start = TOTAL - decay_steps
    if step < start:
        return LR * warmup
    p = (step - start) / decay_steps
    shape = 1 - p if kind == "linear" else 0.5 * (1 + math.cos(math.pi * p))
    return LR * warmup * (floor + (1 - floor) * shape)


def test_no_decay_is_constant_with_warmup():
    assert applied_lrs(lr_lambda(WARMUP), TOTAL) == pytest.approx([LR * warmup_lambda(WARMUP)(s) for s in range(TOTAL)])
    assert applied_lrs(lr_lambda(WARMUP, None, TOTAL), TOTAL)[-1] == pytest.approx(LR)


@pytest.mark.parametrize("kind", ["linear", "cosine"])
@pytest.mark.parametrize("fraction, floor", [(0.4, 0.0), (1.0, 0.1), (0.25, 0.5)])
def test_decay_follows_the_closed_form(kind, fraction, floor):
    decay = dict(type=kind, fraction=fraction, min_factor=floor)
    lrs = applied_lrs(lr_lambda(WARMUP, decay, TOTAL), TOTAL)
    assert lrs == pytest.approx([closed_form(s, kind, fraction, floor) for s in range(TOTAL)], abs=1e-12)
    start = TOTAL - round(fraction * TOTAL)
    if start >= WARMUP:
        assert lrs[start] == pytest.approx(LR)  # the decay starts from the full lr
    assert lrs[-1] > LR * floor  # the last step still moves the weights; min_factor is reached just after it
    assert all(a >= b for a, b in zip(lrs[WARMUP:], lrs[WARMUP + 1 :]))  # never rises after warmup


def test_total_steps_overrides_max_steps():
    factor = lr_lambda(0, dict(type="linear", fraction=1.0, total_steps=50), max_steps=1000)
    assert factor(0) == 1.0 and factor(25) == pytest.approx(0.5) and factor(50) == 0.0 and factor(999) == 0.0


def test_decay_without_a_horizon_is_an_error():
    with pytest.raises(ValueError, match="total_steps"):
        lr_lambda(0, dict(type="cosine"))


def test_shorthand_reaches_the_role_with_defaults():
    role = role_configs(dict(model=NETWORK, lr_decay=dict(type="linear", fraction=0.3)))["model"]
    assert role["lr_decay"] == dict(type="linear", fraction=0.3, min_factor=0.0, total_steps=None)
    assert role_configs(dict(model=NETWORK))["model"]["lr_decay"] is None


@pytest.mark.parametrize(
    "decay, error, match",
    [
        (dict(type="step"), ConfigValueError, "lr_decay.type"),
        (dict(fraction=0.0), ConfigValueError, "fraction"),
        (dict(min_factor=2.0), ConfigValueError, "min_factor"),
        (dict(total_steps=0), ConfigValueError, "total_steps"),
        (dict(fracton=0.5), ConfigKeyError, "fracton"),
    ],
)
def test_bad_settings_name_the_key(decay, error, match):
    with pytest.raises(error, match=match):
        role_configs(dict(models=dict(student=dict(model=NETWORK, lr_decay=decay))))


def test_demo_config_takes_lr_decay_from_the_command_line():
    cfg, _ = load_config_from_cli([str(DEMO_FAST), "--lr_decay", "{'type': 'cosine'}"])
    assert role_configs(cfg)["model"]["lr_decay"]["type"] == "cosine"
