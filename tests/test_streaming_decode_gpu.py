"""The fast exact-once chunk decode on a GPU against the eager diffusers decoder (bf16 tolerance): the Triton group
norm (+ SiLU, into a strided padded buffer), a whole clip as one chunk, chunks with the whole clip's statistics, and
CUDA-graph replays against eager chunk decodes. Real-size layer widths (the diffusers default config) at a small frame
size, so the kernels see the real channel counts."""

import copy

import pytest
import torch
import torch.nn.functional as F

from opensora.models.vae import HunyuanVideoVAE
from opensora.models.vae.exact_chunk_decode import ExactChunkDecode
from opensora.models.vae.fused_group_norm import fused_group_norm
from opensora.models.vae.streaming_decode import StreamingDecoder, whole_clip_stats

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def uint8(video):
    return ((video.float().clamp(-1, 1) + 1) * 127.5).round()


@pytest.fixture(scope="module")
def vae():
    return HunyuanVideoVAE(config={}, seed=0, dtype="bf16", device="cuda", parallel_group_norm=False)


@pytest.fixture(scope="module")
def decoder32(vae):
    """The same weights in fp32: the reference both bf16 decodes are measured against."""
    return copy.deepcopy(vae.vae).float()


def assert_bf16_close(ours, plain, reference):
    """``ours`` (bf16) is as close to the fp32 ``reference`` as the eager diffusers bf16 decode ``plain`` is
    (uint8 frames: mean and max |diff|, with a little slack for a different order of bf16 roundings)."""
    ours, plain, reference = uint8(ours), uint8(plain), uint8(reference)
    err, base = (ours - reference).abs(), (plain - reference).abs()
    assert ours.shape == reference.shape
    assert err.mean() <= 1.25 * base.mean() + 0.05, (err.mean().item(), base.mean().item())
    assert err.max() <= 1.5 * base.max() + 2, (err.max().item(), base.max().item())


@pytest.mark.parametrize(
    "shape, groups", [((1, 128, 12, 96, 160), 32), ((1, 512, 3, 12, 20), 32), ((2, 64, 5, 7, 9), 4)]
)
@pytest.mark.parametrize("silu", [False, True])
def test_fused_group_norm_matches_torch_in_bf16(shape, groups, silu):
    gen = torch.Generator("cuda").manual_seed(0)
    x = (torch.randn(shape, device="cuda", generator=gen) * 3 + 2).bfloat16()
    w = torch.randn(shape[1], device="cuda", generator=gen)
    b = torch.randn(shape[1], device="cuda", generator=gen)
    ref = F.group_norm(x.float(), groups, w, b, 1e-6)
    ref = F.silu(ref) if silu else ref
    padded = torch.zeros(shape[0], shape[1], shape[2] + 2, shape[3] + 2, shape[4] + 2, device="cuda").bfloat16()
    out = fused_group_norm(x, groups, w.bfloat16(), b.bfloat16(), 1e-6, silu=silu, out=padded[:, :, 2:, 1:-1, 1:-1])
    torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=2e-2)
    assert padded[:, :, :2].abs().max() == 0 and padded[..., 0].abs().max() == 0  # nothing written outside


def test_normalize_writes_the_replicated_border_in_channels_last():
    from opensora.models.vae.fused_group_norm import normalize_into

    gen = torch.Generator("cuda").manual_seed(6)
    x = torch.randn(1, 256, 3, 9, 14, device="cuda", generator=gen).bfloat16()
    x = x.contiguous(memory_format=torch.channels_last_3d)
    scale = torch.rand(1, 256, device="cuda", generator=gen) + 0.5
    shift = torch.randn(1, 256, device="cuda", generator=gen)
    buffer = torch.zeros(1, 256, 5, 11, 16, device="cuda", dtype=torch.bfloat16)
    buffer = buffer.contiguous(memory_format=torch.channels_last_3d)
    assert normalize_into(x, scale, shift, buffer[:, :, 2:, 1:-1, 1:-1], True, border=1)
    ref = F.silu(x.float() * scale[:, :, None, None, None] + shift[:, :, None, None, None])
    inner = buffer[:, :, 2:, 1:-1, 1:-1]
    torch.testing.assert_close(inner.float(), ref, rtol=2**-7, atol=1e-2)
    assert torch.equal(buffer[:, :, 2:], F.pad(inner, (1, 1, 1, 1, 0, 0), mode="replicate"))
    assert buffer[:, :, :2].abs().max() == 0  # the causal front is not the kernel's to write


def test_channel_bias_add_equals_torch_bitwise():
    from opensora.models.vae.fused_group_norm import add_channel_bias_

    gen = torch.Generator("cuda").manual_seed(7)
    for channels in (3, 128, 2048):
        x = torch.randn(1, channels, 3, 10, 14, device="cuda", generator=gen).bfloat16()
        x = x.contiguous(memory_format=torch.channels_last_3d)
        bias = torch.randn(channels, device="cuda", generator=gen).bfloat16()
        ref = x + bias.view(1, -1, 1, 1, 1)
        assert torch.equal(add_channel_bias_(x, bias), ref)


def latents(frames, seed):
    return torch.randn(1, 16, frames, 8, 12, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))


