"""Read device tensors on the host one step late without waiting for the work queued after them.

A plain ``.tolist()`` / ``float()`` of a CUDA tensor is a copy on the current stream, so the host waits for every
kernel queued before the copy, including the whole step queued since the values were computed. ``HostCopy``
queues the device-to-host copies (into pinned memory) right after the values, records an event, and waits only
for that event when the values are read.
"""

from __future__ import annotations

import torch


class HostCopy:
    """``tensors`` copied to the host asynchronously; ``values()`` returns the host tensors once the copies are done
    (on CPU they are the tensors themselves, detached)."""

    def __init__(self, tensors: list):
        self._host = [t.detach().to("cpu", non_blocking=True) for t in tensors]
        self._done = None
        if any(t.is_cuda for t in tensors):
            self._done = torch.cuda.Event()
            self._done.record()

    def values(self) -> list:
        if self._done is not None:
            self._done.synchronize()  # the copies only: long done when read one step later
        return self._host
