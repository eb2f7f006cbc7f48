"""Causal ODE / KD initialisation (CausVid's ODE-pair regression): a bidirectional teacher's ODE trajectories
teach a causal (block-causal attention) student to denoise in a few steps.

Roles: ``student`` (trainable; its network built causal, e.g. ``causal_chunk_frames=2``, usually from the
teacher's weights) and ``teacher`` (frozen, bidirectional). Data-free: the video of a batch only fixes the
latent size; prompts come from the batch (the dataset's captions) or from the config's ``prompts`` list.

One iteration:

1. ODE pairs. From Gaussian noise the teacher integrates the flow ODE with classifier-free guidance
   (``teacher_guidance_scale`` = standard CFG ``s``: ``v = u + s (c - u)``) using the sampler's math
   (``opensora.diffusion.sampling``: ``euler_step``, ``text_cfg``) on its own shifted schedule of
   ``teacher_num_steps`` steps *merged with the student's step times*, so the trajectory passes exactly through
   every time ``t_k`` of ``step_list``. It records ``x_{t_k}`` (``t_0 = 1``: the noise itself) and the final
   sample ``x0_T``.
2. Regression. Step indices ``k`` are drawn from the global torch RNG: with a causal student
   (``num_frames_per_chunk`` set) and ``chunk_timesteps="independent"`` (default, CausVid) one per sample *and
   chunk*, chunk ``c``'s frames taken from the trajectory at ``t_{k_c}``; with ``"shared"`` (or a bidirectional
   student) one per sample. One *full causal forward* of the student (chunk ``c`` attends to the text and chunks
   ``<= c``, each chunk at its own time: the network takes ``t`` [B, num_chunks]) predicts the velocity, turned
   into ``x0 = x_t - t v`` frame by frame; the loss is the float32 MSE against the teacher's ``x0_T``
   (``target="x0"``) or of the velocity against the one that lands on it, ``(x_t - x0_T) / t``
   (``target="velocity"``). Both have the same minimiser; the x0 loss weights all steps equally in x0 space.
   Independent chunk times teach the student to denoise a chunk whatever the noise level of its context
   (CausVid's recipe); the clean (t = 0) context that streaming inference puts in the KV cache never appears
   here -- that train/test gap is what Self-Forcing closes. ``clean_context_prob`` narrows it already here: with
   that probability a sample's first ``c`` chunks (``c`` uniform in 1 .. num_chunks - 1) are the teacher's final
   sample at t = 0, as the streaming cache holds them, and only the later chunks count in the loss. Without it
   a streamed ODE-init student drifts chunk by chunk (on the CPU demo its background darkens by ~8 grey levels a
   frame), because every context it streams with is clean.

Pairs: ``pairs="regenerate"`` (default) integrates a fresh trajectory per micro-step from the global torch RNG
(seeded per data-parallel rank by the trainer and restored on resume, so resuming is exact). ``pairs="cache"``
integrates ``num_cached_pairs`` trajectories once per latent shape, prompts cycled from ``prompts``, noise from a
private ``torch.Generator`` seeded ``pair_seed + rank`` (so a resumed run rebuilds exactly the same cache), and
each micro-step picks ``batch_size`` of them with the global RNG. The cache costs memory:
``num_cached_pairs * (len(step_list) + 1)`` latents.
"""

import dataclasses
import logging
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from opensora.diffusion.guidance import text_cfg
from opensora.diffusion.sampling import euler_step, timesteps_for_sampling, timesteps_from_list
from opensora.methods.base import MissingRoleError, TrainingMethod
from opensora.methods.causal import check_causal_student, num_chunks
from opensora.registry import ADAPTERS, METHODS, build_module

TARGETS = ("x0", "velocity")
PAIR_MODES = ("regenerate", "cache")
CHUNK_TIMESTEPS = ("independent", "shared")


def merged_schedule(teacher_times: torch.Tensor, student_times: torch.Tensor) -> Tuple[torch.Tensor, List[int]]:
    """Descending union of the teacher's schedule and the student's times (both ending at 0); returns it and the
    index in it of every student time (so ``trajectory[index[k]]`` is the ODE state at ``student_times[k]``)."""
    times = torch.unique(torch.cat([teacher_times.float().cpu(), student_times.float().cpu()]))
    times = times.flip(0)  # unique sorts ascending
    positions = [int((times == t).nonzero()[0, 0]) for t in student_times.float().cpu()]
    return times, positions


