"""What a video or image file holds (frames, size, frame rate, duration), read with PyAV / Pillow.

Two depths: ``probe_header`` reads the container header only (the dataset's start-up fallback when a table lacks the
metadata columns: cheap, trusts the header), ``probe_checked`` also counts the video packets and decodes the first
frame, so a truncated, empty or undecodable file is found when a table is built instead of during training.
Both raise ``UnreadableMediaError`` with the reason.
"""

from dataclasses import dataclass
from pathlib import Path

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
VIDEO_SUFFIXES = (".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v", ".mpg", ".mpeg", ".gif")
# fps reported for still images (a large value marks "no motion", as Open-Sora does)
IMAGE_FPS = 120.0


class UnreadableMediaError(Exception):
    """A file that cannot be used as a sample; the message says why."""


@dataclass(frozen=True)
class MediaInfo:
    num_frames: int
    height: int
    width: int
    fps: float  # IMAGE_FPS for an image

    @property
    def duration(self) -> float:
        """Seconds of video (0 for an image)."""
        return self.num_frames / self.fps if self.fps and self.fps != IMAGE_FPS else 0.0


def is_image(path) -> bool:
    return str(path).lower().endswith(IMAGE_SUFFIXES)


def is_media(path) -> bool:
    return str(path).lower().endswith(IMAGE_SUFFIXES + VIDEO_SUFFIXES)


def probe_header(path) -> MediaInfo:
    """Frames, size and rate from the header (frames from duration x rate when the container does not count)."""
    return _probe(Path(path), checked=False)


def probe_checked(path) -> MediaInfo:
    """``probe_header``, with the frames counted from the packets and the first frame decoded."""
    return _probe(Path(path), checked=True)


def _probe(path: Path, checked: bool) -> MediaInfo:
    if not path.is_file():
        raise UnreadableMediaError("no such file")
    if path.stat().st_size == 0:
        raise UnreadableMediaError("empty file (0 bytes)")
    try:
        return _probe_image(path, checked) if is_image(path) else _probe_video(path, checked)
    except UnreadableMediaError:
        raise
    except Exception as error:  # PyAV and Pillow raise many error types for broken files
        raise UnreadableMediaError(f"{type(error).__name__}: {error}") from None


def _probe_image(path: Path, checked: bool) -> MediaInfo:
    from PIL import Image

    with Image.open(path) as image:
        width, height = image.size
        if checked:
            image.load()  # decodes it: a truncated file fails here
    return MediaInfo(1, int(height), int(width), IMAGE_FPS)


def _probe_video(path: Path, checked: bool) -> MediaInfo:
    import av

    with av.open(str(path)) as container:
        if not container.streams.video:
            raise UnreadableMediaError("no video stream")
        stream = container.streams.video[0]
        rate = float(stream.average_rate or stream.guessed_rate or 0)
        frames = int(stream.frames or 0)
        if not frames and stream.duration and rate:
            frames = int(round(float(stream.duration * stream.time_base) * rate))
        if checked:
            # packets with a payload: one per frame for every codec a training clip uses, and read without decoding
            frames = sum(1 for packet in container.demux(stream) if packet.size)
            container.seek(0)
            if next(container.decode(stream), None) is None:
                raise UnreadableMediaError("no decodable frame")
        if frames <= 0:
            raise UnreadableMediaError("no frames")
        if not stream.width or not stream.height:
            raise UnreadableMediaError("no frame size in the header")
        return MediaInfo(frames, int(stream.height), int(stream.width), rate)
