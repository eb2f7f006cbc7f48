"""Score long MovingShapes clips window by window: does a streamed video keep its colour, shape, motion and
brightness after the training length?

A clip of ``T`` frames is cut into windows of ``window`` frames every ``stride`` frames (default: non-overlapping);
each window is read like a short clip (``opensora.eval.moving_shapes.read_shape``) and scored per attribute:

* colour and shape: the caption's, in every window;
* direction: what the motion rule says for that window (``motion``):
  ``linear`` and ``wrap`` -- the caption's direction throughout (a linear clip past the training length has no
  defined answer: its shape leaves the frame); ``bounce`` -- the caption's direction reversed at every wall contact
  *of the clip itself*: the shape's extent along the motion axis is tracked over the whole clip and the expected
  direction flips each time the shape reaches the wall it is heading for (so a sample that bounces where it really
  touches a wall is right, one that turns mid-canvas or sticks to the wall is wrong). A window whose steps do not
  mostly go one way (``majority_direction``: a bounce near its middle) is not scored for direction. With the
  generator's own motion at hand (ground truth), ``expected_directions`` replaces the tracking;
* frame statistics, split so each catches one kind of drift: the background level (median grey level: the shape
  covers under 15% of the frame) within ``BACKGROUND_TOLERANCE`` grey levels of the generator's background (a frame
  darkening or brightening); the shape's share of the frame mean (mean - background) and the standard deviation
  (over frames, pixels and channels) within the range a correct clip *with that caption* can have -- the
  generator's renders at the smallest and largest shape size (``SIZE_RANGE``), widened by ``stats_margin``
  (relative) -- (a shape that grows, fades, smears or saturates). A correct bounce or wrap clip always keeps its
  whole shape in view, so these are its size's alone.

Why a per-caption range: the old rule (one range for all captions, the min/max over 288 training clips) let the
caption decide the verdict -- a small red triangle's clip mean sits 3.3 grey levels above the background, right at
that range's lower end, while a large magenta square sits at its upper end -- so ground truth itself scored 0.96
(fresh seeds at 64x64x16) and a one-grey-level darker background threw out 10% of correct clips, while a bright
shape could darken a lot before leaving. Per caption, the range covers exactly what that caption allows, so ground
truth scores 1.0 and a brightness drift is caught for every caption alike.
"""

from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from opensora.datasets.moving_shapes import (
    BACKGROUND,
    DIRECTION_VECTORS,
    MOTIONS,
    OPPOSITE,
    SIZE_RANGE,
    ShapeMotion,
    caption,
    majority_direction,
    parse_caption,
    render_video,
)
from opensora.eval.moving_shapes import (
    downsample,
    find_foreground,
    map_in_processes,
    mask_centroids,
    read_shape,
    score_rows,
)
from opensora.eval.resampled_criteria import hit_string

STATS_MARGIN = 0.05  # relative widening of the per-caption shape statistics' range (sub-pixel coverage, rounding)
# grey levels the background may move: a sampler's colour bias and video coding move a flat background by a level
# or two; the drift seen in long rollouts (frame means 18-21 over a background of 24) moves it by more
BACKGROUND_TOLERANCE = 3.0
WALL_TOLERANCE = 0.06  # a shape within this fraction of min(H, W) (and at least 2 px) of a wall touches it


# ---- frame statistics ---------------------------------------------------------------------------------------------
STATISTICS = ("shape_mean", "std", "background")


def frame_stats(frames: np.ndarray) -> Tuple[float, float, float]:
    """(mean - background, standard deviation, background = median grey level) of uint8 frames [T, H, W, 3], in grey
    levels: the shape's share of the frame mean, the contrast, and the flat background's level."""
    values = np.asarray(frames, dtype=np.float32)
    background = float(np.median(values.mean(axis=-1)))
    return float(values.mean()) - background, float(values.std()), background


@lru_cache(maxsize=256)
def stats_range(color: str, shape: str, height: int, width: int, margin: float = STATS_MARGIN) -> Dict[str, tuple]:
    """The ``STATISTICS`` ranges of a correct clip of this colour and shape at this size: the generator's renders at
    the smallest and largest shape size (both shape statistics grow with its area), widened by ``margin``; the
    background within ``BACKGROUND_TOLERANCE`` grey levels of the rendered one."""
    stats = []
    for fraction in SIZE_RANGE:
        size = fraction * min(height, width)
        still = ShapeMotion(color, shape, "none", size, width / 2, height / 2, 0.0, 0.0)
        stats.append(frame_stats(render_video(still, height, width, 1)))
    ranges = {name: (min(v) * (1 - margin), max(v) * (1 + margin)) for name, v in zip(STATISTICS, zip(*stats))}
    level = float(np.mean(BACKGROUND))
    ranges["background"] = (level - BACKGROUND_TOLERANCE, level + BACKGROUND_TOLERANCE)
    return ranges


