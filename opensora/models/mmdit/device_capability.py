"""The compute capability of a CUDA device, read once per device: a dict hit is free inside torch.compile regions,
where the attention paths pick their kernels by it."""

import torch

_CAPABILITY = {}  # device index -> compute capability major


def device_major(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)[0]
    return _CAPABILITY[index]
