"""MovingShapes: a synthetic text-to-video dataset small enough for a CPU demo.

Each clip shows one anti-aliased coloured shape (circle, square or triangle) moving in a straight line at
constant speed (left, right, up or down) over a plain dark-gray background, captioned in words:
``"a red circle moving left"``. Because the caption fully describes the clip, a trained model can be scored
by reading the attributes back from its samples (see ``opensora.eval.moving_shapes``).

Everything here is a pure function of its arguments (a seed included) except ``write_dataset``, which
renders a whole dataset to disk:

    DIR/meta.csv         path,text,num_frames,height,width,fps,color,shape,direction,size,x0,y0,dx,dy
    DIR/attributes.json  palette, shapes, directions, generation settings and one record per clip
    DIR/prompts.txt      every caption once (a prompt file for sampling)
    DIR/videos/NNNNNN.mp4  (or .png for single-frame image samples)

``path`` in meta.csv is relative to the directory holding meta.csv (portable: the folder can be moved).
Image samples (``image_fraction > 0``) are single png frames captioned without a direction
(``"a red circle"``) and have ``direction == "none"``.

Long clips (``motion``): ``"linear"`` (the default above) moves the centre by (dx, dy) over the clip, whatever its
length, so past the training length there is no defined continuation. ``"bounce"`` and ``"wrap"`` fix the speed
instead -- (dx, dy) per ``reference_frames - 1`` frames (the training clip length) -- and define the motion for any
length: ``bounce`` reflects the centre off the walls (the shape always fully in frame, the direction reverses at each
contact); ``wrap`` moves on a torus (the shape leaves one edge and re-enters at the opposite one, drawn split across
the edge; the direction never changes). ``direction_at`` / ``window_direction`` give the true direction per frame and
per window. The caption names the direction at frame 0.
"""

import csv
import itertools
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

# Six colours, 60 degrees apart in hue, so they stay distinguishable after blur, noise and chroma
# subsampling. RGB in 0..255.
PALETTE: Dict[str, Tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "yellow": (230, 220, 40),
    "green": (40, 210, 60),
    "cyan": (40, 210, 220),
    "blue": (50, 70, 240),
    "magenta": (220, 50, 220),
}
COLORS: Tuple[str, ...] = tuple(PALETTE)
SHAPES: Tuple[str, ...] = ("circle", "square", "triangle")
DIRECTIONS: Tuple[str, ...] = ("left", "right", "up", "down")
BACKGROUND: Tuple[int, int, int] = (24, 24, 24)
NO_DIRECTION = "none"  # direction attribute of single-frame image samples
MOTIONS: Tuple[str, ...] = ("linear", "bounce", "wrap")
# a window's true direction is the one most of its frame steps take, when at least this share of them do (a window
# around a bounce has none: it is not scored for direction)
WINDOW_DIRECTION_MAJORITY = 0.6

# Unit vectors in image coordinates (x to the right, y downwards).
DIRECTION_VECTORS: Dict[str, Tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}

# Geometry ranges as fractions of the frame: shape size of min(H, W), travel of the frame extent along the
# motion axis. size + travel <= 0.85 keeps the whole shape in frame for the whole clip.
SIZE_RANGE = (0.28, 0.38)
TRAVEL_RANGE = (0.30, 0.45)
SUPERSAMPLE = 4  # anti-aliasing: samples per pixel along each axis

META_COLUMNS = (
    "path",
    "text",
    "num_frames",
    "height",
    "width",
    "fps",
    "color",
    "shape",
    "direction",
    "size",
    "x0",
    "y0",
    "dx",
    "dy",
    "motion",
    "reference_frames",
)


# ----------------------------------------------------------------------------------------------- captions
def caption(color: str, shape: str, direction: Optional[str] = None) -> str:
    """The caption of a clip; without a direction (images) it is just ``"a red circle"``."""
    _check_attributes(color, shape, direction)
    if direction is None or direction == NO_DIRECTION:
        return f"a {color} {shape}"
    return f"a {color} {shape} moving {direction}"


