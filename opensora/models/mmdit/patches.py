"""Video latents <-> patch tokens, in the token order the whole model (RoPE ids, causal chunks, caches) assumes."""

from typing import Sequence

import torch


def patchify(x: torch.Tensor, patch_size: Sequence[int]) -> torch.Tensor:
    """[B, C, T, H, W] -> [B, (T/pt)(H/ph)(W/pw), C*pt*ph*pw]; features ordered (c, pt, ph, pw)."""
    b, c, t, h, w = x.shape
    pt, ph, pw = patch_size
    if t % pt or h % ph or w % pw:
        raise ValueError(f"latent size (T,H,W)=({t},{h},{w}) is not divisible by patch_size {tuple(patch_size)}")
    x = x.reshape(b, c, t // pt, pt, h // ph, ph, w // pw, pw)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, (t // pt) * (h // ph) * (w // pw), c * pt * ph * pw)


def unpatchify(tokens: torch.Tensor, grid: Sequence[int], patch_size: Sequence[int]) -> torch.Tensor:
    """Inverse of ``patchify``: [B, t*h*w, C*pt*ph*pw] with grid (t, h, w) -> [B, C, t*pt, h*ph, w*pw]."""
    b = tokens.shape[0]
    gt, gh, gw = grid
    pt, ph, pw = patch_size
    x = tokens.reshape(b, gt, gh, gw, -1, pt, ph, pw)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, -1, gt * pt, gh * ph, gw * pw)
