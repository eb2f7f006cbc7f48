"""DMD2: closed-form generator gradient, backward simulation = the inference sampler, and the demo distillation
config end to end on 2 gloo ranks (role checkpoints, exact resume)."""

import json
import math
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed
from opensora.diffusion.sampling import sample
from opensora.methods.dmd2 import dmd_gradient, generator_loss, is_student_iteration
from opensora.registry import METHODS, build_module

REPO = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


# ---- the math ----------------------------------------------------------------------------------------------------
def test_generator_loss_gradient_is_g_closed_form():
    torch.manual_seed(0)
    x0 = torch.randn(3, 4, 2, 5, 5, dtype=torch.float64).float().requires_grad_(True)
    real, fake = torch.randn_like(x0), torch.randn_like(x0)
    # reference, written out per sample: g = (fake - real) / mean(|x0 - real|)
    g_ref = torch.stack([(fake[i] - real[i]) / (x0[i].detach() - real[i]).abs().mean() for i in range(3)])
    g = dmd_gradient(x0, real, fake)
    assert g.dtype == torch.float32
    torch.testing.assert_close(g, g_ref)
    loss = generator_loss(x0, g)
    (grad,) = torch.autograd.grad(loss, x0)
    # 0.5 * mean((x0 - sg(x0 - g))^2): d/dx0 = g / N, and the loss value is 0.5 * mean(g^2)
    torch.testing.assert_close(grad, g / x0.numel())
    torch.testing.assert_close(loss, 0.5 * (g**2).mean())


def test_dmd_gradient_in_fp32_from_bf16_inputs_and_finite_when_real_equals_x0():
    x0 = torch.randn(2, 3, 4, 4).bfloat16()
    real = x0.clone()
    fake = torch.randn(2, 3, 4, 4).bfloat16()
    g = dmd_gradient(x0, real, fake)
    assert g.dtype == torch.float32 and torch.isfinite(g).all()


def test_two_time_scale_rule():
    assert [i for i in range(50) if is_student_iteration(i, 5)] == list(range(0, 50, 5))
    assert all(is_student_iteration(i, 1) for i in range(7))


# ---- backward simulation matches the inference sampler --------------------------------------------------------
def test_backward_simulation_follows_the_inference_euler_trajectory():
    from test_methods_framework import make_components, make_dmd2_roles, tiny_batch

    roles = make_dmd2_roles()
    step_list = [1.0, 0.8, 0.5, 0.2]
    method = build_module(dict(type="DMD2", step_list=step_list), METHODS, roles=roles, components=make_components())
    batch = method.adapter.prepare_batch(tiny_batch(2))
    noise = method.adapter.noise(batch)
    student = roles["student"]

    def model_fn(x, t, **_):
        return method.adapter.predict_velocity(student, x, t.expand(x.shape[0]), batch)

    _, trajectory = sample(model_fn, noise, step_list=step_list, progress=False, return_trajectory=True)
    for j in range(len(step_list)):
        torch.testing.assert_close(method.simulate_student_input(noise, j, batch), trajectory[j])
    # the few-step sample inference returns is the student's x0 prediction at the last step
    last_t = torch.tensor(step_list[-1]).expand(2)
    with torch.no_grad():
        x0_last = method.adapter.predict_x0(student, trajectory[-2], last_t, batch)
    torch.testing.assert_close(trajectory[-1], x0_last, rtol=1e-5, atol=1e-5)


def test_renoise_rollout_lands_on_the_step_time():
    from test_methods_framework import make_components, make_dmd2_roles, tiny_batch

    roles = make_dmd2_roles()
    method = build_module(
        dict(type="DMD2", step_list=[1.0, 0.5], rollout="renoise"), METHODS, roles=roles, components=make_components()
    )
    batch = method.adapter.prepare_batch(tiny_batch(1))
    noise = method.adapter.noise(batch)
    torch.manual_seed(5)
    x = method.simulate_student_input(noise, 1, batch)
    with torch.no_grad():
        x0 = method.adapter.predict_x0(roles["student"], noise, torch.ones(1), batch)
    torch.manual_seed(5)
    torch.testing.assert_close(x, 0.5 * x0 + 0.5 * torch.randn_like(x0))
    with pytest.raises(ValueError, match="rollout"):
        build_module(dict(type="DMD2", rollout="ode"), METHODS, roles=roles, components=make_components())


# ---- end to end: the demo distillation config on 2 ranks, checkpoint by role, exact resume --------------------
TINY = dict(hidden_size=32, num_heads=2, depth_double=1, depth_single=1, mlp_ratio=2.0, axes_dims=[4, 6, 6])
TIMING_KEYS = {"step_time", "samples_per_s", "tokens_per_s", "mfu"}


