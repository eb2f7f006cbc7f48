"""The video shapes a model can take, checked from the config before anything is built.

Two rules, both read off the config (no network is built, no weights are read):

* frames: a causal autoencoder (HunyuanVideo: temporal compression 4) takes ``1 + c*k`` frames, a non-causal one
  ``c*k``; the latent frame count must then be divisible by the transformer's temporal patch;
* size: height and width must be divisible by the autoencoder's spatial compression times the transformer's spatial
  patch (PatchVAE 4 x patch 2 = 8 for the demo, HunyuanVideo 8 x 2 = 16).

Training checks every bucket of ``bucket_config`` (every aspect ratio of an area bucket, as the sampler sizes it),
sampling checks ``--num-frames`` and the size ``--resolution`` / ``--aspect-ratio`` give. A refusal names the flag or
bucket, the rule and the nearest shapes that fit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence, Tuple

from opensora.cli_errors import UserInputError

# diffusers' AutoencoderKLHunyuanVideo defaults (what ``HunyuanVideoVAE(config=...)`` builds without those keys)
_HUNYUAN_DEFAULTS = dict(spatial_compression_ratio=8, temporal_compression_ratio=4)


@dataclass(frozen=True)
class ShapeRule:
    """Divisors of a (VAE, transformer) pair: video frames and pixels that map onto whole latent patches."""

    temporal: int  # the VAE's temporal compression
    causal: bool  # first frame kept on its own: 1 + temporal*k frames
    spatial: int  # the VAE's spatial compression x the transformer's height patch
    temporal_patch: int = 1
    spatial_w: Optional[int] = None  # ... x its width patch, where that differs
    vae_name: str = "the autoencoder"

    def frames_fit(self, frames: int) -> bool:
        if frames < 1:
            return False
        if self.causal:
            latent, rest = divmod(frames - 1, self.temporal)
            latent += 1
        else:
            latent, rest = divmod(frames, self.temporal)
        return rest == 0 and latent >= 1 and latent % self.temporal_patch == 0

    def frames_rule(self) -> str:
        step = self.temporal * self.temporal_patch
        if self.causal:
            return f"1 + {self.temporal}*k frames (causal temporal compression {self.temporal})"
        return f"a multiple of {step} frames"

    def nearest_frames(self, frames: int) -> Tuple[int, ...]:
        below = next((f for f in range(frames - 1, 0, -1) if self.frames_fit(f)), None)
        above = next(
            f for f in range(frames + 1, frames + 4 * self.temporal * self.temporal_patch + 2) if self.frames_fit(f)
        )
        return tuple(f for f in (below, above) if f is not None)

    def check_frames(self, frames, what: str) -> None:
        if not self.frames_fit(int(frames)):
            options = " or ".join(map(str, self.nearest_frames(int(frames))))
            raise UserInputError(f"{what}: {self.vae_name} needs {self.frames_rule()}, got {frames}: use {options}")

    def check_size(self, height: int, width: int, what: str) -> None:
        sh, sw = self.spatial, self.spatial_w or self.spatial
        if height % sh or width % sw or height < 1 or width < 1:
            near = lambda v, d: max(d, round(v / d) * d)  # noqa: E731
            multiples = f"{sh}" if sh == sw else f"{sh} (height) and {sw} (width)"
            raise UserInputError(
                f"{what} gives {height}x{width} pixels, but height and width must be multiples of {multiples} "
                f"({self.vae_name}'s spatial compression x the transformer's patch): use e.g. "
                f"{near(height, sh)}x{near(width, sw)}"
            )


def _vae_divisors(vae_cfg: Mapping) -> Optional[Tuple[int, int, bool, str]]:
    """(spatial, temporal, causal, name) of a VAE config, or None for a type this module does not know."""
    kind = vae_cfg.get("type")
    if kind == "PatchVAE":
        return int(vae_cfg.get("patch_size", 2)), int(vae_cfg.get("temporal_patch_size", 1)), False, "PatchVAE"
    if kind == "HunyuanVideoVAE":
        config = dict(_HUNYUAN_DEFAULTS)
        if vae_cfg.get("from_pretrained"):
            path = Path(str(vae_cfg["from_pretrained"])) / str(vae_cfg.get("subfolder") or "") / "config.json"
            if not path.is_file():
                return None  # a hub id or a missing folder: the VAE's own loader reports it
            config.update(json.loads(path.read_text()))
        config.update(vae_cfg.get("config") or {})
        spatial, temporal = int(config["spatial_compression_ratio"]), int(config["temporal_compression_ratio"])
        return spatial, temporal, True, "HunyuanVideoVAE"
    return None


def shape_rule(vae_cfg: Optional[Mapping], model_cfg: Optional[Mapping]) -> Optional[ShapeRule]:
    """The rule of a VAE and transformer config pair, or None when either is missing or of an unknown kind."""
    if not vae_cfg or not model_cfg:
        return None
    divisors = _vae_divisors(vae_cfg)
    if divisors is None:
        return None
    spatial, temporal, causal, name = divisors
    patch: Sequence[int] = model_cfg.get("patch_size", (1, 2, 2)) or (1, 2, 2)
    pt, ph, pw = (int(p) for p in patch)
    return ShapeRule(temporal, causal, spatial * ph, pt, spatial * pw, name)


def check_bucket_config(bucket_config: Mapping, rule: Optional[ShapeRule], size_multiple: int = 16) -> None:
    """Every (frames, height, width) the buckets can produce fits ``rule`` (a ``UserInputError`` naming the bucket)."""
    if rule is None or not bucket_config:
        return
    from opensora.datasets.buckets import BucketTable

    try:
        table = BucketTable(bucket_config, size_multiple=size_multiple)
    except ValueError as error:
        raise UserInputError(f"bucket_config: {error}") from None
    for index, bucket in enumerate(table.frame_buckets):
        name = bucket.resolution.name
        rule.check_frames(bucket.num_frames, f"bucket_config[{name!r}][{bucket.num_frames}]")
        ratios = [None] if bucket.resolution.exact_size is not None else range(len(table.aspect_ratios))
        for aspect in ratios:
            _, height, width = table.bucket_shape(index, aspect or 0)
            where = f"bucket_config[{name!r}]" + (
                "" if aspect is None else f" at aspect ratio {table.aspect_ratios[aspect][0]}"
            )
            rule.check_size(height, width, where)


def check_training_shapes(cfg: Mapping) -> None:
    """Training: every bucket against the VAE and every trained role's transformer."""
    from opensora.role_config import role_configs

    for role in role_configs(cfg).values():
        check_bucket_config(cfg.get("bucket_config") or {}, shape_rule(cfg.get("vae"), role.get("model")))


def check_sampling_shape(cfg: Mapping, role: str, num_frames: int, height: int, width: int, resolution: str) -> None:
    """Sampling: ``--num-frames`` and the size from ``--resolution`` / ``--aspect-ratio`` against the role's network."""
    from opensora.role_config import role_configs

    model_cfg = role_configs(cfg).get(role, {}).get("model")
    rule = shape_rule(cfg.get("vae"), model_cfg)
    if rule is None:
        return
    rule.check_frames(num_frames, "--num-frames")
    rule.check_size(height, width, f"--resolution {resolution}")
