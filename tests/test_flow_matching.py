import math

import pytest
import torch
import torch.nn.functional as F

from opensora.diffusion.flow_matching import (
    add_noise,
    drop_text,
    inverse_time_shift,
    masked_mse,
    masked_mse_per_sample,
    num_latent_tokens,
    predict_noise,
    predict_x0,
    sample_timesteps,
    sample_training_timesteps,
    shift_alpha_for,
    time_shift,
    velocity_target,
)


# ---------------------------------------------------------------- shift
@pytest.mark.parametrize("alpha", [0.5, 1.0, 1.7, 3.0, 8.0])
def test_time_shift_monotone_endpoints_closed_form(alpha):
    t = torch.linspace(0, 1, 1001, dtype=torch.float64)
    s = time_shift(t, alpha)
    assert s[0].item() == 0.0 and s[-1].item() == 1.0
    assert bool((s[1:] > s[:-1]).all())
    expected = torch.tensor([alpha * v / (1 + (alpha - 1) * v) for v in t.tolist()], dtype=torch.float64)
    torch.testing.assert_close(s, expected, rtol=0, atol=1e-15)
    # inverse consistency both ways; the inverse is the shift with 1/alpha
    torch.testing.assert_close(inverse_time_shift(s, alpha), t, rtol=0, atol=1e-12)
    torch.testing.assert_close(time_shift(inverse_time_shift(t, alpha), alpha), t, rtol=0, atol=1e-12)
    torch.testing.assert_close(inverse_time_shift(t, alpha), time_shift(t, 1 / alpha), rtol=0, atol=1e-12)


def test_time_shift_moves_towards_noise_and_rejects_bad_alpha():
    t = torch.tensor([0.25, 0.5, 0.75])
    assert bool((time_shift(t, 3.0) > t).all())
    assert time_shift(0.5, 3.0) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="alpha"):
        time_shift(t, 0.0)


def test_shift_alpha_for_grows_with_sqrt_tokens():
    assert num_latent_tokens((5, 32, 32), (1, 2, 2)) == 5 * 16 * 16
    assert num_latent_tokens((5, 33, 31), (1, 2, 2)) == 5 * 17 * 16  # partial patches are padded
    # one 256px frame (32x32 latent, 2x2 patches) is the base
    assert shift_alpha_for((1, 32, 32)) == pytest.approx(1.0)
    assert shift_alpha_for((5, 32, 32)) == pytest.approx(math.sqrt(5))
    assert shift_alpha_for((1, 64, 64)) == pytest.approx(2.0)
    assert shift_alpha_for(1024, base_tokens=256, base_shift=1.5) == pytest.approx(3.0)
    # clamps: tiny latents never shift towards data by default, max_shift caps
    assert shift_alpha_for((1, 4, 4)) == 1.0
    assert shift_alpha_for((1, 4, 4), min_shift=None) == pytest.approx(0.125)  # 4 tokens
    assert shift_alpha_for((16, 64, 64), max_shift=3.0) == 3.0


