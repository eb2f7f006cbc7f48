"""MovingShapes rendered on the fly: the demo data without files (no video decoding, no disk).

Same clips as ``tools/make_demo_dataset.py`` writes for the same seed and size (before mp4 compression), served
through the ``VideoTextDataset`` interface so buckets, the resumable sampler and the trainer treat it like any
table of videos. Useful on machines without PyAV and for benchmarks that must not measure decoding.

``where`` keeps only the clips whose attributes match, e.g. ``where=dict(direction="left")`` or
``where=dict(shape=["triangle", "square"])`` (a subset to finetune on); kept clips are the very same clips as in the
unfiltered dataset (same index streams), so a subset of ``num`` clips holds about ``num * fraction`` of them.

``motion="bounce"`` / ``"wrap"`` serves clips of the long-clip modes (``moving_shapes.sample_motion``): the shape
travels at the speed of a ``reference_frames`` clip (default: ``num_frames``) from a start anywhere on its path, so
the clips are windows of endless bouncing / wrapping motion (a teacher trained on them knows what comes next).
"""

from typing import Mapping, Optional, Tuple

import numpy as np

from opensora.datasets import moving_shapes as shapes
from opensora.datasets.dataset import IMAGE_FPS, VideoTextDataset
from opensora.registry import DATASETS


@DATASETS.register_module()
class MovingShapesDataset(VideoTextDataset):
    def __init__(
        self,
        num: int = 720,
        seed: int = 0,
        height: int = 32,
        width: int = 32,
        num_frames: int = 16,
        fps: float = 8.0,
        frame_interval: int = 1,
        interpolation: str = "bilinear",
        where: Optional[Mapping] = None,
        motion: str = "linear",
        reference_frames: Optional[int] = None,
    ):
        if num < 1:
            raise ValueError(f"num must be >= 1, got {num}")
        if motion not in shapes.MOTIONS:
            raise ValueError(f"MovingShapesDataset motion {motion!r} unknown; choose from {list(shapes.MOTIONS)}")
        self.motion = motion
        self.reference_frames = int(reference_frames or num_frames)
        combos = shapes.dataset_attributes(num, seed)
        self.clip_ids = _matching(combos, where)
        num = len(self.clip_ids)
        self.data_path = (
            f"moving_shapes(num={num}, seed={seed}, {height}x{width}x{num_frames}"
            f"{f', where={dict(where)}' if where else ''}{f', motion={motion}' if motion != 'linear' else ''})"
        )
        self.num_frames_default = int(num_frames)
        self.image_size = (int(height), int(width))
        self.seed = int(seed)
        self.interpolation = interpolation
        self.epoch = 0
        self.combos = [combos[i] for i in self.clip_ids]
        self.paths = [f"moving_shapes/{i:06d}" for i in self.clip_ids]  # names for logs; nothing is on disk
        self.texts = [shapes.caption(*combo) for combo in self.combos]
        self.is_image = np.zeros(num, dtype=bool)
        self.num_frames = np.full(num, num_frames, dtype=np.int64)
        self.heights = np.full(num, height, dtype=np.int64)
        self.widths = np.full(num, width, dtype=np.int64)
        self.fps = np.full(num, float(fps), dtype=np.float64)
        self.frame_intervals = np.full(num, int(frame_interval), dtype=np.int64)

    def read_frames(self, index: int, num_frames: int, epoch: int) -> Tuple[np.ndarray, float]:
        motion = shapes.clip_motion(
            self.clip_ids[index],
            self.combos[index],
            self.seed,
            int(self.heights[index]),
            int(self.widths[index]),
            image=False,
            motion=self.motion,
            reference_frames=self.reference_frames,
        )
        clip = shapes.render_video(
            motion, int(self.heights[index]), int(self.widths[index]), int(self.num_frames[index])
        )
        frames = clip[self.frame_indices(index, num_frames, epoch)]
        fps = float(self.fps[index]) / float(self.frame_intervals[index]) if num_frames > 1 else IMAGE_FPS
        return frames, fps


def _matching(combos, where: Optional[Mapping]) -> list:
    """Indices of the (color, shape, direction) combos that ``where`` keeps (all without ``where``)."""
    if not where:
        return list(range(len(combos)))
    columns = ("color", "shape", "direction")
    unknown = [key for key in where if key not in columns]
    if unknown:
        raise ValueError(f"MovingShapesDataset where: unknown attribute(s) {unknown}; use {list(columns)}")
    allowed = {key: {value} if isinstance(value, str) else set(value) for key, value in where.items()}
    vocab = dict(color=set(shapes.PALETTE), shape=set(shapes.SHAPES), direction=set(shapes.DIRECTIONS))
    for key, values in allowed.items():
        if not values <= vocab[key]:
            raise ValueError(
                f"MovingShapesDataset where: {key} {sorted(values - vocab[key])} unknown; "
                f"choose from {sorted(vocab[key])}"
            )
    kept = [
        i
        for i, combo in enumerate(combos)
        if all(combo[columns.index(key)] in values for key, values in allowed.items())
    ]
    if not kept:
        raise ValueError(f"MovingShapesDataset where={dict(where)} keeps no clip")
    return kept
