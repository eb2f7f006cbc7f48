"""Video-text dataset read from a csv or parquet table, decoded with PyAV.

Table columns: ``path`` (absolute, or relative to the table's directory), ``text`` (or ``caption``), and for
bucketing without decoding ``num_frames``, ``height``, ``width``, ``fps``. When any of those four is missing, the
files' headers are probed once at start-up (no frames are decoded; slow on huge tables, so add the columns there).

Samples are requested by key ``(index, T, H, W[, epoch])`` or its string form ``"index-T-H-W[-epoch]"``, as the
bucket sampler emits them; a plain ``int`` asks for the dataset's default ``(num_frames, image_size)``. The clip's
random temporal start depends only on ``(seed, epoch, index)``, so a resumed run decodes exactly the same clips.

Bad data never raises out of ``__getitem__`` / ``__getitems__``: ``load_sample`` raises ``BadSampleError`` and
the batch loader replaces the sample with a spare from the same bucket (see ``__getitems__``), recording
``(path, reason)`` in the batch so the main process can count and log it once.
"""

import logging
import os
from fractions import Fraction
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

try:
    import av
except ImportError:  # rendered datasets (MovingShapesDataset) need no PyAV; decoding files does
    av = None
import numpy as np
import pandas as pd
import torch

from opensora.cli_errors import UserInputError
from opensora.registry import DATASETS

from .media_probe import IMAGE_FPS, IMAGE_SUFFIXES, UnreadableMediaError, is_image, probe_header  # noqa: F401
from .transforms import resize_center_crop
from .video_io import frame_to_rgb

logger = logging.getLogger(__name__)

_METADATA_COLUMNS = ("num_frames", "height", "width", "fps")

SampleKey = Union[int, str, Tuple[int, ...]]


