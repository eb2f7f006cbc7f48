"""Skip the per-tensor passes ColossalAI 0.5.0's ZeRO optimizer makes around its step, on one rank and on several.

On one GPU ``LowLevelZeroOptimizer`` still runs the multi-rank data path, and every step makes passes over
parameter-sized memory that only move bytes from one buffer to another:

* each gradient bucket (``_run_reduction``) is flattened into a new buffer, divided by the world size (1) in
  place, then reduce-scattered over one rank into another new buffer (a copy) that the gradients become views of;
* the optimizer step casts each gradient to fp32 with its own ``.to()`` (a launch and an allocation per tensor,
  ~340 tensors at 1B), and afterwards casts each master back to bf16 and gathers those casts
  (``TensorBucket.all_gather``): flattened into one buffer, all-gathered over one rank into another (a copy), each
  tensor flattened again (a copy per tensor) and copied into its parameter (another copy per tensor).

With one rank a sum over ranks and a division by 1 are the identity, so ``install()`` makes both do only what
changes the result. For the plain ``LowLevelZeroOptimizer`` (not subclasses such as HybridParallel's, whose sequence
parallelism reads the gradient store in the backward) the gradients are left where autograd puts them: the backward's
per-parameter hooks only note the order the gradients arrive in, instead of queueing each into a bucket, copying the
bucket into a flat buffer and filing a view of it per parameter (about five host ops per parameter tensor a step, host
time a host-bound step pays); the step reads ``param.grad`` and sums the norm in that arrival order, as ColossalAI sums
its store. Otherwise the bucket's flat gradient buffer becomes the reduced gradient itself. The step casts all
gradients into one fp32 buffer with one multi-tensor copy and writes the updated masters straight into the bf16
parameters with another (``copy_`` rounds fp32 to bf16 exactly as ``.to()`` does). Bit for bit the same values
(gradient norm, clipping and the inner optimizer are ColossalAI's / ``zero_sync``'s, called as before).

With several ranks (``install(multi_rank=True)``, the default) the backward's reduce-scatter stays ColossalAI's; the
step casts this rank's gradient shards with one multi-tensor copy as above and, after the inner optimizer, gathers the
parameters without the tensor bucket's per-tensor work: per chunk of at most the bucket size (elements per rank,
ColossalAI's bound too) the updated master shards are cast by one multi-tensor copy straight into this rank's slice
of one bf16 buffer, one in-place ``all_gather_into_tensor`` fills the other ranks' slices (as FSDP2 does), and one
multi-tensor copy writes every parameter from its pieces (rank r's shard is elements ``[r*s, (r+1)*s)`` of the
parameter's flat view; the last shard's padding is not copied). The all-gather only moves bytes, so the parameters
get the same bits as through ``TensorBucket``. Only plain data parallelism takes it: one ZeRO process group (not
an n-d tuple), no tensor / pipeline parallel group of more than one rank.

fp8 communication, a communication dtype different from the gradients', CPU offload, ``overlap_allgather`` and
``master_weights=False`` take ColossalAI's own path. Idempotent.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_ORIGINAL: dict = {}
ENABLED = {"single_rank": True, "multi_rank": True, "grads_in_place": True}  # set by install()
SHORTCUTS_TAKEN = {"reduction": 0, "step": 0, "multi_rank_step": 0, "grads_in_place": 0}  # so tests see which path ran
_ARRIVALS = "_opensora_grad_arrivals"  # optimizer attribute: {id(param): (group_id, param)} in backward order


def _communicates_gradient_bytes(optimizer) -> bool:
    """No fp8 and no other dtype on the wire: communication moves the gradients' own bytes."""
    return not optimizer._fp8_communication and optimizer._communication_dtype in (None, optimizer._dtype)


def _reduction_is_identity(optimizer) -> bool:
    return _communicates_gradient_bytes(optimizer) and all(
        store.world_size == 1 for store in optimizer.pg_to_bucket_store.values()
    )


def _run_reduction(self):
    if not (ENABLED["single_rank"] and _reduction_is_identity(self)):
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


def _plain_data_parallel(optimizer) -> bool:
    """One ZeRO process group, a plain one, and no tensor / pipeline group of more than one rank."""
    groups = list(optimizer.pg_to_param_list)
    if len(groups) != 1 or isinstance(groups[0], tuple):
        return False
    return all(
        getattr(optimizer, name, None) is None or dist.get_world_size(getattr(optimizer, name)) == 1
        for name in ("tp_pg", "pp_pg")
    )


def _step_path(optimizer) -> str | None:
    """``"local"`` (one rank), ``"gather"`` (several ranks) or None (ColossalAI's own step)."""
    if not optimizer._master_weights or optimizer._cpu_offload or optimizer._overlap_allgather:
        return None
    if ENABLED["single_rank"] and _reduction_is_identity(optimizer):
        return "local"
    if ENABLED["multi_rank"] and _communicates_gradient_bytes(optimizer) and _plain_data_parallel(optimizer):
        return "gather"
    return None


