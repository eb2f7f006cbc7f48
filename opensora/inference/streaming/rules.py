"""The decisions every streaming chunk loop shares, in one place: the one-GPU generator (generator.py), the two-GPU
pipeline's causal stages (``pipeline_parallel.streaming_stages``) and the tests' reference loop all call these, so
they cannot drift apart (a mask decision written twice once did).

* The step rule (``rollout_step``): ``euler`` moves ``x`` along the velocity to the next time; ``renoise`` takes the
  predicted clean latent ``x0 = x - t v`` and re-noises it with fresh noise at the next time (Self-Forcing's
  few-step rollout), or keeps ``x0`` at the final time 0.
* The noise order (``StreamNoise``): per chunk the initial latent, then one draw for every re-noised step, then one
  for the context time when it is > 0 (the refill re-runs the finished chunk noised to it); one CPU generator per
  sample, so a sample's noise does not depend on its batch.
* The padding decision (``text_has_padding``): whether any text token of any CFG row is padding, read once per
  video. Without padding the text-cached passes attend without a mask, which another attention kernel computes:
  every loop must decide alike, or their outputs differ in the last bits.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Mapping, Optional, Sequence, Tuple

import torch

from opensora.diffusion import flow_matching as fm
from opensora.inference.sampler import noise_from_generators
from opensora.inference.streaming import ROLLOUTS


def check_rollout(rollout: str) -> str:
    if rollout not in ROLLOUTS:
        raise ValueError(f"unknown rollout {rollout!r}; choose one of {ROLLOUTS}")
    return rollout


def rollout_step(
    x: torch.Tensor, v: torch.Tensor, t: float, t_next: float, rollout: str, noise: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """One denoising step of a chunk (host floats ``t``, ``t_next``): ``euler``: ``x + (t_next - t) v``;
    ``renoise``: ``x0 = x - t v``, then ``x0`` at ``t_next == 0`` else ``add_noise(x0, noise, t_next)`` (``noise``:
    the step's draw of ``StreamNoise``)."""
    if rollout == "euler":
        return x + (t_next - t) * v
    check_rollout(rollout)
    x0 = x - t * v
    return x0 if t_next == 0 else fm.add_noise(x0, noise, t_next)


def step_draws_noise(rollout: str, t_next: float) -> bool:
    """Whether a step to ``t_next`` draws noise: ``renoise`` re-noises to a next time that is not 0."""
    return rollout == "renoise" and t_next != 0


def text_has_padding(text_mask: Optional[torch.Tensor]) -> bool:
    """Whether any token of ``text_mask`` [rows, L] (every CFG row of a video; None: none padded) is padding. A host
    read when the mask lives on the GPU: once per video."""
    return text_mask is not None and not bool(text_mask.bool().all())


def rows_of_passes(texts: Sequence[Mapping], key: str) -> Optional[torch.Tensor]:
    """The CFG passes' ``key`` (``text_emb``, ``text_mask``, ``pooled``) as rows of one batch, cond first (a missing
    text mask: every token valid)."""
    parts = [t.get(key) for t in texts]
    if all(p is None for p in parts):
        return None
    if key == "text_mask":
        parts = [
            torch.ones(t["text_emb"].shape[:2], dtype=torch.bool, device=t["text_emb"].device) if p is None else p
            for t, p in zip(texts, parts)
        ]
    return torch.cat(parts)


class StreamNoise:
    """One video's (or prompt group's) noise in the loops' order (see the module docstring): ``initial``, then
    ``for_step`` at every step, then ``for_context``, chunk after chunk; ``chunk`` draws a whole chunk's at once.

    Args:
        seeds: one per sample. channels / hw: the latent's channels and (H, W). times: the chunk's schedule with
        the final 0. rollout: the step rule. context_time: the refill's time. device: where the draws go (drawn on the
        CPU, copied without blocking; None: stay on the CPU).
    """

    def __init__(
        self,
        seeds: Sequence[int],
        channels: int,
        hw: Sequence[int],
        times: Sequence[float],
        rollout: str,
        context_time: float,
        device=None,
    ):
        self.gens = [torch.Generator("cpu").manual_seed(int(s)) for s in seeds]
        self.channels, self.hw, self.times = channels, tuple(hw), [float(t) for t in times]
        self.rollout, self.context_time, self.device = check_rollout(rollout), float(context_time), device
        self.reserved: Deque[Tuple[int, torch.Tensor]] = deque()  # (frames, host buffer) per chunk: ``reserve``

    def draw(self, frames: int) -> torch.Tensor:
        return noise_from_generators(self.gens, (self.channels, frames, *self.hw), self.device)

    def initial(self, frames: int) -> torch.Tensor:
        """The chunk's starting latent (pure noise at the first time)."""
        return self.draw(frames)

    def renoises(self, step: int) -> bool:
        """Whether step ``step`` (0-based) draws: ``renoise`` re-noises to a next time that is not 0."""
        return step_draws_noise(self.rollout, self.times[step + 1])

    def for_step(self, step: int, frames: int) -> Optional[torch.Tensor]:
        return self.draw(frames) if self.renoises(step) else None

    def for_context(self, frames: int) -> Optional[torch.Tensor]:
        """The refill's noise (None at context time 0: the clean latent is re-run)."""
        return self.draw(frames) if self.context_time != 0 else None

    def draws_per_chunk(self) -> int:
        """The initial latent, one draw per re-noised step, the context noise."""
        return 1 + sum(map(self.renoises, range(len(self.times) - 1))) + (1 if self.context_time != 0 else 0)

    def chunk(self, frames: int):
        """(initial x, [noise per step or None], context noise or None), drawn now (in a ``reserve``d buffer, if
        any: then views of it)."""
        x = self.initial(frames)
        steps = [self.for_step(k, frames) for k in range(len(self.times) - 1)]
        context = self.for_context(frames)
        if not self.reserved:
            return x, steps, context
        reserved_frames, buffer = self.reserved.popleft()
        if reserved_frames != frames:
            raise ValueError(f"noise was reserved for a chunk of {reserved_frames} frames, asked for {frames}")
        views = iter(buffer.view(-1, *x.shape).unbind(0))

        def place(t):
            return None if t is None else next(views).copy_(t)

        return place(x), [place(n) for n in steps], place(context)

    def reserve(self, chunk_frames: Sequence[int], pin: bool) -> None:
        """One host buffer (pinned for a GPU) for the noise of the next chunks (``chunk_frames`` each), which
        ``chunk`` then fills chunk by chunk as it draws (the same values, in the same order): one page-locked
        allocation instead of one per tensor (each cost ~2 ms of host time, on the one thread that issues both GPUs
        of the pipeline), and the draws stay where they were, in each chunk's prep, instead of all before the
        first chunk's (2 items x 6 chunks x 4 draws: ~10-15 ms of host time during which both GPUs would idle)."""
        per_frame = len(self.gens) * self.channels * self.hw[0] * self.hw[1] * self.draws_per_chunk()
        flat = torch.empty(per_frame * sum(chunk_frames), pin_memory=pin)
        offset = 0
        for f in chunk_frames:
            self.reserved.append((f, flat[offset : offset + per_frame * f]))
            offset += per_frame * f
