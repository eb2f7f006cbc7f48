#!/usr/bin/env python
"""Build the training table of a folder of clips: every video and image under DIR with its caption.

    python tools/make_table.py DIR --out DIR/table.csv [--config configs/diffusion/train/X.py [--dataset.target-fps 8]]

Captions come from a .txt beside each file (clip.mp4 + clip.txt), else from DIR/captions.csv, captions.json or
metadata.jsonl (or --captions FILE). Every file is probed with PyAV (frames, fps, size, duration; the first frame is
decoded); unreadable and uncaptioned files are listed and left out. With --config, the table is read back through
that config's dataset and bucket sampler and a summary says which buckets the clips fill (any further --key value
overrides the config, as in train.py). Columns: path, text, num_frames, height, width, fps, duration (README,
"Train on your own clips"). Bad input prints one line and exits with code 2.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opensora.cli_errors import UserInputError, run_cli  # noqa: E402
from opensora.datasets.folder_table import MAPPING_NAMES, build_folder_table, write_table  # noqa: E402

SHOWN = 10  # problem files listed one by one; the rest are counted


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="make_table.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", help="the folder of videos / images (searched recursively)")
    parser.add_argument("--out", required=True, help="the table to write: .csv or .parquet")
    parser.add_argument(
        "--captions", default=None, help=f"a caption mapping file (default: DIR/{{{','.join(MAPPING_NAMES)}}})"
    )
    parser.add_argument(
        "--config", default=None, help="a training config: summarise which of its buckets the data fills"
    )
    parser.add_argument("--ranks", type=int, default=1, help="with --config: data-parallel ranks of the summary")
    parser.add_argument(
        "--allow-uncaptioned",
        action="store_true",
        help="keep files without a caption (empty text) instead of leaving them out",
    )
    parser.add_argument("--absolute", action="store_true", help="absolute paths (default: relative to the table)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def _listed(title: str, items) -> list:
    lines = [f"{title}: {len(items)}"] if items else []
    lines += [f"  {item}" for item in items[:SHOWN]]
    if len(items) > SHOWN:
        lines.append(f"  ... and {len(items) - SHOWN} more")
    return lines


def main(argv=None) -> int:
    args, config_overrides = _parser().parse_known_args(argv)
    if config_overrides and args.config is None:
        raise UserInputError(f"unrecognized arguments {config_overrides}: config overrides need --config")
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise UserInputError(f"--out {out} already exists: pass --overwrite to replace it")
    if args.ranks < 1:
        raise UserInputError(f"--ranks must be >= 1, got {args.ranks}")
    cfg = None
    if args.config is not None:  # loaded first: a typo in an override fails before the folder is probed
        from opensora.config import load_config

        cfg = load_config(args.config, config_overrides)
        if not cfg.get("bucket_config") or "data_path" not in (cfg.get("dataset") or {}):
            raise UserInputError(
                f"--config {args.config} has no bucket_config or no dataset that reads a table (dataset.data_path)"
            )
    try:
        table = build_folder_table(
            args.folder, args.captions, allow_uncaptioned=args.allow_uncaptioned, progress=not args.no_progress
        )
    except ValueError as error:
        raise UserInputError(str(error)) from None
    report = _listed("left out, unreadable", [f"{path}: {reason}" for path, reason in table.unreadable])
    report += _listed(
        "left out, no caption (a .txt beside it, or a captions file; --allow-uncaptioned keeps them)", table.uncaptioned
    )
    if report:
        print("\n".join(report), file=sys.stderr)
    if not table.rows:
        raise UserInputError(f"{args.folder}: no readable, captioned video or image; nothing to write")
    write_table(table.rows, out, absolute=args.absolute)
    sources = ", ".join(f"{n} from {s}" for s, n in sorted(table.caption_source.items()))
    frames = sum(r["num_frames"] for r in table.rows)
    print(f"wrote {out}: {len(table.rows)} files ({frames} frames; captions: {sources})")
    if cfg is not None:
        from opensora.datasets.bucket_summary import bucket_summary

        print(f"buckets of {args.config}:")
        print("\n".join(bucket_summary(out, cfg, num_ranks=args.ranks)))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:], prog="make_table.py"))
