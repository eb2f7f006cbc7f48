"""The one config dialect for networks and their optimisation: roles.

A config lists its networks under ``models``, one entry per role::

    models = dict(
        student=dict(model=dict(type="MMDiT", ...), optimizer=dict(lr=5e-5), warmup_steps=5, grad_clip=1.0,
                     ema=dict(decay=0.95), init_from=dict(path=..., role="model", ema=True)),
        teacher=dict(model=..., trainable=False, precision="bf16", init_from=...),
    )

Plain training may use Open-Sora's top-level keys instead (``model``, ``lr``, ``optimizer``, ``warmup_steps``,
``grad_clip``, ``ema_decay``, ``ema_start_step``, ``ema_warmup``, ``init_from``, ``lora``, ``lr_decay``): a shorthand for the single trainable role
``model``, expanded by ``role_configs`` and nowhere else. A key that would be ignored is an error that names it:
a shorthand key next to ``models`` (set it to None in a config that inherits it), ``lr`` given twice (top level and
``optimizer.lr``), or an unknown key inside a role. Unset keys take ``ROLE_DEFAULTS``.
"""

import copy
import difflib
from typing import Any, Dict, Mapping

from opensora.config_values import ConfigKeyError, ConfigValueError
from opensora.lr_schedule import lr_decay_settings

ROLE_DEFAULTS = dict(
    trainable=True,
    precision="bf16",  # a frozen role is cast to it; a trainable one trains in it (the booster's mixed precision)
    optimizer=dict(type="AdamW", lr=1e-4, betas=(0.9, 0.95), eps=1e-15, weight_decay=0.01),
    warmup_steps=0,  # constant_with_warmup, counted in this role's optimizer steps
    lr_decay=None,  # dict(type="cosine" | "linear", fraction=..., min_factor=0.0): opensora.lr_schedule
    grad_clip=None,  # max global grad norm; None: no clipping
    # dict(decay=..., start_step=0, warmup=True, sharded=None): an EMA of the weights, on rank 0, or sharded over
    # several LowLevelZero ranks (sharded=None: where that fits)
    ema=None,
    init_from=None,  # a checkpoint / safetensors path, or dict(path=..., role="model", ema=True)
    lora=None,  # dict(rank=8, alpha=8, target_modules=["qkv", ...], dropout=0.0): train a LoRA adapter only
)
ROLE_KEYS = ("model", *ROLE_DEFAULTS)
# ``init_from = dict(...)`` keys (a plain path string means dict(path=...)): ``opensora.convert.weights.load_role_weights``
INIT_FROM_DEFAULTS = dict(path=None, role="model", ema=True)

# Open-Sora's top-level keys: plain training's shorthand for the single role ``model``
SHORTHAND_KEYS = (
    "model",
    "lr",
    "optimizer",
    "warmup_steps",
    "grad_clip",
    "ema_decay",
    "ema_start_step",
    "ema_warmup",
    "init_from",
    "lora",
    "lr_decay",
)


def _check_role_keys(name: str, role: Mapping) -> None:
    for key in role:
        if key not in ROLE_KEYS:
            near = difflib.get_close_matches(key, ROLE_KEYS, n=1)
            hint = f"; did you mean '{near[0]}'" if near else ""
            raise ConfigKeyError(f"unknown key 'models.{name}.{key}'{hint} (role keys: {list(ROLE_KEYS)})")
    if "model" not in role:
        raise ConfigKeyError(f"role '{name}' has no 'model' (the network config)")


def _with_defaults(name: str, role: Mapping) -> Dict[str, Any]:
    """Unset role keys from ``ROLE_DEFAULTS``; unset optimizer settings from its ``optimizer`` entry; a ``lora``
    entry checked and completed (``opensora.lora.lora_settings``)."""
    out = {**copy.deepcopy(ROLE_DEFAULTS), **copy.deepcopy(dict(role))}
    out["optimizer"] = optimizer_settings(out["optimizer"])
    if isinstance(out["init_from"], Mapping):
        unknown = [key for key in out["init_from"] if key not in INIT_FROM_DEFAULTS]
        if unknown or not out["init_from"].get("path"):
            raise ConfigKeyError(
                f"'models.{name}.init_from' needs a path and takes only {list(INIT_FROM_DEFAULTS)}; got "
                f"{dict(out['init_from'])}"
            )
    try:
        out["lr_decay"] = lr_decay_settings(out["lr_decay"], where=f"models.{name}.lr_decay")
    except KeyError as error:
        raise ConfigKeyError(error.args[0]) from None
    except ValueError as error:
        raise ConfigValueError(str(error)) from None
    if out["lora"] is not None:
        from opensora.lora import lora_settings

        where = f"models.{name}.lora"
        if not out["trainable"]:
            raise ConfigKeyError(
                f"'{where}' is set on a frozen role: LoRA trains an adapter, so the role must be "
                "trainable (or drop its lora entry)"
            )
        if not out["init_from"]:
            raise ConfigKeyError(
                f"'{where}' needs 'models.{name}.init_from': the adapter is trained on, saved "
                "against and merged into those base weights"
            )
        out["lora"] = lora_settings(out["lora"], where)
    return out


def optimizer_settings(optimizer: Mapping) -> Dict[str, Any]:
    """``optimizer`` with unset settings (type, lr, betas, eps, weight_decay) from ``ROLE_DEFAULTS``."""
    return {**copy.deepcopy(ROLE_DEFAULTS["optimizer"]), **dict(optimizer or {})}


def _expand_shorthand(cfg: Mapping) -> Dict[str, Any]:
    """The single trainable role ``model`` that plain training's top-level keys describe."""
    optimizer = dict(cfg.get("optimizer") or {})
    if cfg.get("lr") is not None:
        if "lr" in optimizer:
            raise ConfigKeyError(f"'lr' is given twice (lr={cfg['lr']} and optimizer.lr={optimizer['lr']}): keep one")
        optimizer["lr"] = cfg["lr"]
    role = dict(model=cfg["model"], optimizer=optimizer)
    for key in ("precision", "warmup_steps", "grad_clip", "init_from", "lora", "lr_decay"):
        if cfg.get(key) is not None:
            role[key] = cfg[key]
    if cfg.get("ema_decay") is not None:
        role["ema"] = dict(
            decay=cfg["ema_decay"], start_step=cfg.get("ema_start_step", 0), warmup=cfg.get("ema_warmup", True)
        )
    return role


def role_configs(cfg: Mapping) -> Dict[str, Dict[str, Any]]:
    """Every role of ``cfg`` with ``ROLE_DEFAULTS`` filled in: ``cfg.models``, or the shorthand's role ``model``."""
    models = cfg.get("models")
    if models:
        ignored = [key for key in SHORTHAND_KEYS if cfg.get(key) is not None]
        if ignored:
            raise ConfigKeyError(
                f"top-level {ignored} would be ignored: this config declares its networks under 'models' "
                f"(roles {sorted(models)}); set them per role, or to None where a base config sets them"
            )
        roles = {name: dict(role) for name, role in models.items()}
    elif cfg.get("model") is not None:
        roles = {"model": _expand_shorthand(cfg)}
    else:
        raise ConfigKeyError("config has neither 'model' nor 'models': no network to build")
    for name, role in roles.items():
        _check_role_keys(name, role)
    return {name: _with_defaults(name, role) for name, role in roles.items()}
