"""Build roles (``opensora.roles.Role``): each trainable network gets its own optimizer, scheduler, booster and EMA.

``role_configs`` (``opensora.role_config``) gives each role's config with every key set. Trainable roles get their own plugin instance and booster; frozen roles are cast, set to eval,
``requires_grad_(False)`` and never boosted. A role with ``lora`` gets peft LoRA layers on top of its ``init_from``
weights before boosting (``opensora.lora``): the base is frozen, and the optimizer and the EMA see only the adapter. Methods reach roles by name; the trainer only iterates over them.
"""

import contextlib
import inspect
import logging
from typing import Mapping

import torch
import torch.nn as nn

from opensora.dtypes import resolve_dtype
from opensora.lr_schedule import lr_lambda, warmup_lambda  # noqa: F401  (warmup_lambda: tests import it here)
from opensora.registry import MODELS, build_module
from opensora.role_config import optimizer_settings
from opensora.roles import Components, Role
from opensora.training.booster import PLUGIN_REGISTRY, build_booster
from opensora.training.distributed import get_rank, get_world_size
from opensora.training.ema import EMA


def build_optimizer(params, cfg: Mapping) -> torch.optim.Optimizer:
    """The optimizer a role's ``optimizer`` config names; unset settings from ``ROLE_DEFAULTS``."""
    settings = optimizer_settings(cfg)
    kind = settings.pop("type")
    settings["betas"] = tuple(settings["betas"])
    if kind == "AdamW":
        # groups' params as lists: the device check below must not use up a generator AdamW reads afterwards
        params = [dict(p, params=list(p["params"])) if isinstance(p, Mapping) else p for p in params]
        if settings.get("fused") is None and settings.get("foreach") is None:
            # one kernel over all tensors instead of ~7 multi-tensor passes: 28 instead of 72 B per fp32 parameter
            # (~29 ms of a 1B step on an H100). CUDA only, so CPU runs keep the foreach update's exact bits.
            settings["fused"] = all(p.is_cuda for p in _tensors(params)) or None
        return torch.optim.AdamW(params, **settings)
    if kind == "HybridAdam":  # colossalai's fused CPU/GPU Adam (JIT-compiles kernels on first use)
        from colossalai.nn.optimizer import HybridAdam

        return HybridAdam(params, adamw_mode=True, **settings)
    raise ValueError(f"unknown optimizer type '{kind}' (expected 'AdamW' or 'HybridAdam')")


def _tensors(params):
    """The tensors of an optimizer's ``params``: tensors, or parameter groups (dicts with ``params``)."""
    for item in params:
        yield from (item["params"] if isinstance(item, Mapping) else [item])


def _plugin_takes_max_norm(plugin_cfg: Mapping) -> bool:
    spec = PLUGIN_REGISTRY.get(plugin_cfg.get("type"))
    return spec is not None and "max_norm" in inspect.signature(spec.cls.__init__).parameters


def load_initial_weights(model: nn.Module, init_from) -> dict:
    """``init_from``: a checkpoint directory / safetensors path, or ``dict(path=..., role="model", ema=True)``.

    Distillation starts student, critic and teacher from a trained model this way; loading is strict, so an
    architecture mismatch fails here with the offending keys, not later as a silent partial load.
    """
    from opensora.convert.weights import check_shapes_fit, load_role_weights

    spec = dict(init_from) if isinstance(init_from, Mapping) else {"path": init_from}
    spec_path = spec.pop("path")
    weights = load_role_weights(spec_path, **spec)
    check_shapes_fit({k: v.shape for k, v in weights.state_dict.items()}, model, f"init_from {weights.path}")
    model.load_state_dict(weights.state_dict, strict=True)
    logging.getLogger(__name__).info("init_from %s: loaded %s", spec_path, weights.path)
    return weights.state_dict


# plugins that shard the parameters themselves: the rank-0 EMA (whole parameters) cannot follow them
SHARDED_PARAMETER_PLUGINS = ("GeminiPlugin", "TorchFSDPPlugin")


