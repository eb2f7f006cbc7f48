"""The sync-free ZeRO grad norm / clipping (opensora.training.zero_sync) against ColossalAI's own code."""

import math
import types

import pytest
import torch

pytest.importorskip("colossalai")

from opensora.training import zero_sync  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402


def _grads(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) * s for n, s in ((1000, 0.5), (37, 3.0), (4096, 0.01))]


def _original():
    from colossalai.zero.low_level import low_level_optim

    zero_sync.install()
    return zero_sync._ORIGINAL["compute"], zero_sync._ORIGINAL["clip"], low_level_optim


def _norms_agree(rank, world_size):
    import torch.distributed as dist

    from opensora.training.distributed import init_distributed

    init_distributed()
    compute, _, _ = _original()
    grads = _grads(rank)
    fake = types.SimpleNamespace()
    ours = zero_sync._compute_grad_norm(fake, dist.group.WORLD, grads)
    reference = compute(fake, dist.group.WORLD, grads)
    assert torch.is_tensor(ours) and isinstance(reference, float)
    return float(ours), reference


def test_grad_norm_matches_colossalai_on_two_ranks():
    results = run_distributed(_norms_agree, world_size=2)
    for ours, reference in results:
        assert ours == pytest.approx(reference, rel=1e-6)
    assert results[0][0] == results[1][0]  # every rank sees the global norm


@pytest.mark.parametrize("max_norm", [0.0, 1.0, 1e6])
def test_clipping_matches_colossalai(max_norm):
    _, clip, module = _original()
    fake = types.SimpleNamespace(mixed_precision_mixin=None, _clip_grad_norm=max_norm)
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in _grads()))
    expected = _grads()
    clip(fake, expected, norm)
    got = _grads()
    zero_sync._unscale_and_clip_grads(fake, got, torch.tensor(norm))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    # the global norm over groups: the same sqrt(sum of squares) as ColossalAI's, as a tensor
    assert float(zero_sync._global_norm([torch.tensor(3.0), 4.0])) == pytest.approx(5.0)
    assert module.calculate_global_norm_from_list is zero_sync._global_norm
