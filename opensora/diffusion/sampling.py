"""Euler sampling of the flow-matching ODE, with classifier-free guidance.

Schedule: ``timesteps_for_sampling(n, alpha) = time_shift(linspace(1, 0, n + 1), alpha)`` -- ``n + 1``
descending values from exactly 1 (noise) to exactly 0 (data), shifted with the same ``time_shift`` and
``shift_alpha_for`` as training. Distilled few-step students pass an explicit step list instead
(used as given, no shift; a final 0 is appended when missing).

Step: ``x_next = x + (t_next - t) * v(x, t)`` (``t_next < t``, so it moves against the velocity
``eps - x0``). This matches diffusers' ``FlowMatchEulerDiscreteScheduler`` with ``shift=alpha``,
``use_dynamic_shifting=False`` and ``set_timesteps(sigmas=linspace(1, 0, n + 1)[:-1])``.

Guidance (see ``guidance.py`` for the formulas): ``sample`` runs

* 1 pass  when no unconditional inputs are given;
* 2 passes (cond, null text) batched along dim 0 -- ``v = u + w_txt (c - u)``;
* 3 passes (cond, null text with image, null text without image) when ``uncond_all_kwargs`` is given --
  ``v = u_noimg + w_img (u_img - u_noimg) + w_txt (c - u_img)``.

The model is called as ``model_fn(x, t, **kwargs)`` with ``t`` a float ``[B * passes]`` tensor; tensor
kwargs of the branches are concatenated along the batch, other kwargs must be identical in all branches.
The ODE state is kept in float32 whatever the dtype of ``noise`` and of the model output.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from tqdm.auto import tqdm

from .flow_matching import time_shift
from .guidance import image_text_cfg, text_cfg


def timesteps_for_sampling(num_steps: int, shift_alpha: float = 1.0, device=None) -> torch.Tensor:
    """Float32 ``[num_steps + 1]``: ``time_shift(linspace(1, 0, num_steps + 1), shift_alpha)``."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    # Computed in float64 and rounded once, so the endpoints are exact and no float32 error accumulates.
    times = time_shift(torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64), shift_alpha)
    return times.to(device=device, dtype=torch.float32)


def timesteps_from_list(step_list: Sequence[float], device=None) -> torch.Tensor:
    """Explicit schedule (e.g. a distilled student's ``[1.0, 0.9, 0.7, 0.4]``), strictly descending in [0, 1].

    The values are used as given (no shift); 0 is appended when the list does not end there.
    """
    steps = torch.as_tensor(list(step_list), dtype=torch.float32)  # checked on the host: no device syncs
    if steps.ndim != 1 or steps.numel() == 0:
        raise ValueError(f"step_list must be a non-empty 1-D list of times, got {step_list!r}")
    if steps.min() < 0 or steps.max() > 1 or not bool((steps[1:] < steps[:-1]).all()):
        raise ValueError(f"step_list must be strictly descending inside [0, 1], got {steps.tolist()}")
    if steps[-1] != 0:
        steps = torch.cat([steps, steps.new_zeros(1)])
    return steps.to(device)


def euler_step(x: torch.Tensor, velocity: torch.Tensor, t, t_next) -> torch.Tensor:
    """``x + (t_next - t) * velocity`` (``t``/``t_next`` scalars or ``[B]``)."""
    dt = torch.as_tensor(t_next, dtype=x.dtype, device=x.device) - torch.as_tensor(t, dtype=x.dtype, device=x.device)
    if dt.ndim == 1:
        dt = dt.view(-1, *([1] * (x.ndim - 1)))
    return x + dt * velocity.to(x.dtype)


