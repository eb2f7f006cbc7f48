"""`make demo`'s configs (demo_fast.py): the sampler builds the network it trains, and the clips fit both."""

import sys
from pathlib import Path

from opensora.config import load_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from run_demo import clip_shape, sample_command  # noqa: E402

TRAIN = ROOT / "configs/diffusion/train/demo_fast.py"
SAMPLE = ROOT / "configs/diffusion/inference/demo_fast.py"
SHARED_KEYS = ("model", "vae", "text_encoder", "method")  # repeated in the sample config: they must agree


def test_sample_config_builds_the_trained_network():
    train, sample = load_config(TRAIN), load_config(SAMPLE)
    for key in SHARED_KEYS:
        assert sample[key] == train[key], key


def test_clips_match_the_bucket_and_the_sampler():
    train, sample = load_config(TRAIN), load_config(SAMPLE)
    side, frames = clip_shape(TRAIN)
    assert (side, frames) == (24, 4)
    assert sample.resolution == f"{side}x{side}" and sample.num_frames == frames
    patch = train.vae.patch_size
    assert side % (patch * train.model.patch_size[1]) == 0  # whole latent patches
    assert train.model.in_channels == 3 * patch * patch
    assert train.method.condition_probs == {"t2v": 1.0}


def test_old_demo_shape_and_sampling_steps_default():
    assert clip_shape(ROOT / "configs/diffusion/train/demo.py") == (32, 16)
    cmd = [str(c) for c in sample_command("py", SAMPLE, "ckpt", "data", "out", None)]
    assert "--num-steps" not in cmd  # the sample config's num_steps
    assert cmd[cmd.index("--seed") + 1] == "1000"  # held prompt i: seed 1000 + i, never a training seed