def stats_sides(frames: np.ndarray, color: str, shape: str, margin: float = STATS_MARGIN) -> Dict[str, int]:
    """Per ``STATISTICS`` name, where a window's value lies against its caption's range: -1 below, 0 in, +1 above
    (which statistic fails, and which way, says what kind of drift it is)."""
    ranges = stats_range(color, shape, frames.shape[1], frames.shape[2], float(margin))
    return {
        name: -1 if value < ranges[name][0] else (1 if value > ranges[name][1] else 0)
        for name, value in zip(STATISTICS, frame_stats(frames))
    }


def stats_in_range(frames: np.ndarray, color: Optional[str], shape: Optional[str], margin: float = STATS_MARGIN):
    """Whether a window's ``STATISTICS`` lie in its caption's ranges (False when the caption names no colour/shape)."""
    if color is None or shape is None:
        return False
    return not any(stats_sides(frames, color, shape, margin).values())


# ---- the direction a window should have -----------------------------------------------------------------------------
def window_starts(num_frames: int, window: int, stride: Optional[int] = None) -> List[int]:
    if window < 2 or num_frames < window:
        raise ValueError(f"need 2 <= window <= clip frames, got window={window} for {num_frames} frames")
    stride = int(stride or window)
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    return list(range(0, num_frames - window + 1, stride))


def bounce_step_directions(frames: np.ndarray, direction: str) -> List[str]:
    """Per frame step, the direction a bouncing shape should take, tracked on the clip itself: the caption's
    ``direction`` at first, reversed at each frame where the shape's extent is at the wall it is heading for and
    its centroid gets no nearer to that wall in the next frame (the turning point)."""
    frames = np.asarray(frames)
    frames = frames.astype(np.float64) / 255 if frames.dtype == np.uint8 else frames.astype(np.float64)
    frames = downsample(frames)
    t, h, w, _ = frames.shape
    fg = find_foreground(frames)
    ux, uy = DIRECTION_VECTORS[direction]
    extent = w if ux else h
    tolerance = max(2.0, WALL_TOLERANCE * min(h, w))
    along = np.full(t, np.nan)  # centroid along the motion axis
    ids = np.nonzero(fg.valid)[0]
    if len(ids):
        along[ids] = mask_centroids(fg.masks[ids])[:, 1 if ux else 0]
    heading, steps = direction, []
    for f in range(t - 1):
        if fg.valid[f]:
            occupied = np.nonzero(fg.masks[f].any(axis=0 if ux else 1))[0]  # the columns (rows) the shape covers
            sign = sum(DIRECTION_VECTORS[heading])  # +1: towards the right / bottom wall
            at_wall = occupied.max() >= extent - 1 - tolerance if sign > 0 else occupied.min() <= tolerance
            turning = np.isnan(along[f + 1]) or (along[f + 1] - along[f]) * sign <= 0
            if at_wall and turning:
                heading = OPPOSITE[heading]
        steps.append(heading)
    return steps


def expected_window_directions(
    frames: np.ndarray, direction: Optional[str], motion: str, starts: Sequence[int], window: int
) -> List[Optional[str]]:
    """The direction each window should show (None: not scored), from the caption and the motion rule."""
    if direction is None:
        return [None] * len(starts)
    if motion != "bounce":
        return [direction] * len(starts)
    steps = bounce_step_directions(frames, direction)
    return [majority_direction(steps[s : s + window - 1]) for s in starts]


def score_clips(videos, prompts: Sequence[str], motion: str, names: Optional[Sequence[str]] = None, workers: int = 1):
    """``opensora.eval.moving_shapes.score_rows`` of clips under the ``motion`` rule (an ``EvalReport``): ``wrap``
    clips are read on the torus (a shape that crosses an edge inside the clip keeps its direction); a ``bounce`` clip
    may turn at a wall, so its direction is the bounce rule's over the clip (``expected_window_directions``; the
    caption's direction is dropped, so not scored, when the clip has no majority direction). ``names``: the rows'
    names (default ``s0``, ``s1``, ...); ``workers``: processes that read the clips."""
    if motion == "bounce":
        rewritten = []
        for video, prompt in zip(videos, prompts):
            color, shape, direction = parse_caption(prompt)
            expected = expected_window_directions(video, direction, motion, [0], len(video))[0]
            rewritten.append(caption(color, shape, expected))
        prompts = rewritten
    names = list(names) if names is not None else [f"s{i}" for i in range(len(prompts))]
    items = [(n, t, v, None) for n, t, v in zip(names, prompts, videos)]
    return score_rows(items, wrap=motion == "wrap", workers=workers)


