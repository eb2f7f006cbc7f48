#!/usr/bin/env python
"""Export, convert and inspect MMDiT weights.

    python tools/convert_checkpoint.py SRC DST [--ema | --no-ema] [--dtype bf16] [--role model]
                                       [--to opensora|opensora2|diffusers] [--opensora2-fused-qkv]
                                       [--opensora2-rope half-split|adjacent] [--config CONFIG.py]
                                       [--merge-lora [--base PATH] | --lora-only]
    python tools/convert_checkpoint.py SRC DST --from diffusers|opensora [--dtype bf16] [--axes-dims 16,56,56]
    python tools/convert_checkpoint.py inspect SRC [--role model] [--no-ema]      (or: SRC --inspect)

SRC is a training checkpoint directory (``.../checkpoints/step-0000500``), a training run's outputs directory (its
newest complete checkpoint, named on stderr) or an exported ``.safetensors`` file;
``--to opensora`` (default) keeps our keys, ``opensora2`` writes Open-Sora 2.0's MMDiT layout (split q/k/v as in the
released v2 checkpoint unless ``--opensora2-fused-qkv``), ``diffusers`` writes FluxTransformer2DModel keys (a DST
without ``.safetensors`` becomes a ``from_pretrained`` directory). ``--from`` imports foreign weights (a diffusers
model/pipeline directory or an Open-Sora 2.0 ``.safetensors``) into our layout. ``--role student`` for distilled runs.

Open-Sora 2.0's shipped configs rotate RoPE half-split channel pairs (``use_liger_rope=True``); ours rotates adjacent
pairs. ``--to opensora2`` / ``--from opensora`` reorder q/k for it (``--opensora2-rope adjacent`` for a model run with
``use_liger_rope=False``). Reading a checkpoint never runs code: the architecture comes from its JSON ``arch`` record,
or from ``--config`` (your own config file); a foreign Open-Sora 2.0 file needs ``--axes-dims`` (its RoPE split).
A LoRA checkpoint (a role trained with ``lora = dict(...)``) holds only its adapter: ``--merge-lora`` adds it into the
base weights (its recorded ``init_from``, or ``--base PATH``; the base must hash to the recorded sha256) and writes full
weights; ``--lora-only`` writes the adapter alone (one small safetensors file that the sampler merges on load).
Bad input prints one line and exits with code 2 (``--debug`` keeps the traceback).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opensora.checkpoint_layout import newest_checkpoint_of  # noqa: E402
from opensora.checkpoint_layout import is_complete  # noqa: E402
from opensora.checkpoint_manifest import verify_checkpoint  # noqa: E402
from opensora.cli_errors import UserInputError, run_cli  # noqa: E402
from opensora.convert.export import (  # noqa: E402
    export_weights,
    format_summary,
    import_weights,
    inspect_weights,
)
from opensora.convert.opensora2 import HALF_SPLIT, ROPE_PAIRINGS  # noqa: E402
from opensora.convert.weights import LORA_KEY, load_role_weights  # noqa: E402
from opensora.dtypes import SHORT_NAMES  # noqa: E402
from opensora.writable import check_writable_dir  # noqa: E402


def _inspect_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="convert_checkpoint.py inspect", description="summarise weights")
    parser.add_argument("src", help="checkpoint directory or .safetensors file")
    parser.add_argument(
        "--role", default="model", help="trained role to read (default: model; 'student' for distillation)"
    )
    parser.add_argument("--ema", dest="ema", action="store_true", default=True, help="read the EMA weights (default)")
    parser.add_argument("--no-ema", dest="ema", action="store_false", help="read the raw model weights")
    return parser


def _convert_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="convert_checkpoint.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("src", help="checkpoint directory, .safetensors file, or (with --from) foreign weights")
    parser.add_argument("dst", nargs="?", help="output .safetensors file (or directory for --to diffusers)")
    parser.add_argument(
        "--role", default="model", help="trained role to export (default: model; 'student' for distillation)"
    )
    parser.add_argument("--ema", dest="ema", action="store_true", default=True, help="export the EMA weights (default)")
    parser.add_argument("--no-ema", dest="ema", action="store_false", help="export the raw model weights")
    parser.add_argument(
        "--dtype", choices=sorted(SHORT_NAMES.values()), default=None, help="cast floating tensors (default: keep)"
    )
    parser.add_argument(
        "--to",
        default="opensora",
        choices=["opensora", "opensora2", "diffusers"],
        help="key layout of the output (default: ours)",
    )
    parser.add_argument(
        "--from",
        dest="from_",
        default=None,
        choices=["diffusers", "opensora"],
        help="import foreign weights (diffusers Flux dir / Open-Sora 2.0 file) into our layout",
    )
    parser.add_argument(
        "--opensora2-fused-qkv",
        action="store_true",
        help="with --to opensora2: fused qkv/linear1 (Flux form) instead of split q/k/v",
    )
    parser.add_argument(
        "--opensora2-rope",
        default=None,
        choices=ROPE_PAIRINGS,
        help=f"RoPE channel pairing on the Open-Sora 2.0 side (default {HALF_SPLIT}: its shipped "
        "use_liger_rope=True; adjacent: use_liger_rope=False; on import a file's own record wins)",
    )
    parser.add_argument(
        "--axes-dims", default=None, help="with --from opensora: the RoPE split of a head over (t, h, w), e.g. 16,56,56"
    )
    parser.add_argument(
        "--config",
        default=None,
        help="take the architecture from this config file (yours) instead of the checkpoint's record",
    )
    lora = parser.add_mutually_exclusive_group()
    lora.add_argument(
        "--merge-lora",
        action="store_true",
        help="a LoRA role: merge its adapter into the base weights (init_from, or --base)",
    )
    lora.add_argument("--lora-only", action="store_true", help="a LoRA role: export the adapter alone")
    parser.add_argument(
        "--base",
        default=None,
        help="with --merge-lora: the base weights (checkpoint dir or .safetensors) instead of the "
        "adapter's recorded init_from",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    parser.add_argument("--inspect", action="store_true", help="only print a summary of SRC")
    return parser


def _newest_checkpoint(src) -> Path:
    """SRC as given, or a run directory's newest complete checkpoint (said on stderr, as the sampler logs it)."""
    resolved = newest_checkpoint_of(src)
    if resolved != Path(src):
        print(f"{src} is a training run: using its newest complete checkpoint {resolved}", file=sys.stderr)
    return resolved


