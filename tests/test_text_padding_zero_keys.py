"""``padded_text_attention="zero-keys"``: padded keys / values set to zero, an unmasked kernel, the zero keys' share
taken out of its output and log-sum-exp, and the kernel's backward fed the corrected pair. It equals the dense key
mask on the output and every gradient (CPU fp32, PyTorch's flash kernel for the CPU), stays finite where the valid
keys hold almost none of the softmax sum, and keeps one compiled graph per block kind while the lengths change."""

import math

import pytest
import torch
import torch.nn.functional as F
from test_text_padding import (
    assert_one_compiled_graph_per_block_kind,
    assert_padded_batch_matches_the_masked_computation,
    qkv_with_garbage_in_padding,
)

from opensora.models.mmdit.attention import attention
from opensora.models.mmdit.zero_key_attention import ZeroKeyRows, remove_zero_keys, zero_key_kernel

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


def masked_reference(q, k, v, mask):
    batch, heads, tokens, head_dim = q.shape
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(batch, tokens, heads * head_dim)


@pytest.mark.parametrize("lengths", [[2, 0, 5], [3], [5, 5]])
def test_zero_key_rows_equal_sdpa_with_their_boolean_mask(lengths):
    """Rows of 2, 0 and 5 (all) valid text tokens of 5, then 6 video tokens: every query (padded text ones too) gets
    the masked SDPA output and gradients; large values in the padded keys and values change nothing, and their
    gradients are zero."""
    (q, k, v), gen = qkv_with_garbage_in_padding(lengths)
    rows = ZeroKeyRows(lengths, num_text=5, num_video=6, device="cpu")
    assert zero_key_kernel(q, "auto") == "cpu" and zero_key_kernel(q, "math") is None
    mask = rows.dense(11)
    assert torch.equal(rows.num_padded, torch.tensor([5.0 - length for length in lengths]))
    out = attention(q, k, v, rows)
    reference = masked_reference(q, k, v, mask)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    grad = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, (q, k, v), grad)
    for have, want in zip(got, torch.autograd.grad(reference, (q, k, v), grad)):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
    padded_keys = ~mask[:, 0, 0]  # [B, N]
    for grad_of_padded in (got[1].transpose(1, 2)[padded_keys], got[2].transpose(1, 2)[padded_keys]):
        assert torch.count_nonzero(grad_of_padded) == 0
    with pytest.raises(ValueError, match="got q"):
        attention(q[:, :, :10], k[:, :, :10], v[:, :, :10], rows)


def test_the_math_backend_takes_the_dense_mask():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 11, 8, generator=gen) for _ in range(3))
    rows = ZeroKeyRows([1, 4], num_text=5, num_video=6, device="cpu")
    torch.testing.assert_close(attention(q, k, v, rows, "math"), masked_reference(q, k, v, rows.dense(11)))


def test_remove_zero_keys_is_the_closed_form():
    """A kernel run over 3 valid keys plus 4 zero keys (zero values): the corrected output and log-sum-exp are the
    softmax over the 3 valid keys alone, computed directly."""
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(1, 1, 2, 3, generator=gen, dtype=torch.float64) * 4
    values = torch.randn(1, 1, 3, 5, generator=gen, dtype=torch.float64)
    with_zeros = torch.cat((scores, torch.zeros(1, 1, 2, 4, dtype=torch.float64)), -1)
    kernel_out = torch.softmax(with_zeros, -1)[..., :3] @ values
    kernel_lse = torch.logsumexp(with_zeros, -1)
    out, lse = remove_zero_keys(kernel_out.float(), kernel_lse.float(), torch.tensor([4.0]))
    torch.testing.assert_close(out, (torch.softmax(scores, -1) @ values).float())
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1).float())


def test_a_query_whose_valid_keys_hold_almost_nothing_stays_finite():
    """Valid scores near -60 next to 4 zero keys (share of the sum ~1e-26): 1 - r cancels to 0 in fp32; the cap
    keeps the output and log-sum-exp finite."""
    out = torch.full((1, 1, 1, 2), 1e-20)
    lse = torch.tensor([[[math.log(4.0)]]])
    corrected, lse_valid = remove_zero_keys(out, lse, torch.tensor([4.0]))
    assert torch.isfinite(corrected).all() and torch.isfinite(lse_valid).all()


@pytest.mark.parametrize("lengths", [[80, 5], [5, 37], [0, 12]])
def test_padded_batch_through_the_model_equals_the_masked_computation(lengths):
    """[80, 5]: row 0 fills all 80 columns, row 1 is padded; [0, 12]: a row with no valid text at all."""
    assert_padded_batch_matches_the_masked_computation("zero-keys", lengths, ZeroKeyRows)


def test_changing_prompt_lengths_reuse_one_compiled_graph_per_block_kind():
    """The lengths reach the compiled blocks as tensors (keep mask, padded counts): one graph per block kind."""
    assert_one_compiled_graph_per_block_kind("zero-keys")


def test_the_compiled_correction_equals_the_eager_one():
    """What ``fused_remove_zero_keys`` runs on CUDA (``torch.compile`` of ``remove_zero_keys``) traces as one graph
    (``fullgraph``) and, run through AOTAutograd on the CPU, gives the same output and log-sum-exp."""
    gen = torch.Generator().manual_seed(3)
    out = torch.randn(2, 3, 7, 8, generator=gen).to(torch.bfloat16)
    lse = torch.randn(2, 3, 7, generator=gen) + 2
    num_padded = torch.tensor([0.0, 5.0])
    compiled = torch.compile(remove_zero_keys, dynamic=False, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(out, lse, num_padded), remove_zero_keys(out, lse, num_padded)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