def _grads_in_place(optimizer) -> bool:
    """One rank, the plain ``LowLevelZeroOptimizer`` and the one-rank step: the gradients can stay in ``.grad``.
    Asked once per parameter per backward, so the answer is kept while ``ENABLED`` is unchanged (the rest is fixed
    when the optimizer is built)."""
    key = tuple(ENABLED.values())
    kept = optimizer.__dict__.get("_opensora_grads_in_place")
    if kept is not None and kept[0] == key:
        return kept[1]
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    answer = (
        ENABLED["grads_in_place"]
        and type(optimizer) is LowLevelZeroOptimizer
        and optimizer._dtype != torch.float16  # fp16's loss scaler looks for overflow in the store's gradients
        and len(optimizer.pg_to_grad_store) == 1
        and _step_path(optimizer) == "local"
    )
    optimizer._opensora_grads_in_place = (key, answer)
    return answer


def _add_to_bucket(self, param, group_id):
    if not _grads_in_place(self):
        return _ORIGINAL["add_to_bucket"](self, param, group_id)
    # the first arrival's place, as ColossalAI's store keeps it when a later backward adds to a gradient
    self.__dict__.setdefault(_ARRIVALS, {}).setdefault(id(param), (group_id, param))


def _zero_grad_stores(self):
    # what ColossalAI leaves after zero_grad, also for set_to_none=False: the gradients that reached the store are
    # gone from .grad (a zeroed .grad left behind would be re-added by ZeRO-1's end-of-backward sweep and stepped)
    for _, param in self.__dict__.pop(_ARRIVALS, {}).values():
        param.grad = None
    return _ORIGINAL["zero_grad_stores"](self)


def _arrived_grad(param):
    """A noted gradient, flat; one cleared since the backward (``model.zero_grad()`` before ``step()``) is refused:
    ColossalAI's store would still hold it."""
    if param.grad is None:
        raise RuntimeError(
            "a gradient of this backward was cleared before optimizer.step() (model.zero_grad() between backward and "
            "step?): on one rank the gradients stay in .grad; zero them through the optimizer after its step, or set "
            "grads_in_place=False in the plugin config"
        )
    return param.grad.reshape(-1)


def _cast_all(tensors: list, dtype: torch.dtype) -> list:
    """``[t.to(dtype) for t in tensors]`` as views of one new buffer filled by one multi-tensor copy (tensors already
    of ``dtype`` are returned as they are, as ``.to()`` does)."""
    if not tensors or tensors[0].dtype == dtype:
        return list(tensors)
    sizes = [t.numel() for t in tensors]
    pieces = torch.empty(sum(sizes), dtype=dtype, device=tensors[0].device).split(sizes)
    if all(t.dim() == 1 for t in tensors):  # ZeRO's gradient shards are flat: the pieces need no view each
        casts = list(pieces)
    else:
        casts = [piece.view(t.shape) for piece, t in zip(pieces, tensors)]
    torch._foreach_copy_(casts, tensors)
    return casts


def _write_back_lists(self, stepped: list) -> tuple:
    """(each stepped parameter's data, its master viewed in the parameter's shape) for the one-rank write-back, kept
    on the optimizer while the stepped pairs are the same tensors on the same storage: a view and an alias per
    parameter tensor every step are host time a host-bound step pays. Masters that cannot be viewed in the
    parameter's shape are reshaped (a copy) every step instead, as before."""
    key = tuple((id(w), w.data_ptr(), m.data_ptr()) for w, m in stepped)
    cached = getattr(self, "_opensora_write_back", None)
    if cached is not None and cached[0] == key:
        return cached[1], cached[2]
    working = [w.data for w, _ in stepped]
    try:
        masters = [m.view(w.shape) for w, (_, m) in zip(working, stepped)]
    except RuntimeError:  # not viewable: no cache (a copy would go stale)
        return working, [m.reshape(w.shape) for w, (_, m) in zip(working, stepped)]
    self._opensora_write_back = (key, working, masters)
    return working, masters


def _chunks(pairs: list, bound: float) -> list:
    """``pairs`` cut in order into runs whose masters hold at most ``bound`` elements together (a larger one alone)."""
    chunks, current, size = [], [], 0
    for pair in pairs:
        numel = pair[1].numel()
        if current and size + numel > bound:
            chunks.append(current)
            current, size = [], 0
        current.append(pair)
        size += numel
    return chunks + [current] if current else chunks


