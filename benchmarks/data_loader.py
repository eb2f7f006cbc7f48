"""Decoded samples/s of the real data path (VideoTextDataset + bucket loader) at 256px x 33 frames.

Renders a few MovingShapes mp4s (256x256, 40 frames) once, then times the loader with 0 workers (the cost of one
worker, measured in the main process) and with N workers, and compares with what one GPU's training step
consumes at that shape. The GPU side is not run here: its samples/s comes from the measured 1B step in
benchmarks/results/ (scaled by FLOPs to this shape at the same achieved TFLOP/s) or from --gpu-samples-per-s.

  python -m benchmarks.data_loader --workers 0,2 --batches 12
"""

import argparse
import datetime
import json
import os
import time
from pathlib import Path

from benchmarks.common import OUT, ROOT

FRAMES, SIZE = 33, 256
# HunyuanVideo-style VAE: 4x time (causal: 1 + (T-1)/4), 8x space, 16 channels; MMDiT patch 1x2x2.
LATENT_T, LATENT_HW, PATCH = 1 + (FRAMES - 1) // 4, SIZE // 8, 2
VIDEO_TOKENS = LATENT_T * (LATENT_HW // PATCH) ** 2
TEXT_TOKENS = 512


def make_clips(out_dir: Path, num: int) -> Path:
    from opensora.datasets.moving_shapes import write_dataset

    meta = out_dir / "meta.csv"
    if not meta.exists():
        write_dataset(out_dir, num=num, seed=0, height=SIZE, width=SIZE, num_frames=FRAMES + 7, progress=False)
    return meta


def time_loader(meta: Path, workers: int, batch_size: int, batches: int) -> dict:
    from opensora.datasets import VideoTextDataset, build_dataloader

    dataset = VideoTextDataset(str(meta), num_frames=FRAMES, image_size=(SIZE, SIZE))
    bucket_config = {f"{SIZE}x{SIZE}": {FRAMES: (1.0, batch_size)}}
    loader, _ = build_dataloader(
        dataset,
        bucket_config,
        num_workers=workers,
        pin_memory=False,
        seed=0,
        rank=0,
        world_size=1,
        prefetch_factor=4 if workers else None,
    )
    samples, epoch, start, first = 0, 0, None, None
    while samples < batches * batch_size:
        loader.set_epoch(epoch)
        for batch in loader:
            if start is None:  # the first batch pays worker start-up: leave it out
                first = time.perf_counter()
                start = first
                continue
            assert batch["video"].shape[1:] == (3, FRAMES, SIZE, SIZE), batch["video"].shape
            samples += batch["video"].shape[0]
            if samples >= batches * batch_size:
                break
        epoch += 1
    elapsed = time.perf_counter() - start
    rate = samples / elapsed
    return dict(
        workers=workers,
        samples=samples,
        seconds=elapsed,
        samples_per_s=rate,
        samples_per_s_per_worker=rate / max(workers, 1),
    )


def gpu_samples_per_s(results_dir: Path):
    """1B training-step samples/s at this shape, FLOP-scaled from the newest measured full-shape step."""
    from opensora.models.mmdit import MMDIT_CONFIGS, mmdit_train_flops

    files = sorted(results_dir.glob("train_step_*.json"))
    best = None
    for path in files:
        report = json.loads(path.read_text())
        for run in report.get("runs", []):
            if "error" in run or run.get("ckpt") != "none" or not run["variant"].startswith("ours"):
                continue
            if best is None or run["step_ms"] < best[1]["step_ms"]:
                best = (report["environment"], run)
    if best is None:
        return None
    env, run = best
    flops_here = mmdit_train_flops(MMDIT_CONFIGS["1b"], VIDEO_TOKENS, TEXT_TOKENS)
    step_s = flops_here / (run["model_tflops"] * 1e12)
    return dict(
        samples_per_s=1.0 / step_s,
        estimated_step_ms=step_s * 1e3,
        from_variant=run["variant"],
        from_step_ms=run["step_ms"],
        from_tflops=run["model_tflops"],
        device=env.get("device"),
        video_tokens=VIDEO_TOKENS,
        text_tokens=TEXT_TOKENS,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="outputs/bench_data/moving_shapes_256", help="clip folder (made if absent)")
    parser.add_argument("--clips", type=int, default=8)
    parser.add_argument("--workers", default="0,2", help="comma list of worker counts")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--batches", type=int, default=12, help="timed batches per setting (after the first)")
    parser.add_argument("--gpu-samples-per-s", type=float, default=None, help="override the GPU consumption")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    meta = make_clips(ROOT / args.data, args.clips)
    render_s = time.perf_counter() - t0
    runs = [time_loader(meta, int(w), args.batch_size, args.batches) for w in args.workers.split(",")]
    gpu = (
        dict(samples_per_s=args.gpu_samples_per_s, source="--gpu-samples-per-s")
        if args.gpu_samples_per_s
        else gpu_samples_per_s(ROOT / "benchmarks" / "results")
    )
    per_worker = runs[0]["samples_per_s_per_worker"]
    report = dict(
        date=datetime.date.today().isoformat(),
        device=f"CPU ({os.cpu_count()} cores visible)",
        shape=dict(frames=FRAMES, height=SIZE, width=SIZE),
        clips=args.clips,
        render_s=render_s,
        runs=runs,
        gpu=gpu,
        workers_needed_per_gpu=(gpu["samples_per_s"] / per_worker) if gpu else None,
    )
    out = Path(args.out or OUT / f"data_loader_{report['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    for r in runs:
        print(
            f"workers={r['workers']}: {r['samples_per_s']:.2f} samples/s "
            f"({r['samples_per_s_per_worker']:.2f} per worker) over {r['samples']} samples"
        )
    if gpu:
        print(
            f"GPU step consumes {gpu['samples_per_s']:.2f} samples/s -> ~{report['workers_needed_per_gpu']:.1f} "
            f"decode workers per GPU at {per_worker:.2f} samples/s/worker"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