DIRECTION_RELATIONS = ("match", "reverse", "sideways", "static")


def direction_relation(read: str, expected: str) -> str:
    """How a read direction relates to the expected one: a wrong direction that is the opposite (a shape pulled back
    towards where it was) tells a different story from one across the axis or a shape that stopped."""
    if read == expected:
        return "match"
    if read not in DIRECTION_VECTORS:
        return "static"
    return "reverse" if OPPOSITE[expected] == read else "sideways"


# ---- scoring ------------------------------------------------------------------------------------------------------
@dataclass
class WindowScore:
    start_frame: int
    color_acc: Optional[float]  # None when no clip is scored in this window (every one straddles a prompt switch)
    shape_acc: Optional[float]
    direction_acc: Optional[float]  # None when no clip has a scored direction in this window
    direction_n: int  # clips whose direction is scored in this window
    # how the scored clips' read directions relate to the expected one: match / reverse / sideways / static
    direction_reads: Dict[str, int]
    stats_in_range: Optional[float]  # share of clips whose frame statistics lie in their caption's range
    # per statistic, the scored clips below / above their caption's range: [low, high]
    stats_outside: Dict[str, List[int]]
    frame_mean: float
    frame_std: float
    background: float
    scored_n: int  # clips scored in this window (all but those straddling a prompt switch)


def caption_of_window(prompt, start: int, window: int) -> Optional[str]:
    """The caption in force over frames ``start .. start + window - 1``: ``prompt`` itself, or for a prompt schedule
    ``[(first_frame, caption), ...]`` the one entry covering the whole window (None when a switch falls inside)."""
    if isinstance(prompt, str):
        return prompt
    schedule = sorted((int(frame), text) for frame, text in prompt)
    if not schedule or schedule[0][0] != 0:
        raise ValueError(f"a prompt schedule must start at frame 0, got {schedule[:1]}")
    active = [text for frame, text in schedule if frame <= start][-1]
    switches = [frame for frame, _ in schedule if start < frame < start + window]
    return None if switches else active