def all_combinations() -> List[Tuple[str, str, str]]:
    """Every (color, shape, direction) triple, in a fixed order (6 x 3 x 4 = 72)."""
    return list(itertools.product(COLORS, SHAPES, DIRECTIONS))


def all_captions() -> List[str]:
    """Every video caption once, in the order of ``all_combinations`` (a prompt list for evaluation)."""
    return [caption(*combo) for combo in all_combinations()]


_WORD = re.compile(r"[a-z]+")


def parse_caption(text: str) -> Tuple[Optional[str], Optional[str], Optional[str]]:
    """Read (color, shape, direction) back from a caption; an attribute the text does not name is None.

    Tolerant of wording ("A Red circle, moving left.") but not of ambiguity: two different colour words
    (or shapes, or directions) give None for that attribute.
    """
    words = _WORD.findall(str(text).lower())

    def the_one(vocabulary):
        found = {w for w in words if w in vocabulary}
        return found.pop() if len(found) == 1 else None

    return the_one(COLORS), the_one(SHAPES), the_one(DIRECTIONS)


def _check_attributes(color, shape, direction=None):
    if color not in PALETTE:
        raise ValueError(f"unknown color {color!r}; choose one of {list(COLORS)}")
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {list(SHAPES)}")
    if direction not in (None, NO_DIRECTION) and direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; choose one of {list(DIRECTIONS)}")


# ----------------------------------------------------------------------------------------------- geometry
@dataclass(frozen=True)
class ShapeMotion:
    """One clip's content. Positions are the shape centre in pixels (x right, y down) at frame 0.

    ``motion="linear"``: the centre moves by (dx, dy) over the whole clip (frame 0 to frame T-1). ``"bounce"`` /
    ``"wrap"``: it moves by (dx, dy) every ``reference_frames - 1`` frames, reflected off the walls or wrapped
    around the canvas (``canvas_height`` x ``canvas_width``, needed by these two modes); see the module docstring."""

    color: str
    shape: str
    direction: str
    size: float
    x0: float
    y0: float
    dx: float
    dy: float
    motion: str = "linear"
    reference_frames: int = 0  # bounce / wrap: frames over which the centre travels (dx, dy)
    canvas_height: int = 0
    canvas_width: int = 0

    def __post_init__(self):
        if self.motion not in MOTIONS:
            raise ValueError(f"unknown motion {self.motion!r}; choose one of {list(MOTIONS)}")
        if self.motion != "linear" and (self.reference_frames < 2 or min(self.canvas_height, self.canvas_width) < 1):
            raise ValueError(f"motion {self.motion!r} needs reference_frames >= 2 and the canvas height/width")

    def unfolded_centre(self, frame_index: int, num_frames: int) -> Tuple[float, float]:
        """The centre before any reflection or wrap: a straight line at constant speed."""
        span = (num_frames if self.motion == "linear" else self.reference_frames) - 1
        progress = frame_index / span if span > 0 else 0.0
        return self.x0 + progress * self.dx, self.y0 + progress * self.dy

    def centre(self, frame_index: int, num_frames: int) -> Tuple[float, float]:
        x, y = self.unfolded_centre(frame_index, num_frames)
        if self.motion == "bounce":
            half = self.size / 2
            return reflect(x, half, self.canvas_width - half), reflect(y, half, self.canvas_height - half)
        if self.motion == "wrap":
            return x % self.canvas_width, y % self.canvas_height
        return x, y

    def direction_at(self, frame_index: int, num_frames: int) -> str:
        """The direction the shape moves from ``frame_index`` to the next frame (the caption's one for linear and
        wrap; reversed after every wall contact when bouncing)."""
        if self.motion != "bounce" or self.direction == NO_DIRECTION:
            return self.direction
        (xa, ya), (xb, yb) = (self.centre(f, num_frames) for f in (frame_index, frame_index + 1))
        step = (xb - xa) if self.dx else (yb - ya)
        ux, uy = DIRECTION_VECTORS[self.direction]
        return self.direction if step * (ux + uy) > 0 else OPPOSITE[self.direction]

    def window_direction(self, start: int, length: int, num_frames: int) -> Optional[str]:
        """The true direction of frames ``start .. start + length - 1``: the one most frame steps take (at least
        ``WINDOW_DIRECTION_MAJORITY`` of them), else None (a bounce near the window's middle)."""
        return majority_direction([self.direction_at(f, num_frames) for f in range(start, start + length - 1)])


