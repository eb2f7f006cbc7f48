"""The valid text lengths of a joint [text T, video N] training batch as a device tensor, shared by the key-mask
objects that hand them to a kernel (``FlexRows``, ``BiasChannelRows``): row ``b`` has ``lengths[b]`` valid text
tokens first, then padding, then its video tokens."""

from typing import Sequence

import torch


def host_ints_to(values: Sequence[int], dtype, device) -> torch.Tensor:
    """Host integers as a tensor on ``device``, copied from pinned memory without blocking (no wait for the queued
    work)."""
    cpu = torch.tensor([int(value) for value in values], dtype=dtype)
    if torch.device(device).type == "cuda":
        cpu = cpu.pin_memory()
    return cpu.to(device, non_blocking=True)


class DeviceRowLengths:
    def __init__(self, lengths: Sequence[int], num_text: int, num_video: int, device, dtype=torch.int64):
        self.num_text, self.num_video = int(num_text), int(num_video)
        self.lengths = host_ints_to(lengths, dtype, device)

    def __len__(self) -> int:
        return len(self.lengths)

    def dense(self, num_keys: int, device=None) -> torch.Tensor:
        """The equivalent boolean key mask [B, 1, 1, num_keys] (True = may attend) of the [text, video] order."""
        keys = torch.arange(num_keys, device=device)
        mask = (keys[None] < self.lengths.to(device)[:, None]) | (keys[None] >= self.num_text)
        return mask[:, None, None, :]

    def check(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """q / k [B, heads, T + N, head_dim] must be this batch's joint sequence."""
        batch, _, tokens, _ = q.shape
        if batch != len(self) or tokens != self.num_text + self.num_video or k.shape[2] != tokens:
            raise ValueError(
                f"{type(self).__name__} of {len(self)} rows x {self.num_text}+{self.num_video} tokens got q "
                f"{tuple(q.shape)}, k {tuple(k.shape)}"
            )
