"""opensora.config: _base_ inheritance, typed CLI overrides at any depth, key checking, saving."""

import textwrap

import pytest
from mmengine.config import Config

from opensora.config import (
    BARE_FLAG,
    ConfigKeyError,
    ConfigValueError,
    apply_overrides,
    dotted_keys,
    load_config,
    load_config_from_cli,
    parse_overrides,
    save_config,
    split_cli,
)

BASE = """
model = dict(
    type="MMDiT",
    hidden_size=256,
    depth=4,
    qk_norm=True,
    mlp_ratio=4.0,
    patch_size=(1, 2, 2),
    blocks=[dict(depth=1), dict(depth=2)],
    extra=dict(note="x"),
)
dataset = dict(type="VideoTextDataset", data_path="data/meta.csv", num_frames=[1, 17, 33])
bucket_config = {"256px": {1: (1.0, 16), 33: (0.5, 4)}}
lr = 1e-4
seed = 42
use_ema = True
grad_clip = 1.0
plugin = "zero2"
ckpt_path = None
outputs = "outputs"
optim = dict(betas=(0.9, 0.95), weight_decay=0.01)
_allow_new_keys_ = ["model.extra", "wandb"]
"""

CHILD = """
_base_ = ["base.py"]
model = dict(depth=8, mlp_ratio=2.0)
lr = 3e-4
"""


def _write(directory, name, text):
    path = directory / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def child_path(tmp_path):
    _write(tmp_path, "base.py", BASE)
    return _write(tmp_path, "child.py", CHILD)


@pytest.fixture
def cfg(child_path):
    return load_config(child_path)


# ---------------------------------------------------------------------------------------------- loading


def test_base_inheritance_merges_nested_dicts(cfg):
    assert cfg.model.depth == 8 and cfg.model.mlp_ratio == 2.0  # child wins
    assert cfg.model.hidden_size == 256 and cfg.model.type == "MMDiT"  # base keys kept
    assert cfg.lr == 3e-4 and cfg.seed == 42
    assert cfg.dataset.data_path == "data/meta.csv"
    assert "_base_" not in cfg


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_config(tmp_path / "nope.py")


# ---------------------------------------------------------------------------------------------- parsing


def test_parse_overrides_forms():
    argv = ["--a.b", "1", "--c=x=y", "--flag", "--d-e.f_g", "-2", "--h="]
    assert parse_overrides(argv) == [("a.b", "1"), ("c", "x=y"), ("flag", BARE_FLAG), ("d-e.f_g", "-2"), ("h", "")]


@pytest.mark.parametrize("argv", [["stray"], ["--a", "1", "stray"], ["--"], ["-x", "1"], ["--a..b", "1"]])
def test_parse_overrides_rejects_malformed(argv):
    with pytest.raises(ConfigValueError):
        parse_overrides(argv)


def test_split_cli_needs_config_first():
    assert split_cli(["c.py", "--a", "1"]) == ("c.py", [("a", "1")])
    with pytest.raises(ConfigValueError, match="config file must come first"):
        split_cli(["--a", "1", "c.py"])


# ---------------------------------------------------------------------------------------------- casting


@pytest.mark.parametrize(
    "key, raw, expected",
    [
        ("seed", "7", 7),
        ("seed", "-1", -1),
        ("seed", "1e3", 1000),
        ("lr", "0.5", 0.5),
        ("lr", "2", 2.0),
        ("use_ema", "false", False),
        ("use_ema", "No", False),
        ("use_ema", "1", True),
        ("plugin", "zero1", "zero1"),
        ("plugin", "123", "123"),  # a str key keeps digits as text
        ("ckpt_path", "ckpts/a", "ckpts/a"),  # None-valued: not a literal -> str
        ("ckpt_path", "3", 3),  # None-valued: literal
        ("ckpt_path", "true", True),
        ("seed", "None", None),
        ("dataset.num_frames", "1,5", [1, 5]),
        ("dataset.num_frames", "[9]", [9]),
        ("dataset.num_frames", "", []),
        ("optim.betas", "0.8,0.9", (0.8, 0.9)),  # tuple stays a tuple, elements floats
        ("optim.betas", "(1, 0.5)", (1.0, 0.5)),
        ("optim", "{'betas': (0.5, 0.6)}", {"betas": (0.5, 0.6)}),  # a dict literal replaces the dict
    ],
)
def test_values_are_cast_to_the_existing_type(cfg, key, raw, expected):
    new = apply_overrides(cfg, [f"--{key}", raw])
    value = new
    for part in key.split("."):
        value = value[part]
    value = value.to_dict() if hasattr(value, "to_dict") else value
    assert value == expected and type(value) is type(expected)


