"""Roles: the networks a method trains or queries, each with its own optimizer, scheduler, booster and EMA.

A config declares ``models = dict(student=dict(model=..., trainable=True, optimizer=..., ...), teacher=...)``.
Trainable roles get their own plugin instance and booster; frozen roles are cast, set to eval,
``requires_grad_(False)`` and never boosted. Methods reach roles by name; the trainer only iterates over them.
"""

import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

import torch
import torch.nn as nn

from opensora.dtypes import resolve_dtype
from opensora.registry import MODELS, build_module
from opensora.training.booster import PLUGIN_REGISTRY, build_booster
from opensora.training.ema import EMA



@dataclass
class Components:
    """Frozen helpers shared by every role: autoencoder, text conditioner, device and compute dtype."""

    vae: Optional[nn.Module]
    text_encoder: Optional[nn.Module]
    device: torch.device
    dtype: torch.dtype
    null_text: Optional[Dict[str, torch.Tensor]] = None  # encode([""]), computed once at start-up
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Role:
    name: str
    model: nn.Module  # the boosted wrapper when trainable
    trainable: bool
    optimizer: Any = None
    lr_scheduler: Any = None
    booster: Any = None
    ema: Optional[EMA] = None
    max_grad_norm: Optional[float] = None
    plugin_clips: bool = False  # ZeRO/Hybrid/Gemini plugins clip inside optimizer.step()

    def unwrap(self) -> nn.Module:
        return self.model.unwrap() if hasattr(self.model, "unwrap") else self.model

    def wait_for_params(self) -> None:
        """Block until this rank's parameters hold the last step's values. With LowLevelZero's
        ``overlap_allgather`` the updated shards are gathered asynchronously and waited for by the next forward;
        readers outside a forward (the EMA) must wait first."""
        wait = getattr(self.model, "_force_wait_all_gather", None)
        if wait is not None:
            wait()

    def clip_and_step(self) -> Optional[float]:
        """Clip gradients to ``max_grad_norm`` and step; returns the pre-clip global grad norm."""
        if self.plugin_clips:
            self.optimizer.step()
            norm = self.optimizer.get_grad_norm()
        else:
            max_norm = self.max_grad_norm if self.max_grad_norm is not None else float("inf")
            norm = self.optimizer.clip_grad_by_norm(max_norm)
            self.optimizer.step()
        return None if norm is None else float(norm)


def warmup_lambda(warmup_steps: int):
    """constant_with_warmup: linear ramp over ``warmup_steps`` optimizer steps, the first step already > 0."""

    def factor(step: int) -> float:
        return 1.0 if warmup_steps <= 0 else min(1.0, (step + 1) / warmup_steps)

    return factor


def build_optimizer(params, cfg: Mapping) -> torch.optim.Optimizer:
    cfg = dict(cfg)
    kind = cfg.pop("type", "AdamW")
    defaults = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-15, weight_decay=0.01)
    defaults.update(cfg)
    defaults["betas"] = tuple(defaults["betas"])
    if kind == "AdamW":
        return torch.optim.AdamW(params, **defaults)
    if kind == "HybridAdam":  # colossalai's fused CPU/GPU Adam (JIT-compiles kernels on first use)
        from colossalai.nn.optimizer import HybridAdam

        return HybridAdam(params, adamw_mode=True, **defaults)
    raise ValueError(f"unknown optimizer type '{kind}' (expected 'AdamW' or 'HybridAdam')")


def _plugin_takes_max_norm(plugin_cfg: Mapping) -> bool:
    spec = PLUGIN_REGISTRY.get(plugin_cfg.get("type"))
    return spec is not None and "max_norm" in inspect.signature(spec.cls.__init__).parameters


def load_initial_weights(model: nn.Module, init_from) -> None:
    """``init_from``: a checkpoint directory / safetensors path, or ``dict(path=..., role="model", ema=True)``.

    Distillation starts student, critic and teacher from a trained model this way; loading is strict, so an
    architecture mismatch fails here with the offending keys, not later as a silent partial load.
    """
    from opensora.convert.weights import check_shapes_fit, load_role_weights

    spec = dict(init_from) if isinstance(init_from, Mapping) else {"path": init_from}
    weights = load_role_weights(spec.pop("path"), **spec)
    check_shapes_fit({k: v.shape for k, v in weights.state_dict.items()}, model, f"init_from {weights.path}")
    model.load_state_dict(weights.state_dict, strict=True)


def build_role(name: str, cfg: Mapping, components: Components, plugin_cfg: Mapping, is_main: bool) -> Role:
    """Build one role from its config; boost it when trainable."""
    cfg = dict(cfg)
    model = build_module(cfg["model"], MODELS)
    if cfg.get("init_from"):
        load_initial_weights(model, cfg["init_from"])
    trainable = bool(cfg.get("trainable", True))
    precision = cfg.get("precision", "bf16")
    if not trainable:
        model = model.to(components.device, resolve_dtype(precision)).eval().requires_grad_(False)
        return Role(name=name, model=model, trainable=False)

    model = model.to(components.device)
    max_norm = cfg.get("grad_clip")
    plugin_cfg = dict(plugin_cfg)
    plugin_clips = _plugin_takes_max_norm(plugin_cfg)
    if plugin_clips and max_norm is not None:
        plugin_cfg.setdefault("max_norm", max_norm)
    ema = None
    ema_cfg = cfg.get("ema")
    if ema_cfg is not None and is_main:
        # built from the fp32 weights before the booster casts them; warmup unless the config turns it off
        ema = EMA(model, **{"warmup": True, **dict(ema_cfg)})
    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], cfg.get("optimizer", {}))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_lambda(int(cfg.get("warmup_steps", 0))))
    booster = build_booster(plugin_cfg, mixed_precision=precision)
    model, optimizer, _, _, scheduler = booster.boost(model, optimizer, lr_scheduler=scheduler)
    return Role(
        name=name,
        model=model,
        trainable=True,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        booster=booster,
        ema=ema,
        max_grad_norm=max_norm,
        plugin_clips=plugin_clips,
    )
