"""Checks around checkpoint IO that turn late, confusing failures into clear errors at the point of cause.

* ``check_model_fits``: before ``booster.load_model``, compare the saved tensor shapes (read from the safetensors
  headers, no data loaded) with the model's. ColossalAI's loader skips size mismatches, so a checkpoint of another
  architecture would load "fine" and fail later in the EMA or the first optimizer step.
* ``save_failure``: a save that fails on any rank (disk full, quota, permissions) removes the partial temporary
  directory at once and raises one error naming the path and the free bytes there; a full disk reads "no space
  left on device" however the serializer reported it (``write_failure_cause``).
"""

import errno
import shutil
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from opensora.cli_errors import UserInputError


class CheckpointSaveError(UserInputError, OSError):
    """A checkpoint could not be written; the message names the path and the free space there. An ``OSError`` for
    callers that handle IO failures, and reported by the CLIs like bad input (one line, exit code 2)."""


def saved_shapes(model_dir) -> Dict[str, Tuple[int, ...]]:
    """Tensor shapes of a sharded safetensors model directory, read from the file headers only."""
    from safetensors import safe_open

    from opensora.convert.weights import shard_names

    model_dir = Path(model_dir)
    shapes = {}
    for shard in shard_names(model_dir):
        with safe_open(str(model_dir / shard), framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def check_model_fits(model_dir, module: torch.nn.Module, what: str = "model") -> None:
    """Raise ``UserInputError`` naming the first tensor whose saved shape differs from ``module``'s (and how
    many differ), or the tensors one side lacks."""
    from opensora.convert.weights import check_shapes_fit

    saved = saved_shapes(model_dir)
    if saved:  # not a safetensors checkpoint: leave it to the booster
        check_shapes_fit(saved, module, f"checkpoint {model_dir}", what)


def free_bytes(path) -> int:
    """Free bytes on the filesystem holding ``path`` (its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return -1


# How the serializers report a full disk or quota, besides an ``OSError`` with its errno: torch's zip writer as an
# enforce failure ("unexpected pos", "file write failed"), safetensors as a Rust io error in its message.
_FULL_DISK_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
_FULL_DISK_MESSAGES = (
    "unexpected pos",
    "file write failed",
    "failed writing file",
    "no space left on device",
    "storagefull",
    "os error 28",
    "code: 28",
    "disk quota exceeded",
    "os error 122",
)


def write_failure_cause(error: BaseException) -> Optional[str]:
    """'no space left on device' / 'disk quota exceeded' when ``error`` (or its cause) is one of the ways the
    serializers report a full filesystem; None for anything else."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if getattr(error, "errno", None) in _FULL_DISK_ERRNOS:
            return _FULL_DISK_ERRNOS[error.errno]
        text = str(error).lower()
        if any(marker in text for marker in _FULL_DISK_MESSAGES):
            return "disk quota exceeded" if "quota" in text or "os error 122" in text else "no space left on device"
        error = error.__cause__ or error.__context__
    return None


def is_write_failure(error: BaseException) -> bool:
    """An IO problem (reported as ``CheckpointSaveError``), not a bug (which keeps its traceback)."""
    return isinstance(error, OSError) or write_failure_cause(error) is not None


def save_failure(tmp: Path, final: Path, error: BaseException) -> CheckpointSaveError:
    """Remove the partial ``tmp`` directory now and describe the failure (what, where, how much space is left)."""
    shutil.rmtree(tmp, ignore_errors=True)
    free = free_bytes(final.parent)
    cause = write_failure_cause(error) or str(error)
    return CheckpointSaveError(
        f"saving checkpoint {final} failed: {cause} ({free:,} bytes free on that filesystem); the partial "
        f"temporary directory {tmp} was removed and earlier checkpoints are untouched"
    )


def any_rank_failed(error) -> bool:
    """Whether ``error`` (this rank's, or None) or any other rank's is set; every rank must call it, so one rank's
    failure stops all of them instead of leaving the others waiting in a barrier."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return error is not None
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, error is not None)
    return any(flags)