def test_nested_keys_are_cast_too(cfg):
    # Open-Sora 2.0 left nested override values as strings; here they take the existing type.
    new = apply_overrides(
        cfg, ["--model.depth", "3", "--model.mlp_ratio", "1.5", "--model.qk_norm=false", "--model.patch_size", "1,4,4"]
    )
    assert new.model.depth == 3 and type(new.model.depth) is int
    assert new.model.mlp_ratio == 1.5 and new.model.qk_norm is False
    assert new.model.patch_size == (1, 4, 4)


def test_equals_and_space_forms_agree(cfg):
    spaced = apply_overrides(cfg, ["--model.depth", "5", "--lr", "0.1"])
    joined = apply_overrides(cfg, ["--model.depth=5", "--lr=0.1"])
    assert spaced.to_dict() == joined.to_dict()


def test_dashes_and_underscores_are_equivalent(cfg):
    new = apply_overrides(cfg, ["--model.hidden-size", "64", "--grad-clip=0.5", "--bucket-config.256px.1", "(0.2, 8)"])
    assert new.model.hidden_size == 64 and new.grad_clip == 0.5
    assert "hidden-size" not in new.model and "grad-clip" not in new  # the config's own spelling is kept
    assert new.bucket_config["256px"][1] == (0.2, 8)  # int dict key found by its text; per-position casting


def test_bare_flag_and_negation(cfg):
    assert apply_overrides(cfg, ["--use-ema=false", "--use-ema"]).use_ema is True
    assert apply_overrides(cfg, ["--no-use-ema"]).use_ema is False
    assert apply_overrides(cfg, ["--model.no-qk-norm"]).model.qk_norm is False
    with pytest.raises(ConfigValueError, match="needs a value"):
        apply_overrides(cfg, ["--seed"])


def test_list_index_paths(cfg):
    new = apply_overrides(cfg, ["--model.blocks.1.depth", "9", "--model.patch_size.0", "2"])
    assert new.model.blocks[1].depth == 9 and new.model.blocks[0].depth == 1
    assert new.model.patch_size == (2, 2, 2)
    with pytest.raises(ConfigKeyError, match="out of range"):
        apply_overrides(cfg, ["--model.blocks.5.depth", "1"])


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--seed", "1.5"], "'seed' is an int"),
        (["--use_ema", "maybe"], "'use_ema' is a bool"),
        (["--lr", "fast"], "'lr' is a float"),
        (["--dataset.num_frames", "1,x"], r"'dataset.num_frames\[1\]' is an int"),
        (["--optim", "[1]"], "holds a dict"),
        (["--lr.value", "1"], "'lr' holds a float"),
    ],
)
def test_bad_values_name_the_key(cfg, argv, match):
    with pytest.raises(ConfigValueError, match=match):
        apply_overrides(cfg, argv)


def test_python_value_overrides(cfg):
    new = apply_overrides(cfg, {"model.depth": 2, "lr": 1, "ckpt_path": "a", "seed": None})
    assert new.model.depth == 2 and new.lr == 1.0 and type(new.lr) is float
    assert new.ckpt_path == "a" and new.seed is None
    with pytest.raises(ConfigValueError):
        apply_overrides(cfg, {"model.depth": "two"}.items())  # pairs: strings are parsed, and "two" is no int


# ---------------------------------------------------------------------------------------------- keys


def test_unknown_key_names_the_nearest_key(cfg):
    with pytest.raises(ConfigKeyError) as error:
        apply_overrides(cfg, ["--model.hiden_size", "3"])
    message = str(error.value)
    assert message.startswith("unknown config key 'model.hiden_size'; did you mean 'model.hidden_size'?")
    assert isinstance(error.value, KeyError)


def test_unknown_short_key_suggests_by_leaf_name(cfg):
    with pytest.raises(ConfigKeyError, match="did you mean 'model.hidden_size'"):
        apply_overrides(cfg, ["--hidden_size", "3"])
    with pytest.raises(ConfigKeyError, match="keys under '<top level>'"):
        apply_overrides(cfg, ["--zzzzzz", "3"])


