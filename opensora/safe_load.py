"""Reading a checkpoint never runs code: every ``torch.load`` of a checkpoint file is weights-only.

torch >= 2.6 loads weights-only by default, but ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` in the environment (set by
some clusters and older scripts) turns that default off for every call that does not pass ``weights_only``, and
ColossalAI's checkpoint IO (optimizer shards, param groups, ``lr_scheduler.pt``) passes nothing. So:

* ``load_tensors(path)``: our own loads, always ``weights_only=True``;
* ``weights_only_loads()``: a context in which every ``torch.load`` (ColossalAI's included) is weights-only, whatever
  the caller or the environment asks for.

A file whose pickle names anything but tensors and plain types is refused with ``CodeBearingPickleError``: one line
naming the file, never torch's advice to retry with ``weights_only=False``.
"""

from __future__ import annotations

import contextlib
import pickle
import threading

import torch

from opensora.cli_errors import UserInputError


class CodeBearingPickleError(UserInputError):
    """A checkpoint file holds pickled objects that would run code when loaded; it is not loaded."""


class UnreadableCheckpointFileError(UserInputError):
    """A checkpoint file that is not a readable torch file (truncated, overwritten)."""


def _refusal(path, error: BaseException) -> UserInputError:
    if isinstance(error, pickle.UnpicklingError):
        first = str(error).split("\n")[0][:200]
        return CodeBearingPickleError(
            f"{path} holds code-bearing pickle data (objects other than tensors and plain types: {first}); it is "
            "never loaded, whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says. Use a checkpoint written by this trainer "
            "(or check where this file came from)"
        )
    return UnreadableCheckpointFileError(
        f"{path} is damaged or not a torch file ({type(error).__name__}: {str(error).splitlines()[0][:200]}); "
        "resume from an older checkpoint (--resume auto skips damaged ones)"
    )


def load_tensors(path, map_location="cpu", **kwargs):
    """``torch.load(path, weights_only=True)`` with a one-line error for a refused or damaged file."""
    try:
        return _real_load(path, map_location=map_location, weights_only=True, **kwargs)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as error:
        raise _refusal(path, error) from None


_real_load = torch.load
_lock = threading.Lock()
_depth = 0


def _weights_only_load(f, map_location=None, pickle_module=None, *, weights_only=None, **kwargs):
    """``torch.load`` with ``weights_only=True`` forced (a ``pickle_module`` is ignored: weights-only has its own)."""
    return load_tensors(f, map_location=map_location, **kwargs)


@contextlib.contextmanager
def weights_only_loads():
    """Within this context every ``torch.load`` is weights-only (nests; restores ``torch.load`` on exit)."""
    global _depth
    with _lock:
        if _depth == 0:
            torch.load = _weights_only_load
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                torch.load = _real_load