@METHODS.register_module()
class CausalODEInit(TrainingMethod):
    required_roles = ("student", "teacher")
    trainable_roles = ("student",)

    def __init__(
        self,
        roles,
        components,
        step_list: Sequence[float] = (1.0, 0.75, 0.5, 0.25),
        num_frames_per_chunk: Optional[int] = None,
        teacher_num_steps: int = 30,
        teacher_guidance_scale: float = 5.0,
        target: str = "x0",
        pairs: str = "regenerate",
        prompts: Optional[Sequence[str]] = None,
        num_cached_pairs: int = 64,
        pair_seed: int = 1234,
        chunk_timesteps: str = "independent",
        clean_context_prob: float = 0.0,
        adapter: Optional[Mapping] = None,
    ):
        super().__init__(roles, components)
        if self.roles["teacher"].trainable:
            raise MissingRoleError("CausalODEInit: role 'teacher' must be frozen (trainable=False)")
        if target not in TARGETS:
            raise ValueError(f"CausalODEInit: target must be one of {TARGETS}, got {target!r}")
        if pairs not in PAIR_MODES:
            raise ValueError(f"CausalODEInit: pairs must be one of {PAIR_MODES}, got {pairs!r}")
        if pairs == "cache" and not prompts:
            raise ValueError(
                "CausalODEInit: pairs='cache' needs a `prompts` list (the cache is built once, before "
                "any batch is seen, so that a resumed run rebuilds the same pairs)"
            )
        if int(teacher_num_steps) < 1 or int(num_cached_pairs) < 1:
            raise ValueError("CausalODEInit: teacher_num_steps and num_cached_pairs must be >= 1")
        self.student, self.teacher = self.roles["student"], self.roles["teacher"]
        self.num_frames_per_chunk = (
            None
            if num_frames_per_chunk is None
            else check_causal_student("CausalODEInit", self.student, num_frames_per_chunk)
        )
        if chunk_timesteps not in CHUNK_TIMESTEPS:
            raise ValueError(
                f"CausalODEInit: chunk_timesteps must be one of {CHUNK_TIMESTEPS}, got {chunk_timesteps!r}"
            )
        # a bidirectional student (no num_frames_per_chunk) has no chunks: one time per sample
        self.chunk_timesteps = "shared" if self.num_frames_per_chunk is None else chunk_timesteps
        if not 0.0 <= float(clean_context_prob) <= 1.0:
            raise ValueError(f"CausalODEInit: clean_context_prob must be in [0, 1], got {clean_context_prob}")
        if clean_context_prob and self.chunk_timesteps != "independent":
            raise ValueError("CausalODEInit: clean_context_prob needs a causal student with independent chunk times")
        self.clean_context_prob = float(clean_context_prob)
        self.step_times = timesteps_from_list(step_list)  # with the final 0
        self.num_student_steps = len(self.step_times) - 1
        self.teacher_num_steps = int(teacher_num_steps)
        self.teacher_guidance_scale = float(teacher_guidance_scale)
        self.target = target
        self.pairs = pairs
        self.prompts = list(prompts or [])
        self.num_cached_pairs = int(num_cached_pairs)
        self.pair_seed = int(pair_seed)
        self.adapter = build_module(adapter or dict(type="MMDiTAdapter"), ADAPTERS, components=components)
        self._cache: Dict[tuple, dict] = {}
        self.last_teacher_passes = 0

    # ---- the teacher's ODE ----------------------------------------------------------------------------------
    @torch.no_grad()
    def teacher_trajectory(self, noise: torch.Tensor, batch) -> Tuple[List[torch.Tensor], torch.Tensor]:
        """Integrate the teacher's guided ODE from ``noise``; returns ``[x at each student time]`` (the noise
        first) and the final sample, all float32."""
        teacher_times = timesteps_for_sampling(self.teacher_num_steps, batch.shift_alpha)
        times, positions = merged_schedule(teacher_times, self.step_times)
        self.last_teacher_passes = (len(times) - 1) * (2 if self.teacher_guidance_scale != 1.0 else 1)
        wanted = {p: k for k, p in enumerate(positions[:-1])}  # the final 0 is the sample itself
        x = noise.float()
        states: List[Optional[torch.Tensor]] = [None] * self.num_student_steps
        for i in range(len(times) - 1):
            if i in wanted:
                states[wanted[i]] = x
            t, t_next = times[i], times[i + 1]
            t_batch = t.to(x.device).expand(x.shape[0])
            v = self.adapter.predict_velocity(self.teacher, x, t_batch, batch, conditional=True)
            if self.teacher_guidance_scale != 1.0:
                u = self.adapter.predict_velocity(self.teacher, x, t_batch, batch, conditional=False)
                v = text_cfg(v, u, self.teacher_guidance_scale)
            x = euler_step(x, v, t, t_next)
        return states, x

    def _cached_pairs(self, batch) -> dict:
        """``num_cached_pairs`` trajectories for this latent shape, built once from ``pair_seed + rank``."""
        from opensora.training.distributed import get_rank

        shape = tuple(batch.latent_shape[1:])
        if shape in self._cache:
            return self._cache[shape]
        device = self.components.device
        # the first step waits for this (a minute on 2 CPU cores for the demo's 144 pairs): say why it stands still
        logging.getLogger(__name__).info(
            "integrating %d teacher ODE trajectories (%d steps each) once for latent shape %s",
            self.num_cached_pairs,
            self.teacher_num_steps,
            shape,
        )
        generator = torch.Generator(device="cpu").manual_seed(self.pair_seed + get_rank())
        null = {k: v[:1] for k, v in self.components.null_text.items()}
        states, finals, texts = [], [], []
        for start in range(0, self.num_cached_pairs, batch.batch_size):
            count = min(batch.batch_size, self.num_cached_pairs - start)
            prompts = [self.prompts[(start + i) % len(self.prompts)] for i in range(count)]
            text = {k: v.to(device) for k, v in self.components.text_encoder.encode(prompts).items()}
            sub = dataclasses.replace(
                batch,
                latent_shape=(count, *shape),
                text=text,
                null_text={k: v.to(device).expand(count, *v.shape[1:]) for k, v in null.items()},
            )
            noise = torch.randn((count, *shape), generator=generator, dtype=torch.float32).to(device)
            trajectory, final = self.teacher_trajectory(noise, sub)
            states.append(torch.stack(trajectory, dim=1))  # [n, K, C, T, H, W]
            finals.append(final)
            texts.append(text)
        cache = dict(
            states=torch.cat(states),
            final=torch.cat(finals),
            text={k: torch.cat([t[k] for t in texts]) for k in texts[0]},
        )
        self._cache[shape] = cache
        return cache

    # ---- one micro-step -------------------------------------------------------------------------------------
    def draw_step_indices(self, batch_size: int, num_frames: int) -> torch.Tensor:
        """Student step index per sample ``[B]`` or, with ``chunk_timesteps="independent"``, per sample and chunk
        ``[B, num_chunks]`` (global torch RNG)."""
        if self.chunk_timesteps == "shared":
            return torch.randint(0, self.num_student_steps, (batch_size,))
        return torch.randint(0, self.num_student_steps, (batch_size, num_chunks(num_frames, self.num_frames_per_chunk)))

    def ode_pairs(self, prepared):
        """``(x_t, t, x0_teacher, batch, index)`` for this micro-step: ``x_t`` is the teacher's ODE state at the
        student time ``t = step_times[index]`` (per sample ``[B]``, or per chunk ``[B, num_chunks]`` with each
        chunk's frames taken from the trajectory at its own time)."""
        b = prepared.batch_size
        if self.pairs == "regenerate":
            states, final = self.teacher_trajectory(self.adapter.noise(prepared), prepared)
            stacked = torch.stack(states, dim=1)  # [B, K, C, T, H, W]
            batch = prepared
        else:
            cache = self._cached_pairs(prepared)
            rows = torch.randint(0, cache["final"].shape[0], (b,))
            stacked = cache["states"][rows.to(cache["states"].device)]
            final = cache["final"][rows.to(cache["final"].device)]
            batch = dataclasses.replace(prepared, text={k: v[rows.to(v.device)] for k, v in cache["text"].items()})
        num_frames = stacked.shape[3]
        index = self.draw_step_indices(b, num_frames)
        device = stacked.device
        if index.dim() == 1:
            x_t = stacked[torch.arange(b, device=device), index.to(device)]
        else:  # per frame: the step index of its chunk
            frame_index = index.repeat_interleave(self.num_frames_per_chunk, dim=1).to(device)  # [B, T]
            per_frame = stacked.permute(0, 3, 1, 2, 4, 5)  # [B, T, K, C, H, W]
            rows = torch.arange(b, device=device)[:, None]
            frames = torch.arange(num_frames, device=device)[None, :]
            x_t = per_frame[rows, frames, frame_index].permute(0, 2, 1, 3, 4)  # [B, C, T, H, W]
        if self.clean_context_prob:
            index = self.clean_prefixes(index)
            clean = self.frame_times(index == self.num_student_steps, x_t).to(device)  # [B, 1, T, 1, 1]
            x_t = torch.where(clean, final.to(x_t.dtype), x_t)
        t = self.step_times[index].to(device)
        return x_t, t, final, batch, index

    def clean_prefixes(self, index: torch.Tensor) -> torch.Tensor:
        """``index`` [B, num_chunks] with, for a ``clean_context_prob`` share of the samples, the first ``c``
        chunks (``c`` uniform in 1 .. num_chunks - 1) set to the final step (t = 0: the clean sample, as the
        streaming cache holds the chunks before the one being denoised); global torch RNG."""
        b, chunks = index.shape
        if chunks < 2:
            return index
        chosen = torch.rand(b) < self.clean_context_prob
        lengths = torch.randint(1, chunks, (b,)) * chosen  # 0: no clean prefix
        prefix = torch.arange(chunks)[None, :] < lengths[:, None]
        return torch.where(prefix, torch.full_like(index, self.num_student_steps), index)

    def frame_times(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``t`` [B] or [B, num_chunks] as a tensor broadcasting over ``like`` [B, C, T, H, W] frame by frame."""
        if t.dim() == 1:
            return t.view(-1, 1, 1, 1, 1)
        return t.repeat_interleave(self.num_frames_per_chunk, dim=1)[:, None, :, None, None]

    def single_train_step(self, batch: Mapping, iteration: int):
        prepared = self.adapter.prepare_batch(batch)
        x_t, t, x0_teacher, batch_used, index = self.ode_pairs(prepared)
        x_t, x0_teacher = x_t.float(), x0_teacher.float()
        # one network call; per-chunk times [B, num_chunks] go to the causal network as they are (each chunk at
        # its own time). The flow-matching relations, frame by frame: x0 = x_t - t v, v = (x_t - x0) / t
        velocity = self.adapter.predict_velocity(self.student, x_t, t, batch_used)
        t_frames = self.frame_times(t.float(), x_t)
        if self.target == "x0":
            prediction, target = x_t - t_frames * velocity, x0_teacher
        else:  # t > 0 wherever the loss looks (the clamp only keeps the masked clean chunks finite)
            prediction, target = velocity, (x_t - x0_teacher) / t_frames.clamp_min(1e-12)
        if self.clean_context_prob:  # the clean prefix chunks are context only: nothing to denoise, no loss
            scored = (t_frames > 0).expand_as(x_t)
            prediction, target = prediction.masked_select(scored), target.masked_select(scored)
        loss = F.mse_loss(prediction, target)

        teacher_passes = self.last_teacher_passes if self.pairs == "regenerate" else 0
        pass_flops = self.adapter.forward_flops(self.student, prepared)
        outputs = dict(
            num_samples=prepared.batch_size,
            num_tokens=self.adapter.num_tokens(self.student, prepared),
            flops=pass_flops * (teacher_passes + 3),  # teacher ODE + student forward and backward
            student_step_index=index.tolist(),
        )
        return {"total_loss": loss, "ode_loss": loss.detach()}, outputs