def score_windows(
    videos: Sequence[np.ndarray],
    prompts: Sequence,
    window: int,
    stride: Optional[int] = None,
    motion: str = "linear",
    expected_directions: Optional[Sequence[Sequence[Optional[str]]]] = None,
    stats_margin: float = STATS_MARGIN,
    workers: int = 1,
) -> dict:
    """Per-window scores of uint8 videos [T, H, W, 3] (one per prompt; all of the same length) and their summary:
    ``windows`` (a ``WindowScore`` dict per window), ``{color,shape,direction,stats}_window_min`` (the worst
    window), ``*_vs_first_min`` (the worst window over the first) and the settings. ``expected_directions[i][k]``:
    clip i's true direction in window k where known (ground truth), instead of the motion rule's reading.

    A prompt may be a schedule ``[(0, caption), (frame, next caption), ...]`` (a prompt switched mid-stream): each
    window is scored against the caption in force over all of it; a window with a switch inside is not scored for
    that clip (``scored_n``). Schedules are scored with linear or wrap motion (the bounce rule tracks one caption).

    ``workers`` > 1 scores the clips in that many spawned processes (the same scores: each clip is scored alone;
    reading a window takes ~40 ms, so 288 clips of 128 frames take ~90 s in one process). Spawned workers import the
    calling script again: a script needs the usual ``if __name__ == "__main__":`` guard."""
    if motion not in MOTIONS:
        raise ValueError(f"unknown motion {motion!r}; choose one of {list(MOTIONS)}")
    if len(videos) != len(prompts) or not len(videos):
        raise ValueError(f"need one prompt per video and at least one video, got {len(videos)} and {len(prompts)}")
    if motion == "bounce" and not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompt schedules are scored with linear or wrap motion, not bounce")
    starts = window_starts(len(videos[0]), window, stride)
    for i, video in enumerate(videos):
        if len(video) != len(videos[0]):
            raise ValueError(f"video {i} has {len(video)} frames, video 0 has {len(videos[0])}")
    known = [None] * len(videos) if expected_directions is None else list(expected_directions)
    jobs = [(v, p, starts, window, motion, e, stats_margin) for v, p, e in zip(videos, prompts, known)]
    clips = map_in_processes(_score_clip, jobs, workers)
    hits = {a: np.full((len(videos), len(starts)), np.nan) for a in ("color", "shape", "stats", "direction")}
    reads = [dict.fromkeys(DIRECTION_RELATIONS, 0) for _ in starts]
    outside = [{name: [0, 0] for name in STATISTICS} for _ in starts]
    moments = np.zeros((len(videos), len(starts), len(STATISTICS)))
    for i, clip_windows in enumerate(clips):
        for k, scored in enumerate(clip_windows):
            moments[i, k] = scored["moments"]
            if scored["color"] is None:  # a prompt switch inside the window
                continue
            for name in ("color", "shape", "stats"):
                hits[name][i, k] = scored[name]
            for name, side in scored["sides"].items():
                if side:
                    outside[k][name][side > 0] += 1
            if scored["direction"] is not None:
                hits["direction"][i, k] = scored["direction"]
                reads[k][scored["relation"]] += 1

    def share(name, k):
        scored = hits[name][:, k][~np.isnan(hits[name][:, k])]
        return (float(scored.mean()) if len(scored) else None), int(len(scored))

    windows = []
    for k, start in enumerate(starts):
        direction_acc, direction_n = share("direction", k)
        windows.append(
            WindowScore(
                start_frame=start,
                color_acc=share("color", k)[0],
                shape_acc=share("shape", k)[0],
                direction_acc=direction_acc,
                direction_n=direction_n,
                direction_reads=reads[k],
                stats_in_range=share("stats", k)[0],
                stats_outside=outside[k],
                frame_mean=float((moments[:, k, 0] + moments[:, k, 2]).mean()),
                frame_std=float(moments[:, k, 1].mean()),
                background=float(moments[:, k, 2].mean()),
                scored_n=share("color", k)[1],
            ).__dict__
        )
    return dict(
        window=int(window),
        stride=int(stride or window),
        motion=motion,
        stats_margin=float(stats_margin),
        windows=windows,
        **summarise_windows(windows),
        # per clip, one character per window (resampled_criteria: "1" hit, "0" miss, "." not scored): how stable a
        # verdict on these shares is when the clips are drawn again
        clip_hits={
            name: [hit_string([None if np.isnan(h) else bool(h) for h in row]) for row in table]
            for name, table in hits.items()
        },
    )


def _score_clip(job) -> List[dict]:
    """One clip's windows (``score_windows``' per-clip part, a top-level function so worker processes can run it):
    per window its frame statistics and, where one caption covers the window, the colour / shape / stats hits, the
    statistics' sides and the direction hit with its relation (None where the window's direction is not scored)."""
    video, prompt, starts, window, motion, expected, stats_margin = job
    video = np.asarray(video)
    captions = [caption_of_window(prompt, start, window) for start in starts]
    if expected is not None:
        expected = list(expected)
    elif isinstance(prompt, str):
        expected = expected_window_directions(video, parse_caption(prompt)[2], motion, starts, window)
    else:  # linear / wrap: each window's caption names its direction
        expected = [None if c is None else parse_caption(c)[2] for c in captions]
    out = []
    for k, start in enumerate(starts):
        clip = video[start : start + window]
        scored = dict(moments=frame_stats(clip), color=None)
        out.append(scored)
        if captions[k] is None:
            continue
        color, shape, _ = parse_caption(captions[k])
        reading = read_shape(clip, motion == "wrap")
        sides = stats_sides(clip, color, shape, stats_margin)
        scored.update(
            color=reading.color == color,
            shape=reading.shape == shape,
            stats=not any(sides.values()),
            sides=sides,
            direction=None if expected[k] is None else reading.direction == expected[k],
            relation=None if expected[k] is None else direction_relation(reading.direction, expected[k]),
        )
    return out


def summarise_windows(windows: Sequence[dict]) -> dict:
    """The worst window per attribute and the worst window relative to the first (drift)."""
    keys = dict(color="color_acc", shape="shape_acc", direction="direction_acc", stats="stats_in_range")
    out = {}
    for name, key in keys.items():
        values = [w[key] for w in windows if w[key] is not None]
        out[f"{name}_window_min"] = min(values) if values else None
        first = next((w[key] for w in windows if w[key] is not None), None)  # the first scored window
        out[f"{name}_vs_first_min"] = min(v / first for v in values) if values and first else None
    return out


