"""``rope_anchor="window"``: once a rolling KV cache rolls, the text and the sink frames sit at the window's start in
RoPE time (``KVCache.anchor``), so a streamed chunk computes what the same window computes at the start of a video.

The strong check runs an independent reference: every chunk at positions shifted so that the anchor is 0 (text at
id 0, sinks at 0.., kept frames at their frame minus the anchor), its cached keys re-rotated by the model's own RoPE
from where they were made. RoPE scores depend on position differences only (tests/test_rope_positions.py), so the
two must agree to float tolerance.
"""

import pytest
import torch
from test_causal import causal_model, padded_inputs, text_kwargs
from test_streaming import PROMPTS, EagerReplayGraphs, assert_streams_bitwise_equal, tiny_sampler

from opensora.inference.streaming.generator import StreamingGenerator
from opensora.models.mmdit import rope
from opensora.models.mmdit.rope import shift_time, shift_time_all

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

CHUNK, WINDOW, SINKS, FRAMES = 2, 4, 2, 12


def stream_model(model, data, anchor_mode, window=WINDOW, sinks=SINKS, text_cache=None):
    """Chunks of ``data`` through ``forward_chunk`` with a storing pass each -> (outputs per chunk, caches' anchors,
    positions seen by each chunk)."""
    cache = model.new_kv_cache(window, sinks, rope_anchor=anchor_mode)
    outs, seen = [], []
    with torch.no_grad():
        for start in range(0, data["x"].shape[2], CHUNK):
            seen.append((start, cache.anchor, list(cache.positions)))
            out = model.forward_chunk(
                data["x"][:, :, start : start + CHUNK], **text_kwargs(data), cond=data["cond"][:, :, start : start + CHUNK],
                cache=cache, start_frame=start, store_kv=True, text_cache=text_cache, text_key=0.5,
            )  # fmt: skip
            outs.append(out)
    return outs, seen


class Past:
    """The ``past`` argument of ``chunk_body``: given keys/values per block."""

    def __init__(self, keys, values):
        self.keys, self.values, self.num_blocks = keys, values, len(keys)

    def block(self, i):
        return self.keys[i], self.values[i]


