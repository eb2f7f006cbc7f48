"""HunyuanVideo's causal 3D VAE (diffusers ``AutoencoderKLHunyuanVideo``) behind ``VideoAutoencoder``.

Built from a local diffusers checkpoint (``from_pretrained``, never downloads) or, for tests and the demo, from a
tiny random ``config``. Takes ``1 + 4k`` frames to ``1 + k`` latent frames (the first frame is kept on its own).
"""

import math
from typing import Optional

import torch

from opensora.registry import MODELS

from .base import VideoAutoencoder, resolve_dtype
from .group_norm import use_parallel_group_norm


def _load_diffusers_vae(
    from_pretrained: Optional[str], subfolder: Optional[str], config: Optional[dict], seed: int, dtype: torch.dtype
):
    from diffusers import AutoencoderKLHunyuanVideo

    if (from_pretrained is None) == (config is None):
        raise ValueError("HunyuanVideoVAE needs exactly one of from_pretrained (a local path) or config (tiny random)")
    if from_pretrained is not None:
        return AutoencoderKLHunyuanVideo.from_pretrained(
            from_pretrained, subfolder=subfolder, local_files_only=True, dtype=dtype
        )
    # Seeded inside a forked RNG so building the model never disturbs the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoencoderKLHunyuanVideo(**config)
    return model if dtype == torch.float32 else model.to(dtype)


def hunyuan_compression(num_blocks: int, spatial_ratio: int, temporal_ratio: int) -> tuple:
    """(spatial, temporal) compression the diffusers encoder really applies for this block layout.

    Its encoder downsamples space in the first log2(spatial_ratio) blocks and time in the log2(temporal_ratio)
    blocks before the last, so a config with fewer blocks than the ratios imply compresses less than it says.
    """
    spatial_steps = min(num_blocks, int(math.log2(spatial_ratio)))
    temporal_steps = min(num_blocks - 1, int(math.log2(temporal_ratio)))
    return 2**spatial_steps, 2**temporal_steps


@MODELS.register_module()
class HunyuanVideoVAE(VideoAutoencoder):
    causal_temporal = True

    def __init__(
        self,
        from_pretrained: Optional[str] = None,
        subfolder: Optional[str] = None,
        config: Optional[dict] = None,
        seed: int = 0,
        dtype="fp32",
        device=None,
        sample_posterior: bool = False,
        scaling_factor: Optional[float] = None,
        shift_factor: Optional[float] = None,
        use_tiling: bool = False,
        tile_kwargs: Optional[dict] = None,
        use_slicing: bool = False,
        clamp_output: bool = True,
        parallel_group_norm: bool = True,
    ):
        vae = _load_diffusers_vae(from_pretrained, subfolder, config, seed, resolve_dtype(dtype))
        if parallel_group_norm:  # few-group GPU norms (batch 1): statistics over all SMs (CPU: unchanged)
            use_parallel_group_norm(vae)
        vae_config = vae.config
        if scaling_factor is None:
            scaling_factor = vae_config.scaling_factor
        if shift_factor is None:
            shift_factor = getattr(vae_config, "shift_factor", None) or 0.0
        super().__init__(scaling_factor=scaling_factor, shift_factor=shift_factor)
        if vae_config.temporal_compression_ratio != 4:
            raise ValueError(
                f"diffusers' HunyuanVideo decoder supports temporal_compression_ratio=4 only, "
                f"got {vae_config.temporal_compression_ratio}"
            )
        self.vae = vae
        self.latent_channels = vae_config.latent_channels
        # diffusers' tiling and frame-wise paths trust the declared ratios, so they must be what the blocks do.
        declared = (vae_config.spatial_compression_ratio, vae_config.temporal_compression_ratio)
        actual = hunyuan_compression(len(vae_config.block_out_channels), *declared)
        if actual != declared:
            raise ValueError(
                f"HunyuanVideo config with {len(vae_config.block_out_channels)} blocks compresses (spatial, temporal) "
                f"by {actual}, but declares {declared}; use at least 3 blocks and "
                f"spatial_compression_ratio <= 2**num_blocks"
            )
        self.spatial_compression, self.temporal_compression = declared
        self.sample_posterior = sample_posterior
        self.clamp_output = clamp_output
        if use_tiling:
            self.enable_tiling(**(tile_kwargs or {}))
        if use_slicing:
            self.enable_slicing()
        if device is not None:
            self.to(device)
        self.freeze()

    # Memory toggles for large videos: tiling splits H/W into overlapping tiles, slicing runs one sample at a time.
    def enable_tiling(self, **tile_kwargs) -> None:
        self.vae.enable_tiling(**tile_kwargs)

    def disable_tiling(self) -> None:
        self.vae.disable_tiling()

    def enable_slicing(self) -> None:
        self.vae.enable_slicing()

    def disable_slicing(self) -> None:
        self.vae.disable_slicing()

    def _encode_raw(self, video: torch.Tensor) -> torch.Tensor:
        posterior = self.vae.encode(video.to(self.vae.dtype)).latent_dist
        latent = posterior.sample() if self.sample_posterior else posterior.mode()
        return latent.to(video.dtype)

    def _decode_raw(self, latent: torch.Tensor) -> torch.Tensor:
        video = self.vae.decode(latent.to(self.vae.dtype)).sample.to(latent.dtype)
        return video.clamp(-1, 1) if self.clamp_output else video
