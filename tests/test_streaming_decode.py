"""Exact-once chunk decode of the causal HunyuanVideo VAE (CPU, fp32, tiny random diffusers config): the chunked
causal convs (conv caches, the upsamplers' first-frame rule, the attention cache) equal the whole-clip decoder of
diffusers exactly when the GroupNorm statistics are held at the whole clip's; the running rule's statistics are
those of every frame seen so far; the first chunk under any rule is the diffusers decode of that chunk alone; the
streaming sampler decodes through it by default and keeps the overlap rule on request."""

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLHunyuanVideo

from opensora.models.vae import HunyuanVideoVAE
from opensora.models.vae.conv_cache import CausalConvCache
from opensora.models.vae.exact_chunk_decode import ExactChunkDecode, exact_chunk_decode
from opensora.models.vae.fused_group_norm import fused_group_norm
from opensora.models.vae.phase_upsample import PhaseUpsampleConv, axis_phases
from opensora.models.vae.streaming_decode import NormStatistics, StreamingDecoder, whole_clip_stats

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

TINY = dict(block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=4, latent_channels=4)


@pytest.fixture(scope="module")
def vae():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoencoderKLHunyuanVideo(**TINY).eval()
    with torch.no_grad():  # non-zero biases and norm affines everywhere, so no path hides behind a zero
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def whole_clip(vae, z):
    with torch.no_grad():
        return vae.decoder(vae.post_quant_conv(z))


def latents(frames, seed=0):
    return torch.randn(1, 4, frames, 4, 6, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "chunk, channels_last, upsample",
    [(1, False, "phase"), (2, False, "phase"), (3, False, "phase"), (2, True, "phase"), (1, False, "direct"),
     (2, True, "direct"), (3, False, "direct")],
)  # fmt: skip
def test_chunked_causal_convs_equal_the_whole_clip_with_its_statistics(vae, chunk, channels_last, upsample):
    z = latents(7)
    ref = whole_clip(vae, z)
    stats = whole_clip_stats(vae, z)
    decoder = StreamingDecoder(
        vae, "fixed", attention_window=7, fixed_stats=stats, channels_last=channels_last, upsample=upsample
    )
    with torch.no_grad():
        out = decoder.decode_clip(z, chunk)
    assert out.shape == ref.shape == (1, 3, 25, 32, 48)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention_kernel", ["sdpa", "fp32-scores"])
