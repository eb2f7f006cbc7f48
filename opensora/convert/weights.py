"""Read a role's weights from a training checkpoint directory or a single safetensors file.

A training checkpoint (layout: ``opensora.checkpoint_layout``) holds one sub-directory per trained role (``model``
for plain training, ``student``/``critic`` for distillation) with its EMA weights, the booster's sharded safetensors
and ``arch.json`` (the network's keyword arguments, see ``arch.py``). Exported files are one ``.safetensors`` with the
architecture in the metadata (key ``arch``) and, for the record only, the training config text (key ``config``).
Config text is never executed here.

A LoRA role (``lora.json`` + ``adapter.safetensors``, see ``opensora.lora``) or an exported adapter file (metadata
key ``lora``) is merged into its base weights on load by default (``lora="merge"``): the base comes from the recorded
``init_from`` or from ``base`` (a checkpoint directory or file), and must hash to the recorded ``base_sha256``.
``lora="only"`` returns the adapter's matrices alone.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

import torch
from safetensors import safe_open
from safetensors.torch import load_file as _load_file

from opensora.checkpoint_layout import (
    ADAPTER_FILE,
    CONFIG_FILE,
    EMA_FILE,
    LORA_FILE,
    META_FILE,
    MODEL_DIR,
    is_role_dir,
    newest_checkpoint_of,
)
from opensora.checkpoint_manifest import check_safetensors_complete, verify_checkpoint
from opensora.cli_errors import UserInputError

from .arch import ARCH_FILE, ARCH_KEY, arch_from_json

INDEX_NAME = "model.safetensors.index.json"
LORA_KEY = "lora"  # metadata key of an exported adapter file: the lora.json record
LORA_MODES = ("merge", "only", "stored")  # stored: an adapter alone, full weights as they are


@dataclass
class LoadedWeights:
    state_dict: Dict[str, torch.Tensor]
    source: str  # "ema", "model" or "file"
    path: Path
    step: Optional[int] = None
    config_text: Optional[str] = None  # the training config, when the checkpoint carries one
    metadata: Dict[str, str] = field(default_factory=dict)
    arch: Optional[dict] = None  # the network's keyword arguments, when the checkpoint records them as JSON


def load_file(path) -> Dict[str, torch.Tensor]:
    """``safetensors.torch.load_file`` after checking the file is whole: a truncated or foreign file is one error
    naming it, never a ``SafetensorError`` traceback."""
    check_safetensors_complete(path)
    return _load_file(str(path))


def shard_names(directory: Path) -> list:
    """File names of a sharded safetensors directory's shards (from the index json), or its ``*.safetensors``."""
    directory = Path(directory)
    index = directory / INDEX_NAME
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return sorted(p.name for p in directory.glob("*.safetensors"))


def load_sharded_safetensors(directory: Path) -> Dict[str, torch.Tensor]:
    """All tensors of a sharded safetensors directory (index json + shards), or a lone ``*.safetensors``."""
    directory = Path(directory)
    shards = shard_names(directory)
    if not shards:
        raise FileNotFoundError(f"no safetensors weights in {directory}")
    state = {}
    for shard in shards:
        state.update(load_file(str(directory / shard)))
    return state


def check_shapes_fit(saved: Dict[str, tuple], module: torch.nn.Module, where, what: str = "model") -> None:
    """Raise ``UserInputError`` naming the first tensor whose saved shape differs from ``module``'s (with both shapes
    and how many differ), or the tensors one side lacks. ``saved``: key -> shape (``module.`` prefixes ignored)."""
    strip = lambda key: key[len("module.") :] if key.startswith("module.") else key  # noqa: E731
    saved = {strip(k): tuple(v) for k, v in saved.items()}
    ours = {strip(k): tuple(v.shape) for k, v in module.state_dict().items()}
    differ = [k for k in ours if k in saved and saved[k] != ours[k]]
    advice = "load it with the config it was trained with"
    if differ:
        first = differ[0]
        raise UserInputError(
            f"{where} does not fit this {what}: {first} has shape {list(saved[first])} in the checkpoint but "
            f"{list(ours[first])} in the model built from the config ({len(differ)} tensor(s) differ); {advice}"
        )
    missing, unexpected = [k for k in ours if k not in saved], [k for k in saved if k not in ours]
    if missing or unexpected:
        more = lambda keys: f"{keys[:3]}{' ...' if len(keys) > 3 else ''}"  # noqa: E731
        raise UserInputError(
            f"{where} does not fit this {what}: missing {more(missing)}, unexpected {more(unexpected)}; {advice}"
        )


