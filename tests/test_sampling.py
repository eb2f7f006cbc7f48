import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from opensora.diffusion.flow_matching import add_noise, time_shift
from opensora.diffusion.guidance import image_text_cfg, text_cfg
from opensora.diffusion.sampling import (
    euler_step,
    guided_velocity,
    sample,
    timesteps_for_sampling,
    timesteps_from_list,
)


def _linear_field(seed=0, shape=(2, 3, 4, 5, 6)):
    """A velocity field v(x, t) = a * x + t * b + c (affine in x, depends on t)."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(shape, generator=g)
    c = torch.randn(shape, generator=g)

    def field(x, t):
        return -0.7 * x + t.view(-1, *([1] * (x.ndim - 1))) * b + 0.3 * c

    return field


def test_timesteps_descend_from_one_to_zero_with_the_training_shift():
    times = timesteps_for_sampling(10, shift_alpha=3.0)
    assert times.shape == (11,) and times[0].item() == 1.0 and times[-1].item() == 0.0
    assert bool((times[1:] < times[:-1]).all())
    torch.testing.assert_close(times, time_shift(torch.linspace(1, 0, 11, dtype=torch.float64), 3.0).float())
    torch.testing.assert_close(timesteps_for_sampling(4), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))


def test_step_list_for_few_step_students():
    torch.testing.assert_close(timesteps_from_list([1.0, 0.75, 0.5]), torch.tensor([1.0, 0.75, 0.5, 0.0]))
    torch.testing.assert_close(timesteps_from_list([1.0, 0.5, 0.0]), torch.tensor([1.0, 0.5, 0.0]))
    with pytest.raises(ValueError, match="descending"):
        timesteps_from_list([0.5, 0.75])
    with pytest.raises(ValueError, match="descending"):
        timesteps_from_list([1.5, 0.5])


def test_euler_step_closed_form():
    x = torch.randn(3, 2, 4)
    v = torch.randn(3, 2, 4)
    torch.testing.assert_close(euler_step(x, v, 0.8, 0.5), x - 0.3 * v)
    t, t_next = torch.tensor([0.9, 0.5, 0.2]), torch.tensor([0.6, 0.5, 0.0])
    expected = x + (t_next - t).view(3, 1, 1) * v
    torch.testing.assert_close(euler_step(x, v, t, t_next), expected)


@pytest.mark.parametrize("shift", [1.0, 3.0, 7.5])
@pytest.mark.parametrize("num_steps", [1, 8, 30])
def test_sampler_parity_with_diffusers_flow_match_euler(shift, num_steps):
    field = _linear_field(seed=num_steps)
    noise = torch.randn(2, 3, 4, 5, 6, generator=torch.Generator().manual_seed(42))

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift, use_dynamic_shifting=False)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1].tolist())
    ours_times = timesteps_for_sampling(num_steps, shift_alpha=shift)
    torch.testing.assert_close(ours_times, scheduler.sigmas.float(), rtol=0, atol=1e-6)

    x_ref = noise.clone()
    reference = [x_ref]
    for timestep in scheduler.timesteps:
        t = scheduler.sigmas[scheduler.index_for_timestep(timestep)].expand(x_ref.shape[0])
        x_ref = scheduler.step(field(x_ref, t), timestep, x_ref).prev_sample
        reference.append(x_ref)

    x_ours, trajectory = sample(
        lambda x, t: field(x, t),
        noise,
        num_steps=num_steps,
        shift_alpha=shift,
        progress=False,
        return_trajectory=True,
    )
    assert len(trajectory) == len(reference) == num_steps + 1
    # both integrate in float32: allow 1e-6 absolute plus 1e-6 relative (a few ulps over 30 steps)
    for ours, ref in zip(trajectory, reference):
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x_ours, x_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "schedule", [dict(num_steps=1), dict(num_steps=7, shift_alpha=3.0), dict(step_list=[1.0, 0.8, 0.4, 0.1])]
)
def test_exact_velocity_of_a_point_mass_recovers_the_data(schedule):
    """Flow paths are straight lines, so Euler with the exact velocity (x - x0) / t lands on x0."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 3, 2, 4, 4, generator=g, dtype=torch.float64)
    noise = torch.randn(2, 3, 2, 4, 4, generator=g, dtype=torch.float64)

    def exact_velocity(x, t):
        return (x - x0.float()) / t.view(-1, 1, 1, 1, 1)

    out, trajectory = sample(exact_velocity, noise, progress=False, return_trajectory=True, **schedule)
    torch.testing.assert_close(out, x0.float(), rtol=0, atol=1e-5)
    times = (
        timesteps_from_list(schedule["step_list"])
        if "step_list" in schedule
        else timesteps_for_sampling(schedule["num_steps"], schedule.get("shift_alpha", 1.0))
    )
    for x, t in zip(trajectory, times):  # every intermediate state lies on the interpolation path
        torch.testing.assert_close(x, add_noise(x0, noise, float(t)).float(), rtol=0, atol=1e-5)


