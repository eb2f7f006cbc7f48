"""The MMDiT cut into the two stages of ``pipeline_parallel`` and the ``Stages`` of the bidirectional sampler.

Global block index: ``[*double_blocks, *single_blocks]``. ``place_model(model, split, devices)`` puts the input
embedders and blocks[0..split] on devices[0] and blocks[split+1..] and the final layer on devices[1]. Stage 0
runs ``embed`` + ``run_blocks(0, split + 1)``; stage 1 runs ``run_blocks(split + 1, n)`` + ``finish``. These are
the operations of ``MMDiT.forward`` in its order and with its shapes (the activations in between are a dict:
``img``/``txt`` inside the double blocks, ``tokens`` + ``num_text`` after them), so the output is bit-identical to
``forward`` on one device.

``BidirectionalStages``: the multi-step Euler sampler with CFG (``opensora.diffusion.sampling``), one prompt group
per work unit and the CFG branches as separate micro-batches, so independent forwards keep both GPUs busy.
Its single-device reference is ``sample_microbatched`` (same math as ``sampling.sample`` but one branch per
forward, since a batch of 2 runs other GEMM shapes than two batches of 1 and so may round differently).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from opensora.diffusion import flow_matching as fm
from opensora.diffusion.guidance import text_cfg
from opensora.diffusion.sampling import euler_step
from opensora.models.mmdit.causal import text_keys_all_valid
from opensora.models.mmdit.model import patchify, unpatchify

from .schedule import Lanes, Plan

STAGE0_MODULES = ("img_in", "cond_in", "txt_in", "time_in", "vector_in", "guidance_in")


def all_blocks(model) -> list:
    return [*model.double_blocks, *model.single_blocks]


def place_model(model, split: int, devices: Sequence) -> None:
    """Move ``model``'s modules in place: embedders + blocks[0..split] -> devices[0], the rest -> devices[1]."""
    dev0, dev1 = (torch.device(d) for d in devices)
    blocks = all_blocks(model)
    if not 0 <= split < len(blocks) - 1:
        raise ValueError(f"split {split} must lie in [0, {len(blocks) - 2}]")
    for name in STAGE0_MODULES:
        module = getattr(model, name, None)
        if module is not None:
            module.to(dev0)
    for i, block in enumerate(blocks):
        block.to(dev0 if i <= split else dev1)
    model.final_layer.to(dev1)


def embed(model, x: torch.Tensor, text_emb: torch.Tensor, cond: Optional[torch.Tensor] = None) -> dict:
    """``forward``'s video and text token embeddings."""
    img = model.img_in(patchify(x, model.patch_size))
    if cond is not None:
        img = img + model.cond_in(patchify(cond, model.patch_size))
    return dict(img=img, txt=model.txt_in(text_emb))


def run_blocks(model, state: dict, lo: int, hi: int, vec, rope, mask, kv_hook_for: Optional[Callable] = None) -> dict:
    """Blocks ``lo..hi-1`` (global index) on ``state``; ``kv_hook_for(i)`` gives block i's kv_hook (or None)."""
    depth_double = len(model.double_blocks)
    for i in range(lo, hi):
        hook = kv_hook_for(i) if kv_hook_for is not None else None
        extra = {} if hook is None else dict(kv_hook=hook)
        if i < depth_double:
            img, txt = model.double_blocks[i](state["img"], state["txt"], vec, rope, mask, **extra)
            state = dict(img=img, txt=txt)
        else:
            if "tokens" not in state:
                state = dict(tokens=torch.cat((state["txt"], state["img"]), dim=1), num_text=state["txt"].shape[1])
            state = dict(
                tokens=model.single_blocks[i - depth_double](state["tokens"], vec, rope, mask, **extra),
                num_text=state["num_text"],
            )
    return state


def finish(model, state: dict, vec, grid) -> torch.Tensor:
    """Final layer + unpatchify of the video tokens."""
    if "tokens" in state:
        img = state["tokens"][:, state["num_text"] :]
    else:
        img = torch.cat((state["txt"], state["img"]), dim=1)[:, state["txt"].shape[1] :]
    return unpatchify(model.final_layer(img, vec), grid, model.patch_size)


