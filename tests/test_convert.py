"""Checkpoint export/inspect CLI on a real 2-step demo checkpoint, Open-Sora 2.0 layout round trips, and numerical
parity with diffusers' FluxTransformer2DModel in both directions (one frame, all text tokens valid)."""

import importlib.util
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from opensora.convert import diffusers_flux, opensora2
from opensora.convert.arch import arch_from_json, arch_to_json
from opensora.convert.export import export_weights, import_weights, inspect_weights
from opensora.convert.weights import load_role_weights
from opensora.models.mmdit import MMDiT, patchify, unpatchify
from opensora.models.mmdit.rope import video_position_ids

REPO = Path(__file__).resolve().parents[1]
TINY = dict(
    in_channels=16,
    hidden_size=64,
    num_heads=2,
    depth_double=2,
    depth_single=2,
    text_dim=32,
    pooled_dim=24,
    axes_dims=(8, 12, 12),
)


def _cli():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", REPO / "tools" / "convert_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A real checkpoint: the demo config trained for 2 steps (EMA + sharded model weights, config, step)."""
    root = tmp_path_factory.mktemp("demo")

    def run(*args):
        done = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, f"{args[0]} exited with {done.returncode}:\n{done.stderr[-4000:]}"

    run("tools/make_demo_dataset.py", "--out", str(root / "data"), "--num", "8", "--seed", "0")
    run(
        "scripts/diffusion/train.py",
        "configs/diffusion/train/demo.py",
        "--outputs",
        str(root / "train"),
        "--max-steps",
        "2",
        "--dataset.data_path",
        str(root / "data" / "meta.csv"),
        "--num-workers",
        "0",
        "--tensorboard",
        "False",
    )
    path = root / "train" / "checkpoints" / "step-0000002"
    assert (path / "COMPLETE").is_file()
    return path


def _metadata(path):
    with safe_open(str(path), framework="pt") as handle:
        return handle.metadata()


def _randomise(module, seed=0):
    """Random values everywhere (zero-initialised adaLN/final layers included), norms scattered around 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.2
            is_norm = name.endswith(
                ("_scale", "norm_q.weight", "norm_k.weight", "norm_added_q.weight", "norm_added_k.weight")
            )
            param.copy_(noise + (1.0 if is_norm else 0.0))
    return module


@pytest.mark.parametrize("ema", [True, False])
def test_export_matches_source_with_metadata(checkpoint, tmp_path, ema):
    dst = tmp_path / "out.safetensors"
    assert _cli()([str(checkpoint), str(dst), "--dtype", "bf16", "--ema" if ema else "--no-ema"]) == 0
    source = load_role_weights(checkpoint, ema=ema).state_dict
    exported = load_file(str(dst))
    assert set(exported) == set(source) and len(exported) > 50
    for key, value in source.items():
        assert exported[key].dtype == torch.bfloat16
        assert torch.equal(exported[key], value.to(torch.bfloat16)), key
    meta = _metadata(dst)
    assert meta["step"] == "2" and meta["source"] == ("ema" if ema else "model")
    assert meta["role"] == "model" and meta["dtype"] == "bf16" and meta["layout"] == "opensora"
    assert meta["config"] == (checkpoint / "config.py").read_text()
    # The recorded architecture (JSON, no code) rebuilds the model, which loads the file strictly.
    model = MMDiT(**arch_from_json(meta["arch"], str(dst)))
    model.load_state_dict(load_role_weights(dst).state_dict, strict=True)
    if ema:  # the EMA and raw weights are different tensors after 2 updates with decay 0.99
        raw = load_role_weights(checkpoint, ema=False).state_dict
        assert any(not torch.equal(raw[k], source[k]) for k in source)


def test_export_keeps_dtype_and_rejects_bad_role(checkpoint, tmp_path):
    result = export_weights(checkpoint, tmp_path / "fp32.safetensors")
    assert result.metadata["dtype"] == "fp32"
    with pytest.raises(FileNotFoundError, match="no role 'student'"):
        export_weights(checkpoint, tmp_path / "x.safetensors", role="student")
    assert _cli()([str(checkpoint), str(tmp_path / "y.safetensors"), "--role", "student"]) == 2