def main(argv=None) -> int:
    """Bad input (a missing or foreign file, a layout that does not fit) is one line and exit code 2."""
    return run_cli(_run, argv, prog="convert_checkpoint.py", also=(ValueError, KeyError))


def _run(argv) -> int:
    argv = list(argv)
    if argv and argv[0] == "inspect":
        args = _inspect_parser().parse_args(argv[1:])
        print(format_summary(inspect_weights(_newest_checkpoint(args.src), role=args.role, ema=args.ema)))
        return 0
    parser = _convert_parser()
    args = parser.parse_args(argv)
    if args.from_ is None:
        args.src = str(_newest_checkpoint(args.src))
        if is_complete(args.src):  # a training checkpoint: every file against its manifest
            verify_checkpoint(args.src, checksums=True, only=args.role)
    if args.inspect:
        print(format_summary(inspect_weights(args.src, role=args.role, ema=args.ema)))
        return 0
    if args.dst is None:
        parser.error("DST is required unless --inspect / inspect is used")
    dst = Path(args.dst)
    if dst.exists() and dst.resolve() == Path(args.src).resolve():
        raise UserInputError(f"DST {dst} is SRC: write the converted weights to another path")
    if dst.exists() and not args.overwrite:
        raise UserInputError(f"DST {dst} already exists: pass --overwrite to replace it, or choose another path")
    check_writable_dir(dst.parent, "DST's folder")  # before reading SRC: a read-only target fails at once
    if args.from_ is not None:
        if args.to != "opensora":
            parser.error("--from imports into our layout; convert the result with a second call for --to")
        result = import_weights(
            args.src, args.dst, args.from_, dtype=args.dtype, axes_dims=args.axes_dims, rope_pairing=args.opensora2_rope
        )
    else:
        if args.base is not None and not args.merge_lora:
            parser.error("--base is the base weights for --merge-lora")
        stored = load_role_weights(args.src, role=args.role, ema=args.ema, lora="stored")
        is_adapter = LORA_KEY in stored.metadata
        if is_adapter and not (args.merge_lora or args.lora_only):
            raise UserInputError(
                f"{stored.path} is a LoRA adapter: pass --merge-lora (full weights, base from its "
                "init_from or --base) or --lora-only (the adapter alone)"
            )
        if not is_adapter and (args.merge_lora or args.lora_only):
            raise UserInputError(
                f"{stored.path} holds full weights, not a LoRA adapter: drop "
                f"{'--merge-lora' if args.merge_lora else '--lora-only'}"
            )
        result = export_weights(
            args.src,
            args.dst,
            role=args.role,
            ema=args.ema,
            dtype=args.dtype,
            to=args.to,
            opensora2_fused_qkv=args.opensora2_fused_qkv,
            rope_pairing=args.opensora2_rope or HALF_SPLIT,
            config_path=args.config,
            lora="only" if args.lora_only else "merge",
            base=args.base,
        )
    meta = result.metadata
    print(
        f"wrote {result.path} ({result.num_tensors} tensors, layout {result.layout}, dtype {meta['dtype']}, "
        f"source {meta['source']}, step {meta.get('step', 'unknown')})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
