"""opensora.registry.build_module: config dict -> object through an mmengine Registry."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mmengine.registry import Registry

from opensora.registry import DATASETS, METHODS, MODELS, build_module


class _Toy:
    def __init__(self, width=1, depth=2, inner=None):
        self.width, self.depth, self.inner = width, depth, inner


@pytest.fixture
def local_registry():
    registry = Registry("test_local", scope="opensora_tests")
    registry.register_module(name="Toy", module=_Toy)
    return registry


@pytest.fixture
def models_toy():
    """Register a toy class in the real MODELS under a unique name; remove it afterwards."""
    name = "_TestRegistryToyModel"
    MODELS.register_module(name=name, module=_Toy, force=True)
    yield name
    MODELS.module_dict.pop(name, None)


def test_build_with_overrides(local_registry):
    obj = build_module(dict(type="Toy", width=3), local_registry, depth=5)
    assert isinstance(obj, _Toy) and (obj.width, obj.depth) == (3, 5)
    assert build_module(dict(type="Toy", width=3), local_registry, width=7).width == 7  # overrides win


def test_build_from_models_registry(models_toy):
    obj = build_module(dict(type=models_toy, depth=9), MODELS)
    assert isinstance(obj, _Toy) and obj.depth == 9


def test_none_and_built_objects_pass_through(local_registry):
    assert build_module(None, local_registry) is None
    built = _Toy()
    assert build_module(built, local_registry) is built


def test_missing_type_is_an_error(local_registry):
    with pytest.raises(KeyError, match="no 'type' key"):
        build_module(dict(width=1), local_registry)


def test_unknown_type_lists_registered_names(local_registry):
    with pytest.raises(KeyError) as error:
        build_module(dict(type="Toyy"), local_registry)
    assert "'Toyy' is not registered in 'test_local'" in str(error.value)
    assert "'Toy'" in str(error.value)


def test_config_is_not_mutated(local_registry):
    cfg = dict(type="Toy", width=2, inner=dict(a=[1, 2]))
    before = copy.deepcopy(cfg)
    obj = build_module(cfg, local_registry, depth=4)
    assert cfg == before
    obj.inner["a"].append(3)  # the object got its own copy of nested values
    assert cfg == before


def test_registries_are_distinct():
    assert len({id(MODELS), id(DATASETS), id(METHODS)}) == 3
    assert {MODELS.name, DATASETS.name, METHODS.name} == {"model", "dataset", "method"}


def test_a_cpu_rank_beyond_the_gpus_of_its_machine_can_build_models():
    """``torchrun --nproc_per_node 4 ... --device cpu`` on a machine with fewer GPUs than ranks: mmengine's logger,
    made on the registry's first lookup, used to index the GPU list with LOCAL_RANK and fail (seen on a 1-GPU and a
    2-GPU machine). Run in a fresh interpreter (the logger is made once per process) that reports 1 GPU."""
    script = (
        "import os, torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "torch.cuda.device_count = lambda: 1\n"
        "os.environ.pop('CUDA_VISIBLE_DEVICES', None)\n"
        "os.environ['LOCAL_RANK'] = '3'\n"
        "from mmengine.logging import print_log\n"
        "from opensora.registry import MODELS, build_module\n"
        "model = build_module(dict(type='MMDiT', in_channels=4, hidden_size=32, num_heads=2, depth_double=1,"
        " depth_single=1, text_dim=8, pooled_dim=8, axes_dims=(4, 6, 6)), MODELS)\n"
        "print_log('built')\n"
        "assert os.environ['LOCAL_RANK'] == '3'\n"
        "print(type(model).__name__)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("MMDiT")
