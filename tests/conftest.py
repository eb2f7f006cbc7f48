"""Shared pytest set-up: skip ``@pytest.mark.gpu`` tests without CUDA; a per-test outputs directory; the process
group of in-process runs freed at the end."""

import pytest


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch  # only when GPU tests were collected: keeps CPU-only collection fast

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def tmp_outputs(tmp_path):
    """A fresh outputs directory for one test (what scripts get as --outputs)."""
    path = tmp_path / "outputs"
    path.mkdir()
    return path


@pytest.fixture
def one_thread():
    """Tiny networks: thread start-up costs more than it saves, and CI has 2 cores shared with other work."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_sessionfinish(session, exitstatus):
    """In-process runs leave this process's group open: free it (and its gloo threads) before the interpreter is torn
    down, where a live gloo group can abort the exit (see ``release_process_group``)."""
    import sys

    if "torch.distributed" not in sys.modules:
        return
    from opensora.training.distributed import release_process_group

    release_process_group(succeeded=True)
