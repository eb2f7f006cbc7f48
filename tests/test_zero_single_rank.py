"""The ZeRO shortcuts (opensora.training.zero_single_rank) against ColossalAI's own path, bit for bit: the one-rank
shortcuts on one gloo rank, the multi-rank step on two."""

import contextlib
import functools
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
    # gradient accumulation: two backwards a step (ZeRO-2 adds each to its reduced gradient), and ZeRO-1's no_sync
    ("zero2_bf16_two_backwards", dict(type="LowLevelZeroPlugin", stage=2), "bf16", "two_backwards"),
    ("zero1_bf16_no_sync", dict(type="LowLevelZeroPlugin", stage=1), "bf16", "no_sync"),
    # the opt-out: one rank's gradients through the bucket store
    ("zero2_bf16_bucketed", dict(type="LowLevelZeroPlugin", stage=2, grads_in_place=False), "bf16"),
]
SHORTCUTS_ON = dict(single_rank_shortcut=True, multi_rank_shortcut=True)
SHORTCUTS_OFF = dict(single_rank_shortcut=False, multi_rank_shortcut=False)
MULTI_RANK_ONLY = {"reduction": 0, "step": 0, "multi_rank_step": 4, "grads_in_place": 0}  # what 4 steps on 2 ranks take


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


def _train(plugin_cfg, precision, rank, device, accumulate=None):
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
        for micro in range(1 if accumulate is None else 2):
            x, y = torch.randn(6, 7, generator=gen), torch.randn(6, 5, generator=gen)
            loss = ((model(x.to(device, dtype)).float() - y.to(device)) ** 2).mean()
            quiet = accumulate == "no_sync" and micro == 0  # the first micro-batch only accumulates
            with optimizer.no_sync() if quiet else contextlib.nullcontext():
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
    return losses, weights, _whole_masters_check(model, optimizer)


def _whole_masters_check(model, optimizer):
    """``whole_masters`` per trainable weight: (dtype, same shape, its rounding is the weight), or None."""
    from opensora.training.ema import unwrap_model
    from opensora.training.zero_single_rank import whole_masters

    masters = whole_masters(optimizer)
    if masters is None:
        return None
    return {
        n: (masters[id(p)].dtype, masters[id(p)].shape == p.shape, torch.equal(masters[id(p)].to(p.dtype), p.detach()))
        for n, p in unwrap_model(model).named_parameters()
        if p.requires_grad
    }


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
    for name, plugin_cfg, precision, *accumulate in CASES:
        run = functools.partial(
            _train, precision=precision, rank=rank, device=device, accumulate=(accumulate or [None])[0]
        )
        ours, taken = _taken(lambda: run(dict(plugin_cfg, **SHORTCUTS_ON)))
        reference, ref_taken = _taken(lambda: run(dict(plugin_cfg, **SHORTCUTS_OFF)))
        assert not any(ref_taken.values()), "the reference must run ColossalAI's own methods"
        results[name] = dict(ours=ours, reference=reference, taken=taken)
    return results


def _assert_bit_identical(result):
    (losses, weights, _), (ref_losses, ref_weights, _) = result["ours"], result["reference"]
    assert losses == ref_losses
    for key, value in ref_weights.items():
        assert weights[key].dtype == value.dtype and torch.equal(weights[key], value), key


@pytest.fixture(scope="module")
def one_rank():
    return run_distributed(_both_paths, world_size=1, timeout=240)[0]


@pytest.mark.parametrize("name", [case[0] for case in CASES])
def test_one_rank_shortcuts_are_bit_identical_to_colossalai(one_rank, name):
    _assert_one_rank_paths(name, one_rank[name]["taken"])
    _assert_bit_identical(one_rank[name])
    # the EMA's fp32 weights (whole_masters): with the shortcuts and without, each master in its weight's shape whose
    # rounding is the weight; fp32 training has none (the weights are the masters' bits)
    for masters in (one_rank[name]["ours"][2], one_rank[name]["reference"][2]):
        if "fp32" in name:
            assert masters is None
        else:
            assert len(masters) == 7 and all(v == (torch.float32, True, True) for v in masters.values()), masters


def _assert_one_rank_paths(name, taken):
    # HybridParallel's optimizer, a subclass, keeps the store (its sequence parallelism reads it); so does the opt-out
    if name.startswith("hybrid") or name.endswith("bucketed"):
        assert taken["reduction"] >= 4 and taken["grads_in_place"] == 0, (name, taken)
    else:  # LowLevelZero: the gradients stay in .grad, no bucket is filled
        assert taken["reduction"] == 0 and taken["grads_in_place"] >= 4, (name, taken)
    assert taken["step"] >= 4 and taken["multi_rank_step"] == 0, (name, taken)


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_both_paths, world_size=2, timeout=240)


