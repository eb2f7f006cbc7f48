"""The frozen components (VAE, text conditioner) of a run: built as training runs them, or lazily.

``build_vae`` / ``build_text_encoder`` are the one place that says how the trainer places them (the VAE in the
run's precision, the text conditioner in its own dtype); ``precompute.py`` builds its encoders with the same
functions, so stored features are exactly what training would have computed.

When the dataset holds precomputed features (``CachedLatentDataset``) that cover the config's components, training
needs neither: ``build_components`` then hands out ``LazyComponent`` stand-ins that build the real module the first
time anything touches them (validation sampling, a method that encodes), and takes the null-text features from the
cache.
"""

import logging
from typing import Callable, Optional

import torch

from opensora.registry import MODELS, build_module
from opensora.roles import Components

logger = logging.getLogger(__name__)


def build_vae(spec, device: torch.device, dtype: torch.dtype):
    vae = build_module(spec, MODELS)
    return vae.to(device, dtype).eval().requires_grad_(False) if vae is not None else None


def build_text_encoder(spec, device: torch.device):
    text_encoder = build_module(spec, MODELS)
    return text_encoder.to(device) if text_encoder is not None else None


class LazyComponent:
    """Stands in for a frozen module; builds it on first use (attribute access) and forwards everything to it."""

    def __init__(self, name: str, build: Callable[[], torch.nn.Module], built: Optional[torch.nn.Module] = None):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_build", build)
        object.__setattr__(self, "_module", built)

    @property
    def is_built(self) -> bool:
        return self._module is not None

    def get(self) -> torch.nn.Module:
        if self._module is None:
            logger.info(
                "building the %s now (the feature cache covers training; this use needs the module)", self._name
            )
            object.__setattr__(self, "_module", self._build())
        return self._module

    def __getattr__(self, attr):
        return getattr(self.get(), attr)

    def __repr__(self) -> str:
        return f"LazyComponent({self._name}, built={self.is_built})"


def build_components(cfg, device: torch.device, dtype: torch.dtype, dataset=None) -> Components:
    """The run's ``Components``. With a ``dataset`` that carries precomputed features (``feature_cache``), the
    cache is first checked against the config's components (``CacheMismatchError`` names what differs), and the
    components are built only when used."""
    cache = getattr(dataset, "feature_cache", None)
    if cache is None:
        vae = build_vae(cfg.get("vae"), device, dtype)
        text_encoder = build_text_encoder(cfg.get("text_encoder"), device)
        null_text = text_encoder.null_embeddings(1) if text_encoder is not None else None
        return Components(vae=vae, text_encoder=text_encoder, device=device, dtype=dtype, null_text=null_text)

    def vae_builder():
        return build_vae(cfg.get("vae"), device, dtype)

    def text_builder():
        return build_text_encoder(cfg.get("text_encoder"), device)

    # a component built to compare its weights (its config entry differs from the cache's) is kept, not rebuilt
    built_vae = cache.check_component("vae", cfg.get("vae"), dtype, vae_builder)
    built_text = cache.check_component("text_encoder", cfg.get("text_encoder"), None, text_builder)
    vae = LazyComponent("vae", vae_builder, built_vae) if cfg.get("vae") else None
    text_encoder = LazyComponent("text_encoder", text_builder, built_text) if cfg.get("text_encoder") else None
    null_text = {key: value.to(device) for key, value in cache.null_text().items()}
    return Components(vae=vae, text_encoder=text_encoder, device=device, dtype=dtype, null_text=null_text)
