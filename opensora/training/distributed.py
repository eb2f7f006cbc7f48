"""Process-group set-up and the few collective helpers the trainer needs.

``init_distributed()`` works the same under ``colossalai run`` / ``torchrun`` (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT in the environment) and under plain ``python``: a lone process gets a world-size-1
group (on an in-memory store), so the Booster and every plugin run unchanged. NCCL on GPU, gloo on CPU
(where the ColossalAI CPU shim is applied). Seeding is not done here: see ``opensora.training.rng``.
"""

from __future__ import annotations

import faulthandler
import os
import socket
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from opensora.parallel.process_group import release_process_group

from .cpu_shim import apply_cpu_shim

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE")


def _free_localhost_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ensure_single_process_env() -> None:
    """Fill in the torchrun variables for a lone ``python`` process (keeps any that are already set)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_localhost_port()))  # no store listens there: it names the launch


def init_distributed(timeout_minutes: float = 30.0) -> tuple[int, int, int, torch.device]:
    """Initialise (once) the default process group; return ``(rank, world_size, local_rank, device)``.

    Safe to call again: an existing group is reused. On GPU the process is bound to ``cuda:LOCAL_RANK``.
    """
    if not all(var in os.environ for var in _LAUNCHER_VARS):
        _ensure_single_process_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        apply_cpu_shim()

    if not dist.is_initialized():
        world_size = int(os.environ["WORLD_SIZE"])
        # one rank talks to nobody: an in-memory store instead of a TCP one, so no port is taken (two lone runs
        # that picked the same free port would collide between the pick and the bind)
        rendezvous = dict(store=dist.HashStore()) if world_size == 1 else dict(init_method="env://")
        dist.init_process_group(
            backend=backend,
            rank=int(os.environ["RANK"]),
            world_size=world_size,
            timeout=timedelta(minutes=timeout_minutes),
            **rendezvous,
            **({"device_id": device} if use_cuda else {}),
        )
    return dist.get_rank(), dist.get_world_size(), local_rank, device


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    """A barrier across all ranks; a no-op without a process group or with one rank."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_reduce_mean(value: torch.Tensor | float) -> torch.Tensor:
    """Mean of ``value`` over all ranks (a copy; the input is untouched). Floats come back as 0-d tensors.

    The tensor lives on the backend's device (CUDA for NCCL) during the reduction and is returned there.
    """
    if isinstance(value, torch.Tensor):
        tensor = value.detach().clone().float()
    else:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        tensor = torch.tensor(float(value), device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor /= dist.get_world_size()
    return tensor


def broadcast_object(obj, src: int = 0):
    """Send a picklable object from ``src`` to every rank (e.g. a resolved checkpoint path)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def run_script(main: Callable, argv: Sequence[str], prog: str, clean_codes: Sequence[int] = (0,)) -> int:
    """A script's whole process: ``run_cli(main, argv, prog)``, then ``release_process_group`` (a clean run is one
    that returned a code in ``clean_codes``). In-process callers (tests) call ``main`` and keep their group."""
    from opensora.cli_errors import run_cli

    faulthandler.enable()  # a crash in native code (SIGSEGV, SIGABRT) prints every thread's Python stack
    succeeded = False
    try:
        code = run_cli(main, argv, prog=prog)
        succeeded = code in clean_codes
        return code
    finally:
        release_process_group(succeeded)
