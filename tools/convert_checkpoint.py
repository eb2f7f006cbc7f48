#!/usr/bin/env python
"""Export, convert and inspect MMDiT weights.

    python tools/convert_checkpoint.py SRC DST [--ema | --no-ema] [--dtype bf16] [--role model]
                                       [--to opensora|opensora2|diffusers] [--opensora2-fused-qkv]
    python tools/convert_checkpoint.py SRC DST --from diffusers|opensora [--dtype bf16]
    python tools/convert_checkpoint.py inspect SRC [--role model] [--no-ema]      (or: SRC --inspect)

SRC is a training checkpoint directory (``.../checkpoints/step-0000500``) or an exported ``.safetensors`` file;
``--to opensora`` (default) keeps our keys, ``opensora2`` writes Open-Sora 2.0's MMDiT layout (split q/k/v as in the
released v2 checkpoint unless ``--opensora2-fused-qkv``), ``diffusers`` writes FluxTransformer2DModel keys (a DST
without ``.safetensors`` becomes a ``from_pretrained`` directory). ``--from`` imports foreign weights (a diffusers
model/pipeline directory or an Open-Sora 2.0 ``.safetensors``) into our layout. ``--role student`` for distilled runs.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opensora.convert.export import (  # noqa: E402
    export_weights, format_summary, import_weights, inspect_weights,
)
from opensora.dtypes import SHORT_NAMES  # noqa: E402


def _inspect_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="convert_checkpoint.py inspect", description="summarise weights")
    parser.add_argument("src", help="checkpoint directory or .safetensors file")
    parser.add_argument("--role", default="model", help="trained role to read (default: model; 'student' for distillation)")
    parser.add_argument("--ema", dest="ema", action="store_true", default=True, help="read the EMA weights (default)")
    parser.add_argument("--no-ema", dest="ema", action="store_false", help="read the raw model weights")
    return parser


def _convert_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="convert_checkpoint.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help="checkpoint directory, .safetensors file, or (with --from) foreign weights")
    parser.add_argument("dst", nargs="?", help="output .safetensors file (or directory for --to diffusers)")
    parser.add_argument("--role", default="model", help="trained role to export (default: model; 'student' for distillation)")
    parser.add_argument("--ema", dest="ema", action="store_true", default=True, help="export the EMA weights (default)")
    parser.add_argument("--no-ema", dest="ema", action="store_false", help="export the raw model weights")
    parser.add_argument("--dtype", choices=sorted(SHORT_NAMES.values()), default=None, help="cast floating tensors (default: keep)")
    parser.add_argument("--to", default="opensora", choices=["opensora", "opensora2", "diffusers"],
                        help="key layout of the output (default: ours)")
    parser.add_argument("--from", dest="from_", default=None, choices=["diffusers", "opensora"],
                        help="import foreign weights (diffusers Flux dir / Open-Sora 2.0 file) into our layout")
    parser.add_argument("--opensora2-fused-qkv", action="store_true",
                        help="with --to opensora2: fused qkv/linear1 (Flux form) instead of split q/k/v")
    parser.add_argument("--inspect", action="store_true", help="only print a summary of SRC")
    return parser


def main(argv=None) -> int:
    try:
        return _run(argv)
    except (ValueError, KeyError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def _run(argv) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "inspect":
        args = _inspect_parser().parse_args(argv[1:])
        print(format_summary(inspect_weights(args.src, role=args.role, ema=args.ema)))
        return 0
    parser = _convert_parser()
    args = parser.parse_args(argv)
    if args.inspect:
        print(format_summary(inspect_weights(args.src, role=args.role, ema=args.ema)))
        return 0
    if args.dst is None:
        parser.error("DST is required unless --inspect / inspect is used")
    if args.from_ is not None:
        if args.to != "opensora":
            parser.error("--from imports into our layout; convert the result with a second call for --to")
        result = import_weights(args.src, args.dst, args.from_, dtype=args.dtype)
    else:
        result = export_weights(args.src, args.dst, role=args.role, ema=args.ema, dtype=args.dtype, to=args.to,
                                opensora2_fused_qkv=args.opensora2_fused_qkv)
    meta = result.metadata
    print(f"wrote {result.path} ({result.num_tensors} tensors, layout {result.layout}, dtype {meta['dtype']}, "
          f"source {meta['source']}, step {meta.get('step', 'unknown')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