GREY_SUMS = 3 * 255 + 1  # the values a pixel's channel sum takes in a uint8 frame


def background_by_frame(videos: Sequence[np.ndarray]) -> List[float]:
    """Per frame, the mean over the videos (uint8 [T, H, W, 3], equal lengths) of the background level (median grey
    level, as ``frame_stats``): where along a long stream the background moves, e.g. at the cache window's first roll.

    A uint8 pixel's grey level is its channel sum over 3, one of 766 values, so each frame's median comes from a
    histogram of the sums (exact, and without sorting: 288 clips of 128 frames in seconds, not tens of them)."""
    total = sum(_median_grey_by_frame(np.asarray(video)) for video in videos)
    return [float(level) for level in total / len(videos)]


def _median_grey_by_frame(video: np.ndarray) -> np.ndarray:
    """[T] median grey level of each frame of one video [T, H, W, 3] (by histogram for uint8)."""
    if video.dtype != np.uint8:  # any other frames: sorted, as np.median does
        return np.median(video.astype(np.float64).mean(axis=-1).reshape(len(video), -1), axis=-1)
    sums = video.sum(axis=-1, dtype=np.int32).reshape(len(video), -1)  # [T, H*W]
    frames, pixels = sums.shape
    rows = np.arange(frames)[:, None] * GREY_SUMS
    counts = np.bincount((sums + rows).ravel(), minlength=frames * GREY_SUMS).reshape(frames, GREY_SUMS)
    below = np.cumsum(counts, axis=1)  # below[t, v]: pixels of frame t with a sum <= v
    # the sums at sorted positions (n-1)//2 and n//2 (equal for odd n): the first v whose count passes each
    low, high = (below <= (pixels - 1) // 2).sum(axis=1), (below <= pixels // 2).sum(axis=1)
    return (low + high) / 6.0


# ---- flicker at chunk edges ----------------------------------------------------------------------------------------
def _frame_step_sums(video: np.ndarray) -> np.ndarray:
    """[T-1] sum over pixels and channels of |frame[f+1] - frame[f]| of one video [T, H, W, C]."""
    exact = video.dtype == np.uint8
    steps = np.abs(np.diff(video.astype(np.int16 if exact else np.float64), axis=0))
    return steps.sum(axis=(1, 2, 3), dtype=np.int64 if exact else np.float64)


def chunk_edge_flicker(
    videos: np.ndarray, chunk_pixel_frames: int, first_chunk_pixel_frames: int, window: Optional[int] = None
) -> dict:
    """Mean |frame[f+1] - frame[f]| across chunk edges vs inside chunks of streamed uint8 videos [B, T, H, W, 3]:
    ``edge_over_inside`` near 1 means the chunk seams do not show (a causal VAE's first chunk is shorter, hence
    ``first_chunk_pixel_frames``). ``window``: also the ratio within each window of that many frames
    (``by_window``, from frame 0; a frame step counts in the window of its first frame), which shows where along a
    long stream the seams show."""
    # |frame step| summed a video at a time, exactly in integers for uint8 (a float copy of 288 clips of 128 frames
    # is 1.8 GB and took 15 s)
    steps = sum(_frame_step_sums(np.asarray(v)) for v in videos)
    diffs = steps / (len(videos) * np.prod(np.shape(videos[0])[1:]))  # [T-1]: the mean step of each frame pair
    is_edge = np.zeros(diffs.shape[0], dtype=bool)
    is_edge[first_chunk_pixel_frames - 1 :: chunk_pixel_frames] = True

    def ratio(d: np.ndarray, edge: np.ndarray) -> Optional[float]:
        if not edge.any() or edge.all() or d[~edge].mean() <= 0:
            return None
        return float(d[edge].mean() / d[~edge].mean())

    out = dict(
        edge_diff=float(diffs[is_edge].mean()) if is_edge.any() else None,
        inside_diff=float(diffs[~is_edge].mean()) if not is_edge.all() else None,
        edge_over_inside=ratio(diffs, is_edge),
    )
    if window:
        spans = [slice(start, start + window) for start in range(0, diffs.shape[0], window)]
        out["by_window"] = [ratio(diffs[span], is_edge[span]) for span in spans]
    return out


__all__ = [
    "background_by_frame",
    "chunk_edge_flicker",
    "frame_stats",
    "stats_range",
    "stats_in_range",
    "stats_sides",
    "window_starts",
    "bounce_step_directions",
    "expected_window_directions",
    "score_clips",
    "caption_of_window",
    "score_windows",
    "summarise_windows",
]
