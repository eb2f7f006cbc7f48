"""Video autoencoders behind one interface (``VideoAutoencoder``); importing registers them in MODELS."""

from .base import VideoAutoencoder, resolve_dtype
from .hunyuan_vae import HunyuanVideoVAE
from .patch_vae import PatchVAE

__all__ = ["VideoAutoencoder", "PatchVAE", "HunyuanVideoVAE", "resolve_dtype"]
