"""FP8 block linears (fp8.py): which layers are swapped, what stays as it was, and the error without torchao. The
matmuls themselves run on FP8 GPUs only (benchmarks/fp8_step.py measures them there)."""

import sys

import pytest
import torch
from test_mmdit import tiny_kwargs

from opensora.models.mmdit import MMDiT
from opensora.models.mmdit.fp8 import is_fp8_block_linear


def test_the_filter_keeps_block_projections_and_mlps_and_skips_modulation_lora_and_odd_widths():
    model = MMDiT(**tiny_kwargs())
    chosen = {name for name, module in model.named_modules() if is_fp8_block_linear(module, name)}
    assert "double_blocks.0.img_attn.qkv" in chosen and "double_blocks.0.txt_mlp.2" in chosen
    assert "single_blocks.0.linear1" in chosen and "single_blocks.0.linear2" in chosen
    assert not any("mod" in name for name in chosen)  # adaLN modulation: one row per sample
    assert not any(name.startswith(("img_in", "txt_in", "final_layer", "time_in")) for name in chosen)
    odd = torch.nn.Linear(24, 64)
    assert not is_fp8_block_linear(odd, "double_blocks.0.img_attn.qkv")
    assert not is_fp8_block_linear(torch.nn.Linear(64, 64), "double_blocks.0.img_attn.qkv.lora_A.default")


def test_conversion_keeps_parameters_state_dict_and_arch():
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    plain = MMDiT(**tiny_kwargs())
    model = MMDiT(**tiny_kwargs(fp8_linears="rowwise"))
    assert "fp8_linears" not in model.arch and MMDiT(**model.arch).state_dict().keys() == plain.state_dict().keys()
    assert model.state_dict().keys() == plain.state_dict().keys()
    swapped = [name for name, module in model.named_modules() if isinstance(module, Float8Linear)]
    assert "double_blocks.0.img_mlp.0" in swapped and not any("mod" in name for name in swapped)


def test_bad_recipe_and_missing_torchao_are_one_line_errors(monkeypatch):
    with pytest.raises(ValueError, match="fp8_linears must be None or one of"):
        MMDiT(**tiny_kwargs(fp8_linears="e4m3"))
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ImportError, match="needs torchao"):
        MMDiT(**tiny_kwargs(fp8_linears="tensorwise"))
