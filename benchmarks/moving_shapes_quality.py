#!/usr/bin/env python
"""Sample the 72 held MovingShapes captions from a checkpoint, score them in memory, and time the sampling.

Quality = the MovingShapes evaluator's colour / shape / direction accuracy (tools/eval_moving_shapes.py scores
the same way from files); speed = wall-clock seconds to generate the whole batch (after one warm-up batch, CUDA
synchronised). Needs no PyAV: frames go straight from the sampler to the evaluator. Used for the GPU teacher
(many Euler steps + CFG) and the DMD2 student (its step list, no CFG), same device, same batch:

  python -m benchmarks.moving_shapes_quality CONFIG --ckpt DIR [--role student] [--num-steps 30]
      [--guidance-scale 4] [--json OUT] [--where direction=left] [--seeds-per-prompt 4]

``--where KEY=V1,V2`` scores only the held captions with those attributes (a subset, e.g. what a LoRA finetune
targets); ``--seeds-per-prompt N`` samples every caption with N seeds (less noise on a small subset).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import held_caption_setup
from opensora.config import load_config
from opensora.eval.moving_shapes import score_rows
from opensora.inference.sampler import VideoSampler


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def parse_where(items) -> dict:
    """``["direction=left", "shape=circle,square"]`` -> ``{"direction": {"left"}, "shape": {"circle", "square"}}``."""
    where = {}
    for item in items or []:
        key, _, values = item.partition("=")
        if key not in ("color", "shape", "direction") or not values:
            raise SystemExit(f"--where {item!r}: use color=..., shape=... or direction=... (comma-separated values)")
        where[key] = set(values.split(","))
    return where


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--role", default=None, help="default: the config's `role`, else 'model'")
    parser.add_argument("--num-steps", type=int, default=30)
    parser.add_argument("--use-step-list", action="store_true", help="sample with the config's step_list")
    parser.add_argument("--guidance-scale", type=float, default=None, help="default: the config's guidance_scale")
    parser.add_argument("--seed", type=int, default=1000, help="sample i uses seed + i (never a training seed)")
    parser.add_argument("--repeats", type=int, default=3, help="timed generations of the whole batch")
    parser.add_argument("--num-prompts", type=int, default=None, help="first N held captions (smoke tests)")
    parser.add_argument("--where", action="append", default=None, help="KEY=V1,V2: score a subset of the captions")
    parser.add_argument("--seeds-per-prompt", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=None, help="default: the whole set in one batch")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    cfg = load_config(args.config)
    role = args.role or cfg.get("role", "model")
    guidance = args.guidance_scale if args.guidance_scale is not None else cfg.get("guidance_scale", 4.0)
    step_list = list(cfg.step_list) if args.use_step_list else None
    sampler = VideoSampler.from_config(cfg, args.ckpt, role=role, progress=False)
    (num_frames, height, width), prompts, seeds = held_caption_setup(
        cfg, args.num_prompts, args.seed, parse_where(args.where), args.seeds_per_prompt
    )

    def generate():
        return sampler.generate(
            prompts,
            seeds,
            num_frames=num_frames,
            height=height,
            width=width,
            num_steps=None if step_list else args.num_steps,
            step_list=step_list,
            guidance_scale=guidance,
            batch_size=args.batch_size or len(prompts),
        )

    videos = generate()  # warm-up (and the scored samples: generation is deterministic per seed)
    times = []
    for _ in range(args.repeats):
        sync()
        start = time.perf_counter()
        generate()
        sync()
        times.append(time.perf_counter() - start)
    report = score_rows([(f"sample_{i:04d}", text, videos[i], None) for i, text in enumerate(prompts)])
    result = dict(
        config=args.config,
        ckpt=str(args.ckpt),
        role=role,
        num_steps=None if step_list else args.num_steps,
        step_list=step_list,
        guidance_scale=guidance,
        batch=len(prompts),
        size=[num_frames, height, width],
        where={k: sorted(v) for k, v in parse_where(args.where).items()},
        seeds_per_prompt=args.seeds_per_prompt,
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        seconds_per_batch=sorted(times)[len(times) // 2],
        seconds_all=times,
        color_acc=report.color_acc,
        shape_acc=report.shape_acc,
        direction_acc=report.direction_acc,
        all_acc=report.all_acc,
        n=report.n,
    )
    print(json.dumps({k: v for k, v in result.items() if k != "seconds_all"}, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(result, rows=report.rows), indent=1, default=str))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
