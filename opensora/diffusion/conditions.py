"""Image/video conditioning (I2V, V2V) for training and inference, in latent time.

Condition types (drawn per sample during training with configured probabilities):

==========  ====================================================
t2v         nothing is given (all-zero condition input)
i2v_head    latent frame 0 is given
i2v_tail    the last latent frame is given
i2v_loop    the first and the last latent frames are given
v2v_head    the first ``k`` latent frames are given
v2v_tail    the last ``k`` latent frames are given
==========  ====================================================

``k`` (``v2v_frames``) is an int (latent frames) or a float in (0, 1) (fraction of ``T``, rounded, >= 1).
A type that would cover *every* latent frame (e.g. any type when ``T == 1``, loop when ``T == 2``) leaves
nothing to generate, so it is downgraded to ``t2v``; the returned ``type_ids`` say what was really used.

Model input convention (as Open-Sora 2.0): the noisy latent ``x_t`` is noisy on *all* frames, condition
frames included; the clean condition frames reach the model only through the extra input
``cond = cat([mask, x0 * mask], dim=1)`` of shape ``[B, C + 1, T, H, W]`` (mask channel first). The loss
ignores condition frames (``loss_mask = 1 - cond_mask``). Sampling follows the same convention: the
trajectory is never overwritten; ``paste_condition_frames`` may be applied to the *final* latent only, to
return the reference frames exactly (it does not feed back into the model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

CONDITION_TYPES = ("t2v", "i2v_head", "i2v_tail", "i2v_loop", "v2v_head", "v2v_tail")
T2V = CONDITION_TYPES.index("t2v")


@dataclass
class ConditionBatch:
    """What the training step needs from the condition builder."""

    cond: torch.Tensor  # [B, C + 1, T, H, W] model condition input (mask channel, then masked latents)
    cond_mask: torch.Tensor  # [B, 1, T, 1, 1] float, 1 on condition frames
    loss_mask: torch.Tensor  # [B, 1, T, 1, 1] float, 1 on frames the loss counts
    type_ids: torch.Tensor  # [B] long, index into CONDITION_TYPES actually used

    def type_names(self) -> list[str]:
        return [CONDITION_TYPES[i] for i in self.type_ids.tolist()]


def condition_probabilities(probs: Mapping[str, float]) -> torch.Tensor:
    """Normalised float ``[len(CONDITION_TYPES)]`` from a ``{name: weight}`` dict (missing names: 0)."""
    unknown = sorted(set(probs) - set(CONDITION_TYPES))
    if unknown:
        raise ValueError(f"unknown condition types {unknown}; expected names from {CONDITION_TYPES}")
    weights = torch.tensor([float(probs.get(name, 0.0)) for name in CONDITION_TYPES], dtype=torch.float64)
    if (weights < 0).any() or weights.sum() <= 0:
        raise ValueError(f"condition probabilities must be >= 0 with a positive sum, got {dict(probs)}")
    return (weights / weights.sum()).float()


def sample_condition_types(
    batch_size: int,
    probs: Mapping[str, float],
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Long ``[batch_size]`` of indices into ``CONDITION_TYPES`` drawn i.i.d. from ``probs``."""
    weights = condition_probabilities(probs)
    draw_device = generator.device if generator is not None else "cpu"
    ids = torch.multinomial(weights.to(draw_device), batch_size, replacement=True, generator=generator)
    return ids.to(device) if device is not None else ids


def num_v2v_frames(num_frames: int, v2v_frames: int | float) -> int:
    """Latent frames given for ``v2v_*`` types: an int as is, a float in (0, 1) as a rounded fraction of T."""
    if isinstance(v2v_frames, float) and 0.0 < v2v_frames < 1.0:
        k = round(v2v_frames * num_frames)
    elif isinstance(v2v_frames, int) and not isinstance(v2v_frames, bool) and v2v_frames >= 1:
        k = v2v_frames
    else:
        raise ValueError(f"v2v_frames must be an int >= 1 or a float in (0, 1), got {v2v_frames!r}")
    return max(1, min(k, num_frames))


def condition_frame_table(num_frames: int, v2v_frames: int | float = 0.5, device=None) -> torch.Tensor:
    """Bool ``[len(CONDITION_TYPES), T]``: which latent frames each type gives (all-covering rows -> t2v)."""
    frame = torch.arange(num_frames, device=device)
    k = num_v2v_frames(num_frames, v2v_frames)
    last = num_frames - 1
    rows = {
        "t2v": torch.zeros_like(frame, dtype=torch.bool),
        "i2v_head": frame == 0,
        "i2v_tail": frame == last,
        "i2v_loop": (frame == 0) | (frame == last),
        "v2v_head": frame < k,
        "v2v_tail": frame >= num_frames - k,
    }
    table = torch.stack([rows[name] for name in CONDITION_TYPES])
    table[table.all(dim=1)] = False  # nothing left to generate: treat as t2v
    return table