def majority_direction(steps: Sequence[str]) -> Optional[str]:
    """The direction of a window from its per-step directions: the most common one when at least
    ``WINDOW_DIRECTION_MAJORITY`` of the steps take it, else None (ambiguous: not scored)."""
    if not steps:
        return None
    best = max(sorted(set(steps)), key=list(steps).count)
    return best if list(steps).count(best) >= WINDOW_DIRECTION_MAJORITY * len(steps) else None


OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}


def reflect(value: float, low: float, high: float) -> float:
    """``value`` folded into [low, high] by reflection off both ends (a ball between two walls)."""
    length = high - low
    if length <= 0:
        return low
    u = (value - low) % (2 * length)
    return low + (u if u <= length else 2 * length - u)


def sample_motion(
    rng: np.random.Generator,
    color: str,
    shape: str,
    direction: str,
    height: int,
    width: int,
    moving: bool = True,
    motion: str = "linear",
    reference_frames: int = 16,
) -> ShapeMotion:
    """Draw size, start and travel so the motion is clearly visible and the shape stays in frame.

    ``direction == "none"`` or ``moving=False`` gives a static shape anywhere in frame. ``motion="linear"`` keeps
    the whole travel inside the frame; ``"bounce"`` starts the centre anywhere the shape fits and ``"wrap"``
    anywhere on the torus (the same travel per ``reference_frames``), so any window of a long clip is as likely as
    another. Linear draws are unchanged by the other modes' existence (same stream, same values).
    """
    _check_attributes(color, shape, direction)
    size = float(rng.uniform(*SIZE_RANGE) * min(height, width))
    half = size / 2
    if direction == NO_DIRECTION or not moving:
        x0 = float(rng.uniform(half, width - half))
        y0 = float(rng.uniform(half, height - half))
        return ShapeMotion(color, shape, direction, size, x0, y0, 0.0, 0.0)
    ux, uy = DIRECTION_VECTORS[direction]
    along_extent = width if ux else height
    across_extent = height if ux else width
    travel = float(rng.uniform(*TRAVEL_RANGE) * along_extent)
    # leftmost possible start of the interval swept by the centre, then flip for negative directions
    slack = along_extent - size - travel
    sweep_start = half + float(rng.uniform(0.0, max(slack, 0.0)))
    sign = ux + uy
    along0 = sweep_start if sign > 0 else sweep_start + travel
    across0 = float(rng.uniform(half, across_extent - half))
    if motion == "bounce":
        along0 = float(rng.uniform(half, along_extent - half))
    elif motion == "wrap":
        along0 = float(rng.uniform(0.0, along_extent))
    elif motion != "linear":
        raise ValueError(f"unknown motion {motion!r}; choose one of {list(MOTIONS)}")
    x0, y0 = (along0, across0) if ux else (across0, along0)
    extra = {}
    if motion != "linear":
        extra = dict(motion=motion, reference_frames=int(reference_frames), canvas_height=height, canvas_width=width)
    return ShapeMotion(color, shape, direction, size, x0, y0, ux * travel, uy * travel, **extra)


