"""The ZeRO shortcuts (opensora.training.zero_single_rank) against ColossalAI's own path, bit for bit: the one-rank
shortcuts on one gloo rank, the multi-rank step on two."""

import warnings

import pytest
import torch

pytest.importorskip("colossalai")

from dist_utils import run_distributed  # noqa: E402

CASES = [
    ("zero2_bf16", dict(type="LowLevelZeroPlugin", stage=2), "bf16"),
    ("zero2_fp32", dict(type="LowLevelZeroPlugin", stage=2), "fp32"),
    ("zero1_bf16", dict(type="LowLevelZeroPlugin", stage=1), "bf16"),
    # its ZeRO optimizer subclasses LowLevelZero's (own grad norm, inherited step and reduction)
    (
        "hybrid_tp1_zero1_bf16",
        dict(type="HybridParallelPlugin", tp_size=1, pp_size=1, zero_stage=1, find_unused_parameters=True),
        "bf16",
    ),
    # 24-element buckets: many reduction buckets, and ColossalAI gathers the larger weights one by one (bigger than
    # a bucket) next to bucketed small ones; the multi-rank step cuts its gather into several chunks
    ("zero2_bf16_small_buckets", dict(type="LowLevelZeroPlugin", stage=2, reduce_bucket_size_in_m=24 / 2**20), "bf16"),
]
SHORTCUTS_ON = dict(single_rank_shortcut=True, multi_rank_shortcut=True)
SHORTCUTS_OFF = dict(single_rank_shortcut=False, multi_rank_shortcut=False)


class _Model(torch.nn.Module):
    """An odd-sized weight, a frozen one and a trainable layer the forward never uses (it gets no gradient)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.GELU(), torch.nn.Linear(13, 5))
        self.norm = torch.nn.LayerNorm(5)
        self.norm.bias.requires_grad_(False)
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.norm(self.body(x))


def _model():
    return _Model()


def _train(plugin_cfg, precision, rank, device):
    from opensora.training.booster import build_booster
    from opensora.training.ema import unwrap_model

    torch.manual_seed(0)
    model = _model()
    # two parameter groups (the norm's own learning rate); the frozen bias is in neither
    optimizer = torch.optim.AdamW(
        [
            dict(params=[p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("norm.")]),
            dict(params=[model.norm.weight], lr=3e-2),
        ],
        lr=1e-2,
    )
    # on a GPU the communication overlaps the backward on side streams (the CPU shim turns that off)
    overlap = dict(overlap_communication=True) if device.type == "cuda" else {}
    booster = build_booster(dict(plugin_cfg, max_norm=0.05, **overlap), precision)
    model, optimizer, *_ = booster.boost(model, optimizer)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(4):
        x, y = torch.randn(6, 7, generator=gen), torch.randn(6, 5, generator=gen)
        loss = ((model(x.to(device, dtype)).float() - y.to(device)) ** 2).mean()
        booster.backward(loss, optimizer)
        optimizer.step()
        losses.append((loss.item(), float(optimizer.get_grad_norm())))
        optimizer.zero_grad()
    weights = {n: p.detach().cpu().clone() for n, p in unwrap_model(model).named_parameters()}
    weights.update(
        (f"master{group}.{i}", master.detach().cpu().clone())  # this rank's fp32 shards
        for group, masters in optimizer._master_param_groups_of_current_rank.items()
        for i, master in enumerate(masters)
    )
    return losses, weights


def _taken(run):
    from opensora.training import zero_single_rank

    before = dict(zero_single_rank.SHORTCUTS_TAKEN)
    result = run()
    return result, {k: zero_single_rank.SHORTCUTS_TAKEN[k] - before[k] for k in before}


def _both_paths(rank, world_size):
    """Each case trained with the shortcuts installed and again with ColossalAI's methods restored."""
    warnings.filterwarnings("ignore")
    from opensora.training.distributed import init_distributed

    _, _, _, device = init_distributed()
    results = {}
    for name, plugin_cfg, precision in CASES:
        ours, taken = _taken(lambda: _train(dict(plugin_cfg, **SHORTCUTS_ON), precision, rank, device))
        reference, ref_taken = _taken(lambda: _train(dict(plugin_cfg, **SHORTCUTS_OFF), precision, rank, device))
        assert not any(ref_taken.values()), "the reference must run ColossalAI's own methods"
        results[name] = dict(ours=ours, reference=reference, taken=taken)
    return results


