"""Resolution / aspect-ratio / frame-count buckets.

A ``bucket_config`` maps a resolution name to ``{num_frames: (probability, batch_size)}``::

    bucket_config = {
        "256px": {1: (1.0, 16), 33: (0.5, 4)},
        "144p": {33: (1.0, 8)},
    }

Resolution names:

* ``"<N>px"``  -> a square pixel area ``N * N`` (``"256px"`` = 65,536 pixels),
* ``"<N>p"``   -> a 16:9 pixel area ``N * round(N * 16 / 9)`` (``"144p"`` = 144 x 256; see ``RESOLUTION_AREAS``),
* ``"<H>x<W>"`` -> exactly ``H x W`` for every aspect ratio (e.g. ``"64x64"`` for a demo of square crops).

For an area name, each video goes to the aspect-ratio bucket (``ASPECT_RATIOS``, height / width) closest to its
own in log space; the bucket size keeps the area and that ratio, with height and width rounded to a multiple of
``size_multiple``. The clip is then resized to cover the bucket and centre-cropped (see ``transforms.py``).

Assignment of one sample for one epoch (vectorised over samples, deterministic for ``(seed, epoch)``): try the
resolutions from the largest area down, and within each the frame counts from the largest down. A
``(resolution, T)`` bucket accepts the sample when the video has at least that many pixels (``H*W >= area``;
``H >= h and W >= w`` for an explicit ``HxW``), has at least ``T`` frames after the frame interval, and a uniform
draw is below the bucket's probability. The first bucket that accepts wins; samples no bucket accepts sit out the
epoch (too small or too short ones sit out every epoch and are reported by the sampler).
"""

import math
import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

# Named pixel areas whose width is not round(N * 16 / 9).
RESOLUTION_AREAS: Dict[str, int] = {
    "144p": 144 * 256,
    "240p": 240 * 426,
    "360p": 360 * 640,
    "480p": 480 * 854,
    "720p": 720 * 1280,
    "1080p": 1080 * 1920,
}

# (name "height:width", height / width). Wide enough to cover portrait phones to cinema scope.
ASPECT_RATIOS: Tuple[Tuple[str, float], ...] = (
    ("1:3", 1 / 3),
    ("9:21", 9 / 21),
    ("1:2", 1 / 2),
    ("9:16", 9 / 16),
    ("2:3", 2 / 3),
    ("3:4", 3 / 4),
    ("1:1", 1.0),
    ("4:3", 4 / 3),
    ("3:2", 3 / 2),
    ("16:9", 16 / 9),
    ("2:1", 2.0),
    ("21:9", 21 / 9),
    ("3:1", 3.0),
)


@dataclass(frozen=True)
class Resolution:
    """A named resolution: either a pixel area (bucketed by aspect ratio) or an exact ``(height, width)``."""

    name: str
    area: int
    exact_size: Optional[Tuple[int, int]] = None


def parse_resolution(name: str) -> Resolution:
    """Turn ``"256px"``, ``"144p"`` or ``"64x48"`` into a ``Resolution``; a clear error for anything else."""
    key = str(name).strip()
    if key in RESOLUTION_AREAS:
        return Resolution(key, RESOLUTION_AREAS[key])
    match = re.fullmatch(r"(\d+)px", key)
    if match:
        side = int(match.group(1))
        return Resolution(key, side * side)
    match = re.fullmatch(r"(\d+)p", key)
    if match:
        height = int(match.group(1))
        return Resolution(key, height * round(height * 16 / 9))
    match = re.fullmatch(r"(\d+)x(\d+)", key)
    if match:
        height, width = int(match.group(1)), int(match.group(2))
        return Resolution(key, height * width, (height, width))
    raise ValueError(
        f"unknown resolution name {name!r} in bucket_config: use '<N>px' (N*N pixels), '<N>p' (16:9, "
        f"e.g. {sorted(RESOLUTION_AREAS)}) or '<H>x<W>' (exact size)"
    )


def round_to_multiple(value: float, multiple: int) -> int:
    return max(multiple, int(round(value / multiple)) * multiple)


def bucket_size(area: int, ratio: float, size_multiple: int) -> Tuple[int, int]:
    """(height, width) with about ``area`` pixels and ``height / width ~= ratio``."""
    height = math.sqrt(area * ratio)
    return round_to_multiple(height, size_multiple), round_to_multiple(area / height, size_multiple)


def closest_aspect_ratio(heights: np.ndarray, widths: np.ndarray, ratios: Sequence[float]) -> np.ndarray:
    """Index into ``ratios`` of the ratio closest (in log space) to each ``height / width``."""
    log_ratio = np.log(np.maximum(heights, 1) / np.maximum(widths, 1))[:, None]
    return np.abs(log_ratio - np.log(np.asarray(ratios, dtype=np.float64))[None, :]).argmin(axis=1)


@dataclass(frozen=True)
class FrameBucket:
    """One ``(resolution, num_frames)`` entry of a bucket config."""

    resolution: Resolution
    num_frames: int
    probability: float
    batch_size: int


