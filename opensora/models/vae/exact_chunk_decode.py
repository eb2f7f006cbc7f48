"""Streamed chunk decode of a ``HunyuanVideoVAE``: each latent frame decoded once (``streaming_decode``), replayed as
one CUDA graph per chunk shape on a GPU.

``ExactChunkDecode(latents, first)`` takes normalised latents (what the sampler makes), undoes the latent
normalisation, decodes the chunk through ``StreamingDecoder`` and applies ``postprocess`` (e.g. the uint8 conversion
of the streaming sampler) on the device. A graph is captured per (latent shape, first chunk or not, cached attention
frames): three for a 33-frame clip in chunks of 3 latent frames, and a bounded number however long the video gets
(the attention window fills up once). The decoder's state (conv caches, running norm statistics, attention keys and
values) lives in tensors the graphs read and write in place; a capture's warm-up runs would advance that state, so it
is saved before and restored after each capture.
"""

from __future__ import annotations

import warnings
from typing import Callable, List, Optional

import torch

from opensora.models.mmdit.graph_memory import GraphMemory, on_capture_device

from .streaming_decode import DEFAULT_ATTENTION_WINDOW, STATS_RULES, StreamingDecoder

DECODE_RULES = (*[r for r in STATS_RULES if r != "fixed"], "overlap")


class ExactChunkDecode:
    """Exact-once chunk decode of a ``HunyuanVideoVAE`` (module docstring).

    Args:
        vae: the ``HunyuanVideoVAE`` wrapper (latent scaling/shift and the diffusers model).
        stats: GroupNorm statistics rule of ``StreamingDecoder`` (``"running"`` or ``"chunk"``).
        attention_window: latent frames of earlier chunks the mid-block attention sees.
        graphs: replay each chunk decode as a CUDA graph (GPU only; falls back to eager if a capture fails).
        postprocess: applied to the decoded frames [B, 3, F, H, W] inside the graph (identity when None).
        decoder_options: further ``StreamingDecoder`` options (``attention_kernel``, ``channels_last``,
            ``upsample``).
    """

    def __init__(
        self,
        vae,
        stats: str = "running",
        attention_window: int = DEFAULT_ATTENTION_WINDOW,
        graphs: bool = True,
        postprocess: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        **decoder_options,
    ):
        self.vae = vae
        self.decoder = StreamingDecoder(vae.vae, stats=stats, attention_window=attention_window, **decoder_options)
        self.use_graphs = bool(graphs)
        self.postprocess = postprocess or (lambda frames: frames)
        self.graphs: dict = {}
        self.failures: List[str] = []
        self.memory = GraphMemory(lane="decode")  # may replay beside the chunk passes (a decode side stream)

    def raw_latents(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.vae
        return (latents / vae.scaling_factor + vae.shift_factor).to(vae.vae.dtype)

    def eager(self, raw: torch.Tensor, first: bool) -> torch.Tensor:
        frames = self.decoder.decode(raw, first)
        return self.postprocess(frames.clamp(-1, 1) if self.vae.clamp_output else frames)

    @torch.no_grad()
    def __call__(self, latents: torch.Tensor, first: bool) -> torch.Tensor:
        raw = self.raw_latents(latents)
        if not (self.use_graphs and raw.is_cuda and torch.cuda.is_available()):
            return self.eager(raw, first)
        seen = 0 if first else self.decoder.frames_seen
        cached = min(seen, self.decoder.attention_window)
        key = (tuple(raw.shape), raw.dtype, raw.device, first, cached)
        entry = self.graphs.get(key)
        if entry is None:
            try:
                with on_capture_device(raw.device):
                    entry = self.graphs[key] = self._capture(raw, first, seen)
            except Exception as error:  # noqa: BLE001  (a capture that fails leaves the eager path)
                self.failures.append(f"{type(error).__name__}: {error}")
                warnings.warn(f"CUDA graph capture of the exact chunk decode failed, decoding eagerly: {error}")
                torch.cuda.synchronize(raw.device)
                self.graphs[key] = entry = False
        if entry is False:
            self.decoder.frames_seen = seen
            return self.eager(raw, first)
        static_in, graph, holder = entry
        self.decoder.refresh()  # weights changed since the capture: the graph reads the refreshed tensors in place
        static_in.copy_(raw)
        graph.replay()
        self.decoder.frames_seen = seen + raw.shape[2]
        return holder["out"]

    def _capture(self, raw: torch.Tensor, first: bool, seen: int):
        decoder = self.decoder
        state = decoder.state_tensors()
        saved = [t.clone() for t in state]  # the warm-up runs advance the state: put it back after the capture
        static_in, holder = raw.clone(), {}

        def body():
            decoder.frames_seen = seen
            holder["out"] = self.memory.output("frames", self.eager(static_in, first))

        try:
            graph = self.memory.capture(body)
        finally:
            for tensor, value in zip(state, saved):
                tensor.copy_(value)
            decoder.frames_seen = seen
        return static_in, graph, holder


def exact_chunk_decode(vae, rule: str = "running", **kwargs) -> Optional[ExactChunkDecode]:
    """An ``ExactChunkDecode`` for ``vae`` under decode ``rule`` (``DECODE_RULES``), or None where the streaming
    sampler keeps its overlap re-decode: ``rule="overlap"``, or an autoencoder without a chunked decoder (the
    frame-independent ``PatchVAE`` needs none: each frame decodes on its own)."""
    if rule not in DECODE_RULES:
        raise ValueError(f"decode rule must be one of {DECODE_RULES}, got {rule!r}")
    from .hunyuan_vae import HunyuanVideoVAE

    if rule == "overlap" or not isinstance(vae, HunyuanVideoVAE):
        return None
    return ExactChunkDecode(vae, stats=rule, **kwargs)
