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

from typing import Callable, List, Mapping, Optional, Sequence, Tuple

import torch

from opensora.diffusion.guidance import text_cfg
from opensora.diffusion.sampling import euler_step
from opensora.models.mmdit.model import patchify, unpatchify

from .pipeline_parallel import Lanes, Plan

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
            state = dict(tokens=model.single_blocks[i - depth_double](state["tokens"], vec, rope, mask, **extra),
                         num_text=state["num_text"])
    return state


def finish(model, state: dict, vec, grid) -> torch.Tensor:
    """Final layer + unpatchify of the video tokens."""
    if "tokens" in state:
        img = state["tokens"][:, state["num_text"]:]
    else:
        img = torch.cat((state["txt"], state["img"]), dim=1)[:, state["txt"].shape[1]:]
    return unpatchify(model.final_layer(img, vec), grid, model.patch_size)


def latent_grid(model, shape) -> tuple:
    pt, ph, pw = model.patch_size
    return (shape[-3] // pt, shape[-2] // ph, shape[-1] // pw)


def seeded_latent_noise(seeds: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """Row i from a CPU generator seeded with seeds[i] (as ``pipeline.seeded_noise``)."""
    return torch.stack([torch.randn(tuple(shape), generator=torch.Generator("cpu").manual_seed(int(s)))
                        for s in seeds])


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

    def __init__(self, model, lanes: Lanes, split: int, groups: Sequence[Mapping], latent_shape: Sequence[int],
                 times: Sequence[float], guidance_scale: float = 1.0, decode: Optional[Callable] = None):
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
        self.plan = Plan(num_groups=len(self.groups), num_branches=len(self.groups[0]["branches"]), num_chunks=1,
                         num_steps=len(self.times) - 1, refill=False, cached=False, decode=decode is not None)

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
            vecs = [model.conditioning_vector(torch.full((batch,), t, device=dev0).to(self.dtype), pooled, None)
                    for t in self.times[:-1]]
            key_mask = model.key_mask(mask, grid[0] * grid[1] * grid[2])
            branches.append(dict(text_emb=text_emb, mask=key_mask, vec=vecs))
        rope = model.rope(grid, branches[0]["text_emb"].shape[1], dev0)
        ready = lanes.event(0)
        lane1 = dict(rope=lanes.pull(rope, ready, 1),
                     branches=[lanes.pull(dict(mask=b["mask"], vec=b["vec"]), ready, 1) for b in branches])
        return dict(x=x, grid=grid, rope=rope, branches=branches, lane1=lane1)

    def stage0(self, ctx, branch: int, step: int, x, store_kv: bool) -> dict:
        b = ctx["branches"][branch]
        state = embed(self.model, x.to(self.dtype), b["text_emb"])
        return run_blocks(self.model, state, 0, self.split + 1, b["vec"][step], ctx["rope"], b["mask"])

    def stage1(self, ctx, branch: int, step: int, state, store_kv: bool) -> torch.Tensor:
        b = ctx["lane1"]["branches"][branch]
        state = run_blocks(self.model, state, self.split + 1, self.num_blocks, b["vec"][step], ctx["lane1"]["rope"],
                           b["mask"])
        return finish(self.model, state, b["vec"][step], ctx["grid"])

    def update(self, ctx, step: int, outputs: List[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        outs = [o.float() for o in outputs]
        v = outs[0] if len(outs) == 1 else text_cfg(outs[0], outs[1], self.guidance_scale)
        return euler_step(x, v, self.times[step], self.times[step + 1])

    def decode(self, ctx, x0: torch.Tensor) -> torch.Tensor:
        return self.decode_fn(x0)


@torch.no_grad()
def sample_microbatched(model, group: Mapping, latent_shape, times: Sequence[float], guidance_scale: float,
                        device, decode: Optional[Callable] = None):
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
            outs.append(model(x.to(dtype), t_vec, text["text_emb"].to(device, dtype), mask,
                              text["pooled"].to(device, dtype)).float())
        v = outs[0] if len(outs) == 1 else text_cfg(outs[0], outs[1], guidance_scale)
        x = euler_step(x, v, times[k], times[k + 1])
    return x, (decode(x) if decode is not None else None)


# ----------------------------------------------------------------------------------------------------------
# Streaming (causal MMDiT with KV caches), chunk by chunk
# ----------------------------------------------------------------------------------------------------------
STEP_RULES = ("renoise", "euler")


def chunk_update(x: torch.Tensor, v: torch.Tensor, t: float, t_next: Optional[float], rule: str,
                 noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One step of the per-chunk few-step sampler (fp32): ``x0 = x - t v``; ``t_next=None`` returns x0; otherwise
    ``renoise`` (DMD / Self-Forcing students): ``(1 - t_next) x0 + t_next noise``; ``euler``: ``x + (t_next - t) v``."""
    if t_next is None:
        return x - t * v
    if rule == "renoise":
        return (1.0 - t_next) * (x - t * v) + t_next * noise
    if rule == "euler":
        return euler_step(x, v, t, t_next)
    raise ValueError(f"unknown step rule '{rule}'; choose one of {STEP_RULES}")


class StreamNoise:
    """Host noise of one group in the single-device order: per chunk the initial latent, then (``renoise``) one
    draw per later step; one CPU generator per sample, so the batch never changes which noise a sample gets."""

    def __init__(self, seeds: Sequence[int], chunk_shape: Sequence[int], num_steps: int, rule: str):
        self.gens = [torch.Generator("cpu").manual_seed(int(s)) for s in seeds]
        self.shape, self.num_steps, self.rule = tuple(chunk_shape), num_steps, rule

    def draw(self) -> torch.Tensor:
        return torch.stack([torch.randn(self.shape, generator=g) for g in self.gens])

    def chunk(self) -> Tuple[torch.Tensor, List[Optional[torch.Tensor]]]:
        x = self.draw()
        later = [self.draw() if self.rule == "renoise" else None for _ in range(1, self.num_steps)]
        return x, later


class CausalStreamingStages:
    """Streaming generation with a block-causal MMDiT (``causal_chunk_frames > 0``) split over two devices.

    Per (group, branch) two ``KVCache``s: one over blocks[0..split] on lane 0, one over blocks[split+1..] on
    lane 1; each stage appends its own blocks' keys/values, so the caches hold exactly what one cache over all
    blocks holds after ``forward_chunk`` (same frames, same rolling window). Every forward runs the operations of
    ``MMDiT.forward_chunk`` in its order, so outputs are bit-identical to ``stream_reference``.

    Args:
        model: a causal MMDiT placed by ``place_model`` (or on one device). lanes / split: as ``BidirectionalStages``.
        groups: per group ``seeds`` (one per sample) and ``branches`` (text dicts per CFG branch, cond first).
        chunk_shape: (C, frames per chunk, H, W) of the latent chunk. num_chunks: chunks per video.
        steps: the per-chunk step list (descending t, without the final 0). refill: re-run the final x0 at
            ``context_t`` with ``store_kv`` (else the last denoising step stores). rule: ``renoise`` or ``euler``.
        guidance_scale: CFG scale with 2 branches. decode: x0 chunk (lane 1) -> frames, or None.
        window_frames / sink_frames: the caches' rolling window (see ``KVCache``).
    """

    def __init__(self, model, lanes: Lanes, split: int, groups: Sequence[Mapping], chunk_shape: Sequence[int],
                 num_chunks: int, steps: Sequence[float], refill: bool = True, rule: str = "renoise",
                 guidance_scale: float = 1.0, decode: Optional[Callable] = None, context_t: float = 0.0,
                 window_frames: Optional[int] = None, sink_frames: int = 0):
        from opensora.models.mmdit.causal import KVCache

        if not getattr(model, "causal_chunk_frames", 0):
            raise ValueError("streaming stages need a causal MMDiT (causal_chunk_frames > 0)")
        if rule not in STEP_RULES:
            raise ValueError(f"unknown step rule '{rule}'; choose one of {STEP_RULES}")
        self.model, self.lanes, self.split = model, lanes, split
        self.num_blocks = len(all_blocks(model))
        self.chunk_shape, self.steps = tuple(chunk_shape), [float(t) for t in steps]
        self.rule, self.guidance_scale, self.decode_fn = rule, float(guidance_scale), decode
        self.context_t = float(context_t)
        self.dtype = model.img_in.weight.dtype
        self.groups = list(groups)
        num_branches = len(self.groups[0]["branches"])
        self.plan = Plan(num_groups=len(self.groups), num_branches=num_branches, num_chunks=num_chunks,
                         num_steps=len(self.steps), refill=refill, cached=True, decode=decode is not None)
        dev0 = lanes.devices[0]
        self.text = [[dict(text_emb=t["text_emb"].to(dev0, self.dtype), pooled=t["pooled"].to(dev0, self.dtype),
                           text_mask=None if t.get("text_mask") is None else t["text_mask"].to(dev0))
                      for t in g["branches"]] for g in self.groups]
        self.text_mask1 = [[lanes.pull(t["text_mask"], None, 1) for t in g] for g in self.text]
        self.caches = [[(KVCache(split + 1, window_frames, sink_frames),
                         KVCache(self.num_blocks - split - 1, window_frames, sink_frames))
                        for _ in g["branches"]] for g in self.groups]
        self.noise = [StreamNoise(g["seeds"], chunk_shape, len(self.steps), rule) for g in self.groups]

    def times(self, k: int) -> float:
        return self.steps[k] if k < len(self.steps) else self.context_t

    def prepare(self, group: int, chunk: int) -> dict:
        model, lanes = self.model, self.lanes
        dev0 = lanes.devices[0]
        x, later = self.noise[group].chunk()
        x = to_device_async(x, dev0)
        later = [None if n is None else to_device_async(n, lanes.devices[1]) for n in later]
        start = chunk * self.chunk_shape[1]
        grid = latent_grid(model, self.chunk_shape)
        rope = model.rope(grid, self.text[group][0]["text_emb"].shape[1], dev0, time_offset=start // model.patch_size[0])
        batch = x.shape[0]
        t = [torch.full((batch,), self.times(k), device=dev0).to(self.dtype) for k in range(self.plan.forwards_per_chunk)]
        rope1 = lanes.pull(rope, lanes.event(0), 1)
        return dict(x=x, later=later, start=start, grid=grid, rope=rope, rope1=rope1, t=t, group=group)

    def _mask(self, cache, text_mask, num_text, num_video, device):
        from opensora.models.mmdit.causal import joint_attention_mask

        past = cache.keys[0].shape[2] if cache.keys[0] is not None else 0
        video = torch.ones(num_video, past + num_video, dtype=torch.bool, device=device)
        return joint_attention_mask(text_mask, num_text, video)

    def _blocks(self, ctx, cache, state, lo, hi, vec, rope, text_mask, store_kv, device):
        from opensora.models.mmdit.causal import streaming_kv_hooks

        num_text = state["txt"].shape[1] if "txt" in state else state["num_text"]
        num_video = state["img"].shape[1] if "img" in state else state["tokens"].shape[1] - num_text
        mask = self._mask(cache, text_mask, num_text, num_video, device)
        pending = {} if store_kv else None
        hooks = streaming_kv_hooks(cache, num_text, mask, pending)
        state = run_blocks(self.model, state, lo, hi, vec, rope, mask, lambda i: hooks[i - lo])
        if store_kv:
            cache.append(pending, ctx["start"], self.chunk_shape[1], frames_per_group=self.model.patch_size[0])
        return state

    def stage0(self, ctx, branch: int, step: int, x, store_kv: bool) -> dict:
        text = self.text[ctx["group"]][branch]
        img, txt, vec, _ = self.model.embed(x.to(self.dtype), ctx["t"][step], text["text_emb"], text["pooled"])
        cache = self.caches[ctx["group"]][branch][0]
        state = self._blocks(ctx, cache, dict(img=img, txt=txt), 0, self.split + 1, vec, ctx["rope"],
                             text["text_mask"], store_kv, self.lanes.devices[0])
        return dict(state=state, vec=vec)

    def stage1(self, ctx, branch: int, step: int, act, store_kv: bool) -> torch.Tensor:
        cache = self.caches[ctx["group"]][branch][1]
        state = self._blocks(ctx, cache, act["state"], self.split + 1, self.num_blocks, act["vec"], ctx["rope1"],
                             self.text_mask1[ctx["group"]][branch], store_kv, self.lanes.devices[1])
        if step >= self.plan.num_steps:
            return None  # the refill's output is never read: only its cache writes matter
        return finish(self.model, state, act["vec"], ctx["grid"])

    def update(self, ctx, step: int, outputs: List[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        outs = [o.float() for o in outputs]
        v = outs[0] if len(outs) == 1 else text_cfg(outs[0], outs[1], self.guidance_scale)
        last = step == self.plan.num_steps - 1
        t_next = None if last else self.steps[step + 1]
        return chunk_update(x, v, self.steps[step], t_next, self.rule, None if last else ctx["later"][step])

    def decode(self, ctx, x0: torch.Tensor) -> torch.Tensor:
        return self.decode_fn(x0)


@torch.no_grad()
def stream_reference(model, group: Mapping, chunk_shape: Sequence[int], num_chunks: int, steps: Sequence[float],
                     refill: bool = True, rule: str = "renoise", guidance_scale: float = 1.0,
                     decode: Optional[Callable] = None, context_t: float = 0.0, window_frames: Optional[int] = None,
                     sink_frames: int = 0, device="cpu"):
    """The single-device streaming loop the pipeline must reproduce: per chunk, ``forward_chunk`` once per branch
    per step (``store_kv`` on the last step without refill), CFG, ``chunk_update``; with refill the final x0 re-run
    at ``context_t`` with ``store_kv``; decode. Returns (list of x0 per chunk, list of frames per chunk)."""
    dtype = model.img_in.weight.dtype
    steps = [float(t) for t in steps]
    caches = [model.new_kv_cache(window_frames, sink_frames) for _ in group["branches"]]
    texts = [dict(text_emb=t["text_emb"].to(device, dtype), pooled=t["pooled"].to(device, dtype),
                  text_mask=None if t.get("text_mask") is None else t["text_mask"].to(device))
             for t in group["branches"]]
    noise = StreamNoise(group["seeds"], chunk_shape, len(steps), rule)
    latents, frames = [], []
    for c in range(num_chunks):
        start = c * chunk_shape[1]
        x, later = noise.chunk()
        x = to_device_async(x, device)
        later = [None if n is None else to_device_async(n, device) for n in later]

        def forward(x_in, t, store):
            outs = []
            for text, cache in zip(texts, caches):
                t_vec = torch.full((x_in.shape[0],), t, device=device).to(dtype)
                outs.append(model.forward_chunk(x_in.to(dtype), t_vec, text["text_emb"], text["text_mask"],
                                                text["pooled"], cache=cache, start_frame=start, store_kv=store))
            return outs

        for k, t in enumerate(steps):
            last = k == len(steps) - 1
            outs = [o.float() for o in forward(x, t, store=last and not refill)]
            v = outs[0] if len(outs) == 1 else text_cfg(outs[0], outs[1], guidance_scale)
            x = chunk_update(x, v, t, None if last else steps[k + 1], rule, None if last else later[k])
        if refill:
            forward(x, context_t, store=True)
        latents.append(x)
        frames.append(decode(x) if decode is not None else None)
    return latents, frames


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


@torch.no_grad()
def measure_stage_times(model, x: torch.Tensor, text: Mapping, decode: Optional[Callable] = None,
                        repeats: int = 3) -> dict:
    """Median time of the embedding, every block, the final layer and the decode of one forward of ``x`` (a chunk
    at frame 0 for a causal model, with the streaming mask; the whole clip otherwise) on the model's device.
    Feed the result to ``pipeline_parallel.choose_split``."""
    from statistics import median

    device = x.device
    dtype = model.img_in.weight.dtype
    text_emb, pooled = text["text_emb"].to(device, dtype), text["pooled"].to(device, dtype)
    text_mask = None if text.get("text_mask") is None else text["text_mask"].to(device)
    t = torch.full((x.shape[0],), 0.5, device=device).to(dtype)
    n = len(all_blocks(model))
    samples = []
    for _ in range(repeats + 1):  # the first run warms up kernels and allocator
        timer = _Timer(device)
        timer.mark()
        img, txt, vec, grid = model.embed(x.to(dtype), t, text_emb, pooled)
        rope = model.rope(grid, txt.shape[1], device)
        hooks = None
        if getattr(model, "causal_chunk_frames", 0):
            from opensora.models.mmdit.causal import joint_attention_mask, streaming_kv_hooks

            mask = joint_attention_mask(text_mask, txt.shape[1],
                                        torch.ones(img.shape[1], img.shape[1], dtype=torch.bool, device=device))
            hooks = streaming_kv_hooks(model.new_kv_cache(), txt.shape[1], mask, None)
        else:
            mask = model.key_mask(text_mask, img.shape[1])
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
    return dict(embed_ms=med[0], block_ms=med[1:1 + n], final_ms=med[1 + n], decode_ms=med[2 + n])