def _concat_branches(branches: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Merge per-branch kwargs: tensors concatenated on dim 0, other values must agree."""
    keys = set(branches[0])
    for branch in branches[1:]:
        if set(branch) != keys:
            raise ValueError(f"guidance branches have different kwargs: {sorted(keys)} vs {sorted(branch)}")
    merged = {}
    for key in branches[0]:
        values = [branch[key] for branch in branches]
        if all(isinstance(v, torch.Tensor) for v in values):
            merged[key] = torch.cat(values, dim=0)
        elif any(isinstance(v, torch.Tensor) for v in values):
            raise ValueError(
                f"kwarg '{key}' is a tensor in some guidance branches only; "
                "use a zero condition (null_condition_like) instead of None"
            )
        else:
            if any(v != values[0] for v in values[1:]):
                raise ValueError(f"non-tensor kwarg '{key}' differs between guidance branches: {values}")
            merged[key] = values[0]
    return merged


def guided_velocity(
    model_fn: Callable[..., torch.Tensor],
    x: torch.Tensor,
    t: float | torch.Tensor,
    cond_kwargs: Mapping[str, Any],
    uncond_kwargs: Mapping[str, Any] | None = None,
    uncond_all_kwargs: Mapping[str, Any] | None = None,
    guidance_scale: float = 1.0,
    image_guidance_scale: float = 1.0,
) -> torch.Tensor:
    """One (batched) model evaluation with CFG at time ``t``; see the module docstring for the passes."""
    branches = [cond_kwargs]
    if uncond_kwargs is not None:
        branches.append(uncond_kwargs)
    if uncond_all_kwargs is not None:
        if uncond_kwargs is None:
            raise ValueError("uncond_all_kwargs (no text, no image) needs uncond_kwargs (no text, image) too")
        branches.append(uncond_all_kwargs)
    passes = len(branches)
    batch = x.shape[0]
    t_vec = torch.as_tensor(t, dtype=torch.float32, device=x.device).expand(batch)
    x_in = torch.cat([x] * passes, dim=0) if passes > 1 else x
    out = model_fn(x_in, t_vec.repeat(passes), **_concat_branches(branches))
    if out.shape != x_in.shape:
        raise ValueError(f"model_fn returned shape {tuple(out.shape)}, expected {tuple(x_in.shape)}")
    out = out.float()
    if passes == 1:
        return out
    chunks = out.chunk(passes, dim=0)
    if passes == 2:
        return text_cfg(chunks[0], chunks[1], guidance_scale)
    return image_text_cfg(chunks[0], chunks[1], chunks[2], guidance_scale, image_guidance_scale)


def sample(
    model_fn: Callable[..., torch.Tensor],
    noise: torch.Tensor,
    num_steps: int | None = None,
    shift_alpha: float = 1.0,
    cond_kwargs: Mapping[str, Any] | None = None,
    uncond_kwargs: Mapping[str, Any] | None = None,
    uncond_all_kwargs: Mapping[str, Any] | None = None,
    guidance_scale: float = 1.0,
    image_guidance_scale: float = 1.0,
    step_list: Sequence[float] | None = None,
    progress: bool = True,
    return_trajectory: bool = False,
    no_grad: bool = True,
):
    """Integrate from ``noise`` (t = 1) to t = 0 with Euler steps; returns the float32 sample.

    Give ``num_steps`` (shifted uniform schedule) or ``step_list`` (explicit, unshifted). With
    ``return_trajectory`` returns ``(x0, [x at each schedule time, noise first, result last])``.
    ``guidance_scale == 1`` with no image guidance skips the unconditional passes.
    """
    if (num_steps is None) == (step_list is None):
        raise ValueError("give exactly one of num_steps or step_list")
    times = (
        timesteps_for_sampling(num_steps, shift_alpha, device=noise.device)
        if step_list is None
        else timesteps_from_list(step_list, device=noise.device)
    )
    cond_kwargs = dict(cond_kwargs or {})
    if uncond_kwargs is None and (guidance_scale != 1.0 or image_guidance_scale != 1.0):
        raise ValueError(f"guidance scales {guidance_scale}/{image_guidance_scale} need uncond_kwargs (null text)")
    if uncond_all_kwargs is None and image_guidance_scale != 1.0:
        raise ValueError(f"image_guidance_scale={image_guidance_scale} needs uncond_all_kwargs (no text, no image)")
    if guidance_scale == 1.0 and (uncond_all_kwargs is None or image_guidance_scale == 1.0):
        uncond_kwargs = uncond_all_kwargs = None  # the combination would return cond exactly
    x = noise.float()
    trajectory = [x] if return_trajectory else None
    grad_context = torch.no_grad() if no_grad else torch.enable_grad()
    with grad_context:
        steps = range(len(times) - 1)
        for i in tqdm(steps, disable=not progress, desc="sampling", leave=False):
            t, t_next = times[i], times[i + 1]
            v = guided_velocity(
                model_fn, x, t, cond_kwargs, uncond_kwargs, uncond_all_kwargs, guidance_scale, image_guidance_scale
            )
            x = euler_step(x, v, t, t_next)
            if return_trajectory:
                trajectory.append(x)
    return (x, trajectory) if return_trajectory else x
