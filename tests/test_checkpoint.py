"""Atomic step checkpoints: exact resume under ZeRO-2 on 2 gloo ranks, crash safety, keep_last, RNG, EMA."""

import json
import random
import warnings

import numpy as np
import pytest
import torch

from dist_utils import run_distributed

SEED = 7


def _roles(booster, model, optimizer, scheduler, ema):
    from opensora.roles import Role

    return {
        "model": Role(
            name="model",
            model=model,
            trainable=True,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            booster=booster,
            ema=ema,
        )
    }


def _boosted(precision, init_seed):
    from opensora.training.booster import build_booster

    with torch.random.fork_rng():  # init from its own seed without touching the data RNG stream
        torch.manual_seed(init_seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-15, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    booster = build_booster(dict(type="LowLevelZeroPlugin", stage=2), precision)
    model, optimizer, _, _, scheduler = booster.boost(model, optimizer, lr_scheduler=scheduler)
    return booster, model, optimizer, scheduler


def _train(booster, model, optimizer, scheduler, ema, steps, first_step, precision):
    """Steps draw their data from the *global* RNGs, so an exact resume needs the RNG state restored too."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    losses = []
    for step in range(first_step, first_step + steps):
        x = torch.randn(4, 8) + float(np.random.rand()) + random.random()
        y = torch.randn(4, 4)
        loss = ((model(x.to(dtype)).float() - y) ** 2).mean()
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        ema.update(model, step=step + 1)
        losses.append(loss.item())
    return losses


def _checkpoint_scenarios(rank, world_size, outputs, precision):
    warnings.filterwarnings("ignore")
    from opensora.training import checkpoint as ckpt
    from opensora.training.distributed import init_distributed
    from opensora.training.ema import EMA
    from opensora.training.rng import seed_everything

    init_distributed()
    out = {}

    # Uninterrupted reference: 6 steps. Seed after boosting (colossalai's lazy imports draw from `random`).
    parts = _boosted(precision, init_seed=0)
    seed_everything(SEED + rank)
    ema = EMA(parts[1], decay=0.9)
    out["reference"] = _train(*parts, ema, steps=6, first_step=0, precision=precision)
    out["reference_ema"] = ema.state_dict()

    # Interrupted: 3 steps, save, then a save that crashes halfway.
    parts = _boosted(precision, init_seed=0)
    seed_everything(SEED + rank)
    booster, model, optimizer, scheduler = parts
    ema = EMA(model, decay=0.9)
    out["first_half"] = _train(*parts, ema, steps=3, first_step=0, precision=precision)
    saved = ckpt.save_checkpoint(
        outputs,
        3,
        _roles(booster, model, optimizer, scheduler, ema),
        extra_state={"trainer": {"step": 3, "epoch": 0}, "sampler": {"index": 12}},
        config_text="lr = 1e-2\n",
        keep_last=2,
    )
    out["saved"] = str(saved)
    out["rng_after_save"] = (torch.rand(3), float(np.random.rand()), random.random())

    def crash(*args, **kwargs):  # model + optimizer are already in the tmp dir when this runs
        raise OSError("disk full (simulated)")

    booster.save_lr_scheduler = crash
    try:
        ckpt.save_checkpoint(outputs, 4, _roles(booster, model, optimizer, scheduler, ema))
    except OSError as err:
        out["crash"] = str(err)
    out["latest_after_crash"] = str(ckpt.find_latest_checkpoint(outputs))

    # Resume into a fresh model/optimizer/scheduler with different init weights and scrambled RNGs.
    seed_everything(1234)
    parts = _boosted(precision, init_seed=99)
    booster, model, optimizer, scheduler = parts
    ema = EMA(model, decay=0.9)
    loaded = ckpt.load_checkpoint(
        ckpt.find_latest_checkpoint(outputs), _roles(booster, model, optimizer, scheduler, ema)
    )
    out["loaded_step"], out["extra_state"] = loaded.step, loaded.extra_state
    out["rng_after_load"] = (torch.rand(3), float(np.random.rand()), random.random())
    ckpt_rng = torch.load(loaded.path / "rng" / f"rank{rank}.pt", weights_only=True)
    from opensora.training.rng import set_rng_state

    set_rng_state(ckpt_rng)
    out["second_half"] = _train(*parts, ema, steps=3, first_step=3, precision=precision)
    out["resumed_ema"] = ema.state_dict()

    # More saves: the crashed tmp dir is cleaned, keep_last=2 drops step 3.
    for step in (4, 5):
        ckpt.save_checkpoint(
            outputs,
            step,
            _roles(booster, model, optimizer, scheduler, ema),
            extra_state={"trainer": {"step": step}},
            keep_last=2,
        )
    out["final_listing"] = sorted(p.name for p in (ckpt.checkpoint_root(outputs)).iterdir())
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{precision: (outputs dir, [rank0 result, rank1 result])}; both precisions share one pair of processes
    so the colossalai import is paid once."""
    outputs = {p: tmp_path_factory.mktemp(f"ckpt_{p}") for p in ("fp32", "bf16")}
    per_rank = run_distributed(_run_both, world_size=2, args=({p: str(o) for p, o in outputs.items()},), timeout=240)
    return {p: (outputs[p], [r[p] for r in per_rank]) for p in outputs}


def _run_both(rank, world_size, outputs_by_precision):
    return {p: _checkpoint_scenarios(rank, world_size, out, p) for p, out in outputs_by_precision.items()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_is_bit_identical(runs, precision):
    _, per_rank = runs[precision]
    for r in per_rank:
        assert r["first_half"] == r["reference"][:3]
        assert r["second_half"] == r["reference"][3:], "resumed losses must equal the uninterrupted run exactly"
        assert r["loaded_step"] == 3
        assert r["extra_state"] == {"trainer": {"step": 3, "epoch": 0}, "sampler": {"index": 12}}
    # rank 0 holds the EMA; the resumed EMA equals the uninterrupted one exactly.
    ref, resumed = per_rank[0]["reference_ema"], per_rank[0]["resumed_ema"]
    assert ref.keys() == resumed.keys() and len(ref) == 4
    for key in ref:
        assert torch.equal(ref[key], resumed[key]), key
    assert per_rank[1]["resumed_ema"] == {}, "only rank 0 keeps EMA weights"


def test_rng_state_restored_per_rank(runs):
    _, per_rank = runs["fp32"]
    for r in per_rank:
        after_save, after_load = r["rng_after_save"], r["rng_after_load"]
        assert torch.equal(after_save[0], after_load[0]) and after_save[1:] == after_load[1:]
    assert not torch.equal(per_rank[0]["rng_after_load"][0], per_rank[1]["rng_after_load"][0])


def test_crash_mid_save_keeps_previous_checkpoint(runs):
    _, per_rank = runs["fp32"]
    for r in per_rank:
        assert "disk full (simulated)" in r["crash"] and "bytes free" in r["crash"]
        assert r["latest_after_crash"] == r["saved"]
        assert r["latest_after_crash"].endswith("step-0000003")


def test_keep_last_and_tmp_cleanup(runs):
    outputs, per_rank = runs["fp32"]
    assert per_rank[0]["final_listing"] == ["step-0000004", "step-0000005"]
    from opensora.training.checkpoint import find_latest_checkpoint, list_checkpoints

    assert [s for s, _ in list_checkpoints(outputs)] == [4, 5]
    latest = find_latest_checkpoint(outputs)
    assert latest.name == "step-0000005"
    files = {p.relative_to(latest).as_posix() for p in latest.rglob("*") if p.is_file()}
    for expected in (
        "COMPLETE",
        "meta.json",
        "model/ema.safetensors",
        "extra_state.pt",
        "model/lr_scheduler.pt",
        "rng/rank0.pt",
        "rng/rank1.pt",
    ):
        assert expected in files
    assert any(f.startswith("model/model/") for f in files) and any(f.startswith("model/optimizer/") for f in files)
    assert json.loads((latest / "meta.json").read_text())["step"] == 5
    # Every payload we write loads with weights_only=True.
    for name in ("extra_state.pt", "rng/rank0.pt", "model/lr_scheduler.pt"):
        torch.load(latest / name, weights_only=True)


def test_find_latest_ignores_incomplete_dirs(tmp_path):
    from opensora.training.checkpoint import COMPLETE_MARKER, find_latest_checkpoint

    root = tmp_path / "checkpoints"
    assert find_latest_checkpoint(tmp_path) is None
    (root / "step-0000002").mkdir(parents=True)
    (root / "step-0000002" / COMPLETE_MARKER).write_text("{}")
    (root / "step-0000009").mkdir()  # no marker: an interrupted save that was somehow renamed
    (root / ".tmp-step-0000010").mkdir()
    (root / ".tmp-step-0000010" / COMPLETE_MARKER).write_text("{}")
    assert find_latest_checkpoint(tmp_path) == root / "step-0000002"


def _partially_used_model_resume(rank, world_size, outputs):
    """ZeRO-2: a layer gets no gradient in the first steps (and nothing has stepped at the first save)."""
    from opensora.roles import Role
    from opensora.training import checkpoint as ckpt
    from opensora.training.booster import build_booster
    from opensora.training.distributed import init_distributed

    init_distributed()

    def build():
        torch.manual_seed(0)
        model = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        booster = build_booster(dict(type="LowLevelZeroPlugin", stage=2), mixed_precision="fp32")
        model, optimizer, *_ = booster.boost(model, optimizer)
        return {"model": Role(name="model", model=model, trainable=True, optimizer=optimizer, booster=booster)}

    def train(roles, steps):
        role = roles["model"]
        layers = role.unwrap()
        losses = []
        for step in steps:
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(100 * step + rank))
            out = layers[0](x) if step < 2 else layers[1](layers[0](x))  # layer 1 unused in steps 0-1
            loss = out.pow(2).mean()
            role.booster.backward(loss, role.optimizer)
            role.optimizer.step()
            role.optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    reference = train(build(), range(4))
    roles = build()
    ckpt.save_checkpoint(outputs, 0, roles)  # before any optimizer step
    first = train(roles, range(2))
    ckpt.save_checkpoint(outputs, 2, roles)
    roles = build()
    ckpt.load_checkpoint(ckpt.checkpoint_dir(outputs, 2), roles, restore_rng=False)
    return reference, first + train(roles, range(2, 4))


def test_zero_checkpoint_with_parameters_that_never_had_a_gradient(tmp_path):
    for reference, resumed in run_distributed(_partially_used_model_resume, world_size=2, args=(str(tmp_path),)):
        assert resumed == reference


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_adamw_steps_after_colossalai_loaded_its_state():
    """ColossalAI's ZeRO loader leaves ``step`` on the host; torch's fused AdamW refuses host counters."""
    from colossalai.checkpoint_io.utils import load_states_into_optimizer

    from opensora.training.checkpoint import place_adam_steps

    param = torch.nn.Parameter(torch.randn(64, device="cuda"))
    optimizer = torch.optim.AdamW([param], lr=1e-3, fused=True)
    param.grad = torch.randn_like(param)
    optimizer.step()
    saved = {0: {k: v.cpu() for k, v in optimizer.state[param].items()}}
    fresh = torch.optim.AdamW([param], lr=1e-3, fused=True)
    load_states_into_optimizer(fresh, saved, {0: param})
    assert fresh.state[param]["step"].device.type == "cpu"  # what the ZeRO loader leaves
    place_adam_steps(fresh)
    assert fresh.state[param]["step"].device == param.device and fresh.state[param]["step"].dtype == torch.float32
    fresh.step()  # raised before: the fused kernel needs the counters on the device
    assert float(fresh.state[param]["step"]) == 2.0


def test_loading_an_adam_state_keeps_the_implementation_this_run_built():
    """Loaders replace the param groups with the saved ones: a foreach checkpoint must not turn a fused run off (nor
    leave a fused optimizer's AMP-scaling flag set under groups that say foreach), and the reverse."""
    from opensora.training.checkpoint import place_adam_steps

    param = torch.nn.Parameter(torch.randn(8))
    saved_foreach = torch.optim.AdamW([param], lr=1e-3, foreach=True)
    param.grad = torch.randn_like(param)
    saved_foreach.step()
    fused = torch.optim.AdamW([param], lr=1e-3, fused=True)
    fused.load_state_dict(saved_foreach.state_dict())
    assert not fused.param_groups[0]["fused"]  # what the load leaves
    place_adam_steps(fused)
    assert fused.param_groups[0]["fused"] and not fused.param_groups[0]["foreach"]
    fused.step()
    foreach = torch.optim.AdamW([param], lr=1e-3, foreach=True)
    foreach.load_state_dict(fused.state_dict())
    place_adam_steps(foreach)
    assert foreach.param_groups[0]["foreach"] and not foreach.param_groups[0]["fused"]
    foreach.step()


def test_gemini_fp32_master_chunks_are_saved_and_written_back(tmp_path):
    """Gemini keeps its fp32 masters in chunks (HybridAdam holds empty stand-ins) and its model checkpoint stores
    them as bf16; the checkpoint keeps each rank's chunk payloads and writes them back over what the bf16 load
    left, so a resumed run continues from the exact masters. (The end-to-end check needs a GPU:
    benchmarks/gemini_check.sh resume.)"""
    from types import SimpleNamespace

    from opensora.training.checkpoint import _load_master_params, _master_params, _save_master_params

    class Manager:
        reuse_fp16_chunk = True

        def __init__(self, chunks):
            self.chunks = chunks

        def get_chunks(self, params):
            return tuple(self.chunks[id(p)] for p in params if id(p) in self.chunks)

    def gemini_model(seed):
        generator = torch.Generator().manual_seed(seed)
        params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
        payloads = [torch.randn(8, generator=generator), torch.randn(5, generator=generator)]
        chunks = {id(p): SimpleNamespace(payload=payload) for p, payload in zip(params, payloads)}
        return SimpleNamespace(chunk_manager=Manager(chunks), fp32_params=params), payloads

    # HybridAdam under Gemini: empty stand-ins, which the generic path would have saved
    optimizer = SimpleNamespace(optim=SimpleNamespace(param_groups=[dict(params=[torch.empty(0)])]))
    saved_model, saved = gemini_model(0)
    assert [t.data_ptr() for t in _master_params(saved_model, optimizer)] == [t.data_ptr() for t in saved]
    _save_master_params(saved_model, optimizer, tmp_path, rank=0)
    loaded_model, loaded = gemini_model(1)
    rounded = [t.to(torch.bfloat16).float() for t in saved]  # what Gemini's own model load leaves
    for target, value in zip(loaded, rounded):
        target.copy_(value)
    _load_master_params(loaded_model, optimizer, tmp_path, rank=0, saved_world_size=1)
    for a, b in zip(loaded, saved):
        assert torch.equal(a, b)
    # a model without Gemini chunks keeps the optimizer's own masters
    assert _master_params(torch.nn.Linear(2, 2), optimizer) == []
