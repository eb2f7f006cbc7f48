"""``padded_text_attention="flex"``: FlexAttention with a per-batch BlockMask equals the dense key mask on the output
and every gradient, reuses one compiled graph while the prompt lengths change, and leaves the combinations it does
not cover to the dense mask (CPU, fp32: torch's unfused flex reference, see ``allow_flex_backward_on_cpu``)."""

import pytest
import torch
import torch.nn.functional as F
from test_mmdit import tiny_kwargs
from test_text_padding import (
    allow_flex_backward_on_cpu,
    assert_one_compiled_graph_per_block_kind,
    assert_padded_batch_matches_the_masked_computation,
    padded_batch,
)

import opensora.models.mmdit.flex_attention as flex_module
from opensora.models.mmdit import MMDiT
from opensora.models.mmdit.attention import attention
from opensora.models.mmdit.flex_attention import FlexRows

pytestmark = [
    pytest.mark.usefixtures("one_thread"),  # fixture in conftest.py
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
]


@pytest.mark.parametrize("block_size", [128, 4])
@pytest.mark.parametrize("lengths", [[2, 0, 5], [3]])
def test_flex_rows_equal_sdpa_with_their_boolean_mask(monkeypatch, block_size, lengths):
    """Rows of 2, 0 and 5 (all) valid text tokens of 5, then 6 video tokens, and a batch of one; block size 4 makes
    blocks that are all padding, all valid and mixed: the BlockMask is the boolean mask, and every query (padded
    text ones too) gets the masked SDPA output and gradients."""
    allow_flex_backward_on_cpu(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(len(lengths), 2, 11, 8, generator=gen, requires_grad=True) for _ in range(3))
    rows = FlexRows(lengths, num_text=5, num_video=6, device="cpu", block_size=block_size)
    mask = rows.dense(11)
    keys = torch.arange(11)
    expected = (keys[None] < torch.tensor(lengths)[:, None]) | (keys[None] >= 5)
    assert torch.equal(mask[:, 0, 0], expected)
    assert torch.equal(rows.block_mask.to_dense()[:, 0].bool(), _block_mask_of(expected, 11, block_size))
    out = attention(q, k, v, rows)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(len(lengths), 11, 16)
    torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-6)
    grad = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    for got, want in zip(grads, torch.autograd.grad(reference, (q, k, v), grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="got q"):
        attention(q[:, :, :10], k[:, :, :10], v[:, :, :10], rows)


def _block_mask_of(mask, tokens, block_size):
    """[B, query blocks, key blocks]: True where a block holds any allowed key (the same for every query block)."""
    blocks = -(-tokens // block_size)
    padded = F.pad(mask, (0, blocks * block_size - tokens)).view(len(mask), blocks, block_size).any(-1)
    return padded[:, None, :].expand(-1, blocks, -1)


def test_a_row_that_fills_the_trimmed_text_equals_the_masked_computation(monkeypatch):
    allow_flex_backward_on_cpu(monkeypatch)
    assert_padded_batch_matches_the_masked_computation("flex", [80, 5])  # row 0 fills all 80 columns


def test_changing_prompt_lengths_reuse_one_compiled_graph_per_block_kind(monkeypatch):
    """The lengths reach the compiled blocks as a tensor the mask_mod closes over: one graph per block kind."""
    allow_flex_backward_on_cpu(monkeypatch)
    assert_one_compiled_graph_per_block_kind("flex")


def test_what_flex_does_not_cover_keeps_the_dense_mask_or_fails_in_one_line(monkeypatch):
    model = MMDiT(**tiny_kwargs(padded_text_attention="flex")).train()
    data = padded_batch([3, 9], text_len=50)
    with pytest.raises(RuntimeError) as refused:  # torch has no flex backward on CPU
        model(**data)
    assert "FlexAttention does not support backward on CPU" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="choose one of dense, packed, rows, flex, bias-channel, zero-keys$"):
        MMDiT(**tiny_kwargs(padded_text_attention="flexx"))
    monkeypatch.setattr(flex_module, "flex_attention", None)
    with pytest.raises(ValueError, match=r"needs torch >= 2.5 \(torch.nn.attention.flex_attention\)$"):
        FlexRows([3], 9, 16, "cpu")
    monkeypatch.undo()

    mask = data["text_mask"][:, :9]
    assert isinstance(model.padding_mask(mask, [3, 9], 9, 16), FlexRows)
    assert type(model.padding_mask(mask, [3, 9], 9, 16, own_keys=False)) is torch.Tensor  # a cache adds keys
    assert model.padding_mask(mask[1:], [9], 9, 16) is None  # no padding left: no mask
    model.sp = object()  # sequence parallelism shards the keys: the dense mask, as for "packed" and "rows"
    assert type(model.padding_mask(mask, [3, 9], 9, 16)) is torch.Tensor
    model.sp = None

    causal = MMDiT(**tiny_kwargs(padded_text_attention="flex", causal_chunk_frames=1)).train()
    seen = []
    import opensora.models.mmdit.layers as layers

    real = layers.attention
    monkeypatch.setattr(
        layers,
        "attention",
        lambda q, k, v, mask=None, backend="auto": seen.append(type(mask)) or real(q, k, v, mask, backend),
    )
    with torch.no_grad():
        causal(**data)  # the block-causal mask stays dense
    assert set(seen) == {torch.Tensor}
