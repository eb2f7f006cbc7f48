"""Lossless pixel packing as an "autoencoder" for the CPU demo and tests.

Each ``pt x p x p`` block of pixels becomes one latent position with ``3*pt*p*p`` channels: no weights, no
information lost, and the latent grid is as small as a real VAE's would be for the same compression.
"""

import torch
from einops import rearrange

from opensora.registry import MODELS

from .base import VideoAutoencoder


@MODELS.register_module()
class PatchVAE(VideoAutoencoder):
    causal_temporal = False

    def __init__(
        self,
        patch_size: int = 2,
        temporal_patch_size: int = 1,
        scaling_factor: float = 1.0,
        shift_factor: float = 0.0,
        in_channels: int = 3,
    ):
        super().__init__(scaling_factor=scaling_factor, shift_factor=shift_factor)
        if patch_size < 1 or temporal_patch_size < 1:
            raise ValueError(
                f"patch sizes must be >= 1, got patch_size={patch_size}, temporal_patch_size={temporal_patch_size}"
            )
        if in_channels != 3:
            raise ValueError(f"PatchVAE packs RGB video (in_channels=3), got in_channels={in_channels}")
        self.patch_size = int(patch_size)
        self.temporal_patch_size = int(temporal_patch_size)
        self.spatial_compression = self.patch_size
        self.temporal_compression = self.temporal_patch_size
        self.latent_channels = in_channels * self.patch_size**2 * self.temporal_patch_size
        self.freeze()

    def _encode_raw(self, video: torch.Tensor) -> torch.Tensor:
        return rearrange(
            video,
            "b c (t pt) (h ph) (w pw) -> b (c pt ph pw) t h w",
            pt=self.temporal_patch_size,
            ph=self.patch_size,
            pw=self.patch_size,
        )

    def _decode_raw(self, latent: torch.Tensor) -> torch.Tensor:
        return rearrange(
            latent,
            "b (c pt ph pw) t h w -> b c (t pt) (h ph) (w pw)",
            pt=self.temporal_patch_size,
            ph=self.patch_size,
            pw=self.patch_size,
        )

    def extra_repr(self) -> str:
        return (
            f"patch_size={self.patch_size}, temporal_patch_size={self.temporal_patch_size}, "
            f"latent_channels={self.latent_channels}, scaling_factor={self.scaling_factor}, "
            f"shift_factor={self.shift_factor}"
        )
