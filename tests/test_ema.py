"""EMA against the closed form  ema_k = d^k w_0 + (1 - d) * sum_{i=1..k} d^(k-i) w_i."""

import pytest
import torch

from opensora.training.ema import EMA, unwrap_model


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    model[1].bias.requires_grad_(False)  # frozen weights are not tracked
    return model


def _set_weights(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))


def test_matches_closed_form():
    decay, steps = 0.9, 5
    model = _model()
    history = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    ema = EMA(model, decay=decay, enabled=True)
    assert set(ema.state_dict()) == {"0.weight", "0.bias", "1.weight"}
    for k in range(1, steps + 1):
        _set_weights(model, seed=k)
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
        ema.update(model, step=k)
    for name, value in ema.state_dict().items():
        expected = decay**steps * history[0][name].double()
        for i in range(1, steps + 1):
            expected += (1 - decay) * decay ** (steps - i) * history[i][name].double()
        assert value.dtype == torch.float32
        torch.testing.assert_close(value.double(), expected, rtol=1e-6, atol=1e-6)
    assert ema.num_updates == steps


def test_copies_before_start_step_and_keeps_fp32_from_bf16():
    model = _model().to(torch.bfloat16)
    ema = EMA(model, decay=0.99, start_step=3, enabled=True)
    _set_weights(model, seed=1)
    ema.update(model, step=2)  # before start: plain copy
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert torch.equal(ema.state_dict()[name], p.float())
    before = {n: t.clone() for n, t in ema.state_dict().items()}
    _set_weights(model, seed=2)
    ema.update(model, step=3)  # from start on: averaging
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(ema.state_dict()[name], 0.99 * before[name] + 0.01 * p.float())


def test_disabled_rank_allocates_nothing():
    model = _model()
    ema = EMA(model, enabled=False)
    ema.update(model, step=1)
    assert ema.state_dict() == {}


def test_safetensors_roundtrip_and_copy_to(tmp_path):
    model = _model()
    ema = EMA(model, decay=0.5, enabled=True)
    _set_weights(model, seed=3)
    ema.update(model, step=1)
    ema.save(tmp_path / "ema.safetensors")
    other = EMA(_model(), decay=0.5, enabled=True)
    other.load(tmp_path / "ema.safetensors")
    assert other.num_updates == 1
    for name in ema.state_dict():
        assert torch.equal(ema.state_dict()[name], other.state_dict()[name])
    target = _model()
    other.copy_to(target)
    assert torch.equal(target[0].weight, ema.state_dict()["0.weight"])
    with pytest.raises(KeyError, match="mismatch"):
        other.load_state_dict({"0.weight": torch.zeros(5, 3)})


def test_unwrap_model_sees_through_wrappers():
    inner = _model()

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def unwrap(self):
            return self.module

    assert unwrap_model(Wrapper(Wrapper(inner))) is inner
    assert unwrap_model(inner) is inner


def test_warmup_decay_schedule_and_average():
    """With warmup the decay ramps as (1 + n) / (10 + n) up to ``decay``, n counted from start_step."""
    import torch.nn as nn

    from opensora.training.ema import EMA

    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0)
    ema = EMA(model, decay=0.9, start_step=0, enabled=True, warmup=True)
    assert [ema.decay_at(n) for n in (0, 1, 10, 1000)] == pytest.approx([0.1, 2 / 11, 11 / 20, 0.9])
    expected = 0.0
    for step in range(1, 30):
        with torch.no_grad():
            model.weight.fill_(float(step))
        ema.update(model, step=step)
        d = min(0.9, (1 + step) / (10 + step))
        expected = d * expected + (1 - d) * step
    assert ema.shadow["weight"].item() == pytest.approx(expected, rel=1e-6)


def _mixed_model(dtype):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.LayerNorm(33), torch.nn.Linear(33, 5))
    model[0].to(dtype)  # weights of two dtypes: chunks split where the dtype changes
    return model


def _per_tensor_reference(shadow: dict, model, decay: float) -> dict:
    """The EMA update as it was before the multi-tensor path: one cast + lerp_ per tensor."""
    from opensora.training.ema import ema_step

    out = {name: value.clone() for name, value in shadow.items()}
    for name, param in model.named_parameters():
        ema_step(out[name], param.detach(), decay)
    return out


def _assert_updates_match_per_tensor(ema, model, steps):
    for step in range(1, steps + 1):
        _set_weights(model, seed=step)
        expected = _per_tensor_reference(ema.shadow, model, ema.decay_at(step))
        ema.update(model, step=step)
        for name, value in expected.items():
            assert torch.equal(ema.shadow[name], value), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_numel", [1, 100, 10**6])
