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

The region-cached forward (``RegionForward``) drives the MMDiT's own submodules with a token subset (RoPE rows
gathered per row) and the blocks' ``kv_hook`` seam; the model has no branch for it. Cache entries go through a
store (stores.py): on the device, the dual-stream ``PackedOffloadManager`` (``--jano-offload``), or a naive synchronous
offload. Keys follow
the spec: ``{s|m}_kv_{layer}`` (keys and values stacked, [2, rows, heads, tokens, head_dim]) and ``{s|m}_x``
(final-layer outputs, [rows, tokens, patch features]). ``--jano-graphs`` (``JanoConfig.graphs``) replays every level
as CUDA graphs (region_graphs.py) against stores at fixed addresses (``StaticDeviceStore``, or the packed manager with
fixed slots); off, the eager forward below runs as before.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from opensora.models.mmdit.attention import device_major
from opensora.models.mmdit.flops import linear_flops, mmdit_forward_flops
from opensora.models.mmdit.layers import modulate
from opensora.models.mmdit.model import patchify, unpatchify

from .stores import make_store

FULL, ACTIVE, MEDIUM, REFRESH = 0, 1, 2, 3  # step levels
STATIC_CLASS, MEDIUM_CLASS, ACTIVE_CLASS = 1, 2, 3  # token classes


@dataclass
class JanoConfig:
    """Settings of the region cache (config key ``jano``; flags ``--jano``, ``--jano-offload``)."""

    warmup_steps: int = 6  # full steps before the region analysis (Jano: 6 of 50)
    cooldown_steps: int = 2  # full steps at the end
    refresh_interval: int = 5  # a level-3 refresh every this many cached steps
    medium_interval: int = 2  # a level-2 step every this many cached steps between refreshes
    static_threshold: float = 0.2
    medium_threshold: float = 0.6
    analysis_steps: int = 3  # warm-up output changes averaged into the score
    dilation: int = 1  # grow dynamic regions by this many tokens in (h, w)
    batch_quantile: float = 1.0  # token counts over rows: 1 = the largest (exact superset); see RegionPlan
    share_branches: bool = True  # the guidance branches of a sample share its regions (Jano: one mask)
    store: str = "device"  # device | offload (PackedOffloadManager) | offload_slots | offload_static | naive
    graphs: bool = False  # replay each level's region forward as CUDA graphs (region_graphs.py; --jano-graphs)

    def __post_init__(self):
        if self.warmup_steps < 2:
            raise ValueError(
                f"jano warmup_steps must be >= 2 (the analysis needs two outputs), got {self.warmup_steps}"
            )
        if self.refresh_interval < 1 or self.medium_interval < 1:
            raise ValueError("jano refresh_interval and medium_interval must be >= 1")
        if not 0 < self.batch_quantile <= 1:
            raise ValueError(f"jano batch_quantile must lie in (0, 1], got {self.batch_quantile}")
        if not 0 <= self.static_threshold <= self.medium_threshold <= 1:
            raise ValueError(
                f"jano thresholds must satisfy 0 <= static ({self.static_threshold}) <= medium "
                f"({self.medium_threshold}) <= 1"
            )


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


