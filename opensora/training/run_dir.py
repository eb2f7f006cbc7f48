"""Guards around a run's outputs directory, checked before anything is written to it.

* A fresh run (no ``--load`` / ``--resume auto``) into a directory that already holds a run (checkpoints or a
  non-empty ``metrics.jsonl``) is refused: it would truncate the old metrics, overwrite its checkpoints and let a
  later ``--resume auto`` mix the two runs. ``--overwrite`` moves the old run aside to
  ``{outputs}.replaced-{time}`` (nothing is deleted) and starts fresh, never while another run holds the directory
  (``run_lock``).
* ``--load CKPT --max-steps N`` with N at or below the checkpoint's step is refused (it would train nothing).
* ``--load`` must name one checkpoint: a run's outputs directory is answered with its list of checkpoints.

Pure filesystem checks with no torch import, so ``train.py`` reports them before any heavy start-up.
"""

import json
import os
import re
import time
from pathlib import Path
from typing import List, Optional

from opensora.cli_errors import UserInputError

_STEP_DIR = re.compile(r"^step-(\d+)$")
COMPLETE_MARKER = "COMPLETE"  # the same name opensora.training.checkpoint writes last


def run_checkpoints(outputs) -> List[Path]:
    """``{outputs}/checkpoints/step-*`` directories (complete or not), oldest first."""
    root = Path(outputs) / "checkpoints"
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), child) for child in root.iterdir() if child.is_dir() and (m := _STEP_DIR.match(child.name))
    ]
    return [path for _, path in sorted(found)]


def holds_run(outputs) -> bool:
    outputs = Path(outputs)
    metrics = outputs / "metrics.jsonl"
    return bool(run_checkpoints(outputs)) or (metrics.is_file() and metrics.stat().st_size > 0)


def describe_checkpoints(outputs) -> str:
    paths = run_checkpoints(outputs)
    if not paths:
        return "it holds no checkpoint yet"
    shown = [f"{p.name}{'' if (p / COMPLETE_MARKER).is_file() else ' (incomplete)'}" for p in paths[-5:]]
    more = f"{len(paths) - 5} older and " if len(paths) > 5 else ""
    return f"its checkpoints: {more}{', '.join(shown)} under {Path(outputs) / 'checkpoints'}"


def check_load_path(load) -> None:
    """``--load`` must be one checkpoint directory (``.../checkpoints/step-XXXXXXX``)."""
    path = Path(load)
    if not path.exists():
        raise UserInputError(f"--load {path}: no such checkpoint directory")
    if not path.is_dir():
        raise UserInputError(f"--load {path} is a file; give a checkpoint directory (.../checkpoints/step-XXXXXXX)")
    if (path / "checkpoints").is_dir() or (path / "metrics.jsonl").is_file():
        raise UserInputError(
            f"--load {path} is a run (outputs) directory, not a checkpoint; "
            f"{describe_checkpoints(path)}: pass one of them to --load, or --outputs {path} "
            "--resume auto to continue that run"
        )


def prepare_outputs(outputs, load: Optional[str], resume_auto: bool, overwrite: bool) -> bool:
    """Refuse a fresh run into a directory holding a run unless ``overwrite``; returns whether the old run is to be
    moved aside (``move_run_aside``, by rank 0 once it holds the run lock: never a live run's directory)."""
    outputs = Path(outputs)
    if outputs.exists() and not outputs.is_dir():
        raise UserInputError(f"--outputs {outputs} is a file, not a directory")
    if resume_auto or not holds_run(outputs):
        return False
    if load is not None and Path(load).resolve().is_relative_to(outputs.resolve()):
        return False  # continuing this run from one of its own checkpoints
    if not overwrite:
        raise UserInputError(
            f"--outputs {outputs} already holds a run ({describe_checkpoints(outputs)}); a fresh run would mix "
            f"with it. Continue it with --resume auto, write elsewhere with --outputs NEW_DIR, or pass --overwrite "
            f"to move the old run aside to {outputs}.replaced-<time> and start fresh"
        )
    return True


def move_run_aside(outputs) -> Path:
    """Move the run in ``outputs`` to ``{outputs}.replaced-{time}`` (nothing is deleted); returns where it went."""
    outputs = Path(outputs)
    aside = outputs.with_name(f"{outputs.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    suffix = 1
    while aside.exists():
        aside = aside.with_name(f"{outputs.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}-{suffix}")
        suffix += 1
    os.replace(outputs, aside)
    return aside


def checkpoint_step(path) -> Optional[int]:
    """The step a checkpoint directory records in its ``meta.json`` (None when it does not say)."""
    meta = Path(path) / "meta.json"
    try:
        return int(json.loads(meta.read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_max_steps_after(checkpoint, max_steps: int, flag: str = "--load") -> None:
    """Resuming from ``checkpoint`` with ``--max-steps`` at or below its step would train nothing."""
    step = checkpoint_step(checkpoint)
    if step is not None and int(max_steps) <= step:
        raise UserInputError(
            f"{flag} {checkpoint} is at step {step} and --max-steps {max_steps} is not past it: nothing to train. "
            f"--max-steps counts all steps, not steps to add: pass --max-steps {step + int(max_steps)} to train "
            f"{max_steps} more"
        )
