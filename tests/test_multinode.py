"""Two "nodes" on this machine: two torchrun agents (``--nnodes 2``, one rank each, gloo, static rendezvous at
127.0.0.1) train, checkpoint, and resume exactly, as a two-host job started by ``torchrun`` on each host would
(README, "Several nodes"). Each agent is its own process tree with its own ``--node_rank``, so the trainer sees
GROUP_RANK / LOCAL_RANK / RANK as it would across hosts.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_train import DEMO_CONFIG, TRAIN_SCRIPT, by_step, launcher_env, read_metrics, write_config

from dist_utils import find_free_port

TIMEOUT_S = 300


def launch_two_nodes(config: Path, outputs: Path, *flags: str) -> None:
    """Start node 0 and node 1 (one rank each) like two hosts would; both must exit 0."""
    port = str(find_free_port())
    agents = []
    for node_rank in (0, 1):
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node_rank",
            str(node_rank),
            "--nproc_per_node",
            "1",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            port,
            str(TRAIN_SCRIPT),
            str(config),
            "--outputs",
            str(outputs),
            *flags,
        ]
        agents.append(
            subprocess.Popen(command, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    logs = []
    try:
        for agent in agents:
            logs.append(agent.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    for node_rank, (agent, log) in enumerate(zip(agents, logs)):
        assert agent.returncode == 0, f"node {node_rank} failed ({agent.returncode}):\n{log[-5000:]}"


@pytest.fixture(scope="module")
def two_node_runs(tmp_path_factory):
    from opensora.datasets.moving_shapes import write_dataset

    root = tmp_path_factory.mktemp("multinode")
    csv = write_dataset(root / "data", num=8, seed=1, height=32, width=32, num_frames=4, progress=False)
    config = write_config(
        root / "tiny.py",
        DEMO_CONFIG,
        dataset=dict(data_path=str(csv)),
        bucket_config={"_delete_": True, "32x32": {4: (1.0, 2)}},
        num_workers=0,
    )
    full = root / "full"
    launch_two_nodes(config, full, "--max-steps", "4", "--ckpt-every", "2")
    resumed = root / "resumed"
    launch_two_nodes(config, resumed, "--max-steps", "4", "--load", str(full / "checkpoints" / "step-0000002"))
    return full, resumed


def test_two_nodes_train_and_checkpoint_as_one_world(two_node_runs):
    full, _ = two_node_runs
    records = read_metrics(full)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    meta = json.loads((full / "checkpoints" / "step-0000002" / "meta.json").read_text())
    assert meta["world_size"] == 2  # one world across both nodes, not two single-rank runs


def test_two_node_resume_is_exact(two_node_runs):
    full, resumed = two_node_runs
    want, got = by_step(read_metrics(full)), by_step(read_metrics(resumed))
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        for key in ("loss", "grad_norm", "lr"):
            assert got[step][key] == want[step][key], f"step {step} {key}: {got[step][key]!r} != {want[step][key]!r}"
