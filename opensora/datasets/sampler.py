"""Distributed, deterministic, resumable batch sampler over resolution / frame-count buckets.

Each epoch (everything below is a pure function of ``(seed, epoch)`` and the metadata, identical on all ranks):

1. every sample is assigned a bucket (``BucketTable.assign``) from the table's columns, never by decoding;
2. the members of each bucket are shuffled and cut into batches of the bucket's batch size (``drop_last`` drops
   each bucket's partial batch, otherwise it is kept as a smaller batch);
3. all batches are shuffled together and dealt out to ranks round-robin: rank ``r`` gets batches
   ``r, r + world_size, ...``. Every rank gets the same number of batches: with ``drop_last`` the surplus is
   dropped, otherwise the list is padded by repeating batches from its start.

A batch is a ``KeyBatch``: a list of sample keys ``"index-T-H-W-epoch"`` plus ``spares``, keys of other samples of
the same bucket the dataset uses, in order, to replace a bad sample (see ``VideoTextDataset.__getitems__``).

Resuming: the sampler cannot know how many batches the training loop has consumed (DataLoader workers prefetch),
so the consumer says so with ``advance()``; ``ResumableDataLoader`` does it for every batch it yields.
``state_dict()`` is ``{"epoch", "batches_consumed", "seed", "num_replicas"}``; after ``load_state_dict`` the next
iteration starts at the next unconsumed batch of that epoch.
"""

import logging
from dataclasses import dataclass
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from opensora.cli_errors import UserInputError

from .buckets import BucketTable
from .dataset import format_sample_key

logger = logging.getLogger(__name__)


class KeyBatch(list):
    """Sample keys of one batch; ``spares`` are same-bucket keys to use in place of bad samples."""

    def __init__(self, keys=(), spares=()):
        super().__init__(keys)
        self.spares = list(spares)


@dataclass(frozen=True)
class EpochPlan:
    """One rank's batches of one epoch, as arrays (no per-batch Python objects: plans can be large).

    ``members[group_offsets[g]:group_offsets[g+1]]`` are bucket ``g``'s samples in shuffled order; batch ``b`` is
    ``members[batch_start[b]:batch_start[b] + batch_length[b]]`` of bucket ``batch_group[b]``.
    """

    members: np.ndarray
    group_offsets: np.ndarray
    group_shapes: List[Tuple[int, int, int]]
    batch_group: np.ndarray
    batch_start: np.ndarray
    batch_length: np.ndarray

    def __len__(self) -> int:
        return len(self.batch_group)


