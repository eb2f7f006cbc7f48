"""Causal MMDiT on a CUDA GPU in bf16: streaming with the KV cache against the full block-causal forward, repeated
runs, per-chunk timesteps, and flat memory of the streaming sampler on a 4x-long video.

Tolerance in bf16: the streamed chunk and the full forward round differently (other key counts per attention
call, other GEMM shapes), so they are compared through an fp32 reference: the streamed output's error against the
fp32 full forward must be no larger than 1.5x the bf16 full forward's own error (+0.1% of the output scale), and
the two bf16 outputs must agree to 3% of the output scale. Each test prints the numbers it checks.
"""

import pytest
import torch

from opensora.models.mmdit import MMDiT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ARCH = dict(
    in_channels=12,
    cond_channels=None,
    patch_size=(1, 2, 2),
    hidden_size=256,
    num_heads=4,
    depth_double=2,
    depth_single=2,
    mlp_ratio=4.0,
    text_dim=64,
    pooled_dim=64,
    axes_dims=(16, 24, 24),
)
CHUNK, FRAMES = 3, 9


def make_model(backend, dtype, seed=0):
    torch.manual_seed(seed)
    model = MMDiT(**ARCH, attn_backend=backend, causal_chunk_frames=CHUNK)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.cuda().to(dtype).eval()


def make_inputs(dtype, seed=0, batch=2):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mask = torch.ones(batch, 20, dtype=torch.bool, device="cuda")
    mask[0, -5:] = False
    return dict(
        x=torch.randn(batch, 12, FRAMES, 16, 16, generator=gen, device="cuda").to(dtype),
        timestep=torch.rand(batch, generator=gen, device="cuda").to(dtype),
        text_emb=torch.randn(batch, 20, 64, generator=gen, device="cuda").to(dtype),
        text_mask=mask,
        pooled=torch.randn(batch, 64, generator=gen, device="cuda").to(dtype),
    )


def streamed(model, data, timesteps=None):
    cache, outs = model.new_kv_cache(), []
    for c, start in enumerate(range(0, FRAMES, CHUNK)):
        t = data["timestep"] if timesteps is None else timesteps[:, c]
        outs.append(
            model.forward_chunk(
                data["x"][:, :, start : start + CHUNK],
                timestep=t,
                text_emb=data["text_emb"],
                text_mask=data["text_mask"],
                pooled=data["pooled"],
                cache=cache,
                start_frame=start,
                store_kv=True,
            )
        )
    return torch.cat(outs, dim=2)


def check_against_fp32(name, stream_bf16, full_bf16, full_fp32):
    scale = full_fp32.abs().max().item()
    err_stream = (stream_bf16.float() - full_fp32).abs().max().item()
    err_full = (full_bf16.float() - full_fp32).abs().max().item()
    direct = (stream_bf16.float() - full_bf16.float()).abs().max().item()
    print(
        f"{name}: scale {scale:.3g}  |stream-fp32| {err_stream:.3g}  |full-fp32| {err_full:.3g}  "
        f"|stream-full| {direct:.3g} ({direct / scale:.2%})"
    )
    assert err_stream <= 1.5 * err_full + 1e-3 * scale
    assert direct <= 0.03 * scale


@pytest.mark.parametrize("backend", ["auto", "efficient", "math"])
def test_streaming_matches_full_causal_forward_in_bf16(backend):
    reference = make_model("math", torch.float32)
    model = make_model(backend, torch.bfloat16)
    data = make_inputs(torch.bfloat16)
    with torch.no_grad():
        full_fp32 = reference(**{k: v.float() if v.is_floating_point() else v for k, v in data.items()})
        full = model(**data)
        first, second = streamed(model, data), streamed(model, data)
    assert first.dtype == full.dtype == torch.bfloat16
    check_against_fp32(f"bf16 {backend}", first, full, full_fp32)
    assert torch.equal(first, second)  # repeated runs are bit-identical on the GPU too


def test_per_chunk_timesteps_match_streaming_in_bf16():
    model = make_model("auto", torch.bfloat16)
    reference = make_model("math", torch.float32)
    data = make_inputs(torch.bfloat16)
    times = torch.rand(2, FRAMES // CHUNK, device="cuda").bfloat16().float()  # the same times for the fp32 reference
    with torch.no_grad():
        full = model(**dict(data, timestep=times.bfloat16()))
        fp32_inputs = {k: v.float() if v.is_floating_point() else v for k, v in dict(data, timestep=times).items()}
        full_fp32 = reference(**fp32_inputs)
        stream = streamed(model, data, timesteps=times.bfloat16())
    check_against_fp32("per-chunk t bf16", stream, full, full_fp32)


def test_streaming_sampler_memory_is_flat_at_4x_length():
    from opensora.inference.sampler import VideoSampler
    from opensora.inference.streaming.generator import StreamingGenerator
    from opensora.registry import MODELS, build_module

    model = make_model("auto", torch.bfloat16)
    # PatchVAE(2): 3 x 2 x 2 = 12 latent channels; the demo's TextConditioner: text_dim 64, pooled_dim 64
    vae = build_module(dict(type="PatchVAE", patch_size=2, temporal_patch_size=1), MODELS)
    text = build_module(dict(type="TextConditioner", seed=0), MODELS)
    sampler = VideoSampler(model, vae.cuda().to(torch.bfloat16).eval(), text.cuda().eval(), progress=False)
    gen = StreamingGenerator(sampler, step_list=[1.0, 0.75, 0.5, 0.25], window_frames=FRAMES - CHUNK, sink_frames=0)
    peaks = {}
    for multiple in (1, 4):
        list(gen.stream(["a red circle"], [0], FRAMES * multiple, 32, 32))  # warm-up
        torch.cuda.reset_peak_memory_stats()
        # chunks are dropped as they come (a kept chunk holds its latents on the GPU)
        cached = max(c.cached_frames for c in gen.stream(["a red circle"], [0], FRAMES * multiple, 32, 32))
        peaks[multiple] = torch.cuda.max_memory_allocated()
        assert cached == FRAMES - CHUNK
    print(f"peak memory 1x {peaks[1] / 2**20:.1f} MiB, 4x {peaks[4] / 2**20:.1f} MiB")
    assert peaks[4] <= 1.05 * peaks[1]
