"""Config-friendly dtype names, shared by every module that reads ``precision`` / ``dtype`` from a config."""

from typing import Union

import torch

DTYPE_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
SHORT_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def resolve_dtype(dtype: Union[str, torch.dtype, None]) -> torch.dtype:
    """A ``torch.dtype``, a name ("fp32", "bf16", "fp16", "float32", ...) or None (fp32)."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.lower()]
    raise ValueError(f"unknown dtype {dtype!r}; use a torch.dtype or one of {sorted(DTYPE_NAMES)}")
