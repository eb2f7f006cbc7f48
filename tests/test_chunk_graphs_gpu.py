"""CUDA graphs of streamed chunk passes (opensora/inference/streaming/chunk_graphs.py) on a GPU in bf16, and the text cache there.

Graph replay runs the same body as the eager pass; the kernels chosen inside a capture may differ (cuBLAS picks per
stream/workspace), so graphed and eager streaming are compared to bf16 tolerance: per chunk pass, the velocity
difference must stay under 2% of the velocity scale (measured on CPU: 0, the plumbing is exact there, see
tests/test_streaming.py). The text cache on the GPU is compared the same way (different GEMM row counts).
"""

import pytest
import torch
from test_causal_gpu import ARCH  # the same small causal-capable architecture

from opensora.models.mmdit import MMDiT
from opensora.models.mmdit.rope import shift_time, shift_time_all

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CHUNK = 3


def make_model(seed=0):
    torch.manual_seed(seed)
    model = MMDiT(**ARCH, attn_backend="auto", causal_chunk_frames=CHUNK)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.cuda().to(torch.bfloat16).eval()


def run(model, forward, text_cache, chunks=5, window=6, seed=0, sinks=0, rope_anchor="absolute"):
    """Every pass's velocity over ``chunks`` chunks x (2 steps + the refill), batch 2 with padded text."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mask = torch.ones(2, 20, dtype=torch.bool, device="cuda")
    mask[0, -5:] = False
    text = dict(
        text_emb=torch.randn(2, 20, 64, generator=gen, device="cuda").to(torch.bfloat16),
        text_mask=mask,
        pooled=torch.randn(2, 64, generator=gen, device="cuda").to(torch.bfloat16),
    )
    cache, outs = model.new_kv_cache(window, sinks, rope_anchor), []
    for c in range(chunks):
        x = torch.randn(2, 12, CHUNK, 16, 16, generator=gen, device="cuda").to(torch.bfloat16)
        for i, t in enumerate((1.0, 0.5, 0.0)):
            timestep = torch.full((2,), t, device="cuda", dtype=torch.bfloat16)
            outs.append(
                forward(
                    x,
                    timestep=timestep,
                    **text,
                    cache=cache,
                    start_frame=c * CHUNK,
                    store_kv=i == 2,
                    text_cache=text_cache,
                    text_key=t,
                ).float()
            )
    return outs


def close(a, b, rel=0.02):
    return all((x - y).abs().max() <= rel * y.abs().max() for x, y in zip(a, b))


@torch.no_grad()
def test_graphed_streaming_matches_eager_in_bf16():
    from opensora.inference.streaming.chunk_graphs import ChunkGraphs

    model = make_model()
    eager = run(model, model.forward_chunk, None)
    cached = run(model, model.forward_chunk, model.new_text_cache())
    graphs = ChunkGraphs(model)
    graphed = run(model, graphs, model.new_text_cache())
    again = run(model, graphs, model.new_text_cache())  # graphs kept: replays only
    print(graphs.summary, max((x - y).abs().max().item() for x, y in zip(graphed, eager)))
    assert graphs.summary["failures"] == [] and graphs.summary["eager"] == 0
    assert close(cached, eager) and close(graphed, eager) and close(again, graphed, rel=1e-6)
    # text-filling (steps, and the storing refill) + 3 times x (3, 6 cached frames)
    assert graphs.captures == len(graphs.graphs) == 2 + 3 * 2


@torch.no_grad()
def test_graphed_streaming_with_the_window_anchor_matches_eager_in_bf16():
    """``rope_anchor="window"``: the text's time id comes in through the RoPE tables and the re-rotated sinks / text
    keys through the static buffers, so the anchor moving every chunk needs no capture of its own."""
    from opensora.inference.streaming.chunk_graphs import ChunkGraphs

    model = make_model()
    kw = dict(chunks=7, sinks=CHUNK)
    absolute = run(model, model.forward_chunk, None, **kw)
    eager = run(model, model.forward_chunk, None, rope_anchor="window", **kw)
    cached = run(model, model.forward_chunk, model.new_text_cache(), rope_anchor="window", **kw)
    graphs = ChunkGraphs(model)
    graphed = run(model, graphs, model.new_text_cache(), rope_anchor="window", **kw)
    assert graphs.summary["failures"] == [] and graphs.summary["eager"] == 0
    assert close(cached, eager) and close(graphed, eager)
    assert graphs.captures == len(graphs.graphs) == 2 + 3 * 2  # as many as absolute positions capture
    rolled = 3 * 3  # the chunks at frames 0, 3, 6 see anchor 0; from frame 9 on the anchor moves
    assert close(eager[:rolled], absolute[:rolled], rel=1e-6) and not close(eager[rolled:], absolute[rolled:], 1e-3)


@torch.no_grad()
def test_moving_the_anchor_makes_no_host_sync():
    """Every chunk after the roll moves the sink keys and the cached text keys to the new anchor: on the device from the
    Python time shift, never through a host-to-device copy (which waits for the stream and would stall the host that
    runs ahead of the GPU while a chunk decodes)."""
    model = make_model()
    text_cache = model.new_text_cache()
    run(model, model.forward_chunk, text_cache, chunks=4, sinks=CHUNK, rope_anchor="window")  # fills a text cache
    keys = [torch.randn(2, 4, 20, sum(model.axes_dims), device="cuda", dtype=torch.bfloat16) for _ in range(5)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moved = shift_time_all(keys, 7, model.axes_dims, model.theta)
        for key in list(text_cache.entries):
            text_cache.get(key, 9)  # the text keys re-rotated to a moved anchor
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for k, m in zip(keys, moved):
        assert torch.equal(m, shift_time(k, 7, model.axes_dims, model.theta))
