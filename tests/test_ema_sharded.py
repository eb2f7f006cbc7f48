"""The EMA sharded like ZeRO's masters: each rank's pieces against the whole EMA (closed form tested in test_ema.py),
files it writes and reads at other rank counts, and 2 gloo ranks under the real LowLevelZero optimizer."""

import warnings

import pytest
import torch

from dist_utils import run_distributed


def _model():
    # 7 * 5 = 35 and 5 elements: neither divides by 2 or 3, so every rank count pads
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4, bias=False))


def _drift(model, step):
    """New weights for ``step`` (deterministic), written into the model."""
    gen = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen))


def test_shard_of_matches_colossalai_partition():
    from opensora.training.ema_sharded import shard_of

    flat = torch.arange(10.0)
    pieces = [shard_of(flat, r, 3) for r in range(3)]
    assert [p.tolist() for p in pieces] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 0]]  # zero-padded to 12
    padded = torch.nn.functional.pad(flat, [0, 2])
    for r, piece in enumerate(padded.split(4)):  # ColossalAI: pad, split(numel // world), take [local_rank]
        assert torch.equal(pieces[r], piece)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_pieces_equal_the_whole_ema_sliced(world_size):
    """Every rank's pieces after warmup and plain updates are exactly the whole EMA's tensors cut the same way."""
    from opensora.training.ema import EMA
    from opensora.training.ema_sharded import ShardedEMA, shard_of

    model = _model()
    whole = EMA(model, decay=0.9, warmup=True, enabled=True, overlap=False)
    ranks = [ShardedEMA(model, r, world_size, decay=0.9, warmup=True, overlap=False) for r in range(world_size)]
    params = list(model.parameters())
    for step in range(1, 6):
        _drift(model, step)
        whole.update(model, step=step)
        for r, ema in enumerate(ranks):
            masters = {id(p): shard_of(p.detach().reshape(-1), r, world_size) for p in params}
            ema.update(model, step=step, values=masters)
    for r, ema in enumerate(ranks):
        assert ema.num_updates == whole.num_updates == 5
        for name, value in whole.shadow.items():
            assert torch.equal(ema.shadow[name], shard_of(value.reshape(-1), r, world_size)), (r, name)
    # one process: the "gather" is the rank's own pieces
    if world_size == 1:
        got = ranks[0].gathered()
        assert got.keys() == whole.shadow.keys()
        for name, value in whole.shadow.items():
            assert torch.equal(got[name], value)


def test_update_without_master_pieces_or_with_wrong_sizes_is_refused():
    from opensora.training.ema_sharded import ShardedEMA

    model = _model()
    ema = ShardedEMA(model, 0, 2, decay=0.9, overlap=False)
    with pytest.raises(RuntimeError, match="no master piece"):
        ema.update(model, step=1)
    wrong = {id(p): torch.zeros(p.numel()) for p in model.parameters()}  # whole tensors, not pieces
    with pytest.raises(ValueError, match="does not shard over 2 ranks"):
        ema.update(model, step=1, values=wrong)
    with pytest.raises(ValueError, match="rank 2 is not one of 2"):
        ShardedEMA(model, 2, 2)


def test_a_whole_ema_file_loads_into_pieces_at_any_rank_count(tmp_path):
    """The file format is EMA's: a rank-0 EMA's file (or a sharded run's) resumes on 2 or 3 ranks, metadata too."""
    from opensora.training.ema import EMA
    from opensora.training.ema_sharded import ShardedEMA, shard_of

    model = _model()
    whole = EMA(model, decay=0.9, enabled=True, overlap=False)
    for step in range(1, 4):
        _drift(model, step)
        whole.update(model, step=step)
    path = tmp_path / "ema.safetensors"
    whole.save(path)
    fresh = _model()
    for world_size in (2, 3):
        for r in range(world_size):
            ema = ShardedEMA(fresh, r, world_size, decay=0.9, overlap=False)
            ema.load(path)
            assert ema.num_updates == 3
            for name, value in whole.shadow.items():
                assert torch.equal(ema.shadow[name], shard_of(value.reshape(-1), r, world_size))
    with pytest.raises(KeyError, match="missing"):
        ShardedEMA(fresh, 0, 2).load_state_dict({"0.weight": whole.shadow["0.weight"]})
    with pytest.raises(ValueError, match="has shape"):
        ShardedEMA(fresh, 0, 2).load_state_dict({k: v.t() if v.dim() == 2 else v for k, v in whole.shadow.items()})


