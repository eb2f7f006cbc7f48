"""opensora.registry.build_module: config dict -> object through an mmengine Registry."""

import copy

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
