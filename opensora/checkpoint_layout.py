"""Where a training run keeps its checkpoints: directory and file names, the completion marker, the newest one.

Training writes this layout (``opensora.training.checkpoint``); inference, the converter and the demo read it
(``opensora.convert.weights``). One checkpoint, ``{outputs}/checkpoints/step-{step:07d}/``::

    {role}/model/          sharded safetensors of the role's network (``model.safetensors.index.json`` + shards)
    {role}/optimizer/      sharded optimizer state
    {role}/lr_scheduler.pt the role's scheduler                                (if it has one)
    {role}/ema.safetensors EMA weights, written by rank 0                      (if the role keeps an EMA)
    {role}/master/rank{r}.pt fp32 master weights held by rank r's optimizer    (bf16/fp16 training only)
    {role}/lora.json       a LoRA role: its settings, init_from and the base weights' sha256 (then no model/:
    {role}/adapter.safetensors  the adapter's lora_A/lora_B matrices; ema.safetensors is the adapter's EMA)
    extra_state.pt         the trainer's dict (sampler state, {step, epoch, ...}), tensors/plain types
    rng/rank{r}.pt         python/numpy/torch(/cuda) RNG state of every rank r
    config.py              the resolved config text
    meta.json              step, world size, roles, time
    manifest.json          every file's size and CRC-32 (``opensora.checkpoint_manifest``), checked by every reader
    COMPLETE               completion marker, written last

``role`` is ``model`` for plain training and ``student``, ``critic``... for distillation. Saves go to a hidden
sibling ``.tmp-step-{step:07d}`` and are renamed into place, so only directories with the marker count.
"""

from __future__ import annotations

import re
from pathlib import Path

COMPLETE_MARKER = "COMPLETE"
META_FILE = "meta.json"
CONFIG_FILE = "config.py"
MODEL_DIR = "model"  # inside a role directory
EMA_FILE = "ema.safetensors"  # inside a role directory
LORA_FILE = "lora.json"  # inside a LoRA role's directory: settings, init_from, base sha256 (JSON, never code)
ADAPTER_FILE = "adapter.safetensors"  # inside a LoRA role's directory: the adapter's own weights
TMP_PREFIX = ".tmp-"  # unfinished saves and directories being deleted
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_root(outputs: str | Path) -> Path:
    return Path(outputs) / "checkpoints"


def checkpoint_dir(outputs: str | Path, step: int) -> Path:
    return checkpoint_root(outputs) / f"step-{step:07d}"


def is_role_dir(path: str | Path) -> bool:
    """A checkpoint's role directory: full weights (``model/``) or a LoRA adapter (``lora.json``)."""
    return (Path(path) / MODEL_DIR).is_dir() or (Path(path) / LORA_FILE).is_file()


def is_complete(path: str | Path) -> bool:
    return (Path(path) / COMPLETE_MARKER).is_file()


def list_checkpoints(outputs: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``outputs`` as (step, path), oldest first; tmp/incomplete dirs are ignored."""
    root = checkpoint_root(outputs)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and is_complete(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def find_latest_checkpoint(outputs: str | Path) -> Path | None:
    """The newest complete checkpoint directory, or None."""
    found = list_checkpoints(outputs)
    return found[-1][1] if found else None


def is_run_dir(path: str | Path) -> bool:
    """A training run's outputs directory (it has ``checkpoints/``), as opposed to one checkpoint."""
    return checkpoint_root(path).is_dir()


def newest_checkpoint_of(path: str | Path) -> Path:
    """``path`` itself, or, for a run directory, its newest complete checkpoint: what the sampler, the converter
    and ``init_from`` read when given a run. A run without one is a ``FileNotFoundError`` naming what is there.
    ``RUN/best`` is the run's best checkpoint by its validation metric (``opensora.best_checkpoint``)."""
    from opensora.best_checkpoint import BEST_NAME, best_checkpoint_of

    path = Path(path)
    if path.name == BEST_NAME and not path.exists() and is_run_dir(path.parent):
        return best_checkpoint_of(path.parent)
    if not (path.is_dir() and is_run_dir(path)):
        return path
    latest = find_latest_checkpoint(path)
    if latest is None:
        unfinished = sorted(p.name for p in checkpoint_root(path).iterdir())
        raise FileNotFoundError(
            f"run directory {path} holds no complete checkpoint under checkpoints/ (found: {unfinished or 'nothing'}; "
            f"a checkpoint counts once its {COMPLETE_MARKER} marker is written)"
        )
    return latest
