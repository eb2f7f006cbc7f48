"""Self-Forcing: DMD on the causal student's own autoregressive rollout, generated chunk by chunk with a KV cache.

It reuses DMD2 / CausVid for everything (real score = teacher with CFG, fake score = critic trained with flow
matching on the rollout, ``dmd_gradient`` / ``generator_loss``, the two-time-scale rule with
``student_update_every``, default 5) and overrides only the student's rollout and the cache's lifetime:

For one iteration, on the latent noise ``[B, C, T, H, W]`` split into chunks of ``num_frames_per_chunk`` frames:

1. Exit step: ``j`` in ``[0, len(step_list))`` drawn once per iteration, on rank 0 and broadcast (every rank
   draws too, so all RNG streams advance alike and resume stays exact); the same ``j`` for every chunk.
2. A fresh KV cache (``adapter.new_kv_cache``; its lifetime is this one rollout). For each chunk ``c``:
   steps ``0 .. j-1`` denoise it under ``no_grad`` with the cache as context (``predict_x0_streaming`` with
   ``store_kv=False``), moving from ``t_i`` to ``t_{i+1}`` with the rule ``rollout`` -- the same two rules as the
   streaming sampler (``opensora.inference.streaming.generator``): ``"renoise"`` (default, as Self-Forcing and CausVid
   sample) re-noises the predicted x0 with fresh noise, ``"euler"`` takes the Euler step; train with the rule
   you will sample with. Step ``j`` predicts the chunk's ``x0`` -- the only forward that keeps a graph,
   and only on student iterations and when the chunk lies inside the last ``grad_frames`` latent frames
   (``None``: all). Then the cache refill: the chunk's detached ``x0`` (noised to ``context_noise``, default 0
   = clean) runs once more under ``no_grad`` with ``store_kv=True``, so later chunks attend to the clean
   context exactly as the streaming sampler provides it. The last chunk needs no refill.
3. The chunks concatenate to the rolled-out video, on which DMD2 computes the generator loss (whole video,
   bidirectional teacher and critic) and the critic's flow-matching loss.

Gradients never flow through the cache (it is filled under ``no_grad``), so memory is one student forward's graph
per graded chunk.
"""

from typing import Optional, Tuple

import torch

from opensora.cli_errors import UserInputError
from opensora.diffusion.sampling import euler_step
from opensora.methods.causal import num_chunks, shared_randint
from opensora.methods.causvid import CausVid
from opensora.models.mmdit.causal import ROPE_ANCHORS
from opensora.registry import METHODS


