"""The pipeline's chunk decoders: the one-GPU streaming sampler's decode rule, one decoder per video, on the GPU the
plan gives that video (``Plan.decode_lanes``), and the time a chunk decode costs there (for the plan)."""

from __future__ import annotations

import copy
import time
from statistics import median
from typing import Dict, Optional, Tuple

import torch

from opensora.inference.io import uint8_frames_on_device
from opensora.inference.sampler import _module_dtype
from opensora.inference.streaming.generator import ChunkDecoder
from opensora.models.vae.exact_chunk_decode import exact_chunk_decode


def device_decoder(vae, sampler_dtype):
    """``VideoSampler.decode`` on ``vae``'s device without the host copy: latents cast as it casts them (to the
    autoencoder's dtype; the sampler's for a parameter-free one) -> uint8 frames on the device."""
    dtype = _module_dtype(vae, sampler_dtype)
    return lambda latents: uint8_frames_on_device(vae.decode(latents.to(dtype)))


class ChunkDecoders:
    """``make_decoder`` of ``CausalStreamingStages``: ``decoders(device, group)`` -> a fresh ``ChunkDecoder`` that
    decodes one video's chunks in order on ``device`` under ``rule`` (``StreamingGenerator``'s ``decode_rule``:
    ``running`` / ``chunk`` decode each latent frame once, ``overlap`` re-decodes earlier frames), returning uint8
    frames on the device.

    The exact decoder is stateful (conv caches, running GroupNorm statistics, attention keys), so each (device,
    group) has its own, kept across runs with its CUDA graphs (a new video restarts its state at the first chunk).
    The autoencoder is copied once to every other device that decodes. ``graphs``: replay the exact chunk decodes as
    CUDA graphs (the generator's ``decode_graphs``; a graph replay equals its eager decode bit for bit on a GPU, but
    keep the pipeline's setting equal to the one-GPU run it is compared with).
    """

    def __init__(self, vae, rule: str = "running", graphs: bool = False, dtype=None, overlap: Optional[int] = None):
        self.vae, self.rule, self.graphs, self.overlap = vae, rule, bool(graphs), overlap
        self.dtype = dtype if dtype is not None else torch.float32  # the sampler's (device_decoder's rule)
        self.vaes: Dict[torch.device, object] = {}
        self.exact: Dict[Tuple[torch.device, int], object] = {}

    @classmethod
    def like(cls, generator) -> "ChunkDecoders":
        """The decoders of a ``StreamingGenerator``'s runs (its autoencoder, decode rule, decode graphs, overlap)."""
        sampler = generator.sampler
        return cls(sampler.vae, generator.decode_rule, generator.exact_graphs, sampler.dtype, generator.decode_overlap)

    def vae_on(self, device) -> object:
        device = torch.device(device)
        if device not in self.vaes:
            here = next((p.device for p in self.vae.parameters()), device)
            self.vaes[device] = self.vae if here == device else copy.deepcopy(self.vae).to(device)
        return self.vaes[device]

    def __call__(self, device, group: int = 0) -> ChunkDecoder:
        device = torch.device(device)
        vae = self.vae_on(device)
        key = (device, int(group))
        if key not in self.exact:
            self.exact[key] = exact_chunk_decode(vae, self.rule, graphs=self.graphs, postprocess=uint8_frames_on_device)
        on_device = device_decoder(vae, self.dtype)  # the overlap rule's decode

        decoder = ChunkDecoder(lambda latents: on_device(latents.to(device)), vae, self.overlap, self.exact[key])
        decoder.device_output = True
        return decoder

    def summary(self) -> dict:
        return dict(
            rule=self.rule,
            graphs=self.graphs,
            devices=[str(d) for d in self.vaes],
            graph_failures=[f for e in self.exact.values() if e is not None for f in e.failures],
        )


@torch.no_grad()
def measure_chunk_decode(make_decoder, device, latent_chunks, repeats: int = 2) -> dict:
    """Mean time (ms) of one chunk decode of a video, as the run decodes it: a fresh decoder from ``make_decoder``
    (``ChunkDecoders``) fed ``latent_chunks`` in order on ``device``; one video first (warm-up: kernels, graph
    captures), then ``repeats`` timed videos. The first chunk of a clip decodes fewer frames than the later ones (a
    causal VAE keeps the first frame alone), so the mean over the video is what the plan's per-chunk cost is."""
    device = torch.device(device)
    chunks = [c.to(device) for c in latent_chunks]
    per_chunk = []
    for video in range(repeats + 1):
        decoder = make_decoder(device, 0)
        samples = []
        for chunk in chunks:
            if device.type == "cuda":
                with torch.cuda.device(device):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    decoder(chunk)
                    end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                decoder(chunk)
                samples.append((time.perf_counter() - t0) * 1e3)
        if video:
            per_chunk.append(samples)
    columns = [median(run[i] for run in per_chunk) for i in range(len(chunks))]
    return dict(mean_ms=sum(columns) / len(columns), per_chunk_ms=columns, device=str(device))
