"""The documented optional config blocks from the command line (lora, init_from, validation, dataset keys, role
keys), linked keys (--teacher-ckpt), run directories wherever a checkpoint is read, and quiet, umask-honouring runs:
through the real train.py and convert_checkpoint.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_lora import _convert  # tools/convert_checkpoint.py's main, in this process

from opensora.config import ConfigKeyError, load_config

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs/diffusion/train/demo.py"
DISTILL = ROOT / "configs/distill"
NOISE = ("kernels-community", "tensornvme", "apex", "broadcast_buffers", "split to checkpoint shards")


# ---- the schema: keys come from the blocks' owners --------------------------------------------------------------
def test_optional_blocks_take_their_owners_keys_and_types():
    from opensora.lora import LORA_DEFAULTS
    from opensora.role_config import INIT_FROM_DEFAULTS, role_configs
    from opensora.training.defaults import VALIDATION_DEFAULTS
    from opensora.training.validation import validation_settings

    cfg = load_config(
        DEMO,
        [
            "--lora.rank", "16", "--lora.alpha", "8", "--lora.target-modules", "qkv,proj",
            "--init-from", "base.safetensors", "--init-from.ema", "false",
            "--dataset.target-fps", "8", "--validation.every", "5", "--validation.seeds", "[3, 4]",
            "--validation.prompts", "['a red circle', 'a blue square']", "--lr-decay.type", "linear",
        ],
    )  # fmt: skip
    assert set(cfg.lora) <= set(LORA_DEFAULTS) and set(cfg.init_from) <= set(INIT_FROM_DEFAULTS)
    assert cfg.init_from == {"path": "base.safetensors", "ema": False}  # a path given first, then a key inside
    assert cfg.dataset.target_fps == 8 and cfg.lr_decay == {"type": "linear"}
    role = role_configs(cfg)["model"]  # the owners accept what the command line built
    assert role["lora"]["rank"] == 16 and role["lora"]["target_modules"] == ["qkv", "proj"]
    assert role["lora"]["alpha"] == 8.0 and role["lr_decay"]["type"] == "linear"
    settings = validation_settings(cfg)
    assert settings["seeds"] == [3, 4] and settings["every"] == 5
    assert set(VALIDATION_DEFAULTS) >= {"seeds", "every"}


def test_role_keys_and_blocks_of_declared_roles_are_settable():
    cfg = load_config(
        DISTILL / "dmd2_demo.py",
        [
            "--models.student.lora.rank",
            "4",
            "--models.critic.lr-decay.type",
            "cosine",
            "--models.teacher.precision",
            "bf16",
        ],
    )
    assert cfg.models.student.lora == {"rank": 4} and cfg.models.critic.lr_decay == {"type": "cosine"}
    assert cfg.models.teacher.precision == "bf16"


@pytest.mark.parametrize(
    "config, argv, suggestion",
    [
        (DEMO, ["--lora.rnak", "4"], "'lora.rank'"),
        (DEMO, ["--dataset.target-fsp", "8"], "'dataset.target_fps'"),
        (DEMO, ["--validation.evry", "3"], "'validation.every'"),
        (DEMO, ["--init-from.pth", "x"], "'init_from.path'"),
        # a config with roles has no top-level lora: the error points at the roles' blocks
        (DISTILL / "dmd2_demo.py", ["--lora.rank", "4"], "'models.student.lora.rank'"),
        (DISTILL / "dmd2_demo.py", ["--models.stduent.lora.rank", "4"], "'models.student.lora.rank'"),
    ],
)
def test_unknown_keys_are_still_refused_with_the_nearest_valid_name(config, argv, suggestion):
    with pytest.raises(ConfigKeyError, match="unknown config key") as error:
        load_config(config, argv)
    assert suggestion in str(error.value)


def test_teacher_flag_reaches_every_role_that_starts_from_the_teacher():
    everyone = ("student", "teacher", "critic")
    for name, roles in (("ode_init_demo", everyone[:2]), ("dmd2_demo", everyone), ("dmd2_gpu", everyone)):
        cfg = load_config(DISTILL / f"{name}.py", ["--teacher-ckpt", "runs/teacher"])
        assert {r: cfg.models[r].init_from.path for r in roles} == dict.fromkeys(roles, "runs/teacher"), name
    # the streaming student starts from the ODE init, the teacher and critic from the teacher
    for name in ("self_forcing_demo", "self_forcing_gpu"):
        cfg = load_config(DISTILL / f"{name}.py", ["--teacher-ckpt", "T", "--ode-ckpt", "O"])
        assert (cfg.models.student.init_from.path, cfg.models.teacher.init_from.path) == ("O", "T"), name
        assert cfg.models.critic.init_from.path == "T" and cfg.models.student.init_from.role == "student", name
    # a key set on the command line itself wins over the link
    cfg = load_config(DISTILL / "dmd2_demo.py", ["--teacher-ckpt", "T", "--models.critic.init-from.path", "C"])
    assert (cfg.models.critic.init_from.path, cfg.models.student.init_from.path) == ("C", "T")


def test_distill_demos_fit_the_make_demo_teacher():
    teacher = load_config(ROOT / "configs/diffusion/train/demo_fast.py")
    for name in ("ode_init", "causal_ode", "dmd2", "causvid", "self_forcing"):
        cfg = load_config(DISTILL / f"{name}_demo.py")
        for role in cfg.models.values():
            model = {k: v for k, v in role.model.items() if k != "causal_chunk_frames"}
            assert model == teacher.model, name
        assert cfg.bucket_config == teacher.bucket_config and cfg.vae == teacher.vae, name
        assert cfg.method.adapter.shift == teacher.method.shift, name  # the teacher's own timestep shift


# ---- through the real CLIs ----------------------------------------------------------------------------------------
def _train(*args, umask=0o027):
    cmd = [sys.executable, str(ROOT / "scripts/diffusion/train.py"), *map(str, args)]
    return subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, preexec_fn=lambda: os.umask(umask)
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from opensora.datasets.moving_shapes import write_dataset

    root = tmp_path_factory.mktemp("optional_blocks")
    csv = write_dataset(root / "data", num=4, seed=0, height=32, width=32, num_frames=4, fps=16, progress=False)
    common = ["--dataset.data_path", csv, "--bucket-config", "{'32x32': {2: (1.0, 2)}}", "--num-workers", "0"]
    common += ["--tensorboard", "false"]
    base = _train(DEMO, "--outputs", root / "base", "--max-steps", 2, "--ckpt-every", 1, *common)
    assert base.returncode == 0, base.stderr[-3000:]
    # LoRA switched on from the command line, on top of the base run's newest checkpoint; target_fps 8 on 16 fps
    # clips takes every 2nd frame
    lora = _train(
        DEMO, "--outputs", root / "lora", "--max-steps", 1, *common, "--init-from", root / "base",
        "--lora.rank", 2, "--lora.target-modules", "qkv,proj", "--dataset.target-fps", 8,
    )  # fmt: skip
    assert lora.returncode == 0, lora.stderr[-3000:]
    return dict(root=root, base=base, lora=lora)


def test_lora_run_from_the_command_line(runs):
    root = runs["root"]
    role = root / "lora/checkpoints/step-0000001/model"
    record = json.loads((role / "lora.json").read_text())
    assert record["rank"] == 2 and record["target_modules"] == ["qkv", "proj"]
    # init_from named the base run: the record pins the checkpoint it stood for, and the log says which
    assert record["init_from"]["path"] == str((root / "base/checkpoints/step-0000002").resolve())
    assert "step-0000002" in runs["lora"].stderr
    adapter = load_file(str(role / "adapter.safetensors"))
    assert adapter and all(".lora_" in k and (".qkv." in k or ".proj." in k) for k in adapter)
    saved = load_config(root / "lora/config.py")
    assert saved.dataset.target_fps == 8 and saved.lora.rank == 2


def test_runs_are_quiet_and_honour_the_umask(runs):
    for name in ("base", "lora"):
        for noise in NOISE:
            assert noise not in runs[name].stderr, (name, noise)
    config = runs["root"] / "base/config.py"
    assert config.stat().st_mode & 0o777 == 0o640  # umask 027, as the process set it (mkstemp alone gives 0600)


def test_converter_takes_a_run_directory(runs, tmp_path, capsys):
    root = runs["root"]
    (root / "base/checkpoints/step-0000003").mkdir()  # newer, but never completed: not a checkpoint
    assert _convert(root / "base", tmp_path / "run.safetensors") == 0
    said = capsys.readouterr().err
    assert "newest complete checkpoint" in said and "step-0000002" in said
    assert _convert(root / "base/checkpoints/step-0000002", tmp_path / "ckpt.safetensors") == 0
    a, b = load_file(str(tmp_path / "run.safetensors")), load_file(str(tmp_path / "ckpt.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    empty = tmp_path / "empty_run"
    (empty / "checkpoints/.tmp-step-0000001").mkdir(parents=True)
    capsys.readouterr()
    assert _convert(empty, tmp_path / "x.safetensors") == 2
    said = capsys.readouterr().err
    assert "no complete checkpoint" in said and len(said.strip().splitlines()) == 1