def _gather_into_params(self, pairs: list) -> None:
    """Write every working parameter of ``pairs`` ((working, master shard) in the same order on every rank) from all
    ranks' updated master shards: what ColossalAI's ``TensorBucket.all_gather`` writes, with three launches per chunk
    instead of several per tensor."""
    store = self.pid_to_bucket_store[id(pairs[0][0])]
    world, rank = store.world_size, store.local_rank
    for chunk in _chunks(pairs, store.reduce_bucket_size):
        sizes = [master.numel() for _, master in chunk]
        total = sum(sizes)
        gathered = torch.empty(world * total, dtype=self._dtype, device=chunk[0][1].device)
        local = gathered[rank * total : (rank + 1) * total]
        torch._foreach_copy_(list(local.split(sizes)), [master for _, master in chunk])
        dist.all_gather_into_tensor(gathered, local, group=store.torch_pg)
        shards = gathered.split(sizes * world)  # rank-major: rank r's shard of chunk[i] is shards[r * len(chunk) + i]
        targets, sources = [], []
        for i, ((working, _), size) in enumerate(zip(chunk, sizes)):
            if size == 0:
                continue
            # the flat parameter split like its padded copy; the last piece is short by the padding (or absent)
            for r, target in enumerate(working.data.view(-1).split(size)):
                targets.append(target)
                sources.append(shards[r * len(chunk) + i][: target.numel()])
        torch._foreach_copy_(targets, sources)


def _from_store(self, group_id: int) -> tuple:
    """(working, master) pairs and this rank's gradient shards of the group's parameters that have one (an unused
    layer has none and is not stepped), from ColossalAI's gradient store; None: the norm reads the store."""
    pairs, grads = [], []
    for working, master in zip(
        self._working_param_groups[group_id], self._master_param_groups_of_current_rank[group_id]
    ):
        store = self.pid_to_grad_store[id(working)]
        partitions = store.get_partitioned_gradients_by_param_id(group_id, id(working))
        if partitions:
            pairs.append((working, master))
            grads.append(partitions[0 if self._partition_grads else store.local_rank])
    return pairs, grads, None


def _master_of(self) -> dict:
    """{id(working parameter): (it, its master)}, kept while the groups' lists are the same lists of the same length
    (ColossalAI builds them once; a checkpoint load copies into the masters)."""
    groups = self._master_param_groups_of_current_rank
    key = tuple(
        (id(groups[g]), len(groups[g]), id(self._working_param_groups[g])) for g in range(self.num_param_groups)
    )
    kept = self.__dict__.get("_opensora_master_of")
    if kept is None or kept[0] != key:
        pairs = (zip(self._working_param_groups[g], groups[g]) for g in range(self.num_param_groups))
        kept = (key, {id(w): (w, m) for group in pairs for w, m in group})
        self._opensora_master_of = kept
    return kept[1]


def _zero_optimizer(optimizer):
    """The LowLevelZero optimizer (or subclass) inside booster wrappers, or None."""
    while optimizer is not None and not hasattr(optimizer, "_master_param_groups_of_current_rank"):
        optimizer = getattr(optimizer, "optim", None)
    return optimizer


def master_shards(optimizer) -> tuple[dict, set] | None:
    """({id(working parameter): this rank's 1-D master piece}, {(local rank, ranks) of every parameter's shard
    group}) for a LowLevelZero optimizer (or a subclass) with its masters on the device; the pieces are what the
    optimizer step writes (``ema_sharded.ShardedEMA`` folds them in). None for other optimizers or CPU-offloaded
    masters. Kept while the lists are the same."""
    optimizer = _zero_optimizer(optimizer)
    if optimizer is None or optimizer._cpu_offload:
        return None
    pairs = _master_of(optimizer)
    kept = optimizer.__dict__.get("_opensora_master_shards")
    if kept is not None and kept[0] is pairs:
        return kept[1]
    stores = optimizer.pid_to_bucket_store
    found = (
        {key: master for key, (_, master) in pairs.items()},
        {(stores[key].local_rank, stores[key].world_size) for key in pairs},
    )
    optimizer._opensora_master_shards = (pairs, found)
    return found


def whole_masters(optimizer) -> dict | None:
    """{id(working parameter): its fp32 master viewed in the parameter's shape} where a LowLevelZero optimizer (or a
    subclass) runs on one rank with master weights on the GPU: each master is then its parameter's whole flat copy,
    written by every step, whichever step path runs. For readers of the exact weights (the EMA). None elsewhere:
    several ranks hold shards; CPU-offloaded masters; other optimizers; masters of the weights' own dtype, where the
    weights are the masters' bits. Kept while the lists are the same."""
    optimizer = _zero_optimizer(optimizer)
    if optimizer is None or not optimizer._master_weights or optimizer._cpu_offload or optimizer._overlap_allgather:
        return None
    if any(store.world_size != 1 for store in optimizer.pg_to_bucket_store.values()):
        return None
    pairs = _master_of(optimizer)
    kept = optimizer.__dict__.get("_opensora_whole_masters")
    if kept is not None and kept[0] is pairs:
        return kept[1]
    whole = {}
    for key, (working, master) in pairs.items():
        if master.dtype == working.dtype or master.numel() != working.numel():
            return None
        whole[key] = master.view(working.shape)
    optimizer._opensora_whole_masters = (pairs, whole)
    return whole