def _default_rank_and_world() -> Tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class BucketBatchSampler(torch.utils.data.Sampler):
    """Yields ``KeyBatch`` lists for one rank.

    Args:
        dataset: anything with ``usable_frames()``, ``heights``, ``widths`` arrays (``VideoTextDataset``). One that
            also has ``fixed_bucket_assignment(epoch, table)`` (stored clips) fixes the buckets; the plan's shuffles
            are unchanged, and ``check_bucket_table(table)`` refuses a bucket config it cannot serve.
        bucket_config: ``{resolution: {num_frames: (probability, batch_size)}}``, see ``buckets.py``.
        num_replicas, rank: data-parallel world size and this rank (default: from torch.distributed, else 1, 0).
        seed: shared by all ranks.
        drop_last: drop partial batches and the batches that do not divide evenly over ranks.
        num_spares: replacement keys per batch (default: the batch size).
        size_multiple, aspect_ratios: forwarded to ``BucketTable``.
    """

    def __init__(
        self,
        dataset,
        bucket_config: Mapping,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        seed: int = 0,
        drop_last: bool = True,
        num_spares: Optional[int] = None,
        size_multiple: int = 16,
        aspect_ratios: Optional[Sequence[Tuple[str, float]]] = None,
    ):
        default_rank, default_world = _default_rank_and_world()
        self.num_replicas = default_world if num_replicas is None else int(num_replicas)
        self.rank = default_rank if rank is None else int(rank)
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is not in [0, {self.num_replicas})")
        self.table = BucketTable(bucket_config, size_multiple=size_multiple, aspect_ratios=aspect_ratios)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.num_spares = num_spares
        self.usable_frames = np.asarray(dataset.usable_frames(), dtype=np.int64)
        self.heights = np.asarray(dataset.heights, dtype=np.int64)
        self.widths = np.asarray(dataset.widths, dtype=np.int64)
        self.epoch = 0
        self.batches_consumed = 0
        self._plan_cache: Dict[int, EpochPlan] = {}
        # a dataset of stored clips (CachedLatentDataset) decides each sample's bucket itself
        self._fixed_assignment = getattr(dataset, "fixed_bucket_assignment", None)
        if self._fixed_assignment is not None:
            dataset.check_bucket_table(self.table)
        self._report_unbucketable(dataset)

    def _report_unbucketable(self, dataset) -> None:
        fits_any = self.table.fits(self.usable_frames, self.heights, self.widths).any(axis=1)
        self.unbucketable_indices = np.flatnonzero(~fits_any)
        if len(self.unbucketable_indices):
            paths = getattr(dataset, "paths", None)
            examples = [paths[i] if paths else int(i) for i in self.unbucketable_indices[:5]]
            logger.warning(
                "%d of %d samples fit no bucket (too small, too short, or unreadable metadata) and are never "
                "used; e.g. %s",
                len(self.unbucketable_indices),
                len(self.usable_frames),
                examples,
            )

    def check_has_batches(self, name: str = "the dataset") -> None:
        """Raise ``UserInputError`` unless epoch 0 gives every rank at least one batch (a full global batch).

        Without this, a dataset too small for ``num_replicas x batch size`` (with ``drop_last``), or one whose
        samples all fit no bucket, makes every epoch empty and the training loop spins forever.
        """
        if len(self.plan_epoch(0)) > 0:
            return
        fits = self.table.fits(self.usable_frames, self.heights, self.widths)
        needs = []
        for j, bucket in enumerate(self.table.frame_buckets):
            need = bucket.batch_size * (self.num_replicas if self.drop_last else 1)
            needs.append(
                f"{bucket.resolution.name} x {bucket.num_frames} frames: batch size {bucket.batch_size} x "
                f"{self.num_replicas} rank(s) = {need} samples, {int(fits[:, j].sum())} fit it"
            )
        usable = len(self.usable_frames) - len(self.unbucketable_indices)
        raise UserInputError(
            f"{name}: no full global batch: {usable} usable sample(s) of {len(self.usable_frames)} "
            f"({len(self.unbucketable_indices)} fit no bucket: too small, too short or unreadable); one global batch "
            f"needs one batch per rank from a single bucket ({'; '.join(needs)}). Add data, lower the batch sizes "
            "in bucket_config, or use fewer ranks"
        )

    # -- planning (pure in seed, epoch)

    def plan_epoch(self, epoch: int) -> EpochPlan:
        """All batches of ``epoch`` for this rank, in order."""
        if epoch not in self._plan_cache:
            self._plan_cache = {epoch: self._plan(epoch)}  # keep one epoch: plans can be large
        return self._plan_cache[epoch]

    def bucket_assignment(self, epoch: int) -> Tuple[np.ndarray, np.ndarray]:
        """Per sample: the frame bucket (-1: sits out) and aspect-ratio index that ``epoch``'s plan uses."""
        return self._assign(epoch, np.random.default_rng([self.seed, epoch]))

    def _assign(self, epoch: int, rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
        # draws from ``rng`` even when the dataset fixes the buckets, so the shuffles that follow stay the same
        drawn = self.table.assign(self.usable_frames, self.heights, self.widths, rng)
        return drawn if self._fixed_assignment is None else self._fixed_assignment(epoch, self.table)

    def _plan(self, epoch: int) -> EpochPlan:
        rng = np.random.default_rng([self.seed, epoch])
        frame_bucket, aspect = self._assign(epoch, rng)
        num_ratios = len(self.table.ratio_values)
        codes = np.where(frame_bucket >= 0, frame_bucket * num_ratios + aspect, -1)
        present = np.flatnonzero(np.bincount(codes[codes >= 0], minlength=1))
        # Buckets are (frame bucket, final shape): exact-size resolutions merge all aspect ratios.
        bucket_of_code = {}
        for code in present.tolist():
            frame_bucket_index, ratio_index = divmod(code, num_ratios)
            bucket_of_code[code] = (frame_bucket_index, self.table.bucket_shape(frame_bucket_index, ratio_index))
        buckets = sorted(set(bucket_of_code.values()))
        code_to_group = np.full(max(1, len(self.table.frame_buckets) * num_ratios), -1, dtype=np.int64)
        for code, bucket in bucket_of_code.items():
            code_to_group[code] = buckets.index(bucket)
        group = np.where(codes >= 0, code_to_group[np.maximum(codes, 0)], -1)

        # shuffle all samples, then stable-sort by bucket: each bucket's members end up contiguous and shuffled
        order = rng.permutation(len(group))
        order = order[group[order] >= 0]
        members = order[np.argsort(group[order], kind="stable")]
        counts = np.bincount(group[group >= 0], minlength=len(buckets))
        group_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

        batch_group, batch_start, batch_length = [], [], []
        for g, (frame_bucket_index, _) in enumerate(buckets):
            batch_size = self.table.batch_size(frame_bucket_index)
            starts = np.arange(0, counts[g], batch_size)
            lengths = np.minimum(batch_size, counts[g] - starts)
            if self.drop_last:
                starts, lengths = starts[lengths == batch_size], lengths[lengths == batch_size]
            batch_group.append(np.full(len(starts), g))
            batch_start.append(group_offsets[g] + starts)
            batch_length.append(lengths)
        batch_group, batch_start, batch_length = (
            np.concatenate(a).astype(np.int64) if a else np.zeros(0, np.int64)
            for a in (batch_group, batch_start, batch_length)
        )
        batch_order = rng.permutation(len(batch_group))
        remainder = len(batch_order) % self.num_replicas
        if remainder and self.drop_last:
            batch_order = batch_order[: len(batch_order) - remainder]
        elif remainder:  # pad by repeating batches from the start so every rank gets as many
            padding = self.num_replicas - remainder
            batch_order = np.concatenate([batch_order, batch_order[np.arange(padding) % len(batch_order)]])
        mine = batch_order[self.rank :: self.num_replicas]
        return EpochPlan(
            members,
            group_offsets,
            [shape for _, shape in buckets],
            batch_group[mine],
            batch_start[mine],
            batch_length[mine],
        )

    # -- iteration and resume

    def __len__(self) -> int:
        """Batches per epoch for this rank (the whole epoch, regardless of the resume position)."""
        return len(self.plan_epoch(self.epoch))

    def __iter__(self) -> Iterator[KeyBatch]:
        epoch, start = self.epoch, self.batches_consumed
        plan = self.plan_epoch(epoch)
        for position in range(start, len(plan)):
            yield self._keys(plan, position, epoch)

    def _keys(self, plan: EpochPlan, position: int, epoch: int) -> KeyBatch:
        group = plan.batch_group[position]
        begin, length = plan.batch_start[position], plan.batch_length[position]
        bucket = plan.members[plan.group_offsets[group] : plan.group_offsets[group + 1]]
        local_begin = begin - plan.group_offsets[group]
        # spares: the bucket's samples after this batch, wrapping around, never the batch itself
        num_spares = length if self.num_spares is None else int(self.num_spares)
        count = min(num_spares, len(bucket) - length)
        spares = bucket[(local_begin + length + np.arange(count)) % len(bucket)]
        shape = plan.group_shapes[group]

        def key(index) -> str:
            return format_sample_key(int(index), *shape, epoch)

        return KeyBatch([key(i) for i in bucket[local_begin : local_begin + length]], [key(i) for i in spares])

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` from its first batch; a no-op for the current epoch, so a resumed position survives
        the usual ``sampler.set_epoch(epoch)`` at the top of the epoch loop."""
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self.batches_consumed = 0

    def advance(self, num_batches: int = 1) -> None:
        """Record that the training loop consumed ``num_batches`` more batches of the current epoch."""
        self.batches_consumed += int(num_batches)

    def state_dict(self) -> dict:
        return dict(
            epoch=self.epoch, batches_consumed=self.batches_consumed, seed=self.seed, num_replicas=self.num_replicas
        )

    def load_state_dict(self, state: Mapping) -> None:
        saved_replicas = state.get("num_replicas", self.num_replicas)
        if saved_replicas != self.num_replicas:
            logger.warning(
                "sampler state was saved with %d ranks, resuming on %d: the epoch restarts from its first batch",
                saved_replicas,
                self.num_replicas,
            )
        if int(state["seed"]) != self.seed:
            logger.warning("sampler state has seed %s (config: %s): using the saved seed", state["seed"], self.seed)
            self.seed = int(state["seed"])
            self._plan_cache = {}
        self.epoch = int(state["epoch"])
        self.batches_consumed = int(state["batches_consumed"]) if saved_replicas == self.num_replicas else 0
