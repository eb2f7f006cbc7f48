"""Skip the communication ColossalAI 0.5.0's ZeRO optimizer does when its process group has one rank.

On one GPU ``LowLevelZeroOptimizer`` still runs the multi-rank data path, and every step makes passes over
parameter-sized memory that only move bytes from one buffer to another:

* each gradient bucket (``_run_reduction``) is flattened into a new buffer, divided by the world size (1) in
  place, then reduce-scattered over one rank into another new buffer (a copy) that the gradients become views of;
* the optimizer step casts each gradient to fp32 with its own ``.to()`` (a launch and an allocation per tensor,
  ~340 tensors at 1B), and afterwards casts each master back to bf16 and gathers those casts
  (``TensorBucket.all_gather``): flattened into one buffer, all-gathered over one rank into another (a copy), each
  tensor flattened again (a copy per tensor) and copied into its parameter (another copy per tensor).

With one rank a sum over ranks and a division by 1 are the identity, so ``install()`` makes both do only what
changes the result: the bucket's flat gradient buffer becomes the reduced gradient itself; the step casts all
gradients into one fp32 buffer with one multi-tensor copy and writes the updated masters straight into the bf16
parameters with another (``copy_`` rounds fp32 to bf16 exactly as ``.to()`` does). Bit for bit the same values
(gradient norm, clipping and the inner optimizer are ColossalAI's / ``zero_sync``'s, called as before). Groups of
more than one rank, fp8 communication, a communication dtype different from the gradients', CPU offload,
``overlap_allgather`` and ``master_weights=False`` take ColossalAI's own path. Idempotent.
"""

from __future__ import annotations

import torch

_ORIGINAL: dict = {}
SHORTCUTS_TAKEN = {"reduction": 0, "step": 0}  # counts, so tests can tell which path ran


def _reduction_is_identity(optimizer) -> bool:
    return (
        not optimizer._fp8_communication
        and all(store.world_size == 1 for store in optimizer.pg_to_bucket_store.values())
        and optimizer._communication_dtype in (None, optimizer._dtype)
    )


def _run_reduction(self):
    if not _reduction_is_identity(self):
        return _ORIGINAL["run_reduction"](self)
    for store in self.pg_to_bucket_store.values():
        if store.num_elements_in_bucket() <= 0:
            continue
        store.build_grad_in_bucket()
        flat_grads = store.get_flatten_grad()  # the sum over one rank, already divided by 1
        store.reset_num_elements_in_bucket()
        group_id = store.current_group_id
        if self._partition_grads:
            self._update_partitoned_grad(store, store.get_grad()[store.local_rank], flat_grads, group_id, 1)
        else:
            self._update_unpartitoned_grad(store, store.get_grad().values(), [flat_grads], group_id)
        store.reset()
        SHORTCUTS_TAKEN["reduction"] += 1


def _step_is_local(optimizer) -> bool:
    return (
        _reduction_is_identity(optimizer)
        and optimizer._master_weights
        and not optimizer._cpu_offload
        and not optimizer._overlap_allgather
    )


def _cast_all(tensors: list, dtype: torch.dtype) -> list:
    """``[t.to(dtype) for t in tensors]`` as views of one new buffer filled by one multi-tensor copy (tensors already
    of ``dtype`` are returned as they are, as ``.to()`` does)."""
    if not tensors or tensors[0].dtype == dtype:
        return list(tensors)
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
    casts = [piece.view(t.shape) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
    torch._foreach_copy_(casts, tensors)
    return casts


def _step(self, closure=None):
    if not _step_is_local(self):
        return _ORIGINAL["step"](self, closure)
    from colossalai.zero.low_level import low_level_optim

    assert closure is None, "closure is not supported by step()"
    if not self.require_grad_sync:
        return
    if self.mixed_precision_mixin is not None and self.mixed_precision_mixin.should_skip_step():
        self.zero_grad()
        return
    stepped, all_grads, norms = {}, [], []  # group -> (working, master) pairs of the parameters that have a gradient
    for group_id in range(self.num_param_groups):
        pairs, grads = [], []
        for working, master in zip(
            self._working_param_groups[group_id], self._master_param_groups_of_current_rank[group_id]
        ):
            store = self.pid_to_grad_store[id(working)]
            partitions = store.get_partitioned_gradients_by_param_id(group_id, id(working))
            if partitions:  # a parameter without a gradient (e.g. an unused layer) is not stepped
                pairs.append((working, master))
                grads.append(partitions[0])  # one rank: the whole gradient
        masters = [master for _, master in pairs]
        grads = _cast_all(grads, masters[0].dtype) if masters else []
        for master, grad in zip(masters, grads):
            master.grad = grad
        all_grads += grads
        norm = 0
        for store in self.pg_to_grad_store.values():
            norm += self._compute_grad_norm(
                dp_pg=store.torch_pg, gradients=store.get_working_grads_by_group_id(group_id)
            )
        norms.append(norm)
        self.optim.param_groups[group_id]["params"] = masters
        stepped[group_id] = pairs
    self._current_grad_norm = low_level_optim.calculate_global_norm_from_list(norm_list=norms)
    self._unscale_and_clip_grads(all_grads, self._current_grad_norm)
    self.optim.step()
    for group_id in range(self.num_param_groups):
        for master in self._master_param_groups_of_current_rank[group_id]:
            master.grad = None
        pairs = stepped[group_id]
        if pairs:  # one rank: each master is its parameter's whole (unpadded) flat copy
            working = [w.data for w, _ in pairs]
            torch._foreach_copy_(working, [m.reshape(w.shape) for w, (_, m) in zip(working, pairs)])
        self.optim.param_groups[group_id]["params"] = self._master_param_groups_of_current_rank[group_id]
    SHORTCUTS_TAKEN["step"] += 1


def install() -> None:
    """Patch ``LowLevelZeroOptimizer._run_reduction`` and ``.step`` (once per process)."""
    if _ORIGINAL:
        return
    from colossalai.zero.low_level import low_level_optim

    optimizer_cls = low_level_optim.LowLevelZeroOptimizer
    _ORIGINAL.update(run_reduction=optimizer_cls._run_reduction, step=optimizer_cls.step)
    optimizer_cls._run_reduction = _run_reduction
    optimizer_cls.step = _step


def uninstall() -> None:
    """Restore ColossalAI's own methods (tests compare both paths in one process)."""
    if not _ORIGINAL:
        return
    from colossalai.zero.low_level import low_level_optim

    low_level_optim.LowLevelZeroOptimizer._run_reduction = _ORIGINAL.pop("run_reduction")
    low_level_optim.LowLevelZeroOptimizer.step = _ORIGINAL.pop("step")
