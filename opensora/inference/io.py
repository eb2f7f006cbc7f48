"""Sampling inputs and outputs: reference images/videos in, videos + JSON sidecars + samples.csv out."""

import csv
import json
import os
import tempfile
from io import StringIO
from pathlib import Path
from typing import Iterable, List, Mapping, Tuple

import numpy as np
import torch

from opensora.datasets.transforms import resize_center_crop
from opensora.file_modes import match_umask
from opensora.datasets.video_io import read_video, write_video


def read_reference_frames(path) -> np.ndarray:
    """uint8 ``[T, H, W, 3]`` from an image (T = 1) or a video file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"reference file not found: {path}")
    return read_video(path)


def load_reference(path, size: Tuple[int, int]) -> torch.Tensor:
    """Reference image or video -> float ``[3, T, H, W]`` in [-1, 1], resized to cover ``size`` and centre-cropped
    (the same transform as the training data)."""
    return resize_center_crop(read_reference_frames(path), tuple(size))


def to_uint8_frames(video: torch.Tensor) -> torch.Tensor:
    """``[B, 3, T, H, W]`` in [-1, 1] -> uint8 ``[B, T, H, W, 3]`` (on the CPU)."""
    return uint8_frames_on_device(video).cpu()


def uint8_frames_on_device(video: torch.Tensor) -> torch.Tensor:
    """``to_uint8_frames`` without the copy to the CPU (the result stays on ``video``'s device)."""
    pixels = ((video.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return pixels.permute(0, 2, 3, 4, 1).contiguous()


def save_sample(stem_path, frames, fps: float = 8.0, crf: int = 18) -> Path:
    """Write one sample: ``stem.mp4`` (``stem.png`` for a single frame). Returns the written path."""
    frames = np.asarray(frames)
    path = Path(f"{stem_path}{'.png' if frames.shape[0] == 1 else '.mp4'}")
    write_video(path, frames, fps=fps, crf=crf)
    return path


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", newline="") as f:
        f.write(text)
    match_umask(tmp)  # mkstemp made it 0600; the mp4 beside it has open()'s mode
    os.replace(tmp, path)


def write_sidecar(path, record: Mapping) -> Path:
    """JSON next to a sample (``stem.json``) describing how it was made."""
    path = Path(path)
    _atomic_write_text(path, json.dumps(dict(record), indent=1, default=str) + "\n")
    return path


def write_samples_csv(save_dir, rows: Iterable[Mapping]) -> Path:
    """``save_dir/samples.csv`` with columns ``path,text`` (paths relative to ``save_dir``), the input of
    ``tools/eval_moving_shapes.py``."""
    save_dir = Path(save_dir)
    path = save_dir / "samples.csv"
    buffer = StringIO()
    writer = csv.DictWriter(buffer, fieldnames=["path", "text"], lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({"path": str(row["path"]), "text": row["text"]})
    _atomic_write_text(path, buffer.getvalue())
    return path


def save_samples(save_dir, prompts, videos, fps: float = 8.0) -> List[Path]:
    """Each of ``videos`` as ``save_dir/{index}_{slug}`` (``save_sample``) and their ``samples.csv`` (prompt per
    clip, re-scorable by ``tools/eval_moving_shapes.py``); returns the written paths in order."""
    from opensora.inference.prompts import sample_stem

    paths = [
        save_sample(Path(save_dir) / sample_stem(i, p), frames, fps=fps)
        for i, (p, frames) in enumerate(zip(prompts, videos))
    ]
    write_samples_csv(save_dir, [dict(path=path.name, text=p) for path, p in zip(paths, prompts)])
    return paths
