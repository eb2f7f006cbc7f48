"""What the causal MMDiT's positions carry: which attention scores depend on frame distances only and which on
absolute frame indices (the premise behind re-positioning sink frames in a rolling KV cache).

Findings pinned here:

* video query vs video key: the score depends on the (t, h, w) differences only (RoPE);
* video query vs text key: text tokens sit at RoPE id (0, 0, 0), so the score depends on the query's absolute
  frame index: text is an anchor at frame 0 whose distance to the newest chunk grows with the video, like a sink;
* the model has no other absolute signal: shifting every video frame *and* the text's time id by one constant
  leaves a streamed chunk's output unchanged (float tolerance), shifting the video alone does not.
"""

import pytest
import torch
from test_causal import causal_model, padded_inputs, text_kwargs

from opensora.models.mmdit.rope import apply_rope, rope_cos_sin, video_position_ids

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

AXES = (16, 56, 56)  # the production model's split of a 128-channel head
THETA = 10000.0


def scores(q_ids, k_ids, seed=0):
    """Attention logits [Nq, Nk] of random fp64-rounded q/k rotated at ``q_ids`` / ``k_ids`` by the model's RoPE."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(q_ids), sum(AXES), generator=gen, dtype=torch.float64).float()
    k = torch.randn(len(k_ids), sum(AXES), generator=gen, dtype=torch.float64).float()
    q = apply_rope(q, *rope_cos_sin(q_ids, AXES, THETA))
    k = apply_rope(k, *rope_cos_sin(k_ids, AXES, THETA))
    return q @ k.T


def test_video_to_video_scores_depend_only_on_position_differences():
    q_ids = video_position_ids(2, 3, 3)  # a chunk at frames 0..1
    k_ids = video_position_ids(14, 3, 3)  # keys at frames 0..13
    base = scores(q_ids, k_ids)
    for shift in (1, 16, 100, 1000):
        moved_q, moved_k = q_ids.clone(), k_ids.clone()
        moved_q[:, 0] += shift
        moved_k[:, 0] += shift
        torch.testing.assert_close(scores(moved_q, moved_k), base, rtol=1e-4, atol=1e-4)
    far = q_ids.clone()
    far[:, 0] += 100  # moving the query alone changes the distance, hence the scores
    assert (scores(far, k_ids) - base).abs().max() > 1.0


def test_text_keys_anchor_video_queries_at_absolute_frame_zero():
    text_ids = torch.zeros(6, 3, dtype=torch.long)  # what MMDiT.rope gives every text token
    q_ids = video_position_ids(2, 3, 3)
    base = scores(q_ids, text_ids)
    moved = q_ids.clone()
    moved[:, 0] += 100  # the same chunk 100 frames later: the text did not move with it
    assert (scores(moved, text_ids) - base).abs().max() > 1.0
    text_moved = text_ids.clone()
    text_moved[:, 0] += 100
    torch.testing.assert_close(scores(moved, text_moved), base, rtol=1e-4, atol=1e-4)


def stream_at(model, data, offset, text_offset, chunk=2, frames=6):
    """Stream ``frames`` frames chunk by chunk with every video time id + ``offset`` and the text's time id at
    ``text_offset``, through the model's own chunk body (the rope table is the only thing changed)."""
    cache = model.new_kv_cache()
    num_text = data["text_emb"].shape[1]
    outs = []
    with torch.no_grad():
        for start in range(0, frames, chunk):
            x = data["x"][:, :, start : start + chunk]
            grid = (chunk, x.shape[3] // 2, x.shape[4] // 2)
            video = video_position_ids(*grid)
            video[:, 0] += start + offset
            text = torch.zeros(num_text, 3, dtype=torch.long)
            text[:, 0] = text_offset
            rope = rope_cos_sin(torch.cat((text, video)), model.axes_dims, model.theta)
            past = cache.keys[0].shape[2] if cache.keys[0] is not None else 0
            mask = model.chunk_mask(data["text_mask"], num_text, video.shape[0], past, x.device)
            pending = {}
            kw = text_kwargs(data)
            out = model.chunk_body(
                x, kw["timestep"], kw["text_emb"], kw["pooled"], data["cond"][:, :, start : start + chunk], None,
                rope, mask, cache, None, pending, None,
            )  # fmt: skip
            cache.append(pending, start + offset, chunk)
            outs.append(out)
    return torch.cat(outs, dim=2)


def test_a_streamed_video_is_shift_invariant_only_when_the_text_moves_with_it():
    model = causal_model()
    data = padded_inputs(t=6)
    with torch.no_grad():
        reference = model.forward_chunk(
            data["x"][:, :, :2], **text_kwargs(data), cond=data["cond"][:, :, :2], cache=model.new_kv_cache(),
            start_frame=0, store_kv=False,
        )  # fmt: skip
    base = stream_at(model, data, 0, 0)
    assert torch.equal(base[:, :, :2], reference)  # the helper is the model's own streamed pass
    both = stream_at(model, data, 40, 40)
    torch.testing.assert_close(both, base, rtol=1e-4, atol=1e-4)
    video_only = stream_at(model, data, 40, 0)
    assert (video_only - base).abs().max() > 100 * (both - base).abs().max()
