"""Pixel transforms: resize to cover a target size, centre crop, scale uint8 to [-1, 1]."""

import math
from typing import Tuple

import numpy as np
import torch
import torch.nn.functional as F


def cover_size(height: int, width: int, target_height: int, target_width: int) -> Tuple[int, int]:
    """Smallest size with the source aspect ratio that covers ``target`` (both sides >= target)."""
    scale = max(target_height / height, target_width / width)
    # ceil so rounding never leaves a side one pixel short of the crop
    return max(target_height, math.ceil(height * scale - 1e-6)), max(target_width, math.ceil(width * scale - 1e-6))


def resize_center_crop(frames: np.ndarray, size: Tuple[int, int], interpolation: str = "bilinear") -> torch.Tensor:
    """uint8 frames [T, H, W, 3] -> float32 video [3, T, h, w] in [-1, 1].

    Resized (aspect kept) to cover ``size``, then centre-cropped to it."""
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected uint8 frames [T, H, W, 3], got {frames.dtype} {frames.shape}")
    target_height, target_width = size
    # torch.from_numpy needs a writable array (it warns on a read-only one, e.g. np.asarray of a PIL image): copy only then
    video = torch.from_numpy(np.require(frames, requirements=("C", "W"))).permute(0, 3, 1, 2).float()  # [T, 3, H, W]
    height, width = video.shape[-2:]
    resized_height, resized_width = cover_size(height, width, target_height, target_width)
    if (resized_height, resized_width) != (height, width):
        smooth = interpolation in ("bilinear", "bicubic")
        extra = dict(antialias=True, align_corners=False) if smooth else {}
        video = F.interpolate(video, size=(resized_height, resized_width), mode=interpolation, **extra)
    top = (resized_height - target_height) // 2
    left = (resized_width - target_width) // 2
    video = video[:, :, top : top + target_height, left : left + target_width]
    video = (video / 127.5 - 1.0).clamp_(-1.0, 1.0)
    return video.permute(1, 0, 2, 3).contiguous()  # [3, T, h, w]
