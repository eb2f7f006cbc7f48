"""Take the host syncs out of ColossalAI 0.5.0's ZeRO optimizer step (``LowLevelZeroOptimizer``).

Left alone, every ZeRO step makes the host wait for the GPU three times, and each wait drains the launch queue so
the GPU then idles while the host launches the optimizer step and the next forward:

* ``backward`` ends with a full device synchronize when ``overlap_communication`` is on (the gradient reduction
  runs on a side stream); ordering the compute stream after the communication streams is all the later work needs
  (the reduced buffers are ``record_stream``-ed there already);
* ``_compute_grad_norm`` sums per-tensor fp64 norms, turns the sum into a Python float (a sync), all-reduces it and
  calls ``.item()`` (another), and ``calculate_global_norm_from_list`` takes ``math.sqrt`` of the result;
* ``_unscale_and_clip_grads`` compares the norm with the clip threshold in Python.

``install()`` swaps those three pieces for device-tensor versions: per-tensor fp32 norms (``torch._foreach_norm``
with an fp32 result, so bf16 gradients are not rounded first), squared and summed in fp64 on the device, one
all-reduce per process group, and the clip factor ``min(1, max_norm / (norm + 1e-6))`` applied with one
``_foreach_mul_`` (the same rule as ColossalAI's: scale only when ``norm + 1e-6 > max_norm``). ``get_grad_norm()``
then returns a 0-dim device tensor that the trainer reads one step late. Idempotent; only LowLevelZero (and the
HybridParallel ZeRO optimizer, which subclasses it) is touched.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

_INSTALLED = False


def _sum_of_squares(gradients) -> torch.Tensor:
    norms = torch._foreach_norm(list(gradients), 2, dtype=torch.float32)
    return torch.stack(norms).double().pow(2).sum()


def _compute_grad_norm(self, dp_pg, gradients, norm_type: int = 2):
    if float(norm_type) != 2.0:
        return _ORIGINAL["compute"](self, dp_pg, gradients, norm_type)
    gradients = list(gradients)  # not ``.data`` each: gradients never require grad, and an alias costs host time
    if not gradients:
        return 0.0
    with torch.no_grad():
        total = _sum_of_squares(gradients).float().reshape(1)
    for group in dp_pg if isinstance(dp_pg, tuple) else (dp_pg,):
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total[0].sqrt()


def _global_norm(norm_list):
    tensors = [n for n in norm_list if torch.is_tensor(n)]
    if not tensors:
        return sum(float(n) ** 2 for n in norm_list) ** 0.5
    floats = sum(float(n) ** 2 for n in norm_list if not torch.is_tensor(n))
    return (torch.stack([t.float() for t in tensors]).pow(2).sum() + floats).sqrt()


def _unscale_and_clip_grads(self, grad_groups_flat, total_norm):
    div_scale = 1.0 if self.mixed_precision_mixin is None else self.mixed_precision_mixin.get_grad_div_scale()
    if not torch.is_tensor(total_norm):
        return _ORIGINAL["clip"](self, grad_groups_flat, total_norm)
    factor = torch.ones((), device=total_norm.device, dtype=torch.float32) / div_scale
    if self._clip_grad_norm > 0.0:
        clip = (total_norm / div_scale + 1e-6) / self._clip_grad_norm
        factor = torch.where(clip > 1, factor / clip, factor)
    if grad_groups_flat:
        with torch.no_grad():
            torch._foreach_mul_(list(grad_groups_flat), factor.to(grad_groups_flat[0].dtype))


@contextlib.contextmanager
def _stream_wait_instead_of_synchronize(optimizer):
    """While ``optimizer`` backwards: the accelerator's ``synchronize`` orders the current stream after the
    optimizer's communication streams instead of blocking the host."""
    from colossalai.accelerator import get_accelerator

    accelerator = get_accelerator()
    if not torch.cuda.is_available() or "synchronize" in vars(accelerator):
        yield
        return

    def wait_for_communication(device=None):
        current = torch.cuda.current_stream()
        for store in optimizer.pg_to_bucket_store.values():
            stream = getattr(store, "comm_stream", None)
            if stream is not None:
                current.wait_stream(stream)

    accelerator.synchronize = wait_for_communication
    try:
        yield
    finally:
        del accelerator.synchronize


def _wrap_backward(original):
    def backward(self, *args, **kwargs):
        if not getattr(self, "_overlap_communication", False):
            return original(self, *args, **kwargs)
        with _stream_wait_instead_of_synchronize(self):
            return original(self, *args, **kwargs)

    backward.__wrapped__ = original
    return backward


_ORIGINAL: dict = {}


def install() -> None:
    """Patch ``LowLevelZeroOptimizer`` (once per process); see the module docstring."""
    global _INSTALLED
    if _INSTALLED:
        return
    from colossalai.zero.low_level import low_level_optim

    cls = low_level_optim.LowLevelZeroOptimizer
    _ORIGINAL.update(compute=cls._compute_grad_norm, clip=cls._unscale_and_clip_grads)
    cls._compute_grad_norm = _compute_grad_norm
    cls._unscale_and_clip_grads = _unscale_and_clip_grads
    low_level_optim.calculate_global_norm_from_list = _global_norm
    cls.backward = _wrap_backward(cls.backward)
    cls.backward_by_grad = _wrap_backward(cls.backward_by_grad)
    _INSTALLED = True