def check_plugin_fits_role(name: str, cfg: Mapping, plugin_cfg: Mapping) -> None:
    """Refuse, before anything is built, role settings the plugin cannot train with: Gemini takes only
    ColossalAI's Adam optimizers (``HybridAdam`` here), and a parameter-sharding plugin leaves no whole weights for
    the rank-0 EMA to average."""
    kind = plugin_cfg.get("type")
    if not cfg["trainable"]:
        return
    optimizer = optimizer_settings(cfg["optimizer"])["type"]
    if kind == "GeminiPlugin" and optimizer != "HybridAdam":
        raise ValueError(
            f"role '{name}': GeminiPlugin needs optimizer type 'HybridAdam' (ColossalAI's Adam), got '{optimizer}'"
        )
    if kind in SHARDED_PARAMETER_PLUGINS and cfg["ema"] is not None:
        raise ValueError(
            f"role '{name}': {kind} shards the parameters, so the rank-0 EMA cannot average them; "
            "set ema_decay=None (or use LowLevelZeroPlugin / TorchDDPPlugin)"
        )


def sharded_ema_fits(plugin_cfg: Mapping) -> bool:
    """Whether the role's EMA is sharded over the ranks like ZeRO's masters (``ema_sharded``): LowLevelZero on
    several ranks with its masters on the device."""
    return plugin_cfg.get("type") == "LowLevelZeroPlugin" and get_world_size() > 1 and not plugin_cfg.get("cpu_offload")


def build_ema(ema_cfg: Mapping | None, model: nn.Module, plugin_cfg: Mapping, is_main: bool):
    """The role's EMA, built from the fp32 weights before the booster casts them (warmup unless the config turns it
    off): sharded over the ranks where ``sharded_ema_fits`` (``ema=dict(..., sharded=False)`` keeps it whole on rank
    0), else on rank 0 only; None without an EMA config."""
    if ema_cfg is None:
        return None
    settings = {"warmup": True, **dict(ema_cfg)}
    sharded = settings.pop("sharded", None)
    if sharded is None:
        sharded = sharded_ema_fits(plugin_cfg)
    elif sharded and not sharded_ema_fits(plugin_cfg):
        raise ValueError("ema sharded=True needs LowLevelZeroPlugin on several ranks without cpu_offload; drop the key")
    if sharded:
        from opensora.training.ema_sharded import ShardedEMA

        return ShardedEMA(model, get_rank(), get_world_size(), **settings)
    return EMA(model, **settings) if is_main else None


def build_role(
    name: str, cfg: Mapping, components: Components, plugin_cfg: Mapping, is_main: bool, max_steps: int | None = None
) -> Role:
    """Build one role from its resolved config (``role_configs``); boost it when trainable. ``max_steps``: the
    run's, the horizon of an ``lr_decay`` that gives no ``total_steps``."""
    check_plugin_fits_role(name, cfg, plugin_cfg)
    # on a GPU the weights are created there: initialising an 11B model on the CPU takes minutes
    on_gpu = components.device.type == "cuda"
    with torch.device(components.device) if on_gpu else contextlib.nullcontext():
        model = build_module(cfg["model"], MODELS)
    base = load_initial_weights(model, cfg["init_from"]) if cfg["init_from"] else None
    lora = None
    if cfg.get("lora") is not None:
        from opensora.lora import add_lora, base_fingerprint, lora_record

        lora = lora_record(cfg["lora"], _absolute_init_from(cfg["init_from"]), base_fingerprint(base))
        model = add_lora(model, cfg["lora"], where=f"models.{name}.lora")
    trainable = bool(cfg["trainable"])
    precision = cfg["precision"]
    if not trainable:
        model = model.to(components.device, resolve_dtype(precision)).eval().requires_grad_(False)
        return Role(name=name, model=model, trainable=False)

    model = model.to(components.device)
    grad_clip = cfg["grad_clip"]
    plugin_cfg = dict(plugin_cfg)
    plugin_clips = _plugin_takes_max_norm(plugin_cfg)
    if plugin_clips and grad_clip is not None:
        plugin_cfg.setdefault("max_norm", grad_clip)  # colossalai's name for it
    ema = build_ema(cfg["ema"], model, plugin_cfg, is_main)
    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], cfg["optimizer"])
    factor = lr_lambda(int(cfg["warmup_steps"]), cfg.get("lr_decay"), max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
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
        grad_clip=grad_clip,
        plugin_clips=plugin_clips,
        lora=lora,
    )


def _absolute_init_from(init_from):
    """``init_from`` with an absolute path, so an export from another directory finds the base weights (a run
    directory as the checkpoint it stood for: the run may train on and move its newest checkpoint)."""
    from opensora.checkpoint_layout import newest_checkpoint_of

    spec = dict(init_from) if isinstance(init_from, Mapping) else {"path": init_from}
    spec["path"] = str(newest_checkpoint_of(spec["path"]).resolve())
    return spec