def shape_coverage(shape: str, centre_x: float, centre_y: float, size: float, height: int, width: int) -> np.ndarray:
    """Fraction of each pixel [H, W] covered by the shape (supersampled, so edges are anti-aliased).

    The shape fills a ``size`` x ``size`` box centred on the centre: a disc, the full square, or an upright
    isosceles triangle with its apex at the top middle and its base along the bottom edge.
    """
    offsets = (np.arange(SUPERSAMPLE) + 0.5) / SUPERSAMPLE
    ys = (np.arange(height)[:, None] + offsets[None, :]).reshape(-1)[:, None] - centre_y  # [H*S, 1]
    xs = (np.arange(width)[:, None] + offsets[None, :]).reshape(-1)[None, :] - centre_x  # [1, W*S]
    half = size / 2
    if shape == "circle":
        inside = xs**2 + ys**2 <= half**2
    elif shape == "square":
        inside = (np.abs(xs) <= half) & (np.abs(ys) <= half)
    elif shape == "triangle":
        depth = ys + half  # distance below the apex
        inside = (depth >= 0) & (ys <= half) & (np.abs(xs) <= depth / 2)
    else:
        raise ValueError(f"unknown shape {shape!r}; choose one of {list(SHAPES)}")
    return inside.reshape(height, SUPERSAMPLE, width, SUPERSAMPLE).mean(axis=(1, 3))


def render_video(motion: ShapeMotion, height: int, width: int, num_frames: int) -> np.ndarray:
    """Render a clip as uint8 frames [T, H, W, 3]."""
    background = np.asarray(BACKGROUND, dtype=np.float64)
    foreground = np.asarray(PALETTE[motion.color], dtype=np.float64)
    frames = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    # on a torus the shape is drawn at its centre and at the copies one canvas away (it is smaller than the canvas,
    # so the copies never overlap): a shape crossing an edge shows on both sides
    copies = [(0, 0)] if motion.motion != "wrap" else [(i * width, j * height) for i in (-1, 0, 1) for j in (-1, 0, 1)]
    half = motion.size / 2
    for t in range(num_frames):
        cx, cy = motion.centre(t, num_frames)
        # only the copies whose box reaches the canvas (the others cover nothing): 1-4 of the 9, a 2-9x cheaper frame
        seen = [(ox, oy) for ox, oy in copies if -half <= cx + ox <= width + half and -half <= cy + oy <= height + half]
        alpha = sum(shape_coverage(motion.shape, cx + ox, cy + oy, motion.size, height, width) for ox, oy in seen)
        alpha = np.minimum(alpha, 1.0)[..., None]
        frames[t] = np.round(background + alpha * (foreground - background)).astype(np.uint8)
    return frames


def render_from_attributes(
    color: str,
    shape: str,
    direction: str,
    height: int = 32,
    width: int = 32,
    num_frames: int = 16,
    seed: int = 0,
    moving: bool = True,
    motion: str = "linear",
    reference_frames: int = 16,
) -> np.ndarray:
    """Convenience: sample a motion for these attributes with ``seed`` and render it [T, H, W, 3] uint8."""
    rng = np.random.default_rng(seed)
    drawn = sample_motion(rng, color, shape, direction, height, width, moving, motion, reference_frames)
    return render_video(drawn, height, width, num_frames)


# ----------------------------------------------------------------------------------------------- dataset
def dataset_attributes(num: int, seed: int) -> List[Tuple[str, str, str]]:
    """Balanced attributes for clips 0..num-1: every block of 72 clips is a seeded shuffle of all combos,
    so num >= 72 covers every combination and each colour/shape/direction is equally frequent."""
    combos = all_combinations()
    rng = np.random.default_rng([seed, 0x5EED])
    out: List[Tuple[str, str, str]] = []
    while len(out) < num:
        out.extend(combos[i] for i in rng.permutation(len(combos)))
    return out[:num]


def image_indices(num: int, image_fraction: float) -> set:
    """Which clips are single-frame images: round(num * image_fraction) indices spread evenly."""
    num_images = int(round(num * image_fraction))
    if num_images <= 0:
        return set()
    return set(np.linspace(0, num - 1, num_images).round().astype(int).tolist())


def clip_motion(
    index: int,
    combo: Tuple[str, str, str],
    seed: int,
    height: int,
    width: int,
    image: bool,
    motion: str = "linear",
    reference_frames: int = 16,
):
    """The motion of clip ``index``: its own random stream, so clip i does not depend on ``num``."""
    rng = np.random.default_rng([seed, index])
    color, shape, direction = combo
    direction = NO_DIRECTION if image else direction
    return sample_motion(rng, color, shape, direction, height, width, motion=motion, reference_frames=reference_frames)


