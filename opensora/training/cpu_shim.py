"""Make ColossalAI's CPU accelerator usable for training on gloo (CI, laptops). GPU runs never touch this.

ColossalAI 0.5.0's ``CpuAccelerator`` raises ``RuntimeError`` for every stream / event / synchronize /
memory-statistics call, yet its plugins call those unconditionally (the ZeRO optimizer synchronises and
opens side streams, checkpoint IO empties caches, ...). On a CPU every one of those calls has an obvious
meaning: there is one synchronous "stream", nothing to synchronise, no cache and no device memory to report.
``LowLevelZeroOptimizer._sanity_checks`` also asserts the accelerator is cuda/npu; the rest of that optimizer
works on CPU tensors, so the shim relaxes only that assertion and keeps its dtype check.

``apply_cpu_shim()`` patches the classes in place, is idempotent, and does nothing when CUDA is available.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

_APPLIED = False


class _CpuStream:
    """Stand-in for a device stream: CPU work is synchronous, so every operation is a no-op."""

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


class _CpuEvent:
    """Stand-in for a device event; it is always complete."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event) -> float:
        return 0.0


def _noop(self, *args, **kwargs):
    return None


def _zero(self, *args, **kwargs):
    return 0


def _new_stream(self, *args, **kwargs):
    return _CpuStream()


def _new_event(self, *args, **kwargs):
    return _CpuEvent()


def _stream_context(self, stream_):
    return nullcontext()


# CpuAccelerator method -> CPU meaning. Kept as one table so the whole shim is visible at a glance.
_ACCELERATOR_PATCHES = {
    "synchronize": _noop,
    "empty_cache": _noop,
    "reset_peak_memory_stats": _noop,
    "reset_max_memory_allocated": _noop,
    "reset_max_memory_cached": _noop,
    "memory_allocated": _zero,
    "max_memory_allocated": _zero,
    "memory_reserved": _zero,
    "max_memory_reserved": _zero,
    "memory_stats": lambda self, *a, **k: {},
    "memory_summary": lambda self, *a, **k: "",
    "Stream": _new_stream,
    "Event": _new_event,
    "current_stream": _new_stream,
    "default_stream": _new_stream,
    "set_stream": _noop,
    "stream": _stream_context,
}


def _low_level_zero_sanity_checks(self):
    """The upstream check minus its cuda/npu assertion: all params must share the optimizer's dtype."""
    for param_group in self.optim.param_groups:
        for param in param_group["params"]:
            if not getattr(param, "skip_zero_check", False) and param.dtype != self._dtype:
                raise TypeError(
                    f"LowLevelZeroOptimizer expects every parameter in dtype {self._dtype}, got {param.dtype}"
                )


def apply_cpu_shim(force: bool = False) -> bool:
    """Patch ColossalAI for CPU training. Returns True if the shim is active after the call.

    Does nothing when CUDA is available (unless ``force``, used by tests); calling it twice is harmless.
    """
    global _APPLIED
    if _APPLIED:
        return True
    if torch.cuda.is_available() and not force:
        return False

    from colossalai.accelerator.cpu_accelerator import CpuAccelerator
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    for name, replacement in _ACCELERATOR_PATCHES.items():
        setattr(CpuAccelerator, name, replacement)
    LowLevelZeroOptimizer._sanity_checks = _low_level_zero_sanity_checks
    _APPLIED = True
    return True


def is_cpu_shim_applied() -> bool:
    return _APPLIED
