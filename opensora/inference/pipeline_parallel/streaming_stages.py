"""``CausalStreamingStages``: the streaming generator's chunk loop with a block-causal MMDiT split over two devices
(the ``Stages`` that ``runtime.run`` issues; see the class docstring)."""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch

from opensora.diffusion import flow_matching as fm
from opensora.diffusion.guidance import text_cfg
from opensora.models.mmdit.causal import KVCache, TextKVCache, text_keys_all_valid

from ..streaming.chunk_graphs import ChunkGraphs
from ..streaming.rules import StreamNoise, check_rollout, rollout_step, rows_of_passes, text_has_padding
from .runtime import Lanes
from .schedule import Plan
from .stages import all_blocks, to_device_async

_REUSED_ENTRIES = 64  # CausalStreamingStages._reused: RoPE tables of ~16 chunk starts x masks x a few groups


class CausalStreamingStages:
    """``StreamingGenerator``'s chunk loop with a block-causal MMDiT split over two devices.

    Per (group, branch) two ``KVCache``s: one over blocks[0..split] on lane 0, one over blocks[split+1..] on lane 1;
    each stage appends its own blocks' keys/values, so together they hold exactly what one cache over all blocks
    holds after ``forward_chunk`` (same frames, same rolling window); likewise two ``TextKVCache``s. Every forward
    runs ``forward_chunk``'s own functions (``MMDiT.chunk_start``, ``chunk_blocks`` on the lane's block range,
    ``chunk_finish``; a text-cache hit runs the video rows only, as there), the step rule, the noise order and the padding
    decision are ``StreamingGenerator``'s (streaming/rules.py): with
    ``cfg_rows=True`` (its layout: the cond and null-text passes as rows of one batch and one cache) the output is
    bit-identical to it; ``cfg_rows=False`` runs the CFG passes as separate micro-batches with their own caches
    (independent items a second GPU can overlap; identical to ``stream_reference(cfg_rows=False)``).

    Args:
        model: a causal MMDiT placed by ``place_model`` (or on one device). lanes / split: as ``BidirectionalStages``.
        groups: per group ``seeds`` (one per sample) and ``branches`` (text dicts ``text_emb``/``text_mask``/
            ``pooled`` per CFG pass, cond first; two passes = CFG).
        latent_size: (C, T, H, W) of the whole video's latent; chunks of ``causal_chunk_frames`` (the last may be
            shorter). times: the chunk's schedule with the final 0 (``StreamingGenerator.schedule``).
        refill: re-run each chunk's result at ``context_time`` with ``store_kv`` (as ``StreamingGenerator`` always
            does); False stores the keys/values of the last denoising step instead (the cache is written by the
            denoising pass, as FlashVSR's one-step model does: a different sampler, with no 1-GPU twin in the streaming generator).
        rollout: ``renoise`` or ``euler``. guidance_scale: CFG ``u + w (c - u)`` with two branches.
        make_decoder: called once per group with the device that decodes it: a callable decoding that group's
            chunks in order on that device, e.g. ``decoders.ChunkDecoders`` (the one-GPU streaming
            sampler's decode rule, so the frames equal its frames); None: no decode.
        decode_lanes: the lane that decodes each group (``Plan.decode_lanes``: one per group; None: all on lane 1).
            A causal decoder carries state from chunk to chunk, so a group's chunks stay on one lane.
        decode_stream: ``side`` (each lane decodes on a decode stream beside its compute stream) or ``compute``
            (``Plan.decode_stream``; the frames are the same).
        window_frames / sink_frames: the caches' rolling window (see ``KVCache``).
        rope_anchor: ``"absolute"`` or ``"window"`` (``StreamingGenerator``'s): where the text and the sinks sit in
            RoPE time once the window rolls. Each chunk's RoPE tables carry the anchor its passes will see (a pure
            function of the chunk start, ``KVCache.anchor_before``), so the prep needs no cache state.
        text_cache: keep every block's text keys/values per pass time after the first chunk (``StreamingGenerator``'s
            ``text_cache``, on by default there and here). It changes which rows a pass runs, hence the GEMM shapes and
            in bf16 the rounding: the pipeline and its one-GPU reference must agree on it.
        cuda_graphs: replay each stage's pass as a CUDA graph (``chunk_graphs.ChunkGraphs.stage``, the mechanism of
            ``StreamingGenerator(cuda_graphs=True)``; GPU and text cache only, eager elsewhere): True, or the pair of
            runners (lane 0, lane 1) of an earlier run, whose graphs are reused. Graphs and host threads do not
            mix (a capture on one thread while another launches fails): run such stages from one host thread.
    """

    def __init__(
        self,
        model,
        lanes: Lanes,
        split: int,
        groups: Sequence[Mapping],
        latent_size: Sequence[int],
        times: Sequence[float],
        refill: bool = True,
        rollout: str = "renoise",
        guidance_scale: float = 1.0,
        make_decoder: Optional[Callable] = None,
        context_time: float = 0.0,
        window_frames: Optional[int] = None,
        sink_frames: int = 0,
        rope_anchor: str = "absolute",
        cfg_rows: bool = True,
        text_cache: bool = True,
        cuda_graphs=False,
        decode_lanes: Optional[Sequence[int]] = None,
        decode_stream: str = "side",
    ):
        if not getattr(model, "causal_chunk_frames", 0):
            raise ValueError("streaming stages need a causal MMDiT (causal_chunk_frames > 0)")
        check_rollout(rollout)
        self.times = [float(t) for t in times]
        if len(self.times) < 2 or self.times[-1] != 0:
            raise ValueError(f"times must be a schedule ending at 0, got {self.times}")
        self.model, self.lanes, self.split = model, lanes, split
        self.num_blocks = len(all_blocks(model))
        self.channels, self.total_frames = int(latent_size[0]), int(latent_size[1])
        self.hw = tuple(latent_size[2:])
        self.chunk_frames = int(model.causal_chunk_frames)
        self.rollout, self.guidance_scale, self.context_time = rollout, float(guidance_scale), float(context_time)
        self.dtype = model.img_in.weight.dtype
        self.groups = list(groups)
        passes = len(self.groups[0]["branches"])
        if passes not in (1, 2) or any(len(g["branches"]) != passes for g in self.groups):
            raise ValueError("every group needs the same number of CFG passes (1 or 2)")
        self.guided = passes == 2
        self.cfg_rows = bool(cfg_rows) and self.guided
        self.plan = self.plan_for(
            len(self.groups),
            1 if self.cfg_rows else passes,
            latent_size,
            self.chunk_frames,
            self.times,
            refill,
            make_decoder is not None,
            decode_lanes,
            decode_stream,
        )
        dev0 = lanes.devices[0]
        self.text = []  # per group, per branch: text tensors on lane 0 (rows mode: one branch of all passes)
        for g in self.groups:
            branches = [g["branches"]] if self.cfg_rows else [[b] for b in g["branches"]]
            self.text.append(
                [
                    dict(
                        text_emb=rows_of_passes(b, "text_emb").to(dev0, self.dtype),
                        pooled=rows_of_passes(b, "pooled").to(dev0, self.dtype),
                        text_mask=None
                        if rows_of_passes(b, "text_mask") is None
                        else rows_of_passes(b, "text_mask").to(dev0),
                    )
                    for b in branches
                ]
            )
        self.text_mask1 = [[lanes.pull(t["text_mask"], None, 1) for t in g] for g in self.text]
        self.text_padded = [
            text_has_padding(rows_of_passes(g["branches"], "text_mask")) for g in self.groups
        ]  # one host read per group
        rope = (tuple(model.axes_dims), model.theta)  # moves the sinks and the text keys under the window anchor
        self.caches = [
            [
                (
                    KVCache(split + 1, window_frames, sink_frames, rope_anchor, *rope),
                    KVCache(self.num_blocks - split - 1, window_frames, sink_frames, rope_anchor, *rope),
                )
                for _ in g
            ]
            for g in self.text
        ]
        # per (group, branch, lane): the text keys/values of each lane's blocks per pass time (``TextKVCache``),
        # filled by the first chunk, as ``StreamingGenerator``'s one cache over all blocks (None: text_cache off)
        self.text_caches = [
            [
                (TextKVCache(split + 1, rope), TextKVCache(self.num_blocks - split - 1, rope))
                if text_cache
                else (None, None)
                for _ in g
            ]
            for g in self.text
        ]
        if cuda_graphs is True:  # one runner per lane (a graph pool lives on one device); pass them on to keep them
            cuda_graphs = (ChunkGraphs(model), ChunkGraphs(model))
        self.graphs = tuple(cuda_graphs) if cuda_graphs else None
        self.noise = [
            StreamNoise(g["seeds"], self.channels, self.hw, self.times, rollout, self.context_time) for g in self.groups
        ]
        self.decoders = None
        if make_decoder is not None:
            self.decoders = [make_decoder(lanes.devices[self.plan.decode_lane(g)], g) for g in range(len(self.groups))]
        self.rows = [len(g["seeds"]) * (2 if self.cfg_rows else 1) for g in self.groups]
        self._reused_tensors: Dict[tuple, Any] = {}
        self._reused_lock = threading.Lock()  # lane 0 (prep, stage0) and lane 1 (stage1) may run on two threads
        chunk_frames = [
            min(self.chunk_frames, self.total_frames - s) for s in range(0, self.total_frames, self.chunk_frames)
        ]
        for noise in self.noise:
            noise.reserve(chunk_frames, pin=lanes.cuda)

    @staticmethod
    def plan_for(
        num_groups: int,
        num_branches: int,
        latent_size: Sequence[int],
        chunk_frames: int,
        times: Sequence[float],
        refill: bool = True,
        decode: bool = True,
        decode_lanes: Optional[Sequence[int]] = None,
        decode_stream: str = "side",
    ) -> Plan:
        """The ``Plan`` such stages run (for ``choose_split`` before building them)."""
        num_chunks = -(-int(latent_size[1]) // chunk_frames)
        return Plan(
            num_groups=num_groups,
            num_branches=num_branches,
            num_chunks=num_chunks,
            num_steps=len(times) - 1,
            refill=refill,
            cached=True,
            decode=decode,
            decode_lanes=tuple(decode_lanes or ()) if decode else (),
            decode_stream=decode_stream,
        )

    def prepare(self, group: int, chunk: int) -> dict:
        """Stage A, on lane 0 only (its prep stream; see ``Stages``): the chunk's noise (host RNG drawn ahead into
        pinned memory: the initial latent and the context noise copied to lane 0, the re-noise draws left on the
        host for ``update`` to copy to lane 1), RoPE tables (lane 1's pulled by ``stage1``), timestep rows."""
        model, lanes = self.model, self.lanes
        dev0 = lanes.devices[0]
        start = chunk * self.chunk_frames
        frames = min(self.chunk_frames, self.total_frames - start)
        x, steps, context = self.noise[group].chunk(frames)
        x = to_device_async(x, dev0)
        context = None if context is None else to_device_async(context, dev0)
        pt, ph, pw = model.patch_size
        grid = (frames // pt, self.hw[0] // ph, self.hw[1] // pw)
        num_text = self.text[group][0]["text_emb"].shape[1]

        def rope_tables():
            text_time = self.caches[group][0][0].anchor_before(start) // pt  # the caches' text time at the passes
            return model.rope(grid, num_text, dev0, time_offset=start // pt, text_time=text_time), lanes.event(0)

        rope, rope_ready = self._reused(("rope", grid, num_text, start), rope_tables)
        rows = self.rows[group]
        pass_times = [*self.times[:-1], *([self.context_time] if self.plan.refill else [])]
        t = self._reused(
            ("t", rows), lambda: [torch.full((rows,), tk, device=dev0, dtype=self.dtype) for tk in pass_times]
        )
        cond = None
        if getattr(model, "cond_channels", None):  # text-to-video: the all-zero condition
            cond = self._reused(
                ("cond", rows, frames),
                lambda: torch.zeros(rows, model.cond_channels, frames, *self.hw, device=dev0, dtype=self.dtype),
            )
        return dict(
            x=x,
            steps=steps,
            context=context,
            start=start,
            frames=frames,
            grid=grid,
            rope=rope,
            rope_ready=rope_ready,
            t=t,
            cond=cond,
            group=group,
        )

    def _reused(self, key: tuple, make: Callable):
        """A read-only tensor (tree) the passes share: RoPE tables per chunk start, timestep rows, the zero
        condition, attention masks. Made once instead of per chunk and pass: with graphed stages one host thread
        issues both GPUs, so the launches that rebuild them would be the bottleneck; the same tensors also skip
        the graphs' static-input copies (``_Statics.load`` copies a source only when it changed). The oldest
        entries go first past ``_REUSED_ENTRIES`` (a RoPE table per chunk start: a long stream makes many)."""
        with self._reused_lock:
            value = self._reused_tensors.get(key)
            if value is None:
                value = self._reused_tensors[key] = make()
                while len(self._reused_tensors) > _REUSED_ENTRIES:
                    self._reused_tensors.pop(next(iter(self._reused_tensors)))
        return value

    def text_key(self, step: int) -> float:
        """The text-cache key of a pass (``StreamingGenerator``'s: the pass time, a host float)."""
        return self.context_time if step == self.plan.num_steps else self.times[step]

    def _pass(self, ctx, lane: int, branch: int, step: int, inputs: dict, text_mask, store_kv: bool, num_text: int):
        """``MMDiT.chunk_stage`` over this lane's blocks with its KV cache and text cache (the one-GPU pass's code
        on a range of blocks), then the cache writes ``forward_chunk`` makes after its pass; replayed as a CUDA
        graph (``ChunkGraphs.stage``) when the stages were built with ``cuda_graphs``."""
        model, g = self.model, ctx["group"]
        lo, hi = (0, self.split + 1) if lane == 0 else (self.split + 1, self.num_blocks)
        cache = self.caches[g][branch][lane]
        text_cache = self.text_caches[g][branch][lane]
        key = self.text_key(step)
        past = cache.keys[0].shape[2] if cache.keys[0] is not None else 0
        tokens = ctx["grid"][0] * ctx["grid"][1] * ctx["grid"][2]
        device = self.lanes.devices[lane]
        # as forward_chunk: a text-cached pass with every text key valid attends without a mask
        text_hit = text_cache is not None and key in text_cache.entries  # (get() would count a hit or miss)
        if text_hit and text_keys_all_valid(text_mask, self.text_padded[g]):
            inputs["mask"] = None
        else:
            inputs["mask"] = self._reused(
                ("mask", lane, g, branch, num_text, tokens, past),
                lambda: model.chunk_mask(text_mask, num_text, tokens, past, device),
            )

        def eager():
            text_kv = None if text_cache is None else text_cache.get(key, cache.text_time)
            pending = {} if store_kv else None
            entry = {} if text_cache is not None and text_kv is None else None
            out = model.chunk_stage(inputs, lo, hi, num_text, cache, text_kv, pending, entry, ctx["grid"])
            if entry is not None:
                text_cache.put(key, [entry[i] for i in range(text_cache.num_blocks)], cache.text_time)
            if store_kv:
                cache.append(pending, ctx["start"], ctx["frames"], frames_per_group=model.patch_size[0])
            return out

        runner = None if self.graphs is None else self.graphs[lane]
        if runner is None or text_cache is None or not runner.usable(inputs["cos"]):
            return eager()
        return runner.stage(
            inputs,
            lo,
            hi,
            num_text=num_text,
            cache=cache,
            text_cache=text_cache,
            text_key=key,
            store_kv=store_kv,
            start_frame=ctx["start"],
            eager=eager,
            grid=ctx["grid"],
            fresh=("x", "timestep", "img", "txt", "tokens", "vec"),
            slot=(g, branch),
        )

    def stage0(self, ctx, branch: int, step: int, x, store_kv: bool) -> dict:
        if step == self.plan.num_steps and ctx["context"] is not None:  # the refill at a context time > 0
            x = fm.add_noise(x, ctx["context"], self.context_time)
        if self.cfg_rows:
            x = torch.cat([x] * 2)
        text = self.text[ctx["group"]][branch]
        inputs = dict(
            x=x.to(self.dtype),
            timestep=ctx["t"][step],
            text_emb=text["text_emb"],
            pooled=text["pooled"],
            cond=ctx["cond"],
            cos=ctx["rope"][0],
            sin=ctx["rope"][1],
        )
        num_text = text["text_emb"].shape[1]
        return self._pass(ctx, 0, branch, step, inputs, text["text_mask"], store_kv, num_text)

    def stage1(self, ctx, branch: int, step: int, act, store_kv: bool) -> Optional[torch.Tensor]:
        g = ctx["group"]
        num_text = self.text[g][branch]["text_emb"].shape[1]
        # lane 1's RoPE tables: pulled here, once per chunk start, not by the prep (a pull there would make lane 1's
        # stream wait for lane 0 at the prep's position); the copy waits for the tables' event, which precedes the
        # stage0 whose activations this stage already waits for
        rope1 = self._reused(
            ("rope1", ctx["grid"], num_text, ctx["start"]),
            lambda: self.lanes.pull(ctx["rope"], ctx["rope_ready"], 1),
        )
        inputs = dict(act, cos=rope1[0], sin=rope1[1])
        out = self._pass(ctx, 1, branch, step, inputs, self.text_mask1[g][branch], store_kv, num_text)
        return None if step >= self.plan.num_steps else out  # the refill's output is never read

    def update(self, ctx, step: int, outputs: List[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if self.cfg_rows:
            v = text_cfg(*outputs[0].float().chunk(2), self.guidance_scale)
        elif self.guided:
            v = text_cfg(outputs[0].float(), outputs[1].float(), self.guidance_scale)
        else:
            v = outputs[0].float()
        noise = ctx["steps"][step]  # a pinned host view: copied here, on lane 1's stream, not by the prep
        noise = None if noise is None else to_device_async(noise, self.lanes.devices[1])
        return rollout_step(x, v, self.times[step], self.times[step + 1], self.rollout, noise)

    def decode(self, ctx, x0: torch.Tensor) -> torch.Tensor:
        return self.decoders[ctx["group"]](x0)