def _parse_entry(resolution: str, num_frames, entry) -> Tuple[int, float, int]:
    try:
        frames = int(num_frames)
    except (TypeError, ValueError):
        raise ValueError(f"bucket_config[{resolution!r}] has a non-integer num_frames key {num_frames!r}") from None
    if isinstance(entry, (int, np.integer)) and not isinstance(entry, bool):
        probability, batch_size = 1.0, int(entry)
    elif isinstance(entry, Sequence) and len(entry) == 2:
        probability, batch_size = float(entry[0]), int(entry[1])
    else:
        raise ValueError(
            f"bucket_config[{resolution!r}][{num_frames!r}] must be (probability, batch_size) or a batch size, "
            f"got {entry!r}"
        )
    if frames < 1 or batch_size < 1 or not 0.0 <= probability <= 1.0:
        raise ValueError(
            f"bucket_config[{resolution!r}][{num_frames!r}] = {entry!r}: need num_frames >= 1, batch_size >= 1 "
            "and 0 <= probability <= 1"
        )
    return frames, probability, batch_size


class BucketTable:
    """Parsed ``bucket_config``: which sample goes to which ``(T, H, W)`` bucket, and each bucket's batch size.

    Bucket ids are ``(frame_bucket_index, aspect_ratio_index)``; ``bucket_shape(bucket_id)`` is ``(T, H, W)``.
    """

    def __init__(
        self,
        bucket_config: Mapping,
        size_multiple: int = 16,
        aspect_ratios: Optional[Sequence[Tuple[str, float]]] = None,
    ):
        if not bucket_config:
            raise ValueError("bucket_config is empty: give at least one {resolution: {num_frames: (prob, bs)}}")
        self.size_multiple = int(size_multiple)
        self.aspect_ratios = tuple(aspect_ratios or ASPECT_RATIOS)
        self.ratio_values = [float(value) for _, value in self.aspect_ratios]
        buckets: List[FrameBucket] = []
        for res_name, frames_config in bucket_config.items():
            resolution = parse_resolution(res_name)
            if not isinstance(frames_config, Mapping) or not frames_config:
                raise ValueError(f"bucket_config[{res_name!r}] must be a non-empty {{num_frames: (prob, bs)}} dict")
            for num_frames, entry in frames_config.items():
                frames, probability, batch_size = _parse_entry(res_name, num_frames, entry)
                buckets.append(FrameBucket(resolution, frames, probability, batch_size))
        # Try order: largest area first, then most frames first (stable for equal keys).
        buckets.sort(key=lambda b: (-b.resolution.area, -b.num_frames))
        self.frame_buckets: Tuple[FrameBucket, ...] = tuple(buckets)

    def bucket_shape(self, frame_bucket: int, aspect_index: int) -> Tuple[int, int, int]:
        bucket = self.frame_buckets[frame_bucket]
        if bucket.resolution.exact_size is not None:
            height, width = bucket.resolution.exact_size
        else:
            height, width = bucket_size(bucket.resolution.area, self.ratio_values[aspect_index], self.size_multiple)
        return bucket.num_frames, height, width

    def batch_size(self, frame_bucket: int) -> int:
        return self.frame_buckets[frame_bucket].batch_size

    def fits(self, num_frames: np.ndarray, heights: np.ndarray, widths: np.ndarray) -> np.ndarray:
        """[N, num_frame_buckets] bool: sample i is big and long enough for frame bucket j (ignoring probability)."""
        columns = []
        for bucket in self.frame_buckets:
            if bucket.resolution.exact_size is not None:
                big_enough = (heights >= bucket.resolution.exact_size[0]) & (widths >= bucket.resolution.exact_size[1])
            else:
                big_enough = heights.astype(np.int64) * widths >= bucket.resolution.area
            columns.append(big_enough & (num_frames >= bucket.num_frames))
        return np.stack(columns, axis=1) if columns else np.zeros((len(heights), 0), dtype=bool)

    def assign(
        self, num_frames: np.ndarray, heights: np.ndarray, widths: np.ndarray, rng: np.random.Generator
    ) -> Tuple[np.ndarray, np.ndarray]:
        """Per sample: frame bucket index (-1 = sits out this epoch) and aspect-ratio index.

        ``num_frames`` counts the frames usable after the frame interval. One uniform draw per (sample, bucket)
        keeps the result independent of dict order and of which other samples are present.
        """
        num_frames, heights, widths = (np.asarray(a, dtype=np.int64) for a in (num_frames, heights, widths))
        fits = self.fits(num_frames, heights, widths)
        draws = rng.random(fits.shape)
        probabilities = np.array([b.probability for b in self.frame_buckets])[None, :]
        accepted = fits & (draws < probabilities)
        chosen = np.where(accepted.any(axis=1), accepted.argmax(axis=1), -1)
        aspect = closest_aspect_ratio(heights, widths, self.ratio_values)
        return chosen, aspect


def first_bucket(bucket_config: Mapping) -> Tuple[str, int]:
    """(resolution name, frame count) of a bucket config's first bucket: the clip size a config trains on first,
    which validation samples and the sampler defaults to for a training config."""
    if not bucket_config:
        raise ValueError("bucket_config is empty")
    resolution = next(iter(bucket_config))
    return str(resolution), int(next(iter(bucket_config[resolution])))
