"""Jano-style region-aware caching for the MMDiT sampler, and a whole-step (TeaCache-style) baseline.

Idea (Jano: region-aware caching with early-stage convergence awareness): after a few full warm-up steps, the
tokens whose predictions barely change are *static*, those that change a lot are *active*, the rest *medium*.
Later steps recompute only some tokens; the others contribute the keys/values cached at the last refresh (so the
computed tokens still attend to the whole sequence) and their last output.

Step levels (``step_levels``): 0 = full compute (warm-up, cool-down); 3 = full compute and refresh the static +
medium caches; 2 = compute active + medium tokens (their keys/values/outputs refresh the medium cache), reuse
static; 1 = compute active tokens only, reuse medium + static. After warm-up the cached steps cycle: level 3 every
``refresh_interval`` steps, level 2 every ``medium_interval`` steps in between, level 1 otherwise.

Region analysis (``region_classes``), once, at the first cached step: per row (sample x CFG branch), the mean
absolute change of the model output per token over the last ``analysis_steps`` warm-up steps, divided by the row's
largest change (so it lies in [0, 1]), grown by ``dilation`` tokens in (h, w) (a moving object enters its
neighbours next); static <= ``static_threshold`` < medium <= ``medium_threshold`` < active (Jano's defaults
0.2 / 0.6). Condition frames (i2v / v2v: tokens whose condition mask is set) are static: their outputs are
overwritten by the reference after sampling, so only their keys/values matter, and those follow the fixed
reference.

Batch and CFG: the sampler batches samples and CFG branches along dim 0 ("rows"); every row has its own cache
rows, so branches never share cached values. By default (``share_branches``) the branches of one sample share one
region set, from the mean of their normalised scores (as Jano uses one mask for both conditions): cond and uncond
then reuse the same tokens, and their difference, which CFG amplifies, stays consistent; a condition frame of any
branch is static for all. ``share_branches=False`` (or an unknown batch size) gives every row its own regions. Rows differ in how many tokens are active, and one
batched forward needs one count: each row computes its ``K`` first tokens in the order (active, medium, static;
token index inside a class), with ``K`` the largest active (level 1) or active + medium (level 2) count over the
rows (inside a class, the most changing tokens first). A row with fewer dynamic tokens recomputes a few of its
medium (static) tokens too, which only makes it more exact; unlike a per-batch union, the cost does not grow with
the number of rows that move in different places. One row whose every token is active still forces full compute
for the batch; ``batch_quantile`` < 1 takes that quantile of the counts instead (the rows above it reuse their
least changing dynamic tokens: cheaper, approximate).

Exactness: levels 0 and 3 run exactly the model's forward (same ops, same order; the level-3 hook only reads), and
a step whose computed set would be every token runs as level 3; so all-active regions, or ``--jano`` off, give the
model's output bit for bit (tests/test_jano.py).

Where it lives: plan.py (step levels, region classes, the plan: pure), region_forward.py (``RegionForward``: the
model's own ``patch_inputs`` / ``embed_patches``, ``run_block_range`` and ``final_tokens`` with a token subset, RoPE
rows gathered per row, and cache hooks on the blocks' ``kv_hook`` seam; the model has no branch for it), stores.py
(the ``CacheStore`` protocol; on the device, or the dual-stream ``PackedOffloadManager`` of ``--jano-offload``),
region_graphs.py (``--jano-graphs``, ``JanoConfig.graphs``: every level replayed as CUDA graphs against stores at
fixed addresses, ``StaticDeviceStore`` or the packed manager with fixed slots), and this module: the policy that
drives them over a trajectory, and a whole-step baseline. Cache keys: ``{s|m}_kv_{layer}`` (keys and values stacked,
[2, rows, heads, tokens, head_dim]) and ``{s|m}_x`` (final-layer outputs, [rows, tokens, patch features]).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import List, Optional

import torch

from opensora.models.mmdit.flops import linear_flops, mmdit_forward_flops
from opensora.models.mmdit.layers import modulate
from opensora.models.mmdit.patches import patchify

from .plan import (
    ACTIVE,
    FULL,
    MEDIUM,
    REFRESH,
    JanoConfig,
    RegionPlan,
    entry_shapes,
    medium_read_later,
    region_classes,
    step_levels,
)
from .region_forward import RegionForward
from .region_graphs import RegionGraphs
from .stores import make_store


def region_forward_flops(
    model,
    num_video_tokens: int,
    num_text_tokens: int,
    rows: int,
    computed_video_tokens: Optional[int] = None,
    with_cond: Optional[bool] = None,
) -> int:
    """Matmul FLOPs of one forward of ``rows`` rows computing ``computed_video_tokens`` of ``num_video_tokens``
    (queries) against all keys; equals ``mmdit_forward_flops(...)["total"]`` when every token is computed."""
    k = num_video_tokens if computed_video_tokens is None else computed_video_tokens
    flops = mmdit_forward_flops(model, k, num_text_tokens, rows, with_cond)["total"]
    arch = model.arch if hasattr(model, "arch") else model
    layers = arch["depth_double"] + arch["depth_single"]
    # the attention above used L + K keys; the cached keys add (N - K) to each query's row
    return flops + layers * 4 * rows * (num_text_tokens + k) * (num_video_tokens - k) * arch["hidden_size"]


@dataclass
class AccelStats:
    levels: List[int] = field(default_factory=list)
    flops: int = 0
    full_flops: int = 0  # what full compute of the same calls costs
    computed_tokens: List[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["flops_ratio"] = self.full_flops / self.flops if self.flops else None
        return out


class _Accelerator:
    """The sampler-side interface: ``begin(num_steps)`` before a trajectory, then one call per model evaluation
    with the model's arguments (``VideoSampler.accelerator``)."""

    def __init__(self):
        self.num_steps = 0
        self.step = 0
        self.stats = AccelStats()

    def begin(self, num_steps: int, batch: Optional[int] = None) -> None:
        """Before a trajectory of ``num_steps`` model calls on ``batch`` samples (the rows of a call are the guidance
        branches of those samples, branch-major, as ``opensora.diffusion.sampling`` batches them)."""
        self.num_steps, self.step, self.batch = int(num_steps), 0, batch

    def reset_stats(self) -> None:
        self.stats = AccelStats()

    def _count(self, model, x, text_emb, cond, level, computed=None):
        n = x.shape[2] * x.shape[3] * x.shape[4] // (model.patch_size[0] * model.patch_size[1] * model.patch_size[2])
        with_cond = cond is not None
        full = region_forward_flops(model, n, text_emb.shape[1], x.shape[0], None, with_cond)
        self.stats.full_flops += full
        self.stats.levels.append(level)
        self.stats.computed_tokens.append(n if computed is None else computed)
        return n, full


