"""What the sampling CLI writes and says: a training config's own defaults (clip size, seed) used and shown by
--help, repeated --prompt, earlier samples kept (or --overwrite), files with the umask's mode, a quiet start-up and a
streaming progress bar. Random tiny networks saved as safetensors: nothing here needs training."""

import csv
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.torch import save_file

from opensora.config import load_config
from opensora.datasets.video_io import read_video
from opensora.inference import cli
from opensora.registry import MODELS, build_module

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "configs/diffusion/train/demo_fast.py"  # a training config: 24x24 x 4-frame bucket, seed 42


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    import torch

    root = tmp_path_factory.mktemp("weights")
    torch.manual_seed(0)
    model = build_module(load_config(TRAIN).model, MODELS)
    save_file(model.state_dict(), str(root / "model.safetensors"))
    causal = build_module({**load_config(TRAIN).model, "causal_chunk_frames": 1}, MODELS)
    save_file(causal.state_dict(), str(root / "causal.safetensors"))
    return root


def _sample(weights, save_dir, *args):
    argv = [TRAIN, "--ckpt", weights / "model.safetensors", "--save-dir", save_dir, "--num-steps", 2, "--no-progress"]
    return cli.main([str(a) for a in [*argv, *args]])


def _rows(save_dir):
    with open(save_dir / "samples.csv", newline="") as f:
        return [(r["path"], r["text"]) for r in csv.DictReader(f)]


def test_training_config_defaults_are_used_and_shown(weights, tmp_path, capsys):
    written = _sample(weights, tmp_path / "s", "--prompt", "a red circle moving left")
    assert read_video(written[0]).shape == (4, 24, 24, 3)  # the training clip, not the generic 256px x 16
    side = json.loads(written[0].with_suffix(".json").read_text())
    assert side["seed"] == load_config(TRAIN).seed == 42 and (side["height"], side["num_frames"]) == (24, 4)
    with pytest.raises(SystemExit):
        cli.main([str(TRAIN), "--help"])
    shown = capsys.readouterr().out
    for flag, value in (("seed", "42"), ("resolution", "'24x24'"), ("num-frames", "4")):
        assert any(line.split()[:3] == [f"--{flag}", "default:", value] for line in shown.splitlines()), flag
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    generic = capsys.readouterr().out
    assert "--seed" in generic and "a config's own 'seed'" in generic and "repeat --prompt" in generic


def test_repeated_prompt_is_taken_verbatim_and_a_single_one_splits_at_the_bar(weights, tmp_path):
    save_dir = tmp_path / "p"
    _sample(weights, save_dir, "--prompt", "a red | blue circle", "--prompt", "a green square")
    assert [text for _, text in _rows(save_dir)] == ["a red | blue circle", "a green square"]
    _sample(weights, tmp_path / "q", "--prompt", "a red circle | a blue square")  # the old spelling
    assert [text for _, text in _rows(tmp_path / "q")] == ["a red circle", "a blue square"]


def test_second_run_adds_samples_and_overwrite_starts_over(weights, tmp_path):
    save_dir = tmp_path / "runs"
    first = _sample(weights, save_dir, "--prompt", "a red circle", "--prompt", "a blue square", "--seed", 5)
    before = {p: p.read_bytes() for p in first}
    second = _sample(weights, save_dir, "--prompt", "a red circle", "--seed", 5)
    assert [p.name for p in second] == ["0002_a_red_circle.mp4"]
    assert all(p.read_bytes() == before[p] for p in first)  # nothing of the first run was touched
    assert second[0].read_bytes() == first[0].read_bytes()  # same seed, same prompt: the same video
    assert json.loads(second[0].with_suffix(".json").read_text())["index"] == 2
    assert [path for path, _ in _rows(save_dir)] == [p.name for p in first + second]
    assert (save_dir / "config.py").is_file() and (save_dir / "config_0002.py").is_file()
    again = _sample(weights, save_dir, "--prompt", "a green triangle", "--overwrite")
    assert [p.name for p in again] == ["0000_a_green_triangle.mp4"]
    assert sorted(p.name for p in save_dir.iterdir()) == sorted(
        ["0000_a_green_triangle.mp4", "0000_a_green_triangle.json", "config.py", "samples.csv"]
    )


def test_files_honour_the_umask(weights, tmp_path):
    old = os.umask(0o027)
    try:
        written = _sample(weights, tmp_path / "u", "--prompt", "a red circle")
    finally:
        os.umask(old)
    for path in (written[0], written[0].with_suffix(".json"), tmp_path / "u/samples.csv", tmp_path / "u/config.py"):
        assert path.stat().st_mode & 0o777 == 0o640, path.name


def test_reference_image_loads_without_a_warning(tmp_path):
    from opensora.inference.io import load_reference

    Image.fromarray(np.full((30, 40, 3), 200, np.uint8)).save(tmp_path / "ref.png")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warned that the image's numpy array is not writable
        video = load_reference(tmp_path / "ref.png", (24, 24))
    assert tuple(video.shape) == (3, 1, 24, 24)


def test_streaming_run_is_quiet_and_shows_progress(weights, tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts/diffusion/inference.py"), str(TRAIN)]
    cmd += ["--ckpt", str(weights / "causal.safetensors"), "--model.causal-chunk-frames", "1", "--streaming"]
    cmd += ["--prompt", "a red circle", "--prompt", "a blue square", "--step-list", "1.0,0.5", "--batch-size", "1"]
    cmd += ["--save-dir", str(tmp_path / "stream")]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for noise in ("kernels-community", "tensornvme", "apex", "broadcast_buffers", "UserWarning"):
        assert noise not in result.stderr, noise
    assert "streaming: 100%" in result.stderr and "8/8" in result.stderr  # 4 chunks x 2 prompts, one bar
    assert [text for _, text in _rows(tmp_path / "stream")] == ["a red circle", "a blue square"]
