"""Seeding and RNG-state capture, in plain types so ``torch.load(weights_only=True)`` reads them back.

A state dict holds python ``random``, numpy's global generator, the torch CPU generator and, when CUDA is
present, the generator of this process's current CUDA device (one device per rank, as torchrun binds it).
"""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU + all CUDA devices). Offset ``seed`` by rank yourself if wanted."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def get_rng_state() -> dict:
    """This process's RNG states as tensors / ints / strings / tuples (no numpy arrays, no pickled objects)."""
    py_version, py_internal, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state = {
        "python": (py_version, tuple(py_internal), py_gauss),
        "numpy": {
            "kind": str(np_kind),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state().cpu()
    return state


def set_rng_state(state: dict) -> None:
    """Restore a state made by ``get_rng_state`` (the CUDA state is skipped when this process has no CUDA)."""
    py_version, py_internal, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_internal), py_gauss))
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["kind"],
            np_state["keys"].numpy().astype(np.uint32),
            int(np_state["pos"]),
            int(np_state["has_gauss"]),
            float(np_state["cached_gaussian"]),
        )
    )
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])
