"""DataLoader over bucket batches, with bad-sample accounting and exact resume.

``build_dataloader`` returns ``(loader, sampler)``. ``loader`` is a ``ResumableDataLoader``: iterate it for batch
dicts (the dataset sample fields default-collated, plus ``num_skipped``: how many bad samples were replaced while
building this batch). It tells the sampler about every batch it hands out, so ``loader.state_dict()`` taken after
a training step resumes at exactly the next batch, however far the workers had prefetched. Bad files are counted
(``loader.num_skipped``, ``loader.bad_paths``) and logged once each, here in the main process.
"""

import atexit
import logging
import random
import signal
import weakref
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, default_collate

from opensora.cli_errors import UserInputError

from .sampler import BucketBatchSampler

logger = logging.getLogger(__name__)


def collate_samples(samples: Sequence[Optional[dict]]) -> dict:
    """Default-collate the good samples; count the bad ones (``None`` entries, or a ``SampleList.skipped``).

    Returns the collated dict plus ``num_skipped`` (int) and ``skipped`` (list of ``(path, reason)``). When no
    sample is good the dict holds only ``num_samples = 0`` and those two keys.
    """
    skipped: List[Tuple[str, str]] = list(getattr(samples, "skipped", ()))
    good = [s for s in samples if s is not None]
    skipped += [("<unknown>", "dataset returned None")] * (len(samples) - len(good))
    batch = default_collate(good) if good else {}
    batch["num_samples"] = len(good)
    batch["num_skipped"] = len(skipped)
    batch["skipped"] = skipped
    return batch


def seed_worker(worker_id: int) -> None:
    """Seed the global RNGs of a worker from torch's per-worker seed (our dataset does not use them, but
    user transforms might)."""
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)
    # stop signals are the main process's (graceful preemption: finish the step, save): a worker that Ctrl-C or
    # Slurm's SIGTERM killed would fail the very step being finished. Workers still exit with their parent, and the
    # main process shuts them down at exit (``_shut_down_workers_at_exit``): terminate() cannot.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


# Worker iterators still open. At interpreter exit torch leaves their workers to multiprocessing, which sends them
# SIGTERM (ignored above) and then joins them without a timeout: a run that ended with its loader open hung there
# for good (seen on GPU runs with persistent workers). This atexit hook runs before both (atexit is last-in,
# first-out) and shuts the workers down the normal way: their index queues get the end marker and they return.
_OPEN_ITERATORS: "weakref.WeakSet" = weakref.WeakSet()


@atexit.register
def _shut_down_workers_at_exit() -> None:
    for iterator in list(_OPEN_ITERATORS):
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def _track_open_iterator(iterator) -> None:
    """Shut ``iterator``'s workers down at exit, before torch's own exit hooks for them. With persistent workers
    and pinned memory torch registers, while building the iterator, one hook per worker that joins it for 5 s and
    then sends SIGTERM: workers never told to stop (and ignoring SIGTERM) cost 5 s each, a minute at 12 workers
    (seen on the GPU). Registering again makes this hook the latest, so it runs first (atexit is last-in,
    first-out) and torch's joins find the workers gone."""
    _OPEN_ITERATORS.add(iterator)
    atexit.unregister(_shut_down_workers_at_exit)
    atexit.register(_shut_down_workers_at_exit)


