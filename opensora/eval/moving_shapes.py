"""Score videos against MovingShapes captions: read colour, shape and motion direction back from the pixels.

Built to judge samples of small diffusion models, which are blurry and noisy, so nothing here expects
pixel-perfect input:

* background = per-frame median colour; a pixel's "distance" is its RGB distance to it (after a light
  3x3 smoothing that cuts per-pixel noise);
* a frame has a clear foreground when its brightest distances stand far above the background's own spread
  (robust: median and MAD); the foreground is then the largest 4-connected component above the midpoint
  between background and foreground levels;
* colour = hue of the mean colour of the shape's core pixels -> nearest palette hue ("none" if grayish or no foreground);
* shape = the frames are aligned on the shape's centroid and averaged into one denoised coverage map,
  which is compared (least squares) with circle, square and triangle templates of the same area and
  centroid (the triangle upright, as generated), each blurred by the best of a few widths;
* direction = robust (Theil-Sen) line through the centroids; the dominant axis and sign, or "static" when
  the fitted travel is small.

Predictions "none" and "static" never match a caption, so noise or frozen videos score at or below chance.

``wrap=True`` reads clips of the ``wrap`` motion (a torus): smoothing, connected components, centroids (circular
means) and the alignment shifts wrap around the canvas edges, and the centroid track is unwrapped before the line
fit, so a shape split across an edge is one shape moving on. Per-window scoring of long clips:
``opensora.eval.moving_shapes_windows``.
"""

import json
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from opensora.datasets.moving_shapes import PALETTE, parse_caption, read_meta, resolve_path, shape_coverage

ATTRIBUTES = ("color", "shape", "direction")
NO_COLOR, NO_SHAPE, STATIC = "none", "none", "static"

# A frame has a foreground when (peak - background level) exceeds both this many robust noise sigmas ...
MIN_CONTRAST_SIGMAS = 5.0
# ... and this absolute RGB distance (colours in [0, 1]); the noise sigma is floored at NOISE_FLOOR.
MIN_CONTRAST = 0.15
NOISE_FLOOR = 0.02
PEAK_FRACTION = 0.01  # the "peak" level is the mean of the brightest 1% of distances (at least 3 pixels)
MIN_AREA_FRACTION = 0.004  # smallest accepted component, as a fraction of the frame
MIN_VALID_FRAME_FRACTION = 0.5  # frames with a foreground needed to judge a video at all
MIN_SATURATION = 0.12  # below this the mean colour is gray: no palette colour
ANALYSIS_SIDE = 64  # larger videos are block-averaged down to about this many pixels on their short side
TEMPLATE_BLURS = (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0)  # Gaussian widths (px) tried for each shape template
STATIC_TRAVEL_FRACTION = 0.06  # fitted travel below this fraction of min(H, W) (and below 1.5 px) is static
STATIC_TRAVEL_MIN_PX = 1.5


# ----------------------------------------------------------------------------------------------- pixels
def smooth3x3(frames: np.ndarray, wrap: bool = False) -> np.ndarray:
    """Separable [1, 2, 1] / 4 blur over H and W of [T, H, W, C] (edge pixels replicated, or wrapped on a torus)."""
    padded = np.pad(frames, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="wrap" if wrap else "edge")
    rows = (padded[:, :-2] + 2 * padded[:, 1:-1] + padded[:, 2:]) / 4
    return (rows[:, :, :-2] + 2 * rows[:, :, 1:-1] + rows[:, :, 2:]) / 4


