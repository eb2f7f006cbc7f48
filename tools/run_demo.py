#!/usr/bin/env python
"""`make demo`: build MovingShapes -> train the demo model -> sample the held prompts -> score them.

Every stage is the user-facing command (printed before it runs), so the demo doubles as a walkthrough. Re-running
resumes training from the newest checkpoint (`--resume auto`) and regenerates samples and scores.
"""

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd) -> None:
    print("\n$ " + " ".join(shlex.quote(str(c)) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="outputs/demo", help="where data, checkpoints, samples and scores go")
    parser.add_argument("--num-videos", type=int, default=288, help="training clips (4 per caption combination)")
    parser.add_argument("--max-steps", type=int, default=None, help="training steps (default: the config's)")
    parser.add_argument("--num-steps", type=int, default=30, help="sampling steps")
    parser.add_argument("--train-config", default="configs/diffusion/train/demo.py")
    parser.add_argument("--sample-config", default="configs/diffusion/inference/demo.py")
    args = parser.parse_args(argv)

    out = Path(args.out)
    data, train, samples = out / "data", out / "train", out / "samples"
    py = sys.executable
    started = time.time()

    run([py, "tools/make_demo_dataset.py", "--out", data, "--num", args.num_videos, "--seed", 0, "--no-progress"])
    train_cmd = [
        py,
        "scripts/diffusion/train.py",
        args.train_config,
        "--outputs",
        train,
        "--resume",
        "auto",
        "--dataset.data_path",
        data / "meta.csv",
    ]
    if args.max_steps is not None:
        train_cmd += ["--max-steps", args.max_steps]
    run(train_cmd)

    from opensora.checkpoint_layout import find_latest_checkpoint

    ckpt = find_latest_checkpoint(train)
    # held prompts: every colour x shape x direction caption, one sample each, seeds never used in training
    run(
        [
            py,
            "scripts/diffusion/inference.py",
            args.sample_config,
            "--ckpt",
            ckpt,
            "--prompt-file",
            data / "prompts.txt",
            "--save-dir",
            samples,
            "--num-steps",
            args.num_steps,
            "--seed",
            1000,
        ]
    )
    scores = out / "eval.json"
    run([py, "tools/eval_moving_shapes.py", samples / "samples.csv", "--json", scores, "--no-progress"])

    report = json.loads(scores.read_text())
    minutes = (time.time() - started) / 60
    print(
        f"\nMovingShapes demo ({minutes:.1f} min): n={report['n']}  colour {report['color_acc']:.3f}  "
        f"shape {report['shape_acc']:.3f}  direction {report['direction_acc']:.3f}  "
        f"(chance 0.167 / 0.333 / 0.250)"
    )


if __name__ == "__main__":
    main()
