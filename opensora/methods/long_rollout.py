"""Long-rollout DMD (Self-Forcing++-style): DMD on teacher-length windows of the student's own long rollouts.

A Self-Forcing student only ever learns from rollouts of the teacher's length, so what it does after that length
-- attending to a rolling KV cache that has dropped its first frames, at RoPE positions it never saw -- is never
corrected, and it drifts. This method trains exactly that regime: the student streams ``rollout_multiple`` times
the clip length through the rolling cache it will stream with (``kv_window_frames``, ``kv_sink_frames``), and the
DMD loss judges a teacher-length window of that rollout, which the bidirectional teacher can score.

For one iteration, with the clip of ``T`` latent frames (the batch's) in chunks of ``K`` (``W = T / K`` chunks):

1. Exit step ``j`` and the window's last chunk ``e`` in ``[W, rollout_multiple * W]``, both drawn on rank 0 and
   broadcast (every rank draws, so RNG streams advance alike and resume stays exact). ``window="uniform"`` draws
   ``e`` uniformly; ``"last"`` always takes the rollout's last window (the furthest from the start).
2. Self-Forcing's rollout (``SelfForcing.rollout_chunks``: the same per-chunk steps, rule, exit step and cache
   refill) over chunks ``0 .. e - 1`` with noise of ``e * K`` frames and the rolling cache. Chunks before the
   window run entirely under ``no_grad`` and only fill the cache; their outputs are dropped at once. The window's
   chunks ``e - W .. e - 1`` keep their exit step's graph (only on student iterations; ``grad_frames`` narrows them
   to the window's last frames as in Self-Forcing). Chunks after ``e`` are never generated: nothing judges them.
3. DMD2 on the window as a clip of its own (``DMD2.single_train_step``): teacher with CFG (real score) and critic
   (fake score, trained with flow matching on the windows) at the clip length they know; the generator loss and
   the two-time-scale rule are DMD2's. The caption stays the clip's, which suits motion that keeps its direction
   (MovingShapes ``wrap``); with ``bounce`` the caption names the first direction only.
4. Prompt switches (``switch_prob``, default 0; LongLive trains interactive prompts this way): with that
   probability the prompts switch at the judged window's first chunk (each sample takes another sample's prompt,
   ``adapter.roll_prompts``), the kept context is re-cached under the new text as the streaming sampler does on a
   switch (``switch_recache``), and DMD judges the window with the new prompts. The student learns to follow a new
   prompt from the chunk after the switch, where otherwise it copies its context (the old prompt's colour). Needs
   a batch of 2 or more and a window that starts after the first chunk; drawn every iteration, used where it fits.

``critic_windows`` (default 1): the critic learns from this many windows of each rollout -- the judged one and
``critic_windows - 1`` more, drawn as the judged one is, cut from the same rollout (which then runs to the furthest
window's end) and detached -- in one critic pass on the windows stacked along the batch. The rollout, not the
critic, is what costs here (about 16 clip-lengths of chunk passes an iteration at ``rollout_multiple=8``, against
about 3 clip-length passes of the critic's forward and backward), so more windows give the critic more samples of
the student's long-range distribution for little time; the student's gradient still comes from the judged window
alone. Windows of one rollout share their noise stream and context, so they are correlated samples. Only with
``window="uniform"``, ``context_steps="exit"`` and no ``switch_prob``: otherwise the other windows would not be drawn
as the judged one is.

``first_window_share`` (default 0): the share of drawn windows that are the clip's first instead (``e = W``: the
rollout is then Self-Forcing's at the clip length, and cheap). A uniform draw judges the first window once in
``(rollout_multiple - 1) * W + 1`` draws (1 in 57 at 8x a clip of 8 chunks), so the clip length, the regime the
student is most often used in, otherwise loses its own training signal as the long windows reshape the student.
Every window is drawn this way, the critic's extra ones too; the extra draw is made only where the share is above 0
(the default's RNG stream is unchanged).

``context_steps``: the chunks before the judged window stop at the iteration's exit step, as every Self-Forcing chunk
does (``"exit"``, the default); or they run the whole step list (``"full"``), so the window's context is what the
streaming sampler would have cached (the same frames for the same noise), not up to ``rollout_multiple - 1`` clip
lengths of one-step predictions when the exit step is early. They carry no gradient either way; ``"full"`` costs
more no-grad passes (a 4-step list: 5 passes a context chunk with its refill instead of 3.5 on average).

Memory is bounded by the window: one student graph per graded chunk (as many as Self-Forcing at the clip length)
plus a KV cache of at most ``kv_window_frames`` frames; the longer rollout costs time (no-grad passes), not memory.
``kv_window_frames`` defaults to the clip length minus one chunk (what the streaming sampler keeps by default) and
``kv_sink_frames`` to one chunk (the first chunk stays in view as an attention sink, LongLive's frame sink).
``kv_rope_anchor`` (Self-Forcing's, default ``"absolute"``) trains the rollout with the text and the sinks where the
streaming sampler's ``rope_anchor`` puts them; train in the regime the student will stream in.
"""

