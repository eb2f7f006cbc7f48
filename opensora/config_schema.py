"""Optional config blocks and keys that the command line may set although the config file leaves them out.

A config lists what it sets; the documented optional blocks are settable on top of it, their keys taken from the
module that defines (and checks) each block, so a new key there is settable here with no second list::

    --init-from outputs/demo/train --lora.rank 16     plain training: init_from (INIT_FROM_DEFAULTS), lora (LORA_DEFAULTS)
    --init-from.path P --init-from.ema false          a string init_from becomes dict(path=...) when a key is set
    --lr-decay.type cosine                            plain training: lr_decay (opensora.lr_schedule.LR_DECAY_DEFAULTS)
    --models.student.grad-clip 1                      any role key of an existing role (role_config.ROLE_DEFAULTS),
    --models.student.lora.rank 4                        and that role's lora / init_from / lr_decay blocks
    --validation.every 100 --validation.seed 7        validation (training.defaults.VALIDATION_DEFAULTS)
    --dataset.target-fps 8                            any keyword argument of the config's dataset class,
    --model.causal-chunk-frames 1                       and of its network's (model, models.<role>.model)

A block the config sets to None (``lora = None``) is created like a missing one. Each settable key comes with a
template, the value whose type an override is cast to (``opensora.config_values``; None: a Python literal, or the text
itself). The owners still check the values; this module only says which keys exist.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Mapping, Optional

MISSING = object()
ROLE = "*"  # in a pattern: the name of any role the config's ``models`` declares


def _lora() -> dict:
    from opensora.lora import LORA_DEFAULTS

    return LORA_DEFAULTS


def _init_from() -> dict:
    from opensora.role_config import INIT_FROM_DEFAULTS

    return INIT_FROM_DEFAULTS


def _lr_decay() -> dict:
    from opensora.lr_schedule import LR_DECAY_DEFAULTS

    return LR_DECAY_DEFAULTS


def _role() -> dict:
    from opensora.role_config import ROLE_DEFAULTS

    return ROLE_DEFAULTS


def _validation() -> dict:
    from opensora.training.defaults import VALIDATION_DEFAULTS

    return VALIDATION_DEFAULTS


def _constructor_keys(block: Any, registry_name: str) -> dict:
    """The keyword arguments of the class a ``dict(type=...)`` block builds, with their defaults: the class's
    signature is the schema of its block (``dataset``, ``model``)."""
    if not isinstance(block, Mapping) or not block.get("type"):
        return {}
    from opensora import registry

    cls = getattr(registry, registry_name).get(block["type"])
    if cls is None:
        return {}
    keys = {}
    for name, param in inspect.signature(cls.__init__).parameters.items():
        if name != "self" and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            keys[name] = None if param.default is param.empty else param.default
    return keys


# block pattern -> its keys and their templates; top-level lora / init_from / lr_decay are plain training's
# shorthand for the single role "model", so they count only in a config without ``models``
_SHORTHAND_BLOCKS: Dict[tuple, Callable[[], dict]] = {
    ("lora",): _lora,
    ("init_from",): _init_from,
    ("lr_decay",): _lr_decay,
}
_BLOCKS: Dict[tuple, Callable[[], dict]] = {
    ("validation",): _validation,
    ("models", ROLE): _role,
    ("models", ROLE, "lora"): _lora,
    ("models", ROLE, "init_from"): _init_from,
    ("models", ROLE, "lr_decay"): _lr_decay,
}
SCALAR_FORMS = {"init_from": "path"}  # a block that may be given as one value: init_from="ckpt" = dict(path="ckpt")


class OptionalKeys:
    """The optional blocks and keys of one config tree (the roles it declares, its dataset class)."""

    def __init__(self, tree: Mapping):
        self._tree = tree
        models = tree.get("models")
        self._roles = [str(name) for name in models] if isinstance(models, Mapping) else []
        self._blocks = dict(_BLOCKS)
        if not self._roles:
            self._blocks.update(_SHORTHAND_BLOCKS)

    def _block_keys(self, parts: tuple) -> Optional[dict]:
        if parts == ("dataset",):
            return _constructor_keys(self._tree.get("dataset"), "DATASETS")
        if parts == ("model",) or (len(parts) == 3 and parts[0] == "models" and parts[2] == "model"):
            node = self._tree.get("model") if len(parts) == 1 else self._node(parts)
            return _constructor_keys(node, "MODELS") if node is not None else None
        for pattern, keys in self._blocks.items():
            if len(pattern) == len(parts) and all(
                p == q or (p == ROLE and q in self._roles) for p, q in zip(pattern, parts)
            ):
                return keys()
        return None

    def _node(self, parts: tuple) -> Any:
        node: Any = self._tree
        for part in parts:
            node = node.get(part) if isinstance(node, Mapping) else None
        return node

    def is_block(self, path: str) -> bool:
        """Whether ``path`` names an optional block (a dict that may be created)."""
        return self._block_keys(tuple(path.split("."))) is not None

    def template(self, path: str) -> Any:
        """The template value of the optional key ``path``, or ``MISSING`` when it is not one."""
        parts = tuple(path.split("."))
        keys = self._block_keys(parts[:-1]) if len(parts) > 1 else None
        if keys is not None and parts[-1] in keys:
            return keys[parts[-1]]
        if len(parts) == 1 and self._block_keys(parts) is not None:
            return None  # a whole top-level block, given as a Python literal (or init_from as a path)
        return MISSING

    def paths(self) -> list:
        """Every optional key of this tree as a dotted path (for "did you mean" hints)."""
        found = []
        patterns = list(self._blocks) + [("dataset",), ("model",)] + [("models", r, "model") for r in self._roles]
        for pattern in patterns:
            names = self._roles if ROLE in pattern else [None]
            for role in names:
                parts = tuple(role if p == ROLE else p for p in pattern)
                prefix = ".".join(parts)
                found.append(prefix)
                found += [f"{prefix}.{key}" for key in self._block_keys(parts) or {}]
        return found


def block_from_value(path: str, value: Any) -> Any:
    """The dict a block's existing value stands for before a key is set inside it: {} for None, and
    ``dict(path=value)`` for a block that may be given as one value (``init_from="ckpt"``); else ``value``."""
    if value is None:
        return {}
    scalar_key = SCALAR_FORMS.get(path.rsplit(".", 1)[-1])
    if scalar_key is not None and isinstance(value, str):
        return {scalar_key: value}
    return value