def test_a_whole_clip_as_one_chunk_is_the_diffusers_decoder(vae, attention_kernel):
    z = latents(5, seed=1)
    with torch.no_grad():
        out = StreamingDecoder(vae, "running", attention_kernel=attention_kernel).decode(z, first=True)
    torch.testing.assert_close(out, whole_clip(vae, z), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rule", ["running", "chunk"])
def test_the_first_chunk_is_the_diffusers_decode_of_that_chunk(vae, rule):
    """Causality: nothing after the first chunk reaches it, so it is the whole-clip decode of its own frames."""
    z = latents(6, seed=2)
    decoder = StreamingDecoder(vae, rule)
    with torch.no_grad():
        first = decoder.decode_clip(z, 2)[:, :, :5]
    torch.testing.assert_close(first, whole_clip(vae, z[:, :, :2]), rtol=1e-5, atol=1e-5)


def test_running_statistics_are_those_of_every_frame_seen():
    norm = torch.nn.GroupNorm(2, 6)
    stats = NormStatistics(norm, "running")
    chunks = [torch.randn(1, 6, t, 3, 5, generator=torch.Generator().manual_seed(t)) * t + t for t in (1, 4, 4, 2)]
    for i, x in enumerate(chunks):
        mean, var = stats(x, first=i == 0)
        seen = torch.cat(chunks[: i + 1], dim=2).reshape(1, 2, -1).double()
        ref_var, ref_mean = torch.var_mean(seen, dim=-1, correction=0)
        torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(var.double(), ref_var, rtol=1e-5, atol=1e-6)
    mean, _ = stats(chunks[1], first=True)  # a new clip starts afresh
    torch.testing.assert_close(mean.double(), chunks[1].reshape(1, 2, -1).double().mean(-1), rtol=1e-6, atol=1e-6)


def test_attention_window_bounds_the_cache_and_is_exact_within_it(vae):
    """A window of 2 latent frames: equal to the whole clip (its statistics held) while every query frame sees all
    its predecessors (the window covers them), different once it does not; the cache stays 2 frames."""
    z = latents(6, seed=3)
    stats = whole_clip_stats(vae, z)
    ref = whole_clip(vae, z)
    decoder = StreamingDecoder(vae, "fixed", attention_window=2, fixed_stats=stats)
    with torch.no_grad():
        out = decoder.decode_clip(z, 2)
    torch.testing.assert_close(out[:, :, :13], ref[:, :, :13], rtol=1e-5, atol=1e-5)  # chunks 0-1: within the window
    assert (out[:, :, 13:] - ref[:, :, 13:]).abs().max() > 1e-4  # chunk 2 no longer sees frames 0-1
    assert decoder.attentions[0].keys.shape[2] == 2 * 4 * 6


def test_conv_cache_replaces_replication_with_real_frames():
    conv_module = AutoencoderKLHunyuanVideo(**TINY).decoder.conv_in
    cache = CausalConvCache.of(conv_module)
    x = torch.randn(1, 4, 5, 4, 6)
    padded = F.pad(x, conv_module.time_causal_padding, mode="replicate")
    ref = F.conv3d(padded, conv_module.conv.weight, conv_module.conv.bias)
    parts = [cache(x[:, :, :2], first=True), cache(x[:, :, 2:3], first=False), cache(x[:, :, 3:], first=False)]
    torch.testing.assert_close(torch.cat(parts, dim=2), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("factors", [(2, 2, 2), (1, 2, 2)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_phase_upsampler_equals_the_diffusers_upsampler(factors, channels_last):
    """By phase at the low resolution == nearest upsampling + the causal 3x3x3 conv of diffusers, for a whole clip
    and for the same clip in chunks of 2, 1 and 2 frames (the later chunks' fronts from the cache)."""
    from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import HunyuanVideoUpsampleCausal3D

    torch.manual_seed(0)
    up = HunyuanVideoUpsampleCausal3D(6, 5, upsample_factor=factors)
    x = torch.randn(1, 6, 5, 4, 7) * 2 + 0.5
    fmt = torch.channels_last_3d if channels_last else None
    with torch.no_grad():
        ref = up(x)
        phase = PhaseUpsampleConv(up)
        whole = phase(x, first=True, fmt=fmt)
        parts = [phase(x[:, :, :2], True, fmt), phase(x[:, :, 2:3], False, fmt), phase(x[:, :, 3:], False, fmt)]
    assert whole.shape == ref.shape == (1, 5, 1 + factors[0] * 4, 8, 14)
    torch.testing.assert_close(whole, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(parts, dim=2), ref, rtol=1e-5, atol=1e-5)


def test_phase_taps_cover_each_original_tap_once():
    """Every original tap lands in exactly one merged tap of every phase; the (2x) phases read two low-res voxels."""
    for factor, causal in [(2, True), (2, False), (1, True)]:
        merge, front, starts = axis_phases(factor, causal)
        assert merge.sum(dim=1).eq(1).all() and merge.shape[0] == factor
        assert merge.shape[1] == (2 if factor == 2 else 3)
    assert axis_phases(2, causal=True)[1:] == (1, [0, 0])  # time: one cached low-res frame in front
    assert axis_phases(2, causal=False)[1:] == (1, [0, 1])  # space: phase 1 one voxel later
    with pytest.raises(ValueError, match="factors 1 and 2"):
        axis_phases(3, causal=False)


def test_phase_taps_follow_the_weights_when_they_change():
    """A ``load_state_dict`` after the decoder was built: the merged taps follow, in the same tensor (what a
    captured graph reads)."""
    from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import HunyuanVideoUpsampleCausal3D

    torch.manual_seed(1)
    up = HunyuanVideoUpsampleCausal3D(4, 4, upsample_factor=(2, 2, 2))
    phase = PhaseUpsampleConv(up)
    taps = phase.conv.weight
    with torch.no_grad():
        up.load_state_dict({k: torch.randn_like(v) for k, v in up.state_dict().items()})
        x = torch.randn(1, 4, 3, 3, 5)
        torch.testing.assert_close(phase(x, first=True), up(x), rtol=1e-5, atol=1e-5)
    assert phase.conv.weight is taps


def test_fused_group_norm_cpu_path_matches_group_norm():
    x = torch.randn(2, 8, 3, 5, 7) * 4 + 3
    w, b = torch.randn(8), torch.randn(8)
    out = torch.zeros(2, 8, 5, 7, 9)
    fused_group_norm(x, 4, w, b, 1e-6, silu=True, out=out[:, :, 2:, 1:-1, 1:-1])
    torch.testing.assert_close(out[:, :, 2:, 1:-1, 1:-1], F.silu(F.group_norm(x, 4, w, b, 1e-6)), rtol=1e-5, atol=1e-5)
    assert out[:, :, :2].abs().max() == 0 and out[..., 0].abs().max() == 0


def test_bad_uses_are_refused(vae):
    with pytest.raises(ValueError, match="stats rule"):
        StreamingDecoder(vae, "median")
    with pytest.raises(ValueError, match="fixed_stats"):
        StreamingDecoder(vae, "fixed")
    with pytest.raises(RuntimeError, match="first chunk"):
        StreamingDecoder(vae).decode(latents(2), first=False)
    with pytest.raises(ValueError, match="decode rule"):
        exact_chunk_decode(None, "median")
    with pytest.raises(ValueError, match="upsample"):
        StreamingDecoder(vae, upsample="bilinear")


def test_streaming_sampler_decodes_each_latent_frame_once_by_default():
    """The generator's frames are the exact-once decode of its own latents (running rule); ``decode_rule="overlap"``
    keeps the overlap re-decode; frame counts are the causal VAE's either way."""
    from test_streaming import tiny_sampler

    from opensora.inference.io import uint8_frames_on_device
    from opensora.inference.streaming.generator import StreamingGenerator

    sampler = tiny_sampler()
    sampler.vae = HunyuanVideoVAE(config=dict(TINY, latent_channels=48), seed=0).eval()
    gen = StreamingGenerator(sampler, step_list=[1.0])
    assert isinstance(gen.exact_decode, ExactChunkDecode)
    chunks = list(gen.stream(["a red circle moving left"], [0], 17, 32, 32))
    assert [c.frames.shape[1] for c in chunks] == [5, 8, 4]
    check = ExactChunkDecode(sampler.vae, graphs=False, postprocess=uint8_frames_on_device)
    for c in chunks:
        assert torch.equal(c.frames, check(c.latents, first=c.start_frame == 0))
    overlap = StreamingGenerator(sampler, step_list=[1.0], decode_rule="overlap")
    assert overlap.exact_decode is None
    frames = [c.frames.shape[1] for c in overlap.stream(["a red circle moving left"], [0], 17, 32, 32)]
    assert frames == [5, 8, 4]


def test_a_vae_built_under_inference_mode_decodes():
    """Inference-mode weights keep no version counter: the phase upsamplers must not need one."""
    with torch.inference_mode():
        model = AutoencoderKLHunyuanVideo(**TINY).eval()
        z = latents(3, seed=4)
        out = StreamingDecoder(model).decode(z, first=True)  # the clip as one chunk: the diffusers decode
        torch.testing.assert_close(out, whole_clip(model, z), rtol=1e-5, atol=1e-5)