import dataclasses
from typing import Optional, Tuple

import torch

from opensora.methods.causal import num_chunks, shared_randint
from opensora.methods.self_forcing import SelfForcing
from opensora.registry import METHODS

WINDOWS = ("uniform", "last")
CONTEXT_STEPS = ("exit", "full")  # the chunks before the judged window: Self-Forcing's exit step, or every step
CHANCE_DRAWS = 1 << 20  # resolution of the switch_prob and first_window_share draws


@METHODS.register_module()
class LongRollout(SelfForcing):
    def __init__(
        self,
        roles,
        components,
        rollout_multiple: int = 4,
        window: str = "uniform",
        kv_window_frames: Optional[int] = None,
        kv_sink_frames: Optional[int] = None,
        switch_prob: float = 0.0,
        context_steps: str = "exit",
        critic_windows: int = 1,
        first_window_share: float = 0.0,
        **self_forcing_kwargs,
    ):
        super().__init__(roles, components, **self_forcing_kwargs)
        if int(critic_windows) != critic_windows or critic_windows < 1:
            raise ValueError(f"LongRollout: critic_windows must be a whole number >= 1, got {critic_windows}")
        clashes = [  # (setting, its value, whether it clashes with more windows, why)
            ("switch_prob", switch_prob, switch_prob > 0, "a window across the prompt switch has no one prompt"),
            ("context_steps", context_steps, context_steps == "full", "the windows would mix fully denoised chunks"),
            ("window", window, window == "last", "every window would be the last one: the same samples again"),
        ]
        for key, value, clash, why in clashes:
            if critic_windows > 1 and clash:
                raise ValueError(
                    f"LongRollout: critic_windows > 1 does not combine with {key}={value!r} ({why}); "
                    f"set critic_windows=1 or {key} back to its default"
                )
        self.critic_windows = int(critic_windows)
        self.extra_windows = []  # this iteration's detached windows for the critic beside the judged one
        if not 0.0 <= float(switch_prob) <= 1.0:
            raise ValueError(f"LongRollout: switch_prob must be in [0, 1], got {switch_prob}")
        self.switch_prob = float(switch_prob)
        if not 0.0 <= float(first_window_share) <= 1.0:
            raise ValueError(f"LongRollout: first_window_share must be in [0, 1], got {first_window_share}")
        self.first_window_share = float(first_window_share)
        if context_steps not in CONTEXT_STEPS:
            raise ValueError(f"LongRollout: context_steps must be one of {CONTEXT_STEPS}, got {context_steps!r}")
        self.context_steps = context_steps
        self.switched = None  # the prompts the judged window was made with, after a prompt switch
        if int(rollout_multiple) != rollout_multiple or rollout_multiple < 1:
            raise ValueError(f"LongRollout: rollout_multiple must be a whole number >= 1, got {rollout_multiple}")
        if window not in WINDOWS:
            raise ValueError(f"LongRollout: window must be one of {WINDOWS}, got {window!r}")
        chunk = self.num_frames_per_chunk
        sinks = chunk if kv_sink_frames is None else int(kv_sink_frames)
        if sinks < 0 or (kv_window_frames is not None and not sinks < int(kv_window_frames)):
            raise ValueError(
                f"LongRollout: need 0 <= kv_sink_frames < kv_window_frames, got {sinks} and {kv_window_frames}"
            )
        self.rollout_multiple = int(rollout_multiple)
        self.window = window
        self.kv_window_frames = None if kv_window_frames is None else int(kv_window_frames)  # None: clip - K
        self.kv_sink_frames = sinks
        self.last_window = (0, 0)  # (first latent frame of the judged window, latent frames rolled out)
        self.last_critic_windows = []  # the first latent frame of each window the critic learnt from

    # ---- the rollout ----------------------------------------------------------------------------------------
    def cache_window(self, batch) -> int:
        """The rolling cache's size: ``kv_window_frames``, by default the clip's latent frames minus one chunk."""
        clip_frames = batch.latent_shape[2]
        window = self.kv_window_frames if self.kv_window_frames is not None else clip_frames - self.num_frames_per_chunk
        if not self.kv_sink_frames < window:
            raise ValueError(
                f"LongRollout: the cache window of {window} latent frames leaves no room beside "
                f"{self.kv_sink_frames} sink frames; set kv_window_frames or a longer clip"
            )
        return window

    def shared_chance(self, probability: float) -> bool:
        """True with ``probability``, the same on every rank (one ``shared_randint`` draw, so RNG streams advance
        alike)."""
        return shared_randint(CHANCE_DRAWS, self.components.device) < probability * CHANCE_DRAWS

    def draw_window_end(self, clip_chunks: int) -> int:
        """The chunk after a window: in ``[W, rollout_multiple * W]``, the same on every rank; ``W`` (the clip's
        first window) at least ``first_window_share`` of the time."""
        longest = self.rollout_multiple * clip_chunks
        drawn = shared_randint(longest - clip_chunks + 1, self.components.device)  # drawn in both modes (RNG)
        if self.first_window_share > 0 and self.shared_chance(self.first_window_share):
            return clip_chunks
        return longest if self.window == "last" else clip_chunks + drawn

    def generate(self, batch, with_grad: bool) -> Tuple[torch.Tensor, int]:
        """A teacher-length window ``x0`` [B, C, T, H, W] of a long rollout, and the exit step."""
        self._last_batch = batch
        chunk = self.num_frames_per_chunk
        clip_frames = batch.latent_shape[2]
        clip_chunks = num_chunks(clip_frames, chunk)
        exit_index = self.draw_exit_step()
        end = self.draw_window_end(clip_chunks)
        start = end - clip_chunks
        extra_ends = [self.draw_window_end(clip_chunks) for _ in range(self.critic_windows - 1)]
        furthest, first = max([end, *extra_ends]), min([end, *extra_ends]) - clip_chunks
        long_shape = (*batch.latent_shape[:2], furthest * chunk, *batch.latent_shape[3:])
        noise = self.adapter.noise(dataclasses.replace(batch, latent_shape=long_shape))
        graded = range(start, end)
        if self.grad_frames is not None:  # Self-Forcing's grad_frames, counted from the window's end
            graded = range(max(start, end - -(-self.grad_frames // chunk)), end)
        self.switched, switch = None, None
        if self.switch_prob > 0:  # drawn on every iteration (RNG alike on every rank), used where a switch fits
            drawn = self.shared_chance(self.switch_prob)
            if drawn and start >= 1 and batch.batch_size >= 2:
                self.switched = self.adapter.roll_prompts(batch)
                switch = (start, self.switched)
        context_exit = self.num_student_steps - 1 if self.context_steps == "full" else None
        video = self.rollout_chunks(
            noise,
            batch,
            exit_index,
            with_grad,
            graded=graded,
            keep_from=first,
            switch=switch,
            context_exit_index=context_exit,  # (only with one critic window, where first == start)
        )

        def window(window_end: int) -> torch.Tensor:
            return video[:, :, (window_end - clip_chunks - first) * chunk : (window_end - first) * chunk]

        self.extra_windows = [window(e).detach() for e in extra_ends]
        self.last_window = (start * chunk, furthest * chunk)
        self.last_critic_windows = [(e - clip_chunks) * chunk for e in [end, *extra_ends]]
        return window(end), exit_index

    def critic_loss(self, x0, batch):
        """DMD2's critic loss on the judged window and this iteration's other windows, stacked along the batch."""
        extra, self.extra_windows = self.extra_windows, []
        if not extra:
            return super().critic_loss(x0, batch)
        windows = torch.cat([x0.detach(), *extra], dim=0)
        return super().critic_loss(windows, self.adapter.repeat_batch(batch, len(extra) + 1))

    def judged_batch(self, prepared):
        return self.switched if self.switched is not None else prepared

    def single_train_step(self, batch, iteration: int):
        loss_map, outputs = super().single_train_step(batch, iteration)
        outputs["window_start_frame"], outputs["rollout_frames"] = self.last_window
        outputs["prompt_switch"] = int(self.switched is not None)
        # the critic's forward and backward (about 3 passes) on each window beyond the judged one
        outputs["flops"] += 3 * (self.critic_windows - 1) * self.adapter.forward_flops(self.critic, self._last_batch)
        return loss_map, outputs
