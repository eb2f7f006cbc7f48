"""Pre-extracted latents and text features held in memory: a dataset whose loading costs nothing.

For measuring the trainer itself (benchmarks/train_step.py's trainer mode): every sample is one of ``pool`` random
latent clips ``[C, t, h, w]`` with random T5-width text features ``[L, text_dim]`` and a pooled vector, made once at
construction. ``FlowMatching`` takes such a batch's ``latents`` and text features as they are (no VAE, no text
encoder). The bucket sampler sees the pixel shape a VAE with the given compression would have decoded
(``t -> 1 + (t - 1) * temporal`` frames for a causal VAE, ``h, w -> h * spatial, w * spatial``), so the usual
``bucket_config`` (an explicit ``"<H>x<W>"`` resolution) and the resumable sampler apply unchanged.

``text_valid_tokens`` < ``text_tokens`` adds a ``text_mask`` with that many real tokens (padded prompts);
``text_valid_range=(lo, hi)`` instead draws each pool slot's count uniformly in ``[lo, hi]`` (seeded), so the rows of
a batch differ as real prompts do (e.g. 20-120 of 512 T5 tokens).
"""

from typing import Optional, Sequence

import numpy as np
import torch

from opensora.datasets.dataset import VideoTextDataset
from opensora.registry import DATASETS


@DATASETS.register_module()
class SyntheticLatentDataset(VideoTextDataset):
    def __init__(
        self,
        num: int = 1024,
        latent_channels: int = 16,
        latent_frames: int = 11,
        latent_height: int = 48,
        latent_width: int = 64,
        spatial_compression: int = 8,
        temporal_compression: int = 4,
        causal_temporal: bool = True,
        text_tokens: int = 512,
        text_dim: int = 4096,
        pooled_dim: int = 768,
        text_valid_tokens: Optional[int] = None,
        text_valid_range: Optional[Sequence[int]] = None,
        pool: int = 4,
        seed: int = 0,
        dtype: str = "bf16",
    ):
        if num < 1 or pool < 1:
            raise ValueError(f"num and pool must be >= 1, got num={num}, pool={pool}")
        if text_valid_tokens is not None and not 0 < text_valid_tokens <= text_tokens:
            raise ValueError(f"text_valid_tokens={text_valid_tokens} must lie in [1, text_tokens={text_tokens}]")
        if text_valid_range is not None:
            lo, hi = (int(v) for v in text_valid_range)
            if text_valid_tokens is not None or not 0 < lo <= hi <= text_tokens:
                raise ValueError(
                    f"text_valid_range={tuple(text_valid_range)} must be (lo, hi) with 1 <= lo <= hi <= "
                    f"text_tokens={text_tokens}, without text_valid_tokens"
                )
        frames = (
            1 + (latent_frames - 1) * temporal_compression if causal_temporal else latent_frames * temporal_compression
        )
        height, width = latent_height * spatial_compression, latent_width * spatial_compression
        self.data_path = (
            f"synthetic_latents(num={num}, [{latent_channels}, {latent_frames}, {latent_height}, {latent_width}])"
        )
        self.num_frames_default = frames
        self.image_size = (height, width)
        self.interpolation = "bilinear"
        self.epoch = 0
        self.paths = [f"synthetic_latents/{i:06d}" for i in range(num)]
        self.texts = [f"synthetic prompt {i % pool}" for i in range(num)]
        self.is_image = np.zeros(num, dtype=bool)
        self.num_frames = np.full(num, frames, dtype=np.int64)
        self.heights = np.full(num, height, dtype=np.int64)
        self.widths = np.full(num, width, dtype=np.int64)
        self.fps = np.full(num, 24.0, dtype=np.float64)
        self.frame_intervals = np.ones(num, dtype=np.int64)
        store = torch.bfloat16 if dtype == "bf16" else torch.float32
        gen = torch.Generator().manual_seed(int(seed))
        self.latents = torch.randn(pool, latent_channels, latent_frames, latent_height, latent_width, generator=gen)
        self.text_emb = torch.randn(pool, text_tokens, text_dim, generator=gen).to(store)
        self.pooled = torch.randn(pool, pooled_dim, generator=gen).to(store)
        self.text_mask = None  # one mask [L] for every sample, or one per pool slot [pool, L]
        if text_valid_tokens is not None and text_valid_tokens < text_tokens:
            self.text_mask = torch.arange(text_tokens) < text_valid_tokens
        if text_valid_range is not None:
            counts = torch.randint(lo, hi + 1, (pool,), generator=gen)
            self.text_mask = torch.arange(text_tokens)[None, :] < counts[:, None]

    def load_sample(self, key) -> dict:
        index, num_frames, height, width, _ = self._resolve_key(key)
        if (num_frames, height, width) != (self.num_frames_default, *self.image_size):
            raise ValueError(
                f"SyntheticLatentDataset holds one shape ({self.num_frames_default} frames, "
                f"{self.image_size[0]}x{self.image_size[1]}); the bucket asked for {num_frames}, {height}x{width}"
            )
        slot = index % len(self.latents)
        sample = dict(
            latents=self.latents[slot],
            text_emb=self.text_emb[slot],
            pooled=self.pooled[slot],
            text=self.texts[index],
            num_frames=num_frames,
            height=height,
            width=width,
            path=self.paths[index],
            index=index,
        )
        if self.text_mask is not None:
            sample["text_mask"] = self.text_mask if self.text_mask.dim() == 1 else self.text_mask[slot]
        return sample
