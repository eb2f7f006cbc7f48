"""The merged refill + first-step pass (causal_refill.refill_and_step) is the two separate passes it replaces:
``forward_chunk(prev, store_kv=True)`` then ``forward_chunk(next)``, on CPU fp32, with and without the text cache,
across a rolling window with sink frames, with CFG-style rows; and the streaming sampler gives the same video."""

import copy

import pytest
import torch
from test_streaming import PROMPTS, EagerReplayGraphs, tiny_sampler

from opensora.inference.streaming import StreamingGenerator
from opensora.models.mmdit.causal_refill import refill_and_step

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


def _inputs(sampler, rows):
    text, null = sampler.encode_text(PROMPTS[:1] * (rows // 2) + PROMPTS[1:] * (rows - rows // 2))
    return dict(text_emb=text["text_emb"], text_mask=text["text_mask"], pooled=text["pooled"])


@pytest.mark.parametrize("text_cache", [False, True])
@pytest.mark.parametrize("window,sinks", [(None, 0), (4, 0), (4, 2)])
def test_merged_pass_equals_refill_then_first_step(text_cache, window, sinks):
    sampler = tiny_sampler()
    model = sampler.model
    rows, frames = 2, model.causal_chunk_frames
    text = _inputs(sampler, rows)
    gen = torch.Generator().manual_seed(0)
    chunks = [torch.randn(rows, 48, frames, 4, 4, generator=gen) for _ in range(5)]
    cond = torch.zeros(rows, 49, frames, 4, 4)
    ctx, first = torch.full((rows,), 0.0), torch.full((rows,), 1.0)
    caches = [model.new_kv_cache(window, sinks) for _ in range(2)]
    text_caches = [model.new_text_cache() if text_cache else None for _ in range(2)]
    with torch.no_grad():
        for c in range(4):  # the cache fills, then rolls (window 4 = 2 chunks)
            prev, nxt, start = chunks[c], chunks[c + 1], c * frames
            common = dict(**text, cond=cond)
            model.forward_chunk(
                prev, timestep=ctx, **common, cache=caches[0], start_frame=start, store_kv=True,
                text_cache=text_caches[0], text_key=0.0,
            )  # fmt: skip
            expected = model.forward_chunk(
                nxt, timestep=first, **common, cache=caches[0], start_frame=start + frames, store_kv=False,
                text_cache=text_caches[0], text_key=1.0,
            )  # fmt: skip
            merged = refill_and_step(
                model, prev, nxt, prev_timestep=ctx, next_timestep=first, **common, cache=caches[1],
                prev_start=start, text_cache=text_caches[1], prev_key=0.0, next_key=1.0,
            )  # fmt: skip
            torch.testing.assert_close(merged, expected, rtol=1e-5, atol=1e-5)
            assert caches[1].frame_ids == caches[0].frame_ids
            for a, b in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            if text_cache:
                assert sorted(text_caches[1].entries) == sorted(text_caches[0].entries) == [0.0, 1.0]


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
def test_streaming_with_merged_refill_makes_the_same_video(guidance_scale):
    """Stream with separate refill passes vs merged ones: same chunks (fp32 tolerance), fewer model calls."""
    sampler = tiny_sampler()
    kwargs = dict(step_list=[1.0, 0.5], guidance_scale=guidance_scale, window_frames=4, context_time=0.1)
    separate = StreamingGenerator(sampler, merge_refill=False, **kwargs)
    merged = StreamingGenerator(copy.copy(sampler), merge_refill=True, **kwargs)
    a = list(separate.stream(PROMPTS, [0, 1], num_frames=10, height=16, width=16, decode=False))
    b = list(merged.stream(PROMPTS, [0, 1], num_frames=10, height=16, width=16, decode=False))
    assert len(a) == len(b) == 5
    for x, y in zip(a, b):
        torch.testing.assert_close(x.latents, y.latents, rtol=1e-4, atol=1e-4)
    assert merged.passes < separate.passes


@pytest.mark.parametrize("text_cached", [False, True])
def test_chunk_flops_formula_matches_the_flop_counter(text_cached):
    """``mmdit_chunk_flops`` counts what PyTorch's FlopCounterMode sees in a streamed pass with cached frames."""
    from torch.utils.flop_counter import FlopCounterMode

    from opensora.models.mmdit.flops import mmdit_chunk_flops

    sampler = tiny_sampler()
    model = sampler.model
    text = _inputs(sampler, 1)
    frames = model.causal_chunk_frames
    cache, text_cache = model.new_kv_cache(), model.new_text_cache()
    x, cond, t = torch.randn(1, 48, frames, 4, 4), torch.zeros(1, 49, frames, 4, 4), torch.ones(1)
    common = dict(timestep=t, **text, cond=cond, cache=cache, text_cache=text_cache, text_key=1.0)
    with torch.no_grad():
        model.forward_chunk(x, **common, start_frame=0, store_kv=True)
        if not text_cached:
            text_cache.clear()
        with FlopCounterMode(display=False) as counter:
            model.forward_chunk(x, **common, start_frame=frames, store_kv=False)
    tokens = frames * 2 * 2
    expected = mmdit_chunk_flops(model, tokens, text["text_emb"].shape[1], tokens, run_text=not text_cached)
    assert counter.get_total_flops() == expected


def test_merged_graph_plumbing_replays_the_eager_pass_on_a_cpu():
    """``MergedGraphs`` with the capture replaced by re-running the body: static inputs, cached video and text copied
    in, outputs cloned out; the streamed video equals the eager merged one over two videos (graphs kept)."""
    sampler = tiny_sampler()
    kwargs = dict(step_list=[1.0, 0.5], guidance_scale=3.0, window_frames=4, merge_refill=True)
    eager = StreamingGenerator(sampler, **kwargs)
    graphed = StreamingGenerator(sampler, **kwargs)
    graphed.merged_graphs = EagerReplayGraphs.make_merged(sampler.model)
    for prompts in (PROMPTS, PROMPTS[::-1]):
        a = list(eager.stream(prompts, [0, 1], 12, 16, 16, decode=False))
        b = list(graphed.stream(prompts, [0, 1], 12, 16, 16, decode=False))
        for x, y in zip(a, b):
            assert torch.equal(x.latents, y.latents)
    summary = graphed.merged_graphs.summary
    # 6 chunks: 5 merged passes per video; shapes: no cached frames and text rows run (the context time is not in the
    # text cache yet), then text-cached with 2 and with 4 (window) cached frames
    assert summary["replays"] == 2 * 5 and summary["graphs"] == 3 and summary["failures"] == []
