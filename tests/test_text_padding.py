"""Padded prompts: trimming the text and attending through ``KeyRanges`` equal the masked computation and each prompt
run alone without padding, on the output and on every gradient (CPU, fp32)."""

import pytest
import torch
import torch.nn.functional as F
from test_mmdit import inputs, perturb, tiny_kwargs

from opensora.models.mmdit import MMDiT
from opensora.models.mmdit.attention import KeyRanges, attention
from opensora.models.mmdit.model import unpatchify
from opensora.models.mmdit.packed_attention import PackedRows, segment_attention
from opensora.models.mmdit.text_padding import padded_text_keys, trim_text, trimmed_length, valid_prefix_lengths

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


def allow_flex_backward_on_cpu(monkeypatch):
    """torch refuses flex_attention's backward on CPU; its unfused reference computes it all the same, which is what
    the CPU tests check the flex path with (the GPU test runs the fused kernels)."""
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_validate_device", lambda *tensors: None)


def test_key_ranges_equal_sdpa_with_their_boolean_mask():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 11, 8, generator=gen, requires_grad=True) for _ in range(3))
    ranges = KeyRanges([((0, 2), (5, 11)), ((0, 0), (5, 11)), ((1, 4), (6, 9))])
    mask = ranges.dense(11)
    expected = torch.zeros(3, 11, dtype=torch.bool)
    expected[0, [0, 1, 5, 6, 7, 8, 9, 10]] = True
    expected[1, 5:] = True
    expected[2, [1, 2, 3, 6, 7, 8]] = True
    assert torch.equal(mask[:, 0, 0], expected)
    out = attention(q, k, v, ranges, backend="math")
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(3, 11, 16)
    torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-6)
    grad = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    reference_grads = torch.autograd.grad(reference, (q, k, v), grad, retain_graph=True)
    for got, want in zip(grads, reference_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="3 rows for a batch of 2"):
        attention(q[:2], k[:2], v[:2], ranges)

    # queries_at_keys: the queries at the key positions as above, zeros elsewhere, gradients through them only
    selected = KeyRanges(ranges.rows, queries_at_keys=True)
    out = attention(q, k, v, selected, backend="math")
    keep = mask[:, 0, 0, :, None]  # [B, N, 1]: the rows' own key positions
    torch.testing.assert_close(out, torch.where(keep, reference, 0.0), rtol=1e-6, atol=1e-6)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    reference_grads = torch.autograd.grad(reference, (q, k, v), grad * keep)
    for got, want in zip(grads, reference_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="sorted, non-overlapping"):
        KeyRanges([((5, 11), (0, 2))], queries_at_keys=True)


def test_packed_rows_equal_sdpa_with_their_boolean_mask():
    """Rows of 2, 0 and 5 (all: an empty padding run) valid text tokens of 5, then 6 video tokens: the packed
    sequences give the masked SDPA output at every valid query, and the same gradients; padded queries attend among
    themselves (outputs nobody reads) and pass no gradient to the valid tokens."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 11, 8, generator=gen, requires_grad=True) for _ in range(3))
    packed = PackedRows([2, 0, 5], num_text=5, num_video=6, device="cpu")
    assert packed.offsets == [0, 8, 11, 17, 22, 33, 33]  # [video + valid text, padded text] per row of 11
    assert packed.cu_seqlens.tolist() == packed.offsets and packed.cu_seqlens.dtype == torch.int32
    mask = packed.dense(11)
    assert torch.equal(mask, KeyRanges([((0, 2), (5, 11)), ((0, 0), (5, 11)), ((0, 5), (5, 11))]).dense(11))
    out = attention(q, k, v, packed, backend="math")
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(3, 11, 16)
    valid = mask[:, 0, 0, :, None]  # [B, N, 1]: the rows' valid tokens, as queries
    torch.testing.assert_close(torch.where(valid, out, 0.0), torch.where(valid, reference, 0.0), rtol=1e-6, atol=1e-6)
    grad = torch.randn(out.shape, generator=gen) * valid
    grads = torch.autograd.grad(out, (q, k, v), grad)
    reference_grads = torch.autograd.grad(reference, (q, k, v), grad)
    for got, want in zip(grads, reference_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="3 rows x 5\\+6 tokens"):
        attention(q[:2], k[:2], v[:2], packed)
    # the reference kernel: each sequence alone, empty ones skipped
    flat = [t.detach().transpose(1, 2).reshape(33, 2, 8) for t in (q, k, v)]
    alone = F.scaled_dot_product_attention(*(t[11:17].transpose(0, 1)[None] for t in flat))[0].transpose(0, 1)
    torch.testing.assert_close(segment_attention(*flat, [0, 11, 11, 17, 33])[11:17], alone)


def test_trimmed_lengths_and_masks_that_are_not_prefixes():
    assert trimmed_length([20, 120, 64], 512) == 128
    assert trimmed_length([0, 0], 512) == 32 and trimmed_length([5, 9], 6) == 6
    # rows that agree (every batch of one) keep exactly their valid tokens: nothing left to mask
    assert trimmed_length([7], 512) == 7 and trimmed_length([40, 40], 512) == 40 and trimmed_length([5], 3) == 3
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[0, :7], mask[1, :33] = True, True
    assert valid_prefix_lengths(mask) == [7, 33]
    emb = torch.randn(2, 40, 3)
    trimmed, trimmed_mask, lengths = trim_text(emb, mask)
    assert trimmed.shape[1] == 40 and lengths == [7, 33]  # 64 would exceed the 40 columns: all kept
    mask[1, :33] = False
    mask[1, 2] = True  # a hole: not a prefix, so nothing is cut and the dense mask stays
    assert valid_prefix_lengths(mask) is None and trim_text(emb, mask)[2] is None
    assert trim_text(emb, mask, has_padding=False)[0] is emb
    assert padded_text_keys([32, 32], 32, 10) is None  # no padding left: no mask at all
    with pytest.raises(ValueError, match="text_mask"):
        trim_text(emb, mask[:, :5])


def padded_batch(lengths, text_len=80, seed=0):
    data = inputs(batch=len(lengths), t=2, text_len=text_len, seed=seed)
    for row, length in enumerate(lengths):
        data["text_mask"][row, length:] = False
        data["text_emb"][row, length:] = 100.0  # garbage in the padding must not matter
    data["text_emb"].requires_grad_(True)
    return data


def dense_masked_forward(model, data):
    """The computation before trimming: every padded column kept, a boolean key mask over all of them."""
    img, txt, vec, grid = model.embed(data["x"], data["timestep"], data["text_emb"], data["pooled"])
    rope = model.rope(grid, txt.shape[1], img.device)
    mask = model.key_mask(data["text_mask"], img.shape[1], has_padding=True)
    return unpatchify(model.run_blocks(img, txt, vec, rope, mask), grid, model.patch_size)


def qkv_with_garbage_in_padding(lengths, num_text=5, num_video=6, seed=0):
    """q, k, v [B, 2 heads, num_text + num_video, 8] (requiring grad) whose padded text keys / values hold large
    values (1e3 / -1e3) that a correct key mask must ignore; the generator, for more draws."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(len(lengths), 2, num_text + num_video, 8, generator=gen) * 3 for _ in range(3))
    for row, length in enumerate(lengths):
        k[row, :, length:num_text] = 1e3
        v[row, :, length:num_text] = -1e3
    return tuple(t.requires_grad_(True) for t in (q, k, v)), gen


