#!/usr/bin/env python
"""Score videos against their MovingShapes captions (colour, shape, motion direction).

    python tools/eval_moving_shapes.py SAMPLES.csv --json scores.json

The csv needs columns ``path`` and ``text``; a relative path is taken relative to the csv's directory.
Videos that cannot be decoded are reported and counted as wrong.
"""

import argparse
import sys

from opensora.eval.moving_shapes import evaluate_csv


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="csv with columns path,text")
    parser.add_argument("--json", default=None, help="write the full report (per-video predictions) here")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    report = evaluate_csv(args.csv, json_out=args.json, progress=not args.no_progress)
    print(report.summary())
    for path in report.failed:
        print(f"  failed to decode: {path}", file=sys.stderr)
    if args.json:
        print(f"report: {args.json}")


if __name__ == "__main__":
    from opensora.cli_errors import run_cli

    sys.exit(run_cli(main, sys.argv[1:], prog="eval_moving_shapes.py"))