def latent_grid(model, shape) -> tuple:
    pt, ph, pw = model.patch_size
    return (shape[-3] // pt, shape[-2] // ph, shape[-1] // pw)


def seeded_latent_noise(seeds: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """Row i from a CPU generator seeded with seeds[i] (as ``sampler.seeded_noise``)."""
    return torch.stack([torch.randn(tuple(shape), generator=torch.Generator("cpu").manual_seed(int(s))) for s in seeds])


def to_device_async(x: torch.Tensor, device) -> torch.Tensor:
    device = torch.device(device)
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


# ----------------------------------------------------------------------------------------------------------
# Bidirectional multi-step sampler (independent work items: prompt groups x CFG branches)
# ----------------------------------------------------------------------------------------------------------
class BidirectionalStages:
    """Euler + CFG over the whole clip for several prompt groups; ``plan``: one chunk, no cache.

    Args:
        model: an MMDiT already placed by ``place_model(model, split, lanes.devices)`` (or on one device).
        lanes: the pipeline's ``Lanes``.
        split: index of the last block on lane 0.
        groups: per group a dict with ``seeds`` (one per sample) and ``branches``: a list of text dicts
            (``text_emb``, ``text_mask``, ``pooled``) per CFG branch, cond first, each batched like the seeds.
        latent_shape: (C, T, H, W). times: the sampler's schedule (``timesteps_for_sampling``), n + 1 floats.
        guidance_scale: CFG scale (2 branches) or ignored with 1 branch. decode: x0 (lane 1) -> frames, or None.
    """

    def __init__(
        self,
        model,
        lanes: Lanes,
        split: int,
        groups: Sequence[Mapping],
        latent_shape: Sequence[int],
        times: Sequence[float],
        guidance_scale: float = 1.0,
        decode: Optional[Callable] = None,
    ):
        self.model, self.lanes, self.split = model, lanes, split
        self.num_blocks = len(all_blocks(model))
        self.groups = list(groups)
        self.latent_shape = tuple(latent_shape)
        self.times = [float(t) for t in times]
        self.guidance_scale = float(guidance_scale)
        self.decode_fn = decode
        self.dtype = model.img_in.weight.dtype
        branches = {len(g["branches"]) for g in self.groups}
        if len(branches) != 1 or branches.pop() not in (1, 2):
            raise ValueError("every group needs the same number of CFG branches (1 or 2)")
        self.plan = Plan(
            num_groups=len(self.groups),
            num_branches=len(self.groups[0]["branches"]),
            num_chunks=1,
            num_steps=len(self.times) - 1,
            refill=False,
            cached=False,
            decode=decode is not None,
        )

    def prepare(self, group: int, chunk: int) -> dict:
        model, lanes, dev0 = self.model, self.lanes, self.lanes.devices[0]
        spec = self.groups[group]
        x = to_device_async(seeded_latent_noise(spec["seeds"], self.latent_shape), dev0)
        batch = x.shape[0]
        grid = latent_grid(model, self.latent_shape)
        branches = []
        for text in spec["branches"]:
            text_emb = text["text_emb"].to(dev0, self.dtype)
            pooled = text["pooled"].to(dev0, self.dtype)
            mask = None if text.get("text_mask") is None else text["text_mask"].to(dev0)
            vecs = [
                model.conditioning_vector(torch.full((batch,), t, device=dev0).to(self.dtype), pooled, None)
                for t in self.times[:-1]
            ]
            key_mask = model.key_mask(mask, grid[0] * grid[1] * grid[2])
            branches.append(dict(text_emb=text_emb, mask=key_mask, vec=vecs))
        rope = model.rope(grid, branches[0]["text_emb"].shape[1], dev0)
        # lane 1's copies of the tables are pulled by its first stage1 (``lane1``), not here: see ``Stages``
        return dict(x=x, grid=grid, rope=rope, branches=branches, ready=lanes.event(0))

    def lane1(self, ctx) -> dict:
        """The RoPE tables, masks and conditioning vectors on lane 1, pulled once per group by its first stage1
        (the copies wait for the prep's event, which that stage1's input already waited for)."""
        if "lane1" not in ctx:
            pull, ready = self.lanes.pull, ctx["ready"]
            ctx["lane1"] = dict(
                rope=pull(ctx["rope"], ready, 1),
                branches=[pull(dict(mask=b["mask"], vec=b["vec"]), ready, 1) for b in ctx["branches"]],
            )
        return ctx["lane1"]

    def stage0(self, ctx, branch: int, step: int, x, store_kv: bool) -> dict:
        b = ctx["branches"][branch]
        state = embed(self.model, x.to(self.dtype), b["text_emb"])
        return run_blocks(self.model, state, 0, self.split + 1, b["vec"][step], ctx["rope"], b["mask"])

    def stage1(self, ctx, branch: int, step: int, state, store_kv: bool) -> torch.Tensor:
        b = self.lane1(ctx)["branches"][branch]
        state = run_blocks(
            self.model, state, self.split + 1, self.num_blocks, b["vec"][step], self.lane1(ctx)["rope"], b["mask"]
        )
        return finish(self.model, state, b["vec"][step], ctx["grid"])

    def update(self, ctx, step: int, outputs: List[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        outs = [o.float() for o in outputs]
        v = outs[0] if len(outs) == 1 else text_cfg(outs[0], outs[1], self.guidance_scale)
        return euler_step(x, v, self.times[step], self.times[step + 1])

    def decode(self, ctx, x0: torch.Tensor) -> torch.Tensor:
        return self.decode_fn(x0)


@torch.no_grad()
def sample_microbatched(
    model,
    group: Mapping,
    latent_shape,
    times: Sequence[float],
    guidance_scale: float,
    device,
    decode: Optional[Callable] = None,
):
    """Single-device reference for one group of ``BidirectionalStages``: ``model.forward`` once per branch per
    step, CFG and Euler as ``sampling.sample``. Returns (x0, frames or None)."""
    dtype = model.img_in.weight.dtype
    x = to_device_async(seeded_latent_noise(group["seeds"], latent_shape), device)
    times = [float(t) for t in times]
    for k in range(len(times) - 1):
        outs = []
        for text in group["branches"]:
            t_vec = torch.full((x.shape[0],), times[k], device=device).to(dtype)
            mask = None if text.get("text_mask") is None else text["text_mask"].to(device)
            outs.append(
                model(
                    x.to(dtype),
                    timestep=t_vec,
                    text_emb=text["text_emb"].to(device, dtype),
                    text_mask=mask,
                    pooled=text["pooled"].to(device, dtype),
                ).float()
            )
        v = outs[0] if len(outs) == 1 else text_cfg(outs[0], outs[1], guidance_scale)
        x = euler_step(x, v, times[k], times[k + 1])
    return x, (decode(x) if decode is not None else None)


# ----------------------------------------------------------------------------------------------------------
# Streaming (causal MMDiT with KV caches), chunk by chunk: the math of ``StreamingGenerator``
# ----------------------------------------------------------------------------------------------------------
STEP_RULES = ("renoise", "euler")
_REUSED_ENTRIES = 64  # CausalStreamingStages._reused: RoPE tables of ~16 chunk starts x masks x a few groups


def chunk_update(
    x: torch.Tensor, v: torch.Tensor, t: float, t_next: float, rule: str, noise: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """One step of ``StreamingGenerator``'s chunk loop, with its exact expressions (host floats ``t``, ``t_next``):
    ``euler``: ``x + (t_next - t) v``; ``renoise``: ``x0 = x - t v``, then ``x0`` at ``t_next == 0`` else
    ``add_noise(x0, noise, t_next)``."""
    if rule == "euler":
        return x + (t_next - t) * v
    if rule != "renoise":
        raise ValueError(f"unknown step rule '{rule}'; choose one of {STEP_RULES}")
    x0 = x - t * v
    return x0 if t_next == 0 else fm.add_noise(x0, noise, t_next)


class StreamNoise:
    """One group's host noise in ``StreamingGenerator``'s order: per chunk the initial latent, a draw for every
    re-noised step (``renoise``, next time > 0), then one for the context time when it is > 0. One CPU generator per
    sample, so a sample's noise does not depend on its batch."""

    def __init__(
        self,
        seeds: Sequence[int],
        channels: int,
        hw: Sequence[int],
        times: Sequence[float],
        rule: str,
        context_t: float,
    ):
        self.gens = [torch.Generator("cpu").manual_seed(int(s)) for s in seeds]
        self.channels, self.hw, self.times = channels, tuple(hw), list(times)
        self.rule, self.context_t = rule, context_t
        self.reserved: Deque[Tuple[int, torch.Tensor]] = deque()  # (frames, host buffer) per chunk: ``reserve``

    def draw(self, frames: int) -> torch.Tensor:
        from opensora.inference.sampler import noise_from_generators

        return noise_from_generators(self.gens, (self.channels, frames, *self.hw))

    def draws_per_chunk(self) -> int:
        """The initial latent, one draw per re-noised step, the context noise."""
        renoised = sum(1 for t_next in self.times[1:] if self.rule == "renoise" and t_next != 0)
        return 1 + renoised + (1 if self.context_t != 0 else 0)

    def chunk(self, frames: int):
        """(initial x, [noise per step or None], context noise or None), drawn now (in a ``reserve``d buffer, if
        any: then views of it)."""
        x = self.draw(frames)
        steps = [self.draw(frames) if self.rule == "renoise" and t_next != 0 else None for t_next in self.times[1:]]
        context = self.draw(frames) if self.context_t != 0 else None
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


def _rows(texts: Sequence[Mapping], key: str):
    """The CFG passes' ``key`` as rows of one batch (a missing text mask = every token valid)."""
    parts = [t.get(key) for t in texts]
    if all(p is None for p in parts):
        return None
    if key == "text_mask":
        parts = [
            torch.ones(t["text_emb"].shape[:2], dtype=torch.bool, device=t["text_emb"].device) if p is None else p
            for t, p in zip(texts, parts)
        ]
    return torch.cat(parts)


def text_has_padding(branches: Sequence[Mapping]) -> bool:
    """Whether a text token of any CFG pass of a group is padding (a missing mask: none is), read once per stream as
    ``StreamingGenerator.prepare_text`` reads it over all its text rows. Without padding a text-cached pass attends
    without a mask (``forward_chunk(text_mask_has_padding=False)``), which another attention kernel computes: the
    pipeline and its one-GPU references decide alike, or their outputs differ in the last bits."""
    mask = _rows(branches, "text_mask")
    return mask is not None and not bool(mask.all())


class CausalStreamingStages:
    """``StreamingGenerator``'s chunk loop with a block-causal MMDiT split over two devices.

    Per (group, branch) two ``KVCache``s: one over blocks[0..split] on lane 0, one over blocks[split+1..] on lane 1;
    each stage appends its own blocks' keys/values, so together they hold exactly what one cache over all blocks
    holds after ``forward_chunk`` (same frames, same rolling window); likewise two ``TextKVCache``s. Every forward
    runs ``forward_chunk``'s own functions (``MMDiT.chunk_start``, ``chunk_blocks`` on the lane's block range,
    ``chunk_finish``; a text-cache hit runs the video rows only, as there), the step update (``chunk_update``) and
    the noise order are ``StreamingGenerator``'s: with
    ``cfg_rows=True`` (its layout: the cond and null-text passes as rows of one batch and one cache) the output is
    bit-identical to it; ``cfg_rows=False`` runs the CFG passes as separate micro-batches with their own caches
    (independent items a second GPU can overlap; identical to ``stream_reference(cfg_rows=False)``).

    Args:
        model: a causal MMDiT placed by ``place_model`` (or on one device). lanes / split: as ``BidirectionalStages``.
        groups: per group ``seeds`` (one per sample) and ``branches`` (text dicts ``text_emb``/``text_mask``/
            ``pooled`` per CFG pass, cond first; two passes = CFG).
        latent_size: (C, T, H, W) of the whole video's latent; chunks of ``causal_chunk_frames`` (the last may be
            shorter). times: the chunk's schedule with the final 0 (``StreamingGenerator.schedule``).
        refill: re-run each chunk's result at ``context_t`` with ``store_kv`` (as ``StreamingGenerator`` always
            does); False stores the keys/values of the last denoising step instead (the cache is written by the
            denoising pass, as FlashVSR's one-step model does: a different sampler, with no 1-GPU twin in the streaming generator).
        rule: ``renoise`` or ``euler``. guidance_scale: CFG ``u + w (c - u)`` with two branches.
        make_decoder: called once per group: a callable decoding that group's chunks in order (lane 1), e.g. a
            ``streaming.generator.ChunkDecoder``; None: no decode.
        window_frames / sink_frames: the caches' rolling window (see ``KVCache``).
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
        rule: str = "renoise",
        guidance_scale: float = 1.0,
        make_decoder: Optional[Callable] = None,
        context_t: float = 0.0,
        window_frames: Optional[int] = None,
        sink_frames: int = 0,
        cfg_rows: bool = True,
        text_cache: bool = True,
        cuda_graphs=False,
    ):
        from opensora.models.mmdit.causal import KVCache, TextKVCache

        if not getattr(model, "causal_chunk_frames", 0):
            raise ValueError("streaming stages need a causal MMDiT (causal_chunk_frames > 0)")
        if rule not in STEP_RULES:
            raise ValueError(f"unknown step rule '{rule}'; choose one of {STEP_RULES}")
        self.times = [float(t) for t in times]
        if len(self.times) < 2 or self.times[-1] != 0:
            raise ValueError(f"times must be a schedule ending at 0, got {self.times}")
        self.model, self.lanes, self.split = model, lanes, split
        self.num_blocks = len(all_blocks(model))
        self.channels, self.total_frames = int(latent_size[0]), int(latent_size[1])
        self.hw = tuple(latent_size[2:])
        self.chunk_frames = int(model.causal_chunk_frames)
        self.rule, self.guidance_scale, self.context_t = rule, float(guidance_scale), float(context_t)
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
        )
        dev0 = lanes.devices[0]
        self.text = []  # per group, per branch: text tensors on lane 0 (rows mode: one branch of all passes)
        for g in self.groups:
            branches = [g["branches"]] if self.cfg_rows else [[b] for b in g["branches"]]
            self.text.append(
                [
                    dict(
                        text_emb=_rows(b, "text_emb").to(dev0, self.dtype),
                        pooled=_rows(b, "pooled").to(dev0, self.dtype),
                        text_mask=None if _rows(b, "text_mask") is None else _rows(b, "text_mask").to(dev0),
                    )
                    for b in branches
                ]
            )
        self.text_mask1 = [[lanes.pull(t["text_mask"], None, 1) for t in g] for g in self.text]
        self.text_padded = [text_has_padding(g["branches"]) for g in self.groups]  # one host read per group
        self.caches = [
            [
                (
                    KVCache(split + 1, window_frames, sink_frames),
                    KVCache(self.num_blocks - split - 1, window_frames, sink_frames),
                )
                for _ in g
            ]
            for g in self.text
        ]
        # per (group, branch, lane): the text keys/values of each lane's blocks per pass time (``TextKVCache``),
        # filled by the first chunk, as ``StreamingGenerator``'s one cache over all blocks (None: text_cache off)
        self.text_caches = [
            [
                (TextKVCache(split + 1), TextKVCache(self.num_blocks - split - 1)) if text_cache else (None, None)
                for _ in g
            ]
            for g in self.text
        ]
        if cuda_graphs is True:  # one runner per lane (a graph pool lives on one device); pass them on to keep them
            from opensora.inference.streaming.chunk_graphs import ChunkGraphs

            cuda_graphs = (ChunkGraphs(model), ChunkGraphs(model))
        self.graphs = tuple(cuda_graphs) if cuda_graphs else None
        self.noise = [
            StreamNoise(g["seeds"], self.channels, self.hw, self.times, rule, self.context_t) for g in self.groups
        ]
        self.decoders = [make_decoder() for _ in self.groups] if make_decoder is not None else None
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
            return model.rope(grid, num_text, dev0, time_offset=start // pt), lanes.event(0)

        rope, rope_ready = self._reused(("rope", grid, num_text, start), rope_tables)
        rows = self.rows[group]
        pass_times = [*self.times[:-1], *([self.context_t] if self.plan.refill else [])]
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
        return self.context_t if step == self.plan.num_steps else self.times[step]

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
            text_kv = None if text_cache is None else text_cache.get(key)
            pending = {} if store_kv else None
            entry = {} if text_cache is not None and text_kv is None else None
            out = model.chunk_stage(inputs, lo, hi, num_text, cache, text_kv, pending, entry, ctx["grid"])
            if entry is not None:
                text_cache.entries[key] = [entry[i] for i in range(text_cache.num_blocks)]
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
            x = fm.add_noise(x, ctx["context"], self.context_t)
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
        return chunk_update(x, v, self.times[step], self.times[step + 1], self.rule, noise)

    def decode(self, ctx, x0: torch.Tensor) -> torch.Tensor:
        return self.decoders[ctx["group"]](x0)


@torch.no_grad()
def stream_reference(
    model,
    group: Mapping,
    latent_size: Sequence[int],
    times: Sequence[float],
    refill: bool = True,
    rule: str = "renoise",
    guidance_scale: float = 1.0,
    make_decoder: Optional[Callable] = None,
    context_t: float = 0.0,
    window_frames: Optional[int] = None,
    sink_frames: int = 0,
    cfg_rows: bool = True,
    device="cpu",
    text_cache: bool = True,
):
    """A single-device streaming loop with ``CausalStreamingStages``'s options: ``StreamingGenerator``'s math on
    ``forward_chunk`` with its text cache (its own test checks it against the generator), plus the variants the generator does not
    have (``refill=False``: the last step stores the keys/values; ``cfg_rows=False``: one cache per CFG pass).
    Returns (x0 per chunk, decoded frames per chunk or None)."""
    dtype = model.img_in.weight.dtype
    times = [float(t) for t in times]
    channels, total, hw = int(latent_size[0]), int(latent_size[1]), tuple(latent_size[2:])
    chunk_frames = int(model.causal_chunk_frames)
    guided = len(group["branches"]) == 2
    rows_mode = cfg_rows and guided
    branch_sets = [group["branches"]] if rows_mode else [[b] for b in group["branches"]]
    texts = [
        dict(
            text_emb=_rows(b, "text_emb").to(device, dtype),
            pooled=_rows(b, "pooled").to(device, dtype),
            text_mask=None if _rows(b, "text_mask") is None else _rows(b, "text_mask").to(device),
        )
        for b in branch_sets
    ]
    padded = text_has_padding(group["branches"])
    caches = [model.new_kv_cache(window_frames, sink_frames) for _ in texts]
    text_caches = [model.new_text_cache() if text_cache else None for _ in texts]
    noise = StreamNoise(group["seeds"], channels, hw, times, rule, context_t)
    decoder = make_decoder() if make_decoder is not None else None
    rows = len(group["seeds"]) * (2 if rows_mode else 1)
    latents, frames_out = [], []
    for start in range(0, total, chunk_frames):
        frames = min(chunk_frames, total - start)
        x, steps, context = noise.chunk(frames)
        x = to_device_async(x, device)
        cond = None
        if getattr(model, "cond_channels", None):
            cond = torch.zeros(rows, model.cond_channels, frames, *hw, device=device, dtype=dtype)

        def forward(x_in, t, store):
            if rows_mode:
                x_in = torch.cat([x_in] * 2)
            outs = []
            for text, cache, text_cache_ in zip(texts, caches, text_caches):
                t_vec = torch.full((rows,), t, device=device, dtype=dtype)
                outs.append(
                    model.forward_chunk(
                        x_in.to(dtype),
                        timestep=t_vec,
                        text_emb=text["text_emb"],
                        text_mask=text["text_mask"],
                        pooled=text["pooled"],
                        cond=cond,
                        cache=cache,
                        start_frame=start,
                        store_kv=store,
                        text_cache=text_cache_,
                        text_key=t,
                        text_mask_has_padding=padded,
                    ).float()
                )
            if rows_mode:
                return text_cfg(*outs[0].chunk(2), guidance_scale)
            return text_cfg(outs[0], outs[1], guidance_scale) if guided else outs[0]

        for k, (t, t_next) in enumerate(zip(times[:-1], times[1:])):
            last = k == len(times) - 2
            v = forward(x, t, store=last and not refill)
            eps = None if steps[k] is None else to_device_async(steps[k], device)
            x = chunk_update(x, v, t, t_next, rule, eps)
        if refill and start + frames < total:  # the last chunk's cache is never read (as StreamingGenerator)
            ctx_in = x if context is None else fm.add_noise(x, to_device_async(context, device), context_t)
            forward(ctx_in, context_t, store=True)
        latents.append(x)
        frames_out.append(decoder(x) if decoder is not None else None)
    return latents, frames_out


# ----------------------------------------------------------------------------------------------------------
# Stage times for ``--pp-split auto``
# ----------------------------------------------------------------------------------------------------------
class _Timer:
    """Marks on one device: CUDA events (no host sync until ``read``) or host clocks on the CPU."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.marks = []

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            self.marks.append(ev)
        else:
            import time

            self.marks.append(time.perf_counter())

    def read(self) -> List[float]:
        """Milliseconds between consecutive marks."""
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def _graph_replay_ms(body, device, repeats: int) -> float:
    """Median GPU time (ms) of one replay of ``body`` captured as a CUDA graph on ``device`` (events around every
    replay; the first replay is not counted). (tests/test_pipeline_parallel.py swaps this for an eager timer.)"""
    from statistics import median

    from opensora.models.mmdit.graph_memory import GraphMemory, on_capture_device

    with on_capture_device(device):
        graph = GraphMemory().capture(body, device)
        stream = torch.cuda.current_stream(device)
        pairs = []
        for _ in range(repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            graph.replay()
            end.record(stream)
            pairs.append((start, end))
        pairs[-1][1].synchronize()
    return median(a.elapsed_time(b) for a, b in pairs[1:])


@torch.no_grad()
def measure_stage_times(
    model,
    x: torch.Tensor,
    text: Mapping,
    decode: Optional[Callable] = None,
    repeats: int = 3,
    cuda_graphs: bool = False,
    past_frames: int = 0,
) -> dict:
    """Median time of the embedding, every block, the final layer and the decode of one forward of ``x`` (a chunk
    for a causal model, with the streaming mask; the whole clip otherwise) on the model's device.
    Feed the result to ``pipeline_parallel.choose_split``.

    ``past_frames`` (causal models): the chunk attends to that many cached latent frames, as a chunk does once the
    rolling window is full. Pass the window the stages will hold: attention over the cache is a larger share of a
    single block than of a double block, so blocks timed at frame 0 put too much on the lane of the single blocks
    (2 H200s, 1B, split 10: GPU1 96% busy, GPU0 86%).

    Eager (default): what eager stages cost, launch time included (at a 1B streamed chunk the GPU waits for the
    host: a block's time is about its kernel count, not its work). ``cuda_graphs=True`` (a CUDA device only; eager
    elsewhere): the embedding, every block and the final layer each captured as a CUDA graph and timed by replays,
    i.e. what graphed stages (``CausalStreamingStages(cuda_graphs=...)``) cost; choose a graphed pipeline's split
    from these (``graphed`` in the result says which were taken: a failed capture falls back to the eager times).
    The decode is timed eagerly either way (the stages decode eagerly)."""
    if cuda_graphs and x.is_cuda and torch.cuda.is_available():
        try:
            return _graphed_stage_times(model, x, text, decode, repeats, past_frames)
        except Exception as error:  # noqa: BLE001  (a failed capture: the eager times, said so, not a crash)
            import warnings

            warnings.warn(f"graphed stage times failed, using eager ones: {error}")
            torch.cuda.synchronize(x.device)
    return _eager_stage_times(model, x, text, decode, repeats, past_frames)


@torch.no_grad()
def measure_stage_passes(
    model,
    devices: Sequence,
    split: int,
    group: Mapping,
    latent_size: Sequence[int],
    times: Sequence[float],
    past_frames: int,
    repeats: int = 4,
    cuda_graphs: bool = False,
    **stage_kw,
) -> dict:
    """Median time (ms) of one whole stage0 and one whole stage1 pass of ``CausalStreamingStages`` (the run's own
    pass code: its masks, caches, text cache, activation hand-over, and CUDA graphs when ``cuda_graphs``) with
    ``model`` placed at ``split`` on ``devices``, for the chunk after ``past_frames`` cached frames (the caches
    filled by running the earlier chunks' cache-writing passes eagerly). One warm-up pass per stage (the capture,
    when graphed), then ``repeats`` timed passes of the first denoising step (no cache write). ``group``: one
    prompt group as the stages take it; ``latent_size`` (C, T, H, W): the video's, only C, H, W are used;
    ``stage_kw``: the stages' sampler options (``refill``, ``rule``, ``context_t``, ``window_frames``,
    ``cfg_rows``, ...). The result (``split``, ``stage0``, ``stage1``, ...) is what
    ``pipeline_parallel.calibrated_split`` takes as ``measured``: per-block probes do not add up to a stage's pass."""
    from statistics import median

    lanes = Lanes(devices)
    chunk = int(model.causal_chunk_frames)
    size = (latent_size[0], int(past_frames) + chunk, *latent_size[2:])
    kw = dict(stage_kw, make_decoder=None, cuda_graphs=False)
    stages = CausalStreamingStages(model, lanes, split, [group], size, times, **kw)
    plan = stages.plan

    def forward(ctx, step: int, store: bool):
        with lanes.device_context(0):
            act = stages.stage0(ctx, 0, step, ctx["x"], store)
        with lanes.device_context(1):
            act = lanes.pull(act, lanes.event(0), 1)
            return act, stages.stage1(ctx, 0, step, act, store)

    for c in range(plan.num_chunks - 1):  # the caches (and the text cache: every pass time of chunk 0)
        ctx = stages.prepare(0, c)
        for step in range(plan.forwards(c)) if c == 0 else [plan.writer_step]:
            forward(ctx, step, plan.store_kv(step))
    if cuda_graphs:  # fill eagerly, capture only the timed passes (one graph per stage)
        from opensora.inference.streaming.chunk_graphs import ChunkGraphs

        stages.graphs = (ChunkGraphs(model), ChunkGraphs(model))
    ctx = stages.prepare(0, plan.num_chunks - 1)
    # warm-up; in a one-chunk video (nothing filled) the first pass fills the text cache, running the text rows
    # too, and the timed passes are the ones after it
    for _ in range(1 if plan.num_chunks > 1 else 2):
        act, _ = forward(ctx, 0, False)
    samples = []
    for lane in (0, 1):
        timer = _Timer(lanes.devices[lane])
        with lanes.device_context(lane):
            for _ in range(repeats):
                timer.mark()
                if lane == 0:
                    stages.stage0(ctx, 0, 0, ctx["x"], False)
                else:
                    stages.stage1(ctx, 0, 0, act, False)
                timer.mark()
        samples.append(timer.read()[::2])  # each pass's own span, not the gaps between them
    lanes.synchronize()
    graphs = None if stages.graphs is None else [runner.summary for runner in stages.graphs]
    return dict(
        split=split,
        stage0=median(samples[0]),
        stage1=median(samples[1]),
        stage0_samples=samples[0],
        stage1_samples=samples[1],
        past_frames=int(past_frames),
        cached_frames=stages.caches[0][0][0].num_frames,
        graphed=bool(graphs) and all(g["replays"] > 0 and g["eager"] == 0 for g in graphs),
        graphs=graphs,
    )


def typical_past_frames(total_frames: int, chunk_frames: int, window_frames: Optional[int] = None) -> int:
    """The cached latent frames a chunk of the video attends to on average (each chunk sees the frames before it,
    at most ``window_frames``): the ``past_frames`` at which to time stages for a split."""
    starts = range(0, int(total_frames), int(chunk_frames))
    seen = [s if window_frames is None else min(s, int(window_frames)) for s in starts]
    mean = sum(seen) / len(seen)
    return int(round(mean / chunk_frames)) * int(chunk_frames)  # whole chunks, as the cache holds them


def _stage_inputs(model, x, text):
    """(x, timestep, text_emb, pooled, text_mask) of a stage-time probe on ``x``'s device and the model's dtype."""
    device, dtype = x.device, model.img_in.weight.dtype
    text_emb, pooled = text["text_emb"].to(device, dtype), text["pooled"].to(device, dtype)
    text_mask = None if text.get("text_mask") is None else text["text_mask"].to(device)
    t = torch.full((x.shape[0],), 0.5, device=device).to(dtype)
    return x.to(dtype), t, text_emb, pooled, text_mask


def _probe_mask_hooks(model, text_mask, num_text: int, num_video: int, device, past=None):
    """The attention mask and kv hooks of a probe forward (a causal model: a chunk after the frames ``past``, a
    ``KVCache``, holds; none: at frame 0, nothing cached)."""
    if getattr(model, "causal_chunk_frames", 0):
        from opensora.models.mmdit.causal import streaming_kv_hooks

        past = model.new_kv_cache() if past is None else past
        past_tokens = past.keys[0].shape[2] if past.keys[0] is not None else 0
        mask = model.chunk_mask(text_mask, num_text, num_video, past_tokens, device)
        return mask, streaming_kv_hooks(past, num_text, mask, None)
    return model.key_mask(text_mask, num_video), None


def _probe_past(model, x, t, text_emb, pooled, text_mask, past_frames: int):
    """A ``KVCache`` holding ``past_frames`` latent frames (copies of one probe chunk's keys/values; only their
    shapes matter for timing), or None for a bidirectional model or ``past_frames == 0``."""
    if not getattr(model, "causal_chunk_frames", 0) or past_frames <= 0:
        return None
    from opensora.models.mmdit.causal import streaming_kv_hooks

    img, txt, vec, grid = model.embed(x, t, text_emb, pooled)
    rope = model.rope(grid, txt.shape[1], x.device)
    fresh = model.new_kv_cache()
    mask = model.chunk_mask(text_mask, txt.shape[1], img.shape[1], 0, x.device)
    pending = {}
    run_blocks(
        model,
        dict(img=img, txt=txt),
        0,
        len(all_blocks(model)),
        vec,
        rope,
        mask,
        streaming_kv_hooks(fresh, txt.shape[1], mask, pending).__getitem__,
    )
    chunk = x.shape[2]
    for start in range(0, past_frames, chunk):
        frames = min(chunk, past_frames - start)
        tokens = pending[0][0].shape[2] * frames // chunk
        fresh.append(
            {i: (k[:, :, :tokens], v[:, :, :tokens]) for i, (k, v) in pending.items()},
            start,
            frames,
            frames_per_group=model.patch_size[0],
        )
    return fresh


def _graphed_stage_times(model, x, text, decode, repeats: int, past_frames: int = 0) -> dict:
    device = x.device
    x, t, text_emb, pooled, text_mask = _stage_inputs(model, x, text)
    n = len(all_blocks(model))
    past = _probe_past(model, x, t, text_emb, pooled, text_mask, past_frames)
    img, txt, vec, grid = model.embed(x, t, text_emb, pooled)
    rope = model.rope(grid, txt.shape[1], device, time_offset=_probe_offset(model, past))
    mask, hooks = _probe_mask_hooks(model, text_mask, txt.shape[1], img.shape[1], device, past)
    hook_for = None if hooks is None else hooks.__getitem__
    states = [dict(img=img, txt=txt)]  # the input of every block (eager), each block then timed on its own input
    for i in range(n):
        states.append(run_blocks(model, dict(states[-1]), i, i + 1, vec, rope, mask, hook_for))
    embed_ms = _graph_replay_ms(lambda: model.embed(x, t, text_emb, pooled), device, repeats)
    block_ms = [
        _graph_replay_ms(
            lambda i=i: run_blocks(model, dict(states[i]), i, i + 1, vec, rope, mask, hook_for), device, repeats
        )
        for i in range(n)
    ]
    final_ms = _graph_replay_ms(lambda: finish(model, dict(states[n]), vec, grid), device, repeats)
    decode_ms = 0.0
    if decode is not None:
        out = finish(model, dict(states[n]), vec, grid).float()
        decode_ms = _eager_ms(lambda: decode(out), device, repeats)
    return dict(embed_ms=embed_ms, block_ms=block_ms, final_ms=final_ms, decode_ms=decode_ms, graphed=True)


def _eager_ms(fn, device, repeats: int) -> float:
    """Median eager time (ms) of ``fn`` over ``repeats`` runs after a warm-up run."""
    from statistics import median

    samples = []
    for _ in range(repeats + 1):
        timer = _Timer(device)
        timer.mark()
        fn()
        timer.mark()
        samples.append(timer.read()[0])
    return median(samples[1:])


def _probe_offset(model, past) -> int:
    """RoPE time offset (in time patches) of the probe chunk: right after the frames ``past`` holds."""
    return 0 if past is None else past.end_frame // model.patch_size[0]


def _eager_stage_times(model, x, text, decode, repeats: int, past_frames: int = 0) -> dict:
    from statistics import median

    device = x.device
    x, t, text_emb, pooled, text_mask = _stage_inputs(model, x, text)
    n = len(all_blocks(model))
    past = _probe_past(model, x, t, text_emb, pooled, text_mask, past_frames)
    samples = []
    for _ in range(repeats + 1):  # the first run warms up kernels and allocator
        timer = _Timer(device)
        timer.mark()
        img, txt, vec, grid = model.embed(x, t, text_emb, pooled)
        rope = model.rope(grid, txt.shape[1], device, time_offset=_probe_offset(model, past))
        mask, hooks = _probe_mask_hooks(model, text_mask, txt.shape[1], img.shape[1], device, past)
        timer.mark()
        state = dict(img=img, txt=txt)
        for i in range(n):
            state = run_blocks(model, state, i, i + 1, vec, rope, mask, None if hooks is None else hooks.__getitem__)
            timer.mark()
        out = finish(model, state, vec, grid)
        timer.mark()
        if decode is not None:
            decode(out.float())
        timer.mark()
        samples.append(timer.read())
    samples = samples[1:]
    med = [median(s[i] for s in samples) for i in range(len(samples[0]))]
    return dict(embed_ms=med[0], block_ms=med[1 : 1 + n], final_ms=med[1 + n], decode_ms=med[2 + n], graphed=False)
