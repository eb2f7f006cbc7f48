"""Import rules, checked at run time: sampling, the converter and the model package never load ColossalAI or the
training stack. Each case runs in a fresh interpreter and inspects ``sys.modules`` after the work is done."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from opensora.checkpoint_layout import COMPLETE_MARKER, EMA_FILE, META_FILE, checkpoint_dir
from opensora.config import load_config
from opensora.registry import MODELS, build_module

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_CONFIG = ROOT / "configs/diffusion/inference/demo.py"
TRAINING_STACK = ("colossalai", "opensora.training")
MARKER = "LOADED-MODULES:"

# Runs a script as __main__ (or executes a statement), then prints every loaded module's name after MARKER.
PROBE = """
import json, runpy, sys
target, args = sys.argv[1], sys.argv[2:]
try:
    if target.endswith(".py"):
        sys.argv = [target, *args]
        runpy.run_path(target, run_name="__main__")
    else:
        exec(target)
except SystemExit as stop:
    if stop.code not in (None, 0):
        raise
print({marker!r} + json.dumps(sorted(sys.modules)))
""".format(marker=MARKER)


def loaded_modules(target: str, *args) -> list:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, target, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith(MARKER))
    return json.loads(line[len(MARKER) :])


def assert_not_loaded(modules: list, packages) -> None:
    found = sorted(m for m in modules for p in packages if m == p or m.startswith(p + "."))
    assert not found, f"loaded {found[:10]}"


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """A training outputs directory holding one complete checkpoint of the demo network (EMA weights only)."""
    outputs = tmp_path_factory.mktemp("import_rules") / "train"
    role = checkpoint_dir(outputs, 1) / "model"  # the role of plain training
    role.mkdir(parents=True)
    torch.manual_seed(0)
    network = build_module(load_config(SAMPLE_CONFIG).model, MODELS)
    save_file({k: v.contiguous() for k, v in network.state_dict().items()}, str(role / EMA_FILE))
    (role.parent / META_FILE).write_text(json.dumps({"step": 1}))
    (role.parent / COMPLETE_MARKER).write_text("{}")
    return outputs


def test_inference_help_loads_no_training_stack():
    modules = loaded_modules(str(ROOT / "scripts/diffusion/inference.py"), "--help")
    assert_not_loaded(modules, TRAINING_STACK + ("torch",))  # --help answers before anything heavy loads


def test_sampling_from_a_checkpoint_loads_no_training_stack(outputs, tmp_path):
    modules = loaded_modules(
        str(ROOT / "scripts/diffusion/inference.py"),
        SAMPLE_CONFIG,
        "--ckpt",
        outputs,
        "--prompt",
        "a red circle moving left",
        "--num-steps",
        1,
        "--num-frames",
        2,
        "--save-dir",
        tmp_path / "samples",
        "--progress",
        "false",
    )
    assert (tmp_path / "samples" / "samples.csv").is_file()
    assert "opensora.inference.sampler" in modules and "opensora.models.mmdit.model" in modules
    assert_not_loaded(modules, TRAINING_STACK + ("opensora.methods",))


def test_converter_loads_no_training_stack(outputs, tmp_path):
    step = checkpoint_dir(outputs, 1)
    modules = loaded_modules(
        str(ROOT / "tools/convert_checkpoint.py"), step, tmp_path / "model.safetensors", "--dtype", "bf16"
    )
    assert (tmp_path / "model.safetensors").is_file()
    assert_not_loaded(modules, TRAINING_STACK + ("opensora.methods",))


def test_model_package_loads_only_models():
    modules = loaded_modules("import opensora.models")
    assert "opensora.models.mmdit.model" in modules
    assert_not_loaded(modules, TRAINING_STACK + ("opensora.methods", "opensora.inference", "opensora.datasets"))


def test_methods_load_without_colossalai():
    """Methods and adapters use the role contract (``opensora.roles``), not the trainer that builds roles."""
    modules = loaded_modules("import opensora.methods")
    assert_not_loaded(modules, TRAINING_STACK)
