"""Which buckets of a training config a table's clips fill: the bucket sampler's own epoch-0 plan, in words.

Built from the real ``VideoTextDataset`` (the config's dataset settings, e.g. ``target_fps``, on the given table) and
``BucketBatchSampler``, so the counts are the ones training will see on one rank, not a re-implementation.
"""

from __future__ import annotations

import logging
from typing import List, Mapping

import numpy as np


def bucket_summary(table_path, cfg: Mapping, num_ranks: int = 1) -> List[str]:
    """Lines describing how ``cfg``'s ``bucket_config`` takes the clips of ``table_path`` in epoch 0."""
    from opensora.registry import DATASETS, build_module

    from . import sampler as sampler_module
    from .sampler import BucketBatchSampler

    try:
        dataset = build_module(dict(cfg["dataset"]), DATASETS, data_path=str(table_path))
    except TypeError as error:  # a dataset type that does not read a table (rendered or synthetic data)
        from opensora.cli_errors import UserInputError

        raise UserInputError(
            f"the config's dataset (type {cfg['dataset'].get('type')!r}) does not read a table ({error}); "
            "summarise with a config whose dataset is a VideoTextDataset"
        ) from None
    quiet = logging.getLogger(sampler_module.__name__)
    level, quiet.level = quiet.level, logging.ERROR  # its "fit no bucket" warning is a line of this summary
    try:
        sampler = BucketBatchSampler(
            dataset, cfg["bucket_config"], num_replicas=num_ranks, rank=0, seed=int(cfg.get("seed") or 0)
        )
    finally:
        quiet.setLevel(level)
    plan = sampler.plan_epoch(0)
    table, usable = sampler.table, sampler.usable_frames
    heights, widths = sampler.heights, sampler.widths
    lines = [f"epoch 0 on {num_ranks} rank(s) ({len(usable)} clips; a clip takes the largest bucket it fits):"]
    fits = table.fits(usable, heights, widths)
    for j, bucket in enumerate(table.frame_buckets):
        lines.append(
            f"  bucket {bucket.resolution.name} x {bucket.num_frames} frames (probability {bucket.probability:g}, "
            f"batch {bucket.batch_size}): {int(fits[:, j].sum())} clips fit it"
        )
    counts = np.diff(plan.group_offsets)
    batches = np.bincount(plan.batch_group, minlength=len(counts)) * num_ranks
    for g, (frames, height, width) in enumerate(plan.group_shapes):
        lines.append(
            f"  -> {frames} frames at {height}x{width}: {int(counts[g])} clips, {int(batches[g])} full batches"
        )
    unfit = sampler.unbucketable_indices
    if len(unfit):
        big_enough = table.fits(np.full_like(usable, 1 << 30), heights, widths).any(axis=1)
        short = int(big_enough[unfit].sum())
        lines.append(
            f"  fit no bucket: {len(unfit)} clips ({short} too short after the frame interval, "
            f"{len(unfit) - short} smaller than every resolution), e.g. {dataset.paths[int(unfit[0])]}"
        )
    if len(plan) == 0:
        lines.append("  no full batch in epoch 0: add clips, lower the batch sizes or change bucket_config")
    return lines