def test_multi_tensor_update_is_bit_identical_to_per_tensor(monkeypatch, dtype, chunk_numel):
    import opensora.training.ema as ema_module

    monkeypatch.setattr(ema_module, "CAST_CHUNK_NUMEL", chunk_numel)
    monkeypatch.setattr(ema_module.ema_step_all, "__defaults__", (chunk_numel,))
    model = _mixed_model(dtype)
    ema = EMA(model, decay=0.999, enabled=True, warmup=True)
    _assert_updates_match_per_tensor(ema, model, steps=5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shadow_device", [None, "cpu"])
def test_multi_tensor_update_is_bit_identical_on_gpu(shadow_device):
    model = _mixed_model(torch.bfloat16).cuda()
    ema = EMA(model, decay=0.9999, enabled=True, device=shadow_device)
    _assert_updates_match_per_tensor(ema, model, steps=3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlapped_update_on_a_side_stream_equals_the_serial_update():
    """The trainer's order: optimizer writes the weights, EMA update (side stream), next forward, fence, next write."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)]).cuda().to(torch.bfloat16)
    serial = EMA(model, decay=0.99, enabled=True, overlap=False, warmup=True)
    overlapped = EMA(model, decay=0.99, enabled=True, warmup=True)
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    for step in range(1, 8):
        serial.update(model, step=step)
        overlapped.update(model, step=step)
        assert overlapped._done is not None and overlapped._stream != torch.cuda.current_stream()
        with torch.no_grad():
            model(x)  # the next forward reads the weights while the side stream does
            overlapped.fence()
            for p in model.parameters():  # the next optimizer step writes them
                p.mul_(0.5).add_(torch.randn_like(p))
    for name, value in serial.state_dict().items():
        assert torch.equal(overlapped.state_dict()[name], value), name


def test_an_update_reuses_its_plan_until_the_parameters_change(monkeypatch):
    """The names, lists and casting plan are made once; a parameter on new storage (``.to()``, ``param.data = ...``)
    or a newly frozen one makes the next update see the model as it is, never stale tensors."""
    model = _mixed_model(torch.bfloat16)
    ema = EMA(model, decay=0.9, enabled=True)
    walks = []
    monkeypatch.setattr(EMA, "_tracked", staticmethod(lambda m, _tracked=EMA._tracked: walks.append(1) or _tracked(m)))
    _assert_updates_match_per_tensor(ema, model, steps=3)
    assert len(walks) == 1  # the named walk and the plan: the first update only
    model[2].weight.data = torch.randn(5, 33)  # new storage: the old plan would average stale weights
    _assert_updates_match_per_tensor(ema, model, steps=2)
    assert len(walks) == 2
    model[1].weight.requires_grad_(False)  # frozen: no longer tracked, its shadow stays where it was
    kept = ema.shadow["1.weight"].clone()
    _set_weights(model, seed=9)
    ema.update(model, step=9)
    assert len(walks) == 3 and torch.equal(ema.shadow["1.weight"], kept)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
        ),
    ],
)
def test_values_instead_of_parameters_follow_the_closed_form_and_the_plan_tracks_them(device):
    """``update(values=...)`` (the trainer's fp32 masters) folds those tensors in for the named parameters, the
    others as they are; new value tensors make a new plan; a value of the wrong shape is refused by name. On a GPU
    the update runs on its side stream; the shadow read back fences it."""
    decay = 0.8
    model = _model().to(device, torch.bfloat16)
    ema = EMA(model, decay=decay, enabled=True)
    start = {n: v.clone() for n, v in ema.state_dict().items()}
    weight = model[0].weight
    for k in (1, 2):
        exact = torch.randn(weight.shape, generator=torch.Generator().manual_seed(k)).to(device)  # fp32, a master
        with torch.no_grad():
            weight.copy_(exact)  # the bf16 weight: the master rounded
        ema.update(model, step=k, values={id(weight): exact})
        expected = start["0.weight"].lerp(exact, 1 - decay)
        shadow = ema.state_dict()
        assert torch.equal(shadow["0.weight"], expected)  # the fp32 values, not the rounded weight
        start["0.weight"] = expected
        other = start["0.bias"].lerp(model[0].bias.detach().float(), 1 - decay)
        assert torch.equal(shadow["0.bias"], other)
        start["0.bias"] = other
    with pytest.raises(ValueError, match="0.weight"):
        ema.update(model, step=3, values={id(weight): torch.zeros(weight.numel())})