def assert_close_at_scale(got, want, tol=1e-5, what=""):
    """Max abs error within ``tol`` of the reference's largest magnitude (perturbed tiny models reach 1e4)."""
    scale = want.abs().max().clamp_min(1e-12)
    assert (got - want).abs().max() <= tol * scale, f"{what}: error {(got - want).abs().max():.3g}, scale {scale:.3g}"


def assert_padded_batch_matches_the_masked_computation(how, lengths, mask_type=None, **model_kwargs):
    """A tiny perturbed MMDiT with ``padded_text_attention=how`` (and ``model_kwargs``) on a batch of ``lengths``
    valid prompt tokens (80 columns): output and every gradient equal the dense masked computation's, and
    (``mask_type``) the batch's key mask is of that type. Returns the model."""
    model = MMDiT(**tiny_kwargs(padded_text_attention=how, **model_kwargs)).train()
    perturb(model)
    data = padded_batch(lengths)
    target = torch.randn(len(lengths), 4, 2, 8, 8, generator=torch.Generator().manual_seed(3))
    out = model(**data)
    _, grads = loss_and_grads(model, out, target, data["text_emb"])
    masked = dense_masked_forward(model, data)
    _, masked_grads = loss_and_grads(model, masked, target, data["text_emb"])
    assert_close_at_scale(out, masked, what="output")
    for name, grad in masked_grads.items():
        assert (grad is None) == (grads[name] is None), name
        if grad is not None:
            assert_close_at_scale(grads[name], grad, what=name)
    if mask_type is not None:
        mask = torch.arange(80)[None] < torch.tensor(lengths)[:, None]
        assert isinstance(model.padding_mask(mask, lengths, 80, 16), mask_type)
    return model