def effective_type_ids(type_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Map types whose table row is empty (downgraded) to ``t2v``."""
    is_empty = ~table.any(dim=1)
    return torch.where(is_empty[type_ids], torch.full_like(type_ids, T2V), type_ids)


def condition_mask_for_types(type_ids: torch.Tensor, num_frames: int, v2v_frames: int | float = 0.5) -> torch.Tensor:
    """Float ``[B, 1, T, 1, 1]`` condition mask (1 = given frame) gathered from the per-type table."""
    table = condition_frame_table(num_frames, v2v_frames, device=type_ids.device)
    return table[type_ids].float().view(type_ids.shape[0], 1, num_frames, 1, 1)


def make_cond_input(latents: torch.Tensor, cond_mask: torch.Tensor) -> torch.Tensor:
    """``cat([mask, latents * mask], dim=1)``: ``[B, C, T, H, W]`` -> ``[B, C + 1, T, H, W]``.

    ``cond_mask`` is ``[B, 1, T, 1, 1]`` or ``[B, 1, T, H, W]``. Frames outside the mask are zeroed, so the
    values of ``latents`` there do not matter.
    """
    if latents.ndim != 5 or cond_mask.ndim != 5 or cond_mask.shape[1] != 1:
        raise ValueError(
            f"expected latents [B,C,T,H,W] and cond_mask [B,1,T,1|H,1|W]; "
            f"got {tuple(latents.shape)} and {tuple(cond_mask.shape)}"
        )
    batch, _, frames, height, width = latents.shape
    mask = cond_mask.to(dtype=latents.dtype, device=latents.device).expand(batch, 1, frames, height, width)
    return torch.cat([mask, latents * mask], dim=1)


def build_training_condition(
    x0: torch.Tensor,
    probs: Mapping[str, float] | None = None,
    v2v_frames: int | float = 0.5,
    generator: torch.Generator | None = None,
    type_ids: torch.Tensor | None = None,
) -> ConditionBatch:
    """Draw a condition type per sample (or take ``type_ids``) and build cond input, cond mask and loss mask.

    ``x0`` are the clean latents ``[B, C, T, H, W]``; ``probs`` maps type names to probabilities
    (default: all t2v). Everything is built with tensor ops from the per-type frame table.
    """
    if x0.ndim != 5:
        raise ValueError(f"x0 must be latents [B, C, T, H, W], got shape {tuple(x0.shape)}")
    batch, _, frames = x0.shape[:3]
    if type_ids is None:
        type_ids = sample_condition_types(batch, probs or {"t2v": 1.0}, generator=generator, device=x0.device)
    type_ids = type_ids.to(device=x0.device, dtype=torch.long)
    if type_ids.shape != (batch,):
        raise ValueError(f"type_ids must have shape [{batch}], got {tuple(type_ids.shape)}")
    table = condition_frame_table(frames, v2v_frames, device=x0.device)
    type_ids = effective_type_ids(type_ids, table)
    cond_mask = table[type_ids].to(x0.dtype).view(batch, 1, frames, 1, 1)
    return ConditionBatch(
        cond=make_cond_input(x0, cond_mask),
        cond_mask=cond_mask,
        loss_mask=1.0 - cond_mask,
        type_ids=type_ids,
    )


# ----------------------------------------------------------------------------------------------------------
# Inference
# ----------------------------------------------------------------------------------------------------------
def build_inference_condition(
    num_frames: int,
    head: torch.Tensor | None = None,
    tail: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Condition input from reference latents placed at the start and/or end of ``num_frames`` latent frames.

    ``head`` ``[B, C, Th, H, W]`` fills frames ``[0, Th)``; ``tail`` ``[B, C, Tt, H, W]`` fills the last ``Tt``
    frames (i2v_head: head = image latent; i2v_tail: tail = image latent; i2v_loop: head = tail = image
    latent; v2v_head/tail: a video latent of k frames). Returns ``(cond [B, C+1, T, H, W], cond_mask
    [B, 1, T, 1, 1])``, laid out exactly as ``build_training_condition`` lays out the same type.
    """
    refs = [r for r in (head, tail) if r is not None]
    if not refs:
        raise ValueError("give at least one of head / tail reference latents (for t2v use a zero condition)")
    ref = refs[0]
    for r in refs:
        if r.ndim != 5 or r.shape[:2] != ref.shape[:2] or r.shape[3:] != ref.shape[3:]:
            raise ValueError(f"head/tail latents must be [B,C,t,H,W] with matching B,C,H,W; got {tuple(r.shape)}")
    used = (head.shape[2] if head is not None else 0) + (tail.shape[2] if tail is not None else 0)
    if used > num_frames:
        raise ValueError(f"head+tail references use {used} latent frames but only {num_frames} are generated")
    batch, channels, _, height, width = ref.shape
    latents = ref.new_zeros(batch, channels, num_frames, height, width)
    cond_mask = ref.new_zeros(batch, 1, num_frames, 1, 1)
    if head is not None:
        latents[:, :, : head.shape[2]] = head
        cond_mask[:, :, : head.shape[2]] = 1
    if tail is not None:
        latents[:, :, num_frames - tail.shape[2] :] = tail
        cond_mask[:, :, num_frames - tail.shape[2] :] = 1
    return make_cond_input(latents, cond_mask), cond_mask


def reference_condition(ref_latent: torch.Tensor, num_frames: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``build_inference_condition`` by condition-type name (``i2v_head``, ``i2v_tail``, ``i2v_loop``,
    ``v2v_head``, ``v2v_tail``); ``ref_latent`` is the encoded image (1 frame) or video clip."""
    if mode in ("i2v_head", "v2v_head"):
        return build_inference_condition(num_frames, head=ref_latent)
    if mode in ("i2v_tail", "v2v_tail"):
        return build_inference_condition(num_frames, tail=ref_latent)
    if mode == "i2v_loop":
        return build_inference_condition(num_frames, head=ref_latent, tail=ref_latent)
    raise ValueError(f"unknown reference mode '{mode}'; expected one of {CONDITION_TYPES[1:]}")


def null_condition_like(cond: torch.Tensor) -> torch.Tensor:
    """The t2v / "no image" condition input (all zeros), used for the unconditional CFG branch."""
    return torch.zeros_like(cond)


def paste_condition_frames(x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
    """Replace the condition frames of a *final* latent ``x`` by the reference latents held in ``cond``."""
    mask = cond[:, :1].to(x.dtype)
    return x * (1 - mask) + cond[:, 1:].to(x.dtype) * mask
