"""Learning-rate multipliers per optimizer step: linear warmup, then constant, then an optional decay.

Pure Python (no torch), so a role config is checked where it is read (``opensora.role_config``, which sampling
imports too) and the trainer wraps the multiplier in ``torch.optim.lr_scheduler.LambdaLR``.

A role's ``lr_decay`` (top-level ``lr_decay`` in plain training)::

    lr_decay = dict(type="cosine", fraction=0.5, min_factor=0.0, total_steps=None)

decays the lr over the last ``fraction`` of ``total_steps`` optimizer steps (None: the run's ``max_steps``, right
for a role that steps every trainer step; set it for a role that steps less often, e.g. a DMD2 student), down to
``min_factor`` x lr just after the last step. ``None`` (the default) keeps constant_with_warmup. The multiplier
depends only on the step, so an exact resume with the same ``max_steps`` follows the same schedule; a run stopped
early (``max_minutes``) never reaches the end of its decay.
"""

import math
from typing import Any, Callable, Dict, Mapping, Optional

LR_DECAY_TYPES = ("linear", "cosine")
LR_DECAY_DEFAULTS = dict(type="cosine", fraction=1.0, min_factor=0.0, total_steps=None)


def warmup_lambda(warmup_steps: int) -> Callable[[int], float]:
    """constant_with_warmup: linear ramp over ``warmup_steps`` optimizer steps, the first step already > 0."""

    def factor(step: int) -> float:
        return 1.0 if warmup_steps <= 0 else min(1.0, (step + 1) / warmup_steps)

    return factor


def lr_decay_settings(decay: Optional[Mapping], where: str = "lr_decay") -> Optional[Dict[str, Any]]:
    """``decay`` checked and completed from ``LR_DECAY_DEFAULTS``; None stays None. Errors name ``where``."""
    if decay is None:
        return None
    if not isinstance(decay, Mapping):
        raise ValueError(f"'{where}' must be a dict like {LR_DECAY_DEFAULTS} or None, got {decay!r}")
    unknown = sorted(set(decay) - set(LR_DECAY_DEFAULTS))
    if unknown:
        raise KeyError(f"unknown key(s) {unknown} in '{where}' (keys: {list(LR_DECAY_DEFAULTS)})")
    settings = {**LR_DECAY_DEFAULTS, **dict(decay)}
    if settings["type"] not in LR_DECAY_TYPES:
        raise ValueError(f"'{where}.type' must be one of {LR_DECAY_TYPES}, got {settings['type']!r}")
    if not 0.0 < float(settings["fraction"]) <= 1.0:
        raise ValueError(f"'{where}.fraction' must be in (0, 1], got {settings['fraction']!r}")
    if not 0.0 <= float(settings["min_factor"]) <= 1.0:
        raise ValueError(f"'{where}.min_factor' must be in [0, 1], got {settings['min_factor']!r}")
    total = settings["total_steps"]
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 1):
        raise ValueError(f"'{where}.total_steps' must be a positive integer or None, got {total!r}")
    return settings


def decay_factor(step: int, decay: Mapping, total_steps: int) -> float:
    """The decay's multiplier at 0-based optimizer step ``step``: 1 before the decay window, then falling to
    ``min_factor`` at step ``total_steps`` (one past the last step, so the last step still moves the weights)."""
    decay_steps = max(1, round(float(decay["fraction"]) * total_steps))
    start = total_steps - decay_steps
    if step < start:
        return 1.0
    progress = min(1.0, (step - start) / decay_steps)
    floor = float(decay["min_factor"])
    if decay["type"] == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_lambda(warmup_steps: int, decay: Optional[Mapping] = None, max_steps: Optional[int] = None):
    """The LambdaLR multiplier: warmup x decay. ``max_steps`` is the decay's horizon when ``decay.total_steps``
    is None."""
    warmup = warmup_lambda(warmup_steps)
    if decay is None:
        return warmup
    decay = lr_decay_settings(decay)
    total_steps = decay["total_steps"] or max_steps
    if total_steps is None:
        raise ValueError("lr_decay needs total_steps (or the run's max_steps) to know where the decay ends")

    def factor(step: int) -> float:
        return warmup(step) * decay_factor(step, decay, int(total_steps))

    return factor
