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
# the multi-rank step with the inner optimizer called once over all masters and the gather after it
SHORTCUTS_ON_NOT_OVERLAPPED = dict(SHORTCUTS_ON, multi_rank_overlap=False)


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


def _large_model():
    """~50M parameters in 12 layers: the overlapped gather's side-stream work is long enough that a missing wait
    would let the next forward read parameters the gather has not written yet."""
    layers = [torch.nn.Linear(2048, 2048) for _ in range(12)]
    model = torch.nn.Sequential(torch.nn.Linear(7, 2048), *layers, torch.nn.Linear(2048, 5), torch.nn.LayerNorm(5))
    model.norm = model[-1]
    return model


def _train(plugin_cfg, precision, rank, device, make_model=_model):
    from opensora.training.booster import build_booster
    from opensora.training.ema import unwrap_model

    torch.manual_seed(0)
    model = make_model()
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


def _both_paths(rank, world_size, cases=tuple(CASES), make_model=_model):
    """Each case trained with the shortcuts installed and again with ColossalAI's methods restored."""
    warnings.filterwarnings("ignore")
    from opensora.training.distributed import init_distributed

    _, _, _, device = init_distributed()
    results = {}
    for name, plugin_cfg, precision in cases:
        run = lambda shortcuts: _train(dict(plugin_cfg, **shortcuts), precision, rank, device, make_model)  # noqa: E731
        ours, taken = _taken(lambda: run(SHORTCUTS_ON))
        serial, _ = _taken(lambda: run(SHORTCUTS_ON_NOT_OVERLAPPED))
        reference, ref_taken = _taken(lambda: run(SHORTCUTS_OFF))
        assert not any(ref_taken.values()), "the reference must run ColossalAI's own methods"
        results[name] = dict(ours=ours, serial=serial, reference=reference, taken=taken)
    return results


def _assert_bit_identical(result):
    """The shortcuts (the multi-rank step overlapped and not) against ColossalAI's own path."""
    ref_losses, ref_weights = result["reference"]
    for variant in ("ours", "serial"):
        losses, weights = result[variant]
        assert losses == ref_losses, variant
        for key, value in ref_weights.items():
            assert weights[key].dtype == value.dtype and torch.equal(weights[key], value), (variant, key)


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
        taken = result["taken"]
        assert (taken["reduction"], taken["step"], taken["multi_rank_step"]) == (0, 0, 4), taken
        assert taken["optimizer_chunks"] >= 4 * 2, taken  # the overlapped step calls the optimizer per chunk
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
            taken = result["taken"]
            assert (taken["reduction"], taken["step"], taken["multi_rank_step"]) == (0, 0, 4), (name, taken)
            assert taken["optimizer_chunks"] >= 4 * 2, (name, taken)  # gathers on the side stream
            _assert_bit_identical(result)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_overlapped_gather_is_bit_identical_on_two_gpus_with_a_larger_model():
    """~50M parameters, 4M-element buckets (the gather in 8 chunks behind the optimizer on a side stream): every
    forward after a step must see the gathered parameters, so losses, grad norms and weights equal ColossalAI's."""
    bucket = dict(type="LowLevelZeroPlugin", stage=2, reduce_bucket_size_in_m=4)
    cases = (("zero2_bf16_large", bucket, "bf16"),)
    for per_rank in run_distributed(_both_paths, world_size=2, args=(cases, _large_model), timeout=300):
        result = per_rank["zero2_bf16_large"]
        assert result["taken"]["multi_rank_step"] == 4, result["taken"]
        assert result["taken"]["optimizer_chunks"] >= 4 * 8, result["taken"]  # ~8 chunks per step
        _assert_bit_identical(result)