class ResumableDataLoader:
    """Iterates a ``DataLoader`` driven by a ``BucketBatchSampler`` and keeps the sampler's resume position.

    * every batch it yields (and every batch of only bad samples, which it skips) advances the sampler by one,
      before the batch is handed out: a checkpoint saved after training on it resumes at the next one;
    * one ``for batch in loader`` walks the rest of the current epoch; ``set_epoch(epoch + 1)`` moves on
      (``set_epoch`` with the current epoch keeps a resumed position);
    * ``state_dict()`` = the sampler's state + the skip count; ``load_state_dict()`` restores both.
    """

    def __init__(self, dataloader: DataLoader, sampler: BucketBatchSampler):
        self.dataloader = dataloader
        self.sampler = sampler
        self.num_skipped = 0
        self.bad_paths: Dict[str, str] = {}

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        """Batches in the current epoch for this rank (whole epoch)."""
        return len(self.sampler)

    @property
    def num_batches_remaining(self) -> int:
        return max(0, len(self.sampler) - self.sampler.batches_consumed)

    def __iter__(self) -> Iterator[dict]:
        """The rest of the current epoch (all of it unless resumed mid-epoch). Call ``set_epoch(epoch + 1)``
        before iterating again for the next epoch, as with torch's DistributedSampler."""
        batches = iter(self.dataloader)
        _track_open_iterator(batches)
        for batch in batches:
            self.sampler.advance(1)
            self._record_skips(batch.pop("skipped"))
            if batch["num_samples"] == 0:
                logger.warning("a batch of epoch %d had only bad samples and no spares; skipped it", self.epoch)
                continue
            yield batch

    def batches_forever(self) -> Iterator[dict]:
        """Batches epoch after epoch (from a resumed position first). An epoch iterated from its first batch that
        yields nothing (every planned sample bad) raises ``UserInputError`` instead of looping forever."""
        while True:
            fresh, yielded = self.sampler.batches_consumed == 0, False
            for batch in self:
                yielded = True
                yield batch
            if fresh and not yielded:
                example = next(iter(self.bad_paths.items()), None)
                raise UserInputError(
                    f"epoch {self.epoch} yielded no batch: every sample planned for it was bad ({len(self.bad_paths)} "
                    f"bad file(s), e.g. {': '.join(example) if example else 'none recorded'}); fix or remove them"
                )
            self.set_epoch(self.epoch + 1)

    def _record_skips(self, skipped: Sequence[Tuple[str, str]]) -> None:
        self.num_skipped += len(skipped)
        for path, reason in skipped:
            if path not in self.bad_paths:
                self.bad_paths[path] = reason
                logger.warning("skipping bad sample %s: %s (%d bad files so far)", path, reason, len(self.bad_paths))

    def state_dict(self) -> dict:
        return dict(self.sampler.state_dict(), num_skipped=self.num_skipped, num_bad_files=len(self.bad_paths))

    def load_state_dict(self, state: Mapping) -> None:
        self.sampler.load_state_dict(state)
        self.num_skipped = int(state.get("num_skipped", 0))


def build_dataloader(
    dataset,
    bucket_config: Mapping,
    num_workers: int = 0,
    pin_memory: bool = True,
    seed: int = 0,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    prefetch_factor: Optional[int] = 2,
    drop_last: bool = True,
    persistent_workers: bool = False,
    num_spares: Optional[int] = None,
    size_multiple: int = 16,
    aspect_ratios=None,
    multiprocessing_context=None,
    check_batches: bool = True,
) -> Tuple[ResumableDataLoader, BucketBatchSampler]:
    """A resumable loader over ``dataset`` bucketed by ``bucket_config`` for this rank; returns (loader, sampler).

    ``rank`` / ``world_size`` default to torch.distributed's (or 0 / 1). ``pin_memory`` is ignored without CUDA.
    ``check_batches``: refuse (``UserInputError``) a dataset whose first epoch has no full global batch.
    """
    sampler = BucketBatchSampler(
        dataset,
        bucket_config,
        num_replicas=world_size,
        rank=rank,
        seed=seed,
        drop_last=drop_last,
        num_spares=num_spares,
        size_multiple=size_multiple,
        aspect_ratios=aspect_ratios,
    )
    if check_batches:
        sampler.check_has_batches(getattr(dataset, "data_path", type(dataset).__name__))
    extra = {}
    if num_workers > 0:
        extra = dict(
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            worker_init_fn=seed_worker,
            multiprocessing_context=multiprocessing_context,
        )
    dataloader = DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate_samples,
        pin_memory=bool(pin_memory) and torch.cuda.is_available(),
        generator=torch.Generator().manual_seed(int(seed) * 1000 + sampler.rank),  # worker seeds
        **extra,
    )
    return ResumableDataLoader(dataloader, sampler), sampler