@pytest.mark.parametrize("name", [case[0] for case in CASES])
def test_multi_rank_step_is_bit_identical_to_colossalai(two_ranks, name):
    """ZeRO's step on two gloo ranks (an odd-sized weight: padded last shard) against ColossalAI's own step."""
    for per_rank in two_ranks:
        result = per_rank[name]
        # the one-rank shortcuts, enabled too, are not taken
        assert result["taken"] == MULTI_RANK_ONLY, result["taken"]
        _assert_bit_identical(result)
        assert result["ours"][2] is None and result["reference"][2] is None  # shards: the EMA reads the weights
    (_, weights0, _), (_, weights1, _) = (per_rank[name]["ours"] for per_rank in two_ranks)
    for key, value in weights0.items():  # every rank holds the same gathered parameters
        if not key.startswith("master"):
            assert torch.equal(value, weights1[key]), key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_rank_shortcuts_are_bit_identical_on_gpu_with_overlapped_communication():
    """NCCL, one GPU, overlap_communication=True (the trainer's setting): the side-stream path vs the shortcut."""
    for name, result in run_distributed(_both_paths, world_size=1, timeout=240)[0].items():
        _assert_one_rank_paths(name, result["taken"])
        _assert_bit_identical(result)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_multi_rank_step_is_bit_identical_on_two_gpus_with_overlapped_communication():
    """NCCL, two GPUs, overlap_communication=True: the multi-rank step (in-place all-gather) vs ColossalAI's."""
    for per_rank in run_distributed(_both_paths, world_size=2, timeout=240):
        for name, result in per_rank.items():
            assert result["taken"] == MULTI_RANK_ONLY, (name, result["taken"])
            _assert_bit_identical(result)


def _default_plugin_run(rank, world_size):
    warnings.filterwarnings("ignore")
    from opensora.training.distributed import init_distributed

    _, _, _, device = init_distributed()
    return _taken(lambda: _train(dict(type="LowLevelZeroPlugin", stage=2), "bf16", rank, device))[1]


def test_the_plugin_defaults_take_the_multi_rank_step_on_two_ranks():
    """No shortcut keys in the plugin config: two ranks take the multi-rank step (the default since its 2-GPU run)."""
    for taken in run_distributed(_default_plugin_run, world_size=2, timeout=240):
        assert taken == MULTI_RANK_ONLY, taken


def _edge_runs(rank, world_size):
    """One rank, each run with the gradients in .grad and through the store: fp16 (its loss scaler reads the store
    for overflow), ZeRO-1 with zero_grad(set_to_none=False) and a layer unused in later steps, and
    model.zero_grad() between backward and step."""
    warnings.filterwarnings("ignore")
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator

    from opensora.training.booster import build_booster
    from opensora.training.distributed import init_distributed
    from opensora.training.ema import unwrap_model

    _, _, _, device = init_distributed()
    if device.type == "cpu":  # fp16's DynamicGradScaler asks the accelerator for a device count the CPU one refuses
        CpuAccelerator.device_count = lambda self: 1

    def run(precision, stage, in_place, set_to_none=True, clear_between=False):
        torch.manual_seed(0)
        model = _model()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
        booster = build_booster(
            dict(type="LowLevelZeroPlugin", stage=stage, max_norm=1.0, grads_in_place=in_place), precision
        )
        model, optimizer, *_ = booster.boost(model, optimizer)
        dtype = dict(fp16=torch.float16, bf16=torch.bfloat16)[precision]
        gen = torch.Generator().manual_seed(1)
        scales = []
        for step in range(3):
            x = torch.randn(6, 7, generator=gen).to(device, dtype)
            out = model(x)
            if step == 0:  # the unused layer gets a gradient in the first step only
                out = out + unwrap_model(model).unused(x[:, :3]).sum()
            booster.backward(out.float().pow(2).mean(), optimizer)
            if clear_between:
                model.zero_grad()
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
            if optimizer.mixed_precision_mixin is not None and hasattr(optimizer.mixed_precision_mixin, "loss_scale"):
                scales.append(float(optimizer.mixed_precision_mixin.loss_scale))
        weights = {n: p.detach().float().clone() for n, p in unwrap_model(model).named_parameters()}
        return weights, scales

    results = {}
    for name, kwargs in (
        ("fp16", dict(precision="fp16", stage=2)),
        ("zero1_keep", dict(precision="bf16", stage=1, set_to_none=False)),
    ):
        results[name] = [run(in_place=flag, **kwargs) for flag in (True, False)]
    try:
        run("bf16", 2, True, clear_between=True)
        results["cleared"] = "ran"
    except RuntimeError as error:
        results["cleared"] = str(error)
    return results


def test_fp16_set_to_none_false_and_cleared_gradients_match_or_are_refused():
    """fp16 keeps the store (its overflow check reads it), so the loss scale backs off as ColossalAI's does;
    zero_grad(set_to_none=False) leaves no zeroed gradient for ZeRO-1 to step again; a gradient cleared between
    backward and step is refused in one line naming the cause."""
    (result,) = run_distributed(_edge_runs, world_size=1, timeout=240)
    for name in ("fp16", "zero1_keep"):
        (ours, our_scales), (reference, ref_scales) = result[name]
        assert our_scales == ref_scales, name
        for key, value in reference.items():
            assert torch.equal(ours[key], value), (name, key)
    assert result["fp16"][0][1][-1] < 2.0**32  # overflow was seen: the scale backed off from its start
    assert "cleared before optimizer.step()" in result["cleared"] and "grads_in_place=False" in result["cleared"]