def shifted_reference(model, data, window=WINDOW, sinks=SINKS):
    """Each chunk as the start of a video: positions minus the anchor, text at 0 (module docstring)."""
    axes, theta = model.axes_dims, model.theta
    held = []  # (start, keys per block rotated at the chunk's absolute frame, values per block)
    num_text = data["text_emb"].shape[1]
    outs = []
    with torch.no_grad():
        for start in range(0, data["x"].shape[2], CHUNK):
            sink_chunks = [h for h in held if h[0] < sinks]
            rest = [h for h in held if h[0] >= sinks]
            anchor = max(rest[0][0] - sinks, 0) if rest else 0
            keys, values = [], []
            blocks = len(model.double_blocks) + len(model.single_blocks)
            for i in range(blocks):
                ks = [h[1][i] for h in sink_chunks] + [shift_time(h[1][i], -anchor, axes, theta) for h in rest]
                vs = [h[2][i] for h in sink_chunks] + [h[2][i] for h in rest]
                keys.append(torch.cat(ks, dim=2) if ks else None)
                values.append(torch.cat(vs, dim=2) if vs else None)
            x = data["x"][:, :, start : start + CHUNK]
            grid = (CHUNK, x.shape[3] // 2, x.shape[4] // 2)
            rope = model.rope(grid, num_text, x.device, time_offset=start - anchor)
            past_tokens = 0 if keys[0] is None else keys[0].shape[2]
            mask = model.chunk_mask(data["text_mask"], num_text, grid[0] * grid[1] * grid[2], past_tokens, x.device)
            pending = {}
            kw = text_kwargs(data)
            c = data["cond"][:, :, start : start + CHUNK]
            past = Past(keys, values)
            outs.append(
                model.chunk_body(
                    x, kw["timestep"], kw["text_emb"], kw["pooled"], c, None, rope, mask, past, None, pending, None
                )
            )
            new_k = [shift_time(pending[i][0], anchor, axes, theta) for i in range(blocks)]  # back to absolute
            held.append((start, new_k, [pending[i][1] for i in range(blocks)]))
            # the rolling window after the store: sinks plus the newest frames
            keep_rest = (window - sinks) // CHUNK
            held = [h for h in held if h[0] < sinks] + [h for h in held if h[0] >= sinks][-keep_rest:]
    return outs


def test_window_anchor_equals_each_window_streamed_as_a_video_start():
    model = causal_model(chunk=CHUNK)
    data = padded_inputs(t=FRAMES)
    window, seen = stream_model(model, data, "window")
    absolute, _ = stream_model(model, data, "absolute")
    reference = shifted_reference(model, data)
    anchors = [a for _, a, _ in seen]
    assert anchors == [0, 0, 0, 2, 4, 6]  # rolls from the chunk at frame 6 on
    for k, (w, a, r) in enumerate(zip(window, absolute, reference)):
        torch.testing.assert_close(w, r, rtol=1e-4, atol=1e-4)
        if anchors[k] == 0:  # before the first roll: today's computation, bit for bit
            assert torch.equal(w, a)
    # the anchor matters: absolute positions give another result once the window rolled
    assert (absolute[-1] - reference[-1]).abs().max() > 100 * (window[-1] - reference[-1]).abs().max()


def test_no_query_key_distance_leaves_a_window_plus_a_chunk():
    model = causal_model(chunk=CHUNK)
    data = padded_inputs(t=FRAMES)
    for mode in ("window", "absolute"):
        _, seen = stream_model(model, data, mode)
        farthest = 0
        for start, anchor, positions in seen:
            newest_query = start + CHUNK - 1
            oldest_key = min([anchor] + positions)  # the text sits at the anchor
            farthest = max(farthest, newest_query - oldest_key)
            if mode == "window":
                assert positions == sorted(positions) and positions == list(range(anchor, anchor + len(positions)))
        # window: the span of a training clip of window + chunk frames; absolute: the whole video
        assert farthest == (WINDOW + CHUNK - 1 if mode == "window" else FRAMES - 1)


def test_sink_keys_are_rotated_from_their_originals():
    model = causal_model(chunk=CHUNK)
    data = padded_inputs(t=FRAMES)
    cache = model.new_kv_cache(WINDOW, SINKS, rope_anchor="window")
    with torch.no_grad():
        for start in range(0, FRAMES, CHUNK):
            x = data["x"][:, :, start : start + CHUNK]
            c = data["cond"][:, :, start : start + CHUNK]
            model.forward_chunk(
                x, **text_kwargs(data), cond=c, cache=cache, start_frame=start, store_kv=True
            )  # fmt: skip
    tokens = SINKS * cache.tokens_per_frame_group
    assert cache.anchor == FRAMES - WINDOW and cache.placed_anchor == cache.anchor
    for original, held in zip(cache.sink_keys, cache.keys):
        torch.testing.assert_close(
            held[:, :, :tokens], shift_time(original, cache.anchor, model.axes_dims, model.theta)
        )
        back = shift_time(held[:, :, :tokens], -cache.anchor, model.axes_dims, model.theta)
        torch.testing.assert_close(back, original, rtol=1e-5, atol=1e-5)


def test_text_cache_hits_move_the_text_keys_to_the_anchor():
    model = causal_model(chunk=CHUNK)
    data = padded_inputs(t=FRAMES)
    plain, _ = stream_model(model, data, "window")
    cached, _ = stream_model(model, data, "window", text_cache=model.new_text_cache())
    for a, b in zip(plain, cached):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


GEN = dict(step_list=[1.0, 0.5], window_frames=4, sink_frames=2)


def test_generator_absolute_is_the_default_and_window_only_differs_after_the_roll():
    sampler = tiny_sampler()
    default = list(StreamingGenerator(sampler, **GEN).stream(PROMPTS, [0, 1], 10, 16, 16))
    absolute = list(StreamingGenerator(sampler, rope_anchor="absolute", **GEN).stream(PROMPTS, [0, 1], 10, 16, 16))
    window = list(StreamingGenerator(sampler, rope_anchor="window", **GEN).stream(PROMPTS, [0, 1], 10, 16, 16))
    for d, a, w in zip(default, absolute, window):
        assert torch.equal(d.latents, a.latents) and torch.equal(d.frames, a.frames)
        # chunks 0-2 see anchor 0 (the cache first rolls when chunk 2 is stored): bit-identical
        assert torch.equal(w.latents, a.latents) == (w.index < 3)
    unrolled = dict(GEN, window_frames=None)
    a = StreamingGenerator(sampler, **unrolled).generate(PROMPTS, [0, 1], 10, 16, 16)
    w = StreamingGenerator(sampler, rope_anchor="window", **unrolled).generate(PROMPTS, [0, 1], 10, 16, 16)
    assert torch.equal(a, w)  # a cache that never rolls never moves the anchor


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_chunk_graph_plumbing_with_the_window_anchor_replays_the_eager_passes(guidance):
    """The graph runner's static buffers (eager 'replay' on a CPU): the moved text keys and re-rotated sinks reach the
    graphs through their inputs, with no capture per anchor."""
    sampler = tiny_sampler()
    kwargs = dict(GEN, guidance_scale=guidance, rope_anchor="window")
    graphed = StreamingGenerator(sampler, **kwargs)
    graphed.cuda_graphs = EagerReplayGraphs.make(sampler.model)
    eager = StreamingGenerator(sampler, **kwargs)
    assert_streams_bitwise_equal(eager, graphed, 12)
    summary = graphed.cuda_graphs.summary
    assert summary["failures"] == [] and summary["eager"] == 0
    assert summary["graphs"] == 2 + 3 * 2  # as with absolute positions: the anchor is an input, not a shape


def test_unsupported_combinations_and_values_are_refused():
    sampler = tiny_sampler()
    with pytest.raises(ValueError, match="rope_anchor"):
        StreamingGenerator(sampler, rope_anchor="relative")
    with pytest.raises(ValueError, match="merge_refill"):
        StreamingGenerator(sampler, rope_anchor="window", merge_refill=True)
    with pytest.raises(ValueError, match="rope_anchor"):
        sampler.model.new_kv_cache(4, 2, rope_anchor="sideways")


def test_moving_many_keys_at_once_is_each_moved_alone_bit_for_bit():
    model = causal_model(chunk=CHUNK)
    axes, theta = model.axes_dims, model.theta
    same = [torch.randn(2, 3, 5, sum(axes)) for _ in range(4)]
    mixed = same[:2] + [torch.randn(1, 3, 7, sum(axes))]
    for keys in (same, mixed, same[:1]):
        for got, x in zip(shift_time_all(keys, 6, axes, theta), keys):
            assert torch.equal(got, shift_time(x, 6, axes, theta))
    back = shift_time_all(shift_time_all(same, 6, axes, theta), -6, axes, theta)
    for b, x in zip(back, same):
        torch.testing.assert_close(b, x, rtol=1e-5, atol=1e-5)
    assert shift_time_all([], 3, axes, theta) == []
    # stacks are capped in bytes (the transient of moving a large model's text keys stays small): groups of 3 here
    rope.SHIFT_GROUP_BYTES, cap = 3 * 4 * same[0].numel(), rope.SHIFT_GROUP_BYTES
    try:
        many = same * 2 + mixed
        for got, x in zip(shift_time_all(many, 6, axes, theta), many):
            assert torch.equal(got, shift_time(x, 6, axes, theta))
    finally:
        rope.SHIFT_GROUP_BYTES = cap
