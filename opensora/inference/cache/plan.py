"""The Jano region cache's plan, pure functions of the denoising schedule and the model outputs (no model, no
store): which step runs at which level (``step_levels``), which tokens are static / medium / active
(``region_classes``), the per-row token order and counts a level computes (``RegionPlan``), and the cache entries
those imply (``entry_shapes``). The ideas and conventions are in jano.py's docstring."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from .config import JanoConfig

FULL, ACTIVE, MEDIUM, REFRESH = 0, 1, 2, 3  # step levels
STATIC_CLASS, MEDIUM_CLASS, ACTIVE_CLASS = 1, 2, 3  # token classes


def step_levels(num_steps: int, config: JanoConfig) -> List[int]:
    """The level of each of ``num_steps`` steps (see the module docstring)."""
    levels = []
    for step in range(num_steps):
        if step < config.warmup_steps or step >= num_steps - config.cooldown_steps:
            levels.append(FULL)
            continue
        j = step - config.warmup_steps
        if j % config.refresh_interval == 0:
            levels.append(REFRESH)
        elif j % config.medium_interval == 0:
            levels.append(MEDIUM)
        else:
            levels.append(ACTIVE)
    return levels


def region_classes(score: torch.Tensor, grid, config: JanoConfig, fixed: Optional[torch.Tensor] = None):
    """Token classes [R, N] (1 static, 2 medium, 3 active) from per-token change ``score`` [R, N] on ``grid``
    (t, h, w); ``fixed`` [R, N] bool marks tokens forced static (condition frames)."""
    rows = score.shape[0]
    score = score.float()
    score = score / score.amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    if config.dilation > 0:
        d = config.dilation
        kernel, pad = (1, 2 * d + 1, 2 * d + 1), (0, d, d)  # in space only: a frame's motion is its own
        score = F.max_pool3d(score.view(rows, 1, *grid), kernel, stride=1, padding=pad).view(rows, -1)
    classes = torch.full_like(score, STATIC_CLASS, dtype=torch.int8)
    classes[score > config.static_threshold] = MEDIUM_CLASS
    classes[score > config.medium_threshold] = ACTIVE_CLASS
    if fixed is not None:
        classes[fixed] = STATIC_CLASS
    return classes


@dataclass
class RegionPlan:
    """Per-row token order (active, medium, static; index order inside a class) and how many of them a level-1
    (``k_active``) and level-2 (``k_medium``) step computes."""

    order: torch.Tensor  # [R, N] long
    k_active: int
    k_medium: int
    _entry_keys: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_classes(
        cls, classes: torch.Tensor, score: Optional[torch.Tensor] = None, batch_quantile: float = 1.0
    ) -> "RegionPlan":
        """``score`` [R, N] (optional) orders tokens inside a class, most changing first. ``batch_quantile`` picks
        the counts over rows: 1 = the largest (every row computes all its dynamic tokens); below 1, rows above it
        leave their least changing dynamic tokens to the cache (an approximation that bounds the cost)."""
        key = (ACTIVE_CLASS - classes).float()
        if score is not None:
            score = score.float()
            key = key - 0.5 * score / score.amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        order = torch.sort(key, dim=1, stable=True).indices

        def count(selected):
            counts = selected.sum(1).float()
            return int(torch.quantile(counts, float(batch_quantile), interpolation="higher"))

        k_active = max(1, count(classes == ACTIVE_CLASS))
        k_medium = max(k_active, count(classes >= MEDIUM_CLASS))
        return cls(order, k_active, k_medium)

    @property
    def num_tokens(self) -> int:
        return self.order.shape[1]

    def computed(self, level: int) -> int:
        return {ACTIVE: self.k_active, MEDIUM: self.k_medium}.get(level, self.num_tokens)

    def entry_keys(self, layers: int, level: int) -> Tuple[str, ...]:
        """Entries a level-1/2 step reads, in reading order (``begin_fetch_step``'s argument; made once per level)."""
        keys = self._entry_keys.get((layers, level))
        if keys is None:
            keys = []
            for layer in range(layers):
                keys += self.reads(level, f"kv_{layer}")
            keys = self._entry_keys[(layers, level)] = tuple(keys + self.reads(level, "x"))
        return keys

    def reads(self, level: int, name: str) -> List[str]:
        """Entries of cache ``name`` (``kv_{layer}`` or ``x``) a level-1/2 step reads: medium (level 1), static."""
        keys = []
        if level == ACTIVE and self.k_medium > self.k_active:
            keys.append(f"m_{name}")
        if self.k_medium < self.num_tokens:
            keys.append(f"s_{name}")
        return keys


def entry_shapes(model, rows: int, plan: RegionPlan, num_layers: int) -> dict:
    """Shape of every cache entry, in reservation order (medium, then static; layers, then outputs)."""
    heads = model.num_heads
    head_dim = model.hidden_size // heads
    features = model.final_layer.linear.out_features
    shapes = {}
    for part, count in (("m", plan.k_medium - plan.k_active), ("s", plan.num_tokens - plan.k_medium)):
        if count == 0:
            continue
        for layer in range(num_layers):
            shapes[f"{part}_kv_{layer}"] = (2, rows, heads, count, head_dim)
        shapes[f"{part}_x"] = (rows, count, features)
    return shapes


def medium_read_later(level_of, step: int, num_steps: int) -> bool:
    """Whether a level-1 step reads the medium cache that step ``step`` (level 2) writes before a later level-2 or
    level-3 step overwrites it; ``level_of(j)`` is step j's level."""
    for j in range(step + 1, num_steps):
        level = level_of(j)
        if level == ACTIVE:
            return True
        if level in (MEDIUM, REFRESH):
            return False
    return False
