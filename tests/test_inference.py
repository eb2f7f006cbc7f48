"""Sampling pipeline and CLI against a tiny checkpoint trained once for this module (2 steps of the demo config)."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from opensora.config import load_config
from opensora.convert.weights import load_role_weights
from opensora.datasets.moving_shapes import write_dataset
from opensora.datasets.transforms import resize_center_crop
from opensora.datasets.video_io import read_video, write_video
from opensora.inference import cli
from opensora.inference.io import to_uint8_frames
from opensora.inference.prompts import read_prompt_file, resolve_prompts, sample_stem, slugify
from opensora.inference.sampler import VideoSampler, role_model_config, seeded_noise, video_size_for
from opensora.registry import MODELS, build_module

ROOT = Path(__file__).resolve().parents[1]
TRAIN_CONFIG = ROOT / "configs/diffusion/train/demo.py"
SAMPLE_CONFIG = ROOT / "configs/diffusion/inference/demo.py"
FRAMES, SIZE, STEPS = 4, 32, 2  # 4 frames -> 4 latent frames of 8x8: fast on a CPU
GEN = dict(num_frames=FRAMES, height=SIZE, width=SIZE, num_steps=STEPS, guidance_scale=4.0)
PROMPTS = ["a red circle moving left", "a blue square moving up", "a green triangle moving down", "a red square"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("inference")


@pytest.fixture(scope="module")
def dataset_csv(workdir):
    return write_dataset(workdir / "data", num=4, seed=0, progress=False)


@pytest.fixture(scope="module")
def checkpoint(workdir, dataset_csv):
    """A real training checkpoint directory (EMA + sharded model) from 2 steps of the demo trainer."""
    outputs = workdir / "train"
    cmd = [
        sys.executable,
        str(ROOT / "scripts/diffusion/train.py"),
        str(TRAIN_CONFIG),
        "--outputs",
        str(outputs),
        "--max-steps",
        "2",
        "--ckpt-every",
        "2",
        "--dataset.data_path",
        str(dataset_csv),
        "--num-workers",
        "0",
        "--bucket_config",
        "{'32x32': {16: (1.0, 2)}}",
        "--tensorboard",
        "false",
    ]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ckpt = outputs / "checkpoints" / "step-0000002"
    assert (ckpt / "COMPLETE").exists()
    return ckpt


@pytest.fixture(scope="module")
def cfg():
    return load_config(SAMPLE_CONFIG)


@pytest.fixture(scope="module")
def sampler(cfg, checkpoint):
    return VideoSampler.from_config(cfg, checkpoint, progress=False)


@pytest.fixture(scope="module")
def reference_image(workdir):
    """A 48x64 image (not the target size: exercises resize + centre crop) with structure in it."""
    rng = np.random.default_rng(0)
    image = np.zeros((48, 64, 3), np.uint8)
    image[:, :, 0] = np.linspace(0, 255, 64, dtype=np.uint8)[None]
    image[8:40, 20:44] = rng.integers(0, 256, (32, 24, 3), dtype=np.uint8)
    path = workdir / "ref.png"
    write_video(path, image[None])
    return path, image


def expected_reference_frames(frames_uint8):
    return to_uint8_frames(resize_center_crop(frames_uint8, (SIZE, SIZE))[None])[0]


class PassCounter(torch.nn.Module):
    """Wraps the network and records the batch size of every call."""

    def __init__(self, model):
        super().__init__()
        self.inner = model
        self.batches = []
        self.patch_size, self.cond_channels = model.patch_size, model.cond_channels

    def forward(self, x, *args, **kwargs):
        self.batches.append(x.shape[0])
        return self.inner(x, *args, **kwargs)


# ---- pure helpers --------------------------------------------------------------------------------------------
def test_prompt_files(tmp_path, dataset_csv):
    txt = tmp_path / "p.txt"
    txt.write_text("a red circle moving left\n\n  a blue square moving up \n")
    assert read_prompt_file(txt) == ["a red circle moving left", "a blue square moving up"]
    rows = list(csv.DictReader(open(dataset_csv)))
    assert read_prompt_file(dataset_csv) == [r["text"] for r in rows]
    assert len(read_prompt_file(Path(dataset_csv).parent / "prompts.txt")) == 72  # the held MovingShapes captions
    assert resolve_prompts("a | b") == ["a", "b"]
    with pytest.raises(ValueError, match="exactly one"):
        resolve_prompts("a", txt)
    assert slugify("A Red circle, moving LEFT!") == "a_red_circle_moving_left"
    assert sample_stem(3, "???") == "0003_sample"


def test_video_size_and_roles(cfg):
    assert video_size_for("32x32", "16:9") == (32, 32)
    assert video_size_for("256px", "1:1") == (256, 256)
    height, width = video_size_for("256px", "9:16")
    assert height < width and height % 16 == 0 and abs(height * width - 65536) / 65536 < 0.05
    assert role_model_config(cfg, "model")["type"] == "MMDiT"
    with pytest.raises(KeyError, match="student"):
        role_model_config(cfg, "student")


def test_seeded_noise_is_per_sample():
    both = seeded_noise([5, 6], (2, 3))
    assert torch.equal(both[1], seeded_noise([6], (2, 3))[0])
    assert not torch.equal(both[0], both[1])


# ---- pipeline ------------------------------------------------------------------------------------------------
def test_same_seed_same_video_and_batch_size_invariance(sampler):
    seeds = [10, 11, 12, 13]
    batched = sampler.generate(PROMPTS, seeds, batch_size=4, **GEN)
    single = sampler.generate(PROMPTS, seeds, batch_size=1, **GEN)
    assert batched.shape == (4, FRAMES, SIZE, SIZE, 3) and batched.dtype == torch.uint8
    assert torch.equal(batched, single)
    again = sampler.generate(PROMPTS[:1], seeds[:1], **GEN)
    assert torch.equal(again[0], batched[0])
    other = sampler.generate(PROMPTS[:1], [99], **GEN)
    assert not torch.equal(other[0], batched[0])


def test_i2v_first_frame_matches_reference(sampler, reference_image):
    path, image = reference_image
    expected = expected_reference_frames(image[None])[0]
    videos = sampler.generate(PROMPTS[:2], [0, 1], cond_type="i2v_head", ref=path, image_guidance_scale=1.5, **GEN)
    for video in videos:
        assert (video[0].int() - expected.int()).abs().max() <= 1  # PatchVAE is lossless: only rounding differs
        assert (video[1].int() - expected.int()).abs().float().mean() > 2  # the rest is generated
    tail = sampler.generate(PROMPTS[:1], [0], cond_type="i2v_tail", ref=path, **GEN)[0]
    assert (tail[-1].int() - expected.int()).abs().max() <= 1
    loop = sampler.generate(PROMPTS[:1], [0], cond_type="i2v_loop", ref=path, **GEN)[0]
    assert (loop[0].int() - expected.int()).abs().max() <= 1 and (loop[-1].int() - expected.int()).abs().max() <= 1


def test_v2v_keeps_reference_frames(sampler, dataset_csv):
    video_path = Path(dataset_csv).parent / "videos" / "000000.mp4"
    ref = read_video(video_path)
    expected = expected_reference_frames(ref)  # [16, 32, 32, 3]
    k = 2  # v2v_frames 0.5 of 4 latent frames, PatchVAE keeps frames 1:1
    head = sampler.generate(PROMPTS[:1], [0], cond_type="v2v_head", ref=video_path, **GEN)[0]
    assert (head[:k].int() - expected[:k].int()).abs().max() <= 1
    tail = sampler.generate(PROMPTS[:1], [0], cond_type="v2v_tail", ref=video_path, **GEN)[0]
    assert (tail[-k:].int() - expected[-k:].int()).abs().max() <= 1
    assert head.shape == tail.shape == (FRAMES, SIZE, SIZE, 3)


def test_model_passes_per_step(sampler, reference_image):
    counter = PassCounter(sampler.model)
    original, sampler.model = sampler.model, counter
    try:
        sampler.generate(PROMPTS[:2], [0, 1], **GEN)  # t2v with text CFG: 2 passes
        assert counter.batches == [2 * 2] * STEPS
        counter.batches.clear()
        sampler.generate(
            PROMPTS[:2], [0, 1], cond_type="i2v_head", ref=reference_image[0], image_guidance_scale=2.0, **GEN
        )  # image + text CFG: 3 passes
        assert counter.batches == [3 * 2] * STEPS
        counter.batches.clear()
        sampler.generate(PROMPTS[:1], [0], **{**GEN, "guidance_scale": 1.0})  # no guidance: 1 pass
        assert counter.batches == [1] * STEPS
        counter.batches.clear()
        sampler.generate(PROMPTS[:1], [0], step_list=[1.0, 0.5, 0.0], **GEN)  # explicit steps replace num_steps
        assert counter.batches == [2, 2]
    finally:
        sampler.model = original


def test_checkpoint_dir_and_safetensors_file_agree(cfg, checkpoint, sampler, tmp_path):
    weights = load_role_weights(checkpoint, "model", ema=True)
    file = tmp_path / "ema.safetensors"
    save_file(weights.state_dict, str(file), metadata={"step": "2"})
    from_file = VideoSampler.from_config(cfg, file, progress=False)
    assert from_file.weights.source == "file" and sampler.weights.source == "ema"
    assert torch.equal(from_file.generate(PROMPTS[:2], [3, 4], **GEN), sampler.generate(PROMPTS[:2], [3, 4], **GEN))
    raw = VideoSampler.from_config(cfg, checkpoint, ema=False, progress=False)  # --no-ema: the sharded model
    assert raw.weights.source == "model"


def test_shift_matches_training_method(sampler, cfg):
    from opensora.diffusion.flow_matching import shift_alpha_for

    latent = sampler.latent_size(16, 64, 64)
    assert sampler.shift_alpha(latent) == shift_alpha_for(latent, tuple(cfg.model.patch_size), **cfg.method.shift)
    assert sampler.shift_alpha(latent) > 1.0  # 1024 tokens > base 256


# ---- CLI -----------------------------------------------------------------------------------------------------
def _cli(args):
    return cli.main(
        [str(SAMPLE_CONFIG), "--num-frames", str(FRAMES), "--num-steps", str(STEPS), "--no-progress", *map(str, args)]
    )


def test_cli_t2v_from_checkpoint_dir(checkpoint, dataset_csv, tmp_path):
    save_dir = tmp_path / "samples"
    written = _cli(
        [
            "--ckpt",
            checkpoint.parent.parent,
            "--prompt-file",
            dataset_csv,
            "--save-dir",
            save_dir,
            "--batch-size",
            3,
            "--seed",
            7,
        ]
    )  # an outputs dir: its newest checkpoint
    prompts = read_prompt_file(dataset_csv)
    assert [p.name for p in written] == [f"{sample_stem(i, p)}.mp4" for i, p in enumerate(prompts)]
    for index, path in enumerate(written):
        assert read_video(path).shape == (FRAMES, SIZE, SIZE, 3)
        side = json.loads(path.with_suffix(".json").read_text())
        for key in ("prompt", "seed", "num_steps", "guidance_scale", "image_guidance_scale", "checkpoint", "config"):
            assert key in side, key
        assert side["prompt"] == prompts[index] and side["seed"] == 7 + index and side["num_steps"] == STEPS
        assert side["weights_source"] == "ema" and side["checkpoint"].endswith("step-0000002")
    rows = list(csv.DictReader(open(save_dir / "samples.csv")))
    assert [(r["path"], r["text"]) for r in rows] == [(p.name, t) for p, t in zip(written, prompts)]
    from opensora.eval.moving_shapes import evaluate_csv

    assert len(evaluate_csv(save_dir / "samples.csv", progress=False).failed) == 0  # the evaluator reads it as is


def test_cli_i2v_from_random_init_safetensors(cfg, dataset_csv, tmp_path):
    model = build_module(cfg.model, MODELS)
    file = tmp_path / "random.safetensors"
    save_file(model.state_dict(), str(file))
    save_dir = tmp_path / "i2v"
    image = read_video(Path(dataset_csv).parent / "videos" / "000001.mp4")[:1]  # a MovingShapes frame
    path = tmp_path / "frame.png"
    write_video(path, image)
    written = _cli(
        [
            "--ckpt",
            file,
            "--prompt",
            "a red circle moving left",
            "--save-dir",
            save_dir,
            "--cond-type",
            "i2v_head",
            "--ref",
            path,
            "--image-guidance-scale",
            2.0,
        ]
    )
    frames = read_video(written[0]).astype(int)
    assert frames.shape == (FRAMES, SIZE, SIZE, 3)
    expected = expected_reference_frames(image)[0].numpy().astype(int)
    # the first frame survives H.264 (crf 18) closely; the random network's other frames are nowhere near it
    assert np.abs(frames[0] - expected).mean() < 4 < np.abs(frames[1] - expected).mean()
    side = json.loads(written[0].with_suffix(".json").read_text())
    assert side["cond_type"] == "i2v_head" and side["ref"] == str(path) and side["weights_source"] == "file"
    one = _cli(
        [
            "--ckpt",
            file,
            "--prompt",
            "a red square",
            "--save-dir",
            save_dir,
            "--num-frames",
            1,
            "--step-list",
            "1.0,0.5",
        ]
    )
    assert one[0].suffix == ".png" and read_video(one[0]).shape == (1, SIZE, SIZE, 3)
    side = json.loads(one[0].with_suffix(".json").read_text())
    assert side["step_list"] == [1.0, 0.5] and side["num_steps"] == 2


def test_cli_errors(tmp_path, checkpoint):
    with pytest.raises(SystemExit, match="exactly one"):
        _cli(["--ckpt", checkpoint, "--save-dir", tmp_path])
    with pytest.raises(ValueError, match="needs a reference"):
        _cli(["--ckpt", checkpoint, "--prompt", "x", "--save-dir", tmp_path, "--cond-type", "i2v_head"])