def test_inspect_prints_params_dtypes_step(checkpoint, tmp_path, capsys):
    expected = sum(t.numel() for t in load_role_weights(checkpoint).state_dict.values())
    assert _cli()(["inspect", str(checkpoint)]) == 0
    text = capsys.readouterr().out
    assert f"{expected:,}" in text and "fp32" in text and "step:       2" in text and "roles:      model" in text
    dst = tmp_path / "bf16.safetensors"
    export_weights(checkpoint, dst, dtype="bf16", ema=False)
    assert _cli()([str(dst), "--inspect"]) == 0
    text = capsys.readouterr().out
    assert "bf16" in text and "source: model" in text and "step:       2" in text
    summary = inspect_weights(dst)
    assert summary["num_params"] == expected and summary["dtypes"] == {"bf16": expected}


@pytest.mark.parametrize("fused_qkv", [False, True])
def test_opensora2_round_trip_is_lossless(checkpoint, tmp_path, fused_qkv):
    theirs = tmp_path / "os2.safetensors"
    back = tmp_path / "back.safetensors"
    args = [str(checkpoint), str(theirs), "--to", "opensora2"] + (["--opensora2-fused-qkv"] if fused_qkv else [])
    assert _cli()(args) == 0
    foreign = load_file(str(theirs))
    hidden = 128
    if fused_qkv:
        assert foreign["double_blocks.0.img_attn.qkv.weight"].shape == (3 * hidden, hidden)
        assert foreign["single_blocks.1.linear1.weight"].shape == (3 * hidden + 4 * hidden, hidden)
    else:  # the released Open-Sora v2 form
        assert foreign["double_blocks.0.txt_attn.k_proj.weight"].shape == (hidden, hidden)
        assert foreign["single_blocks.1.v_mlp.weight"].shape == (hidden + 4 * hidden, hidden)
    assert "double_blocks.1.img_attn.norm.query_norm.scale" in foreign
    assert "single_blocks.0.norm.key_norm.scale" in foreign and "final_layer.adaLN_modulation.1.weight" in foreign
    assert not any(k.endswith("query_scale") for k in foreign)

    assert _cli()([str(theirs), str(back), "--from", "opensora"]) == 0
    source = load_role_weights(checkpoint).state_dict
    restored = load_file(str(back))
    assert set(restored) == set(source)
    assert all(torch.equal(restored[k], source[k]) for k in source)
    meta = _metadata(back)
    assert (
        meta["step"] == "2"
        and meta["source"] == "opensora2"
        and meta["config"] == (checkpoint / "config.py").read_text()
    )


def test_opensora2_import_infers_architecture(tmp_path):
    model = _randomise(MMDiT(**TINY, cond_channels=17, guidance_embed=True))
    theirs = tmp_path / "os2.safetensors"
    save_file(opensora2.to_opensora2(model.state_dict()), str(theirs))  # no metadata, like a foreign file
    result = import_weights(theirs, tmp_path / "ours.safetensors", "opensora", axes_dims=TINY["axes_dims"])
    arch = arch_from_json(result.metadata["arch"], str(result.path))
    for key in (
        "in_channels",
        "cond_channels",
        "hidden_size",
        "num_heads",
        "depth_double",
        "depth_single",
        "text_dim",
        "pooled_dim",
        "guidance_embed",
        "patch_size",
        "mlp_ratio",
    ):
        assert arch[key] == model.arch[key], key
    rebuilt = MMDiT(**arch)
    rebuilt.load_state_dict(load_file(str(result.path)), strict=True)