def _gather_tokens(tokens: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[R, N, F] rows picked by ``index`` [R, K] -> [R, K, F]."""
    return torch.gather(tokens, 1, index[..., None].expand(-1, -1, tokens.shape[-1]))


def _gather_heads(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[R, H, L, D] positions ``index`` [R, K] (of dim 2) -> [R, H, K, D]."""
    r, h, _, d = t.shape
    return torch.gather(t, 2, index[:, None, :, None].expand(r, h, index.shape[1], d))


class RegionForward:
    """The MMDiT's forward at a step level, computing only a token subset below level 3 (see the module docstring).

    Levels 0 and 3 compute every token in the model's own order; level 3 also stores the medium/static keys,
    values and outputs. Levels 1/2 compute ``plan.order[:, :K]`` and fill in the rest from ``store``.
    """

    def __init__(self, model):
        if getattr(model, "sp", None) is not None:
            raise ValueError("region caching cannot be combined with sequence parallelism")
        if getattr(model, "compile_blocks", False):
            raise ValueError(
                "region caching runs Python cache hooks inside every block; build the model with "
                "compile_blocks=False (or call model.set_compile_blocks(False))"
            )
        self.model = model
        self.num_layers = len(model.double_blocks) + len(model.single_blocks)

    def __call__(
        self,
        level,
        x,
        timestep,
        text_emb,
        text_mask=None,
        pooled=None,
        cond=None,
        guidance=None,
        text_mask_has_padding=None,
        plan: Optional[RegionPlan] = None,
        store=None,
        store_medium: bool = True,
    ) -> torch.Tensor:
        """``store_medium=False``: a level-2 step does not store its medium entries (the caller knows no step reads
        them before they are overwritten, so they need not cross the bus)."""
        state = self.prepare(
            level, x, timestep, text_emb, text_mask, pooled, cond, guidance, text_mask_has_padding, plan, store
        )
        hooks = self.hooks(level, plan, store, state["n_txt"], store_medium)
        self.run_layers(state, 0, self.num_layers, hooks)
        return self.finish(state, level, plan, store, store_medium)

    def prepare(
        self, level, x, timestep, text_emb, text_mask, pooled, cond, guidance, text_mask_has_padding, plan, store
    ) -> dict:
        """The work before the first block: checks, embeddings, RoPE rows and (below level 3) the token subset.
        Returns the forward's state (``run_layers`` and ``finish`` carry it on; ``region_graphs`` cuts it there)."""
        m = self.model
        if x.dim() != 5 or x.shape[1] != m.in_channels:
            raise ValueError(f"x must be [B, {m.in_channels}, T, H, W], got {tuple(x.shape)}")
        if cond is not None and m.cond_in is None:
            raise ValueError("cond was given but this MMDiT was built with cond_channels=None")
        full = level in (FULL, REFRESH)
        if not full or level == REFRESH:
            if plan is None or store is None:
                raise ValueError(f"step level {level} needs a region plan and a cache store")
        b, _, t, h, w = x.shape
        pt, ph, pw = m.patch_size
        grid = (t // pt, h // ph, w // pw)
        patches = patchify(x, m.patch_size)
        cond_patches = None if cond is None else patchify(cond, m.patch_size)
        txt = m.txt_in(text_emb)
        vec = m.conditioning_vector(timestep, pooled, guidance)
        n, n_txt = patches.shape[1], txt.shape[1]
        rope = m.rope(grid, n_txt, x.device)
        mask = m.key_mask(text_mask, n, text_mask_has_padding)  # [B, 1, 1, L + N]: valid for the extended keys
        if x.is_cuda:
            device_major(x.device)

        index = None
        if not full:
            index = plan.order[:, : plan.computed(level)]
            patches = _gather_tokens(patches, index)
            cond_patches = None if cond_patches is None else _gather_tokens(cond_patches, index)
            rope = tuple(
                torch.cat((table[:n_txt].expand(b, -1, -1), table[n_txt:][index]), 1)[:, None] for table in rope
            )
        img = m.img_in(patches)
        if cond_patches is not None:
            img = img + m.cond_in(cond_patches)
        return dict(img=img, txt=txt, vec=vec, rope=rope, mask=mask, grid=grid, n_txt=n_txt)

    def hooks(self, level, plan, store, n_txt: int, store_medium: bool = True) -> list:
        """The ``kv_hook`` of every layer (double blocks first) at ``level``."""
        if level == FULL:
            return [None] * self.num_layers
        return [self._kv_hook(level, plan, store, layer, n_txt, store_medium) for layer in range(self.num_layers)]

    def run_layers(self, state: dict, lo: int, hi: int, hooks) -> None:
        """Layers ``lo`` to ``hi - 1`` (double blocks, then single blocks) on ``state``, in place."""
        m = self.model
        depth_double = len(m.double_blocks)
        vec, rope, mask = state["vec"], state["rope"], state["mask"]
        for i in range(lo, hi):
            if i < depth_double:
                state["img"], state["txt"] = m.double_blocks[i](
                    state["img"], state["txt"], vec, rope, mask, kv_hook=hooks[i]
                )
                continue
            if "tokens" not in state:
                state["tokens"] = torch.cat((state.pop("txt"), state.pop("img")), dim=1)
            state["tokens"] = m.single_blocks[i - depth_double](state["tokens"], vec, rope, mask, kv_hook=hooks[i])

    def finish(self, state: dict, level, plan, store, store_medium: bool = True) -> torch.Tensor:
        """The final layer on ``state`` (after every block), the cached outputs, and the video layout."""
        m = self.model
        if "tokens" not in state:
            state["tokens"] = torch.cat((state.pop("txt"), state.pop("img")), dim=1)
        out = m.final_layer(state["tokens"][:, state["n_txt"] :], state["vec"])
        if level != FULL:
            out = self._outputs(level, plan, store, out, store_medium)
            store.flush()  # a store that batches its copies issues this step's last ones now
        return unpatchify(out, state["grid"], m.patch_size)

    @staticmethod
    def _kv_hook(level, plan: RegionPlan, store, layer: int, n_txt: int, store_medium: bool = True):
        k1, k2, n = plan.k_active, plan.k_medium, plan.num_tokens
        m_key, s_key = f"m_kv_{layer}", f"s_kv_{layer}"

        def hook(k, v, mask):
            if level == REFRESH:
                if k1 < k2:
                    pos = n_txt + plan.order[:, k1:k2]
                    store.store_async(torch.stack((_gather_heads(k, pos), _gather_heads(v, pos))), m_key)
                if k2 < n:
                    pos = n_txt + plan.order[:, k2:]
                    store.store_async(torch.stack((_gather_heads(k, pos), _gather_heads(v, pos))), s_key)
                return k, v, mask
            if level == MEDIUM and k1 < k2 and store_medium:  # the medium tokens were computed: refresh their cache
                store.store_async(
                    torch.stack((k[:, :, n_txt + k1 : n_txt + k2], v[:, :, n_txt + k1 : n_txt + k2])), m_key
                )
            keys = plan.reads(level, f"kv_{layer}")
            cached = [store.fetch(key) for key in keys]
            k = torch.cat([k] + [entry[0] for entry in cached], dim=2)
            v = torch.cat([v] + [entry[1] for entry in cached], dim=2)
            for key in keys:
                store.release(key)
            return k, v, mask

        return hook

    @staticmethod
    def _outputs(level, plan: RegionPlan, store, out: torch.Tensor, store_medium: bool = True) -> torch.Tensor:
        """Store (level 3) or complete (levels 1/2) the final-layer outputs; returns [R, N, F] in token order."""
        k1, k2, n = plan.k_active, plan.k_medium, plan.num_tokens
        if level == REFRESH:
            if k1 < k2:
                store.store_async(_gather_tokens(out, plan.order[:, k1:k2]), "m_x")
            if k2 < n:
                store.store_async(_gather_tokens(out, plan.order[:, k2:]), "s_x")
            return out
        if level == MEDIUM and k1 < k2 and store_medium:
            store.store_async(out[:, k1:k2].contiguous(), "m_x")
        keys = plan.reads(level, "x")
        permuted = torch.cat([out] + [store.fetch(key) for key in keys], dim=1)
        for key in keys:
            store.release(key)
        return torch.empty_like(permuted).scatter_(1, plan.order[..., None].expand_as(permuted), permuted)


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
                from .region_graphs import RegionGraphs

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
            if getattr(self.store, "wants_hints", False):  # the steps after the queued one
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
        img = model.img_in(patchify(x, model.patch_size))
        if cond is not None:
            img = img + model.cond_in(patchify(cond, model.patch_size))
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
