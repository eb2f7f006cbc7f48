"""Registries that turn config dicts (``dict(type="Name", ...)``) into objects.

``MODELS`` holds networks (MMDiT, autoencoders, text conditioners), ``DATASETS`` datasets, ``METHODS`` the
training-step strategies. Modules register themselves with ``@MODELS.register_module()`` at import time;
``import_all_modules`` imports every package that registers something so configs can name any of them.
"""

import copy
import importlib
from typing import Any, Mapping

from mmengine.registry import Registry

MODELS = Registry("model", scope="opensora")
DATASETS = Registry("dataset", scope="opensora")
METHODS = Registry("method", scope="opensora")
ADAPTERS = Registry("adapter", scope="opensora")  # per-model-family runtime ops that distillation methods call

# Packages whose import registers the modules configs may name.
_REGISTERING_PACKAGES = (
    "opensora.models",
    "opensora.datasets",
    "opensora.methods",
)


def import_all_modules() -> None:
    for name in _REGISTERING_PACKAGES:
        importlib.import_module(name)


def build_module(cfg: Any, registry: Registry, **overrides) -> Any:
    """Build ``cfg`` through ``registry``; ``overrides`` win over the config's own keys.

    ``cfg`` may be a mapping with a ``type`` key, ``None`` (returns ``None``) or an already-built object
    (returned as is), so call sites need no special cases. The config is copied, never mutated.
    """
    if cfg is None:
        return None
    if not isinstance(cfg, Mapping):
        return cfg
    if "type" not in cfg:
        raise KeyError(f"config for registry '{registry.name}' has no 'type' key: {dict(cfg)}")
    import_all_modules()
    kwargs = copy.deepcopy(dict(cfg))
    kwargs.update(overrides)
    type_name = kwargs.pop("type")
    cls = registry.get(type_name)
    if cls is None:
        known = sorted(registry.module_dict)
        raise KeyError(f"'{type_name}' is not registered in '{registry.name}'; registered: {known}")
    return cls(**kwargs)
