"""Video-text data: the dataset (csv/parquet + PyAV), buckets, the resumable bucket sampler, the loader."""

from .buckets import ASPECT_RATIOS, RESOLUTION_AREAS, BucketTable, parse_resolution
from .dataloader import ResumableDataLoader, build_dataloader, collate_samples
from .dataset import BadSampleError, VideoTextDataset, format_sample_key, parse_sample_key
from .sampler import BucketBatchSampler, KeyBatch

__all__ = [
    "ASPECT_RATIOS",
    "RESOLUTION_AREAS",
    "BadSampleError",
    "BucketBatchSampler",
    "BucketTable",
    "KeyBatch",
    "ResumableDataLoader",
    "VideoTextDataset",
    "build_dataloader",
    "collate_samples",
    "format_sample_key",
    "parse_resolution",
    "parse_sample_key",
]

from . import (
    cached_latents,  # noqa: E402,F401  (registers CachedLatentDataset)
    moving_shapes_dataset,  # noqa: E402,F401  (registers MovingShapesDataset)
    synthetic_latents,  # noqa: E402,F401  (registers SyntheticLatentDataset)
)
