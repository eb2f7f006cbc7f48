#!/usr/bin/env python
"""`make demo`: build MovingShapes -> train the demo model -> sample the held prompts -> score them.

`make demo-stream` (``--stream``) goes on from that teacher to a streaming student: causal ODE init
(configs/distill/causal_ode_demo.py) -> Self-Forcing (configs/distill/self_forcing_demo.py) -> the held prompts
streamed chunk by chunk -> scored like the teacher's samples. A teacher that `make demo` already trained is reused.

Every stage is the user-facing command (printed before it runs), so the demo doubles as a walkthrough. Re-running
resumes training from the newest checkpoint (`--resume auto`) and regenerates samples and scores.
The command builders below are shared with `benchmarks/demo_sweep.py`, which tunes the demo with these very commands.
"""

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA_SEED = 0  # renders the training clips
SAMPLE_SEED = 1000  # held prompt i is sampled with noise seed 1000 + i (never used in training)


def dataset_command(py, data_dir, num_videos, size=32, num_frames=16) -> list:
    return [
        py,
        "tools/make_demo_dataset.py",
        "--out",
        data_dir,
        "--num",
        num_videos,
        "--seed",
        DATA_SEED,
        "--size",
        size,
        "--num-frames",
        num_frames,
        "--no-progress",
    ]


def train_command(py, train_config, train_dir, data_dir, overrides=()) -> list:
    """``overrides``: extra ``--key value`` arguments (e.g. ``--max-steps 500``)."""
    return [
        py,
        "scripts/diffusion/train.py",
        train_config,
        "--outputs",
        train_dir,
        "--resume",
        "auto",
        "--dataset.data_path",
        Path(data_dir) / "meta.csv",
        *overrides,
    ]


def sample_command(py, sample_config, ckpt, data_dir, samples_dir, num_steps, overrides=()) -> list:
    """The held prompts: every colour x shape x direction caption (prompts.txt), one sample each.
    ``num_steps`` None: the sample config's."""
    steps = [] if num_steps is None else ["--num-steps", num_steps]
    return [
        py,
        "scripts/diffusion/inference.py",
        sample_config,
        "--ckpt",
        ckpt,
        "--prompt-file",
        Path(data_dir) / "prompts.txt",
        "--save-dir",
        samples_dir,
        *steps,
        "--seed",
        SAMPLE_SEED,
        "--overwrite",  # a re-run regenerates the samples it scores (instead of adding more)
        *overrides,
    ]


def stream_commands(py, data_dir, teacher_dir, out, ode_steps=None, self_forcing_steps=None) -> list:
    """The three commands from a trained demo teacher to streamed samples: causal ODE init, Self-Forcing (both
    resumable), streaming the held prompts. Step counts None: the configs'."""
    data = ["--dataset.data_path", Path(data_dir) / "meta.csv", "--teacher-ckpt", teacher_dir]
    ode, self_forcing = Path(out) / "causal_ode", Path(out) / "self_forcing"
    steps = lambda n: [] if n is None else ["--max-steps", n]  # noqa: E731
    return [
        [py, "scripts/diffusion/train.py", "configs/distill/causal_ode_demo.py", "--outputs", ode, "--resume", "auto"]
        + data
        + steps(ode_steps),
        [py, "scripts/diffusion/train.py", "configs/distill/self_forcing_demo.py", "--outputs", self_forcing]
        + ["--resume", "auto", *data, "--ode-ckpt", ode, *steps(self_forcing_steps)],
        sample_command(
            py, "configs/distill/self_forcing_demo.py", self_forcing, data_dir, Path(out) / "stream_samples", None
        )
        + ["--streaming"],
    ]


def eval_command(py, samples_dir, scores) -> list:
    return [py, "tools/eval_moving_shapes.py", Path(samples_dir) / "samples.csv", "--json", scores, "--no-progress"]


def clip_shape(train_config) -> tuple:
    """(side, frames) of the training config's one bucket: the demo renders its clips to exactly that shape."""
    from opensora.config import load_config

    buckets = [
        (res, frames) for res, by_frames in load_config(train_config).bucket_config.items() for frames in by_frames
    ]
    if len(buckets) != 1 or len(set(buckets[0][0].split("x"))) != 1:
        raise ValueError(f"{train_config}: expected one square 'NxN' bucket with one frame count, got {buckets}")
    res, frames = buckets[0]
    return int(res.split("x")[0]), int(frames)


def run(cmd) -> None:
    print("\n$ " + " ".join(shlex.quote(str(c)) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="outputs/demo", help="where data, checkpoints, samples and scores go")
    parser.add_argument("--num-videos", type=int, default=288, help="training clips (4 per caption combination)")
    parser.add_argument("--max-steps", type=int, default=None, help="training steps (default: the config's)")
    parser.add_argument("--num-steps", type=int, default=None, help="sampling steps (default: the sample config's)")
    parser.add_argument("--train-config", default="configs/diffusion/train/demo_fast.py")
    parser.add_argument("--sample-config", default="configs/diffusion/inference/demo_fast.py")
    parser.add_argument("--stream", action="store_true", help="go on to a streaming student (make demo-stream)")
    parser.add_argument("--ode-steps", type=int, default=None, help="--stream: causal ODE init steps (the config's)")
    parser.add_argument("--self-forcing-steps", type=int, default=None, help="--stream: Self-Forcing steps")
    args = parser.parse_args(argv)

    out = Path(args.out)
    data, train, samples = out / "data", out / "train", out / "samples"
    py = sys.executable
    started = time.time()

    size, num_frames = clip_shape(ROOT / args.train_config)
    run(dataset_command(py, data, args.num_videos, size, num_frames))
    run(
        train_command(
            py, args.train_config, train, data, [] if args.max_steps is None else ["--max-steps", args.max_steps]
        )
    )

    from opensora.checkpoint_layout import find_latest_checkpoint

    if args.stream:  # the teacher's own samples are make demo's business: straight on to the student
        *distill, stream = stream_commands(py, data, train, out, args.ode_steps, args.self_forcing_steps)
        for command in distill:
            run(command)
        run(stream)
        samples, scores, name = out / "stream_samples", out / "eval_stream.json", "streaming demo"
    else:
        ckpt = find_latest_checkpoint(train)
        run(sample_command(py, args.sample_config, ckpt, data, samples, args.num_steps))
        scores, name = out / "eval.json", "demo"
    run(eval_command(py, samples, scores))

    report = json.loads(scores.read_text())
    minutes = (time.time() - started) / 60
    print(
        f"\nMovingShapes {name} ({minutes:.1f} min): n={report['n']}  colour {report['color_acc']:.3f}  "
        f"shape {report['shape_acc']:.3f}  direction {report['direction_acc']:.3f}  "
        f"(chance 0.167 / 0.333 / 0.250)"
    )


if __name__ == "__main__":
    main()
