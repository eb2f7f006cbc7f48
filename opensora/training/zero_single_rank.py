"""Skip the communication ColossalAI 0.5.0's ZeRO optimizer does when its process group has one rank.

On one GPU ``LowLevelZeroOptimizer`` still runs the multi-rank data path, and every step makes passes over
parameter-sized memory that only move bytes from one buffer to another:

* each gradient bucket (``_run_reduction``) is flattened into a new buffer, divided by the world size (1) in
  place, then reduce-scattered over one rank into another new buffer (a copy) that the gradients become views of;
* after the optimizer step the bf16 copies of the masters are gathered (``TensorBucket.all_gather``): flattened
  into one buffer, all-gathered over one rank into another (a copy), each tensor flattened again (a copy per
  tensor) and copied into its parameter (another copy per tensor).

With one rank a sum over ranks and a division by 1 are the identity, so ``install()`` makes both do only what
changes the result: the bucket's flat gradient buffer becomes the reduced gradient itself, and the gathered
tensors are copied straight into their parameters with one multi-tensor copy. Bit for bit the same values; groups
of more than one rank, fp8 communication and a communication dtype different from the gradients' take
ColossalAI's own path. Idempotent.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_ORIGINAL: dict = {}
SHORTCUTS_TAKEN = {"reduction": 0, "gather": 0}  # counts, so tests can tell which path ran


def _one_rank(group) -> bool:
    if isinstance(group, tuple):
        return all(dist.get_world_size(g) == 1 for g in group)
    return dist.get_world_size(group) == 1


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


def _all_gather(self, group=None, fp8_communication: bool = False):
    if not _one_rank(group):
        return _ORIGINAL["all_gather"](self, group, fp8_communication)
    targets = [self._write_back_pairs[tensor] for tensor in self._bucket]
    sources = [
        tensor.reshape(-1)[: target.numel()].reshape(target.shape) for tensor, target in zip(self._bucket, targets)
    ]
    torch._foreach_copy_([target.data for target in targets], sources)
    self.empty()
    SHORTCUTS_TAKEN["gather"] += 1


def install() -> None:
    """Patch ``LowLevelZeroOptimizer._run_reduction`` and ``TensorBucket.all_gather`` (once per process)."""
    if _ORIGINAL:
        return
    from colossalai.zero.low_level import low_level_optim
    from colossalai.zero.low_level.bookkeeping import tensor_bucket

    optimizer_cls = low_level_optim.LowLevelZeroOptimizer
    _ORIGINAL.update(run_reduction=optimizer_cls._run_reduction, all_gather=tensor_bucket.TensorBucket.all_gather)
    optimizer_cls._run_reduction = _run_reduction
    tensor_bucket.TensorBucket.all_gather = _all_gather


def uninstall() -> None:
    """Restore ColossalAI's own methods (tests compare both paths in one process)."""
    if not _ORIGINAL:
        return
    from colossalai.zero.low_level import low_level_optim
    from colossalai.zero.low_level.bookkeeping import tensor_bucket

    low_level_optim.LowLevelZeroOptimizer._run_reduction = _ORIGINAL.pop("run_reduction")
    tensor_bucket.TensorBucket.all_gather = _ORIGINAL.pop("all_gather")