def write_dataset(
    out_dir,
    num: int,
    seed: int = 0,
    height: int = 32,
    width: int = 32,
    num_frames: int = 16,
    fps: float = 8.0,
    image_fraction: float = 0.0,
    crf: int = 18,
    progress: bool = True,
    motion: str = "linear",
    reference_frames: int = 16,
) -> Path:
    """Render ``num`` clips to ``out_dir`` (see the module docstring for the layout); returns meta.csv's path.
    ``motion`` / ``reference_frames``: long-clip motion (``sample_motion``).

    Deterministic: the same arguments give identical csv/json files and identical decoded frames.
    """
    from opensora.datasets.video_io import write_video

    if num < 1 or height < 8 or width < 8 or num_frames < 2:
        raise ValueError(
            f"need num >= 1, height/width >= 8, num_frames >= 2; got {num}, {height}x{width}, {num_frames}"
        )
    if not 0.0 <= image_fraction <= 1.0:
        raise ValueError(f"image_fraction must be in [0, 1], got {image_fraction}")
    motion_mode = motion
    fps = float(fps)
    out_dir = Path(out_dir)
    (out_dir / "videos").mkdir(parents=True, exist_ok=True)
    combos = dataset_attributes(num, seed)
    images = image_indices(num, image_fraction)
    indices = range(num)
    if progress:
        from tqdm import tqdm

        indices = tqdm(indices, desc="MovingShapes", unit="clip")
    rows = []
    for index in indices:
        image = index in images
        motion = clip_motion(index, combos[index], seed, height, width, image, motion_mode, reference_frames)
        frames = render_video(motion, height, width, 1 if image else num_frames)
        rel_path = f"videos/{index:06d}.{'png' if image else 'mp4'}"
        write_video(out_dir / rel_path, frames, fps=fps, crf=crf)
        record = {
            k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(motion).items() if k in META_COLUMNS
        }
        row = {
            "path": rel_path,
            "text": caption(motion.color, motion.shape, motion.direction),
            "num_frames": len(frames),
            "height": height,
            "width": width,
            "fps": fps,
            **record,
        }
        rows.append(row)
    meta_path = out_dir / "meta.csv"
    with open(meta_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(META_COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
    settings = dict(
        num=num,
        seed=seed,
        height=height,
        width=width,
        num_frames=num_frames,
        fps=fps,
        image_fraction=image_fraction,
        crf=crf,
        motion=motion_mode,
        reference_frames=reference_frames,
    )
    attributes = {
        "palette": {name: list(rgb) for name, rgb in PALETTE.items()},
        "shapes": list(SHAPES),
        "directions": list(DIRECTIONS),
        "background": list(BACKGROUND),
        "caption_template": "a {color} {shape} moving {direction}",
        "paths_relative_to": "the directory containing meta.csv",
        "settings": settings,
        "clips": rows,
    }
    (out_dir / "attributes.json").write_text(json.dumps(attributes, indent=1) + "\n")
    (out_dir / "prompts.txt").write_text("\n".join(all_captions()) + "\n")
    return meta_path


def read_meta(csv_path) -> List[dict]:
    """Rows of a meta.csv as dicts of strings (no pandas needed)."""
    with open(csv_path, newline="") as f:
        return list(csv.DictReader(f))


def resolve_path(csv_path, path: str) -> Path:
    """A meta.csv ``path``: absolute as is, otherwise relative to the csv's directory (as write_dataset writes)."""
    p = Path(path)
    return p if p.is_absolute() else Path(csv_path).resolve().parent / p


__all__: Sequence[str] = (
    "PALETTE",
    "COLORS",
    "SHAPES",
    "DIRECTIONS",
    "BACKGROUND",
    "NO_DIRECTION",
    "MOTIONS",
    "ShapeMotion",
    "reflect",
    "majority_direction",
    "caption",
    "all_captions",
    "all_combinations",
    "parse_caption",
    "sample_motion",
    "shape_coverage",
    "render_video",
    "render_from_attributes",
    "dataset_attributes",
    "write_dataset",
    "read_meta",
    "resolve_path",
)