def _step(self, closure=None):
    path = _step_path(self)
    if path is None:
        return _ORIGINAL["step"](self, closure)
    from colossalai.zero.low_level import low_level_optim

    assert closure is None, "closure is not supported by step()"
    if not self.require_grad_sync:
        return
    if self.mixed_precision_mixin is not None and self.mixed_precision_mixin.should_skip_step():
        self.zero_grad()
        return
    # the gradients left in .grad: those whose hook ran (the store would hold exactly these), flat
    arrivals = self.__dict__.get(_ARRIVALS, {}) if path == "local" and _grads_in_place(self) else None
    stepped, all_grads, norms = [], [], []  # (working, master) pairs of the parameters that have a gradient
    for group_id in range(self.num_param_groups):
        if arrivals is None:
            pairs, grads, norm_grads = _from_store(self, group_id)
        else:  # in arrival order, the order the store would list them in for the norm
            master_of = _master_of(self)
            pairs = [master_of[id(p)] for g, p in arrivals.values() if g == group_id]
            grads = norm_grads = [_arrived_grad(working) for working, _ in pairs]
        masters = [master for _, master in pairs]
        casts = _cast_all(grads, masters[0].dtype) if masters else []
        for master, grad in zip(masters, casts):
            master.grad = grad
        all_grads += casts
        norm = 0
        for store in self.pg_to_grad_store.values():
            norm += self._compute_grad_norm(
                dp_pg=store.torch_pg,
                gradients=store.get_working_grads_by_group_id(group_id) if norm_grads is None else norm_grads,
            )
        norms.append(norm)
        self.optim.param_groups[group_id]["params"] = masters
        stepped += pairs
    self._current_grad_norm = low_level_optim.calculate_global_norm_from_list(norm_list=norms)
    self._unscale_and_clip_grads(all_grads, self._current_grad_norm)
    self.optim.step()
    for group_id in range(self.num_param_groups):
        for master in self._master_param_groups_of_current_rank[group_id]:
            master.grad = None
        self.optim.param_groups[group_id]["params"] = self._master_param_groups_of_current_rank[group_id]
    if stepped and path == "local":  # one rank: each master is its parameter's whole (unpadded) flat copy
        torch._foreach_copy_(*_write_back_lists(self, stepped))
    elif stepped:
        _gather_into_params(self, stepped)
    SHORTCUTS_TAKEN["step" if path == "local" else "multi_rank_step"] += 1
    SHORTCUTS_TAKEN["grads_in_place"] += arrivals is not None


def install(single_rank: bool = True, multi_rank: bool = True, grads_in_place: bool = True) -> None:
    """Patch ``LowLevelZeroOptimizer``'s ``_run_reduction``, ``step``, ``_add_to_bucket`` and ``zero_grad_stores``
    (once per process) and choose which shortcuts they take: ``single_rank`` (groups of one rank), ``grads_in_place``
    (with it, one rank's gradients stay in ``.grad``; off: through the store) and ``multi_rank`` (the step of plain
    data parallel groups)."""
    ENABLED.update(single_rank=bool(single_rank), multi_rank=bool(multi_rank), grads_in_place=bool(grads_in_place))
    if _ORIGINAL:
        return
    from colossalai.zero.low_level import low_level_optim

    optimizer_cls = low_level_optim.LowLevelZeroOptimizer
    _ORIGINAL.update(
        run_reduction=optimizer_cls._run_reduction,
        step=optimizer_cls.step,
        add_to_bucket=optimizer_cls._add_to_bucket,
        zero_grad_stores=optimizer_cls.zero_grad_stores,
    )
    optimizer_cls._run_reduction = _run_reduction
    optimizer_cls.step = _step
    optimizer_cls._add_to_bucket = _add_to_bucket
    optimizer_cls.zero_grad_stores = _zero_grad_stores


def uninstall() -> None:
    """Restore ColossalAI's own methods (tests compare both paths in one process)."""
    if not _ORIGINAL:
        return
    from colossalai.zero.low_level import low_level_optim

    for name, original in (
        ("_run_reduction", "run_reduction"),
        ("step", "step"),
        ("_add_to_bucket", "add_to_bucket"),
        ("zero_grad_stores", "zero_grad_stores"),
    ):
        setattr(low_level_optim.LowLevelZeroOptimizer, name, _ORIGINAL.pop(original))
