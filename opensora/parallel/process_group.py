"""A torch.distributed start-up for processes that must not load the training stack (sampling).

``init_process_group_from_env`` reads what ``torchrun`` sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) and starts the default group: NCCL with the process bound to ``cuda:LOCAL_RANK`` when ``device`` is
CUDA, gloo on the CPU; ``release_process_group`` frees it at the end of a process (training uses it too). It imports
neither ColossalAI nor ``opensora.training``.
"""

from __future__ import annotations

import gc
import os
from datetime import timedelta
from typing import Union

import torch
import torch.distributed as dist


def init_process_group_from_env(
    device: Union[str, torch.device] = "cpu", timeout_minutes: float = 30.0
) -> tuple[int, int, torch.device]:
    """Start (or reuse) the default process group; return ``(rank, world_size, this rank's device)``."""
    missing = [var for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if var not in os.environ]
    if missing and not dist.is_initialized():
        raise RuntimeError(f"not started by torchrun: {', '.join(missing)} unset (launch with torchrun)")
    device = torch.device(device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            timeout=timedelta(minutes=timeout_minutes),
            **({"device_id": device} if device.type == "cuda" else {}),
        )
    return dist.get_rank(), dist.get_world_size(), device


def release_process_group(succeeded: bool) -> None:
    """At the end of a process: destroy the process group after a clean run, or on a lone rank.

    A process that exits with a live gloo group can abort (SIGABRT, "terminate called without an active exception")
    while the interpreter is torn down: the group's worker threads still hold tensors. Destroying is not enough:
    objects of the run (seen with the training stack) hold subgroups in reference cycles, so a collection frees them
    (and joins their threads) now, not during the teardown. After a failure on several ranks a peer may still be
    inside a collective, and destroying could wait on it, so that case is left alone.
    """
    if dist.is_initialized() and (succeeded or dist.get_world_size() == 1):
        dist.destroy_process_group()
        gc.collect()
