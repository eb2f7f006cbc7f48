"""The one interface every video autoencoder implements.

Subclasses turn pixels into raw latents and back (``_encode_raw`` / ``_decode_raw``); this base applies the
latent normalisation ``z = (raw - shift_factor) * scaling_factor`` on the way in and its inverse on the way out,
so callers only ever see normalised latents. Autoencoders are frozen: they run without gradients and stay in
eval mode even when a parent module calls ``.train()``.
"""

from typing import Sequence, Tuple

import torch
from torch import nn

from opensora.dtypes import resolve_dtype  # noqa: F401  (re-exported: opensora.models.vae.resolve_dtype)


def latent_num_frames(num_frames: int, compression: int, causal: bool) -> int:
    """Latent frames for ``num_frames`` video frames.

    A causal autoencoder keeps the first frame on its own and compresses the rest, so it takes ``1 + k*c``
    frames to ``1 + k``; a non-causal one takes ``k*c`` frames to ``k``.
    """
    if causal:
        if num_frames < 1 or (num_frames - 1) % compression != 0:
            raise ValueError(
                f"this autoencoder needs 1 + {compression}*k frames (causal temporal compression {compression}), "
                f"got {num_frames}"
            )
        return (num_frames - 1) // compression + 1
    if num_frames < 1 or num_frames % compression != 0:
        raise ValueError(f"frame count {num_frames} is not divisible by the temporal compression {compression}")
    return num_frames // compression


def video_num_frames(latent_frames: int, compression: int, causal: bool) -> int:
    """Inverse of ``latent_num_frames``."""
    if latent_frames < 1:
        raise ValueError(f"latent frame count must be >= 1, got {latent_frames}")
    return (latent_frames - 1) * compression + 1 if causal else latent_frames * compression


def latent_spatial_size(size: int, compression: int, name: str) -> int:
    if size < 1 or size % compression != 0:
        raise ValueError(f"video {name} {size} is not divisible by the spatial compression {compression}")
    return size // compression


class VideoAutoencoder(nn.Module):
    """Frozen video autoencoder: ``encode([B,3,T,H,W] in [-1,1]) -> normalised latent [B,C,t,h,w]``.

    Subclasses set ``latent_channels``, ``temporal_compression``, ``spatial_compression`` and
    ``causal_temporal`` and implement ``_encode_raw`` / ``_decode_raw``.
    """

    latent_channels: int
    temporal_compression: int
    spatial_compression: int
    causal_temporal: bool = False

    def __init__(self, scaling_factor: float = 1.0, shift_factor: float = 0.0):
        super().__init__()
        if scaling_factor == 0:
            raise ValueError("scaling_factor must be non-zero")
        self.scaling_factor = float(scaling_factor)
        self.shift_factor = float(shift_factor)

    # --- what subclasses implement -------------------------------------------------------------------------
    def _encode_raw(self, video: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _decode_raw(self, latent: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # --- public interface ----------------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, video: torch.Tensor) -> torch.Tensor:
        if video.dim() != 5 or video.shape[1] != 3:
            raise ValueError(f"encode expects a video [B, 3, T, H, W], got shape {tuple(video.shape)}")
        self.get_latent_size(video.shape[2:])  # raises a clear error for sizes the autoencoder cannot take
        raw = self._encode_raw(video)
        return (raw - self.shift_factor) * self.scaling_factor

    @torch.no_grad()
    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        if latent.dim() != 5 or latent.shape[1] != self.latent_channels:
            raise ValueError(
                f"decode expects a latent [B, {self.latent_channels}, t, h, w], got shape {tuple(latent.shape)}"
            )
        raw = latent / self.scaling_factor + self.shift_factor
        return self._decode_raw(raw)

    def get_latent_size(self, video_size: Sequence[int]) -> Tuple[int, int, int]:
        """(T, H, W) of a video -> (t, h, w) of its latent; raises for sizes the autoencoder cannot take."""
        num_frames, height, width = (int(s) for s in video_size)
        return (
            latent_num_frames(num_frames, self.temporal_compression, self.causal_temporal),
            latent_spatial_size(height, self.spatial_compression, "height"),
            latent_spatial_size(width, self.spatial_compression, "width"),
        )

    def get_video_size(self, latent_size: Sequence[int]) -> Tuple[int, int, int]:
        """(t, h, w) of a latent -> (T, H, W) of the video it decodes to."""
        latent_frames, height, width = (int(s) for s in latent_size)
        return (
            video_num_frames(latent_frames, self.temporal_compression, self.causal_temporal),
            height * self.spatial_compression,
            width * self.spatial_compression,
        )

    def train(self, mode: bool = True) -> "VideoAutoencoder":
        # Frozen: a parent's .train() must not switch dropout/norm statistics back on.
        return super().train(False)

    def freeze(self) -> "VideoAutoencoder":
        self.requires_grad_(False)
        return self.eval()
