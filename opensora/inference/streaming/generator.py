"""Streaming generation with a causal MMDiT: chunk after chunk, each denoised in a few steps against a KV cache of
the frames already made, decoded and handed out as soon as it is done (Self-Forcing / CausVid inference).

Per chunk of ``K`` latent frames (``MMDiT.causal_chunk_frames``) at absolute latent frame ``s``:

1. ``x`` = fresh noise; for each time ``t_i`` of the step list: ``v = model.forward_chunk(x, t_i, store_kv=False)``
   (with CFG ``u + w (c - u)``, both branches as rows of one batch and one cache), then
   ``rollout="renoise"``: ``x0 = x - t_i v``, ``x = (1 - t_{i+1}) x0 + t_{i+1} eps'`` with fresh noise
   (what Self-Forcing and CausVid sample with); ``rollout="euler"``: ``x = x + (t_{i+1} - t_i) v``.
2. Cache refill: the clean chunk runs once more at the context time (0 by default; Self-Forcing's "context
   noise") with ``store_kv=True``; later chunks attend to these keys/values. The refill runs after the chunk is
   decoded and handed out (it only matters to the next chunk), and the last chunk is not refilled (no chunk reads
   it). With ``merge_refill`` the refill of chunk ``k`` and the first step of chunk ``k + 1`` run as one
   pass of twice the rows (``causal_refill.refill_and_step``: same math, fewer, fuller passes). The cache keeps at most
   ``window_frames`` frames (sinks included), so memory stays flat however long the video gets.
   With ``text_cache`` (default) every block's text keys/values are kept per distinct pass time (the step times
   and the context time) after the first chunk made them, and later passes run the video tokens only
   (``TextKVCache``: exact, the text stream of a causal model never sees the video).
3. Decode. An autoencoder without temporal compression (the demo's ``PatchVAE``) decodes frames independently, so
   chunk-wise decoding is exact. The causal HunyuanVideo VAE decodes each latent frame once by default
   (``decode_rule``, ``models/vae/exact_chunk_decode.py``: conv caches, a GroupNorm statistics rule). Under
   ``decode_rule="overlap"`` (and for other temporally compressing autoencoders) a chunk gets ``decode_overlap``
   earlier latent frames as context and only the new chunk's pixel frames are kept: an approximation of the whole-video decode whose
   error shrinks with the overlap (the decoder's temporal receptive field is finite), not an identity.
   With ``overlap_decode`` (default with CUDA graphs) chunk ``k`` is decoded on a side stream while the next chunk's
   passes run, and handed out one chunk later (``DecodeAhead``); the frames are the same.

Re-cache (``recache.py``): with ``kv_recache="shift"`` a refill that rolls the window re-runs the kept frames against
the context they have now; at a prompt switch (``stream(switches=...)``) the text changes (a fresh text cache) and
every kept frame re-runs under the new prompt (with ``switch_renoise``, re-rendered under it first). Both replace that
refill; without either, nothing changes.

Noise: sample ``i`` draws every chunk's noise (and re-noising) from its own CPU generator seeded with
``seeds[i]``, in order, so a sample's video does not depend on the batch it runs in.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from opensora.diffusion import flow_matching as fm
from opensora.diffusion.guidance import text_cfg
from opensora.diffusion.sampling import timesteps_for_sampling, timesteps_from_list
from opensora.inference.io import uint8_frames_on_device
from opensora.inference.sampler import _module_dtype
from opensora.models.mmdit.causal_refill import MergedGraphs, refill_and_step
from opensora.models.mmdit.graph_memory import GraphMemory, on_capture_device
from opensora.models.vae.base import video_num_frames
from opensora.models.vae.exact_chunk_decode import exact_chunk_decode

from . import KV_RECACHE, ROPE_ANCHORS
from .chunk_graphs import ChunkGraphs
from .decode_ahead import DecodeAhead
from .prompt_schedule import switch_chunks
from .recache import Rerender, Stopwatch, WindowLatents, plan_recache, run_recache
from .rules import StreamNoise, check_rollout, rollout_step, text_has_padding


@dataclass
class StreamChunk:
    """One finished chunk: ``frames`` uint8 [B, F, H, W, 3] on the CPU (None without decoding)."""

    index: int
    start_frame: int  # absolute latent frame of the chunk's first frame
    latents: torch.Tensor  # float32 [B, C, Tc, h, w] on the device
    frames: Optional[torch.Tensor]
    seconds: float  # wall time from the end of the previous chunk (or of the set-up) to this chunk's frames
    cached_frames: int  # latent frames in the KV cache when this chunk is handed out (its own refill runs later)
    cache_bytes: int
    text_cache_bytes: int = 0  # text keys/values held by the text cache (every block, every distinct step time)
    prompts: Optional[List[str]] = None  # the prompts this chunk was generated under (one per sample)
    # the re-cache run before this chunk's passes, if any: reason ("shift" | "switch"), frames, passes, seconds
    recache: Optional[dict] = None


class ChunkDecoder:
    """Decodes latent chunks in order, giving each the ``overlap`` previous latent frames as context (see the
    module docstring); with a frame-independent autoencoder (no temporal compression) the result is exact."""

    def __init__(self, decode_fn, vae, overlap: Optional[int] = None, exact=None):
        self.decode_fn = decode_fn  # latents -> uint8 [B, F, H, W, 3]
        self.exact, self.device_output = exact, False  # exact-once decode (exact_chunk_decode): no overlap
        self.compression = int(getattr(vae, "temporal_compression", 1))
        self.causal = bool(getattr(vae, "causal_temporal", False))
        temporal = self.compression > 1 or self.causal
        self.overlap = (2 if temporal else 0) if overlap is None else int(overlap)
        self.context: Optional[torch.Tensor] = None
        self.decoded_latents = 0

    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        start, end = self.decoded_latents, self.decoded_latents + latents.shape[2]
        if self.exact is not None:
            frames, self.decoded_latents = self.exact(latents, first=start == 0), end
            return frames if self.device_output else frames.cpu()
        new_pixels = video_num_frames(end, self.compression, self.causal) - (
            video_num_frames(start, self.compression, self.causal) if start else 0
        )
        inputs = latents if self.context is None else torch.cat((self.context, latents), dim=2)
        frames = self.decode_fn(inputs)[:, -new_pixels:]
        if self.overlap:
            self.context = inputs[:, :, -self.overlap :]
        self.decoded_latents = end
        return frames


class GraphedDecode:
    """``VideoSampler.decode`` (latents -> uint8 frames on the CPU) with the autoencoder and the uint8 conversion
    replayed as one CUDA graph per input shape (a stream has two: the first chunk, and later chunks with their
    decode context). The tiny autoencoders of the benchmarks launch hundreds of small kernels per chunk, which costs
    more host time than the GPU needs. Falls back to ``fallback`` off the GPU or when a capture fails. The decode
    graphs share one memory pool of their own (``GraphMemory``): they may run on a stream beside the chunk graphs."""

    def __init__(self, vae, dtype, fallback):
        self.vae, self.dtype, self.fallback = vae, dtype, fallback
        self.graphs: dict = {}
        self.failures: List[str] = []
        self.memory = GraphMemory(lane="decode")  # may replay beside the chunk graphs (``DecodeAhead``)

    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        frames = self.on_device(latents)
        return self.fallback(latents) if frames is None else frames.cpu()

    def on_device(self, latents: torch.Tensor) -> Optional[torch.Tensor]:
        """The uint8 frames [B, F, H, W, 3] on the device, replayed on the current stream (a static buffer, valid
        until the next replay on that stream); None where no graph runs (off the GPU, with grad, failed capture)."""
        if not (latents.is_cuda and torch.cuda.is_available()) or torch.is_grad_enabled():
            return None
        key = (tuple(latents.shape), latents.device)
        entry = self.graphs.get(key)
        if entry is None:
            try:
                with on_capture_device(latents.device):  # the decode's device, whatever the current device is
                    entry = self.graphs[key] = self._capture(latents)
            except Exception as error:  # noqa: BLE001  (a capture that fails leaves the eager path)
                self.failures.append(f"{type(error).__name__}: {error}")
                warnings.warn(f"CUDA graph capture of the chunk decode failed, decoding eagerly: {error}")
                torch.cuda.synchronize(latents.device)
                self.graphs[key] = entry = False
        if entry is False:
            return None
        static_in, replay, holder = entry
        static_in.copy_(latents)
        replay()
        return holder["out"]

    def _capture(self, latents):
        static_in, holder = latents.to(self.dtype).clone(), {}

        def body():
            holder["out"] = uint8_frames_on_device(self.vae.decode(static_in))

        return static_in, self.memory.capture(body).replay, holder


class StreamingGenerator:
    """Chunk-by-chunk sampling with a causal network held by a ``VideoSampler`` (which brings the autoencoder,
    the text conditioner, the device/dtype and the time shift).

    Args:
        sampler: a ``VideoSampler`` whose model is a causal MMDiT.
        step_list: the chunk's denoising times, used as given (e.g. a distilled student's ``[1.0, 0.75, 0.5,
            0.25]``); ``None``: ``num_steps`` shifted uniform steps, as the sampler uses for full videos.
        rollout: ``"renoise"`` (x0 re-noised with fresh noise at the next time) or ``"euler"``.
        guidance_scale: text CFG ``u + w (c - u)`` per chunk (1: no unconditional branch).
        window_frames / sink_frames: the KV cache's rolling window (``KVCache``); None keeps every frame.
        context_time: time at which the finished chunk is re-run to fill the cache (0: clean).
        decode_overlap: latent frames of context for a temporally compressing autoencoder (default 2) under the
            overlap rule.
        decode_rule: ``"running"`` (default) / ``"chunk"``: the exact-once chunk decode of a HunyuanVideo VAE with
            that GroupNorm statistics rule (``models/vae/streaming_decode.py``; its graphs follow ``decode_graphs``);
            ``"overlap"``: re-decode ``decode_overlap`` earlier latent frames with each chunk.
        text_cache: reuse every block's text keys/values per distinct pass time across the chunks of a video
            (``TextKVCache``): the text stream depends only on (prompts, t), so after the first chunk each pass runs
            the video tokens alone. Bit-identical to ``False`` (recompute the text every pass) on CPU fp32; costs
            ``rows x blocks x 2 x text tokens x hidden`` values per distinct time (reported per chunk as
            ``text_cache_bytes``). A fresh cache per ``stream`` call: nothing carries over between videos.
        merge_refill: run each refill together with the next chunk's first step as one pass of twice the rows
            (``causal_refill.refill_and_step``; equal to the separate passes up to reduction order, fp32 tolerance).
            When no text token is padding (checked once per video) the text-cached merged passes attend without a
            mask: two SDPA calls per block, the refill rows and the step rows each over their own keys (and so do
            the separate text-cached passes, one call over all their keys).
            With ``cuda_graphs`` the merged passes are replayed too (``causal_refill.MergedGraphs``).
        trim_text: cut the text after its last token that is valid in some row (one host read per video; exact up
            to reduction order). The tokenizer pads every prompt to its full length (512 tokens at the 1B shape),
            so this shrinks every pass's text keys, the first chunk's text rows and the text cache, and a batch
            without padding left (one prompt, no CFG) attends without a mask. Off by default: with ``cuda_graphs``
            every distinct prompt length captures graphs of its own.
        decode_graphs: decode each chunk through ``GraphedDecode`` (one CUDA graph per chunk shape, GPU only);
            ``None``: when ``cuda_graphs`` is on. Kept across videos.
        cuda_graphs: replay the chunk passes as CUDA graphs (``chunk_graphs.ChunkGraphs``: one graph per pass shape
            and step time, captured on first use and kept across videos). GPU only and with ``text_cache``; off the
            GPU it is the eager path. Off by default: equal to eager within bf16 tolerance, not bitwise. The chunk
            graphs and the merged ones share one ``GraphMemory`` (pool, outputs, cached video), so the memory they
            hold does not grow with the number of graphs a long video adds. Re-cache passes are storing passes like
            the refills and replay graphs too (a piece size or cached-frame count not seen before captures one).
        overlap_decode: decode chunk ``k`` on a high-priority side stream (``DecodeAhead``) while the main stream
            runs chunk ``k``'s refill and chunk ``k + 1``'s passes; chunk ``k`` is handed out once its frames are on
            the host, after chunk ``k + 1``'s work was enqueued (one chunk of look-ahead). Frames and latents are
            bit-identical to the serial order. ``None``: on with ``cuda_graphs`` on a GPU (eager passes are
            host-bound: enqueueing a chunk ahead would delay the first chunk by its launch time).
        kv_recache: ``"off"`` (default) or ``"shift"``: a refill that rolls the window re-runs the kept frames
            against their current context instead (``recache.py``); ``"off"`` runs exactly the passes it ran before.
        switch_recache: at a prompt switch, re-run every kept frame under the new prompt (default; LongLive).
            False keeps the old prompt's keys/values (the chunk before the switch is refilled under the old prompt).
        switch_renoise: a time ``s`` in (context_time, 1]: at a prompt switch with ``switch_recache`` every kept piece
            is first re-rendered under the new prompt from time ``s`` (``recache.Rerender``), so later chunks attend
            to a context that shows the new prompt; the frames handed out do not change. None (default): off.
        rope_anchor: ``"absolute"`` (default) or ``"window"``: once the window rolls, the text and the sink frames
            sit at the window's start in RoPE time, so no query-key distance leaves the range of a video starting
            there (``KVCache``). A re-cache (``kv_recache``, a prompt switch) then rebuilds the window as a video starting
            at its anchor (``KVCache.pin_anchor``). Not combined with ``merge_refill`` (its merged pass assumes absolute
            positions).
    """

    def __init__(
        self,
        sampler,
        step_list: Optional[Sequence[float]] = None,
        num_steps: int = 4,
        rollout: str = "renoise",
        guidance_scale: float = 1.0,
        window_frames: Optional[int] = None,
        sink_frames: int = 0,
        context_time: float = 0.0,
        decode_overlap: Optional[int] = None,
        text_cache: bool = True,
        cuda_graphs: bool = False,
        merge_refill: bool = False,
        decode_graphs: Optional[bool] = None,
        overlap_decode: Optional[bool] = None,
        trim_text: bool = False,
        decode_rule: str = "running",
        kv_recache: str = "off",
        switch_recache: bool = True,
        rope_anchor: str = "absolute",
        switch_renoise: Optional[float] = None,
    ):
        model = sampler.model
        if not getattr(model, "causal_chunk_frames", 0):
            raise ValueError("streaming needs a causal model (MMDiT with causal_chunk_frames > 0)")
        check_rollout(rollout)
        if kv_recache not in KV_RECACHE:
            raise ValueError(f"unknown kv_recache {kv_recache!r}; choose one of {KV_RECACHE}")
        if rope_anchor not in ROPE_ANCHORS:
            raise ValueError(f"unknown rope_anchor {rope_anchor!r}; choose one of {ROPE_ANCHORS}")
        if rope_anchor == "window" and merge_refill:
            raise ValueError("rope_anchor='window' does not support merge_refill yet")
        if not 0.0 <= context_time < 1.0:
            raise ValueError(f"context_time must lie in [0, 1), got {context_time}")
        if switch_renoise is not None and not context_time < switch_renoise <= 1.0:
            raise ValueError(f"switch_renoise must lie in (context_time={context_time}, 1], got {switch_renoise}")
        if switch_renoise is not None and not switch_recache:
            raise ValueError("switch_renoise re-renders the window a switch re-caches: it needs switch_recache=True")
        self.switch_renoise = None if switch_renoise is None else float(switch_renoise)
        self.sampler, self.model = sampler, model
        self.chunk_frames = int(model.causal_chunk_frames)
        self.step_list = None if step_list is None else [float(t) for t in step_list]
        self.num_steps = int(num_steps)
        self.rollout = rollout
        self.guidance_scale = float(guidance_scale)
        self.window_frames, self.sink_frames = window_frames, int(sink_frames)
        self.context_time = float(context_time)
        self.decode_overlap = decode_overlap
        self.text_cache = bool(text_cache)
        self.merge_refill = bool(merge_refill)
        self.overlap_decode = overlap_decode
        self.trim_text = bool(trim_text)
        self.kv_recache, self.switch_recache = kv_recache, bool(switch_recache)
        self.rope_anchor = rope_anchor
        decode_graphs = cuda_graphs if decode_graphs is None else decode_graphs
        self.decode_graphs = None
        offloaded = getattr(sampler, "offload", False)  # an offloaded autoencoder moves: overlap rule, no graphs
        self.exact_decode = None
        self.decode_rule, self.exact_graphs = decode_rule, bool(decode_graphs)  # what a pipeline's decoders copy
        if not offloaded:
            graphs = bool(decode_graphs)
            self.exact_decode = exact_chunk_decode(
                sampler.vae, decode_rule, graphs=graphs, postprocess=uint8_frames_on_device
            )
        if decode_graphs and not offloaded and self.exact_decode is None:
            vae_dtype = _module_dtype(sampler.vae, sampler.dtype)
            self.decode_graphs = GraphedDecode(sampler.vae, vae_dtype, sampler.decode)
        self.passes = 0  # model passes run (a merged pass counts once), over every ``stream`` call
        self.cuda_graphs = self.merged_graphs = None
        if cuda_graphs:
            self.cuda_graphs = ChunkGraphs(model, GraphMemory())
            self.merged_graphs = MergedGraphs(model, self.cuda_graphs.memory) if merge_refill else None

    def overlaps_decode(self, device: torch.device) -> bool:
        """Whether ``stream`` decodes a chunk ahead on a side stream (``overlap_decode``; None: with CUDA graphs on a
        GPU). Never with an offloaded autoencoder (it moves between host and device around each decode)."""
        if getattr(self.sampler, "offload", False):
            return False
        if self.overlap_decode is not None:
            return bool(self.overlap_decode)
        return self.cuda_graphs is not None and device.type == "cuda"

    def device_decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> uint8 frames on the device (the decode graph where one runs, else the eager autoencoder): the
        same operations as ``VideoSampler.decode`` without its copy to the host."""
        frames = self.decode_graphs.on_device(latents) if self.decode_graphs is not None else None
        if frames is None:
            vae = self.sampler.vae
            with torch.no_grad():
                frames = uint8_frames_on_device(
                    vae.decode(latents.to(self.sampler.device, _module_dtype(vae, self.sampler.dtype)))
                )
        return frames

    def prepare_text(self, text_args: Dict[str, torch.Tensor]):
        """(text inputs, whether a text token is padding), one host read per video. Without padding the text-cached
        passes attend without a mask. ``trim_text``: the text columns after the last token valid in any row are cut
        first (exact: in the causal model text attends to valid text only, text RoPE ids are 0 and every text op is
        per token, so padded tokens change nothing but the work)."""
        valid = text_args["text_mask"].bool().cpu()  # the one host read
        if self.trim_text:
            used = valid.any(0).nonzero()
            length = int(used.max()) + 1 if len(used) else 1
            mask, emb = text_args["text_mask"], text_args["text_emb"]
            text_args = dict(text_args, text_emb=emb[:, :length], text_mask=mask[:, :length])
            valid = valid[:, :length]
        return text_args, text_has_padding(valid)

    def chunk_pixel_starts(self, num_frames: int, height: int, width: int) -> Dict[int, int]:
        """{first pixel frame of a chunk: its first latent frame} for a video of this size (where a prompt may
        switch)."""
        sampler = self.sampler
        total = sampler.latent_size(num_frames, height, width)[0]
        compression = int(getattr(sampler.vae, "temporal_compression", 1))
        causal = bool(getattr(sampler.vae, "causal_temporal", False))
        return {(video_num_frames(s, compression, causal) if s else 0): s for s in range(0, total, self.chunk_frames)}

    def schedule_switches(self, schedule, num_frames: int, height: int, width: int) -> List[Tuple[int, List[str]]]:
        """A pixel-frame prompt schedule ``[(0, A), (64, B), ...]`` of one video as ``stream``'s ``switches``
        (a one-line ``UserInputError`` naming the valid frames when a switch is not at a chunk start)."""
        starts = self.chunk_pixel_starts(num_frames, height, width)
        return [(at, [prompt]) for at, prompt in switch_chunks(schedule, starts, num_frames)]

    def check_switches(self, switches, total: int, batch: int) -> Dict[int, List[str]]:
        """``stream``'s ``switches`` as {latent frame: prompts}, checked."""
        switch_at = {}
        for at, batch_prompts in switches:
            batch_prompts = [batch_prompts] if isinstance(batch_prompts, str) else list(batch_prompts)
            if not 0 < int(at) < total or at % self.chunk_frames or int(at) in switch_at:
                raise ValueError(f"a prompt switch must be at a chunk's first latent frame after 0, got {at}")
            if len(batch_prompts) != batch:
                raise ValueError(f"a prompt switch needs one prompt per sample ({batch}), got {len(batch_prompts)}")
            switch_at[int(at)] = batch_prompts
        return switch_at

    def schedule(self, latent_size: Sequence[int]) -> List[float]:
        """Times of one chunk, the final 0 included (host floats: the loop never reads a device value)."""
        if self.step_list is not None:
            times = timesteps_from_list(self.step_list)
        else:  # the shift of a training clip of the chunk's size
            chunk_size = (self.chunk_frames, *latent_size[1:])
            times = timesteps_for_sampling(self.num_steps, self.sampler.shift_alpha(chunk_size))
        return [float(t) for t in times]

    def stream(
        self,
        prompts: Sequence[str],
        seeds: Sequence[int],
        num_frames: int,
        height: int,
        width: int,
        decode: bool = True,
        switches: Sequence[Tuple[int, Sequence[str]]] = (),
    ) -> Iterator[StreamChunk]:
        """Yield the video's chunks in order as they finish (``num_frames`` pixel frames, any length the
        autoencoder accepts; the last chunk may be shorter). ``switches``: ``(latent frame, prompts)`` pairs, each
        a chunk's first latent frame after 0 and one prompt per sample: from that chunk on the video follows those
        prompts (``schedule_switches`` makes them from pixel frames)."""
        prompts, seeds = list(prompts), [int(s) for s in seeds]
        if len(prompts) != len(seeds) or not prompts:
            raise ValueError(f"need one seed per prompt (and at least one prompt); got {len(prompts)} and {len(seeds)}")
        sampler, model, device, dtype = self.sampler, self.model, self.sampler.device, self.sampler.dtype
        clock = time.perf_counter()
        latent_size = sampler.latent_size(num_frames, height, width)
        total, pt = latent_size[0], model.patch_size[0]
        if total % pt:
            raise ValueError(f"{total} latent frames are not a multiple of the temporal patch size {pt}")
        times = self.schedule(latent_size)
        switch_at = self.check_switches(switches, total, len(prompts))
        guided = self.guidance_scale != 1.0
        rows = len(prompts) * (2 if guided else 1)

        def encode(batch_prompts):
            """The text inputs of every pass (CFG rows: the prompts, then the null text) and the padding decision."""
            text, null = sampler.encode_text(batch_prompts)
            branches = [text, null] if guided else [text]
            args = {key: torch.cat([b[key] for b in branches]) for key in ("text_emb", "text_mask", "pooled")}
            args.update(text_emb=args["text_emb"].to(dtype), pooled=args["pooled"].to(dtype))
            return self.prepare_text(args)

        text_args, text_padded = encode(prompts)
        cond = None
        if getattr(model, "cond_channels", None):  # text-to-video: the all-zero condition
            cond = torch.zeros(
                rows, model.cond_channels, self.chunk_frames, *latent_size[1:], device=device, dtype=dtype
            )
        cache = model.new_kv_cache(self.window_frames, self.sink_frames, self.rope_anchor)
        text_cache = model.new_text_cache() if self.text_cache else None
        noise = StreamNoise(
            seeds, sampler.vae.latent_channels, latent_size[1:], times, self.rollout, self.context_time, device
        )
        decode_fn = self.decode_graphs or sampler.decode
        decoder = ChunkDecoder(decode_fn, sampler.vae, self.decode_overlap, self.exact_decode) if decode else None

        def guided_rows(x):
            return torch.cat([x, x]) if guided else x

        def combine(out):
            out = out.float()
            return text_cfg(*out.chunk(2), self.guidance_scale) if guided else out

        def velocity(x, t, store, at):
            self.passes += 1
            x_in = guided_rows(x)
            t_in = torch.full((rows,), t, device=device, dtype=dtype)
            c = None if cond is None else cond[:, :, : x.shape[2]]
            forward = self.cuda_graphs if self.cuda_graphs is not None else model.forward_chunk
            out = forward(
                x_in.to(dtype),
                timestep=t_in,
                **text_args,
                cond=c,
                cache=cache,
                start_frame=at,
                store_kv=store,
                text_cache=text_cache,
                text_key=t,
                text_mask_has_padding=text_padded,
            )
            return combine(out)

        def refill_then_velocity(context, x, t):
            """The refill of the previous chunk (``context``, at ``start - frames``) and ``x``'s pass at ``t``."""
            self.passes += 1
            c = None if cond is None else cond[:, :, : x.shape[2]]
            out = refill_and_step(
                model,
                guided_rows(context).to(dtype),
                guided_rows(x).to(dtype),
                prev_timestep=torch.full((rows,), self.context_time, device=device, dtype=dtype),
                next_timestep=torch.full((rows,), t, device=device, dtype=dtype),
                **text_args,
                cond=c,
                cache=cache,
                prev_start=start - context.shape[2],
                text_cache=text_cache,
                prev_key=self.context_time,
                next_key=t,
                graphs=self.merged_graphs,
                text_mask_has_padding=text_padded,
            )
            return combine(out)

        starts = list(range(0, total, self.chunk_frames))
        waiting = None  # a finished chunk whose refill is merged into the next chunk's first pass
        ahead = None
        if decoder is not None and self.overlaps_decode(device):
            if device.type == "cuda":
                decoder.decode_fn, decoder.device_output = self.device_decode, True
            ahead = DecodeAhead(decoder, device)
        held = None  # look-ahead: the chunk being decoded while the next one's passes are enqueued
        # the refill inputs of the cached frames, kept only when a re-cache may run
        window = WindowLatents() if self.kv_recache != "off" or (switch_at and self.switch_recache) else None
        active = list(prompts)

        def switch_text(batch_prompts):
            """From now on the passes follow ``batch_prompts``: their text, and a fresh text cache for it."""
            nonlocal text_args, text_padded, text_cache, active
            text_args, text_padded = encode(batch_prompts)
            text_cache = model.new_text_cache() if self.text_cache else None
            active = list(batch_prompts)

        def before_steps(start, shape) -> Optional[dict]:
            """The previous chunk's refill (left ``waiting`` when it merges into this chunk's first step), or the
            re-cache that replaces it, and the prompt switch at ``start``. Returns the re-cache's record, if one ran."""
            nonlocal waiting
            switch = switch_at.get(start)
            everything = switch is not None and self.switch_recache
            plan = None
            if window is not None and waiting is not None:
                at = start - waiting.shape[2]
                window.keep(cache.frame_ids)
                window.add(at, waiting)
                if everything or self.kv_recache == "shift":
                    after = cache.frame_ids_after_append(at, waiting.shape[2])
                    plan = plan_recache(cache.frame_ids, after, self.chunk_frames, everything)
            record = None
            if plan is not None:
                if everything:
                    switch_text(switch)
                watch, rerender = Stopwatch(device), None
                if everything and self.switch_renoise is not None:
                    rerender = Rerender(
                        seeds, start, self.switch_renoise, times, self.context_time, self.rollout, velocity, device
                    )
                recomputed = run_recache(
                    cache, window, plan, lambda latents, at: velocity(latents, self.context_time, True, at), rerender
                )
                record = dict(reason="switch" if everything else "shift", frames=recomputed, passes=len(plan.pieces))
                if rerender is not None:
                    record["rerender_passes"] = rerender.passes
                record["watch"], waiting = watch.stop(), None
            elif waiting is not None and (switch is not None or not self.merge_refill or waiting.shape != shape):
                # the previous chunk's refill as a pass of its own (under the prompt it was made with)
                velocity(waiting, self.context_time, True, start - waiting.shape[2])
                waiting = None
            if switch is not None and not everything:
                switch_text(switch)
            return record

        def hand_out(index, start, x, pixels, stats):
            nonlocal clock
            if ahead is not None:
                pixels = ahead.result(pixels)
            *stats, record = stats
            if record is not None:
                record = dict(record, seconds=record.pop("watch").seconds())
            now = time.perf_counter()
            chunk = StreamChunk(index, start, x, pixels, now - clock, *stats, record)
            clock = now
            return chunk

        with torch.no_grad():
            for index, start in enumerate(starts):
                frames = min(self.chunk_frames, total - start)
                x = noise.initial(frames)
                recache = before_steps(start, x.shape)
                for step, (t, t_next) in enumerate(zip(times[:-1], times[1:])):
                    if step == 0 and waiting is not None:
                        v, waiting = refill_then_velocity(waiting, x, t), None
                    else:
                        v = velocity(x, t, False, start)
                    x = rollout_step(x, v, t, t_next, self.rollout, noise.for_step(step, frames))
                if index + 1 < len(starts):  # refilled after this chunk is handed out (no chunk reads the last)
                    context = noise.for_context(frames)
                    waiting = x if context is None else fm.add_noise(x, context, self.context_time)
                text_bytes = text_cache.nbytes if text_cache is not None else 0
                stats = (cache.num_frames, cache.nbytes, text_bytes, active, recache)
                if ahead is None:
                    yield hand_out(index, start, x, decoder(x) if decoder is not None else None, stats)
                    continue
                launched = (index, start, x, ahead.launch(x), stats)
                if held is not None:  # this chunk's passes are enqueued: hand out the previous one
                    yield hand_out(*held)
                held = launched
            if held is not None:
                yield hand_out(*held)

    def generate(self, prompts, seeds, num_frames, height, width, switches=()) -> torch.Tensor:
        """The whole video, uint8 [B, T, H, W, 3] (the chunks of ``stream`` concatenated)."""
        chunks = self.stream(prompts, seeds, num_frames, height, width, switches=switches)
        return torch.cat([chunk.frames for chunk in chunks], dim=1)
