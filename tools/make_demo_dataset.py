#!/usr/bin/env python
"""Write the MovingShapes demo dataset: mp4 clips, meta.csv (paths relative to the csv), attributes.json
and prompts.txt. Example:

    python tools/make_demo_dataset.py --out data/moving_shapes --num 512 --seed 0
    # long clips with a defined motion (ground truth for per-window scoring: eval_moving_shapes.py --window 16)
    python tools/make_demo_dataset.py --out data/wrap_long --num 72 --size 64 --num-frames 128 --motion wrap
"""

import argparse
import sys

from opensora.datasets.moving_shapes import write_dataset


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument("--num", type=int, default=256, help="number of clips")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=None, help="square frames of this side (sets height and width)")
    parser.add_argument("--height", type=int, default=32)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--num-frames", type=int, default=16)
    parser.add_argument("--fps", type=float, default=8.0)
    parser.add_argument(
        "--image-fraction",
        type=float,
        default=0.0,
        help="fraction of samples written as single png frames captioned without a direction",
    )
    parser.add_argument("--crf", type=int, default=18, help="H.264 quality (lower is better)")
    parser.add_argument(
        "--motion",
        choices=("linear", "bounce", "wrap"),
        default="linear",
        help="linear: the travel spans the clip; bounce / wrap: the speed of a --reference-frames clip, any length",
    )
    parser.add_argument("--reference-frames", type=int, default=16, help="bounce / wrap: frames per travel")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.size is not None:
        args.height = args.width = args.size
    return args


def main(argv=None):
    args = parse_args(argv)
    meta = write_dataset(
        args.out,
        num=args.num,
        seed=args.seed,
        height=args.height,
        width=args.width,
        num_frames=args.num_frames,
        fps=args.fps,
        image_fraction=args.image_fraction,
        crf=args.crf,
        progress=not args.no_progress,
        motion=args.motion,
        reference_frames=args.reference_frames,
    )
    print(f"wrote {args.num} clips; index: {meta}")


if __name__ == "__main__":
    from opensora.cli_errors import run_cli

    sys.exit(run_cli(main, sys.argv[1:], prog="make_demo_dataset.py", also=(ValueError,)))
