"""LoRA finetuning and LoRA distillation (issue 17, item 1) on CPU, through the real trainer and plugins.

A tiny MMDiT (the demo preset) is trained with ``lora = dict(...)`` on top of saved base weights: checkpoints hold
only the adapter (+ its optimizer / EMA state), resume is bit-identical on one and on two gloo ranks, the converter
merges the adapter into the base (the merged export samples like the unmerged LoRA network) or exports it alone,
and a DMD2 run trains a LoRA student next to a full critic.
"""

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = ROOT / "configs" / "diffusion" / "train" / "demo.py"
DMD2_CONFIG = ROOT / "configs" / "distill" / "dmd2_demo.py"
TARGETS = ["qkv", "proj", "linear1", "linear2"]
TIMING_KEYS = {"step_time", "samples_per_s", "tokens_per_s", "mfu", "data_time"}


def _metrics(run: Path):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS and not k.startswith("time/")} for row in rows]


def _base_model(seed=0):
    from opensora.config import load_config
    from opensora.registry import MODELS, build_module

    torch.manual_seed(seed)
    model = build_module(load_config(str(DEMO_CONFIG), []).model, MODELS)
    with torch.no_grad():  # a fresh MMDiT predicts v = 0 (zero-initialised output layers): make it say something
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """8 real 4-frame 32x32 clips, base weights in one safetensors file, and a LoRA config on the demo config."""
    from opensora.datasets.moving_shapes import write_dataset

    root = tmp_path_factory.mktemp("lora")
    csv = write_dataset(root / "data", num=8, seed=0, height=32, width=32, num_frames=4, progress=False)
    base = root / "base.safetensors"
    save_file({k: v.contiguous() for k, v in _base_model().state_dict().items()}, str(base))
    common = f"""_base_ = [{str(DEMO_CONFIG)!r}]
dataset = dict(data_path={str(csv)!r})
bucket_config = {{"_delete_": True, "32x32": {{4: (1.0, 2)}}}}
num_workers = 0
tensorboard = False
warmup_steps = 2
keep_last = 5
init_from = {str(base)!r}
lora = dict(rank=4, alpha=8, target_modules={TARGETS!r})
"""
    config = root / "lora.py"
    config.write_text(common)
    config_bf16 = root / "lora_bf16.py"
    config_bf16.write_text(common + 'precision = "bf16"\n')
    return dict(root=root, csv=Path(csv), base=base, config=config, config_bf16=config_bf16)


