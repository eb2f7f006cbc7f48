#!/usr/bin/env python
"""Score videos against their MovingShapes captions (colour, shape, motion direction).

    python tools/eval_moving_shapes.py SAMPLES.csv --json scores.json
    # long clips, window by window (16 frames each; wrap / bounce: the motion rule the clips follow)
    python tools/eval_moving_shapes.py SAMPLES.csv --window 16 --motion wrap --json windows.json
    # and what each window of each clip reads: direction, fitted travel and where the shape starts (a drift's shape)
    python tools/eval_moving_shapes.py SAMPLES.csv --window 16 --motion wrap --track
    # streamed clips: the frame step across chunk edges over the step inside chunks, overall and by window
    python tools/eval_moving_shapes.py SAMPLES.csv --window 16 --motion wrap --chunk-frames 2

The csv needs columns ``path`` and ``text``; a relative path is taken relative to the csv's directory.
Videos that cannot be decoded are reported and counted as wrong (the window mode refuses them instead: its windows
need every clip). In the window mode a text that is a prompt schedule (``0:A;64:B``, what ``inference.py
--prompt-schedule`` lists) scores each window against the caption in force over it (a window with a switch inside is
not scored).
"""

import argparse
import json
import sys
from pathlib import Path

from opensora.eval.moving_shapes import evaluate_csv, load_rows


def evaluate_windows(args, rows) -> dict:
    """Window scores of the decoded ``rows`` (``load_rows``)."""
    from opensora.cli_errors import UserInputError
    from opensora.eval.moving_shapes_windows import score_windows
    from opensora.inference.streaming.prompt_schedule import looks_like_schedule, parse_prompt_schedule

    broken = [path for path, _, _, error in rows if error is not None]
    if not rows or broken:
        raise UserInputError(f"{args.csv}: {'no videos' if not rows else f'cannot decode {broken}'}; fix the csv")
    lengths = {len(frames) for _, _, frames, _ in rows}
    if len(lengths) > 1 or min(lengths) < args.window:
        raise UserInputError(
            f"window scoring needs clips of one length >= --window {args.window}; got lengths {sorted(lengths)}"
        )
    # a streamed prompt schedule ("0:A;64:B", --prompt-schedule) is scored window by window against its captions
    prompts = [parse_prompt_schedule(text) if looks_like_schedule(text) else text for _, text, _, _ in rows]
    videos = [frames for _, _, frames, _ in rows]
    return score_windows(
        videos, prompts, args.window, args.stride, args.motion, stats_margin=args.stats_margin, workers=args.workers
    )


def track_lines(rows, window: int, stride, motion: str) -> list:
    """One line per clip: each window's direction read, its fitted travel (x, y) and the centre it starts from, in
    the evaluator's analysis pixels (x right, y down): a shape that stops at an edge, turns or vanishes shows here."""
    from opensora.eval.moving_shapes import read_shape
    from opensora.eval.moving_shapes_windows import window_starts

    lines = []
    for path, text, frames, _ in rows:
        cells = []
        for start in window_starts(len(frames), window, stride):
            r = read_shape(frames[start : start + window], wrap=motion == "wrap")
            travel = "-" if r.travel_xy is None else "({:+.1f}, {:+.1f})".format(*r.travel_xy)
            where = "" if r.start_xy is None else " @({:.0f}, {:.0f})".format(*r.start_xy)
            cells.append(f"{start} {r.direction} {travel}{where}")
        lines.append(f"{Path(path).name} [{text}]: " + " | ".join(cells))
    return lines


def flicker_of(args, rows) -> dict:
    """The frame step across the clips' chunk edges over the step inside chunks, overall and by window."""
    import numpy as np

    from opensora.eval.moving_shapes_windows import chunk_edge_flicker

    videos = np.stack([frames for _, _, frames, _ in rows])
    first = args.first_chunk_frames or args.chunk_frames
    return chunk_edge_flicker(videos, args.chunk_frames, first, window=args.window)


def main(argv=None):
    from opensora.datasets.moving_shapes import MOTIONS
    from opensora.eval.moving_shapes_windows import STATS_MARGIN

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="csv with columns path,text")
    parser.add_argument("--json", default=None, help="write the full report (per-video predictions) here")
    parser.add_argument("--window", type=int, default=None, help="score windows of this many frames")
    parser.add_argument("--stride", type=int, default=None, help="frames between window starts (default: --window)")
    parser.add_argument("--motion", choices=MOTIONS, default="linear", help="the motion rule of the clips")
    parser.add_argument("--stats-margin", type=float, default=STATS_MARGIN, help="relative frame-statistics margin")
    parser.add_argument(
        "--workers", type=int, default=1, help="window mode: score the clips in this many processes (~40 ms a window)"
    )
    parser.add_argument(
        "--track", action="store_true", help="window mode: print each clip's per-window direction, travel and start"
    )
    parser.add_argument(
        "--chunk-frames",
        type=int,
        default=None,
        help="window mode, streamed clips: their chunk in pixel frames; reports the chunk-edge flicker by window",
    )
    parser.add_argument(
        "--first-chunk-frames",
        type=int,
        default=None,
        help="the first chunk's pixel frames (a causal VAE's is shorter)",
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.track and args.window is None:
        parser.error("--track reads windows: give --window")
    if args.workers < 1:
        parser.error(f"--workers {args.workers}: give 1 or more processes")
    if args.chunk_frames is not None and (args.window is None or args.chunk_frames < 1):
        parser.error("--chunk-frames N: N >= 1, with --window (the flicker is reported by window)")
    if args.first_chunk_frames is not None and (args.chunk_frames is None or args.first_chunk_frames < 1):
        parser.error("--first-chunk-frames M: M >= 1, with --chunk-frames")
    if args.window is None:
        report = evaluate_csv(args.csv, json_out=args.json, progress=not args.no_progress)
        print(report.summary())
        for path in report.failed:
            print(f"  failed to decode: {path}", file=sys.stderr)
    else:
        rows = list(load_rows(args.csv, progress=not args.no_progress))  # decoded once, for the scores and --track
        report = evaluate_windows(args, rows)
        if args.chunk_frames:
            report["flicker"] = flicker_of(args, rows)
        if args.track:
            print("\n".join(track_lines(rows, args.window, args.stride, args.motion)))
        print(f"{len(report['windows'])} windows of {args.window} frames ({args.motion} motion)")
        for w in report["windows"]:
            print("  " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in w.items()))
        print("  " + "  ".join(f"{k} {v:.3f}" for k, v in report.items() if k.endswith("_min") and v is not None))
        if "flicker" in report:
            by_window = ", ".join("-" if r is None else f"{r:.2f}" for r in report["flicker"]["by_window"])
            overall = report["flicker"]["edge_over_inside"]
            print(f"  chunk-edge flicker {'-' if overall is None else f'{overall:.3f}'} (by window {by_window})")
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.json:
        print(f"report: {args.json}")


if __name__ == "__main__":
    from opensora.cli_errors import run_cli

    sys.exit(run_cli(main, sys.argv[1:], prog="eval_moving_shapes.py"))
