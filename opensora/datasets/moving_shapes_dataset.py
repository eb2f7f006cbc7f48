"""MovingShapes rendered on the fly: the demo data without files (no video decoding, no disk).

Same clips as ``tools/make_demo_dataset.py`` writes for the same seed and size (before mp4 compression), served
through the ``VideoTextDataset`` interface so buckets, the resumable sampler and the trainer treat it like any
table of videos. Useful on machines without PyAV and for benchmarks that must not measure decoding.
"""

from typing import Tuple

import numpy as np

from opensora.datasets import moving_shapes as shapes
from opensora.datasets.dataset import IMAGE_FPS, VideoTextDataset
from opensora.registry import DATASETS


@DATASETS.register_module()
class MovingShapesDataset(VideoTextDataset):
    def __init__(self, num: int = 720, seed: int = 0, height: int = 32, width: int = 32, num_frames: int = 16,
                 fps: float = 8.0, frame_interval: int = 1, interpolation: str = "bilinear"):
        if num < 1:
            raise ValueError(f"num must be >= 1, got {num}")
        self.data_path = f"moving_shapes(num={num}, seed={seed}, {height}x{width}x{num_frames})"
        self.num_frames_default = int(num_frames)
        self.image_size = (int(height), int(width))
        self.seed = int(seed)
        self.interpolation = interpolation
        self.epoch = 0
        self.combos = shapes.dataset_attributes(num, seed)
        self.paths = [f"moving_shapes/{i:06d}" for i in range(num)]  # names for logs; nothing is on disk
        self.texts = [shapes.caption(*combo) for combo in self.combos]
        self.is_image = np.zeros(num, dtype=bool)
        self.num_frames = np.full(num, num_frames, dtype=np.int64)
        self.heights = np.full(num, height, dtype=np.int64)
        self.widths = np.full(num, width, dtype=np.int64)
        self.fps = np.full(num, float(fps), dtype=np.float64)
        self.frame_intervals = np.full(num, int(frame_interval), dtype=np.int64)

    def read_frames(self, index: int, num_frames: int, epoch: int) -> Tuple[np.ndarray, float]:
        motion = shapes.clip_motion(index, self.combos[index], self.seed, int(self.heights[index]),
                                    int(self.widths[index]), image=False)
        clip = shapes.render_video(motion, int(self.heights[index]), int(self.widths[index]), int(self.num_frames[index]))
        frames = clip[self.frame_indices(index, num_frames, epoch)]
        fps = float(self.fps[index]) / float(self.frame_intervals[index]) if num_frames > 1 else IMAGE_FPS
        return frames, fps
