"""Run a picklable function on N local processes that form a torch.distributed world.

Usage in a test::

    def _body(rank, world_size, scale):      # module-level, so spawn can pickle it
        rank, world, _, _ = init_distributed()
        ...
        return some_picklable_value

    results = run_distributed(_body, world_size=2, args=(3.0,))   # list indexed by rank

Each child gets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (a free localhost port) in its
environment, exactly as torchrun would set them, and is called as ``fn(rank, world_size, *args, **kwargs)``.
The function decides how to initialise the process group (normally ``opensora.training.distributed
.init_distributed()``); any group still open when it returns is destroyed.

If a child raises, the other children are killed (they would hang in a collective otherwise) and a
``ChildProcessError`` carrying the child's traceback is raised in the caller.
"""

from __future__ import annotations

import os
import pickle
import queue
import random
import socket
import time
import traceback
from typing import Any, Callable, Sequence

import torch.multiprocessing as mp

# Under pytest-xdist each worker picks from its own block of ports below the OS's ephemeral range (32768 up, where
# gloo's connections land): two workers never pick the same port between the check and the launcher's bind.
_XDIST_PORT_RANGE = (20000, 32000)


def find_free_port() -> int:
    """A localhost TCP port that is free right now: the OS's pick, or under pytest-xdist one of this worker's block."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    size = (_XDIST_PORT_RANGE[1] - _XDIST_PORT_RANGE[0]) // workers
    first = _XDIST_PORT_RANGE[0] + int(worker[2:]) * size
    for port in random.Random().sample(range(first, first + size), size):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first}-{first + size - 1} for pytest-xdist worker {worker}")


def _child_entry(rank, world_size, port, fn, args, kwargs, env, result_queue):
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        value = fn(rank, world_size, *args, **kwargs)
        # Plain pickle (not the torch multiprocessing reducer): tensors travel by value, so the child may exit
        # before the parent reads them.
        result_queue.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent with its traceback
        result_queue.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: Sequence[Any] = (),
    kwargs: dict | None = None,
    timeout: float = 300.0,
    env: dict | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned processes; return values by rank.

    ``env`` adds environment variables to every child (``OMP_NUM_THREADS=1`` is the default so two ranks do
    not fight over a 2-core CI machine). Raises ``ChildProcessError`` with the first failing rank's
    traceback, or ``TimeoutError`` if the ranks do not all finish within ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    result_queue = ctx.Queue()
    port = find_free_port()
    child_env = {"OMP_NUM_THREADS": "1", **(env or {})}
    processes = [
        ctx.Process(
            target=_child_entry,
            args=(rank, world_size, port, fn, tuple(args), dict(kwargs or {}), child_env, result_queue),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for proc in processes:
        proc.start()

    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"run_distributed: ranks {sorted(set(range(world_size)) - set(results))} "
                    f"did not finish within {timeout:.0f} s"
                )
            try:
                rank, status, payload = result_queue.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(processes) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    raise ChildProcessError(
                        f"rank {dead[0]} exited with code {processes[dead[0]].exitcode} without reporting"
                    )
                continue
            if status == "error":
                raise ChildProcessError(f"rank {rank} failed:\n{payload}")
            results[rank] = pickle.loads(payload)
    finally:
        for proc in processes:
            proc.join(timeout=10 if len(results) == world_size else 0.1)
        for proc in processes:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [results[r] for r in range(world_size)]