@METHODS.register_module()
class SelfForcing(CausVid):
    def __init__(
        self,
        roles,
        components,
        rollout: str = "renoise",
        grad_frames: Optional[int] = None,
        context_noise: float = 0.0,
        kv_window_frames: Optional[int] = None,
        kv_sink_frames: int = 0,
        kv_rope_anchor: str = "absolute",
        **causvid_kwargs,
    ):
        super().__init__(roles, components, rollout=rollout, **causvid_kwargs)
        if kv_rope_anchor not in ROPE_ANCHORS:
            raise UserInputError(f"SelfForcing: kv_rope_anchor must be one of {ROPE_ANCHORS}, got {kv_rope_anchor!r}")
        if grad_frames is not None and int(grad_frames) < 1:
            raise ValueError(f"SelfForcing: grad_frames must be >= 1 latent frame or None (all), got {grad_frames}")
        if not 0.0 <= float(context_noise) < 1.0:
            raise ValueError(f"SelfForcing: context_noise must be in [0, 1), got {context_noise}")
        self.grad_frames = None if grad_frames is None else int(grad_frames)
        self.context_noise = float(context_noise)
        self.kv_window_frames = kv_window_frames
        self.kv_sink_frames = int(kv_sink_frames)
        self.kv_rope_anchor = kv_rope_anchor  # where the text and the sinks sit once the window rolls (KVCache)
        self.last_extra_passes = 0.0

    # ---- the rollout ----------------------------------------------------------------------------------------
    def draw_exit_step(self) -> int:
        return shared_randint(self.num_student_steps, self.components.device)

    def first_graded_chunk(self, num_frames: int) -> int:
        """Chunks before this one run their exit step without gradients (``grad_frames``)."""
        chunks = num_chunks(num_frames, self.num_frames_per_chunk)
        if self.grad_frames is None:
            return 0
        graded = -(-self.grad_frames // self.num_frames_per_chunk)  # ceil: a chunk is graded whole
        return max(0, chunks - graded)

    def cache_window(self, batch) -> Optional[int]:
        """Latent frames the rollout's KV cache keeps (``kv_window_frames``; None: all)."""
        return self.kv_window_frames

    def _next_state(self, x: torch.Tensor, x0: torch.Tensor, i: int) -> torch.Tensor:
        t, t_next = self.step_times[i], self.step_times[i + 1]
        if self.rollout == "euler":  # v = (x_t - x0) / t, then the sampler's Euler step
            return euler_step(x, (x - x0) / t.to(x.device), t, t_next)
        return self.adapter.add_noise(x0, torch.randn_like(x0), t_next.to(x.device).expand(x.shape[0]))

    def rollout_chunks(
        self,
        noise: torch.Tensor,
        batch,
        exit_index: int,
        with_grad: bool,
        graded: Optional[range] = None,
        keep_from: int = 0,
        switch: Optional[Tuple[int, object]] = None,
        context_exit_index: Optional[int] = None,
    ) -> torch.Tensor:
        """The autoregressive rollout described in the module docstring; returns the video's x0 [B, C, T, H, W].
        With ``exit_index`` the last step it is exactly what the streaming sampler generates from ``noise``.

        ``noise`` may be longer than the batch's clip (a long rollout). ``graded``: the chunks whose exit step keeps
        a graph (default: those of ``grad_frames``); ``keep_from``: the first chunk returned (earlier chunks only
        fill the cache, so their outputs are dropped as soon as they are stored). ``switch``: ``(chunk, batch)``, a
        prompt switch at that chunk (> 0): from it on the passes take ``batch``'s text, and the previous chunk's
        refill becomes a re-cache of every kept frame under the new text (the streaming sampler's
        ``switch_recache``, LongLive's re-cache on a prompt switch). ``context_exit_index``: the exit step of the
        chunks before ``keep_from`` (default ``exit_index``; the last step: the sampler's own chunks)."""
        from opensora.inference.streaming.recache import WindowLatents, plan_recache, run_recache

        switch_chunk, switch_batch = switch if switch is not None else (None, None)
        if switch_chunk is not None and switch_chunk < 1:
            raise ValueError(f"a prompt switch needs a chunk before it, got chunk {switch_chunk}")
        window = WindowLatents() if switch is not None else None  # the refill inputs of the cached frames
        chunk = self.num_frames_per_chunk
        frames = noise.shape[2]
        count = num_chunks(frames, chunk)
        graded = range(self.first_graded_chunk(frames), count) if graded is None else graded
        b = noise.shape[0]
        exits = [
            exit_index if c >= keep_from or context_exit_index is None else context_exit_index for c in range(count)
        ]
        t_exits = {e: self.step_times[e].to(noise.device).expand(b) for e in set(exits)}  # made once, as before
        t_context = torch.full((b,), self.context_noise, device=noise.device)
        cache = self.adapter.new_kv_cache(
            self.student,
            batch,
            window_frames=self.cache_window(batch),
            sink_frames=self.kv_sink_frames,
            rope_anchor=self.kv_rope_anchor,
        )
        outputs = []
        try:
            for c in range(count):
                start = c * chunk
                x = noise[:, :, start : start + chunk]
                with torch.no_grad():
                    for i in range(exits[c]):
                        t = self.step_times[i].to(x.device).expand(b)
                        x0 = self.adapter.predict_x0_streaming(self.student, x, t, batch, cache, start, False)
                        x = self._next_state(x, x0, i)
                with torch.set_grad_enabled(with_grad and c in graded):
                    x0 = self.adapter.predict_x0_streaming(
                        self.student, x, t_exits[exits[c]], batch, cache, start, False
                    )
                if c >= keep_from:
                    outputs.append(x0)
                if c + 1 < count:  # cache refill: the chunk's own output as clean (or lightly noised) context
                    with torch.no_grad():
                        context = x0.detach()
                        if self.context_noise > 0:
                            context = self.adapter.add_noise(context, torch.randn_like(context), t_context)
                        if c + 1 != switch_chunk:
                            self.adapter.predict_x0_streaming(
                                self.student, context, t_context, batch, cache, start, True
                            )
                            if window is not None:
                                window.add(start, context)
                                window.keep(cache.frame_ids)
                        else:  # the prompt switch: every kept frame, this chunk's included, again under the new text
                            window.add(start, context)
                            kept = cache.frame_ids_after_append(start, context.shape[2])
                            plan = plan_recache(cache.frame_ids, kept, chunk, everything=True)
                            batch = switch_batch

                            def store(latents, at, batch=batch):
                                self.adapter.predict_x0_streaming(
                                    self.student, latents, t_context, batch, cache, at, True
                                )

                            run_recache(cache, window, plan, store)
                            window = None  # one switch per rollout: no re-cache after it needs the inputs
        finally:
            cache.clear()
        # clip-equivalent student passes beyond DMD2's count (exit_index + 1 over one clip): the refills, and the
        # chunks a rollout longer than the clip adds
        clip_chunks = batch.latent_shape[2] // chunk
        chunk_passes = sum(e + 1 for e in exits)
        self.last_extra_passes = ((count - 1) + chunk_passes - clip_chunks * (exit_index + 1)) / clip_chunks
        return torch.cat(outputs, dim=2)

    def generate(self, batch, with_grad: bool) -> Tuple[torch.Tensor, int]:
        self._last_batch = batch
        noise = self.adapter.noise(batch)
        exit_index = self.draw_exit_step()
        return self.rollout_chunks(noise, batch, exit_index, with_grad), exit_index

    def single_train_step(self, batch, iteration: int):
        loss_map, outputs = super().single_train_step(batch, iteration)
        # DMD2 counts step_index + 1 full-clip student passes for the rollout, which the chunk passes of one clip add
        # up to; the cache refills add (count - 1) / count of one more (``last_extra_passes``)
        outputs["flops"] += self.adapter.forward_flops(self.critic, self._last_batch) * self.last_extra_passes
        outputs["exit_step"] = outputs["student_step_index"]
        return loss_map, outputs
