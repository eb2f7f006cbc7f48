"""Build a ColossalAI plugin + Booster from a config dict; the trainer only ever sees the Booster API.

    plugin = dict(type="LowLevelZeroPlugin", stage=2, max_norm=1.0)
    booster = build_booster(plugin, mixed_precision="bf16")
    model, optimizer, _, _, lr_scheduler = booster.boost(model, optimizer, lr_scheduler=lr_scheduler)

``mixed_precision`` fills the plugin's ``precision`` argument for plugins that manage precision themselves
(LowLevelZero, HybridParallel, Gemini) unless the plugin config names one. TorchDDPPlugin leaves precision to
the Booster: fp32 runs as is, fp16 uses torch AMP (GPU), and bf16 is refused because ColossalAI 0.5.0 has no
bf16 AMP for it.

Without a GPU the factory applies the CPU shim and CPU-safe defaults (no communication overlap, no CUDA-only
kernels); Gemini and FSDP cannot run on CPU and raise a clear error instead.

HybridParallelPlugin needs a shardformer policy for a model that is not a HuggingFace one; ``NoShardPolicy``
is a no-op policy valid for any ``nn.Module`` with tp_size=1. The plugins' own tensor / sequence parallel sharding
(shardformer) has no MMDiT policy, so the factory rejects tp_size > 1 or plugin sequence parallelism. The MMDiT's
sequence parallelism is the trainer's ``sequence_parallel_size`` instead (``opensora.parallel``), which works
with every plugin.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import torch
from colossalai.booster import Booster
from colossalai.booster.plugin import GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin, TorchDDPPlugin
from colossalai.booster.plugin.plugin_base import Plugin
from colossalai.shardformer.policies.base_policy import Policy

from . import zero_single_rank, zero_sync
from .cpu_shim import apply_cpu_shim

PRECISIONS = ("fp32", "fp16", "bf16")


class NoShardPolicy(Policy):
    """A shardformer policy that replaces nothing: lets HybridParallelPlugin wrap any ``nn.Module``.

    Valid only for tp_size == 1 and no plugin sequence parallelism (the module is kept whole on every rank; data
    parallel + ZeRO still apply, and so does the trainer's ``sequence_parallel_size``). A tensor-parallel MMDiT
    policy (column/row-parallel qkv/proj/mlp) does not exist.
    """

    def config_sanity_check(self):
        cfg = self.shard_config
        if cfg is not None and (cfg.enable_tensor_parallelism or cfg.enable_sequence_parallelism):
            raise NotImplementedError(
                "NoShardPolicy cannot shard a model: use tp_size=1 and no plugin sequence parallelism "
                "(for MMDiT sequence parallelism set the trainer's sequence_parallel_size instead)"
            )

    def preprocess(self):
        return self.model

    def module_policy(self):
        return {}

    def postprocess(self):
        return self.model


def _cpu_unsupported(name: str) -> Callable[[dict], dict]:
    def reject(kwargs: dict) -> dict:
        raise RuntimeError(
            f"{name} needs a GPU (it manages CUDA memory itself); on CPU use "
            "LowLevelZeroPlugin, HybridParallelPlugin or TorchDDPPlugin"
        )

    return reject


def _force_off_on_cpu(kwargs: dict, plugin: str, flags: tuple[str, ...], why: str) -> dict:
    for flag in flags:
        if kwargs.get(flag):
            warnings.warn(f"{plugin}: {flag}=True {why}; turned off because there is no GPU", stacklevel=3)
        kwargs[flag] = False
    return kwargs


def _cpu_zero(kwargs: dict) -> dict:
    # Overlap reduces gradients on a side CUDA stream; the shim's CPU streams are no-ops, so keep it off.
    return _force_off_on_cpu(
        kwargs, "LowLevelZeroPlugin", ("overlap_communication", "overlap_allgather"), "needs CUDA streams"
    )


def _cpu_hybrid(kwargs: dict) -> dict:
    kwargs = _force_off_on_cpu(
        kwargs, "HybridParallelPlugin", ("overlap_communication", "overlap_allgather"), "needs CUDA streams"
    )
    return _force_off_on_cpu(
        kwargs,
        "HybridParallelPlugin",
        ("enable_all_optimization", "enable_fused_normalization", "enable_flash_attention", "enable_jit_fused"),
        "needs CUDA kernels",
    )


def _hybrid_defaults(kwargs: dict) -> dict:
    kwargs.setdefault("tp_size", 1)
    kwargs.setdefault("pp_size", 1)
    if kwargs.get("zero_stage", 0) > 0 and kwargs.get("precision") == "fp32":
        raise ValueError(
            "HybridParallelPlugin with zero_stage > 0 needs precision bf16 or fp16 (ColossalAI "
            "asserts this); use zero_stage=0 or LowLevelZeroPlugin for fp32"
        )
    if kwargs.get("custom_policy") is None:
        if kwargs["tp_size"] != 1 or kwargs.get("enable_sequence_parallelism") or (kwargs.get("sp_size") or 1) > 1:
            raise NotImplementedError(
                "HybridParallelPlugin with tp_size>1 or sequence parallelism needs a sharding policy, which the "
                "MMDiT has not; use tp_size=1 (ZeRO / data parallel still apply) and the trainer's "
                "sequence_parallel_size for sequence parallelism"
            )
        kwargs["custom_policy"] = NoShardPolicy()
    return kwargs


def _identity(kwargs: dict) -> dict:
    return kwargs


class _PluginSpec:
    """How to build one plugin: its class, whether it takes ``precision``, and its default/CPU adjustments."""

    def __init__(self, cls: type, takes_precision: bool, defaults=_identity, cpu_adjust=_identity):
        self.cls = cls
        self.takes_precision = takes_precision
        self.defaults = defaults
        self.cpu_adjust = cpu_adjust


PLUGIN_REGISTRY: dict[str, _PluginSpec] = {
    "LowLevelZeroPlugin": _PluginSpec(LowLevelZeroPlugin, True, cpu_adjust=_cpu_zero),
    "HybridParallelPlugin": _PluginSpec(HybridParallelPlugin, True, _hybrid_defaults, _cpu_hybrid),
    "GeminiPlugin": _PluginSpec(GeminiPlugin, True, cpu_adjust=_cpu_unsupported("GeminiPlugin")),
    "TorchDDPPlugin": _PluginSpec(TorchDDPPlugin, False),
}


def _register_fsdp() -> None:
    try:
        from colossalai.booster.plugin.torch_fsdp_plugin import TorchFSDPPlugin
    except ImportError:  # FSDP plugin import can fail on exotic torch builds; it is optional
        return
    PLUGIN_REGISTRY["TorchFSDPPlugin"] = _PluginSpec(
        TorchFSDPPlugin, False, cpu_adjust=_cpu_unsupported("TorchFSDPPlugin")
    )


_register_fsdp()


def _check_precision(mixed_precision: str) -> None:
    if mixed_precision not in PRECISIONS:
        raise ValueError(f"mixed_precision must be one of {PRECISIONS}, got {mixed_precision!r}")


def build_plugin(plugin_cfg: dict, mixed_precision: str = "bf16", on_gpu: bool | None = None) -> Plugin:
    """Instantiate the plugin named by ``plugin_cfg["type"]`` with the remaining keys as arguments.

    ``on_gpu`` defaults to ``torch.cuda.is_available()``; without a GPU the CPU shim is applied and the
    plugin's CPU adjustments run (they raise if the config asks for something CPU cannot do).
    """
    _check_precision(mixed_precision)
    kwargs: dict[str, Any] = copy.copy(dict(plugin_cfg))  # never mutate the caller's config
    name = kwargs.pop("type", None)
    if name not in PLUGIN_REGISTRY:
        raise KeyError(f"unknown plugin type {name!r}; known: {sorted(PLUGIN_REGISTRY)}")
    spec = PLUGIN_REGISTRY[name]
    if spec.takes_precision:
        kwargs.setdefault("precision", mixed_precision)
    kwargs = spec.defaults(kwargs)
    if on_gpu is None:
        on_gpu = torch.cuda.is_available()
    # one rank: no flatten / copy passes standing in for communication (zero_single_rank.py); bit-identical to
    # ColossalAI's path (CPU and GPU tests), ~25 ms less per 1B step on an H100. `single_rank_shortcut=False` opts out.
    zero_like = name in ("LowLevelZeroPlugin", "HybridParallelPlugin")
    single_rank_shortcut = bool(kwargs.pop("single_rank_shortcut", zero_like))
    # several ranks, plain data parallel: the step's per-tensor gradient casts and TensorBucket gather replaced by
    # multi-tensor copies around one all-gather per bucket (zero_single_rank.py); bit-identical to ColossalAI's path
    # (2 gloo ranks, 2 GPUs over NCCL). 1B on 2 H200s: 2-GPU scaling efficiency 0.972 vs 0.941 with ColossalAI's
    # step (benchmarks/README.md). `multi_rank_shortcut=False` opts out.
    multi_rank_shortcut = bool(kwargs.pop("multi_rank_shortcut", zero_like))
    # one rank, LowLevelZero: the gradients stay in .grad, no bucket store in the backward (host time of a host-bound
    # step; bit-identical). `grads_in_place=False`: through the store, as before.
    grads_in_place = bool(kwargs.pop("grads_in_place", True))
    if zero_like:
        zero_sync.install()  # grad norm, clipping and the end of backward without host syncs
        if single_rank_shortcut or multi_rank_shortcut:
            zero_single_rank.install(
                single_rank=single_rank_shortcut, multi_rank=multi_rank_shortcut, grads_in_place=grads_in_place
            )
        else:
            zero_single_rank.uninstall()
    elif single_rank_shortcut or multi_rank_shortcut:
        raise ValueError(
            f"single_rank_shortcut / multi_rank_shortcut apply to LowLevelZeroPlugin / HybridParallelPlugin, not {name}"
        )
    if not on_gpu:
        apply_cpu_shim()
        kwargs = spec.cpu_adjust(kwargs)
    return spec.cls(**kwargs)


def build_booster(plugin_cfg: dict, mixed_precision: str = "bf16") -> Booster:
    """A Booster around ``build_plugin(plugin_cfg, mixed_precision)``; needs an initialised process group."""
    _check_precision(mixed_precision)
    plugin = build_plugin(plugin_cfg, mixed_precision)
    if plugin.control_precision() or mixed_precision == "fp32":
        return Booster(plugin=plugin)
    if mixed_precision == "bf16":
        raise ValueError(
            f"{type(plugin).__name__} has no bf16 mode in ColossalAI 0.5.0; use mixed_precision='fp32' "
            "or a plugin that manages precision (LowLevelZeroPlugin / HybridParallelPlugin)"
        )
    if not torch.cuda.is_available():
        raise ValueError(f"{type(plugin).__name__} fp16 uses CUDA AMP; use mixed_precision='fp32' on CPU")
    return Booster(plugin=plugin, mixed_precision="fp16")