@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("attention_kernel", ["sdpa", "fp32-scores"])
@pytest.mark.parametrize("upsample", ["phase", "direct"])
def test_one_chunk_equals_the_diffusers_decoder(vae, decoder32, channels_last, attention_kernel, upsample):
    z = latents(3, 1)
    with torch.no_grad():
        reference = decoder32.decoder(decoder32.post_quant_conv(z))
        zb = z.bfloat16()
        plain = vae.vae.decoder(vae.vae.post_quant_conv(zb))
        decoder = StreamingDecoder(
            vae.vae, attention_kernel=attention_kernel, channels_last=channels_last, upsample=upsample
        )
        ours = decoder.decode(zb, first=True)
    assert ours.is_contiguous(memory_format=torch.channels_last_3d) == channels_last
    assert_bf16_close(ours, plain, reference)


def test_chunks_with_the_whole_clip_statistics_equal_the_whole_clip(vae, decoder32):
    z = latents(7, 2)
    with torch.no_grad():
        reference = decoder32.decoder(decoder32.post_quant_conv(z))
        zb = z.bfloat16()
        plain = vae.vae.decoder(vae.vae.post_quant_conv(zb))
        stats = whole_clip_stats(vae.vae, zb)
        ours = StreamingDecoder(vae.vae, "fixed", attention_window=7, fixed_stats=stats).decode_clip(zb, 3)
    assert_bf16_close(ours, plain, reference)


def test_channels_last_moments_at_a_480x832_chunk():
    """A 12-frame chunk at 480x832 in channels-last: ~75k statistics blocks (more than a grid's second axis takes)."""
    from opensora.models.vae.fused_group_norm import group_moments

    gen = torch.Generator("cuda").manual_seed(4)
    x = torch.randn(1, 128, 12, 480, 832, device="cuda", generator=gen, dtype=torch.bfloat16) + 1
    x = x.contiguous(memory_format=torch.channels_last_3d)
    _, mean, var = group_moments(x, 32)
    ref_var, ref_mean = torch.var_mean(x.float().reshape(1, 32, -1), dim=-1, correction=0)
    torch.testing.assert_close(mean, ref_mean, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(var, ref_var, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("rule", ["running", "chunk"])
def test_graph_replays_equal_eager_chunk_decodes(vae, rule, channels_last):
    """Six chunks with a window of 4 latent frames: the attention cache fills and rolls, the first chunk is replayed
    again for a second clip; every replay equals the eager decode of the same chunk bitwise."""
    gen = torch.Generator("cuda").manual_seed(3)
    z = torch.randn(1, 16, 18, 8, 12, device="cuda", generator=gen)
    options = dict(stats=rule, attention_window=4, channels_last=channels_last)
    eager = ExactChunkDecode(vae, graphs=False, **options)
    graphed = ExactChunkDecode(vae, graphs=True, **options)
    for clip in range(2):
        for start in range(0, 18 if clip == 0 else 6, 3):
            part = z[:, :, start : start + 3] * (1 + clip)
            a, b = eager(part, first=start == 0), graphed(part, first=start == 0)
            assert torch.equal(a, b), (clip, start, (a.float() - b.float()).abs().max())
    assert not graphed.failures and len(graphed.graphs) == 3  # first chunk; later with 3, 4 (full) cached frames


def test_fp32_score_attention_is_as_close_to_fp32_as_sdpa():
    """The decoder's attention shape (one 512-wide head, a latent frame of 60x104 queries over 2 frames of keys) in
    bf16: the two-GEMM fp32-score path is no further from the fp32 attention than PyTorch's SDPA."""
    from opensora.models.vae.score_attention import fp32_output_gemm, fp32_score_attention, scaled_softmax

    gen = torch.Generator("cuda").manual_seed(5)
    q, k, v = (torch.randn(1, 1, n, 512, device="cuda", generator=gen) for n in (6240, 12480, 12480))
    reference = F.scaled_dot_product_attention(q, k, v)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    ours = (fp32_score_attention(qb, kb, vb).float() - reference).abs()
    sdpa = (F.scaled_dot_product_attention(qb, kb, vb).float() - reference).abs()
    assert ours.mean() <= 1.1 * sdpa.mean() and ours.max() <= 1.5 * sdpa.max(), (ours.max(), sdpa.max())
    scores = torch.randn(7, 5000, device="cuda", generator=gen) * 20
    torch.testing.assert_close(
        scaled_softmax(scores, 0.3, torch.bfloat16).float(), torch.softmax(scores * 0.3, -1), rtol=2**-7, atol=1e-6
    )
    print("bf16 x bf16 -> fp32 GEMM:", fp32_output_gemm(q.device))


def test_graph_replays_follow_a_weight_change(vae):
    """Weights changed in place after the capture (a checkpoint loaded into the same VAE): the replays use them,
    the phase upsamplers' merged taps included."""
    gen = torch.Generator("cuda").manual_seed(8)
    z = torch.randn(1, 16, 6, 8, 12, device="cuda", generator=gen)
    eager = ExactChunkDecode(vae, graphs=False)
    graphed = ExactChunkDecode(vae, graphs=True)
    graphed(z[:, :, :3], first=True)  # captures the first-chunk graph
    conv = vae.vae.decoder.up_blocks[1].upsamplers[0].conv.conv
    saved = conv.weight.detach().clone()
    try:
        with torch.no_grad():
            conv.weight.mul_(1.5)
        a, b = eager(z[:, :, :3], first=True), graphed(z[:, :, :3], first=True)
        assert torch.equal(a, b) and not graphed.failures
    finally:
        with torch.no_grad():
            conv.weight.copy_(saved)