def _write_run_config(tmp: Path) -> Path:
    from safetensors.torch import save_file

    from opensora.datasets.moving_shapes import write_dataset
    from opensora.registry import MODELS
    from opensora.config import load_config

    meta = write_dataset(tmp / "data", num=8, seed=0, height=18, width=18, num_frames=4, progress=False)
    base = load_config(str(REPO / "configs/distill/dmd2_demo.py"), [])
    torch.manual_seed(0)
    teacher = build_module({**base.models.teacher.model, **TINY}, MODELS)
    with torch.no_grad():  # a fresh MMDiT predicts v = 0 (zero-initialised output layers): make it say something
        for param in teacher.parameters():
            param.add_(0.05 * torch.randn_like(param))
    save_file({k: v.contiguous() for k, v in teacher.state_dict().items()}, str(tmp / "teacher.safetensors"))

    weights = f'dict(path="{tmp / "teacher.safetensors"}")'
    role = lambda extra="": f"dict(model=dict(**_tiny), init_from={weights}{extra})"  # noqa: E731
    text = f"""_base_ = ["{REPO / "configs/distill/dmd2_demo.py"}"]
_tiny = {TINY!r}
dataset = dict(_delete_=True, type="VideoTextDataset", data_path="{meta}", frame_interval=1)
bucket_config = dict(_delete_=True, **{{"18x18": {{4: (1.0, 2)}}}})
num_workers = 0
tensorboard = False
keep_last = 5
models = dict(student={role()}, teacher={role()}, critic={role()})
method = dict(student_update_every=2, step_list=[1.0, 0.6, 0.3])
"""
    path = tmp / "dmd2_tiny.py"
    path.write_text(text)
    return path


def _train_three_ways(rank, world_size, config, root):
    """6 steps straight; 3 steps then 3 more resumed from the checkpoint (each run a fresh Trainer)."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from opensora.training.launch import main

    main([config, "--outputs", f"{root}/full", "--max-steps", "6"])
    main([config, "--outputs", f"{root}/split", "--max-steps", "3"])
    main([config, "--outputs", f"{root}/split", "--max-steps", "6", "--resume", "auto"])
    return rank


def _metrics(run: Path):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in rows]


@pytest.fixture(scope="module")
def distill_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dmd2")
    config = _write_run_config(tmp)
    run_distributed(_train_three_ways, world_size=2, args=(str(config), str(tmp)), timeout=600)
    return tmp


def test_resume_is_bit_identical_on_two_ranks(distill_runs):
    full, split = _metrics(distill_runs / "full"), _metrics(distill_runs / "split")
    assert [row["step"] for row in full] == list(range(1, 7))
    assert full == split
    assert all(math.isfinite(row["loss"]) for row in full)
    # two-time-scale rule inside the real trainer: the student steps at iterations 0, 2, 4 (logged steps 1, 3, 5)
    assert [("grad_norm/student" in row) for row in full] == [True, False] * 3


def test_checkpoints_are_namespaced_by_role_and_restore_exactly(distill_runs):
    from opensora.convert.weights import load_role_weights

    ckpt_full = distill_runs / "full/checkpoints/step-0000006"
    ckpt_split = distill_runs / "split/checkpoints/step-0000006"
    roles = sorted(p.name for p in ckpt_full.iterdir() if (p / "model").is_dir())
    assert roles == ["critic", "student"]  # the frozen teacher is rebuilt from its config, never saved
    for role, ema in (("student", True), ("student", False), ("critic", False)):
        a = load_role_weights(ckpt_full, role=role, ema=ema).state_dict
        b = load_role_weights(ckpt_split, role=role, ema=ema).state_dict
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), (role, ema, key)
    # distillation moved both trained roles away from the teacher
    teacher = load_role_weights(distill_runs / "teacher.safetensors").state_dict
    for role in ("student", "critic"):
        trained = load_role_weights(ckpt_full, role=role, ema=False).state_dict
        assert any(not torch.equal(trained[k].float(), teacher[k].float()) for k in teacher), role


def test_student_exports_alone_and_samples_with_its_step_list(distill_runs, tmp_path):
    """tools/convert_checkpoint.py --role student: one safetensors file that the sampler loads like a checkpoint."""
    from opensora.config import load_config
    from opensora.convert.export import export_weights
    from opensora.convert.weights import load_role_weights
    from opensora.inference.sampler import VideoSampler

    ckpt = distill_runs / "full/checkpoints/step-0000006"
    exported = tmp_path / "student.safetensors"
    export_weights(ckpt, exported, role="student", ema=True)
    a, b = load_role_weights(exported).state_dict, load_role_weights(ckpt, role="student").state_dict
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert load_role_weights(exported).metadata["role"] == "student"

    cfg = load_config(str(distill_runs / "dmd2_tiny.py"))
    videos = []
    for source in (ckpt, exported):
        sampler = VideoSampler.from_config(cfg, source, role="student", device="cpu", dtype="fp32", progress=False)
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
    assert torch.equal(videos[0], videos[1])