def _train_full_and_split(rank, world_size, config, root, steps=4):
    """``steps`` straight; half, then resumed to ``steps`` (each a fresh Trainer through the CLI entry point)."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from opensora.training.launch import main

    half = str(steps // 2)
    main([config, "--outputs", f"{root}/full", "--max-steps", str(steps), "--ckpt-every", half])
    main([config, "--outputs", f"{root}/split", "--max-steps", half, "--ckpt-every", half])
    main([config, "--outputs", f"{root}/split", "--max-steps", str(steps), "--ckpt-every", half, "--resume", "auto"])
    return rank


@pytest.fixture(scope="module")
def one_rank(setup):
    root = setup["root"] / "one"
    _train_full_and_split(0, 1, str(setup["config"]), str(root))
    return root


# ---- config errors: one line, naming what to fix ------------------------------------------------------------------
def test_bad_lora_settings_are_one_line_errors():
    from opensora.cli_errors import UserInputError
    from opensora.config import ConfigKeyError
    from opensora.lora import add_lora, lora_settings
    from opensora.role_config import role_configs

    with pytest.raises(UserInputError, match="rank' must be a positive integer, got 0"):
        role_configs(dict(model=dict(type="MMDiT"), init_from="x", lora=dict(rank=0, target_modules=["qkv"])))
    with pytest.raises(UserInputError, match=r"unknown key\(s\) \['rnak'\]"):
        lora_settings(dict(rnak=4, target_modules=["qkv"]))
    with pytest.raises(ConfigKeyError, match="needs 'models.model.init_from'"):
        role_configs(dict(model=dict(type="MMDiT"), lora=dict(rank=4, target_modules=["qkv"])))
    with pytest.raises(ConfigKeyError, match="frozen role"):
        role_configs(
            dict(
                models=dict(
                    teacher=dict(
                        model=dict(type="MMDiT"),
                        trainable=False,
                        init_from="x",
                        lora=dict(rank=4, target_modules=["qkv"]),
                    )
                )
            )
        )
    with pytest.raises(ConfigKeyError, match=r"top-level \['lora'\] would be ignored"):
        role_configs(dict(models=dict(student=dict(model=dict(type="MMDiT"))), lora=dict(rank=4)))
    resolved = role_configs(dict(model=dict(type="MMDiT"), init_from="x", lora=dict(rank=4, target_modules="qkv")))
    assert resolved["model"]["lora"] == dict(rank=4, alpha=4.0, target_modules=["qkv"], dropout=0.0)
    model = _base_model()
    with pytest.raises(UserInputError, match=r"\['qvk'\] match no Linear layer.*Linear names that exist: .*'qkv'"):
        add_lora(model, lora_settings(dict(rank=4, target_modules=["qkv", "qvk"])))
    with pytest.raises(UserInputError, match="also match non-Linear modules"):
        add_lora(model, lora_settings(dict(rank=4, target_modules=["0"])))  # img_mlp.0 and double_blocks.0


def test_only_the_adapter_trains_and_merging_is_the_closed_form():
    """peft's forward equals the base network with W + (alpha / rank) B A in every adapted layer."""
    from opensora.lora import adapter_state_dict, add_lora, lora_settings, merge_adapter

    model = _base_model()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    settings = lora_settings(dict(rank=4, alpha=8, target_modules=TARGETS))
    add_lora(model, settings)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.copy_(0.1 * torch.randn_like(param))
    merged_model = _base_model()
    merged = merge_adapter(base, adapter_state_dict(model), settings)
    changed = [k for k in base if not torch.equal(base[k], merged[k])]
    assert len(changed) == 4 * 2 + 2 * 2  # qkv + proj per double-block stream, linear1 + linear2 per single block
    merged_model.load_state_dict(merged)
    torch.manual_seed(1)
    inputs = dict(timestep=torch.tensor([0.5]), text_emb=torch.randn(1, 7, 64), pooled=torch.randn(1, 64))
    x = torch.randn(1, 48, 2, 8, 8)
    with torch.no_grad():
        want, got = merged_model(x, **inputs), model(x, **inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- one rank: what a checkpoint holds, exact resume, the base untouched ---------------------------------------
def test_checkpoint_holds_only_the_adapter_and_resume_is_exact_on_one_rank(one_rank, setup):
    from opensora.lora import base_fingerprint

    full, split = _metrics(one_rank / "full"), _metrics(one_rank / "split")
    assert [row["step"] for row in full] == [1, 2, 3, 4]
    assert full == split, "resumed losses / grad norms differ from the uninterrupted run"
    assert all(math.isfinite(row["loss"]) for row in full)

    role = one_rank / "full" / "checkpoints" / "step-0000004" / "model"
    assert not (role / "model").exists(), "a LoRA role must not save the (frozen) base weights"
    adapter = load_file(str(role / "adapter.safetensors"))
    ema = load_file(str(role / "ema.safetensors"))
    assert adapter.keys() == ema.keys() and all(".lora_" in k for k in adapter)
    record = json.loads((role / "lora.json").read_text())
    assert record["rank"] == 4 and record["alpha"] == 8.0 and record["target_modules"] == TARGETS
    assert record["init_from"]["path"] == str(setup["base"].resolve())
    assert record["base_sha256"] == base_fingerprint(load_file(str(setup["base"])))
    # the optimizer state is the adapter's: far smaller than the base weights
    optimizer_bytes = sum(f.stat().st_size for f in (role / "optimizer").rglob("*") if f.is_file())
    assert optimizer_bytes < setup["base"].stat().st_size / 3
    split_adapter = load_file(str(one_rank / "split/checkpoints/step-0000004/model/adapter.safetensors"))
    assert all(torch.equal(adapter[k], split_adapter[k]) for k in adapter)
    assert any(k.split(".lora_")[1].startswith("B") and adapter[k].abs().sum() > 0 for k in adapter), (
        "lora_B never moved from zero"
    )


def test_resume_on_a_different_base_is_refused(one_rank, setup, tmp_path):
    from opensora.cli_errors import UserInputError
    from opensora.training.launch import main

    other = tmp_path / "other.safetensors"
    save_file({k: v.contiguous() for k, v in _base_model(seed=1).state_dict().items()}, str(other))
    with pytest.raises(UserInputError, match="not the ones this adapter was trained on"):
        main(
            [
                str(setup["config"]),
                "--outputs",
                str(tmp_path / "run"),
                "--max-steps",
                "4",
                "--init_from",
                str(other),
                "--load",
                str(one_rank / "full" / "checkpoints" / "step-0000002"),
            ]
        )


# ---- two ranks, bf16 (fp32 masters restored): exact resume ----------------------------------------------------
def test_resume_is_bit_identical_on_two_ranks_in_bf16(setup):
    root = setup["root"] / "two"
    run_distributed(_train_full_and_split, world_size=2, args=(str(setup["config_bf16"]), str(root)), timeout=600)
    full, split = _metrics(root / "full"), _metrics(root / "split")
    assert [row["step"] for row in full] == [1, 2, 3, 4]
    assert full == split
    role = root / "full" / "checkpoints" / "step-0000004" / "model"
    assert (role / "master" / "rank1.pt").is_file() and not (role / "model").exists()


# ---- export: merge / adapter alone, through the converter CLI and the sampler ---------------------------------
def _convert(*argv):
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "tools" / "convert_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main([str(a) for a in argv])


def test_merged_export_samples_like_the_unmerged_lora_network(one_rank, setup, tmp_path, capsys):
    from opensora.config import load_config
    from opensora.convert.weights import load_role_weights
    from opensora.inference.sampler import VideoSampler
    from opensora.lora import add_lora, load_adapter_state_dict

    ckpt = one_rank / "full" / "checkpoints" / "step-0000004"
    merged, adapter_only = tmp_path / "merged.safetensors", tmp_path / "adapter.safetensors"
    assert _convert(ckpt, tmp_path / "x.safetensors") == 2
    assert "is a LoRA adapter: pass --merge-lora" in capsys.readouterr().err
    assert _convert(ckpt, merged, "--merge-lora") == 0
    assert _convert(ckpt, adapter_only, "--lora-only") == 0
    assert adapter_only.stat().st_size < merged.stat().st_size / 5
    other = tmp_path / "other.safetensors"
    save_file({k: v.contiguous() for k, v in _base_model(seed=1).state_dict().items()}, str(other))
    assert _convert(ckpt, tmp_path / "y.safetensors", "--merge-lora", "--base", other) == 2
    assert "not the ones this adapter was trained on" in capsys.readouterr().err
    assert _convert(setup["base"], tmp_path / "z.safetensors", "--lora-only") == 2

    # the adapter file merges on load to the same weights as the merged export; the base file is untouched
    a, b = load_role_weights(merged).state_dict, load_role_weights(adapter_only).state_dict
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    base = load_file(str(setup["base"]))
    assert a.keys() == base.keys() and any(not torch.equal(a[k], base[k]) for k in a)

    cfg = load_config(str(ckpt / "config.py"))
    kwargs = dict(num_frames=4, height=32, width=32, num_steps=4, guidance_scale=3.0)
    merged_sampler = VideoSampler.from_config(cfg, merged, device="cpu", dtype="fp32", progress=False)
    lora_sampler = VideoSampler.from_config(cfg, setup["base"], device="cpu", dtype="fp32", progress=False)
    record = json.loads((ckpt / "model" / "lora.json").read_text())
    add_lora(lora_sampler.model, record)
    load_adapter_state_dict(lora_sampler.model, load_file(str(ckpt / "model" / "ema.safetensors")))
    lora_sampler.model.eval()
    videos = [s.generate(["a red circle moving left"], [3], **kwargs) for s in (merged_sampler, lora_sampler)]
    torch.testing.assert_close(videos[0], videos[1], rtol=0, atol=1e-4)
    # and the sampler takes the checkpoint itself (merging on load)
    direct = VideoSampler.from_config(cfg, ckpt, device="cpu", dtype="fp32", progress=False)
    assert torch.equal(direct.generate(["a red circle moving left"], [3], **kwargs), videos[0])


# ---- DMD2: a LoRA student next to a full critic, through the trainer CLI ----------------------------------------
@pytest.mark.parametrize("critic_lora", [False, True], ids=["full-critic", "lora-critic"])
def test_dmd2_trains_a_lora_student(setup, tmp_path, critic_lora):
    from opensora.training.launch import main

    weights = f"dict(path={str(setup['base'])!r})"
    critic_extra = f", lora=dict(rank=2, target_modules={TARGETS!r})" if critic_lora else ""
    config = tmp_path / "dmd2_lora.py"
    config.write_text(f"""_base_ = [{str(DMD2_CONFIG)!r}]
dataset = dict(_delete_=True, type="VideoTextDataset", data_path={str(setup["csv"])!r}, frame_interval=1)
bucket_config = dict(_delete_=True, **{{"32x32": {{4: (1.0, 2)}}}})
num_workers = 0
tensorboard = False
vae = dict(patch_size=4)  # the demo.py base weights: 48-channel latents (dmd2_demo.py fits make demo's 27)
_net = dict(in_channels=48, cond_channels=49)
models = dict(student=dict(model=_net, init_from={weights}, lora=dict(rank=4, target_modules={TARGETS!r})),
              teacher=dict(model=_net, init_from={weights}), critic=dict(model=_net, init_from={weights}{critic_extra}))
method = dict(student_update_every=2, step_list=[1.0, 0.5])
""")
    torch.set_num_threads(2)
    main([str(config), "--outputs", str(tmp_path / "run"), "--max-steps", "4", "--ckpt-every", "4"])
    rows = _metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(row["loss"]) for row in rows)
    ckpt = tmp_path / "run" / "checkpoints" / "step-0000004"
    assert (ckpt / "student" / "lora.json").is_file() and not (ckpt / "student" / "model").exists()
    assert (ckpt / "critic" / "lora.json").is_file() == critic_lora
    assert (ckpt / "critic" / "model").is_dir() == (not critic_lora) and not (ckpt / "teacher").exists()
    adapter = load_file(str(ckpt / "student" / "adapter.safetensors"))
    assert any(k.split(".lora_")[1].startswith("B") and adapter[k].abs().sum() > 0 for k in adapter)
