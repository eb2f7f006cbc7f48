"""Fixed costs of the full-video sampler (issue 13): noise drawn in parallel threads is the per-row noise, and the
model passes never inspect the text mask (no GPU->host sync per pass)."""

import torch

from opensora.inference.sampler import VideoSampler, seeded_noise
from opensora.models.mmdit import MMDiT
from opensora.registry import MODELS, build_module


def test_threaded_seeded_noise_equals_the_per_row_draws():
    seeds, shape = [7, 8, 9, 10], (48, 8, 32, 32)  # 1.5M values: large enough for the threaded path
    noise = seeded_noise(seeds, shape)
    for row, seed in zip(noise, seeds):
        assert torch.equal(row, torch.randn(shape, generator=torch.Generator().manual_seed(seed)))


def test_sampler_passes_the_padding_flag_so_no_pass_inspects_the_mask(monkeypatch):
    torch.manual_seed(0)
    model = build_module(
        dict(
            type="MMDiT",
            in_channels=48,
            patch_size=(1, 2, 2),
            hidden_size=32,
            num_heads=2,
            depth_double=1,
            depth_single=1,
            text_dim=64,
            pooled_dim=64,
            axes_dims=(4, 6, 6),
        ),
        MODELS,
    ).eval()
    vae = build_module(dict(type="PatchVAE", patch_size=4, temporal_patch_size=1), MODELS).eval()
    text = build_module(dict(type="TextConditioner", seed=0), MODELS)
    sampler = VideoSampler(model, vae, text, progress=False)
    flags = []
    original = MMDiT.key_mask

    def spy(text_mask, num_video_tokens, has_padding=None):
        flags.append(has_padding)
        return original(text_mask, num_video_tokens, has_padding)

    monkeypatch.setattr(MMDiT, "key_mask", staticmethod(spy))
    sampler.generate(
        ["a red circle moving left"], [0], num_frames=2, height=16, width=16, num_steps=3, guidance_scale=2.0
    )
    assert len(flags) == 3 and None not in flags
