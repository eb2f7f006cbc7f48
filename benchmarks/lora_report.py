#!/usr/bin/env python
"""Helpers of benchmarks/gpu_lora.sh: pick the subset a teacher scores worst on, and report a LoRA finetune.

  python -m benchmarks.lora_report worst TEACHER_SCORES.json          -> prints e.g. "direction=left"
  python -m benchmarks.lora_report report --teacher CKPT --lora CKPT --adapter-file F --before J --after J
      [--before-all J --after-all J] --hashes-before F --hashes-after F --json OUT

The report: subset (and all-caption) scores before / after, the adapter's size on disk, the base's and the adapter's
parameter counts, the optimizer memory of full finetuning vs LoRA (AdamW: fp32 exp_avg + exp_avg_sq, plus the fp32
master copy that bf16 training keeps: 12 bytes per trained parameter), the optimizer state measured on disk for both
(the teacher's own checkpoint holds a full-finetuning optimizer), and whether the base weights are bit-identical
afterwards (every file of the teacher checkpoint hashes the same, and the adapter's recorded base sha256 matches).
"""

import argparse
import json
from collections import defaultdict
from pathlib import Path

from opensora.convert.weights import load_role_weights
from opensora.lora import base_fingerprint


def worst_subset(scores: dict) -> str:
    """The shape or direction value whose captions the teacher gets fully right least often."""
    hits = defaultdict(list)
    for row in scores["rows"]:
        for key in ("direction", "shape"):
            hits[(key, row["truth"][key])].append(bool(all(v for v in row["correct"].values() if v is not None)))
    (key, value), _ = min(hits.items(), key=lambda kv: (sum(kv[1]) / len(kv[1]), kv[0][0] != "direction"))
    return f"{key}={value}"


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) if Path(path).exists() else 0


def report(args) -> dict:
    teacher, lora = Path(args.teacher), Path(args.lora)
    base = load_role_weights(teacher, role="model", ema=True).state_dict
    adapter = load_role_weights(lora, role="model", ema=False, lora="only").state_dict
    record = json.loads((lora / "model" / "lora.json").read_text())
    n_base = sum(t.numel() for t in base.values())
    n_adapter = sum(t.numel() for t in adapter.values())
    scores = {
        name: json.loads(Path(path).read_text())
        for name, path in (
            ("before", args.before),
            ("after", args.after),
            ("before_all", args.before_all),
            ("after_all", args.after_all),
        )
        if path
    }
    pick = lambda s: {k: s[k] for k in ("color_acc", "shape_acc", "direction_acc", "all_acc", "n")}  # noqa: E731
    hashes_before, hashes_after = (Path(p).read_text() for p in (args.hashes_before, args.hashes_after))
    result = dict(
        subset=scores["before"].get("where"),
        scores={name: pick(s) for name, s in scores.items()},
        base_params=n_base,
        adapter_params=n_adapter,
        adapter_fraction=n_adapter / n_base,
        adapter_file_bytes=Path(args.adapter_file).stat().st_size,
        adapter_checkpoint_bytes=(lora / "model" / "adapter.safetensors").stat().st_size,
        optimizer_bytes_full_finetune=12 * n_base,
        optimizer_bytes_lora=12 * n_adapter,
        optimizer_bytes_saved=12 * (n_base - n_adapter),
        optimizer_on_disk_teacher=dir_bytes(teacher / "model" / "optimizer") + dir_bytes(teacher / "model" / "master"),
        optimizer_on_disk_lora=dir_bytes(lora / "model" / "optimizer") + dir_bytes(lora / "model" / "master"),
        base_files_identical=hashes_before == hashes_after and bool(hashes_before.strip()),
        base_sha256_matches_record=base_fingerprint(base) == record["base_sha256"],
        lora=dict(rank=record["rank"], alpha=record["alpha"], target_modules=record["target_modules"]),
    )
    print(json.dumps(result, indent=1))
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    worst = sub.add_parser("worst")
    worst.add_argument("scores")
    rep = sub.add_parser("report")
    for name in ("teacher", "lora", "adapter-file", "before", "after", "hashes-before", "hashes-after", "json"):
        rep.add_argument(f"--{name}", required=True)
    rep.add_argument("--before-all")
    rep.add_argument("--after-all")
    args = parser.parse_args(argv)
    if args.command == "worst":
        print(worst_subset(json.loads(Path(args.scores).read_text())))
    else:
        report(args)


if __name__ == "__main__":
    main()
