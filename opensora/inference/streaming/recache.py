"""KV re-cache of a streamed video's rolling window (LongLive's idea): recompute the cached frames' keys/values from
their refill inputs against the context they have now.

Every cached frame's keys/values were made by its chunk's refill, attending to the cache as it was then. When the
window rolls, frames leave, yet the frames after them keep keys/values computed while they saw the frames that left
(in every block past the first, a key is a function of the attention outputs below it). A re-cache runs the kept
frames again, in order, each piece (the kept frames of one chunk) attending to the kept pieces before it and to
itself: the cache then holds what a block-causal forward over the kept frames alone, at their absolute positions,
computes (under ``rope_anchor="window"``, with the text and the sinks at the window's anchor: a video starting there).
The refill input of a frame is the finished chunk noised to the context time (the clean latent at time 0), kept by
``WindowLatents``; no noise is drawn, so the noise order of the video is unchanged.

* ``shift`` (``--kv-recache shift``): when a refill would drop frames, the refill becomes a re-cache: the frames before
  the first dropped one (the sinks, when whole chunks) are already consistent and stay; every piece after them and
  the new chunk run again. Cost: one pass per recomputed piece instead of the refill's one pass.
* a prompt switch (``--prompt-schedule``): every kept frame and the new chunk run again under the new prompt's text
  (the text stream changed, so every key changed), LongLive's re-cache on a prompt switch.
* a re-rendered switch (``switch_renoise=s``, ``--switch-renoise``): the kept frames still SHOW the old prompt (its
  colour, say), and later chunks copy what their context shows. So at a prompt switch every kept piece is first
  re-rendered under the new prompt (``Rerender``): its refill input (time ``c``) is carried forward to time ``s``
  with fresh noise (``flow_matching.noise_forward``), denoised by the chunk's own schedule from ``s`` (its times
  below ``s``, down to 0) with non-storing passes and the stream's step rule, attending to the pieces re-rendered
  and stored before it (nothing of the old window is left), then stored as above and kept as that frame's refill
  input. The frames already handed out do not change; only what later chunks attend to does. Its noise comes
  from CPU generators of its own, one per sample seeded from (the sample's seed, the switch's latent frame), so the
  stream's noise sequence stays the plain switch's and a sample's video does not depend on its batch.

The storing passes are the generator's ordinary storing passes (``forward_chunk``, or its CUDA graphs), so a re-cache costs
and captures what refills of those sizes do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from opensora.diffusion import flow_matching as fm
from opensora.inference.sampler import noise_from_generators

from .rules import rollout_step, step_draws_noise


class WindowLatents:
    """The refill input of every frame the KV cache holds: latent frames [B, C, 1, h, w] by absolute frame index."""

    def __init__(self):
        self.frames: Dict[int, torch.Tensor] = {}

    def add(self, start_frame: int, latents: torch.Tensor) -> None:
        for offset in range(latents.shape[2]):
            self.frames[start_frame + offset] = latents[:, :, offset : offset + 1]

    def gather(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.cat([self.frames[i] for i in ids], dim=2)

    def keep(self, ids: Sequence[int]) -> None:
        wanted = set(ids)
        self.frames = {i: t for i, t in self.frames.items() if i in wanted}


def pieces_of(ids: Sequence[int], chunk_frames: int) -> List[List[int]]:
    """``ids`` (ascending) cut into pieces: runs of consecutive frames of one chunk (chunk = frame // chunk_frames)."""
    pieces: List[List[int]] = []
    for i in ids:
        if pieces and i == pieces[-1][-1] + 1 and i // chunk_frames == pieces[-1][-1] // chunk_frames:
            pieces[-1].append(i)
        else:
            pieces.append([i])
    return pieces


@dataclass
class RecachePlan:
    keep_frames: int  # the oldest cached frames that stay as they are
    pieces: List[List[int]]  # the frames to run again, piece by piece, in order (the new chunk's last)
    dropped: List[int]  # the frames that leave the window


def plan_recache(
    cached_ids: Sequence[int], ids_after: Sequence[int], chunk_frames: int, everything: bool
) -> Optional[RecachePlan]:
    """What a refill that leaves ``ids_after`` in a cache holding ``cached_ids`` re-runs. ``everything``: every kept
    frame (a prompt switch); else None when no frame leaves, and the frames before the first one that leaves stay
    unless their chunk lost a frame (they attended to it inside the chunk)."""
    after = set(ids_after)
    dropped = [i for i in cached_ids if i not in after]
    if not everything and not dropped:
        return None
    pieces = pieces_of(ids_after, chunk_frames)
    cached = set(cached_ids)
    first_dropped = min(dropped) if dropped else None
    touched = {i // chunk_frames for i in dropped}
    fresh = 0
    if not everything:
        for piece in pieces:
            if (
                all(i in cached for i in piece)
                and piece[-1] < first_dropped
                and piece[0] // chunk_frames not in touched
            ):
                fresh += 1
            else:
                break
    return RecachePlan(sum(map(len, pieces[:fresh])), pieces[fresh:], dropped)


def run_recache(
    cache, latents: WindowLatents, plan: RecachePlan, store_pass: Callable, rerender: Optional[Callable] = None
) -> int:
    """Apply ``plan`` to ``cache`` (a ``KVCache``): keep its oldest ``plan.keep_frames`` frames, then
    ``store_pass(latents, start_frame)`` each piece in order (a storing pass at the context time). ``rerender``
    (a ``Rerender``): each piece's refill input is first replaced by ``rerender(refill input, start_frame)``, in
    ``latents`` too. Returns the frames recomputed. Under ``rope_anchor="window"`` the pieces see the text and the
    sinks at the anchor of the frames the cache ends with (``KVCache.pin_anchor``)."""
    ids_after = list(cache.frame_ids[: plan.keep_frames]) + [i for piece in plan.pieces for i in piece]
    with cache.pin_anchor(ids_after):
        cache.truncate(plan.keep_frames)
        for piece in plan.pieces:
            inputs = latents.gather(piece)
            if rerender is not None:
                inputs = rerender(inputs, piece[0])
                latents.add(piece[0], inputs)
            store_pass(inputs, piece[0])
    latents.keep(cache.frame_ids)
    return sum(map(len, plan.pieces))


def rerender_times(times: Sequence[float], start: float) -> List[float]:
    """The chunk schedule ``times`` (ending in 0) restricted to ``start`` and its times below it."""
    return [float(start)] + [float(t) for t in times if t < start]


def rerender_seed(seed: int, frame: int) -> int:
    """The seed of a sample's re-render noise at the switch at latent ``frame`` (a 63-bit mix of both)."""
    return (int(seed) * 0x9E3779B97F4A7C15 + (int(frame) + 1) * 0xBF58476D1CE4E5B9) % (1 << 63)


class Rerender:
    """The re-render of a prompt switch (module docstring): ``self(refill input [B, C, F, h, w], start_frame)`` ->
    the piece's new refill input. Per piece: noise forward from ``context_time`` to ``start`` (``noise_forward``),
    the steps of ``rerender_times(times, start)`` with ``velocity(x, t, False, start_frame)`` (non-storing passes)
    and ``rollout_step``, then the clean result noised to ``context_time`` when it is > 0. Every draw comes from one
    CPU generator per sample seeded with ``rerender_seed(seed, switch_frame)``, in that order, piece after piece.
    ``passes``: the velocity passes run."""

    def __init__(self, seeds, switch_frame, start, times, context_time, rollout, velocity, device=None):
        self.gens = [torch.Generator("cpu").manual_seed(rerender_seed(s, switch_frame)) for s in seeds]
        self.times, self.context_time = rerender_times(times, start), float(context_time)
        self.rollout, self.velocity, self.device = rollout, velocity, device
        self.passes = 0

    def draw(self, like: torch.Tensor) -> torch.Tensor:
        return noise_from_generators(self.gens, like.shape[1:], self.device).to(like.dtype)

    def __call__(self, latents: torch.Tensor, start_frame: int) -> torch.Tensor:
        x = latents.float()
        x = fm.noise_forward(x, self.draw(x), self.context_time, self.times[0])
        for t, t_next in zip(self.times[:-1], self.times[1:]):
            v = self.velocity(x, t, False, start_frame)
            self.passes += 1
            x = rollout_step(
                x, v, t, t_next, self.rollout, self.draw(x) if step_draws_noise(self.rollout, t_next) else None
            )
        return x if self.context_time == 0 else fm.add_noise(x, self.draw(x), self.context_time)


class Stopwatch:
    """Times work on ``device`` without a host sync: CUDA events read when the result is asked for (by then the
    chunk's frames are on the host, so the events are done); the host clock off the GPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        if self.cuda:
            self.begin, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.begin, self.end = time.perf_counter(), None

    def stop(self) -> "Stopwatch":
        if self.cuda:
            self.end.record()
        else:
            self.end = time.perf_counter()
        return self

    def seconds(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.begin.elapsed_time(self.end) / 1000.0
        return self.end - self.begin
