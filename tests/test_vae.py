"""Autoencoders: PatchVAE packing against an explicit reference; tiny HunyuanVideoVAE against diffusers."""

import itertools

import pytest
import torch

from opensora.models.vae import HunyuanVideoVAE, PatchVAE, VideoAutoencoder
from opensora.registry import MODELS, build_module

TINY_HUNYUAN = dict(block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4, latent_channels=4)


def _video(t, h, w, batch=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 3, t, h, w, generator=generator) * 2 - 1


# ---------------------------------------------------------------------------------------------------------------
# PatchVAE


@pytest.mark.parametrize("patch_size,temporal_patch_size", [(1, 1), (2, 1), (4, 1), (2, 2), (4, 4)])
def test_patch_vae_round_trip_is_exact(patch_size, temporal_patch_size):
    vae = PatchVAE(patch_size=patch_size, temporal_patch_size=temporal_patch_size)
    video = _video(4 * temporal_patch_size, 8, 12)
    latent = vae.encode(video)
    assert latent.shape == (2, vae.latent_channels, *vae.get_latent_size(video.shape[2:]))
    assert vae.latent_channels == 3 * patch_size * patch_size * temporal_patch_size
    assert vae.get_video_size(latent.shape[2:]) == tuple(video.shape[2:])
    assert torch.equal(vae.decode(latent), video)


def test_patch_vae_channel_layout_matches_reference_loop():
    p, pt = 2, 2
    vae = PatchVAE(patch_size=p, temporal_patch_size=pt)
    video = _video(4, 4, 6, batch=1)
    latent = vae.encode(video)
    for c, it, ih, iw in itertools.product(range(3), range(pt), range(p), range(p)):
        channel = ((c * pt + it) * p + ih) * p + iw
        expected = video[0, c, it::pt, ih::p, iw::p]
        assert torch.equal(latent[0, channel], expected)


def test_patch_vae_scale_and_shift():
    vae = PatchVAE(patch_size=2, scaling_factor=2.0, shift_factor=0.5)
    plain = PatchVAE(patch_size=2)
    video = _video(2, 4, 4)
    latent = vae.encode(video)
    torch.testing.assert_close(latent, (plain.encode(video) - 0.5) * 2.0)
    torch.testing.assert_close(vae.decode(latent), video)


def test_patch_vae_rejects_bad_sizes():
    vae = PatchVAE(patch_size=4, temporal_patch_size=2)
    with pytest.raises(ValueError, match="height 6 is not divisible"):
        vae.encode(_video(2, 6, 8))
    with pytest.raises(ValueError, match="frame count 3 is not divisible"):
        vae.encode(_video(3, 8, 8))
    with pytest.raises(ValueError, match=r"\[B, 3, T, H, W\]"):
        vae.encode(torch.zeros(1, 4, 2, 8, 8))
    with pytest.raises(ValueError, match="decode expects a latent"):
        vae.decode(torch.zeros(1, 3, 1, 2, 2))
    with pytest.raises(ValueError, match="width 10 is not divisible"):
        vae.get_latent_size((2, 8, 10))


def test_patch_vae_from_registry_and_frozen():
    vae = build_module(dict(type="PatchVAE", patch_size=2), MODELS)
    assert isinstance(vae, VideoAutoencoder)
    vae.train()
    assert not vae.training
    assert (vae.spatial_compression, vae.temporal_compression) == (2, 1)


# ---------------------------------------------------------------------------------------------------------------
# HunyuanVideoVAE (tiny random config: 4 blocks, so the real 8x spatial / 4x causal temporal compression)


@pytest.fixture(scope="module")
def hunyuan():
    return HunyuanVideoVAE(config=TINY_HUNYUAN, seed=0)


def test_hunyuan_shapes_for_one_plus_4k_frames(hunyuan):
    assert (hunyuan.spatial_compression, hunyuan.temporal_compression) == (8, 4)
    assert hunyuan.latent_channels == 4
    video = _video(9, 32, 16, batch=1)
    latent = hunyuan.encode(video)
    assert hunyuan.get_latent_size((9, 32, 16)) == (3, 4, 2)
    assert latent.shape == (1, 4, 3, 4, 2)
    decoded = hunyuan.decode(latent)
    assert decoded.shape == (1, 3, *hunyuan.get_video_size(latent.shape[2:]))
    assert decoded.shape == video.shape
    assert decoded.min() >= -1 and decoded.max() <= 1


def test_hunyuan_applies_scaling_factor_around_diffusers(hunyuan):
    scale = hunyuan.vae.config.scaling_factor
    assert hunyuan.scaling_factor == pytest.approx(scale) and hunyuan.shift_factor == 0.0
    video = _video(5, 16, 16, batch=1)
    with torch.no_grad():
        raw = hunyuan.vae.encode(video).latent_dist.mode()
        latent = hunyuan.encode(video)
        torch.testing.assert_close(latent, raw * scale)
        expected_video = hunyuan.vae.decode(latent / scale).sample.clamp(-1, 1)
    torch.testing.assert_close(hunyuan.decode(latent), expected_video)


def test_hunyuan_rejects_frame_counts_that_are_not_one_plus_4k(hunyuan):
    with pytest.raises(ValueError, match=r"1 \+ 4\*k frames"):
        hunyuan.encode(_video(8, 16, 16, batch=1))
    with pytest.raises(ValueError, match="height 12"):
        hunyuan.get_latent_size((5, 12, 16))


def test_hunyuan_rejects_configs_whose_blocks_do_not_give_the_declared_compression():
    config = dict(
        TINY_HUNYUAN,
        block_out_channels=(8, 8),
        down_block_types=("HunyuanVideoDownBlock3D",) * 2,
        up_block_types=("HunyuanVideoUpBlock3D",) * 2,
    )
    with pytest.raises(ValueError, match="compresses"):
        HunyuanVideoVAE(config=config)
    with pytest.raises(ValueError, match="exactly one of"):
        HunyuanVideoVAE()


def test_hunyuan_seeded_init_and_pretrained_round_trip(hunyuan, tmp_path):
    video = _video(5, 16, 16, batch=1)
    same_seed = HunyuanVideoVAE(config=TINY_HUNYUAN, seed=0)
    assert torch.equal(same_seed.encode(video), hunyuan.encode(video))
    hunyuan.vae.save_pretrained(tmp_path / "vae")
    loaded = build_module(dict(type="HunyuanVideoVAE", from_pretrained=str(tmp_path), subfolder="vae"), MODELS)
    assert torch.equal(loaded.encode(video), hunyuan.encode(video))


def test_hunyuan_sampling_tiling_and_freezing():
    vae = HunyuanVideoVAE(config=TINY_HUNYUAN, sample_posterior=True, use_tiling=True, use_slicing=True)
    assert vae.vae.use_tiling and vae.vae.use_slicing
    assert not any(p.requires_grad for p in vae.parameters())
    vae.train()
    assert not vae.training and not vae.vae.training
    video = _video(5, 16, 16, batch=2)
    torch.manual_seed(0)
    first = vae.encode(video)
    second = vae.encode(video)
    assert not torch.equal(first, second)  # drawn from the posterior, not its mode
    vae.disable_tiling()
    assert not vae.vae.use_tiling