def _assert_bit_identical(result):
    (losses, weights), (ref_losses, ref_weights) = result["ours"], result["reference"]
    assert losses == ref_losses
    for key, value in ref_weights.items():
        assert weights[key].dtype == value.dtype and torch.equal(weights[key], value), key


@pytest.fixture(scope="module")
def one_rank():
    return run_distributed(_both_paths, world_size=1, timeout=240)[0]


@pytest.mark.parametrize("name", [case[0] for case in CASES])
def test_one_rank_shortcuts_are_bit_identical_to_colossalai(one_rank, name):
    result = one_rank[name]
    assert result["taken"]["reduction"] >= 4, "every backward's bucket must take the shortcut"
    assert result["taken"]["step"] >= 4, "every step must take the shortcut"
    assert result["taken"]["multi_rank_step"] == 0, "one rank takes the one-rank step"
    _assert_bit_identical(result)


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_both_paths, world_size=2, timeout=240)


@pytest.mark.parametrize("name", [case[0] for case in CASES])
def test_multi_rank_step_is_bit_identical_to_colossalai(two_ranks, name):
    """ZeRO's step on two gloo ranks (an odd-sized weight: padded last shard) against ColossalAI's own step."""
    for per_rank in two_ranks:
        result = per_rank[name]
        # the one-rank shortcuts, enabled too, are not taken
        assert result["taken"] == {"reduction": 0, "step": 0, "multi_rank_step": 4}, result["taken"]
        _assert_bit_identical(result)
    (_, weights0), (_, weights1) = (per_rank[name]["ours"] for per_rank in two_ranks)
    for key, value in weights0.items():  # every rank holds the same gathered parameters
        if not key.startswith("master"):
            assert torch.equal(value, weights1[key]), key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_rank_shortcuts_are_bit_identical_on_gpu_with_overlapped_communication():
    """NCCL, one GPU, overlap_communication=True (the trainer's setting): the side-stream path vs the shortcut."""
    for name, result in run_distributed(_both_paths, world_size=1, timeout=240)[0].items():
        assert result["taken"]["reduction"] >= 4 and result["taken"]["step"] >= 4, name
        _assert_bit_identical(result)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_multi_rank_step_is_bit_identical_on_two_gpus_with_overlapped_communication():
    """NCCL, two GPUs, overlap_communication=True: the multi-rank step (in-place all-gather) vs ColossalAI's."""
    for per_rank in run_distributed(_both_paths, world_size=2, timeout=240):
        for name, result in per_rank.items():
            assert result["taken"] == {"reduction": 0, "step": 0, "multi_rank_step": 4}, (name, result["taken"])
            _assert_bit_identical(result)


def _default_plugin_run(rank, world_size):
    warnings.filterwarnings("ignore")
    from opensora.training.distributed import init_distributed

    _, _, _, device = init_distributed()
    return _taken(lambda: _train(dict(type="LowLevelZeroPlugin", stage=2), "bf16", rank, device))[1]


def test_the_plugin_defaults_take_the_multi_rank_step_on_two_ranks():
    """No shortcut keys in the plugin config: two ranks take the multi-rank step (the default since its 2-GPU run)."""
    for taken in run_distributed(_default_plugin_run, world_size=2, timeout=240):
        assert taken == {"reduction": 0, "step": 0, "multi_rank_step": 4}, taken