def assert_one_compiled_graph_per_block_kind(how):
    """Batches of one trimmed length (80 columns) with new prompt lengths through ``padded_text_attention=how``
    compile one double and one single block graph (forward and backward), and each matches the dense mask (run
    through the same compiled blocks: one more graph per block kind)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    model = MMDiT(**tiny_kwargs(padded_text_attention=how)).train()
    perturb(model)
    target = torch.randn(2, 4, 2, 8, 8, generator=torch.Generator().manual_seed(3))
    try:
        for block in [*model.double_blocks, *model.single_blocks]:
            block.compile(backend=counter)
        for step, lengths in enumerate(([5, 37], [60, 2], [17, 79])):
            data = padded_batch(lengths, seed=step)
            out = model(**data)
            _, grads = loss_and_grads(model, out, target, data["text_emb"])
            masked = dense_masked_forward(model, data)
            _, masked_grads = loss_and_grads(model, masked, target, data["text_emb"])
            assert_close_at_scale(out, masked, what=f"output {lengths}")
            for name in ("double_blocks.0.img_attn.qkv.weight", "single_blocks.0.linear1.weight", "text_emb"):
                assert_close_at_scale(grads[name], masked_grads[name], what=f"{name} {lengths}")
            if step == 0:
                graphs = counter.frame_count
        assert graphs == 4 and counter.frame_count == graphs  # per block kind: the path, and the reference's mask
    finally:
        torch._dynamo.reset()


def loss_and_grads(model, out, target, text_emb):
    loss = (out - target).square().sum()
    names = [n for n, p in model.named_parameters()]
    grads = torch.autograd.grad(loss, [p for p in model.parameters()] + [text_emb], allow_unused=True)
    return loss, dict(zip(names + ["text_emb"], grads))


@pytest.mark.parametrize("grad_ckpt", [0, 1])
@pytest.mark.parametrize("lengths, kept", [([5, 37, 1], 64), ([9], 9), ([6, 6], 6)])
@pytest.mark.parametrize("how", ["packed", "rows", "dense", "flex"])
def test_padded_prompts_equal_the_masked_computation_and_each_prompt_alone(grad_ckpt, lengths, kept, how, monkeypatch):
    """Lengths 5, 37 and 1 of 80: ``trim_text`` keeps 64 (the multiple of 32 above 37; the model, at multiples of
    128, keeps all 80), rows 0 and 2 attend via PackedRows, KeyRanges or the dense mask. A batch of one, or rows of
    one length: trimmed to exactly that length, attention without a mask."""
    allow_flex_backward_on_cpu(monkeypatch)
    kwargs = tiny_kwargs(grad_ckpt_double=grad_ckpt, grad_ckpt_single=grad_ckpt, padded_text_attention=how)
    model = MMDiT(**kwargs).train()
    perturb(model)
    data = padded_batch(lengths)
    target = torch.randn(len(lengths), 4, 2, 8, 8, generator=torch.Generator().manual_seed(3))

    trimmed, _, seen = trim_text(data["text_emb"], data["text_mask"])
    assert trimmed.shape[1] == kept and seen == lengths
    assert (padded_text_keys(seen, kept, 128) is None) == (min(lengths) == kept)
    coarse = kept if len(set(lengths)) == 1 else 80  # multiples of 128, at most the 80 columns there are
    assert trim_text(data["text_emb"], data["text_mask"], multiple=128)[0].shape[1] == coarse

    out = model(**data)
    loss, grads = loss_and_grads(model, out, target, data["text_emb"])
    masked = dense_masked_forward(model, data)
    masked_loss, masked_grads = loss_and_grads(model, masked, target, data["text_emb"])
    assert_close_at_scale(out, masked, what="output")
    assert_close_at_scale(loss, masked_loss, 1e-6, "loss")
    for name, grad in masked_grads.items():
        if grad is None:
            assert grads[name] is None, name
            continue
        assert_close_at_scale(grads[name], grad, what=name)
    first = lengths[0]
    assert grads["text_emb"][0, first:].abs().max() == 0 and grads["text_emb"][0, :first].abs().max() > 0

    for row, length in enumerate(lengths):  # each prompt alone, without padding and without a mask
        alone = {k: v[row : row + 1] for k, v in data.items() if k != "text_mask"}
        alone["text_emb"] = data["text_emb"][row : row + 1, :length].detach()
        assert_close_at_scale(model(**alone), out[row : row + 1], what=f"row {row} alone")


@pytest.mark.parametrize(
    "how, kind",
    [("packed", "PackedRows"), ("rows", "KeyRanges"), ("dense", "Tensor"), ("flex", "FlexRows"),
     ("zero-keys", "ZeroKeyRows")],
)  # fmt: skip
def test_padded_rows_reach_every_block_and_no_dense_mask_is_built(monkeypatch, how, kind):
    """A training-mode batch with rows of different lengths attends through PackedRows, KeyRanges, the dense mask,
    FlexRows or ZeroKeyRows (the default) in all blocks, as padded_text_attention says; an eval-mode pass (sampling, frozen teachers) keeps
    the dense mask."""
    model = MMDiT(**tiny_kwargs(padded_text_attention=how)).train()
    perturb(model)
    seen = []
    import opensora.models.mmdit.layers as layers

    real = layers.attention

    def spy(q, k, v, mask=None, backend="auto"):
        seen.append(type(mask).__name__)
        return real(q, k, v, mask=mask, backend=backend)

    monkeypatch.setattr(layers, "attention", spy)
    with torch.no_grad():
        model(**padded_batch([3, 9], text_len=50))
    assert seen == [kind] * (len(model.double_blocks) + len(model.single_blocks))
    seen.clear()
    with torch.no_grad():
        model(**padded_batch([32, 32], text_len=50))  # equal rows trimmed to their length: no mask at all
    assert set(seen) == {"NoneType"}
    seen.clear()
    with torch.no_grad():
        model.eval()(**padded_batch([3, 9], text_len=50))
    assert set(seen) == {"Tensor"}
