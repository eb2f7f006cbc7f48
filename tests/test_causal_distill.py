"""Causal ODE init, CausVid, Self-Forcing and long-rollout DMD through the real trainer CLI on 2 gloo ranks, with tiny causal students:
losses bit-identical after a checkpoint/resume, checkpoints namespaced by role, the student exported alone and
sampled with the full causal forward and with the streaming sampler (chunk by chunk through the KV cache)."""

import math
from pathlib import Path

import pytest
import torch
from test_dmd2 import _metrics, _train_three_ways  # 6 steps straight vs 3 + 3 resumed; metrics without timings

from dist_utils import run_distributed

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

TINY = dict(hidden_size=32, num_heads=2, depth_double=1, depth_single=1, mlp_ratio=2.0, axes_dims=[4, 6, 6])
RUNS = {
    # config, roles, method overrides (tiny clips: 4 latent frames -> 4 chunks of 1)
    "causal_ode": (
        "configs/distill/causal_ode_demo.py",
        ("student", "teacher"),
        "dict(teacher_num_steps=4, num_cached_pairs=8)",
    ),
    "causvid": (
        "configs/distill/causvid_demo.py",
        ("student", "teacher", "critic"),
        "dict(student_update_every=2, step_list=[1.0, 0.6, 0.3])",
    ),
    "self_forcing": (
        "configs/distill/self_forcing_demo.py",
        ("student", "teacher", "critic"),
        "dict(student_update_every=2, step_list=[1.0, 0.6, 0.3])",
    ),
    "long_rollout": (  # 3x the clip through a 3-frame rolling cache with a 1-frame sink; prompt switches
        "configs/distill/long_rollout_demo.py",
        ("student", "teacher", "critic"),
        "dict(student_update_every=2, step_list=[1.0, 0.6, 0.3], rollout_multiple=3, kv_window_frames=3, "
        "kv_sink_frames=1, switch_prob=0.5)",
    ),
    "long_rollout_critic_windows": (  # the critic learns from 3 windows of each rollout, half of them the first
        "configs/distill/long_rollout_demo.py",
        ("student", "teacher", "critic"),
        "dict(student_update_every=2, step_list=[1.0, 0.6, 0.3], rollout_multiple=3, kv_window_frames=3, "
        "kv_sink_frames=1, switch_prob=0.0, critic_windows=3, first_window_share=0.5)",
    ),
}


def _write_run_config(tmp: Path, name: str) -> Path:
    from safetensors.torch import save_file

    from opensora.config import load_config
    from opensora.datasets.moving_shapes import write_dataset
    from opensora.registry import MODELS, build_module

    base_config, roles, method = RUNS[name]
    meta = write_dataset(tmp / "data", num=8, seed=0, height=18, width=18, num_frames=4, progress=False)
    base = load_config(str(REPO / base_config), [])
    torch.manual_seed(0)
    teacher = build_module({**base.models.teacher.model, **TINY}, MODELS)
    with torch.no_grad():  # a fresh MMDiT predicts v = 0 (zero-initialised output layers): make it say something
        for param in teacher.parameters():
            param.add_(0.05 * torch.randn_like(param))
    save_file({k: v.contiguous() for k, v in teacher.state_dict().items()}, str(tmp / "teacher.safetensors"))

    # every role (the causal student too) starts from the bidirectional teacher's weights
    weights = f'dict(path="{tmp / "teacher.safetensors"}", role="model", ema=False)'
    role = f"dict(model=dict(**_tiny), init_from={weights})"
    text = f"""_base_ = ["{REPO / base_config}"]
_tiny = {TINY!r}
dataset = dict(_delete_=True, type="VideoTextDataset", data_path="{meta}", frame_interval=1)
bucket_config = dict(_delete_=True, **{{"18x18": {{4: (1.0, 2)}}}})
num_workers = 0
tensorboard = False
keep_last = 5
models = dict({", ".join(f"{r}={role}" for r in roles)})
method = {method}
"""
    path = tmp / f"{name}_tiny.py"
    path.write_text(text)
    return path


