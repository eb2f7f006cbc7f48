"""``stream_reference``: a plain one-device streaming loop with the two-GPU causal stages' options, the reference the
pipeline's bit-identity tests (and benchmarks/pipeline_parallel.py) compare against. It is ``StreamingGenerator``'s
math (the step rule, noise order and padding decision of ``opensora.inference.streaming.rules``) on
``forward_chunk`` with its text cache (tests/test_pipeline_parallel.py checks it against the generator), plus the
variants the generator does not have (``refill=False``: the last step stores the keys/values; ``cfg_rows=False``:
one cache per CFG pass)."""

from typing import Callable, Mapping, Optional, Sequence

import torch

from opensora.diffusion import flow_matching as fm
from opensora.diffusion.guidance import text_cfg
from opensora.inference.pipeline_parallel.stages import to_device_async
from opensora.inference.streaming.rules import StreamNoise, rollout_step, rows_of_passes, text_has_padding


@torch.no_grad()
def stream_reference(
    model,
    group: Mapping,
    latent_size: Sequence[int],
    times: Sequence[float],
    refill: bool = True,
    rollout: str = "renoise",
    guidance_scale: float = 1.0,
    make_decoder: Optional[Callable] = None,
    context_time: float = 0.0,
    window_frames: Optional[int] = None,
    sink_frames: int = 0,
    cfg_rows: bool = True,
    device="cpu",
    text_cache: bool = True,
):
    """The loop of the module docstring for one prompt group as ``CausalStreamingStages`` takes it.
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
            text_emb=rows_of_passes(b, "text_emb").to(device, dtype),
            pooled=rows_of_passes(b, "pooled").to(device, dtype),
            text_mask=None if rows_of_passes(b, "text_mask") is None else rows_of_passes(b, "text_mask").to(device),
        )
        for b in branch_sets
    ]
    padded = text_has_padding(rows_of_passes(group["branches"], "text_mask"))
    caches = [model.new_kv_cache(window_frames, sink_frames) for _ in texts]
    text_caches = [model.new_text_cache() if text_cache else None for _ in texts]
    noise = StreamNoise(group["seeds"], channels, hw, times, rollout, context_time)
    decoder = make_decoder(torch.device(device), 0) if make_decoder is not None else None  # (device, group)
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
            x = rollout_step(x, v, t, t_next, rollout, eps)
        if refill and start + frames < total:  # the last chunk's cache is never read (as StreamingGenerator)
            ctx_in = x if context is None else fm.add_noise(x, to_device_async(context, device), context_time)
            forward(ctx_in, context_time, store=True)
        latents.append(x)
        frames_out.append(decoder(x) if decoder is not None else None)
    return latents, frames_out
