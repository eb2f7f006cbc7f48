"""``padded_text_attention="bias-channel"``: the key mask carried by one extra q/k channel pair (an unmasked SDPA
call) equals the dense key mask on the output and every gradient, whatever the lengths (a row with no valid text, a
row that fills the trimmed text), and keeps one compiled graph per block kind while the lengths change (CPU, fp32)."""

import pytest
import torch
import torch.nn.functional as F
from test_text_padding import (
    assert_one_compiled_graph_per_block_kind,
    assert_padded_batch_matches_the_masked_computation,
    qkv_with_garbage_in_padding,
)

from opensora.models.mmdit.attention import attention
from opensora.models.mmdit.bias_channel_attention import EXTRA_CHANNELS, BiasChannelRows

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


@pytest.mark.parametrize("lengths", [[2, 0, 5], [3]])
def test_bias_channel_rows_equal_sdpa_with_their_boolean_mask(lengths):
    """Rows of 2, 0 and 5 (all) valid text tokens of 5, then 6 video tokens: every query (padded text ones too) gets
    the masked SDPA output and gradients; large values in the padded keys and values change nothing."""
    (q, k, v), gen = qkv_with_garbage_in_padding(lengths)
    rows = BiasChannelRows(lengths, num_text=5, num_video=6, device="cpu")
    mask = rows.dense(11)
    keys = torch.arange(11)
    assert torch.equal(mask[:, 0, 0], (keys[None] < torch.tensor(lengths)[:, None]) | (keys[None] >= 5))
    out = attention(q, k, v, rows)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(len(lengths), 11, 16)
    torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-5)
    grad = torch.randn(out.shape, generator=gen)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(reference, (q, k, v), grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    augmented = rows.augment(q, k, v)
    assert [t.shape[-1] for t in augmented] == [8 + EXTRA_CHANNELS] * 3
    with pytest.raises(ValueError, match="got q"):
        attention(q[:, :, :10], k[:, :, :10], v[:, :, :10], rows)


@pytest.mark.parametrize("lengths", [[80, 5], [5, 37]])
def test_padded_batch_through_the_model_equals_the_masked_computation(lengths):
    """[80, 5]: row 0 fills all 80 columns, row 1 is padded."""
    assert_padded_batch_matches_the_masked_computation("bias-channel", lengths, BiasChannelRows)


def test_changing_prompt_lengths_reuse_one_compiled_graph_per_block_kind():
    """The lengths reach the compiled blocks as a tensor (the key channel): one graph per block kind."""
    assert_one_compiled_graph_per_block_kind("bias-channel")
