"""Precomputed latents and text features: encode a dataset once (``scripts/diffusion/precompute.py``), train
from the stored features (``CachedLatentDataset``)."""
