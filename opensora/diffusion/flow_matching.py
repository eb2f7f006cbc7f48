"""Rectified-flow (flow-matching) math shared by training and sampling.

Convention (pinned project-wide, no ``sigma_min``):

* ``t`` in [0, 1]; ``t = 1`` is pure noise, ``t = 0`` is data.
* ``x_t = (1 - t) * x0 + t * eps`` and the model predicts the velocity ``v = eps - x0 = d x_t / d t``.
* Hence ``x0 = x_t - t * v`` and ``eps = x_t + (1 - t) * v``.

Timestep shift: ``time_shift(t, a) = a t / (1 + (a - 1) t)`` pushes ``t`` towards the noisy end for ``a > 1``.
Larger videos need more noise to destroy the same amount of signal, so ``a`` grows with the square root of
the number of latent tokens (``shift_alpha_for``). Training and inference call the same two functions.

All functions are pure and vectorised over the batch: ``t`` is a scalar or a ``[B]`` tensor that is
broadcast over the trailing dimensions of ``[B, ...]`` tensors.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

TIMESTEP_KINDS = ("logit_normal", "uniform")
# Keeps uniform samples strictly inside (0, 1); logit-normal samples are inside by construction.
_UNIFORM_EPS = 1e-5


# ----------------------------------------------------------------------------------------------------------
# Timesteps
# ----------------------------------------------------------------------------------------------------------
def sample_timesteps(
    batch_size: int,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    kind: str = "logit_normal",
    mean: float = 0.0,
    std: float = 1.0,
) -> torch.Tensor:
    """Draw training timesteps ``t`` in (0, 1), float32 ``[batch_size]`` (before any shift).

    ``logit_normal``: ``t = sigmoid(mean + std * z)``, ``z ~ N(0, 1)`` (median ``sigmoid(mean)``).
    ``uniform``: ``t ~ U(eps, 1 - eps)``.
    Random numbers are drawn on the generator's device (so a seeded CPU generator gives the same ``t`` on any
    device) and then moved to ``device``.
    """
    if kind not in TIMESTEP_KINDS:
        raise ValueError(f"unknown timestep kind '{kind}'; expected one of {TIMESTEP_KINDS}")
    if std <= 0:
        raise ValueError(f"timestep std must be positive, got {std}")
    draw_device = generator.device if generator is not None else (device or "cpu")
    if kind == "logit_normal":
        z = torch.randn(batch_size, generator=generator, device=draw_device, dtype=torch.float32)
        t = torch.sigmoid(mean + std * z)
    else:
        u = torch.rand(batch_size, generator=generator, device=draw_device, dtype=torch.float32)
        t = _UNIFORM_EPS + (1.0 - 2.0 * _UNIFORM_EPS) * u
    return t.to(device) if device is not None else t


def time_shift(t, alpha: float):
    """``alpha * t / (1 + (alpha - 1) * t)``: monotone on [0, 1], fixes 0 and 1; ``alpha = 1`` is identity."""
    if alpha <= 0:
        raise ValueError(f"shift alpha must be positive, got {alpha}")
    return alpha * t / (1 + (alpha - 1) * t)


def inverse_time_shift(s, alpha: float):
    """Inverse of ``time_shift``: ``t = s / (alpha - (alpha - 1) * s)`` (equals ``time_shift(s, 1/alpha)``)."""
    if alpha <= 0:
        raise ValueError(f"shift alpha must be positive, got {alpha}")
    return s / (alpha - (alpha - 1) * s)


def num_latent_tokens(latent_size: Sequence[int], patch_size: Sequence[int] = (1, 2, 2)) -> int:
    """Tokens the transformer sees for a latent of size ``(T, H, W)`` cut into ``patch_size`` patches."""
    if len(latent_size) != 3 or len(patch_size) != 3:
        raise ValueError(f"latent_size and patch_size must be (T, H, W); got {latent_size}, {patch_size}")
    return math.prod(math.ceil(s / p) for s, p in zip(latent_size, patch_size))


def shift_alpha_for(
    latent_size: Sequence[int] | int,
    patch_size: Sequence[int] = (1, 2, 2),
    base_tokens: int = 256,
    base_shift: float = 1.0,
    min_shift: float | None = 1.0,
    max_shift: float | None = None,
) -> float:
    """Resolution/length-dependent shift: ``alpha = base_shift * sqrt(tokens / base_tokens)``, clamped.

    ``latent_size`` is either the latent ``(T, H, W)`` (tokens counted after patching) or a token count.
    Frames and pixels are treated alike (one token-count ratio). With the defaults, a single 256px frame
    (32x32 latent, 2x2 patches = 256 tokens) gets ``alpha = 1`` and ``n`` such latent frames get
    ``sqrt(n)`` -- the Open-Sora 2.0 ``sqrt(num_frames)`` factor -- while doubling height and width
    doubles ``alpha``. ``min_shift`` (default 1: never shift towards data) and ``max_shift`` clamp it.
    Inference must call this with the same arguments as training.
    """
    if isinstance(latent_size, int):
        tokens = latent_size
    else:
        tokens = num_latent_tokens(latent_size, patch_size)
    if tokens <= 0 or base_tokens <= 0 or base_shift <= 0:
        raise ValueError(f"tokens ({tokens}), base_tokens ({base_tokens}) and base_shift ({base_shift}) must be > 0")
    alpha = base_shift * math.sqrt(tokens / base_tokens)
    if min_shift is not None:
        alpha = max(alpha, min_shift)
    if max_shift is not None:
        alpha = min(alpha, max_shift)
    return alpha


def sample_training_timesteps(
    batch_size: int,
    shift_alpha: float = 1.0,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    kind: str = "logit_normal",
    mean: float = 0.0,
    std: float = 1.0,
) -> torch.Tensor:
    """``time_shift(sample_timesteps(...), shift_alpha)``: what a training step feeds the model."""
    t = sample_timesteps(batch_size, generator=generator, device=device, kind=kind, mean=mean, std=std)
    return time_shift(t, shift_alpha)


# ----------------------------------------------------------------------------------------------------------
# Interpolation and targets
# ----------------------------------------------------------------------------------------------------------
def _broadcast_time(t, like: torch.Tensor) -> torch.Tensor:
    """``t`` (scalar, ``[]`` or ``[B]``) as a tensor shaped ``[B, 1, 1, ...]`` matching ``like``.

    A host number stays a 0-dim CPU tensor of ``like``'s dtype: device kernels take it as a scalar of the same
    value, so the result is the same, without the blocking host-to-device copy a device scalar would cost
    (it stalled the streaming samplers' loops once per re-noised step)."""
    if isinstance(t, (int, float)):
        return torch.tensor(t, dtype=like.dtype)
    t = torch.as_tensor(t, dtype=like.dtype, device=like.device)
    if t.ndim == 0:
        return t
    if t.ndim != 1 or t.shape[0] != like.shape[0]:
        raise ValueError(f"t must be a scalar or [B] with B={like.shape[0]}, got shape {tuple(t.shape)}")
    return t.view(-1, *([1] * (like.ndim - 1)))


def add_noise(x0: torch.Tensor, noise: torch.Tensor, t) -> torch.Tensor:
    """``x_t = (1 - t) * x0 + t * noise``."""
    if x0.shape != noise.shape:
        raise ValueError(f"x0 {tuple(x0.shape)} and noise {tuple(noise.shape)} must have the same shape")
    tb = _broadcast_time(t, x0)
    return (1 - tb) * x0 + tb * noise


def noise_forward(x_c: torch.Tensor, noise: torch.Tensor, c: float, s: float) -> torch.Tensor:
    """A latent at time ``c`` carried forward to time ``s >= c`` with fresh noise (host floats, ``0 <= c < 1``):
    ``x_s = a x_c + b noise`` with ``a = (1 - s) / (1 - c)`` and ``b = sqrt(s^2 - (a c)^2)``. If ``x_c = (1 - c) x0
    + c eps``, then ``x_s = (1 - s) x0 + (a c eps + b noise)``, whose noise part has variance ``s^2``: the marginal of
    ``add_noise(x0, ., s)``. ``c = 0`` is ``add_noise(x_c, noise, s)``; ``s = 1`` is ``noise``."""
    c, s = float(c), float(s)
    if not 0.0 <= c < 1.0 or not c <= s <= 1.0:
        raise ValueError(f"noise_forward needs 0 <= c < 1 and c <= s <= 1, got c={c}, s={s}")
    if x_c.shape != noise.shape:
        raise ValueError(f"x_c {tuple(x_c.shape)} and noise {tuple(noise.shape)} must have the same shape")
    a = (1.0 - s) / (1.0 - c)
    b = math.sqrt(max(s * s - (a * c) ** 2, 0.0))
    return a * x_c + b * noise


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Velocity the model learns: ``noise - x0``."""
    return noise - x0


def predict_x0(x_t: torch.Tensor, velocity: torch.Tensor, t) -> torch.Tensor:
    """Clean sample implied by a velocity at time ``t``: ``x_t - t * v``."""
    return x_t - _broadcast_time(t, x_t) * velocity


def predict_noise(x_t: torch.Tensor, velocity: torch.Tensor, t) -> torch.Tensor:
    """Noise implied by a velocity at time ``t``: ``x_t + (1 - t) * v``."""
    return x_t + (1 - _broadcast_time(t, x_t)) * velocity


# ----------------------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------------------
def masked_mse_per_sample(
    pred: torch.Tensor, target: torch.Tensor, loss_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample mean squared error over counted elements, computed in float32.

    ``loss_mask`` broadcasts to ``pred`` (e.g. ``[B, 1, T, 1, 1]`` or ``[B, 1, T, H, W]``; 1 = counts). The
    normaliser is the number of counted *elements* (mask broadcast over channels/pixels), so an all-ones mask
    gives exactly ``mean((pred - target) ** 2)`` per sample. Returns ``(loss [B], counted [B])``; samples with
    nothing counted get loss 0. Masked-out elements get exactly zero gradient (``torch.where``, so even a
    non-finite prediction there cannot leak in).
    """
    if pred.shape != target.shape:
        raise ValueError(f"pred {tuple(pred.shape)} and target {tuple(target.shape)} must have the same shape")
    sq_err = (pred.float() - target.float()).pow(2)
    reduce_dims = tuple(range(1, sq_err.ndim))
    if loss_mask is None:
        counted = torch.full((sq_err.shape[0],), sq_err[0].numel(), dtype=torch.float32, device=sq_err.device)
        return sq_err.mean(dim=reduce_dims), counted
    if loss_mask.ndim != pred.ndim or loss_mask.shape[0] != pred.shape[0]:
        raise ValueError(
            f"loss_mask {tuple(loss_mask.shape)} must have pred's rank and batch size ({tuple(pred.shape)})"
        )
    weights = loss_mask.to(device=sq_err.device, dtype=torch.float32).expand_as(sq_err)
    weighted = torch.where(weights > 0, sq_err * weights, torch.zeros_like(sq_err))
    counted = weights.sum(dim=reduce_dims)
    per_sample = weighted.sum(dim=reduce_dims) / counted.clamp_min(1e-12)
    per_sample = torch.where(counted > 0, per_sample, torch.zeros_like(per_sample))
    return per_sample, counted


def masked_mse(pred: torch.Tensor, target: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Scalar flow-matching loss: per-sample masked MSE, averaged over samples that count anything.

    Each sample weighs the same whatever its number of condition frames (unlike the seed's global
    ``sum / mask.sum()``). Samples whose mask is all zero are left out of the average; if no sample counts
    anything the result is a zero that is still attached to ``pred``'s graph.
    """
    per_sample, counted = masked_mse_per_sample(pred, target, loss_mask)
    has_elements = (counted > 0).float()
    return (per_sample * has_elements).sum() / has_elements.sum().clamp_min(1.0)


# ----------------------------------------------------------------------------------------------------------
# Classifier-free-guidance dropout
# ----------------------------------------------------------------------------------------------------------
def sample_drop_mask(
    batch_size: int, drop_prob: float, generator: torch.Generator | None = None, device=None
) -> torch.Tensor:
    """Bool ``[batch_size]``: True where the condition is replaced by its null version."""
    if not 0.0 <= drop_prob <= 1.0:
        raise ValueError(f"drop_prob must be in [0, 1], got {drop_prob}")
    draw_device = generator.device if generator is not None else (device or "cpu")
    drop = torch.rand(batch_size, generator=generator, device=draw_device) < drop_prob
    return drop.to(device) if device is not None else drop


def drop_text(
    text: Mapping[str, torch.Tensor],
    null_text: Mapping[str, torch.Tensor],
    drop_prob: float,
    generator: torch.Generator | None = None,
    drop: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Replace each sample's text condition by the null one with probability ``drop_prob`` (CFG training).

    ``text`` is the text conditioner's output (``text_emb [B,L,D]``, ``text_mask [B,L]``, ``pooled [B,P]``);
    ``null_text`` has the same keys with batch ``B`` or 1 (it broadcasts). Every key of ``text`` is
    swapped with one shared per-sample draw, so embedding, mask and pooled vector stay consistent. Pass
    ``drop`` (bool ``[B]``) to force the choice. Returns ``(new_text, drop)``.
    """
    missing = [key for key in text if key not in null_text]
    if missing:
        raise KeyError(f"null_text lacks keys {missing} present in text")
    batch_size = next(iter(text.values())).shape[0]
    device = next(iter(text.values())).device
    if drop is None:
        drop = sample_drop_mask(batch_size, drop_prob, generator=generator, device=device)
    drop = drop.to(device=device, dtype=torch.bool)
    out = {}
    for key, value in text.items():
        null_value = null_text[key].to(device=value.device, dtype=value.dtype)
        if null_value.shape[1:] != value.shape[1:]:
            raise ValueError(f"null_text['{key}'] {tuple(null_value.shape)} does not match {tuple(value.shape)}")
        choose_null = drop.view(-1, *([1] * (value.ndim - 1)))
        out[key] = torch.where(choose_null, null_value, value)
    return out, drop
