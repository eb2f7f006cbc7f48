"""Text conditioning (T5 tokens + CLIP pooled vector); importing registers ``TextConditioner`` in MODELS."""

from .conditioner import TextConditioner

__all__ = ["TextConditioner"]