def test_layout_errors_name_the_keys():
    state = MMDiT(**TINY).state_dict()
    with pytest.raises(KeyError, match="bogus.weight"):
        opensora2.to_opensora2({**state, "bogus.weight": torch.zeros(1)})
    foreign = diffusers_flux.to_diffusers_flux(state)
    del foreign["transformer_blocks.1.attn.to_k.bias"]
    with pytest.raises(KeyError, match="transformer_blocks.1.attn.to_k.bias"):
        diffusers_flux.from_diffusers_flux(foreign)
    trained_cond = _randomise(MMDiT(**TINY, cond_channels=17)).state_dict()
    with pytest.raises(ValueError, match="cond_in"):
        diffusers_flux.to_diffusers_flux(trained_cond)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        untrained = diffusers_flux.to_diffusers_flux(MMDiT(**TINY, cond_channels=17).state_dict())
    assert not any(k.startswith("cond_in") for k in untrained)


# ---- numerical parity with diffusers' FluxTransformer2DModel --------------------------------------------------------


def _inputs(batch=2, text_len=5, grid=(1, 4, 5), seed=1):
    generator = torch.Generator().manual_seed(seed)
    _, h, w = grid
    x = torch.randn(batch, TINY["in_channels"], 1, 2 * h, 2 * w, generator=generator)
    text = torch.randn(batch, text_len, TINY["text_dim"], generator=generator)
    pooled = torch.randn(batch, TINY["pooled_dim"], generator=generator)
    t = torch.rand(batch, generator=generator)
    return x, t, text, pooled


@torch.no_grad()
def _ours(model, x, t, text, pooled, guidance):
    mask = torch.ones(text.shape[:2], dtype=torch.bool)
    return model(x, timestep=t, text_emb=text, text_mask=mask, pooled=pooled, guidance=guidance)


@torch.no_grad()
def _diffusers(flux, x, t, text, pooled, guidance):
    """The Flux pipeline's view: our patchify as the 2x2 packing, ids (0, h, w), text ids 0, t in [0, 1]."""
    grid = (1, x.shape[3] // 2, x.shape[4] // 2)
    out = flux(
        hidden_states=patchify(x, (1, 2, 2)),
        encoder_hidden_states=text,
        pooled_projections=pooled,
        timestep=t,
        img_ids=video_position_ids(*grid).float(),
        txt_ids=torch.zeros(text.shape[1], 3),
        guidance=guidance,
    ).sample
    return unpatchify(out, grid, (1, 2, 2))


@pytest.mark.parametrize("guidance_embed", [False, True])
def test_diffusers_flux_to_ours_matches(tmp_path, guidance_embed):
    from diffusers import FluxTransformer2DModel

    ours_kwargs = dict(TINY, guidance_embed=guidance_embed)
    with torch.device("meta"):
        config = diffusers_flux.diffusers_flux_config(MMDiT(**ours_kwargs).arch)
    flux = _randomise(FluxTransformer2DModel(**config).eval(), seed=3)
    flux.save_pretrained(tmp_path / "flux")

    result = import_weights(tmp_path / "flux", tmp_path / "ours.safetensors", "diffusers")
    arch = arch_from_json(result.metadata["arch"], str(result.path))
    assert json.loads((tmp_path / "flux" / "config.json").read_text())["num_layers"] == arch["depth_double"]
    model = MMDiT(**arch).eval()
    model.load_state_dict(load_file(str(result.path)), strict=True)

    x, t, text, pooled = _inputs()
    guidance = torch.full((x.shape[0],), 2.0) if guidance_embed else None  # x1000 exact in bf16
    expected = _diffusers(flux, x, t, text, pooled, guidance)
    actual = _ours(model, x, t, text, pooled, guidance)
    assert expected.abs().max() > 1.0  # a real signal, not two zero outputs
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)

    # bf16: both run in bf16 from the same converted weights and agree to bf16 precision. diffusers multiplies the
    # timestep by 1000 in bf16 (steps of 4 near 700), so use timesteps whose x1000 is exact in bf16.
    t = torch.tensor([0.5, 0.25])
    guidance16 = guidance.bfloat16() if guidance is not None else None
    reference = _ours(model, x, t, text, pooled, guidance)
    expected16 = _diffusers(
        flux.to(torch.bfloat16), x.bfloat16(), t.bfloat16(), text.bfloat16(), pooled.bfloat16(), guidance16
    )
    actual16 = _ours(
        model.to(torch.bfloat16), x.bfloat16(), t.bfloat16(), text.bfloat16(), pooled.bfloat16(), guidance16
    )
    scale = reference.abs().max()
    assert (actual16.float() - reference).abs().max() < 0.05 * scale
    assert (actual16.float() - expected16.float()).abs().max() < 0.05 * scale


