"""Where a streamed causal student drifts: the background level of every frame, and the accuracy at the clip length.

Each ``--runs`` entry is a training run directory (its newest checkpoint, role ``student``) of a causal student on
MovingShapes: a causal ODE init, a Self-Forcing or a long-rollout student. Each is streamed on the held captions
(``--prompts``, seeds ``--seed + i``) with the step list and rollout of ``--config``, through a rolling KV cache of
``--window-frames`` latent frames (``none``: every frame kept) with ``--sink-frames`` sinks, for ``--frames`` frames.
Reported per run: colour / shape / direction accuracy and the share of clips with frame statistics in range over the
first clip length (``opensora.eval.moving_shapes_windows.score_windows``), and the mean background level of every frame
(``background_by_frame``; the data's is 24). A background that slides frame by frame from the first chunk on is
drift; one that holds and then jumps where the window first rolls is the cache's doing.
``--prompt-switch`` adds, per run, ``long_streaming_quality``'s prompt switch (every caption switches at the first chunk
start after the clip to one that differs in colour, shape and direction; the window after it scored against the new
caption), with the re-cache, without it, and with the kept window re-rendered from each ``--switch-renoise`` time.

  # the CPU demo's students (make demo-stream), streamed 4x their 4-frame clip
  python -m benchmarks.streaming_drift --config configs/distill/self_forcing_demo.py \\
      --runs outputs/demo/causal_ode outputs/demo/self_forcing --frames 16 --out F.json
  # their prompt switch, plain and with the kept window re-rendered under the new prompt from t = 0.5 / 0.75 / 1
  python -m benchmarks.streaming_drift --runs outputs/demo/self_forcing --prompt-switch --switch-renoise 0.5 0.75 1
"""

import argparse
import json
import time
from pathlib import Path


def stream_run(run_dir, cfg, prompts, seeds, frames, size, window, sinks, device, switch=None) -> dict:
    """Stream one run's newest student and score it (accuracy over the first clip, background per frame).
    ``window``: latent frames, None (every frame) or "clip" (the clip's latent frames minus one chunk). ``switch``:
    the re-render times of ``long_streaming_switch.evaluate_switch`` (a list, maybe empty; None: no switch)."""
    import torch

    from benchmarks.streaming import clip_window
    from opensora.checkpoint_layout import find_latest_checkpoint
    from opensora.eval.moving_shapes_windows import background_by_frame, score_windows
    from opensora.inference.sampler import VideoSampler
    from opensora.inference.streaming.generator import StreamingGenerator

    ckpt = find_latest_checkpoint(run_dir)
    if ckpt is None:
        raise SystemExit(f"no checkpoint under {run_dir}: give training run directories with --runs")
    sampler = VideoSampler.from_config(cfg, ckpt, role="student", device=device, progress=False)
    clip, height, width = size
    if window == "clip":
        window = clip_window(sampler, clip, height, width)
    generator = StreamingGenerator(
        sampler,
        step_list=list(cfg.step_list),
        rollout=cfg.get("rollout", "renoise"),
        context_time=float(cfg.get("context_time") or 0.0),
        window_frames=window,
        sink_frames=sinks,
    )
    started = time.perf_counter()
    with torch.no_grad():
        videos = generator.generate(prompts, seeds, frames, height, width).numpy()
    seconds = time.perf_counter() - started
    first = score_windows([v[:clip] for v in videos], prompts, clip, motion="linear")["windows"][0]
    row = dict(
        ckpt=str(ckpt),
        window_frames=window,
        seconds=seconds,
        clip_scores={k: first[k] for k in ("color_acc", "shape_acc", "direction_acc", "stats_in_range")},
        background_by_frame=background_by_frame(list(videos)),
    )
    if switch is not None:
        from benchmarks.long_streaming_switch import evaluate_switch

        long_multiple = max(frames // clip, 2)
        row["switch"] = evaluate_switch(
            generator, prompts, seeds, size, motion="linear", long_multiple=long_multiple, renoise=switch
        )
    return row


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/distill/self_forcing_demo.py", help="sampling settings")
    parser.add_argument("--runs", nargs="+", required=True, help="training run directories of causal students")
    parser.add_argument("--frames", type=int, default=None, help="frames to stream (default: 4x the clip)")
    parser.add_argument("--window-frames", default="clip", help="clip (the clip's latent frames - a chunk), none, N")
    parser.add_argument("--sink-frames", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=72)
    parser.add_argument("--seed", type=int, default=7000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="JSON report")
    parser.add_argument("--prompt-switch", action="store_true", help="score a prompt switch after the clip too")
    parser.add_argument(
        "--switch-renoise", type=float, nargs="+", default=[], metavar="T", help="with --prompt-switch: re-render times"
    )
    args = parser.parse_args(argv)
    if args.switch_renoise and not args.prompt_switch:
        parser.error("--switch-renoise varies the prompt switch: add --prompt-switch")

    from benchmarks.streaming import training_clip
    from opensora.config import load_config
    from opensora.datasets.moving_shapes import all_captions

    cfg = load_config(args.config)
    clip = training_clip(cfg)
    frames = args.frames or 4 * clip[0]
    prompts = all_captions()[: args.prompts]
    seeds = [args.seed + i for i in range(len(prompts))]
    spec = args.window_frames
    if spec not in ("none", "clip") and not spec.isdigit():
        parser.error(f"--window-frames takes clip, none or a number of latent frames, got {spec!r}")
    window = None if spec == "none" else spec if spec == "clip" else int(spec)
    report = dict(config=args.config, clip=list(clip), frames=frames, prompts=len(prompts), seed=args.seed)
    switch = args.switch_renoise if args.prompt_switch else None
    rows = {
        run: stream_run(run, cfg, prompts, seeds, frames, clip, window, args.sink_frames, args.device, switch)
        for run in args.runs
    }
    report["runs"] = rows
    for run, row in rows.items():
        s = row["clip_scores"]
        levels = " ".join(f"{v:.1f}" for v in row["background_by_frame"])
        print(
            f"{run}: colour {s['color_acc']:.3f} shape {s['shape_acc']:.3f} direction {s['direction_acc']:.3f} "
            f"stats {s['stats_in_range']:.3f}\n  background by frame: {levels}"
        )
        if "switch" in row:
            from benchmarks.long_streaming_report import print_switch_lines

            print_switch_lines({"switch": dict(row["switch"], rope_anchor="absolute")})
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
