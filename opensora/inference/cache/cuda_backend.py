"""The CUDA calls of the offload stores (streams, events, pinned and device buffers) behind one small object, so the
stores' bookkeeping runs on a CPU too with a recording fake (tests/test_offload.py)."""

from __future__ import annotations

import torch


class _StreamSwitch:
    """``torch.cuda.stream(stream)`` for a stream of the current device, with less host work (it is entered for every
    batch of copies)."""

    __slots__ = ("stream", "previous")

    def __init__(self, stream):
        self.stream = stream

    def __enter__(self):
        self.previous = torch.cuda.current_stream(self.stream.device)
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc):
        torch.cuda.set_stream(self.previous)


class CudaBackend:
    """The CUDA calls of ``OffloadManager`` (streams, events, pinned and device buffers, copies)."""

    def __init__(self, device):
        self.device = torch.device(device)

    def new_stream(self):
        return torch.cuda.Stream(self.device)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream):
        return _StreamSwitch(stream)

    def new_event(self):
        return torch.cuda.Event()

    def record(self, event, stream) -> None:
        event.record(stream)

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def done(self, event) -> bool:
        return event.query()

    def pinned_empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)

    def device_empty(self, numel: int, dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def synchronize(self, stream) -> None:
        stream.synchronize()