def test_ours_to_diffusers_flux_loads_strictly_and_matches(tmp_path):
    from diffusers import FluxTransformer2DModel

    kwargs = dict(type="MMDiT", **TINY, guidance_embed=True)
    model = _randomise(MMDiT(**{k: v for k, v in kwargs.items() if k != "type"}).eval(), seed=5)
    ours_file = tmp_path / "ours.safetensors"
    save_file(model.state_dict(), str(ours_file), metadata={"arch": arch_to_json(model.arch), "step": "7"})

    # State-dict path: strict load into a model built from the derived config.
    flux = FluxTransformer2DModel(**diffusers_flux.diffusers_flux_config(model.arch)).eval()
    flux.load_state_dict(diffusers_flux.to_diffusers_flux(model.state_dict()), strict=True)
    x, t, text, pooled = _inputs(seed=2)
    guidance = torch.full((x.shape[0],), 2.0)
    expected = _ours(model, x, t, text, pooled, guidance)
    torch.testing.assert_close(_diffusers(flux, x, t, text, pooled, guidance), expected, rtol=1e-4, atol=1e-4)

    # CLI path: a from_pretrained-able directory.
    assert _cli()([str(ours_file), str(tmp_path / "flux"), "--to", "diffusers"]) == 0
    loaded = FluxTransformer2DModel.from_pretrained(tmp_path / "flux").eval()
    torch.testing.assert_close(_diffusers(loaded, x, t, text, pooled, guidance), expected, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_zero_weight_condition_input_is_folded_for_diffusers(tmp_path):
    """A text-to-video model's ``cond_in``: weight never trained (zero), bias trained and added on every call. The
    diffusers export folds the bias into ``x_embedder``'s: the Flux model computes what ours computes with a
    condition given (any: the weight ignores it). A nonzero weight is refused in one line and writes nothing."""
    from diffusers import FluxTransformer2DModel

    model = _randomise(MMDiT(**TINY, cond_channels=17, guidance_embed=True).eval(), seed=7)
    model.cond_in.weight.zero_()
    assert model.cond_in.bias.abs().min() > 0
    source = tmp_path / "t2v.safetensors"
    save_file(model.state_dict(), str(source), metadata={"arch": arch_to_json(model.arch)})
    with pytest.warns(UserWarning, match="folded cond_in's bias"):
        assert _cli()([str(source), str(tmp_path / "flux"), "--to", "diffusers"]) == 0
    flux = FluxTransformer2DModel.from_pretrained(tmp_path / "flux").eval()

    x, t, text, pooled = _inputs(seed=3)
    guidance = torch.full((x.shape[0],), 3.0)
    cond = torch.randn(x.shape[0], 17, *x.shape[2:], generator=torch.Generator().manual_seed(4))
    mask = torch.ones(text.shape[:2], dtype=torch.bool)
    ours = model(x, timestep=t, text_emb=text, text_mask=mask, pooled=pooled, guidance=guidance, cond=cond)
    torch.testing.assert_close(_diffusers(flux, x, t, text, pooled, guidance), ours, rtol=1e-5, atol=1e-5)
    dropped = _ours(model, x, t, text, pooled, guidance)  # without the bias: what the export must not compute
    assert (dropped - ours).abs().max() > 100 * 1e-5

    model.cond_in.weight[0, 0] = 1e-3  # one trained entry: Flux has nothing to hold it
    trained = tmp_path / "i2v.safetensors"
    save_file(model.state_dict(), str(trained), metadata={"arch": arch_to_json(model.arch)})
    result = subprocess.run(
        [sys.executable, "tools/convert_checkpoint.py", str(trained), str(tmp_path / "refused"), "--to", "diffusers"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "cond_in's weight is not zero" in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "refused").exists()
