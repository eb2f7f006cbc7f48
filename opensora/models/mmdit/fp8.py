"""FP8 training of the blocks' linear layers through torchao's float8 (``MMDiT(fp8_linears="tensorwise"|"rowwise")``).

Which layers: every ``nn.Linear`` inside the double / single blocks whose input and output widths are multiples of
16 (what the FP8 GEMM needs), except the adaLN modulation layers (their GEMMs have one row per sample: all cast, no
gain) and LoRA's low-rank matrices. The embedders and the final layer stay in bf16, as in torchao's own recipes.
The weights stay what they were (same parameters, same state-dict keys, same optimizer state); only the matmuls of
forward and backward run in FP8 with dynamic scales: one per tensor (``tensorwise``) or one per row (``rowwise``,
closer to bf16, slower). A training option, not architecture: checkpoints, EMA and sampling see plain weights.

Needs torchao and an FP8-capable GPU (compute capability 8.9+); pays with compiled blocks (torchao's casts fuse there)
and at large widths (torchao measures ~0.8x on small GEMMs, up to ~1.4x on large ones).
"""

from typing import Optional

import torch.nn as nn

FP8_RECIPES = ("tensorwise", "rowwise")


def check_recipe(recipe: Optional[str]) -> Optional[str]:
    if recipe is not None and recipe not in FP8_RECIPES:
        raise ValueError(f"fp8_linears must be None or one of {FP8_RECIPES}, got {recipe!r}")
    return recipe


def is_fp8_block_linear(module: nn.Module, name: str) -> bool:
    """torchao's ``module_filter_fn``: the block linears that gain from FP8 (see the module docstring)."""
    if not isinstance(module, nn.Linear) or not name.startswith(("double_blocks.", "single_blocks.")):
        return False
    if "lora_" in name or name.endswith(("_mod.lin", "modulation.lin")):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_block_linears(model: nn.Module, recipe: str) -> int:
    """Swap ``model``'s FP8 block linears for torchao's ``Float8Linear`` in place; returns how many were swapped."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as error:
        raise ImportError(
            f"fp8_linears={recipe!r} needs torchao (pip install torchao) and an FP8 GPU; set fp8_linears=None"
        ) from error
    swapped = []

    def keep(module, name):
        chosen = is_fp8_block_linear(module, name)
        if chosen:
            swapped.append(name)
        return chosen

    convert_to_float8_training(model, module_filter_fn=keep, config=Float8LinearConfig.from_recipe_name(recipe))
    return len(swapped)
