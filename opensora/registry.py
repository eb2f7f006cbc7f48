"""Registries that turn config dicts (``dict(type="Name", ...)``) into objects.

``MODELS`` holds networks (MMDiT, autoencoders, text conditioners), ``DATASETS`` datasets, ``METHODS`` the
training-step strategies, ``ADAPTERS`` the per-model-family operations methods and the sampler call. Modules
register themselves with ``@MODELS.register_module()`` at import time. Each registry imports only the package that
holds what it registers, the first time a name is looked up (mmengine's ``locations``), so building a model for
sampling never imports the training methods (or ColossalAI behind them).
"""

import copy
import os
from typing import Any, Mapping

import torch
from mmengine.logging import MMLogger
from mmengine.registry import Registry

MODELS = Registry("model", scope="opensora", locations=["opensora.models"])
DATASETS = Registry("dataset", scope="opensora", locations=["opensora.datasets"])
METHODS = Registry("method", scope="opensora", locations=["opensora.methods"])
ADAPTERS = Registry("adapter", scope="opensora", locations=["opensora.adapters"])


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
    kwargs = copy.deepcopy(dict(cfg))
    kwargs.update(overrides)
    type_name = kwargs.pop("type")
    _make_mmengine_logger_on_any_rank()
    cls = registry.get(type_name)
    if cls is None:
        known = sorted(registry.module_dict)
        raise KeyError(f"'{type_name}' is not registered in '{registry.name}'; registered: {known}")
    return cls(**kwargs)


def _make_mmengine_logger_on_any_rank() -> None:
    """mmengine's registry logs through a global logger that, when first made, looks up its rank's GPU by
    ``LOCAL_RANK``; a CPU run with more ranks than the machine has GPUs (``torchrun ... --device cpu`` on a GPU
    machine) has none there and failed with an IndexError. Make that logger first, under a local rank that has a
    GPU (it only labels log lines)."""
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None or MMLogger.check_instance_created("mmengine") or not torch.cuda.is_available():
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    num_gpus = len(visible.split(",")) if visible else torch.cuda.device_count()
    if int(local_rank) < num_gpus:
        return
    os.environ["LOCAL_RANK"] = str(int(local_rank) % num_gpus)
    try:
        MMLogger.get_instance("mmengine")
    finally:
        os.environ["LOCAL_RANK"] = local_rank
