"""HostCopy: device values read on the host later, equal to a plain synchronous read."""

import pytest
import torch

from opensora.training.host_copy import HostCopy


def test_cpu_values_are_the_tensors():
    a, b = torch.tensor([1.5, -2.0]), torch.tensor(3.25)
    values = HostCopy([a, b]).values()
    assert torch.equal(values[0], a) and torch.equal(values[1], b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_values_match_a_synchronous_read_while_later_work_is_queued():
    x = torch.randn(4096, 4096, device="cuda")
    means = torch.stack([x.mean(), x.square().mean()])
    first_row = x[0, :3].clone()
    copy = HostCopy([means, x[0, :3]])
    for _ in range(20):  # work queued after the copy (x is overwritten), which values() must not wait for
        x = x @ x.T / 64
    got = copy.values()
    assert got[0].is_pinned() and got[0].tolist() == means.tolist()
    assert got[1].tolist() == first_row.tolist()