class FullCompute(_Accelerator):
    """No caching: the model's forward, with FLOPs counted (the reference row of the benchmarks)."""

    def __call__(self, model, x, timestep, text_emb, text_mask=None, pooled=None, cond=None, **kwargs):
        _, full = self._count(model, x, text_emb, cond, FULL)
        self.stats.flops += full
        self.step += 1
        return model(x, timestep=timestep, text_emb=text_emb, text_mask=text_mask, pooled=pooled, cond=cond, **kwargs)


class JanoCache(_Accelerator):
    """Region-aware caching over one sampling trajectory (see the module docstring).

    Args:
        config: ``JanoConfig`` (or a dict of its fields). store: a cache store (stores.py); by default the one
        ``config.store`` names, made for the model's device at the first call. graphs: with ``config.graphs``, the
        class that wraps the ``RegionForward`` (default ``region_graphs.RegionGraphs``).
    """

    def __init__(self, config=None, store=None, graphs=None):
        super().__init__()
        self.config = config if isinstance(config, JanoConfig) else JanoConfig(**(config or {}))
        self.store = store
        self.graphs_class = graphs  # with config.graphs: the class that replays the levels (tests pass a fake)
        self.levels: List[int] = []
        self.forced_levels: Optional[List[int]] = None  # benchmarks: a fixed schedule
        self.forced_classes: Optional[torch.Tensor] = None  # benchmarks: fixed regions [R, N]
        self._forward = None
        self.region_counts: Optional[dict] = None  # per-row token counts of each class, after the analysis
        self._reset_trajectory()

    def _reset_trajectory(self):
        self.plan: Optional[RegionPlan] = None
        self._previous = None
        self._score = None

    def begin(self, num_steps: int, batch: Optional[int] = None) -> None:
        super().begin(num_steps, batch)
        self.levels = (
            list(self.forced_levels) if self.forced_levels is not None else step_levels(num_steps, self.config)
        )
        self._reset_trajectory()
        if self.store is not None:
            self.store.clear()

    def __call__(
        self,
        model,
        x,
        timestep,
        text_emb,
        text_mask=None,
        pooled=None,
        cond=None,
        guidance=None,
        text_mask_has_padding=None,
    ):
        if self._forward is None or self._forward.model is not model:
            self._forward = RegionForward(model)
            if self.config.graphs:
                self._forward = (self.graphs_class or RegionGraphs)(self._forward)
        if self.store is None:
            self.store = make_store(self.config.store, x.device, graphs=self.config.graphs)
        grid = tuple(s // p for s, p in zip(x.shape[2:], model.patch_size))
        if self._level(self.step) != FULL and self.plan is None:
            self.plan = self._make_plan(model, x, cond, grid)
        level = self._level(self.step)
        if level in (ACTIVE, MEDIUM):  # a no-op for the entries the previous step already queued
            self.store.begin_fetch_step(self.plan.entry_keys(self._forward.num_layers, level))
        n, full = self._count(model, x, text_emb, cond, level, None if self.plan is None else self.plan.computed(level))
        out = self._forward(
            level,
            x,
            timestep,
            text_emb,
            text_mask,
            pooled,
            cond,
            guidance,
            text_mask_has_padding,
            plan=self.plan,
            store=self.store,
            store_medium=level != MEDIUM or medium_read_later(self._level, self.step, len(self.levels)),
        )
        self.stats.flops += (
            full
            if level in (FULL, REFRESH)
            else region_forward_flops(
                model, n, text_emb.shape[1], x.shape[0], self.plan.computed(level), cond is not None
            )
        )
        if self.plan is None and self.forced_classes is None and self.step < self.config.warmup_steps:
            self._observe(out, model.patch_size)
        self.step += 1
        following = self._level(self.step) if self.plan is not None else FULL
        if following in (ACTIVE, MEDIUM):
            # Queue the next step's prefetches now: the first ring slots fill while this step's tail still computes
            # (this step's stores were queued before them, and each key's prefetch waits for its store).
            self.store.begin_fetch_step(self.plan.entry_keys(self._forward.num_layers, following))
            if self.store.wants_hints:  # the steps after the queued one
                self.store.hint_upcoming(self._keys_after(self.step))
        return out

    def _keys_after(self, step: int, steps: int = 2) -> List[str]:
        """Entries the cached steps after ``step`` read (up to ``steps`` of them, stopping at a refresh), in order."""
        keys = []
        for j in range(step + 1, len(self.levels)):
            level = self._level(j)
            if level == REFRESH or steps == 0:
                break
            if level in (ACTIVE, MEDIUM):
                keys += self.plan.entry_keys(self._forward.num_layers, level)
                steps -= 1
        return keys

    def _level(self, step: int) -> int:
        """The level step ``step`` runs at: the schedule's, or 3 when a cached level would compute every token."""
        level = self.levels[step] if step < len(self.levels) else FULL
        if level in (ACTIVE, MEDIUM) and self.plan is not None and self.plan.computed(level) == self.plan.num_tokens:
            return REFRESH  # nothing to skip: compute everything, keep the caches fresh
        return level

    def _observe(self, out: torch.Tensor, patch_size) -> None:
        """Accumulate the per-token output change of the last ``analysis_steps`` warm-up steps."""
        tokens = patchify(out.float(), patch_size)
        if self._previous is not None and self.step >= self.config.warmup_steps - self.config.analysis_steps:
            change = (tokens - self._previous).abs().mean(-1)
            self._score = change if self._score is None else self._score + change
        self._previous = tokens

    def _make_plan(self, model, x, cond, grid) -> RegionPlan:
        score = None
        if self.forced_classes is not None:
            classes = self.forced_classes.to(x.device)
        else:
            if self._score is None:
                raise RuntimeError("the region analysis needs at least two full warm-up steps before a cached step")
            score, fixed = self._score, None
            if cond is not None:  # channel 0 of the condition input is the frame mask
                fixed = patchify(cond[:, :1].float(), model.patch_size).amax(-1) > 0
            rows, branches = score.shape[0], self._branches(score.shape[0])
            if branches > 1:  # one region set per sample: the mean of its branches' normalised scores
                score = score / score.amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
                score = score.view(branches, rows // branches, -1).mean(0)
                fixed = None if fixed is None else fixed.view(branches, rows // branches, -1).any(0)
            classes = region_classes(score, grid, self.config, fixed)
            if branches > 1:
                classes, score = classes.repeat(branches, 1), score.repeat(branches, 1)
        self.region_counts = {
            name: (classes == c).sum(1).tolist() for name, c in (("static", 1), ("medium", 2), ("active", 3))
        }
        self._previous = self._score = None
        plan = RegionPlan.from_classes(classes, score, self.config.batch_quantile)
        self._reserve(model, x, plan)
        return plan

    def _branches(self, rows: int) -> int:
        """Guidance branches sharing one region set per sample (1: every row its own, see ``share_branches``)."""
        if not self.config.share_branches or not self.batch or rows % self.batch:
            return 1
        return rows // self.batch

    def _reserve(self, model, x, plan: RegionPlan) -> None:
        """Announce every entry to the store (the offload manager allocates its pinned buffers here, once)."""
        dtype = model.img_in.weight.dtype
        for key, shape in entry_shapes(model, x.shape[0], plan, self._forward.num_layers).items():
            self.store.reserve(key, shape, dtype)
        self.store.allocate()


class StepCache(_Accelerator):
    """TeaCache-style baseline: reuse the whole previous output while the accumulated relative L1 change of the
    first block's timestep-modulated video input stays below ``threshold`` (one decision for the whole batch;
    TeaCache's fitted polynomial rescaling is left out). The first ``warmup_steps`` and last ``cooldown_steps``
    always compute."""

    def __init__(self, threshold: float = 0.1, warmup_steps: int = 1, cooldown_steps: int = 1):
        super().__init__()
        self.threshold, self.warmup_steps, self.cooldown_steps = threshold, warmup_steps, cooldown_steps
        self._reset_trajectory()

    def _reset_trajectory(self):
        self._previous_input = self._previous_output = None
        self._accumulated = 0.0

    def begin(self, num_steps: int, batch: Optional[int] = None) -> None:
        super().begin(num_steps, batch)
        self._reset_trajectory()

    def __call__(
        self,
        model,
        x,
        timestep,
        text_emb,
        text_mask=None,
        pooled=None,
        cond=None,
        guidance=None,
        text_mask_has_padding=None,
    ):
        img = model.embed_patches(*model.patch_inputs(x, cond)[:2])
        vec = model.conditioning_vector(timestep, pooled, guidance)
        shift, scale = model.double_blocks[0].img_mod(vec)[:2]
        modulated = modulate(img, shift, scale)
        forced = self.step < self.warmup_steps or self.step >= self.num_steps - self.cooldown_steps
        reuse = False
        if not forced and self._previous_input is not None and self._previous_output is not None:
            previous = self._previous_input.float()
            change = ((modulated.float() - previous).abs().mean() / previous.abs().mean().clamp_min(1e-12)).item()
            self._accumulated += change
            reuse = self._accumulated < self.threshold
        self._previous_input = modulated
        n, full = self._count(model, x, text_emb, cond, -1 if reuse else FULL, 0 if reuse else None)
        h = model.hidden_size
        check = linear_flops(x.shape[0] * n, model.img_in.in_features, h) + linear_flops(x.shape[0], h, 6 * h)
        if cond is not None:
            check += linear_flops(x.shape[0] * n, model.cond_in.in_features, h)
        if reuse:
            self.stats.flops += check
            out = self._previous_output
        else:
            self._accumulated = 0.0
            self.stats.flops += full + linear_flops(x.shape[0], h, 6 * h)
            out = model(
                x,
                timestep=timestep,
                text_emb=text_emb,
                text_mask=text_mask,
                pooled=pooled,
                cond=cond,
                guidance=guidance,
                text_mask_has_padding=text_mask_has_padding,
            )
            self._previous_output = out
        self.step += 1
        return out
