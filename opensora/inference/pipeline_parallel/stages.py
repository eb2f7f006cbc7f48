"""The MMDiT cut into the two stages of the two-GPU pipeline, and the ``Stages`` of the bidirectional sampler.

Global block index: ``[*double_blocks, *single_blocks]``. ``place_model(model, split, devices)`` puts the input
embedders and blocks[0..split] on devices[0] and blocks[split+1..] and the final layer on devices[1]. Stage 0
runs the model's own ``embed_tokens`` + ``run_block_range(0, split + 1)``; stage 1 runs ``run_block_range(split + 1,
n)`` + ``final_tokens``. These are the operations of ``MMDiT.forward`` in its order and with its shapes (the
activations in between are ``run_block_range``'s state: ``img``/``txt`` inside the double blocks, ``tokens`` +
``num_text`` after them), so the output is bit-identical to ``forward`` on one device. The causal streaming stages
(streaming_stages.py) run the model's ``chunk_stage`` the same way.

``BidirectionalStages``: the multi-step Euler sampler with CFG (``opensora.diffusion.sampling``), one prompt group
per work unit and the CFG branches as separate micro-batches, so independent forwards keep both GPUs busy.
Its single-device reference is ``sample_microbatched`` (same math as ``sampling.sample`` but one branch per
forward, since a batch of 2 runs other GEMM shapes than two batches of 1 and so may round differently).
"""

from __future__ import annotations

from typing import Callable, List, Mapping, Optional, Sequence

import torch

from opensora.diffusion.guidance import text_cfg
from opensora.diffusion.sampling import euler_step
from opensora.models.mmdit.patches import unpatchify

from .runtime import Lanes
from .schedule import Plan

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


def final_velocity(model, state: dict, vec, grid) -> torch.Tensor:
    """The model's final layer on a stage's state after the last block, in the video layout."""
    return unpatchify(model.final_tokens(state, vec), grid, model.patch_size)


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
            mask = None if text.get("text_mask") is None else text["text_mask"].to(dev0)
            # the text and padding mask ``forward`` attends with (trimmed after the longest valid prompt)
            text_emb, mask, lengths = model.prepare_text(text["text_emb"].to(dev0, self.dtype), mask)
            pooled = text["pooled"].to(dev0, self.dtype)
            vecs = [
                model.conditioning_vector(torch.full((batch,), t, device=dev0).to(self.dtype), pooled, None)
                for t in self.times[:-1]
            ]
            key_mask = model.padding_mask(mask, lengths, text_emb.shape[1], grid[0] * grid[1] * grid[2])
            rope = model.rope(grid, text_emb.shape[1], dev0)  # per branch: a trimmed text has its own length
            branches.append(dict(text_emb=text_emb, mask=key_mask, vec=vecs, rope=rope))
        # lane 1's copies of the tables are pulled by its first stage1 (``lane1``), not here: see ``Stages``
        return dict(x=x, grid=grid, branches=branches, ready=lanes.event(0))

    def lane1(self, ctx) -> dict:
        """The RoPE tables, masks and conditioning vectors on lane 1, pulled once per group by its first stage1
        (the copies wait for the prep's event, which that stage1's input already waited for)."""
        if "lane1" not in ctx:
            pull, ready = self.lanes.pull, ctx["ready"]
            ctx["lane1"] = [pull(dict(mask=b["mask"], vec=b["vec"], rope=b["rope"]), ready, 1) for b in ctx["branches"]]
        return ctx["lane1"]

    def stage0(self, ctx, branch: int, step: int, x, store_kv: bool) -> dict:
        b = ctx["branches"][branch]
        img, txt, _ = self.model.embed_tokens(x.to(self.dtype), b["text_emb"])
        return self.model.run_block_range(
            dict(img=img, txt=txt), 0, self.split + 1, b["vec"][step], b["rope"], b["mask"]
        )

    def stage1(self, ctx, branch: int, step: int, state, store_kv: bool) -> torch.Tensor:
        b = self.lane1(ctx)[branch]
        state = self.model.run_block_range(state, self.split + 1, self.num_blocks, b["vec"][step], b["rope"], b["mask"])
        return final_velocity(self.model, state, b["vec"][step], ctx["grid"])

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