class BadSampleError(Exception):
    """A sample that cannot be loaded (missing, empty, truncated, undecodable or too short)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class SampleList(list):
    """The samples of one batch plus ``skipped``: ``(path, reason)`` of each bad sample that was replaced."""

    def __init__(self, samples=(), skipped=()):
        super().__init__(samples)
        self.skipped: List[Tuple[str, str]] = list(skipped)


def parse_sample_key(key) -> Tuple[int, int, int, int, int]:
    """``"i-T-H-W[-epoch]"`` or a tuple of the same -> ``(index, T, H, W, epoch)`` (epoch -1 = the dataset's)."""
    parts = key.split("-") if isinstance(key, str) else list(key)
    if len(parts) not in (4, 5):
        raise ValueError(f"sample key {key!r} must be 'index-T-H-W[-epoch]' or a tuple of 4 or 5 ints")
    values = [int(p) for p in parts]
    if len(values) == 4:
        values.append(-1)
    return tuple(values)


def format_sample_key(index: int, num_frames: int, height: int, width: int, epoch: int) -> str:
    return f"{index}-{num_frames}-{height}-{width}-{epoch}"


# ----------------------------------------------------------------------------------------------- metadata


def read_table(data_path) -> pd.DataFrame:
    path = Path(data_path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset table {path} does not exist")
    try:
        if path.suffix.lower() == ".csv":
            table = pd.read_csv(path)
        elif path.suffix.lower() in (".parquet", ".pq"):
            table = pd.read_parquet(path)
        else:
            raise UserInputError(f"dataset table {path} must be .csv or .parquet")
    except pd.errors.EmptyDataError:
        raise UserInputError(f"dataset table {path} is empty (no header, no rows)") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as error:
        raise UserInputError(f"dataset table {path} cannot be parsed: {error}") from None
    if "path" not in table.columns:
        raise UserInputError(f"dataset table {path} has no 'path' column (columns: {list(table.columns)})")
    if len(table) == 0:
        raise UserInputError(f"dataset table {path} has a header but no rows: nothing to train on")
    return table


def probe_media(path: str) -> Tuple[int, int, int, float]:
    """(num_frames, height, width, fps) from the file header, without decoding; zeros when unreadable."""
    try:
        info = probe_header(path)
    except UnreadableMediaError as error:  # any unreadable file: report, let the sampler leave it out
        logger.warning("cannot probe %s (%s): it will be left out", path, error)
        return 0, 0, 0, 0.0
    return info.num_frames, info.height, info.width, info.fps


# ----------------------------------------------------------------------------------------------- decoding


def _frame_index(frame, first_pts: int, time_base: Fraction, rate: Fraction) -> int:
    return int(round((frame.pts - first_pts) * time_base * rate))


def decode_frames(path: str, indices: Sequence[int], threads: int = 1) -> np.ndarray:
    """Decode frames ``indices`` (sorted, 0-based display order) of a video -> uint8 [T, H, W, 3].

    Seeks to the key frame before the first wanted frame and decodes forward, stopping after the last one;
    frame numbers come from presentation timestamps. When timestamps are missing or the seek lands past the
    wanted frame, it falls back to decoding from the start and counting frames. ``threads``: ffmpeg decoder
    threads (0: ffmpeg's choice, one per core).
    """
    indices = list(indices)
    try:
        frames = _decode_with_seek(path, indices, threads)
        if frames is None:
            frames = _decode_sequential(path, indices, threads)
    except BadSampleError:
        raise
    except Exception as error:  # PyAV raises many error types for broken files
        raise BadSampleError(path, f"cannot decode ({type(error).__name__}: {error})") from None
    return np.stack(frames)


def _decode_with_seek(path: str, indices: List[int], threads: int) -> Optional[List[np.ndarray]]:
    wanted = set(indices)
    found: Dict[int, np.ndarray] = {}
    last = indices[-1]
    with av.open(path) as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = threads
        rate = stream.average_rate or stream.guessed_rate
        time_base = stream.time_base
        if not rate or time_base is None:
            return None
        first_pts = stream.start_time or 0
        if indices[0] > 0:
            target = first_pts + int(Fraction(indices[0]) / Fraction(rate) / Fraction(time_base))
            container.seek(target, stream=stream, backward=True, any_frame=False)
        first_seen = None
        for frame in container.decode(stream):
            if frame.pts is None:
                return None
            index = _frame_index(frame, first_pts, time_base, rate)
            first_seen = index if first_seen is None else first_seen
            if first_seen > indices[0]:
                return None  # landed past the wanted frame: count from the start instead
            if index in wanted:
                found[index] = frame_to_rgb(frame)
            if index >= last:
                break
    if len(found) < len(indices):
        raise BadSampleError(path, _too_short_reason(indices, max(found, default=first_seen)))
    return [found[i] for i in indices]


def _decode_sequential(path: str, indices: List[int], threads: int) -> List[np.ndarray]:
    wanted = set(indices)
    found: Dict[int, np.ndarray] = {}
    index = -1
    with av.open(path) as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = threads
        for index, frame in enumerate(container.decode(stream)):
            if index in wanted:
                found[index] = frame_to_rgb(frame)
            if index >= indices[-1]:
                break
    if len(found) < len(indices):
        raise BadSampleError(path, _too_short_reason(indices, index))
    return [found[i] for i in indices]


def _too_short_reason(indices: Sequence[int], last_decoded: Optional[int]) -> str:
    seen = "no frames" if last_decoded is None or last_decoded < 0 else f"frames up to {last_decoded}"
    return f"too short or truncated: decoded {seen}, needed frame {indices[-1]}"


def load_image(path: str) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(path) as image:
            return np.array(image.convert("RGB"))[None]
    except Exception as error:
        raise BadSampleError(path, f"cannot read image ({type(error).__name__}: {error})") from None


# ----------------------------------------------------------------------------------------------- dataset


@DATASETS.register_module()
class VideoTextDataset(torch.utils.data.Dataset):
    """Video (or image) + caption pairs from a csv / parquet table.

    Args:
        data_path: the csv or parquet table.
        num_frames, image_size: clip shape for plain ``int`` indices (bucket keys carry their own).
        frame_interval: take every ``frame_interval``-th frame. Ignored when ``target_fps`` is set.
        target_fps: pick the interval per video as ``max(1, round(video_fps / target_fps))``.
        seed: with the epoch and index, fixes each clip's random start frame.
        interpolation: ``torch.nn.functional.interpolate`` mode for resizing.
        allow_empty_text: accept a table without a ``text``/``caption`` column (every caption empty: unconditional
            training). Without it such a table is an error, since it silently trains a model that ignores prompts.
        decode_threads: ffmpeg threads per video decoder. 1 by default: the DataLoader workers already decode
            clips in parallel, and for short clips starting threads costs more than it saves; 0 = one per core.
    """

    def __init__(
        self,
        data_path: str,
        num_frames: int = 16,
        image_size: Sequence[int] = (256, 256),
        frame_interval: int = 1,
        target_fps: Optional[float] = None,
        seed: int = 0,
        interpolation: str = "bilinear",
        allow_empty_text: bool = False,
        decode_threads: int = 1,
    ):
        if frame_interval < 1:
            raise ValueError(f"frame_interval must be >= 1, got {frame_interval}")
        self.data_path = str(data_path)
        self.num_frames_default = int(num_frames)
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self.seed = int(seed)
        self.interpolation = interpolation
        self.decode_threads = int(decode_threads)
        self.epoch = 0

        table = read_table(data_path)
        root = Path(data_path).resolve().parent
        self.paths: List[str] = [p if os.path.isabs(p) else str(root / p) for p in table["path"].astype(str)]
        text_column = "text" if "text" in table.columns else ("caption" if "caption" in table.columns else None)
        if text_column is None and not allow_empty_text:
            raise UserInputError(
                f"dataset table {data_path} has no 'text' (or 'caption') column (columns: {list(table.columns)}): "
                "add the captions, or set dataset.allow_empty_text=True to train without text on purpose"
            )
        self.texts: List[str] = (
            table[text_column].fillna("").astype(str).tolist() if text_column else [""] * len(self.paths)
        )
        self._load_frame_metadata(table)
        if target_fps:
            intervals = np.rint(np.where(self.fps > 0, self.fps, target_fps) / float(target_fps))
            self.frame_intervals = np.maximum(1, intervals).astype(np.int64)
        else:
            self.frame_intervals = np.full(len(self.paths), int(frame_interval), dtype=np.int64)
        self.frame_intervals[self.is_image] = 1

    def _load_frame_metadata(self, table: pd.DataFrame) -> None:
        self.is_image = np.array([is_image(p) for p in self.paths], dtype=bool)
        if all(column in table.columns for column in _METADATA_COLUMNS):
            values = table[list(_METADATA_COLUMNS)]
            self.num_frames = values["num_frames"].fillna(0).to_numpy(np.int64, copy=True)
            self.heights = values["height"].fillna(0).to_numpy(np.int64, copy=True)
            self.widths = values["width"].fillna(0).to_numpy(np.int64, copy=True)
            self.fps = values["fps"].fillna(0).to_numpy(np.float64, copy=True)
        else:
            missing = [c for c in _METADATA_COLUMNS if c not in table.columns]
            logger.info("%s lacks columns %s: probing %d file headers", self.data_path, missing, len(self.paths))
            probed = np.array([probe_media(p) for p in self.paths], dtype=np.float64).reshape(-1, 4)
            self.num_frames, self.heights, self.widths = (probed[:, i].astype(np.int64) for i in range(3))
            self.fps = probed[:, 3]
        self.num_frames[self.is_image] = np.minimum(self.num_frames[self.is_image], 1)
        self.fps[self.is_image] = IMAGE_FPS

    def __len__(self) -> int:
        return len(self.paths)

    def set_epoch(self, epoch: int) -> None:
        """Epoch used for plain ``int`` / 4-part keys (bucket sampler keys carry their own epoch)."""
        self.epoch = int(epoch)

    def usable_frames(self) -> np.ndarray:
        """Frames each sample can supply after its frame interval (what buckets compare ``T`` against)."""
        return np.where(self.num_frames > 0, (self.num_frames - 1) // self.frame_intervals + 1, 0)

    # -- loading

    def frame_indices(self, index: int, num_frames: int, epoch: int) -> List[int]:
        """The frame numbers of the clip: a random start (fixed by seed, epoch, index), then every interval."""
        interval = int(self.frame_intervals[index])
        span = (num_frames - 1) * interval + 1
        available = int(self.num_frames[index])
        if available < span:
            raise BadSampleError(self.paths[index], f"has {available} frames, needs {span} for {num_frames}x{interval}")
        rng = np.random.default_rng([self.seed, epoch, index])
        start = int(rng.integers(0, available - span + 1))
        return list(range(start, start + span, interval))

    def load_sample(self, key: SampleKey) -> dict:
        """Decode one sample; raises ``BadSampleError`` for bad data."""
        index, num_frames, height, width, epoch = self._resolve_key(key)
        frames, fps = self.read_frames(index, num_frames, epoch)
        video = resize_center_crop(frames, (height, width), self.interpolation)
        return dict(
            video=video,
            text=self.texts[index],
            fps=fps,
            num_frames=num_frames,
            height=height,
            width=width,
            path=self.paths[index],
            index=index,
        )

    def read_frames(self, index: int, num_frames: int, epoch: int) -> Tuple[np.ndarray, float]:
        """The clip's uint8 frames [T, H, W, 3] at source resolution and its fps; ``BadSampleError`` for bad data."""
        path = self.paths[index]
        if not os.path.exists(path):
            raise BadSampleError(path, "file is missing")
        if os.path.getsize(path) == 0:
            raise BadSampleError(path, "file is empty (0 bytes)")
        if self.is_image[index]:
            if num_frames != 1:
                raise BadSampleError(path, f"an image cannot fill a {num_frames}-frame clip")
            frames, fps = load_image(path), IMAGE_FPS
        else:
            frames = decode_frames(path, self.frame_indices(index, num_frames, epoch), self.decode_threads)
            fps = float(self.fps[index]) / float(self.frame_intervals[index]) if self.fps[index] > 0 else 0.0
        return frames, fps

    def _resolve_key(self, key: SampleKey) -> Tuple[int, int, int, int, int]:
        if isinstance(key, (int, np.integer)):
            index = int(key)
            num_frames = 1 if self.is_image[index] else self.num_frames_default
            index, num_frames, height, width, epoch = index, num_frames, *self.image_size, -1
        else:
            index, num_frames, height, width, epoch = parse_sample_key(key)
        if not 0 <= index < len(self.paths):
            raise IndexError(f"sample index {index} out of range for a dataset of {len(self.paths)}")
        return index, num_frames, height, width, self.epoch if epoch < 0 else epoch

    def __getitem__(self, key: SampleKey) -> Optional[dict]:
        """One sample, or ``None`` for bad data (``collate_samples`` drops and counts Nones)."""
        try:
            return self.load_sample(key)
        except BadSampleError as error:
            logger.debug("skipping %s", error)
            return None

    def __getitems__(self, keys: Sequence[SampleKey]) -> SampleList:
        """Load a batch. A bad sample is replaced by the next loadable key of ``keys.spares`` (same bucket, chosen
        by the sampler), else by repeating a good sample of this batch, so the batch keeps its size unless every
        candidate is bad (then it is empty). Each replaced sample's ``(path, reason)`` is in ``.skipped``."""
        spares = list(getattr(keys, "spares", ()))
        samples, skipped = SampleList(), []
        missing = 0
        for key in keys:
            sample = self._load_or_record(key, skipped)
            while sample is None and spares:
                sample = self._load_or_record(spares.pop(0), skipped)
            if sample is None:
                missing += 1
            else:
                samples.append(sample)
        for position in range(missing if samples else 0):
            samples.append(samples[position % len(samples)])
        samples.skipped = skipped
        return samples

    def _load_or_record(self, key: SampleKey, skipped: List[Tuple[str, str]]) -> Optional[dict]:
        try:
            return self.load_sample(key)
        except BadSampleError as error:
            logger.debug("skipping %s", error)
            skipped.append((error.path, error.reason))
            return None