def test_new_keys_only_under_opened_prefixes(cfg):
    new = apply_overrides(cfg, ["--wandb.project", "demo", "--wandb.enabled", "false", "--model.extra.depth", "2"])
    assert new.wandb == {"project": "demo", "enabled": False}
    assert new.model.extra.depth == 2 and new.model.extra.note == "x"
    for argv in (["--model.new_key", "1"], ["--wandbx", "1"], ["--dataset.extra", "1"]):
        with pytest.raises(ConfigKeyError):
            apply_overrides(cfg, argv)
    assert apply_overrides(cfg, ["--dataset.extra", "1"], allow_new=["dataset"]).dataset.extra == 1


def test_original_config_is_not_mutated(cfg):
    before = cfg.to_dict()
    new = apply_overrides(
        cfg,
        [
            "--model.depth",
            "1",
            "--model.blocks.0.depth",
            "7",
            "--wandb.project",
            "p",
            "--optim.betas",
            "0.1,0.2",
            "--model.extra.k",
            "v",
        ],
    )
    assert cfg.to_dict() == before
    assert new is not cfg and new.model.depth == 1
    assert new.filename == cfg.filename


def test_load_config_applies_overrides(child_path):
    cfg = load_config(child_path, ["--model.depth", "2", "--seed=3"])
    assert isinstance(cfg, Config) and cfg.model.depth == 2 and cfg.seed == 3


def test_dotted_keys_lists_every_path(cfg):
    keys = dotted_keys(cfg)
    assert {"model", "model.hidden_size", "model.blocks.1.depth", "bucket_config.256px.33"} <= set(keys)
    assert "model.blocks.1.depth" not in dotted_keys(cfg, into_lists=False)


# ---------------------------------------------------------------------------------------------- saving


def test_save_config_round_trip(cfg, tmp_outputs):
    resolved = apply_overrides(cfg, ["--model.depth", "3", "--wandb.project", "p", "--ckpt_path", "a/b"])
    path = save_config(resolved, tmp_outputs)
    assert path == tmp_outputs / "config.py" and path.is_file()
    assert load_config(path).to_dict() == resolved.to_dict()
    assert [p.name for p in tmp_outputs.iterdir()] == ["config.py"]  # no temporary file left behind
    path = save_config(cfg, tmp_outputs / "nested" / "dir", name="resolved.py")  # creates directories
    assert load_config(path).to_dict() == cfg.to_dict()


# ---------------------------------------------------------------------------------------------- scripts

TRAIN_FLAGS = {
    "outputs": "outputs/default",
    "max_steps": None,
    "ckpt_every": 100,
    "load": None,
    "resume": None,
    "seed": 0,
}


def test_cli_script_flags_map_onto_config_keys(child_path):
    cfg, args = load_config_from_cli(
        [str(child_path), "--max-steps", "10", "--outputs=/tmp/run", "--model.depth", "2", "--ckpt-every", "5"],
        script_flags=TRAIN_FLAGS,
    )
    assert cfg.max_steps == 10 and cfg.outputs == "/tmp/run" and cfg.ckpt_every == 5 and cfg.model.depth == 2
    assert cfg.load is None and cfg.resume is None  # absent from the config: created with the default
    assert cfg.seed == 42  # present in the config: the config wins over the script default
    assert args.config == str(child_path)
    assert (args.max_steps, args.outputs, args.ckpt_every, args.load, args.seed) == (10, "/tmp/run", 5, None, 42)


def test_cli_script_flags_are_cast(child_path):
    with pytest.raises(ConfigValueError, match="'ckpt_every' is an int"):
        load_config_from_cli([str(child_path), "--ckpt-every", "often"], script_flags=TRAIN_FLAGS)
    cfg, args = load_config_from_cli([str(child_path), "--resume", "auto"], script_flags=TRAIN_FLAGS)
    assert cfg.resume == "auto" == args.resume


def test_cli_unknown_key_still_errors(child_path):
    with pytest.raises(ConfigKeyError, match="did you mean 'max_steps'"):
        load_config_from_cli([str(child_path), "--max-step", "10"], script_flags=TRAIN_FLAGS)


def test_cli_help_exits_cleanly(child_path, capsys):
    with pytest.raises(SystemExit) as stop:
        load_config_from_cli([str(child_path), "--help"], script_flags=TRAIN_FLAGS, prog="train.py")
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "usage: train.py CONFIG.py" in out and "--max-steps" in out
