"""Flux-style MMDiT video transformer; importing this package registers ``MMDiT`` in ``MODELS``."""

from .attention import ATTENTION_BACKENDS, attention
from .configs import MMDIT_CONFIGS, mmdit_config
from .flops import mmdit_forward_flops, mmdit_train_flops
from .model import MMDiT, patchify, unpatchify

__all__ = [
    "ATTENTION_BACKENDS",
    "MMDIT_CONFIGS",
    "MMDiT",
    "attention",
    "mmdit_config",
    "mmdit_forward_flops",
    "mmdit_train_flops",
    "patchify",
    "unpatchify",
]