def downsample(frames: np.ndarray, max_side: int = ANALYSIS_SIDE) -> np.ndarray:
    """Block-average [T, H, W, C] by an integer factor so min(H, W) is about ``max_side``: the shapes stay
    large in pixels, noise drops, and the (iterative) component labelling stays fast for big samples."""
    factor = min(frames.shape[1], frames.shape[2]) // max_side
    if factor <= 1:
        return frames
    t, h, w, c = frames.shape
    h, w = h // factor * factor, w // factor * factor
    return frames[:, :h, :w].reshape(t, h // factor, factor, w // factor, factor, c).mean(axis=(2, 4))


def largest_components(masks: np.ndarray, wrap: bool = False) -> np.ndarray:
    """Keep only the largest 4-connected component of each mask in [T, H, W] (numpy label propagation:
    every pixel takes the smallest label among itself and its neighbours until nothing changes). ``wrap``: pixels
    on opposite edges are neighbours (a torus).

    A label is a pixel index of the same component, never above the pixel's own, so after each round a pixel may
    also take its label's label (pointer jumping): the same fixed point (each component labelled by its smallest
    index) in a few rounds instead of one round per pixel of the component's longest path."""
    t, h, w = masks.shape
    big = t * h * w + 1
    labels = np.where(masks, np.arange(t * h * w).reshape(t, h, w), big)
    while True:
        if wrap:
            padded = np.pad(labels, ((0, 0), (1, 1), (1, 1)), mode="wrap")
        else:
            padded = np.pad(labels, ((0, 0), (1, 1), (1, 1)), constant_values=big)
        neighbours = np.minimum.reduce(
            [
                padded[:, 1:-1, 1:-1],
                padded[:, :-2, 1:-1],
                padded[:, 2:, 1:-1],
                padded[:, 1:-1, :-2],
                padded[:, 1:-1, 2:],
            ]
        )
        updated = np.where(masks, neighbours, big)
        flat = updated.reshape(-1)
        inside = flat < big
        flat[inside] = flat[flat[inside]]  # a masked pixel's label indexes a masked pixel
        if np.array_equal(updated, labels):
            break
        labels = updated
    keep = np.zeros_like(masks)
    for i in range(t):
        frame_labels = labels[i][masks[i]]
        if frame_labels.size:
            values, counts = np.unique(frame_labels, return_counts=True)
            keep[i] = labels[i] == values[np.argmax(counts)]
    return keep


@dataclass
class Foreground:
    """Per-frame foreground evidence for [T, H, W, 3] frames in [0, 1]."""

    masks: np.ndarray  # [T, H, W] bool: largest component above the mid level (empty where not valid)
    core: np.ndarray  # [T, H, W] bool: mask pixels well inside the shape (for its colour)
    valid: np.ndarray  # [T] bool: a clear foreground of a plausible size
    background: np.ndarray  # [T, 3] median colour


def find_foreground(frames: np.ndarray, wrap: bool = False) -> Foreground:
    """Background = per-frame median colour; foreground = pixels whose (lightly smoothed) distance to it is
    above the midpoint between the background level and the brightest 1%, kept only when that peak stands
    MIN_CONTRAST_SIGMAS robust noise sigmas above the background (so pure noise has no foreground)."""
    t, h, w, _ = frames.shape
    smoothed = smooth3x3(frames, wrap)
    background = np.median(smoothed.reshape(t, -1, 3), axis=1)  # [T, 3]
    distance = np.linalg.norm(smoothed - background[:, None, None, :], axis=-1)  # [T, H, W]
    flat = distance.reshape(t, -1)
    level = np.median(flat, axis=1)
    noise = np.maximum(1.4826 * np.median(np.abs(flat - level[:, None]), axis=1), NOISE_FLOOR)
    k = max(3, int(round(PEAK_FRACTION * h * w)))
    peak = np.sort(flat, axis=1)[:, -k:].mean(axis=1)
    contrast = peak - level
    clear = (contrast >= MIN_CONTRAST_SIGMAS * noise) & (contrast >= MIN_CONTRAST)
    masks = largest_components((distance > (level + 0.5 * contrast)[:, None, None]) & clear[:, None, None], wrap)
    areas = masks.reshape(t, -1).sum(axis=1)
    valid = clear & (areas >= max(3, MIN_AREA_FRACTION * h * w))
    masks &= valid[:, None, None]
    core = masks & (distance >= (level + 0.75 * contrast)[:, None, None])
    return Foreground(masks, core, valid, background)


def foreground_masks(frames: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Foreground mask [T, H, W] bool and the per-frame "has a clear foreground" flag [T], frames in [0, 1]."""
    fg = find_foreground(np.asarray(frames, dtype=np.float64))
    return fg.masks, fg.valid


def mask_centroids(masks: np.ndarray, wrap: bool = False) -> np.ndarray:
    """Centroids [T, 2] as (y, x) pixel indices of non-empty masks [T, H, W]; ``wrap``: circular means on the
    torus (in [0, H) x [0, W)), so a shape split across an edge has its centroid inside the shape."""
    h, w = masks.shape[1:]
    ys, xs = np.mgrid[0:h, 0:w]
    areas = masks.sum(axis=(1, 2))
    if not wrap:
        return np.stack([(masks * ys).sum(axis=(1, 2)) / areas, (masks * xs).sum(axis=(1, 2)) / areas], axis=1)

    def circular(coords, period):
        angle = 2 * np.pi * coords / period
        mean = np.arctan2((masks * np.sin(angle)).sum(axis=(1, 2)), (masks * np.cos(angle)).sum(axis=(1, 2)))
        return (mean * period / (2 * np.pi)) % period

    return np.stack([circular(ys, h), circular(xs, w)], axis=1)


def bilinear_shift(image: np.ndarray, dy: float, dx: float, wrap: bool = False) -> np.ndarray:
    """``out[i, j] = image[i + dy, j + dx]`` with bilinear interpolation and zeros outside (``wrap``: indices
    modulo the image size, a torus)."""
    h, w = image.shape
    y0, x0 = int(np.floor(dy)), int(np.floor(dx))
    fy, fx = dy - y0, dx - x0
    padded = np.pad(image, ((h + 1, h + 1), (w + 1, w + 1)))

    def window(oy, ox):
        if wrap:
            return np.roll(image, (-oy, -ox), axis=(0, 1))
        oy, ox = int(np.clip(oy, -h - 1, h)), int(np.clip(ox, -w - 1, w))
        return padded[h + 1 + oy : 2 * h + 1 + oy, w + 1 + ox : 2 * w + 1 + ox]

    return (
        (1 - fy) * (1 - fx) * window(y0, x0)
        + (1 - fy) * fx * window(y0, x0 + 1)
        + fy * (1 - fx) * window(y0 + 1, x0)
        + fy * fx * window(y0 + 1, x0 + 1)
    )


def gaussian_blur(image: np.ndarray, sigma: float) -> np.ndarray:
    """Separable Gaussian blur of [H, W] with zero padding (the background is 0 in coverage maps)."""
    if sigma <= 0:
        return image
    radius = int(np.ceil(3 * sigma))
    taps = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
    taps /= taps.sum()
    padded = np.pad(image, radius)
    h, w = image.shape
    rows = sum(tap * padded[i : i + h, :] for i, tap in enumerate(taps))
    return sum(tap * rows[:, i : i + w] for i, tap in enumerate(taps))


def aligned_coverage(frames: np.ndarray, fg: Foreground, shape_rgb: np.ndarray, wrap: bool = False) -> np.ndarray:
    """Average over valid frames of the shape's coverage map, each frame shifted so its mask centroid sits
    at the frame centre. Coverage = projection of (pixel - background) on (shape colour - background), so
    noise averages out instead of biasing it; rigid motion makes this a denoised view of the shape."""
    t, h, w, _ = frames.shape
    ids = np.nonzero(fg.valid)[0]
    total = np.zeros((h, w))
    for i, (cy, cx) in zip(ids, mask_centroids(fg.masks[ids], wrap)):
        contrast = shape_rgb - fg.background[i]
        coverage = (frames[i] - fg.background[i]) @ contrast / max(float(contrast @ contrast), 1e-6)
        total += bilinear_shift(coverage, cy - (h - 1) / 2, cx - (w - 1) / 2, wrap)
    return total / len(ids)


# ----------------------------------------------------------------------------------------------- attributes
def rgb_to_hue(rgb: np.ndarray) -> Tuple[float, float]:
    """(hue in degrees, chroma = max - min) of one RGB colour in [0, 1]."""
    r, g, b = (float(c) for c in rgb)
    high, low = max(r, g, b), min(r, g, b)
    chroma = high - low
    if chroma <= 1e-9:
        return 0.0, 0.0
    if high == r:
        hue = 60 * (((g - b) / chroma) % 6)
    elif high == g:
        hue = 60 * ((b - r) / chroma + 2)
    else:
        hue = 60 * ((r - g) / chroma + 4)
    return hue, chroma


PALETTE_HUES: Dict[str, float] = {name: rgb_to_hue(np.asarray(rgb) / 255)[0] for name, rgb in PALETTE.items()}


def classify_color(mean_rgb: np.ndarray) -> str:
    """Nearest palette colour by hue angle; "none" for grayish colours."""
    hue, chroma = rgb_to_hue(mean_rgb)
    if chroma < MIN_SATURATION:
        return NO_COLOR

    def angle(name):
        diff = abs(hue - PALETTE_HUES[name]) % 360
        return min(diff, 360 - diff)

    return min(PALETTE_HUES, key=angle)


def fit_shape(coverage: np.ndarray) -> Tuple[str, Dict[str, float]]:
    """Pick the shape whose template best explains a centred coverage map (least squares).

    Each template has the map's area and centroid (a blur keeps both) and is blurred with the best of a few
    widths, so blurry samples are compared with blurred templates rather than sharp ones.
    """
    h, w = coverage.shape
    ys, xs = np.mgrid[0:h, 0:w]
    # judge inside a window around the centre: the rest is background noise shared by every template
    radius = 0.75 * np.sqrt(2 * max(float(np.clip(coverage, 0, None).sum()), 1.0)) + 3
    window = (np.abs(ys - (h - 1) / 2) <= radius) & (np.abs(xs - (w - 1) / 2) <= radius)
    area = float(coverage[window].sum())
    if area <= 1.0:
        return NO_SHAPE, {}
    cy = float((coverage * ys)[window].sum() / area) + 0.5  # continuous coordinates: pixel i spans [i, i+1]
    cx = float((coverage * xs)[window].sum() / area) + 0.5
    sizes = {"circle": 2 * np.sqrt(area / np.pi), "square": np.sqrt(area), "triangle": np.sqrt(2 * area)}
    residuals = {}
    for shape, size in sizes.items():
        box_cy = cy - size / 6 if shape == "triangle" else cy  # a triangle's centroid is size/6 below its box centre
        template = shape_coverage(shape, cx, box_cy, size, h, w)
        residuals[shape] = min(
            float(((gaussian_blur(template, sigma) - coverage)[window] ** 2).sum()) for sigma in TEMPLATE_BLURS
        )
    return min(residuals, key=residuals.get), residuals


def theil_sen_slope(t: np.ndarray, y: np.ndarray) -> float:
    """Median of pairwise slopes: a line fit that ignores a few wild points."""
    i, j = np.triu_indices(len(t), k=1)
    return float(np.median((y[j] - y[i]) / (t[j] - t[i])))


def classify_direction(travel_x: float, travel_y: float, height: int, width: int) -> str:
    """Dominant axis and sign of the fitted travel (image y points down), or "static" when it is small."""
    threshold = max(STATIC_TRAVEL_MIN_PX, STATIC_TRAVEL_FRACTION * min(height, width))
    if max(abs(travel_x), abs(travel_y)) < threshold:
        return STATIC
    if abs(travel_x) >= abs(travel_y):
        return "right" if travel_x > 0 else "left"
    return "down" if travel_y > 0 else "up"


@dataclass
class ShapeReading:
    """What the evaluator read from one video, with the evidence behind it."""

    color: str = NO_COLOR
    shape: str = NO_SHAPE
    direction: str = STATIC
    valid_frames: int = 0
    num_frames: int = 0
    mean_rgb: Optional[List[float]] = None
    shape_residuals: Optional[Dict[str, float]] = None
    travel_xy: Optional[List[float]] = None  # fitted travel over the clip, in analysis pixels (see downsample)
    start_xy: Optional[List[float]] = None  # the centre in the first frame the shape is found in, analysis pixels
    error: Optional[str] = None

    def attributes(self) -> Dict[str, str]:
        return {"color": self.color, "shape": self.shape, "direction": self.direction}


def read_shape(frames: np.ndarray, wrap: bool = False) -> ShapeReading:
    """Estimate (colour, shape, direction) from uint8 or [0, 1] float frames [T, H, W, 3] (``wrap``: on a torus)."""
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] < 1:
        raise ValueError(f"expected frames [T, H, W, 3], got {frames.shape}")
    frames = frames.astype(np.float64) / 255 if frames.dtype == np.uint8 else frames.astype(np.float64)
    frames = downsample(frames)
    t, h, w, _ = frames.shape
    fg = find_foreground(frames, wrap)
    reading = ShapeReading(valid_frames=int(fg.valid.sum()), num_frames=t)
    if fg.valid.sum() < max(1, MIN_VALID_FRAME_FRACTION * t):
        return reading
    shape_rgb = frames[fg.core if fg.core.any() else fg.masks].mean(axis=0)
    reading.mean_rgb = [round(float(c), 4) for c in shape_rgb]
    reading.color = classify_color(shape_rgb)

    reading.shape, residuals = fit_shape(aligned_coverage(frames, fg, shape_rgb, wrap))
    reading.shape_residuals = {k: round(v, 3) for k, v in residuals.items()}

    ids = np.nonzero(fg.valid)[0]
    if len(ids) >= 2:
        cy, cx = mask_centroids(fg.masks[ids], wrap).T
        reading.start_xy = [round(float(cx[0]), 2), round(float(cy[0]), 2)]
        if wrap:  # a track across an edge continues past it instead of jumping back by a canvas
            cy, cx = np.unwrap(cy, period=h), np.unwrap(cx, period=w)
        travel_x = theil_sen_slope(ids.astype(float), cx) * (t - 1)
        travel_y = theil_sen_slope(ids.astype(float), cy) * (t - 1)
        reading.travel_xy = [round(travel_x, 3), round(travel_y, 3)]
        reading.direction = classify_direction(travel_x, travel_y, h, w)
    return reading


def map_in_processes(function, jobs: Sequence, workers: int = 1) -> list:
    """``[function(job) for job in jobs]``, in ``workers`` spawned processes when there are several (not forked: the
    caller may hold CUDA or threads). Spawned workers import the calling script again: a script needs the usual
    ``if __name__ == "__main__":`` guard, and ``function`` must be a module-level function. Inside
    ``kept_process_pool(workers)`` every call reuses one pool; outside, each call starts its own."""
    if workers <= 1 or len(jobs) <= 1:
        return [function(job) for job in jobs]
    chunksize = max(1, len(jobs) // (4 * workers))
    kept = _KEPT_POOLS.get(workers)
    if kept is None:
        with _spawned_pool(min(workers, len(jobs))) as pool:
            return list(pool.map(function, jobs, chunksize=chunksize))
    from concurrent.futures.process import BrokenProcessPool

    try:
        return list(kept.map(function, jobs, chunksize=chunksize))
    except BrokenProcessPool:  # a worker died (killed, out of memory): the block's next call gets a fresh pool
        _KEPT_POOLS[workers] = _spawned_pool(workers)
        kept.shutdown(wait=False, cancel_futures=True)
        raise


_KEPT_POOLS: dict = {}  # workers -> the pool ``kept_process_pool`` holds open


def _spawned_pool(workers: int):
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(workers, mp_context=context, initializer=_exit_with_parent, initargs=(os.getpid(),))


def _exit_with_parent(parent: int, every_s: float = 1.0) -> None:
    """A pool worker's watch: exit once ``parent`` is gone. An idle worker holds both ends of its call queue, so a
    killed parent (kill -9, a time limit) would otherwise leave it waiting forever with the parent's stdout open."""
    import os
    import threading
    import time

    def watch():
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


@contextmanager
def kept_process_pool(workers: int):
    """One pool of ``workers`` spawned processes for every ``map_in_processes(..., workers)`` inside the block, shut
    down when it ends. A pool costs about 2 s to start (each worker imports the calling script, torch with it), and
    an evaluation that scores a few hundred clips a dozen times would pay that each time. A block inside another of
    the same size uses the outer pool."""
    if workers <= 1 or workers in _KEPT_POOLS:
        yield
        return
    _KEPT_POOLS[workers] = _spawned_pool(workers)
    try:
        yield
    finally:
        _KEPT_POOLS.pop(workers).shutdown(cancel_futures=True)


def _read_or_error(job: Tuple[np.ndarray, bool]) -> ShapeReading:
    """``read_shape`` of one (frames, wrap) job, with a malformed array read as an error (a wrong answer, not a
    crash)."""
    frames, wrap = job
    try:
        return read_shape(frames, wrap)
    except Exception as exc:
        return ShapeReading(error=f"{type(exc).__name__}: {exc}")


def read_shapes(clips: Sequence[np.ndarray], wrap: bool = False, workers: int = 1) -> List[ShapeReading]:
    """``read_shape`` of each clip, a malformed one read as an error; ``workers`` > 1 reads them in that many spawned
    processes (``map_in_processes``; the same readings: each clip is read alone; ~40 ms a 16-frame clip at 64x64, so
    288 clips take ~11 s in one process)."""
    return map_in_processes(_read_or_error, [(clip, wrap) for clip in clips], workers)


# ----------------------------------------------------------------------------------------------- datasets
@dataclass
class EvalReport:
    n: int = 0
    color_acc: float = 0.0
    shape_acc: float = 0.0
    direction_acc: float = 0.0
    all_acc: float = 0.0
    counts: Dict[str, int] = field(default_factory=dict)  # rows whose caption names each attribute
    failed: List[str] = field(default_factory=list)  # paths that could not be decoded (scored wrong)
    rows: List[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        lines = [
            f"MovingShapes eval: {self.n} videos, {len(self.failed)} failed to decode",
            f"  color     {self.color_acc:.3f}  (n={self.counts.get('color', 0)})",
            f"  shape     {self.shape_acc:.3f}  (n={self.counts.get('shape', 0)})",
            f"  direction {self.direction_acc:.3f}  (n={self.counts.get('direction', 0)})",
            f"  all       {self.all_acc:.3f}  (n={self.counts.get('all', 0)})",
        ]
        return "\n".join(lines)


def score_rows(
    items: List[Tuple[str, str, Optional[np.ndarray], Optional[str]]], wrap: bool = False, workers: int = 1
) -> EvalReport:
    """Score (path, caption, frames or None, decode error or None) items (``wrap``: clips on a torus; ``workers``:
    processes that read the clips, ``read_shapes``).

    Each attribute's accuracy is over the rows whose caption names it (an image caption has no direction);
    ``all_acc`` is over rows naming all three. Undecodable videos count as wrong.
    """
    report = EvalReport(n=len(items))
    correct = {a: 0 for a in ATTRIBUTES + ("all",)}
    counts = {a: 0 for a in ATTRIBUTES + ("all",)}
    decoded = [i for i, item in enumerate(items) if item[3] is None]
    readings = dict(zip(decoded, read_shapes([items[i][2] for i in decoded], wrap, workers)))
    for index, (path, text, _, error) in enumerate(items):
        truth = dict(zip(ATTRIBUTES, parse_caption(text)))
        reading = readings.get(index, ShapeReading(error=error))
        if reading.error is not None:
            report.failed.append(path)
        predicted = reading.attributes()
        # None where the caption does not name the attribute (not scored)
        hits = {a: None if truth[a] is None else predicted[a] == truth[a] for a in ATTRIBUTES}
        for a in ATTRIBUTES:
            if truth[a] is not None:
                counts[a] += 1
                correct[a] += hits[a]
        if all(truth[a] is not None for a in ATTRIBUTES):
            counts["all"] += 1
            correct["all"] += all(hits.values())
        row = {"path": path, "text": text, "truth": truth, "pred": predicted, "correct": hits}
        row.update({k: v for k, v in asdict(reading).items() if k not in ATTRIBUTES})
        report.rows.append(row)
    report.counts = counts
    for a in ATTRIBUTES + ("all",):
        setattr(report, f"{a}_acc", correct[a] / counts[a] if counts[a] else 0.0)
    return report


def load_rows(csv_path, progress: bool = True):
    """Yield (path, text, frames or None, error or None) for every row of a csv with ``path`` and ``text``."""
    from opensora.datasets.video_io import read_video

    rows = read_meta(csv_path)
    if rows and not {"path", "text"} <= set(rows[0]):
        raise ValueError(f"{csv_path} needs columns 'path' and 'text'; it has {sorted(rows[0])}")
    if progress:
        from tqdm import tqdm

        rows = tqdm(rows, desc="eval", unit="video")
    for row in rows:
        path = row["path"]
        try:
            frames, error = read_video(resolve_path(csv_path, path)), None
        except Exception as exc:  # broken or missing file: reported and scored wrong
            frames, error = None, f"{type(exc).__name__}: {exc}"
        yield path, row["text"], frames, error


def evaluate_csv(csv_path, json_out=None, progress: bool = True) -> EvalReport:
    """Score every video listed in ``csv_path`` (columns path, text; paths relative to the csv or absolute)."""
    rows = list(load_rows(csv_path, progress=progress))
    if not rows:  # scores of nothing would read as 0.000 accuracy
        from opensora.cli_errors import UserInputError

        raise UserInputError(f"{csv_path} lists no videos: nothing to score")
    report = score_rows(rows)
    if json_out is not None:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    return report


__all__ = [
    "ShapeReading",
    "EvalReport",
    "read_shape",
    "read_shapes",
    "kept_process_pool",
    "map_in_processes",
    "score_rows",
    "evaluate_csv",
    "foreground_masks",
    "largest_components",
    "classify_color",
    "fit_shape",
    "classify_direction",
]