# ---------------------------------------------------------------- guidance
def test_text_cfg_formula_and_identity_at_one():
    g = torch.Generator().manual_seed(0)
    c, u = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    torch.testing.assert_close(text_cfg(c, u, 4.5), u + 4.5 * (c - u))
    torch.testing.assert_close(text_cfg(c, u, 0.0), u)
    assert torch.equal(text_cfg(c, u, 1.0), c)


def test_image_text_cfg_formula_and_identity_at_one():
    g = torch.Generator().manual_seed(1)
    c, u_img, u_noimg = (torch.randn(2, 3, 4, generator=g, dtype=torch.float64) for _ in range(3))
    w_txt, w_img = 5.0, 2.5
    hand = u_noimg + w_img * (u_img - u_noimg) + w_txt * (c - u_img)
    torch.testing.assert_close(image_text_cfg(c, u_img, u_noimg, w_txt, w_img), hand)
    assert torch.equal(image_text_cfg(c, u_img, u_noimg, 1.0, 1.0), c)
    # with w_img = 1 it reduces to text CFG against the image-kept branch
    torch.testing.assert_close(image_text_cfg(c, u_img, u_noimg, w_txt, 1.0), text_cfg(c, u_img, w_txt))


class _RecordingModel:
    """Returns x + branch_id so each CFG branch is identifiable; records batch sizes."""

    def __init__(self):
        self.batch_sizes = []

    def __call__(self, x, t, branch_id, cond=None, flag="same"):
        assert t.shape == (x.shape[0],)
        self.batch_sizes.append(x.shape[0])
        return x + branch_id.view(-1, 1, 1)


def test_guided_velocity_batches_the_branches():
    x = torch.randn(2, 3, 4)
    ones = torch.ones(2)
    cond, u_img, u_all = dict(branch_id=1 * ones), dict(branch_id=2 * ones), dict(branch_id=3 * ones)
    model = _RecordingModel()
    v = guided_velocity(model, x, 0.5, cond, u_img, guidance_scale=4.0)
    torch.testing.assert_close(v, text_cfg(x + 1, x + 2, 4.0))
    v3 = guided_velocity(model, x, 0.5, cond, u_img, u_all, guidance_scale=4.0, image_guidance_scale=2.0)
    torch.testing.assert_close(v3, image_text_cfg(x + 1, x + 2, x + 3, 4.0, 2.0))
    v1 = guided_velocity(model, x, 0.5, cond)
    torch.testing.assert_close(v1, x + 1)
    assert model.batch_sizes == [4, 6, 2]
    with pytest.raises(ValueError, match="differs"):
        guided_velocity(model, x, 0.5, dict(cond, flag="a"), dict(u_img, flag="b"))
    with pytest.raises(ValueError, match="tensor in some"):
        guided_velocity(model, x, 0.5, dict(cond, cond=torch.ones(2)), dict(u_img, cond=None))


def test_sample_runs_one_two_or_three_passes():
    noise = torch.randn(2, 3, 4)
    ones = torch.ones(2)
    cond, u_img, u_all = dict(branch_id=ones), dict(branch_id=2 * ones), dict(branch_id=3 * ones)
    for kwargs, expected in [
        (dict(), 2),
        (dict(uncond_kwargs=u_img, guidance_scale=1.0), 2),  # w = 1: the uncond pass is skipped
        (dict(uncond_kwargs=u_img, guidance_scale=5.0), 4),
        (dict(uncond_kwargs=u_img, uncond_all_kwargs=u_all, guidance_scale=5.0, image_guidance_scale=2.0), 6),
    ]:
        model = _RecordingModel()
        sample(model, noise, num_steps=3, cond_kwargs=cond, progress=False, **kwargs)
        assert model.batch_sizes == [expected] * 3, kwargs
    with pytest.raises(ValueError, match="uncond_kwargs"):
        sample(_RecordingModel(), noise, num_steps=2, cond_kwargs=cond, guidance_scale=3.0, progress=False)
    with pytest.raises(ValueError, match="exactly one"):
        sample(_RecordingModel(), noise, num_steps=2, step_list=[1.0, 0.5], cond_kwargs=cond, progress=False)
