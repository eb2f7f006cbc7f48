"""Which clips a cache stores: each sample's bucket, frame indices and crop, decided exactly as training decides them.

The bucket sampler's own assignment (``BucketBatchSampler.bucket_assignment``, a pure function of seed, epoch and
the table's metadata) gives each sample its ``(T, H, W)`` bucket for each of the first ``epochs`` epochs; the
dataset's ``frame_indices`` gives the clip's frames for that epoch, and ``load_sample`` with the training key
``index-T-H-W-epoch`` decodes, resizes and crops it. Epochs that pick the same frames at the same shape share one
stored clip (``slots`` lists the epochs a clip serves).
"""

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from opensora.datasets.dataset import BadSampleError, VideoTextDataset, format_sample_key


@dataclass
class Clip:
    """One stored clip of one sample."""

    sample: int
    slots: List[int]
    resolution: str
    aspect: int
    shape: Tuple[int, int, int]  # (T, H, W) in pixels
    frame_indices: Optional[List[int]]
    key: str  # the training sample key that loads it (its first epoch)


@dataclass
class SamplePlan:
    sample: int
    clips: List[Clip] = field(default_factory=list)


def plan_clips(dataset, sampler, epochs: int) -> List[SamplePlan]:
    """Per sample, the distinct clips training would load in epochs ``0 .. epochs-1``."""
    plans = [SamplePlan(i) for i in range(len(dataset))]
    table = sampler.table
    for epoch in range(epochs):
        frame_bucket, aspect = sampler.bucket_assignment(epoch)
        for index in (frame_bucket >= 0).nonzero()[0].tolist():
            bucket = table.frame_buckets[int(frame_bucket[index])]
            shape = table.bucket_shape(int(frame_bucket[index]), int(aspect[index]))
            frames = _frame_indices(dataset, index, shape[0], epoch)
            same = [
                clip
                for clip in plans[index].clips
                if frames is not None and clip.shape == shape and clip.frame_indices == frames
            ]
            if same:
                same[0].slots.append(epoch)
                continue
            plans[index].clips.append(
                Clip(
                    sample=index,
                    slots=[epoch],
                    resolution=bucket.resolution.name,
                    aspect=int(aspect[index]),
                    shape=shape,
                    frame_indices=frames,
                    key=format_sample_key(index, *shape, epoch),
                )
            )
    return plans


def _frame_indices(dataset, index: int, num_frames: int, epoch: int) -> Optional[List[int]]:
    """The clip's frame numbers, or None where they are unknown before loading (then clips of different epochs are
    never shared): a dataset that renders its frames, or a video too short for the bucket (loading reports it)."""
    if type(dataset).read_frames is not VideoTextDataset.read_frames:
        return None
    if bool(dataset.is_image[index]):
        return [0]
    try:
        return list(dataset.frame_indices(index, num_frames, epoch))
    except BadSampleError:
        return None
