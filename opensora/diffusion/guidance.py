"""Classifier-free guidance combinations (one convention everywhere).

Model outputs are velocities. Notation for one denoising step:

* ``c``        = model(x, text, image)            (fully conditional)
* ``u_img``    = model(x, null text, image)       (image kept, text dropped)
* ``u_noimg``  = model(x, null text, no image)    (nothing; "no image" = all-zero condition input)

Text-only guidance (2 passes, no image condition):

    v = u + w_txt * (c - u)                                   with u = model(x, null text)

Image + text guidance (3 passes, I2V/V2V):

    v = u_noimg + w_img * (u_img - u_noimg) + w_txt * (c - u_img)

Both are evaluated in the algebraically equal form ``c + (w - 1) * (c - u) [+ ...]`` so that guidance
scale 1 returns ``c`` bit for bit.
"""

from __future__ import annotations

import torch


def text_cfg(cond: torch.Tensor, uncond: torch.Tensor, text_scale: float) -> torch.Tensor:
    """``uncond + text_scale * (cond - uncond)``."""
    return cond + (text_scale - 1.0) * (cond - uncond)


def image_text_cfg(
    cond: torch.Tensor,
    uncond_text: torch.Tensor,
    uncond_all: torch.Tensor,
    text_scale: float,
    image_scale: float,
) -> torch.Tensor:
    """``u_noimg + image_scale * (u_img - u_noimg) + text_scale * (c - u_img)``.

    ``cond`` = c, ``uncond_text`` = u_img (null text, image kept), ``uncond_all`` = u_noimg.
    """
    return cond + (text_scale - 1.0) * (cond - uncond_text) + (image_scale - 1.0) * (uncond_text - uncond_all)