def read_metadata(path: Path) -> Dict[str, str]:
    """A safetensors file's string metadata; a ``UserInputError`` when the file is not safetensors at all."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except FileNotFoundError:
        raise
    except Exception as error:  # safetensors raises its own error types for a file of another format
        raise UserInputError(
            f"{path} is not a safetensors file ({type(error).__name__}: {error}); give a "
            ".safetensors file or a checkpoint directory (.../checkpoints/step-XXXXXXX)"
        ) from None


def load_role_weights(path, role: str = "model", ema: bool = True, lora: str = "merge", base=None) -> LoadedWeights:
    """Weights of ``role`` from checkpoint directory ``path`` (EMA unless ``ema=False``) or from a file.

    A LoRA adapter (a LoRA role's directory or an exported adapter file) is merged into its base weights
    (``lora="merge"``, base from its ``init_from`` record or ``base``), or returned alone (``lora="only"``).
    """
    if lora not in LORA_MODES:
        raise ValueError(f"lora must be one of {LORA_MODES}, got {lora!r}")
    loaded = _load_stored(Path(path), role, ema)
    if LORA_KEY not in loaded.metadata:
        if lora == "only":
            raise UserInputError(f"{loaded.path} holds full weights, not a LoRA adapter: drop --lora-only")
        return loaded
    if lora in ("only", "stored"):
        return loaded
    return _merged(loaded, base)


def _merged(adapter: LoadedWeights, base) -> LoadedWeights:
    from opensora.lora import base_fingerprint, check_same_base, merge_adapter, record_from_json

    record = record_from_json(adapter.metadata[LORA_KEY], f"LoRA record of {adapter.path}")
    spec = dict(record["init_from"])
    base_path = Path(base) if base is not None else Path(spec.pop("path"))
    spec.pop("path", None)
    if not base_path.exists():
        raise UserInputError(
            f"the base weights of LoRA adapter {adapter.path} ({base_path}) do not exist: give "
            "them with --base PATH (base=...)"
        )
    base_weights = load_role_weights(base_path, lora="merge", **spec)
    check_same_base(
        record, base_fingerprint(base_weights.state_dict), f"LoRA adapter {adapter.path}", base_name=str(base_path)
    )
    merged = merge_adapter(base_weights.state_dict, adapter.state_dict, record)
    metadata = {k: v for k, v in adapter.metadata.items() if k != LORA_KEY}
    metadata["merged_lora"] = adapter.metadata[LORA_KEY]
    return LoadedWeights(
        merged,
        adapter.source,
        adapter.path,
        adapter.step,
        adapter.config_text,
        metadata,
        adapter.arch or base_weights.arch,
    )


def _load_stored(path: Path, role: str, ema: bool) -> LoadedWeights:
    """What is stored at ``path`` for ``role``: full weights, or an adapter (metadata ``lora`` set). A run directory
    stands for its newest complete checkpoint."""
    path = newest_checkpoint_of(path)
    if path.is_file():
        metadata = read_metadata(path)
        step = int(metadata["step"]) if "step" in metadata else None
        arch = arch_from_json(metadata[ARCH_KEY], str(path)) if ARCH_KEY in metadata else None
        return LoadedWeights(load_file(str(path)), "file", path, step, metadata.get("config"), metadata, arch)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    role_dir = path / role
    if not role_dir.is_dir():
        roles = sorted(p.name for p in path.iterdir() if is_role_dir(p))
        raise FileNotFoundError(f"checkpoint {path} has no role '{role}'; it has {roles}")
    verify_checkpoint(path, only=role, quiet=True)  # the role's files against the manifest's sizes (a stat each)
    meta_file = path / META_FILE
    step = json.loads(meta_file.read_text()).get("step") if meta_file.is_file() else None
    config_file = path / CONFIG_FILE
    config_text = config_file.read_text() if config_file.is_file() else None
    arch_file = role_dir / ARCH_FILE
    arch = arch_from_json(arch_file.read_text(), str(arch_file)) if arch_file.is_file() else None
    lora_file = role_dir / LORA_FILE
    lora_meta = {LORA_KEY: lora_file.read_text()} if lora_file.is_file() else {}
    ema_file = role_dir / EMA_FILE
    if ema and ema_file.is_file():
        return LoadedWeights(
            load_file(str(ema_file)), "ema", ema_file, step, config_text, {**read_metadata(ema_file), **lora_meta}, arch
        )
    if ema:
        raise FileNotFoundError(f"{ema_file} missing (trained without EMA?); pass ema=False / --no-ema for raw weights")
    if lora_meta:
        adapter_file = role_dir / ADAPTER_FILE
        return LoadedWeights(load_file(str(adapter_file)), "model", adapter_file, step, config_text, lora_meta, arch)
    model_dir = role_dir / MODEL_DIR
    return LoadedWeights(load_sharded_safetensors(model_dir), "model", model_dir, step, config_text, arch=arch)
