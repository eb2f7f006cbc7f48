"""The fast exact-once chunk decode on a GPU against the eager diffusers decoder (bf16 tolerance): the Triton group
norm (+ SiLU, into a strided padded buffer), a whole clip as one chunk, chunks with the whole clip's statistics, and
CUDA-graph replays against eager chunk decodes. Real-size layer widths (the diffusers default config) at a small frame
size, so the kernels see the real channel counts."""

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


def test_one_chunk_equals_the_diffusers_decoder(vae):
    z = torch.randn(
        1, 16, 3, 8, 12, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(1)
    )
    with torch.no_grad():
        ref = vae.vae.decoder(vae.vae.post_quant_conv(z))
        ours = StreamingDecoder(vae.vae).decode(z, first=True)
    assert ours.shape == ref.shape
    diff = (uint8(ours) - uint8(ref)).abs()
    assert diff.mean() < 0.5 and diff.max() <= 8  # bf16 rounding of different (fused) kernels


def test_chunks_with_the_whole_clip_statistics_equal_the_whole_clip(vae):
    z = torch.randn(
        1, 16, 7, 8, 12, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(2)
    )
    with torch.no_grad():
        ref = vae.vae.decoder(vae.vae.post_quant_conv(z))
        stats = whole_clip_stats(vae.vae, z)
        ours = StreamingDecoder(vae.vae, "fixed", attention_window=7, fixed_stats=stats).decode_clip(z, 3)
    diff = (uint8(ours) - uint8(ref)).abs()
    assert ours.shape == ref.shape and diff.mean() < 0.5 and diff.max() <= 8


@pytest.mark.parametrize("rule", ["running", "chunk"])
def test_graph_replays_equal_eager_chunk_decodes(vae, rule):
    """Six chunks with a window of 4 latent frames: the attention cache fills and rolls, the first chunk is replayed
    again for a second clip; every replay equals the eager decode of the same chunk bitwise."""
    gen = torch.Generator("cuda").manual_seed(3)
    z = torch.randn(1, 16, 18, 8, 12, device="cuda", generator=gen)
    eager = ExactChunkDecode(vae, stats=rule, attention_window=4, graphs=False)
    graphed = ExactChunkDecode(vae, stats=rule, attention_window=4, graphs=True)
    for clip in range(2):
        for start in range(0, 18 if clip == 0 else 6, 3):
            part = z[:, :, start : start + 3] * (1 + clip)
            a, b = eager(part, first=start == 0), graphed(part, first=start == 0)
            assert torch.equal(a, b), (clip, start, (a.float() - b.float()).abs().max())
    assert not graphed.failures and len(graphed.graphs) == 3  # first chunk; later with 3, 4 (full) cached frames
