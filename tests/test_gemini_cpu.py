"""What can be checked of GeminiPlugin without a GPU: the configs resolve, the role settings Gemini cannot train
with are refused before anything is built, and the plugin itself is refused on CPU with a clear message."""

from pathlib import Path

import pytest

pytest.importorskip("colossalai")

from opensora.config import load_config  # noqa: E402
from opensora.role_config import role_configs  # noqa: E402
from opensora.training.booster import build_plugin  # noqa: E402
from opensora.training.role_builder import check_plugin_fits_role  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "diffusion" / "train"


@pytest.mark.parametrize("name", ["mmdit_1b_gemini.py", "mmdit_11b_synthetic.py"])
def test_gemini_configs_resolve_and_fit_the_plugin(name):
    cfg = load_config(CONFIGS / name)
    roles = role_configs(cfg)
    assert cfg.plugin["type"] == "GeminiPlugin"
    for role_name, role in roles.items():
        check_plugin_fits_role(role_name, role, cfg.plugin)
        assert role["ema"] is None and role["optimizer"]["type"] == "HybridAdam"


def test_gemini_refuses_torch_adamw_and_the_rank0_ema():
    cfg = load_config(CONFIGS / "mmdit_1b_gemini.py")
    role = role_configs(cfg)["model"]
    with pytest.raises(ValueError, match="HybridAdam"):
        check_plugin_fits_role("model", {**role, "optimizer": dict(type="AdamW")}, cfg.plugin)
    with pytest.raises(ValueError, match="ema_decay=None"):
        check_plugin_fits_role("model", {**role, "ema": dict(decay=0.99)}, cfg.plugin)
    zero = dict(type="LowLevelZeroPlugin", stage=2)
    check_plugin_fits_role("model", {**role, "optimizer": dict(type="AdamW"), "ema": dict(decay=0.99)}, zero)


def test_gemini_is_refused_on_cpu_with_a_clear_error():
    with pytest.raises(RuntimeError, match="needs a GPU"):
        build_plugin(dict(type="GeminiPlugin", placement_policy="static"), "bf16", on_gpu=False)