def test_build_ema_picks_sharded_only_for_multi_rank_zero():
    from opensora.training.ema import EMA
    from opensora.training.ema_sharded import ShardedEMA
    from opensora.training.role_builder import build_ema

    model = _model()
    zero = dict(type="LowLevelZeroPlugin", stage=2)
    # one process: never sharded
    assert type(build_ema(dict(decay=0.9), model, zero, is_main=True)) is EMA
    assert build_ema(dict(decay=0.9), model, zero, is_main=False) is None
    assert build_ema(None, model, zero, is_main=True) is None
    with pytest.raises(ValueError, match="sharded=True needs LowLevelZeroPlugin on several ranks"):
        build_ema(dict(decay=0.9, sharded=True), model, zero, is_main=True)
    assert not issubclass(EMA, ShardedEMA)


# ---- 2 gloo ranks, the real LowLevelZero optimizer ----------------------------------------------------------------
def _zero_two_ranks(rank, world_size, path):
    """Train 4 steps under ZeRO-2 in fp32 (the masters equal the working weights after each step) with the trainer's
    EMA choice (``build_ema``: sharded here) and a whole EMA of the working weights beside it. On gloo / CPU, or on
    NCCL / GPU where the sharded EMA folds in on its side stream and gathers over NCCL."""
    warnings.filterwarnings("ignore")
    from opensora.training.booster import build_booster
    from opensora.training.distributed import init_distributed
    from opensora.training.ema import EMA, unwrap_model
    from opensora.training.ema_sharded import ShardedEMA
    from opensora.training.role_builder import build_ema

    rank, world, _, device = init_distributed()
    model = _model().to(device)
    plugin = dict(type="LowLevelZeroPlugin", stage=2)
    ema = build_ema(dict(decay=0.8, warmup=True), model, plugin, is_main=rank == 0)
    reference = EMA(model, decay=0.8, warmup=True, enabled=True, overlap=False)
    wrong_layout = ShardedEMA(model, rank, 3, decay=0.8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    booster = build_booster(plugin, "fp32")
    model, optimizer, *_ = booster.boost(model, optimizer)
    gen = torch.Generator().manual_seed(7 + rank)
    for step in range(1, 5):
        x, y = torch.randn(4, 7, generator=gen).to(device), torch.randn(4, 4, generator=gen).to(device)
        booster.backward(((model(x) - y) ** 2).mean(), optimizer)
        optimizer.step()
        optimizer.zero_grad()
        ema.update(model, step=step, values=ema.masters_of(optimizer))
        reference.update(model, step=step)
    error = None
    try:
        wrong_layout.masters_of(optimizer)
    except RuntimeError as exc:
        error = str(exc)
    gathered = ema.gathered()
    ema.save(path)  # a collective: rank 0 writes
    target = _model().to(device)
    ema.copy_to(target if rank == 0 else None)
    on_cpu = lambda tensors: {name: value.detach().cpu().clone() for name, value in tensors}  # noqa: E731
    return dict(
        kind=type(ema).__name__,
        gathered=on_cpu(gathered.items()),
        reference=on_cpu(reference.shadow.items()),
        copied=on_cpu(target.named_parameters()),
        live=on_cpu(unwrap_model(model).named_parameters()),
        error=error,
    )


def test_two_zero_ranks_keep_the_whole_ema_in_pieces(tmp_path):
    _check_two_zero_ranks(
        tmp_path, run_distributed(_zero_two_ranks, world_size=2, args=(str(tmp_path / "ema.safetensors"),), timeout=240)
    )


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_zero_gpus_keep_the_whole_ema_in_pieces_over_nccl(tmp_path):
    """The same on two GPUs: NCCL gathers for save / copy_to, the update on the EMA's side stream."""
    _check_two_zero_ranks(
        tmp_path, run_distributed(_zero_two_ranks, world_size=2, args=(str(tmp_path / "ema.safetensors"),), timeout=240)
    )


def _check_two_zero_ranks(tmp_path, results):
    from safetensors.torch import load_file

    from opensora.training.ema import EMA

    path = tmp_path / "ema.safetensors"
    first, second = results
    assert first["kind"] == second["kind"] == "ShardedEMA"
    assert second["gathered"] == {}  # whole tensors on rank 0 only
    reference = first["reference"]
    assert first["gathered"].keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(first["gathered"][name], value), name
        assert torch.equal(first["copied"][name], value), name
        assert not torch.equal(value, first["live"][name])  # an average, not the weights
    saved = load_file(str(path))
    for name, value in reference.items():
        assert torch.equal(saved[name], value), name
    whole = EMA(_model(), enabled=True)
    whole.load(path)
    assert whole.num_updates == 4
    for error in (first["error"], second["error"]):
        assert error is not None and "built for rank" in error and "(rank, ranks)" in error


def test_pieces_are_read_by_rows_for_any_shape_and_rank_count(tmp_path):
    """``load`` reads only the rows holding a rank's piece: equal to cutting the whole tensor, for 3-D, 2-D, 1-D and
    0-d weights, and for rank counts above a weight's size (pieces that are all padding)."""
    from opensora.training.ema import EMA
    from opensora.training.ema_sharded import ShardedEMA, shard_of

    class Shapes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            gen = torch.Generator().manual_seed(3)
            for name, shape in {"cube": (3, 2, 5), "plane": (4, 3), "line": (7,), "one": (1,), "scalar": ()}.items():
                setattr(self, name, torch.nn.Parameter(torch.randn(shape, generator=gen)))

    model = Shapes()
    path = tmp_path / "ema.safetensors"
    EMA(model, enabled=True, overlap=False).save(path)
    for world_size in (1, 2, 3, 4, 7, 31):
        for r in range(world_size):
            ema = ShardedEMA(Shapes(), r, world_size, overlap=False)
            ema.load(path)
            for name, param in model.named_parameters():
                assert torch.equal(ema.shadow[name], shard_of(param.detach().reshape(-1), r, world_size)), (name, r)
    wrong = Shapes()
    wrong.plane = torch.nn.Parameter(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="'plane' has shape"):
        ShardedEMA(wrong, 0, 2).load(path)


def _failures_two_ranks(rank, world_size, outputs):
    """A sharded EMA whose rank 0 cannot keep the gathered tensors still takes part in every gather; and a
    checkpoint whose rank 0 cannot write its scheduler file ends with the same error on both ranks."""
    import errno

    warnings.filterwarnings("ignore")
    from opensora.roles import Role
    from opensora.training import checkpoint as ckpt
    from opensora.training.booster import build_booster
    from opensora.training.distributed import init_distributed
    from opensora.training.role_builder import build_ema

    rank, _, _, _ = init_distributed()
    model = _model()
    plugin = dict(type="LowLevelZeroPlugin", stage=2)
    ema = build_ema(dict(decay=0.8), model, plugin, is_main=rank == 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    booster = build_booster(plugin, "fp32")
    model, optimizer, _, _, scheduler = booster.boost(model, optimizer, lr_scheduler=scheduler)
    booster.backward(((model(torch.randn(4, 7)) - torch.randn(4, 4)) ** 2).mean(), optimizer)
    optimizer.step()
    optimizer.zero_grad()
    ema.update(model, step=1, values=ema.masters_of(optimizer))
    result = {}
    try:  # rank 0 asks for an impossible device: it fails at the first tensor and goes on gathering
        result["gathered"] = len(ema.gathered(device="meta" if rank else "no-such-device"))
    except RuntimeError as exc:
        result["gathered"] = f"raised: {str(exc)[:80]}"
    result["after"] = len(ema.gathered())  # both ranks still in step

    role = Role(
        name="model", model=model, trainable=True, optimizer=optimizer, lr_scheduler=scheduler, booster=booster, ema=ema
    )
    real_save = torch.save

    def disk_full_for_the_scheduler(obj, f, *args, **kwargs):
        if rank == 0 and "lr_scheduler" in str(f):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    torch.save = disk_full_for_the_scheduler
    try:
        ckpt.save_checkpoint(outputs, 1, {"model": role})
        result["save"] = "saved"
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
        result["save"] = type(exc).__name__
    finally:
        torch.save = real_save
    return result


def test_a_failure_on_rank_0_leaves_no_rank_in_a_gather(tmp_path):
    first, second = run_distributed(_failures_two_ranks, world_size=2, args=(str(tmp_path / "run"),), timeout=180)
    assert first["gathered"].startswith("raised") and second["gathered"] == 0, (first, second)
    assert (first["after"], second["after"]) == (3, 0)  # the model's 3 weights, whole on rank 0
    assert first["save"] == second["save"] == "CheckpointSaveError"
    assert not list((tmp_path / "run").rglob("ema.safetensors"))  # nothing half-written was published
