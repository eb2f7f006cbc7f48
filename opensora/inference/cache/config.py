"""``JanoConfig``: the region cache's settings, the one owner of their defaults (the CLI's ``--jano-settings`` and
``inference.options.CacheOptions`` take them from here). Plain data, no torch: ``--help`` lists them without loading
anything heavy."""

from dataclasses import dataclass, fields

STORE_KINDS = ("device", "offload")  # stores.make_store: on the device | PackedOffloadManager (--jano-offload)


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
    store: str = "device"  # device | offload (PackedOffloadManager; --jano-offload)
    graphs: bool = False  # replay each level's region forward as CUDA graphs (region_graphs.py; --jano-graphs)

    def __post_init__(self):
        if self.store not in STORE_KINDS:
            raise ValueError(f"jano store must be one of {STORE_KINDS}, got {self.store!r}")
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


def tunable_defaults() -> dict:
    """The settings a user tunes (``--jano-settings.KEY``) with their defaults; ``store`` and ``graphs`` have flags
    of their own (``--jano-offload``, ``--jano-graphs``)."""
    return {f.name: f.default for f in fields(JanoConfig) if f.name not in ("store", "graphs")}
