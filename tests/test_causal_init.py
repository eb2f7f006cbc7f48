"""Causal ODE init: the teacher's trajectory is the inference sampler's (CFG included) and passes through every
student time, the regression targets, and the deterministic pair cache."""

import pytest
import torch

from opensora.diffusion.sampling import sample, timesteps_for_sampling, timesteps_from_list
from opensora.methods.causal_init import merged_schedule
from opensora.registry import METHODS, build_module

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

STEPS = [1.0, 0.75, 0.5, 0.25]


def make_ode_init(causal_chunk_frames=0, **kwargs):
    from test_methods_framework import TINY_MMDIT, make_components, make_dmd2_roles, make_role

    from opensora.registry import MODELS

    roles = make_dmd2_roles()
    del roles["critic"]
    if causal_chunk_frames:  # a causal student with the teacher's weights
        network = build_module(dict(TINY_MMDIT, causal_chunk_frames=causal_chunk_frames), MODELS)
        network.load_state_dict(roles["teacher"].unwrap().state_dict())
        roles["student"] = make_role("student", network, True)
    cfg = dict(type="CausalODEInit", step_list=STEPS, teacher_num_steps=6, teacher_guidance_scale=3.0)
    cfg.update(kwargs)
    return build_module(cfg, METHODS, roles=roles, components=make_components()), roles


