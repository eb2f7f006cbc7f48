"""Named MMDiT shapes, as plain dicts that mmengine configs can use: ``model = dict(**MMDIT_CONFIGS["tiny"])``.

``in_channels`` is the latent channel count; patchify happens inside the model, so a 16-channel latent with
patch (1, 2, 2) gives the 64-wide patch tokens of Flux / Open-Sora 2.0. Override text_dim / pooled_dim /
in_channels to match the text conditioner and VAE of a run.
"""

import copy

MMDIT_CONFIGS = {
    # ~1.9M parameters: trains on CPU on 32x32..64x64 latents (PatchVAE-style 12-channel latents).
    "tiny": dict(
        type="MMDiT",
        in_channels=12,
        cond_channels=13,
        patch_size=(1, 2, 2),
        hidden_size=128,
        num_heads=4,
        depth_double=2,
        depth_single=2,
        mlp_ratio=4.0,
        text_dim=64,
        pooled_dim=64,
        axes_dims=(8, 12, 12),
        theta=10000.0,
    ),
    # ~1.26B parameters: the Flux-like shape of the diffusers baseline (8 double + 16 single, 12 x 128).
    "1b": dict(
        type="MMDiT",
        in_channels=16,
        cond_channels=None,
        patch_size=(1, 2, 2),
        hidden_size=1536,
        num_heads=12,
        depth_double=8,
        depth_single=16,
        mlp_ratio=4.0,
        text_dim=4096,
        pooled_dim=768,
        axes_dims=(16, 56, 56),
        theta=10000.0,
    ),
    # Open-Sora 2.0 (11B) shape: 19 double + 38 single, 3072 = 24 x 128, 16-channel HunyuanVAE latent, patch 2,
    # condition input (mask + masked latents) for I2V/V2V.
    "11b": dict(
        type="MMDiT",
        in_channels=16,
        cond_channels=17,
        patch_size=(1, 2, 2),
        hidden_size=3072,
        num_heads=24,
        depth_double=19,
        depth_single=38,
        mlp_ratio=4.0,
        text_dim=4096,
        pooled_dim=768,
        axes_dims=(16, 56, 56),
        theta=10000.0,
    ),
}


def mmdit_config(name: str, **overrides) -> dict:
    """A copy of preset ``name`` with ``overrides`` applied (unknown names list the valid ones)."""
    if name not in MMDIT_CONFIGS:
        raise KeyError(f"unknown MMDiT preset '{name}'; choose one of {sorted(MMDIT_CONFIGS)}")
    cfg = copy.deepcopy(MMDIT_CONFIGS[name])
    cfg.update(overrides)
    return cfg