# ---------------------------------------------------------------- timestep sampling
def test_logit_normal_range_median_and_seeding():
    g = torch.Generator().manual_seed(0)
    t = sample_timesteps(200_000, generator=g)
    assert t.dtype == torch.float32 and t.shape == (200_000,)
    assert bool(((t > 0) & (t < 1)).all())
    assert t.median().item() == pytest.approx(0.5, abs=0.01)
    t_mean = sample_timesteps(200_000, generator=torch.Generator().manual_seed(1), mean=1.0, std=0.5)
    assert t_mean.median().item() == pytest.approx(1 / (1 + math.exp(-1.0)), abs=0.01)
    # logit of samples is N(mean, std)
    logit = torch.logit(t_mean.double())
    assert logit.mean().item() == pytest.approx(1.0, abs=0.01)
    assert logit.std().item() == pytest.approx(0.5, abs=0.01)
    a = sample_timesteps(8, generator=torch.Generator().manual_seed(3))
    b = sample_timesteps(8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_uniform_and_shifted_training_timesteps():
    t = sample_timesteps(100_000, generator=torch.Generator().manual_seed(0), kind="uniform")
    assert bool(((t > 0) & (t < 1)).all())
    assert t.mean().item() == pytest.approx(0.5, abs=0.01)
    shifted = sample_training_timesteps(100_000, shift_alpha=3.0, generator=torch.Generator().manual_seed(0))
    base = sample_timesteps(100_000, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(shifted, time_shift(base, 3.0))
    # median of a shifted logit-normal is the shifted median
    assert shifted.median().item() == pytest.approx(0.75, abs=0.01)
    with pytest.raises(ValueError, match="kind"):
        sample_timesteps(4, kind="cosine")


# ---------------------------------------------------------------- interpolation
def test_add_noise_target_and_recovery():
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(3, 4, 2, 5, 6, generator=g, dtype=torch.float64)
    eps = torch.randn(3, 4, 2, 5, 6, generator=g, dtype=torch.float64)
    t = torch.tensor([0.0, 0.3, 1.0], dtype=torch.float64)
    x_t = add_noise(x0, eps, t)
    torch.testing.assert_close(x_t[0], x0[0], rtol=0, atol=0)
    torch.testing.assert_close(x_t[2], eps[2], rtol=0, atol=0)
    torch.testing.assert_close(x_t[1], 0.7 * x0[1] + 0.3 * eps[1])
    v = velocity_target(x0, eps)
    torch.testing.assert_close(v, eps - x0, rtol=0, atol=0)
    torch.testing.assert_close(predict_x0(x_t, v, t), x0, rtol=0, atol=1e-12)
    torch.testing.assert_close(predict_noise(x_t, v, t), eps, rtol=0, atol=1e-12)
    # scalar t broadcasts too; x_t is linear in t with slope v
    torch.testing.assert_close(add_noise(x0, eps, 0.6) - add_noise(x0, eps, 0.2), 0.4 * v)
    with pytest.raises(ValueError, match="t must be"):
        add_noise(x0, eps, torch.ones(2))


# ---------------------------------------------------------------- masked loss
def _masked_example():
    g = torch.Generator().manual_seed(0)
    pred = torch.randn(2, 3, 4, 2, 2, generator=g)
    target = torch.randn(2, 3, 4, 2, 2, generator=g)
    mask = torch.ones(2, 1, 4, 1, 1)
    mask[0, :, 0] = 0  # sample 0: frame 0 is a condition frame
    mask[1, :, -1] = 0  # sample 1: last frame is a condition frame
    return pred, target, mask


def test_masked_mse_equals_hand_computation():
    pred, target, mask = _masked_example()
    err = (pred - target) ** 2
    hand_0 = err[0, :, 1:].sum() / (3 * 3 * 2 * 2)
    hand_1 = err[1, :, :-1].sum() / (3 * 3 * 2 * 2)
    torch.testing.assert_close(masked_mse(pred, target, mask), (hand_0 + hand_1) / 2)
    per_sample, counted = masked_mse_per_sample(pred, target, mask)
    torch.testing.assert_close(per_sample, torch.stack([hand_0, hand_1]))
    assert counted.tolist() == [36.0, 36.0]
    # no mask / all-ones mask is plain MSE
    torch.testing.assert_close(masked_mse(pred, target), F.mse_loss(pred, target))
    torch.testing.assert_close(masked_mse(pred, target, torch.ones_like(mask)), F.mse_loss(pred, target))
    # a full-resolution mask [B,1,T,H,W] gives the same answer as the frame mask
    torch.testing.assert_close(masked_mse(pred, target, mask.expand(2, 1, 4, 2, 2)), masked_mse(pred, target, mask))


def test_masked_mse_ignores_condition_frames_value_and_gradient():
    pred, target, mask = _masked_example()
    pred = pred.clone().requires_grad_(True)
    loss = masked_mse(pred, target, mask)
    loss.backward()
    assert bool((pred.grad[0, :, 0] == 0).all()) and bool((pred.grad[1, :, -1] == 0).all())
    assert bool((pred.grad[0, :, 1:] != 0).all())
    changed = pred.detach().clone()
    changed[0, :, 0] = 1e6
    changed[1, :, -1] = float("inf")
    assert masked_mse(changed, target, mask).item() == loss.item()


def test_masked_mse_all_zero_mask_sample():
    pred, target, mask = _masked_example()
    mask[1] = 0
    pred = pred.clone().requires_grad_(True)
    loss = masked_mse(pred, target, mask)
    hand_0 = ((pred - target) ** 2)[0, :, 1:].mean()
    torch.testing.assert_close(loss, hand_0)  # sample 1 counts nothing and is left out of the mean
    assert torch.isfinite(loss)
    none = masked_mse(pred, target, torch.zeros_like(mask))
    assert none.item() == 0.0 and none.requires_grad
    none.backward()
    assert bool((pred.grad == 0).all())


def test_masked_mse_bf16_inputs_computed_in_fp32():
    pred, target, mask = _masked_example()
    loss = masked_mse(pred.bfloat16(), target.bfloat16(), mask)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, masked_mse(pred.bfloat16().float(), target.bfloat16().float(), mask))


# ---------------------------------------------------------------- CFG dropout
def _text_batch(batch):
    g = torch.Generator().manual_seed(0)
    text = dict(
        text_emb=torch.randn(batch, 5, 8, generator=g),
        text_mask=torch.ones(batch, 5, dtype=torch.long),
        pooled=torch.randn(batch, 4, generator=g),
    )
    null = dict(
        text_emb=torch.zeros(1, 5, 8), text_mask=torch.tensor([[1, 0, 0, 0, 0]]), pooled=torch.full((1, 4), -1.0)
    )
    return text, null


def test_drop_text_swaps_consistently_and_at_the_right_rate():
    text, null = _text_batch(20_000)
    out, drop = drop_text(text, null, drop_prob=0.1, generator=torch.Generator().manual_seed(0))
    assert drop.dtype == torch.bool and drop.shape == (20_000,)
    assert drop.float().mean().item() == pytest.approx(0.1, abs=0.01)
    for key in text:
        assert out[key].dtype == text[key].dtype and out[key].shape == text[key].shape
        assert torch.equal(out[key][~drop], text[key][~drop])
        assert torch.equal(out[key][drop], null[key].expand_as(text[key])[drop])


def test_drop_text_forced_and_edge_probabilities():
    text, null = _text_batch(4)
    forced = torch.tensor([True, False, False, True])
    out, drop = drop_text(text, null, drop_prob=0.0, drop=forced)
    assert torch.equal(drop, forced)
    assert torch.equal(out["pooled"][0], null["pooled"][0]) and torch.equal(out["pooled"][1], text["pooled"][1])
    _, none = drop_text(text, null, drop_prob=0.0, generator=torch.Generator().manual_seed(0))
    _, all_ = drop_text(text, null, drop_prob=1.0, generator=torch.Generator().manual_seed(0))
    assert not none.any() and all_.all()
    with pytest.raises(KeyError, match="pooled"):
        drop_text(text, {k: v for k, v in null.items() if k != "pooled"}, 0.5)


def _device_scalar_reference(x0, noise, t):
    """``add_noise`` as first written: ``t`` as a 0-dim tensor on ``x0``'s device."""
    tb = torch.as_tensor(t, dtype=x0.dtype, device=x0.device)
    return (1 - tb) * x0 + tb * noise


def _check_host_scalar_time(device):
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x0 = torch.randn(3, 16, 3, 8, 8, generator=g).to(device, dtype)
        noise = torch.randn(3, 16, 3, 8, 8, generator=g).to(device, dtype)
        for t in (0.75, 0.5, 0.25, 0.1234567, 1 / 3, 0.0, 1.0, 1):
            out = add_noise(x0, noise, t)
            assert out.device == x0.device and out.dtype == dtype
            assert torch.equal(out, _device_scalar_reference(x0, noise, t)), (dtype, t)


def test_host_scalar_time_gives_the_device_scalar_result_on_cpu():
    _check_host_scalar_time("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_scalar_time_gives_the_device_scalar_result_on_cuda_without_a_sync():
    """A host float ``t`` must not cost a blocking host-to-device copy, and must round as a device scalar does."""
    _check_host_scalar_time("cuda")
    x0 = torch.randn(2, 4, 8, 8, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        add_noise(x0, torch.randn_like(x0), 0.3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