@pytest.fixture(scope="module", params=sorted(RUNS))
def run(request, tmp_path_factory):
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    config = _write_run_config(tmp, name)
    run_distributed(_train_three_ways, world_size=2, args=(str(config), str(tmp)), timeout=900)
    return name, tmp, config


def test_resume_is_bit_identical_on_two_ranks(run):
    name, tmp, _ = run
    full, split = _metrics(tmp / "full"), _metrics(tmp / "split")
    assert [row["step"] for row in full] == list(range(1, 7))
    assert full == split
    assert all(math.isfinite(row["loss"]) for row in full)
    if name in (
        "causvid",
        "self_forcing",
        "long_rollout",
        "long_rollout_critic_windows",
    ):  # two-time-scale rule inside the real trainer: the student steps at 0, 2, 4
        assert [("grad_norm/student" in row) for row in full] == [True, False] * 3
        assert all("critic_loss" in row for row in full)
        assert [("generator_loss" in row) for row in full] == [True, False] * 3
    else:
        assert all("ode_loss" in row for row in full)


def test_checkpoints_are_namespaced_by_role_and_restore_exactly(run):
    from opensora.convert.weights import load_role_weights

    name, tmp, _ = run
    ckpt_full, ckpt_split = tmp / "full/checkpoints/step-0000006", tmp / "split/checkpoints/step-0000006"
    roles = sorted(p.name for p in ckpt_full.iterdir() if (p / "model").is_dir())
    trained = ["student"] if name == "causal_ode" else ["critic", "student"]
    assert roles == trained  # the frozen teacher is rebuilt from its config, never saved
    for role in trained:
        for ema in (True, False) if role == "student" else (False,):
            a = load_role_weights(ckpt_full, role=role, ema=ema).state_dict
            b = load_role_weights(ckpt_split, role=role, ema=ema).state_dict
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (role, ema)
    teacher = load_role_weights(tmp / "teacher.safetensors").state_dict
    for role in trained:
        weights = load_role_weights(ckpt_full, role=role, ema=False).state_dict
        assert any(not torch.equal(weights[k].float(), teacher[k].float()) for k in teacher), role


def test_student_exports_alone_and_samples_causally(run, tmp_path):
    from opensora.config import load_config
    from opensora.convert.export import export_weights
    from opensora.convert.weights import load_role_weights
    from opensora.inference.sampler import VideoSampler
    from opensora.inference.streaming.generator import StreamingGenerator

    _, tmp, config = run
    ckpt = tmp / "full/checkpoints/step-0000006"
    exported = tmp_path / "student.safetensors"
    export_weights(ckpt, exported, role="student", ema=True)
    a, b = load_role_weights(exported).state_dict, load_role_weights(ckpt, role="student").state_dict
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    cfg = load_config(str(config))
    rollout = cfg.method.get("rollout", "renoise")
    videos, streamed = [], []
    for source in (ckpt, exported):
        sampler = VideoSampler.from_config(cfg, source, role="student", device="cpu", dtype="fp32", progress=False)
        assert sampler.model.causal_chunk_frames == cfg.method.num_frames_per_chunk
        videos.append(
            sampler.generate(
                ["a red circle moving left"],
                [7],
                num_frames=4,
                height=18,
                width=18,
                num_steps=None,
                step_list=list(cfg.method.step_list),
                guidance_scale=1.0,
            )
        )
        # chunk by chunk with the KV cache, as the student is meant to run (and as Self-Forcing trains it)
        stream = StreamingGenerator(sampler, step_list=list(cfg.method.step_list), rollout=rollout)
        chunks = list(stream.stream(["a red circle moving left"], [7], num_frames=4, height=18, width=18))
        # the last chunk saw chunk 0 in the cache; it is not refilled itself (no chunk reads it)
        assert [chunk.start_frame for chunk in chunks] == [0, 1, 2, 3] and chunks[-1].cached_frames == 3
        streamed.append(torch.cat([chunk.frames for chunk in chunks], dim=1))
    assert torch.equal(videos[0], videos[1]) and torch.equal(streamed[0], streamed[1])
    assert streamed[0].shape == videos[0].shape == (1, 4, 18, 18, 3) and streamed[0].dtype == torch.uint8
