"""Decoding a streamed chunk ahead on a side stream of its GPU (``DecodeAhead``), while the main stream runs the
next chunk's passes; ``decode_stream``: that stream, one per device for the process (the two-GPU pipeline's decodes
use it too)."""

from __future__ import annotations

from typing import Dict

import torch

_DECODE_STREAMS: Dict[int, "torch.cuda.Stream"] = {}


def decode_stream(device: torch.device) -> "torch.cuda.Stream":
    """The high-priority stream chunk decodes run on beside the chunk passes (one per device, for the process: cuBLAS
    and cuDNN keep workspaces per stream). High priority: the decode of chunk k is on the first chunk's latency path,
    the passes it overlaps are not."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _DECODE_STREAMS:
        _DECODE_STREAMS[index] = torch.cuda.Stream(device=index, priority=-1)
    return _DECODE_STREAMS[index]


class DecodeAhead:
    """Decodes a chunk on ``decode_stream`` while the main stream goes on with the next chunk's passes.

    ``launch(latents)``: the decode stream waits for the main stream's work so far (the chunk's last pass), decodes
    (``decode_fn`` returns uint8 frames on the device: a decode graph or the eager autoencoder), copies the frames
    into a fresh pinned host tensor without blocking and records an event; ``result(handle)`` waits for that event
    and returns the host frames, final from then on. The latents are marked as used by the decode stream, so the
    main stream cannot reuse their memory before the decode read them. Off the GPU it decodes at once (same frames).
    """

    def __init__(self, decoder, device: torch.device):  # decoder: a ``generator.ChunkDecoder``
        self.decoder = decoder
        self.stream = decode_stream(device) if device.type == "cuda" and torch.cuda.is_available() else None

    def launch(self, latents: torch.Tensor):
        if self.stream is None:
            return self.decoder(latents), None
        self.stream.wait_stream(torch.cuda.current_stream(latents.device))
        latents.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            frames = self.decoder(latents)
            host = torch.empty(frames.shape, dtype=frames.dtype, pin_memory=True)
            host.copy_(frames, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return host, done

    @staticmethod
    def result(handle) -> torch.Tensor:
        frames, done = handle
        if done is not None:
            done.synchronize()
        return frames
