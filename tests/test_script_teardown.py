"""A script's process destroys its process group before the interpreter is torn down (a live gloo group can abort
the exit with SIGABRT), except after a failure on several ranks, where a peer may still be inside a collective."""

import sys
from pathlib import Path

import pytest

from dist_utils import run_distributed
from opensora.training.preemption import EXIT_PREEMPTED

ROOT = Path(__file__).resolve().parents[1]


def _gloo_worker_threads() -> int:
    """Live gloo worker threads of this process (Linux names them)."""
    tasks = Path("/proc/self/task")
    return sum((task / "comm").read_text().strip() == "pt_gloo_runloop" for task in tasks.iterdir())


def _after_run_script(rank, world_size, codes):
    """``run_script`` around a main that uses the group and a subgroup held in a reference cycle (as the optimizer
    and plugin hold theirs) and returns each of ``codes`` in turn; after each: is the group still there, and how
    many gloo worker threads are left?"""
    import torch
    import torch.distributed as dist

    from opensora.training.distributed import init_distributed, run_script

    def main(argv):
        init_distributed()
        holder = {"group": dist.new_group(list(range(world_size)))}
        holder["self"] = holder  # freed only by the cycle collector
        value = torch.ones(1)
        dist.all_reduce(value, group=holder["group"])
        assert value.item() == world_size
        return int(argv[0])

    results = []
    for code in codes:
        returned = run_script(main, [str(code)], prog="probe.py", clean_codes=(0, EXIT_PREEMPTED))
        results.append((returned, dist.is_initialized(), _gloo_worker_threads() > 0))
    return results


def test_a_failure_keeps_the_group_on_several_ranks_and_a_clean_run_frees_it():
    # train.py's preempted exit is a clean code too; after it no gloo thread is left to die in the teardown
    expected = [(2, True, True), (EXIT_PREEMPTED, False, False)]
    assert run_distributed(_after_run_script, world_size=2, args=([2, EXIT_PREEMPTED],), timeout=120) == [expected] * 2


def test_a_lone_rank_frees_the_group_even_after_a_failure():
    assert run_distributed(_after_run_script, world_size=1, args=([2],), timeout=120) == [[(2, False, False)]]


def test_the_training_and_precompute_scripts_end_through_run_script():
    """Both scripts that start torch.distributed end through ``run_script`` (their exit codes: test_bad_inputs.py)."""
    from opensora.training.launch import run_train_script

    assert "run_script(main, argv" in Path(sys.modules[run_train_script.__module__].__file__).read_text()
    assert "run_train_script(sys.argv[1:])" in (ROOT / "scripts/diffusion/train.py").read_text()
    assert "run_script(main, sys.argv[1:]" in (ROOT / "scripts/diffusion/precompute.py").read_text()


LONE_GPU_PROCESS = """
import torch, torch.distributed as dist
from opensora.training.distributed import init_distributed, run_script

def main(argv):
    rank, world_size, _, device = init_distributed()
    assert (rank, world_size, device.type) == (0, 1, "cuda") and dist.get_backend() == "nccl", (rank, device)
    value = torch.full((4,), 3.0, device=device)
    dist.all_reduce(value, group=dist.new_group([0]))
    dist.barrier()
    assert value.tolist() == [3.0] * 4
    return 0

code = run_script(main, [], prog="probe.py", clean_codes=(0,))
print("lone NCCL process:", code, "group left:", dist.is_initialized())
raise SystemExit(code)
"""


@pytest.mark.gpu
def test_a_lone_gpu_process_runs_nccl_on_its_in_memory_store():
    """What every single-GPU run does: no launcher variables, so the group's store is in memory (no port); NCCL
    builds its communicator through it, collectives and a subgroup work, and the run ends with the group freed."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", LONE_GPU_PROCESS], env=env, capture_output=True, text=True, timeout=180, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lone NCCL process: 0 group left: False" in done.stdout
