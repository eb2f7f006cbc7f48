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


def test_demo_stream_chains_teacher_ode_init_self_forcing_and_streaming():
    from run_demo import stream_commands

    from opensora.config import load_config_from_cli
    from opensora.inference.cli import INFERENCE_FLAGS
    from opensora.inference.cli_help import training_clip_defaults
    from opensora.training.launch import TRAIN_FLAGS

    ode, self_forcing, stream = [[str(c) for c in cmd] for cmd in stream_commands("py", "d", "o/train", "o", 5, 7)]
    cfg, args = load_config_from_cli(ode[2:], TRAIN_FLAGS)
    assert {r.init_from.path for r in cfg.models.values()} == {"o/train"} and args.max_steps == 5
    assert cfg.models.student.model.causal_chunk_frames == cfg.method.num_frames_per_chunk
    cfg, args = load_config_from_cli(self_forcing[2:], TRAIN_FLAGS)
    assert cfg.models.student.init_from.path == cfg.ode_ckpt == ode[ode.index("--outputs") + 1]  # stage 1's run
    assert cfg.models.teacher.init_from.path == cfg.models.critic.init_from.path == "o/train"
    cfg, args = load_config_from_cli(stream[2:], INFERENCE_FLAGS, config_defaults=training_clip_defaults)
    assert args.ckpt == self_forcing[self_forcing.index("--outputs") + 1] and args.streaming and args.overwrite
    assert (args.resolution, args.num_frames, args.role) == ("24x24", 4, "student")  # the clips it trained on
    assert args.guidance_scale == 1.0 and list(args.step_list) == list(cfg.method.step_list)
