"""An mp4 that grows while a video is being generated: frames are encoded and muxed as they arrive.

Fragmented mp4 (``movflags=frag_every_frame+empty_moov``: the header comes first, then one self-contained fragment
per frame) with x264's ``zerolatency`` tuning (no look-ahead, no B-frames: a frame's packet leaves the encoder at
once) and a key frame every ``keyframe_interval`` frames (the streaming CLI uses the chunk's frame count, so a
player can start at any chunk). A reader opening the file mid-generation decodes every frame written so far but
the newest one (the muxer holds a packet until the next one gives its duration; measured with PyAV 18: after
chunks of 4 frames, 3 / 7 / 11 / 15 frames decode; with ``frag_keyframe`` the lag grew to 2). ``close`` finishes
the file.
"""

from pathlib import Path
from typing import Optional

import numpy as np


class StreamingVideoWriter:
    """``write(frames)`` uint8 [T, H, W, 3] as often as needed, then ``close()`` (or use it as a context manager)."""

    def __init__(
        self, path, height: int, width: int, fps: float = 8.0, crf: int = 18, keyframe_interval: Optional[int] = None
    ):
        import av  # imported where used, as in datasets/video_io.py

        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "wb")
        self._container = av.open(
            self._file, mode="w", format="mp4", options={"movflags": "frag_every_frame+empty_moov+default_base_moof"}
        )
        stream = self._container.add_stream("libx264", rate=int(round(fps)))
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p" if width % 2 == 0 and height % 2 == 0 else "yuv444p"  # as write_video
        options = {"crf": str(crf), "tune": "zerolatency"}
        if keyframe_interval:
            options.update(g=str(keyframe_interval), keyint_min=str(keyframe_interval))
        stream.options = options
        self._stream, self._av = stream, av
        self.frames_written = 0
        self.packets_muxed = 0

    def write(self, frames) -> None:
        frames = np.asarray(frames)
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"expected uint8 frames [T, H, W, 3], got {frames.dtype} {frames.shape}")
        for frame in frames:
            video_frame = self._av.VideoFrame.from_ndarray(frame, format="rgb24")
            video_frame.pts = self.frames_written
            self.frames_written += 1
            self._mux(self._stream.encode(video_frame))
        self._file.flush()  # what was muxed is on disk for readers

    def _mux(self, packets) -> None:
        for packet in packets:
            self._container.mux(packet)
            self.packets_muxed += 1

    def close(self) -> None:
        if self._container is None:
            return
        self._mux(self._stream.encode())  # drain the encoder
        self._container.close()
        self._file.close()
        self._container = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class BatchVideoWriters:
    """One ``StreamingVideoWriter`` per sample of a batch (``stems`` -> ``stem.mp4``), opened by the first chunk:
    ``write(frames)`` takes a chunk's uint8 [B, T, H, W, 3] and appends row i to sample i's file; key frames at
    chunk starts (every chunk but a causal autoencoder's first has the first one's frame count). The one-GPU
    ``--streaming`` path and the two-GPU pipeline write through it, so equal frames give byte-identical files."""

    def __init__(self, stems, height: int, width: int, fps: float):
        self.stems, self.height, self.width, self.fps = list(stems), height, width, fps
        self.writers = []

    @property
    def paths(self):
        return [Path(stem).with_suffix(".mp4") for stem in self.stems]

    def write(self, frames) -> None:
        frames = np.asarray(frames)
        if not self.writers:
            self.writers = [
                StreamingVideoWriter(path, self.height, self.width, fps=self.fps, keyframe_interval=frames.shape[1])
                for path in self.paths
            ]
        for writer, sample in zip(self.writers, frames):
            writer.write(sample)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
