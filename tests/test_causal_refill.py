"""The merged refill + first-step pass (causal_refill.refill_and_step) is the two separate passes it replaces:
``forward_chunk(prev, store_kv=True)`` then ``forward_chunk(next)``, on CPU fp32, with and without the text cache,
across a rolling window with sink frames, with CFG-style rows; and the streaming sampler gives the same video."""

import copy

import pytest
import torch
from test_streaming import PROMPTS, EagerReplayGraphs, tiny_sampler, unpadded

from opensora.inference.streaming.generator import StreamingGenerator
from opensora.models.mmdit.attention import RowGroups, attention
from opensora.models.mmdit.causal_refill import refill_and_step, split_keys

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


def _inputs(sampler, rows):
    text, null = sampler.encode_text(PROMPTS[:1] * (rows // 2) + PROMPTS[1:] * (rows - rows // 2))
    return dict(text_emb=text["text_emb"], text_mask=text["text_mask"], pooled=text["pooled"])


def compare_with_separate_passes(model, text, window, sinks, text_cache: bool, tol: float, seed: int = 0, **flags):
    """Four refills + first steps (the cache fills, then rolls: window 4 = 2 chunks), once as the two separate
    ``forward_chunk`` passes, once merged: same velocity, cached keys/values and frames to ``tol``. ``flags``:
    passed to all passes (``text_mask_has_padding``)."""
    rows, frames = text["text_emb"].shape[0], model.causal_chunk_frames
    gen = torch.Generator().manual_seed(seed)
    chunks = [torch.randn(rows, 48, frames, 4, 4, generator=gen) for _ in range(5)]
    common = dict(**text, cond=torch.zeros(rows, 49, frames, 4, 4), **flags)
    ctx, first = torch.full((rows,), 0.0), torch.full((rows,), 1.0)
    caches = [model.new_kv_cache(window, sinks) for _ in range(2)]
    text_caches = [model.new_text_cache() if text_cache else None for _ in range(2)]
    with torch.no_grad():
        for c in range(4):
            prev, nxt, start = chunks[c], chunks[c + 1], c * frames
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
            torch.testing.assert_close(merged, expected, rtol=tol, atol=tol)
            assert caches[1].frame_ids == caches[0].frame_ids
            for a, b in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values):
                torch.testing.assert_close(a, b, rtol=tol, atol=tol)
            if text_cache:
                assert sorted(text_caches[1].entries) == sorted(text_caches[0].entries) == [0.0, 1.0]


@pytest.mark.parametrize("text_cache", [False, True])
@pytest.mark.parametrize("window,sinks", [(None, 0), (4, 0), (4, 2)])
def test_merged_pass_equals_refill_then_first_step(text_cache, window, sinks):
    """The tiny text encoder pads its tokens: the masked merged pass."""
    sampler = tiny_sampler()
    compare_with_separate_passes(sampler.model, _inputs(sampler, 2), window, sinks, text_cache, tol=1e-5)


@pytest.fixture
def grouped_calls(monkeypatch):
    """Counts the mask-free grouped attention calls (``RowGroups.attend``) made while a test runs."""
    calls = []
    attend = RowGroups.attend

    def counted(self, q, backend="auto"):
        calls.append(len(self))
        return attend(self, q, backend)

    monkeypatch.setattr(RowGroups, "attend", counted)
    return calls


def test_text_cached_chunk_passes_without_padding_attend_without_a_mask(monkeypatch):
    """``forward_chunk(text_mask_has_padding=False)``: a text-cache hit gives SDPA no mask (every key is visible to
    every video query), with the bits of the masked pass (math backend, CPU fp32: an all-true mask adds zeros); the
    passes that run the text rows keep the mask (text queries must not see the video)."""
    from opensora.models.mmdit import layers

    sampler = tiny_sampler()
    model = sampler.model
    text = _inputs(sampler, 2)
    text["text_mask"] = torch.ones_like(text["text_mask"])
    seen = []
    attend = layers.attention

    def spy(q, k, v, mask=None, backend="auto"):
        seen.append(mask is None)
        return attend(q, k, v, mask=mask, backend=backend)

    monkeypatch.setattr(layers, "attention", spy)
    gen = torch.Generator().manual_seed(2)
    chunks = [torch.randn(2, 48, 2, 4, 4, generator=gen) for _ in range(3)]
    runs, masks = {}, {}
    for flag in (None, False):
        cache, text_cache, outs = model.new_kv_cache(4), model.new_text_cache(), []
        seen.clear()
        with torch.no_grad():
            for c, x in enumerate(chunks):
                common = dict(**text, cond=torch.zeros(2, 49, 2, 4, 4), cache=cache, text_cache=text_cache)
                common.update(start_frame=2 * c, text_mask_has_padding=flag)
                outs.append(model.forward_chunk(x, timestep=torch.ones(2), **common, store_kv=False, text_key=1.0))
                outs.append(model.forward_chunk(x, timestep=torch.zeros(2), **common, store_kv=True, text_key=0.0))
        runs[flag], masks[flag] = outs + cache.keys + cache.values, list(seen)
    assert all(torch.equal(a, b) for a, b in zip(runs[None], runs[False]))
    # 2 blocks per pass; the first chunk's 2 passes run the text rows (masked), the 4 later ones are text-cached
    assert masks[None] == [False] * 12 and masks[False] == [False] * 4 + [True] * 8


def test_split_keys_slices_the_frames_the_window_keeps():
    """The step rows' video keys: token ranges of the held frames and of the finished chunk that survive its append
    (4 tokens per latent frame at this size)."""
    model = tiny_sampler().model
    x = torch.zeros(1, 48, 2, 4, 4)

    def kv(frames):
        return {i: (torch.zeros(1, 2, 4 * frames, 8),) * 2 for i in range(2)}

    cache = model.new_kv_cache(4, 1)
    assert split_keys(model, x, cache, 0) == ((), ((0, 8),))
    cache.append(kv(2), 0, 2)
    assert split_keys(model, x, cache, 2) == (((0, 8),), ((0, 8),))  # no drop: whole tensors
    cache.append(kv(2), 2, 2)  # frames 0-3: appending 4, 5 keeps the sink 0 and 3
    assert split_keys(model, x, cache, 4) == (((0, 4), (12, 16)), ((0, 8),))
    small = model.new_kv_cache(1)  # a window under the chunk: only the finished chunk's last frame survives
    small.append(kv(2), 0, 2)
    assert split_keys(model, x, small, 2) == ((), ((4, 8),))


def test_row_groups_attend_bitwise_like_the_masked_union():
    """``RowGroups.attend`` (one mask-free call per group of rows) gives, with the math backend on CPU fp32, the bits
    of one masked call over the union of the keys (refill rows masked off the next chunk's keys) and of the separate
    refill pass's call (all-true mask over its keys): the merged pass's remaining differences to the separate passes
    come from the matmuls' row counts (2R rows instead of R), not from the attention."""
    torch.manual_seed(0)
    rows, heads, n, seen, dim = 2, 2, 16, 40, 8  # seen: text + cached video + finished chunk
    q = torch.randn(2 * rows, heads, n, dim)
    k, v = torch.randn(2, 2 * rows, heads, seen + n, dim)
    mask = torch.ones(2 * rows, 1, n, seen + n, dtype=torch.bool)
    mask[:rows, :, :, seen:] = False
    groups = RowGroups(((0, rows, k[:rows, :, :seen], v[:rows, :, :seen]), (rows, 2 * rows, k[rows:], v[rows:])))
    grouped = groups.attend(q, "math")
    assert torch.equal(grouped, attention(q, k, v, mask, "math"))
    alone = attention(q[:rows], k[:rows, :, :seen], v[:rows, :, :seen], mask[:rows, :, :, :seen], "math")
    assert torch.equal(grouped[:rows], alone)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("window,sinks", [(None, 0), (4, 0), (4, 2), (3, 1), (1, 0)])
def test_mask_free_merged_pass_gives_the_separate_passes_values(window, sinks, rows, padded, grouped_calls):
    """Text without padding, text cache hit: the merged pass attends without a mask, the refill rows over exactly the
    separate refill pass's keys and the step rows over the next pass's keys after the append (survivors of the rolling
    window gathered by slices: window (1, 0) keeps only the finished chunk's last frame). Both halves equal the
    separate passes to 1e-5 on CPU fp32 (as the masked case above: the grouped and separate attention calls sum in
    different orders, ~1e-6 apart on this CPU); padded text takes the masked fallback (no grouped call)."""
    sampler = tiny_sampler()
    text = {k: v[:rows] for k, v in _inputs(sampler, 2).items()}
    if not padded:
        text["text_mask"] = torch.ones_like(text["text_mask"])
    flags = dict(text_mask_has_padding=padded)
    compare_with_separate_passes(sampler.model, text, window, sinks, text_cache=True, tol=1e-5, seed=1, **flags)
    # the first merged pass runs the text rows (the context time is not cached yet): masked; the 3 others grouped
    assert grouped_calls == ([] if padded else [2] * 3 * 2)  # 2 blocks


@pytest.mark.parametrize("text_cache", [True, False])
@pytest.mark.parametrize("guidance_scale,window,sinks", [(1.0, 4, 0), (3.0, 4, 2), (3.0, None, 0), (1.0, 2, 0)])
def test_mask_free_merged_streaming_makes_the_same_video(guidance_scale, window, sinks, text_cache, grouped_calls):
    """Unpadded text: streaming with merged refills (mask-free once the text is cached) makes the video of the
    separate passes, with CFG rows, rolling windows with and without sinks, and without the text cache (masked)."""
    sampler = unpadded(tiny_sampler())
    kwargs = dict(
        step_list=[1.0, 0.5], guidance_scale=guidance_scale, window_frames=window, sink_frames=sinks,
        context_time=0.1, text_cache=text_cache,
    )  # fmt: skip
    separate = StreamingGenerator(sampler, merge_refill=False, **kwargs)
    merged = StreamingGenerator(sampler, merge_refill=True, **kwargs)
    a = list(separate.stream(PROMPTS, [0, 1], num_frames=10, height=16, width=16, decode=False))
    b = list(merged.stream(PROMPTS, [0, 1], num_frames=10, height=16, width=16, decode=False))
    assert len(a) == len(b) == 5
    for x, y in zip(a, b):
        torch.testing.assert_close(x.latents, y.latents, rtol=1e-5, atol=1e-5)
    # 4 merged passes; the first runs the text rows (masked), the other 3 are grouped in each of the 2 blocks
    assert grouped_calls == ([2] * 3 * 2 if text_cache else [])


@pytest.mark.parametrize("merge_refill", [False, True])
@pytest.mark.parametrize("prompts,guidance_scale", [(PROMPTS, 3.0), (PROMPTS[:1], 1.0)])
def test_trimmed_text_makes_the_same_video(prompts, guidance_scale, merge_refill, grouped_calls):
    """``trim_text``: the text after the last token valid in some row is cut (the tiny tokenizer pads to its length);
    the video is the untrimmed one's (fp32 tolerance). One prompt without CFG has no padding left, so its text-cached
    merged passes run mask-free; two prompts with CFG keep padded rows (the null text), hence the mask."""
    sampler = tiny_sampler()
    kwargs = dict(step_list=[1.0, 0.5], guidance_scale=guidance_scale, window_frames=4, merge_refill=merge_refill)
    seeds = [0, 1][: len(prompts)]
    full = list(StreamingGenerator(sampler, **kwargs).stream(prompts, seeds, 10, 16, 16, decode=False))
    trimmed_gen = StreamingGenerator(sampler, trim_text=True, **kwargs)
    trimmed = list(trimmed_gen.stream(prompts, seeds, 10, 16, 16, decode=False))
    for x, y in zip(full, trimmed):
        torch.testing.assert_close(y.latents, x.latents, rtol=1e-5, atol=1e-5)
    text, _ = sampler.encode_text(prompts)
    used = int(text["text_mask"].any(0).nonzero().max()) + 1
    assert used < text["text_mask"].shape[1] and trimmed[-1].text_cache_bytes * text["text_mask"].shape[1] == (
        full[-1].text_cache_bytes * used
    )
    unpadded_rows = len(prompts) == 1 and guidance_scale == 1.0
    assert len(grouped_calls) == (3 * 2 if merge_refill and unpadded_rows else 0)


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


def test_stream_flops_of_mask_free_merged_passes_are_the_separate_passes():
    """benchmarks/streaming.py's FLOP count: a mask-free merged pass computes what the two separate passes do; only
    the masked ones (padded text, or the first merged pass, which runs the text rows) add the next chunk's keys."""
    import sys
    from pathlib import Path

    from opensora.models.mmdit.flops import mmdit_chunk_flops

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import streaming as bench

    model = tiny_sampler().model
    shape = (model, 16, 8, 4, 2, 4, 2)  # chunk tokens, text tokens, chunks, chunk frames, window, steps
    separate = bench.stream_flops(*shape, merged=False, text_cache=True)
    masked = bench.stream_flops(*shape, merged=True, text_cache=True)
    free = bench.stream_flops(*shape, merged=True, text_cache=True, text_padded=False)
    first = mmdit_chunk_flops(model, 16, 8, 0, 1, True, extra_key_tokens=16) - mmdit_chunk_flops(model, 16, 8, 0)
    assert masked > free == separate + first


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


@pytest.mark.parametrize("padded", [True, False])
def test_merged_graph_plumbing_replays_the_eager_pass_on_a_cpu(padded, grouped_calls):
    """``MergedGraphs`` with the capture replaced by re-running the body: static inputs, cached video and text copied
    in, outputs cloned out; the streamed video equals the eager merged one over two videos (graphs kept). Unpadded
    text: the text-cached graphs capture the mask-free grouped pass (no mask among their static inputs)."""
    sampler = tiny_sampler() if padded else unpadded(tiny_sampler())
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
    keys = list(graphed.merged_graphs.graphs)  # the last entry of a graph's key: the grouped keys' slices or None
    assert [key[-1] is not None for key in keys] == [False, not padded, not padded]
    assert [dict(key[:9])["mask"] is None for key in keys] == [False, not padded, not padded]
    # eager and graphed videos each: 4 text-cached merged passes x 2 blocks per video, 2 videos; + the 2 "captures"
    assert len(grouped_calls) == (0 if padded else (2 * 2 * 4 + 2) * 2)
