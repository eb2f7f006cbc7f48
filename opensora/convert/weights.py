"""Read a role's weights from a training checkpoint directory or a single safetensors file.

A training checkpoint (layout: ``opensora.checkpoint_layout``) holds one sub-directory per trained role with its
EMA weights and the booster's sharded safetensors. Exported files are one ``.safetensors`` with the resolved
config in the metadata (key ``config``).
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from opensora.checkpoint_layout import CONFIG_FILE, EMA_FILE, META_FILE, MODEL_DIR

INDEX_NAME = "model.safetensors.index.json"


@dataclass
class LoadedWeights:
    state_dict: Dict[str, torch.Tensor]
    source: str  # "ema", "model" or "file"
    path: Path
    step: Optional[int] = None
    config_text: Optional[str] = None  # the training config, when the checkpoint carries one
    metadata: Dict[str, str] = field(default_factory=dict)


def load_sharded_safetensors(directory: Path) -> Dict[str, torch.Tensor]:
    """All tensors of a sharded safetensors directory (index json + shards), or a lone ``*.safetensors``."""
    directory = Path(directory)
    index = directory / INDEX_NAME
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = sorted(p.name for p in directory.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no safetensors weights in {directory}")
    state = {}
    for shard in shards:
        state.update(load_file(str(directory / shard)))
    return state


def read_metadata(path: Path) -> Dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def load_role_weights(path, role: str = "model", ema: bool = True) -> LoadedWeights:
    """Weights of ``role`` from checkpoint directory ``path`` (EMA unless ``ema=False``) or from a file."""
    path = Path(path)
    if path.is_file():
        metadata = read_metadata(path)
        step = int(metadata["step"]) if "step" in metadata else None
        return LoadedWeights(load_file(str(path)), "file", path, step, metadata.get("config"), metadata)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    role_dir = path / role
    if not role_dir.is_dir():
        roles = sorted(p.name for p in path.iterdir() if (p / MODEL_DIR).is_dir())
        raise FileNotFoundError(f"checkpoint {path} has no role '{role}'; it has {roles}")
    meta_file = path / META_FILE
    step = json.loads(meta_file.read_text()).get("step") if meta_file.is_file() else None
    config_file = path / CONFIG_FILE
    config_text = config_file.read_text() if config_file.is_file() else None
    ema_file = role_dir / EMA_FILE
    if ema and ema_file.is_file():
        return LoadedWeights(load_file(str(ema_file)), "ema", ema_file, step, config_text, read_metadata(ema_file))
    if ema:
        raise FileNotFoundError(f"{ema_file} missing (trained without EMA?); pass ema=False / --no-ema for raw weights")
    model_dir = role_dir / MODEL_DIR
    return LoadedWeights(load_sharded_safetensors(model_dir), "model", model_dir, step, config_text)