def test_merged_schedule_contains_every_student_time_in_order():
    teacher = timesteps_for_sampling(6, 2.0)
    student = timesteps_from_list(STEPS)
    times, positions = merged_schedule(teacher, student)
    assert bool((times[1:] < times[:-1]).all()) and times[0] == 1 and times[-1] == 0
    assert [float(times[p]) for p in positions] == student.tolist()
    assert set(teacher.tolist()) <= set(times.tolist())


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_teacher_trajectory_is_the_guided_inference_sampler(scale):
    from test_methods_framework import tiny_batch

    method, roles = make_ode_init(teacher_guidance_scale=scale)
    batch = method.adapter.prepare_batch(tiny_batch(2))
    noise = method.adapter.noise(batch)
    states, final = method.teacher_trajectory(noise, batch)
    teacher = roles["teacher"].unwrap()

    def model_fn(x, t, text_emb, text_mask, pooled):
        return teacher(
            x,
            timestep=t,
            text_emb=text_emb,
            text_mask=text_mask,
            pooled=pooled,
            cond=torch.zeros(x.shape[0], 49, *x.shape[2:]),
        )

    times, positions = merged_schedule(timesteps_for_sampling(6, batch.shift_alpha), method.step_times)
    ref, trajectory = sample(
        model_fn,
        noise,
        step_list=times.tolist(),
        cond_kwargs=batch.text,
        uncond_kwargs=batch.null_text,
        guidance_scale=scale,
        progress=False,
        return_trajectory=True,
    )
    torch.testing.assert_close(final, ref, rtol=1e-4, atol=1e-5)
    assert len(states) == len(STEPS)
    torch.testing.assert_close(states[0], noise)
    for k, position in enumerate(positions[:-1]):
        torch.testing.assert_close(states[k], trajectory[position], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("target", ["x0", "velocity"])
def test_regression_step_trains_the_student_towards_the_teacher_sample(target):
    from test_methods_framework import tiny_batch, trainer_like_step

    method, roles = make_ode_init(target=target)
    teacher_before = {k: v.clone() for k, v in roles["teacher"].unwrap().state_dict().items()}
    losses = []
    torch.manual_seed(0)
    batch = tiny_batch(2)
    for iteration in range(12):
        torch.manual_seed(1)  # the same pairs every time: the loss must fall
        loss_map, outputs, grad_norms = trainer_like_step(method, roles, batch, iteration)
        losses.append(float(loss_map["total_loss"].detach()))
        assert set(grad_norms) == {"student"} and outputs["flops"] > 0
    assert losses[-1] < 0.7 * losses[0], losses
    for key, value in roles["teacher"].unwrap().state_dict().items():
        assert torch.equal(value, teacher_before[key])


def test_velocity_target_lands_on_the_teacher_sample():
    from test_methods_framework import tiny_batch

    method, _ = make_ode_init(target="velocity")
    batch = method.adapter.prepare_batch(tiny_batch(2))
    x_t, t, final, _, index = method.ode_pairs(batch)
    target = (x_t - final) / t.view(-1, 1, 1, 1, 1)
    torch.testing.assert_close(x_t - t.view(-1, 1, 1, 1, 1) * target, final, rtol=1e-5, atol=1e-5)
    assert all(0 <= k < len(STEPS) for k in index.tolist())


def test_pair_cache_is_rebuilt_identically_whatever_the_global_rng():
    from test_methods_framework import tiny_batch

    prompts = ["a red circle moves left", "a blue square moves up", "a green triangle"]
    caches = []
    for global_seed in (0, 99):
        torch.manual_seed(global_seed)
        method, _ = make_ode_init(pairs="cache", prompts=prompts, num_cached_pairs=5)
        batch = method.adapter.prepare_batch(tiny_batch(2))
        caches.append(method._cached_pairs(batch))
        x_t, t, final, used, _ = method.ode_pairs(batch)
        assert x_t.shape == batch.latent_shape and used.text["text_emb"].shape[0] == 2
    for key in ("states", "final"):
        assert caches[0][key].shape[0] == 5 and torch.equal(caches[0][key], caches[1][key])
    with pytest.raises(ValueError, match="prompts"):
        make_ode_init(pairs="cache")


def test_independent_chunk_times_take_each_chunk_from_its_own_trajectory_state():
    """Causal student, chunks of 2 of the 4 latent frames: every chunk's frames come from the ODE state at its own
    step, the network gets t [B, num_chunks], and the x0 loss is computed frame by frame."""
    from test_methods_framework import tiny_batch, trainer_like_step

    method, roles = make_ode_init(causal_chunk_frames=2, num_frames_per_chunk=2)
    batch = method.adapter.prepare_batch(tiny_batch(2))
    torch.manual_seed(3)
    states, final = method.teacher_trajectory(method.adapter.noise(batch), batch)
    torch.manual_seed(3)
    x_t, t, x0, _, index = method.ode_pairs(batch)
    assert index.shape == t.shape == (2, 2) and torch.equal(x0, final)
    for b in range(2):
        for c in range(2):
            frames = slice(2 * c, 2 * c + 2)
            torch.testing.assert_close(x_t[b, :, frames], states[int(index[b, c])][b, :, frames])
            assert float(t[b, c]) == STEPS[int(index[b, c])]
    assert method.frame_times(t, x_t).shape == (2, 1, 4, 1, 1)
    with pytest.raises(ValueError, match="causal_chunk_frames"):
        make_ode_init(num_frames_per_chunk=2)  # a bidirectional student
    loss_map, _, grad_norms = trainer_like_step(method, roles, tiny_batch(2), 0)
    assert torch.isfinite(loss_map["total_loss"]) and grad_norms["student"] > 0


@pytest.mark.parametrize("target", ["x0", "velocity"])
def test_clean_context_prefixes_hold_the_teacher_sample_at_t0_and_leave_the_loss(target):
    """``clean_context_prob=1``: every sample's first c chunks (1 <= c < num_chunks) are the teacher's final sample
    at t = 0, as the streaming cache holds them; the loss is the mean squared error over the other chunks' frames
    only, computed here by hand from the student's own velocity."""
    from test_methods_framework import tiny_batch

    method, roles = make_ode_init(causal_chunk_frames=1, num_frames_per_chunk=1, clean_context_prob=1.0, target=target)
    torch.manual_seed(5)  # the train step below prepares the batch and draws the pairs in this order
    x_t, t, final, used, index = method.ode_pairs(method.adapter.prepare_batch(tiny_batch(2)))
    chunks = index.shape[1]
    assert chunks == 4
    for b in range(2):
        clean = int((index[b] == len(STEPS)).sum())
        assert 1 <= clean < chunks and bool((index[b, :clean] == len(STEPS)).all())  # a prefix, never all
        assert bool((t[b, :clean] == 0).all()) and bool((t[b, clean:] > 0).all())
        torch.testing.assert_close(x_t[b, :, :clean], final[b, :, :clean], rtol=0, atol=0)
    torch.manual_seed(5)
    loss_map, _ = method.single_train_step(tiny_batch(2), 0)
    velocity = method.adapter.predict_velocity(roles["student"], x_t.float(), t, used)
    t_frames = method.frame_times(t.float(), x_t)
    scored = (t_frames > 0).expand_as(x_t)
    if target == "x0":
        error = x_t - t_frames * velocity - final
    else:
        error = velocity - (x_t - final) / torch.where(t_frames > 0, t_frames, torch.ones_like(t_frames))
    expected = error[scored].square().mean()
    torch.testing.assert_close(loss_map["total_loss"], expected, rtol=1e-5, atol=1e-7)


def test_clean_context_off_keeps_every_chunk_noisy_and_bad_values_are_refused():
    """The default (0) leaves the pairs as before (no chunk at t = 0, the plain mean squared error); a probability
    outside [0, 1] or a student without chunks is refused."""
    import torch.nn.functional as F
    from test_methods_framework import tiny_batch

    plain, roles = make_ode_init(causal_chunk_frames=1, num_frames_per_chunk=1)
    torch.manual_seed(8)
    x_t, t, final, used, index = plain.ode_pairs(plain.adapter.prepare_batch(tiny_batch(2)))
    assert bool((index < len(STEPS)).all()) and bool((t > 0).all())
    torch.manual_seed(8)
    loss_map, _ = plain.single_train_step(tiny_batch(2), 0)
    velocity = plain.adapter.predict_velocity(roles["student"], x_t.float(), t, used)
    expected = F.mse_loss(x_t - plain.frame_times(t.float(), x_t) * velocity, final)
    torch.testing.assert_close(loss_map["total_loss"], expected, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="clean_context_prob"):
        make_ode_init(causal_chunk_frames=1, num_frames_per_chunk=1, clean_context_prob=1.5)
    with pytest.raises(ValueError, match="clean_context_prob"):
        make_ode_init(clean_context_prob=0.5)  # a bidirectional student has no chunks
